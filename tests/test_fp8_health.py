"""fp8.quantization_health per granularity: what each recipe's blocks lose."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmp_lite import fp8

ROW = fp8.CurrentScaling(granularity="row")
BLOCK = fp8.CurrentScaling(granularity="block")


def outlier_rows(rows=256, cols=256, outlier=1e6, seed=0):
  """Magnitudes in [0.1, 1] (no block of its own flushes), row 0 x outlier."""
  rng = np.random.default_rng(seed)
  x = rng.uniform(0.1, 1.0, (rows, cols)) * rng.choice([-1, 1], (rows, cols))
  x[0] *= outlier
  return jnp.asarray(x, jnp.float32)


def test_an_outlier_row_flushes_the_other_rows_per_tensor_only():
  x = outlier_rows()
  # Per tensor: at the tensor's scale, every other row flushes to zero.
  rows = {i: x[i] for i in range(1, x.shape[0])}
  per_row = fp8.quantization_health(rows, amax=float(jnp.max(jnp.abs(x))))
  assert all(float(f) == 1.0 for f in per_row.flushed.values())
  h = fp8.quantization_health(x)
  assert float(h.flushed) == pytest.approx(255 / 256)
  assert (int(h.blocks), float(h.flushed_blocks)) == (1, 1.0)
  assert float(h.saturated) == float(h.saturated_blocks) == 0.0
  # Row, 1x128 strips and MX blocks: the outlier stays in its own blocks.
  for recipe, blocks in ((ROW, 256), (BLOCK, 512), (fp8.MXFP8(), 2048)):
    for operand in ("lhs", "grad"):
      h = fp8.quantization_health(x, recipe=recipe, operand=operand)
      assert int(h.blocks) == blocks, (recipe, operand)
      assert float(h.flushed) == float(h.flushed_blocks) == 0.0
      assert float(h.saturated_blocks) == 0.0
      assert float(h.amax) == float(jnp.max(jnp.abs(x)))
  # 128x128 weight tiles (axis=-1: rows are the free dimension): the two
  # tiles holding the outlier row flush their other 127 rows.
  h = fp8.quantization_health(x, recipe=BLOCK, operand="rhs", axis=-1)
  assert int(h.blocks) == 4
  assert float(h.flushed_blocks) == 0.5
  assert float(h.flushed) == pytest.approx(127 / 256)
  # The same weight as the kernel of x @ w (contracting axis 0, default).
  h = fp8.quantization_health(x.T, recipe=BLOCK, operand="rhs")
  assert (int(h.blocks), float(h.flushed_blocks)) == (4, 0.5)


def test_row_scales_follow_the_contracting_axis():
  x = outlier_rows(rows=8, cols=16, outlier=1e8)
  # Rows along the last axis isolate the outlier; along axis 0 each "row"
  # (a column) holds one outlier element and flushes its other elements.
  assert float(fp8.quantization_health(x, recipe=ROW).flushed) == 0.0
  h = fp8.quantization_health(x, recipe=ROW, axis=0)
  assert int(h.blocks) == 16
  assert float(h.flushed_blocks) == 1.0
  assert float(h.flushed) == pytest.approx(7 / 8)


def test_mx_floor_rounding_saturates_where_up_does_not():
  # A block amax of 1.9 * 2**k: floor's scale puts it at 1.9 * 256 = 486.4,
  # past E4M3's 448 (and its rounding midpoint, 464); "up" doubles it.
  x = jnp.concatenate([jnp.full((31,), 0.5), jnp.array([1.9])]) * 2.0 ** 5
  x = jnp.stack([x, x / 1.9])  # the second block's amax is a power of two
  floor = fp8.quantization_health(x, recipe=fp8.MXFP8(scale_rounding="floor"))
  assert (int(floor.blocks), float(floor.saturated_blocks)) == (2, 0.5)
  assert float(floor.saturated) == pytest.approx(1 / 64)
  up = fp8.quantization_health(x, recipe=fp8.MXFP8())
  assert float(up.saturated) == float(up.saturated_blocks) == 0.0


def test_scaling_by_its_own_amax_never_reports_saturation():
  # fp32's 448 / amax * amax can land one ulp above 448 (one amax in ten);
  # that rounds to 448 and is no saturation.
  amaxes = np.random.default_rng(1).uniform(1e-3, 1e3, 64)
  tree = [jnp.array([a, a / 3], jnp.float32) for a in amaxes]
  for recipe in (None, ROW, BLOCK, fp8.MXFP8()):
    h = fp8.quantization_health(tree, recipe=recipe)
    assert max(float(s) for s in h.saturated) == 0.0, recipe


def test_recipe_formats_per_operand_and_delayed_scaling():
  x = {"g": jnp.array([1.0, 1e-6, 1e-5, 2.0])}
  # The gradient's format is the recipe's backward one (E5M2: more range).
  e5 = fp8.quantization_health(x, jnp.float8_e5m2)
  grad = fp8.quantization_health(x, recipe=fp8.CurrentScaling(),
                                 operand="grad")
  assert jax.tree.map(float, grad) == jax.tree.map(float, e5)
  assert float(grad.flushed["g"]) == 0.0
  lhs = fp8.quantization_health(x, recipe=fp8.CurrentScaling())
  assert float(lhs.flushed["g"]) == 0.25
  # DelayedScaling is per tensor and takes a history's amax.
  stale = fp8.quantization_health(x, recipe=fp8.DelayedScaling(), amax=1.0)
  assert float(stale.saturated["g"]) == 0.25
  assert float(stale.saturated_blocks["g"]) == 1.0
  margin = fp8.quantization_health(x, recipe=fp8.CurrentScaling(margin=8))
  # Scale 448 / 2 / 2**8: 1e-5 now flushes too, and nothing is subnormal.
  assert float(margin.flushed["g"]) == 0.5
  assert float(margin.subnormal["g"]) == 0.0


def test_leaves_of_any_rank_partial_tiles_and_jit():
  tree = {"w": jnp.ones((130, 200)), "b": jnp.ones((200,)),
          "s": jnp.float32(2.0), "step": jnp.int32(1)}
  health = jax.jit(functools.partial(fp8.quantization_health, recipe=BLOCK,
                                     operand="rhs"))
  h = health(tree)
  assert h.blocks["step"] is None and h.flushed["step"] is None
  # w: contracting 130 -> 2 strips of 128, 200 free -> 2 tiles: 4 tiles.
  assert {k: int(v) for k, v in h.blocks.items() if v is not None} == {
      "w": 4, "b": 2, "s": 1}
  assert h.blocks["w"].dtype == jnp.int32
  assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(h.flushed))
  assert float(h.flushed["w"]) == 0.0
  eager = fp8.quantization_health(tree, recipe=BLOCK, operand="rhs")
  assert jax.tree.map(float, h) == jax.tree.map(float, eager)


def test_nonfinite_leaves():
  x = jnp.array([[1.0, jnp.inf, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0]])
  for recipe in (None, ROW, fp8.MXFP8()):
    h = fp8.quantization_health(x, recipe=recipe)
    assert float(h.saturated) == pytest.approx(1 / 8), recipe
    assert not np.isnan(float(h.flushed))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"operand": "weight"}, ValueError, "operand must be one of"),
    ({"recipe": "fp8"}, TypeError, "recipe"),
    ({"recipe": ROW, "dtype": jnp.float8_e5m2}, ValueError,
     "dtype and margin from the recipe"),
    ({"recipe": fp8.CurrentScaling(), "margin": 1}, ValueError,
     "dtype and margin from the recipe"),
    ({"recipe": fp8.MXFP8(), "amax": 1.0}, ValueError, "per-tensor"),
    ({"recipe": ROW, "axis": 2}, ValueError, "out of range"),
    ({"recipe": ROW, "axis": "0"}, TypeError, "axis must be an int"),
    ({"recipe": ROW, "axis": True}, TypeError, "axis must be an int"),
    ({"dtype": jnp.bfloat16}, TypeError, "dtype must be one of the FP8"),
    ({"margin": -1}, ValueError, "margin"),
])
def test_bad_arguments(kwargs, error, match):
  with pytest.raises(error, match=match):
    fp8.quantization_health(jnp.ones((2, 4)), **kwargs)
