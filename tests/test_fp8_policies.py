"""FP8 recipes given by policy rules: linen and nnx models need no edits."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_lite
import jmp_lite.linen as jl
import jmp_lite.nnx as jnnx
from tests.conftest import assert_dtype
from tests.models.harness import matmul_dtypes

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
BF16 = np.dtype(jnp.bfloat16)
CURRENT = jmp_lite.fp8.CurrentScaling()
DELAYED = jmp_lite.fp8.DelayedScaling(history=4)


def _dots(fn, *args):
  return {d for _, d, _ in matmul_dtypes(jax.make_jaxpr(fn)(*args))}


class Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(16, dtype=jnp.float32, name="first")(x)  # Kept bf16 below.
    x = nn.gelu(nn.Dense(32)(nn.LayerNorm()(x)))
    x = nn.Dense(16)(x)
    return nn.Dense(4, name="head")(x)


LINEN_RULES = [("first|head", "p=f32,c=bf16,o=bf16"), (nn.Dense, CURRENT)]


def test_linen_rule_runs_dense_layers_in_fp8():
  model = jl.mixed_precision(Mlp(), "p=f32,c=bf16,o=f32", rules=LINEN_RULES)
  x = jnp.ones((4, 8))
  variables = model.init(jax.random.key(0), x)
  fwd = _dots(lambda v: model.apply(v, x), variables)
  assert fwd == {(BF16, BF16), (E4M3, E4M3)}  # first/head bf16, the rest FP8.
  bwd = _dots(jax.grad(lambda v: model.apply(v, x).sum()), variables)
  assert {(E5M2, E4M3), (E4M3, E5M2)} <= bwd
  assert_dtype(model.apply(variables, x), jnp.float32)
  report = jl.dtype_report(model, variables, x)
  rows = {r.path: r for r in report.rows}
  assert rows["Dense_0"].computed == "float8_e4m3fn"
  assert rows["head"].computed == "bfloat16"
  assert not report.mismatches()


def test_linen_delayed_rule_threads_its_collection():
  model = jl.mixed_precision(Mlp(), "p=f32,c=bf16,o=f32",
                             rules=[("first|head", "p=f32,c=bf16,o=bf16"),
                                    (nn.Dense, DELAYED)])
  x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8)), jnp.float32)
  variables = model.init(jax.random.key(0), x)
  params, fp8_vars = variables["params"], variables["fp8"]
  assert set(fp8_vars) == {"Dense_0", "Dense_1"}
  opt = jmp_lite.loss_scaled(optax.adam(1e-2), "bf16")
  opt_state = opt.init(params)

  @jax.jit
  def step(params, fp8_vars, opt_state):
    def loss(p, f):
      return jnp.mean(jnp.square(model.apply({"params": p, "fp8": f}, x)))
    grads, observed = jax.grad(loss, argnums=(0, 1))(params, fp8_vars)
    updates, opt_state = opt.update(grads, opt_state, params)
    fp8_vars = jmp_lite.fp8.commit(fp8_vars, observed, opt_state)
    return optax.apply_updates(params, updates), fp8_vars, opt_state

  for _ in range(3):
    params, fp8_vars, opt_state = step(params, fp8_vars, opt_state)
  history = fp8_vars["Dense_0"]["Fp8DotGeneral_0"]["scaling"].history
  assert int(jnp.sum(jnp.any(history > 0, axis=0))) == 3  # One entry a step.


class NnxMlp(nnx.Module):
  def __init__(self, rngs):
    self.first = nnx.Linear(8, 16, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=16,
                                       decode=False, rngs=rngs)
    self.hidden = nnx.Linear(16, 16, dtype=jnp.float32, rngs=rngs)
    self.head = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    x = self.first(x)
    return self.head(nnx.gelu(self.hidden(x + self.attn(x))))


@pytest.mark.parametrize("recipe", [CURRENT, DELAYED],
                         ids=["current", "delayed"])
def test_nnx_rule_runs_linear_layers_in_fp8(recipe):
  model = jnnx.mixed_precision(
      NnxMlp(nnx.Rngs(0)), "p=f32,c=bf16,o=f32",
      rules=[("first|head", "p=f32,c=bf16,o=bf16"), ("hidden|attn", recipe)])
  x = jnp.ones((2, 3, 8))
  fwd = _dots(lambda x: model(x), x)
  # hidden and attention's projections in FP8; attention's own score and
  # value products, first and head in bf16.
  assert fwd == {(BF16, BF16), (E4M3, E4M3)}
  assert len([d for _, d, _ in matmul_dtypes(jax.make_jaxpr(model)(x))
              if d == (E4M3, E4M3)]) == 5
  assert_dtype(model(x), jnp.float32)
  if isinstance(recipe, jmp_lite.fp8.DelayedScaling):
    import jmp_lite.fp8.nnx as fp8_nnx
    stats = nnx.state(model, fp8_nnx.ScalingStat)
    assert len(jax.tree.leaves(stats)) == 2 * 5  # history and pending, x5.


def test_equinox_refuses_fp8_rules_and_names_the_way():
  eqx = pytest.importorskip("equinox")
  import jmp_lite.equinox as jeqx
  with pytest.raises(TypeError, match=r"cannot give FP8 recipes.*autocast"):
    jeqx.mixed_precision(eqx.nn.Linear(2, 2, key=jax.random.key(0)), "bf16",
                         rules=[(eqx.nn.Linear, CURRENT)])
  with pytest.raises(TypeError, match="needs a policy .* or an FP8 recipe"):
    jmp_lite.rules.Rule(nn.Dense)
