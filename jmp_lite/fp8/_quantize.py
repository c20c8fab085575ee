"""Per-tensor FP8 quantisation: amax, scale, saturating cast.

Conventions (TransformerEngine's): ``scale`` multiplies a tensor *into* the
FP8 range, ``scale_inv = 1 / scale`` multiplies the FP8 values (or a product
of them) back out. All scale arithmetic is float32.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite.fp8._recipes import _fp8_dtype, check_margin

__all__ = ["quantize"]

_F32 = np.dtype(np.float32)
# Scales stay within float32's normal range, so that both the scale and its
# inverse are exact normal numbers (GPUs flush float32 subnormals to zero).
_MIN_SCALE = float(2.0 ** -126)
_MAX_SCALE = float(2.0 ** 126)


def amax_of(x: jax.Array) -> jax.Array:
  """``max(|x|)`` as a float32 scalar (0 for an empty array; NaN propagates)."""
  return jnp.max(jnp.abs(x), initial=0).astype(_F32)


def scale_for(amax: jax.Array, dtype: np.dtype, margin: int) -> jax.Array:
  """The float32 multiplier that maps ``amax`` onto ``finfo(dtype).max``.

  An amax of zero (an all-zero tensor, an empty history) gives 1; a
  non-finite amax gives 1 too (:func:`scale_inv_for` turns that into NaN).
  """
  fmax = np.float32(float(jnp.finfo(dtype).max) / 2.0 ** margin)
  amax = jnp.asarray(amax, _F32)
  one = np.float32(1)
  usable = (amax > 0) & jnp.isfinite(amax)
  # XLA:CPU computes fmax / amax as fmax * (1 / amax), and 1 / amax is a
  # subnormal (flushed to 0) for an amax above 2**126: the scale fell to
  # its floor, 274x too small at amax 1.4e38. Both scaled by 2**-64 there
  # (exactly), the reciprocal stays normal.
  big = amax > np.float32(2.0**64)
  shrink = jnp.where(big, np.float32(2.0**-64), one)
  scale = jnp.where(usable, (fmax * shrink) / jnp.where(
      usable, amax * shrink, one), one)
  return jax.lax.clamp(np.float32(_MIN_SCALE), scale, np.float32(_MAX_SCALE))


def scale_inv_for(scale: jax.Array, amax: jax.Array) -> jax.Array:
  """``1 / scale``, or NaN when the tensor's own ``amax`` is not finite.

  Saturating casts would turn an inf into the format's maximum and hide an
  overflow from ``loss_scaled``; poisoning the de-scale factor instead makes
  the whole product NaN, at no per-element cost.
  """
  return jnp.where(jnp.isfinite(amax), np.float32(1) / scale,
                   np.float32(np.nan))


def cast_limit(scale: jax.Array, dtype: np.dtype) -> jax.Array:
  """The largest FP8 value a cast at ``scale`` may produce.

  The format's maximum, except where the scale sits at its floor
  ``2**-126`` (an amax past ``max * 2**126 / 2**margin``): there the amax
  lands above its target, and an element rounded up to ``4 * 2**-126 *
  2**126`` would dequantise to ``2**128``, inf. Such elements keep the
  largest FP8 value whose de-scaled value is finite, ``(2 - 2**-mantissa)
  * 2``, one FP8 step below.
  """
  fmax = np.float32(jnp.finfo(dtype).max)
  nmant = int(jnp.finfo(dtype).nmant)
  top = np.float32(min((2.0 - 2.0 ** -nmant) * 2.0, float(fmax)))
  return jnp.where(scale <= np.float32(_MIN_SCALE), top, fmax)


def cast_saturating(x: jax.Array, scale: jax.Array,
                    dtype: np.dtype) -> jax.Array:
  """``x * scale`` clipped to the format's finite range, cast to ``dtype``.

  Clipping matters: E4M3 has no infinity, and a value past its maximum
  converts to NaN. ``scale`` is a scalar (see :func:`cast_limit`).
  """
  limit = cast_limit(scale, dtype)
  wide = x.astype(_F32) * scale
  return jax.lax.clamp(-limit, wide, limit).astype(dtype)


def quantize(x: jax.typing.ArrayLike, dtype: Any = jnp.float8_e4m3fn, *,
             margin: int = 0,
             amax: jax.typing.ArrayLike | None = None
             ) -> tuple[jax.Array, jax.Array]:
  """Quantises ``x`` to FP8 with one per-tensor scale.

  Args:
    x: a floating array.
    dtype: the FP8 format.
    margin: powers of two of headroom below the format's maximum.
    amax: the amax to scale by (say, from a delayed-scaling history); default
      ``max(|x|)``, computed just in time. Values beyond it saturate.

  Returns:
    ``(q, scale_inv)``: the FP8 array and the float32 scalar that maps it
    back, ``x ~= q.astype(float32) * scale_inv``. ``scale_inv`` is NaN if
    ``x`` holds inf or NaN.

  Raises:
    TypeError: if ``dtype`` is not an FP8 format or ``x`` is not floating.
    ValueError: for a ``margin`` that would put the amax below the format's
      smallest normal number (past 14 for E4M3, 29 for E5M2), or an
      ``amax`` that is no scalar.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> q, scale_inv = jmp_lite.fp8.quantize(jnp.array([1e-4, -3e-4]))
    >>> q.dtype, q.astype(jnp.float32).tolist()  # -3e-4 lands on -448
    (dtype(float8_e4m3fn), [144.0, -448.0])
    >>> back = (q.astype(jnp.float32) * scale_inv).tolist()
    >>> [round(v * 1e4, 3) for v in back]
    [0.964, -3.0]
  """
  dtype = _fp8_dtype(dtype, "dtype")
  margin = check_margin(margin, dtype)
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"quantize expects a floating array, got {x.dtype}")
  own = amax_of(x)
  if amax is None:
    use = own
  else:
    if np.ndim(amax) != 0:
      raise ValueError("quantize scales per tensor: amax must be a scalar,"
                       f" got shape {np.shape(amax)}")
    amax = jnp.asarray(amax, _F32)
    use = jax.lax.select(amax > 0, amax, own)
  scale = scale_for(use, dtype, margin)
  return cast_saturating(x, scale, dtype), scale_inv_for(scale, own)
