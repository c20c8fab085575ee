"""A block's statistics for :mod:`._blockwise`: the index of its
largest-magnitude element (its outlier, kept exactly) and the largest
magnitude of the others (its scale), as one variadic reduction (the XLA
path) or as plain maxima (the fused kernel: Triton lowers no variadic
reduction). Both give the same results.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._jaxpr import type_sharding
from jmp_lite.low_precision._common import F32

_F32_MAX = np.float32(np.finfo(np.float32).max)


def _saturated(mag: jax.Array) -> jax.Array:
  """A magnitude as the block's scale counts it: NaN as 0, inf as
  float32's largest. A second infinite element in a block (the outlier slot
  holds the first) then takes the scale to float32's largest and comes back
  there, as huge as it was (a second moment: an update of about 0), instead
  of at the finite elements' scale (an update 1e19 times too large)."""
  return jnp.where(jnp.isnan(mag), 0.0, jnp.minimum(mag, _F32_MAX))


_INF_BITS = np.int32(0x7F800000)
_MAX_BITS = np.int32(0x7F7FFFFF)


def outlier_and_scale(mag: jax.Array, raw: jax.Array
                       ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per block (last axis): the index of the largest magnitude (NaN counts
  as the largest; of equals, the first on the CPU, as ``argmax``: a GPU's
  reduction order may pick another, which decodes to the same values), the
  ``raw`` value there, and the largest magnitude of the other elements
  (:func:`_saturated`; 0 if none), in one variadic reduction."""
  # Sharded as ``mag`` is when its type says (explicit mesh axes): the
  # reduction's index output takes this operand's sharding, and a
  # replicated one made every device gather the indices.
  index = jax.lax.broadcasted_iota(jnp.int32, mag.shape, mag.ndim - 1,
                                   out_sharding=type_sharding(mag))
  # Magnitudes compared as their bits: for non-negative floats integer
  # order is float order, and any NaN (its sign bit cleared) sits above
  # inf. The reducer, which XLA runs once per element (and counts), then
  # needs no NaN tests.
  key = jax.lax.bitcast_convert_type(mag, jnp.int32) & np.int32(0x7FFFFFFF)

  def combine(left: tuple[jax.Array, ...], right: tuple[jax.Array, ...]
              ) -> tuple[jax.Array, ...]:
    k1, i1, r1, f1 = left
    k2, i2, r2, f2 = right
    # Ties go left: XLA:CPU reduces in order with the accumulator on the
    # left, so the first of equals wins there.
    first = k1 >= k2
    lost = jnp.minimum(k1, k2)
    # The loser as the scale counts it (_saturated): NaN 0, inf the largest.
    lost = jnp.where(lost > _INF_BITS, np.int32(0),
                     jnp.minimum(lost, _MAX_BITS))
    return (jnp.maximum(k1, k2), jnp.where(first, i1, i2),
            jnp.where(first, r1, r2), jnp.maximum(jnp.maximum(f1, f2), lost))

  init = (np.int32(-1), np.int32(2**31 - 1), np.float32(0.0), np.int32(0))
  _, where, outliers, rest = jax.lax.reduce(
      (key, index, raw, jnp.zeros_like(key)),
      tuple(np.asarray(v) for v in init), combine, (mag.ndim - 1,))
  return where, outliers, jax.lax.bitcast_convert_type(rest, jnp.float32)


def outlier_and_scale_max(mag: jax.Array, raw: jax.Array
                          ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """:func:`outlier_and_scale` as plain max/min reductions, which kernels
  lower (maxima are exact: the same results). XLA:CPU runs them faster than the
  variadic reduction, but as several fusions that each recompute the new
  moment: five times the bytes in XLA's cost model."""
  index = jax.lax.broadcasted_iota(jnp.int32, mag.shape, mag.ndim - 1)
  nan = jnp.isnan(mag)
  # Integer maxima, not any/gather: Pallas' Triton lowering has neither.
  # Of NaNs, the one with the largest bits, as outlier_and_scale's order.
  key = jax.lax.bitcast_convert_type(mag, jnp.int32) & np.int32(0x7FFFFFFF)
  top_key = jnp.max(key, axis=-1, keepdims=True)
  any_nan = top_key > _INF_BITS
  top = jnp.max(jnp.where(nan, -jnp.inf, mag), axis=-1, keepdims=True)
  # Within 2**-20 and clamped into the block: XLA may compute the moment
  # for the top and for the match in two fusions, an ulp apart, and an
  # exact "==" matched nothing (the index ran past the block: a NaN
  # outlier). Any element near the top will do: the scale is the others'.
  hit = jnp.where(any_nan, key == top_key,
                  mag >= top * np.float32(1 - 2**-20))
  where = jnp.minimum(
      jnp.min(jnp.where(hit, index, np.int32(2**31 - 1)), axis=-1),
      mag.shape[-1] - 1)
  at = index == where[..., None]
  # By its bits (an integer max): XLA:CPU's float max flushes subnormals.
  outlier = jax.lax.bitcast_convert_type(jnp.max(jnp.where(
      at, jax.lax.bitcast_convert_type(raw, jnp.int32),
      np.int32(-2**31)), axis=-1), F32)
  rest = jnp.max(jnp.where(at, 0.0, _saturated(mag)), axis=-1)
  return where, outlier, rest
