"""Moving a run from Orbax: each Orbax step restored with Orbax itself, saved as a minickpt
checkpoint, and compared leaf by leaf (``minickpt convert-orbax SRC DST``; see
docs/orbax-migration.md). Recognising an Orbax directory is :mod:`minickpt.orbax_dirs`."""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .commit import METADATA_FILE
from .errors import CheckpointCorruptedError, CheckpointNotFoundError, MiniCkptError
from .format.spec import canonical_impl
from .fs import DEFAULT_FS, FileSystem
from .manager import CheckpointManager
from .options import CheckpointManagerOptions
from .orbax_dirs import ITEM_FILES, orbax_metrics, orbax_steps, read_json, real_dir
from .tree import HostKey


# ---- conversion ---------------------------------------------------------------------------
@dataclass
class Converted:
    """One Orbax step converted (or not: ``error`` says why): where it came from and went,
    and what was checked."""

    step: int
    source: str
    path: str
    items: list[str]
    leaves: int
    skipped: bool = False  # already converted (the minickpt step was there and verified)
    error: str | None = None  # why this step was not converted (one line); None: converted
    json_items: list[str] = field(default_factory=list)  # those that were Orbax JSON items
    keys: int = 0  # typed PRNG keys kept as keys (Orbax's metadata named their impl)


class ConversionFailed(MiniCkptError):
    """Some Orbax steps could not be converted (the others were): ``failed`` maps each such
    step to why, in one line; ``converted`` holds the steps that were."""

    def __init__(self, source: str, converted: list[Converted], failed: dict[int, str]):
        self.converted, self.failed = converted, failed
        super().__init__(
            f"{len(failed)} Orbax step(s) of {source} not converted ("
            + "; ".join(f"step {s}: {why}" for s, why in sorted(failed.items()))
            + f"); {len(converted)} converted")


class _StepRefused(Exception):
    """This Orbax step cannot be converted; the message says why in one line."""


_PYTREE, _JSON = "pytree", "json"
_MARKER_FILES = ("commit_success.txt",)
_TMP_MARK = ".orbax-checkpoint-tmp"


def _one_line(e: BaseException) -> str:
    """An exception as one line (Orbax and TensorStore errors can run to pages)."""
    text = " ".join(str(e).split())
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _item_dirs(step_dir: str, fs: FileSystem) -> dict[str, tuple[str, str]]:
    """An Orbax step's items: name -> (kind, directory), a bare PyTree save is item
    'default'. Raises :class:`_StepRefused` naming an item that is neither a PyTree nor a
    JSON item (a custom handler's): dropping it would convert a step that is not whole."""
    names = set(fs.listdir(step_dir))
    if names & set(ITEM_FILES):
        return {"default": (_PYTREE, step_dir)}
    meta = read_json(fs, os.path.join(step_dir, METADATA_FILE))
    handlers = meta.get("item_handlers") if isinstance(meta, dict) else None
    handlers = handlers if isinstance(handlers, dict) else {}
    items: dict[str, tuple[str, str]] = {}
    for name in sorted(names | set(handlers)):
        if name.startswith(".") or _TMP_MARK in name:
            continue
        sub = os.path.join(step_dir, name)
        handler = str(handlers.get(name) or "")
        if not real_dir(fs, sub):
            if name in handlers:
                raise _StepRefused(f"item {name!r} ({handler or 'no handler'}) is recorded "
                                   "in the step's metadata but its directory is missing")
            continue
        inside = set(fs.listdir(sub))
        if inside & set(ITEM_FILES):
            items[name] = (_PYTREE, sub)
        elif "JsonCheckpointHandler" in handler or (not handler and _json_file(sub, fs)):
            items[name] = (_JSON, sub)
        else:
            raise _StepRefused(
                f"item {name!r} (handler {handler or 'unknown'}) is neither a PyTree nor a "
                "JSON item, and minickpt cannot convert it; leaving it out would make a "
                "checkpoint that is not the whole step")
    return items


def _json_file(item_dir: str, fs: FileSystem) -> str | None:
    """The one data file of a JSON item (Orbax's ``JsonCheckpointHandler`` names it
    ``metadata`` unless told otherwise), or None."""
    files = [n for n in sorted(fs.listdir(item_dir)) if n not in _MARKER_FILES
             and stat.S_ISREG(_mode(fs, os.path.join(item_dir, n)))]
    if "metadata" in files:
        return "metadata"
    return files[0] if len(files) == 1 else None


def _mode(fs: FileSystem, path: str) -> int:
    try:
        return fs.lstat(path).st_mode
    except FileNotFoundError:
        return 0


@contextlib.contextmanager
def _quiet_orbax() -> Iterator[None]:
    """Orbax logs a warning per item it restores without a step metadata file beside it;
    the conversion reports its own outcome per step, so only Orbax's errors get through."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(max(level, logging.ERROR))
    try:
        yield
    finally:
        absl.setLevel(level)


def _key_impls(item_dir: str, fs: FileSystem) -> dict[str, str]:
    """Orbax's record of the typed PRNG keys in a PyTree item: parameter name (key path
    joined with '.') -> key impl, from ``array_metadatas/process_*`` (Orbax 0.11+)."""
    impls: dict[str, str] = {}
    where = os.path.join(item_dir, "array_metadatas")
    if not real_dir(fs, where):
        return impls
    for name in sorted(fs.listdir(where)):
        doc = read_json(fs, os.path.join(where, name))
        for rec in doc.get("array_metadatas", []) if isinstance(doc, dict) else []:
            am = rec.get("array_metadata") if isinstance(rec, dict) else None
            ext = am.get("ext_metadata") if isinstance(am, dict) else None
            impl = ext.get("random_key_impl") if isinstance(ext, dict) else None
            if isinstance(impl, str) and isinstance(am.get("param_name"), str):
                impls[am["param_name"]] = impl
    return impls


def _wrap_keys(tree: Any, impls: Mapping[str, str], at: tuple[Any, ...] = ()) -> Any:
    """``tree`` with each leaf Orbax recorded as a typed PRNG key made a :class:`HostKey`
    (its ``uint32`` data and impl), which minickpt saves as a key."""
    if isinstance(tree, Mapping):
        return {k: _wrap_keys(v, impls, (*at, k)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        out = [_wrap_keys(v, impls, (*at, i)) for i, v in enumerate(tree)]
        return out if isinstance(tree, list) else tuple(out)
    impl = impls.get(".".join(map(str, at)))
    if impl is None or not isinstance(tree, np.ndarray) or tree.dtype != np.uint32:
        return tree
    return HostKey(tree, canonical_impl(impl))


def _restore_item(path: str, fs: FileSystem | None = None) -> Any:
    """One Orbax PyTree item restored by Orbax, its arrays as numpy arrays (no device
    needed), its typed PRNG keys as :class:`HostKey` where Orbax's metadata names them."""
    import jax
    import orbax.checkpoint as ocp

    fs = fs or DEFAULT_FS
    ck = ocp.PyTreeCheckpointer()
    with _quiet_orbax():
        why = _unreadable_files(path, fs)
        if why:
            raise _StepRefused(f"item {path}: {why}")
        meta = ck.metadata(path)  # Orbax 0.11 raises its own error when it cannot read it
        # Orbax 0.12 wraps the tree's metadata in a StepMetadata (item_metadata: None when it
        # could not be read, the reason only logged); Orbax 0.11 returns it bare
        item = meta.item_metadata if hasattr(meta, "item_metadata") else meta
        tree = getattr(item, "tree", None)
        if tree is None:  # the restore itself then says what Orbax cannot read
            out = jax.tree.map(np.asarray, ck.restore(path))
            return _wrap_keys(out, _key_impls(path, fs))
        args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree,
                            is_leaf=lambda x: not isinstance(x, (dict, list, tuple)))
        try:
            out = ck.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))
        except (TypeError, ValueError):  # a leaf numpy cannot hold as restore_type
            out = jax.tree.map(np.asarray, ck.restore(path))
    return _wrap_keys(out, _key_impls(path, fs))


def _unreadable_files(item_dir: str, fs: FileSystem) -> str | None:
    """What is visibly wrong with a PyTree item's own files, in words, or None: its
    ``_METADATA`` (Orbax's record of the tree) missing or not JSON, or the root of its OCDBT
    database (``manifest.ocdbt``) missing. Orbax's own errors for these name a symptom (a
    structure not identified, an array's ``.zarray`` not found) that reads like damage to the
    arrays."""
    names = set(fs.listdir(item_dir))
    where = os.path.join(item_dir, "_METADATA")
    if "_METADATA" not in names:
        return "its _METADATA (Orbax's record of the tree) is missing"
    doc = read_json(fs, where)
    if not isinstance(doc, dict) or not isinstance(doc.get("tree_metadata"), dict):
        return "its _METADATA (Orbax's record of the tree) is not the JSON Orbax writes"
    ocdbt = doc.get("use_ocdbt", True) is not False and (
        "d" in names or any(n.startswith("ocdbt.process_") for n in names))
    if ocdbt and "manifest.ocdbt" not in names:
        return ("its manifest.ocdbt (the root of the OCDBT database that holds the arrays) "
                "is missing")
    return None


def _restore_json(path: str, fs: FileSystem) -> Any:
    """One Orbax JSON item (``JsonSave``: a loader position, a config) restored by Orbax."""
    import orbax.checkpoint as ocp
    from etils import epath

    name = _json_file(path, fs)
    if name is None:
        raise _StepRefused(f"JSON item {path} holds no JSON file")
    with _quiet_orbax():
        return ocp.JsonCheckpointHandler(filename=name).restore(epath.Path(path))


def _leaves(tree: Any, at: tuple[Any, ...] = ()) -> Iterable[tuple[tuple[Any, ...], Any]]:
    if isinstance(tree, Mapping):
        for k in sorted(tree, key=str):
            yield from _leaves(tree[k], (*at, k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _leaves(v, (*at, i))
    else:
        yield at, tree


def _describe(x: Any) -> str:
    if isinstance(x, HostKey):
        return f"key<{x.impl}>{list(x.data.shape)}"
    if isinstance(x, (np.ndarray, np.generic)):
        return f"{x.dtype}{list(np.shape(x))}"
    return f"{type(x).__name__} {x!r}"[:80]


def _same(a: Any, b: Any) -> bool:
    """Whether two leaves are the same: arrays by dtype, shape and bytes; keys by impl and
    data; JSON values by type and value (NaN equals NaN)."""
    if isinstance(a, HostKey) or isinstance(b, HostKey):
        return (isinstance(a, HostKey) and isinstance(b, HostKey)
                and canonical_impl(a.impl) == canonical_impl(b.impl) and _same(a.data, b.data))
    if isinstance(a, (np.ndarray, np.generic)) or isinstance(b, (np.ndarray, np.generic)):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype == object or b.dtype == object:
            return False
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if type(a) is not type(b):
        return False
    return bool(a == b) or (isinstance(a, float) and a != a and b != b)


def compare_leaves(expected: Any, got: Any, where: str) -> int:
    """Check ``got`` holds every leaf of ``expected`` with its dtype, shape and bytes (a
    JSON value: its type and value); returns the number of leaves, raises
    :class:`CheckpointCorruptedError` naming each difference."""
    want, have = dict(_leaves(expected)), dict(_leaves(got))
    problems = [f"{'/'.join(map(str, k))}: missing" for k in want if k not in have]
    problems += [f"{'/'.join(map(str, k))}: not in the original" for k in have if k not in want]
    for k in want.keys() & have.keys():
        if not _same(want[k], have[k]):
            problems.append(f"{'/'.join(map(str, k))}: {_describe(want[k])} differs from "
                            f"{_describe(have[k])} or its values")
    if problems:
        raise CheckpointCorruptedError(where, "the converted checkpoint differs from the "
                                       "Orbax one: " + "; ".join(sorted(problems)))
    return len(want)


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder


def _read_step(step_dir: str, fs: FileSystem) -> tuple[dict[str, Any], list[str]]:
    """An Orbax step's items, each restored with Orbax (PyTree and JSON items), and the
    names of the JSON ones; :class:`_StepRefused` or Orbax's own error if it cannot be."""
    item_dirs = _item_dirs(step_dir, fs)
    if "metrics" in item_dirs and item_dirs["metrics"][0] == _JSON:
        del item_dirs["metrics"]  # Orbax's metrics item: saved as the step's metrics
    if not item_dirs:
        raise _StepRefused("an Orbax step with no item minickpt can restore (no _METADATA "
                           "in it or its items)")
    items, json_items = {}, []
    for item, (kind, p) in item_dirs.items():
        if kind == _JSON:
            items[item] = _restore_json(p, fs)
            json_items.append(item)
        else:
            items[item] = _restore_item(p, fs)
    return items, json_items


def convert(source: str | os.PathLike[str], destination: str | os.PathLike[str], *,
            steps: Iterable[int] | None = None, options: Any = None,
            fs: FileSystem | None = None,
            on_step: Callable[[Converted], None] | None = None) -> list[Converted]:
    """Convert the Orbax checkpoints of run directory ``source`` into minickpt checkpoints
    in ``destination`` (a new or minickpt directory, neither ``source`` nor inside it:
    nothing is written into Orbax's directory).

    Each step (all, or ``steps``) is restored with Orbax — PyTree items with their arrays
    as numpy arrays and typed PRNG keys as keys, JSON items (``JsonSave``) as their JSON —
    saved with its metrics as the same step (items keep Orbax's names; a single-item run's
    is ``default``), read back and compared leaf by leaf — dtype, shape and every byte —
    before the next. A step already in ``destination`` is compared instead of saved again,
    so an interrupted conversion resumes.

    A step that cannot be converted (damaged, an item that is neither a PyTree nor JSON,
    its step number taken in ``destination`` by another run's checkpoint) is passed to
    ``on_step`` with ``error`` set and skipped; the others are converted, and then
    :class:`ConversionFailed` names every step left out. A converted checkpoint that
    differs from Orbax's raises at once. Needs ``orbax-checkpoint`` installed.
    """

    fs = fs or DEFAULT_FS
    src, dst = os.path.abspath(os.fspath(source)), os.path.abspath(os.fspath(destination))
    real_src, real_dst = os.path.realpath(src), os.path.realpath(dst)
    if real_src == real_dst:
        raise MiniCkptError(f"convert {src} into another directory: writing minickpt "
                            "checkpoints among Orbax's would change the directory Orbax reads")
    if _inside(real_dst, real_src):
        raise MiniCkptError(f"the destination {dst} is inside the Orbax directory {src}: "
                            "converting there would write into the directory Orbax reads; "
                            "choose a destination outside it")
    if not fs.is_dir(src):
        raise CheckpointNotFoundError(f"no such directory: {src}")
    found = orbax_steps(src, fs)
    if steps is not None:
        wanted = set(steps)
        if wanted - set(found):
            raise CheckpointNotFoundError(f"no Orbax checkpoint for step(s) "
                                          f"{sorted(wanted - set(found))} in {src} (Orbax "
                                          f"steps: {sorted(found) or 'none'})")
        found = {s: n for s, n in found.items() if s in wanted}
    if not found:
        raise CheckpointNotFoundError(f"no Orbax checkpoint in {src}")
    try:
        import orbax.checkpoint  # noqa: F401
    except ImportError as e:
        raise MiniCkptError("converting from Orbax restores with Orbax: pip install "
                            "orbax-checkpoint") from e
    out: list[Converted] = []
    failed: dict[int, str] = {}
    with CheckpointManager(dst, options or CheckpointManagerOptions(), fs=fs) as mngr:
        for step, name in sorted(found.items()):
            step_dir = os.path.join(src, name)
            error = None
            try:
                items, json_items = _read_step(step_dir, fs)
            except _StepRefused as e:
                error = str(e)
            except Exception as e:  # Orbax's error reading a damaged step (or TensorStore's)
                error = f"Orbax cannot restore it: {_one_line(e)}"
            if error is None:
                try:  # an error writing or comparing the destination stops the conversion
                    rec = _convert_step(mngr, step, step_dir, items, json_items)
                except _StepRefused as e:
                    error = str(e)
            if error is not None:
                rec = Converted(step, step_dir, mngr.step_path(step), [], 0, error=error)
            if rec.error is None:
                out.append(rec)
            else:
                failed[step] = rec.error
            if on_step is not None:
                on_step(rec)
    if failed:
        raise ConversionFailed(src, out, failed)
    return out


def _convert_step(mngr: CheckpointManager, step: int, step_dir: str, items: dict[str, Any],
                  json_items: list[str]) -> Converted:
    """Save one restored Orbax step into ``mngr`` (unless there already) and compare it."""
    metrics = orbax_metrics(step_dir, mngr.fs)
    path = mngr.step_path(step)
    skipped = step in mngr.all_steps(read=True)
    if not skipped:
        mngr.save(step, items, metrics=metrics or None, force=True,
                  metadata={"converted_from": step_dir})
    back = mngr.restore(step, verify=True)
    try:
        n = sum(compare_leaves(items[i], back.get(i, {}), path) for i in items)
    except CheckpointCorruptedError:
        came_from = mngr.metadata(step).custom_metadata.get("converted_from")
        if not skipped or came_from == step_dir:
            raise
        raise _StepRefused(
            f"{path} already holds step {step} of another run ("
            + (f"converted from {came_from}" if came_from else "not converted from Orbax")
            + "), left as it is; convert into a new directory, or delete that step first"
        ) from None
    keys = sum(isinstance(v, HostKey) for i in items for _, v in _leaves(items[i]))
    return Converted(step, step_dir, path, sorted(items), n, skipped,
                     json_items=sorted(json_items), keys=keys)
