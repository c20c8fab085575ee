"""What an FP8 recipe's scales do to a tree of tensors, block by block."""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import dtypes as _dtypes
from jmp_lite import struct
from jmp_lite._lowbit import on_auto_axes
from jmp_lite.fp8._blocked import Layout, quantize_blocks
from jmp_lite.fp8._quantize import amax_of, cast_saturating, scale_for
from jmp_lite.fp8._recipes import (
  _fp8_dtype,
  check_margin,
  check_recipe,
  CurrentScaling,
  MXFP8,
  Recipe,
  ROLES,
)

__all__ = ["QuantizationHealth", "quantization_health"]

_F32 = np.dtype(np.float32)


@struct.dataclass
class QuantizationHealth:
  """Per leaf: its amax and what quantising it to FP8 loses.

  A *block* is what one scale covers: the whole leaf (per tensor), one row,
  one ``1 x block_size`` strip or ``block_size x block_size`` tile, or one
  32-element MX block.

  Attributes:
    amax: ``max(|x|)`` (float32).
    saturated: the fraction of elements that, at the scale used, round past
      the format's largest finite value (and are clipped to it); always 0
      when each block is scaled by its own amax (but for MX's ``"floor"``
      rule).
    flushed: the fraction of *non-zero* elements that become zero.
    subnormal: the fraction of non-zero elements that land in the format's
      subnormal range (fewer significant bits than the format's mantissa).
    blocks: the number of blocks (int32).
    saturated_blocks: the fraction of blocks with a saturated element.
    flushed_blocks: the fraction of blocks in which a non-zero element
      flushes to zero.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> h = jmp_lite.fp8.quantization_health(jnp.array([448.0, 1e-2, 1e-5]))
    >>> round(float(h.subnormal), 3), round(float(h.flushed), 3)  # scale 1
    (0.333, 0.333)
    >>> int(h.blocks), float(h.flushed_blocks)
    (1, 1.0)
  """

  amax: Any
  saturated: Any
  flushed: Any
  subnormal: Any
  blocks: Any
  saturated_blocks: Any
  flushed_blocks: Any


def _overflow(dtype: np.dtype) -> np.float32:
  """Where rounding to ``dtype`` leaves its finite range: max + ulp / 2."""
  info = jnp.finfo(dtype)
  fmax = float(info.max)
  ulp = 2.0 ** (math.floor(math.log2(fmax)) - int(info.nmant))
  return np.float32(fmax + ulp / 2)


def _layout(recipe: Recipe, operand: str) -> Layout | None:
  """The blocks ``recipe`` scales ``operand`` in; None: per tensor."""
  dtype = recipe.bwd_dtype if operand == "grad" else recipe.fwd_dtype
  if isinstance(recipe, MXFP8):
    return Layout("mx", dtype, 0, MXFP8.BLOCK, recipe.scale_rounding)
  if not isinstance(recipe, CurrentScaling) or recipe.granularity == "tensor":
    return None
  if recipe.granularity == "row":
    return Layout("row", dtype, recipe.margin)
  kind = "square" if operand == "rhs" else "vector"
  return Layout(kind, dtype, recipe.margin, recipe.block_size)


def _fractions(x: jax.Array, q: jax.Array, scaled: jax.Array,
               dtype: np.dtype) -> tuple[jax.Array, ...]:
  """Per-element masks: saturated, non-zero, flushed, subnormal."""
  tiny = np.float32(jnp.finfo(dtype).smallest_normal)
  nonzero = x != 0
  zero = q == 0
  return (scaled > _overflow(dtype), nonzero, nonzero & zero,
          nonzero & ~zero & (jnp.abs(q.astype(_F32)) < tiny))


def _summary(size: int, sat: jax.Array, nonzero: jax.Array,
             flushed: jax.Array, sub: jax.Array, block_sat: jax.Array,
             block_flushed: jax.Array) -> tuple[jax.Array, ...]:
  """The fractions; ``size``: the leaf's elements (not the padding)."""
  count = jnp.maximum(jnp.sum(nonzero), 1).astype(_F32)
  size = max(size, 1)
  return (jnp.sum(sat).astype(_F32) / np.float32(size),
          jnp.sum(flushed).astype(_F32) / count,
          jnp.sum(sub).astype(_F32) / count,
          jnp.asarray(max(block_sat.size, 1), jnp.int32),
          jnp.mean(block_sat.astype(_F32)) if block_sat.size
          else jnp.zeros((), _F32),
          jnp.mean(block_flushed.astype(_F32)) if block_flushed.size
          else jnp.zeros((), _F32))


def _per_tensor(x: jax.Array, given: Any, dtype: np.dtype,
                margin: int) -> tuple[jax.Array, ...]:
  use = amax_of(x) if given is None else jnp.asarray(given, _F32)
  scale = scale_for(use, dtype, margin)
  q = cast_saturating(x, scale, dtype)
  scaled = jnp.abs(x.astype(_F32)) * scale
  sat, nonzero, flushed, sub = _fractions(x, q, scaled, dtype)
  return _summary(x.size, sat, nonzero, flushed, sub, jnp.any(sat)[None],
                  jnp.any(flushed)[None])


def _blocked(x: jax.Array, layout: Layout,
             axis: int) -> tuple[jax.Array, ...]:
  if x.ndim == 0:
    x = x.reshape(1)
  if not -x.ndim <= axis < x.ndim:
    raise ValueError(f"axis {axis} is out of range for a leaf of shape"
                     f" {x.shape}")
  x = jnp.moveaxis(x, axis, -1)
  c = x.shape[-1]
  x = x.reshape(1, math.prod(x.shape[:-1]), c)   # -1 fails for size 0
  q, inv = quantize_blocks(x, layout)
  b, p, nb, bs = q.shape
  blocks = jnp.pad(x, ((0, 0), (0, 0), (0, nb * bs - c))).reshape(q.shape)
  # inf and NaN blocks have a NaN de-scale factor; an inf still saturates.
  scale = jnp.where(jnp.isfinite(inv), 1 / inv, np.float32(1))
  scaled = jnp.abs(blocks.astype(_F32)) * scale[..., None]
  sat, nonzero, flushed, sub = _fractions(blocks, q, scaled, layout.dtype)
  block_sat, block_flushed = jnp.any(sat, axis=3), jnp.any(flushed, axis=3)
  if layout.kind == "square":
    # bs x bs tiles: also group the rows, bs at a time (the last partial).
    rows = -p % bs

    def tiles(m: jax.Array) -> jax.Array:
      m = jnp.pad(m, ((0, 0), (0, rows), (0, 0)))
      return jnp.any(m.reshape(b, -1, bs, nb), axis=2)

    block_sat, block_flushed = tiles(block_sat), tiles(block_flushed)
  return _summary(b * p * c, sat, nonzero, flushed, sub, block_sat,
                  block_flushed)


def quantization_health(tree: Any, dtype: Any = None, *,
                        margin: int | None = None, amax: Any = None,
                        recipe: Recipe | None = None, operand: str = "lhs",
                        axis: int | None = None) -> QuantizationHealth:
  """Measures saturation and flush-to-zero of FP8 quantisation, per block.

  ``gradient_health`` for FP8, at any granularity: pass weights or
  activations with the forward format, gradients (or captured cotangents)
  with the backward one; pass a ``recipe`` to use its formats and its
  blocks, and compare recipes on your own tensors. Jit-safe (bind the
  keyword arguments with ``functools.partial``); never syncs with the host.

  Args:
    tree: a pytree of floating arrays (other leaves give ``None``).
    dtype: the FP8 format, per tensor (default ``float8_e4m3fn``); not with
      ``recipe``.
    margin: powers of two of headroom (default 0); not with ``recipe``.
    amax: per tensor only. ``None`` scales each leaf by its own amax
      (:class:`CurrentScaling`); otherwise a pytree of ``tree``'s structure
      with one amax per leaf (say, from a delayed-scaling history), or one
      number for every leaf.
    recipe: a :class:`CurrentScaling` (any granularity), :class:`MXFP8` or
      :class:`DelayedScaling` (per tensor, with ``amax``): its format for
      ``operand``, its margin and its blocks.
    operand: which operand of a matmul the leaves are, for ``recipe``:
      ``"lhs"`` (activations: forward format, ``1 x block_size`` strips),
      ``"rhs"`` (weights: forward format, ``block_size x block_size``
      tiles) or ``"grad"`` (cotangents: backward format, strips).
    axis: the contracting axis of each leaf, along which rows, strips and
      MX blocks run (tiles span it and the other axes flattened). Default:
      the last for ``"lhs"`` and ``"grad"``, the first for ``"rhs"`` (the
      kernel of ``x @ w``).

  Returns:
    A :class:`QuantizationHealth` whose fields have ``tree``'s structure.

  Raises:
    TypeError: if ``dtype`` is not an FP8 format or ``recipe`` not a recipe.
    ValueError: for an unknown ``operand``, ``dtype`` or ``margin`` given
      with ``recipe``, ``amax`` with a recipe finer than per tensor, or an
      ``axis`` out of a leaf's range.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> x = {"w": jnp.array([1.0, 1e-3, 0.0, 2.0])}
    >>> h = jmp_lite.fp8.quantization_health(x)  # scale 224: 1e-3 -> 0.224
    >>> float(h.amax["w"]), float(h.flushed["w"]), float(h.saturated["w"])
    (2.0, 0.0, 0.0)
    >>> h = jmp_lite.fp8.quantization_health(x, amax=0.5)  # a stale history
    >>> float(h.saturated["w"]), round(float(h.flushed["w"]), 3)
    (0.5, 0.0)
    >>> rows = jnp.array([[1e6, 3e5], [1e-3, 2e-3]])  # an outlier row
    >>> float(jmp_lite.fp8.quantization_health(rows).flushed)
    0.5
    >>> h = jmp_lite.fp8.quantization_health(
    ...     rows, recipe=jmp_lite.fp8.CurrentScaling(granularity="row"))
    >>> int(h.blocks), float(h.flushed), float(h.flushed_blocks)
    (2, 0.0, 0.0)
  """
  if operand not in ROLES:
    raise ValueError(f"operand must be one of {ROLES}, got {operand!r}")
  if axis is not None and (isinstance(axis, bool)
                           or not isinstance(axis, numbers.Integral)):
    raise TypeError(f"axis must be an int or None, got {axis!r}")
  layout = None
  if recipe is not None:
    recipe = check_recipe(recipe)
    if dtype is not None or margin is not None:
      raise ValueError("quantization_health takes dtype and margin from the"
                       " recipe; pass one or the other")
    layout = _layout(recipe, operand)
    if layout is not None and amax is not None:
      raise ValueError("amax is for per-tensor scaling; a row, block or MX"
                       " recipe scales each block by its own amax")
    dtype = recipe.bwd_dtype if operand == "grad" else recipe.fwd_dtype
    margin = recipe.margin
  dtype = _fp8_dtype(jnp.float8_e4m3fn if dtype is None else dtype, "dtype")
  margin = check_margin(0 if margin is None else margin, dtype)
  where = int(axis) if axis is not None else (0 if operand == "rhs" else -1)

  def leaf(x: Any, given: Any) -> Any:
    if not _dtypes.is_floating_array(x):
      return None
    def run(x: jax.Array, given: Any) -> tuple[jax.Array, ...]:
      stats = (_per_tensor(x, given, dtype, margin) if layout is None
               else _blocked(x, layout, where))
      return (amax_of(x), *stats)

    # Scalars out, replicated, also under explicit mesh axes.
    return on_auto_axes(run, (x, given), jax.sharding.PartitionSpec())

  one_for_all = amax is None or isinstance(amax, numbers.Real) or (
      isinstance(amax, (np.ndarray, np.generic, jax.Array))
      and amax.ndim == 0)
  if one_for_all:
    stats = jax.tree.map(lambda x: leaf(x, amax), tree)
  else:
    stats = jax.tree.map(leaf, tree, amax)
  is_stat = lambda s: isinstance(s, tuple)
  pick = lambda i: jax.tree.map(lambda s: s[i], stats, is_leaf=is_stat)
  return QuantizationHealth(
      amax=pick(0), saturated=pick(1), flushed=pick(2), subnormal=pick(3),
      blocks=pick(4), saturated_blocks=pick(5), flushed_blocks=pick(6))
