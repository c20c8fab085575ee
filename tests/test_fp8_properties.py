"""Property tests of jmp_lite.fp8: the invariants users rely on, on shapes,
dtypes and magnitudes a generator picks.

* quantise-dequantise: every element within its format's rounding of the
  original, plus half a subnormal step of its block's scale;
* every recipe's dot, and both its gradients, within its formats'
  rounding of a float64 reference (relative to ``|x| @ |w|``, which bounds
  cancellation) wherever the exact result is a normal number of the output
  dtype, from float32's smallest normal numbers to its largest;
* inf and NaN poison exactly the outputs whose blocks hold them.

Arrays come from NumPy seeded by the drawn seed (hypothesis draws the
shape, dtype, magnitudes and spread, which is where the edges are); the
default run takes a few examples of each, ``-m slow`` many more.
"""

from __future__ import annotations

import functools
import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmp_lite import fp8
from jmp_lite.fp8._blocked import dequantize_blocks, Layout, quantize_blocks
from jmp_lite.fp8._recipes import max_margin

MATMUL = (((1,), (0,)), ((), ()))
E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
TINY32 = float(np.finfo(np.float32).tiny)
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}

FAST = hypothesis.settings(
    max_examples=12, deadline=None, derandomize=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow])
DEEP = hypothesis.settings(
    max_examples=60, deadline=None,
    suppress_health_check=[hypothesis.HealthCheck.too_slow])


def _u(fmt: np.dtype) -> float:
  """Unit roundoff: half an ulp at 1 (E4M3 2**-4, E5M2 2**-3)."""
  return 2.0 ** -(int(jnp.finfo(fmt).nmant) + 1)


def _sub(fmt: np.dtype) -> float:
  """The format's smallest subnormal (E4M3 2**-9, E5M2 2**-16)."""
  return float(jnp.finfo(fmt).smallest_subnormal)


def _fmax(fmt: np.dtype) -> float:
  return float(jnp.finfo(fmt).max)


def _exponent_range(dtype) -> tuple[int, int]:
  """Binades whose values (mantissa below 1.99) are normal in ``dtype``."""
  info = jnp.finfo(dtype)
  return int(info.minexp), int(info.maxexp) - 1


def _values(seed: int, shape: tuple[int, ...], exp: int, spread: int,
            dtype) -> np.ndarray:
  """Signed values ``m * 2**(exp - s)``: m in [1, 1.99), s in [0, spread]."""
  rng = np.random.default_rng(seed)
  lo = _exponent_range(dtype)[0]
  shift = rng.integers(0, spread + 1, shape)
  e = np.maximum(exp - shift, lo)
  m = rng.uniform(1.0, 1.99, shape) * rng.choice([-1.0, 1.0], shape)
  x = np.ldexp(m, e)
  return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)


# ------------------------------------------------------- quantise/dequantise

@st.composite
def _tensors(draw, dtypes=tuple(DTYPES)):
  name = draw(st.sampled_from(dtypes))
  lo, hi = _exponent_range(DTYPES[name])
  rows = draw(st.integers(1, 5))
  cols = draw(st.integers(1, 70))
  exp = draw(st.integers(lo, hi))
  spread = draw(st.integers(0, 24))
  return name, _values(draw(st.integers(0, 2**31)), (rows, cols), exp,
                       spread, DTYPES[name])


def _check_round_trip(x: np.ndarray, back: np.ndarray, inv: np.ndarray,
                      fmt: np.dtype, rel: float) -> None:
  """``|back - x| <= rel |x| + inv * sub / 2`` (plus float32's flush)."""
  bound = rel * np.abs(x) + inv * _sub(fmt) / 2 + TINY32
  assert np.all(np.isfinite(back))
  excess = np.abs(back - x) - bound
  assert np.all(excess <= 0), (np.max(excess), x.flat[np.argmax(excess)])


def _quantize_round_trip(data, fmt_name, margin_fraction):
  name, x = data
  fmt = E4M3 if fmt_name == "e4m3" else E5M2
  margin = int(margin_fraction * max_margin(fmt))
  q, inv = fp8.quantize(jnp.asarray(x, DTYPES[name]), fmt, margin=margin)
  back = np.asarray(q.astype(jnp.float32) * inv, np.float64)
  amax = np.max(np.abs(x))
  # The scale stays within [2**-126, 2**126], and so does the de-scale.
  want_inv = min(max(amax * 2.0 ** margin / _fmax(fmt), 2.0 ** -126),
                 2.0 ** 126)
  assert float(inv) == pytest.approx(want_inv, rel=1e-6)
  _check_round_trip(x, back, float(inv), fmt, _u(fmt))


@FAST
@hypothesis.given(_tensors(), st.sampled_from(["e4m3", "e5m2"]),
                  st.floats(0, 1))
def test_quantize_round_trip_is_within_the_format(data, fmt, margin):
  _quantize_round_trip(data, fmt, margin)


@pytest.mark.slow
@DEEP
@hypothesis.given(_tensors(), st.sampled_from(["e4m3", "e5m2"]),
                  st.floats(0, 1))
def test_quantize_round_trip_is_within_the_format_deep(data, fmt, margin):
  _quantize_round_trip(data, fmt, margin)


LAYOUTS = ["row", "vector", "square", "mx-up", "mx-floor"]


@functools.partial(jax.jit, static_argnums=1)
def _round_trip_blocks(x, layout):
  q, inv = quantize_blocks(x, layout)
  return q, inv, dequantize_blocks(q, inv, x.shape[2])


def _blocks_round_trip(data, kind, fmt_name, bs):
  name, x = data
  fmt = E4M3 if fmt_name == "e4m3" else E5M2
  mx = kind.startswith("mx")
  layout = (Layout("mx", fmt, 0, 32, kind[3:]) if mx
            else Layout(kind, fmt, 0, bs))
  q, inv, back = _round_trip_blocks(jnp.asarray(x, DTYPES[name])[None],
                                    layout)
  back = np.asarray(back, np.float64)[0]
  inv = np.asarray(inv, np.float64)[0]                       # (rows, nb)
  nb, size = inv.shape[1], q.shape[3]
  per_elem = np.repeat(inv, size, axis=1)[:, :x.shape[1]]
  # Each block's de-scale covers its amax: exactly amax / max for the
  # float32 scales, the next power of two up (or down, "floor") for MX,
  # never below 2**-126.
  padded = np.zeros((x.shape[0], nb * size))
  padded[:, :x.shape[1]] = np.abs(x)
  amax = padded.reshape(x.shape[0], nb, size).max(axis=2)
  if kind == "square":
    groups = np.arange(x.shape[0]) // bs
    amax = np.stack([amax[groups == g].max(axis=0) for g in groups])
  ratio = inv / np.maximum(amax / _fmax(fmt), 2.0 ** -126)
  if kind == "mx-up":
    assert np.all((ratio >= 1 - 1e-6) & (ratio <= 2 + 1e-6))
  elif kind == "mx-floor":   # 2**floor(log2 amax) / 2**emax: 7/8 to 7/4.
    assert np.all((ratio >= 0.875 - 1e-6) & (ratio <= 1.75 + 1e-6))
  else:
    np.testing.assert_allclose(ratio, 1.0, rtol=1e-6)
  # "floor" lets elements past the format's max saturate: up to 1/8 off.
  rel = max(_u(fmt), 0.125) if kind == "mx-floor" else _u(fmt)
  _check_round_trip(x, back, per_elem, fmt, rel)


@FAST
@hypothesis.given(_tensors(), st.sampled_from(LAYOUTS),
                  st.sampled_from(["e4m3", "e5m2"]), st.integers(1, 40))
def test_block_round_trip_is_within_the_format_per_block(data, kind, fmt,
                                                         bs):
  _blocks_round_trip(data, kind, fmt, bs)


@pytest.mark.slow
@DEEP
@hypothesis.given(_tensors(), st.sampled_from(LAYOUTS),
                  st.sampled_from(["e4m3", "e5m2"]), st.integers(1, 40))
def test_block_round_trip_is_within_the_format_per_block_deep(data, kind,
                                                              fmt, bs):
  _blocks_round_trip(data, kind, fmt, bs)


@pytest.mark.parametrize("kind", ["row", "vector", "square"])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_jitted_scales_of_blocks_near_float32s_largest(kind, fmt):
  # Found by the deep property test: jitted, a "square" block of amax
  # 1.4e38 got the scale floor 2**-126 (de-scale 274x too large): XLA:CPU
  # took fmax / amax as fmax * (1 / amax), a flushed subnormal.
  x = jnp.asarray([[[-1.38715435e38], [-1.07792002e38]]], jnp.float32)
  _, inv = jax.jit(lambda x: quantize_blocks(x, Layout(kind, fmt, 0, 2)))(x)
  amax = np.abs(np.asarray(x, np.float64))[0]
  if kind == "square":
    amax = np.full_like(amax, amax.max())
  np.testing.assert_allclose(np.asarray(inv, np.float64)[0],
                             amax / _fmax(fmt), rtol=1e-6)


# ------------------------------------------------------------------ the dots

RECIPES = ["tensor", "row", "block", "mx", "mx-floor"]


def _recipe(name: str, bs: int):
  return {"tensor": fp8.CurrentScaling(),
          "row": fp8.CurrentScaling(granularity="row"),
          "block": fp8.CurrentScaling(granularity="block", block_size=bs),
          "mx": fp8.MXFP8(),
          "mx-floor": fp8.MXFP8(scale_rounding="floor")}[name]


def _amax_per_element(a: np.ndarray, name: str, bs: int,
                      rhs: bool) -> np.ndarray:
  """An upper bound of the amax of each element's block (contracting axis
  0 for ``rhs``, 1 for the lhs)."""
  a = np.abs(a)
  if name == "tensor":
    return np.full_like(a, a.max())
  if rhs and name == "block":
    # bs x bs tiles: the amax over the whole contracting axis and the
    # tile's columns bounds every tile's.
    cols = a.max(axis=0)
    groups = np.arange(a.shape[1]) // bs
    tile = np.array([cols[groups == g].max() for g in groups])
    return np.broadcast_to(tile, a.shape)
  return np.broadcast_to(a.max(axis=0 if rhs else 1, keepdims=True), a.shape)


def _dot_bound(x, w, name, bs, out_dtype) -> tuple[np.ndarray, np.ndarray]:
  """(float64 reference, the error each output may have)."""
  fmt = E4M3
  u = _u(fmt)
  mx = name.startswith("mx")
  # A de-scale is at most amax / max (twice that for MX's rounded-up power
  # of two), never below 2**-126: an element's quantisation error is at
  # most u |v| + inv * sub / 2; "floor" saturates up to 1/8.
  rel = 0.125 if name == "mx-floor" else u
  hx = np.maximum(_amax_per_element(x, name, bs, False) / _fmax(fmt)
                  * (2 if mx else 1), 2.0 ** -126) * _sub(fmt) / 2
  hw = np.maximum(_amax_per_element(w, name, bs, True) / _fmax(fmt)
                  * (2 if mx else 1), 2.0 ** -126) * _sub(fmt) / 2
  ax, aw = np.abs(x), np.abs(w)
  ex, ew = rel * ax + hx, rel * aw + hw
  ref = x @ w
  bound = ex @ aw + ax @ ew + ex @ ew
  # float32 accumulation and the de-scales' roundings, the output dtype's
  # rounding, and results or partial products below float32's (or the
  # output dtype's) normal range, which may flush to zero.
  k = x.shape[1]
  out = jnp.finfo(out_dtype)
  bound += 1e-5 * (ax @ aw) + float(out.eps) * np.abs(ref)
  bound += (k + 4) * TINY32 + float(out.smallest_normal)
  return ref, bound


@st.composite
def _dot_cases(draw):
  name = draw(st.sampled_from(tuple(DTYPES)))
  dtype = DTYPES[name]
  lo, hi = _exponent_range(dtype)
  m, k, n = (draw(st.integers(1, 6)), draw(st.integers(1, 70)),
             draw(st.integers(1, 6)))
  ex = draw(st.integers(lo, hi))
  # The result's binade: within the output dtype's normal range, with room
  # for the sum of k terms (and for float32's when the operands are half).
  top = min(hi, 127) - 2 - math.ceil(math.log2(k))
  er = draw(st.integers(lo + 1, top))
  ew = min(max(er - ex, lo), hi)
  spread = draw(st.integers(0, 12))
  seed = draw(st.integers(0, 2**31))
  x = _values(seed, (m, k), ex, spread, dtype)
  w = _values(seed + 1, (k, n), ew, spread, dtype)
  return name, x, w


def _dot_within_tolerance(case, recipe_name, bs):
  name, x, w = case
  dtype = DTYPES[name]
  dot = fp8.dot_general(_recipe(recipe_name, bs))
  y = jax.jit(lambda a, b: dot(a, b, MATMUL))(jnp.asarray(x, dtype),
                                              jnp.asarray(w, dtype))
  assert y.dtype == dtype
  ref, bound = _dot_bound(x, w, recipe_name, bs, dtype)
  finite_ref = np.abs(ref) + bound <= float(jnp.finfo(dtype).max)
  got = np.asarray(y.astype(jnp.float32), np.float64)
  assert np.all(np.isfinite(got[finite_ref]))
  excess = (np.abs(got - ref) - bound)[finite_ref]
  assert np.all(excess <= 0), (np.max(excess), ref.flat[np.argmax(excess)])


@FAST
@hypothesis.given(_dot_cases(), st.sampled_from(RECIPES), st.integers(1, 40))
def test_fp8_dots_are_within_their_format_of_float64(case, recipe, bs):
  _dot_within_tolerance(case, recipe, bs)


@pytest.mark.slow
@DEEP
@hypothesis.given(_dot_cases(), st.sampled_from(RECIPES), st.integers(1, 40))
def test_fp8_dots_are_within_their_format_of_float64_deep(case, recipe, bs):
  _dot_within_tolerance(case, recipe, bs)


def _product_bound(a, b, fa, fb, rel_a, rel_b, mx):
  """The error bound of ``a @ b`` with ``a`` in format ``fa`` and ``b`` in
  ``fb``, each scaled by (at most) its own global amax."""
  def err(v, fmt, rel):
    inv = max(np.max(np.abs(v)) / _fmax(fmt) * (2 if mx else 1), 2.0 ** -126)
    return rel * np.abs(v) + inv * _sub(fmt) / 2
  ea, eb = err(a, fa, rel_a), err(b, fb, rel_b)
  aa, ab = np.abs(a), np.abs(b)
  return ea @ ab + aa @ eb + ea @ eb + 1e-5 * (aa @ ab)


@st.composite
def _grad_cases(draw):
  name = draw(st.sampled_from(tuple(DTYPES)))
  lo, hi = _exponent_range(DTYPES[name])
  m, k, n = (draw(st.integers(1, 6)), draw(st.integers(1, 70)),
             draw(st.integers(1, 6)))
  # Pairwise sums of the three binades cover the dtype's range.
  half = st.integers(lo // 2 + 4, (hi - 7) // 2)
  ex, ew, ec = draw(half), draw(half), draw(half)
  spread = draw(st.integers(0, 12))
  seed = draw(st.integers(0, 2**31))
  dtype = DTYPES[name]
  return (name, _values(seed, (m, k), ex, spread, dtype),
          _values(seed + 1, (k, n), ew, spread, dtype),
          _values(seed + 2, (m, n), ec, spread, dtype))


def _grads_within_tolerance(case, recipe_name, bs):
  name, x, w, c = case
  dtype = DTYPES[name]
  recipe = _recipe(recipe_name, bs)
  dot = fp8.dot_general(recipe)
  loss = lambda a, b: jnp.sum(
      dot(a, b, MATMUL).astype(jnp.float32) * jnp.asarray(c, dtype))
  gx, gw = jax.jit(jax.grad(loss, (0, 1)))(jnp.asarray(x, dtype),
                                          jnp.asarray(w, dtype))
  assert gx.dtype == dtype and gw.dtype == dtype
  fwd, bwd = recipe.fwd_dtype, recipe.bwd_dtype
  floor = recipe_name == "mx-floor"
  mx = recipe_name.startswith("mx")
  ru = lambda fmt: max(_u(fmt), 0.125) if floor else _u(fmt)
  out = jnp.finfo(dtype)
  for got, ref, bound in (
      (gx, c @ w.T, _product_bound(c, w.T, bwd, fwd, ru(bwd), ru(fwd), mx)),
      (gw, x.T @ c, _product_bound(x.T, c, fwd, bwd, ru(fwd), ru(bwd), mx))):
    size = max(x.shape[0], w.shape[1])
    bound = (bound + float(out.eps) * np.abs(ref) + (size + 4) * TINY32
             + float(out.smallest_normal))
    got = np.asarray(got.astype(jnp.float32), np.float64)
    keep = np.abs(ref) + bound <= float(out.max)
    assert np.all(np.isfinite(got[keep]))
    excess = (np.abs(got - ref) - bound)[keep]
    assert np.all(excess <= 0), (np.max(excess), ref.flat[np.argmax(excess)])


@FAST
@hypothesis.given(_grad_cases(), st.sampled_from(RECIPES), st.integers(1, 40))
def test_fp8_gradients_are_within_their_formats_of_float64(case, recipe, bs):
  _grads_within_tolerance(case, recipe, bs)


@pytest.mark.slow
@DEEP
@hypothesis.given(_grad_cases(), st.sampled_from(RECIPES), st.integers(1, 40))
def test_fp8_gradients_are_within_their_formats_of_float64_deep(case, recipe,
                                                                bs):
  _grads_within_tolerance(case, recipe, bs)


# ------------------------------------------------------------- inf and NaN

def _nonfinite_placement(recipe_name, bs, shape, seed, n_bad):
  m, k, n = shape
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = rng.standard_normal((k, n)).astype(np.float32)
  bad = [np.inf, -np.inf, np.nan]
  for _ in range(n_bad):
    target = x if rng.integers(2) else w
    i = tuple(rng.integers(0, s) for s in target.shape)
    target[i] = bad[rng.integers(3)]
  dot = fp8.dot_general(_recipe(recipe_name, bs))
  y = np.asarray(jax.jit(lambda a, b: dot(a, b, MATMUL))(x, w))
  bad_rows = ~np.isfinite(x).all(axis=1)
  bad_cols = ~np.isfinite(w).all(axis=0)
  if recipe_name == "tensor":
    poisoned = np.full((m, n), bad_rows.any() or bad_cols.any())
  else:
    if recipe_name == "block":   # the weight's bs x bs tiles span columns
      groups = np.arange(n) // bs
      bad_cols = np.array([bad_cols[groups == g].any() for g in groups])
    poisoned = bad_rows[:, None] | bad_cols[None, :]
  # A poisoned output is NaN (never a saturated finite value); every other
  # one is finite and as accurate as without the bad elements.
  assert np.all(np.isnan(y[poisoned]))
  clean = ~poisoned
  assert np.all(np.isfinite(y[clean]))
  if clean.any():
    xs, ws = np.where(np.isfinite(x), x, 0), np.where(np.isfinite(w), w, 0)
    ref = xs.astype(np.float64) @ ws.astype(np.float64)
    scale = np.abs(xs) @ np.abs(ws)
    # E4M3 rounds each operand by 1/16; "floor" saturates by up to 1/8.
    tol = 0.27 if recipe_name == "mx-floor" else 0.13
    assert np.all(np.abs(y - ref)[clean] <= tol * scale[clean] + 1e-6)


@FAST
@hypothesis.given(st.sampled_from(RECIPES), st.integers(1, 40),
                  st.tuples(st.integers(1, 5), st.integers(1, 70),
                            st.integers(1, 5)),
                  st.integers(0, 2**31), st.integers(0, 3))
def test_inf_and_nan_poison_exactly_their_blocks(recipe, bs, shape, seed,
                                                 n_bad):
  _nonfinite_placement(recipe, bs, shape, seed, n_bad)


@pytest.mark.slow
@DEEP
@hypothesis.given(st.sampled_from(RECIPES), st.integers(1, 40),
                  st.tuples(st.integers(1, 5), st.integers(1, 70),
                            st.integers(1, 5)),
                  st.integers(0, 2**31), st.integers(0, 3))
def test_inf_and_nan_poison_exactly_their_blocks_deep(recipe, bs, shape, seed,
                                                      n_bad):
  _nonfinite_placement(recipe, bs, shape, seed, n_bad)
