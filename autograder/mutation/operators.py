"""The mutation operators: cosmic-ray's own (a well-kept tool's, used as its library exposes
them: parso nodes in, parso nodes out) and a few more written to cosmic-ray's ``Operator``
interface for the mistakes issue 48 names that cosmic-ray has no operator for (a removed
statement or call, swapped arguments, a removed ``raise``, an exception widened, ``is None``
read as truthiness, a lock or a copy removed, ``in`` against ``not in``).

Why a curated subset of cosmic-ray's pairs rather than all of them: cosmic-ray replaces every
binary operator by each of the 12 others and every comparison by each of the 7 others. Most of
those pairs make the same point as one of their neighbours (``<`` to ``>=`` says nothing that
``<`` to ``<=`` and ``<`` to ``>`` have not), and each mutant costs a run of the task's test
cells, with JAX, on a 2-core machine shared by a team. The pairs kept are the ones a student
writes by mistake: the bound off by one, the sign, the negation, ``is`` for ``==``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import parso
import parso.python.tree as pt
from cosmic_ray.operators import (
    binary_operator_replacement as cr_binary,
)
from cosmic_ray.operators import (
    boolean_replacer as cr_boolean,
)
from cosmic_ray.operators import (
    break_continue as cr_break,
)
from cosmic_ray.operators import (
    comparison_operator_replacement as cr_comparison,
)
from cosmic_ray.operators import (
    exception_replacer as cr_exception,
)
from cosmic_ray.operators import (
    number_replacer as cr_number,
)
from cosmic_ray.operators import (
    unary_operator_replacement as cr_unary,
)
from cosmic_ray.operators import (
    zero_iteration_for_loop as cr_loop,
)
from cosmic_ray.operators.operator import Example, Operator

NEVER_RAISED = "__import__('cosmic_ray.exceptions').exceptions.CosmicRayTestingException"
"""What cosmic-ray's ExceptionReplacer puts in an ``except`` clause, spelled so that it
resolves in the reference function's own module (no name is added to that module)."""

_COMPARISONS = ("Eq_NotEq", "NotEq_Eq", "Lt_LtE", "LtE_Lt", "Gt_GtE", "GtE_Gt", "Lt_Gt",
                "Gt_Lt", "Is_IsNot", "IsNot_Is", "Is_Eq", "IsNot_NotEq", "Eq_Is", "NotEq_IsNot")
_BINARY = ("Add_Sub", "Sub_Add", "Mul_Div", "Div_Mul", "FloorDiv_Div", "Mod_FloorDiv",
           "Pow_Mul", "BitOr_BitAnd", "BitAnd_BitOr", "BitXor_BitOr", "LShift_RShift",
           "RShift_LShift")


def _leaf(code: str, like: Any) -> pt.Name:
    """A parso leaf printing ``code`` where ``like`` was, with ``like``'s leading whitespace.
    (parso has no public node builder; a leaf's code is its prefix and value.)"""
    first = like.get_first_leaf() if hasattr(like, "get_first_leaf") else like
    return pt.Name(code, like.start_pos, prefix=first.prefix)


def _code(node: Any) -> str:
    """The node's code without its leading whitespace or comments."""
    first = node.get_first_leaf() if hasattr(node, "get_first_leaf") else node
    return node.get_code()[len(first.prefix):]


class HarnessOperator(Operator):
    """An operator of this harness (not cosmic-ray's): one mutation per matching node."""

    def matches(self, node: Any) -> bool:  # pragma: no cover - every subclass overrides it
        raise NotImplementedError

    def replacement(self, node: Any) -> str:  # pragma: no cover
        raise NotImplementedError

    def mutation_positions(self, node: Any) -> Iterator[tuple[tuple[int, int], tuple[int, int]]]:
        if self.matches(node):
            yield (node.start_pos, node.end_pos)

    def mutate(self, node: Any, index: int) -> Any:
        return _leaf(self.replacement(node), node)

    @classmethod
    def examples(cls) -> tuple[Example, ...]:
        return ()


def _is_statement_of_suite(node: Any) -> bool:
    return node.type == "simple_stmt" and node.parent is not None and \
        node.parent.type in ("suite", "file_input")


class RemoveStatement(HarnessOperator):
    """A statement with a side effect left out: a bare call (``fs.fsync(path)``,
    ``f.close()``, ``writer.wait_until_finished()``, ``log.info(...)``), an assignment to an
    attribute or an item (``self.error = e``, ``out[k] = v``), an augmented assignment. A plain
    ``name = ...`` is not removed: the name's next use fails with NameError, which says nothing
    about the tests."""

    def matches(self, node: Any) -> bool:
        if not _is_statement_of_suite(node) or len(node.children) != 2:
            return False
        stmt = node.children[0]
        if stmt.type in ("power", "atom_expr") and stmt.children[-1].type == "trailer" and \
                stmt.children[-1].children[0] == "(":
            return True  # a call made for its effect
        if stmt.type == "expr_stmt":
            op = stmt.children[1]
            target = stmt.children[0]
            if op.type == "operator" and op.value.endswith("=") and op.value != "=":
                return True  # x += 1
            if op == "=" and target.type in ("power", "atom_expr"):
                return True  # obj.attr = ..., d[k] = ...
        return False

    def replacement(self, node: Any) -> str:
        return "pass" + node.children[-1].get_code()


class RemoveRaise(HarnessOperator):
    """``raise ...`` replaced by ``pass``: the error a contract promises is never raised."""

    def matches(self, node: Any) -> bool:
        return node.type == "raise_stmt"

    def replacement(self, node: Any) -> str:
        return "pass"


class WidenRaisedException(HarnessOperator):
    """``raise SomeError(...)`` raises ``Exception(...)`` instead: a caller catching the
    promised type (or a test naming it) no longer can."""

    def matches(self, node: Any) -> bool:
        if node.type != "raise_stmt" or len(node.children) < 2:
            return False
        exc = node.children[1]
        name = exc.children[0] if exc.type in ("power", "atom_expr") else exc
        return name.type == "name" and name.value not in ("Exception", "BaseException") and \
            bool(re.match(r"^[A-Z]\w*(Error|Exception|Exit|Interrupt|Warning)$", name.value))

    def mutate(self, node: Any, index: int) -> Any:
        exc = node.children[1]
        name = exc.children[0] if exc.type in ("power", "atom_expr") else exc
        name.value = "Exception"
        return node


class WidenCaughtException(HarnessOperator):
    """``except SomeError`` catches ``Exception``: errors the contract lets through are
    swallowed (cosmic-ray's ExceptionReplacer gives the narrowing: an exception never raised)."""

    def matches(self, node: Any) -> bool:
        return node.type == "except_clause" and len(node.children) > 1 and \
            _code(node.children[1]) not in ("Exception", "BaseException")

    def mutate(self, node: Any, index: int) -> Any:
        node.children[1] = _leaf("Exception", node.children[1])
        return node


class NoneCheckToTruthiness(HarnessOperator):
    """``x is not None`` becomes ``x`` and ``x is None`` becomes ``not x``: 0, "" and an empty
    list are read as "nothing" (task 1.4's ``if step:``)."""

    def matches(self, node: Any) -> bool:
        if node.type != "comparison" or len(node.children) != 3:
            return False
        op, rhs = node.children[1], node.children[2]
        return _code(op) in ("is", "is not") and rhs.type == "keyword" and rhs.value == "None"

    def replacement(self, node: Any) -> str:
        lhs = _code(node.children[0])
        return lhs if _code(node.children[1]) == "is not" else f"not {lhs}"


class ReplaceInWithNotIn(HarnessOperator):
    """``in`` against ``not in`` (mutmut has it; cosmic-ray does not)."""

    def matches(self, node: Any) -> bool:
        return node.type == "comparison" and len(node.children) == 3 and \
            _code(node.children[1]) in ("in", "not in")

    def mutate(self, node: Any, index: int) -> Any:
        op = node.children[1]
        node.children[1] = _leaf("not in" if _code(op) == "in" else "in", op)
        return node


class SwapArguments(HarnessOperator):
    """The first two positional arguments of a call swapped (``rename(tmp, final)`` as
    ``rename(final, tmp)``)."""

    @staticmethod
    def _args(node: Any) -> list[Any] | None:
        if node.type != "trailer" or node.children[0] != "(" or len(node.children) != 3:
            return None
        arglist = node.children[1]
        if arglist.type != "arglist":
            return None
        args = [a for a in arglist.children if a != ","]
        positional = []
        for a in args:
            if a.type == "argument" or (a.type == "operator"):
                break
            positional.append(a)
        if len(positional) < 2 or _code(positional[0]) == _code(positional[1]):
            return None
        return positional

    def matches(self, node: Any) -> bool:
        return self._args(node) is not None

    def mutate(self, node: Any, index: int) -> Any:
        a, b = self._args(node)[:2]  # type: ignore[index]
        arglist = node.children[1]
        ia, ib = arglist.children.index(a), arglist.children.index(b)
        ca, cb = _code(a), _code(b)
        arglist.children[ia] = _leaf(cb, a)
        arglist.children[ib] = _leaf(ca, b)
        return node


_UNWRAP = {"copy", "_copy", "deepcopy", "array", "ascontiguousarray", "list", "tuple", "sorted",
           "dict", "set", "frozenset", "int", "float", "str", "abs", "bytes"}


class RemoveWrappingCall(HarnessOperator):
    """A call that copies or converts its single argument dropped, the argument kept:
    ``_copy(x)``, ``np.array(x)``, ``list(xs)``, ``sorted(xs)``, ``int(s)``. A removed copy
    is how an async snapshot ends up sharing the buffer a training step overwrites."""

    @staticmethod
    def _arg(node: Any) -> Any | None:
        if node.type not in ("power", "atom_expr"):
            return None
        call = node.children[-1]
        if call.type != "trailer" or call.children[0] != "(" or len(call.children) != 3:
            return None
        name = node.children[-2]
        if name.type == "trailer":
            name = name.children[-1]
        if name.type != "name" or name.value not in _UNWRAP:
            return None
        arg = call.children[1]
        if arg.type in ("arglist", "argument"):
            return None
        return arg

    def matches(self, node: Any) -> bool:
        return self._arg(node) is not None

    def replacement(self, node: Any) -> str:
        arg = _code(self._arg(node))
        return f"({arg})" if " " in arg else arg


class RemoveMethodCopy(HarnessOperator):
    """``x.copy()`` becomes ``x``."""

    def matches(self, node: Any) -> bool:
        if node.type not in ("power", "atom_expr") or len(node.children) < 3:
            return False
        last, before = node.children[-1], node.children[-2]
        return last.type == "trailer" and _code(last) == "()" and before.type == "trailer" and \
            _code(before) in (".copy", ".deepcopy")

    def replacement(self, node: Any) -> str:
        return "".join(c.get_code() for c in node.children[:-2])[len(node.get_first_leaf().prefix):]


class RemoveWith(HarnessOperator):
    """``with lock:`` (a context without ``as``) becomes ``if True:``: the body runs without
    the lock, the suppression, the plug or the clean-up the context gave it."""

    def matches(self, node: Any) -> bool:
        return node.type == "with_stmt" and not any(
            c.type == "with_item" for c in node.children)

    def mutate(self, node: Any, index: int) -> Any:
        colon = node.children.index(next(c for c in node.children if c == ":"))
        node.children[1:colon] = [_leaf("True", node.children[1])]
        node.children[0] = _leaf("if", node.children[0])
        return node


class ReturnNone(HarnessOperator):
    """``return value`` becomes ``return None`` (mutmut's operator)."""

    def matches(self, node: Any) -> bool:
        return node.type == "return_stmt" and len(node.children) == 2 and \
            _code(node.children[1]) != "None"

    def replacement(self, node: Any) -> str:
        return "return None"


def _cosmic(module: Any, names: tuple[str, ...], prefix: str) -> list[type[Operator]]:
    return [getattr(module, f"{prefix}_{n}") for n in names]


def operators() -> list[tuple[str, Callable[[], Operator]]]:
    """Every operator the harness applies, by a stable name (cosmic-ray's class name, or this
    module's), in a fixed order: a mutant's id depends on it."""
    ops: list[type[Operator]] = [
        *_cosmic(cr_comparison, _COMPARISONS, "ReplaceComparisonOperator"),
        *_cosmic(cr_binary, _BINARY, "ReplaceBinaryOperator"),
        cr_unary.ReplaceUnaryOperator_Delete_Not,
        cr_unary.ReplaceUnaryOperator_Delete_USub,
        cr_boolean.AddNot,
        cr_boolean.ReplaceTrueWithFalse,
        cr_boolean.ReplaceFalseWithTrue,
        cr_boolean.ReplaceAndWithOr,
        cr_boolean.ReplaceOrWithAnd,
        cr_break.ReplaceBreakWithContinue,
        cr_break.ReplaceContinueWithBreak,
        cr_exception.ExceptionReplacer,
        cr_number.NumberReplacer,
        cr_loop.ZeroIterationForLoop,
        NoneCheckToTruthiness,
        ReplaceInWithNotIn,
        RemoveStatement,
        RemoveRaise,
        WidenRaisedException,
        WidenCaughtException,
        SwapArguments,
        RemoveWrappingCall,
        RemoveMethodCopy,
        RemoveWith,
        ReturnNone,
    ]
    return [(op.__name__, op) for op in ops]


def is_harness_operator(name: str) -> bool:
    """Whether the operator is this module's rather than cosmic-ray's (the report says which)."""
    return name in globals() and isinstance(globals()[name], type) and \
        issubclass(globals()[name], HarnessOperator)


def mutate(source: str, operator: Operator, occurrence: int) -> str | None:
    """``source`` with the ``occurrence``-th mutation of ``operator`` applied, or None when
    there are no more (cosmic-ray's own walk: one mutation per walk)."""
    from cosmic_ray.mutating import mutate_code

    out = mutate_code(source, operator, occurrence)
    if out is not None:
        out = out.replace("CosmicRayTestingException", NEVER_RAISED) \
            if "CosmicRayTestingException" not in source else out
    return out


__all__ = ["is_harness_operator", "mutate", "operators", "parso"]
