"""``partial`` written independently (issue 31): each lab's honest half-done submission, its
task cells written from the released lab alone (the task text, its docstring, the visible
tests), not from minickpt's source — other structure, other names, some tasks wrong or left
blank — so that the similarity report has a real case of honest work it must not flag.
The quiz answers are the reference's but for a few wrong ones. The expected rows are in each
lab's ``autograder/examples/expected-<lab>.csv``.

:data:`EXAMPLES` (``{lab: {"partial": edit}}``, gathered by ``make_examples.CROSS_LAB``)
replaces the lab module's own ``partial`` for the labs listed here.
"""

from __future__ import annotations

from typing import Any

from .common import Edit, _answers, _cell, perfect

LAB3_NEWEST = """def restore_newest_valid(directory: str, steps: Iterable[int],
                         restore_step: Callable[[int], Any], *, fallback: bool = True,
                         on_skip: Callable[[int, BaseException], None] | None = None
                         ) -> tuple[int, Any]:
    \"\"\"Task 3.1 — mine: newest first; only verified damage moves on to an older step.\"\"\"
    candidates = sorted(set(steps))
    if len(candidates) == 0:
        raise CheckpointNotFoundError(f"{directory}: nothing saved yet")
    why = {}
    while candidates:
        step = candidates.pop()
        try:
            value = restore_step(step)
        except (CheckpointCorruptedError, CheckpointTooLargeError) as err:
            if not fallback:
                raise
            why[step] = err
            if on_skip:
                on_skip(step, err)
            continue
        return step, value
    listed = "; ".join(f"step {s}: {e}" for s, e in why.items())
    raise CheckpointCorruptedError(directory, f"every checkpoint is damaged or too large: {listed}")
"""
LAB3_STRUCTURE = """def check_structure(manifest: Manifest, target: Any, *, item: str = "",
                    partial: bool = False) -> list[tuple[Names, int]]:
    \"\"\"Task 3.2 — mine: pair each target leaf with the saved one of the same path.\"\"\"
    index = manifest.by_path
    out = []
    seen = set()
    for names, leaf in flatten_with_names(target):
        seen.add(names)
        if names not in index:  # (stops at the first problem: one fix per run)
            raise StructureMismatchError(item, [Mismatch(path_str(names), "missing")])
        trouble = compare_leaf(path_str(names), manifest.entries[index[names]], expect_of(leaf))
        if trouble:
            raise StructureMismatchError(item, trouble[:1])
        out.append((names, index[names]))
    extra = [n for n in index if n not in seen]
    if extra and not partial:
        raise StructureMismatchError(item, [Mismatch(path_str(extra[0]), "unexpected")])
    return out
"""
LAB3_RESUME = """def resume(mngr: Any, state: Any, rng: Any) -> tuple[Any, Any, int]:
    \"\"\"Task 3.3 — mine: start fresh, or go on after the newest checkpoint.\"\"\"
    if mngr.latest_step() is None:
        return state, rng, 1
    back = mngr.restore(target={"state": state, "rng": rng})
    step = back.step
    counter = int(back["state"].step)
    if counter != step:
        raise ValueError(f"checkpoint {step} holds a state at step {counter}: wrong number")
    return back["state"], back["rng"], step + 1
"""


def lab03_partial(release: Any, source: Any) -> Any:
    """3.1 and 3.3 right; 3.2 stops at the first mismatch; 3.4 not attempted; 6 of 9 quiz
    answers right (Q2: "the RNG key was not restored", Q5: falls back on EIO, Q8: 35, the
    loop's step rather than the state's counter)."""
    nb = perfect(release, source)
    _cell(nb, "task_3_1").source = LAB3_NEWEST
    _cell(nb, "task_3_2").source = LAB3_STRUCTURE
    _cell(nb, "task_3_3").source = LAB3_RESUME
    _cell(nb, "task_3_4").source = _cell(release, "task_3_4").source
    _answers(nb, Q2='"C"', Q5='"A"', Q8="35")
    return nb


LAB4_AGREE = '''def agree_on_step(steps: Sequence[int]) -> int:
    """Task 4.1 — mine: one step for everybody, or an error that says who wanted which."""
    wanted = list(steps)
    if not wanted:
        raise ValueError("nobody said which step to save")
    first = wanted[0]
    if [i for i, step in enumerate(wanted) if step != first]:
        raise ProcessDisagreementError("the step to save", wanted)
    return first  # (no check of what a step is: True and 5.0 pass)
'''
LAB4_OWNED = '''def owned_shards(shape: Sequence[int], devices_indices_map: Mapping[Any, Sequence[slice]],
                 process_index: int, *,
                 process_of: Callable[[Any], int] = lambda d: d.process_index
                 ) -> list[tuple[Box, Any]]:
    """Task 4.2 — mine: a piece belongs to the first device listed with it."""
    owner: dict[Box, Any] = {}
    for dev, idx in devices_indices_map.items():
        owner.setdefault(box_of(idx, shape), dev)
    return [(b, dev) for b, dev in owner.items() if process_of(dev) == process_index]
'''
LAB4_REGION = '''def region_from_pieces(box: Box, dtype: np.dtype,
                       pieces: Sequence[tuple[Box, Callable[[Box], np.ndarray]]]) -> np.ndarray:
    """Task 4.4 — mine: copy the overlap of every saved piece into the region."""
    result = aligned_empty(box_shape(box), dtype)
    for saved, read in pieces:
        lo = [max(s[0], b[0]) for s, b in zip(saved, box)]
        hi = [min(s[1], b[1]) for s, b in zip(saved, box)]
        if all(a < z for a, z in zip(lo, hi)):
            where = tuple(slice(a - b[0], z - b[0]) for a, z, b in zip(lo, hi, box))
            result[where] = read(tuple(zip(lo, hi)))
    return result
'''


def lab04_partial(release: Any, source: Any) -> Any:
    """4.1 without the type checks (2 of 4), 4.2 and 4.4 right, 4.3 left blank; 5 of 7 quiz
    answers right."""
    nb = perfect(release, source)
    _cell(nb, "task_4_1").source = LAB4_AGREE
    _cell(nb, "task_4_2").source = LAB4_OWNED
    _cell(nb, "task_4_3").source = _cell(release, "task_4_3").source
    _cell(nb, "task_4_4").source = LAB4_REGION
    _answers(nb, Q3="2.0", Q6='{"A", "C"}')
    return nb


EXAMPLES: dict[str, dict[str, Edit]] = {
    "lab03_resume": {"partial": lab03_partial},
    "lab04_multihost": {"partial": lab04_partial},
}
