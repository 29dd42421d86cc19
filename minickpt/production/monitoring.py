"""Monitoring: every save and restore as one JSON line next to the checkpoints.

What to watch on a long run (chapter 6): how long saves take (and how much of it the training
loop waits for), whether they succeed, how many bytes they write, how full the disk gets, and
how long a restore takes — the number a failure will cost. :func:`attach_monitor` records
each of these through the manager's ``listeners`` hook, so it works the same for synchronous
and asynchronous managers, into ``<checkpoint dir>/.minickpt-metrics.jsonl`` (a file name the
manager never takes for a checkpoint or a temporary). ``minickpt stats DIR`` summarises it and
:func:`plot_dashboard` draws it.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..fs import DEFAULT_FS, FileSystem

log = logging.getLogger("minickpt")

METRICS_FILE = ".minickpt-metrics.jsonl"
EVENTS = ("save", "restore", "skip", "delete", "mirror")


class MetricsMonitor:
    """A manager listener that appends one JSON line per event to ``path``.

    Each line has ``event`` (save, restore, skip — a damaged checkpoint passed over —,
    delete, mirror), ``time`` (seconds since the epoch), ``step``, ``ok``, ``error``,
    ``duration_s``, ``bytes`` and ``disk_bytes`` (everything under the checkpoint
    directory at that moment), plus what the manager reported (a save's phases, for
    instance). Writing the line never fails a save: a problem is logged once.
    """

    def __init__(self, manager: Any, path: str | os.PathLike[str] | None = None, *,
                 fs: FileSystem | None = None, disk_usage: bool = True):
        self.manager = manager
        self.directory = os.fspath(manager.directory)
        self.fs = fs or getattr(manager, "fs", None) or DEFAULT_FS
        self.path = os.fspath(path) if path is not None else os.path.join(self.directory,
                                                                          METRICS_FILE)
        self.disk_usage = disk_usage
        self._lock = threading.Lock()
        self._failed_once = False
        manager.listeners.append(self)

    def detach(self) -> None:
        try:
            self.manager.listeners.remove(self)
        except ValueError:
            pass

    def __call__(self, event: str, record: Mapping[str, Any]) -> None:
        if event not in EVENTS:
            return
        line = self.line(event, record)
        self._append(json.dumps(line, default=str, allow_nan=True) + "\n")

    def line(self, event: str, record: Mapping[str, Any]) -> dict[str, Any]:
        """The JSON object written for one event."""
        out: dict[str, Any] = {"event": event, "time": time.time()}
        out.update(record)
        out.setdefault("step", None)
        out.setdefault("ok", event != "skip")
        out.setdefault("error", None)
        out["duration_s"] = record.get("total_s")
        if event == "restore" and "bytes" not in record and record.get("step") is not None:
            try:  # the restored arrays' size, from the metadata (no array is read)
                out["bytes"] = int(self.manager.metadata(record["step"]).bytes)
            except Exception:
                out["bytes"] = None
        out.setdefault("bytes", None)
        if self.disk_usage:
            try:
                out["disk_bytes"] = self.fs.dir_size(self.directory)
            except OSError:
                out["disk_bytes"] = None
        return out

    def _append(self, text: str) -> None:
        data = text.encode()
        with self._lock:
            try:
                # one write per line on an O_APPEND file: lines from several processes never
                # interleave on a local file system
                fd = self.fs.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
                try:
                    self.fs.write_all(fd, [data])
                finally:
                    self.fs.close(fd)
            except OSError as e:
                if not self._failed_once:
                    self._failed_once = True
                    log.error("minickpt: cannot write metrics to %s: %s (further failures "
                              "are not logged)", self.path, e)


def attach_monitor(manager: Any, path: str | os.PathLike[str] | None = None, *,
                   disk_usage: bool = True) -> MetricsMonitor:
    """Record every save, restore, skipped damaged checkpoint, deletion and mirror copy of
    ``manager`` as JSON lines (default ``<directory>/.minickpt-metrics.jsonl``)."""
    return MetricsMonitor(manager, path, disk_usage=disk_usage)


# ---------------------------------------------------------------------------------------
# reading and summarising
# ---------------------------------------------------------------------------------------
@dataclass
class MetricsLog:
    """The events of a metrics file; lines that are not JSON objects are counted, not fatal
    (a crash can cut the last line short)."""

    path: str
    records: list[dict[str, Any]] = field(default_factory=list)
    malformed: int = 0


def metrics_path(path: str | os.PathLike[str], fs: FileSystem | None = None) -> str:
    """The metrics file of a checkpoint directory (or the file itself)."""
    path = os.fspath(path)
    return os.path.join(path, METRICS_FILE) if (fs or DEFAULT_FS).is_dir(path) else path


def load_metrics(path: str | os.PathLike[str], fs: FileSystem | None = None) -> MetricsLog:
    """Read a metrics file, or the one in a checkpoint directory."""
    fs = fs or DEFAULT_FS
    p = metrics_path(path, fs)
    if not fs.exists(p):
        raise FileNotFoundError(f"no metrics in {path}: expected {p} (record them with "
                                "minickpt.production.attach_monitor(manager))")
    out = MetricsLog(p)
    for raw in fs.read_file(p, max_bytes=1 << 30).decode("utf-8", "replace").splitlines():
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError:
            out.malformed += 1
            continue
        if isinstance(rec, dict) and isinstance(rec.get("event"), str):
            out.records.append(rec)
        else:
            out.malformed += 1
    return out


def _num(xs: Iterable[Any]) -> list[float]:
    return [float(x) for x in xs if isinstance(x, (int, float)) and not isinstance(x, bool)]


def _dist(xs: Sequence[float]) -> dict[str, float] | None:
    if not xs:
        return None
    return {"median": statistics.median(xs), "p95": float(np.percentile(xs, 95)),
            "max": max(xs)}


def _outcomes(recs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    ok = sum(1 for r in recs if r.get("ok"))
    return {"count": len(recs), "ok": ok, "failed": len(recs) - ok,
            "success_rate": ok / len(recs) if recs else None}


def summarize(records: Iterable[Mapping[str, Any]] | MetricsLog) -> dict[str, Any]:
    """Counts, success rates, median/p95/max durations, bytes, disk use and the last error.

    Durations and bytes are over successful events; p95 interpolates linearly.
    """
    malformed = 0
    if isinstance(records, MetricsLog):
        malformed, records = records.malformed, records.records
    recs = list(records)
    by: dict[str, list[Mapping[str, Any]]] = {e: [] for e in EVENTS}
    for r in recs:
        by.setdefault(str(r.get("event")), []).append(r)
    saves, restores = by["save"], by["restore"]
    ok_saves = [r for r in saves if r.get("ok")]
    ok_restores = [r for r in restores if r.get("ok")]
    save_bytes = _num(r.get("bytes") for r in ok_saves)
    restore_bytes = _num(r.get("bytes") for r in ok_restores)
    disk = _num(r.get("disk_bytes") for r in recs)
    errors = [r for r in recs if r.get("ok") is False and r.get("error")]
    last = errors[-1] if errors else None
    times = _num(r.get("time") for r in recs)
    return {
        "events": len(recs),
        "malformed_lines": malformed,
        "first_time": min(times) if times else None,
        "last_time": max(times) if times else None,
        "saves": {**_outcomes(saves),
                  "time_s": _dist(_num(r.get("total_s") for r in ok_saves)),
                  "blocking_s": _dist(_num(r.get("blocking_s") for r in ok_saves)),
                  "bytes": {"last": save_bytes[-1], "median": statistics.median(save_bytes),
                            "total": sum(save_bytes)} if save_bytes else None,
                  "last_step": max((r["step"] for r in ok_saves
                                    if isinstance(r.get("step"), int)), default=None)},
        "restores": {**_outcomes(restores),
                     "time_s": _dist(_num(r.get("total_s") for r in ok_restores)),
                     "bytes": {"last": restore_bytes[-1],
                               "median": statistics.median(restore_bytes)}
                     if restore_bytes else None},
        "mirror": _outcomes(by["mirror"]),
        "skipped_damaged": len(by["skip"]),
        "deleted": len(by["delete"]),
        "disk_bytes": {"last": disk[-1], "max": max(disk)} if disk else None,
        "last_error": {k: last.get(k) for k in ("event", "step", "time", "error")}
        if last else None,
    }


def format_summary(s: Mapping[str, Any], *, path: str = "", disk_now: int | None = None) -> str:
    """The human-readable form of :func:`summarize`, as ``minickpt stats`` prints it."""
    from ..checkpointer import human_bytes

    def t(d: Mapping[str, float] | None, key: str = "") -> str:
        if not d:
            return "-"
        return f"{key}median {_secs(d['median'])}, p95 {_secs(d['p95'])}, max {_secs(d['max'])}"

    def rate(o: Mapping[str, Any]) -> str:
        r = o["success_rate"]
        return f"{o['count']} ({o['ok']} ok, {o['failed']} failed, " \
               f"{'-' if r is None else f'{100 * r:.1f}%'} success)"

    lines = []
    if path:
        span = ""
        if s["first_time"] is not None:
            span = f", {_when(s['first_time'])} .. {_when(s['last_time'])}"
        lines.append(f"metrics {path}: {s['events']} events{span}")
    sv, rs = s["saves"], s["restores"]
    lines.append(f"saves     {rate(sv)}")
    if sv["count"]:
        lines.append(f"          time {t(sv['time_s'])}")
        lines.append(f"          blocking {t(sv['blocking_s'])}")
        if sv["bytes"]:
            lines.append(f"          {human_bytes(sv['bytes']['median'])} per save, "
                         f"{human_bytes(sv['bytes']['total'])} written in all")
    lines.append(f"restores  {rate(rs)}")
    if rs["count"]:
        lines.append(f"          time {t(rs['time_s'])}")
        if rs["bytes"]:
            lines.append(f"          {human_bytes(rs['bytes']['median'])} per restore")
    if s["mirror"]["count"]:
        lines.append(f"mirror    {rate(s['mirror'])}")
    if s["skipped_damaged"]:
        lines.append(f"damaged   {s['skipped_damaged']} checkpoint(s) skipped at restore")
    d = s["disk_bytes"]
    disk = []
    if disk_now is not None:
        disk.append(f"{human_bytes(disk_now)} now")
    if d:
        disk.append(f"{human_bytes(d['last'])} at the last event, {human_bytes(d['max'])} at "
                    "most")
    lines.append("disk      " + (", ".join(disk) or "-"))
    e = s["last_error"]
    lines.append("last error " + ("none" if not e else
                                  f"{e['event']} step {e['step']} at {_when(e['time'])}: "
                                  f"{e['error']}"))
    if s["malformed_lines"]:
        lines.append(f"({s['malformed_lines']} line(s) were not valid JSON and were skipped)")
    return "\n".join(lines)


def _unit(n: float) -> tuple[str, int]:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return unit, scale
    return "bytes", 1


def _secs(x: float) -> str:
    return f"{x * 1000:.1f} ms" if x < 1 else f"{x:.2f} s"


def _when(t: float | None) -> str:
    if t is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


# ---------------------------------------------------------------------------------------
# the dashboard figure
# ---------------------------------------------------------------------------------------
def plot_dashboard(source: Any, *, fig: Any = None, title: str | None = None) -> Any:
    """The chapter's dashboard: save (and restore) time per step, bytes per save, disk use.

    ``source`` is a metrics file, a checkpoint directory, a :class:`MetricsLog` or a list
    of records. Returns the matplotlib Figure (imported only here).
    """
    import matplotlib.pyplot as plt

    if isinstance(source, (str, os.PathLike)):
        source = load_metrics(source)
    recs = source.records if isinstance(source, MetricsLog) else list(source)
    if fig is None:
        fig = plt.figure(figsize=(8, 7.5))
    ax_t, ax_b, ax_d = fig.subplots(3, 1, sharex=True)

    def pts(event: str, key: str, ok: bool | None = True) -> tuple[list[int], list[float]]:
        xs, ys = [], []
        for r in recs:
            if r.get("event") != event or not isinstance(r.get("step"), int):
                continue
            if ok is not None and bool(r.get("ok")) != ok:
                continue
            v = r.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                xs.append(r["step"])
                ys.append(float(v))
        return xs, ys

    x, y = pts("save", "total_s")
    ax_t.plot(x, y, "o-", ms=3, label="save (total)")
    xb, yb = pts("save", "blocking_s")
    if yb != y:
        ax_t.plot(xb, yb, ".--", label="save (blocking)")
    xf, yf = pts("save", "total_s", ok=False)
    if xf:
        ax_t.plot(xf, yf, "x", color="red", ms=8, ls="none", label="failed save")
    xr, yr = pts("restore", "total_s", ok=None)
    if xr:
        ax_t.plot(xr, yr, "v", color="green", ls="none", label="restore")
    ax_t.set_ylabel("seconds")
    ax_t.legend(loc="upper left", fontsize="small")
    x, y = pts("save", "bytes")
    unit, scale = _unit(max(y, default=0))
    ax_b.plot(x, [v / scale for v in y], "s-", ms=3, label="bytes per save")
    ax_b.set_ylabel(f"{unit} per save")
    xd, yd = pts("save", "disk_bytes", ok=None)  # after each save and its retention
    unit, scale = _unit(max(yd, default=0))
    ax_d.step(xd, [v / scale for v in yd], where="post", label="disk use")
    ax_d.set_ylabel(f"{unit} on disk")
    ax_d.set_xlabel("step")
    for ax in (ax_t, ax_b, ax_d):
        ax.grid(alpha=0.3)
    fig.suptitle(title or "checkpointing dashboard")
    fig.tight_layout()
    return fig
