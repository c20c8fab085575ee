"""Many devices and hosts: jmp_lite.distributed, and runs across processes.

The device count is fixed when JAX starts, so the checks on several devices
run in subprocesses: tests/multiprocess/one_process.py on 4 forced host
devices, docs/distributed.md on 4 devices, and tests/multiprocess/worker.py
as 2 processes x 2 CPU devices joined by ``jax.distributed.initialize`` on
localhost (gloo collectives), then 4 processes x 1 device. Every subprocess
has a timeout and every port is picked free, so nothing can hang.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite
from jmp_lite.distributed import device_bytes, init_sharded, state_shardings
from tests.conftest import multidevice_env, ROOT, run_multidevice

WORKER = ROOT / "tests" / "multiprocess" / "worker.py"
TIMEOUT = 300  # seconds for a whole multi-process run


def test_init_sharded_on_one_device_is_a_placed_init():
  opt = jmp_lite.loss_scaled(optax.adam(1e-3),
                             jmp_lite.DynamicLossScale(2.0 ** 15))
  params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
  state = init_sharded(opt, params)
  want = opt.init(params)
  assert jax.tree.structure(state) == jax.tree.structure(want)
  for got, ref in zip(jax.tree.leaves(state), jax.tree.leaves(want),
                      strict=True):
    # numpy loss-scale leaves become device arrays, values and dtypes kept.
    assert isinstance(got, jax.Array)
    assert got.dtype == np.asarray(ref).dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
  assert state_shardings(opt, params) is None


def test_device_bytes_counts_each_device_once_per_array():
  w = jnp.ones((4, 2), jnp.bfloat16)
  (device,) = w.devices()
  assert device_bytes({"w": w, "tied": w, "host": np.ones(3)}) == {
      device: 16}
  assert device_bytes({}) == {}


def test_on_four_devices():
  proc = run_multidevice("multiprocess/one_process.py", 4, timeout=TIMEOUT)
  assert proc.stdout.splitlines() == [
      "ok init_sharded Auto",
      "ok init_sharded Explicit",
      "ok restore into init_sharded",
      "ok unsharded params and params on two meshes",
      "ok device_bytes",
  ], proc.stdout + proc.stderr


def test_quantized_states_whose_blocks_span_devices_are_made_sharded():
  """init_sharded and state_shardings raised JAX's ShardingTypeError for
  quantized_states(adam) when a row-sharded param's last axis was shorter
  than a block (tests/multidevice/distributed_quantized.py, 8 devices)."""
  proc = run_multidevice("multidevice/distributed_quantized.py", 8,
                         timeout=TIMEOUT)
  assert proc.stdout.splitlines() == [
      "ok Explicit 8 bits", "ok Explicit 4 bits", "ok Auto 8 bits",
  ], proc.stdout + proc.stderr


RUN_PAGE = """
import re, textwrap, warnings
from pathlib import Path
warnings.simplefilter("error")
namespace = {}
exec("import jax, jax.numpy as jnp, numpy as np, optax, jmp_lite", namespace)
text = Path("docs/distributed.md").read_text()
for i, block in enumerate(re.findall(
    r"^[ \\t]*```python\\n(.*?)^[ \\t]*```", text, re.S | re.M)):
  exec(compile(textwrap.dedent(block), f"distributed.md[{i}]", "exec"),
       namespace)
assert namespace["n"] == 4
per_device = namespace["per_device"]
assert max(per_device.values()) < namespace["tree_bytes"](
    (namespace["params"], namespace["opt_state"]))
print("ok page")
"""


# tests/test_docs_pages.py runs the page by default (on the 8 devices it asks
# for); this second run on 4 devices is in the slow set.
@pytest.mark.slow
def test_docs_page_runs_on_four_devices():
  proc = subprocess.run([sys.executable, "-c", RUN_PAGE], capture_output=True,
                        text=True, cwd=ROOT, env=multidevice_env(4),
                        timeout=TIMEOUT)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert proc.stdout.splitlines()[-1] == "ok page", proc.stdout


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _run_processes(mode: str, processes: int, local_devices: int,
                   out: Path) -> list[dict]:
  """Runs the worker as ``processes`` processes; returns their records."""
  port = _free_port()
  env = multidevice_env(local_devices)
  procs = [subprocess.Popen(
      [sys.executable, str(WORKER), mode, "--process-id", str(i),
       "--num-processes", str(processes), "--port", str(port),
       "--local-devices", str(local_devices), "--out", str(out)],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
      env=env) for i in range(processes)]
  logs = []
  try:
    for proc in procs:
      logs.append(proc.communicate(timeout=TIMEOUT)[0])
  finally:
    for proc in procs:  # a peer that failed leaves the others waiting
      if proc.poll() is None:
        proc.kill()
        proc.communicate()
  for proc in procs:
    assert proc.returncode == 0, "\n".join(logs)
  return [json.loads((out / f"{mode}-{i}.json").read_text())
          for i in range(processes)]


def _assert_same(records: list[dict], *keys: str) -> None:
  for key in keys:
    values = [r[key] for r in records]
    assert all(v == values[0] for v in values), (key, values)


@pytest.mark.slow   # 2 + 4 processes, each compiling the step: ~25 s
def test_two_processes_agree_and_resume_on_four(tmp_path):
  train = _run_processes("train", 2, 2, tmp_path)
  assert [(r["processes"], r["devices"], r["local_devices"])
          for r in train] == [(2, 4, 2)] * 2
  # The same decisions on every process, and every device's copy agrees.
  _assert_same(train, "history", "losses", "origin", "final", "final_state",
               "resumed_history", "resumed_final", "resumed_final_state")
  history = train[0]["history"]
  assert all(len(h["copies"]) == 1 for h in history), history
  # Only the step with process 1's overflowing row was skipped; the scale
  # backed off there (period 2: it doubles every second good step).
  skips = [h["skips"] for h in history]
  assert skips == [0, 0, 1, 1, 1, 1, 1, 1], skips
  scales = [h["scale"] for h in history]
  assert scales[2] == scales[1] / 2, scales
  assert all(np.isfinite(train[0]["losses"][i]) for i in (0, 1, 3, 4))
  # find_nonfinite on the global batch: the square of the loss overflows.
  assert train[0]["origin"] == "integer_pow", train[0]["origin"]
  # The orbax resume (sharded targets) continues bit-identically.
  assert train[0]["resumed_history"] == history[4:]
  assert train[0]["resumed_final"] == train[0]["final"]
  assert train[0]["resumed_final_state"] == train[0]["final_state"]

  # The same checkpoint restored onto 4 processes x 1 device.
  restored = _run_processes("restore", 4, 1, tmp_path)
  assert [(r["processes"], r["devices"]) for r in restored] == [(4, 4)] * 4
  _assert_same(restored, "history", "losses", "resumed_final")
  # The same decisions; the weights agree closely (a different all-reduce
  # may sum the gradients in another order).
  assert restored[0]["history"] == history[4:]
  np.testing.assert_allclose(restored[0]["losses"], train[0]["losses"][4:],
                             rtol=1e-5)
