"""jmp_lite.fp4: recipes, bit-exact quantisation, the FP4 matmul's semantics."""
# pyright: reportArgumentType=false

from __future__ import annotations

import math
import pickle

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.extend.core import Literal

from jmp_lite import fp4
from jmp_lite.fp4._dot import gemm
from jmp_lite.fp4._quantize import (
  dequantize,
  hadamard_signs,
  quantize_blocks,
  rotate,
)

F32 = np.float32
DIMS = (((1,), (0,)), ((), ()))
NV, MX = fp4.NVFP4(), fp4.MXFP4()


# ---------------------------------------------------------------- recipes

def test_recipes_defaults_frozen_hashable():
  assert (NV.block_size, NV.weight_blocks, NV.hadamard,
          NV.stochastic_gradients) == (16, (16, 16), 16, True)
  assert (MX.block_size, MX.hadamard, MX.stochastic_gradients) == (32, 0, True)
  assert MX.weight_blocks is None
  assert len({NV, fp4.NVFP4(), MX, fp4.MXFP4()}) == 2
  assert fp4.NVFP4(weight_blocks=[16, 16]).weight_blocks == (16, 16)
  with pytest.raises(AttributeError):
    NV.block_size = 32  # type: ignore[misc]
  per = fp4.PerDirection(NV, MX, None)
  assert hash(per) == hash(fp4.PerDirection(NV, MX, None))
  assert pickle.loads(pickle.dumps(per)) == per


# Bad arguments on purpose (the file-level pyright comment above).
@pytest.mark.parametrize("make, error, match", [
    (lambda: fp4.NVFP4(block_size=0), ValueError, "block_size must be >= 1"),
    (lambda: fp4.NVFP4(block_size=16.0), TypeError, "block_size must be a"),
    (lambda: fp4.NVFP4(weight_blocks=(16, 32)), ValueError,
     r"weight_blocks must be \(block_size, block_size\) = \(16, 16\)"),
    (lambda: fp4.NVFP4(weight_blocks=16), TypeError, "a pair of ints"),
    (lambda: fp4.NVFP4(hadamard=12), ValueError, "power of two"),
    (lambda: fp4.NVFP4(hadamard=-1), ValueError, "hadamard must be >= 0"),
    (lambda: fp4.MXFP4(stochastic_gradients=1), TypeError, "must be a bool"),
    (lambda: fp4.PerDirection(NV, "bf16", None), TypeError,
     "input_grad must be a jmp_lite.fp4.NVFP4"),
    (lambda: fp4.PerDirection(None, None, None), ValueError, "at least one"),
    (lambda: fp4.dot_general("nvfp4"), TypeError, "Expected a jmp_lite.fp4"),
    (lambda: fp4.dot_general(NV, key=3), TypeError, "key must be None or a"),
])
def test_bad_recipes_are_refused_at_construction(make, error, match):
  with pytest.raises(error, match=match):
    make()


# ------------------------------------------------- from-spec NumPy reference

def ref_e2m1(v):
  return np.clip(v, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(F32)


def ref_nvfp4(x, bs=16, tiles=False):
  """NVFP4 quantise-dequantise of ``x (R, C)`` along C, from the formulas."""
  x = np.asarray(x, F32)
  r, c = x.shape
  nb = max(math.ceil(c / bs), 1)
  xp = np.zeros((r, nb * bs), F32)
  xp[:, :c] = x
  amax = np.max(np.abs(x), initial=F32(0))
  if not np.isfinite(amax):
    return np.full_like(x, np.nan)
  # s_enc at most 2**126 (its inverse a normal number), and the float32
  # order of the NVFP4 docstring.
  s_enc = F32(1) if amax == 0 else min(F32(6 * 448) / amax, F32(2.0 ** 126))
  blocks = np.abs(xp).reshape(r, nb, bs).max(axis=2)
  if tiles:
    for i in range(0, r, bs):
      blocks[i:i + bs] = blocks[i:i + bs].max(axis=0)
  s_b = np.clip(blocks * (F32(s_enc) / F32(6)), 0, 448)
  s_b = s_b.astype(ml_dtypes.float8_e4m3fn).astype(F32)
  with np.errstate(divide="ignore"):
    mult = np.where(s_b > 0, F32(1) / s_b, F32(0)).astype(F32)
  v = (xp * F32(s_enc)) * np.repeat(mult, bs, axis=1)
  out = (ref_e2m1(v) * np.repeat(s_b, bs, axis=1)) * (F32(1) / F32(s_enc))
  return out[:, :c].astype(F32)


def ref_mxfp4(x, bs=32):
  x = np.asarray(x, F32)
  r, c = x.shape
  nb = max(math.ceil(c / bs), 1)
  out = np.zeros((r, nb * bs), F32)
  xp = np.zeros((r, nb * bs), np.float64)
  xp[:, :c] = x
  for i in range(r):
    for j in range(nb):
      block = xp[i, j * bs:(j + 1) * bs]
      amax = float(np.max(np.abs(block)))
      if not math.isfinite(amax):
        out[i, j * bs:(j + 1) * bs] = np.nan
        continue
      e = -127
      while e < 127 and 6 * 2.0 ** e < amax:
        e += 1
      q = np.clip(block / 2.0 ** e, -6, 6).astype(ml_dtypes.float4_e2m1fn)
      out[i, j * bs:(j + 1) * bs] = q.astype(np.float64) * 2.0 ** e
  return out[:, :c]


def hard_inputs(rows, cols, seed=0):
  """Normal values, a zero block, an outlier, tiny and subnormal values."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(rows, cols)).astype(F32)
  x[0, :min(cols, 16)] = 0                       # an all-zero block
  x[1, 3] = 3e4                                   # an outlier
  x[2, :] *= F32(1e-30)                           # tiny
  x[3, :5] = F32(1e-40)                           # float32 subnormals
  x[4, 0] = F32(6 * 2.0 ** 30)                    # exactly on a power of 2
  return x


@pytest.mark.parametrize("scale", [1e-30, 1e-36, 1e-37])
def test_nvfp4_tiny_tensors_are_exact(scale):
  # A tensor this small needs s_enc near float32's limit; its inverse stays
  # a normal number (XLA:CPU flushes subnormals, which zeroed them).
  x = (hard_inputs(8, 32) * F32(scale / 3e4)).astype(F32)
  got = qdq(x, NV, -1)
  np.testing.assert_array_equal(got, ref_nvfp4(x))
  assert np.abs(got).max() > 0


@pytest.mark.parametrize("cols", [64, 37, 5])
@pytest.mark.parametrize("role", ["activation", "weight"])
def test_nvfp4_is_bit_exact_with_the_formulas(cols, role):
  x = hard_inputs(40, cols)
  got = jax.jit(lambda x: fp4.quantize_dequantize(x, NV, role=role))(x)
  np.testing.assert_array_equal(np.asarray(got),
                                ref_nvfp4(x, tiles=role == "weight"))


@pytest.mark.parametrize("cols", [64, 37])
def test_mxfp4_is_bit_exact_with_the_formulas(cols):
  x = hard_inputs(8, cols)
  got = jax.jit(lambda x: fp4.quantize_dequantize(x, MX))(x)
  np.testing.assert_array_equal(np.asarray(got), ref_mxfp4(x))


def test_special_tensors():
  zeros = jnp.zeros((3, 20))
  for r in (NV, MX):
    assert (qdq(zeros, r, -1) == 0).all()
  x = np.ones((2, 40), F32)
  x[1, 35] = np.inf
  assert np.isnan(qdq(x, NV, -1)).all()  # The per-tensor scale is NaN.
  mx = qdq(x, MX, -1)
  assert np.isnan(mx[1, 32:]).all() and (mx[0] == 1).all()
  assert (mx[1, :32] == 1).all()
  # Blocks whose E4M3 scale rounds to zero decode to zeros.
  y = np.full((1, 32), 1e-7, F32)
  y[0, 0] = 1e3
  got = qdq(y, NV, -1)
  assert got[0, 0] == 1e3 and (got[0, 16:] == 0).all()


def test_axis_bfloat16_and_bad_arguments():
  x = hard_inputs(24, 40)
  t = QDQ(x.T, recipe=NV, axis=0)
  np.testing.assert_array_equal(np.asarray(t).T, ref_nvfp4(x))
  b = QDQ(jnp.asarray(x, jnp.bfloat16), recipe=MX)
  assert b.dtype == jnp.bfloat16
  with pytest.raises(ValueError, match="role must be one of"):
    fp4.quantize_dequantize(x, NV, role="bias")
  with pytest.raises(ValueError, match="axis 2 is out of range"):
    fp4.quantize_dequantize(x, NV, axis=2)
  with pytest.raises(TypeError, match="floating array"):
    fp4.quantize_dequantize(jnp.ones(3, jnp.int32), NV)
  with pytest.raises(TypeError, match="one format"):
    per = fp4.PerDirection(NV, NV, None)
    fp4.quantize_dequantize(x, per)  # pyright: ignore[reportArgumentType]
  with pytest.raises(ValueError, match="rounds gradients stochastically"):
    fp4.quantize_dequantize(x, NV, role="weight", key=jax.random.key(0))


def test_codes_are_e2m1_in_the_program():
  x = jnp.ones((4, 32))
  text = str(jax.make_jaxpr(lambda x: fp4.quantize_dequantize(x, NV))(x))
  assert "new_dtype=float4_e2m1fn" in text
  t = quantize_blocks(x[None], NV)
  assert t.q.dtype == jnp.float4_e2m1fn


# ----------------------------------------------------- stochastic rounding

@pytest.mark.parametrize("recipe", [NV, MX], ids=["nvfp4", "mxfp4"])
def test_stochastic_rounding_is_unbiased(recipe):
  # Within each block: its amax (6 after scaling) and values between grid
  # points, where nearest rounding is biased.
  rng = np.random.default_rng(1)
  x = rng.uniform(-6, 6, size=(4, 64)).astype(F32)
  x[:, ::16] = 6
  keys = jax.random.split(jax.random.key(7), 4000)
  draw = jax.jit(jax.vmap(lambda k: fp4.quantize_dequantize(
      x, recipe, role="gradient", key=k)))
  samples = np.asarray(draw(keys), np.float64)
  mean = samples.mean(axis=0)
  nearest = qdq(x, recipe, -1, "gradient")
  # Each sample is one of the two neighbours around x, the spacing <= 2.
  lo, hi = samples.min(axis=0), samples.max(axis=0)
  assert (lo <= x + 1e-6).all() and (hi >= x - 1e-6).all()
  assert (hi - lo <= 2 + 1e-6).all()
  # Bernoulli std of a mean of 4000 draws of spacing <= 2: <= 1/sqrt(4000).
  # 6 standard deviations: deterministic here (fixed keys), never flaky.
  assert np.abs(mean - x).max() < 6 / math.sqrt(4000)
  assert np.abs(nearest - x).mean() > 10 * np.abs(mean - x).mean()
  # Without a key, or with stochastic_gradients=False: nearest, always.
  off = fp4.NVFP4(stochastic_gradients=False)
  np.testing.assert_array_equal(
      fp4.quantize_dequantize(x, off, role="gradient", key=keys[0]),
      fp4.quantize_dequantize(x, off, role="gradient"))


# ------------------------------------------------------- the FP4 matmul

def data(m=64, k=48, n=40, seed=0):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.normal(size=(m, k)), jnp.float32),
          jnp.asarray(rng.normal(size=(k, n)), jnp.float32),
          jnp.asarray(rng.normal(size=(m, n)), jnp.float32))


@jax.jit(static_argnums=0)
def grads(recipe, key, x, w, g):
  dot = fp4.dot_general(recipe, key)
  y, vjp = jax.vjp(lambda x, w: dot(x, w, DIMS), x, w)
  return (y, *vjp(g))


# Jitted: eager, every small op would compile on its own.
ROTATE = jax.jit(rotate)
QDQ = jax.jit(fp4.quantize_dequantize, static_argnames=("recipe", "axis",
                                                         "role"))


def qdq(x, recipe, axis, role="activation"):
  return np.asarray(QDQ(x, recipe=recipe, axis=axis, role=role), np.float64)


def test_gemms_use_the_quantised_operands_and_tiles_are_reused():
  x, w, g = data()
  y, dx, dw = jax.jit(lambda *a: grads(fp4.NVFP4(hadamard=0), None, *a))(
      x, w, g)
  wq = qdq(w, NV, 0, "weight")  # The forward's weight: 16x16 tiles.
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-4)
  close(y, qdq(x, NV, 1) @ wq)
  # The input gradient reads the forward's tiled weight itself.
  close(dx, qdq(g, NV, 1, "gradient") @ wq.T)
  close(dw, qdq(x, NV, 0).T @ qdq(g, NV, 0, "gradient"))
  # 1-D weights are requantised along the input gradient's contraction.
  one_d = fp4.NVFP4(weight_blocks=None, hadamard=0)
  _, dx1, _ = grads(one_d, None, x, w, g)
  close(dx1, qdq(g, one_d, 1, "gradient") @ qdq(w, one_d, 1, "weight").T)
  assert not np.allclose(qdq(w, one_d, 1, "weight"), wq)
  _, dxm, _ = grads(MX, None, x, w, g)
  close(dxm, qdq(g, MX, 1, "gradient") @ qdq(w, MX, 1, "weight").T)


def test_native_route_gives_the_emulated_numbers():
  x, w, _ = data(32, 64, 24)
  for fmt in (NV, MX):
    quantize = jax.jit(quantize_blocks, static_argnums=1,
                       static_argnames="tiles")
    a = quantize(x[None], fmt)
    b = quantize(w.T[None], fmt, tiles=fmt.weight_blocks is not None)
    run = jax.jit(gemm, static_argnums=(2, 3))
    np.testing.assert_array_equal(run(a, b, fmt, True), run(a, b, fmt, False))


@pytest.mark.parametrize("recipe", [NV, MX], ids=["nvfp4", "mxfp4"])
def test_forward_ignores_the_key_and_no_key_is_deterministic(recipe):
  x, w, g = data()
  no_key = grads(recipe, None, x, w, g)
  keyed = grads(recipe, jax.random.key(0), x, w, g)
  raw = grads(recipe, jax.random.PRNGKey(0), x, w, g)  # raw keys too
  np.testing.assert_array_equal(no_key[0], keyed[0])
  for a, b in zip(keyed, raw, strict=True):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(no_key, grads(recipe, None, x, w, g), strict=True):
    np.testing.assert_array_equal(a, b)
  other = grads(recipe, jax.random.key(1), x, w, g)
  assert not np.array_equal(keyed[1], other[1])  # SR draws from the key
  off = type(recipe)(stochastic_gradients=False)
  a, b = (grads(off, jax.random.key(i), x, w, g) for i in (0, 0))
  for u, v in zip(a, b, strict=True):
    np.testing.assert_array_equal(u, v)


def test_hadamard_signs_come_from_the_key():
  x, w, g = data()
  r = fp4.NVFP4(stochastic_gradients=False)
  _, dx0, dw0 = grads(r, jax.random.key(0), x, w, g)
  _, dx1, dw1 = grads(r, jax.random.key(1), x, w, g)
  np.testing.assert_array_equal(dx0, dx1)  # no SR, no transform: same
  assert not np.array_equal(dw0, dw1)
  exact = np.asarray(x, np.float64).T @ np.asarray(g, np.float64)
  for dw in (dw0, dw1):  # rotated or not, still the weight gradient
    assert np.linalg.norm(dw - exact) / np.linalg.norm(exact) < 0.2


def relative_error(got, exact, rows=slice(None)):
  got = np.asarray(got, np.float64)
  return np.linalg.norm(got[..., rows, :] - exact[rows]) / np.linalg.norm(
      exact[rows])


def test_hadamard_lowers_the_weight_gradient_error_on_outliers():
  # Heavy-tailed activations and gradients (Student's t, 2 degrees of
  # freedom): blocks along the tokens hold a few large values that set the
  # scale and flush the rest. MXFP4's power-of-two scales leave a block's
  # largest value anywhere in (3, 6], so the transform pays off there. On
  # NVFP4 one draw shows no gain (0.167 without, 0.209 with, on these
  # inputs): its E4M3 scale already lands each block's largest value on 6.
  rng = np.random.default_rng(3)
  x = rng.standard_t(2, size=(256, 64)).astype(F32)
  g = rng.standard_t(2, size=(256, 32)).astype(F32)
  w = jnp.zeros((64, 32))
  exact = x.astype(np.float64).T @ g.astype(np.float64)
  errors = {}
  for h in (0, 16):
    r = fp4.MXFP4(hadamard=h)
    e = [relative_error(grads(r, jax.random.key(i), x, w, g)[2], exact)
         for i in range(2)]
    errors[h] = np.mean(e)
  assert errors[16] < 0.8 * errors[0], errors


def test_hadamard_makes_nvfp4s_expected_weight_gradient_exact():
  # The weight gradient's activations are rounded to nearest: without the
  # transform their error is the same whatever the key, and the mean over
  # keys (over steps, with a fresh key each) keeps it (0.097). The
  # transform's signs change with the key, so that error changes sign too
  # and averages out with the stochastic rounding's (0.023 over 64 keys, the
  # 0.17 of one draw / sqrt(64)); one draw's error is the same either way.
  rng = np.random.default_rng(3)
  x = rng.normal(size=(256, 64)).astype(F32)
  g = rng.normal(size=(256, 32)).astype(F32)
  w = jnp.zeros((64, 32))
  exact = x.astype(np.float64).T @ g.astype(np.float64)
  keys = jax.random.split(jax.random.key(0), 64)
  mean_error = {}
  for h in (0, 16):
    r = fp4.NVFP4(hadamard=h)
    dw = jax.vmap(lambda k, r=r: grads(r, k, x, w, g)[2])(keys)
    mean_error[h] = relative_error(np.mean(dw, axis=0), exact)
  assert mean_error[16] < 0.5 * mean_error[0], mean_error


def test_hadamard_keeps_nvfp4_block_scales_above_e4m3s_range():
  # A tensor's block scales are E4M3 relative to its amax: 448 * amax_b /
  # amax rounds to zero where amax / amax_b > 448 * 2**10 (4.6e5) and loses
  # its precision (subnormal) from 448 * 2**6 (2.9e4). Two activations at
  # 1e6 among unit normals (massive activations; a gradient spike does the
  # same) leave 64% of the other channels' blocks a zero scale and the rest
  # E4M3's smallest, so their weight gradient is mostly lost (0.73). The
  # transform spreads each spike over 16 tokens, its amax 4x lower: no zero
  # scale, and the other channels' error is 0.18, as without spikes.
  rng = np.random.default_rng(3)
  x = rng.normal(size=(256, 64)).astype(F32)
  g = rng.normal(size=(256, 32)).astype(F32)
  x[7, 3], x[200, 40] = 1e6, -1e6
  others = np.setdiff1d(np.arange(64), [3, 40])
  w = jnp.zeros((64, 32))
  exact = x.astype(np.float64).T @ g.astype(np.float64)
  errors = {h: relative_error(grads(fp4.NVFP4(hadamard=h), jax.random.key(1),
                                    x, w, g)[2], exact, others)
            for h in (0, 16)}
  assert errors[0] > 0.5 and errors[16] < 0.3, errors
  # Why: the other channels' block scales along the tokens.
  scales = jax.jit(lambda x, s: (
      quantize_blocks(x[None], NV).scale[0],
      quantize_blocks(rotate(x, s)[None], NV).scale[0]))
  raw, rotated = scales(x.T, hadamard_signs(jax.random.key(1), 16))
  assert (raw[others] == 0).mean() > 0.5
  assert (rotated[others] > 0).all()


def test_two_d_tiles_confine_an_outlier_to_its_tile():
  rng = np.random.default_rng(4)
  w = rng.normal(size=(64, 64)).astype(F32)
  spiked = w.copy()
  spiked[20, 37] = 1e3  # tile (1, 2) of the 16x16 grid
  base = qdq(w, NV, 1, "weight")
  spike = qdq(spiked, NV, 1, "weight")
  tile = np.zeros_like(w, bool)
  tile[16:32, 32:48] = True
  tile[20, 37] = False
  # Inside its tile the outlier's scale flushes most neighbours to zero ...
  assert (spike[tile] == 0).mean() > 0.8
  # ... outside it, the error stays what it was without the outlier.
  outside = ~tile
  outside[20, 37] = False
  e_base = np.abs(base - w)[outside].mean()
  e_spike = np.abs(spike - w)[outside].mean()
  assert e_spike < 1.1 * e_base, (e_spike, e_base)
  assert (spike[outside] != 0).mean() >= (base[outside] != 0).mean() - 0.01


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dtypes_batch_dims_and_einsum(dtype):
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.normal(size=(2, 8, 20)), dtype)
  w = jnp.asarray(rng.normal(size=(2, 20, 6)), dtype)
  dot = fp4.dot_general(NV, jax.random.key(0))
  dims = (((2,), (1,)), ((0,), (0,)))
  y = jax.jit(lambda a, b: dot(a, b, dims))(x, w)
  assert y.dtype == dtype and y.shape == (2, 8, 6)
  gx, gw = jax.jit(jax.grad(lambda a, b: dot(a, b, dims).astype(F32).sum(),
                            argnums=(0, 1)))(x, w)
  assert gx.dtype == gw.dtype == dtype
  e = jax.jit(lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b,
                                      _dot_general=dot))(x, w)
  np.testing.assert_array_equal(np.asarray(e, F32), np.asarray(y, F32))
  assert dot(x, w, dims, preferred_element_type=F32).dtype == F32


def test_per_direction_formats():
  x, w, g = data()
  nv = fp4.NVFP4(hadamard=0)
  _, dx, dw = grads(fp4.PerDirection(nv, nv, None), None, x, w, g)
  exact = np.asarray(x, np.float64).T @ np.asarray(g, np.float64)
  np.testing.assert_allclose(dw, exact, rtol=1e-5, atol=1e-4)
  _, dx_all, _ = grads(nv, None, x, w, g)
  np.testing.assert_array_equal(dx, dx_all)
  y, dx_hi, _ = grads(fp4.PerDirection(None, MX, MX), None, x, w, g)
  np.testing.assert_allclose(y, np.asarray(x) @ np.asarray(w), rtol=1e-5,
                             atol=1e-4)
  wq = qdq(w, MX, 1, "weight")
  np.testing.assert_allclose(dx_hi, qdq(g, MX, 1, "gradient") @ wq.T,
                             rtol=2e-5, atol=2e-4)


@pytest.mark.parametrize("recipe", [NV, MX], ids=["nvfp4", "mxfp4"])
def test_a_non_finite_operand_makes_the_product_nan(recipe):
  # So that loss_scaled skips the step instead of FP4 saturation hiding an
  # overflow.
  x, w, g = data()
  x = x.at[3, 5].set(jnp.inf)
  y, dx, dw = grads(recipe, None, x, w, g)
  y = np.asarray(y)
  assert np.isnan(y[3]).all()
  if recipe is NV:  # the per-tensor scale: every output
    assert np.isnan(y).all()
  else:  # the MX block's scale: its row only
    assert np.isfinite(np.delete(y, 3, axis=0)).all()


def test_jit_traces_once_and_keys_can_be_traced():
  x, w, g = data()

  @jax.jit
  def step(x, w, key, i):
    k = jax.random.fold_in(key, i)
    return jax.grad(lambda w: fp4.dot_general(NV, k)(x, w, DIMS).sum())(w)

  a = step(x, w, jax.random.key(0), 0)
  b = step(x, w, jax.random.key(0), 1)
  assert step._cache_size() == 1  # pyright: ignore[reportAttributeAccessIssue]
  assert not np.array_equal(a, b)


@pytest.mark.parametrize("recipe", [fp4.NVFP4(), fp4.MXFP4()],
                         ids=["nvfp4", "mxfp4"])
def test_dimension_numbers_lax_refuses_are_refused(recipe):
  """Before: contracting sizes 2 and 3 gave a (32, 32) result."""
  x, w = jnp.ones((32, 2)), jnp.ones((3, 32))
  with pytest.raises(TypeError, match="fp4 dot_general: .*contracting"):
    fp4.dot_general(recipe)(x, w, (((1,), (0,)), ((), ())))


# --------------------------------- what each GEMM reads, from the jaxpr

def _sources(jaxpr, tags_in, dots):
  """Tags each variable with what it is computed from: the inputs' names,
  ``"fp4"`` below a conversion to float4_e2m1fn, ``"rand"`` below random
  bits; appends ``(operand shapes, operand tags)`` of every dot_general.
  Calls (jit, custom rules) are followed into their jaxprs."""
  env = dict(zip(jaxpr.invars, tags_in, strict=True))
  get = lambda a: frozenset() if isinstance(a, Literal) else env.get(
      a, frozenset())
  for eqn in jaxpr.eqns:
    tags = [get(a) for a in eqn.invars]
    sub = next((v for v in eqn.params.values()
                if hasattr(v, "eqns") or hasattr(v, "jaxpr")), None)
    if sub is not None and eqn.primitive.name != "dot_general":
      sub = getattr(sub, "jaxpr", sub)
      outs = _sources(sub, tags[-len(sub.invars):], dots)
    else:
      out = frozenset().union(*tags)
      name = eqn.primitive.name
      if name == "convert_element_type" and (
          eqn.params["new_dtype"] == jnp.float4_e2m1fn):
        out |= {"fp4"}
      if name in ("random_bits", "threefry2x32"):
        out |= {"rand"}
      if name == "dot_general":
        dots.append(([a.aval.shape for a in eqn.invars], tags))
      outs = [out] * len(eqn.outvars)
    env.update(zip(eqn.outvars, outs, strict=True))
  return [get(a) for a in jaxpr.outvars]


@pytest.mark.parametrize("recipe", [NV, MX, fp4.MXFP4(hadamard=16),
                                    fp4.NVFP4(hadamard=0)],
                         ids=["nvfp4", "mxfp4", "mxfp4-h16", "nvfp4-h0"])
@pytest.mark.parametrize("keyed", [False, True], ids=["nokey", "key"])
def test_every_gemm_reads_fp4_operands_and_only_gradients_are_random(
    recipe, keyed):
  x, w, g = data()
  key = jax.random.key(0) if keyed else None

  def step(x, w, g):
    y, vjp = jax.vjp(lambda x, w: fp4.dot_general(recipe, key)(x, w, DIMS),
                     x, w)
    return (y, *vjp(g))

  dots = []
  closed = jax.make_jaxpr(step)(x, w, g)
  _sources(closed.jaxpr, [frozenset({n}) for n in "xwg"], dots)
  # The transform's 16x16 products aside: forward, input and weight grad.
  gemms = [tags for shapes, tags in dots if (16, 16) not in shapes]
  assert len(dots) - len(gemms) == (2 if recipe.hadamard else 0)
  (fx, fw), (dg, dw), (wg, wx) = gemms
  assert fx == {"x", "fp4"} and fw == {"w", "fp4"}  # no key read
  assert dw == {"w", "fp4"}
  # The cotangent is rounded stochastically in both gradient GEMMs exactly
  # when there is a key; with a transform, both weight-gradient operands
  # also read its (random) signs, drawn from key(0) without a key.
  assert dg == {"g", "fp4"} | ({"rand"} if keyed else set())
  rotated = {"rand"} if recipe.hadamard else set()
  assert wg == {"g", "fp4"} | rotated | ({"rand"} if keyed else set())
  assert wx == {"x", "fp4"} | rotated


# ------------------------------------------- the Hadamard transform itself

def test_rotation_is_orthonormal_and_keeps_products():
  signs = jax.random.rademacher(jax.random.key(3), (16,), jnp.float32)
  m = np.asarray(rotate(jnp.eye(16), signs), np.float64)
  # diag(signs) H / 4: entries +-1/4, orthonormal.
  np.testing.assert_array_equal(np.abs(m), np.full((16, 16), 0.25))
  np.testing.assert_allclose(m @ m.T, np.eye(16), atol=1e-7)
  rng = np.random.default_rng(8)
  a = rng.standard_t(2, size=(24, 40)).astype(F32)  # 40: padded to 48
  b = rng.standard_t(2, size=(12, 40)).astype(F32)
  ra, rb = (np.asarray(rotate(jnp.asarray(v), signs), np.float64)
            for v in (a, b))
  assert ra.shape == (24, 48)
  exact = a.astype(np.float64) @ b.T.astype(np.float64)
  np.testing.assert_allclose(ra @ rb.T, exact, rtol=1e-5,
                             atol=1e-5 * np.abs(exact).max())


def test_rotation_runs_at_float32_precision_everywhere():
  """Before: a default-precision dot (bfloat16 passes on TPUs, TF32 on
  recent GPUs), so the transform did not undo itself exactly there."""
  signs = jnp.ones(16)
  with jax.default_matmul_precision("bfloat16"):
    text = str(jax.make_jaxpr(rotate)(jnp.ones((4, 32)), signs))
  assert "Precision.HIGHEST" in text, text


@pytest.mark.parametrize("recipe", [fp4.NVFP4(stochastic_gradients=False),
                                    fp4.MXFP4(hadamard=16,
                                              stochastic_gradients=False)],
                         ids=["nvfp4", "mxfp4-h16"])
def test_weight_gradient_quantises_the_rotated_operands(recipe):
  # Token spikes: the transform spreads each over 16 tokens, so the rotated
  # tensors' amax (NVFP4's tensor scale) is far below the raw ones'.
  x, w, g = data(m=72)  # 72 tokens: padded to whole transform chunks
  x = x.at[5].multiply(300.0)
  g = g.at[40].multiply(300.0)
  key = jax.random.key(11)
  _, _, dw = grads(recipe, key, x, w, g)
  signs = hadamard_signs(jax.random.split(key, 3)[2], 16)
  rx, rg = ROTATE(x.T, signs), ROTATE(g.T, signs)
  assert float(jnp.abs(rx).max()) < 0.5 * float(jnp.abs(x).max())
  want = qdq(rx, recipe, 1) @ qdq(rg, recipe, 1, "gradient").T
  np.testing.assert_allclose(dw, want, rtol=2e-5,
                             atol=2e-5 * np.abs(want).max())
  if isinstance(recipe, fp4.NVFP4):
    # The tensor scale from the raw (unrotated) tensor gives other numbers.
    @jax.jit
    def raw_scale(r, v):
      return dequantize(quantize_blocks(r[None], recipe,
                                        amax=jnp.abs(v).max()))[0]
    other = np.asarray(raw_scale(rx, x), np.float64) @ np.asarray(
        raw_scale(rg, g), np.float64).T
    assert np.abs(other - want).max() > 1e-3 * np.abs(want).max()


@pytest.mark.parametrize("recipe", [fp4.NVFP4(hadamard=0), MX],
                         ids=["nvfp4", "mxfp4"])
def test_both_gradient_gemms_round_the_cotangent_without_bias(recipe):
  x, w, g = data()
  keys = jax.random.split(jax.random.key(5), 256)
  _, dx, dw = jax.vmap(lambda k: grads(recipe, k, x, w, g))(keys)
  _, dx_rtn, dw_rtn = grads(recipe, None, x, w, g)
  # The input gradient's weight: the forward's tiles, or blocks along N.
  wq = qdq(w, recipe, 0 if recipe.weight_blocks else 1, "weight")
  # The unrounded cotangent against the (deterministic) other operand.
  dx_true = np.asarray(g, np.float64) @ wq.T
  dw_true = qdq(x, recipe, 0).T @ np.asarray(g, np.float64)
  for draws, rtn, true in ((dx, dx_rtn, dx_true), (dw, dw_rtn, dw_true)):
    draws = np.asarray(draws, np.float64)
    assert np.ptp(draws, axis=0).min() > 0  # every output varies
    bias = np.abs(draws.mean(axis=0) - true).mean()
    # Measured 0.09 (MXFP4) and 0.15 (NVFP4) of nearest rounding's error:
    # 256 draws' noise, and for NVFP4 a block scale that E4M3 rounds down
    # saturates the block's largest value at 6 whatever the rounding.
    assert bias < 0.25 * np.abs(np.asarray(rtn, np.float64) - true).mean()


@pytest.mark.parametrize("fmt", [fp4.NVFP4(), fp4.MXFP4()])
@pytest.mark.parametrize("xs,ws", [((0, 32), (32, 4)), ((3, 0), (0, 4)),
                                   ((2, 0, 32), (32, 4))])
def test_empty_operands_give_empty_or_zero_products(fmt, xs, ws):
  # An expert given no tokens: the blocks had no rows (a modulo by zero).
  dims = (((len(xs) - 1,), (0,)), ((), ()))
  f = fp4.dot_general(fmt)
  y = jax.jit(lambda x, w: f(x, w, dims))(jnp.ones(xs, jnp.bfloat16),
                                           jnp.ones(ws, jnp.bfloat16))
  assert y.shape == (*xs[:-1], ws[1]) and y.dtype == jnp.bfloat16
  assert not np.asarray(y, np.float32).any()
  gx, gw = jax.grad(lambda x, w: f(x, w, dims).sum(), argnums=(0, 1))(
      jnp.ones(xs), jnp.ones(ws))
  assert gx.shape == xs and gw.shape == ws and not np.asarray(gw).any()


def test_dtype_report_takes_fp4_rules():
  # FP4 recipes have one format (no bwd_dtype): the report raised.
  import flax.linen as nn

  import jmp_lite.linen as jl
  m = jl.mixed_precision(nn.Dense(4), "p=f32,c=bf16,o=f32",
                         rules=[(nn.Dense, fp4.NVFP4())])
  v = m.init(jax.random.key(0), jnp.ones((2, 32)))
  report = str(jl.dtype_report(m, v, jnp.ones((2, 32))))
  assert "Fp4DotGeneral" in report and "matmuls ran in" in report


@pytest.mark.parametrize("bad", [0, "fp4"])
def test_nnx_fp4_dot_names_a_bad_rngs(bad):
  import jmp_lite.fp4.nnx as fp4_nnx
  with pytest.raises(TypeError, match="rngs must be an nnx.Rngs with an"
                     " 'fp4' stream"):
    fp4_nnx.Fp4DotGeneral(fp4.NVFP4(), bad)


def test_plain_directions_in_half_precision_run_under_jit():
  # PerDirection(None, None, ...) keeps the forward and data gradient in
  # the operands' bfloat16; x.T @ w made XLA:CPU reject the dot
  # ("Unsupported element type for DotThunk: BF16 x BF16 = F32").
  rec = fp4.PerDirection(None, None, fp4.NVFP4())
  dims = (((0,), (0,)), ((), ()))
  x = jnp.ones((37, 6), jnp.bfloat16)
  w = jnp.ones((37, 11), jnp.bfloat16)
  y = jax.jit(lambda x, w: fp4.dot_general(rec)(x, w, dims))(x, w)
  assert y.dtype == jnp.bfloat16 and float(y[0, 0]) == 37.0
  gx, gw = jax.jit(jax.grad(lambda x, w: fp4.dot_general(rec)(
      x, w, dims).astype(jnp.float32).sum(), argnums=(0, 1)))(x, w)
  assert gx.shape == x.shape and gw.shape == w.shape

