"""Lab 3's example submissions: one typical mistake per task and the two ends (``partial``:
written independently, in ``independent.py``)."""

from __future__ import annotations

from typing import Any

from .common import Edit, Wrong, _cell, _replace, blank, perfect, swap, wrong_examples
from .hostile import ISSUE_20, JUDGED

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


# -- issue 39: plausible wrong versions of every task, each breaking one clause --------------
_DAMAGE = "        except (CheckpointCorruptedError, CheckpointTooLargeError) as e:"
_FINAL = ('    raise CheckpointCorruptedError(directory, "no checkpoint can be restored (damaged, or too "\n'
          '                                   "large):\\n  " + "\\n  ".join(errors))')
_HINT = ('        hint = "Fix the rename rules (each saved path onto the new model\'s path)"\n'
         '        if "dtype" in kinds:\n'
         '            hint += ", or pass allow_cast=True to cast dtypes (each cast is reported)"\n'
         '        if "missing" in kinds:\n'
         '            hint += ", or pass fill_missing=True to keep the new model\'s initial values"\n')
_DUPS = ('    problems: list[Mismatch] = [Mismatch(new, "duplicate", saved=" and ".join(olds[new]),\n'
         '                                         expected="one saved leaf") for new in dup]\n')

WRONG: list[Wrong] = [
    # 3.1 restore_newest_valid
    Wrong("3.1", "only damage (or too large) is given up: any other error propagates unchanged "
          "(issue 39: except Exception)", swap("task_3_1", *ANY_ERROR)),
    Wrong("3.1", "with fallback=False nothing is given up and the step's own error propagates "
          "(not a new CheckpointCorruptedError)",
          swap("task_3_1", "            if not fallback:\n                raise\n"
               "            errors.append(f\"step {s}: {e}\")\n",
               "            errors.append(f\"step {s}: {e}\")\n"
               "            if not fallback:\n                break  # the one error below says why\n")),
    Wrong("3.1", "a program bug (KeyError, ValueError) says nothing about the checkpoint: it "
          "propagates, no fallback",
          swap("task_3_1", _DAMAGE, "        except (CheckpointCorruptedError, CheckpointTooLargeError,"
               " KeyError, ValueError) as e:  # a bad manifest")),
    Wrong("3.1", "only too large *for this checkpoint* is given up: a plain MemoryError (the "
          "program ran out now) propagates (fresh-student trial)",
          swap("task_3_1", _DAMAGE, "        except (CheckpointCorruptedError, MemoryError) as e:"
               "  # too large to restore")),
    Wrong("3.1", "a file that is missing or unreadable *now* (ENOENT, EACCES) says the disk or "
          "the caller is failing: it propagates (fresh-student trial)",
          swap("task_3_1", _DAMAGE, "        except (CheckpointCorruptedError, CheckpointTooLargeError,"
               " FileNotFoundError, PermissionError) as e:  # a file of the step is gone")),
    Wrong("3.1", "the one final error names every step tried *and why it failed*",
          swap("task_3_1", _FINAL,
               '    raise CheckpointCorruptedError(directory, "no checkpoint can be restored: "\n'
               '                                   + ", ".join(f"step {s}" for s in order))')),
    # 3.2 check_structure
    Wrong("3.2", "one error holding every difference (not the first one alone)",
          swap("task_3_2", *FIRST_ONLY)),
    Wrong("3.2", "the unexpected saved leaves come in the checkpoint's order (not sorted by name)",
          swap("task_3_2", "        problems += [Mismatch(path_str(n), \"unexpected\") for n in saved "
               "if n not in wanted]",
               "        problems += [Mismatch(path_str(n), \"unexpected\") for n in sorted(set(saved) "
               "- wanted)]")),
    Wrong("3.2", "the pairs come in the target's leaf order (not sorted by saved index)",
          swap("task_3_2", "    return pairs",
               "    return sorted(pairs, key=lambda p: p[1])  # in file order: one sequential read")),
    Wrong("3.2", "the hint follows from what the whole list holds (any missing/unexpected), not "
          "from its first problem",
          swap("task_3_2", 'if any(m.kind in ("missing", "unexpected") for m in problems) else',
               'if problems[0].kind in ("missing", "unexpected") else')),
    # 3.3 resume
    Wrong("3.3", "goes on from the newest *valid* checkpoint: the manager's fallback past a "
          "damaged newest one (issue 39: an explicit latest_step())",
          swap("task_3_3", '    restored = mngr.restore(target={"state": state, "rng": rng})',
               '    restored = mngr.restore(mngr.latest_step(), target={"state": state, "rng": rng})')),
    Wrong("3.3", "errors of the restore itself (every checkpoint damaged) propagate: no silent "
          "fresh start",
          swap("task_3_3", '    restored = mngr.restore(target={"state": state, "rng": rng})',
               '    try:\n'
               '        restored = mngr.restore(target={"state": state, "rng": rng})\n'
               '    except CheckpointCorruptedError:  # nothing usable: start again\n'
               '        return state, rng, 1')),
    Wrong("3.3", "the checkpoint's own step is never computed again: the first step is "
          "t_ckpt + 1", swap("task_3_3", *AT_T_CKPT)),
    Wrong("3.3", "everything the next update reads comes back: Adam's moments too, not the "
          "parameters alone", swap("task_3_3", *PARAMS_ONLY_RESUME)),
    Wrong("3.3", "goes on from the checkpoint on disk: recomputing the run from the fresh "
          "state is right only for the one run a test starts from (issue 38: it passes the "
          "kernel's drill; the grader's own drill starts from another run's checkpoint)",
          swap("task_3_3", '    return saved, restored["rng"], t_ckpt + 1',
               "    # the run is deterministic: compute it again from the fresh state, bit for bit\n"
               "    redone, key, _ = mc.demo.train(state, rng, 0, t_ckpt)\n"
               "    return redone, key, t_ckpt + 1")),
    # 3.4 migrate
    Wrong("3.4", "each path two saved leaves were renamed onto is a 'duplicate' problem, also "
          "one the target lacks (issue 39)",
          swap("task_3_4", _DUPS + "    flat, treedef = jax.tree_util.tree_flatten_with_path(target)\n",
               "    flat, treedef = jax.tree_util.tree_flatten_with_path(target)\n"
               "    in_target = {path_str(path_names(p)) for p, _ in flat}  # a clash nobody reads\n"
               "    problems: list[Mismatch] = [Mismatch(new, \"duplicate\", saved=\" and \".join(olds[new]),\n"
               "                                         expected=\"one saved leaf\") for new in dup\n"
               "                                if new in in_target]\n")),
    Wrong("3.4", "the optimizer state migrates with its parameters (Adam's moments kept)",
          swap("task_3_4", *PARAMS_ONLY)),
    Wrong("3.4", "the hint names the knobs that apply: allow_cast=True only for a dtype, "
          "fill_missing=True only for a missing leaf",
          swap("task_3_4", _HINT,
               '        hint = ("Fix the rename rules, or pass allow_cast=True to cast dtypes, or "\n'
               '                "fill_missing=True to keep the new model\'s initial values")\n')),
    Wrong("3.4", "report.renamed lists each saved path the rules *changed*, not every leaf "
          "(fresh-student trial)",
          swap("task_3_4", "        if new != old:\n            report.renamed[old] = new\n",
               "        report.renamed[old] = new\n")),
    Wrong("3.4", "one error lists every problem found: duplicates together with the others",
          swap("task_3_4", _DUPS,
               _DUPS + "    if problems:  # a rename clash makes the rest meaningless\n"
               "        raise StructureMismatchError(\"migration\", problems, \"Fix the rename rules.\")\n")),
]


EXAMPLES: dict[str, Edit] = {
    "perfect": perfect, "blank": blank,
    "falls_back_on_io_error": falls_back_on_io_error, "resumes_at_t_ckpt": resumes_at_t_ckpt,
    "restores_params_only": restores_params_only,
    "migrates_params_only": migrates_params_only,
    **wrong_examples(WRONG),  # issue 39: wrong_a ... wrong_d, one wrong version per task each
    **ISSUE_20,  # issue 20's four classes in one submission (cheap: see make_examples)
    **JUDGED,  # issue 47: the kernel liar
}
