"""Probe: what a path lookup costs on this file system, beside descriptor-relative calls.

    python -m benchmarks.lookup_probe --dir FOLDER [--reps 300]

Issue 51's tiny restores: on 9p under gVisor each path-based call revalidates every component.
This times, on a checkpoint-shaped tree (ckpt/item/{manifest,data}), the calls a restore makes
by path against the same reads through directory descriptors (``openat``)."""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def _tree(root: str) -> str:
    ck = os.path.join(root, "ckpt", "7")
    os.makedirs(os.path.join(ck, "state"), exist_ok=True)
    for rel, size in (("_CHECKPOINT_METADATA", 400), ("state/manifest.json", 900),
                      ("state/data.bin", 88)):
        with open(os.path.join(ck, rel), "wb") as f:
            f.write(b"x" * size)
    return ck


def by_path(ck: str) -> None:
    os.lstat(ck)
    fd = os.open(os.path.join(ck, "_CHECKPOINT_METADATA"), os.O_RDONLY)
    os.read(fd, 4096); os.close(fd)  # noqa: E702
    item = os.path.join(ck, "state")
    os.lstat(item)
    for name in ("manifest.json", "data.bin"):
        fd = os.open(os.path.join(item, name), os.O_RDONLY | os.O_NOFOLLOW)
        os.fstat(fd); os.read(fd, 4096); os.close(fd)  # noqa: E702


def by_dirfd(ck: str) -> None:
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    d = os.open(ck, flags)
    try:
        os.fstat(d)
        fd = os.open("_CHECKPOINT_METADATA", os.O_RDONLY | os.O_NOFOLLOW, dir_fd=d)
        os.read(fd, 4096); os.close(fd)  # noqa: E702
        i = os.open("state", flags, dir_fd=d)
        try:
            for name in ("manifest.json", "data.bin"):
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=i)
                os.fstat(fd); os.read(fd, 4096); os.close(fd)  # noqa: E702
        finally:
            os.close(i)
    finally:
        os.close(d)


def single(ck: str, what: str) -> None:
    if what == "lstat":
        os.lstat(ck)
    elif what == "open_dir+close":
        os.close(os.open(ck, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW))
    elif what == "open_file+close (abs)":
        os.close(os.open(os.path.join(ck, "state", "data.bin"), os.O_RDONLY))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None)
    ap.add_argument("--reps", type=int, default=300)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir) as root:
        ck = _tree(root)
        runs = {"by path": lambda: by_path(ck), "by dir fd": lambda: by_dirfd(ck)}
        for w in ("lstat", "open_dir+close", "open_file+close (abs)"):
            runs[w] = lambda w=w: single(ck, w)
        times: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(a.reps):
            for k, f in runs.items():
                t = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t)
        for k, v in times.items():
            print(f"{k:24s} median {statistics.median(v) * 1e6:8.1f} us  "
                  f"p10 {sorted(v)[len(v) // 10] * 1e6:8.1f} us")


if __name__ == "__main__":
    main()
