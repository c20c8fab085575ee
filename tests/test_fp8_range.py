"""FP8 matmuls at the edges of float32's range.

Each recipe scales its operands into the FP8 format and de-scales the
product; wherever the exact result is a normal float32, neither the scales
nor their products may under- or overflow on the way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmp_lite import fp8
from jmp_lite.fp8._blocked import dequantize_blocks, Layout, quantize_blocks

MATMUL = (((1,), (0,)), ((), ()))
E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
F32_MAX = float(np.finfo(np.float32).max)

RECIPES = {
    "tensor": fp8.CurrentScaling(),
    "delayed": fp8.DelayedScaling(history=4),
    "row": fp8.CurrentScaling(granularity="row"),
    "block": fp8.CurrentScaling(granularity="block", block_size=32),
    "mx": fp8.MXFP8(),
    "mx-floor": fp8.MXFP8(scale_rounding="floor"),
}


def _dot(recipe):
  state = recipe.init() if isinstance(recipe, fp8.DelayedScaling) else None
  return jax.jit(lambda x, w: fp8.dot_general(recipe, state)(x, w, MATMUL))


def _operands(x_scale, w_scale, k=64, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.uniform(0.5, 1.0, (4, k)) * x_scale
  w = rng.uniform(0.5, 1.0, (k, 3)) * w_scale
  return x.astype(np.float32), w.astype(np.float32)


# (x's magnitude, w's magnitude): exact results 1e-35 .. 1e36, all normal.
EDGES = {
    # The de-scales' product (~2e-39) is a float32 subnormal, flushed.
    "tiny-times-one": (4e-34, 1.0),
    # MX: the lhs blocks' scale would be 2**-127, a subnormal.
    "mx-subnormal-scale": (1e-37, 1.0),
    "tiny-times-large": (3e-37, 1e3),
    # Row/block: (product * lhs de-scale) overflows before the rhs's.
    "huge-times-small": (1e35, 4e-1),
    # Near float32's max: the de-scales' product overflows; an MX element
    # rounded up to 2**128 in FP8 would dequantise to inf.
    "max-times-tiny": (F32_MAX, 1e-7),
    "tiny-times-max": (1e-7, F32_MAX),
}


@pytest.mark.parametrize("edge", list(EDGES))
@pytest.mark.parametrize("name", list(RECIPES))
def test_forward_is_accurate_where_the_exact_result_is_normal(name, edge):
  x, w = _operands(*EDGES[edge])
  exact = x.astype(np.float64) @ w.astype(np.float64)
  assert np.all((np.abs(exact) > 1e-37) & (np.abs(exact) < 1e37))
  got = np.asarray(_dot(RECIPES[name])(x, w), np.float64)
  # E4M3 rounds each operand by at most 1/16 relative (one ulp at the very
  # top of float32's range for MX); all-positive operands: no cancellation.
  np.testing.assert_allclose(got, exact, rtol=0.13)


@pytest.mark.parametrize("edge", ["tiny-times-one", "huge-times-small"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_gradients_are_accurate_where_the_exact_ones_are_normal(name, edge):
  x, w = _operands(*EDGES[edge])
  dot = fp8.dot_general(RECIPES[name], (
      RECIPES[name].init() if name == "delayed" else None))
  gx, gw = jax.jit(jax.grad(lambda x, w: dot(x, w, MATMUL).sum(), (0, 1)))(
      x, w)
  # d/dx sum(x @ w) = row sums of w; d/dw = column sums of x.
  want_x = np.broadcast_to(w.astype(np.float64).sum(1), x.shape)
  want_w = np.broadcast_to(x.astype(np.float64).sum(0)[:, None], w.shape)
  np.testing.assert_allclose(np.asarray(gx, np.float64), want_x, rtol=0.3)
  np.testing.assert_allclose(np.asarray(gw, np.float64), want_w, rtol=0.3)


@pytest.mark.parametrize("rounding", ["up", "floor"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_mx_quantisation_near_float32_max_stays_finite(fmt, dtype, rounding):
  top = float(jnp.finfo(dtype).max)
  x = jnp.asarray(np.linspace(0.9 * top, top, 64).reshape(1, 2, 32), dtype)
  q, inv = quantize_blocks(x, Layout("mx", fmt, 0, 32, rounding))
  back = np.asarray(dequantize_blocks(q, inv, 32), np.float64)
  assert np.isfinite(back).all()
  # At most one FP8 ulp below (E4M3 1/8, E5M2 1/4; "floor" saturates).
  ulp = 0.125 if fmt == E4M3 else 0.25
  slack = ulp + (0.25 if rounding == "floor" else 0.0)
  np.testing.assert_allclose(back, np.asarray(x, np.float64), rtol=slack)
  # The gather moves the same values.
  mesh = jax.sharding.Mesh(jax.devices()[:1], ("d",))
  gathered = jax.jit(jax.shard_map(
      lambda w: fp8.all_gather(w, "d", fp8.MXFP8(fwd_dtype=fmt,
                                                  scale_rounding=rounding)),
      mesh=mesh, in_specs=jax.sharding.PartitionSpec("d"),
      out_specs=jax.sharding.PartitionSpec("d")))(x[0])
  assert np.isfinite(np.asarray(gathered, np.float32)).all()


def test_mx_scales_are_never_float32_subnormals():
  # 2**-127 is E8M0's smallest value but no normal float32: XLA flushes it.
  x = jnp.asarray([[[2e-38] * 32, [0.0] * 32]], jnp.float32)
  _, inv = quantize_blocks(x, Layout("mx", E4M3, 0, 32))
  assert np.all(np.asarray(inv) >= np.finfo(np.float32).tiny)
  back = dequantize_blocks(*quantize_blocks(x, Layout("mx", E4M3, 0, 32)), 32)
  np.testing.assert_allclose(back[0, 0], 2e-38, rtol=0.07)


@pytest.mark.parametrize("shapes", [((0, 4), (4, 3)), ((2, 0), (0, 3)),
                                    ((2, 4), (4, 0)), ((0, 0), (0, 0))],
                         ids=["no-rows", "no-contraction", "no-columns",
                              "nothing"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_empty_dimensions_give_what_lax_gives(name, shapes):
  # A zero-size dimension anywhere: lax.dot_general's zeros (an empty
  # contraction sums nothing), and zero gradients of the operands' shapes.
  recipe = RECIPES[name]
  dot = fp8.dot_general(
      recipe, recipe.init() if isinstance(recipe, fp8.DelayedScaling)
      else None)
  x, w = jnp.ones(shapes[0]), jnp.ones(shapes[1])

  @jax.jit
  def run(x, w):
    loss = lambda x, w: jnp.sum(dot(x, w, MATMUL))
    return dot(x, w, MATMUL), jax.grad(loss, (0, 1))(x, w)

  y, (gx, gw) = run(x, w)
  want = jax.lax.dot_general(x, w, MATMUL)
  assert y.shape == want.shape and y.dtype == want.dtype
  np.testing.assert_array_equal(y, want)
  assert gx.shape == x.shape and gw.shape == w.shape
  assert not np.asarray(gx).any() and not np.asarray(gw).any()


@pytest.mark.parametrize("name", ["tensor", "row", "block", "mx"])
def test_empty_leaves_and_shards(name):
  recipe = RECIPES[name]
  mesh = jax.sharding.Mesh(jax.devices()[:1], ("d",))
  spec = jax.sharding.PartitionSpec("d")
  gather = lambda axis: jax.jit(jax.shard_map(
      lambda w: fp8.all_gather(w, "d", recipe, axis), mesh=mesh,
      in_specs=spec, out_specs=spec))
  # An empty shard (another axis empty) gathers to an empty tensor...
  assert gather(0)(jnp.ones((32, 0))).shape == (32, 0)
  # ...an empty gathered axis is refused by name (XLA cannot gather it).
  with pytest.raises(ValueError, match="axis 0 of the shard is empty"):
    gather(0)(jnp.ones((0, 32)))
  for leaf in (jnp.ones((0, 32)), jnp.ones((4, 0))):
    health = fp8.quantization_health(leaf, recipe=recipe)
    assert float(health.flushed) == 0.0 and float(health.saturated) == 0.0
