"""Full disks and I/O errors: injected at every call of a save, and for real on a tiny
file system mounted by the test (tmpfs, ext4 in a loop image) where the machine allows."""

import errno
import os

import pytest
from crash_harness import (
    SHARD_PROCESSES,
    SkipCase,
    add_figures,
    build_sharded_run,
    check_collective_save_fault,
    check_real_full_disk,
    check_save_fault,
    collective_save_call_count,
    save_call_count,
    scratch,
    small_filesystem,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("persistent", [False, True], ids=["one-error", "disk-stays-full"])
@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO], ids=["ENOSPC", "EIO"])
def test_an_error_at_any_call_of_a_save_is_clean(err, persistent, tmp_path):
    n = save_call_count()
    assert n > 40
    failures, tried = [], 0
    with scratch(str(tmp_path)) as d:
        for k in range(n):
            wrong = check_save_fault(os.path.join(d, f"k{k}"), k, err, persistent=persistent)
            if wrong == ["the fault was never reached"]:
                continue  # persistent mode counts only write-like calls: fewer points
            tried += 1
            failures += [f"fault at call {k}: {w}" for w in wrong]
    add_figures(**{"I/O errors injected (ENOSPC, EIO)": tried,
                   "I/O errors handled cleanly": tried - len({f.split(":")[0]
                                                              for f in failures})})
    assert not failures, "\n".join(failures[:20])
    assert tried > (10 if persistent else 40)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["tmpfs", "ext4"])
def test_a_really_full_disk(kind, tmp_path):
    try:
        with small_filesystem(kind, str(tmp_path / "mnt"), size_mb=2 if kind == "tmpfs" else 4):
            wrong, met = check_real_full_disk(str(tmp_path / "mnt"))
    except SkipCase as e:
        pytest.skip(str(e))
    add_figures(**{f"real full disks ({kind}) handled": not wrong})
    assert met == errno.ENOSPC
    assert not wrong, "\n".join(wrong)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("process", range(SHARD_PROCESSES), ids=lambda p: f"process{p}")
@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO], ids=["ENOSPC", "EIO"])
def test_an_error_at_any_call_of_a_multi_process_save_is_clean(err, process, tmp_path):
    """The same for a save by several processes: whichever process meets the error, every
    process raises it (errno kept), nothing is committed or left over, nothing is retired."""
    with scratch(str(tmp_path)) as d:
        template = os.path.join(d, "template")
        build_sharded_run(template, (1, 2))
        n = collective_save_call_count(template, os.path.join(d, "count"), process)
        failures, tried = [], 0
        for k in range(n):
            reached, wrong = check_collective_save_fault(template, os.path.join(d, f"k{k}"),
                                                         process, k, err)
            tried += reached
            failures += [f"fault at call {k}: {w}" for w in wrong]
    add_figures(**{"I/O errors injected into multi-process saves": tried,
                   "I/O errors in multi-process saves handled cleanly":
                       tried - len({f.split(":")[0] for f in failures})})
    assert not failures, "\n".join(failures[:20])
    assert tried == n > 10
