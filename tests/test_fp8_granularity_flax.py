"""Row, block and MXFP8 recipes in Flax linen/nnx layers and in autocast."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmp_lite
import jmp_lite.fp8.linen as fp8_linen
import jmp_lite.fp8.nnx as fp8_nnx
import jmp_lite.linen as jl
from jmp_lite import fp8
from tests.test_fp8 import dot_operand_dtypes, normal, rel_err

RECIPES = {
    "row": fp8.CurrentScaling(granularity="row"),
    "block": fp8.CurrentScaling(granularity="block", block_size=16),
    "mx": fp8.MXFP8(),
}
FP8_NAMES = {d.name for d in fp8.FP8_DTYPES}
X = normal(0, (8, 48))


def all_fp8(jaxpr) -> list[tuple[str, str]]:
  found = dot_operand_dtypes(jaxpr)
  assert found and all(set(pair) <= FP8_NAMES for pair in found), found
  return found


class Mlp(nn.Module):
  recipe: fp8.MXFP8 | fp8.CurrentScaling

  @nn.compact
  def __call__(self, x):
    fields = fp8_linen.layer_fields(self.recipe)
    h = jax.nn.relu(nn.Dense(40, **fields)(x))
    return nn.Dense(8, **fields)(h)


@pytest.mark.parametrize("name", list(RECIPES))
def test_linen_dense_model_runs_with_fp8_matmuls(name):
  model = Mlp(RECIPES[name])
  params = model.init(jax.random.key(0), X)
  assert list(params) == ["params"]  # Stateless: no fp8 collection.
  # The FP8 models under jit: eagerly each op of the quantisation compiles
  # alone.
  ref = jax.jit(Mlp(fp8.CurrentScaling()).apply)(params, X)
  p = params["params"]
  hidden = jnp.asarray(nn.Dense(40).apply({"params": p["Dense_0"]}, X))
  exact = nn.Dense(8).apply({"params": p["Dense_1"]}, jax.nn.relu(hidden))
  assert rel_err(jax.jit(model.apply)(params, X), exact) < 0.1
  assert rel_err(ref, exact) < 0.1
  loss = lambda p: jnp.sum(jnp.asarray(model.apply(p, X)) ** 2)
  assert len(all_fp8(jax.make_jaxpr(jax.grad(loss))(params))) == 6
  # The module form (dot_general_cls) works too.
  layer = nn.Dense(8, dot_general_cls=fp8_linen.dot_general_cls(
      RECIPES[name]))
  v = layer.init(jax.random.key(1), X)
  assert len(all_fp8(jax.make_jaxpr(layer.apply)(v, X))) == 1


@pytest.mark.parametrize("name", list(RECIPES))
def test_nnx_linear_model_runs_with_fp8_matmuls(name):
  recipe = RECIPES[name]
  rngs = nnx.Rngs(0)
  model = nnx.Sequential(
      nnx.Linear(48, 40, dot_general=fp8_nnx.dot_general_for(recipe),
                 rngs=rngs),
      jax.nn.relu,
      nnx.Linear(40, 8, dot_general=fp8_nnx.Fp8DotGeneral(recipe),
                 rngs=rngs))
  last = model.layers[2]
  assert isinstance(last, nnx.Linear)
  assert isinstance(last.dot_general, fp8_nnx.Fp8DotGeneral)
  assert last.dot_general.scaling is None
  graphdef, state = nnx.split(model)

  def loss(state):
    return jnp.sum(nnx.merge(graphdef, state)(X) ** 2)

  grads = jax.jit(jax.grad(loss))(state)  # Eagerly each op compiles alone.
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
  assert len(all_fp8(jax.make_jaxpr(jax.grad(loss))(state))) == 6


def mlp_loss(params, x, y):
  h = jax.nn.relu(x @ params["w1"])
  return jnp.mean(jnp.square(h @ params["w2"] - y))


@pytest.mark.parametrize("name", list(RECIPES))
def test_autocast_runs_every_matmul_with_the_recipe(name):
  params = {"w1": normal(1, (48, 40), scale=0.2),
            "w2": normal(2, (40, 8), scale=0.2)}
  y = normal(3, (8, 8))
  f = jmp_lite.autocast(mlp_loss, jnp.bfloat16, fp8=RECIPES[name])
  np.testing.assert_allclose(f(params, X, y), mlp_loss(params, X, y),
                             rtol=0.1)
  grads = jax.jit(jax.grad(f))(params, X, y)
  ref = jax.grad(mlp_loss)(params, X, y)
  for k in params:
    assert grads[k].dtype == jnp.float32
    assert rel_err(grads[k], ref[k]) < 0.2
  found = all_fp8(jax.make_jaxpr(jax.grad(f))(params, X, y))
  assert len(found) >= 5  # 2 forward, 3 gradient (x needs none).


def test_a_policy_rule_takes_mxfp8():
  """Rule(nn.Dense, MXFP8()) was refused (rules knew two recipe classes)."""
  model = jl.mixed_precision(nn.Dense(64), "p=f32,c=bf16,o=f32",
                             rules=[(nn.Dense, jmp_lite.fp8.MXFP8())])
  variables = jax.jit(model.init)(jax.random.key(0), jnp.ones((2, 64)))
  jaxpr = str(jax.make_jaxpr(
      lambda v: model.apply(v, jnp.ones((2, 64))))(variables))
  assert "f8_e4m3fn" in jaxpr
  with pytest.raises(TypeError, match="CurrentScaling, DelayedScaling or"
                     " MXFP8"):
    jmp_lite.rules.Rule(nn.Dense, fp8="mx")
