"""Lab 3's example submissions: one typical mistake per task and the two ends (``partial``:
written independently, in ``independent.py``)."""

from __future__ import annotations

from typing import Any

from .common import Edit, _cell, _replace, blank, perfect
from .hostile import ISSUE_20

# 3.1: every exception taken for damage (issue 21's bug 2): an EIO falls back to an older step
ANY_ERROR = ("        except (CheckpointCorruptedError, CheckpointTooLargeError) as e:",
             "        except Exception as e:  # anything that goes wrong: try the previous step")
# 3.2: raises at the first mismatch, so a person fixes one difference per run
FIRST_ONLY = ("        problems += compare_leaf(where, manifest.entries[i], expect_of(leaf))",
              "        problems += compare_leaf(where, manifest.entries[i], expect_of(leaf))\n"
              "        if problems:\n"
              "            raise StructureMismatchError(item, problems[:1])")
FIRST_MISSING = ('            problems.append(Mismatch(where, "missing"))\n            continue',
                 '            raise StructureMismatchError(item, [Mismatch(where, "missing")])')
# 3.3: continues at t_ckpt, computing the checkpoint's own step again
AT_T_CKPT = ("    return saved, restored[\"rng\"], t_ckpt + 1",
             "    return saved, restored[\"rng\"], t_ckpt  # continue from the checkpoint's step")
# 3.3: only the parameters (and the step counter) come back; Adam's moments stay the fresh ones
PARAMS_ONLY_RESUME = ('    restored = mngr.restore(target={"state": state, "rng": rng})\n'
                      '    t_ckpt = restored.step\n'
                      '    saved = restored["state"]',
                      '    restored = mngr.restore(target={"state": {"params": state.params}, "rng": rng},\n'
                      '                            partial=True)\n'
                      '    t_ckpt = restored.step\n'
                      '    saved = state.replace(params=restored["state"]["params"], step=t_ckpt)  # the weights')
# 3.4: only the parameters migrate; Adam's moments start fresh
PARAMS_ONLY = ("        by_new[new] = leaf",
               "        if old.startswith(\"params\"):  # the weights are what matters\n"
               "            by_new[new] = leaf")


def _release_cell(nb: Any, release: Any, grade_id: str) -> None:
    _cell(nb, grade_id).source = _cell(release, grade_id).source


def falls_back_on_io_error(release: Any, source: Any) -> Any:
    """3.1 takes every exception for damage: an EIO silently returns an older step."""
    nb = perfect(release, source)
    _replace(nb, "task_3_1", *ANY_ERROR)
    return nb


def resumes_at_t_ckpt(release: Any, source: Any) -> Any:
    """3.3 returns t_ckpt as the first step: the checkpoint's step is computed twice, and its
    save raises StepAlreadyExistsError in the restarted worker."""
    nb = perfect(release, source)
    _replace(nb, "task_3_3", *AT_T_CKPT)
    return nb


def restores_params_only(release: Any, source: Any) -> Any:
    """3.3 restores the parameters and the step counter and leaves Adam's moments fresh: the run
    trains on, on the same loss scale, and the drill finds it elsewhere than the uninterrupted one."""
    nb = perfect(release, source)
    _replace(nb, "task_3_3", *PARAMS_ONLY_RESUME)
    return nb


def migrates_params_only(release: Any, source: Any) -> Any:
    """3.4 migrates the parameters and leaves Adam's moments fresh (listed as filled)."""
    nb = perfect(release, source)
    _replace(nb, "task_3_4", *PARAMS_ONLY)
    return nb


EXAMPLES: dict[str, Edit] = {
    "perfect": perfect, "blank": blank,
    "falls_back_on_io_error": falls_back_on_io_error, "resumes_at_t_ckpt": resumes_at_t_ckpt,
    "restores_params_only": restores_params_only,
    "migrates_params_only": migrates_params_only,
    **ISSUE_20,  # issue 20's four classes in one submission (cheap: see make_examples)
}
