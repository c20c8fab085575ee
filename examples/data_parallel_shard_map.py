"""Data parallel training with ``jax.shard_map`` and a dynamic loss scale.

Each device runs the step on its slice of the batch; the gradients are
averaged with ``lax.pmean``, and ``loss_scaled(..., axis_name="data")``
agrees on the finiteness of the gradients over the data axis, so an
overflow on one device makes every device skip the step and back off the
scale together. On a machine with one CPU device the script asks XLA for 8
host devices (set before JAX starts); on a GPU node it uses the GPUs.

  python examples/data_parallel_shard_map.py --steps 20
"""

from __future__ import annotations

import os

flags = os.environ.get("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in flags:
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8"

import argparse  # noqa: E402 (JAX reads XLA_FLAGS when it starts)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jmp_lite  # noqa: E402
import jmp_lite.linen as jl  # noqa: E402


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(10)(nn.relu(nn.Dense(64)(x)))


def main(steps: int) -> None:
  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))
  model = jl.mixed_precision(MLP(), "p=f32,c=f16,o=f32")
  rng = np.random.default_rng(0)
  x_host = rng.standard_normal((16 * n, 32)).astype(np.float32)
  y_host = rng.integers(0, 10, 16 * n)
  params = model.init(jax.random.key(0), jnp.ones((1, 32)))["params"]
  params = jax.device_put(params, NamedSharding(mesh, P()))  # replicated
  batch_sharding = NamedSharding(mesh, P("data"))  # split over the devices
  x, y = (jax.device_put(a, batch_sharding) for a in (x_host, y_host))
  # A batch that overflows float16 (65504) on the first device's slice only.
  bad_host = x_host.copy()
  bad_host[0, 0] = 1e6
  bad_x = jax.device_put(bad_host, batch_sharding)

  optimizer = jmp_lite.loss_scaled(
      optax.adam(3e-3), jmp_lite.DynamicLossScale(2.0 ** 15), axis_name="data")
  opt_state = optimizer.init(params)

  def loss_fn(params, x, y):
    logits = model.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  def local_step(params, opt_state, x, y):
    loss, grads = jmp_lite.scaled_value_and_grad(loss_fn, opt_state)(
        params, x, y)
    grads = jax.lax.pmean(grads, "data")
    params, opt_state = jmp_lite.update_and_apply(optimizer, grads,
                                                  opt_state, params)
    return params, opt_state, jax.lax.pmean(loss, "data")

  train_step = jax.jit(jax.shard_map(
      local_step, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
      out_specs=(P(), P(), P())), donate_argnums=(0, 1))

  losses = []
  for step in range(steps):
    batch = bad_x if step == 2 else x
    params, opt_state, loss = train_step(params, opt_state, batch, y)
    if step != 2:
      losses.append(float(loss))
  state = jmp_lite.loss_scaled_state(opt_state)
  print(f"{n} devices: loss {losses[0]:.3f} -> {losses[-1]:.3f}, scale"
        f" {float(state.loss_scale.loss_scale):.0f},"
        f" skipped {int(state.total_skips)}")

  # What this example demonstrates, checked: one skip, taken by every
  # device; params identical on every device; the model learns.
  assert int(state.total_skips) == 1
  assert float(state.loss_scale.loss_scale) == 2.0 ** 14
  kernel = params["Dense_0"]["kernel"]
  shards = [np.asarray(s.data) for s in kernel.addressable_shards]
  assert len(shards) == n and all((s == shards[0]).all() for s in shards)
  assert losses[-1] < 0.8 * losses[0], losses
  print("ok")


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=20)
  main(parser.parse_args().steps)
