"""Tests for jmp_lite.nnx: policies on flax.nnx models."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_lite
import jmp_lite.nnx as jnnx
from tests.conftest import assert_dtype


class Net(nnx.Module):
  def __init__(self, rngs):
    self.conv = nnx.Conv(3, 8, (3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(8, rngs=rngs)
    self.drop = nnx.Dropout(0.1, rngs=rngs)
    self.mlp = nnx.Sequential(nnx.Linear(8, 16, rngs=rngs), nnx.gelu,
                              nnx.Linear(16, 8, rngs=rngs))
    self.ln = nnx.LayerNorm(8, rngs=rngs)
    self.head = nnx.Linear(8, 10, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.bn(self.conv(x)))
    x = self.drop(x.mean(axis=(1, 2)))
    x = self.ln(x + self.mlp(x))
    return self.head(x)


def _x():
  return jnp.asarray(np.random.default_rng(0).standard_normal((4, 6, 6, 3)),
                     jnp.float32)


def _value(var):
  return var.get_value()


def test_params_stored_per_rule_and_original_untouched():
  model = Net(nnx.Rngs(0))
  half = jnnx.mixed_precision(model, "p=bf16,c=bf16,o=f32")
  assert_dtype(_value(half.conv.kernel), jnp.bfloat16)
  assert_dtype(_value(half.mlp.layers[0].kernel), jnp.bfloat16)
  assert_dtype(_value(half.bn.scale), jnp.float32)      # Norm islands.
  assert_dtype(_value(half.ln.scale), jnp.float32)
  assert_dtype(_value(half.bn.mean), jnp.float32)       # Batch stats.
  assert_dtype(_value(model.conv.kernel), jnp.float32)  # Original untouched.
  assert type(model.conv) is nnx.Conv


def test_hlo_dtypes_batch_stats_and_grads():
  half = jnnx.mixed_precision(Net(nnx.Rngs(0)), "p=f32,c=bf16,o=f32")
  x = _x()
  out = half(x)
  assert_dtype(out, jnp.float32)
  assert_dtype(_value(half.bn.mean), jnp.float32)  # Updated, still float32.
  graphdef, state = nnx.split(half)

  def f(state, x):
    return nnx.merge(graphdef, state)(x)

  text = jax.jit(f).lower(state, x).as_text()
  convs = [l for l in text.splitlines() if "stablehlo.convolution" in l]
  dots = [l for l in text.splitlines() if "stablehlo.dot_general" in l]
  assert len(convs) == 1 and len(dots) == 3
  for op in convs + dots:
    assert re.search(r"\(tensor<[^>]*bf16>, tensor<[^>]*bf16>\)", op), op

  half.eval()

  def loss(model, x):
    return model(x).sum()

  grads = nnx.grad(loss)(half, x)
  for path, g in jax.tree_util.tree_flatten_with_path(
      nnx.state(grads, nnx.Param))[0]:
    assert_dtype(g, jnp.float32)
  # A jitted nnx step works too, and keeps the stored dtypes.
  step = nnx.jit(lambda m, x: m(x))
  assert_dtype(step(half, x), jnp.float32)
  assert_dtype(_value(half.conv.kernel), jnp.float32)


def test_rules_enabled_and_strict():
  model = Net(nnx.Rngs(0))
  ruled = jnnx.mixed_precision(model, "p=bf16,c=bf16,o=f32",
                               rules=[("head", "f32"),
                                      (nnx.Sequential, "p=f16,c=f16")])
  assert_dtype(_value(ruled.head.kernel), jnp.float32)
  assert_dtype(_value(ruled.mlp.layers[2].kernel), jnp.float16)  # Inherited.
  assert_dtype(ruled(_x()), jnp.float32)
  off = jnnx.mixed_precision(model, "bf16", enabled=False)
  for leaf in jax.tree.leaves(nnx.state(off)):
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      assert_dtype(leaf, jnp.float32)
  with pytest.raises(ValueError, match=r"matched no module: \[\"path 'decoder'"):
    jnnx.mixed_precision(model, "bf16", rules=[("decoder", "f32")], strict=True)
  with pytest.raises(TypeError, match="expects a flax.nnx.Module"):
    jnnx.mixed_precision(lambda x: x, "bf16")
  twice = jnnx.mixed_precision(ruled, "p=bf16,c=bf16,o=f32")
  assert_dtype(twice(_x()), jnp.float32)


def test_trains_with_master_weights_and_loss_scaling():
  model = jnnx.mixed_precision(Net(nnx.Rngs(0)), "p=bf16,c=bf16,o=f32")
  model.eval()
  x = _x()
  y = jnp.arange(4) % 10
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  opt = jmp_lite.master_weights(jmp_lite.loss_scaled(
      optax.adam(1e-2), jmp_lite.DynamicLossScale(2.0**10)))
  opt_state = opt.init(params)

  @jax.jit
  def step(params, opt_state):
    scale = jmp_lite.current_loss_scale(opt_state)

    def loss_fn(p):
      logits = nnx.merge(graphdef, p, rest)(x)
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
      return scale.scale(loss), loss

    grads, loss = jax.grad(loss_fn, has_aux=True)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  for _ in range(20):
    params, opt_state, loss = step(params, opt_state)
    losses.append(float(loss))
  assert losses[-1] < 0.5 * losses[0], losses
  assert_dtype(params["conv"]["kernel"][...], jnp.bfloat16)
