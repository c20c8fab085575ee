"""FP4 all-gather for FSDP: 4-bit codes and 8-bit block scales on the wire."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite.fp4._quantize import dequantize, quantize_blocks, Quantized
from jmp_lite.fp4._recipes import check_recipe, Format, MXFP4, PerDirection

__all__ = ["all_gather"]

_F32 = np.dtype(np.float32)


def _gather_impl(x: jax.Array, axis_name: Any, fmt: Format,
                 axis: int) -> jax.Array:
  gather = functools.partial(jax.lax.all_gather, axis_name=axis_name,
                             axis=axis, tiled=True)
  tiles = fmt.weight_blocks is not None and x.ndim >= 2
  c = x.shape[-1]
  rows = x.shape[-2] if x.ndim >= 2 else 1
  # The global amax (NVFP4's per-tensor scale): one scalar pmax.
  amax = jax.lax.pmax(jnp.max(jnp.abs(x), initial=0).astype(_F32), axis_name)
  t = quantize_blocks(x.reshape(-1, rows, c), fmt, tiles=tiles, amax=amax)
  nb, bs = t.scale.shape[2], fmt.block_size
  lead = x.shape[:-1]
  # E2M1 codes (4 bits) and the scales in their own 8-bit format.
  kind = jnp.float8_e8m0fnu if isinstance(fmt, MXFP4) else jnp.float8_e4m3fn
  q = gather(t.q.reshape(*lead, nb * bs))
  scale = t.scale.reshape(*lead, nb)
  if tiles:
    # One scale per bs x bs tile on the wire; a tile's rows share it.
    scale = gather(scale[..., ::bs, :].astype(kind)).astype(_F32)
    scale = jnp.repeat(scale, bs, axis=-2)[..., :q.shape[-2], :]
  else:
    scale = gather(scale.astype(kind)).astype(_F32)
  full = Quantized(q.reshape(-1, q.shape[-2] if q.ndim >= 2 else 1,
                             q.shape[-1]),
                   scale.reshape(-1, q.shape[-2] if q.ndim >= 2 else 1,
                                 scale.shape[-1]), t.enc)
  out = dequantize(full).reshape(q.shape)
  if axis != x.ndim - 1:
    out = out[..., :c]
  return out.astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _fp4_gather(x: jax.Array, axis_name: Any, fmt: Format,
                axis: int) -> jax.Array:
  return _gather_impl(x, axis_name, fmt, axis)


def _fp4_gather_fwd(x, axis_name, fmt, axis):
  return _gather_impl(x, axis_name, fmt, axis), jnp.zeros((), x.dtype)


def _fp4_gather_bwd(axis_name, fmt, axis, res, g):
  del fmt
  # The transpose of a gather, summed in float32 whatever the params' dtype.
  out = jax.lax.psum_scatter(g.astype(_F32), axis_name,
                             scatter_dimension=axis, tiled=True)
  return (out.astype(res.dtype),)


_fp4_gather.defvjp(_fp4_gather_fwd, _fp4_gather_bwd)


def all_gather(x: jax.typing.ArrayLike, axis_name: Any, recipe: Any,
               axis: int = 0) -> jax.Array:
  """``lax.all_gather(x, axis_name, axis=axis, tiled=True)`` moving FP4.

  :func:`jmp_lite.fp8.all_gather`'s FP4 sibling, for FSDP weights under
  ``shard_map``: each shard is quantised (blocks along the last axis;
  NVFP4's ``weight_blocks`` tiles over the last two), and the E2M1 codes
  (4 bits) and their block scales (one E4M3 byte per block or tile, one
  E8M0 byte per MX block) are gathered: 0.25x the bytes of a bfloat16
  gather with NVFP4's tiles, 0.28x with its 1-D blocks, 0.27x with MXFP4.
  NVFP4's per-tensor scale comes from a scalar ``pmax``, so the values are
  those of :func:`quantize_dequantize` of the *global* tensor
  (``role="weight"``, ``axis=-1``). The gradient is a float32
  reduce-scatter (``psum_scatter``), cast to ``x``'s dtype.

  Args:
    x: this shard, floating.
    axis_name: the mapped axis (or axes) to gather over.
    recipe: :class:`NVFP4` or :class:`MXFP4` (a :class:`PerDirection`'s
      forward format).
    axis: the dimension of ``x`` to gather along.

  Returns:
    The gathered tensor, ``x``'s dtype.

  Raises:
    TypeError: for a non-recipe or non-floating ``x``.
    ValueError: for an ``axis`` out of range, or a shard size that the
      blocks do not divide where they must (along a blocked axis).

  Example:
    >>> import jax, jax.numpy as jnp, jmp_lite
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("fsdp",))
    >>> def layer(x, w):
    ...   w = jmp_lite.fp4.all_gather(w, "fsdp", jmp_lite.fp4.NVFP4())
    ...   return x @ w
    >>> f = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=P("fsdp"),
    ...                           out_specs=P("fsdp")))
    >>> y = f(jnp.ones((2, 16)), jnp.full((16, 16), 3.0))
    >>> y.shape, round(float(y[0, 0]), 4)
    ((2, 16), 48.0)
  """
  recipe = check_recipe(recipe)
  fmt = recipe.forward if isinstance(recipe, PerDirection) else recipe
  if fmt is None:
    raise ValueError("fp4.all_gather needs an FP4 forward format; this"
                     " PerDirection's forward is None")
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"fp4.all_gather expects a floating array, got {x.dtype}")
  if isinstance(axis, bool) or not isinstance(axis, int) or not (
      -x.ndim <= axis < x.ndim):
    raise ValueError(f"axis {axis!r} is out of range for a {x.ndim}-d array")
  axis %= x.ndim
  tiled_axes = 2 if fmt.weight_blocks is not None else 1
  if axis >= x.ndim - tiled_axes and x.shape[axis] % fmt.block_size:
    raise ValueError(
        f"fp4.all_gather: the shard's size along axis {axis}"
        f" ({x.shape[axis]}) is not a multiple of the block"
        f" ({fmt.block_size}), so its blocks would not be the global"
        " tensor's")
  return _fp4_gather(x, axis_name, fmt, axis)
