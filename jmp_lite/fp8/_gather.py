"""FP8 all-gather for FSDP: 8-bit payloads and their scales on the wire."""

from __future__ import annotations

import functools
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._checks import check_axis_name
from jmp_lite._lowbit import pow2
from jmp_lite.fp8._blocked import Layout, quantize_blocks
from jmp_lite.fp8._quantize import amax_of, cast_saturating, scale_for
from jmp_lite.fp8._recipes import check_recipe, DelayedScaling, MXFP8, Recipe

__all__ = ["all_gather"]

_F32 = np.dtype(np.float32)


def _layout(recipe: Recipe) -> Layout | None:
  """How a gathered tensor is quantised; None: one global scale."""
  if isinstance(recipe, MXFP8):
    return Layout("mx", recipe.fwd_dtype, 0, MXFP8.BLOCK,
                  recipe.scale_rounding)
  if isinstance(recipe, DelayedScaling) or recipe.granularity == "tensor":
    return None
  kind = "row" if recipe.granularity == "row" else "square"
  return Layout(kind, recipe.fwd_dtype, recipe.margin, recipe.block_size)


def _gather_fwd_impl(x: jax.Array, axis_name: Any, recipe: Recipe,
                     axis: int) -> jax.Array:
  gather = functools.partial(jax.lax.all_gather, axis_name=axis_name,
                             axis=axis, tiled=True)
  layout = _layout(recipe)
  if layout is None:
    # One scale for the whole (global) tensor: a scalar max across shards.
    own = jax.lax.pmax(amax_of(x), axis_name)
    scale = scale_for(own, recipe.fwd_dtype, recipe.margin)
    q = gather(cast_saturating(x, scale, recipe.fwd_dtype))
    inv = jnp.where(jnp.isfinite(own), 1 / scale, np.float32(np.nan))
    return (q.astype(_F32) * inv).astype(x.dtype)
  shape = x.shape
  c = shape[-1]
  lead = shape[:-1]
  rows = shape[-2] if x.ndim >= 2 else 1
  q, inv = quantize_blocks(x.reshape(-1, rows, c), layout)
  nb, bs = q.shape[2], q.shape[3]
  q = q.reshape(*lead, nb * bs)
  inv = inv.reshape(*lead, nb)
  if axis == x.ndim - 1 and nb * bs != c:
    raise ValueError(
        f"fp8.all_gather along the last axis needs its local size ({c}) to"
        f" be a multiple of the block ({bs})")
  if layout.kind == "mx":
    # MX scales are E8M0 on the wire: one byte, the float32 exponent field
    # (2**-127's subnormal encoding has field 0, NaN's 255), as OCP's.
    bits = jax.lax.bitcast_convert_type(inv, jnp.int32)
    code = gather(((bits >> 23) & 0xFF).astype(jnp.uint8)).astype(jnp.int32)
    inv = jnp.where(code == 255, np.float32(np.nan), pow2(code - 127))
    q = gather(q)
  elif layout.kind == "square" and x.ndim >= 2:
    # One scale per bs x bs tile on the wire, not one per row of it: the
    # rows of a tile share theirs (quantize_blocks repeats it per row).
    # all_gather checked that a shard holds whole tiles along the axis.
    q, tiles = gather(q), gather(inv[..., ::bs, :])
    inv = jnp.repeat(tiles, bs, axis=-2)[..., :q.shape[-2], :]
  else:
    q, inv = gather(q), gather(inv)
  full = q.reshape(*q.shape[:-1], nb if axis != x.ndim - 1 else -1, bs)
  out = full.astype(_F32) * inv[..., None]
  out = out.reshape(*q.shape[:-1], -1)
  if axis != x.ndim - 1:
    out = out[..., :c]
  return out.astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _fp8_gather(x: jax.Array, axis_name: Any, recipe: Recipe,
                axis: int) -> jax.Array:
  return _gather_fwd_impl(x, axis_name, recipe, axis)


def _fp8_gather_fwd(x, axis_name, recipe, axis):
  return _gather_fwd_impl(x, axis_name, recipe, axis), jnp.zeros((), x.dtype)


def _fp8_gather_bwd(axis_name, recipe, axis, res, g):
  del recipe
  # The transpose of a gather: each shard's slice summed over the axis, in
  # float32 whatever the parameters' dtype.
  out = jax.lax.psum_scatter(g.astype(_F32), axis_name,
                             scatter_dimension=axis, tiled=True)
  return (out.astype(res.dtype),)


_fp8_gather.defvjp(_fp8_gather_fwd, _fp8_gather_bwd)


def all_gather(x: jax.typing.ArrayLike, axis_name: Any, recipe: Recipe,
               axis: int = 0) -> jax.Array:
  """``lax.all_gather(x, axis_name, axis=axis, tiled=True)`` moving FP8.

  For FSDP under ``shard_map``: each shard is quantised to
  ``recipe.fwd_dtype``, the 8-bit payload and its scales (float32; one
  E8M0 byte per block for :class:`MXFP8`) are gathered, and the result is
  dequantised to ``x``'s dtype. The values are those of
  quantise-dequantise of the *global* tensor:

  * per tensor (``CurrentScaling()``, and ``DelayedScaling``, which uses
    the current amax here): one scale, from a scalar ``pmax`` of the
    shards' amaxes;
  * ``granularity="row"``: one scale per row along the last axis (the
    last axis must not be the gathered one);
  * ``granularity="block"``: ``block_size`` x ``block_size`` tiles over
    the last two axes; :class:`MXFP8`: 32-element blocks along the last
    axis. Each shard's size along the gathered axis must then be a
    multiple of the block for the tiles to match the global ones.

  Its gradient (a ``custom_vjp``) is the transpose of the gather, a
  reduce-scatter (``psum_scatter``) summed in **float32**, cast to ``x``'s
  dtype.

  Args:
    x: this shard, floating.
    axis_name: the mapped axis (or axes) to gather over.
    recipe: an FP8 recipe (its forward format and granularity are used).
    axis: the dimension of ``x`` to gather along.

  Returns:
    The gathered tensor, ``x``'s dtype.

  Raises:
    TypeError: for a non-recipe, non-floating ``x``, an ``axis_name`` that
      is no str or tuple of str, or a non-integer ``axis``.
    ValueError: for an ``axis`` out of range or empty, or a shard size the
      blocks do not divide where they must.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jmp_lite
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("fsdp",))
    >>> def layer(x, w):  # x: a batch shard, w: a weight shard.
    ...   w = jmp_lite.fp8.all_gather(w, "fsdp", jmp_lite.fp8.MXFP8())
    ...   return x @ w
    >>> f = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=P("fsdp"),
    ...                           out_specs=P("fsdp")))
    >>> y = f(jnp.ones((2, 4)), jnp.full((4, 32), 3.0))
    >>> y.shape, float(y[0, 0])
    ((2, 32), 12.0)
  """
  recipe = check_recipe(recipe)
  if axis_name is None:
    raise TypeError("fp8.all_gather needs the mapped axis to gather over:"
                    " axis_name must be a str or a tuple of str, got None")
  check_axis_name(axis_name)
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"fp8.all_gather expects a floating array, got {x.dtype}")
  if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
    raise TypeError(f"fp8.all_gather: axis must be an int, got"
                    f" {type(axis).__name__}: {axis!r}")
  if not -x.ndim <= axis < x.ndim:
    raise ValueError(f"axis {axis!r} is out of range for a {x.ndim}-d array")
  axis = int(axis) % x.ndim
  layout = _layout(recipe)
  if layout is not None and layout.kind == "row" and axis == x.ndim - 1:
    raise ValueError("fp8.all_gather with granularity='row' scales along the"
                     " last axis; gather along another one")
  if layout is not None and layout.kind != "row":
    along = x.shape[axis]
    tiled = axis >= x.ndim - (2 if layout.kind == "square" else 1)
    if tiled and along % layout.bs:
      raise ValueError(
          f"fp8.all_gather: the shard's size along axis {axis} ({along}) is"
          f" not a multiple of the block ({layout.bs}), so its blocks would"
          " not be the global tensor's")
  if x.shape[axis] == 0:
    raise ValueError(f"fp8.all_gather: axis {axis} of the shard is empty"
                     f" (shape {x.shape}); XLA cannot gather along it")
  if x.size == 0:
    # Nothing to quantise, and no block to scale: moves no bytes either.
    return jax.lax.all_gather(x, axis_name, axis=axis, tiled=True)
  return _fp8_gather(x, axis_name, recipe, axis)
