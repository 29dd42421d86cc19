"""Monitoring: JSON lines next to the checkpoints, `minickpt stats`, the dashboard figure."""

import json
import os

import jax.numpy as jnp
import pytest

from minickpt import CheckpointManager, CheckpointManagerOptions
from minickpt.cli import main as cli
from minickpt.faults import FaultyFileSystem
from minickpt.production.monitoring import (
    METRICS_FILE,
    attach_monitor,
    load_metrics,
    plot_dashboard,
    summarize,
)


def _tree(v=0.0):
    return {"w": jnp.full((32, 32), float(v)), "b": jnp.arange(8.0)}


def _run(tmp_path):
    """Saves 0, 1, 3 (2 fails on its commit), a restore, and a restore that skips a damaged
    checkpoint. Returns the manager's own SaveStats for comparison."""
    fs = FaultyFileSystem(fail_at=0, ops={"rename"},
                          when=lambda op, args: str(args[1]).endswith("step_2"))
    with CheckpointManager(tmp_path, CheckpointManagerOptions(max_to_keep=2), fs=fs) as m:
        mon = attach_monitor(m)
        assert mon.path == os.path.join(str(tmp_path), METRICS_FILE)
        m.save(0, {"t": _tree(0)})
        m.save(1, {"t": _tree(1)})
        with pytest.raises(OSError):
            m.save(2, {"t": _tree(2)})
        m.save(3, {"t": _tree(3)})
        m.restore(target={"t": _tree()})
        # damage the latest: restore skips it and falls back to step 1
        with open(os.path.join(m.step_path(3), "t", "data.bin"), "r+b") as f:
            f.seek(10)
            f.write(b"\xff\xff")
        with pytest.warns(UserWarning, match="skipping damaged"):
            assert m.restore(target={"t": _tree()}).step == 1
        history = list(m.save_history)
    return history


def test_every_save_and_restore_is_one_json_line(tmp_path):
    history = _run(tmp_path)
    log = load_metrics(tmp_path)
    events = [(r["event"], r["step"], r["ok"]) for r in log.records]
    assert events == [("save", 0, True), ("save", 1, True), ("save", 2, False),
                      ("delete", 0, True), ("save", 3, True), ("restore", 3, True),
                      ("restore", 3, False), ("skip", 3, False), ("restore", 1, True)]
    saves = [r for r in log.records if r["event"] == "save"]
    for line, stats in zip(saves, history, strict=True):
        assert line["duration_s"] == stats.total_s and line["bytes"] == stats.bytes
        assert line["blocking_s"] == stats.blocking_s
    assert saves[2]["error"].startswith("OSError") and saves[2]["bytes"] == 0
    restore = [r for r in log.records if r["event"] == "restore"]
    assert restore[0]["bytes"] == history[-1].bytes > 32 * 32 * 4  # data + alignment
    assert restore[0]["duration_s"] > 0
    assert "checksum mismatch" in restore[1]["error"]
    skip = next(r for r in log.records if r["event"] == "skip")
    assert "checksum" in skip["error"] or "CRC" in skip["error"]
    # disk use is the size of the directory at each event: it grows with each save
    disk = [r["disk_bytes"] for r in saves[:2]]
    assert 0 < disk[0] < disk[1]


def test_the_metrics_file_is_never_taken_for_a_checkpoint(tmp_path, capsys):
    _run(tmp_path)
    assert os.path.isfile(tmp_path / METRICS_FILE)
    with CheckpointManager(tmp_path, CheckpointManagerOptions(max_to_keep=2)) as m:
        assert m.removed_temporaries == []
        assert m.all_steps() == [1]  # the damaged step 3 was set aside by the restore
    assert os.path.isfile(tmp_path / METRICS_FILE)
    assert cli(["ls", str(tmp_path), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["status"]) for r in listed] == [(1, "valid"), (None, "set aside")]


def test_stats_summarises_counts_times_bytes_and_the_last_error(tmp_path, capsys):
    history = _run(tmp_path)
    assert cli(["stats", str(tmp_path), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["saves"]["count"] == 4 and s["saves"]["failed"] == 1
    assert s["saves"]["success_rate"] == 0.75
    assert s["restores"]["count"] == 3 and s["restores"]["ok"] == 2
    assert s["skipped_damaged"] == 1 and s["deleted"] == 1
    assert s["saves"]["time_s"]["median"] <= s["saves"]["time_s"]["p95"] \
        <= s["saves"]["time_s"]["max"]
    assert s["saves"]["bytes"]["total"] == sum(h.bytes for h in history) > 3 * 4096
    assert s["last_error"]["event"] == "skip" and s["last_error"]["step"] == 3
    assert s["disk_bytes_now"] > 0
    assert cli(["stats", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "saves     4 (3 ok, 1 failed, 75.0% success)" in out
    assert "last error skip step 3" in out


def test_stats_survives_a_cut_last_line_and_says_when_there_is_nothing(tmp_path, capsys):
    _run(tmp_path)
    with open(tmp_path / METRICS_FILE, "a") as f:
        f.write('{"event": "save", "st')  # the process died mid-line
    s = summarize(load_metrics(tmp_path))
    assert s["malformed_lines"] == 1 and s["saves"]["count"] == 4
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli(["stats", str(empty)]) == 2
    assert "attach_monitor" in capsys.readouterr().err


def test_a_broken_metrics_file_never_breaks_a_save(tmp_path):
    with CheckpointManager(tmp_path) as m:
        attach_monitor(m, path=tmp_path / "no-such-dir" / "metrics.jsonl")
        assert m.save(0, {"t": _tree()})
        assert m.all_steps() == [0]


def test_dashboard_plots_what_was_recorded(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    _run(tmp_path)
    fig = plot_dashboard(tmp_path)
    ax_t, ax_b, ax_d = fig.axes[:3]
    lines = {ln.get_label(): ln for ln in ax_t.get_lines()}
    assert list(lines["save (total)"].get_xdata()) == [0, 1, 3]
    recs = load_metrics(tmp_path).records
    ok_saves = [r for r in recs if r["event"] == "save" and r["ok"]]
    assert list(lines["save (total)"].get_ydata()) == [r["total_s"] for r in ok_saves]
    assert list(lines["failed save"].get_xdata()) == [2]
    assert list(lines["restore"].get_xdata()) == [3, 3, 1]
    assert list(ax_b.get_lines()[0].get_ydata()) == [r["bytes"] / 2**10 for r in ok_saves]
    assert ax_b.get_ylabel() == "KiB per save"  # 4 KiB saves
    assert len(ax_d.get_lines()[0].get_xdata()) == 4  # disk use after every save
    import matplotlib.pyplot as plt

    plt.close(fig)
