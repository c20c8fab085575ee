"""jmp_lite.fp8 building blocks for Flax: linen and nnx layers in FP8."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite
from jmp_lite import fp8
from tests.test_fp8 import dot_operand_dtypes

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
import jmp_lite.fp8.linen as fp8_linen  # noqa: E402
import jmp_lite.fp8.nnx as fp8_nnx  # noqa: E402

CURRENT = fp8.CurrentScaling()
DELAYED = fp8.DelayedScaling(history=4)
FP8_FWD = ("float8_e4m3fn", "float8_e4m3fn")
FP8_BWD = {("float8_e5m2", "float8_e4m3fn"), ("float8_e4m3fn", "float8_e5m2")}


def data(seed, shape):
  x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
  return jnp.asarray(x)


X = data(0, (4, 8))


# ------------------------------------------------------------------ linen


class LinenMLP(nn.Module):
  """First and last layers bf16, the middle ones FP8 (the usual recipe)."""

  fields: dict

  @nn.compact
  def __call__(self, x):
    kw = {"dtype": jnp.bfloat16, "param_dtype": jnp.float32}
    x = nn.relu(nn.Dense(16, **kw)(x))
    x = nn.relu(nn.Dense(16, **kw, **self.fields)(x))
    x = nn.DenseGeneral((2, 8), **kw, **self.fields)(x)  # (4, 2, 8)
    x = nn.relu(nn.DenseGeneral(16, axis=(-2, -1), **kw, **self.fields)(x))
    return nn.Dense(3, **kw)(x)


@pytest.mark.parametrize("recipe", [CURRENT, DELAYED], ids=["current",
                                                            "delayed"])
def test_linen_dense_and_dense_general_run_fp8(recipe):
  model = LinenMLP(fp8_linen.layer_fields(recipe))
  variables = model.init(jax.random.key(0), X)
  if isinstance(recipe, fp8.DelayedScaling):
    assert sorted(variables) == ["fp8", "params"]
    assert sorted(variables["fp8"]) == ["DenseGeneral_0", "DenseGeneral_1",
                                        "Dense_1"]
    state = variables["fp8"]["Dense_1"]["Fp8DotGeneral_0"][fp8_linen.VARIABLE]
    assert isinstance(state, fp8.ScalingState)
    assert fp8_linen.COLLECTION == "fp8"
  else:
    assert sorted(variables) == ["params"]

  def loss(variables, x):
    return jnp.sum(model.apply(variables, x).astype(jnp.float32) ** 2)

  y = jax.jit(model.apply)(variables, X)
  assert y.dtype == jnp.bfloat16 and y.shape == (4, 3)
  dots = dot_operand_dtypes(jax.make_jaxpr(jax.grad(loss))(variables, X))
  # 5 layers: 2 bf16 (fwd + 2 bwd, the first layer's d-input is dropped) and
  # 3 FP8 layers (fwd + 2 bwd each).
  assert dots.count(FP8_FWD) == 3
  assert sum(d in FP8_BWD for d in dots) == 6
  assert sum(d == ("bfloat16", "bfloat16") for d in dots) == 2 + 3
  # Close to the same model without FP8.
  plain = jax.jit(LinenMLP({}).apply)({"params": variables["params"]}, X)
  np.testing.assert_allclose(np.asarray(y, np.float32),
                             np.asarray(plain, np.float32), rtol=0.2,
                             atol=0.1)


def test_linen_delayed_training_step_commits_the_collection():
  model = LinenMLP(fp8_linen.layer_fields(DELAYED))
  variables = model.init(jax.random.key(0), X)
  params, fp8_state = variables["params"], variables["fp8"]
  opt = jmp_lite.loss_scaled(optax.adam(1e-2), "bf16")
  opt_state = opt.init(params)

  @jax.jit
  def step(params, fp8_state, opt_state, x):
    def loss(p, s):
      y = model.apply({"params": p, "fp8": s}, x).astype(jnp.float32)
      return jnp.mean(y ** 2)
    grads, observed = jax.grad(loss, argnums=(0, 1))(params, fp8_state)
    updates, opt_state = opt.update(grads, opt_state, params)
    fp8_state = fp8.commit(fp8_state, observed, opt_state)
    return optax.apply_updates(params, updates), fp8_state, opt_state

  for _ in range(2):
    params, fp8_state, opt_state = step(params, fp8_state, opt_state, X)
  for amax in jax.tree.leaves(fp8.history_amax(fp8_state)):
    assert (np.asarray(amax) > 0).all()
  hist = fp8_state["Dense_1"]["Fp8DotGeneral_0"]["scaling"].history
  assert int(jnp.sum(hist[0] > 0)) == 2
  # Without the collection, apply fails loudly instead of running unscaled.
  from flax.errors import ScopeCollectionNotFound
  with pytest.raises(ScopeCollectionNotFound, match='collection "fp8"'):
    model.apply({"params": params}, X)


def test_linen_dot_general_cls_builds_a_module_per_layer():
  factory = fp8_linen.dot_general_cls(DELAYED)
  assert isinstance(factory(), fp8_linen.Fp8DotGeneral)
  assert factory().recipe == DELAYED
  fields = fp8_linen.layer_fields(CURRENT)
  assert fields["dot_general_cls"] is None and callable(fields["dot_general"])
  with pytest.raises(TypeError, match="Expected a jmp_lite.fp8.CurrentScaling"):
    fp8_linen.dot_general_cls(jnp.bfloat16)
  attention = fp8_linen.layer_fields(DELAYED, nn.SelfAttention(num_heads=2))
  assert attention["qkv_dot_general"] is None
  assert attention["out_dot_general_cls"]().recipe == DELAYED
  with pytest.raises(TypeError, match="LayerNorm has no dot_general"):
    fp8_linen.layer_fields(CURRENT, nn.LayerNorm)


# -------------------------------------------------------------------- nnx


class NnxMLP(nnx.Module):

  def __init__(self, recipe, rngs):
    kw = {"dtype": jnp.bfloat16, "param_dtype": jnp.float32, "rngs": rngs}
    self.first = nnx.Linear(8, 16, **kw)
    self.mid = nnx.Linear(16, 16, dot_general=fp8_nnx.dot_general_for(recipe),
                          **kw)
    self.general = nnx.LinearGeneral(
        16, (2, 8), dot_general=fp8_nnx.dot_general_for(recipe), **kw)
    self.last = nnx.Linear(16, 3, **kw)

  def __call__(self, x):
    x = nnx.relu(self.mid(nnx.relu(self.first(x))))
    x = self.general(x).reshape(x.shape[0], 16)
    return self.last(x)


@pytest.mark.parametrize("recipe", [CURRENT, DELAYED], ids=["current",
                                                            "delayed"])
def test_nnx_linear_and_linear_general_run_fp8(recipe):
  model = NnxMLP(recipe, nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params, rest, x):
    m = nnx.merge(graphdef, params, rest)
    return jnp.sum(m(x).astype(jnp.float32) ** 2)

  y = nnx.jit(lambda m, x: m(x))(model, X)
  assert y.dtype == jnp.bfloat16 and y.shape == (4, 3)
  dots = dot_operand_dtypes(jax.make_jaxpr(jax.grad(loss))(params, rest, X))
  assert dots.count(FP8_FWD) == 2
  assert sum(d in FP8_BWD for d in dots) == 4
  scaling = nnx.state(model, fp8_nnx.ScalingStat)
  if isinstance(recipe, fp8.DelayedScaling):
    assert sorted(scaling) == ["general", "mid"]
  else:
    assert not jax.tree.leaves(scaling)


def test_nnx_delayed_training_step_commits_and_the_optimizer_ignores_it():
  model = NnxMLP(DELAYED, nnx.Rngs(0))
  optimizer = nnx.Optimizer(
      model, jmp_lite.loss_scaled(optax.adam(1e-2), "bf16"), wrt=nnx.Param)
  wrt = nnx.Any(nnx.Param, fp8_nnx.ScalingStat)

  @nnx.jit
  def step(model, optimizer, x):
    def loss(m):
      return jnp.mean(m(x).astype(jnp.float32) ** 2)
    grads = nnx.grad(loss, argnums=nnx.DiffState(0, wrt))(model)
    optimizer.update(model, nnx.filter_state(grads, nnx.Param))
    fp8_nnx.commit(model, grads, optimizer.opt_state)

  kernel_before = model.mid.kernel.get_value()
  step(model, optimizer, X)
  step(model, optimizer, X)
  hist = model.mid.dot_general.scaling.get_value().history
  assert int(jnp.sum(hist[0] > 0)) == 2 and float(hist[2, 0]) > 0
  assert not np.allclose(model.mid.kernel.get_value(), kernel_before)
  # A skipped step (NaN input) leaves the histories as they were.
  before = nnx.state(model, fp8_nnx.ScalingStat)
  step(model, optimizer, X.at[0, 0].set(jnp.nan))
  assert int(jmp_lite.loss_scaled_state(optimizer.opt_state).total_skips) == 1
  chex.assert_trees_all_equal(
      jax.tree.leaves(nnx.state(model, fp8_nnx.ScalingStat)),
      jax.tree.leaves(before))


def test_nnx_commit_needs_the_scaling_gradients():
  model = NnxMLP(DELAYED, nnx.Rngs(0))
  grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(X).astype(jnp.float32))))(
      model)
  with pytest.raises(ValueError, match="grads holds no gradient for the fp8"):
    fp8_nnx.commit(model, grads)
