"""Checks whose messages teach: :func:`check` raises :class:`LabCheckError` with a message for the
student; comparisons check types first, because an object whose ``==`` is always ``True`` must
not pass a test."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np


class LabCheckError(AssertionError):
    """A lab test failed; the message says what was expected and what to look at. Under the
    grader (the graded build of minickpt) it also names the student's functions of the lab's
    other tasks that minickpt called in this test: :func:`other_tasks_note`."""

    def __init__(self, *args: object) -> None:
        if len(args) == 1 and isinstance(args[0], str) and "this test runs your Task" not in args[0]:
            args = (args[0] + other_tasks_note(),)
        super().__init__(*args)


def other_tasks_note() -> str:
    """On the graded build, where minickpt holds none of the lab's tasks and calls the
    student's function wherever it needs one: which of the student's functions of *other*
    tasks the running test made minickpt call (a fault in any of them can fail it). Empty
    elsewhere, and when there were none."""
    import re
    import sys

    graded = sys.modules.get("minickpt._graded")
    test = graded.current_test() if graded is not None else None
    m = re.match(r"test_(\d+)_(\d+)", test or "")
    if not m:
        return ""
    own = f"{m.group(1)}.{m.group(2)}"
    others = [f"Task {task} {name}" for t, task, name in list(graded.CALLED)
              if t == test and task != own]
    if not others:
        return ""
    return (f" [this test runs your {', '.join(others)} too: under the grader minickpt holds none "
            f"of this lab's tasks and calls your function wherever it needs one]")



def check(ok: Any, message: str) -> None:
    """Fail with ``message`` unless ``ok`` is exactly ``True`` (not merely truthy)."""
    if ok is not True and not (isinstance(ok, (bool, np.bool_)) and bool(ok)):
        raise LabCheckError(message)


class Raised:
    """What :func:`expect_raises` caught (``value``), once the block has ended."""

    value: BaseException | None = None


@contextlib.contextmanager
def expect_raises(exc_type: type[BaseException] | tuple[type[BaseException], ...],
                  message: str) -> Iterator[Raised]:
    """The block must raise ``exc_type``; anything else fails with ``message`` and what
    happened instead."""
    caught = Raised()
    try:
        yield caught
    except exc_type as e:
        caught.value = e
        return
    except Exception as e:
        raise LabCheckError(f"{message} (it raised {type(e).__name__}: {e})") from None
    raise LabCheckError(f"{message} (nothing was raised)")


def same(value: Any, expected: Any) -> bool:
    """Equality that also requires the same types, recursively (sets, lists, tuples, dicts),
    so an object that claims to equal everything does not pass."""
    if type(value) is not type(expected):
        return False
    if isinstance(expected, (set, frozenset)):
        return all(any(same(v, e) for e in expected) for v in value) and \
            len(value) == len(expected)
    if isinstance(expected, (list, tuple)):
        return len(value) == len(expected) and all(
            same(v, e) for v, e in zip(value, expected, strict=True))
    if isinstance(expected, dict):
        return value.keys() == expected.keys() and all(same(value[k], expected[k])
                                                       for k in expected)
    if isinstance(expected, float):
        return bool(value == expected or (value != value and expected != expected))
    return bool(value == expected)


def close_to(value: Any, expected: float, rel: float) -> bool:
    """A number (int or float, not a bool or an imposter) within ``rel`` of ``expected``."""
    if type(value) not in (int, float):
        return False
    return abs(float(value) - expected) <= rel * abs(expected)


def check_choice(name: str, value: Any, options: str) -> None:
    """A quiz answer that is one letter among ``options``."""
    check(type(value) is str and len(value) == 1 and value in options,
          f"{name} should be one letter among {', '.join(repr(o) for o in options)} "
          f"(a str), got {value!r}")


def check_choices(name: str, value: Any, options: str) -> None:
    """A quiz answer that is a set of letters among ``options``."""
    check(type(value) in (set, frozenset) and len(value) > 0 and
          all(type(v) is str and len(v) == 1 and v in options for v in value),
          f"{name} should be a non-empty set of letters among "
          f"{', '.join(repr(o) for o in options)}, such as {{'A', 'C'}}; got {value!r}")


def is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def tree_diff(got: Any, want: Any, *, rtol: float = 0.0) -> str | None:
    """The first difference between two trees, said for a person, or ``None`` if they are
    identical: same structure and containers, same leaf types, dtypes and shapes, and the
    same bytes (or, with ``rtol``, values that close)."""
    from ..tree import _LIBRARY_FLATTEN, path_str

    ref_flat = _LIBRARY_FLATTEN[0]  # the library's own, even while a student's is in
    try:
        g, w = ref_flat(got), ref_flat(want)
    except Exception as e:  # a structure that is not even a pytree
        return f"cannot compare: {type(e).__name__}: {e}"
    gn, wn = [n for n, _ in g], [n for n, _ in w]
    if gn != wn:
        missing = [path_str(n) for n in wn if n not in set(gn)]
        extra = [path_str(n) for n in gn if n not in set(wn)]
        return (f"the leaves differ: missing {missing[:3]}, unexpected {extra[:3]}"
                if missing or extra else "the leaves come in a different order")
    kinds_got = _kinds(jax.tree_util.tree_structure(got))
    kinds_want = _kinds(jax.tree_util.tree_structure(want))
    if kinds_got != kinds_want:
        return f"the containers differ: got {kinds_got}, expected {kinds_want}"
    for (names, a), (_, b) in zip(g, w, strict=True):
        where = path_str(names)
        if is_key(b):
            if not is_key(a):
                return f"{where}: expected a typed PRNG key, got {type(a).__name__}"
            if str(jax.random.key_impl(a)) != str(jax.random.key_impl(b)):
                return f"{where}: key implementation differs"
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        if isinstance(b, (bool, int, float, complex, str)) and not hasattr(b, "dtype"):
            if not same(a, b):
                return f"{where}: expected {b!r} ({type(b).__name__}), got {a!r}"
            continue
        if isinstance(b, jax.Array) and not isinstance(a, jax.Array):
            return f"{where}: expected a jax.Array, got {type(a).__name__}"
        if not hasattr(a, "dtype") or not hasattr(a, "shape"):
            return f"{where}: expected an array, got {type(a).__name__}"
        x, y = np.asarray(a), np.asarray(b)
        if x.dtype != y.dtype:
            return f"{where}: dtype {x.dtype}, expected {y.dtype}"
        if x.shape != y.shape:
            return f"{where}: shape {x.shape}, expected {y.shape}"
        if rtol == 0.0 or not np.issubdtype(y.dtype, np.inexact):
            if x.tobytes() != y.tobytes():
                return f"{where}: the values differ (not bit for bit identical)"
        elif not np.allclose(x.astype(np.float64), y.astype(np.float64), rtol=rtol, atol=0,
                             equal_nan=True):
            return f"{where}: the values differ by more than {rtol:g} relative"
    return None


def _kinds(td: Any) -> Any:
    """The container types of a tree structure, without the static data (a TrainState's
    apply_fn and tx differ between two models, yet their states compare)."""
    data = td.node_data()
    if data is None:
        return "*"
    return (data[0].__name__, tuple(_kinds(c) for c in td.children()))
