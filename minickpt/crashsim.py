"""Crash simulation: what a power cut at any moment can leave on disk (ALICE-style).

Killing a process leaves the page cache intact, so it only tests half of crash safety. A power
cut (or a kernel panic, or a VM that is reset) also loses everything the program wrote but did
not make durable:

* a file's **contents** are durable only once the file itself was fsynced; before that the file
  may come back empty, with its new size but zeros instead of data, or half written;
* a **directory entry** — a create, a mkdir, a rename, an unlink — is durable only once the
  *directory holding it* was fsynced. A rename is therefore not durable when it returns, only
  after the parent directory's fsync; and a new file can be durable in its contents while its
  name is lost, or the other way round: named, but holding nothing.

:class:`CrashRecorder` is a :class:`~minickpt.fs.FileSystem` that passes every call through to
the real file system and keeps, next to it, a model of what has been made durable. It can stop
the program dead before any chosen call (every later call raises
:class:`~minickpt.faults.SimulatedCrash`, from any thread), and then list the states a crash at
that point could leave (:meth:`CrashRecorder.crash_states`):

* only what was fsynced (every un-synced directory operation lost),
* the un-synced directory operations persisted in order, one more at a time, up to all of
  them (a journal that commits in order),
* directories persisting independently, each its own operations in order,

each combined with what became of un-synced file data: ``old`` (as at the last fsync: empty for
a new file), ``zeros`` (the new size but no data: a hole-filled file), ``torn`` (half of it),
``new`` (all of it). :meth:`CrashRecorder.materialise` writes one such state into a fresh
directory, where a fresh process can look at it. :func:`explore` runs a scenario once per crash
point and hands every distinct state to a checker.

This module is for tests and for the course's labs; the library itself never imports it.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .faults import SimulatedCrash
from .fs import Buffer, FileSystem

DATA_MODES = ("old", "zeros", "torn", "new")
"""What a crash may leave of a file's un-synced data (see the module docstring)."""

IN_FLIGHT_MODES = (*DATA_MODES, "holes")
""":data:`DATA_MODES` and ``holes``: every other 4 KiB block of the new data, the blocks
between as they were at the last fsync (zeros past its end) — what writes still in flight at
a crash leave, since several queued writes finish in any order and each may be half done.
Set :attr:`CrashRecorder.data_modes` to these to explore a write path that has them."""

_HOLE = 4096

Tree = dict[str, Any]  # name -> bytes (a file) or Tree (a directory)


@dataclass
class _File:
    data: bytearray  # the contents now (what the page cache holds)
    synced: bytes  # the contents at the last fsync (empty if never synced)
    dirty: bool = False


@dataclass
class _Dir:
    base: dict[str, int]  # entries when recording began (durable by assumption)
    entries: dict[str, int]  # entries now


@dataclass
class _Op:
    """One directory operation: entry changes applied together, atomically."""

    call: int  # the number of the call that made it
    desc: str
    changes: tuple[tuple[int, str, int | None], ...]  # (dir inode, name, inode or None)
    dirs: frozenset[int]
    durable: bool = False


@dataclass
class _Fd:
    ino: int
    pos: int = 0
    append: bool = False


@dataclass(frozen=True)
class CrashState:
    """One state a crash could leave: which directory operations persisted, and what became
    of un-synced file data (one mode for every file, or a mode per file inode)."""

    label: str
    ops: frozenset[int]
    data: str | tuple[tuple[int, str], ...] = "new"


DATA_SAID = {"old": "file data not fsynced lost (a new file empty)",
             "zeros": "files not fsynced hold zeros at their new size",
             "torn": "files not fsynced cut short (half their new data)",
             "new": "file data not fsynced kept"}
"""How a crash state's label says what became of un-synced file data (a lab's message reads it)."""


class CrashRecorder(FileSystem):
    """A pass-through file system that models durability and can crash before any call.

    ``world`` is the directory the model covers (it must exist; what is in it when recording
    starts counts as durable). Calls on paths outside it pass through unmodelled. With
    ``crash_at=k`` calls ``0 .. k-1`` run and call ``k`` and every later one raise
    :class:`SimulatedCrash`. ``sync=False`` (the default) skips the real fsyncs: durability is
    modelled, not needed, and the simulation runs much faster.
    """

    data_modes: tuple[str, ...] = DATA_MODES  # what un-synced data may become at a crash

    def __init__(self, world: str | os.PathLike[str], *, crash_at: int | None = None,
                 base: FileSystem | None = None, sync: bool = False):
        self.world = os.path.abspath(os.fspath(world))
        self.base = base or FileSystem()
        self.sync = sync
        self.crash_at = crash_at
        self.count = 0
        self.crashed = False
        self.ended = False  # close_all() was called: the "dead" program is gone
        self.calls: list[tuple[str, str]] = []  # (op, what) of every call made
        self._lock = threading.RLock()
        self._files: dict[int, _File] = {}
        self._dirs: dict[int, _Dir] = {}
        self._ops: list[_Op] = []
        self._fds: dict[int, _Fd] = {}
        self._real_fds: set[int] = set()
        self._next_ino = 1
        self.root = self._snapshot(self.world)

    # ---- the model -----------------------------------------------------------------------
    def _new_ino(self) -> int:
        self._next_ino += 1
        return self._next_ino - 1

    def _snapshot(self, path: str) -> int:
        st = self.base.lstat(path)
        ino = self._new_ino()
        if stat.S_ISDIR(st.st_mode):
            entries = {name: self._snapshot(os.path.join(path, name))
                       for name in sorted(self.base.listdir(path))}
            self._dirs[ino] = _Dir(dict(entries), dict(entries))
        elif stat.S_ISREG(st.st_mode):
            data = self.base.read_file(path, max_bytes=1 << 40)
            self._files[ino] = _File(bytearray(data), data)
        else:
            raise ValueError(f"{path}: the crash model handles files and directories only")
        return ino

    def _parts(self, path: str) -> list[str] | None:
        ap = os.path.abspath(path)
        if ap == self.world:
            return []
        if not ap.startswith(self.world + os.sep):
            return None
        return ap[len(self.world) + 1:].split(os.sep)

    def _lookup(self, parts: Sequence[str]) -> int | None:
        ino = self.root
        for name in parts:
            d = self._dirs.get(ino)
            if d is None or name not in d.entries:
                return None
            ino = d.entries[name]
        return ino

    def _parent(self, path: str) -> tuple[int, str] | None:
        parts = self._parts(path)
        if not parts:
            return None
        pino = self._lookup(parts[:-1])
        if pino is None or pino not in self._dirs:
            raise RuntimeError(f"crash model out of step with the disk at {path}")
        return pino, parts[-1]

    def _op(self, desc: str, *changes: tuple[int, str, int | None]) -> None:
        for dino, name, ino in changes:
            if ino is None:
                self._dirs[dino].entries.pop(name, None)
            else:
                self._dirs[dino].entries[name] = ino
        self._ops.append(_Op(self.count - 1, desc, tuple(changes),
                             frozenset(d for d, _, _ in changes)))

    def _enter(self, op: str, what: str) -> None:
        """Count a call; crash instead of making it when its time has come."""
        k = self.count
        self.count += 1
        if self.crashed or (self.crash_at is not None and k >= self.crash_at):
            self.crashed = True
            raise SimulatedCrash(f"simulated power cut at call {k}: {op} {what}")
        self.calls.append((op, what))

    def _write_model(self, fd: int, data: bytes, at: int | None = None) -> None:
        """``data`` written at the file position (``at=None``) or at offset ``at``, which
        leaves the position where it was (pwrite)."""
        h = self._fds.get(fd)
        if h is None or h.ino not in self._files:
            return
        f = self._files[h.ino]
        pos = at if at is not None else len(f.data) if h.append else h.pos
        if pos > len(f.data):
            f.data.extend(bytes(pos - len(f.data)))
        f.data[pos:pos + len(data)] = data
        if at is None:
            h.pos = pos + len(data)
        f.dirty = True

    # ---- primitives ------------------------------------------------------------------------
    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        with self._lock:
            self._enter("open", path)
            parts = self._parts(path)
            fd = self.base.open(path, flags, mode)
            self._real_fds.add(fd)
            if parts is None:
                return fd
            ino = self._lookup(parts)
            if ino is None:
                if not flags & os.O_CREAT:
                    raise RuntimeError(f"crash model out of step with the disk at {path}")
                parent = self._parent(path)
                assert parent is not None
                ino = self._new_ino()
                self._files[ino] = _File(bytearray(), b"")
                self._op(f"create {path}", (parent[0], parent[1], ino))
            elif ino in self._files and flags & os.O_TRUNC and flags & (os.O_WRONLY | os.O_RDWR):
                self._files[ino].data = bytearray()
                self._files[ino].dirty = True
            self._fds[fd] = _Fd(ino, 0, bool(flags & os.O_APPEND))
            return fd

    def write(self, fd: int, data: Buffer) -> int:
        with self._lock:
            self._enter("write", f"fd {fd}")
            n = self.base.write(fd, data)
            self._write_model(fd, bytes(memoryview(data).cast("B")[:n]))
            return n

    def pwrite(self, fd: int, data: Buffer, offset: int) -> int:
        with self._lock:
            self._enter("pwrite", f"fd {fd} at {offset}")
            n = self.base.pwrite(fd, data, offset)
            self._write_model(fd, bytes(memoryview(data).cast("B")[:n]), offset)
            return n

    def writev(self, fd: int, buffers: Sequence[Buffer]) -> int:
        with self._lock:
            self._enter("writev", f"fd {fd}")
            n = self.base.writev(fd, buffers)
            joined = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
            self._write_model(fd, joined[:n])
            return n

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        with self._lock:
            self._enter("preadv", f"fd {fd}")
            return self.base.preadv(fd, buffers, offset)

    def fsync(self, fd: int) -> None:
        with self._lock:
            self._enter("fsync", f"fd {fd}")
            if self.sync:
                self.base.fsync(fd)
            h = self._fds.get(fd)
            if h is None:
                return
            if h.ino in self._files:
                f = self._files[h.ino]
                f.synced, f.dirty = bytes(f.data), False
            else:  # a directory: its entries (creates, renames, unlinks) become durable
                for op in self._ops:
                    if h.ino in op.dirs:
                        op.durable = True

    def close(self, fd: int) -> None:
        with self._lock:
            if self.ended:  # a finaliser of the dead program's objects: nothing to do
                return
            self._enter("close", f"fd {fd}")
            self.base.close(fd)
            self._real_fds.discard(fd)
            self._fds.pop(fd, None)

    def ftruncate(self, fd: int, length: int) -> None:
        with self._lock:
            self._enter("ftruncate", f"fd {fd} to {length}")
            self.base.ftruncate(fd, length)
            h = self._fds.get(fd)
            if h is not None and h.ino in self._files:
                f = self._files[h.ino]
                del f.data[length:]
                f.data.extend(bytes(length - len(f.data)))
                f.dirty = True

    def allocate(self, fd: int, length: int) -> bool:
        """The file grows to ``length`` zeros (un-synced, like a write), where the real file
        system did it."""
        with self._lock:
            self._enter("allocate", f"fd {fd} to {length}")
            done = self.base.allocate(fd, length)
            h = self._fds.get(fd)
            if done and h is not None and h.ino in self._files:
                f = self._files[h.ino]
                if length > len(f.data):
                    f.data.extend(bytes(length - len(f.data)))
                f.dirty = True
            return done

    def start_writeback(self, fd: int, offset: int, nbytes: int) -> None:
        """A hint to start writing: one more call a crash can come before, and nothing
        more — data is durable only once ``fsync`` returns, so the model does not change."""
        with self._lock:
            self._enter("start_writeback", f"fd {fd} [{offset}, +{nbytes})")
            if self.sync:
                self.base.start_writeback(fd, offset, nbytes)

    def fsync_all(self, fds: Sequence[int] = (), dirs: Sequence[str] = ()) -> None:
        """The group commit, modelled as its fsyncs one after another, in a fixed order.

        For real they run concurrently and finish in any order, so a crash in the middle
        can leave any subset of them done. Such a state is one a crash *before* the first of
        them can leave too (un-synced data and entries may persist anyway, file by file and
        directory by directory: the random states sample those mixes), and the crash points
        between them add every prefix. Running them in order keeps every run of a scenario
        making the same calls."""
        for fd in fds:
            self.fsync(fd)
        for d in dirs:
            self.fsync_dir(d)

    def mkdir(self, path: str, mode: int = 0o755) -> None:
        with self._lock:
            self._enter("mkdir", path)
            self.base.mkdir(path, mode)
            parent = self._parent(path)
            if parent is not None:
                ino = self._new_ino()
                self._dirs[ino] = _Dir({}, {})
                self._op(f"mkdir {path}", (parent[0], parent[1], ino))

    def rename(self, src: str, dst: str) -> None:
        with self._lock:
            self._enter("rename", f"{src} -> {dst}")
            s_in, d_in = self._parts(src) is not None, self._parts(dst) is not None
            if s_in != d_in:
                raise NotImplementedError("the crash model cannot follow a rename into or out "
                                          f"of {self.world}")
            self.base.rename(src, dst)
            if s_in:
                s, d = self._parent(src), self._parent(dst)
                assert s is not None and d is not None
                ino = self._dirs[s[0]].entries[s[1]]
                self._op(f"rename {src} -> {dst}", (s[0], s[1], None), (d[0], d[1], ino))

    def unlink(self, path: str) -> None:
        with self._lock:
            self._enter("unlink", path)
            self.base.unlink(path)
            parent = self._parent(path)
            if parent is not None:
                self._op(f"unlink {path}", (parent[0], parent[1], None))

    def rmdir(self, path: str) -> None:
        with self._lock:
            self._enter("rmdir", path)
            self.base.rmdir(path)
            parent = self._parent(path)
            if parent is not None:
                self._op(f"rmdir {path}", (parent[0], parent[1], None))

    def listdir(self, path: str) -> list[str]:
        with self._lock:
            self._enter("listdir", path)
            return self.base.listdir(path)

    def lstat(self, path: str) -> os.stat_result:
        with self._lock:
            self._enter("lstat", path)
            return self.base.lstat(path)

    def fstat(self, fd: int) -> os.stat_result:
        with self._lock:
            self._enter("fstat", f"fd {fd}")
            return self.base.fstat(fd)

    def flock(self, fd: int, exclusive: bool = True, blocking: bool = False) -> None:
        with self._lock:
            self._enter("flock", f"fd {fd}")
            self.base.flock(fd, exclusive, blocking)

    # ---- after the crash -------------------------------------------------------------------
    def close_all(self) -> None:
        """Close what the "dead" program left open (a dead process's fds close themselves)."""
        with self._lock:
            for fd in list(self._real_fds):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._real_fds.clear()
            self._fds.clear()
            self.ended = True

    @property
    def pending_ops(self) -> list[str]:
        """The directory operations not yet made durable, in order (for error messages)."""
        return [op.desc for op in self._ops if not op.durable]

    def crash_states(self, *, random_states: int = 4, seed: int = 0) -> list[CrashState]:
        """The states a crash now could leave (see the module docstring); the first is the
        harshest (only what was fsynced, un-synced data lost), the last of the in-order ones
        is what a killed process leaves (everything, data included)."""
        durable = frozenset(i for i, op in enumerate(self._ops) if op.durable)
        pending = [i for i, op in enumerate(self._ops) if not op.durable]
        dirty = sorted(i for i, f in self._files.items() if f.dirty)
        modes = self.data_modes if dirty else ("new",)
        states = []
        for k in range(len(pending) + 1):
            ops = durable | frozenset(pending[:k])
            what = ("the disk kept only what was fsynced" if k == 0 else
                    "the disk kept every directory change (mkdir, rename, unlink)"
                    if k == len(pending) else
                    f"the disk kept the first {k} of the {len(pending)} directory changes "
                    "not yet fsynced, in order")
            states += [CrashState(f"{what}; {DATA_SAID.get(m, m)}", ops, m) for m in modes]
        rng = random.Random(f"{seed}/{self.count}")
        for r in range(random_states if pending or dirty else 0):
            ops = durable | self._per_directory_prefixes(pending, rng)
            data = tuple((i, rng.choice(self.data_modes)) for i in dirty)
            states.append(CrashState(f"each directory kept its own changes up to a point of its "
                                     f"own (draw {r}); file data not fsynced lost, zeroed, cut "
                                     "or kept, file by file", ops, data))
        return states

    def _per_directory_prefixes(self, pending: list[int], rng: random.Random) -> frozenset[int]:
        by_dir: dict[int, list[int]] = {}
        for i in pending:
            for d in self._ops[i].dirs:
                by_dir.setdefault(d, []).append(i)
        cut = {d: rng.randint(0, len(ops)) for d, ops in by_dir.items()}
        while True:  # an op spanning two directories needs both prefixes; keep each in order
            chosen = {i for i in pending
                      if all(by_dir[d].index(i) < cut[d] for d in self._ops[i].dirs)}
            changed = False
            for d, ops in by_dir.items():
                first_out = next((n for n, i in enumerate(ops) if i not in chosen), len(ops))
                if first_out < cut[d]:
                    cut[d], changed = first_out, True
            if not changed:
                return frozenset(chosen)

    def tree(self, state: CrashState | None = None) -> Tree:
        """The directory tree a state leaves (without one: the state on disk right now)."""
        state = state or CrashState("now", frozenset(range(len(self._ops))), "new")
        entries = {ino: dict(d.base) for ino, d in self._dirs.items()}
        for i in sorted(state.ops):
            for dino, name, ino in self._ops[i].changes:
                if ino is None:
                    entries[dino].pop(name, None)
                else:
                    entries[dino][name] = ino
        per_file = dict(state.data) if isinstance(state.data, tuple) else {}
        seen: set[int] = set()

        def walk(ino: int) -> Tree:
            seen.add(ino)
            out: Tree = {}
            for name, child in sorted(entries[ino].items()):
                if child in seen:  # an impossible mix of renames: keep the first name only
                    continue
                if child in self._dirs:
                    out[name] = walk(child)
                else:
                    mode = per_file.get(child, state.data if isinstance(state.data, str)
                                        else "new")
                    out[name] = self._contents(child, mode)
            return out

        return walk(self.root)

    def _contents(self, ino: int, mode: str) -> bytes:
        f = self._files[ino]
        if not f.dirty or mode == "new":
            return bytes(f.data)
        if mode == "old":
            return f.synced
        if mode == "zeros":
            return bytes(len(f.data))
        if mode == "torn":
            return bytes(f.data[: len(f.data) // 2])
        if mode == "holes":
            out = bytearray(f.data)
            old = f.synced
            for a in range(_HOLE, len(out), 2 * _HOLE):
                b = min(a + _HOLE, len(out))
                was = old[a:b]
                out[a:b] = was + bytes(b - a - len(was))
            return bytes(out)
        raise ValueError(f"unknown data mode {mode!r}")

    def materialise(self, state: CrashState, dest: str) -> None:
        """Write the tree ``state`` leaves into the new directory ``dest``."""
        write_tree(self.base, self.tree(state), dest)


# ---------------------------------------------------------------------------------------
# trees
# ---------------------------------------------------------------------------------------
def write_tree(fs: FileSystem, tree: Tree, dest: str) -> None:
    fs.mkdir(dest)
    for name, v in tree.items():
        p = os.path.join(dest, name)
        if isinstance(v, dict):
            write_tree(fs, v, p)
        else:
            fs.write_file(p, [v], fsync=False)


def read_tree(fs: FileSystem, path: str) -> Tree:
    """A real directory as a :data:`Tree` (regular files and directories only)."""
    out: Tree = {}
    for name in sorted(fs.listdir(path)):
        p = os.path.join(path, name)
        st = fs.lstat(p)
        if stat.S_ISDIR(st.st_mode):
            out[name] = read_tree(fs, p)
        elif stat.S_ISREG(st.st_mode):
            out[name] = fs.read_file(p, max_bytes=1 << 40)
        else:
            raise ValueError(f"{p}: not a file or a directory")
    return out


def fingerprint(tree: Tree) -> str:
    """A digest of a tree's names and contents, to check each distinct state only once."""
    h = hashlib.sha256()

    def walk(t: Tree) -> None:
        for name in sorted(t):
            v = t[name]
            if isinstance(v, dict):
                h.update(b"D" + name.encode() + b"\0")
                walk(v)
                h.update(b"U")
            else:
                h.update(b"F" + name.encode() + b"\0" + len(v).to_bytes(8, "little"))
                h.update(v)

    walk(tree)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------
# exploring every crash point of a scenario
# ---------------------------------------------------------------------------------------
@dataclass
class CrashPoint:
    """What a crash before call ``index`` could leave: ``outcomes[i]`` is the checker's answer
    for ``states[i]``."""

    index: int
    call: str  # the call that never happened ("end" after the last one)
    pending: list[str]
    states: list[CrashState]
    outcomes: list[Any]
    checked: int = 0  # states first seen (and checked) at this point


def explore(template: str, scenario: Callable[[FileSystem, str], None],
            check: Callable[[str], Any], *, workdir: str, random_states: int = 4,
            seed: int = 0, points: Sequence[int] | None = None,
            fidelity: bool = True) -> Iterator[CrashPoint]:
    """Crash ``scenario`` before each of its calls, and check every state each crash leaves.

    ``template`` is a directory holding the world before the scenario; for each crash point
    it is copied, ``scenario(fs, world)`` runs on the copy until the crash, and every state
    the crash could leave is materialised and passed to ``check(world_dir)``, whose answer
    (or the ``AssertionError`` it raised, as a string) is recorded. Identical states are
    checked once. ``points`` limits the crash points (default: every call, plus "after the
    end"). With ``fidelity`` each run also checks that the model's "nothing lost" state is
    exactly what the real disk holds, so that the model cannot drift from reality.
    """
    os.makedirs(workdir, exist_ok=True)
    probe = _run(template, scenario, os.path.join(workdir, "probe"), None)
    total = probe.count
    cache: dict[str, Any] = {}
    n = 0
    for k in (range(total + 1) if points is None else points):
        world = os.path.join(workdir, f"point{k}")
        rec = _run(template, scenario, world, k)
        if k >= total and rec.crashed:
            raise RuntimeError(f"the scenario made more calls on a second run ({rec.count}) "
                               f"than on the first ({total}): it must be deterministic")
        if fidelity:
            now = read_tree(FileSystem(), world)
            if now != rec.tree():
                raise AssertionError(f"crash model differs from the disk at crash point {k}")
        states = rec.crash_states(random_states=random_states, seed=seed)
        outcomes = []
        n_before = n
        for st in states:
            tree = rec.tree(st)
            fp = fingerprint(tree)
            if fp not in cache:
                n += 1
                dest = os.path.join(workdir, f"state{n}")
                write_tree(FileSystem(), tree, dest)
                try:
                    cache[fp] = check(dest)
                except AssertionError as e:
                    cache[fp] = AssertionFailure(str(e))
                shutil.rmtree(dest, ignore_errors=True)
            outcomes.append(cache[fp])
        call = "end" if k >= total else " ".join(probe.calls[k]).replace(probe.world, "<world>")
        yield CrashPoint(k, call, rec.pending_ops, states, outcomes, n - n_before)
        shutil.rmtree(world, ignore_errors=True)
    shutil.rmtree(os.path.join(workdir, "probe"), ignore_errors=True)


@dataclass(frozen=True)
class AssertionFailure:
    """A checker's assertion, recorded as an outcome (so that every failure is reported)."""

    message: str


def _run(template: str, scenario: Callable[[FileSystem, str], None], world: str,
         crash_at: int | None) -> CrashRecorder:
    shutil.copytree(template, world, symlinks=True)
    rec = CrashRecorder(world, crash_at=crash_at)
    try:
        scenario(rec, world)
    except BaseException:
        rec.close_all()  # before the dead program's objects are freed and their finalisers run
        if not rec.crashed:
            raise
    finally:
        rec.close_all()
    return rec
