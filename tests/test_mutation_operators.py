"""Issue 48: the harness's own mutation operators make the mistakes they are named for, and
a mutant runs as a function of the reference's module (what the report's numbers rest on)."""

from __future__ import annotations

import pytest

from autograder.mutation import mutants as M
from autograder.mutation import operators as ops

CASES = [
    ("RemoveStatement", "def f(fs, fd):\n    fs.fsync(fd)\n    return fd\n",
     "def f(fs, fd):\n    pass\n    return fd\n"),
    ("RemoveStatement", "def f(w, e):\n    w.error = e\n", "def f(w, e):\n    pass\n"),
    ("RemoveRaise", "def f(x):\n    if x:\n        raise KeyError(x)\n",
     "def f(x):\n    if x:\n        pass\n"),
    ("WidenRaisedException", "def f():\n    raise StepAlreadyExistsError('taken')\n",
     "def f():\n    raise Exception('taken')\n"),
    ("WidenCaughtException", "try:\n    g()\nexcept FileNotFoundError:\n    pass\n",
     "try:\n    g()\nexcept Exception:\n    pass\n"),
    ("NoneCheckToTruthiness", "if step is not None:\n    pass\n", "if step:\n    pass\n"),
    ("NoneCheckToTruthiness", "if latest is None:\n    pass\n", "if not latest:\n    pass\n"),
    ("ReplaceInWithNotIn", "ok = a in b\n", "ok = a not in b\n"),
    ("SwapArguments", "fs.rename(tmp, final)\n", "fs.rename(final, tmp)\n"),
    ("RemoveWrappingCall", "y = _copy(x)\n", "y = x\n"),
    ("RemoveMethodCopy", "y = x.copy()\n", "y = x\n"),
    ("RemoveWith", "with w._lock:\n    w.e = None\n", "if True:\n    w.e = None\n"),
    ("ReturnNone", "def f(t):\n    return t\n", "def f(t):\n    return None\n"),
]


@pytest.mark.parametrize(("name", "before", "after"), CASES)
def test_each_harness_operator_makes_its_mistake(name, before, after):
    op = dict(ops.operators())[name]
    assert ops.is_harness_operator(name)
    assert ops.mutate(before, op(), 0) == after


def test_a_with_that_binds_a_name_is_not_removed():
    # without it the name is undefined: a NameError says nothing about the tests
    op = dict(ops.operators())["RemoveWith"]
    assert ops.mutate("with open(p) as f:\n    f.read()\n", op(), 0) is None


def test_the_narrowed_except_names_an_exception_nothing_raises():
    op = dict(ops.operators())["ExceptionReplacer"]
    out = ops.mutate("try:\n    g()\nexcept OSError:\n    pass\n", op(), 0)
    assert out is not None and ops.NEVER_RAISED in out
    with pytest.raises(OSError):  # the mutant's except no longer catches it
        exec(compile(out.replace("g()", "raise OSError()"), "<t>", "exec"), {})


def test_a_mutant_runs_in_its_references_module_and_ids_are_stable():
    from minickpt.policy import should_save

    ms = list(M.mutants_of("2.1", should_save))
    assert ms and len({m.id for m in ms}) == len(ms)
    assert [m.id for m in ms] == [m.id for m in M.mutants_of("2.1", should_save)]
    m = next(m for m in ms if m.operator == "ReplaceComparisonOperator_LtE_Lt")
    fn = M.compile_mutant(m, should_save)
    assert fn.__globals__ is should_save.__globals__ and fn is not should_save
    assert should_save(5, last_saved_step=5) is False and fn(5, last_saved_step=5) is True
