"""What an FP4 recipe does to a tree of tensors: error, flushes, per leaf."""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import dtypes as _dtypes
from jmp_lite import struct
from jmp_lite._lowbit import on_auto_axes
from jmp_lite.fp4._quantize import dequantize, quantize_blocks
from jmp_lite.fp4._recipes import check_recipe, PerDirection, ROLES

__all__ = ["FP4Health", "quantization_health"]

_F32 = np.dtype(np.float32)


@struct.dataclass
class FP4Health:
  """Per leaf: what quantising it to FP4 loses.

  Attributes:
    amax: ``max(|x|)`` (float32).
    error: the relative error ``||qdq(x) - x|| / ||x||`` (0 for zeros).
    flushed: the fraction of non-zero elements that become zero.
    flushed_blocks: the fraction of blocks (tiles) in which a non-zero
      element becomes zero.
    blocks: the number of blocks (int32).

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> x = jnp.array([[1.0] * 15 + [1e3]])  # one outlier per block
    >>> h = jmp_lite.fp4.quantization_health(x, jmp_lite.fp4.MXFP4(),
    ...                                      role="activation")
    >>> float(h.flushed), int(h.blocks)
    (0.9375, 1)
  """

  amax: Any
  error: Any
  flushed: Any
  flushed_blocks: Any
  blocks: Any


def _leaf(x: jax.Array, fmt: Any, tiles: bool, axis: int) -> FP4Health:
  x = x.reshape(1) if x.ndim == 0 else x
  if not -x.ndim <= axis < x.ndim:
    raise ValueError(f"axis {axis} is out of range for a leaf of shape"
                     f" {x.shape}")
  moved = jnp.moveaxis(x, axis, -1)
  c = moved.shape[-1]
  wide = moved.reshape(1, -1, c).astype(_F32)
  t = quantize_blocks(wide, fmt, tiles=tiles)
  back = dequantize(t, c)
  nonzero = wide != 0
  lost = nonzero & (back == 0)
  nb, bs = t.scale.shape[2], fmt.block_size
  pad = nb * bs - c
  per_block = jnp.pad(lost, ((0, 0), (0, 0), (0, pad))).reshape(
      1, -1, nb, bs).any(axis=3)
  if tiles:
    rows = -per_block.shape[1] % bs
    per_block = jnp.pad(per_block, ((0, 0), (0, rows), (0, 0)))
    per_block = per_block.reshape(1, -1, bs, nb).any(axis=2)
  norm = jnp.sqrt(jnp.sum(jnp.square(wide)))
  error = jnp.sqrt(jnp.sum(jnp.square(back - wide)))
  return FP4Health(
      amax=jnp.max(jnp.abs(wide), initial=0),
      error=jnp.where(norm > 0, error / jnp.where(norm > 0, norm, 1), 0),
      flushed=jnp.sum(lost) / jnp.maximum(jnp.sum(nonzero), 1).astype(_F32),
      flushed_blocks=jnp.mean(per_block.astype(_F32)),
      blocks=jnp.asarray(per_block.size, jnp.int32))


def quantization_health(tree: Any, recipe: Any, *, role: str = "weight",
                        axis: int | None = None) -> FP4Health:
  """Measures the FP4 error of every leaf of ``tree``, as ``recipe`` would.

  Run it on a model's weights (or captured activations and gradients) to
  choose which layers stay in bfloat16: a leaf whose ``error`` or
  ``flushed`` stands out is one the recipe treats badly. Jit-safe; no
  host sync. Hadamard transforms and stochastic rounding are left out (they
  act inside the weight-gradient GEMM, on the tokens).

  Args:
    tree: a pytree of floating arrays (other leaves give ``None``).
    recipe: :class:`NVFP4` or :class:`MXFP4` (a :class:`PerDirection`'s
      forward format).
    role: ``"weight"`` (NVFP4's 2-D tiles), ``"activation"`` or
      ``"gradient"`` (1-D blocks).
    axis: the contracting axis of each leaf, along which blocks run.
      Default: the first for weights (the kernel of ``x @ w``), the last
      otherwise.

  Returns:
    An :class:`FP4Health` whose fields have ``tree``'s structure.

  Raises:
    TypeError: for a non-recipe or a non-int ``axis``.
    ValueError: for an unknown ``role`` or an ``axis`` out of a leaf's range.

  Example:
    >>> import jax.numpy as jnp, numpy as np, jmp_lite
    >>> rng = np.random.default_rng(0)
    >>> params = {"w": jnp.asarray(rng.normal(size=(64, 32)), jnp.float32)}
    >>> h = jmp_lite.fp4.quantization_health(params, jmp_lite.fp4.NVFP4())
    >>> 0.05 < float(h.error["w"]) < 0.15, int(h.blocks["w"])
    (True, 8)
  """
  recipe = check_recipe(recipe)
  fmt = recipe.forward if isinstance(recipe, PerDirection) else recipe
  if fmt is None:
    raise ValueError("quantization_health needs an FP4 forward format; this"
                     " PerDirection's forward is None")
  if role not in ROLES:
    raise ValueError(f"role must be one of {ROLES}, got {role!r}")
  if axis is not None and (isinstance(axis, bool)
                           or not isinstance(axis, numbers.Integral)):
    raise TypeError(f"axis must be an int or None, got {axis!r}")
  where = int(axis) if axis is not None else (0 if role == "weight" else -1)
  tiles = role == "weight" and fmt.weight_blocks is not None

  def leaf(x: Any) -> Any:
    if not _dtypes.is_floating_array(x):
      return None
    # Scalars out, replicated, also under explicit mesh axes.
    return on_auto_axes(lambda x: _leaf(x, fmt, tiles, where),
                        (jnp.asarray(x),), jax.sharding.PartitionSpec())

  stats = jax.tree.map(leaf, tree)
  is_stat = lambda s: isinstance(s, FP4Health)
  pick = lambda name: jax.tree.map(lambda s: getattr(s, name), stats,
                                   is_leaf=is_stat)
  return FP4Health(amax=pick("amax"), error=pick("error"),
                   flushed=pick("flushed"),
                   flushed_blocks=pick("flushed_blocks"),
                   blocks=pick("blocks"))
