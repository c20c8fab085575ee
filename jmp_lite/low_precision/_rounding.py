"""Stochastic rounding's random bits and the rounding itself.

The bits come from a counter-based hash of (seed, step counter, leaf,
element index) computed inside the fused update kernel: no random array is
materialised and no key is passed per call. The quantized states' codes
hash (seed, step counter, param, element index) once for a param's two
moments (:func:`pair_bits`). Under ``shard_map`` each element hashes its
*global* index, so a sharded run draws the unsharded run's bits.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import dtypes as _dtypes
from jmp_lite.low_precision._common import BF16, F32


def check_seed(seed: Any) -> int:
  """``seed`` as an int in ``[0, 2**32)``, or a ``TypeError``/``ValueError``.

  Example:
    >>> import numpy as np
    >>> from jmp_lite.low_precision._rounding import check_seed
    >>> check_seed(np.uint32(7))
    7
  """
  if isinstance(seed, (bool, np.bool_)) or not isinstance(
      seed, (int, np.integer)):
    raise TypeError(f"seed must be an int, got {type(seed).__name__}: {seed!r}")
  if not 0 <= int(seed) < 2**32:
    raise ValueError(f"seed must be in [0, 2**32), got {seed}")
  return int(seed)


_M1, _M2 = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35)
_GOLDEN = 0x9E3779B9
_C0, _C1 = np.uint32(0x68E31DA4), np.uint32(0xB5297A4D)


def _mix(x: jax.Array) -> jax.Array:
  """A bijective 32-bit avalanche (MurmurHash3's finaliser); uint32 in/out."""
  x = x ^ (x >> 16)
  x = x * _M1
  x = x ^ (x >> 13)
  x = x * _M2
  return x ^ (x >> 16)


def step_key(seed: jax.Array, count: jax.Array) -> jax.Array:
  """This step's 32-bit key, from the stream's seed and step counter."""
  return _mix(_mix(jnp.asarray(seed, jnp.uint32) ^ _C0)
              ^ jnp.asarray(count, jnp.uint32))


def _global_index(shape: tuple[int, ...], spec: Any) -> jax.Array:
  """Each element's flat index in the *global* array (uint32, wrapping).

  Under ``shard_map`` a leaf is a local shard; ``spec`` (its
  ``PartitionSpec``) says which mesh axes split each dimension, and
  ``axis_index`` gives this shard's offset. So shards draw different bits
  and replicated copies draw the same ones, as the unsharded run would.
  """
  index = None
  stride = 1
  entries = tuple(spec) if spec is not None else ()
  for d in reversed(range(len(shape))):
    coord = jax.lax.broadcasted_iota(jnp.uint32, shape, d)
    names = entries[d] if d < len(entries) else None
    parts = 1
    if names is not None:
      try:
        parts = int(jax.lax.axis_size(names))
      except NameError as e:
        raise ValueError(
            f"specs= names the mesh axis {names!r}, which is not bound here:"
            " specs= is for steps under jax.shard_map (inside it, each shard"
            " draws its own bits). Outside shard_map (an evaluation step"
            " under jit, say), step with the same optimizer built without"
            " specs=: its state is the same") from e
      offset = jax.lax.axis_index(names).astype(jnp.uint32)
      coord = coord + offset * np.uint32(shape[d] % 2**32)
    if stride != 1:
      coord = coord * np.uint32(stride % 2**32)
    index = coord if index is None else index + coord
    stride *= shape[d] * parts
  return jnp.zeros(shape, jnp.uint32) if index is None else index


def random_bits(key: jax.Array, leaf: int, shape: tuple[int, ...],
                 spec: Any = None) -> jax.Array:
  """Uniform uint32 bits for one leaf, elementwise (fuses into the update)."""
  k1 = stream_key(key, leaf)
  k2 = _mix(k1 ^ _C1)
  return _mix(_mix(_global_index(shape, spec) ^ k1) + k2)


def stream_key(key: jax.Array, stream: int) -> jax.Array:
  """One stream's 32-bit key (a scalar) from the step's key."""
  return _mix(key + np.uint32((stream * _GOLDEN) % 2**32))


def pair_bits(k: jax.Array, index: jax.Array) -> jax.Array:
  """32 random bits per element for two moments' codes: one MurmurHash3
  finaliser round over a Weyl sequence (the element's flat ``index`` times
  the golden ratio) keyed by XOR with the stream's key ``k``
  (:func:`stream_key`). XOR, not an addition: an added key shifts one
  sequence, and two streams whose keys differ by a multiple of the golden
  ratio would draw the same bits, shifted. The first moment takes the high
  16 bits, the second the low 16 (:func:`half_noise`): half the hashing of
  a stream per moment.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite.low_precision._rounding import pair_bits
    >>> pair_bits(jnp.uint32(7), jnp.arange(3, dtype=jnp.uint32)).dtype
    dtype('uint32')
  """
  return _mix((index * np.uint32(_GOLDEN)) ^ k)


def half_noise(bits: jax.Array, half: int) -> jax.Array:
  """Half ``half`` (0: high, 1: low) of :func:`pair_bits` as float32 integers
  in ``[0, 2**16)``: times :data:`NOISE_SCALE`, uniform in ``[0, 1)``."""
  part = bits >> 16 if half == 0 else bits & np.uint32(0xFFFF)
  return part.astype(F32)


# What half_noise's integers are multiplied by (inside the codes' threshold).
NOISE_SCALE = 2.0**-16


def stream_bits(key: jax.Array, stream: int, shape: tuple[int, ...],
                spec: Any = None) -> jax.Array:
  """A stream's :func:`pair_bits` at each element's global index (under
  ``shard_map``, ``spec`` as for :func:`random_bits`)."""
  return pair_bits(stream_key(key, stream), _global_index(shape, spec))


def round_stochastic(x: jax.Array, dtype: Any, bits: jax.Array) -> jax.Array:
  """``x`` rounded to ``dtype`` up or down, unbiased: E[result] == x."""
  dtype = np.dtype(dtype)
  if np.dtype(x.dtype) == F32 and dtype == BF16:
    # bfloat16 is float32's top 16 bits: add 16 random bits below them and
    # truncate. Carries round the magnitude up with probability equal to the
    # dropped fraction; the sign bit is never touched.
    raw = jax.lax.bitcast_convert_type(x, jnp.uint32)
    raw = (raw + (bits >> 16)) & np.uint32(0xFFFF0000)
    out = jax.lax.bitcast_convert_type(raw, jnp.float32)
    return jnp.where(jnp.isnan(x), x, out).astype(dtype)
  # Any other pair (float16's subnormals and narrower exponent included):
  # between the nearest value and its neighbour on the far side of x. The
  # nearest value comes from round_to: a cast pair there would be deleted
  # by XLA:GPU, leaving err == 0 and plain round-to-nearest.
  near_wide = _dtypes.round_to(x, dtype)
  near = near_wide.astype(dtype)
  err = x - near_wide
  # Toward the largest finite value, not infinity: FP8 formats without one
  # (float8_e4m3fn) cast infinity to NaN, and then nothing ever rounded away.
  top = float(jnp.finfo(dtype).max)
  toward = jnp.where(err > 0, top, -top).astype(dtype)
  other = jnp.nextafter(near, toward)
  gap = other.astype(x.dtype) - near_wide
  uniform = (bits >> 8).astype(x.dtype) * (2.0**-24)
  # err / gap is in [0, 1/2]; NaN (never taken) where near is +-inf.
  return jnp.where(uniform < err / gap, other, near)


def specs_per_leaf(specs: Any, tree: Any, what: str) -> list[Any]:
  """One ``PartitionSpec`` (or ``None``) per leaf of ``tree``."""
  leaves = jax.tree.leaves(tree)
  if specs is None:
    return [None] * len(leaves)
  is_spec = lambda s: s is None or isinstance(s, jax.sharding.PartitionSpec)
  spec_leaves, spec_def = jax.tree.flatten(specs, is_leaf=is_spec)
  try:
    subtrees = spec_def.flatten_up_to(tree)
  except (ValueError, TypeError) as e:
    raise ValueError(
        f"specs must be a pytree prefix of the {what} (PartitionSpecs as given"
        f" to shard_map's in_specs): {e}") from None
  out = []
  for spec, sub in zip(spec_leaves, subtrees, strict=True):
    if not is_spec(spec):
      raise TypeError(
          f"specs leaves must be jax.sharding.PartitionSpec or None, got"
          f" {spec!r}")
    out.extend([spec] * len(jax.tree.leaves(sub)))
  return out
