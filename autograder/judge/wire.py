"""The wire between the judge and the student's worker: plain data by value, everything else
by handle, over one ``multiprocessing.connection`` (``send_bytes``/``recv_bytes`` only: nothing
is ever unpickled) carrying msgpack.

This file runs on both sides. The worker gets its text over the connection (it is public
code), so the sandbox needs no copy of ``autograder/``; it imports only the standard library,
msgpack and numpy at the top, JAX when an array of it crosses.

* **Values**: None, bools, ints, floats, strings, bytes; lists, tuples, dicts, sets; numpy
  arrays and scalars (any dtype but object); JAX arrays and typed PRNG keys; named tuples and
  dataclasses (flax's struct nodes, optax's states, minickpt's records) of classes from the
  modules in :data:`CLASS_MODULES`; exceptions of such classes (``OSError`` with its errno).
* **Handles**: any other object stays where it is; the other side gets a :class:`Remote`
  whose calls, attribute reads and (where allowed) writes travel back. What a side may do
  with the other's objects is its :class:`Policy`.
* **Identity**: an object that comes back to the side it came from is that side's own object
  again (``a is b`` holds across the wire), and an array argument the callee changed in place
  is changed in place at the caller's too.
* **Threads**: a call made while serving a call runs on the thread that waits for it (so a
  callback sees the locks its caller holds, as in one process); other requests get a thread.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

CLASS_MODULES = ("builtins", "collections", "minickpt", "flax", "optax", "jax", "jaxlib",
                 "numpy", "ml_dtypes", "errno", "concurrent", "__judge_test__")
"""A named tuple, dataclass or exception crosses by value only if its class lives in one of
these modules (or below): the receiver imports the class by name, never code from the wire.
``__judge_test__`` is the judge's test namespace: its classes are recreated by name in the
worker as plain subclasses of their nearest importable base."""

MAX_MESSAGE = 512 << 20


class WireError(RuntimeError):
    """The other side broke the protocol, went away, or asked for what it may not have."""


class RemoteTimeout(TimeoutError):
    """The other side did not answer in time."""


# ------------------------------------------------------------------------------------------
# classes by name
# ------------------------------------------------------------------------------------------
def class_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _allowed_module(mod: str) -> bool:
    return any(mod == m or mod.startswith(m + ".") for m in CLASS_MODULES)


def load_class(name: str) -> type | None:
    """The class called ``name`` (``module:qualname``) from an allowed module, else None."""
    mod, _, qual = name.partition(":")
    if not _allowed_module(mod) or not qual or "<" in qual:
        return None
    try:
        obj: Any = importlib.import_module(mod)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError):
        return None
    return obj if isinstance(obj, type) else None


def _nameable(cls: type) -> bool:
    return "<" not in cls.__qualname__ and _allowed_module(cls.__module__) and \
        load_class(class_name(cls)) is cls


# ------------------------------------------------------------------------------------------
# what a side lets the other do with its objects
# ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Policy:
    """What the other side may do with this side's objects. ``private`` lets it read and call
    underscore names (never dunders); ``setattr`` lets it write attributes; ``serve`` decides
    which objects may be handed out at all (an object refused there is an error, not a
    handle); ``check`` sees every call's arguments first (e.g. to keep paths in a folder)."""

    private: bool = False
    setattr: bool = False
    serve: Callable[[Any], bool] = lambda obj: True
    check: Callable[[Any, str, tuple, dict], None] = lambda obj, name, args, kwargs: None


def _forbidden_type(obj: Any) -> bool:
    import types

    return isinstance(obj, (type, types.ModuleType, types.FunctionType, types.CodeType,
                            types.FrameType, types.BuiltinFunctionType, types.TracebackType,
                            types.GeneratorType, types.CoroutineType, types.CellType))


# ------------------------------------------------------------------------------------------
# the connection
# ------------------------------------------------------------------------------------------
class Remote:
    """An object of the other side. Calls, attribute reads and writes go over the wire."""

    __slots__ = ("__weakref__", "_ep", "_rid")

    def __init__(self, ep: Endpoint, rid: int) -> None:
        object.__setattr__(self, "_ep", ep)
        object.__setattr__(self, "_rid", rid)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._ep.request("call", self._rid, None, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self._ep.request("getattr", self._rid, name, (), {})

    def __setattr__(self, name: str, value: Any) -> None:
        self._ep.request("setattr", self._rid, name, (value,), {})

    def __enter__(self) -> Any:
        return self._ep.request("call", self._rid, "__enter__", (), {})

    def __exit__(self, *exc: Any) -> Any:
        return self._ep.request("call", self._rid, "__exit__", (None, None, None), {})

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"<remote {self._ep.describe(self._rid)}>"


class Endpoint:
    """One side of the wire. ``policy`` governs what the other side may do with this side's
    objects; ``timeout`` bounds every wait for an answer (None: no bound)."""

    def __init__(self, conn: Any, name: str, policy: Policy | None = None,
                 timeout: float | None = None) -> None:
        self.conn, self.name = conn, name
        self.policy = policy or Policy()
        self.timeout = timeout
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._chains = itertools.count(1)
        self._exported: dict[int, Any] = {}      # my objects the other side holds: rid -> obj
        self._export_ids: dict[int, int] = {}    # id(obj) -> rid
        self._imported: dict[int, tuple[int, Any]] = {}  # id(obj) of a value I decoded -> (its id there, obj)
        self._remotes: dict[int, Remote] = {}    # rid there -> Remote (one per object)
        self._waiting: dict[int, queue.Queue] = {}       # request id -> the waiter's queue
        self._chain_q: dict[str, list[queue.Queue]] = {}  # chain -> waiters in it (innermost last)
        self._local = threading.local()
        self._closed: str | None = None
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"wire-{name}")

    def start(self) -> Endpoint:
        self._reader.start()
        return self

    # ---------- encoding -----------------------------------------------------------------
    def encode(self, obj: Any, memo: dict[int, Any] | None = None) -> Any:
        memo = {} if memo is None else memo
        back = self._imported.get(id(obj))
        if back is not None and back[1] is obj:
            ref: dict[str, Any] = {"$": "back", "id": back[0]}
            if isinstance(obj, np.ndarray):
                ref["nd"] = _nd_enc(obj)
            return ref
        if obj is None or isinstance(obj, (bool, str, bytes)):
            return obj
        if isinstance(obj, int) and type(obj) is int:
            return obj if -(2**63) <= obj < 2**64 else {"$": "bigint", "v": str(obj)}
        if type(obj) is float:
            return obj
        if isinstance(obj, Remote) and obj._ep is self:
            return {"$": "yours", "rid": obj._rid}
        if isinstance(obj, np.ndarray):
            return {"$": "nd", "id": id(obj), **_nd_enc(obj)}
        if isinstance(obj, np.generic):
            if obj.dtype.hasobject:
                return self._handle(obj)
            return {"$": "npscalar", "dtype": _dtype_name(obj.dtype),
                    "data": np.asarray(obj).tobytes()}
        jax_enc = _encode_jax(obj)
        if jax_enc is not None:
            return {**jax_enc, "id": id(obj)}
        if id(obj) in memo:
            return self._handle(obj)
        cls = type(obj)
        if cls in (list, tuple, set, frozenset):
            memo[id(obj)] = obj
            return {"$": cls.__name__, "id": id(obj), "v": [self.encode(x, memo) for x in obj]}
        if cls is dict:
            memo[id(obj)] = obj
            return {"$": "dict", "id": id(obj), "k": [self.encode(k, memo) for k in obj],
                    "v": [self.encode(v, memo) for v in obj.values()]}
        if isinstance(obj, BaseException):
            return self._exception(obj, memo)
        if isinstance(obj, tuple) and hasattr(cls, "_fields") and _nameable(cls):
            memo[id(obj)] = obj
            return {"$": "nt", "cls": class_name(cls), "id": id(obj),
                    "v": [self.encode(x, memo) for x in obj]}
        if dataclasses.is_dataclass(obj) and _nameable(cls):
            memo[id(obj)] = obj
            fields = [f.name for f in dataclasses.fields(obj)]
            return {"$": "dc", "cls": class_name(cls), "id": id(obj), "k": fields,
                    "v": [self.encode(getattr(obj, f), memo) for f in fields]}
        return self._handle(obj)

    def _exception(self, e: BaseException, memo: dict[int, Any]) -> dict[str, Any]:
        cls = type(e)
        name = class_name(cls)
        if not _nameable(cls):
            base = next((b for b in cls.__mro__[1:] if issubclass(b, BaseException)
                         and _nameable(b)), Exception)
            name = f"{class_name(base)}|{cls.__name__}"
        out: dict[str, Any] = {"$": "exc", "cls": name, "id": id(e),
                               "args": [self.encode(a, memo) for a in e.args]
                               if all(_plain(a) for a in e.args) else [str(e)],
                               "notes": [str(n) for n in getattr(e, "__notes__", [])]}
        if isinstance(e, OSError):
            out.update(errno=e.errno, strerror=e.strerror,
                       filename=e.filename if isinstance(e.filename, str) else None)
        return out

    def _handle(self, obj: Any) -> dict[str, Any]:
        import types

        bound_builtin = isinstance(obj, types.BuiltinMethodType) and not isinstance(
            getattr(obj, "__self__", None), (types.ModuleType, type(None)))
        if not bound_builtin and (isinstance(obj, (type, types.ModuleType,
                                                   types.BuiltinFunctionType, types.CodeType,
                                                   types.FrameType, types.TracebackType))
                                  or (_forbidden_type(obj) and not callable(obj))):
            raise WireError(f"{type(obj).__name__} objects do not cross the wire")
        if not self.policy.serve(obj):
            raise WireError(f"{self.name} does not hand out a {type(obj).__name__}")
        with self._lock:
            rid = self._export_ids.get(id(obj))
            if rid is None or self._exported.get(rid) is not obj:
                rid = next(self._ids)
                self._exported[rid] = obj
                self._export_ids[id(obj)] = rid
        return {"$": "handle", "rid": rid, "type": type(obj).__name__,
                "callable": callable(obj)}

    def describe(self, rid: int) -> str:
        return f"object #{rid} of the {'judge' if self.name == 'worker' else 'worker'}"

    # ---------- decoding -----------------------------------------------------------------
    def decode(self, enc: Any) -> Any:
        if not isinstance(enc, dict):
            if isinstance(enc, list):  # msgpack gives lists only for our own tags' payloads
                raise WireError("malformed message")
            return enc
        tag = enc.get("$")
        if tag == "bigint":
            return int(enc["v"])
        if tag == "yours":  # one of my objects, back
            obj = self._exported.get(enc["rid"])
            if obj is None:
                raise WireError("a handle to an object that was never handed out")
            return obj
        if tag == "back":  # one of mine that the other side received as a value
            obj = self._sent.get(enc["id"]) if hasattr(self, "_sent") else None
            if obj is None:
                raise WireError("an object that was never sent")
            if "nd" in enc and isinstance(obj, np.ndarray):
                _write_back(obj, _nd_from(enc["nd"]))
            return obj
        if tag == "handle":
            rid = enc["rid"]
            with self._lock:
                r = self._remotes.get(rid)
                if r is None:
                    r = self._remotes[rid] = Remote(self, rid)
            return r
        if tag == "nd":
            return self._keep(enc, _nd_from(enc))
        if tag == "npscalar":
            return np.frombuffer(enc["data"], dtype=_dtype(enc["dtype"]))[0]
        if tag in ("jax", "jaxkey"):
            return self._keep(enc, _decode_jax(enc))
        if tag in ("list", "tuple", "set", "frozenset"):
            items = [self.decode(x) for x in enc["v"]]
            return self._keep(enc, {"list": list, "tuple": tuple, "set": set,
                                    "frozenset": frozenset}[tag](items))
        if tag == "dict":
            return self._keep(enc, {self.decode(k): self.decode(v)
                                    for k, v in zip(enc["k"], enc["v"], strict=True)})
        if tag == "nt":
            cls = load_class(enc["cls"])
            if cls is None:
                raise WireError(f"no named tuple {enc['cls']} here")
            return self._keep(enc, cls(*[self.decode(x) for x in enc["v"]]))
        if tag == "dc":
            cls = load_class(enc["cls"])
            if cls is None or not dataclasses.is_dataclass(cls):
                raise WireError(f"no dataclass {enc['cls']} here")
            obj = object.__new__(cls)
            for k, v in zip(enc["k"], enc["v"], strict=True):
                object.__setattr__(obj, k, self.decode(v))
            return self._keep(enc, obj)
        if tag == "exc":
            return self._keep(enc, self._decode_exception(enc))
        raise WireError(f"unknown value tag {tag!r}")

    def _keep(self, enc: dict[str, Any], obj: Any) -> Any:
        """Remember a value decoded from the other side, so that sending it back sends a
        reference to the other side's own object."""
        if "id" in enc:
            with self._lock:
                self._imported[id(obj)] = (enc["id"], obj)
        return obj

    def _decode_exception(self, enc: dict[str, Any]) -> BaseException:
        name, _, own = str(enc["cls"]).partition("|")
        cls = load_class(name)
        if cls is None or not issubclass(cls, BaseException):
            cls, own = RuntimeError, own or name
        if own:  # a class of the other side's own code: a subclass of its nearest known base
            cls = type(own, (cls,), {"__module__": "__judge_test__"})
        args = [self.decode(a) for a in enc.get("args", [])]
        try:
            e = cls(*args)
        except Exception:
            e = cls(*(str(a) for a in args[:1]))
        if isinstance(e, OSError) and enc.get("errno") is not None:
            e = cls(enc["errno"], enc.get("strerror") or "", *(
                [enc["filename"]] if enc.get("filename") else []))
        for n in enc.get("notes", []):
            e.add_note(n)
        return e

    # ---------- requests -----------------------------------------------------------------
    def request(self, op: str, rid: int | None, name: str | None, args: tuple,
                kwargs: dict) -> Any:
        """Ask the other side to do ``op`` on its object ``rid`` and wait for the answer,
        serving the other side's calls in this chain of calls meanwhile."""
        if self._closed:
            raise WireError(f"the {self._peer()} has gone ({self._closed})")
        chain = getattr(self._local, "chain", None)
        if chain is None:
            chain = f"{self.name}-{next(self._chains)}"
        qid = next(self._ids)
        q: queue.Queue = queue.Queue()
        self._remember_sent(args, kwargs)
        msg = {"op": op, "q": qid, "rid": rid, "name": name, "chain": chain,
               "args": [self.encode(a) for a in args],
               "kw": {k: self.encode(v) for k, v in kwargs.items()}}
        with self._lock:
            self._waiting[qid] = q
            self._chain_q.setdefault(chain, []).append(q)
        old = getattr(self._local, "chain", None)
        self._local.chain = chain
        try:
            self._send(msg)
            deadline = None if self.timeout is None else time.monotonic() + self.timeout
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    item = q.get(timeout=left)
                except queue.Empty:
                    raise RemoteTimeout(f"the {self._peer()} did not answer within "
                                        f"{self.timeout:.0f} s") from None
                if item is None:
                    raise WireError(f"the {self._peer()} has gone ({self._closed})")
                if "re" in item:
                    return self._result(item)
                self._serve(item)  # a call back to us in this chain: run it on this thread
        finally:
            self._local.chain = old
            with self._lock:
                self._waiting.pop(qid, None)
                stack = self._chain_q.get(chain, [])
                if q in stack:
                    stack.remove(q)
                if not stack:
                    self._chain_q.pop(chain, None)

    def _remember_sent(self, *values: Any) -> None:
        """Every container and array sent as a value, by its id: what the other side may
        send back as ``back``. Kept for the life of the wire (one submission)."""
        if not hasattr(self, "_sent"):
            self._sent: dict[int, Any] = {}

        def walk(v: Any, depth: int = 0) -> None:
            if depth > 64 or v is None or isinstance(v, (bool, int, float, str, bytes, Remote)):
                return
            self._sent[id(v)] = v
            if type(v) in (list, tuple, set, frozenset) or (isinstance(v, tuple)
                                                             and hasattr(v, "_fields")):
                for x in v:
                    walk(x, depth + 1)
            elif type(v) is dict:
                for k, x in v.items():
                    walk(k, depth + 1)
                    walk(x, depth + 1)
            elif dataclasses.is_dataclass(v) and not isinstance(v, type):
                for f in dataclasses.fields(v):
                    walk(getattr(v, f.name, None), depth + 1)
            elif isinstance(v, BaseException):
                for a in v.args:
                    walk(a, depth + 1)
        with self._lock:
            for v in values:
                walk(v)

    def _result(self, item: dict[str, Any]) -> Any:
        for rec in item.get("wb", []):  # arrays the callee changed in place
            obj = getattr(self, "_sent", {}).get(rec["id"])
            if isinstance(obj, np.ndarray):
                _write_back(obj, _nd_from(rec["nd"]))
        if "err" in item:
            raise self.decode(item["err"])
        return self.decode(item["ok"])

    def _send(self, msg: dict[str, Any]) -> None:
        data = msgpack.packb(msg, use_bin_type=True)
        with self._send_lock:
            self.conn.send_bytes(data)

    def _peer(self) -> str:
        return "worker" if self.name == "judge" else "judge"

    # ---------- serving ------------------------------------------------------------------
    def _read(self) -> None:
        try:
            while True:
                data = self.conn.recv_bytes(MAX_MESSAGE)
                msg = msgpack.unpackb(data, raw=False, strict_map_key=False)
                if not isinstance(msg, dict):
                    raise WireError("malformed message")
                if "re" in msg:
                    with self._lock:
                        q = self._waiting.get(msg["re"])
                    if q is not None:
                        q.put(msg)
                    continue
                with self._lock:
                    stack = self._chain_q.get(str(msg.get("chain")))
                    q = stack[-1] if stack else None
                if q is not None:
                    q.put(msg)
                else:
                    threading.Thread(target=self._serve, args=(msg,), daemon=True,
                                     name=f"wire-{self.name}-serve").start()
        except (EOFError, OSError) as e:
            self._close(f"connection closed: {type(e).__name__}")
        except Exception as e:  # garbage on the wire
            self._close(f"{type(e).__name__}: {e}")

    def _close(self, why: str) -> None:
        self._closed = why
        with self._lock:
            waiting = list(self._waiting.values())
        for q in waiting:
            q.put(None)

    def close(self) -> None:
        self._close("closed")
        try:
            self.conn.close()
        except OSError:
            pass

    def _serve(self, msg: dict[str, Any]) -> None:
        old = getattr(self._local, "chain", None)
        self._local.chain = str(msg.get("chain"))
        reply: dict[str, Any] = {"re": msg.get("q")}
        before: list[tuple[np.ndarray, bytes]] = []
        try:
            args = [self.decode(a) for a in msg.get("args", [])]
            kwargs = {str(k): self.decode(v) for k, v in (msg.get("kw") or {}).items()}
            before = _array_args(args, kwargs)
            result = self._do(str(msg.get("op")), msg.get("rid"), msg.get("name"), args, kwargs)
            self._remember_sent(result)
            reply["ok"] = self.encode(result)
        except BaseException as e:
            try:
                self._remember_sent(e)
                reply["err"] = self.encode(e)
            except Exception as bad:
                reply["err"] = self.encode(WireError(f"{type(e).__name__}: {e} ({bad})"))
        wb = []
        for a, digest in before:
            if _digest(a) != digest:
                back = self._imported.get(id(a))
                if back is not None:
                    wb.append({"id": back[0], "nd": _nd_enc(a)})
        if wb:
            reply["wb"] = wb
        self._local.chain = old
        try:
            self._send(reply)
        except (OSError, ValueError):
            self._close("could not answer")

    def _do(self, op: str, rid: Any, name: Any, args: list, kwargs: dict) -> Any:
        obj = self._exported.get(rid) if isinstance(rid, int) else None
        if obj is None:
            raise WireError(f"no object #{rid} here")
        if name is not None:
            name = str(name)
            if name.startswith("__") and name not in ("__enter__", "__exit__"):
                raise AttributeError(f"{name} may not be reached across the wire")
            if name.startswith("_") and not name.startswith("__") and not self.policy.private:
                raise AttributeError(f"{type(obj).__name__}.{name} is not part of its contract")
        if op == "call":
            target = obj if name is None else getattr(obj, name)
            self.policy.check(obj, name or "__call__", tuple(args), kwargs)
            return target(*args, **kwargs)
        if op == "getattr":
            value = getattr(obj, name)
            if not _servable_attr(obj, value):
                raise AttributeError(f"{type(obj).__name__}.{name} is not part of its contract")
            return value
        if op == "setattr":
            if not self.policy.setattr:
                raise AttributeError(f"{type(obj).__name__}.{name} may not be set across the wire")
            setattr(obj, name, args[0])
            return None
        raise WireError(f"unknown operation {op!r}")


def _servable_attr(obj: Any, value: Any) -> bool:
    """An attribute read across the wire gives data, an object, or a method of ``obj`` itself:
    never a class, a module, a function or a builtin (a way from a served object to anything
    else the serving process can do)."""
    import types

    if isinstance(value, types.MethodType):
        return value.__self__ is obj
    if isinstance(value, types.BuiltinMethodType) and getattr(value, "__self__", None) is obj:
        return True
    return not _forbidden_type(value) and not isinstance(value, (types.MethodType,
                                                                   types.BuiltinMethodType))


def _plain(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str, bytes, np.ndarray, np.generic,
                                       tuple, list, dict))


def _array_args(args: list, kwargs: dict) -> list[tuple[np.ndarray, bytes]]:
    out = []
    for a in [*args, *kwargs.values()]:
        if isinstance(a, np.ndarray) and a.flags.writeable and not a.dtype.hasobject:
            out.append((a, _digest(a)))
    return out


def _digest(a: np.ndarray) -> bytes:
    import hashlib

    return hashlib.blake2b(np.ascontiguousarray(a).view(np.uint8).tobytes()
                           if a.size else b"", digest_size=16).digest()


def _write_back(dest: np.ndarray, src: np.ndarray) -> None:
    if dest.shape == src.shape and dest.dtype == src.dtype and dest.flags.writeable:
        np.copyto(dest, src)


# ------------------------------------------------------------------------------------------
# arrays
# ------------------------------------------------------------------------------------------
def _nd_enc(a: np.ndarray) -> dict[str, Any]:
    if a.dtype.hasobject:
        raise WireError("an object array cannot cross the wire")
    c = np.ascontiguousarray(a)
    little = c.dtype.newbyteorder("<") if c.dtype.byteorder == ">" else c.dtype
    return {"dtype": _dtype_name(c.dtype), "order": c.dtype.byteorder, "shape": list(c.shape),
            "data": c.astype(little, copy=False).tobytes(), "ro": not a.flags.writeable}


def _dtype_name(dt: np.dtype) -> str:
    return dt.newbyteorder("=").name if dt.byteorder in "<>" else dt.name


def _dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))


def _nd_from(enc: dict[str, Any]) -> np.ndarray:
    dt = _dtype(enc["dtype"]).newbyteorder("<")
    a = np.frombuffer(enc["data"], dtype=dt).reshape(enc["shape"]).copy()
    if enc.get("order") == ">":
        a = a.astype(a.dtype.newbyteorder(">"))
    if enc.get("ro"):
        a.flags.writeable = False
    return a


def _encode_jax(obj: Any) -> dict[str, Any] | None:
    import sys

    jax = sys.modules.get("jax")
    if jax is None or not isinstance(obj, jax.Array):
        return None
    if jax.dtypes.issubdtype(obj.dtype, jax.dtypes.prng_key):
        data = np.asarray(jax.random.key_data(obj))
        return {"$": "jaxkey", "impl": str(jax.random.key_impl(obj)),
                "data": _nd_enc(data)}
    return {"$": "jax", "data": _nd_enc(np.asarray(obj)),
            "weak": bool(getattr(obj, "weak_type", False))}


def _decode_jax(enc: dict[str, Any]) -> Any:
    import jax
    import jax.numpy as jnp

    data = _nd_from(enc["data"])
    if enc["$"] == "jaxkey":
        return jax.random.wrap_key_data(data, impl=enc["impl"])
    return jnp.asarray(data)
