"""Checkpoint a loss-scaled run with orbax, resume it, get the same result.

The optimizer state (Adam's moments, the dynamic loss scale, its counters,
the skip count) is a pytree of arrays like the params, so orbax saves and
restores it with them. The run trains ``--steps`` steps without a break,
then again with a save half-way, a restore into a fresh process's worth of
state (a target built by ``jax.eval_shape``, no real init) and the rest of
the steps: the two runs end bit for bit equal.

  python examples/checkpoint_resume_orbax.py --steps 20
"""

from __future__ import annotations

import argparse
import tempfile

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import jmp_lite
import jmp_lite.linen as jl


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(10)(nn.relu(nn.Dense(64)(x)))


model = jl.mixed_precision(MLP(), "p=f32,c=f16,o=f32")
optimizer = jmp_lite.loss_scaled(optax.adam(3e-3),
                                 jmp_lite.DynamicLossScale(2.0 ** 15, period=4))
rng = np.random.default_rng(0)
X = jnp.asarray(rng.standard_normal((128, 32)), jnp.float32)
Y = jnp.asarray(rng.integers(0, 10, 128))


def loss_fn(params, x, y):
  logits = model.apply({"params": params}, x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@jax.jit
def train_step(params, opt_state, x, y):
  loss, grads = jmp_lite.scaled_value_and_grad(loss_fn, opt_state)(
      params, x, y)
  params, opt_state = jmp_lite.update_and_apply(optimizer, grads, opt_state,
                                                params)
  return params, opt_state, loss


def init():
  params = model.init(jax.random.key(0), X[:1])["params"]
  return params, optimizer.init(params)


def run(params, opt_state, start: int, stop: int):
  for _ in range(start, stop):
    params, opt_state, _ = train_step(params, opt_state, X, Y)
  return params, opt_state


def main(steps: int) -> None:
  half = steps // 2
  uninterrupted = run(*init(), 0, steps)

  with tempfile.TemporaryDirectory() as directory:
    checkpointer = ocp.StandardCheckpointer()
    params, opt_state = run(*init(), 0, half)
    checkpointer.save(f"{directory}/step_{half}", (params, opt_state))
    checkpointer.wait_until_finished()
    del params, opt_state
    # A new process would start here: it knows the state's structure (from
    # eval_shape, which allocates nothing), not its values.
    target = jax.eval_shape(init)
    params, opt_state = checkpointer.restore(f"{directory}/step_{half}",
                                             target)
    resumed = run(params, opt_state, half, steps)

  # What this example demonstrates, checked: every leaf, loss scale and
  # counters included, equal bit for bit.
  jax.tree.map(np.testing.assert_array_equal, uninterrupted, resumed)
  state = jmp_lite.loss_scaled_state(resumed[1])
  assert isinstance(state.loss_scale, jmp_lite.DynamicLossScale)
  print(f"resumed at step {half} of {steps}: equal to the uninterrupted run;"
        f" scale {float(state.loss_scale.loss_scale):.0f}")
  print("ok")


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=20)
  main(parser.parse_args().steps)
