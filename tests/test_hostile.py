"""Hostile checkpoints, handed over by someone else: refused with a clear error (or, when
harmless, ignored), nothing executed, nothing outside the run read or written — through the
Checkpointer, a read-only manager, and every CLI command."""

import os
import shutil

import pytest
from crash_harness import (
    HOSTILE,
    SHARDED_HOSTILE,
    AuditFileSystem,
    SkipCase,
    _snapshot,
    add_figures,
    build_run,
    build_sharded_run,
    check_hostile,
    check_items,
    items,
)

from minickpt import CheckpointManager, CheckpointManagerOptions

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile") / "run"
    build_run(str(d))
    return str(d)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", HOSTILE, ids=[c.name for c in HOSTILE])
def test_hostile_checkpoint_is_refused_and_contained(case, template, tmp_path):
    try:
        wrong = check_hostile(case, template, str(tmp_path))
    except SkipCase as e:
        pytest.skip(str(e))
    add_figures(**{("hostile inputs refused" if case.refused else
                    "hostile inputs ignored harmlessly"): not wrong})
    assert not wrong, "\n".join(wrong)


@pytest.fixture(scope="module")
def sharded_template(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile-sharded") / "run"
    build_sharded_run(str(d))
    return str(d)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", SHARDED_HOSTILE, ids=[c.name for c in SHARDED_HOSTILE])
def test_hostile_multi_process_checkpoint_is_refused_and_contained(case, sharded_template,
                                                                    tmp_path):
    try:
        wrong = check_hostile(case, sharded_template, str(tmp_path))
    except SkipCase as e:
        pytest.skip(str(e))
    add_figures(**{("hostile inputs refused" if case.refused else
                    "hostile inputs ignored harmlessly"): not wrong})
    assert not wrong, "\n".join(wrong)


def _outside(tmp_path):
    out = tmp_path / "outside"
    (out / "sub").mkdir(parents=True)
    (out / "precious.txt").write_text("keep me")
    (out / "sub" / "also.txt").write_text("keep me too")
    return out


def test_cleanup_unlinks_symlinked_temporaries_never_their_targets(tmp_path):
    out = _outside(tmp_path)
    run = tmp_path / "run"
    build_run(str(run), (1,))
    (run / "step_2.minickpt-tmp-evil").symlink_to(out)
    (run / "step_3.minickpt-del-evil").symlink_to(out / "precious.txt")
    junk = run / "step_4.minickpt-tmp-mixed"
    junk.mkdir()
    (junk / "link").symlink_to(out)
    before = _snapshot(str(out))
    fs = AuditFileSystem(str(run))
    with CheckpointManager(run, fs=fs) as m:
        assert len(m.removed_temporaries) == 3 and m.all_steps() == [1]
    assert _snapshot(str(out)) == before and not fs.escapes
    assert sorted(os.listdir(run)) == [".minickpt.lock", "step_1"]
    add_figures(**{"hostile inputs refused": 1})


def test_retention_deletes_a_checkpoint_full_of_symlinks_without_following_them(tmp_path):
    out = _outside(tmp_path)
    run = tmp_path / "run"
    build_run(str(run), (1,))
    (run / "step_1" / "params" / "evil").symlink_to(out)
    (run / "step_1" / "evil.txt").symlink_to(out / "precious.txt")
    (run / "step_9").symlink_to(out)  # a symlinked "step": never listed, never deleted
    before = _snapshot(str(out))
    fs = AuditFileSystem(str(run))
    with CheckpointManager(run, CheckpointManagerOptions(max_to_keep=1), fs=fs) as m:
        assert m.all_steps() == [1]
        m.save(2, items(2))
        assert m.all_steps() == [2]
        check_items(m.restore(), 2)
    assert _snapshot(str(out)) == before and not fs.escapes
    assert (run / "step_9").is_symlink()
    add_figures(**{"hostile inputs refused": 1})


def test_a_symlinked_run_directory_is_the_users_choice(tmp_path):
    """Only links *inside* a checkpoint are refused: the run directory itself may be a link
    (say, to a bigger disk)."""
    real = tmp_path / "disk" / "run"
    build_run(str(real), (1, 2))
    (tmp_path / "run").symlink_to(real)
    m = CheckpointManager(tmp_path / "run", CheckpointManagerOptions(read_only=True))
    check_items(m.restore(), 2)


def test_the_table_covers_every_kind_of_hostility():
    names = " ".join(c.name for c in HOSTILE)
    for needle in ["pickle", "object", "..", "/etc/passwd", "symlink", "10^12", "format_version",
                   "nested", "FIFO", "300 MB", "step directory is a symlink", "item name"]:
        assert needle in names, needle
    assert sum(c.refused for c in HOSTILE) >= 50


def test_nothing_in_minickpt_can_unpickle():
    """No pickle, no np.load(allow_pickle), no eval anywhere a checkpoint is read."""
    import minickpt

    root = os.path.dirname(minickpt.__file__)
    names = sorted(os.path.relpath(os.path.join(d, f), root)
                   for d, _, files in os.walk(root) for f in files if f.endswith(".py"))
    assert "format/read.py" in names and "labkit/lab4.py" in names  # the sub-packages too
    for name in names:
        if name.endswith(".py"):
            text = open(os.path.join(root, name)).read()
            for bad in ("import pickle", "pickle.load", "np.load(", "allow_pickle=True",
                        "eval(", "exec(", "__import__("):
                if name.startswith("labkit" + os.sep) and bad == "exec(":
                    # the labs' test drivers run the student's own cell in a subprocess
                    # (labs 3 and 4): student code, never anything read from a checkpoint
                    continue
                assert bad not in text, f"{name} uses {bad}"


def test_copy_of_template_is_untouched(template, tmp_path):
    """The module's template stays intact across cases (each case works on a copy)."""
    shutil.copytree(template, tmp_path / "run")
    m = CheckpointManager(tmp_path / "run", CheckpointManagerOptions(read_only=True))
    assert [m.verify(s).ok for s in (1, 2, 3)] == [True, True, True]


def test_step_names_other_than_this_managers_still_restore(tmp_path):
    """A run saved as step_00000042 read by a manager that would write step_42: listed AND
    restorable (before, it was listed but restore() failed with not-found)."""
    from minickpt import CheckpointManagerOptions as O

    with CheckpointManager(tmp_path, O(step_format_fixed_length=8)) as m:
        m.save(42, items(42))
    m = CheckpointManager(tmp_path, O(read_only=True))
    assert m.all_steps() == [42] and m.verify(42).ok
    check_items(m.restore(), 42)
    check_items(m.restore(42), 42)
