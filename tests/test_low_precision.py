"""Tests for jmp_lite.low_precision: Kahan, stochastic rounding, dtypes."""

from __future__ import annotations

import base64
import pickle
import re
import warnings
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite
from tests.conftest import (
  as_xla_gpu_simplifies,
  assert_dtype,
  AUTO_KIND,
  run_multidevice,
)

HALF = [jnp.bfloat16, jnp.float16]
HALF_IDS = ["bf16", "f16"]


def _ulp(x, dtype):
  """The spacing of ``dtype`` at each value of ``x`` (float32)."""
  h = jnp.asarray(x).astype(dtype)
  up = jnp.nextafter(h, jnp.asarray(jnp.inf, dtype))
  return (up.astype(jnp.float32) - h.astype(jnp.float32))


def _run(opt, params, grads, steps, jit=True):
  def step(p, s):
    u, s = opt.update(grads, s, p)
    return optax.apply_updates(p, u), s
  step = jax.jit(step) if jit else step
  state = opt.init(params)
  for _ in range(steps):
    params, state = step(params, state)
  return params, state


def _tiny_problem(dtype, n=256):
  rng = np.random.default_rng(0)
  params = jnp.asarray(rng.uniform(0.5, 2.0, n), dtype)
  grads = jnp.asarray(rng.uniform(0.2, 1.0, n), dtype)
  return params, grads


# ------------------------------------------------------------- kahan


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_plain_half_never_moves_kahan_tracks_float32(dtype, variant):
  params, grads = _tiny_problem(dtype)
  lr, steps = 1e-4, 300          # Every update is far below half an ulp.
  ref = (params.astype(jnp.float32)
         - steps * lr * grads.astype(jnp.float32))
  plain, _ = _run(optax.sgd(lr), params, grads, steps)
  chex.assert_trees_all_equal(plain, params)        # Stuck.
  opt = jmp_lite.kahan_summation(optax.sgd(lr))
  step = variant(lambda p, s: (lambda us: (optax.apply_updates(p, us[0]),
                                           us[1]))(opt.update(grads, s, p)))
  p, state = params, opt.init(params)
  for _ in range(steps):
    p, state = step(p, state)
  assert_dtype(p, dtype)
  assert_dtype(state.compensation, dtype)
  ulp = _ulp(ref, dtype)
  err = np.abs(np.asarray(p.astype(jnp.float32) - ref) / ulp)
  assert err.max() <= 1.0, err.max()
  total = p.astype(jnp.float32) + state.residual()
  assert np.abs(np.asarray(total - ref) / ulp).max() <= 0.5
  # The plain run is off by several ulps on average.
  assert np.mean(np.asarray(plain.astype(jnp.float32) - ref) / ulp) > 3


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_kahan_still_compensates_where_xla_deletes_cast_round_trips(dtype):
  """XLA:GPU drops f32 -> half -> f32 casts; on an H100 a cast-pair Kahan
  left every param where it was (compensation 0). Evaluated the GPU's way."""
  params, grads = _tiny_problem(dtype, 64)
  lr, steps = 1e-4, 100
  ref = params.astype(jnp.float32) - steps * lr * grads.astype(jnp.float32)
  opt = jmp_lite.kahan_summation(optax.sgd(lr))
  step = as_xla_gpu_simplifies(
      lambda p, s: (lambda us: (optax.apply_updates(p, us[0]), us[1]))(
          opt.update(grads, s, p)))
  p, state = params, opt.init(params)
  for _ in range(steps):
    p, state = step(p, state)
  assert_dtype(p, dtype)
  err = np.abs(np.asarray(p.astype(jnp.float32) - ref) / _ulp(ref, dtype))
  assert err.max() <= 1.0, err.max()
  assert np.asarray(state.compensation).any()


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_kahan_updates_land_exactly_on_the_compensated_sum(dtype):
  rng = np.random.default_rng(3)
  params = jnp.asarray(rng.standard_normal(512), dtype)
  opt = jmp_lite.kahan_summation(optax.sgd(0.3))
  state = opt.init(params)
  for _ in range(5):   # Large, sign-changing updates: params cross zero.
    grads = jnp.asarray(rng.standard_normal(512), dtype)
    c = state.residual()
    sgd_u, _ = optax.sgd(0.3).update(grads, optax.sgd(0.3).init(params))
    s = params.astype(jnp.float32) + (sgd_u.astype(jnp.float32) + c)
    updates, state = opt.update(grads, state, params)
    assert_dtype(updates, jnp.float32)
    new = optax.apply_updates(params, updates)
    assert_dtype(new, dtype)
    np.testing.assert_array_equal(np.asarray(new), np.asarray(s.astype(dtype)))
    # float16 buffers hold the error times 2**11 (exact: a power of two).
    scale = 2.0**11 if dtype == jnp.float16 else 1.0
    np.testing.assert_array_equal(
        np.asarray(state.compensation),
        np.asarray(((s - new.astype(jnp.float32)) * scale).astype(dtype)))
    params = new


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("p0", [2e-4, 3e-3, 3e-2, 1.0, 3e4])
def test_kahan_carries_tenth_ulp_updates_at_every_magnitude(dtype, p0):
  """float16's compensation was subnormal for params below 2**-3: 100
  updates of 0.1 ulp moved a param of 2e-4 by 0 ulps and of 3e-3 by 9."""
  params = jnp.full((4,), p0, dtype)
  ulp = float(_ulp(params[0].astype(jnp.float32), dtype))
  grads = jnp.ones((4,), jnp.float32)   # float32 updates: none underflow.
  opt = jmp_lite.kahan_summation(optax.sgd(0.1 * ulp))
  p, state = _run(opt, params, grads, 100, jit=True)
  assert_dtype(p, dtype)
  moved = (params.astype(jnp.float32) - p.astype(jnp.float32)) / ulp
  np.testing.assert_allclose(np.asarray(moved), 10.0, atol=1.0)
  # What is carried makes up the rest of 10 ulps (less what rounding the
  # buffer each step loses: up to 2**-9 of it in bfloat16, 2**-12 float16).
  total = (params.astype(jnp.float32) - p.astype(jnp.float32)
           - state.residual()) / ulp
  np.testing.assert_allclose(np.asarray(total), 10.0, atol=0.2)


def test_kahan_residual_unscales_float16_buffers_only():
  params = {"h": jnp.ones(2, jnp.float16), "b": jnp.ones(2, jnp.bfloat16),
            "f": jnp.ones(2)}
  opt = jmp_lite.kahan_summation(optax.sgd(1e-4))
  _, state = opt.update(jax.tree.map(jnp.ones_like, params), opt.init(params),
                        params)
  residual = state.residual()
  assert residual["f"] is None
  for k in ("h", "b"):   # 1.0 - 1e-4 is not one half step away from 1.0.
    assert_dtype(residual[k], jnp.float32)
    np.testing.assert_allclose(np.asarray(residual[k]), -1e-4, rtol=1e-2)
  np.testing.assert_allclose(
      np.asarray(state.compensation["h"].astype(jnp.float32)),
      -1e-4 * 2.0**11, rtol=1e-2)


# A Kahan state restored under another dtype. Each float16 buffer holds its
# error times 2**11; read by a bfloat16 run as the error itself, it moved
# params by up to 124 bfloat16 ulps in one step (issue 29, item 2).

F16, BF16 = jnp.float16, jnp.bfloat16
_DTYPE_CHANGES = {   # leaf -> (dtype saved, dtype restored)
    "same": {"a": (F16, F16), "b": (BF16, BF16)},
    "swap": {"a": (F16, BF16), "b": (BF16, F16)},
    "to_bf16": {"a": (F16, BF16), "b": (BF16, BF16)},
    "to_f16": {"a": (F16, F16), "b": (BF16, F16)},
}


def _restore_problem(change: str) -> Any:
  rng = np.random.default_rng(7)
  dtypes = _DTYPE_CHANGES[change]
  values = {k: rng.uniform(0.5, 2.0, 64) for k in dtypes}
  saved = {k: jnp.asarray(values[k], d[0]) for k, d in dtypes.items()}
  saved["f"] = jnp.asarray(values["a"], jnp.float32)
  # float32 updates of 1/32 to 1/4 of a bfloat16 ulp at 1.0 (1/4 to 2
  # float16 ulps): a wrongly scaled residual would dwarf them.
  grads = [{k: jnp.asarray(rng.uniform(0.25, 2.0, 64), jnp.float32)
            for k in saved} for _ in range(8)]
  return saved, grads


def _cast_params(params: Any, change: str) -> Any:
  return {k: p.astype(_DTYPE_CHANGES[change][k][1]) if k in
          _DTYPE_CHANGES[change] else p for k, p in params.items()}


def _restore(how: str, saved: Any, target: Any, tmp_path: Any) -> Any:
  """``saved`` (params, state) brought back in ``target``'s dtypes."""
  import orbax.checkpoint as ocp
  if how == "orbax":
    with ocp.StandardCheckpointer() as ckptr:
      ckptr.save(tmp_path / "ckpt", saved)
      ckptr.wait_until_finished()
      return ckptr.restore(tmp_path / "ckpt", target)
  loaded = pickle.loads(pickle.dumps(jax.device_get(saved)))
  if how == "pickle_cast":   # What orbax does: each leaf to its target's.
    return jax.tree.map(lambda x, t: jnp.asarray(x, t.dtype), loaded, target)
  # "cast_every_float": every float leaf of a changed param's dtype is cast,
  # the float32 scales included (to the params' new dtype: exact, powers of
  # two).
  assert how == "cast_every_float"
  params, state = loaded
  new = {k: t.dtype for k, t in target[0].items()}
  cast = lambda tree: {k: None if x is None else jnp.asarray(x, new[k])
                       for k, x in tree.items()}
  return cast(params), jmp_lite.struct.replace(
      state, compensation=cast(state.compensation),
      compensation_scale=cast(state.compensation_scale))


@pytest.mark.parametrize("how", ["orbax", "pickle_cast", "cast_every_float"])
@pytest.mark.parametrize("change", list(_DTYPE_CHANGES))
def test_kahan_state_restored_under_another_dtype_continues_correctly(
    change, how, tmp_path):
  """A state knows what its buffers hold (compensation_scale, a value): a
  float16 run's state restored into bfloat16 params (and back) continues as
  a run in the new dtype from the same residual, which a state rebuilt from
  ``residual()`` by hand shows."""
  opt = jmp_lite.kahan_summation(optax.sgd(2.0**-12))
  params, grads = _restore_problem(change)

  @jax.jit
  def step(p: Any, s: Any, g: Any) -> Any:
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s

  def run(p: Any, s: Any, lo: int, hi: int) -> Any:
    for g in grads[lo:hi]:
      p, s = step(p, s, g)
    return p, s

  saved = run(params, opt.init(params), 0, 5)
  new_params = _cast_params(params, change)
  p, state = _restore(how, saved, (new_params, opt.init(new_params)),
                      tmp_path)
  chex.assert_trees_all_equal_dtypes(p, new_params)
  # residual() reads each buffer with the scale it was written with: the
  # saved residual, rounded to the new dtype.
  assert state.residual()["f"] is None
  for k in ("a", "b"):
    chex.assert_trees_all_equal(state.residual()[k], saved[1].residual()[
        k].astype(p[k].dtype).astype(jnp.float32))

  # By hand: the residual in float32, stored as the new dtype's run would.
  fresh: Any = opt.init(p)
  by_hand = jmp_lite.struct.replace(
      fresh, inner_state=state.inner_state,
      compensation=jax.tree.map(
          lambda c, r: (r * (2.0**11 if c.dtype == F16 else 1.0)
                        ).astype(c.dtype),
          fresh.compensation, saved[1].residual()))
  stepped, _ = step(p, state, grads[5])
  ulp = {k: _ulp(p[k].astype(jnp.float32), p[k].dtype) for k in ("a", "b")}
  for k in ("a", "b"):
    # The update plus the residual carried, rounded: never tens of ulps (a
    # bfloat16 run's residual is up to 4 float16 ulps).
    moved = jnp.abs(stepped[k].astype(jnp.float32) - p[k].astype(jnp.float32))
    bound = jnp.abs(-2.0**-12 * grads[5][k] + saved[1].residual()[k])
    assert float(jnp.max((moved - bound) / ulp[k])) <= 0.5, k

  got, want = run(p, state, 5, 8), run(p, by_hand, 5, 8)
  chex.assert_trees_all_equal(got[0], want[0])
  chex.assert_trees_all_equal(got[1].residual(), want[1].residual())
  chex.assert_trees_all_equal_dtypes(got[1], state)   # Dtypes kept.
  if change == "same":   # As if never saved.
    chex.assert_trees_all_equal(got[0], run(saved[0], saved[1], 5, 8)[0])
  # And p + residual follows float32 within one ulp of the new dtype.
  exact = {k: params[k].astype(jnp.float32)
           - 2.0**-12 * sum(g[k] for g in grads) for k in ("a", "b")}
  for k in ("a", "b"):
    carried = got[0][k].astype(jnp.float32) + got[1].residual()[k]
    assert float(jnp.max(jnp.abs(carried - exact[k]) / ulp[k])) <= 1.0


# pickle.dumps(jax.device_get(state), protocol=4) at commit 10db000, before
# KahanState had compensation_scale, of kahan_summation(optax.sgd(2**-14))
# after one step of ones on {"h": ones(2, float16), "f": ones(1)}: buffers
# of -2**-14 * 2**11 = -0.125.
_PICKLED_WITHOUT_SCALES = base64.b64decode("""
gASVEgEAAAAAAACMFmptcF9saXRlLmxvd19wcmVjaXNpb26UjApLYWhhblN0YXRllJOUKY
GUfZQojAxjb21wZW5zYXRpb26UfZQojAFmlE6MAWiUjBZudW1weS5fY29yZS5tdWx0aWFy
cmF5lIwMX3JlY29uc3RydWN0lJOUjAVudW1weZSMB25kYXJyYXmUk5RLAIWUQwFilIeUUp
QoSwFLAoWUaAyMBWR0eXBllJOUjAJmMpSJiIeUUpQoSwOMATyUTk5OSv////9K/////0sA
dJRiiUMEALAAsJR0lGJ1jAtpbm5lcl9zdGF0ZZSMD29wdGF4Ll9zcmMuYmFzZZSMCkVtcH
R5U3RhdGWUk5QpgZRoICmBlIaUdWIu""")


def test_kahan_state_pickled_before_compensation_scale_loads_and_converts():
  """An old pickle keeps its buffers' dtypes, so loading it fills in the
  scales they were written with; cast to bfloat16 afterwards, it still
  continues correctly."""
  opt = jmp_lite.kahan_summation(optax.sgd(2.0**-14))
  params = {"h": jnp.ones(2, F16), "f": jnp.ones(1)}
  grads = jax.tree.map(jnp.ones_like, params)
  old: Any = pickle.loads(_PICKLED_WITHOUT_SCALES)
  assert old.compensation["h"].dtype == F16
  assert float(old.compensation_scale["h"]) == 2.0**11
  assert old.compensation_scale["f"] is None
  _, new = opt.update(grads, opt.init(params), params)
  chex.assert_trees_all_equal(old, jax.device_get(new))
  chex.assert_trees_all_equal(opt.update(grads, old, params),
                              opt.update(grads, new, params))
  # Cast by hand to bfloat16 after loading: read as 2**-14, not 2**-3.
  bf = jmp_lite.struct.replace(
      old, compensation={"h": old.compensation["h"].astype(BF16), "f": None})
  np.testing.assert_array_equal(np.asarray(bf.residual()["h"]), -(2.0**-14))
  p = {"h": jnp.ones(2, BF16), "f": jnp.ones(1)}
  stepped: Any = opt.update(grads, bf, p)
  u, bf = stepped
  np.testing.assert_array_equal(np.asarray(u["h"]), 0.0)   # 2 * 2**-14 < ulp/2
  np.testing.assert_array_equal(np.asarray(bf.residual()["h"]), -(2.0**-13))
  assert float(bf.compensation_scale["h"]) == 1.0


@pytest.mark.parametrize("guard", ["none", "outside"])
def test_kahan_state_without_scales_runs_as_its_dtypes_say(guard):
  """A state whose compensation_scale is None (an orbax checkpoint saved
  before the field, restored into such a target; one built by hand) reads
  each buffer with its dtype's scale, keeps its structure (a guard outside
  keeps the old state on a skip, so it must), and takes init's scales to
  become a state that knows them."""
  kahan = jmp_lite.kahan_summation(optax.sgd(1e-3))
  opt = (kahan if guard == "none" else
         jmp_lite.loss_scaled(kahan, jmp_lite.NoOpLossScale()))
  params = {"h": jnp.full(8, 0.75, F16), "b": jnp.full(8, 0.75, BF16),
            "f": jnp.ones(8)}
  grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.3, jnp.float32), params)

  @jax.jit
  def step(p: Any, s: Any) -> Any:
    u, s = opt.update(grads, s, p)
    return optax.apply_updates(p, u), s

  def kahan_state(s: Any) -> Any:
    return s if guard == "none" else s.inner_state

  def without_scales(s: Any) -> Any:
    k = jmp_lite.struct.replace(kahan_state(s), compensation_scale=None)
    return k if guard == "none" else jmp_lite.struct.replace(
        s, inner_state=k)

  p_new, s_new = step(*step(params, opt.init(params)))
  p_old, s_old = step(*step(params, without_scales(opt.init(params))))
  assert kahan_state(s_old).compensation_scale is None
  chex.assert_trees_all_equal(p_old, p_new)
  chex.assert_trees_all_equal(without_scales(s_old), without_scales(s_new))
  chex.assert_trees_all_equal(kahan_state(s_old).residual(),
                              kahan_state(s_new).residual())
  upgraded = jmp_lite.struct.replace(
      kahan_state(s_old),
      compensation_scale=kahan.init(params).compensation_scale)
  chex.assert_trees_all_equal(upgraded, kahan_state(s_new))


def test_float32_leaves_pass_through_without_buffer():
  params = {"w": jnp.ones(3), "h": jnp.ones(3, jnp.bfloat16),
            "d": jnp.ones(2, jnp.float64) if jax.config.x64_enabled
            else jnp.ones(2), "i": jnp.arange(3)}
  inner = optax.multi_transform(
      {"f": optax.sgd(0.1), "z": optax.set_to_zero()},
      {"w": "f", "h": "f", "d": "f", "i": "z"})
  grads = {"w": jnp.full(3, 0.7), "h": jnp.full(3, 0.7, jnp.bfloat16),
           "d": jnp.full(2, 0.7), "i": jnp.zeros(3, jnp.int32)}
  for opt in (jmp_lite.kahan_summation(inner),
              jmp_lite.stochastic_rounding(inner)):
    state = opt.init(params)
    updates, _ = opt.update(grads, state, params)
    want, _ = inner.update(grads, inner.init(params), params)
    chex.assert_trees_all_equal(updates["w"], want["w"])
    chex.assert_trees_all_equal(updates["d"], want["d"])
    chex.assert_trees_all_equal(updates["i"], want["i"])
    assert_dtype(updates["h"], jnp.float32)
  state = jmp_lite.kahan_summation(inner).init(params)
  assert state.compensation["w"] is None and state.compensation["i"] is None
  assert_dtype(state.compensation["h"], jnp.bfloat16)


FP8 = [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float8_e4m3fnuz,
       jnp.float8_e5m2fnuz]


def _fp8_ulp(x, dtype):
  """Spacing of an FP8 ``dtype`` at ``x``, upwards (toward its max, not inf:
  e4m3fn has none)."""
  h = jnp.asarray(x).astype(dtype)
  up = jnp.nextafter(h, jnp.asarray(jnp.finfo(dtype).max, dtype))
  return np.asarray(up.astype(jnp.float32) - h.astype(jnp.float32))


@pytest.mark.parametrize("dtype", FP8, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("wrapper", ["master", "kahan", "stochastic"])
def test_fp8_params_keep_their_dtype_and_track_float32(dtype, wrapper):
  """FP8 params (JAX refuses to promote them implicitly) train through all
  three: params stay FP8, updates are FP8 (optax.apply_updates cannot add a
  float32 update to them), and the tiny updates are not lost."""
  rng = np.random.default_rng(0)
  params = jnp.asarray(rng.uniform(0.5, 2.0, 256), dtype)
  grads = jnp.asarray(rng.uniform(0.2, 1.0, 256), jnp.float32)
  lr, steps = 1e-3, 200     # Each update is about 1/200 of an FP8 ulp.
  ref = params.astype(jnp.float32) - steps * lr * grads
  plain, _ = _run(optax.sgd(lr), params, grads.astype(dtype), steps)
  chex.assert_trees_all_equal(plain, params)        # Stuck.
  opt = {"master": jmp_lite.master_weights,
         "kahan": jmp_lite.kahan_summation,
         "stochastic": jmp_lite.stochastic_rounding}[wrapper](optax.sgd(lr))
  updates, _ = opt.update(grads, opt.init(params), params)
  assert_dtype(updates, dtype)
  p, state = _run(opt, params, grads, steps)
  assert_dtype(p, dtype)
  ulp = _fp8_ulp(ref, dtype)
  if wrapper == "master":
    chex.assert_trees_all_equal(p, state.master.astype(dtype))
    held = state.master
  elif wrapper == "kahan":
    assert_dtype(state.compensation, jnp.bfloat16)
    held = p.astype(jnp.float32) + state.compensation.astype(jnp.float32)
  else:
    held = p.astype(jnp.float32)
  err = np.asarray(held - ref) / ulp
  if wrapper == "stochastic":   # Unbiased: about 1 ulp each, 0 on average.
    assert abs(err.mean()) <= 0.3, err.mean()
  else:   # Kahan: bfloat16 rounds the carried residual by up to 2**-9 of
    # it per step, about 0.1 ulp here; the stuck plain run is 1.6 off.
    assert np.abs(err).max() <= (0.05 if wrapper == "master" else 0.25)


@pytest.mark.parametrize("wrapper", ["master", "kahan", "stochastic"])
def test_fp8_leaps_beyond_the_format_stay_finite(wrapper):
  """A difference over float8_e4m3fn's 448 cast to NaN (no infinity): the
  FP8 update is clipped to the finite range, and the param lands finite."""
  dtype = jnp.float8_e4m3fn
  params = jnp.asarray([-240.0, 448.0, 1.0, 0.0], dtype)
  grads = jnp.asarray([-480.0, 896.0, 0.0, 0.0])
  opt = {"master": jmp_lite.master_weights,
         "kahan": jmp_lite.kahan_summation,
         "stochastic": jmp_lite.stochastic_rounding}[wrapper](optax.sgd(1.0))
  updates, _ = opt.update(grads, opt.init(params), params)
  new = np.asarray(optax.apply_updates(params, updates), np.float32)
  assert np.isfinite(new).all(), new
  np.testing.assert_array_equal(new[2:], [1.0, 0.0])
  # Toward -> 240 and -> -448; clipped to 448, the second stops at 0.
  np.testing.assert_array_equal(new[:2], [208.0, 0.0])


@pytest.mark.parametrize("wrapper", ["master", "kahan", "stochastic"])
def test_fp8_params_skip_bit_identically(wrapper):
  dtype = jnp.float8_e4m3fn
  opt = {"master": jmp_lite.master_weights,
         "kahan": jmp_lite.kahan_summation,
         "stochastic": jmp_lite.stochastic_rounding}[wrapper](
             jmp_lite.state_dtypes(jmp_lite.skip_nonfinite(optax.adam(1e-2)),
                                   "bf16"))
  params = {"w": jnp.linspace(-2.0, 2.0, 64).astype(dtype)}
  step = jax.jit(lambda p, s, g: jmp_lite.update_and_apply(opt, g, s, p))
  state = opt.init(params)
  for i in range(3):
    params, state = step(params, state, {"w": jnp.full(64, 0.1 * (i + 1))})
  bad = {"w": jnp.full(64, 0.1).at[7].set(jnp.nan)}
  skipped_p, skipped_s = step(params, state, bad)
  chex.assert_trees_all_equal(skipped_p, params)
  chex.assert_trees_all_equal(_ours(skipped_s), _ours(state))


@pytest.mark.parametrize("make", [jmp_lite.kahan_summation,
                                  jmp_lite.stochastic_rounding],
                         ids=["kahan", "stochastic"])
def test_update_without_params_raises(make):
  opt = make(optax.sgd(0.1))
  state = opt.init(jnp.ones(2, jnp.bfloat16))
  with pytest.raises(ValueError, match="needs the current params"):
    opt.update(jnp.ones(2, jnp.bfloat16), state)


def test_bad_arguments_raise_clear_errors():
  for make in (jmp_lite.kahan_summation, jmp_lite.stochastic_rounding):
    with pytest.raises(TypeError, match="optax.GradientTransformation"):
      make(optax.sgd)  # The factory, not a transformation.
  with pytest.raises(TypeError, match="seed must be an int"):
    jmp_lite.stochastic_rounding(optax.sgd(0.1), seed=True)
  with pytest.raises(ValueError, match=re.escape("seed must be in [0, 2**32)")):
    jmp_lite.stochastic_rounding(optax.sgd(0.1), seed=-1)
  with pytest.raises(ValueError, match="rounding must be one of"):
    jmp_lite.state_dtypes(optax.adam(0.1), "bf16", rounding="up")
  with pytest.raises(ValueError, match="Unknown dtype 'bf17'"):
    jmp_lite.state_dtypes(optax.adam(0.1), "bf17")
  with pytest.raises(TypeError, match="dtypes must be a floating dtype"):
    jmp_lite.state_dtypes(optax.adam(0.1), jnp.int32)
  with pytest.raises(ValueError, match="bad pattern '\\(mu'"):
    jmp_lite.state_dtypes(optax.adam(0.1), {"(mu": "bf16"})
  with pytest.raises(TypeError, match="pattern keys must be str"):
    jmp_lite.state_dtypes(optax.adam(0.1), {1: "bf16"})
  with pytest.raises(ValueError, match="mapping is empty"):
    jmp_lite.state_dtypes(optax.adam(0.1), {})
  # np.dtype(None) is float64: None must not pass for a dtype.
  with pytest.raises(TypeError, match="dtypes must be a floating dtype.*got"
                     " None"):
    jmp_lite.state_dtypes(optax.adam(0.1), None)
  with pytest.raises(TypeError, match=r"dtypes\['mu'\] must be a floating"):
    jmp_lite.state_dtypes(optax.adam(0.1), {"mu": None})
  with pytest.raises(TypeError, match="strict must be a bool.*'no'"):
    jmp_lite.state_dtypes(optax.adam(0.1), "bf16", strict="no")
  with pytest.raises(TypeError, match="state_dtypes expects an"
                     r" optax.GradientTransformation .* got str: 'adam'"):
    jmp_lite.state_dtypes("adam", "bf16")


# ------------------------------------------------------- stochastic rounding


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_stochastic_rounding_is_unbiased_over_seeds(dtype):
  params, grads = _tiny_problem(dtype, 128)
  lr, steps, seeds = 1e-4, 100, 32
  ref = params.astype(jnp.float32) - steps * lr * grads.astype(jnp.float32)
  opt = jmp_lite.stochastic_rounding(optax.sgd(lr))

  @jax.jit
  def run(seed):
    state = jmp_lite.struct.replace(opt.init(params),
                                    seed=seed.astype(jnp.uint32))

    def body(carry, _):
      p, s = carry
      u, s = opt.update(grads, s, p)
      return (optax.apply_updates(p, u), s), None

    (p, _), _ = jax.lax.scan(body, (params, state), None, length=steps)
    return p

  finals = jax.vmap(run)(jnp.arange(seeds))
  assert_dtype(finals, dtype)
  err = np.asarray((finals.astype(jnp.float32) - ref) / _ulp(ref, dtype))
  # Each run wanders by a few ulps; their mean sits on the exact sum.
  assert np.abs(err).max() > 1
  assert abs(err.mean()) < 0.1, err.mean()
  # Per element, the mean over seeds is within 4.5 standard errors of it.
  z = err.mean(axis=0) / (err.std(axis=0, ddof=1) / np.sqrt(seeds))
  assert np.abs(z).max() < 4.5, np.abs(z).max()


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_stochastic_rounding_still_random_where_xla_deletes_cast_round_trips(
    dtype):
  """With f32 -> half -> f32 casts deleted (XLA:GPU), a cast-pair rounding
  saw no rounding error and always rounded to nearest: biased."""
  n, fraction = 4096, 0.25
  params = jnp.full(n, 1.5, dtype)
  ulp = _ulp(params.astype(jnp.float32), dtype)
  grads = -fraction * ulp   # SGD(1): an update of a quarter ulp up.
  opt = jmp_lite.stochastic_rounding(optax.sgd(1.0), seed=3)
  new, _ = as_xla_gpu_simplifies(
      lambda p, s: (lambda us: (optax.apply_updates(p, us[0]), us[1]))(
          opt.update(grads, s, p)))(params, opt.init(params))
  assert_dtype(new, dtype)
  up = float(np.mean(np.asarray(new) != np.asarray(params)))
  assert abs(up - fraction) < 4.5 * np.sqrt(fraction * (1 - fraction) / n), up


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("fraction", [0.25, 0.7])
def test_stochastic_rounding_rounds_up_with_the_dropped_fraction(dtype,
                                                                 fraction):
  n = 8192
  # Normal values of both signs, and float16 subnormals (spacing 2**-24).
  base = jnp.concatenate([jnp.full(n // 4, 1.5), jnp.full(n // 4, -0.75),
                          jnp.full(n // 2, 0.0 if dtype == jnp.float16
                                   else 3.0)]).astype(dtype)
  ulp = _ulp(jnp.abs(base.astype(jnp.float32)), dtype)
  grads = -fraction * ulp * jnp.sign(base.astype(jnp.float32) + 1e-30)
  opt = jmp_lite.stochastic_rounding(optax.identity(), seed=7)
  updates, _ = opt.update(grads, opt.init(base), base)
  new = optax.apply_updates(base, updates).astype(jnp.float32)
  moved = np.asarray(new != base.astype(jnp.float32))
  # Away from zero by exactly one ulp, or not at all.
  np.testing.assert_allclose(
      np.asarray(jnp.abs(new - base.astype(jnp.float32)))[moved],
      np.asarray(ulp)[moved], rtol=0)
  for part in np.split(moved, [n // 4, n // 2]):
    assert abs(part.mean() - fraction) < 0.04, (part.mean(), fraction)


def test_fixed_seed_reproducible_and_bits_differ_across_seeds_leaves_steps():
  n = 2048
  params = {"a": jnp.ones(n, jnp.bfloat16), "b": jnp.ones(n, jnp.bfloat16)}
  grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)

  def moved(seed, steps):
    opt = jmp_lite.stochastic_rounding(optax.sgd(1.0), seed=seed)
    p, _ = _run(opt, params, grads, steps)
    return jax.tree.map(lambda x: np.asarray(x != 1.0), p)

  first, again = moved(3, 1), moved(3, 1)
  chex.assert_trees_all_equal(first, again)
  assert 0.1 < first["a"].mean() < 0.4    # 1e-3 is ~1/4 of an ulp below 1.
  assert (first["a"] != first["b"]).mean() > 0.2      # Leaves differ.
  assert (first["a"] != moved(4, 1)["a"]).mean() > 0.2  # Seeds differ.
  # Steps differ: two steps do not move the same elements twice.
  assert moved(3, 2)["a"].mean() > first["a"].mean()


def test_bits_are_uniform():
  from jmp_lite.low_precision import _rounding
  bits = np.asarray(_rounding.random_bits(
      _rounding.step_key(jnp.uint32(0), jnp.uint32(5)), 2, (64, 256)))
  # The 16 low and 16 high bits, each in 16 buckets: a chi-square test.
  for chunk in (bits >> 16, bits & 0xFFFF):
    counts = np.bincount((chunk >> 12).ravel(), minlength=16)
    expected = bits.size / 16
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 40, chi2     # 15 dof: p < 1e-3 above ~37.7.
  assert len(np.unique(bits)) > 0.99 * bits.size


def test_code_noise_is_uniform_and_independent():
  """The quantized states' code noise (one hash per element: mu's codes
  take its high 16 bits, nu's the low): each half uniform, and each pair a
  step relies on independent (the two halves, neighbouring elements, two
  steps, two params' streams): chi-square tests on 16 x 16 buckets of the
  top and of the bottom 4 bits."""
  from jmp_lite.low_precision import _rounding

  def halves(count: int, stream: int = 3) -> list[np.ndarray]:
    key = _rounding.step_key(jnp.uint32(0), jnp.uint32(count))
    bits = _rounding.stream_bits(key, stream, (256, 512))
    return [np.asarray(_rounding.half_noise(bits, h)).astype(np.int64).ravel()
            for h in (0, 1)]

  (hi, lo), (next_hi, _), (other_hi, _) = halves(5), halves(6), halves(5, 4)
  assert hi.max() < 2**16 and lo.max() < 2**16
  # 255 degrees of freedom: p < 1e-4 above about 345.
  limit = 345

  def chi2(cells: np.ndarray) -> float:
    counts = np.bincount(cells, minlength=256)
    expected = cells.size / 256
    return float(((counts - expected) ** 2 / expected).sum())

  for half in (hi, lo):
    assert chi2(half >> 8) < limit
  pairs = {"halves": (hi, lo), "neighbours": (hi[:-1], hi[1:]),
           "low neighbours": (lo[:-1], lo[1:]), "steps": (hi, next_hi),
           "streams": (hi, other_hi)}
  for name, (a, b) in pairs.items():
    for bucket in (lambda x: x >> 12, lambda x: x & 15):
      assert chi2(bucket(a) * 16 + bucket(b)) < limit, name


def test_code_noise_streams_are_not_shifted_copies():
  """Two params' streams draw unrelated bits whatever their keys: an added
  key would make keys that differ by a multiple of the golden ratio draw
  the same bits, shifted by that multiple."""
  from jmp_lite.low_precision import _rounding
  index = jnp.arange(2**17, dtype=jnp.uint32)
  key, golden = 0x1234567, 0x9E3779B9
  base = set(np.asarray(_rounding.pair_bits(jnp.uint32(key), index)).tolist())
  for other in (key + golden, key + 3 * golden, key ^ golden, key + 1):
    bits = np.asarray(_rounding.pair_bits(jnp.uint32(other % 2**32),
                                          index)).tolist()
    # Independent 32-bit values: about 2**34 / 2**32 = 4 coincide.
    assert len(base.intersection(bits)) < 40, hex(int(other))


# -------------------------------------------------------------- state_dtypes


def test_state_dtypes_one_dtype_stores_arrays_not_scalars():
  params = {"w": jnp.ones((3, 2), jnp.bfloat16), "b": jnp.ones(2)}
  opt = jmp_lite.state_dtypes(
      optax.inject_hyperparams(optax.adam)(learning_rate=1e-3), "bf16")
  state = opt.init(params)
  adam = state.inner_state.inner_state[0]
  for tree in (adam.mu, adam.nu):
    assert_dtype(tree["w"], jnp.bfloat16)
    assert_dtype(tree["b"], jnp.bfloat16)
  assert_dtype(adam.count, jnp.int32)
  assert_dtype(state.inner_state.hyperparams["learning_rate"], jnp.float32)
  assert state.seed is None and state.count is None
  grads = {"w": jnp.ones((3, 2), jnp.bfloat16), "b": jnp.ones(2)}
  updates, new = jax.jit(opt.update)(grads, state, params)
  assert_dtype(updates["w"], jnp.float32)  # Computed in float32.
  chex.assert_trees_all_equal_dtypes(new, state)


def test_state_dtypes_mapping_fullmatch_unmatched_stay_and_strict():
  params = {"w": jnp.ones(4, jnp.bfloat16)}
  with pytest.warns(jmp_lite.PrecisionWarning):  # float16 storage.
    opt = jmp_lite.state_dtypes(optax.adam(1e-3), {".*/mu/.*": "bf16",
                                                   "0/nu/w": "f16"})
  adam = opt.init(params).inner_state[0]
  assert_dtype(adam.mu["w"], jnp.bfloat16)
  assert_dtype(adam.nu["w"], jnp.float16)
  # fullmatch: "mu" alone matches no path; unmatched leaves stay float32
  # (inner computes on float32 params).
  loose = jmp_lite.state_dtypes(optax.adam(1e-3), {"mu": "bf16"})
  adam = loose.init(params).inner_state[0]
  assert_dtype(adam.mu["w"], jnp.float32)
  assert_dtype(adam.nu["w"], jnp.float32)
  strict = jmp_lite.state_dtypes(optax.adam(1e-3), {"mu": "bf16"},
                                 strict=True)
  with pytest.raises(ValueError,
                     match=r"pattern\(s\) \['mu'\] matched no floating state"
                     r" leaf; the floating leaves are \['0/mu/w', '0/nu/w'\]"):
    strict.init(params)


def test_state_dtypes_warns_for_float16_storage():
  with pytest.warns(jmp_lite.PrecisionWarning, match="'bf16'"):
    jmp_lite.state_dtypes(optax.adam(1e-3), "f16")
  with pytest.warns(jmp_lite.PrecisionWarning, match="second moments"):
    jmp_lite.state_dtypes(optax.adam(1e-3), {".*/mu/.*": "bf16",
                                             ".*/nu/.*": jnp.float16})
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jmp_lite.state_dtypes(optax.adam(1e-3), "bf16")
    jmp_lite.state_dtypes(optax.adam(1e-3), {".*/mu/.*": "bf16"})


def test_state_dtypes_computes_in_float32():
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.standard_normal(64), jnp.bfloat16)}
  opt = jmp_lite.state_dtypes(optax.adam(1e-2), "bf16")
  ref = optax.adam(1e-2)
  state = opt.init(params)
  for _ in range(3):
    grads = {"w": jnp.asarray(rng.standard_normal(64), jnp.bfloat16)}
    f32_state = jax.tree.map(
        lambda x: x.astype(jnp.float32)
        if x.dtype == jnp.bfloat16 else x, state.inner_state)
    want, want_state = ref.update(jmp_lite.cast_to_full(grads), f32_state,
                                  jmp_lite.cast_to_full(params))
    updates, state = opt.update(grads, state, params)
    chex.assert_trees_all_equal(updates, want)
    chex.assert_trees_all_equal(
        state.inner_state,
        jax.tree.map(lambda x: x.astype(jnp.bfloat16)
                     if x.dtype == jnp.float32 else x, want_state))


def test_stochastic_state_rounding_follows_adam_second_moment():
  # g = 1 each step: nu = 1 - 0.999**t. Nearest-rounded bfloat16 stalls once
  # the 0.1% increment is below half an ulp; stochastic rounding does not.
  params = jnp.zeros(512, jnp.bfloat16)
  grads = jnp.ones(512, jnp.bfloat16)
  steps = 1000
  want = 1 - 0.999**steps
  results = {}
  for rounding in ("nearest", "stochastic"):
    opt = jmp_lite.state_dtypes(optax.scale_by_adam(), "bf16",
                                rounding=rounding, seed=1)
    _, state = _run(opt, params, grads, steps)
    nu = state.inner_state.nu
    assert_dtype(nu, jnp.bfloat16)
    results[rounding] = float(nu.astype(jnp.float32).mean())
  assert results["nearest"] < 0.8 * want, results
  assert abs(results["stochastic"] - want) < 0.02 * want, results


@pytest.mark.parametrize("mode", ["jit", "xla_gpu"])
def test_stochastic_state_rounding_to_float8_is_unbiased(mode):
  """FP8 state too, also where XLA deletes cast round trips (XLA:GPU)."""
  n, g = 4096, 0.3   # 0.3 lies between the E4M3 values 0.28125 and 0.3125.
  params = jnp.zeros(n, jnp.bfloat16)
  with pytest.warns(jmp_lite.PrecisionWarning, match="quantized_states"):
    opt = jmp_lite.state_dtypes(optax.trace(decay=0.0), jnp.float8_e4m3fn,
                                rounding="stochastic", seed=4)
  step = lambda p, s: opt.update(jnp.full(n, g, jnp.bfloat16), s, p)[1]
  step = jax.jit(step) if mode == "jit" else as_xla_gpu_simplifies(step)
  stored = step(params, opt.init(params)).inner_state.trace
  assert_dtype(stored, jnp.float8_e4m3fn)
  values = np.asarray(stored, np.float32)
  assert set(np.unique(values)) == {0.28125, 0.3125}
  g_bf16 = float(jnp.bfloat16(g))   # What the state is handed.
  assert abs(values.mean() - g_bf16) < 4.5 * 0.016 / np.sqrt(n)


# ----------------------------------------------------- composition and skips

NOOP = jmp_lite.NoOpLossScale()


def _compositions():
  adam = optax.adam(1e-2)
  ls = lambda inner: jmp_lite.loss_scaled(inner, NOOP, allow_half_state=True)
  sn = jmp_lite.skip_nonfinite
  kahan, sr = jmp_lite.kahan_summation, jmp_lite.stochastic_rounding
  sd = lambda inner: jmp_lite.state_dtypes(inner, "bf16",
                                           rounding="stochastic", seed=9)
  return {
      # Guard outside: it keeps our state.
      "loss_scaled(kahan(state_dtypes))": ls(kahan(sd(adam))),
      "skip_nonfinite(sr(state_dtypes))": sn(sr(sd(adam), seed=5)),
      # Guard inside: its -0.0 updates and its state tell us.
      "kahan(state_dtypes(loss_scaled))": kahan(sd(jmp_lite.loss_scaled(
          adam, NOOP))),
      "sr(state_dtypes(skip_nonfinite))": sr(sd(sn(adam)), seed=5),
      "sr(accumulate(loss_scaled))": sr(jmp_lite.accumulate_gradients(
          jmp_lite.loss_scaled(adam, NOOP, allow_half_state=True), 2)),
  }


def _params():
  rng = np.random.default_rng(1)
  return {"w": jnp.asarray(rng.standard_normal((8, 4)) * 0.3, jnp.bfloat16),
          "b": jnp.asarray([-0.0, 0.0, 1.0, -1.0], jnp.bfloat16)}


def _grads(i, bad=False):
  rng = np.random.default_rng(100 + i)
  g = {"w": jnp.asarray(rng.standard_normal((8, 4)) * 1e-2, jnp.bfloat16),
       "b": jnp.asarray(rng.standard_normal(4) * 1e-3, jnp.bfloat16)}
  if bad:
    g["w"] = g["w"].at[1, 2].set(jnp.inf)
  return g


_GUARDS = (jmp_lite.LossScaledState, jmp_lite.transforms.SkipNonfiniteState,
           jmp_lite.accumulation.AccumulateState)


def _ours(state):
  """Our states (buffers, seeds, counters, stored moments), guards removed.

  A guard's own counters (skips, loss scale, micro-steps) move on a skipped
  step by design; everything else must not.
  """
  while jmp_lite.struct.find_nodes(state, _GUARDS):
    state = jax.tree.map(
        lambda n: n.inner_state if isinstance(n, _GUARDS) else n, state,
        is_leaf=lambda n: isinstance(n, _GUARDS))
  lp = jmp_lite.low_precision
  kinds = (lp.KahanState, lp.StochasticRoundingState, lp.StateDtypesState)
  return [n for k in kinds for n in jmp_lite.struct.find_nodes(state, k)]


@pytest.mark.parametrize("name", list(_compositions()))
def test_skipped_step_is_bit_identical_and_stream_continues(name):
  opt = _compositions()[name]
  chex.clear_trace_counter()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(params, state, grads):
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params = _params()
  state = opt.init(params)
  for i in range(4):
    params, state = step(params, state, _grads(i))
  before = (params, state)
  skipped = step(params, state, _grads(99, bad=True))
  chex.assert_trees_all_equal(skipped[0], params)
  # Sign bits too (-0.0 stays -0.0).
  assert np.signbit(np.asarray(skipped[0]["b"], np.float32)).tolist() == \
      np.signbit(np.asarray(params["b"], np.float32)).tolist()
  chex.assert_trees_all_equal(_ours(skipped[1]), _ours(state))
  if "accumulate" in name:
    # Counts optimizer steps (2 windows of 2), not micro-batches. A bad
    # micro-batch shifts the windows, so the runs below would differ.
    assert int(state.count) == 2
    return
  # The run with the skip continues exactly like the run without it.
  p_skip, s_skip = skipped
  p_none, s_none = before
  for i in range(4, 8):
    p_skip, s_skip = step(p_skip, s_skip, _grads(i))
    p_none, s_none = step(p_none, s_none, _grads(i))
  chex.assert_trees_all_equal(p_skip, p_none)
  chex.assert_trees_all_equal(_ours(s_skip), _ours(s_none))
  assert not jax.tree.all(jax.tree.map(
      lambda a, b: bool((a == b).all()), p_none, before[0]))


@pytest.mark.parametrize("name", [
    "kahan(state_dtypes(loss_scaled))", "sr(state_dtypes(skip_nonfinite))"])
def test_update_and_apply_decides_up_front_and_skips_bit_identically(name):
  opt = _compositions()[name]
  params = _params()
  state = opt.init(params)
  # Our wrappers hand the guard the gradients as they are, so the step
  # compiles as the bare guard's would (one lax.cond on the CPU).
  assert jmp_lite.step.formulation(opt)[0] == AUTO_KIND
  step = jax.jit(lambda p, s, g: jmp_lite.update_and_apply(opt, g, s, p))
  plain = jax.jit(lambda p, s, g: (lambda us: (optax.apply_updates(
      p, us[0]), us[1]))(opt.update(g, s, p)))
  p_a, s_a = params, state
  p_b, s_b = params, state
  for i in range(3):
    p_a, s_a = step(p_a, s_a, _grads(i))
    p_b, s_b = plain(p_b, s_b, _grads(i))
  chex.assert_trees_all_equal((p_a, _ours(s_a)), (p_b, _ours(s_b)))
  skipped = step(p_a, s_a, _grads(99, bad=True))
  chex.assert_trees_all_equal(skipped[0], p_a)
  chex.assert_trees_all_equal(_ours(skipped[1]), _ours(s_a))
  assert int(jmp_lite.struct.find_nodes(
      skipped[1],
      (jmp_lite.LossScaledState, jmp_lite.transforms.SkipNonfiniteState)
  )[0].total_skips) == 1


def _two_partitions(make_inner):
  """``make_inner`` around a multi_transform with a guard per partition."""
  guard = lambda: jmp_lite.skip_nonfinite(optax.sgd(1.0))
  return make_inner(optax.multi_transform({"a": guard(), "b": guard()},
                                          {"a": "a", "b": "b"}))


def _counter(state):
  kinds = (jmp_lite.low_precision.StochasticRoundingState,
           jmp_lite.low_precision.StateDtypesState)
  return int(jmp_lite.struct.find_nodes(state, kinds)[0].count)


@pytest.mark.parametrize("use_update_and_apply", [False, True])
def test_stochastic_rounding_counter_advances_when_one_partition_applies(
    use_update_and_apply):
  """One partition's guard skips, the other's applies: the applied partition
  must draw fresh bits next step. Were the counter to stand still, it would
  round the same elements the same way again (correlated, biased)."""
  opt = _two_partitions(lambda inner: jmp_lite.stochastic_rounding(
      inner, seed=0))
  params = {"a": jnp.ones(64, jnp.bfloat16), "b": jnp.ones(64, jnp.bfloat16)}
  state = opt.init(params)
  # Half an ulp of 1.0 in bfloat16: each element rounds up or down at random.
  grads = {"a": jnp.full(64, 2.0**-9), "b": jnp.full(64, jnp.nan)}
  if use_update_and_apply:
    step = jax.jit(lambda p, s, g: jmp_lite.update_and_apply(opt, g, s, p))
  else:
    step = jax.jit(lambda p, s, g: _apply_update(opt, p, s, g))
  moved = []
  for i in range(2):
    new_params, state = step(params, state, grads)
    assert _counter(state) == i + 1
    moved.append(np.asarray(new_params["a"] != params["a"]))
    chex.assert_trees_all_equal(new_params["b"], params["b"])
  assert moved[0].any() and (moved[0] != moved[1]).any()
  # Both partitions skipped: the state comes back bit-identical.
  both_bad = {"a": jnp.full(64, jnp.inf), "b": jnp.full(64, jnp.nan)}
  _, skipped = step(params, state, both_bad)
  assert _counter(skipped) == 2
  chex.assert_trees_all_equal(_ours(skipped), _ours(state))


def _apply_update(opt, params, state, grads):
  updates, state = opt.update(grads, state, params)
  return optax.apply_updates(params, updates), state


def test_state_dtypes_stochastic_counter_advances_when_one_partition_applies():
  opt = _two_partitions(lambda inner: jmp_lite.state_dtypes(
      inner, "bf16", rounding="stochastic", seed=1))
  params = {"a": jnp.ones(4), "b": jnp.ones(4)}
  state = opt.init(params)
  grads = {"a": jnp.ones(4), "b": jnp.full(4, jnp.nan)}
  _, state = jax.jit(opt.update)(grads, state, params)
  assert _counter(state) == 1
  _, skipped = jax.jit(opt.update)(
      {"a": jnp.full(4, jnp.nan), "b": jnp.full(4, jnp.nan)}, state, params)
  assert _counter(skipped) == 1


def test_stochastic_rounding_counter_ignores_guards_inside_a_skipping_one():
  """A guard inside a guard that skipped keeps last step's state (here: an
  applied one). The step moved nothing, so the counter must stay."""
  inner = jmp_lite.skip_nonfinite(optax.multi_transform(
      {"a": jmp_lite.loss_scaled(optax.sgd(1.0), NOOP, name="a"),
       "b": jmp_lite.loss_scaled(optax.sgd(1.0), NOOP, name="b")},
      {"a": "a", "b": "b"}))
  opt = jmp_lite.stochastic_rounding(inner, seed=2)
  params = {"a": jnp.ones(4, jnp.bfloat16), "b": jnp.ones(4, jnp.bfloat16)}
  state = opt.init(params)
  _, state = opt.update({"a": jnp.ones(4), "b": jnp.ones(4)}, state, params)
  assert _counter(state) == 1
  _, state = opt.update({"a": jnp.full(4, jnp.nan), "b": jnp.ones(4)}, state,
                        params)
  assert _counter(state) == 1   # The outer guard skipped the whole step.


@pytest.mark.parametrize("inner", ["kahan(state_dtypes)", "sr(state_dtypes)",
                                   "state_dtypes(stochastic)"])
def test_loss_scaled_outside_needs_no_allow_half_state(inner):
  """Kahan's half compensation and state_dtypes' half storage are half by
  design: loss_scaled outside them does not ask for allow_half_state (which
  also turns on check_updates and so the slower path), while moments
  *computed* in half are still refused."""
  adam = optax.adam(1e-2)
  sd = lambda o, **kw: jmp_lite.state_dtypes(o, "bf16", **kw)
  opt = jmp_lite.loss_scaled({
      "kahan(state_dtypes)": lambda: jmp_lite.kahan_summation(sd(adam)),
      "sr(state_dtypes)": lambda: jmp_lite.stochastic_rounding(sd(adam)),
      "state_dtypes(stochastic)": lambda: sd(adam, rounding="stochastic"),
  }[inner](), NOOP)
  params = _params()
  state = opt.init(params)
  assert jmp_lite.step.formulation(opt)[0] == AUTO_KIND
  step = jax.jit(lambda p, s, g: jmp_lite.update_and_apply(opt, g, s, p))
  params, state = step(params, state, _grads(0))
  skipped = step(params, state, _grads(1, bad=True))
  chex.assert_trees_all_equal(skipped[0], params)
  chex.assert_trees_all_equal(_ours(skipped[1]), _ours(state))
  with pytest.raises(TypeError, match=r"inner_state\[0\]\.mu\['w'\]"):
    jmp_lite.loss_scaled(jmp_lite.kahan_summation(adam), NOOP).init(params)


# ------------------------------------------- pytree, jit, checkpoint, memory


def _all_three():
  base = lambda: optax.adam(1e-2)
  return {
      "kahan": jmp_lite.kahan_summation(base()),
      "stochastic": jmp_lite.stochastic_rounding(base(), seed=11),
      "state_dtypes": jmp_lite.state_dtypes(base(), "bf16",
                                            rounding="stochastic", seed=12),
  }


@pytest.mark.parametrize("name", list(_all_three()))
def test_state_round_trips(name, tmp_path):
  import orbax.checkpoint as ocp
  opt = _all_three()[name]
  params = _params()
  state = opt.init(params)
  _, state = opt.update(_grads(0), state, params)
  leaves, treedef = jax.tree.flatten(state)
  chex.assert_trees_all_equal(jax.tree.unflatten(treedef, leaves), state)
  chex.assert_trees_all_equal(jax.tree.map(lambda x: x, state), state)
  chex.assert_trees_all_equal(pickle.loads(pickle.dumps(state)), state)
  jax.jit(lambda s: opt.update(_grads(1), s, params)).lower(state).compile()
  shapes = jax.eval_shape(lambda s: opt.update(_grads(1), s, params)[1], state)
  assert jax.tree.structure(shapes) == treedef
  chex.assert_trees_all_equal_dtypes(shapes, state)

  def body(s, g):
    return opt.update(g, s, params)[1], None
  stacked = jax.tree.map(lambda *x: jnp.stack(x), _grads(2), _grads(3))
  final, _ = jax.lax.scan(body, state, stacked)
  assert jax.tree.structure(final) == treedef
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(tmp_path / "ckpt", state)
    ckptr.wait_until_finished()
    restored = ckptr.restore(tmp_path / "ckpt", opt.init(params))
  chex.assert_trees_all_equal(restored, state)
  chex.assert_trees_all_equal_dtypes(restored, state)


def test_checkpoint_resume_continues_the_random_stream(tmp_path):
  import orbax.checkpoint as ocp
  opt = jmp_lite.stochastic_rounding(jmp_lite.state_dtypes(
      optax.adam(1e-3), "bf16", rounding="stochastic", seed=3), seed=2)

  @jax.jit
  def step(params, state, grads):
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  def run(params, state, lo, hi):
    for i in range(lo, hi):
      params, state = step(params, state, _grads(i))
    return params, state

  p0 = _params()
  full = run(p0, opt.init(p0), 0, 10)
  half = run(p0, opt.init(p0), 0, 4)
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(tmp_path / "ckpt", half)
    ckptr.wait_until_finished()
    restored = ckptr.restore(tmp_path / "ckpt", (p0, opt.init(p0)))
  assert int(restored[1].count) == 4
  chex.assert_trees_all_equal(run(*restored, 4, 10), full)
  # A fresh stream (count 0) would have rounded differently.
  fresh = run(restored[0], opt.init(p0), 4, 10)
  assert not np.array_equal(np.asarray(fresh[0]["w"]),
                            np.asarray(full[0]["w"]))


@pytest.mark.parametrize("name", list(_all_three()))
def test_donated_step_no_aliasing_no_recompiles(name):
  opt = _all_three()[name]
  params = _params()
  state = opt.init(params)
  param_ptrs = {x.unsafe_buffer_pointer() for x in jax.tree.leaves(params)}
  state_ptrs = {x.unsafe_buffer_pointer() for x in jax.tree.leaves(state)}
  assert not param_ptrs & state_ptrs
  chex.clear_trace_counter()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(params, state, grads):
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(step, donate_argnums=(0, 1))
  for i in range(4):  # Warnings are errors: an unusable donation would fail.
    params, state = step(params, state, _grads(i))
  chex.assert_trees_all_equal_dtypes(params, _params())
  if name == "stochastic":
    assert int(state.count) == 4
    # A new seed is a new leaf value, not a new compilation.
    params, state = step(params, jmp_lite.struct.replace(
        state, seed=jnp.uint32(77)), _grads(5))


def test_state_never_holds_the_params_buffers():
  # An inner optimizer that keeps the params it was given (as EMA or
  # lookahead-style transformations do).
  keeper = optax.GradientTransformation(
      lambda p: {"kept": p}, lambda u, s, p=None: (u, s))
  params = {"w": jnp.ones(4, jnp.bfloat16), "v": jnp.ones(4)}
  ptrs = {x.unsafe_buffer_pointer() for x in jax.tree.leaves(params)}
  for opt in (jmp_lite.kahan_summation(keeper),
              jmp_lite.stochastic_rounding(keeper),
              jmp_lite.state_dtypes(keeper, {"kept/w": "bf16"})):
    state = opt.init(params)
    assert not ptrs & {x.unsafe_buffer_pointer()
                       for x in jax.tree.leaves(state)}
    chex.assert_trees_all_equal(state.inner_state["kept"], params)


# --------------------------------------------------------- sharded, docs


def test_sharded_runs_match_the_unsharded_run():
  proc = run_multidevice("multidevice/low_precision_sharded.py", 8)
  assert proc.stdout.splitlines() == [
      "ok init buffers keep the params' sharding",
      "ok jit with sharded params equals unsharded",
      "ok shard_map with specs equals unsharded",
      "ok shard_map without specs repeats bits across shards",
      "ok shard_map replicated params stay identical",
  ], proc.stdout + proc.stderr


