"""The minickpt command line on real checkpoint directories."""

import json
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from minickpt import CheckpointManager
from minickpt.cli import main


@pytest.fixture
def run_dir(tmp_path):
    with CheckpointManager(tmp_path / "run") as m:
        for s in (10, 20):
            m.save(s, {"params": {"w": jnp.full((2, 3), s, jnp.float32),
                                  "b": jnp.zeros(3, jnp.bfloat16)},
                       "meta": {"lr": 0.1, "name": "mlp"}},
                   metrics={"loss": 1.0 / s}, metadata={"version": f"v{s}"})
    return tmp_path / "run"


def cli(capsys, *args):
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_ls(capsys, run_dir):
    (run_dir / "step_30.minickpt-tmp-dead").mkdir()
    rc, out, _ = cli(capsys, "ls", run_dir)
    assert rc == 0
    assert "10" in out and "20" in out and "valid" in out and "loss=0.05" in out
    assert "temporary" in out
    rc, out, _ = cli(capsys, "ls", run_dir, "--json")
    recs = json.loads(out)
    assert [r["step"] for r in recs] == [10, 20, None]
    assert recs[1]["metrics"] == {"loss": 0.05} and recs[1]["items"] == ["meta", "params"]


def test_inspect_shows_paths_dtypes_shapes(capsys, run_dir):
    rc, out, _ = cli(capsys, "inspect", run_dir)
    assert rc == 0 and "step_20" in out
    assert "w" in out and "float32" in out and "(2, 3)" in out and "bfloat16" in out
    assert "'mlp'" in out and "v20" in out
    rc, out, _ = cli(capsys, "inspect", run_dir, 10, "--json", "--item", "params")
    data = json.loads(out)
    assert data["step"] == 10 and list(data["items"]) == ["params"]
    assert {"path": "w", "names": ["w"], "kind": "array", "dtype": "float32", "shape": [2, 3],
            "bytes": 24} in data["items"]["params"]["leaves"]


def test_verify_detects_damage_and_names_it(capsys, run_dir):
    rc, out, _ = cli(capsys, "verify", run_dir)
    assert rc == 0 and out.count("OK") == 2
    data = run_dir / "step_20" / "params" / "data.bin"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    rc, out, _ = cli(capsys, "verify", run_dir)
    assert rc == 1 and "DAMAGED" in out and "data.bin" in out and "leaf w" in out
    rc, out, _ = cli(capsys, "verify", run_dir, 10)
    assert rc == 0
    rc, out, _ = cli(capsys, "ls", run_dir, "--deep")
    assert rc == 1 and "damaged" in out
    rc, out, _ = cli(capsys, "verify", run_dir, "--json")
    assert [r["ok"] for r in json.loads(out)] == [True, False]


def test_diff(capsys, run_dir):
    rc, out, _ = cli(capsys, "diff", run_dir / "step_10", run_dir / "step_20")
    assert rc == 1 and "params/w: 6 of 6 values differ" in out and "max |A-B| = 10" in out
    rc, out, _ = cli(capsys, "diff", run_dir / "step_20", run_dir)  # run dir = its latest
    assert rc == 0 and "identical" in out
    rc, out, _ = cli(capsys, "diff", run_dir / "step_10", run_dir / "step_20", "--json")
    d = json.loads(out)
    assert not d["identical"] and d["leaves"][0]["path"] == "params/w"


def test_usage_errors_are_clear(capsys, tmp_path):
    rc, _, err = cli(capsys, "ls", tmp_path / "missing")
    assert rc == 2 and "no such directory" in err
    rc, _, err = cli(capsys, "inspect", tmp_path, 5)
    assert rc == 2 and "no checkpoint for step 5" in err


def test_verify_with_nothing_to_verify_fails_clearly(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "step_3.minickpt-tmp-dead").mkdir()  # a temporary is no checkpoint
    for args in (("verify", tmp_path / "empty"), ("verify", tmp_path / "empty", "--json")):
        rc, out, err = cli(capsys, *args)
        assert rc == 2 and "no checkpoints in" in err and "nothing to verify" in err
        assert out == ""
    rc, _, err = cli(capsys, "verify", tmp_path / "missing")
    assert rc == 2 and "no such directory" in err
    rc, _, err = cli(capsys, "ls", tmp_path / "empty")  # an empty listing is an answer
    assert rc == 0


def test_damage_found_by_inspect_and_diff_exits_1(capsys, run_dir):
    data = run_dir / "step_20" / "params" / "data.bin"
    raw = bytearray(data.read_bytes())
    raw[0] ^= 1
    data.write_bytes(bytes(raw))
    rc, _, err = cli(capsys, "diff", run_dir / "step_10", run_dir / "step_20")
    assert rc == 1 and "error" in err and "data.bin" in err
    meta = run_dir / "step_10" / "_CHECKPOINT_METADATA"
    meta.write_bytes(meta.read_bytes()[:-5])
    rc, _, err = cli(capsys, "inspect", run_dir, 10)
    assert rc == 1 and "_CHECKPOINT_METADATA" in err
    rc, _, err = cli(capsys, "inspect", run_dir, 99)  # a step that is not there: usage
    assert rc == 2


@pytest.mark.parametrize("cmd", ["ls", "inspect", "verify", "diff", "stats"])
def test_every_subcommand_describes_its_arguments(capsys, cmd):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in {"ls": ["DIR"], "inspect": ["DIR", "STEP"], "verify": ["DIR", "STEP"],
                 "diff": ["A", "B"], "stats": ["DIR"]}[cmd]:
        line = next(x for x in out.splitlines() if x.strip().startswith(name + " "))
        assert len(line.split(None, 1)[1]) > 20, line  # a description, not just the name


def test_console_script_help():
    out = subprocess.run([sys.executable, "-m", "minickpt.cli", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "inspect" in out.stdout and "atomic rename" in out.stdout
    text = " ".join(out.stdout.split())
    assert "1 damage found by any command" in text and "2 usage error" in text
    assert np


def _slash_run(tmp_path, nested):
    """A dict key holding '/' beside a nested dict whose path joins to the same string."""
    d = tmp_path / f"slash-{nested}"
    with CheckpointManager(d) as m:
        m.save(1, {"s": {"a/b": np.ones(3, np.float32),
                         "a": {"b": np.full(3, nested, np.float32)}}})
    return d


def test_a_key_holding_a_slash_is_its_own_leaf_in_diff_and_inspect(capsys, tmp_path):
    a, b = _slash_run(tmp_path, 0.0), _slash_run(tmp_path, 1.0)
    rc, out, _ = cli(capsys, "diff", a, b)
    assert rc == 1 and "identical" not in out, \
        f"'a/b' and a -> b are two leaves, and a -> b differs:\n{out}"
    assert "s/a/b: 3 of 3 values differ" in out
    rc, out, _ = cli(capsys, "diff", a, b, "--json")
    d = json.loads(out)
    assert not d["identical"] and [r["names"] for r in d["leaves"]] == [["s", "a", "b"]]
    rc, out, _ = cli(capsys, "diff", a, a, "--json", "--all")
    assert [r["names"] for r in json.loads(out)["leaves"]] == [["s", "a", "b"], ["s", "a/b"]]
    rc, out, _ = cli(capsys, "inspect", a, "--json")
    leaves = json.loads(out)["items"]["s"]["leaves"]
    assert sorted(r["names"] for r in leaves) == [["a", "b"], ["a/b"]]
    assert len({r["path"] for r in leaves}) == 2, "two leaves shown under one name"
    rc, out, _ = cli(capsys, "inspect", a)
    assert rc == 0 and '"a/b"' in out and "\na/b " in out


def _strict_json(text):
    def refuse(name):
        raise AssertionError(f"--json printed {name}, which is not JSON (RFC 8259)")
    return json.loads(text, parse_constant=refuse)


def test_json_is_strict_with_non_finite_metrics_and_values(capsys, tmp_path):
    with CheckpointManager(tmp_path / "run") as m:
        m.save(1, {"s": {"w": np.ones(2), "lr": float("nan"), "big": float("-inf")}},
               metrics={"loss": float("nan"), "grad": float("inf")}, metadata={"x": 1.5})
    rc, out, _ = cli(capsys, "ls", tmp_path / "run", "--json")
    assert rc == 0 and _strict_json(out)[0]["metrics"] == {"loss": "NaN", "grad": "Infinity"}
    rc, out, _ = cli(capsys, "inspect", tmp_path / "run", "--json")
    d = _strict_json(out)
    assert d["metrics"] == {"loss": "NaN", "grad": "Infinity"}
    values = {r["path"]: r.get("value") for r in d["items"]["s"]["leaves"]}
    assert values["lr"] == "NaN" and values["big"] == "-Infinity"
    for cmd in (["verify"], ["diff", tmp_path / "run"]):
        rc, out, _ = cli(capsys, cmd[0], tmp_path / "run", *cmd[1:], "--json")
        _strict_json(out)
    rc, out, _ = cli(capsys, "ls", tmp_path / "run")  # people still read nan
    assert "loss=nan" in out and "grad=inf" in out


def test_a_file_where_a_directory_is_expected_says_so(capsys, tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("not a checkpoint\nnor metrics\n")
    for cmd in ("ls", "inspect", "verify"):
        rc, out, err = cli(capsys, cmd, f)
        assert rc == 2 and "is a file" in err and "checkpoint directory" in err, (cmd, err)
        assert "Errno" not in err and out == ""
    rc, out, err = cli(capsys, "stats", f)
    assert rc == 2 and "not a metrics file" in err and ".minickpt-metrics.jsonl" in err, err
    assert out == ""
