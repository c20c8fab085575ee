"""The block-quantized array :func:`quantized_states` stores: codes, scales,
and each block's largest element kept exactly.

The maps (measured on Adam's moments after 300 steps of the digits MLP at
3e-4, ``docs/low_precision.md``) are square companding maps, which need no
code table: a value ``y`` of a block whose largest magnitude (its outlier
aside, below) is ``s`` is stored as one of the two integers around
``Q * sqrt(|y| / s)``, up or down at random so that the decoded value is
unbiased (``mu``; for ``nu``, its square root), or with
``rounding="nearest"`` the nearer one.

* Signed leaves (``mu``): symmetric, with an exact zero; ``Q = 127`` for 8
  bits and ``7`` for 4 bits.
* Unsigned leaves (``nu``, ``sum_of_squares``): the map stores ``sqrt(v)``
  (what Adam divides by) and has no zero: code ``k`` means
  ``((k + 1) / 2**bits) ** 2``. A positive ``v`` never comes back as 0,
  which would make Adam's update ``m / (sqrt(v) + eps)`` explode (the
  "zero-point problem" of arXiv 2309.01507); a small ``v`` comes back at
  least at the block's floor, which only shrinks its update.

Each block keeps its largest-magnitude element exactly, in float32 (inf and
NaN included), with its index; the block's scale is the largest magnitude of
the *other* finite elements. One gradient spike (a ``1e20`` gradient, whose
square overflows) then changes that element alone, as it would in a float32
state: its 255 neighbours keep their resolution instead of rounding to the
spike's scale (zero, or the unsigned map's floor, for as long as the spike
lasts). A second infinite element in the same block takes the block's
scale to float32's largest and comes back there (its neighbours then round
to zero or to the map's floor); a second NaN comes back as zero.

Each array records how it was stored (``form``: bits, block size and map, as
data) so a checkpoint restored into another configuration is read the way it
was written: the map is chosen by ``form``; bits and block size decide the
arrays' shapes, and a mismatch the shapes cannot show raises when ``form`` is
concrete and reads as NaN (loudly) under ``jax.jit``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import struct
from jmp_lite._jaxpr import is_tracer
from jmp_lite.low_precision._block_stats import outlier_and_scale
from jmp_lite.low_precision._common import F32
from jmp_lite.low_precision._reshape import reshape, sharded_like

# Companding powers, per (bits, signed): the square for every map (the 8-bit
# ``nu`` map of earlier versions took the cube; its states are refused).
POWERS = {(8, True): 2.0, (8, False): 2.0, (4, True): 2.0, (4, False): 2.0}

# ``form[2]``, the map the codes were written with: signed, or unsigned. 0
# was the unsigned map before it took the square at 8 bits (at 4 bits the
# same map, read as unsigned; at 8 bits refused).
SIGNED_MAP, UNSIGNED_MAP, OLD_UNSIGNED_MAP = 1, 2, 0


@struct.dataclass
class QuantizedArray:
  """One state leaf stored block-quantized by :func:`quantized_states`.

  Attributes:
    codes: ``uint8`` codes; the leaf's shape for 8 bits, two codes per byte
      along the last axis for 4 bits (low nibble first).
    scales: one scale per block, shaped (row groups, blocks per row): a
      block is ``block_size`` elements along the last axis (the last block
      of a row may be partial), or ``block_size // n`` whole rows when the
      last axis ``n`` is shorter. The largest magnitude of the block's
      elements other than its outlier.
    outliers: each block's largest-magnitude element, exactly (float32,
      shaped like ``scales``).
    where: the outlier's index within its block (``uint8`` for blocks of at
      most 256 elements, else ``int32``), shaped like ``scales``.
    form: how the codes were written, as data that checkpoints keep:
      ``int32[3]`` of (bits, block size, map: 1 signed, 2 unsigned).
    shape: the leaf's shape (static).
    dtype: the leaf's dtype (static).
    bits: 8 or 4 (static).
    block_size: elements per block (static).
    signed: the signed map (``mu``) or the unsigned square-root map
      (``nu``) (static; the codes are read by ``form``).
    power: the map's companding power (static; 2).

  Example:
    >>> import jax.numpy as jnp, optax, jmp_lite
    >>> opt = jmp_lite.quantized_states(optax.adam(1e-3))
    >>> q = opt.init({"w": jnp.ones((4, 512))}).inner_state[0].mu["w"]
    >>> q.codes.dtype, q.codes.shape, q.scales.shape, q.where.dtype
    (dtype('uint8'), (4, 512), (4, 2), dtype('uint8'))
  """

  codes: Any
  scales: Any
  outliers: Any = None
  where: Any = None
  form: Any = None
  shape: tuple[int, ...] = struct.field(static=True, default=())
  dtype: Any = struct.field(static=True, default=F32)
  bits: int = struct.field(static=True, default=8)
  block_size: int = struct.field(static=True, default=256)
  signed: bool = struct.field(static=True, default=True)
  power: float = struct.field(static=True, default=2.0)


def layout(shape: tuple[int, ...], block_size: int) -> tuple[int, int, int]:
  """(rows, r, c): the leaf seen as ``rows`` rows of its last axis; a block
  is ``r`` whole rows by ``c`` columns (``r > 1`` only for a last axis
  shorter than a block)."""
  n = shape[-1]
  rows = int(np.prod(shape[:-1], dtype=np.int64))
  return rows, max(1, block_size // n), min(block_size, n)


def grid(shape: tuple[int, ...], block_size: int) -> tuple[int, int]:
  """The scales' shape: (row groups, column blocks)."""
  rows, r, c = layout(shape, block_size)
  return -(-rows // r), -(-shape[-1] // c)


def stored_shapes(shape: tuple[int, ...], bits: int, block_size: int
                  ) -> tuple[tuple[int, ...], tuple[int, int]]:
  """The shapes a leaf of ``shape`` is stored in: its codes' (two per byte
  along the last axis for 4 bits), and its scales', outliers' and indices'
  (:func:`grid`)."""
  n = shape[-1]
  codes = tuple(shape) if bits == 8 else (*shape[:-1], -(-n // 2))
  return codes, grid(shape, block_size)


def block_grid(shape: tuple[int, ...], block_size: int) -> tuple[int, ...]:
  """The blocks' grid as the computation lays it out: the leaf's leading
  dimensions and its column blocks while a block lies in one row (the
  leaf's sharding along any dimension then carries over to its blocks),
  else (row groups, column blocks): :func:`grid`, what is stored."""
  _, r, _ = layout(shape, block_size)
  groups, col_blocks = grid(shape, block_size)
  return (*shape[:-1], col_blocks) if r == 1 else (groups, col_blocks)


def _blocks(y: jax.Array, block_size: int) -> jax.Array:
  """``y`` as ``(*block_grid, r * c)``, zero-padded."""
  n = y.shape[-1]
  rows, r, c = layout(y.shape, block_size)
  groups, col_blocks = grid(y.shape, block_size)
  if r == 1:
    if col_blocks * c != n:
      y = jnp.pad(y, [(0, 0)] * (y.ndim - 1) + [(0, col_blocks * c - n)])
    return reshape(y, (*y.shape[:-1], col_blocks, c))
  y = reshape(y, (rows, n))
  pads = [(0, groups * r - rows), (0, col_blocks * c - n)]
  if any(p for _, p in pads):
    y = jnp.pad(y, pads)
  y = reshape(y, (groups, r, col_blocks, c)).transpose(0, 2, 1, 3)
  return reshape(y, (groups, col_blocks, r * c))


def _unblock(blocks: jax.Array, shape: tuple[int, ...],
             block_size: int) -> jax.Array:
  """The inverse of :func:`_blocks` (from blocks in any leading shape of
  the same order): ``shape`` again, padding dropped."""
  n = shape[-1]
  rows, r, c = layout(shape, block_size)
  groups, col_blocks = grid(shape, block_size)
  blocks = reshape(blocks, (*block_grid(shape, block_size), r * c))
  if r == 1:
    y = reshape(blocks, (*shape[:-1], col_blocks * c))
    return y if col_blocks * c == n else y[..., :n]
  y = reshape(blocks, (groups, col_blocks, r, c)).transpose(0, 2, 1, 3)
  y = reshape(y, (groups * r, col_blocks * c))
  if (groups * r, col_blocks * c) != (rows, n):
    y = y[:rows, :n]
  return reshape(y, shape)


def where_dtype(block_size: int) -> np.dtype:
  """The outlier index's dtype: one byte while a block has 256 elements."""
  return np.dtype(jnp.uint8 if block_size <= 256 else jnp.int32)


def form_of(bits: int, block_size: int, signed: bool) -> np.ndarray:
  """The ``form`` a :class:`QuantizedArray` records (int32[3])."""
  return np.array([bits, block_size, SIGNED_MAP if signed else UNSIGNED_MAP],
                  np.int32)


_BF16_MAX_BITS = np.int32(0x7F7F0000)
_F32_TINY = np.float32(np.finfo(np.float32).tiny)


def _bfloat16_ceiling(x: jax.Array) -> jax.Array:
  """The least bfloat16 at or above the magnitude ``x`` (finite float32),
  up to bfloat16's largest, as float32 (exactly a bfloat16).

  By the float32 bits (bfloat16 is their top half), not by a cast and
  ``nextafter``: Pallas' Triton lowering has no bfloat16 ``nextafter``.
  Up to bfloat16's largest, not to inf: a block between 3.39e38 and
  float32's max would otherwise come back NaN; above bfloat16's max,
  elements saturate at it."""
  bits = jax.lax.bitcast_convert_type(x, jnp.int32) & np.int32(0x7FFFFFFF)
  up = (bits + np.int32(0xFFFF)) & np.int32(-0x10000)
  return jax.lax.bitcast_convert_type(jnp.minimum(up, _BF16_MAX_BITS), F32)


def _round_half_up(x: jax.Array) -> jax.Array:
  """``x`` to the nearest integer, halves up: Pallas' Triton lowering has
  no ``round``, and ``floor(x + 0.5)`` takes 0.49999997 to 1 (the sum
  rounds). ``x - floor(x)`` is exact."""
  low = jnp.floor(x)
  return low + (x - low >= 0.5).astype(x.dtype)


def check_power(power: float) -> None:
  """The maps' powers this codec computes: 2 (its maps), 1 (linear)."""
  if power not in (1.0, 2.0):
    raise ValueError(f"a map's power must be 1 or 2, got {power!r}")


def encode_blocks(raw: jax.Array, noise: jax.Array | None, *, bits: int,
                  signed: bool, power: float, scale_dtype: Any = F32,
                  stats: Any = None, noise_scale: float = 1.0
                  ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """The codes (as float32 integers), scales, outliers and outlier indices
  of float32 blocks ``raw`` (blocks along the last axis); what
  :func:`quantize` stores, before packing. ``noise * noise_scale`` is
  uniform in ``[0, 1)`` (``None``: nearest codes). ``stats(mag, raw)``
  gives (index, outlier, scale) per block (default: one variadic
  reduction)."""
  check_power(power)
  # One variadic reduction: the fewest passes and bytes, a scalar loop on
  # XLA:CPU. outlier_and_scale_max is no faster there: YNNPACK's reductions
  # read a materialised input (4.5x the bytes; full step no faster).
  stats = stats or outlier_and_scale
  # The outlier and scale of an unsigned block are found on v, not on
  # sqrt(v) (sqrt is monotone, so the scale is the same): a reduction that
  # needs no square root lets XLA recompute the new moment in each fusion
  # instead of writing sqrt(v) out and reading it back.
  order = jnp.abs(raw) if signed else jnp.maximum(raw, 0.0)
  where, outliers, top = stats(order, raw)
  absmax = top if signed else jnp.sqrt(top)
  # Scales are rounded up to their storage dtype, so that |y| / scale <= 1.
  scales = absmax.astype(scale_dtype)
  if np.dtype(scale_dtype) != F32:
    scales = _bfloat16_ceiling(absmax).astype(scale_dtype)
  # What is stored (a backend may flush a subnormal bfloat16 scale to 0).
  wide = scales.astype(F32)[..., None]
  # The code grid: Q steps from 0 to the scale, each moment's magnitude in
  # units where the codes' squares are integers: u = Q**p |y| / s, whose
  # p-th root lies between two codes. The other non-finite elements
  # saturate (NaN to zero); the outlier's own code is never read.
  q = 2 ** (bits - 1) - 1 if signed else 2**bits
  mag = order if signed else jnp.sqrt(order)
  if signed:
    # (An unsigned NaN reaches the lowest code through ``low`` below.)
    mag = jnp.where(jnp.isnan(mag), 0.0, mag)
  # Times r twice, r = Q**(p/2) / sqrt(s): 1 / s itself is a float32
  # subnormal for scales above 2**126, which XLA:CPU flushes to zero, and
  # a block of 1e37s would come back as zeros. An infinite element clips.
  # The maximum (never taken) keeps XLA from rewriting q / sqrt(s) with its
  # approximate rsqrt (an ulp off a third of the time), which the kernels
  # could not reproduce: they divide.
  root = jnp.maximum(jnp.sqrt(jnp.where(wide > 0, wide, 1.0)), _F32_TINY)
  r = np.float32(q ** (power / 2)) / root
  u = jnp.minimum((mag * r) * r, np.float32(q**power))
  c = jnp.sqrt(u) if power == 2.0 else u
  if noise is None:
    # The nearer code in the companded domain, halves up.
    m = _round_half_up(c)
    if signed:
      k = jnp.where(raw < 0, q - m, q + m)
    else:
      # NaN to the lowest code, as the stochastic codes take it.
      k = jnp.where(m > 1.0, m - 1.0, 0.0)
    return k, scales, outliers, where
  # Up with the probability that makes the decoded value's expectation
  # |y| (unbiased in y for mu; in sqrt(v), what Adam divides by, for nu:
  # unbiased in v made the digits MLP's 4-bit steps 13% longer than
  # float32's, E[1 / sqrt(v)] growing with v's noise): between the codes
  # low and low + 1, whose u are low**p and (low + 1)**p, up when
  # noise * ((low + 1)**p - low**p) < u - low**p. At the top, u = Q**p and
  # low = Q: never up.
  low = jnp.floor(c)
  if not signed:
    # Code k is (k + 1)**p in u: values below the lowest code round up to
    # it (low 1, below it: never up, k = 0), NaN too (u - below is NaN).
    low = jnp.where(low > 1.0, low, 1.0)
  below = low * low if power == 2.0 else low
  ns = np.float32(noise_scale)
  gap = low * (2 * ns) + ns if power == 2.0 else ns
  up = noise * gap < u - below
  if signed:
    m = jnp.where(up, low + 1.0, low)
    k = jnp.where(raw < 0, q - m, q + m)
  else:
    k = jnp.where(up, low, low - 1.0)
  return k, scales, outliers, where


def quantize(x: jax.Array, *, bits: int, block_size: int, signed: bool,
             power: float, scale_dtype: Any = F32,
             noise: jax.Array | None = None,
             noise_scale: float = 1.0) -> QuantizedArray:
  """Block-quantizes ``x`` (at least one dimension, at least one element).

  Args:
    x: a floating array; with ``signed=False``, non-negative (negative
      values are stored as 0's floor).
    bits: 8 or 4.
    block_size: elements per block along the last axis (even for 4 bits).
    signed: the signed map, or the unsigned square-root map.
    power: the companding power (1: linear absmax).
    scale_dtype: the scales' dtype (float32 or bfloat16).
    noise: ``None`` to round each value to the nearest code in the
      companded domain; or values of ``x``'s shape, uniform in ``[0, 1)``
      once multiplied by ``noise_scale``, to round between the two codes
      around it at random, unbiased in ``x`` (signed) or in ``sqrt(x)``
      (unsigned; values below the lowest code take it).
    noise_scale: what ``noise`` is multiplied by (``noise`` may then be
      integers: :func:`~jmp_lite.low_precision._rounding.half_noise`).

  Returns:
    The :class:`QuantizedArray`.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite.low_precision._blockwise import dequantize, quantize
    >>> q = quantize(jnp.array([-1.0, 0.0, 0.5, 1e30]), bits=8,
    ...              block_size=256, signed=True, power=1.0)
    >>> dequantize(q).round(2)   # The outlier is kept exactly.
    Array([-1.e+00,  0.e+00,  5.e-01,  1.e+30], dtype=float32)
  """
  x32 = x.astype(F32)
  y = x32 if signed else jnp.sqrt(jnp.maximum(x32, 0.0))
  n = y.shape[-1]
  k, scales, outliers, where = encode_blocks(
      _blocks(x32, block_size), None if noise is None else _blocks(
          noise, block_size), bits=bits, signed=signed, power=power,
      scale_dtype=scale_dtype, noise_scale=noise_scale)
  codes = _unblock(k.astype(jnp.uint8), y.shape, block_size)
  if bits == 4:
    # Pairs read as one little-endian uint16, not as stride-2 slices, which
    # made XLA:CPU run the whole encoding fused into them as scalar code.
    if n % 2:
      codes = jnp.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, 1)])
    pairs = jax.lax.bitcast_convert_type(
        reshape(codes, (*codes.shape[:-1], codes.shape[-1] // 2, 2)),
        jnp.uint16)
    codes = ((pairs & 0x0F) | ((pairs >> 4) & 0xF0)).astype(jnp.uint8)
  codes = sharded_like(codes, x)
  # Per-block values from the blocks' grid to their stored shape.
  keep = lambda a: reshape(a, grid(y.shape, block_size))  # noqa: E731
  return QuantizedArray(
      codes=codes, scales=keep(scales), outliers=keep(outliers),
      where=keep(where.astype(where_dtype(block_size))),
      form=jnp.asarray(form_of(bits, block_size, signed)),
      shape=tuple(x.shape), dtype=np.dtype(x.dtype), bits=bits,
      block_size=block_size, signed=signed, power=power)


def check_form(q: QuantizedArray) -> jax.Array | None:
  """Compares ``q.form`` (how the codes were written) with its static
  bits and block size, and refuses the 8-bit unsigned map of earlier
  versions (:data:`OLD_UNSIGNED_MAP`): a ``ValueError`` when ``form`` is
  concrete, else a traced bool (``None`` if there is no ``form``)."""
  if q.form is None:
    return None
  if not is_tracer(q.form) and isinstance(q.form, (jax.Array, np.ndarray)):
    bits, block_size, kind = (int(v) for v in np.asarray(q.form))
    if (bits, block_size) != (q.bits, q.block_size):
      raise ValueError(
          f"quantized_states: a state leaf was written with bits={bits},"
          f" block_size={block_size} and is read as bits={q.bits},"
          f" block_size={q.block_size} (a checkpoint restored into another"
          " configuration?). Restore it into quantized_states(...,"
          f" bits={bits}, block_size={block_size}), step once, then switch")
    if bits == 8 and kind == OLD_UNSIGNED_MAP:
      raise ValueError(
          "quantized_states: a state leaf was written with the 8-bit"
          " unsigned map of earlier jmp_lite versions (cube companding,"
          " form[2] == 0), which this version does not read. Start the"
          " optimizer state afresh (opt.init(params)) and keep the params")
    return None
  return ((q.form[0] == q.bits) & (q.form[1] == q.block_size)
          & ~((q.form[0] == 8) & (q.form[2] == OLD_UNSIGNED_MAP)))


def _squared(y: jax.Array) -> jax.Array:
  return y * y


def decode_blocks(k: jax.Array, scale: jax.Array, *, bits: int,
                  signed: bool, power: float, form_signed: Any = None,
                  outliers: Any = None, where: Any = None,
                  ok: Any = None) -> jax.Array:
  """Float32 blocks from codes ``k`` (float32 integers, blocks along the
  last axis) and ``scale`` (one per block, broadcastable): the map
  ``form_signed`` (a traced bool; ``None``: ``signed``) says, each block's
  outlier put back at ``where``, all NaN unless ``ok``."""
  top = 2 ** (bits - 1) - 1
  levels = 2**bits
  if ok is not None:
    # Per block, not per element: NaN scales and outliers make every
    # element NaN (0 * NaN included) at no cost in the elementwise decode.
    scale = jnp.where(ok, scale, jnp.nan)
    if outliers is not None:
      outliers = jnp.where(ok, outliers, jnp.nan)

  def map_of(a: jax.Array) -> jax.Array:
    # sign(a) |a|**p * scale, a = (k - top) / top in [-1, 1] (signed) or
    # (k + 1) / 2**bits in (0, 1] (unsigned: sqrt(v), squared below).
    return (a * jnp.abs(a) if power == 2.0 else a) * scale

  if form_signed is None:
    y = (map_of((k - top) * (1.0 / top)) if signed
         else _squared(map_of((k + 1.0) * (1.0 / levels))))
  else:
    # Read with the map the codes were written with (a restore into another
    # ``unsigned=`` converts on the next step): the code's affine map, its
    # two constants picked per leaf, and the square for the unsigned map.
    offset = jnp.where(form_signed, np.float32(-top), np.float32(1.0))
    step = jnp.where(form_signed, np.float32(1.0 / top),
                     np.float32(1.0 / levels))
    y = map_of((k + offset) * step)
    y = y * jnp.where(form_signed, np.float32(1.0), y)
  if outliers is not None:
    index = jax.lax.broadcasted_iota(jnp.int32, k.shape, k.ndim - 1)
    y = jnp.where(index == where[..., None], outliers[..., None], y)
  return y


def dequantize(q: QuantizedArray) -> jax.Array:
  """The array a :class:`QuantizedArray` stands for, in its dtype.

  The map is the one ``q.form`` records (the one the codes were written
  with); a ``form`` whose bits or block size differ from ``q``'s raises when
  concrete and gives NaN under tracing.

  Args:
    q: the quantized leaf.

  Returns:
    An array of ``q.shape`` (under ``shard_map``, of the local shard's) and
    ``q.dtype``.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite.low_precision._blockwise import dequantize, quantize
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
    codes = reshape(jnp.stack([codes & 0xF, codes >> 4], axis=-1),
                    (*codes.shape[:-1], 2 * codes.shape[-1]))
    if codes.shape[-1] != n:
      codes = codes[..., :n]
  k = _blocks(codes.astype(F32), q.block_size)
  ok = check_form(q)
  grid_of = lambda a: reshape(a, block_grid(shape, q.block_size))  # noqa: E731
  y = decode_blocks(
      k, grid_of(q.scales.astype(F32))[..., None], bits=q.bits,
      signed=q.signed, power=q.power,
      form_signed=None if q.form is None else q.form[2] == 1,
      outliers=None if q.outliers is None else grid_of(
          q.outliers.astype(F32)),
      where=None if q.where is None else grid_of(q.where.astype(jnp.int32)),
      ok=ok)
  return sharded_like(_unblock(y, shape, q.block_size), q.codes).astype(
      q.dtype)


def bytes_per_element(bits: int, block_size: int,
                      scale_dtype: Any = F32) -> float:
  """Bytes a quantized leaf holds per element (full blocks, even sizes):
  codes, and per block a scale, the outlier and its index.

  Example:
    >>> from jmp_lite.low_precision._blockwise import bytes_per_element
    >>> bytes_per_element(8, 256), bytes_per_element(4, 256)
    (1.03515625, 0.53515625)
  """
  per_block = (np.dtype(scale_dtype).itemsize + 4
               + where_dtype(block_size).itemsize)
  return bits / 8 + per_block / block_size
