"""The block-scaled FP8 GEMM kernel ("block" recipes on GPUs): the sums
looped_dot makes, in Pallas' interpreter here, compiled on a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmp_lite import fp8
from jmp_lite.fp8._block_gemm import block_scaled_dot, tile_sizes
from jmp_lite.fp8._blocked import Layout, looped_dot, quantize_blocks
from tests.conftest import lowered_for_h100
from tests.test_fp8 import rel_err

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)


def _operands(seed, b, p, q, c, lhs=E4M3, rhs_kind="square", bs=64):
  rng = np.random.default_rng(seed)
  # Rows and columns whose magnitudes span 2**-20..2**20: the per-block
  # factors matter.
  a = (rng.standard_normal((b, p, c))
       * 2.0 ** rng.integers(-20, 20, (b, p, 1))).astype(np.float32)
  w = (rng.standard_normal((b, q, c))
       * 2.0 ** rng.integers(-20, 20, (b, q, 1))).astype(np.float32)
  qa, ia = quantize_blocks(jnp.asarray(a), Layout("vector", lhs, bs=bs))
  qb, ib = quantize_blocks(jnp.asarray(w), Layout(rhs_kind, E4M3, bs=bs))
  return qa, ia, qb, ib


@pytest.mark.parametrize("shape,lhs,rhs_kind", [
    ((1, 40, 24, 200), E4M3, "square"),   # edge tiles, a padded block
    ((2, 32, 16, 128), E5M2, "square"),   # a batch; gradient format lhs
    ((1, 48, 40, 192), E5M2, "vector"),   # the weight gradient's layouts
])
def test_kernel_sums_what_looped_dot_sums(shape, lhs, rhs_kind):
  qa, ia, qb, ib = _operands(0, *shape, lhs=lhs, rhs_kind=rhs_kind)
  got = np.asarray(block_scaled_dot(qa, ia, qb, ib, interpret=True))
  want = np.asarray(jax.jit(looped_dot)(qa, ia, qb, ib))
  assert got.shape == want.shape == shape[:3] and got.dtype == np.float32
  # Block by block in the same order; within a block the dot's own order.
  np.testing.assert_allclose(got, want, rtol=1e-5,
                             atol=1e-6 * np.abs(want).max())


def test_a_nonfinite_block_poisons_its_row_only():
  qa, ia, qb, ib = _operands(1, 1, 32, 16, 128)
  ia = ia.at[0, 5, 1].set(jnp.nan)  # what quantize_blocks gives an inf block
  got = np.asarray(block_scaled_dot(qa, ia, qb, ib, interpret=True))
  assert np.isnan(got[0, 5]).all()
  assert np.isfinite(np.delete(got[0], 5, 0)).all()


def test_unknown_scaling_is_refused():
  qa, ia, qb, ib = _operands(4, 1, 16, 16, 64)
  with pytest.raises(ValueError, match="scaling must be 'safe' or 'product'"):
    block_scaled_dot(qa, ia, qb, ib, interpret=True, scaling="exact")


@pytest.mark.parametrize("block,tiles,bad", [
    (24, None, "'block size': 24"), (32, (48, 64), "'tile rows': 48"),
    (32, (128, 100), "'tile columns': 100")])
def test_sizes_triton_cannot_tile_are_refused(block, tiles, bad):
  qa, ia, qb, ib = _operands(4, 1, 32, 32, 2 * block, bs=block)
  with pytest.raises(ValueError, match=f"powers of two, got .*{bad}"):
    block_scaled_dot(qa, ia, qb, ib, tiles=tiles)


def test_tile_sizes_are_powers_of_two_between_16_and_the_measured_best():
  assert tile_sizes(8192, 4096) == (128, 64)
  assert tile_sizes(3, 100) == (16, 64)
  assert tile_sizes(40, 17) == (64, 32)


@pytest.mark.skipif(jax.__version_info__ < (0, 11),
                    reason="JAX 0.10's CPU wheel has no Triton lowering")
def test_kernel_lowers_for_a_gpu():
  # Triton takes only power-of-two tiles and a subset of primitives: lower
  # a Llama-sized projection (11008 = 86 blocks of 128) for an H100.
  args = (jax.ShapeDtypeStruct((1, 4096, 86, 128), E5M2),
          jax.ShapeDtypeStruct((1, 4096, 86), jnp.float32),
          jax.ShapeDtypeStruct((1, 300, 86, 128), E4M3),
          jax.ShapeDtypeStruct((1, 300, 86), jnp.float32))
  assert lowered_for_h100(block_scaled_dot, *args).count(
      "xla.gpu.triton") == 1


@pytest.mark.skipif(jax.__version_info__ < (0, 11),
                    reason="JAX 0.10's CPU wheel has no Triton lowering")
@pytest.mark.parametrize("formats,kernels", [
    ({}, 3),
    # Triton converts no fnuz format (the kernel's E5M2 x E4M3 product goes
    # through float16): the scan, not a kernel that cannot lower.
    (dict(fwd_dtype=jnp.float8_e4m3fnuz, bwd_dtype=jnp.float8_e5m2fnuz), 0)])
def test_block_recipe_picks_the_kernel_by_lowering_platform(formats, kernels):
  # Lowered for a CUDA GPU, the three matmuls of a "block" dot (forward,
  # input and weight gradients) are Triton kernels; lowered for the CPU,
  # the same function has none: the platform decides, not the default
  # backend of the process.
  recipe = fp8.CurrentScaling(granularity="block", **formats)

  def loss(x, w):
    return fp8.dot_general(recipe)(
        x, w, (((1,), (0,)), ((), ()))).astype(jnp.float32).sum()

  fn = jax.value_and_grad(loss, argnums=(0, 1))
  args = (jnp.ones((256, 512), jnp.bfloat16), jnp.ones((512, 384),
                                                         jnp.bfloat16))
  assert lowered_for_h100(fn, *args).count("xla.gpu.triton") == kernels
  cpu = jax.export.export(jax.jit(fn), platforms=["cpu"])(*args)
  assert "triton" not in cpu.mlir_module()


@pytest.mark.skipif(jax.default_backend() != "gpu",
                    reason="the compiled kernel: a GPU")
def test_block_recipe_runs_the_kernel_on_gpu():
  recipe = fp8.CurrentScaling(granularity="block")
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.standard_normal((256, 512)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((512, 384)), jnp.bfloat16)

  def loss(x, w):
    return fp8.dot_general(recipe)(
        x, w, (((1,), (0,)), ((), ()))).astype(jnp.float32).sum()

  fn = jax.value_and_grad(loss, argnums=(0, 1))
  # Forward, input and weight gradients: three kernels.
  assert str(jax.make_jaxpr(fn)(x, w)).count("pallas_call") == 3
  _, (dx, dw) = fn(x, w)
  y = jax.jit(lambda x, w: fp8.dot_general(recipe)(
      x, w, (((1,), (0,)), ((), ()))))(x, w)
  x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)
  ones = jnp.ones((256, 384), jnp.float32)
  # E4M3's 3 mantissa bits: a few percent, as looped_dot's on the CPU.
  assert rel_err(y, x32 @ w32) < 0.05
  assert rel_err(dx, ones @ w32.T) < 0.05
  assert rel_err(dw, x32.T @ ones) < 0.05
