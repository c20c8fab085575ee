"""One process of a multi-process CPU run (tests/test_distributed.py).

Started N times by the test, each with its process id, on forced host CPU
devices, joined through ``jax.distributed.initialize`` on localhost and gloo
collectives. Modes:

* ``train``: the sharded loss-scaled step of docs/distributed.md on a Flax
  MLP (params and optimizer state sharded over ``data``), an inf in process
  1's shard of the batch at one step; an orbax checkpoint mid-way; a resume
  from it into a sharded target; ``find_nonfinite`` on the global batch.
* ``restore``: restores that checkpoint on another process count and
  finishes the run.

Each process writes what it saw as JSON to ``<out>/<mode>-<id>.json``; the
test compares the processes and the modes. Everything here has a timeout
(the coordinator's initialization and the test's subprocess), so a process
that waits for a peer that died cannot hang CI.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any, cast

STEPS = 8
CHECKPOINT_AT = 4
INF_STEP = 2  # process 1 puts a value whose loss overflows into its shard
GLOBAL_BATCH = 16


def parse() -> argparse.Namespace:
  parser = argparse.ArgumentParser()
  parser.add_argument("mode", choices=["train", "restore"])
  parser.add_argument("--process-id", type=int, required=True)
  parser.add_argument("--num-processes", type=int, required=True)
  parser.add_argument("--port", type=int, required=True)
  parser.add_argument("--local-devices", type=int, required=True)
  parser.add_argument("--out", type=Path, required=True)
  return parser.parse_args()


ARGS = parse()
os.environ["XLA_FLAGS"] = " ".join(filter(None, [
    os.environ.get("XLA_FLAGS", ""),
    f"--xla_force_host_platform_device_count={ARGS.local_devices}"]))
os.environ["JAX_PLATFORMS"] = "cpu"

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jmp_lite  # noqa: E402
from jmp_lite.distributed import init_sharded, state_shardings  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
    coordinator_address=f"localhost:{ARGS.port}",
    num_processes=ARGS.num_processes, process_id=ARGS.process_id,
    initialization_timeout=60)


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(32)(x))
    return nn.Dense(4)(x)


MODEL = MLP()


def loss_fn(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
  pred = cast(jax.Array, MODEL.apply({"params": params}, x))
  return jnp.mean((pred - y) ** 2)


def fsdp_spec(x: Any) -> P:
  # FSDP-style: a leaf's first axis over "data" where it divides evenly.
  n = jax.device_count()
  return P("data") if x.ndim and x.shape[0] % n == 0 else P()


def global_batch(step: int) -> tuple[np.ndarray, np.ndarray]:
  """The whole batch of a step, as every process (and one device) sees it."""
  rng = np.random.default_rng(step)
  x = rng.standard_normal((GLOBAL_BATCH, 8)).astype(np.float32)
  y = rng.standard_normal((GLOBAL_BATCH, 4)).astype(np.float32)
  if step == INF_STEP:
    # A row of process 1's shard (rows are split in process order).
    x[GLOBAL_BATCH // 2 + 1, 3] = 1e30  # finite; its square is not
  return x, y


def local_batch(mesh: Any, step: int) -> tuple[jax.Array, jax.Array]:
  sharding = NamedSharding(mesh, P("data"))
  rows = GLOBAL_BATCH // jax.process_count()
  start = jax.process_index() * rows
  return tuple(jax.make_array_from_process_local_data(
      sharding, part[start:start + rows]) for part in global_batch(step))


def make_optimizer() -> optax.GradientTransformation:
  return jmp_lite.loss_scaled(
      optax.adam(1e-2), jmp_lite.DynamicLossScale(2.0 ** 15, period=2))


def make_step(optimizer: optax.GradientTransformation) -> Any:
  def train_step(params, opt_state, x, y):
    loss, grads = jmp_lite.scaled_value_and_grad(loss_fn, opt_state)(
        params, x, y)
    params, opt_state = jmp_lite.update_and_apply(
        optimizer, grads, opt_state, params)
    return params, opt_state, loss
  return jax.jit(train_step, donate_argnums=(0, 1))


def host(tree: Any) -> Any:
  """The global values, on every process (a collective: all must call)."""
  return multihost_utils.process_allgather(tree, tiled=True)


def digest(tree: Any) -> str:
  hashed = hashlib.sha256()
  for leaf in jax.tree.leaves(host(tree)):
    hashed.update(np.ascontiguousarray(leaf).tobytes())
  return hashed.hexdigest()


def scale_record(opt_state: Any) -> dict[str, Any]:
  state = jmp_lite.loss_scaled_state(opt_state)
  scale = state.loss_scale.loss_scale
  # Every local device's copy of the replicated scale, read separately.
  copies = sorted({float(np.asarray(s.data))
                   for s in scale.addressable_shards})
  return {"scale": float(host(scale)), "copies": copies,
          "skips": int(host(state.total_skips))}


def run(mesh: Any, params: Any, opt_state: Any, start: int,
        record: dict[str, Any]) -> tuple[Any, Any]:
  optimizer = make_optimizer()
  step = make_step(optimizer)
  for i in range(start, STEPS):
    x, y = local_batch(mesh, i)
    params, opt_state, loss = step(params, opt_state, x, y)
    record["history"].append(scale_record(opt_state))
    record["losses"].append(float(host(loss)))
    if i + 1 == CHECKPOINT_AT and record.get("checkpoint"):
      checkpointer = ocp.StandardCheckpointer()
      checkpointer.save(record["checkpoint"], (params, opt_state))
      checkpointer.wait_until_finished()
  return params, opt_state


def sharded_targets(mesh: Any) -> tuple[Any, Any]:
  """Restore targets carrying the shardings: abstract, nothing allocated."""
  shapes = jax.eval_shape(
      lambda: MODEL.init(jax.random.key(0), jnp.ones((1, 8)))["params"])
  params = jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(
          s.shape, s.dtype, sharding=NamedSharding(mesh, fsdp_spec(s))),
      shapes)
  optimizer = make_optimizer()
  state_shapes = jax.eval_shape(optimizer.init, params)
  state = jax.tree.map(
      lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                               sharding=sharding),
      state_shapes, state_shardings(optimizer, params))
  return params, state


def train(mesh: Any, out: Path) -> dict[str, Any]:
  params = MODEL.init(jax.random.key(0), jnp.ones((1, 8)))["params"]
  params = jax.device_put(
      params, jax.tree.map(lambda x: NamedSharding(mesh, fsdp_spec(x)),
                           params))
  optimizer = make_optimizer()
  opt_state = init_sharded(optimizer, params)
  record: dict[str, Any] = {"history": [], "losses": [],
                            "checkpoint": str(out / "checkpoint")}
  # find_nonfinite on the global, multi-process batch of the inf step.
  x, y = local_batch(mesh, INF_STEP)
  origin = jmp_lite.find_nonfinite(jax.grad(loss_fn), params, x, y)
  record["origin"] = None if origin is None else origin.primitive
  params, opt_state = run(mesh, params, opt_state, 0, record)
  record["final"] = digest(params)
  record["final_state"] = digest(opt_state)
  # Resume from the checkpoint into a sharded target, on this process count.
  checkpointer = ocp.StandardCheckpointer()
  restored = checkpointer.restore(record["checkpoint"],
                                  sharded_targets(mesh))
  resumed: dict[str, Any] = {"history": [], "losses": []}
  params, opt_state = restored
  params, opt_state = run(mesh, params, opt_state, CHECKPOINT_AT, resumed)
  record["resumed_history"] = resumed["history"]
  record["resumed_final"] = digest(params)
  record["resumed_final_state"] = digest(opt_state)
  return record


def restore(mesh: Any, out: Path) -> dict[str, Any]:
  checkpointer = ocp.StandardCheckpointer()
  restored = checkpointer.restore(str(out / "checkpoint"),
                                  sharded_targets(mesh))
  record: dict[str, Any] = {"history": [], "losses": []}
  params, opt_state = restored
  params, opt_state = run(mesh, params, opt_state, CHECKPOINT_AT, record)
  record["resumed_final_params"] = [
      np.asarray(leaf).tolist() for leaf in jax.tree.leaves(host(params))]
  record["resumed_final"] = digest(params)
  return record


def main() -> None:
  mesh = jax.make_mesh((jax.device_count(),), ("data",),
                       axis_types=(AxisType.Auto,))
  out = ARGS.out
  record = (train if ARGS.mode == "train" else restore)(mesh, out)
  record.update(process=jax.process_index(), processes=jax.process_count(),
                devices=jax.device_count(),
                local_devices=jax.local_device_count())
  path = out / f"{ARGS.mode}-{jax.process_index()}.json"
  path.write_text(json.dumps(record))
  multihost_utils.sync_global_devices("done")
  jax.distributed.shutdown()
  print("ok", ARGS.mode, jax.process_index(), file=sys.stderr)


if __name__ == "__main__":
  main()
