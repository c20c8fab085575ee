"""An Equinox model in bfloat16 with float32 master weights.

``jmp_lite.equinox.mixed_precision`` stores the model's arrays in bfloat16
and runs it in bfloat16, its LayerNorm in float32 and its head under a rule
in float32; ``master_weights`` keeps a float32 copy the optimizer updates,
so the bfloat16 params lose no small update. The step is Equinox's own:
``eqx.partition`` into arrays and the rest, ``eqx.filter_jit``.

  python examples/equinox_mlp.py --steps 50
"""

from __future__ import annotations

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite
import jmp_lite.equinox as jeqx


class Classifier(eqx.Module):
  layers: list

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.layers = [eqx.nn.Linear(32, 64, key=k1), jax.nn.relu,
                   eqx.nn.LayerNorm(64), eqx.nn.Linear(64, 10, key=k2)]

  def __call__(self, x):
    for layer in self.layers:
      x = layer(x)
    return x


def main(steps: int) -> None:
  model = jeqx.mixed_precision(Classifier(jax.random.key(0)),
                               "p=bf16,c=bf16,o=f32",
                               rules=[("layers/3", "p=bf16,c=f32,o=f32")])
  params, static = eqx.partition(model, eqx.is_array)
  optimizer = jmp_lite.master_weights(
      jmp_lite.loss_scaled(optax.adam(3e-3), "bf16"))
  opt_state = optimizer.init(params)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((128, 32)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 10, 128))

  def loss_fn(params, x, y):
    logits = jax.vmap(eqx.combine(params, static))(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  @eqx.filter_jit
  def train_step(params, opt_state, x, y):
    loss, grads = jmp_lite.scaled_value_and_grad(loss_fn, opt_state)(
        params, x, y)
    params, opt_state = jmp_lite.update_and_apply(optimizer, grads,
                                                  opt_state, params)
    return params, opt_state, loss

  losses = []
  for _ in range(steps):
    params, opt_state, loss = train_step(params, opt_state, x, y)
    losses.append(float(loss))
  print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")

  # What this example demonstrates, checked.
  model = eqx.combine(params, static)
  assert model.module.layers[0].weight.dtype == jnp.bfloat16   # stored bf16
  master = jmp_lite.master_params(opt_state)
  assert master.module.layers[0].weight.dtype == jnp.float32   # f32 copy
  assert jax.vmap(model)(x).dtype == jnp.float32
  report = jeqx.dtype_report(model, x[0])
  print(report)
  computed = {row.path: row.computed for row in report.rows}
  assert computed["layers/0"] == "bfloat16", computed
  assert computed["layers/3"] == "float32", computed
  assert losses[-1] < 0.8 * losses[0], losses
  print("ok")


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=30)
  main(parser.parse_args().steps)
