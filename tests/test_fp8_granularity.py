"""jmp_lite.fp8 finer than per tensor: row, block (DeepSeek-V3) and MXFP8."""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jmp_lite import fp8
from jmp_lite._lowbit import mx_exponent
from jmp_lite.fp8._blocked import (
  batched_dot,
  Layout,
  looped_dot,
  quantize_blocks,
  scaled_dot,
)
from tests.test_fp8 import dot_operand_dtypes, MATMUL, normal, rel_err

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
FP8_NAMES = {d.name for d in fp8.FP8_DTYPES}

FINE = {
    "row": fp8.CurrentScaling(granularity="row"),
    "block": fp8.CurrentScaling(granularity="block", block_size=32),
    "mx": fp8.MXFP8(),
}
ALL = {"tensor": fp8.CurrentScaling(), **FINE}


def dot(recipe, x, w, dims=MATMUL):
  return fp8.dot_general(recipe)(x, w, dims)


# ------------------------------------------------------------------ recipes

def test_recipes_are_frozen_values_equal_and_hashable():
  assert fp8.MXFP8() == fp8.MXFP8()
  assert hash(fp8.MXFP8()) == hash(fp8.MXFP8())
  a = fp8.CurrentScaling(granularity="block", block_size=64)
  assert a == fp8.CurrentScaling(granularity="block", block_size=64)
  assert len({a, fp8.CurrentScaling(granularity="block", block_size=64),
              fp8.CurrentScaling(granularity="row")}) == 2
  assert fp8.CurrentScaling() == fp8.CurrentScaling(granularity="tensor")
  with pytest.raises(AttributeError):
    a.granularity = "row"  # type: ignore[misc]
  with pytest.raises(AttributeError):
    fp8.MXFP8().scale_rounding = "floor"  # type: ignore[misc]
  assert fp8.GRANULARITIES == ("tensor", "row", "block")


@pytest.mark.parametrize("make, error, match", [
    (lambda: fp8.CurrentScaling(granularity="bogus"), ValueError,
     "granularity"),
    (lambda: fp8.CurrentScaling(granularity=None),  # type: ignore[arg-type]
     ValueError, "granularity"),
    (lambda: fp8.CurrentScaling(granularity="block", block_size=0),
     ValueError, "block_size"),
    (lambda: fp8.CurrentScaling(block_size=-4), ValueError, "block_size"),
    (lambda: fp8.CurrentScaling(block_size=2.5),  # type: ignore[arg-type]
     TypeError, "block_size"),
    (lambda: fp8.MXFP8(scale_rounding="down"), ValueError, "scale_rounding"),
    (lambda: fp8.MXFP8(fwd_dtype=jnp.float8_e4m3fnuz), ValueError, "OCP"),
    (lambda: fp8.MXFP8(bwd_dtype=jnp.bfloat16), TypeError, "FP8"),
])
def test_bad_recipe_values_raise_at_construction(make, error, match):
  with pytest.raises(error, match=match):
    make()


def test_stateless_recipes_refuse_a_state():
  state = fp8.DelayedScaling(history=2).init()
  with pytest.raises(TypeError, match="MXFP8 is stateless"):
    fp8.dot_general(fp8.MXFP8(), state)


# --------------------------------------------------------- MX scale exponent

def test_mx_scales_are_powers_of_two_rounded_up():
  x = normal(0, (3, 5, 96), scale=7.0) * jnp.logspace(-6, 6, 96)
  _, inv = quantize_blocks(x, Layout("mx", E4M3, bs=32))
  mant, _ = np.frexp(np.asarray(inv, np.float64))
  assert np.all(mant == 0.5)  # Every scale is exactly a power of two.
  blocks = np.abs(np.asarray(x)).reshape(3, 5, 3, 32).max(-1)
  # Nothing overflows (amax / scale <= 448), and half the scale would.
  assert np.all(blocks / np.asarray(inv) <= 448)
  assert np.all(blocks / (np.asarray(inv) / 2) > 448)


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_mx_exponent_boundaries_are_exact(dtype):
  fmax = np.float32(jnp.finfo(dtype).max)
  for k in (-20, 0, 7):
    edge = np.float32(fmax * np.float32(2.0 ** k))
    above = np.nextafter(edge, np.float32(np.inf))
    below = np.nextafter(edge, np.float32(0))
    got = mx_exponent(jnp.array([below, edge, above]), dtype).tolist()
    assert got == [k, k, k + 1]
  # OCP's floor rule: the binade of amax decides; one ulp above a power of
  # two stays in it, the power of two itself starts it.
  emax = int(np.floor(np.log2(float(fmax))))
  two = np.float32(2.0 ** 5)
  got = mx_exponent(jnp.array([np.nextafter(two, np.float32(0)), two,
                               np.nextafter(two, np.float32(64))]),
                    dtype, "floor").tolist()
  assert got == [4 - emax, 5 - emax, 5 - emax]


def test_mx_exponent_of_zero_subnormal_and_nonfinite():
  tiny = np.float32(2.0 ** -140)  # A float32 subnormal.
  got = mx_exponent(jnp.array([0.0, tiny, np.inf, np.nan], jnp.float32),
                    E4M3).tolist()
  assert got == [-127, -127, 128, 128]  # Clamped to E8M0; 128: NaN.
  q, inv = quantize_blocks(jnp.array([[[1.0, np.inf] + [0.0] * 30]]),
                           Layout("mx", E4M3, bs=32))
  assert np.isnan(float(inv[0, 0, 0]))


def ocp_mx_reference(x: np.ndarray, rounding: str) -> np.ndarray:
  """Quantise-dequantise of 1-D ``x`` (a multiple of 32) by the MX rules.

  Written from the OCP Microscaling Formats v1.0 specification (section
  6.3: shared exponent ``floor(log2(amax)) - emax_elem``, clamped to
  E8M0's range, elements ``x / 2**shared`` converted to E4M3 with
  round-to-nearest-even and saturation) and, for ``"up"``, arXiv
  2506.08027's rounded-up exponent (the smallest ``e`` with ``amax / 2**e
  <= 448``). Float64 and ml_dtypes; nothing from jmp_lite.
  """
  out = np.empty_like(x, np.float64)
  for start in range(0, x.size, 32):
    block = x[start:start + 32].astype(np.float64)
    amax = float(np.max(np.abs(block)))
    if amax == 0:
      shared = -127
    else:
      _, e = math.frexp(amax)  # amax = m * 2**e, m in [0.5, 1).
      shared = (e - 1) - 8
      if rounding == "up" and amax > 448.0 * 2.0 ** shared:
        shared += 1
    shared = min(max(shared, -127), 127)
    elems = np.clip(block / 2.0 ** shared, -448, 448)
    q = elems.astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    out[start:start + 32] = q.astype(np.float64) * 2.0 ** shared
  return out


@pytest.mark.parametrize("rounding", ["up", "floor"])
def test_mx_quantize_dequantize_matches_an_ocp_reference(rounding):
  rng = np.random.default_rng(3)
  x = (rng.standard_normal(32 * 64)
       * np.repeat(2.0 ** rng.integers(-30, 30, 64), 32)).astype(np.float32)
  x[5] = 448 * 2.0 ** -3  # A block whose amax is exactly max * 2**k,
  x[40] = np.nextafter(np.float32(448 * 2.0 ** 2), np.float32(1e9))  # ulp up.
  x[64:96] = 0
  q, inv = quantize_blocks(jnp.asarray(x)[None, None],
                           Layout("mx", E4M3, bs=32, rounding=rounding))
  got = (np.asarray(q, np.float64) * np.asarray(inv, np.float64)[..., None])
  np.testing.assert_array_equal(got.reshape(-1),
                                ocp_mx_reference(x, rounding))


@pytest.mark.parametrize("lhs_dtype", [E4M3, np.dtype(jnp.float8_e5m2)])
def test_mx_block_scaled_dot_equals_the_batched_formulation(lhs_dtype):
  # MX goes through XLA's block-scaled dot; its numbers must be those of one
  # FP8 product per block, de-scaled and summed in float32 (the order of
  # the float32 sums aside), on a contracting size that needs padding, with
  # blocks scaled from 2**-100 to 2**100.
  rng = np.random.default_rng(5)
  a = (rng.standard_normal((2, 12, 72))
       * 2.0 ** rng.integers(-100, 100, (2, 12, 1))).astype(np.float32)
  b = rng.standard_normal((2, 9, 72)).astype(np.float32)
  qa, ia = quantize_blocks(jnp.asarray(a), Layout("mx", lhs_dtype, bs=32))
  qb, ib = quantize_blocks(jnp.asarray(b), Layout("mx", E4M3, bs=32))
  got = np.asarray(jax.jit(scaled_dot)(qa, ia, qb, ib), np.float64)
  want = np.asarray(jax.jit(batched_dot)(qa, ia, qb, ib), np.float64)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
  a[1, 4, 40] = np.inf  # A non-finite block: its row comes back NaN.
  qa, ia = quantize_blocks(jnp.asarray(a), Layout("mx", lhs_dtype, bs=32))
  got = np.asarray(scaled_dot(qa, ia, qb, ib))
  assert np.isnan(got[1, 4]).all()
  assert np.isfinite(np.delete(got[1], 4, 0)).all()


def test_block_by_block_loop_equals_the_batched_formulation():
  # "block" sums its blocks in a scan (one float32 accumulator); the numbers
  # are the batched dot's, summation order aside, edge tiles included.
  rng = np.random.default_rng(6)
  a = rng.standard_normal((2, 40, 200)).astype(np.float32)
  b = (rng.standard_normal((2, 24, 200))
       * 2.0 ** rng.integers(-20, 20, (2, 24, 1))).astype(np.float32)
  qa, ia = quantize_blocks(jnp.asarray(a), Layout("vector", E4M3, bs=64))
  qb, ib = quantize_blocks(jnp.asarray(b), Layout("square", E4M3, bs=64))
  assert qa.shape[2] == 4  # 200 = 3 whole blocks and a padded one.
  got = np.asarray(jax.jit(looped_dot)(qa, ia, qb, ib), np.float64)
  want = np.asarray(jax.jit(batched_dot)(qa, ia, qb, ib), np.float64)
  np.testing.assert_allclose(got, want, rtol=1e-5,
                             atol=1e-6 * np.abs(want).max())


# ----------------------------------------------------------------- numerics

def outlier_operands(seed=0):
  x = np.array(normal(seed, (16, 256)))
  w = np.array(normal(seed + 1, (256, 64)))
  x[3] *= 1e5  # One outlier row of the activation,
  w[:32, :32] *= 1e5  # and one outlier block of the weight.
  return jnp.asarray(x), jnp.asarray(w)


def test_fine_granularities_keep_the_rows_an_outlier_ruins_per_tensor():
  x, w = outlier_operands()
  ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  rows = np.arange(16) != 3
  cols = slice(32, None)  # Away from the weight's outlier block.
  errs = {name: rel_err(
      np.asarray(jax.jit(functools.partial(dot, r))(x, w))[rows][:, cols],
      ref[rows][:, cols]) for name, r in ALL.items()}
  assert errs["tensor"] > 0.5, errs  # Small values flushed to zero.
  for name in FINE:
    # E4M3's 3 mantissa bits: a few percent at most.
    assert errs[name] < 0.05, errs
    assert errs[name] < errs["tensor"] / 10, errs


@pytest.mark.parametrize("name", list(FINE))
def test_gradients_inside_shard_map_equal_the_unmapped_ones(name):
  # A batch that varies over the mesh axis times a replicated weight, as in
  # data parallelism under shard_map (check_vma): the dots' results and
  # gradients must carry the axis they vary over (JAX's lax.scaled_dot, MX's
  # dot, forgets it), and the weight's gradient is summed over it. Shapes
  # that reach the GPU kernel of "block" (two blocks, 32 rows and columns):
  # lax.platform_dependent traces it on every platform, and its output
  # type lacked the axis.
  from jax.sharding import PartitionSpec as P
  recipe = FINE[name]
  mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
  x, w = normal(1, (32, 64)), normal(2, (64, 32))

  def loss(x, w):
    return jnp.sum(dot(recipe, x, w) ** 2)

  def mapped(x, w):
    gx, gw = jax.grad(loss, argnums=(0, 1))(x, w)
    return gx, jax.lax.psum(gw, "data")

  got = jax.jit(jax.shard_map(mapped, mesh=mesh, in_specs=(P("data"), P()),
                              out_specs=(P("data"), P())))(x, w)
  want = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(FINE))
def test_gradients_are_close_to_float32_s(name):
  recipe = FINE[name]
  x, w = normal(1, (24, 96)), normal(2, (96, 40), scale=0.1)
  t = normal(3, (24, 40))

  def loss(dot_fn, x, w):
    return jnp.sum((dot_fn(x, w, MATMUL) - t) ** 2)

  # Under jit: eagerly each op of the quantisation compiles alone (the eager
  # path is checked against the jitted one in test_jit_vmap_and_dtypes).
  grad = jax.jit(jax.grad(loss, argnums=(1, 2)), static_argnums=0)
  got = grad(fp8.dot_general(recipe), x, w)
  want = grad(jax.lax.dot_general, x, w)
  for g, r in zip(got, want, strict=True):
    assert g.dtype == jnp.float32
    assert 0 < rel_err(g, r) < 0.1


@pytest.mark.parametrize("name", list(FINE))
def test_forward_and_backward_dots_take_8_bit_operands(name):
  recipe = FINE[name]
  x = normal(1, (8, 64), jnp.bfloat16)
  w = normal(2, (64, 16), jnp.bfloat16)
  fn = jax.value_and_grad(
      lambda x, w: dot(recipe, x, w).astype(jnp.float32).sum(), argnums=(0, 1))
  found = dot_operand_dtypes(jax.make_jaxpr(fn)(x, w))
  assert len(found) == 3  # Forward, input gradient, weight gradient.
  assert all(set(pair) <= FP8_NAMES for pair in found), found
  text = jax.jit(fn).lower(x, w).as_text()
  # MX's blocks go to XLA's block-scaled dot, a composite whose operands are
  # the FP8 values and E8M0 scales (a backend without such GEMMs expands it).
  marker = ('stablehlo.composite "xla.scaled_dot"' if name == "mx"
            else "stablehlo.dot_general")
  dots = [ln for ln in text.splitlines() if marker in ln]
  assert len(dots) == 3 and all(ln.count("f8E") >= 2 for ln in dots), dots
  if name == "mx":
    assert all(ln.count("f8E8M0FNU") == 2 for ln in dots), dots


def test_backward_uses_the_recipes_gradient_format():
  recipe = fp8.CurrentScaling(granularity="row")
  x, w = normal(1, (8, 64)), normal(2, (64, 16))
  found = dot_operand_dtypes(jax.make_jaxpr(jax.grad(
      lambda x: dot(recipe, x, w).sum()))(x))
  assert ("float8_e5m2", "float8_e4m3fn") in found  # d x = g . w^T
  mx = fp8.MXFP8(bwd_dtype=jnp.float8_e5m2)
  found = dot_operand_dtypes(jax.make_jaxpr(jax.grad(
      lambda x: dot(mx, x, w).sum()))(x))
  assert ("float8_e5m2", "float8_e4m3fn") in found


def test_block_scales_are_per_tile():
  # block: the weight in 32x32 tiles, the activation in 1x32 strips.
  recipe = fp8.CurrentScaling(granularity="block", block_size=32)
  w = np.array(normal(4, (64, 64)))
  w[0, 0] = 1e6  # Ruins only its own 32x32 tile.
  x = jnp.eye(64)
  got = np.asarray(dot(recipe, x, jnp.asarray(w)))
  rest = np.ones((64, 64), bool)
  rest[:32, :32] = False
  assert rel_err(got[rest], w[rest]) < 0.05
  assert rel_err(got[:32, :32][1:], w[:32, :32][1:]) > 0.5


@pytest.mark.parametrize("shape", [((5, 70), (70, 3)), ((33, 129), (129, 47)),
                                   ((1, 31), (31, 1))])
@pytest.mark.parametrize("name", list(FINE))
def test_sizes_not_multiples_of_the_block(name, shape):
  # Partial edge tiles (block) and zero-padded contracting blocks (MX).
  x, w = normal(5, shape[0]), normal(6, shape[1])
  got = jax.jit(functools.partial(dot, FINE[name]))(x, w)
  assert got.shape == (shape[0][0], shape[1][1])
  assert rel_err(got, x @ w) < 0.1


@pytest.mark.parametrize("name", list(FINE))
def test_any_dimension_numbers(name):
  # Batch dims, several contracting dims, free dims on both sides.
  recipe = FINE[name]
  x, w = normal(7, (2, 3, 5, 20)), normal(8, (2, 20, 5, 4))
  dims = (((2, 3), (2, 1)), ((0,), (0,)))
  want = jax.lax.dot_general(x, w, dims)
  fp8_dot = lambda x, w: fp8.dot_general(recipe)(x, w, dims)
  got = jax.jit(fp8_dot)(x, w)
  assert got.shape == want.shape == (2, 3, 4)
  assert rel_err(got, want) < 0.1
  gx, gw = jax.jit(jax.grad(lambda x, w: fp8_dot(x, w).sum(),
                            argnums=(0, 1)))(x, w)
  rx, rw = jax.jit(jax.grad(
      lambda x, w: jax.lax.dot_general(x, w, dims).sum(), argnums=(0, 1)))(
          x, w)
  assert rel_err(gx, rx) < 0.1 and rel_err(gw, rw) < 0.1


@pytest.mark.parametrize("name", list(FINE))
def test_jit_vmap_and_dtypes(name):
  recipe = FINE[name]
  x = normal(9, (4, 6, 40), jnp.bfloat16)
  w = normal(10, (40, 8), jnp.bfloat16)
  eager = jax.vmap(lambda x: dot(recipe, x, w))(x)
  jitted = jax.jit(jax.vmap(lambda x: dot(recipe, x, w)))(x)
  assert eager.dtype == jnp.bfloat16 and eager.shape == (4, 6, 8)
  np.testing.assert_array_equal(np.asarray(eager, np.float32),
                                np.asarray(jitted, np.float32))
  g = jax.jit(jax.grad(lambda w: jax.vmap(
      lambda x: dot(recipe, x, w))(x).astype(jnp.float32).sum()))(w)
  assert g.dtype == jnp.bfloat16 and g.shape == w.shape


@pytest.mark.parametrize("name", list(FINE))
def test_zeros_and_nonfinite(name):
  recipe = FINE[name]
  x, w = normal(11, (4, 64)), normal(12, (64, 4))
  assert float(jnp.abs(dot(recipe, jnp.zeros_like(x), w)).max()) == 0.0
  bad = dot(recipe, x.at[0, 0].set(jnp.inf), w)
  assert bool(jnp.isnan(bad[0]).all())


def test_tensor_granularity_is_todays_program():
  # "tensor" is the default and runs the per-tensor path unchanged.
  x, w = normal(13, (8, 32)), normal(14, (32, 8))
  a = jax.make_jaxpr(lambda x, w: dot(fp8.CurrentScaling(), x, w))(x, w)
  b = jax.make_jaxpr(lambda x, w: dot(
      fp8.CurrentScaling(granularity="tensor", block_size=7), x, w))(x, w)
  assert str(a) == str(b)
  assert len(dot_operand_dtypes(a)) == 1
