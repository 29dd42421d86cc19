"""What of the grader's environment reaches a student's kernel, and the grading compilation
cache (autograder/compile_cache.py): filled by trusted code only, read-only to submissions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autograder import ROOT, sandbox
from autograder import compile_cache as cc

GRADER = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
          "JAX_COMPILATION_CACHE_DIR": "/srv/cache",
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
          "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
          "JAX_COMPILATION_CACHE_MAX_SIZE": "1000", "JAX_ENABLE_COMPILATION_CACHE": "1",
          "JAX_RAISE_PERSISTENT_CACHE_ERRORS": "1", "JAX_EXPLAIN_CACHE_MISSES": "1",
          "HOME": "/root", "SECRET_TOKEN": "x"}


def test_a_kernel_gets_jax_settings_but_never_a_shared_compilation_cache():
    """The test suite shares one JAX compilation cache between its processes; a submission
    that could write there would hand the next submission's tests compiled code of its own."""
    assert sandbox.kernel_env(GRADER) == {
        "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    unsandboxed = sandbox.without_shared_caches(GRADER)
    assert not [k for k in unsandboxed if k.startswith(("JAX_COMPILATION", "JAX_PERSISTENT",
                                                        "JAX_ENABLE_COMP", "JAX_RAISE_PERS",
                                                        "JAX_EXPLAIN_CACHE"))]
    assert unsandboxed["JAX_PLATFORMS"] == "cpu" and unsandboxed["HOME"] == "/root"


def test_the_grading_cache_reaches_a_submission_read_only_and_never_asks_jax_to_write():
    env = sandbox.kernel_env(GRADER, cache=(cc.IN_SANDBOX, False))
    assert env["JAX_COMPILATION_CACHE_DIR"] == cc.IN_SANDBOX  # the grader's, not /srv/cache
    assert float(env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]) >= 1e6
    assert env["JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES"] == "none"
    assert "JAX_RAISE_PERSISTENT_CACHE_ERRORS" not in env and "JAX_EXPLAIN_CACHE_MISSES" not in env
    fill = sandbox.kernel_env(GRADER, cache=(cc.IN_SANDBOX, True))
    assert fill["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"
    assert {k: v for k, v in fill.items() if k != "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"} \
        == {k: v for k, v in env.items() if k != "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"}
    iso = sandbox.Isolation("bwrap-root", "bwrap", "setpriv", "prlimit")

    def command(cache):
        return sandbox.kernel_command(iso, ["python"], uid=64999, cwd="/home/student/x",
                                      ipc_dir="/tmp/ipc", read_only=[], env={},
                                      limits=sandbox.Limits(), cache=cache)

    def binds(cmd):
        return [tuple(cmd[i:i + 3]) for i, a in enumerate(cmd) if a in ("--bind", "--ro-bind")]

    assert ("--ro-bind", "/c/lab", cc.IN_SANDBOX) in binds(command(("/c/lab", False)))
    assert not [b for b in binds(command(("/c/lab", False))) if b[0] == "--bind" and
                b[1] == "/c/lab"]
    assert ("--bind", "/c/fill", cc.IN_SANDBOX) in binds(command(("/c/fill", True)))
    assert not [b for b in binds(command(None)) if b[2] == cc.IN_SANDBOX]


def _fake_fill(folder: Path) -> None:
    folder.mkdir()
    (folder / "jit_step-0123abcd-cache").write_bytes(b"compiled program")
    (folder / "notes.txt").write_text("not an entry")
    os.symlink("/etc/passwd", folder / "jit_link-99-cache")
    os.mkfifo(folder / "jit_fifo-98-cache")


def test_only_the_entries_a_fill_wrote_are_kept_and_any_change_fails_the_check(tmp_path):
    source = tmp_path / "lab.ipynb"
    source.write_text("{}")
    _fake_fill(tmp_path / "filled")
    root = tmp_path / "root"
    assert cc.prepare_root(root) is None
    folder = root / "k1"
    entries = cc.install(tmp_path / "filled", folder, lab="lab01_basics", source=source)
    assert list(entries) == ["jit_step-0123abcd-cache"]
    assert cc.check(folder) == entries
    manifest = json.loads((folder / cc.MANIFEST).read_text())
    assert manifest["filled_from"] == str(source) and manifest["lab"] == "lab01_basics"
    assert oct(os.stat(folder).st_mode & 0o777) == "0o755"
    assert oct(os.stat(folder / "jit_step-0123abcd-cache").st_mode & 0o777) == "0o644"
    entry = folder / "jit_step-0123abcd-cache"
    for damage, undo in (
            (lambda: entry.write_bytes(b"other program"),
             lambda: entry.write_bytes(b"compiled program")),
            (lambda: (folder / "jit_new-1-cache").write_bytes(b"x"),
             lambda: (folder / "jit_new-1-cache").unlink()),
            (lambda: os.chmod(entry, 0o666), lambda: os.chmod(entry, 0o644)),
            (lambda: os.chmod(folder, 0o777), lambda: os.chmod(folder, 0o755)),
            (lambda: entry.rename(folder / "gone"), lambda: (folder / "gone").rename(entry))):
        damage()
        with pytest.raises(ValueError):
            cc.check(folder)
        undo()
        assert cc.check(folder) == entries
    copy = tmp_path / "private"
    assert cc.private_copy(str(folder), entries, copy)
    assert (copy / "jit_step-0123abcd-cache").read_bytes() == b"compiled program"
    entry.write_bytes(b"poisoned by an unsandboxed submission")
    assert not cc.private_copy(str(folder), entries, tmp_path / "private2")
    assert not (tmp_path / "private2").exists()


def test_the_cache_folder_is_keyed_by_the_labs_files_and_the_kernel_env_not_its_name(tmp_path):
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
        (tmp_path / name / f"{name}.ipynb").write_text("{}" if name != "c" else '{"x": 1}')
    env = {"JAX_PLATFORMS": "cpu"}
    assert cc.cache_key(tmp_path / "a", env) == cc.cache_key(tmp_path / "b", env)
    assert cc.cache_key(tmp_path / "a", env) != cc.cache_key(tmp_path / "c", env)
    assert cc.cache_key(tmp_path / "a", env) != cc.cache_key(
        tmp_path / "a", {**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    assert cc.where("off") is None and cc.where(str(tmp_path)) == tmp_path
    assert cc.where("") == cc.DEFAULT_ROOT == ROOT / ".cache" / "grading-jax"


# ---------------------------------------------------------------------------------------
# for real: JAX in the sandbox, a trusted fill, then a submission that tries to poison it
# ---------------------------------------------------------------------------------------
TRUSTED = '''
import jax, jax.numpy as jnp
print(float(jax.jit(lambda x: jnp.sin(x) * 3 + 1)(jnp.float32(2.0))))
'''
HOSTILE = '''
import os, jax, jax.numpy as jnp
d = os.environ["JAX_COMPILATION_CACHE_DIR"]
def attempt(f):
    try:
        f()
        return "ok"
    except OSError:  # EROFS (the bind mount) or EACCES (root's files): either way, no
        return "denied"
    except Exception as e:
        return type(e).__name__
entry = sorted(n for n in os.listdir(d) if n.endswith("-cache"))[0]
print("new=" + attempt(lambda: open(os.path.join(d, "jit_evil-1-cache"), "wb").write(b"x")))
print("overwrite=" + attempt(lambda: open(os.path.join(d, entry), "r+b").write(b"x")))
print("unlink=" + attempt(lambda: os.unlink(os.path.join(d, entry))))
print("rename=" + attempt(lambda: os.rename(os.path.join(d, entry), os.path.join(d, "x"))))
print("chmod=" + attempt(lambda: os.chmod(d, 0o777)))
# a miss: JAX compiles and, with the grader's settings, writes nothing and says nothing
print(float(jax.jit(lambda x: jnp.cos(x) - 7)(jnp.float32(1.0))))
# then the student lowers the threshold itself: JAX tries to write, and cannot
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
print(float(jax.jit(lambda x: jnp.tanh(x) + 5)(jnp.float32(1.0))))
print("entries=" + str(len([n for n in os.listdir(d) if n.endswith("-cache")])))
'''
COUNT_HITS = '''
import jax, jax.numpy as jnp
hits = []
jax.monitoring.register_event_listener(
    lambda name, **kw: hits.append(name) if name.endswith("cache_hits") else None)
print(float(jax.jit(lambda x: jnp.sin(x) * 3 + 1)(jnp.float32(2.0))))
print("hits=" + str(len(hits)))
'''


def _in_sandbox(iso, code: str, uid: int, ipc: Path, cache: tuple[str, bool]):
    sandbox.prepare_ipc_dir(ipc, iso, uid)
    inside = (cc.IN_SANDBOX, cache[1])
    cmd = sandbox.kernel_command(
        iso, [sandbox.sandbox_python(), "-c", code], uid=uid, cwd="/home/student/x",
        ipc_dir=str(ipc), read_only=sandbox.python_paths(), limits=sandbox.Limits(),
        env=sandbox.kernel_env({"JAX_PLATFORMS": "cpu"}, cache=inside), cache=cache)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


@pytest.mark.timeout(600)
def test_a_submission_cannot_write_into_the_cache_and_the_next_one_loads_the_references(tmp_path):
    iso = sandbox.probe()
    if iso.mode != "bwrap-root":
        why = f"needs the sandbox as root (have {iso.mode}: {iso.detail})"
        if os.environ.get("MINICKPT_REQUIRE_SANDBOX") == "1":
            pytest.fail(why)
        pytest.skip(why)
    source = tmp_path / "lab.ipynb"
    source.write_text("{}")
    fill, folder = tmp_path / "fill", tmp_path / "root" / "key"
    cc.prepare_root(folder.parent)
    with sandbox.SlotUids(1) as slot:
        uid = slot.uids[0]
        fill.mkdir()
        os.chown(fill, uid, uid)
        trusted = _in_sandbox(iso, TRUSTED, uid, tmp_path / "ipc", (str(fill), True))
        assert trusted.returncode == 0, trusted.stderr[-2000:]
        entries = cc.install(fill, folder, lab="x", source=source)
        assert entries and cc.check(folder) == entries
        hostile = _in_sandbox(iso, HOSTILE, uid, tmp_path / "ipc", (str(folder), False))
        assert hostile.returncode == 0, hostile.stderr[-2000:]
        got = dict(line.split("=", 1) for line in hostile.stdout.split() if "=" in line)
        assert got == {"new": "denied", "overwrite": "denied", "unlink": "denied",
                       "rename": "denied", "chmod": "denied",
                       "entries": str(len(entries))}, hostile.stdout
        lines = hostile.stdout.split()
        assert float(lines[5]) == pytest.approx(0.5403023 - 7) and float(lines[6]) == \
            pytest.approx(0.7615942 + 5)
        before_own = hostile.stderr.split("Error writing persistent compilation cache")[0]
        assert "cache" not in before_own.lower(), hostile.stderr  # a plain miss says nothing
        assert cc.check(folder) == entries  # nothing changed: the next submission's programs
        honest = _in_sandbox(iso, COUNT_HITS, uid, tmp_path / "ipc", (str(folder), False))
    assert honest.returncode == 0, honest.stderr[-2000:]
    assert honest.stdout.split()[0] == trusted.stdout.split()[0]
    assert int(honest.stdout.split("hits=")[1]) >= 1, honest.stdout  # the reference's entry
    assert sys.executable  # (the sandboxed interpreter is this one's environment)
