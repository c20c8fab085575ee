"""A Flax linen model in bfloat16 with loss scaling and a donated train step.

The model is written as Flax's examples write it (``dtype=jnp.float32`` on
every layer); ``jmp_lite.linen.mixed_precision`` runs it under the policy
anyway, keeping the head in float32 by a rule. The optimizer carries a
dynamic loss scale; ``jax.jit(..., donate_argnums=...)`` reuses the params'
and optimizer state's buffers for the new ones.

  python examples/linen_bf16_loss_scaling.py --steps 50
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite
import jmp_lite.linen as jl


class MLP(nn.Module):
  dtype: object = jnp.float32

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(64, dtype=self.dtype)(x))
    x = nn.relu(nn.Dense(64, dtype=self.dtype)(x))
    return nn.Dense(10, dtype=self.dtype, name="head")(x)


def main(steps: int) -> None:
  policy = "p=f32,c=bf16,o=f32"
  model = jl.mixed_precision(MLP(), policy, rules=[("head", "f32")])
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((128, 32)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 10, 128))
  params = model.init(jax.random.key(0), x)["params"]

  optimizer = jmp_lite.loss_scaled(optax.adam(3e-3),
                                   jmp_lite.DynamicLossScale(2.0 ** 15))
  opt_state = optimizer.init(params)

  def loss_fn(params, x, y):
    logits = model.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  def train_step(params, opt_state, x, y):
    loss, grads = jmp_lite.scaled_value_and_grad(loss_fn, opt_state)(
        params, x, y)
    params, opt_state = jmp_lite.update_and_apply(optimizer, grads,
                                                  opt_state, params)
    return params, opt_state, loss

  train_step = jax.jit(train_step, donate_argnums=(0, 1))
  losses = []
  for _ in range(steps):
    old_params = params
    params, opt_state, loss = train_step(params, opt_state, x, y)
    losses.append(float(loss))
  state = jmp_lite.loss_scaled_state(opt_state)
  print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, scale"
        f" {float(state.loss_scale.loss_scale):.0f},"
        f" skipped {int(state.total_skips)}")

  # What this example demonstrates, checked.
  report = jl.dtype_report(model, {"params": params}, x)
  computed = {row.path: row.computed for row in report.rows}
  assert computed["Dense_0"] == "bfloat16", computed
  assert computed["head"] == "float32", computed
  assert params["Dense_0"]["kernel"].dtype == jnp.float32  # params stay f32
  assert jax.tree.leaves(old_params)[0].is_deleted()  # donated
  assert losses[-1] < 0.8 * losses[0], losses
  print("ok")


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=30)
  main(parser.parse_args().steps)
