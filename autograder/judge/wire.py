"""The wire between the judge and the student's worker: plain data by value, everything else
by handle, over one ``multiprocessing.connection`` (``send_bytes``/``recv_bytes`` only: nothing
is ever unpickled) carrying msgpack.

This file runs on both sides. The worker gets its text over the connection (it is public
code), so the sandbox needs no copy of ``autograder/``; it imports only the standard library,
msgpack and numpy at the top, JAX when an array of it crosses.

* **Values**: None, bools, ints, floats, strings, bytes; lists, tuples, dicts, sets; numpy
  arrays, scalars and dtypes (any but object); JAX arrays and typed PRNG keys; named tuples and
  dataclasses (flax's struct nodes, optax's states, minickpt's records) of classes from the
  modules in :data:`CLASS_MODULES`; exceptions of such classes (``OSError`` with its errno).
* **Handles**: any other object stays where it is; the other side gets a :class:`Remote`
  whose calls, attribute reads and (where allowed) writes travel back. What a side may do
  with the other's objects is its :class:`Policy`.
* **Identity**: an object that comes back to the side it came from is that side's own object
  again (``a is b`` holds across the wire), and an array, list, dict or set argument the
  callee changed in place (lab 2's infos sorted) is changed in place at the caller's too.
* **Threads**: a call made while serving a call runs on the thread that waits for it (so a
  callback sees the locks its caller holds, as in one process); other requests get a thread.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import os
import queue
import socket
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

    # the container and iterator protocols (a test's generator of steps, a mapping the other
    # side holds): each is a call of that method of the object, over there
    def __iter__(self) -> Any:
        return self._ep.request("call", self._rid, "__iter__", (), {})

    def __next__(self) -> Any:
        return self._ep.request("call", self._rid, "__next__", (), {})

    def __len__(self) -> int:
        return self._ep.request("call", self._rid, "__len__", (), {})

    def __getitem__(self, key: Any) -> Any:
        return self._ep.request("call", self._rid, "__getitem__", (key,), {})

    def __contains__(self, item: Any) -> bool:
        return self._ep.request("call", self._rid, "__contains__", (item,), {})

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
        self._sent: dict[int, Any] = {}          # id -> my object sent as a value
        self._imported: dict[int, tuple[int, Any]] = {}  # id(obj) of a value I decoded -> (its id there, obj)
        self._remotes: dict[int, Remote] = {}    # rid there -> Remote (one per object)
        self._opaque: set[int] = set()           # my objects the other side may only hold
        self._buffers: list[tuple[int, int, int]] = []  # received arrays' bytes: start, end, id
        self._waiting: dict[int, queue.Queue] = {}       # request id -> the waiter's queue
        self._chain_q: dict[str, list[queue.Queue]] = {}  # chain -> waiters in it (innermost last)
        self._local = threading.local()
        self._closed: str | None = None
        self.timed_out = False  # a call of mine was not answered in time (the other side hangs)
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"wire-{name}")

    def start(self) -> Endpoint:
        self._reader.start()
        return self

    # ---------- encoding -----------------------------------------------------------------
    def encode(self, obj: Any, memo: dict[Any, Any] | None = None) -> Any:
        """``obj`` as the wire carries it. Every value sent with an id is remembered (for
        the life of the wire, one submission): the other side may send it back as itself."""
        memo = {} if memo is None else memo
        enc = self._encode(obj, memo)
        if isinstance(enc, dict) and "id" in enc and enc.get("$") not in ("back", "same"):
            with self._lock:
                self._sent[enc["id"]] = obj
            memo[("done", enc["id"])] = True  # a later occurrence in this message: "same"
        return enc

    def _encode(self, obj: Any, memo: dict[Any, Any]) -> Any:
        back = self._imported.get(id(obj))
        if back is not None and back[1] is obj:
            ref: dict[str, Any] = {"$": "back", "id": back[0]}
            if isinstance(obj, np.ndarray):  # as it is now: this side may have changed it
                ref["nd"] = _nd_enc(obj)
            elif isinstance(obj, BaseException):
                ref["notes"] = [str(n) for n in getattr(obj, "__notes__", [])]
            elif type(obj) in (list, dict, set) and id(obj) not in memo:
                memo[id(obj)] = obj
                ref["now"] = ({"$": "dict", "k": [self.encode(k, memo) for k in obj],
                               "v": [self.encode(v, memo) for v in obj.values()]}
                              if type(obj) is dict else
                              {"$": type(obj).__name__, "v": [self.encode(x, memo) for x in obj]})
            return ref
        if obj is None or type(obj) is bool:
            return obj
        if type(obj) is int and not -(2**63) <= obj < 2**64:
            return {"$": "bigint", "id": id(obj), "v": str(obj)}
        if type(obj) in (int, float, str, bytes):  # with its id: a leaf may come back as itself
            return {"$": "s", "id": id(obj), "v": obj}
        if type(obj) is complex:
            return {"$": "complex", "id": id(obj), "v": [obj.real, obj.imag]}
        if isinstance(obj, Remote) and obj._ep is self:
            return {"$": "yours", "rid": obj._rid}
        if isinstance(obj, np.ndarray) and obj.dtype.hasobject:  # its items, one by one
            memo[id(obj)] = obj
            return {"$": "ndobj", "id": id(obj), "shape": list(obj.shape),
                    "v": [self.encode(x, memo) for x in obj.ravel(order="C").tolist()]}
        if isinstance(obj, np.ndarray):
            view = self._view_of_received(obj)
            if view is not None:
                return view
            return {"$": "nd", "id": id(obj), **_nd_enc(obj)}
        if isinstance(obj, np.generic):
            if obj.dtype.hasobject:
                return self._handle(obj)
            return {"$": "npscalar", "id": id(obj), "dtype": _dtype_name(obj.dtype),
                    "data": np.asarray(obj).tobytes()}
        if isinstance(obj, np.dtype) and not obj.hasobject and obj.fields is None:
            return {"$": "dtype", "id": id(obj), "dtype": _dtype_name(obj),
                    "order": obj.byteorder}  # (lab 4's region_from_pieces(box, dtype, ...))
        jax_enc = _encode_jax(obj)
        if jax_enc is not None:
            return {**jax_enc, "id": id(obj)}
        if type(obj) in (bytearray, memoryview):  # a buffer: its bytes, and what the callee
            return _buf_enc(obj) or self._handle(obj)  # writes into it comes back (preadv)
        if id(obj) in memo:  # shared (two records holding one dict): the same object there;
            if ("done", id(obj)) in memo:  # a cycle (an object inside itself): a handle
                return {"$": "same", "id": id(obj)}
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
        if isinstance(obj, JudgeNode):  # a node the worker built from one of the judge's
            return {"$": "pynode_new", "template": obj._template, "keys": obj._keys,
                    "v": [self.encode(x, memo) for x in obj._children]}
        node = _pytree_node(obj)
        if node is not None:
            memo[id(obj)] = obj
            keys, kids = node
            return {"$": "pynode", "id": id(obj), "keys": keys,
                    "v": [self.encode(x, memo) for x in kids]}
        return self._handle(obj)

    def _view_of_received(self, a: np.ndarray) -> dict[str, Any] | None:
        """``a`` as a view into an array the other side sent (a numpy array, or the buffer of
        a JAX array on the CPU): a function that returns a view of its argument, not a copy,
        returns a view of the caller's own array there too."""
        if not self._buffers or a.dtype.hasobject or a.size == 0:
            return None
        ptr = a.__array_interface__["data"][0]
        with self._lock:
            found = next(((start, rid) for start, end, rid in reversed(self._buffers)
                          if start <= ptr < end), None)
        if found is None:
            return None
        return {"$": "view", "id": id(a), "base": found[1], "offset": ptr - found[0],
                "shape": list(a.shape), "strides": list(a.strides),
                "dtype": _dtype_name(a.dtype), "order": a.dtype.byteorder, "nd": _nd_enc(a)}

    def _note_buffer(self, enc: dict[str, Any], obj: Any) -> None:
        """Where a received array's bytes are (numpy, or a CPU JAX array's own buffer)."""
        try:
            a = obj if isinstance(obj, np.ndarray) else np.asarray(obj)
            if a.flags.c_contiguous and a.size and not a.dtype.hasobject:
                start = a.__array_interface__["data"][0]
                with self._lock:
                    self._buffers.append((start, start + a.nbytes, enc["id"]))
        except Exception:
            pass

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
        attrs = {k: v for k, v in vars(e).items() if not k.startswith("__") and _plain(v)}
        out["attrs"] = {k: self.encode(v, memo) for k, v in attrs.items()}
        if isinstance(e, OSError):
            out.update(errno=e.errno, strerror=e.strerror,
                       filename=e.filename if isinstance(e.filename, str) else None)
        return out

    def _handle(self, obj: Any) -> dict[str, Any]:
        import types

        bound_builtin = isinstance(obj, types.BuiltinMethodType) and not isinstance(
            getattr(obj, "__self__", None), (types.ModuleType, type(None)))
        opaque = not bound_builtin and (
            isinstance(obj, (type, types.ModuleType, types.BuiltinFunctionType, types.CodeType,
                             types.FrameType, types.TracebackType))
            or (_forbidden_type(obj) and not callable(obj)
                and not isinstance(obj, types.GeneratorType))  # a generator: iterated there
            or not self.policy.serve(obj))
        with self._lock:
            rid = self._export_ids.get(id(obj))
            if rid is None or self._exported.get(rid) is not obj:
                rid = next(self._ids)
                self._exported[rid] = obj
                self._export_ids[id(obj)] = rid
                if opaque:  # it may be passed around and sent back, nothing else
                    self._opaque.add(rid)
        return {"$": "handle", "rid": rid, "type": type(obj).__name__,
                "callable": callable(obj) and not opaque}

    def describe(self, rid: int) -> str:
        return f"object #{rid} of the {'judge' if self.name == 'worker' else 'worker'}"

    # ---------- decoding -----------------------------------------------------------------
    def decode(self, enc: Any) -> Any:
        if getattr(self._local, "decoded", None) is not None:
            return self._decode(enc)
        self._local.decoded = {}  # this message's values by their sender's id ("same")
        try:
            return self._decode(enc)
        finally:
            self._local.decoded = None

    def _decode(self, enc: Any) -> Any:
        if not isinstance(enc, dict):
            if isinstance(enc, list):  # msgpack gives lists only for our own tags' payloads
                raise WireError("malformed message")
            return enc
        tag = enc.get("$")
        if tag == "same":  # a second occurrence of a value of this message: the same object
            decoded = self._local.decoded
            if enc.get("id") not in decoded:
                raise WireError("a reference to a value the message did not carry")
            return decoded[enc["id"]]
        if tag == "buf":
            return self._keep(enc, _buf_dec(enc))
        if tag == "bigint":
            return self._keep(enc, int(enc["v"]))
        if tag == "s":
            v = enc["v"]
            if type(v) not in (int, float, str, bytes):
                raise WireError("malformed scalar")
            return self._keep(enc, v)
        if tag == "complex":
            return self._keep(enc, complex(float(enc["v"][0]), float(enc["v"][1])))
        if tag == "pynode":
            kids = [self.decode(x) for x in enc["v"]]
            return self._keep(enc, JudgeNode(enc["id"], list(enc["keys"]), kids))
        if tag == "pynode_new":
            template = self._sent.get(enc["template"])
            if template is None:
                raise WireError("a tree node built from one that was never sent")
            return _rebuild(template, [self.decode(x) for x in enc["v"]])
        if tag == "yours":  # one of my objects, back
            obj = self._exported.get(enc["rid"])
            if obj is None:
                raise WireError("a handle to an object that was never handed out")
            return obj
        if tag == "back":  # one of mine that the other side received as a value
            obj = self._sent.get(enc["id"])
            if obj is None:
                raise WireError("an object that was never sent")
            if "nd" in enc and isinstance(obj, np.ndarray):
                _write_back(obj, _nd_from(enc["nd"]))
            elif "notes" in enc and isinstance(obj, BaseException):
                notes = [str(n) for n in enc["notes"]]
                if notes or hasattr(obj, "__notes__"):
                    obj.__notes__ = notes
            elif "now" in enc and type(obj) in (list, dict, set):
                now = self.decode(enc["now"])
                if type(obj) is list and type(now) is list:
                    obj[:] = now
                elif type(obj) is type(now):
                    obj.clear()
                    obj.update(now)
            return obj
        if tag == "handle":
            rid = enc["rid"]
            with self._lock:
                r = self._remotes.get(rid)
                if r is None:
                    r = self._remotes[rid] = Remote(self, rid)
            return r
        if tag == "nd":
            a = self._keep(enc, _nd_from(enc))
            self._note_buffer(enc, a)
            return a
        if tag == "view":
            base = self._sent.get(enc["base"])
            if base is not None and not isinstance(base, np.ndarray):
                try:  # a JAX array on the CPU: a view of its own buffer (it pins it)
                    base = np.asarray(base)
                except Exception:
                    base = None
            if isinstance(base, np.ndarray) and base.flags.c_contiguous:
                dt = _dtype(enc["dtype"])
                if enc.get("order") == ">":
                    dt = dt.newbyteorder(">")
                try:
                    v = np.ndarray(tuple(enc["shape"]), dt, buffer=base,
                                   offset=int(enc["offset"]), strides=tuple(enc["strides"]))
                    return self._keep(enc, v)
                except (TypeError, ValueError):
                    pass
            return self._keep(enc, _nd_from(enc["nd"]))  # the same values, as a copy
        if tag == "ndobj":
            items = [self.decode(x) for x in enc["v"]]
            a = np.empty(len(items), dtype=object)
            a[:] = items
            return self._keep(enc, a.reshape(enc["shape"]))
        if tag == "npscalar":
            return self._keep(enc, np.frombuffer(enc["data"], dtype=_dtype(enc["dtype"]))[0])
        if tag in ("jax", "jaxkey"):
            x = self._keep(enc, _decode_jax(enc))
            if tag == "jax" and not enc.get("deleted"):
                self._note_buffer(enc, x)
            return x
        if tag == "dtype":
            dt = _dtype(enc["dtype"])
            return self._keep(enc, dt.newbyteorder(">") if enc.get("order") == ">" else dt)
        if tag == "sds":  # a jax.ShapeDtypeStruct: its shape and dtype (the placement stays)
            import jax

            return self._keep(enc, jax.ShapeDtypeStruct(tuple(enc["shape"]),
                                                        _dtype(enc["dtype"])))
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
            decoded = getattr(self._local, "decoded", None)
            if decoded is not None:
                decoded[enc["id"]] = obj
        return obj

    def _decode_exception(self, enc: dict[str, Any]) -> BaseException:
        name, _, own = str(enc["cls"]).partition("|")
        cls = load_class(name)
        if cls is None or not issubclass(cls, BaseException):
            cls, own = RuntimeError, own or name
        if self.name == "judge" and not issubclass(cls, Exception):
            # the worker's SystemExit, KeyboardInterrupt or own BaseException: an error of the
            # call here, never a stop of the judge (the same name, under Exception)
            own, cls = own or cls.__name__, RuntimeError
        if own:  # a class of the other side's own code: a subclass of its nearest known base
            cls = type(own, (cls,), {"__module__": "__judge_test__"})
        args = [self.decode(a) for a in enc.get("args", [])]
        if issubclass(cls, OSError) and enc.get("errno") is not None:
            e = cls(enc["errno"], enc.get("strerror") or "", *(
                [enc["filename"]] if enc.get("filename") else []))
        else:  # as it was, without running a constructor whose signature is its own
            try:
                e = cls.__new__(cls, *args)
            except TypeError:  # a class of two builtin bases (minickpt's MemoryError kind)
                e = Exception.__new__(cls, *args) if issubclass(cls, Exception) else \
                    BaseException.__new__(cls, *args)
            e.args = tuple(args)
        for k, v in (enc.get("attrs") or {}).items():
            if isinstance(k, str) and not k.startswith("__"):
                try:
                    setattr(e, k, self.decode(v))
                except (AttributeError, TypeError):
                    pass
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
                    self.timed_out = True
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

    def _result(self, item: dict[str, Any]) -> Any:
        for rec in item.get("wb", []):  # arrays, lists, dicts the callee changed in place
            if isinstance(rec, dict) and isinstance(rec.get("ref"), dict) \
                    and rec["ref"].get("$") == "back":
                self.decode(rec["ref"])  # a "back" with what it holds now: updated here
                continue
            obj = self._sent.get(rec["id"])
            if isinstance(obj, np.ndarray) and "nd" in rec:
                _write_back(obj, _nd_from(rec["nd"]))
            elif type(obj) in (bytearray, memoryview) and isinstance(rec.get("buf"), bytes):
                _buf_write_back(obj, rec["buf"])
            elif _mutable_record(obj) and isinstance(rec.get("dc"), dict):
                names = {f.name for f in dataclasses.fields(obj)}
                for f, v in rec["dc"].items():
                    if f in names:
                        setattr(obj, f, self.decode(v))
        if "err" in item:
            raise self.decode(item["err"])
        return self.decode(item["ok"])

    def _send(self, msg: dict[str, Any]) -> None:
        data = msgpack.packb(msg, use_bin_type=True)
        with self._send_lock:
            self.conn.send_bytes(data)

    def _peer_of_me(self) -> str:
        return "judge" if self.name == "judge" else "worker"

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
        """End the wire: the reader is woken (the socket shut down) and gone before the
        descriptor is closed, so that it never reads from a socket that reuses its number (a
        new worker's: a torn message, or a call that never arrives)."""
        self._close("closed")
        try:
            s = socket.socket(fileno=os.dup(self.conn.fileno()))
            try:
                s.shutdown(socket.SHUT_RDWR)
            finally:
                s.close()
        except (OSError, ValueError):
            pass  # not a socket, or closed already
        if self._reader.is_alive() and self._reader is not threading.current_thread():
            self._reader.join(5)
        try:
            self.conn.close()
        except OSError:
            pass

    def _serve(self, msg: dict[str, Any]) -> None:
        old = getattr(self._local, "chain", None)
        self._local.chain = str(msg.get("chain"))
        reply: dict[str, Any] = {"re": msg.get("q")}
        before: list[tuple[np.ndarray, bytes]] = []
        records: list[tuple[Any, dict[str, Any]]] = []
        shapes: list[tuple[Any, Any]] = []
        try:
            args = [self.decode(a) for a in msg.get("args", [])]
            kwargs = {str(k): self.decode(v) for k, v in (msg.get("kw") or {}).items()}
            before = _array_args(args, kwargs)
            records = _record_args(args, kwargs)
            shapes = _container_args(args, kwargs)
            result = self._do(str(msg.get("op")), msg.get("rid"), msg.get("name"), args, kwargs)
            reply["ok"] = self.encode(result)
        except BaseException as e:
            try:
                reply["err"] = self.encode(e)
            except Exception as bad:
                reply["err"] = self.encode(WireError(f"{type(e).__name__}: {e} ({bad})"))
        wb = []
        for c, shape in shapes:  # a list, dict or set argument the callee changed in place
            back = self._imported.get(id(c))
            if back is not None and back[1] is c and _shape(c) != shape:
                try:
                    wb.append({"id": back[0], "ref": self.encode(c)})
                except Exception:  # what it now holds cannot cross: the caller's stays
                    pass
        for a, digest in before:
            if _digest(a) != digest:
                back = self._imported.get(id(a))
                if back is not None:
                    wb.append({"id": back[0], "buf": bytes(a)} if type(a) in
                              (bytearray, memoryview) else {"id": back[0], "nd": _nd_enc(a)})
        for rec, fields in records:  # a record whose fields the callee set (lab 6's KillRecord)
            changed = {f: getattr(rec, f) for f in fields if getattr(rec, f) is not fields[f]}
            back = self._imported.get(id(rec))
            if changed and back is not None:
                try:
                    wb.append({"id": back[0], "dc": {f: self.encode(v) for f, v in
                                                     changed.items()}})
                except Exception:
                    pass
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
        if rid in self._opaque:
            raise TypeError(f"a {type(obj).__name__} of the {self._peer_of_me()} can only be "
                            "passed along, not used")
        if name is not None:
            name = str(name)
            if name.startswith("__") and name not in PROTOCOL:
                raise AttributeError(f"{name} may not be reached across the wire")
            if name.startswith("_") and not name.startswith("__") and not self.policy.private:
                raise AttributeError(f"{type(obj).__name__}.{name} is not part of its contract")
        if op == "call":
            if name in PROTOCOL and not hasattr(type(obj), name):  # as Python says it there
                raise TypeError(f"'{type(obj).__name__}' object does not support {name}")
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


PROTOCOL = ("__enter__", "__exit__", "__iter__", "__next__", "__len__", "__getitem__",
            "__contains__")
"""The dunders the other side may call on an object: a context manager's, a container's and
an iterator's protocols (what ``with``, ``for``, ``len``, ``x[k]`` and ``in`` do)."""


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


# ------------------------------------------------------------------------------------------
# pytree nodes of classes the other side cannot import (a test's own)
# ------------------------------------------------------------------------------------------
class JudgeNode:
    """In the worker: a pytree node of a class of the judge's test (a namedtuple, a
    registered class), with the same children under the same keys, so that JAX flattens it
    to the same key paths. Sent back, it is the judge's own node again, or a new one of its
    class built by the judge from the children."""

    def __init__(self, template: int, keys: list, children: list) -> None:
        self._template, self._keys, self._children = template, keys, list(children)
        _register_judge_node()

    def __repr__(self) -> str:
        return f"JudgeNode({self._children!r})"


_REGISTERED: list[bool] = []


def _register_judge_node() -> None:
    if _REGISTERED:
        return
    import jax

    def flatten(n: JudgeNode) -> tuple:
        return tuple(zip([_key(k) for k in n._keys], n._children, strict=True)), \
            (n._template, tuple(map(tuple, n._keys)))

    jax.tree_util.register_pytree_with_keys(
        JudgeNode, flatten, lambda aux, kids: JudgeNode(aux[0], [list(k) for k in aux[1]],
                                                        list(kids)))
    _REGISTERED.append(True)


def _key(k: list) -> Any:
    import jax.tree_util as tu

    kind, v = k[0], k[1]
    return {"dict": tu.DictKey, "attr": tu.GetAttrKey, "seq": tu.SequenceKey,
            "flat": tu.FlattenedIndexKey}[kind](v)


def _pytree_node(obj: Any) -> tuple[list, list] | None:
    """(keys, children) of ``obj`` when JAX knows it as a pytree node, else None."""
    import sys

    jax = sys.modules.get("jax")
    if jax is None:
        return None
    tu = jax.tree_util
    try:
        pairs, treedef = tu.tree_flatten_with_path(obj, is_leaf=lambda x: x is not obj)
    except Exception:
        return None
    if tu.treedef_is_leaf(treedef):
        return None
    keys = []
    for path, _ in pairs:
        k = path[0] if len(path) == 1 else None
        if isinstance(k, tu.DictKey) and (k.key is None or isinstance(k.key, (int, float, str))):
            keys.append(["dict", k.key])
        elif isinstance(k, tu.GetAttrKey):
            keys.append(["attr", k.name])
        elif isinstance(k, tu.SequenceKey):
            keys.append(["seq", k.idx])
        elif isinstance(k, tu.FlattenedIndexKey):
            keys.append(["flat", k.key])
        else:
            return None
    return keys, [x for _, x in pairs]


def _rebuild(template: Any, children: list) -> Any:
    import jax

    treedef = jax.tree_util.tree_structure(template, is_leaf=lambda x: x is not template)
    return jax.tree_util.tree_unflatten(treedef, children)


def _plain(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str, bytes, np.ndarray, np.generic,
                                       tuple, list, dict))


def _array_args(args: list, kwargs: dict) -> list[tuple[Any, bytes]]:
    """The writable arrays and buffers among a call's arguments (and in a list of them, as
    ``preadv`` takes), with a digest of what they hold before the call."""
    out = []
    for a in [*args, *kwargs.values()]:
        for x in (a if type(a) in (list, tuple) else [a]):
            if isinstance(x, np.ndarray) and x.flags.writeable and not x.dtype.hasobject:
                out.append((x, _digest(x)))
            elif type(x) is bytearray or (type(x) is memoryview and not x.readonly):
                out.append((x, _digest(x)))
    return out


def _buf_enc(b: bytearray | memoryview) -> dict[str, Any] | None:
    """A bytearray or a contiguous memoryview by value (None: another kind of view)."""
    if type(b) is memoryview and not b.c_contiguous:
        return None
    return {"$": "buf", "id": id(b), "mv": type(b) is memoryview,
            "ro": type(b) is memoryview and b.readonly, "v": bytes(b),
            "fmt": b.format if type(b) is memoryview else "B",
            "shape": list(b.shape or ()) if type(b) is memoryview else [len(b)]}


def _buf_dec(enc: dict[str, Any]) -> bytearray | memoryview:
    data = enc.get("v")
    if not isinstance(data, bytes):
        raise WireError("malformed buffer")
    if not enc.get("mv"):
        return bytearray(data)
    mv = memoryview(bytes(data) if enc.get("ro") else bytearray(data))
    fmt, shape = str(enc.get("fmt", "B")), tuple(int(n) for n in enc.get("shape") or ())
    if (fmt, shape) != ("B", (len(data),)):
        try:
            mv = mv.cast(fmt, shape)
        except (TypeError, ValueError):
            pass  # a format this side does not know: its bytes
    return mv


def _buf_write_back(dest: bytearray | memoryview, data: bytes) -> None:
    view = memoryview(dest)
    if view.readonly or not view.c_contiguous or view.nbytes != len(data):
        return
    view.cast("B")[:] = data


def _mutable_record(obj: Any) -> bool:
    """A dataclass instance (not a class) whose fields may be set: not frozen."""
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type) and \
        not type(obj).__dataclass_params__.frozen


def _record_args(args: list, kwargs: dict) -> list[tuple[Any, dict[str, Any]]]:
    """The mutable records among a call's arguments, with their fields as they came: a
    field the callee sets goes back to the caller's own record, as an array changed in
    place does."""
    out = []
    for a in [*args, *kwargs.values()]:
        if _mutable_record(a):
            out.append((a, {f.name: getattr(a, f.name) for f in dataclasses.fields(a)}))
    return out


def _container_args(args: list, kwargs: dict) -> list[tuple[Any, Any]]:
    """The list, dict and set arguments of a call, each with its :func:`_shape` before it."""
    return [(a, _shape(a)) for a in [*args, *kwargs.values()] if type(a) in (list, dict, set)]


def _shape(obj: Any, depth: int = 0) -> Any:
    """What a container holds, by identity (nested lists, dicts and sets by their own shape):
    a sort, an append, an update or a replaced item changes it."""
    if depth > 20:
        return id(obj)
    if type(obj) is list:
        return ("l", id(obj), tuple(_shape(x, depth + 1) for x in obj))
    if type(obj) is dict:
        return ("d", id(obj), tuple((id(k), _shape(v, depth + 1)) for k, v in obj.items()))
    if type(obj) is set:
        return ("s", id(obj), frozenset(id(x) for x in obj))
    return id(obj)


def _digest(a: Any) -> bytes:
    import hashlib

    if type(a) in (bytearray, memoryview):
        return hashlib.blake2b(bytes(a), digest_size=16).digest()
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
    c = a if a.flags.c_contiguous else a.copy(order="C")
    little = c.dtype.newbyteorder("<") if c.dtype.byteorder == ">" else c.dtype
    return {"dtype": _dtype_name(c.dtype), "order": c.dtype.byteorder, "shape": list(c.shape),
            "data": c.astype(little, copy=False).tobytes(), "ro": not a.flags.writeable,
            "at": a.__array_interface__["data"][0] % ALIGN}


ALIGN = 64
"""An array's copy on the other side starts at the same address modulo this as the array (a
test checks that a region is 64-byte aligned, lab 4's ``region_from_pieces``: it is where
the student's code allocated it, neither more nor less aligned by the crossing)."""


def _placed(nbytes: int, at: int) -> np.ndarray:
    """``nbytes`` fresh bytes starting ``at`` past a multiple of :data:`ALIGN`."""
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = (int(at) - raw.__array_interface__["data"][0]) % ALIGN
    return raw[start:start + nbytes]


def _dtype_name(dt: np.dtype) -> str:
    """A name the other side's numpy gives the same dtype back for (ml_dtypes' by name)."""
    plain = dt.newbyteorder("<") if dt.byteorder == ">" else dt
    try:
        if np.dtype(plain.str) == plain:
            return plain.str
    except TypeError:
        pass
    return plain.name


def _dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))


def _nd_from(enc: dict[str, Any]) -> np.ndarray:
    dt = _dtype(enc["dtype"]).newbyteorder("<")
    src = np.frombuffer(enc["data"], dtype=dt).reshape(enc["shape"])
    a = _placed(src.nbytes, enc.get("at", 0)).view(dt).reshape(src.shape)
    a[...] = src
    if enc.get("order") == ">":
        a = a.astype(a.dtype.newbyteorder(">"))
    if enc.get("ro"):
        a.flags.writeable = False
    return a


def _encode_jax(obj: Any) -> dict[str, Any] | None:
    import sys

    jax = sys.modules.get("jax")
    if jax is not None and type(obj) is jax.ShapeDtypeStruct:
        try:
            dt = np.dtype(obj.dtype)
        except TypeError:  # a key's dtype: it stays where it is
            return None
        if not dt.hasobject:
            return {"$": "sds", "shape": [int(n) for n in obj.shape], "dtype": _dtype_name(dt)}
    if jax is None or not isinstance(obj, jax.Array):
        return None
    if obj.is_deleted():  # deleted (or donated): it crosses as one, with nothing in it
        return {"$": "jax", "deleted": True, "dtype": _dtype_name(np.dtype(obj.dtype)),
                "shape": list(obj.shape)}
    if jax.dtypes.issubdtype(obj.dtype, jax.dtypes.prng_key):
        data = np.asarray(jax.random.key_data(obj))
        return {"$": "jaxkey", "impl": str(jax.random.key_impl(obj)),
                "data": _nd_enc(data)}
    return {"$": "jax", "data": _nd_enc(np.asarray(obj)),
            "weak": bool(getattr(obj, "weak_type", False))}


def _decode_jax(enc: dict[str, Any]) -> Any:
    import jax
    import jax.numpy as jnp

    if enc.get("deleted"):
        x = jnp.zeros(tuple(enc["shape"]), _dtype(enc["dtype"]))
        x.delete()
        return x
    data = _nd_from(enc["data"])
    if enc["$"] == "jaxkey":
        return jax.random.wrap_key_data(data, impl=enc["impl"])
    return jnp.asarray(data)
