"""``minickpt`` — look at checkpoints from the shell.

    minickpt ls DIR              every checkpoint: step, status, size, time, metrics
    minickpt inspect DIR [STEP]  the saved trees: paths, dtypes, shapes, bytes
    minickpt verify DIR [STEP]   re-check every checksum; exit 1 on any damage (Orbax
                                 steps: listed, not verified, never a failure)
    minickpt diff A B            leaf-by-leaf differences between two checkpoints
    minickpt stats DIR           save/restore times, success rate, bytes, disk use, last error
    minickpt convert-orbax SRC DST  Orbax checkpoints -> minickpt, verified leaf by leaf

DIR is a run's checkpoint directory (holding ``step_*/``) or one checkpoint directory, or
for ``ls`` and ``verify`` a mirror's URL (``s3://bucket/run``): there a step being uploaded
by the live writer that holds the mirror's lease is IN FLIGHT (exit 0), one whose writer is
gone is UNCOMMITTED, cut short (exit 1 for ``verify``).
Every command takes ``--json`` for scripts: strict JSON, in which a non-finite number (a NaN
loss, an infinite difference) is the string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``.

Exit codes, the same for every command: 0 fine; 1 damage found (a checksum, size or metadata
that does not hold up, whichever command read it; for ``diff``, also any difference); 2 usage
error (DIR or STEP names nothing: a missing directory, a missing step, or — for ``inspect``,
``verify`` and ``diff`` — a directory with no checkpoint in it, so a script's
``minickpt verify DIR && deploy`` never passes on nothing). ``ls`` of an empty DIR is an
empty listing and exits 0.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from .checkpointer import Checkpointer, human_bytes
from .commit import DAMAGED_MARK, METADATA_FILE, is_temporary
from .errors import CheckpointCorruptedError, MiniCkptError, UnsafeCheckpointError
from .format.read import read_leaves
from .fs import DEFAULT_FS
from .orbax_dirs import ORBAX, is_orbax_checkpoint, orbax_summary
from .tree import display_path

_STEP_RE = re.compile(r"^(?:(?P<prefix>.+)_)?(?P<step>[0-9]+)$")

EXIT_OK, EXIT_DAMAGE, EXIT_USAGE = 0, 1, 2
DIR_HELP = ("a run's checkpoint directory (holding step_<N>/ or <prefix>_<N>/ checkpoints), "
            "or one checkpoint directory")


class UsageError(Exception):
    """A command line that names something that is not there."""


def _is_checkpoint(path: str) -> bool:
    try:
        return DEFAULT_FS.exists(os.path.join(path, METADATA_FILE))
    except NotADirectoryError:  # a file: scan() says what was expected instead
        return False


def _strict(obj: Any) -> Any:
    """``obj`` with every non-finite float as a string — ``"NaN"``, ``"Infinity"``,
    ``"-Infinity"`` (what ``float()`` reads back) — so ``--json`` is strict JSON (RFC 8259)
    that any parser takes, not Python's ``NaN`` extension."""
    if isinstance(obj, (float, np.floating)):
        obj = float(obj)
        if obj != obj:
            return "NaN"
        if obj in (float("inf"), float("-inf")):
            return "Infinity" if obj > 0 else "-Infinity"
        return obj
    if isinstance(obj, dict):
        return {k: _strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict(v) for v in obj]
    return obj


def _print_json(obj: Any) -> None:
    print(json.dumps(_strict(obj), indent=1, allow_nan=False, default=str))


def scan(root: str) -> tuple[list[tuple[int, str]], list[str]]:
    """Checkpoint directories under ``root`` as (step, path), ascending; and temporaries."""
    steps, temps = [], []
    try:
        names = DEFAULT_FS.listdir(root)
    except FileNotFoundError:
        raise UsageError(f"no such directory: {root}") from None
    except NotADirectoryError:
        raise UsageError(f"not a directory: {root} is a file; expected {DIR_HELP}") from None
    for name in names:
        path = os.path.join(root, name)
        if not DEFAULT_FS.is_dir(path):
            continue
        if is_temporary(name) or DAMAGED_MARK in name:
            temps.append(path)
            continue
        m = _STEP_RE.match(name)
        if m and not name.endswith(".orbax-checkpoint-tmp"):
            steps.append((int(m.group("step")), path))
    steps.sort()
    return steps, sorted(temps)


def resolve(path: str, step: int | None) -> list[tuple[int | None, str]]:
    """The checkpoint(s) a DIR [STEP] argument pair names."""
    path = os.path.abspath(path)
    if step is None and _is_checkpoint(path):
        m = _STEP_RE.match(os.path.basename(path))
        return [(int(m.group("step")) if m else None, path)]
    steps, _ = scan(path)
    if step is None:
        return list(steps)
    for s, p in steps:
        if s == step:
            return [(s, p)]
    raise UsageError(f"no checkpoint for step {step} in {path} "
                     f"(steps: {[s for s, _ in steps] or 'none'})")


def _err(msg: str, code: int = EXIT_USAGE) -> int:
    print(f"minickpt: error: {msg}", file=sys.stderr)
    return code


def _time(ns: int | None) -> str:
    if not ns:
        return "-"
    return _dt.datetime.fromtimestamp(ns / 1e9).isoformat(sep=" ", timespec="seconds")


def _metrics(m: dict[str, Any] | None) -> str:
    if not m:
        return "-"
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items())


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*r).rstrip() for r in [header, *rows])


def _orbax_note(root: str) -> str:
    return f"{ORBAX}: minickpt does not read it ({_convert_hint(root)})"


def _convert_hint(root: str) -> str:
    return f"`minickpt convert-orbax {root} NEW_DIR` converts the run"


def _is_orbax(path: str) -> bool:
    """Whether a checkpoint found is Orbax's, not minickpt's (never a minickpt one, damaged
    or not: its metadata names its format)."""
    return is_orbax_checkpoint(path)


def _run_root(path: str) -> str:
    """The run directory a checkpoint path belongs to (itself, if it is one)."""
    path = os.path.abspath(path)
    return os.path.dirname(path) if _is_checkpoint(path) else path


def _latest_minickpt(targets: list[tuple[int | None, str]], what: str
                     ) -> tuple[int | None, str]:
    """The newest of ``targets`` that is minickpt's (a run's "latest" skips Orbax steps, as
    the manager does); the newest Orbax one if there is no other."""
    mine = [t for t in targets if not _is_orbax(t[1])]
    if not targets:
        raise UsageError(f"no checkpoints in {what}")
    return (mine or targets)[-1]


# ---------------------------------------------------------------------------------------
def _is_url(path: str) -> bool:
    """An fsspec URL (``s3://``, ``gs://`` ...): a tiered manager's mirror, read in place."""
    return "://" in path and not path.startswith("file://")


def _mirror_report(url: str, step: int | None, deep: bool) -> list[dict[str, Any]]:
    """Each step folder of the mirror at ``url``: committed (its commit marker) and checked,
    or not committed: an upload in flight (its in-progress marker names the live writer
    that holds the mirror's lease: not damage) or cut short (no live writer: never
    restored, and damage to report). Credentials and the endpoint come from the environment
    (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID`` ...)."""
    from .commit import parse_step
    from .production.mirror import FsspecStore, abandoned, describe_holder

    store = FsspecStore(url, create=False)
    got = store.lease()
    holder = got[0] if got is not None and store.lease_is_live(got[0]) else None
    out = []
    for name in sorted(store.listdir("")):
        s = parse_step(name)
        if s is None or (step is not None and s != step):
            continue
        rec: dict[str, Any] = {"step": s, "path": store.path(name), "problems": []}
        if not store.committed(name):
            mark = store.marker(name)
            if mark is not None and holder is not None \
                    and mark.get("writer") == holder.get("writer") \
                    and not abandoned(mark, store.stale_after_s):
                rec.update(status="in flight", problems=[
                    f"being written by {describe_holder(mark)}, which holds the mirror's "
                    "lease: not committed yet, so never restored until it is"])
            else:
                rec.update(status="uncommitted", problems=[
                    "no commit marker and no live writer: an upload or a delete cut short; "
                    "never restored (the next writer removes it)"])
        elif deep:
            rec["problems"] = store.verify(name)
            rec["status"] = "damaged" if rec["problems"] else "valid"
        else:
            try:
                store.metadata(name)
                rec["status"] = "valid"
            except (MiniCkptError, OSError) as e:
                rec.update(status="damaged", problems=[str(e)])
        out.append(rec)
    return out


def _mirror_cmd(args: argparse.Namespace, verify: bool) -> int:
    """``ls`` and ``verify`` on a mirror URL."""
    out = _mirror_report(args.dir, getattr(args, "step", None), deep=verify or args.deep)
    if verify and not out:
        raise UsageError(f"no checkpoints in {args.dir}: nothing to verify")
    if args.json:
        _print_json(out)
    else:
        if not out:
            print(f"no checkpoints in {args.dir}")
        for r in out:
            print(f"{r['status'].upper():<12} step {r['step']}: {r['path']}")
            for p in r["problems"]:
                print(f"    {p}")
    bad = ("damaged", "uncommitted") if verify else ("damaged",)
    return EXIT_DAMAGE if any(r["status"] in bad for r in out) else EXIT_OK


def cmd_ls(args: argparse.Namespace) -> int:
    if _is_url(args.dir):
        return _mirror_cmd(args, verify=False)
    ck = Checkpointer()
    root = os.path.abspath(args.dir)
    if _is_checkpoint(root):
        entries, temps = resolve(root, None), []
    else:
        entries, temps = scan(root)
    out = []
    for step, path in entries:
        rec: dict[str, Any] = {"step": step, "path": path}
        rep = ck.verify(path, deep=args.deep, step=step)
        rec["status"] = "valid" if rep.ok else "damaged"
        rec["problems"] = [p for p in rep.problems if "not part of the checkpoint" not in p]
        if not rep.ok and _is_orbax(path):  # not damage: another library's format
            rec["status"] = "orbax"
            rec["problems"] = [_orbax_note(root)]
        try:
            meta = ck.metadata(path)
            rec.update(bytes=DEFAULT_FS.dir_size(path), time=meta.commit_timestamp_nsecs,
                       metrics=meta.metrics, items=sorted(meta.items))
        except (MiniCkptError, OSError):
            rec.update(bytes=DEFAULT_FS.dir_size(path), time=None, metrics=None, items=[])
        out.append(rec)
    for path in temps:
        aside = DAMAGED_MARK in os.path.basename(path)
        out.append({"step": None, "path": path, "status": "set aside" if aside else "temporary",
                    "bytes": DEFAULT_FS.dir_size(path), "time": None, "metrics": None,
                    "items": [], "problems": [
                        "damaged; a restore skipped it and moved it here (delete it when done)"
                        if aside else "left by an interrupted save or delete; a "
                        "CheckpointManager removes it when it opens"]})
    if args.json:
        _print_json(out)
    else:
        rows = [[str(r["step"]) if r["step"] is not None else "-", r["status"],
                 human_bytes(r["bytes"]), _time(r["time"]), ",".join(r["items"]) or "-",
                 _metrics(r["metrics"]) if r["step"] is not None
                 else os.path.basename(r["path"])] for r in out]
        if not rows:
            print(f"no checkpoints in {root}")
        else:
            print(_table(rows, ["STEP", "STATUS", "SIZE", "TIME", "ITEMS", "METRICS"]))
            for r in out:
                for p in r["problems"] if r["status"] in ("damaged", "orbax") else []:
                    print(f"  step {r['step']}: {p}")
            if not args.deep:
                print("(status checks structure and sizes; add --deep to re-check checksums)")
    return EXIT_DAMAGE if any(r["status"] == "damaged" for r in out) else EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    ck = Checkpointer()
    targets = resolve(args.dir, args.step)
    if not targets:
        return _err(f"no checkpoints in {args.dir}")
    step, path = _latest_minickpt(targets, args.dir)  # the named step, or the latest
    if _is_orbax(path):
        return _inspect_orbax(args, step, path)
    meta = ck.metadata(path)
    items = {}
    damage = []
    for name in meta.items:
        if args.item and name != args.item:
            continue
        try:
            m = ck.manifest(path, name, meta)
        except UnsafeCheckpointError:
            raise  # a link out, say: nothing more is read
        except CheckpointCorruptedError as e:  # a data file, say: the listing needs none
            m = _manifest_only(path, name, meta, e)
            damage.append(str(e))
        leaves = []
        for e in m.entries:
            rec = {"path": display_path(e["path"]) if e["path"] else "", "names": e["path"],
                   "kind": e["kind"]}
            if e["kind"] == "value":
                rec.update(dtype=e["type"], shape=None, bytes=0,
                           value=read_leaves(DEFAULT_FS, m, [m.entries.index(e)])[0])
            else:
                rec.update(dtype=e["dtype"] if e["kind"] == "array" else f"key<{e['impl']}>",
                           shape=e["shape"] if e["kind"] == "array" else e["shape"][:-1],
                           bytes=e["nbytes"])
            leaves.append(rec)
        items[name] = {"tree_type": m.skeleton.get("type", m.skeleton["t"]), "leaves": leaves,
                       "bytes": m.stored_bytes}
    if args.json:
        _print_json({"step": step, "path": path, "metrics": meta.metrics,
                     "metadata": meta.custom_metadata, "items": items, "damage": damage})
        return EXIT_DAMAGE if damage else EXIT_OK
    print(f"checkpoint {path}")
    print(f"  step {step}, committed {_time(meta.commit_timestamp_nsecs)}, "
          f"format v{meta.format_version}, {human_bytes(meta.bytes)} of arrays")
    if meta.metrics:
        print(f"  metrics: {_metrics(meta.metrics)}")
    if meta.custom_metadata:
        print(f"  metadata: {json.dumps(meta.custom_metadata)}")
    for name, it in items.items():
        print(f"\n{name}/  ({it['tree_type']}, {len(it['leaves'])} leaves, "
              f"{human_bytes(it['bytes'])})")
        rows = []
        for r in it["leaves"]:
            shape = "-" if r["shape"] is None else "(" + ", ".join(map(str, r["shape"])) + \
                ("," if len(r["shape"]) == 1 else "") + ")"
            extra = repr(r["value"]) if r["kind"] == "value" else human_bytes(r["bytes"])
            rows.append([r["path"] or "<root>", r["dtype"], shape, extra])
        print(_table(rows, ["PATH", "DTYPE", "SHAPE", "BYTES/VALUE"]))
    for d in damage:
        print(f"\nDAMAGED: {d} (`minickpt verify` checks the rest)")
    return EXIT_DAMAGE if damage else EXIT_OK


def _inspect_orbax(args: argparse.Namespace, step: int | None, path: str) -> int:
    """What can be said of an Orbax step without reading its arrays (not damage: exit 0)."""
    info = orbax_summary(path)
    if args.item:
        info["items"] = {k: v for k, v in info["items"].items() if k == args.item}
    note = _orbax_note(_run_root(path))
    if args.json:
        _print_json({"step": step, "path": path, "format": "orbax", "note": note, **info})
        return EXIT_OK
    print(f"checkpoint {path}")
    print(f"  step {step}, committed {_time(info['time'])}; {note}")
    if info["metrics"]:
        print(f"  metrics: {_metrics(info['metrics'])}")
    for name, it in info["items"].items():
        leaves = it["leaves"]
        print(f"\n{name}/  ({it['handler']}"
              + (f", {len(leaves)} leaves: key paths and Orbax's types only)" if leaves
                 is not None else ")"))
        if leaves:
            print(_table([[x["path"] or "<root>", x["type"]] for x in leaves],
                         ["PATH", "ORBAX TYPE"]))
    return EXIT_OK


def _manifest_only(path: str, name: str, meta: Any, error: CheckpointCorruptedError) -> Any:
    """An item's manifest, checked against its recorded checksum but not against its data
    files; ``error`` is raised if the manifest itself is what is damaged."""
    from .format.manifest import parse_json, validate_manifest
    from .format.spec import MANIFEST_FILE, crc32

    item_dir = os.path.join(path, name)
    mpath = os.path.join(item_dir, MANIFEST_FILE)
    try:
        raw = DEFAULT_FS.read_file(mpath, 64 << 20)
    except (OSError, ValueError):
        raise error from None
    want = meta.items[name].get("manifest_crc32")
    if isinstance(want, int) and crc32(raw) != want:
        raise error
    try:
        return validate_manifest(parse_json(raw, mpath, "manifest"), mpath, item_dir,
                                 crc32(raw))
    except CheckpointCorruptedError:
        raise error from None


def cmd_verify(args: argparse.Namespace) -> int:
    if _is_url(args.dir):
        return _mirror_cmd(args, verify=True)
    ck = Checkpointer()
    targets = resolve(args.dir, args.step)
    if not targets:  # nothing verified is not a pass
        raise UsageError(f"no checkpoints in {os.path.abspath(args.dir)}: nothing to verify")
    root = _run_root(args.dir)
    recs = []
    for s, path in targets:
        r = ck.verify(path, deep=True, step=s)
        rec = {"step": s, "path": r.path, "status": "valid" if r.ok else "damaged",
               "ok": r.ok, "problems": r.problems, "leaves": r.items,
               "bytes_checked": r.bytes_checked}
        if not r.ok and _is_orbax(path):  # another library's: not verified, not damaged
            rec.update(status="orbax", ok=None, leaves={}, bytes_checked=0, problems=[
                f"{ORBAX}, not verified by minickpt ({_convert_hint(root)})"])
        recs.append(rec)
    if all(r["status"] == "orbax" for r in recs):  # nothing verified is not a pass
        raise UsageError(f"{os.path.abspath(args.dir)} holds only Orbax checkpoints (steps "
                         f"{[r['step'] for r in recs]}), which minickpt does not verify: "
                         f"nothing verified ({_convert_hint(root)})")
    if args.json:
        _print_json(recs)
    else:
        for r in recs:
            label = f"step {r['step']}" if r["step"] is not None else r["path"]
            if r["status"] == "orbax":
                print(f"ORBAX    {label}: {r['problems'][0]}")
                continue
            if r["ok"]:
                print(f"OK       {label}: {sum(r['leaves'].values())} leaves, "
                      f"{human_bytes(r['bytes_checked'])} checksummed")
            else:
                print(f"DAMAGED  {label}:")
            for p in r["problems"]:
                print(f"    {p}")
    return EXIT_DAMAGE if any(r["status"] == "damaged" for r in recs) else EXIT_OK


def _flat(path: str) -> dict[tuple[str, ...], tuple[str, Any]]:
    """Every leaf of every item of a checkpoint: (item, *names) -> (description, value).

    Keyed by the name tuples, as save and restore key leaves: joined into one string, the
    dict key ``"a/b"`` and the nested ``a`` → ``b`` would be one leaf."""
    ck = Checkpointer()
    meta = ck.metadata(path)
    out = {}
    for name in meta.items:
        m = ck.manifest(path, name, meta)
        values = read_leaves(DEFAULT_FS, m)
        for e, v in zip(m.entries, values, strict=True):
            key = (name, *e["path"])
            desc = e["type"] if e["kind"] == "value" else \
                f"{e['dtype'] if e['kind'] == 'array' else 'key<' + e['impl'] + '>'}{e['shape']}"
            out[key] = (desc, v.data if hasattr(v, "impl") else v)
    return out


def _compare_arrays(a: np.ndarray, b: np.ndarray) -> tuple[int, float]:
    """How many values differ (NaN equals NaN), and the largest absolute difference."""
    if a.size == 0:
        return 0, 0.0
    inexact = a.dtype.kind in "fc" or a.dtype.kind == "V"  # "V": bfloat16, float8...
    if not inexact:
        neq = a != b
        return int(np.count_nonzero(neq)), float(np.max(np.abs(
            a.astype(np.float64) - b.astype(np.float64)))) if neq.any() else 0.0
    wide = np.complex128 if a.dtype.kind == "c" else np.float64
    fa, fb = a.astype(wide), b.astype(wide)
    same = (fa == fb) | (np.isnan(fa) & np.isnan(fb))
    n = int(np.count_nonzero(~same))
    return n, float(np.nanmax(np.abs(fa - fb)[~same])) if n else 0.0


def cmd_diff(args: argparse.Namespace) -> int:
    def one(p: str) -> str:
        path = _latest_minickpt(resolve(p, None), p)[1]
        if _is_orbax(path):
            raise UsageError(f"{path} is {ORBAX}, which minickpt does not read, so diff "
                             f"cannot compare it ({_convert_hint(_run_root(path))})")
        return path

    a_path, b_path = one(args.a), one(args.b)
    a, b = _flat(a_path), _flat(b_path)
    rows: list[dict[str, Any]] = []
    for key in sorted(set(a) | set(b)):
        at = {"path": display_path(key), "names": list(key)}
        if key not in b:
            rows.append({**at, "change": "only in A", "a": a[key][0]})
            continue
        if key not in a:
            rows.append({**at, "change": "only in B", "b": b[key][0]})
            continue
        (da, va), (db, vb) = a[key], b[key]
        if da != db:
            rows.append({**at, "change": "type/shape", "a": da, "b": db})
            continue
        if isinstance(va, np.ndarray):
            neq, max_diff = _compare_arrays(va, vb)
            if neq:
                rows.append({**at, "change": "values", "differing": neq,
                             "of": int(va.size), "max_abs_diff": max_diff})
            elif args.all:
                rows.append({**at, "change": "same"})
        elif va != vb and not (isinstance(va, float) and va != va and vb != vb):
            rows.append({**at, "change": "values", "a": repr(va), "b": repr(vb)})
        elif args.all:
            rows.append({**at, "change": "same"})
    differs = [r for r in rows if r["change"] != "same"]
    if args.json:
        _print_json({"a": a_path, "b": b_path, "identical": not differs, "leaves": rows})
    else:
        print(f"A = {a_path}\nB = {b_path}")
        if not differs:
            print(f"identical: {len(a)} leaves, every value equal")
        for r in rows:
            if r["change"] == "values" and "differing" in r:
                print(f"  ~ {r['path']}: {r['differing']} of {r['of']} values differ "
                      f"(max |A-B| = {r['max_abs_diff']:.3g})")
            elif r["change"] == "values":
                print(f"  ~ {r['path']}: {r['a']} -> {r['b']}")
            elif r["change"] == "type/shape":
                print(f"  ! {r['path']}: {r['a']} -> {r['b']}")
            elif r["change"] == "only in A":
                print(f"  - {r['path']} ({r['a']})")
            elif r["change"] == "only in B":
                print(f"  + {r['path']} ({r['b']})")
            else:
                print(f"  = {r['path']}")
    return EXIT_DAMAGE if differs else EXIT_OK


def cmd_convert_orbax(args: argparse.Namespace) -> int:
    from .options import CheckpointManagerOptions
    from .orbax_convert import ConversionFailed, convert

    def show(c: Any) -> None:
        if args.json:
            return
        if c.error is not None:  # one line, and the next step is converted
            print(f"minickpt: error: step {c.step}: {c.source}: not converted: {c.error}",
                  file=sys.stderr)
            return
        extra = [f"JSON item(s) {', '.join(c.json_items)}"] if c.json_items else []
        extra += [f"{c.keys} typed PRNG key(s)"] if c.keys else []
        print(f"step {c.step}: {c.source} -> {c.path}: items {', '.join(c.items)}: "
              f"{c.leaves} leaves identical" + (f" ({'; '.join(extra)})" if extra else "")
              + (" (already converted)" if c.skipped else ""))

    records: list[Any] = []

    def keep(c: Any) -> None:
        records.append(c)
        show(c)

    src, dst = os.path.abspath(args.src), os.path.abspath(args.dst)
    try:
        convert(args.src, args.dst, steps=args.steps, on_step=keep,
                options=CheckpointManagerOptions(step_prefix=args.step_prefix))
        failed: dict[int, str] = {}
    except FileNotFoundError as e:
        raise UsageError(str(e)) from None
    except ConversionFailed as e:
        failed = e.failed
    if args.json:
        _print_json([vars(c) for c in records])
    elif failed:
        print(f"converted {len(records) - len(failed)} of {len(records)} Orbax "
              f"checkpoint(s) from {src} into {dst}; NOT converted: step(s) "
              f"{sorted(failed)} (why: above); {src} was only read")
    else:
        print(f"converted {len(records)} Orbax checkpoint(s) from {src} into {dst}, every "
              f"item of every step; {src} was only read")
    return EXIT_DAMAGE if failed else EXIT_OK


def cmd_stats(args: argparse.Namespace) -> int:
    from .production.monitoring import format_summary, load_metrics, summarize

    root = os.path.abspath(args.dir)
    try:
        mlog = load_metrics(root)
    except FileNotFoundError as e:
        raise UsageError(str(e)) from None
    if not mlog.records and mlog.malformed:
        raise UsageError(f"{mlog.path} is not a metrics file: none of its {mlog.malformed} "
                         "line(s) is a minickpt metrics record; expected a run's checkpoint "
                         "directory or the .minickpt-metrics.jsonl that "
                         "minickpt.production.attach_monitor writes there")
    s = summarize(mlog)
    disk_now = DEFAULT_FS.dir_size(root) if DEFAULT_FS.is_dir(root) else None
    if args.json:
        _print_json({"path": mlog.path, "disk_bytes_now": disk_now, **s})
    else:
        print(format_summary(s, path=mlog.path, disk_now=disk_now))
    return EXIT_OK


# ---------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="minickpt",
        description="Look at, verify and compare minickpt checkpoints.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="A checkpoint is a directory that became visible in one atomic rename, after every "
               "file in it was fsynced. 'ls' and 'verify' tell you whether each one is still "
               "intact; 'inspect' shows what a training state is made of.\n\n"
               "Exit codes: 0 fine; 1 damage found by any command (for diff, also any "
               "difference); 2 usage error: DIR or STEP names nothing (no such directory or "
               "step, or no checkpoint in DIR for inspect, verify and diff).")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def add(name: str, help_: str, desc: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_, description=desc)
        sp.add_argument("--json", action="store_true",
                        help="machine-readable output: strict JSON, NaN and infinities as "
                             'the strings "NaN", "Infinity", "-Infinity"')
        return sp

    sp = add("ls", "list checkpoints with status, size, time and metrics",
             "List every checkpoint in DIR (and temporaries left by interrupted saves). Status "
             "'valid' means metadata, manifests and file sizes agree; --deep re-reads every "
             "byte and checks the CRC-32 of each leaf.")
    sp.add_argument("dir", metavar="DIR", help=DIR_HELP)
    sp.add_argument("--deep", action="store_true", help="also verify every checksum")
    sp.set_defaults(fn=cmd_ls)

    sp = add("inspect", "show the saved trees: paths, dtypes, shapes, bytes",
             "Show what one checkpoint holds: each item's leaves with their key paths, dtypes "
             "and shapes, plus metrics and metadata. Without STEP, the latest minickpt one. "
             "Of an Orbax step, what its JSON files say (items, handlers, key paths, "
             "metrics). Exits 1 if what it reads is damaged, 2 if DIR holds no checkpoint.")
    sp.add_argument("dir", metavar="DIR", help=DIR_HELP)
    sp.add_argument("step", metavar="STEP", nargs="?", type=int,
                    help="the step to show, a checkpoint in DIR (default: the latest)")
    sp.add_argument("--item", help="only this item (e.g. params)")
    sp.set_defaults(fn=cmd_inspect)

    sp = add("verify", "re-check checksums; exit 1 if anything is damaged",
             "Verify checkpoints without restoring them: metadata, manifests, sizes and the "
             "CRC-32 of every leaf. Without STEP, every checkpoint in DIR. Exits 1 and names the "
             "damaged file and leaf if anything is wrong; exits 2 if DIR does not exist or "
             "holds no checkpoint, since nothing verified is not a pass. Orbax steps are "
             "listed as ORBAX, not verified by minickpt, and never make it fail (only Orbax "
             "steps to verify: exit 2). On a mirror URL, an upload by the live writer holding "
             "the lease is IN FLIGHT (not a failure); one cut short (no live writer) exits 1.")
    sp.add_argument("dir", metavar="DIR", help=DIR_HELP)
    sp.add_argument("step", metavar="STEP", nargs="?", type=int,
                    help="verify only this step's checkpoint in DIR (default: every one)")
    sp.set_defaults(fn=cmd_verify)

    sp = add("diff", "leaf-by-leaf differences between two checkpoints",
             "Compare two checkpoints (each a checkpoint directory, or a run directory meaning "
             "its latest). Lists leaves only in one, with another type or shape, or with "
             "different values (how many and the largest difference). Exits 1 if they differ "
             "or either is damaged; 2 if either is an Orbax checkpoint (a run directory "
             "means its latest minickpt checkpoint).")
    sp.add_argument("a", metavar="A", help="the first checkpoint directory, or a run "
                                            "directory meaning its latest checkpoint")
    sp.add_argument("b", metavar="B", help="the second checkpoint directory, or a run "
                                            "directory meaning its latest checkpoint")
    sp.add_argument("--all", action="store_true", help="also list identical leaves")
    sp.set_defaults(fn=cmd_diff)

    sp = add("stats", "summarise the metrics recorded next to the checkpoints",
             "Summarise DIR/.minickpt-metrics.jsonl (written by "
             "minickpt.production.attach_monitor): number of saves and restores, success "
             "rate, median/p95/max save and restore time, bytes, disk use, the last error.")
    sp.add_argument("dir", metavar="DIR",
                    help="a run's checkpoint directory, or its metrics file")
    sp.set_defaults(fn=cmd_stats)

    sp = add("convert-orbax", "convert an Orbax run directory into minickpt checkpoints",
             "Restore each Orbax checkpoint in SRC with Orbax itself (arrays as numpy arrays), "
             "save it as the same step in DST with its metrics, read it back and compare "
             "every leaf (dtype, shape, bytes). SRC is never written to; a step already in "
             "DST is compared again, not saved twice. Needs orbax-checkpoint.")
    sp.add_argument("src", metavar="SRC", help="the Orbax run directory (holding 0/, 1/ ...)")
    sp.add_argument("dst", metavar="DST", help="the minickpt run directory to write")
    sp.add_argument("--steps", type=int, nargs="+", help="only these steps (default: all)")
    sp.add_argument("--step-prefix", default="step",
                    help="DST's step prefix (default: step, giving step_<N>/)")
    sp.set_defaults(fn=cmd_convert_orbax)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except BrokenPipeError:  # `minickpt ls | head`
        return EXIT_OK
    except CheckpointCorruptedError as e:  # damage met while reading: 1, as verify says it
        return _err(str(e), EXIT_DAMAGE)
    except (UsageError, MiniCkptError, OSError, KeyError) as e:
        return _err(str(e))


if __name__ == "__main__":
    sys.exit(main())
