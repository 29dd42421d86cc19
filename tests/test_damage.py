"""Damage, case by case: each one detected by verify (API and CLI) and by restore, with an
error naming the file and the leaf; restore falls back to the newest valid checkpoint."""

import os
import shutil
import warnings

import numpy as np
import pytest
from crash_harness import (
    DAMAGE,
    SHARDED_DAMAGE,
    add_figures,
    build_run,
    build_sharded_run,
    check_damage,
    check_items,
    items,
)

from minickpt import CheckpointManager, CheckpointManagerOptions


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    d = tmp_path_factory.mktemp("damage") / "run"
    build_run(str(d))
    return str(d)


@pytest.mark.parametrize("case", DAMAGE, ids=[c.name for c in DAMAGE])
def test_damage_is_detected_named_and_skipped(case, template, tmp_path):
    wrong = check_damage(case, template, str(tmp_path))
    add_figures(**{"damage cases detected": not wrong})
    assert not wrong, "\n".join(wrong)


@pytest.fixture(scope="module")
def sharded_template(tmp_path_factory):
    d = tmp_path_factory.mktemp("damage-sharded") / "run"
    build_sharded_run(str(d))
    return str(d)


@pytest.mark.parametrize("case", SHARDED_DAMAGE, ids=[c.name for c in SHARDED_DAMAGE])
def test_damage_to_a_multi_process_checkpoint_is_detected_named_and_skipped(
        case, sharded_template, tmp_path):
    wrong = check_damage(case, sharded_template, str(tmp_path))
    add_figures(**{"damage cases detected": not wrong})
    assert not wrong, "\n".join(wrong)


def test_the_table_covers_every_kind_of_damage():
    kinds = " ".join(c.name for c in DAMAGE)
    for needle in ["bit flip", "truncated", "deleted", "manifest lies about a shape",
                   "manifest lies about an offset", "metadata lies", "metadata deleted",
                   "manifest deleted", "from another step", "zeros"]:
        assert needle in kinds, needle
    assert len(DAMAGE) >= 40


def test_a_flip_in_alignment_padding_is_harmless(template, tmp_path):
    """Padding between leaves carries no data: a flip there changes nothing restored."""
    run = tmp_path / "run"
    shutil.copytree(template, run)
    data = run / "step_3" / "params" / "data.bin"  # b: bytes 0..56, padding 56..64
    raw = bytearray(data.read_bytes())
    raw[60] ^= 0xFF
    data.write_bytes(bytes(raw))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = CheckpointManager(run, CheckpointManagerOptions(read_only=True))
        r = m.restore(3)
    check_items(r, 3)


def test_metadata_written_before_it_carried_a_checksum_still_reads(template, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(template, run)
    meta = run / "step_3" / "_CHECKPOINT_METADATA"
    text = meta.read_text()
    cut = text.rindex('"metadata_crc32"')
    meta.write_text(text[:cut].rstrip().rstrip(",") + "\n}\n")
    m = CheckpointManager(run, CheckpointManagerOptions(read_only=True))
    assert m.verify(3).ok
    check_items(m.restore(3), 3)


def test_every_checkpoint_damaged_is_a_clear_error(template, tmp_path):
    from minickpt import CheckpointCorruptedError

    run = tmp_path / "run"
    shutil.copytree(template, run)
    for s in (1, 2, 3):
        os.truncate(run / f"step_{s}" / "opt" / "data.bin", 3)
    m = CheckpointManager(run, CheckpointManagerOptions(read_only=True))
    with pytest.warns(UserWarning), pytest.raises(CheckpointCorruptedError) as e:
        m.restore()
    assert all(f"step {s}" in str(e.value) for s in (1, 2, 3))


def test_restored_values_are_the_saved_ones(template):
    m = CheckpointManager(template, CheckpointManagerOptions(read_only=True))
    for s in (1, 2, 3):
        check_items(m.restore(s), s)
    assert np.array_equal(m.restore(2)["params"]["w"], items(2)["params"]["w"])


@pytest.mark.timeout(120)
def test_a_damaged_metadata_file_is_set_aside_so_the_resumed_run_saves_again(tmp_path):
    """A flipped byte anywhere in the newest step's metadata (its format name or version
    included) is damage, not a newer format: the fallback moves the step aside, and the run
    that resumed from the step before saves that step again (found by a student: a flip at
    byte 5 left step 4 in place, so save(3) returned False and save(4) raised)."""
    def run(where):
        d = tmp_path / f"run-{where}"
        with CheckpointManager(d) as m:
            m.save(2, {"x": {"w": np.full(3, 2.0)}})
            m.save(4, {"x": {"w": np.full(3, 4.0)}})
        meta = d / "step_4" / "_CHECKPOINT_METADATA"
        raw = bytearray(meta.read_bytes())
        raw[raw.index(where) + len(where) + 3] ^= 0x01  # the value's second character
        meta.write_bytes(bytes(raw))
        with CheckpointManager(d) as m, warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            assert m.restore().step == 2
            assert m.all_steps() == [2], where
            assert m.save(4, {"x": {"w": np.full(3, 4.5)}})
        assert any(".minickpt-damaged-" in n for n in os.listdir(d))

    for where in (b'"format"', b'"format_version"', b'"step"'):
        run(where)
