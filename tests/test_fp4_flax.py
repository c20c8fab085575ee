"""jmp_lite.fp4 in models: linen, nnx, Equinox, policy rules and autocast."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_lite
import jmp_lite.fp4.linen as fp4_linen
import jmp_lite.fp4.nnx as fp4_nnx
import jmp_lite.linen as jl
import jmp_lite.nnx as jnnx
import jmp_lite.rules
from jmp_lite import fp4

NV = fp4.NVFP4()
X = jnp.asarray(np.random.default_rng(0).normal(size=(8, 32)), jnp.float32)


def fp4_casts(fn, *args) -> int:
  """How many times ``fn``'s program quantises a tensor to E2M1."""
  return str(jax.make_jaxpr(fn)(*args)).count("new_dtype=float4_e2m1fn")


class Mlp(nn.Module):
  fields: dict

  @nn.compact
  def __call__(self, x):
    kw = {"dtype": jnp.bfloat16, "param_dtype": jnp.float32}
    x = nn.relu(nn.Dense(32, **kw, name="first")(x))
    x = nn.relu(nn.Dense(32, **kw, **self.fields)(x))
    return nn.Dense(4, **kw, name="head")(x)


def test_linen_dense_draws_keys_from_the_fp4_stream():
  model = Mlp(fp4_linen.layer_fields(NV))
  variables = model.init(jax.random.key(0), X)
  assert sorted(variables) == ["params"]

  @jax.jit
  def grad(variables, key):
    rngs = {} if key is None else {"fp4": key}
    return jax.grad(lambda v: jnp.asarray(model.apply(
        v, X, rngs=rngs), jnp.float32).sum())(variables)

  assert fp4_casts(lambda v: model.apply(v, X), variables) == 2
  # Backward: the cotangent (input gradient), both weight-gradient inputs.
  assert fp4_casts(jax.grad(lambda v: jnp.asarray(
      model.apply(v, X), jnp.float32).sum()), variables) == 2 + 3
  a, b = grad(variables, jax.random.key(1)), grad(variables, jax.random.key(2))
  kernel = lambda g: np.asarray(g["params"]["Dense_0"]["kernel"])
  assert not np.array_equal(kernel(a), kernel(b))
  np.testing.assert_array_equal(kernel(grad(variables, None)),
                                kernel(grad(variables, None)))
  assert a["params"]["Dense_0"]["kernel"].dtype == jnp.float32


def test_linen_rule_runs_dense_layers_in_fp4():
  rules = [("first|head", "p=f32,c=bf16,o=bf16"), (nn.Dense, NV)]
  model = jl.mixed_precision(Mlp({}), "p=f32,c=bf16,o=f32", rules=rules)
  variables = model.init(jax.random.key(0), X)
  assert fp4_casts(lambda v: model.apply(v, X), variables) == 2
  y = model.apply(variables, X, rngs={"fp4": jax.random.key(0)})
  assert y.dtype == jnp.float32
  rule = jmp_lite.rules.Rule(nn.Dense, NV)
  assert rule.describe() == "class Dense -> fp4 NVFP4"


class NnxMlp(nnx.Module):
  def __init__(self, rngs, dot=None):
    self.first = nnx.Linear(32, 32, rngs=rngs)
    kw = {} if dot is None else {"dot_general": dot}
    self.hidden = nnx.Linear(32, 32, rngs=rngs, **kw)
    self.head = nnx.Linear(32, 4, rngs=rngs)

  def __call__(self, x):
    return self.head(nnx.relu(self.hidden(nnx.relu(self.first(x)))))


def test_nnx_linear_draws_a_new_key_every_step():
  model = NnxMlp(nnx.Rngs(0), fp4_nnx.Fp4DotGeneral(NV, nnx.Rngs(fp4=1)))
  opt = nnx.Optimizer(model, optax.sgd(1e-2), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt):
    grads = nnx.grad(lambda m: jnp.mean(m(X) ** 2))(model)
    opt.update(model, grads)
    return grads

  g1, g2 = step(model, opt), step(model, opt)
  assert not np.array_equal(np.asarray(g1["first"]["kernel"].get_value()),
                            np.asarray(g2["first"]["kernel"].get_value()))
  with pytest.raises(ValueError, match="'fp4' stream"):
    fp4_nnx.Fp4DotGeneral(NV, nnx.Rngs(0))


def test_nnx_rule_runs_linear_layers_in_fp4():
  model = jnnx.mixed_precision(
      NnxMlp(nnx.Rngs(0)), "p=f32,c=bf16,o=f32",
      rules=[("first|head", "p=f32,c=bf16,o=bf16"), ("hidden", fp4.MXFP4())])
  assert fp4_casts(lambda x: model(x), X) == 2
  assert model(X).dtype == jnp.float32


def test_equinox_module_with_fp4_matmul():
  eqx = pytest.importorskip("equinox")

  class Linear(eqx.Module):
    weight: jax.Array

    def __call__(self, x, key=None):
      dot = fp4.dot_general(NV, key)
      return dot(x, self.weight, (((x.ndim - 1,), (0,)), ((), ())))

  layer = Linear(jnp.asarray(np.random.default_rng(1).normal(size=(32, 8)),
                             jnp.float32))

  @eqx.filter_jit
  def grad(layer, key):
    return eqx.filter_grad(lambda m: jnp.sum(m(X, key) ** 2))(layer)

  a, b = grad(layer, jax.random.key(0)), grad(layer, jax.random.key(1))
  assert a.weight.shape == (32, 8) and a.weight.dtype == jnp.float32
  assert not np.array_equal(a.weight, b.weight)
  exact = jax.grad(lambda w: jnp.sum((X @ w) ** 2))(layer.weight)
  assert np.linalg.norm(a.weight - exact) < 0.3 * np.linalg.norm(exact)


def test_autocast_runs_matmuls_in_fp4():
  w = jnp.asarray(np.random.default_rng(2).normal(size=(32, 16)) * 0.05,
                  jnp.float32)  # tanh unsaturated: its gradient is stable
  f = lambda w, x: jnp.tanh(x @ w).sum()
  g = jmp_lite.autocast(f, jnp.bfloat16, fp8=NV)
  assert fp4_casts(g, w, X) == 2
  assert fp4_casts(jax.grad(g), w, X) == 2 + 3
  grad = jax.jit(jax.grad(g))(w, X)
  exact = jax.grad(f)(w, X)
  assert grad.dtype == jnp.float32
  assert np.linalg.norm(grad - exact) < 0.3 * np.linalg.norm(exact)
