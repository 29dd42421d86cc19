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

LAB1_BODIES = {
    "flatten_with_names": """    pairs = []
    known = set()
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = path_names(key_path)
        if names in known:
            raise ValueError(f"the key path {path_str(names)!r} appears twice: they must differ")
        known.add(names)
        pairs.append((names, leaf))
    return pairs
""",
    "unflatten_like": """    flat, structure = jax.tree_util.tree_flatten_with_path(target)
    new = []
    for key_path, _old in flat:
        names = path_names(key_path)
        if names not in values:
            raise KeyError(f"nothing saved for {path_str(names)!r}")
        new.append(values[names])
    return jax.tree_util.tree_unflatten(structure, new)
""",
    "to_host": """    if x is None or isinstance(x, (*SCALAR_TYPES, HostKey)):
        return x  # (np.float64 is a float: it slips through here as it is)
    if isinstance(x, np.generic):
        x = np.asarray(x)
    if isinstance(x, jax.Array):
        if is_prng_key(x):
            bits = np.asarray(jax.random.key_data(x))
            return HostKey(bits.copy() if copy else bits, str(jax.random.key_impl(x)))
        here = np.asarray(x)
        return here.copy() if copy else here
    if isinstance(x, np.ndarray):
        if x.dtype.hasobject:
            raise UnsupportedLeafError(f"leaf {path}: an object array ({x.dtype}) cannot be "
                                       "stored without pickle")
        return x.copy() if copy else x
    raise UnsupportedLeafError(f"leaf {path}: a {type(x).__name__} is not an array, a "
                               "number, a string or None")
""",
    "plan_leaf": """    if isinstance(host, HostKey):
        arr = np.asarray(host.data)
        entry = {"path": list(names), "kind": "prng_key", "impl": host.impl}
    elif isinstance(host, np.ndarray):
        arr = host
        entry = {"path": list(names), "kind": "array"}
    else:
        return {"path": list(names), **encode_value(host, path_str(names))}, None
    raw = arr.reshape(-1).view(np.uint8)  # (the bytes as they are in memory)
    entry.update(dtype=dtype_name(arr.dtype), shape=list(arr.shape), nbytes=int(raw.nbytes))
    return entry, raw
""",
    "decode_leaf": """    if entry["kind"] == "value":
        return decode_value(entry, where)
    if verify and "crc32" in entry:
        actual = zlib.crc32(raw)
        if actual != entry["crc32"]:
            raise CheckpointCorruptedError(
                where, f"CRC-32 {actual:#010x} where the manifest says {entry['crc32']:#010x}: "
                       "damaged bytes", leaf=path_str(entry["path"]))
    values = raw.view(DTYPES[entry["dtype"]]).reshape(entry["shape"])
    if entry["kind"] == "prng_key":
        return HostKey(values, entry["impl"])
    if entry.get("scalar"):
        return values[()]
    return values
""",
}


def _fill(nb: Any, grade_id: str, bodies: dict[str, str]) -> None:
    """The release's stub of each function (its signature and docstring, as a student
    starts) with ``bodies[name]`` in place of ``raise NotImplementedError``."""
    cell = _cell(nb, grade_id)
    for name, body in bodies.items():
        stub = f'    # YOUR CODE HERE\n    raise NotImplementedError("Task {grade_id[5:].replace("_", ".")}: {name}")\n'
        if stub not in cell.source + "\n":
            raise ValueError(f"independent.py: no stub of {name} in the release's {grade_id}")
        cell.source = (cell.source + "\n").replace(stub, body, 1).rstrip("\n") + "\n"


def lab01_partial(release: Any, source: Any) -> Any:
    """Task 1.1 right; 1.2 misses np.float64 (a float subclass); 1.3 writes each array's
    bytes as they are in memory, not little-endian C order; 1.4 finds the newest checkpoint
    by sorting names; 7 of 11 quiz answers right."""
    from .lab01_basics import LEXICAL_RESTORE

    nb = perfect(release, source)
    for gid in ("task_1_1", "task_1_2", "task_1_3"):
        _cell(nb, gid).source = _cell(release, gid).source
        _fill(nb, gid, {k: v for k, v in LAB1_BODIES.items()
                        if f"def {k}(" in _cell(release, gid).source})
    _cell(nb, "task_1_4").source = LEXICAL_RESTORE
    _answers(nb, Q2='"B"', Q7="100.0", Q9='"B"', Q10="{100, 400}")
    return nb


LAB2_SHOULD_SAVE = """def should_save(step: int, *, last_saved_step: int | None, save_interval_steps: int = 1,
                save_on_steps: Collection[int] = ()) -> bool:
    \"\"\"Task 2.1 — mine: the first save always; then on the interval or a listed step.\"\"\"
    if last_saved_step is None:
        return True
    on_interval = step % save_interval_steps == 0  # (never asks whether step is past the last)
    return on_interval or step in set(save_on_steps)
"""
LAB2_KEEP = """def steps_to_keep(infos: Sequence[StepInfo], *, max_to_keep: int | None = None,
                  keep_period: int | None = None,
                  best_fn: Callable[[Mapping[str, Any]], float] | None = None,
                  best_mode: str = "max",
                  keep_checkpoints_without_metrics: bool = True) -> set[int]:
    \"\"\"Task 2.2 — mine: the best (or newest) few, the metric-less ones, every period-th.\"\"\"
    every = {info.step for info in infos}
    if max_to_keep is None or len(every) <= max_to_keep:
        return every
    room = max(max_to_keep, 0)
    if best_fn is not None:
        order = rank_by_metric(infos, best_fn, best_mode)
        survivors = {info.step for info in order[:room]}
        if keep_checkpoints_without_metrics:
            survivors.update(every - {info.step for info in order})
    else:
        survivors = set(sorted(every, reverse=True)[:room])
    if keep_period:
        survivors.update(s for s in every if s % keep_period == 0)
    return survivors


def legacy_steps_to_keep(steps: Sequence[int], keep: int,
                         keep_every_n_steps: int | None = None) -> set[int]:
    \"\"\"Task 2.2 (Flax) — mine: the newest ``keep``, and a thinned-out history before them.\"\"\"
    if keep < 0:
        raise ValueError(f"keep={keep}: Flax's keep counts checkpoints, it cannot be negative")
    ordered = sorted(steps)
    if keep == 0 or len(ordered) <= keep:
        return set(ordered)
    result = set(ordered[-keep:])
    previous = None
    for s in ordered[:-keep]:
        if not keep_every_n_steps or s == 0:
            continue
        if previous is None or s - previous >= keep_every_n_steps:
            result.add(s)
            previous = s
    return result
"""
LAB2_COMMIT = """def commit(fs: FileSystem, tmp_dir: str, final_dir: str, *, subdirs: Iterable[str] = (),
           sync: SyncBatch | None = None) -> None:
    \"\"\"Task 2.3 — mine: everything the writers left made durable, the rename, its parent.\"\"\"
    own = sync is None
    pending = SyncBatch(fs) if own else sync
    try:
        for name in subdirs:
            pending.add_dir(os.path.join(tmp_dir, name))
        pending.add_dir(tmp_dir)
        pending.flush()
    finally:
        if own:
            pending.close()
    fs.rename(tmp_dir, final_dir)  # (a final_dir already there: its OSError goes through as is)
    where = os.path.dirname(os.path.abspath(final_dir))
    try:
        fs.fsync_dir(where)
    except OSError as err:
        raise OSError(err.errno, f"{final_dir} is in place but a power cut could undo it: "
                                 f"the fsync of {where} failed ({err})") from err
"""
LAB2_CLEANUP = """def cleanup_temporaries(fs: FileSystem, root: str) -> list[str]:
    \"\"\"Task 2.4 — mine: every leftover of a crashed save or delete, removed.\"\"\"
    try:
        entries = sorted(fs.listdir(root))
    except FileNotFoundError:
        return []
    gone = [name for name in entries if is_temporary(name)]
    for name in gone:
        fs.rmtree(os.path.join(root, name))
    return gone  # (the removals are not made durable: no fsync of root)
"""


def lab02_partial(release: Any, source: Any) -> Any:
    """2.1 may save backwards (no check against the last saved step); 2.2 right; 2.3 lets
    the rename's EEXIST through as a bare OSError; 2.4 never fsyncs the directory; 6 of 10
    quiz answers right."""
    nb = perfect(release, source)
    _cell(nb, "task_2_1").source = LAB2_SHOULD_SAVE
    _cell(nb, "task_2_2").source = LAB2_KEEP
    _cell(nb, "task_2_3").source = LAB2_COMMIT
    _cell(nb, "task_2_4").source = LAB2_CLEANUP
    _answers(nb, Q1='"B"', Q4="23", Q7='{"A", "C"}', Q10="10.0")
    return nb


LAB5_SNAPSHOT = """def snapshot_leaf(x: Any, *, path: str = "<leaf>", pin: bool = False) -> Any:
    \"\"\"Task 5.1 — mine: a pinned view when asked for and possible, else a private copy.\"\"\"
    photo = pinned_view(x) if pin and isinstance(x, jax.Array) else None
    return photo if photo is not None else to_host(x, path=path, copy=True)
"""
LAB5_WRITER = """def start_in_background(writer: AsyncWriter, fn: Callable[[], Any], what: str) -> None:
    \"\"\"Task 5.2 (start) — mine: one write phase at a time, in a thread of its own.\"\"\"
    with writer._lock:
        busy = writer._thread is not None and writer._thread.is_alive()
        if busy or writer._error is not None:
            why = "is still running" if busy else "failed and its error was not raised yet"
            raise MiniCkptError(f"{what} cannot start: the save of {writer._what} {why}")
        worker = threading.Thread(target=run_in_background, args=(writer, fn, what),
                                  daemon=True, name=f"{writer.name}:{what}")  # (exit: gone)
        writer._what, writer._thread = what, worker
    worker.start()


def run_in_background(writer: AsyncWriter, fn: Callable[[], Any], what: str) -> None:
    \"\"\"Task 5.2 (run) — mine: whatever fn raises waits in the writer.\"\"\"
    try:
        fn()
    except BaseException as exc:
        exc.add_note(f"(in the background save of {what})")
        with writer._lock:
            writer._error = exc


def collect_error(writer: AsyncWriter) -> None:
    \"\"\"Task 5.2 (collect) — mine: raise the kept failure once.\"\"\"
    with writer._lock:
        pending = writer._error
        writer._error = None
    if pending is not None:
        raise pending
"""
LAB5_OVERLAP = """def overlap(steps: Sequence[tuple[float, float]],
            saves: Sequence[tuple[float, float, float]]) -> dict[str, float]:
    \"\"\"Task 5.3 — mine: the time in save(), the writes, and what of them a step covered.\"\"\"
    totals = dict.fromkeys(("blocked_s", "stall_s", "write_s", "hidden_s"), 0.0)
    for begin, back, done in saves:
        totals["blocked_s"] += back - begin
        totals["write_s"] += done - back
        for a, b in steps:
            both = min(b, done) - max(a, back)
            if both > 0:
                totals["hidden_s"] += both
    return totals  # (a stall behind the previous save is never counted)
"""


def lab05_partial(release: Any, source: Any) -> Any:
    """5.1 right; 5.2's thread is a daemon (a normal exit would kill a pending save); 5.3
    never counts a stall; 5 of 8 quiz answers right."""
    nb = perfect(release, source)
    _cell(nb, "task_5_1").source = LAB5_SNAPSHOT
    _cell(nb, "task_5_2").source = LAB5_WRITER
    _cell(nb, "task_5_3").source = LAB5_OVERLAP
    _answers(nb, Q2='{"A"}', Q4="0.5", Q6="0.0")
    return nb


LAB6_INTERVAL = """def optimal_interval(save_cost_s: float, mtbf_s: float, *, method: str = "daly") -> float:
    \"\"\"Task 6.1 — mine: Young's sqrt(2CM), or Daly's series (M itself once C >= 2M).\"\"\"
    C, M = save_cost_s, mtbf_s
    if method not in ("young", "daly"):
        raise ValueError(f"unknown method {method!r}: 'young' or 'daly'")
    if math.isnan(C) or math.isnan(M) or C < 0 or M <= 0:
        raise ValueError(f"need C >= 0 and M > 0, got C={C!r}, M={M!r}")
    root = math.sqrt(2 * C * M)
    if method == "young":
        return float(root)
    if C >= 2 * M:
        return float(M)
    r = math.sqrt(C / (2 * M))
    return float(root * (1 + r / 3 + r * r / 9) - C)
"""
LAB6_LOST = """def expected_lost_work(interval_s: float, *, save_cost_s: float = 0.0, restart_s: float = 0.0,
                       mtbf_s: float | None = None) -> float:
    \"\"\"Task 6.2 — mine: half a segment (uniform), or the exponential's conditional mean.\"\"\"
    for name, v in (("interval", interval_s), ("save cost", save_cost_s), ("restart", restart_s)):
        if not v >= 0:
            raise ValueError(f"{name} must be >= 0, got {v!r}")
    T = float(interval_s + save_cost_s)
    if mtbf_s is None:
        return T / 2 + float(restart_s)
    if not mtbf_s > 0:
        raise ValueError(f"the MTBF must be > 0, got {mtbf_s!r}")
    # E[t | t < T] for t exponential of mean M: M - T / (e^(T/M) - 1)
    x = T / mtbf_s
    if x < 1e-4:  # its series T/2 - T²/12M + T⁴/720M³: the subtraction would cancel
        lost = T / 2 - T * T / (12 * mtbf_s) + T**4 / (720 * mtbf_s**3)
    elif x > 50:  # e^(T/M) is huge (and overflows past 709): T / (e^x - 1) is T·e^-x
        lost = mtbf_s - T * math.exp(-x)
    else:
        lost = mtbf_s - T / math.expm1(x)
    return float(lost + restart_s)


def p_fail(p: float, total: float, interval: float) -> float:
    \"\"\"Task 6.2 — mine: at least one of the floor(total / interval) windows interrupted.\"\"\"
    if not (0 <= p <= 1):
        raise ValueError(f"p={p!r} is not a probability")
    if not (interval > 0 and total >= 0):
        raise ValueError(f"total={total!r} must be >= 0 and interval={interval!r} > 0")
    windows = math.floor(total / interval)
    if p == 1:
        return 1.0 if windows else 0.0
    return -math.expm1(windows * math.log1p(-p))  # 1 - (1 - p)^n without cancellation
"""
LAB6_BEST = """def best_checkpoint(source: Any, metric: str | Callable[[Mapping[str, Any]], Any], *,
                    mode: str = "min",
                    where: Mapping[str, Any] | Callable[[CheckpointMetadata], bool] | None = None,
                    fs: FileSystem | None = None) -> CheckpointMetadata | None:
    \"\"\"Task 6.5 — mine: one pass over the metadata, the best so far kept.\"\"\"
    if mode not in ("min", "max"):
        raise ValueError(f"mode is 'min' or 'max', not {mode!r}")
    sign = 1 if mode == "max" else -1
    chosen, score = None, None
    for meta in checkpoint_metadata(source, fs=fs):
        if not metadata_matches(meta, where):
            continue
        value = metric_value(meta, metric)
        if value is None or not math.isfinite(value):  # a diverged run's ±inf is no score
            continue
        step = -1 if meta.step is None else meta.step
        if chosen is None or sign * value > score[0] or (sign * value == score[0] and step > score[1]):
            chosen, score = meta, (sign * value, step)
    return chosen
"""


def lab06_partial(release: Any, source: Any) -> Any:
    """6.1, 6.2 and 6.5 done, 6.3 and 6.4 not started (stubs), 5 of 9 quiz answers right."""
    nb = perfect(release, source)
    _cell(nb, "task_6_1").source = LAB6_INTERVAL
    _cell(nb, "task_6_2").source = LAB6_LOST
    _cell(nb, "task_6_5").source = LAB6_BEST
    for gid in ("task_6_3", "task_6_4"):
        _cell(nb, gid).source = _cell(release, gid).source
    _answers(nb, Q2='"A"', Q3="0.0", Q5="8", Q9='"A"')
    return nb


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
    "lab01_basics": {"partial": lab01_partial},
    "lab02_save_policy": {"partial": lab02_partial},
    "lab03_resume": {"partial": lab03_partial},
    "lab05_async": {"partial": lab05_partial},
    "lab06_production": {"partial": lab06_partial},
    "lab04_multihost": {"partial": lab04_partial},
}
