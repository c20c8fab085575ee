"""What an FP8 format and a per-tensor scale do to a tree of tensors."""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import dtypes as _dtypes
from jmp_lite import struct
from jmp_lite.fp8._quantize import amax_of, scale_for
from jmp_lite.fp8._recipes import _fp8_dtype, _non_negative_int

__all__ = ["QuantizationHealth", "quantization_health"]

_F32 = np.dtype(np.float32)


@struct.dataclass
class QuantizationHealth:
  """Per leaf: its amax and what quantising it to FP8 loses.

  Attributes:
    amax: ``max(|x|)`` (float32).
    saturated: the fraction of elements beyond the format's maximum at the
      scale used (clipped to it); always 0 when scaling by the leaf's own
      amax.
    flushed: the fraction of *non-zero* elements that become zero.
    subnormal: the fraction of non-zero elements that land in the format's
      subnormal range (fewer significant bits than the format's mantissa).

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> h = jmp_lite.fp8.quantization_health(jnp.array([448.0, 1e-2, 1e-5]))
    >>> round(float(h.subnormal), 3), round(float(h.flushed), 3)  # scale 1
    (0.333, 0.333)
  """

  amax: Any
  saturated: Any
  flushed: Any
  subnormal: Any


def quantization_health(tree: Any, dtype: Any = jnp.float8_e4m3fn, *,
                        margin: int = 0,
                        amax: Any = None) -> QuantizationHealth:
  """Measures saturation and flush-to-zero of per-tensor FP8 quantisation.

  ``gradient_health`` for FP8: pass weights or activations with the forward
  format, gradients (or captured cotangents) with the backward one. Jit-safe;
  reads each leaf twice, never syncs with the host.

  Args:
    tree: a pytree of floating arrays (other leaves give ``None``).
    dtype: the FP8 format.
    margin: powers of two of headroom, as in the recipe.
    amax: ``None`` scales each leaf by its own amax (:class:`CurrentScaling`);
      otherwise a pytree of ``tree``'s structure with one amax per leaf (say,
      from a delayed-scaling history), or one number for every leaf.

  Returns:
    A :class:`QuantizationHealth` whose fields have ``tree``'s structure.

  Raises:
    TypeError: if ``dtype`` is not an FP8 format.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> x = {"w": jnp.array([1.0, 1e-3, 0.0, 2.0])}
    >>> h = jmp_lite.fp8.quantization_health(x)  # scale 224: 1e-3 -> 0.224
    >>> float(h.amax["w"]), float(h.flushed["w"]), float(h.saturated["w"])
    (2.0, 0.0, 0.0)
    >>> h = jmp_lite.fp8.quantization_health(x, amax=0.5)  # a stale history
    >>> float(h.saturated["w"]), round(float(h.flushed["w"]), 3)
    (0.5, 0.0)
  """
  dtype = _fp8_dtype(dtype, "dtype")
  margin = _non_negative_int(margin, "margin")
  info = jnp.finfo(dtype)
  fmax = np.float32(info.max)
  tiny = np.float32(info.smallest_normal)

  def leaf(x: Any, given: Any) -> Any:
    if not _dtypes.is_floating_array(x):
      return None
    own = amax_of(x)
    use = own if given is None else jnp.asarray(given, _F32)
    scaled = jnp.abs(x.astype(_F32)) * scale_for(use, dtype, margin)
    nonzero = x != 0
    count = jnp.maximum(jnp.sum(nonzero), 1).astype(_F32)
    cast_zero = scaled.astype(dtype) == 0
    return (own,
            jnp.mean(scaled > fmax).astype(_F32),
            (jnp.sum(nonzero & cast_zero) / count).astype(_F32),
            (jnp.sum(nonzero & ~cast_zero & (scaled < tiny)) / count
             ).astype(_F32))

  one_for_all = amax is None or isinstance(amax, numbers.Real) or (
      isinstance(amax, (np.ndarray, np.generic, jax.Array))
      and amax.ndim == 0)
  if one_for_all:
    stats = jax.tree.map(lambda x: leaf(x, amax), tree)
  else:
    stats = jax.tree.map(leaf, tree, amax)
  is_stat = lambda s: isinstance(s, tuple)
  pick = lambda i: jax.tree.map(lambda s: s[i], stats, is_leaf=is_stat)
  return QuantizationHealth(amax=pick(0), saturated=pick(1), flushed=pick(2),
                            subnormal=pick(3))
