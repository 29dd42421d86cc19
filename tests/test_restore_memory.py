"""A restore onto devices holds a bounded amount of host memory beyond the arrays it returns
(issue 51): its leaves go through a small pool of reused buffers, not one fresh buffer each,
and the bytes restored are the bytes saved.

CI has no accelerator, so the restore runs on 4 CPU devices with the pool forced on
(``MINICKPT_RESTORE_POOL=on``: each leaf read into a pool buffer, copied out to its devices,
the buffer reused), in a fresh process of its own, so that the measure is that restore's
alone. Two measures, neither of them a time (so a loaded machine cannot make them flaky):

* the process's peak resident memory (``VmHWM``, reset just before the restore through
  ``/proc/self/clear_refs`` where the kernel allows it) minus its resident memory before,
  against the bytes of the arrays returned (every addressable shard), with a generous
  margin for the allocator and JAX;
* the pool's own accounting (``RESTORE_POOL.peak``, ``.allocated``), against its bound: two
  buffers per reader thread.

tracemalloc would see neither numpy's buffers nor XLA's, hence these.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from minickpt import Checkpointer

pytestmark = pytest.mark.timeout(300)

LEAVES, PER_LEAF = 48, 4 << 20  # 192 MiB in 4 MiB leaves: a large item, many pool turns
MIB = 1 << 20

_WORKER = r"""
import hashlib, json, os, sys
import numpy as np
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding
from minickpt import Checkpointer
from minickpt.format import buffers, read

def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)

path, spec = sys.argv[1], json.loads(sys.argv[2])
devs = jax.devices()
assert len(devs) == 4, devs
mesh = Mesh(np.array(devs), ("d",))
target = {}
for name, (shape, dtype) in spec.items():
    i = int(name[1:]) if name[1:].isdigit() else 0
    s = SingleDeviceSharding(devs[i % 4]) if i % 4 == 3 else NamedSharding(mesh, P("d"))
    target[name] = jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=s)
target["step"] = 0
buffers.RESTORE_POOL.reset_peak()
reset = True
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
except OSError:
    reset = False
before_rss, before_hwm = status("VmRSS"), status("VmHWM")
out = Checkpointer().restore(path, {"state": target})["state"]
jax.block_until_ready(out)
peak = status("VmHWM")
held = sum(sh.data.nbytes for k, v in out.items() if k != "step"
           for sh in v.addressable_shards)
digests = {k: hashlib.sha256(np.asarray(v).tobytes()).hexdigest()
           for k, v in out.items() if k != "step"}
print(json.dumps({"reset": reset, "before_rss": before_rss, "before_hwm": before_hwm,
                  "peak": peak, "held": held, "digests": digests, "step": out["step"],
                  "pool_peak": buffers.RESTORE_POOL.peak,
                  "pool_allocated": buffers.RESTORE_POOL.allocated,
                  "threads": read._READ_THREADS}))
"""


def _state() -> dict:
    rng = np.random.default_rng(51)
    state: dict = {f"w{i}": rng.standard_normal((4, PER_LEAF // 16), dtype=np.float32)
                   for i in range(LEAVES)}
    state["bias"] = rng.standard_normal((4, 8), dtype=np.float32)  # a small leaf beside them
    state["step"] = 51
    return state


def _run(path: Path, spec: dict, pool: str) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "MINICKPT_RESTORE_POOL": pool,
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    r = subprocess.run([sys.executable, "-c", _WORKER, str(path), json.dumps(spec)],
                       env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, f"the restoring process failed:\n{r.stderr[-3000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_a_restore_onto_devices_holds_a_pool_not_the_state(tmp_path):
    state = _state()
    Checkpointer().save(tmp_path / "ck", {"state": state})
    spec = {k: (list(v.shape), str(v.dtype)) for k, v in state.items() if k != "step"}
    got = _run(tmp_path / "ck", spec, "on")

    # the same bytes as were saved, every leaf
    want = {k: hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()
            for k, v in state.items() if k != "step"}
    assert got["digests"] == want, "restored bytes differ from the saved ones: " + str(
        sorted(k for k in want if got["digests"].get(k) != want[k]))
    assert got["step"] == 51

    # the pool's own accounting: two buffers per reader thread, each of the leaves' class
    bound = 2 * got["threads"] * PER_LEAF
    assert 0 < got["pool_peak"] <= bound, (
        f"the pool had {got['pool_peak'] / MIB:.0f} MiB out at once; its bound is "
        f"{bound / MIB:.0f} MiB (two {PER_LEAF // MIB} MiB buffers per reader thread)")
    assert got["pool_allocated"] <= bound

    # the process's memory: the arrays returned, the pool, and a margin; not the state twice
    state_bytes = LEAVES * PER_LEAF
    grew = got["peak"] - (got["before_rss"] if got["reset"] else got["before_hwm"])
    allowed = got["held"] + bound + 64 * MIB
    assert got["held"] >= state_bytes
    assert grew <= allowed, (
        f"the restore's peak memory grew by {grew / MIB:.0f} MiB for "
        f"{got['held'] / MIB:.0f} MiB of arrays returned: more than those, the pool's "
        f"{bound / MIB:.0f} MiB and a 64 MiB margin ({allowed / MIB:.0f} MiB). Does each "
        "leaf still get a host buffer of its own, kept until the restore returns?")
