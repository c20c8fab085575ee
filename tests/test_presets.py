"""Tests for jmp_lite.presets: the O3 preset's recipes, presets on nnx."""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_lite
from jmp_lite import low_precision
from jmp_lite.diagnostics import tree_bytes
from jmp_lite.presets import preset
from tests.conftest import as_xla_gpu_simplifies, assert_dtype
from tests.models.harness import matmul_dtypes
from tests.models.linen_models import MlpBlock


def _params(dtype):
  rng = np.random.default_rng(0)
  return {"w": jnp.asarray(rng.standard_normal((64, 32)), dtype),
          "b": jnp.zeros((32,), dtype)}


def _adam_state(state):
  (adam,) = jmp_lite.struct.find_nodes(state, optax.ScaleByAdamState)
  return adam


@pytest.mark.parametrize("half", ["bf16", "f16"])
@pytest.mark.parametrize("compensation,kind,bytes_per_param", [
    ("auto", low_precision.KahanState, 8),
    ("kahan", low_precision.KahanState, 8),
    ("stochastic", low_precision.StochasticRoundingState, 6)])
def test_o3_recipe_state_dtypes_and_bytes(half, compensation, kind,
                                          bytes_per_param):
  p = preset("O3", half=half, compensation=compensation)
  dtype = jmp_lite.dtypes.parse_dtype(half)
  params = _params(dtype)
  opt = p.optimizer(optax.adam(1e-3))
  state = opt.init(params)
  assert isinstance(state, kind)
  adam = _adam_state(state)
  # Moments in bfloat16 for float16 params too (float16 lacks the range).
  assert_dtype(adam.mu["w"], jnp.bfloat16)
  assert_dtype(adam.nu["w"], jnp.bfloat16)
  if kind is jmp_lite.low_precision.KahanState:
    assert_dtype(state.compensation["w"], dtype)
  n = sum(x.size for x in jax.tree.leaves(params))
  # Scalars (counts, the loss scale) add a few bytes in all.
  total = tree_bytes(params) + tree_bytes(state)
  assert bytes_per_param * n <= total < bytes_per_param * n + 64
  # Adam computes in float32 and the loss scale unscales float32 gradients.
  scale = jmp_lite.current_loss_scale(state)
  grads = jax.tree.map(lambda x: scale.scale(jnp.full_like(x, 1e-3)), params)
  updates, new_state = jax.jit(opt.update)(grads, state, params)
  assert_dtype(updates["w"], jnp.float32)
  new_params = optax.apply_updates(params, updates)
  assert_dtype(new_params["w"], dtype)
  assert float(jnp.abs(new_params["w"].astype(jnp.float32)
                       - params["w"].astype(jnp.float32)).max()) > 0
  assert jax.tree.structure(new_state) == jax.tree.structure(state)


@pytest.mark.parametrize("compensation", ["kahan", "stochastic"])
def test_o3_float16_moves_like_float32_adam_on_tiny_gradients(compensation):
  # Gradients of 1e-5: the 0.001 * g**2 that Adam adds to nu each step is
  # below float16's smallest subnormal. Stored in float16, nu stays 0 and
  # Adam's steps grow many times larger than lr (models diverge in a few
  # steps); O3 stores the moments in bfloat16 and moves by lr per step.
  lr, steps = 1e-3, 100
  params = {"w": jnp.ones((16, 16), jnp.float16)}
  grads = {"w": jnp.full((16, 16), 1e-5, jnp.float32)}

  def run(opt):
    state = opt.init(params)
    scale = jmp_lite.current_loss_scale(state)
    g = jax.tree.map(lambda x: scale.scale(x).astype(jnp.float16), grads)
    step = jax.jit(lambda p, s: jmp_lite.update_and_apply(opt, g, s, p))
    p = params
    for _ in range(steps):
      last, (p, state) = p, step(p, state)
    return p, float(jnp.max(jnp.abs(p["w"].astype(jnp.float32)
                                    - last["w"].astype(jnp.float32))))

  o3 = preset("O3", half="f16", compensation=compensation)
  p, _ = run(o3.optimizer(optax.adam(lr)))
  # float32 Adam: every step moves by lr (mu_hat / sqrt(nu_hat) = 1).
  np.testing.assert_allclose(np.asarray(p["w"], np.float32),
                             1.0 - steps * lr, atol=3e-3)
  with pytest.warns(jmp_lite.PrecisionWarning, match="second moments"):
    half_moments = jmp_lite.state_dtypes(
        jmp_lite.loss_scaled(optax.adam(lr), o3.loss_scale()), "f16")
  _, last_move = run(jmp_lite.kahan_summation(half_moments))
  assert last_move > 4 * lr  # What storing the moments in bfloat16 avoids.


@pytest.mark.parametrize("level,compensation", [
    ("O1", "auto"), ("O2", "auto"), ("O3", "kahan"), ("O3", "stochastic")])
def test_preset_optimizers_agree_over_axis_name(level, compensation):
  """Preset.optimizer took no axis_name=: per-device gradients under
  shard_map could not share one skip decision and one scale."""
  half = jnp.bfloat16 if level == "O3" else jnp.float32
  opt = preset(level, half="f16", compensation=compensation).optimizer(
      optax.adam(1e-3), axis_name="devices")
  params = {"w": jnp.ones(4, half)}
  state = opt.init(params)
  # Two "devices" (vmap with an axis name runs the collectives) holding the
  # same params and state; only the second one's gradients overflow.
  grads = {"w": jnp.stack([jnp.full(4, 1.0), jnp.full(4, jnp.inf)])}
  step = jax.vmap(lambda g, p, s: jmp_lite.update_and_apply(opt, g, s, p),
                  in_axes=(0, None, None), axis_name="devices")
  new_params, new_state = step(grads, params, state)
  chex.assert_trees_all_equal(   # Both skipped.
      new_params, jax.tree.map(lambda p: jnp.stack([p, p]), params))
  halved = float(jmp_lite.current_loss_scale(state).loss_scale) / 2
  np.testing.assert_array_equal(   # One scale on both devices.
      np.asarray(jmp_lite.current_loss_scale(new_state).loss_scale),
      [halved, halved])


def test_preset_specs_and_seed_only_where_bits_are_random():
  spec = {"w": jax.sharding.PartitionSpec()}
  with pytest.raises(ValueError, match="specs= is for stochastic rounding"):
    preset("O3", half="bf16").optimizer(optax.adam(1e-3), specs=spec)
  with pytest.raises(ValueError, match="seed=3 would be ignored"):
    preset("O3", half="bf16").optimizer(optax.adam(1e-3), seed=3)
  # Kahan over 8-bit states: the codes are stochastic, so specs and the
  # seed reach quantized_states (seeded apart from the params' bits).
  opt = preset("O3", half="bf16", state_bits=8, compensation="kahan"
               ).optimizer(optax.adam(1e-3), seed=3, specs=spec)
  state = opt.init({"w": jnp.ones((2, 256), jnp.bfloat16)})
  codes = state.inner_state
  assert isinstance(codes, low_precision.QuantizedStatesState)
  assert codes.config.seed not in (0, 3)
  with pytest.raises(ValueError, match="preset O2"):
    preset("O2", half="bf16").optimizer(optax.adam(1e-3), specs=spec)
  opt = preset("O3", half="bf16", compensation="stochastic").optimizer(
      optax.adam(1e-3), specs=spec)
  params = {"w": jnp.ones(3, jnp.bfloat16)}
  new_params, _ = jmp_lite.update_and_apply(
      opt, {"w": jnp.ones(3, jnp.bfloat16)}, opt.init(params), params)
  assert_dtype(new_params["w"], jnp.bfloat16)


def test_o3_without_compensation_is_the_plain_pure_half_recipe():
  p = preset("O3", half="bf16", compensation=None)
  state = p.optimizer(optax.adam(1e-3)).init(_params(jnp.bfloat16))
  assert isinstance(state, jmp_lite.LossScaledState)
  assert_dtype(_adam_state(state).nu["w"], jnp.bfloat16)
  assert not jmp_lite.struct.find_nodes(state,
                                        low_precision.StateDtypesState)


def test_other_levels_have_no_compensation():
  for level in ("O0", "O1", "O2"):
    assert preset(level, half="bf16").compensation is None
  with pytest.raises(ValueError, match="applies to .* preset 'O3', not 'O2'"):
    preset("O2", half="bf16", compensation="kahan")
  with pytest.raises(ValueError, match="Unknown compensation 'fast'"):
    preset("O3", half="bf16", compensation="fast")


def test_o3_stochastic_seed_reaches_the_state():
  opt = preset("O3", half="bf16", compensation="stochastic").optimizer(
      optax.adam(1e-3), seed=42)
  assert int(opt.init(_params(jnp.bfloat16)).seed) == 42


# Each case compiles the step twice (10-25 s on 2 cores): both halves and both
# compensations run by default, the third pairing in the slow set.
@pytest.mark.parametrize("half,compensation", [
    ("bf16", "kahan"), pytest.param("f16", "kahan", marks=pytest.mark.slow),
    ("f16", "stochastic")])
def test_o3_on_a_flax_model_still_compensates_where_xla_deletes_casts(
    half, compensation):
  """The O3 recipe on a model written as Flax's examples write it (dtype=
  float32 on every layer), stepped by update_and_apply (its lax.cond), as
  XLA:GPU simplifies it: on an H100 cast-based rounding left compensation
  at 0 and most params unmoved (here, on the old code: 348 of 1866)."""
  o3 = preset("O3", half=half, compensation=compensation)
  model = o3.wrap(MlpBlock(mlp_dim=32, dtype=jnp.float32))
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
  y = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
  params = model.init(jax.random.key(0), x, deterministic=True)["params"]
  opt = o3.optimizer(optax.adam(1e-4))
  state = opt.init(params)
  for leaf in jax.tree.leaves(params):
    assert_dtype(leaf, jmp_lite.dtypes.parse_dtype(half))

  def step(p, s):
    loss = lambda p: jnp.mean(jnp.square(model.apply(
        {"params": p}, x, deterministic=True) - y))
    return jmp_lite.update_and_apply(opt, jax.grad(loss)(p), s, p)

  runs = {"xla:cpu": (jax.jit(step), params, state),
          "xla:gpu": (as_xla_gpu_simplifies(step), params, state)}
  moved = {}
  for name, (fn, p, s) in runs.items():
    for _ in range(10):
      p, s = fn(p, s)
    moved[name] = sum(int((a != b).sum()) for a, b in zip(
        jax.tree.leaves(p), jax.tree.leaves(params), strict=True))
    for kahan in jmp_lite.struct.find_nodes(s, low_precision.KahanState):
      assert any(np.asarray(c).any() for c in
                 jax.tree.leaves(kahan.compensation)), name
  # Updates of 1e-4 are below half an ulp for most params: only a working
  # compensation moves them, under either compiler.
  assert moved["xla:gpu"] >= 0.9 * moved["xla:cpu"] > 0, moved


class NnxMlp(nnx.Module):
  """As Flax's nnx examples write it: ``dtype=jnp.float32`` on each layer."""

  def __init__(self, rngs):
    self.fc = nnx.Linear(8, 16, dtype=jnp.float32, rngs=rngs)
    self.norm = nnx.LayerNorm(16, dtype=jnp.float32, rngs=rngs)
    self.out = nnx.Linear(16, 4, dtype=jnp.float32, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.gelu(self.norm(self.fc(x))))


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_presets_wrap_nnx_models(level):
  """``preset(...).wrap`` raised TypeError on an nnx model (linen only)."""
  p = preset(level, half="bf16")
  model = p.wrap(NnxMlp(nnx.Rngs(0)))
  x = jax.random.normal(jax.random.key(0), (2, 8))
  half, f32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
  stored = half if level in ("O2", "O3") else f32
  assert_dtype(model.fc.kernel[...], stored)
  assert_dtype(model.norm.scale[...], half if level == "O3" else f32)
  computed = f32 if level == "O0" else half
  ops = {d for _, d, _ in matmul_dtypes(jax.make_jaxpr(lambda x: model(x))(x))}
  assert ops == {(computed, computed)}
  # The preset's optimizer steps the nnx model, its dtypes kept.
  opt = nnx.Optimizer(model, p.optimizer(optax.adam(1e-3)), wrt=nnx.Param)
  before = model.out.kernel[...]
  grads = nnx.grad(lambda m: m(x).astype(jnp.float32).mean())(model)
  opt.update(model, grads)
  assert_dtype(model.fc.kernel[...], stored)
  assert not np.array_equal(model.out.kernel[...], before)


@pytest.mark.parametrize("bits,limit", [(8, 4.1), (4, 3.1)])
def test_o3_state_bits_is_the_quantized_recipe(bits, limit):
  o3 = preset("O3", half="bf16", state_bits=bits, compensation="stochastic")
  assert o3.compensation == "stochastic" and o3.state_bits == bits
  opt = o3.optimizer(optax.adam(1e-3), seed=3)
  params = {"w": jnp.ones((16, 512), jnp.bfloat16)}
  state: Any = opt.init(params)
  assert isinstance(state, low_precision.StochasticRoundingState)
  assert isinstance(state.inner_state,
                    low_precision.QuantizedStatesState)
  from tests.conftest import AUTO_KIND
  assert jmp_lite.step.formulation(opt, jnp.bfloat16)[0] == AUTO_KIND
  params, state = jax.jit(lambda p, s: jmp_lite.update_and_apply(
      opt, jax.tree.map(jnp.ones_like, p), s, p))(params, state)
  per_param = tree_bytes((params, state)) / (16 * 512)
  assert per_param <= limit, per_param
  kahan = preset("O3", half="bf16", state_bits=bits,
                                  compensation="kahan")
  assert isinstance(kahan.optimizer(optax.adam(1e-3)).init(params),
                    low_precision.KahanState)


@pytest.mark.parametrize("bits", [8, 4])
def test_o3_state_bits_without_a_compensation_warns_of_the_switch(bits):
  # O3 alone means Kahan; with state_bits "auto" picks stochastic rounding,
  # and says so. Naming the compensation is silent (warnings are errors).
  with pytest.warns(UserWarning, match="compensation='stochastic', not O3's"
                    " default 'kahan'"):
    o3 = preset("O3", half="bf16", state_bits=bits)
  assert o3.compensation == "stochastic"
  assert preset("O3", half="bf16").compensation == "kahan"
  for chosen in ("stochastic", "kahan"):
    assert preset("O3", half="bf16", state_bits=bits,
                  compensation=chosen).compensation == chosen


@pytest.mark.parametrize("kwargs,match", [
    (dict(level="O3", state_bits=3), "state_bits must be 8, 4 or None, got 3"),
    (dict(level="O3", state_bits=True), "got True"),
    (dict(level="O2", state_bits=8), "applies to preset 'O3', not 'O2'"),
    (dict(level="O3", state_bits=8, compensation=None), "needs a compensation"),
])
def test_state_bits_bad_input(kwargs, match):
  with pytest.raises(ValueError, match=match):
    preset(half="bf16", **kwargs)
