"""Tests for jmp_lite.loss_scale: schedule, dtypes, round trips, errors."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite
from tests.conftest import assert_dtype, FLOAT_DTYPE_IDS, FLOAT_DTYPES

T, F = jnp.array(True), jnp.array(False)


def reference_schedule(finite_seq, *, scale, period, factor, backoff, lo, hi,
                       hysteresis):
  """Plain-Python model of the documented schedule (float32 arithmetic)."""
  scale = np.float32(scale)
  counter = nonfinite = 0
  out = []
  for finite in finite_seq:
    if finite:
      counter += 1
      nonfinite = 0
      if counter >= period:
        scale = min(np.float32(scale * np.float32(factor)), np.float32(hi))
        counter = 0
    else:
      counter = 0
      nonfinite += 1
      if nonfinite >= hysteresis:
        scale = max(np.float32(scale * np.float32(backoff)), np.float32(lo))
        nonfinite = 0
    out.append((float(scale), counter, nonfinite))
  return out


@hypothesis.settings(deadline=None, max_examples=40)
@hypothesis.given(
    finite_seq=st.lists(st.booleans(), min_size=1, max_size=60),
    period=st.integers(1, 5),
    factor=st.sampled_from([2, 3, 1.5, 4.0]),
    backoff=st.sampled_from([None, 0.5, 0.25, 0.9]),
    hysteresis=st.integers(1, 3),
    log_scale=st.integers(-3, 20),
    lo=st.sampled_from([1.0, 0.125, 2.0**-10]),
    hi=st.sampled_from([2.0**24, 2.0**16, 1e30]),
)
def test_adjust_matches_reference_schedule(finite_seq, period, factor, backoff,
                                           hysteresis, log_scale, lo, hi):
  scale = float(np.clip(2.0**log_scale, lo, hi))
  state = jmp_lite.DynamicLossScale(
      scale, period=period, factor=factor, min_loss_scale=lo,
      backoff_factor=backoff, max_loss_scale=hi, hysteresis=hysteresis)
  expected = reference_schedule(
      finite_seq, scale=scale, period=period, factor=factor,
      backoff=1 / factor if backoff is None else backoff, lo=lo, hi=hi,
      hysteresis=hysteresis)
  adjust = jax.jit(lambda s, f: s.adjust(f))
  for finite, (e_scale, e_counter, e_nonfinite) in zip(
      finite_seq, expected, strict=True):
    state = adjust(state, jnp.array(finite))
    assert float(state.loss_scale) == e_scale
    assert int(state.counter) == e_counter
    assert int(state.nonfinite_counter) == e_nonfinite
    assert_dtype(state.loss_scale, jnp.float32)
    assert_dtype(state.counter, jnp.int32)


def test_grows_on_the_period_th_finite_step(variant):
  # The same step as PyTorch GradScaler and jmp (Flax grows one step later).
  adjust = variant(lambda s, f: s.adjust(f))
  state = jmp_lite.DynamicLossScale(2.0**10, period=3)
  for expected in [2.0**10, 2.0**10, 2.0**11, 2.0**11, 2.0**11, 2.0**12]:
    state = adjust(state, T)
    assert float(state.loss_scale) == expected


def test_backoff_resets_growth_counter_and_respects_min(variant):
  adjust = variant(lambda s, f: s.adjust(f))
  state = jmp_lite.DynamicLossScale(4.0, period=2, min_loss_scale=0.5)
  state = adjust(state, T)
  assert int(state.counter) == 1
  state = adjust(state, F)
  assert float(state.loss_scale) == 2.0 and int(state.counter) == 0
  for expected in [1.0, 0.5, 0.5]:  # The min may be below 1.
    state = adjust(state, F)
    assert float(state.loss_scale) == expected


def test_hysteresis_counts_consecutive_nonfinite_steps(variant):
  adjust = variant(lambda s, f: s.adjust(f))
  state = jmp_lite.DynamicLossScale(2.0**10, hysteresis=2)
  state = adjust(state, F)
  assert float(state.loss_scale) == 2.0**10
  state = adjust(state, T)          # Breaks the run of non-finite steps.
  state = adjust(state, F)
  assert float(state.loss_scale) == 2.0**10
  state = adjust(state, F)          # Second consecutive: back off.
  assert float(state.loss_scale) == 2.0**9
  assert int(state.nonfinite_counter) == 0


def test_growth_is_capped_and_never_non_finite(variant):
  adjust = variant(lambda s, f: s.adjust(f))
  state = jmp_lite.DynamicLossScale(2.0**23, period=1)
  for _ in range(3):
    state = adjust(state, T)
    assert float(state.loss_scale) == 2.0**24  # Apex's default max.
  # Even with the largest max allowed, growth saturates rather than
  # overflows.
  big = 2.0 ** 126
  state = jmp_lite.DynamicLossScale(big / 2, period=1, factor=4,
                                    max_loss_scale=big)
  state = adjust(state, T)
  assert np.isfinite(float(state.loss_scale))
  assert float(state.loss_scale) == np.float32(big)
  # And 1 / scale, which unscales, is still a normal float32 (XLA flushes
  # subnormals): a gradient unscaled at the largest scale is not zeroed.
  g = jax.jit(state.unscale)(jnp.float32(2.0 ** 100))
  assert float(g) == 2.0 ** -26


def test_backoff_factor_defaults_to_inverse_factor():
  assert jmp_lite.DynamicLossScale(8.0, factor=4).backoff_factor == 0.25
  s = jmp_lite.DynamicLossScale(8.0, backoff_factor=0.75).adjust(F)
  assert float(s.loss_scale) == 6.0


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=FLOAT_DTYPE_IDS)
@pytest.mark.parametrize("make", [
    lambda: jmp_lite.StaticLossScale(2.0**16),
    lambda: jmp_lite.DynamicLossScale(2.0**16),
], ids=["static", "dynamic"])
def test_scaled_loss_keeps_its_dtype(dtype, make, variant):
  state = make()
  loss = jnp.asarray(0.001, dtype)
  scaled = variant(lambda s, x: s.scale(x))(state, loss)
  assert_dtype(scaled, dtype)
  # 2**16 overflows float16, but 0.001 * 2**16 = 65.5 does not: the product
  # must be taken in float32.
  np.testing.assert_allclose(float(scaled), float(loss) * 2.0**16, rtol=1e-2)
  back = variant(lambda s, x: s.unscale(x))(state, scaled)
  assert_dtype(back, dtype)
  np.testing.assert_allclose(float(back), float(loss), rtol=1e-2)


@pytest.mark.parametrize("make", [
    jmp_lite.NoOpLossScale,
    lambda: jmp_lite.StaticLossScale(3),
    lambda: jmp_lite.DynamicLossScale(2**15),
    lambda: jmp_lite.DynamicLossScale(jnp.asarray(2.0**15)),  # weak-typed
    lambda: jmp_lite.DynamicLossScale(np.float16(1024)),
], ids=["noop", "static", "dynamic", "dynamic-weak", "dynamic-f16"])
def test_scale_is_always_strong_float32(make):
  scale = make().loss_scale
  assert_dtype(scale, jnp.float32)
  assert not getattr(scale, "weak_type", False)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2],
                         ids=["e4m3fn", "e5m2"])
def test_scale_and_unscale_fp8_leaves_in_float32(dtype, variant):
  """FP8 leaves (which JAX will not promote implicitly) are multiplied in
  float32 and keep their dtype."""
  state = jmp_lite.StaticLossScale(2.0**10)
  tree = {"g": jnp.asarray([0.25, -0.125, 0.0], dtype)}
  scaled = variant(lambda s, t: s.scale(t))(state, tree)
  assert_dtype(scaled["g"], dtype)
  np.testing.assert_array_equal(np.asarray(scaled["g"], np.float32),
                                [256.0, -128.0, 0.0])
  chex.assert_trees_all_equal(
      variant(lambda s, t: s.unscale(t))(state, scaled), tree)


def test_scale_and_unscale_skip_non_float_leaves():
  state = jmp_lite.StaticLossScale(4.0)
  tree = {"i": jnp.arange(3), "f": jnp.ones(2), "n": None,
          "f0": np.zeros(2, jax.dtypes.float0)}
  out = state.unscale(state.scale(tree))
  assert out["i"] is tree["i"] and out["f0"] is tree["f0"] and out["n"] is None
  chex.assert_trees_all_equal(out["f"], tree["f"])


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_python_floats_are_scaled_as_jmp_scales_them(jit):
  """They passed through unscaled (jmp multiplies them); ints and bools are
  not floating and still pass."""
  run = jax.jit if jit else (lambda f: f)
  for state in (jmp_lite.StaticLossScale(2.0),
                jmp_lite.DynamicLossScale(2.0**10)):
    tree = {"loss": 0.5, "i": 3, "b": True}
    scaled = run(state.scale)(tree)
    assert_dtype(scaled["loss"], jnp.float32)
    assert float(scaled["loss"]) == 0.5 * float(state.loss_scale)
    assert int(scaled["i"]) == 3 and bool(scaled["b"])   # Not scaled.
    assert float(run(state.unscale)(scaled)["loss"]) == 0.5


def _all_states():
  return [
      jmp_lite.NoOpLossScale(),
      jmp_lite.StaticLossScale(2.0**8),
      jmp_lite.DynamicLossScale(
          2.0**12, 3, 50, 4, 0.25, backoff_factor=0.5, max_loss_scale=2.0**20,
          hysteresis=3, nonfinite_counter=2),
  ]


def _assert_same_state(a, b):
  assert type(a) is type(b)
  for f in dataclasses.fields(a):
    x, y = getattr(a, f.name), getattr(b, f.name)
    if hasattr(x, "dtype"):
      assert_dtype(y, x.dtype)
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    else:
      assert x == y, f.name


@pytest.mark.parametrize("state", _all_states(),
                         ids=["noop", "static", "dynamic"])
def test_every_field_survives_round_trips(state, tmp_path):
  _assert_same_state(state, jax.tree.map(lambda x: x, state))
  _assert_same_state(state, jax.jit(lambda s: s)(state))
  _assert_same_state(state, copy.deepcopy(state))
  _assert_same_state(state, pickle.loads(pickle.dumps(state)))
  leaves, treedef = jax.tree.flatten(state)
  _assert_same_state(state, jax.tree.unflatten(treedef, leaves))
  # lower() and eval_shape() rebuild the state from placeholders.
  jax.jit(lambda s: s.adjust(jnp.array(True))).lower(state).compile()
  shapes = jax.eval_shape(lambda s: s.adjust(jnp.array(True)), state)
  assert jax.tree.structure(shapes) == treedef
  # A lax.scan carry.
  def body(s, finite):
    s = s.adjust(finite)
    return s, s.loss_scale
  final, _ = jax.lax.scan(body, state, jnp.array([True, False, True]))
  assert jax.tree.structure(final) == treedef
  # A real orbax checkpoint directory.
  import orbax.checkpoint as ocp
  path = tmp_path / "ckpt"
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, state)
    ckptr.wait_until_finished()
    restored = ckptr.restore(path, state)
  _assert_same_state(state, restored)


def test_jmp_bugs_fixed_min_loss_scale_kept_and_lower_works():
  state = jmp_lite.DynamicLossScale(8.0, min_loss_scale=0.5)
  leaves, treedef = jax.tree.flatten(state)
  again = jax.tree.unflatten(treedef, leaves)
  assert float(again.min_loss_scale) == 0.5
  state = jax.jit(lambda s: s.adjust(jnp.array(False)))(state)
  state = jax.jit(lambda s: s.adjust(jnp.array(False)))(state)
  state = jax.jit(lambda s: s.adjust(jnp.array(False)))(state)
  assert float(state.loss_scale) == 1.0
  state = jax.jit(lambda s: s.adjust(jnp.array(False)))(state)
  assert float(state.loss_scale) == 0.5


def test_moving_values_never_recompile():
  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(state, finite):
    return state.adjust(finite), state.scale(jnp.float32(1.0))

  state = jmp_lite.DynamicLossScale(2.0**15, period=2)
  rng = np.random.default_rng(0)
  scales = set()
  for _ in range(100):
    state, _ = step(state, jnp.array(rng.random() < 0.8))
    scales.add(float(state.loss_scale))
  assert len(scales) > 3
  # A freshly constructed state (numpy leaves) hits the same cache entry.
  step(jmp_lite.DynamicLossScale(123.0, period=2), jnp.array(True))


def test_construction_inside_jit_with_traced_scale():
  @jax.jit
  def f(x):
    return jmp_lite.DynamicLossScale(x, min_loss_scale=x / 4).adjust(F)
  out = f(jnp.float32(8.0))
  assert float(out.loss_scale) == 4.0


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(factor=1), ValueError, r"factor must be > 1, got 1"),
    (dict(factor=0.5), ValueError, r"factor must be > 1"),
    (dict(factor=jnp.float32(2)), TypeError, r"factor must be a Python number"),
    (dict(factor=float("inf")), ValueError, r"factor must be finite"),
    # Factors stored as float32 that are no-ops or not the number asked for:
    # 1.00000001 is 1.0 in float32 and never moved the scale.
    (dict(factor=1.00000001), ValueError,
     r"factor=1.00000001 is 1.0 in float32.*never moves the scale"),
    (dict(factor=1e39), ValueError, r"factor=1e\+39 is inf in float32"),
    (dict(backoff_factor=0.99999999), ValueError,
     r"backoff_factor=0.99999999 is 1.0 in float32.*never moves"),
    (dict(backoff_factor=1e-50), ValueError,
     r"backoff_factor=1e-50 is 0.0 in float32"),
    # Scales outside float32's normal range (or whose reciprocal is not
    # normal), which XLA flushes to zero.
    (dict(max_loss_scale=3e38), ValueError,
     r"max_loss_scale must be in \[2\*\*-126, 2\*\*126\].*got 3e\+38"),
    (dict(min_loss_scale=1e-40), ValueError,
     r"min_loss_scale must be in \[2\*\*-126, 2\*\*126\].*got 1e-40"),
    (dict(min_loss_scale=1e-50), ValueError,
     r"min_loss_scale must be positive and finite, got 1e-50 \(0.0 in"
     r" float32\)"),
    (dict(loss_scale=1e39, max_loss_scale=2.0 ** 126), ValueError,
     r"loss_scale must be positive and finite, got 1e\+39 \(inf in"
     r" float32\)"),
    (dict(backoff_factor=1.0), ValueError,
     r"backoff_factor must be in \(0, 1\)"),
    (dict(backoff_factor=0.0), ValueError,
     r"backoff_factor must be in \(0, 1\)"),
    (dict(backoff_factor=-0.5), ValueError, r"backoff_factor must be in"),
    (dict(period=0), ValueError, r"period must be >= 1, got 0"),
    (dict(period=2.5), TypeError, r"period must be a Python int"),
    (dict(hysteresis=0), ValueError, r"hysteresis must be >= 1"),
    (dict(min_loss_scale=4.0, max_loss_scale=2.0), ValueError,
     r"min_loss_scale \(4.0\) must not exceed max_loss_scale \(2.0\)"),
    (dict(loss_scale=-1.0), ValueError,
     r"loss_scale must be positive and finite, got -1.0"),
    (dict(loss_scale=0.0), ValueError, r"loss_scale must be positive"),
    (dict(loss_scale=float("nan")), ValueError,
     r"loss_scale must be positive and finite"),
    (dict(loss_scale=float("inf")), ValueError,
     r"loss_scale must be positive and finite"),
    (dict(loss_scale=jnp.ones(2)), ValueError,
     r"loss_scale must be a scalar, got shape \(2,\)"),
    (dict(loss_scale="big"), TypeError, r"loss_scale must be a scalar number"),
    (dict(loss_scale=True), TypeError,
     r"loss_scale must be a number, got bool"),
    (dict(min_loss_scale=0.0), ValueError, r"min_loss_scale must be positive"),
    (dict(max_loss_scale=float("inf")), ValueError,
     r"max_loss_scale must be positive and finite"),
    (dict(loss_scale=2.0**30), ValueError, r"above max_loss_scale"),
    (dict(loss_scale=0.5), ValueError, r"below min_loss_scale"),
    (dict(counter=5, period=5), ValueError,
     r"counter must be in \[0, period=5\)"),
    (dict(nonfinite_counter=1), ValueError, r"nonfinite_counter must be in"),
    # Counters are int32 counts: no truncation, no overflow.
    (dict(counter=2.5, period=3), TypeError,
     r"counter must be an integer, got float: 2.5"),
    (dict(counter=np.float32(1.0)), TypeError, r"counter must be an integer"),
    (dict(counter=jnp.float32(1.0)), TypeError,
     r"counter must be an integer, got .* of dtype float32"),
    (dict(counter=True), TypeError, r"counter must be an integer"),
    (dict(counter=2**40), ValueError,
     r"counter must be in \[0, period=2000\), got 1099511627776"),
    (dict(nonfinite_counter=0.5, hysteresis=2), TypeError,
     r"nonfinite_counter must be an integer"),
    (dict(period=2**40), ValueError,
     r"period must be at most 2\*\*31 - 1 = 2147483647 .* got 1099511627776"),
    (dict(hysteresis=2**31), ValueError, r"hysteresis must be at most"),
    (dict(loss_scale=1 + 2j), TypeError,
     r"loss_scale must be a real number, got complex: \(1\+2j\)"),
    (dict(loss_scale=np.complex64(4)), TypeError,
     r"loss_scale must be a real number"),
    (dict(min_loss_scale=np.array(1 + 0j)), TypeError,
     r"min_loss_scale must be a real number"),
    (dict(loss_scale=jnp.array(4 + 0j)), TypeError,
     r"loss_scale must be a real number, got an array of dtype complex64"),
    (dict(loss_scale=jnp.array(True)), TypeError,
     r"loss_scale must be a real number, got an array of dtype bool"),
    (dict(loss_scale=10**400), ValueError,
     r"loss_scale is out of range for float32"),
])
def test_dynamic_bad_configuration(kwargs, err, match):
  kwargs = {"loss_scale": 2.0**10, **kwargs}
  with pytest.raises(err, match=match):
    jmp_lite.DynamicLossScale(**kwargs)


@pytest.mark.parametrize("value,err", [
    (0.0, ValueError), (-2.0, ValueError), (float("nan"), ValueError),
    (float("inf"), ValueError), (np.ones(3), ValueError), (None, TypeError),
])
def test_static_bad_configuration(value, err):
  with pytest.raises(err, match="loss_scale"):
    jmp_lite.StaticLossScale(value)


@pytest.mark.parametrize("value,match", [
    (3e38, r"in \[2\*\*-126, 2\*\*126\].*got 3e\+38"),
    (1e-40, r"in \[2\*\*-126, 2\*\*126\].*got 1e-40"),
    (1e-50, r"positive and finite, got 1e-50 \(0.0 in float32\)"),
])
def test_static_scale_outside_float32s_normal_range_is_refused(value, match):
  """StaticLossScale(3e38) unscaled by 1/3e38, a subnormal XLA flushes:
  every gradient became 0 and the step was applied."""
  with pytest.raises(ValueError, match="loss_scale must be " + match):
    jmp_lite.StaticLossScale(value)
  edge = jmp_lite.StaticLossScale(2.0 ** 126)
  assert float(jax.jit(edge.unscale)(jnp.float32(2.0 ** 127))) == 2.0


def test_static_rejects_complex_naming_the_value():
  with pytest.raises(TypeError, match=r"loss_scale must be a real number, got"
                     r" complex: \(1\+2j\)"):
    jmp_lite.StaticLossScale(1 + 2j)


def test_counters_take_integers_of_any_kind_and_tracers():
  for counter in (3, np.int64(3), np.uint8(3), np.array(3), jnp.array(3),
                  jnp.array(3, jnp.int16)):
    state = jmp_lite.DynamicLossScale(2.0, counter=counter, period=5)
    assert int(state.counter) == 3
    assert_dtype(state.counter, jnp.int32)

  @jax.jit
  def build(counter):
    # A tracer's value is unknown: its dtype is checked, its range is not.
    return jmp_lite.DynamicLossScale(2.0, counter=counter, period=5).adjust(T)

  assert int(build(jnp.int32(3)).counter) == 4
  with pytest.raises(TypeError, match="counter must be an integer"):
    jax.jit(lambda c: jmp_lite.DynamicLossScale(2.0, counter=c))(
        jnp.float32(3.0))


@pytest.mark.parametrize("state", _all_states(),
                         ids=["noop", "static", "dynamic"])
def test_adjust_rejects_bad_predicates(state):
  with pytest.raises(ValueError, match=r"scalar bool, got shape \(2,\)"):
    state.adjust(jnp.array([True, False]))
  with pytest.raises(TypeError, match="grads_finite must be a scalar bool"):
    state.adjust(jnp.float32(1.0))


def test_states_are_immutable():
  state = jmp_lite.DynamicLossScale(8.0)
  with pytest.raises(dataclasses.FrozenInstanceError):
    state.loss_scale = 4.0
  new = state.adjust(F)
  assert float(state.loss_scale) == 8.0 and float(new.loss_scale) == 4.0
