"""A Flax nnx model in float16 with dynamic loss scaling.

``jmp_lite.nnx.mixed_precision`` runs the model's code in float16 while its
params stay float32. The step is functional: ``nnx.split`` separates the
params from the module's structure, the loss ``nnx.merge``-s them back, and
``scaled_value_and_grad`` + ``update_and_apply`` scale the loss, unscale the
gradients, skip a non-finite step and grow or shrink the scale. One batch
with an overflowing input shows a skipped step.

  python examples/nnx_float16_dynamic_scaling.py --steps 50
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jmp_lite
import jmp_lite.nnx


class MLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(32, 64, rngs=rngs)
    self.out = nnx.Linear(64, 10, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.hidden(x)))


def main(steps: int) -> None:
  model = jmp_lite.nnx.mixed_precision(MLP(nnx.Rngs(0)), "p=f32,c=f16,o=f32")
  graphdef, params = nnx.split(model, nnx.Param)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((128, 32)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 10, 128))

  # Dynamic scaling: start high, halve on a non-finite step, double after
  # `period` finite steps in a row.
  optimizer = jmp_lite.loss_scaled(
      optax.adam(3e-3), jmp_lite.DynamicLossScale(2.0 ** 15, period=10))
  opt_state = optimizer.init(params)

  def loss_fn(params, x, y):
    logits = nnx.merge(graphdef, params)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  @jax.jit
  def train_step(params, opt_state, x, y):
    loss, grads = jmp_lite.scaled_value_and_grad(loss_fn, opt_state)(
        params, x, y)
    params, opt_state = jmp_lite.update_and_apply(optimizer, grads,
                                                  opt_state, params)
    return params, opt_state, loss

  losses = []
  for step in range(steps):
    # Step 3's batch overflows float16 (65504): the step is skipped, the
    # params and Adam's moments are left as they were, the scale halves.
    batch = x.at[0, 0].set(1e6) if step == 3 else x
    before = params
    params, opt_state, loss = train_step(params, opt_state, batch, y)
    if step == 3:
      jax.tree.map(np.testing.assert_array_equal, before, params)
    else:
      losses.append(float(loss))
  state = jmp_lite.loss_scaled_state(opt_state)
  print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, scale"
        f" {float(state.loss_scale.loss_scale):.0f},"
        f" skipped {int(state.total_skips)}")

  # What this example demonstrates, checked.
  assert int(state.total_skips) == 1
  model = nnx.merge(graphdef, params)
  assert model.hidden.kernel[...].dtype == jnp.float32        # params f32
  report = jmp_lite.nnx.dtype_report(model, x)
  computed = {row.path: row.computed for row in report.rows}
  assert computed["hidden"] == computed["out"] == "float16", report
  assert model(x).dtype == jnp.float32                        # output f32
  assert losses[-1] < 0.8 * losses[0], losses
  print("ok")


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=30)
  main(parser.parse_args().steps)
