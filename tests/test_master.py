"""Tests for jmp_lite.master: float32 master weights for half params."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite
from tests.conftest import as_xla_gpu_simplifies, assert_dtype

HALF = [jnp.bfloat16, jnp.float16]


def _params(dtype):
  rng = np.random.default_rng(0)
  return {"w": jnp.asarray(rng.standard_normal((8, 4)), dtype),
          "b": jnp.zeros((4,), dtype)}


def _loss(params, x):
  return jnp.mean((x @ params["w"].astype(jnp.float32)
                   + params["b"].astype(jnp.float32)) ** 2)


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "f16"])
def test_half_params_equal_cast_master_after_every_step(dtype):
  # float32 updates, cast back by optax.apply_updates: exact every step.
  opt = jmp_lite.master_weights(jmp_lite.loss_scaled(
      optax.adam(1e-3), jmp_lite.DynamicLossScale(2.0**10, period=5)),
      update_dtype=jnp.float32)
  params = _params(dtype)
  state = opt.init(params)
  # float32 master copy and float32 moments.
  assert_dtype(state.master["w"], jnp.float32)
  assert_dtype(state.inner_state.inner_state[0].mu["w"], jnp.float32)
  assert_dtype(state.inner_state.inner_state[0].nu["w"], jnp.float32)

  def step(params, state, x):
    scale = jmp_lite.current_loss_scale(state)
    grads = jax.grad(lambda p: scale.scale(_loss(p, x)))(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  # Jitted only: eager runs the same arithmetic op by op (52 s against
  # 2.6 s) and asserted nothing more.
  step = jax.jit(step)
  rng = np.random.default_rng(1)
  for _ in range(30):
    params, state = step(params, state,
                         jnp.asarray(rng.standard_normal((16, 8)), jnp.float32))
    assert_dtype(params["w"], dtype)
    chex.assert_trees_all_equal(
        params, jax.tree.map(lambda m: m.astype(dtype), state.master))


def test_master_weights_keep_small_updates_that_bf16_loses():
  params = {"w": jnp.ones((4,), jnp.bfloat16)}
  grads = {"w": jnp.ones((4,), jnp.bfloat16)}
  pure = optax.sgd(1e-4)
  mw = jmp_lite.master_weights(optax.sgd(1e-4))
  p_pure, s_pure = params, pure.init(params)
  p_mw, s_mw = params, mw.init(params)
  for _ in range(200):
    u, s_pure = pure.update(grads, s_pure, p_pure)
    p_pure = optax.apply_updates(p_pure, u)
    u, s_mw = mw.update(grads, s_mw, p_mw)
    p_mw = optax.apply_updates(p_mw, u)
  assert float(p_pure["w"][0]) == 1.0          # Stuck: 1 - 1e-4 rounds to 1.
  np.testing.assert_allclose(float(jmp_lite.master_params(s_mw)["w"][0]),
                             0.98, rtol=1e-5)
  assert float(p_mw["w"][0]) < 0.99


def test_float32_leaves_pass_through():
  params = {"w": jnp.ones((3,)), "h": jnp.ones((3,), jnp.bfloat16),
            "i": jnp.arange(3)}
  opt = jmp_lite.master_weights(optax.multi_transform(
      {"f": optax.sgd(0.5), "z": optax.set_to_zero()},
      {"w": "f", "h": "f", "i": "z"}))
  state = opt.init(params)
  grads = {"w": jnp.ones((3,)), "h": jnp.ones((3,), jnp.bfloat16),
           "i": np.zeros((3,), jax.dtypes.float0)}
  updates, state = opt.update(grads, state, params)
  assert updates["i"].dtype == jax.dtypes.float0
  new = dict(params, **optax.apply_updates(
      {k: params[k] for k in "wh"}, {k: updates[k] for k in "wh"}))
  np.testing.assert_array_equal(np.asarray(new["w"]), 0.5)
  np.testing.assert_array_equal(np.asarray(new["h"], np.float32), 0.5)
  assert_dtype(new["h"], jnp.bfloat16)
  assert_dtype(new["i"], jnp.int32)


def test_update_requires_params():
  opt = jmp_lite.master_weights(optax.sgd(0.1))
  state = opt.init({"w": jnp.ones(2, jnp.float16)})
  with pytest.raises(ValueError, match="needs the current params"):
    opt.update({"w": jnp.ones(2, jnp.float16)}, state)


def test_bad_master_dtype():
  with pytest.raises(TypeError, match="dtype must be a floating dtype"):
    jmp_lite.master_weights(optax.sgd(0.1), dtype=jnp.int32)
  # np.dtype(None) is float64: None must not pass for a dtype.
  with pytest.raises(TypeError, match="dtype must be a floating dtype.*got"
                     " None"):
    jmp_lite.master_weights(optax.sgd(0.1), dtype=None)


def test_not_a_transformation_fails_when_built():
  with pytest.raises(TypeError, match="master_weights expects an"
                     r" optax.GradientTransformation .* got str: 'adam'"):
    jmp_lite.master_weights("adam")


def test_master_params_lookup_errors():
  with pytest.raises(ValueError, match="found 0"):
    jmp_lite.master_params(optax.sgd(0.1).init({"w": jnp.ones(2)}))


@pytest.mark.parametrize("dtype", HALF + [jnp.float8_e4m3fn],
                         ids=["bf16", "f16", "e4m3fn"])
def test_loss_scaled_refuses_half_moments_unless_allowed(dtype):
  params = {"w": jnp.ones((2, 2), dtype)}
  opt = jmp_lite.loss_scaled(optax.adam(1e-3), jmp_lite.NoOpLossScale())
  with pytest.raises(TypeError, match=r"half-precision leaves: .*\['w'\] \("
                     + np.dtype(dtype).name + r"\).*master_weights"):
    opt.init(params)
  allowed = jmp_lite.loss_scaled(optax.adam(1e-3), jmp_lite.NoOpLossScale(),
                                 allow_half_state=True)
  state = allowed.init(params)
  assert_dtype(state.inner_state[0].mu["w"], dtype)
  # With master weights around it the moments are float32.
  ok = jmp_lite.master_weights(
      jmp_lite.loss_scaled(optax.adam(1e-3), jmp_lite.NoOpLossScale()))
  assert_dtype(ok.init(params).inner_state.inner_state[0].mu["w"], jnp.float32)


def test_float16_unscaling_happens_in_float32():
  # A float16 gradient of 2**-10 at scale 2**15 unscales to 2**-25, below
  # float16's smallest subnormal: it only survives if unscaled in float32.
  params = {"w": jnp.zeros((1,), jnp.float16)}
  opt = jmp_lite.master_weights(jmp_lite.loss_scaled(
      optax.sgd(1.0), jmp_lite.StaticLossScale(2.0**15)))
  state = opt.init(params)
  _, state = opt.update({"w": jnp.full((1,), 2.0**-10, jnp.float16)}, state,
                        params)
  assert float(jmp_lite.master_params(state)["w"][0]) == -(2.0**-25)


def _buffers(tree):
  return [s.data.unsafe_buffer_pointer() for x in jax.tree.leaves(tree)
          if isinstance(x, jax.Array) for s in x.addressable_shards]


@pytest.mark.parametrize("variant_jit", ["update", "update_and_apply"])
def test_donated_o2_step_with_float32_norm_params(variant_jit):
  """Issue 9.9: float32 params (norm islands) must not alias the master copy.

  Before the fix, init reused float32 params as their own master copy, and a
  step jitted with donate_argnums=(0, 1) failed: "Attempt to donate the same
  buffer twice".
  """
  opt = jmp_lite.master_weights(jmp_lite.loss_scaled(
      optax.adam(1e-2), jmp_lite.DynamicLossScale(2.0**8)))
  # Integer leaves are carried as copies too.
  with_int = {"norm_scale": jnp.ones((3,)), "step": jnp.array(0)}
  int_state = jmp_lite.master_weights(optax.identity()).init(with_int)
  assert not set(_buffers(int_state)) & set(_buffers(with_int))
  assert_dtype(int_state.master["step"], jnp.int32)
  params = {"dense": jnp.ones((4, 3), jnp.bfloat16),
            "norm_scale": jnp.ones((3,), jnp.float32)}
  state = opt.init(params)
  assert not set(_buffers(state)) & set(_buffers(params))
  assert_dtype(state.master["norm_scale"], jnp.float32)

  def step(params, state, x):
    scale = jmp_lite.current_loss_scale(state)
    grads = jax.grad(lambda p: scale.scale(jnp.sum(
        (x @ p["dense"].astype(jnp.float32)) * p["norm_scale"])))(params)
    if variant_jit == "update_and_apply":
      return jmp_lite.update_and_apply(opt, grads, state, params)
    updates, state = opt.update(grads, state, params)
    return jmp_lite.step.apply_updates(params, updates), state

  step = jax.jit(step, donate_argnums=(0, 1))
  for _ in range(3):
    params, state = step(params, state, jnp.ones((2, 4)))
  assert float(params["norm_scale"][0]) < 1.0
  assert_dtype(params["dense"], jnp.bfloat16)


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "f16"])
def test_skipped_step_keeps_negative_zero_half_params(dtype):
  params = {"w": jnp.array([-0.0, 0.0, 1.0], dtype)}
  opt = jmp_lite.master_weights(jmp_lite.loss_scaled(
      optax.sgd(0.1), jmp_lite.NoOpLossScale()))
  state = opt.init(params)
  updates, state = opt.update({"w": jnp.array([1.0, jnp.nan, 0.0], dtype)},
                              state, params)
  new = optax.apply_updates(params, updates)
  assert np.signbit(np.asarray(new["w"], np.float32)).tolist() == [
      True, False, False]
  chex.assert_trees_all_equal(new, params)


@pytest.mark.parametrize("half", [jnp.bfloat16, jnp.float16])
def test_updates_keep_the_param_dtype_and_land_on_the_master(half):
  """Updates in the param dtype: plain addition (eqx.apply_updates) keeps it."""
  opt = jmp_lite.master_weights(optax.sgd(1e-3))
  # Away from zero, so no step leaps by more than a factor of two.
  params = {"w": jnp.linspace(0.5, 1.0, 64).astype(half)}
  state = opt.init(params)
  grads = {"w": jnp.cos(jnp.arange(64.0)).astype(half)}
  for _ in range(20):
    updates, state = opt.update(grads, state, params)
    assert_dtype(updates["w"], half)
    params = jax.tree.map(lambda p, u: p + u, params, updates)  # No cast.
    assert_dtype(params["w"], half)
    chex.assert_trees_all_equal(
        params["w"], jmp_lite.master_params(state)["w"].astype(half))


def test_a_leap_towards_zero_is_closed_on_the_next_step():
  """No single half update can land 1.0078 on 2**-9: the next step does."""
  p0 = jnp.array([1.0 + 2.0**-7], jnp.bfloat16)
  opt = jmp_lite.master_weights(optax.sgd(1.0))
  state = opt.init({"w": p0})
  params = {"w": p0}
  jump = {"w": (p0.astype(jnp.float32) - 2.0**-9).astype(jnp.bfloat16)}
  updates, state = opt.update(jump, state, params)
  params = optax.apply_updates(params, updates)
  target = jmp_lite.master_params(state)["w"].astype(jnp.bfloat16)
  assert float(jnp.abs(params["w"] - target)[0]) <= 2.0**-7  # One rounding.
  # A skipped step (the master does not move) leaves the param as it is ...
  updates, state = opt.update({"w": jnp.zeros(1, jnp.bfloat16)}, state, params)
  assert bool(jnp.signbit(updates["w"][0])) and float(updates["w"][0]) == 0
  # ... the next step that moves the master lands on it.
  updates, state = opt.update({"w": jnp.full(1, 2.0**-20, jnp.bfloat16)},
                              state, params)
  params = optax.apply_updates(params, updates)
  target = jmp_lite.master_params(state)["w"].astype(jnp.bfloat16)
  chex.assert_trees_all_equal(params["w"], target)
  # With float32 updates (cast back by optax.apply_updates) it lands at once.
  exact = jmp_lite.master_weights(optax.sgd(1.0), update_dtype=jnp.float32)
  state = exact.init({"w": p0})
  updates, state = exact.update(jump, state, {"w": p0})
  assert_dtype(updates["w"], jnp.float32)
  chex.assert_trees_all_equal(
      optax.apply_updates({"w": p0}, updates)["w"],
      jmp_lite.master_params(state)["w"].astype(jnp.bfloat16))


def test_params_equal_the_rounded_master_where_xla_deletes_cast_round_trips():
  """XLA:GPU drops f32 -> bf16 -> f32 casts: a cast-pair target lets the
  delta be rounded twice, and a param that must land on 1 + 2**-7 stays 1."""
  params = {"w": jnp.ones((2,), jnp.bfloat16)}
  opt = jmp_lite.master_weights(optax.sgd(1.0))
  step = as_xla_gpu_simplifies(
      lambda p, s, g: (lambda us: (optax.apply_updates(p, us[0]), us[1]))(
          opt.update(g, s, p)))
  state = opt.init(params)
  # The master moves to 1 + 2**-20 (the param stays 1), then by 2**-8 more:
  # just past the midpoint between 1 and 1 + 2**-7.
  for g in (-(2.0**-20), -(2.0**-8)):
    params, state = step(params, state,
                         {"w": jnp.full((2,), g, jnp.bfloat16)})
  master = jmp_lite.master_params(state)["w"]
  np.testing.assert_array_equal(np.asarray(master, np.float64),
                                1 + 2.0**-8 + 2.0**-20)
  np.testing.assert_array_equal(np.asarray(params["w"], np.float64),
                                1 + 2.0**-7)


@pytest.mark.parametrize("master,param", [
    (jnp.bfloat16, jnp.float16), (jnp.float16, jnp.bfloat16),
    (jnp.float8_e4m3fn, jnp.float32), (jnp.float32, jnp.float64)],
    ids=["bf16-master-f16-params", "f16-master-bf16-params",
         "f8-master", "f32-master-f64-params"])
def test_a_master_narrower_than_its_params_is_refused(master, param):
  """A float16 master of bfloat16 params held a param at 99840 for 100
  steps of -10 (bfloat16's range, float16's max 65504); bfloat16 masters
  round float16 params' mantissas. A master must hold every param value."""
  with jax.enable_x64(param == jnp.float64):
    params = {"w": jnp.ones(4, param)}
    if np.dtype(master).itemsize == 1:
      with pytest.raises(ValueError, match="float8_e4m3fn master copy"):
        jmp_lite.master_weights(optax.sgd(0.05), dtype=master)
      return
    opt = jmp_lite.master_weights(optax.sgd(0.05), dtype=master)
    with pytest.raises(ValueError, match=(
        f"master dtype {np.dtype(master).name} cannot hold every value of"
        f" param \\['w'\\] \\({np.dtype(param).name}\\)")):
      opt.init(params)


def test_a_master_as_wide_as_its_params_in_every_respect_is_taken():
  params = {"w": jnp.ones(4, jnp.bfloat16), "h": jnp.ones(2, jnp.float16),
            "f": jnp.ones(2, jnp.float8_e4m3fn)}
  state = jmp_lite.master_weights(optax.sgd(0.05)).init(params)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.master))
