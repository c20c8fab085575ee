"""``quantized_states``: an optimizer's state in 8 or 4 bits per element.

Each per-parameter floating state leaf (Adam's ``mu`` and ``nu``) is stored
as integer codes with one scale per block of ``block_size`` elements along
its last axis; ``inner`` computes in float32 on the dequantized state.

The maps (measured on Adam's moments after 300 steps of the digits MLP at
3e-4, ``docs/low_precision.md``) are power companding maps, which need no
code table: a value ``y`` of a block whose largest magnitude is ``s`` is
stored as one of the two integers around ``Q * (|y| / s) ** (1 / power)``,
up or down at random so that the decoded value is unbiased (``mu``; for
``nu``, its square root), or with ``rounding="nearest"`` the nearer one.

* Signed leaves (``mu``): symmetric, with an exact zero; ``Q = 127`` for 8
  bits and ``7`` for 4 bits.
* Unsigned leaves (``nu``, ``sum_of_squares``): the map stores ``sqrt(v)``
  (what Adam divides by) and has no zero: code ``k`` means
  ``((k + 1) / 2**bits) ** power``. A positive ``v`` never comes back as 0,
  which would make Adam's update ``m / (sqrt(v) + eps)`` explode (the
  "zero-point problem" of arXiv 2309.01507); a small ``v`` comes back at
  least at the block's floor, which only shrinks its update.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite import contract, struct
from jmp_lite import dtypes as _dtypes
from jmp_lite._checks import check_own_state, check_transformation
from jmp_lite.low_precision._common import F32, forwarding, unaliased, upcast
from jmp_lite.low_precision._rounding import (
  check_seed,
  random_bits,
  specs_per_leaf,
  step_key,
)

_BITS = (8, 4)
# Companding powers, per (bits, signed): measured, see the module docstring.
_POWERS = {(8, True): 2.0, (8, False): 3.0, (4, True): 2.0, (4, False): 2.0}
_UNSIGNED = ("nu", "sum_of_squares")
_ROUNDINGS = ("stochastic", "nearest")


@struct.dataclass
class QuantizedArray:
  """One state leaf stored block-quantized by :func:`quantized_states`.

  Attributes:
    codes: ``uint8`` codes; the leaf's shape for 8 bits, two codes per byte
      along the last axis for 4 bits (low nibble first).
    scales: one scale per block, shaped (row groups, blocks per row): a
      block is ``block_size`` elements along the last axis (the last block
      of a row may be partial), or ``block_size // n`` whole rows when the
      last axis ``n`` is shorter.
    shape: the leaf's shape (static).
    dtype: the leaf's dtype (static).
    bits: 8 or 4 (static).
    block_size: elements per block (static).
    signed: the signed map (``mu``) or the unsigned square-root map
      (``nu``) (static).
    power: the map's companding power (static).

  Example:
    >>> import jax.numpy as jnp, optax, jmp_lite
    >>> opt = jmp_lite.quantized_states(optax.adam(1e-3))
    >>> q = opt.init({"w": jnp.ones((4, 512))}).inner_state[0].mu["w"]
    >>> q.codes.dtype, q.codes.shape, q.scales.shape
    (dtype('uint8'), (4, 512), (4, 2))
  """

  codes: Any
  scales: Any
  shape: tuple[int, ...] = struct.field(static=True, default=())
  dtype: Any = struct.field(static=True, default=F32)
  bits: int = struct.field(static=True, default=8)
  block_size: int = struct.field(static=True, default=256)
  signed: bool = struct.field(static=True, default=True)
  power: float = struct.field(static=True, default=2.0)


@struct.dataclass
class QuantizedStatesState:
  """State of :func:`quantized_states`.

  Attributes:
    seed: the stochastic rounding stream's seed (uint32 scalar).
    count: steps so far that applied updates (uint32 scalar); with
      ``seed`` it picks the step's random bits, so a restored checkpoint
      continues the stream.
    inner_state: the wrapped optimizer's state, each quantized leaf replaced
      by a :class:`QuantizedArray` (the rest as ``inner`` keeps it).
  """

  seed: Any
  count: Any
  inner_state: Any


def _layout(shape: tuple[int, ...], block_size: int) -> tuple[int, int, int]:
  """(rows, r, c): the leaf seen as ``rows`` rows of its last axis; a block
  is ``r`` whole rows by ``c`` columns (``r > 1`` only for a last axis
  shorter than a block)."""
  n = shape[-1]
  rows = int(np.prod(shape[:-1], dtype=np.int64))
  return rows, max(1, block_size // n), min(block_size, n)


def _blocks(y: jax.Array, block_size: int) -> jax.Array:
  """``y`` (float32) as ``(row groups, column blocks, r * c)``, padded."""
  n = y.shape[-1]
  rows, r, c = _layout(y.shape, block_size)
  groups, col_blocks = -(-rows // r), -(-n // c)
  y = jnp.pad(y.reshape(rows, n),
              [(0, groups * r - rows), (0, col_blocks * c - n)])
  return y.reshape(groups, r, col_blocks, c).transpose(0, 2, 1, 3).reshape(
      groups, col_blocks, r * c)


def _unblock(blocks: jax.Array, shape: tuple[int, ...],
             block_size: int) -> jax.Array:
  """The inverse of :func:`_blocks`: ``shape`` again, padding dropped."""
  n = shape[-1]
  rows, r, c = _layout(shape, block_size)
  groups, col_blocks = blocks.shape[:2]
  y = blocks.reshape(groups, col_blocks, r, c).transpose(0, 2, 1, 3)
  return y.reshape(groups * r, col_blocks * c)[:rows, :n].reshape(shape)


def _per_element(scales: jax.Array, shape: tuple[int, ...],
                 block_size: int) -> jax.Array:
  _, r, c = _layout(shape, block_size)
  wide = jnp.broadcast_to(scales.astype(F32)[..., None], (*scales.shape,
                                                           r * c))
  return _unblock(wide, shape, block_size)


def quantize(x: jax.Array, *, bits: int, block_size: int, signed: bool,
             power: float, scale_dtype: Any = F32,
             noise: jax.Array | None = None) -> QuantizedArray:
  """Block-quantizes ``x`` (at least one dimension).

  Args:
    x: a floating array; with ``signed=False``, non-negative (negative
      values are stored as 0's floor).
    bits: 8 or 4.
    block_size: elements per block along the last axis (even for 4 bits).
    signed: the signed map, or the unsigned square-root map.
    power: the companding power (1: linear absmax).
    scale_dtype: the scales' dtype (float32 or bfloat16).
    noise: ``None`` to round each value to the nearest code in the
      companded domain; or uniform values in ``[0, 1)`` of ``x``'s shape to
      round between the two codes around it at random, unbiased in ``x``
      (signed) or in ``sqrt(x)`` (unsigned; values below the lowest code
      take it).

  Returns:
    The :class:`QuantizedArray`.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite.low_precision._quantized import dequantize, quantize
    >>> q = quantize(jnp.array([-1.0, 0.0, 0.5]), bits=8, block_size=256,
    ...              signed=True, power=1.0)
    >>> dequantize(q).round(2)
    Array([-1. ,  0. ,  0.5], dtype=float32)
  """
  y = x.astype(F32)
  if not signed:
    y = jnp.sqrt(jnp.maximum(y, 0.0))
  n = y.shape[-1]
  blocks = _blocks(y, block_size)
  # Scales are rounded up to their storage dtype, so that |y| / scale <= 1.
  absmax = jnp.max(jnp.abs(blocks), axis=-1)
  scales = absmax.astype(scale_dtype)
  scales = jnp.where(scales.astype(F32) < absmax,
                     jnp.nextafter(scales, jnp.asarray(jnp.inf, scales.dtype)),
                     scales)
  wide = scales.astype(F32)[..., None]
  unit = jnp.clip(jnp.abs(blocks) / jnp.where(wide > 0, wide, 1.0), 0.0, 1.0)
  companded = unit ** (1.0 / power)
  if signed:
    top = 2 ** (bits - 1) - 1
    if noise is None:
      magnitude = jnp.round(companded * top)
    else:
      # Between the two codes around |y|, up with the probability that
      # makes the decoded value's expectation |y| (unbiased in y).
      low = jnp.clip(jnp.floor(companded * top), 0, top - 1)
      below, above = (low / top) ** power, ((low + 1) / top) ** power
      up = _blocks(noise, block_size) < (unit - below) / (above - below)
      magnitude = low + up
    k = magnitude * jnp.sign(blocks) + top
  else:
    levels = 2**bits
    if noise is None:
      k = jnp.clip(jnp.round(companded * levels - 1.0), 0, levels - 1)
    else:
      # Unbiased in sqrt(v), what Adam divides by (unbiased in v made the
      # digits MLP's 4-bit steps 13% longer than float32's: E[1 / sqrt(v)]
      # grows with v's noise), down to the lowest code, which values below
      # it round up to.
      low = jnp.clip(jnp.floor(companded * levels) - 1.0, 0, levels - 2)
      below = ((low + 1) / levels) ** power
      above = ((low + 2) / levels) ** power
      up = _blocks(noise, block_size) < (unit - below) / (above - below)
      k = low + up
  codes = _unblock(k.astype(jnp.uint8), y.shape, block_size)
  if bits == 4:
    if n % 2:
      codes = jnp.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, 1)])
    codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
  return QuantizedArray(
      codes=codes, scales=scales, shape=tuple(x.shape),
      dtype=np.dtype(x.dtype), bits=bits, block_size=block_size,
      signed=signed, power=power)


def dequantize(q: QuantizedArray) -> jax.Array:
  """The array a :class:`QuantizedArray` stands for, in its dtype.

  Args:
    q: the quantized leaf.

  Returns:
    An array of ``q.shape`` and ``q.dtype``.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite.low_precision._quantized import dequantize, quantize
    >>> q = quantize(jnp.array([4.0, 1.0]), bits=4, block_size=2,
    ...              signed=False, power=1.0)
    >>> dequantize(q)
    Array([4., 1.], dtype=float32)
  """
  # Under shard_map the codes are a shard along the leading axes while
  # ``q.shape`` stays the global shape: use the local one.
  shape = (*q.codes.shape[:-1], q.shape[-1])
  n = shape[-1]
  codes = q.codes
  if q.bits == 4:
    codes = jnp.stack([codes & 0xF, codes >> 4], axis=-1).reshape(
        *codes.shape[:-1], -1)[..., :n]
  k = codes.astype(F32)
  scale = _per_element(q.scales, shape, q.block_size)
  if q.signed:
    top = 2 ** (q.bits - 1) - 1
    signed_k = k - top
    y = jnp.sign(signed_k) * (jnp.abs(signed_k) / top) ** q.power * scale
    return y.astype(q.dtype)
  root = ((k + 1.0) / 2**q.bits) ** q.power * scale
  return (root * root).astype(q.dtype)


def _is_quantized(x: Any) -> bool:
  return isinstance(x, QuantizedArray)


def _unsigned_leaf(path: Sequence[Any], names: tuple[str, ...]) -> bool:
  # Attribute names only (a NamedTuple state's fields): a param called "nu"
  # inside mu's dict is a DictKey and does not count.
  return any(isinstance(k, jax.tree_util.GetAttrKey) and k.name in names
             for k in path)


def _state_specs(specs: Any, params: Any, stored: list[Any]) -> list[Any]:
  """One ``PartitionSpec`` (or ``None``) per stored state leaf: a quantized
  leaf takes the spec of the first param of its shape."""
  if specs is None:
    return [None] * len(stored)
  by_shape: dict[tuple[int, ...], Any] = {}
  for p, spec in zip(jax.tree.leaves(params),
                     specs_per_leaf(specs, params, "params"), strict=True):
    by_shape.setdefault(tuple(p.shape), spec)
  # Under shard_map the params are local shards: match their local shape.
  return [by_shape.get((*x.codes.shape[:-1], x.shape[-1]))
          if _is_quantized(x) else None for x in stored]


def _check_int(value: Any, what: str, low: int) -> int:
  if isinstance(value, (bool, np.bool_)) or not isinstance(
      value, (int, np.integer)):
    raise TypeError(
        f"quantized_states: {what} must be an int, got"
        f" {type(value).__name__}: {value!r}")
  if value < low:
    raise ValueError(f"quantized_states: {what} must be >= {low}, got {value}")
  return int(value)


def quantized_states(
    inner: optax.GradientTransformation,
    bits: int = 8,
    block_size: int = 256,
    *,
    scale_dtype: Any = "float32",
    unsigned: Sequence[str] = _UNSIGNED,
    rounding: str = "stochastic",
    seed: int = 0,
    specs: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """Stores ``inner``'s state block-quantized; ``inner`` computes in float32.

  ``init`` runs ``inner.init`` on the params upcast to float32 and stores
  every floating state leaf that has the shape of a param (and at least one
  dimension) as a :class:`QuantizedArray`: ``bits`` per element (8: one byte;
  4: two codes per byte) and one scale per block of ``block_size`` elements
  along the last axis. Blocks follow the last axis so that a param sharded
  along its leading axes keeps each block within a shard (under ``jax.jit``
  the codes take the param's sharding; under ``shard_map`` each shard's
  blocks are the whole array's, and with ``rounding="stochastic"`` pass
  ``specs=`` so each shard draws its own bits), and a last axis that is
  not a multiple of ``block_size`` ends in a partial block. A last axis ``n``
  shorter than a block takes ``block_size // n`` whole rows per block (a
  shard then keeps its blocks when it holds a multiple of that many rows).
  Counts and other leaves are kept as ``inner`` makes them. ``update``
  dequantizes to float32, runs ``inner`` on float32 gradients and params,
  and quantizes the new state (stochastically by default); its updates are
  float32 (wrap this in :func:`stochastic_rounding` or
  :func:`kahan_summation` for half params).

  With Adam that is 1 + 1 bytes per parameter for the moments at 8 bits
  (0.5 + 0.5 at 4 bits) plus 4 bytes per block: with bfloat16 params and
  :func:`stochastic_rounding`, about 4 bytes per parameter (3 with 4 bits).

  Leaves under a state field named in ``unsigned`` (Adam's ``nu``) take the
  unsigned square-root map with no zero code, so a positive second moment
  never comes back as 0; the rest the signed map. A step that a guard
  inside (:func:`~jmp_lite.loss_scaled`) skips leaves the codes and scales
  bit-identical.

  Args:
    inner: the optimizer; put a :func:`~jmp_lite.loss_scaled` *inside* so
      that it unscales float32 gradients.
    bits: 8 or 4.
    block_size: elements per block, a positive int (even for 4 bits).
    scale_dtype: ``"float32"`` or ``"bfloat16"`` for the scales.
    unsigned: names of the state fields holding non-negative leaves.
    rounding: ``"stochastic"`` (each code rounds up or down at random,
      unbiased in ``mu`` and in ``sqrt(nu)``) or ``"nearest"`` (the nearest
      code in the companded domain). Nearest codes change the trajectory: a
      moment's per-step change smaller than half a code's gap is lost, so
      4-bit Adam on the digits MLP took steps up to 2.9 times float32's
      along the same gradients, see ``docs/low_precision.md``.
    seed: an int in ``[0, 2**32)`` for the stochastic codes' bits; stored in
      the state, with a step counter, so a restored checkpoint continues
      the stream.
    specs: under ``jax.shard_map`` with ``rounding="stochastic"`` only: the
      params' ``PartitionSpec`` s (a pytree prefix of the params), so each
      element draws the bits of its global index and a sharded run's codes
      equal the unsharded run's. Not needed under ``jax.jit``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`QuantizedStatesState`.

  Raises:
    TypeError: if ``inner`` is not a gradient transformation, or
      ``bits``/``block_size``/``seed`` not an int.
    ValueError: for ``bits`` other than 8 or 4, a ``block_size`` below 1 (or
      odd with 4 bits), another ``scale_dtype`` or ``rounding``, or a
      ``seed`` out of range.

  Example:
    >>> import jax.numpy as jnp, optax, jmp_lite
    >>> opt = jmp_lite.stochastic_rounding(
    ...     jmp_lite.quantized_states(optax.adam(1e-3), bits=8), seed=0)
    >>> params = {"w": jnp.ones((8, 512), jnp.bfloat16)}
    >>> state = opt.init(params)
    >>> updates, state = opt.update(params, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> bytes_ = jmp_lite.diagnostics.tree_bytes((params, state))
    >>> round(bytes_ / 4096, 2)  # params 2, moments 1 + 1, scales
    4.04
  """
  check_transformation(inner, "quantized_states")
  bits = _check_int(bits, "bits", 1)
  if bits not in _BITS:
    raise ValueError(f"quantized_states: bits must be 8 or 4, got {bits}")
  block_size = _check_int(block_size, "block_size", 1)
  if bits == 4 and block_size % 2:
    raise ValueError(
        "quantized_states: with bits=4 two codes share a byte, so block_size"
        f" must be even, got {block_size}")
  scale_dtype = _dtypes.to_floating_dtype(scale_dtype, "scale_dtype")
  if scale_dtype not in (F32, np.dtype(jnp.bfloat16)):
    raise ValueError(
        "quantized_states: scale_dtype must be float32 or bfloat16, got"
        f" {scale_dtype.name}")
  if isinstance(unsigned, str) or not all(
      isinstance(n, str) for n in unsigned):
    raise TypeError(
        "quantized_states: unsigned must be a sequence of field names, got"
        f" {unsigned!r}")
  unsigned = tuple(unsigned)
  if rounding not in _ROUNDINGS:
    raise ValueError(
        "quantized_states: rounding must be 'stochastic' or 'nearest', got"
        f" {rounding!r}")
  seed = check_seed(seed)

  def store(path: Any, x: Any, shapes: set[tuple[int, ...]]) -> Any:
    if not (_dtypes.is_floating_array(x) and x.ndim >= 1
            and tuple(x.shape) in shapes):
      return x
    signed = not _unsigned_leaf(path, unsigned)
    return quantize(x, bits=bits, block_size=block_size, signed=signed,
                    power=_POWERS[(bits, signed)], scale_dtype=scale_dtype)

  def init(params: Any) -> QuantizedStatesState:
    wide_params = upcast(params)
    inner_state = unaliased(inner.init(wide_params), params, wide_params)
    shapes = {tuple(p.shape) for p in jax.tree.leaves(params)
              if hasattr(p, "shape")}
    return QuantizedStatesState(
        seed=jnp.asarray(seed, jnp.uint32), count=jnp.zeros((), jnp.uint32),
        inner_state=jax.tree_util.tree_map_with_path(
            lambda path, x: store(path, x, shapes), inner_state))

  def rebind(inner_update: contract.UpdateFn) -> contract.UpdateFn:
    def update(updates: Any, state: QuantizedStatesState, params: Any = None,
               **extra: Any) -> tuple[Any, QuantizedStatesState]:
      check_own_state(state, QuantizedStatesState, "quantized_states")
      stored, treedef = jax.tree.flatten(state.inner_state,
                                         is_leaf=_is_quantized)
      wide = treedef.unflatten([dequantize(x) if _is_quantized(x) else x
                                for x in stored])
      new_updates, new_inner = inner_update(
          upcast(updates), wide, upcast(params), **extra)
      # A step a guard inside skipped keeps the old codes bit for bit
      # (requantizing what was dequantized may move a scale by an ulp).
      applied = contract.step_applied(new_inner)
      key = step_key(state.seed, state.count)
      leaf_specs = _state_specs(specs, params, stored)

      def back(i: int, old: Any, new: Any) -> Any:
        if not _is_quantized(old):
          return new
        noise = None
        if rounding == "stochastic":
          # Uniform in [0, 1): 24 random bits, each element its own.
          noise = (random_bits(key, i, new.shape, leaf_specs[i]) >> 8
                   ).astype(F32) * 2.0**-24
        fresh = quantize(new, bits=old.bits, block_size=old.block_size,
                         signed=old.signed, power=old.power,
                         scale_dtype=old.scales.dtype, noise=noise)
        # Keep the static (global) shape: quantize saw the local shard.
        fresh = dataclasses.replace(fresh, shape=old.shape)
        return jax.tree.map(lambda a, b: jnp.where(applied, a, b), fresh, old)

      new_leaves = treedef.flatten_up_to(new_inner)
      return new_updates, QuantizedStatesState(
          seed=state.seed, count=state.count + applied.astype(jnp.uint32),
          inner_state=treedef.unflatten(
              [back(i, o, n) for i, (o, n) in enumerate(
                  zip(stored, new_leaves, strict=True))]))

    return update

  def half_by_design(state: QuantizedStatesState) -> QuantizedStatesState:
    # The quantized leaves (codes, and scales perhaps in bfloat16) are
    # narrow on purpose and computed in float32; inner's part is inner's.
    rest = jax.tree.map(lambda x: None if _is_quantized(x) else x,
                        state.inner_state, is_leaf=_is_quantized)
    return struct.replace(
        state, inner_state=contract.without_half_by_design(inner, rest))

  return forwarding(init, rebind, inner, half_by_design=half_by_design)


def bytes_per_element(bits: int, block_size: int,
                      scale_dtype: Any = F32) -> float:
  """Bytes a quantized leaf holds per element (full blocks, even sizes).

  Example:
    >>> from jmp_lite.low_precision._quantized import bytes_per_element
    >>> bytes_per_element(8, 256), bytes_per_element(4, 256)
    (1.015625, 0.515625)
  """
  return bits / 8 + np.dtype(scale_dtype).itemsize / block_size


__all__ = ["QuantizedArray", "QuantizedStatesState", "bytes_per_element",
           "dequantize", "quantize", "quantized_states"]
