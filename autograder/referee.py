"""The referee: runs a lab's test cells inside the student's kernel so that what the student's
code changed cannot make a test pass, and signs each test that ran to its end.

The grader loads this file (by path, never through ``sys.modules``) in the first cell it runs,
before any student code, and the student's notebook never imports it. Then:

1. ``boot(key_file, nonce)`` reads a per-submission secret key (the grader deletes its file
   right after this first cell, before any student code runs); the key lives on only inside an
   OpenSSL HMAC context held in a closure. What the notebook gets (``__referee__``) is two
   plain functions, ``seal`` and ``test``, with no attribute that signs or holds the key or
   the nonce. A :class:`Referee` (no secret in it) copies the pristine builtins.
2. ``seal(namespace)``, right after the lab's locked setup cell: takes a snapshot of every
   callable of the modules a test relies on (minickpt with its functions' code objects and its
   classes' attributes, labkit, numpy, jax, builtins, os, json, ...) and of the names the setup
   cell defined, and loads a *private* copy of ``minickpt.labkit`` whose functions see the
   pristine builtins. Nothing of it is reachable by name from the notebook.
3. ``test(grade_id, source, mac, report)`` runs one test cell:

   * refuses a test text whose MAC (computed by the grader) does not match: an input
     transformer or hook that rewrote the test gets nothing;
   * puts back everything the snapshot holds (and says what it had to put back);
   * runs the test in a fresh namespace: the student's names, then the sealed setup names on
     top (``check``, ``lab``, ``np`` ... as they were), and a private copy of the builtins, so
     redefining ``check``, patching ``minickpt.labkit.check``, the reference functions or
     ``builtins.isinstance`` changes nothing the test uses;
   * wraps each of the student's functions so that after every call it checks that the
     protected modules are unchanged (apart from ``plugged_in``'s own swaps) and that no trace
     function is installed; a function that tampers while under test fails that test;
   * if the test ran to its end, prints a receipt, as the test cell's last output: the HMAC
     of (nonce, grade id, payload). The grader scores a test cell only when its own output
     ends with a valid receipt for it and holds no error, so suppressing errors
     (``sys.exit``, a patched ``showtraceback``, a kernel that lies about the reply status),
     printing "all tests passed", or a receipt printed before the test then failed earns
     nothing;
   * refuses to start inside another test (student code that calls ``__referee__.test``
     while a test runs gets nothing) and runs each grade id once.

   For a quiz question the grader sends only the visible part (the answer's form) and names
   the answer variables in ``report``: their values go into the receipt as Python literals
   and the hidden check runs in the grader, outside the kernel. Quiz answers never enter the
   student's process.

What it cannot stop: code that digs into the referee itself (frames, ``gc``, closures,
``ctypes``) shares its process and can reach the HMAC context, so it could forge anything; the
grader flags such constructs for a person to review (``autograder/notebook.py``). See
docs/LABS.md, "Grading untrusted code".
"""

from __future__ import annotations

import builtins
import hmac
import importlib.machinery
import importlib.util
import os
import re
import sys
import types
from operator import is_ as _is
from re import fullmatch as re_fullmatch

RECEIPT = "[minickpt-referee]"
PROTECTED = ("builtins", "numpy", "jax", "jax.numpy", "jax.tree_util", "jax.random", "jax.dtypes",
             "jax.sharding", "json", "json.encoder", "json.decoder", "os", "os.path", "posixpath",
             "re", "zlib", "math", "tempfile", "shutil", "contextlib", "functools", "inspect",
             "collections", "collections.abc", "typing", "io", "time", "types", "copy",
             "pathlib", "importlib", "pkgutil", "operator", "itertools", "hmac", "hashlib")
IPYTHON_NAMES = frozenset({"In", "Out", "get_ipython", "exit", "quit", "__referee__"})
PER_EXECUTION = {"builtins": {"input", "raw_input", "getpass"}, "getpass": {"getpass"},
                 "sys": {"excepthook"}}
"""Attributes the kernel itself swaps around every execution (ipykernel's stdin forwarding)."""


def _internal(name: str) -> bool:
    """IPython's own names in the user namespace (``_``, ``_i3``, ``_oh`` ...) and dunders."""
    return name in IPYTHON_NAMES or (name.startswith("__") and name.endswith("__")) or \
        re_fullmatch(r"_+|_i+|_i?\d+|_(ih|oh|dh)", name) is not None
MAX_ANSWER = 200_000  # characters of one reported value (a quiz answer, a grader check's input)
MAX_CELL_OUTPUT = 8 << 20
"""Characters a cell may print through ``sys.stdout``/``sys.stderr``; then ``print`` raises.
A flood stops where it starts, the same way on every run (the grader also bounds what
reaches it, for code that writes around these streams)."""
_MISSING = object()
_IMMUTABLE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE: a C type, whose attributes cannot be set
_dict_get = dict.get
_proxy_get = type(vars(type)).get


def _method_like(value: object) -> bool:
    """What a patch of a class replaces: methods and descriptors (data such as a counter or
    ``__slotnames__`` changes for innocent reasons)."""
    return callable(value) or isinstance(value, (property, staticmethod, classmethod))


def _protected(value: object) -> bool:
    """Callables, classes and modules are what a patch replaces; data (a lazily set cache,
    ``tempfile.tempdir``) changes for innocent reasons and is left alone."""
    return callable(value) or isinstance(value, types.ModuleType)


class TamperedError(AssertionError):
    """The student's code changed what the test relies on while the test ran."""


class OutputLimitExceeded(RuntimeError):
    """A cell printed more than :data:`MAX_CELL_OUTPUT` characters."""


class _Capped:
    """A kernel output stream that refuses to print more than the limit in one cell."""

    def __init__(self, stream: object, count: list[int]) -> None:
        self._stream, self._count = stream, count

    def write(self, text: str) -> int:
        self._count[0] += len(text) if type(text) is str else 0
        if self._count[0] > MAX_CELL_OUTPUT:
            raise OutputLimitExceeded(f"this cell printed more than {MAX_CELL_OUTPUT >> 20} MiB; "
                                      "the rest is not printed")
        return self._stream.write(text)

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


def boot(key_file: str, nonce: str, shell: object = None) -> types.SimpleNamespace:
    """The referee as the notebook holds it (``__referee__``): two plain functions, ``seal``
    and ``test``, and no attribute that holds state. The key, the nonce and the signing live
    only in this closure: student code that reaches ``__referee__`` by ordinary means (its
    name, ``sys.modules["__main__"]``) finds nothing to sign with; getting further takes
    ``__closure__``, frames, ``gc`` or ``ctypes``, which the grader's scan flags."""
    with open(key_file, "rb") as f:
        key = f.read()
    try:  # the grader deletes it after this cell in any case
        os.unlink(key_file)
    except OSError:
        pass
    context = hmac.new(key, digestmod="sha256")
    del key
    context = getattr(context, "_hmac", None) or context   # OpenSSL's context: C methods only
    compare, text_of, nonce = hmac.compare_digest, str, str(nonce)
    referee = Referee(shell)
    sys.addaudithook(referee._audit)  # before any student code: theirs are refused from now on
    write = referee._builtins["print"]
    ran: set[str] = set()
    running = [False]

    def sign(text: str) -> str:
        mac = context.copy()
        mac.update(text.encode("utf-8"))
        return mac.hexdigest()

    def unseal(grade_id: str, sealed: str) -> str:
        """The test's text from what the cell holds: XOR with an HMAC-SHA256 keystream (the
        key never leaves the closure), so the kernel's input history (``In``, ``_ih``,
        ``_i<n>``, the history database), input transformers and ``pre_run_cell`` hooks only
        ever see ciphertext."""
        try:
            data = bytes.fromhex(text_of(sealed))
        except ValueError:
            raise TamperedError(f"the text of test {grade_id} is not readable: the test is "
                                "not run") from None
        stream = bytearray()
        for block in range((len(data) + 31) // 32):
            stream += bytes.fromhex(sign(f"{nonce}|text|{grade_id}|{block}"))
        try:
            return bytes(a ^ b for a, b in zip(data, stream, strict=False)).decode("utf-8")
        except UnicodeDecodeError:
            raise TamperedError(f"the text of test {grade_id} was changed before it ran: the "
                                "test is not run") from None

    def attempt(grade_id: str, sealed: str, mac: str, report: tuple) -> BaseException | None:
        """Run one test cell; print its receipt, last, if it ran to the end. Refused inside
        another test (student code calling it gets nothing) and for a grade id that ran.
        Returns what failed it, bare (:func:`_bare`), for :func:`test` to raise: every frame
        that held the test's text or the referee's locals is cleared first."""
        if running[0]:
            return _bare(TamperedError("a test cannot be started from inside another test"))
        grade_id = text_of(grade_id)
        try:
            source = unseal(grade_id, sealed)
        except TamperedError as e:
            return _bare(e)
        if not compare(sign(f"{nonce}|test|{grade_id}|{report!r}|{source}"), text_of(mac)):
            return _bare(TamperedError(f"the text of test {grade_id} was changed before it ran "
                                       "(an input transformer or a hook?): the test is not run"))
        if grade_id in ran:
            return _bare(TamperedError(f"test {grade_id} already ran once: it is not run again"))
        ran.add(grade_id)
        running[0] = True
        restored: list[str] = []
        try:
            restored = referee.repair()
            payload = referee.run(grade_id, source, report, restored)
        except BaseException as e:
            seen = restored + [f"watch: {w}" for w in referee.reached]
            if seen:  # the test fails, but what was put back before it (or what the
                note = repr(seen)  # student's code reached) is for review
                write(f"\n{RECEIPT} {grade_id} {sign(f'{nonce}|restored|{grade_id}|{note}')} "
                      f"{note}", flush=True)
            return _bare(e)
        finally:
            running[0] = False
            del source
        write(f"\n{RECEIPT} {grade_id} {sign(f'{nonce}|pass|{grade_id}|{payload}')} {payload}",
              flush=True)
        return None

    def test(grade_id: str, sealed: str, mac: str, report: tuple = ()) -> None:
        """Run one test cell (:func:`attempt`). What failed it is raised from here, outside
        any handler: its traceback holds this frame (no text of the test, no key, nothing
        but ``attempt``) and the cell's, never the referee's or the test's frames, and the
        kernel forgets even that after the cell (:meth:`Referee.forget`)."""
        failure = attempt(grade_id, sealed, mac, report)
        if failure is not None:
            raise failure

    def seal(namespace: dict) -> None:
        """Snapshot the protected modules and the setup cell's names (once)."""
        referee.seal(namespace)

    return types.SimpleNamespace(seal=seal, test=test)


class Referee:
    """What restores and checks (see the module doc); it holds no secret: signing is
    :func:`boot`'s."""

    def __init__(self, shell: object = None) -> None:
        self._builtins = dict(vars(builtins))          # pristine: no student code ran yet
        self._sealed = False
        # what the referee itself calls, taken before any student code can replace it
        self._sys = sys
        import linecache

        self._linecache = linecache
        self._settrace, self._setprofile = sys.settrace, sys.setprofile
        self._gettrace, self._getprofile = sys.gettrace, sys.getprofile
        self._FunctionType = types.FunctionType
        self._compile, self._exec = compile, exec
        self._waitpid, self._WNOHANG = os.waitpid, os.WNOHANG
        self._ModuleType, self._is, self._all, self._map = types.ModuleType, _is, all, map
        self._setattr, self._delattr, self._getattr = setattr, delattr, getattr
        self._audited: dict = {}        # (id, name) -> (object, name, value before the change)
        self._quiet = False             # the referee's own repairs are not tampering
        self._hooks_refused = 0
        self._failures: list = []       # every check that failed in the running test
        self._watched: dict = {}        # id -> every function and module at the seal
        self._watch = None              # the running test's watch (labkit.watch.Watch)
        self._watch_profile = None
        self.reached: list[str] = []    # what the running test's watch saw
        count = [0]
        sys.stdout, sys.stderr = _Capped(sys.stdout, count), _Capped(sys.stderr, count)
        self._shell = shell
        if shell is not None:  # a fresh count for every cell
            shell.events.register("pre_run_cell", lambda *a: count.__setitem__(0, 0))
            shell.events.register("post_run_cell", self.forget)  # first: before any of theirs

    def forget(self, result: object = None) -> None:
        """After every cell: the kernel keeps no exception with a traceback, no frame of it
        and no text of it: ``sys.last_*``, the cell's result (its exception stays, bare: the
        kernel's reply still says the cell failed), IPython's formatter's ``tb``, its history
        of exceptions, and a ``linecache`` entry of a test's file name. A failed test's own
        frames were cleared already (:func:`_bare`); this is for what IPython kept."""
        sys_, shell, getattr_ = self._sys, self._shell, self._getattr
        for name in LAST:
            value = getattr_(sys_, name, None)
            if isinstance(value, BaseException):
                _bare(value, chain=False)
            elif isinstance(value, types.TracebackType):
                _clear(value)
            try:
                self._delattr(sys_, name)
            except AttributeError:
                pass
        for holder in (result, getattr_(shell, "last_execution_result", None)):
            for name in ("error_in_exec", "error_before_exec"):
                _bare(getattr_(holder, name, None), chain=False)
        for name in ("InteractiveTB", "SyntaxTB"):
            formatter = getattr_(shell, name, None)
            if getattr_(formatter, "tb", None) is not None:
                try:
                    formatter.tb = None
                except AttributeError:
                    pass
        history = getattr_(getattr_(shell, "history_manager", None), "exceptions", None)
        if isinstance(history, dict):
            history.clear()
        cache = getattr_(self._linecache, "cache", None)
        if isinstance(cache, dict):
            for k in [k for k in list(cache) if isinstance(k, str) and TEST_FILE.match(k)]:
                cache.pop(k, None)

    def _audit(self, event: str, args: tuple) -> None:
        """The process's audit hook, installed before any student code: refuses every later
        audit hook (one would see each test's text as it is compiled), and records every
        change of a function's code or defaults and of a module's class made after the seal
        by anything but the referee (the student's own functions aside), with the value
        before it, so that it can be put back and the test it happened in fails."""
        if event == "sys.addaudithook":
            self._hooks_refused += 1
            raise RuntimeError("the grader allows no audit hooks")
        if (event == "sys.setprofile" or event == "sys.settrace") and self._watch is not None \
                and self._watch.audit(event, args) is not None:
            raise RuntimeError("the grader's watch allows no profile or trace function while "
                               "your code runs under test")
        if (event != "object.__setattr__" and event != "object.__delattr__") or self._quiet \
                or not self._sealed or len(args) < 2:
            return
        obj, name = args[0], args[1]
        if self._watched.get(id(obj)) is not obj:  # made after the seal (a namedtuple's
            return                                  # __new__), or the student's own
        key = (id(obj), name)
        if key not in self._audited:
            self._audited[key] = (obj, name, self._getattr(obj, name, _MISSING))

    # -----------------------------------------------------------------------------------
    # the seal
    # -----------------------------------------------------------------------------------
    def seal(self, namespace: dict) -> None:
        """Snapshot the protected modules and the setup cell's names (once)."""
        if self._sealed:
            raise RuntimeError("the referee is sealed already")
        self._ns = namespace
        self._main = sys.modules.get("__main__")
        import gc  # every function and module there is now (held, so no id is reused)

        self._watched = {id(o): o for o in gc.get_objects()
                         if (type(o) is types.FunctionType and o.__globals__ is not namespace)
                         or (isinstance(o, types.ModuleType) and o is not self._main)}
        self._watched.update((id(m), m) for m in list(sys.modules.values())
                             if isinstance(m, types.ModuleType) and m is not self._main)
        names = {n for n in sys.modules if n == "minickpt" or n.startswith("minickpt.")} \
            | {n for n in PROTECTED if n in sys.modules}
        # every module and every class reachable from one (the standard library's included:
        # a test's helpers run through contextlib, tempfile, numpy ... and whatever they call),
        # as (name, object, its dict, names, values): compared at C speed after every call
        self._modules = []
        self._functions = []
        self._classes = []
        classes: dict[int, type] = {}
        for name, mod in sorted(sys.modules.items(), key=lambda kv: (kv[0] not in names, kv[0])):
            if not isinstance(mod, types.ModuleType) or mod is self._main or name == "__main__":
                continue
            skip = PER_EXECUTION.get(name, ())
            items = {k: v for k, v in vars(mod).items() if _protected(v) and k not in skip}
            self._modules.append((name if name in names else None, mod, vars(mod),
                                  tuple(items), tuple(items.values())))
            for v in items.values():
                if isinstance(v, type):
                    for base in v.__mro__:
                        classes.setdefault(id(base), base)
            if name == "minickpt" or name.startswith("minickpt."):
                for v in items.values():
                    if isinstance(v, types.FunctionType) and v.__module__ == name:
                        self._functions.append((v, v.__code__, v.__defaults__, v.__kwdefaults__))
        for cls in classes.values():
            home = getattr(sys.modules.get(str(cls.__module__)), "__file__", None) or ""
            if cls.__flags__ & _IMMUTABLE or cls.__module__ == "__main__" or \
                    not home.endswith(".py"):
                continue  # a C type cannot be patched, an extension's types are its own
                          # (jaxlib adds methods lazily); the student's classes are theirs
            d = vars(cls)
            attrs = {k: a for k, a in d.items() if _method_like(a)}
            self._classes.append((cls, d, tuple(attrs), tuple(attrs.values()), len(d)))
        # the same, flat, for one pass at C speed: after every call of a student's function
        # the named modules (but minickpt's, where plugged_in swaps functions in: compared
        # one by one) and the classes of the named modules (contextlib's context managers,
        # tempfile's, minickpt's ...); before and after every test, everything
        self._swapped = [m for m in self._modules if m[0] is not None
                         and (m[0] == "minickpt" or m[0].startswith("minickpt."))]
        named = [m for m in self._modules if m[0] is not None and m not in self._swapped]
        rest = [m for m in self._modules if m[0] is None]
        self._named_mods = tuple((m[0], m[1]) for m in self._modules if m[0] is not None)
        hot = [c for c in self._classes if str(c[0].__module__) in names]
        self._hot = (self._flat(named), self._flat([c[1:4] for c in hot], first=0),
                     tuple(c[1] for c in hot), [c[4] for c in hot])
        self._cold = (self._flat(rest), self._flat([c[1:4] for c in self._classes], first=0),
                      tuple(c[1] for c in self._classes), [c[4] for c in self._classes])
        self._hot_modules, self._hot_classes = self._swapped + named, hot
        self._sys_hooks = {k: getattr(sys, k) for k in
                           ("stdout", "stderr", "stdin", "displayhook")}
        self._meta_path, self._path_hooks = list(sys.meta_path), list(sys.path_hooks)
        self._reference_ids = {id(f) for f, *_ in self._functions}
        self._labkit = self._fresh_labkit()
        self._refs = dict(self._labkit.reference_functions())
        self._task_names = {f.__name__ for fns in self._refs.values() for f in fns}
        real = sys.modules.get("minickpt.labkit")
        sealed = {}
        for k, v in namespace.items():
            if _internal(k):
                continue
            if v is real:
                v = self._labkit
            elif real is not None and getattr(real, getattr(v, "__name__", ""), _MISSING) is v \
                    and hasattr(self._labkit, v.__name__):
                v = getattr(self._labkit, v.__name__)
            sealed[k] = v
        self._setup_names = sealed
        self._sealed = True

    @staticmethod
    def _flat(entries: list, first: int = 2) -> tuple[tuple, tuple, tuple]:
        """(dicts, names, values), one item per snapshotted attribute."""
        ds, ks, vs = [], [], []
        for e in entries:
            d, keys, values = e[first:first + 3]
            ds += [d] * len(keys)
            ks += keys
            vs += values
        return tuple(ds), tuple(ks), tuple(vs)

    def _unchanged(self, part: tuple) -> bool:
        """Nothing in ``part`` (``_hot`` or ``_cold``) changed: one pass at C speed."""
        (mds, mks, mvs), (cds, cks, cvs), dicts, sizes = part
        map_, is_ = self._map, self._is
        return self._all(map_(is_, map_(_dict_get, mds, mks), mvs)) and \
            list(map_(len, dicts)) == sizes and \
            self._all(map_(is_, map_(_proxy_get, cds, cks), cvs))

    def _fresh_labkit(self) -> types.ModuleType:
        """A private copy of the package minickpt.labkit, every module of it: not in
        sys.modules, its functions bound to the pristine builtins, its reference functions
        found now, before any student code."""
        real = sys.modules.get("minickpt.labkit")
        if real is None:
            import minickpt.labkit as real
        name = f"minickpt._referee_labkit_{id(self):x}"  # under minickpt: its `..` imports work
        finder = _PrivateFinder(name, list(real.__path__), self._builtins)
        spec = importlib.util.spec_from_file_location(
            name, real.__file__, loader=_PrivateLoader(name, real.__file__, self._builtins),
            submodule_search_locations=list(real.__path__))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        sys.meta_path.insert(0, finder)
        try:
            spec.loader.exec_module(mod)
        finally:
            sys.meta_path.remove(finder)
            copies = [k for k in sys.modules if k == name or k.startswith(name + ".")]
            parts = [sys.modules.pop(k) for k in copies]
        mod.reference_functions()
        failures, base = self._failures, mod.LabCheckError

        class LabCheckError(base):  # type: ignore[misc,valid-type]
            """A check that failed: recorded, so that swallowing it changes nothing."""

            def __init__(self, *args: object) -> None:
                failures.append(str(args[0]) if args else "a check failed")
                super().__init__(*args)

        LabCheckError.__qualname__ = LabCheckError.__name__ = base.__name__
        for part in parts:  # what the copy's checks raise (a global lookup in each module)
            if getattr(part, "LabCheckError", None) is base:
                part.LabCheckError = LabCheckError
        return mod

    # -----------------------------------------------------------------------------------
    # restoring and checking
    # -----------------------------------------------------------------------------------
    def _changes(self, allowed: frozenset[int] = frozenset(), fix: bool = False,
                 full: bool = True) -> list[str]:
        """What differs from the snapshot (names for a person); with ``fix``, put it back.
        ``full=False`` (after each call of a student's function, which must be quick): the
        named modules, the hot classes and what the audit hook saw, not the rest."""
        changed = []
        modules, is_, all_, map_ = self._sys.modules, self._is, self._all, self._map
        for name, mod in self._named_mods:
            if modules.get(name) is not mod:
                changed.append(f"sys.modules[{name!r}]")
                if fix:
                    modules[name] = mod
        hot = self._unchanged(self._hot)
        cold = not full or self._unchanged(self._cold)
        check = self._swapped if hot else self._hot_modules
        check = check if cold else self._modules
        for _name, mod, d, keys, values in check:
            if all_(map_(is_, map_(d.get, keys), values)):
                continue
            for k, v in zip(keys, values, strict=True):
                now = d.get(k, _MISSING)
                if now is not v and id(now) not in allowed:
                    changed.append(f"{getattr(mod, '__name__', '?')}.{k}")
                    if fix:
                        d[k] = v
        for f, code, defaults, kwdefaults in self._functions if full else ():  # (and audited)
            if f.__code__ is not code or f.__defaults__ is not defaults \
                    or f.__kwdefaults__ is not kwdefaults:
                changed.append(f"{f.__module__}.{f.__qualname__}.__code__")
                if fix:
                    self._quiet = True
                    try:
                        f.__code__, f.__defaults__, f.__kwdefaults__ = code, defaults, kwdefaults
                    finally:
                        self._quiet = False
        for cls, d, keys, values, size in ((() if hot else self._hot_classes) if cold
                                           else self._classes):
            if len(d) == size and all_(map_(is_, map_(d.get, keys), values)):
                continue
            where = f"{cls.__module__}.{cls.__qualname__}"
            bad = [(k, v) for k, v in zip(keys, values, strict=True) if d.get(k, _MISSING) is not v]
            added = [k for k, a in list(d.items()) if k not in keys and _method_like(a)]
            changed += [f"{where}.{k}" for k, _ in bad] + [f"{where}.{k}" for k in added]
            if fix:
                for k, v in bad:
                    try:
                        self._setattr(cls, k, v)
                    except (AttributeError, TypeError):
                        pass
                for k in added:
                    try:
                        self._delattr(cls, k)
                    except (AttributeError, TypeError):
                        pass
        if self._audited:
            for obj, name, before in list(self._audited.values()):
                changed.append(f"{getattr(obj, '__qualname__', None) or getattr(obj, '__name__', '?')}"
                               f".{name}")
                if fix:
                    self._quiet = True
                    try:
                        if before is _MISSING:
                            self._delattr(obj, name)
                        else:
                            self._setattr(obj, name, before)
                    except (AttributeError, TypeError, ValueError):
                        pass
                    finally:
                        self._quiet = False
            if fix:
                self._audited.clear()
        for k, v in self._sys_hooks.items():
            if getattr(self._sys, k) is not v:
                changed.append(f"sys.{k}")
                if fix:
                    setattr(self._sys, k, v)
        for hooks, snap in ((self._sys.meta_path, self._meta_path),
                            (self._sys.path_hooks, self._path_hooks)):
            # libraries add finders (absl does); one put first, or ours removed, is a patch
            if not _in_order(hooks, snap):
                changed.append("sys.meta_path" if hooks is self._sys.meta_path
                               else "sys.path_hooks")
                if fix:
                    hooks[:] = snap + [h for h in hooks if not any(h is s for s in snap)]
        profile = self._getprofile()
        if self._gettrace() is not None or (profile is not None
                                            and profile is not self._watch_profile):
            changed.append("sys.settrace/setprofile")
            if fix:
                self._settrace(None)
                self._setprofile(None)
        if self._hooks_refused:
            changed.append("sys.addaudithook (refused)")
            if fix:
                self._hooks_refused = 0
        return changed

    def _wrap(self, fn, allowed: set[int], calls: list[str], watch=None):
        """The student's function, checked after every call: a call that changes a protected
        module (other than plugged_in's swaps, which are these wrappers) fails the test; and
        run under the test's ``watch``, which sees the task's reference run inside it."""
        referee = self
        inner = fn if watch is None else watch.wrap(fn)

        def checked(*args, **kwargs):
            try:
                return inner(*args, **kwargs)
            finally:
                changed = referee._changes(frozenset(allowed), fix=True, full=False)
                if changed:
                    calls.append(fn.__name__)
                    raise TamperedError(
                        f"{fn.__name__} changed {', '.join(sorted(set(changed))[:6])} while the "
                        "test ran; a test cannot trust what it sees after that, so it fails")

        for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
            try:
                setattr(checked, attr, getattr(fn, attr))
            except (AttributeError, TypeError):
                pass
        checked.__wrapped__ = fn
        allowed.add(id(checked))
        return checked

    def _reap_children(self) -> None:
        """Collect children that have ended (the grader kills what a cell leaves running):
        a zombie still counts against the process limit."""
        while True:
            try:
                pid, _ = self._waitpid(-1, self._WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return

    # -----------------------------------------------------------------------------------
    # one test
    # -----------------------------------------------------------------------------------
    def repair(self) -> list[str]:
        """Put back everything the snapshot holds; what had to be put back, sorted (reported
        in the test's receipt, passed or failed: a person reviews it either way)."""
        if not self._sealed:
            raise RuntimeError("the referee was not sealed: the setup cell did not run")
        return sorted(set(self._changes(fix=True)))

    def run(self, grade_id: str, source: str, report: tuple, restored: list[str]) -> str:
        """Run one test (its text already checked by :func:`boot`, the snapshot put back by
        :meth:`repair`, whose answer is ``restored``); the payload to sign."""
        if not self._sealed:
            raise RuntimeError("the referee was not sealed: the setup cell did not run")
        self._reap_children()
        allowed: set[int] = set()
        calls: list[str] = []
        # the task under test: its reference functions must not run inside the student's code
        # (in this kernel: the watch; in a worker the labkit starts: the private copy's
        # watch module, told the task, reports into REACHED)
        found = re_fullmatch(r"test_(\d+)_(\d+)(_.*)?", grade_id)
        task = f"{found.group(1)}.{found.group(2)}" if found else None
        kit = self._labkit.watch
        kit.CURRENT[0] = task
        del kit.REACHED[:]
        watch = kit.Watch({task: self._refs[task]} if task in self._refs else {})
        self._watch, self._watch_profile, self.reached = watch, watch.profile, []
        ns = {}
        for k, v in self._ns.items():
            if _internal(k):
                continue
            if k not in self._setup_names and callable(v) and \
                    not isinstance(v, self._ModuleType) and \
                    (not isinstance(v, type) or k in self._task_names):
                v = self._wrap(v, allowed, calls, watch)  # a reference bound to a task's
            ns[k] = v                                     # name too: the watch sees it run
        ns.update(self._setup_names)
        ns["__builtins__"] = self._builtins
        ns["__name__"] = "__main__"
        code = self._compile(source, f"<{grade_id}>", "exec")
        del self._failures[:]
        try:
            self._exec(code, ns)
        finally:
            self.reached = list(dict.fromkeys(watch.hits + list(kit.REACHED)))
            kit.CURRENT[0] = None
            self._watch = None
        if self.reached:
            raise TamperedError(f"while your code ran it {self.reached[0]}: minickpt's own "
                                f"implementation of task {task} must not run inside yours, "
                                "so this test does not count")
        after = self._changes(fix=True)
        if after:
            raise TamperedError(f"the test left {', '.join(sorted(set(after))[:6])} changed: "
                                "something the student's code started kept tampering")
        if self._failures:  # a check failed, and something made the test go on regardless
            raise TamperedError(f"{self._failures[0]} (this check failed, and the failure was "
                                "swallowed: the test does not count)")
        answers = {}
        for name in report:
            answers[name] = _literal(ns.get(name, _MISSING))
        return repr({"answers": answers, "restored": restored})


_get_tb, _set_tb = BaseException.__traceback__.__get__, BaseException.__traceback__.__set__
_get_context, _get_cause = BaseException.__context__.__get__, BaseException.__cause__.__get__
_set_context, _set_cause = BaseException.__context__.__set__, BaseException.__cause__.__set__
LAST = ("last_type", "last_value", "last_traceback", "last_exc")
"""Where Python and IPython keep the last exception of a cell (``last_exc``: 3.12)."""
TEST_FILE = re.compile(r"<test_[^>]*>")
"""The file name a test's text is compiled under (:meth:`Referee.run`)."""


def _clear(tb: object) -> None:
    """Release the locals of every finished frame of a traceback (the test's text, its
    namespace, the referee's state): ``traceback.clear_frames``, without importing it."""
    while isinstance(tb, types.TracebackType):
        try:
            tb.tb_frame.clear()
        except RuntimeError:  # a frame that still runs (the caller's)
            pass
        tb = tb.tb_next


def _bare(e: BaseException | None, chain: bool = True) -> BaseException | None:
    """``e`` without what it carried of the frames it passed through: every frame of its
    traceback (and of the exceptions it chains) cleared, and none of them attached. Read and
    written through ``BaseException``'s own descriptors: an exception class of the student's
    that overrides ``__traceback__`` runs none of its code here. Without ``chain`` its own
    ``__context__``/``__cause__`` stay (the student's exception, for their own reading)."""
    seen: set[int] = set()
    todo = [e]
    while todo:
        x = todo.pop()
        if not isinstance(x, BaseException) or id(x) in seen or len(seen) > 100:
            continue
        seen.add(id(x))
        _clear(_get_tb(x))
        _set_tb(x, None)
        todo += [_get_context(x), _get_cause(x)]
    if chain and isinstance(e, BaseException):
        _set_context(e, None)
        _set_cause(e, None)
    return e


def _in_order(now: list, snap: list) -> bool:
    """``snap``'s items are all in ``now``, in order, and ``now`` starts with ``snap[0]``
    (compared by identity: a student's object never gets to run its ``__eq__``)."""
    if snap and (not now or now[0] is not snap[0]):
        return False
    it = iter(now)
    return all(any(x is y for y in it) for x in snap)


def _literal(value: object, depth: int = 0) -> tuple:
    """A quiz answer as a tagged tree of plain literals (``ast.literal_eval`` reads it back in
    the grader; see ``autograder.notebook.decode_answer``). Exact types only: a ``str``
    subclass with a lying ``__eq__`` is not a str; anything else is ``("unreadable", type)``."""
    t = type(value)
    if value is _MISSING:
        return ("undefined", None)
    if depth > 6:
        return ("unreadable", "nested too deep")
    if t is int and not -10**100 < value < 10**100:
        out: tuple = ("unreadable", "an int of more than 100 digits")
    elif t is str and len(value) > MAX_ANSWER:
        out = ("unreadable", "a str too long to be an answer")
    elif t in (bool, int, str, type(None)):
        out = (t.__name__, value)
    elif t is float:
        out = ("float", repr(value))
    elif t in (list, tuple, set, frozenset, dict) and len(value) > 1000:
        out = ("unreadable", f"a {t.__name__} of {len(value)} items")
    elif t in (list, tuple, set, frozenset):
        out = (t.__name__, [_literal(v, depth + 1) for v in value])
        if t in (set, frozenset):
            out = (t.__name__, sorted(out[1], key=repr))
    elif t is dict:
        out = ("dict", [(_literal(k, depth + 1), _literal(v, depth + 1)) for k, v in value.items()])
    else:
        out = ("unreadable", t.__name__)
    if len(repr(out)) > MAX_ANSWER:
        return ("unreadable", "too large")
    return out


class _PrivateLoader(importlib.machinery.SourceFileLoader):
    """Runs a module of the private labkit copy with the pristine builtins."""

    def __init__(self, name: str, path: str, pristine: object):
        super().__init__(name, path)
        self._pristine = pristine

    def exec_module(self, module: types.ModuleType) -> None:
        module.__dict__["__builtins__"] = self._pristine
        super().exec_module(module)


class _PrivateFinder:
    """Finds the submodules of the private labkit copy (and nothing else), while it loads."""

    def __init__(self, name: str, path: list[str], pristine: object):
        self._name, self._path, self._pristine = name, path, pristine

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> object:
        if not fullname.startswith(self._name + "."):
            return None
        file = os.path.join(self._path[0], fullname.rsplit(".", 1)[1] + ".py")
        if not os.path.isfile(file):
            return None
        return importlib.util.spec_from_file_location(
            fullname, file, loader=_PrivateLoader(fullname, file, self._pristine))
