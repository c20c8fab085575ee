"""Tests for jmp_lite.transforms: skip_nonfinite, loss_scaled, lookups."""

from __future__ import annotations

import base64
import pickle
import re
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite
from tests.conftest import assert_dtype


def _params():
  return {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.ones(4)}


def _grads(scale=1.0, bad=None):
  g = {"w": jnp.full((3, 4), 0.1 * scale), "b": jnp.full((4,), -0.2 * scale)}
  if bad is not None:
    g["w"] = g["w"].at[1, 2].set(bad)
  return g


def _adam_with_schedule():
  return optax.chain(
      optax.clip_by_global_norm(1.0),
      optax.adamw(optax.linear_schedule(1e-2, 1e-3, 100), weight_decay=1e-2),
      optax.ema(0.9),
  )


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_skip_keeps_inner_state_bit_identical(bad, variant):
  opt = jmp_lite.skip_nonfinite(_adam_with_schedule())
  params = _params()
  state = opt.init(params)
  update = variant(opt.update)
  _, state = update(_grads(), state, params)  # One real step first.
  updates, skipped = update(_grads(bad=bad), state, params)
  chex.assert_trees_all_equal(skipped.inner_state, state.inner_state)
  for u in jax.tree.leaves(updates):
    np.testing.assert_array_equal(np.asarray(u), 0.0)
  assert int(skipped.total_skips) == 1
  assert int(skipped.consecutive_skips) == 1
  assert not bool(skipped.last_finite)
  _, after = update(_grads(), skipped, params)
  assert int(after.consecutive_skips) == 0 and int(after.total_skips) == 1
  assert bool(after.last_finite)


def test_skipped_steps_equal_a_run_without_them():
  opt = jmp_lite.skip_nonfinite(_adam_with_schedule())
  ref_opt = _adam_with_schedule()
  step = jax.jit(lambda p, s, g: _apply(opt, p, s, g))
  ref_step = jax.jit(lambda p, s, g: _apply(ref_opt, p, s, g))
  params, ref_params = _params(), _params()
  state, ref_state = opt.init(params), ref_opt.init(ref_params)
  rng = np.random.default_rng(0)
  for i in range(40):
    g = jax.tree.map(lambda x, i=i: x * (1 + i / 10), _grads())
    if rng.random() < 0.3:
      bad = {"w": g["w"].at[0, 0].set(np.nan), "b": g["b"]}
      params, state = step(params, state, bad)
    else:
      params, state = step(params, state, g)
      ref_params, ref_state = ref_step(ref_params, ref_state, g)
  chex.assert_trees_all_equal(params, ref_params)
  chex.assert_trees_all_equal(state.inner_state, ref_state)


def _apply(opt, params, state, grads):
  updates, state = opt.update(grads, state, params)
  return optax.apply_updates(params, updates), state


def test_max_consecutive_skips_halts_and_never_applies_nonfinite():
  opt = jmp_lite.skip_nonfinite(optax.sgd(0.1), max_consecutive_skips=2)
  params = _params()
  state = opt.init(params)
  update = jax.jit(opt.update)
  _, state = update(_grads(bad=np.nan), state, params)
  assert not bool(state.halted)
  jmp_lite.raise_if_halted(state)
  _, state = update(_grads(bad=np.nan), state, params)
  assert bool(state.halted)
  with pytest.raises(jmp_lite.NonFiniteHaltError,
                     match="halted by 2 consecutive"):
    jmp_lite.raise_if_halted({"opt": state})
  # Halted is sticky: even finite steps are skipped from now on.
  updates, state = update(_grads(), state, params)
  assert bool(state.halted) and int(state.total_skips) == 3
  for u in jax.tree.leaves(updates):
    np.testing.assert_array_equal(np.asarray(u), 0.0)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, 2**40, np.bool_(True)])
def test_max_consecutive_skips_validation(bad):
  with pytest.raises((ValueError, TypeError), match="max_consecutive_skips"):
    jmp_lite.skip_nonfinite(optax.sgd(0.1), max_consecutive_skips=bad)


def test_max_consecutive_skips_takes_numpy_integers():
  opt = jmp_lite.skip_nonfinite(optax.sgd(0.1),
                                max_consecutive_skips=np.int64(2))
  state = opt.init(_params())
  assert state.max_consecutive_skips == 2
  assert type(state.max_consecutive_skips) is int


def test_halt_message_reports_the_limit_and_the_skips_since():
  """The halt came on the 2nd consecutive non-finite step; the finite steps
  after it were skipped by the halt, not for being non-finite."""
  opt = jmp_lite.skip_nonfinite(optax.sgd(0.1), max_consecutive_skips=2)
  params = _params()
  state = opt.init(params)
  update = jax.jit(opt.update)
  for bad in (None, np.nan, np.inf, None, None):
    _, state = update(_grads(bad=bad), state, params)
  assert int(state.consecutive_skips) == 4 and int(state.total_skips) == 4
  with pytest.raises(jmp_lite.NonFiniteHaltError) as info:
    jmp_lite.raise_if_halted(state)
  message = str(info.value)
  assert "halted by 2 consecutive steps with non-finite gradients" in message
  assert "max_consecutive_skips=2" in message
  assert "(2 so far; 4 skipped in all)" in message
  assert "4 consecutive" not in message
  # The limit is static: it survives what a state goes through.
  for same in (jax.tree.map(lambda x: x, state),
               pickle.loads(pickle.dumps(jax.device_get(state)))):
    with pytest.raises(jmp_lite.NonFiniteHaltError, match="halted by 2"):
      jmp_lite.raise_if_halted(same)
  assert jax.eval_shape(lambda s: s, state).max_consecutive_skips == 2
  jax.jit(lambda s: s).lower(state)


@pytest.mark.parametrize("flag", ["allow_half_state", "track_nonfinite",
                                  "check_updates"])
@pytest.mark.parametrize("value", ["no", "yes", 1, 0])
def test_loss_scaled_bool_flags_take_only_bools(flag, value):
  # "no" is truthy: taken as a flag it would switch the option *on*.
  with pytest.raises(TypeError, match=f"{flag} must be .*a bool"):
    jmp_lite.loss_scaled(optax.sgd(0.1), "f32", **{flag: value})


def test_loss_scaled_bool_flags_take_numpy_bools_and_none():
  opt = jmp_lite.loss_scaled(optax.sgd(0.1), "f32",
                             allow_half_state=np.bool_(True),
                             track_nonfinite=np.False_, check_updates=None)
  state = opt.init(_params())
  assert state.config.check_updates is True  # None: as allow_half_state.


def test_not_a_transformation():
  with pytest.raises(TypeError, match="optax.GradientTransformation"):
    jmp_lite.skip_nonfinite(lambda g: g)
  with pytest.raises(TypeError, match="loss_scaled expects an"
                     r" optax.GradientTransformation .* got str: 'adam'"):
    jmp_lite.loss_scaled("adam", "f32")
  with pytest.raises(TypeError, match="loss_scale must be"):
    jmp_lite.loss_scaled(optax.sgd(0.1), 2.0**15)


def test_loss_scale_string_that_is_no_policy_names_the_fix():
  """'dynamic' gave only "Unknown dtype 'dynamic'" (found by a review)."""
  with pytest.raises(ValueError, match=r"loss_scale string 'dynamic' is read"
                     r" as a policy.*Unknown dtype 'dynamic'.*"
                     r"DynamicLossScale\(2.0\*\*15\)"):
    jmp_lite.loss_scaled(optax.sgd(0.1), "dynamic")


@pytest.mark.parametrize("wrapper", ["loss_scaled", "skip_nonfinite"])
@pytest.mark.parametrize("via", ["update", "update_and_apply"])
def test_a_state_the_wrapper_did_not_make_is_a_clear_error(wrapper, via):
  """A bare optimizer's state (a script that added the wrapper and kept its
  old opt_state) raised AttributeError: 'tuple' object has no attribute
  'loss_scale'."""
  opt = (jmp_lite.loss_scaled(optax.adam(1e-3), "f16")
         if wrapper == "loss_scaled"
         else jmp_lite.skip_nonfinite(optax.adam(1e-3)))
  params = _params()
  old_state = optax.adam(1e-3).init(params)
  with pytest.raises(TypeError, match=rf"{wrapper}\(...\).update got a tuple"
                     r" as its state, not the \w+State its init makes"):
    if via == "update":
      opt.update(_grads(), old_state, params)
    else:
      jmp_lite.update_and_apply(opt, _grads(), old_state, params)


def test_loss_scaled_unscales_before_inner_clipping():
  # The inner clip sees the true gradient norm, not the scaled one.
  scale = jmp_lite.StaticLossScale(2.0**10)
  opt = jmp_lite.loss_scaled(
      optax.chain(optax.clip_by_global_norm(100.0), optax.sgd(1.0)), scale)
  params = _params()
  state = opt.init(params)
  updates, _ = opt.update(scale.scale(_grads()), state, params)
  chex.assert_trees_all_close(
      updates, jax.tree.map(lambda g: -g, _grads()), rtol=1e-6)


def test_loss_scaled_dynamic_end_to_end(variant):
  opt = jmp_lite.loss_scaled(optax.adam(1e-2),
                             jmp_lite.DynamicLossScale(2.0**4, period=2))
  params = _params()
  state = opt.init(params)

  def step(params, state, bad):
    scale = jmp_lite.current_loss_scale(state)
    loss_fn = lambda p: scale.scale(jnp.sum(p["w"] ** 2) + jnp.sum(p["b"]))
    grads = jax.grad(loss_fn)(params)
    grads["w"] = jnp.where(bad, jnp.inf, grads["w"])
    return _apply(opt, params, state, grads)

  step = variant(step)
  seen = []
  for bad in [False, False, True, False, False]:
    before = params
    params, state = step(params, state, jnp.array(bad))
    seen.append(float(jmp_lite.current_loss_scale(state).loss_scale))
    if bad:
      chex.assert_trees_all_equal(params, before)
  assert seen == [16.0, 32.0, 16.0, 16.0, 32.0]
  assert int(state.total_skips) == 1
  assert int(state.inner_state[0].count) == 4


def test_default_loss_scale_from_policy():
  assert isinstance(jmp_lite.default_loss_scale("c=f16"),
                    jmp_lite.DynamicLossScale)
  assert isinstance(jmp_lite.default_loss_scale(jmp_lite.get_policy("bf16")),
                    jmp_lite.NoOpLossScale)
  opt = jmp_lite.loss_scaled(optax.sgd(0.1), jmp_lite.get_policy("p=f32,c=f16"))
  state = opt.init(_params())
  scale = jmp_lite.current_loss_scale(state)
  assert float(scale.loss_scale) == 2.0**15
  assert_dtype(scale.loss_scale, jnp.float32)
  with pytest.raises(TypeError, match="Policy or policy string"):
    jmp_lite.default_loss_scale(3)


def test_current_loss_scale_found_inside_wrappers():
  inner = jmp_lite.loss_scaled(optax.sgd(0.1), jmp_lite.StaticLossScale(8.0))
  wrapped = [
      optax.chain(optax.identity(), inner),
      optax.MultiSteps(inner, every_k_schedule=2),
      optax.inject_hyperparams(
          lambda learning_rate: jmp_lite.loss_scaled(
              optax.sgd(learning_rate), jmp_lite.StaticLossScale(8.0)))(
                  learning_rate=0.1),
      optax.multi_transform({"a": inner, "b": optax.sgd(0.1)},
                            {"w": "a", "b": "b"}),
  ]
  for opt in wrapped:
    state = opt.init(_params())
    assert float(jmp_lite.current_loss_scale(state).loss_scale) == 8.0


def test_several_named_scales():
  opt = optax.multi_transform(
      {"gen": jmp_lite.loss_scaled(
          optax.sgd(0.1), jmp_lite.StaticLossScale(2.0), name="gen"),
       "disc": jmp_lite.loss_scaled(
           optax.sgd(0.1), jmp_lite.StaticLossScale(4.0), name="disc")},
      {"w": "gen", "b": "disc"})
  state = opt.init(_params())
  disc = jmp_lite.current_loss_scale(state, name="disc")
  assert float(disc.loss_scale) == 4.0
  with pytest.raises(ValueError, match="2 loss_scaled states found"):
    jmp_lite.current_loss_scale(state)
  with pytest.raises(ValueError, match="No loss_scaled state named 'x'"):
    jmp_lite.current_loss_scale(state, name="x")
  with pytest.raises(ValueError, match="No loss_scaled state"):
    jmp_lite.current_loss_scale(optax.sgd(0.1).init(_params()))


def test_loss_scaled_never_recompiles_as_the_scale_moves():
  opt = jmp_lite.loss_scaled(optax.adam(1e-3),
                             jmp_lite.DynamicLossScale(2.0**8, period=3))

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(params, state, bad):
    scale = jmp_lite.current_loss_scale(state)
    grads = jax.grad(lambda p: scale.scale(jnp.sum(p["w"] ** 2)))(params)
    grads = jax.tree.map(lambda g: jnp.where(bad, jnp.nan, g), grads)
    return _apply(opt, params, state, grads)

  params = _params()
  state = opt.init(params)
  rng = np.random.default_rng(3)
  for _ in range(100):
    params, state = step(params, state, jnp.array(rng.random() < 0.2))
  assert int(state.total_skips) > 0


def test_state_round_trips_through_lower_and_eval_shape():
  opt = jmp_lite.loss_scaled(optax.adam(1e-3), jmp_lite.DynamicLossScale(4.0),
                             name="main")
  state = opt.init(_params())
  shapes = jax.eval_shape(opt.update, _grads(), state, _params())
  assert shapes[1].name == "main"
  jax.jit(opt.update).lower(_grads(), state, _params()).compile()


def test_manual_path_composes_to_the_same_result_as_loss_scaled():
  """scale/unscale/adjust by hand + skip_nonfinite == loss_scaled."""
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
  auto = jmp_lite.loss_scaled(inner,
                              jmp_lite.DynamicLossScale(2.0**4, period=2))
  manual = jmp_lite.skip_nonfinite(inner)

  def loss(p, x):
    return jnp.sum(jnp.tanh(p["w"] * x) ** 2) + jnp.sum(p["b"]) * x

  @jax.jit
  def auto_step(params, state, x, bad):
    scale = jmp_lite.current_loss_scale(state)
    grads = jax.grad(lambda p: scale.scale(loss(p, x)))(params)
    grads["b"] = jnp.where(bad, jnp.inf, grads["b"])
    return _apply(auto, params, state, grads)

  @jax.jit
  def manual_step(params, state, scale, x, bad):
    grads = jax.grad(lambda p: scale.scale(loss(p, x)))(params)
    grads["b"] = jnp.where(bad, jnp.inf, grads["b"])
    grads = scale.unscale(grads)
    params, state = _apply(manual, params, state, grads)
    return params, state, scale.adjust(jmp_lite.all_finite(grads))

  p_auto = p_manual = _params()
  s_auto, s_manual = auto.init(p_auto), manual.init(p_manual)
  scale = jmp_lite.DynamicLossScale(2.0**4, period=2)
  rng = np.random.default_rng(7)
  for i in range(30):
    x, bad = jnp.float32(1 + i / 7), jnp.array(rng.random() < 0.25)
    p_auto, s_auto = auto_step(p_auto, s_auto, x, bad)
    p_manual, s_manual, scale = manual_step(p_manual, s_manual, scale, x, bad)
  chex.assert_trees_all_close(p_auto, p_manual, rtol=1e-6)
  chex.assert_trees_all_close(s_auto.inner_state, s_manual.inner_state,
                              rtol=1e-6)
  chex.assert_trees_all_equal(s_auto.loss_scale, scale)
  assert int(s_auto.total_skips) == int(s_manual.total_skips) > 0


def test_check_updates_skips_optimizer_made_overflow():
  """Pure float16 Adam: finite gradients, but eps=1e-8 is 0 in float16."""
  params = {"w": jnp.ones((4,), jnp.float16)}
  grads = {"w": jnp.array([1e-3, 0.0, 0.0, 0.0], jnp.float16)}
  unchecked = jmp_lite.loss_scaled(optax.adam(1e-3), jmp_lite.NoOpLossScale(),
                                   allow_half_state=True, check_updates=False)
  updates, _ = unchecked.update(grads, unchecked.init(params), params)
  assert not bool(jmp_lite.all_finite(updates))  # 0 / (0 + 0) = NaN
  checked = jmp_lite.loss_scaled(optax.adam(1e-3), jmp_lite.NoOpLossScale(),
                                 allow_half_state=True)  # on by default here
  state = checked.init(params)
  updates, new_state = jax.jit(checked.update)(grads, state, params)
  chex.assert_trees_all_equal(optax.apply_updates(params, updates), params)
  chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
  assert int(new_state.total_skips) == 1 and not bool(new_state.last_finite)
  # The loss scale does not back off: the gradients were finite.
  dyn = jmp_lite.loss_scaled(optax.adam(1e-3), jmp_lite.DynamicLossScale(8.0),
                             allow_half_state=True)
  _, dyn_state = dyn.update(grads, dyn.init(params), params)
  assert int(dyn_state.total_skips) == 1
  assert float(dyn_state.loss_scale.loss_scale) == 8.0


@pytest.mark.parametrize("skip_with", ["cond", "select"])
@pytest.mark.parametrize("guard", ["loss_scaled", "skip_nonfinite"])
def test_both_formulations_skip_bit_identically(guard, skip_with):
  """Fault injection through opt.update: a skip changes nothing, either way."""
  if guard == "loss_scaled":
    opt = jmp_lite.loss_scaled(_adam_with_schedule(),
                               jmp_lite.DynamicLossScale(2.0**4, period=2),
                               skip_with=skip_with)
  else:
    opt = jmp_lite.skip_nonfinite(_adam_with_schedule(), skip_with=skip_with)
  step = jax.jit(lambda p, s, g: _apply(opt, p, s, g))
  params = _params()
  params["b"] = params["b"].at[1].set(-0.0)
  state = opt.init(params)
  for bad in [np.inf, None, np.nan, -np.inf, None, None]:
    before = (params, state.inner_state)
    params, state = step(params, state, _grads(scale=16.0, bad=bad))
    if bad is None:
      assert bool(state.last_finite)
      continue
    chex.assert_trees_all_equal((params, state.inner_state), before)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(before[0]),
                    strict=True):
      np.testing.assert_array_equal(np.signbit(a), np.signbit(b))
    assert not bool(state.last_finite)
  assert int(state.total_skips) == 3
  # Adam's count moved on the three applied steps only.
  assert int(state.inner_state[1][0].count) == 3


def test_formulations_agree_on_applied_steps():
  """cond and select run the same arithmetic: equal up to float rounding."""
  out = {}
  for skip_with in ("cond", "select"):
    opt = jmp_lite.loss_scaled(_adam_with_schedule(),
                               jmp_lite.DynamicLossScale(2.0**4, period=2),
                               skip_with=skip_with)
    step = jax.jit(lambda p, s, g, opt=opt: _apply(opt, p, s, g))
    params = _params()
    state = opt.init(params)
    for i in range(8):
      grads = _grads(scale=16.0 * (1 + i), bad=np.nan if i == 3 else None)
      params, state = step(params, state, grads)
    out[skip_with] = (params, state)
  chex.assert_trees_all_close(jax.tree.leaves(out["cond"]),
                              jax.tree.leaves(out["select"]), rtol=1e-6,
                              atol=1e-9)
  assert out["cond"][1].config.skip_with == "cond"
  assert out["select"][1].config.skip_with == "select"


def test_guard_config_lives_in_the_tree_structure():
  opt = jmp_lite.loss_scaled(optax.sgd(0.1), jmp_lite.DynamicLossScale(4.0),
                             axis_name="data", check_updates=True,
                             skip_with="cond")
  state = opt.init(_params())
  assert state.config == jmp_lite.transforms.GuardConfig(
      axis_name="data", skip_with="cond", check_updates=True,
      may_amplify=False)
  # Static: not a leaf, survives tree_map and eval_shape, part of the treedef.
  assert state.config not in jax.tree.leaves(state)
  assert jax.tree.map(lambda x: x, state).config == state.config
  assert jax.eval_shape(lambda s: s, state).config == state.config
  low = jmp_lite.loss_scaled(optax.sgd(0.1), jmp_lite.DynamicLossScale(
      4.0, min_loss_scale=0.5)).init(_params())
  assert low.config.may_amplify
  assert low.config.formulation()[0] == "select"
  assert state.config.formulation() == (
      "select", state.config.formulation()[1])
  assert "check_updates" in state.config.formulation()[1]


def test_skip_with_and_axis_name_validation():
  with pytest.raises(ValueError, match=r"skip_with must be one of \('auto',"
                     r" 'cond', 'select'\), got 'branch'"):
    jmp_lite.loss_scaled(optax.sgd(0.1), "f32", skip_with="branch")
  with pytest.raises(ValueError, match="skip_with must be one of"):
    jmp_lite.skip_nonfinite(optax.sgd(0.1), skip_with=None)
  with pytest.raises(TypeError, match="axis_name must be None, a str"):
    jmp_lite.loss_scaled(optax.sgd(0.1), "f32", axis_name=["data"])


def test_skipped_updates_keep_the_inner_updates_structure():
  """With cond, a skipped step's updates have the inner's dtypes and shapes."""
  def inner_update(updates, state, params=None):
    # Updates in a dtype other than the gradients'.
    return jax.tree.map(lambda g: g.astype(jnp.bfloat16), updates), state

  inner = optax.GradientTransformation(lambda p: optax.EmptyState(),
                                       inner_update)
  opt = jmp_lite.skip_nonfinite(inner, skip_with="cond")
  params = {"w": jnp.ones(3)}
  updates, _ = jax.jit(opt.update)({"w": jnp.array([1.0, jnp.nan, 0.0])},
                                   opt.init(params), params)
  assert_dtype(updates["w"], jnp.bfloat16)
  assert np.signbit(np.asarray(updates["w"], np.float32)).all()


def test_loss_scale_state_is_copied_into_each_state():
  scale = jmp_lite.DynamicLossScale(jnp.float32(8.0))
  opt = jmp_lite.loss_scaled(optax.sgd(0.1), scale)
  a, b = opt.init(_params()), opt.init(_params())
  assert a.loss_scale.loss_scale is not scale.loss_scale
  assert (a.loss_scale.loss_scale.unsafe_buffer_pointer()
          != b.loss_scale.loss_scale.unsafe_buffer_pointer())


# pickle.dumps(jax.device_get(state), protocol=4) at commit 7fed298, before
# transforms.py and low_precision.py became packages, of
# kahan_summation(loss_scaled(optax.sgd(0.1), StaticLossScale(2.0))) on
# {"w": ones(2, bfloat16)}: a KahanState around a LossScaledState.
_PICKLED_BEFORE_THE_SPLIT = base64.b64decode("""
gASVFwMAAAAAAACMFmptcF9saXRlLmxvd19wcmVjaXNpb26UjApLYWhhblN0YXRllJOUKY
GUfZQojAxjb21wZW5zYXRpb26UfZSMAXeUjBZudW1weS5fY29yZS5tdWx0aWFycmF5lIwM
X3JlY29uc3RydWN0lJOUjAVudW1weZSMB25kYXJyYXmUk5RLAIWUQwFilIeUUpQoSwFLAo
WUaAuMBWR0eXBllJOUjAltbF9kdHlwZXOUjAhiZmxvYXQxNpSTlImIh5RSlChLA4wBPJRO
Tk5LAksCS0B0lGKJQwQAAAAAlHSUYnOMC2lubmVyX3N0YXRllIwTam1wX2xpdGUudHJhbn
Nmb3Jtc5SMD0xvc3NTY2FsZWRTdGF0ZZSTlCmBlH2UKGgejA9vcHRheC5fc3JjLmJhc2WU
jApFbXB0eVN0YXRllJOUKYGUaCYpgZSGlIwKbG9zc19zY2FsZZSME2ptcF9saXRlLmxvc3
Nfc2NhbGWUjA9TdGF0aWNMb3NzU2NhbGWUk5QpgZR9lGgqaApoDUsAhZRoD4eUUpQoSwEp
aBSMAmY0lImIh5RSlChLA2gaTk5OSv////9K/////0sAdJRiiUMEAAAAQJR0lGJzYowLdG
90YWxfc2tpcHOUaApoDUsAhZRoD4eUUpQoSwEpaBSMAmk0lImIh5RSlChLA2gaTk5OSv//
//9K/////0sAdJRiiUMEAAAAAJR0lGKMEWNvbnNlY3V0aXZlX3NraXBzlGgKaA1LAIWUaA
+HlFKUKEsBKWg/iUMEAAAAAJR0lGKMC2xhc3RfZmluaXRllGgKaA1LAIWUaA+HlFKUKEsB
KWgUjAJiMZSJiIeUUpQoSwOMAXyUTk5OSv////9K/////0sAdJRiiUMBAZR0lGKMCW5vbm
Zpbml0ZZROjARuYW1llE6MBmNvbmZpZ5RoH4wLR3VhcmRDb25maWeUk5QpgZR9lCiMCWF4
aXNfbmFtZZROjAlza2lwX3dpdGiUjARhdXRvlIwNY2hlY2tfdXBkYXRlc5SJjAttYXlfYW
1wbGlmeZSJdWJ1YnViLg==""")


def test_states_pickled_before_the_split_load_and_step():
  """Pickles name the public modules, before and after the split into
  packages: an old checkpoint loads, and a new pickle names no private
  module."""
  opt = jmp_lite.kahan_summation(
      jmp_lite.loss_scaled(optax.sgd(0.1), jmp_lite.StaticLossScale(2.0)))
  params = {"w": jnp.ones(2, jnp.bfloat16)}
  old: Any = pickle.loads(_PICKLED_BEFORE_THE_SPLIT)
  assert type(old) is jmp_lite.low_precision.KahanState
  assert type(old.inner_state) is jmp_lite.LossScaledState
  assert old.inner_state.config == jmp_lite.transforms.GuardConfig()
  # It recorded no scale settings: they are read from its leaves as it
  # loads, so it has the structure the optimizer's init makes.
  chex.assert_trees_all_equal(old, jax.device_get(opt.init(params)))
  assert old.inner_state.scale_settings == (("loss_scale", 2.0),)
  new: Any = opt.update({"w": jnp.ones(2, jnp.bfloat16)}, old, params)[1]
  assert int(new.inner_state.total_skips) == 0
  data = pickle.dumps(jax.device_get(new), protocol=4)
  assert b"jmp_lite.transforms\x94" in data
  assert b"jmp_lite.low_precision\x94" in data
  assert b"jmp_lite.transforms._" not in data
  assert b"jmp_lite.low_precision._" not in data
  for cls in (jmp_lite.LossScaledState, jmp_lite.transforms.SkipNonfiniteState,
              jmp_lite.transforms.GuardConfig,
              jmp_lite.transforms.NonFiniteHaltError):
    assert cls.__module__ == "jmp_lite.transforms", cls
  for cls in (jmp_lite.low_precision.KahanState,
              jmp_lite.low_precision.StochasticRoundingState,
              jmp_lite.low_precision.StateDtypesState):
    assert cls.__module__ == "jmp_lite.low_precision", cls


@pytest.mark.parametrize("via", ["update", "update_and_apply"])
def test_float16_gradients_are_not_unscaled_in_float16(via):
  """True gradients of 3e-8 and 1e-7 came back 99% and 19% off, silently:
  unscaling float16 gradients in float16 is refused (as PyTorch's
  GradScaler does), and master weights unscale them in float32."""
  scale = 2.0**14
  true = np.array([3e-8, 1e-7], np.float32)
  params = jnp.zeros(2, jnp.float16)
  grads = jnp.asarray(true * scale, jnp.float16)   # what backprop hands on

  def step(opt):
    state = opt.init(params)
    if via == "update":
      return opt.update(grads, state, params)
    return jmp_lite.update_and_apply(opt, grads, state, params)

  bare = jmp_lite.loss_scaled(optax.sgd(1.0), jmp_lite.StaticLossScale(scale))
  with pytest.raises(TypeError, match=r"float16.*master_weights"):
    step(bare)
  _, state = step(jmp_lite.master_weights(bare))
  master = np.asarray(jmp_lite.master_params(state))
  np.testing.assert_allclose(-master, true, rtol=2e-3)
  # Deliberate pure half precision may still unscale in float16.
  step(jmp_lite.loss_scaled(optax.sgd(1.0), jmp_lite.StaticLossScale(scale),
                            allow_half_state=True))


def _static(value):
  return jmp_lite.StaticLossScale(value)


# loss_scaled's every configuration argument (but inner), each with two
# values that make different optimizers: a state made under one is refused
# by the other, both named.
_LOSS_SCALED_CONFIGS = {
    "loss_scale": [
        (_static(128.0), _static(4.0), "loss_scale', 128.0"),
        (jmp_lite.DynamicLossScale(8.0), jmp_lite.DynamicLossScale(
            8.0, max_loss_scale=2.0 ** 16), "max_loss_scale', 16777216.0"),
        (jmp_lite.DynamicLossScale(8.0), jmp_lite.DynamicLossScale(
            8.0, min_loss_scale=2.0), "min_loss_scale', 1.0"),
        (jmp_lite.DynamicLossScale(8.0), jmp_lite.DynamicLossScale(
            8.0, period=7), "period"),
        (jmp_lite.DynamicLossScale(8.0), jmp_lite.DynamicLossScale(
            8.0, factor=3), "loss_scale is"),
        (jmp_lite.DynamicLossScale(8.0), jmp_lite.DynamicLossScale(
            8.0, backoff_factor=0.25), "loss_scale is"),
        (jmp_lite.DynamicLossScale(8.0), jmp_lite.DynamicLossScale(
            8.0, hysteresis=2), "loss_scale is"),
        (jmp_lite.DynamicLossScale(8.0), jmp_lite.DynamicLossScale(
            8.0, hysteresis_reset="growth"), "loss_scale is"),
        (_static(4.0), jmp_lite.DynamicLossScale(4.0), "loss_scale is"),
    ],
    "axis_name": [(None, "data", "axis_name='data'")],
    "name": [(None, "gen", "name is None, the optimizer's 'gen'")],
    "track_nonfinite": [
        (False, True, "track_nonfinite is False, the optimizer's True"),
        (True, False, "track_nonfinite is True, the optimizer's False")],
    "check_updates": [(False, True, "check_updates=True")],
    "skip_with": [("cond", "select", "skip_with='select'")],
}


def _case_ids(configs):
  return [(arg, i) for arg, cases in configs.items()
          for i in range(len(cases))]


@pytest.mark.parametrize("case", _case_ids(_LOSS_SCALED_CONFIGS),
                         ids=lambda c: f"{c[0]}-{c[1]}")
@pytest.mark.parametrize("via", ["update", "update_and_apply"])
def test_loss_scaled_refuses_a_state_of_another_configuration(case, via):
  """A StaticLossScale's value, a DynamicLossScale's bounds, flipped
  track_nonfinite or allow_half_state: the state silently won. Every
  configuration argument is now recorded in the state and compared."""
  arg, i = case
  made, stepped, needle = _LOSS_SCALED_CONFIGS[arg][i]

  def build(value):
    kwargs = {"loss_scale": _static(2.0), "check_updates": False,
              "skip_with": "cond", arg: value}
    loss_scale = kwargs.pop("loss_scale")
    return jmp_lite.loss_scaled(optax.sgd(0.1), loss_scale, **kwargs)

  params = _params()
  state = build(made).init(params)
  opt = build(stepped)
  with pytest.raises(ValueError, match=r"loss_scaled\(\.\.\.\)\.update got a"
                     r" state that another configuration made: .*"
                     + re.escape(needle)) as info:
    if via == "update":
      opt.update(_grads(), state, params)
    else:
      jmp_lite.update_and_apply(opt, _grads(), state, params)
  assert "the state's" in str(info.value)
  assert "the optimizer's" in str(info.value)
  # Its own optimizer steps it.
  build(made).update(_grads(), state, params)


def test_every_loss_scaled_argument_is_compared():
  """A new configuration argument must be recorded and tested above."""
  import inspect
  arguments = set(inspect.signature(jmp_lite.loss_scaled).parameters)
  # allow_half_state: refused one way only (the test below).
  assert arguments - {"inner", "allow_half_state"} == set(
      _LOSS_SCALED_CONFIGS)
  arguments = set(inspect.signature(jmp_lite.skip_nonfinite).parameters)
  assert arguments - {"inner"} == {"max_consecutive_skips", "axis_name",
                                   "skip_with"}


@pytest.mark.parametrize("arg,made,stepped,needle", [
    ("max_consecutive_skips", None, 3, "max_consecutive_skips is None"),
    ("axis_name", "data", None, "axis_name='data'"),
    ("skip_with", "cond", "select", "skip_with='cond'"),
])
def test_skip_nonfinite_refuses_a_state_of_another_configuration(
    arg, made, stepped, needle):
  params = _params()
  state = jmp_lite.skip_nonfinite(optax.sgd(0.1), **{arg: made}).init(params)
  with pytest.raises(ValueError, match=r"another configuration made: .*"
                     + re.escape(needle)):
    jmp_lite.skip_nonfinite(optax.sgd(0.1), **{arg: stepped}).update(
        _grads(), state, params)


@pytest.mark.parametrize("via", ["update", "update_and_apply"])
def test_half_moments_made_with_allow_half_state_are_refused_without_it(via):
  """A state made with allow_half_state=True (bfloat16 Adam moments) was
  stepped by an optimizer that refuses them at init, silently. The other
  way round is accepted: the lenient optimizer could have made that state
  too (a decision, docs/refusals.md)."""
  params = {"w": jnp.ones((2, 3), jnp.bfloat16)}
  grads = {"w": jnp.ones((2, 3), jnp.bfloat16)}

  def build(allow):
    return jmp_lite.loss_scaled(optax.adam(0.1), jmp_lite.NoOpLossScale(),
                                allow_half_state=allow, check_updates=False)

  state = build(True).init(params)
  with pytest.raises(ValueError, match=r"a state made with"
                     r" allow_half_state=True.*this optimizer has"
                     r" allow_half_state=False"):
    if via == "update":
      build(False).update(grads, state, params)
    else:
      jmp_lite.update_and_apply(build(False), grads, state, params)
  f32 = {"w": jnp.ones((2, 3))}
  strict = build(False).init(f32)
  build(True).update(f32, strict, f32)


def test_a_dynamic_scales_current_value_is_state_not_configuration():
  """A documented decision: the scale a dynamic state has reached moves by
  design, so a state started at another initial scale is accepted (the
  bounds and schedule must match)."""
  params = _params()
  state = jmp_lite.loss_scaled(
      optax.sgd(0.1), jmp_lite.DynamicLossScale(2.0 ** 10)).init(params)
  opt = jmp_lite.loss_scaled(optax.sgd(0.1),
                             jmp_lite.DynamicLossScale(2.0 ** 15))
  _, new = opt.update(_grads(2.0 ** 10), state, params)
  assert float(new.loss_scale.loss_scale) == 2.0 ** 10


def test_a_pickled_state_restored_into_another_configuration_is_refused():
  params = _params()
  made = jmp_lite.loss_scaled(optax.sgd(0.1), _static(128.0),
                              track_nonfinite=True)
  state = pickle.loads(pickle.dumps(jax.device_get(made.init(params))))
  for other in (jmp_lite.loss_scaled(optax.sgd(0.1), _static(4.0),
                                     track_nonfinite=True),
                jmp_lite.loss_scaled(optax.sgd(0.1), _static(128.0))):
    with pytest.raises(ValueError, match="another configuration made"):
      other.update(_grads(128.0), state, params)
  made.update(_grads(128.0), state, params)


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_an_orbax_restore_into_another_configuration_is_converted(
    kind, tmp_path):
  """orbax takes the static settings from the restore target and the leaves
  from the checkpoint: a static scale of 128 restored into an optimizer
  configured with 4, a dynamic scale of 2**20 into max_loss_scale=2**16.
  The first step unscales by the scale its loss was scaled with (the
  state's); from then on the configuration holds."""
  import orbax.checkpoint as ocp

  params = _params()
  if kind == "static":
    old = jmp_lite.loss_scaled(optax.sgd(0.1), _static(128.0))
    new = jmp_lite.loss_scaled(optax.sgd(0.1), _static(4.0))
    saved, then = 128.0, 4.0
  else:
    old = jmp_lite.loss_scaled(optax.sgd(0.1), jmp_lite.DynamicLossScale(
        2.0 ** 20, period=1000))
    new = jmp_lite.loss_scaled(optax.sgd(0.1), jmp_lite.DynamicLossScale(
        2.0 ** 10, period=1000, max_loss_scale=2.0 ** 16))
    saved, then = 2.0 ** 20, 2.0 ** 16
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(tmp_path / "c", old.init(params))
    ckptr.wait_until_finished()
    state = ckptr.restore(tmp_path / "c", new.init(params))
  scale = jmp_lite.current_loss_scale(state)
  assert float(scale.loss_scale) == saved  # what the next loss is scaled by
  step = jax.jit(lambda g, s, p: jmp_lite.update_and_apply(new, g, s, p))
  got, state = step(_grads(saved), state, params)
  chex.assert_trees_all_close(got, jax.tree.map(
      lambda p, g: p - 0.1 * g, params, _grads()), rtol=1e-6)
  scale = jmp_lite.current_loss_scale(state)
  assert float(scale.loss_scale) == then
  if kind == "dynamic":
    assert float(scale.max_loss_scale) == 2.0 ** 16
  # And the converted state keeps stepping with the new configuration.
  got, state = step(_grads(then), state, got)
  assert float(jmp_lite.current_loss_scale(state).loss_scale) == then
