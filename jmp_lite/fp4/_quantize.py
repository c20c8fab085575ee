"""FP4 quantisation: E2M1 codes, E4M3 / E8M0 block scales, rounding, Hadamard.

Every tensor is first put in the form ``(B, P, C)``: batch, rows, and the
axis its blocks run along (a GEMM's contraction). ``C`` is zero-padded to a
multiple of the block (zeros change no block's amax and no product). The
result is a :class:`Quantized`: the E2M1 codes, one float32 scale per block
(the exact value of its E4M3 or E8M0 scale) and the inverse of the tensor's
float32 encoding scale (NVFP4's ``1 / s_enc``; 1 for MXFP4), decoded as
``(q * scale) * enc``. All arithmetic is float32, in the order the
docstring of :class:`jmp_lite.fp4.NVFP4` gives.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._lowbit import E8M0_MAX, mx_exponent, on_auto_axes, pad_to, pow2
from jmp_lite.fp4._recipes import E2M1, Format, MXFP4, NVFP4, ROLES

__all__ = ["quantize_dequantize"]

_F32 = np.dtype(np.float32)
_E4M3 = np.dtype(jnp.float8_e4m3fn)
FP4_MAX = 6.0
E4M3_MAX = 448.0
_MAX_ENC = 2.0 ** 126


class Quantized(NamedTuple):
  """One tensor in FP4 (see the module docstring).

  Attributes:
    q: ``float4_e2m1fn (B, P, nb * bs)``, the codes.
    scale: float32 ``(B, P, nb)``, the block scales' values (NaN for an MX
      block holding inf or NaN).
    enc: the float32 scalar ``1 / s_enc`` (NaN when the tensor holds inf
      or NaN); 1 for MXFP4.
  """

  q: jax.Array
  scale: jax.Array
  enc: jax.Array


def uniform(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Float32 uniform in [0, 1), multiples of ``2**-24`` (24 random bits)."""
  bits = jax.random.bits(key, shape, jnp.uint32) >> 8
  return bits.astype(_F32) * np.float32(2.0 ** -24)


def round_e2m1(v: jax.Array, key: jax.Array | None = None) -> jax.Array:
  """``v`` (float32, in [-6, 6]) to E2M1: to nearest even, or stochastically.

  Stochastic rounding picks one of the two neighbouring E2M1 values, the
  upper with probability ``(|v| - lower) / spacing`` (spacing 0.5 below 2,
  1 below 4, 2 up to 6): unbiased, ``E[q] = v``. Exact in float32 (the
  spacings are powers of two).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jmp_lite.fp4._quantize import round_e2m1
    >>> round_e2m1(jnp.array([0.25, 0.75, 2.5, 5.0])).astype(float).tolist()
    [0.0, 1.0, 2.0, 4.0]
    >>> q = round_e2m1(jnp.full((4096,), 2.25), jax.random.key(0))
    >>> values = q.astype(float)
    >>> sorted(set(values.tolist())), abs(float(values.mean()) - 2.25) < 0.03
    ([2.0, 3.0], True)
  """
  if key is None:
    return v.astype(E2M1)
  a = jnp.abs(v)
  ulp = jnp.where(a < 2, np.float32(0.5),
                  jnp.where(a < 4, np.float32(1), np.float32(2)))
  low = jnp.floor(a / ulp) * ulp
  up = uniform(key, v.shape) < (a - low) / ulp
  r = jnp.minimum(low + jnp.where(up, ulp, np.float32(0)), np.float32(6))
  return (jnp.sign(v) * r).astype(E2M1)


def quantize_blocks(x: jax.Array, fmt: Format, *, tiles: bool = False,
                    key: jax.Array | None = None,
                    amax: jax.Array | None = None) -> Quantized:
  """Quantises ``x (B, P, C)`` in blocks along its last axis.

  Args:
    x: a floating array of rank 3.
    fmt: :class:`NVFP4` or :class:`MXFP4`.
    tiles: one scale per ``bs x bs`` tile (rows grouped too; NVFP4's 2-D
      weights) rather than per ``1 x bs`` block.
    key: stochastic rounding's key; ``None`` rounds to nearest even.
    amax: NVFP4's per-tensor amax, when ``x`` is a shard of the tensor;
      default ``max(|x|)``.

  Returns:
    The :class:`Quantized` tensor (``C`` zero-padded to whole blocks).

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> from jmp_lite.fp4._quantize import quantize_blocks
    >>> t = quantize_blocks(jnp.array([[[1.0, 2.0, -12.0, 0.5]]]),
    ...                     jmp_lite.fp4.MXFP4(block_size=2))
    >>> t.q.astype(float).tolist(), t.scale.tolist(), float(t.enc)
    ([[[2.0, 4.0, -6.0, 0.0]]], [[[0.5, 2.0]]], 1.0)
  """
  b, p, c = x.shape
  bs = fmt.block_size
  nb = max(math.ceil(c / bs), 1)
  blocks = pad_to(x.astype(_F32), 2, bs)
  if blocks.shape[2] == 0:
    blocks = jnp.zeros((b, p, bs), _F32)
  blocks = blocks.reshape(b, p, nb, bs)
  absx = jnp.abs(blocks)
  if tiles:
    rows = pad_to(absx, 1, bs)
    amax_b = jnp.max(rows.reshape(b, -1, bs, nb, bs), axis=(2, 4))
    amax_b = jnp.repeat(amax_b, bs, axis=1)[:, :p]
  else:
    amax_b = jnp.max(absx, axis=3)
  if isinstance(fmt, MXFP4):
    exp = mx_exponent(amax_b, E2M1)
    bad = exp > E8M0_MAX
    scale = jnp.where(bad, np.float32(np.nan), pow2(jnp.minimum(exp, 127)))
    v = blocks * pow2(-jnp.minimum(exp, 127))[..., None]
    v = jnp.where(bad[..., None], np.float32(0), v)
    enc = jnp.ones((), _F32)
  else:
    if amax is None:
      amax = jnp.max(absx, initial=np.float32(0))
    finite = jnp.isfinite(amax)
    usable = finite & (amax > 0)
    # At most 2**126, so that 1 / s_enc is a normal number (XLA:CPU
    # flushes subnormals): only tensors with amax < 3.2e-35 see the cap.
    s_enc = jnp.where(usable, jnp.minimum(
        np.float32(FP4_MAX * E4M3_MAX) / jnp.where(usable, amax, 1),
        np.float32(_MAX_ENC)), np.float32(1))
    # Divisions of scalars, and reciprocals per block: XLA turns a division
    # by a broadcast value into a multiplication by its reciprocal, so the
    # order is spelled out rather than left to it.
    raw = amax_b * (s_enc / np.float32(FP4_MAX))
    scale = jnp.clip(raw, 0, np.float32(E4M3_MAX)).astype(_E4M3).astype(_F32)
    scale = jnp.where(jnp.isnan(scale), np.float32(0), scale)
    mult = np.float32(1) / jnp.where(scale > 0, scale, np.float32(1))
    v = jnp.where(scale[..., None] > 0, (blocks * s_enc) * mult[..., None],
                  np.float32(0))
    v = jnp.where(jnp.isfinite(v), v, np.float32(0))
    enc = jnp.where(finite, np.float32(1) / s_enc, np.float32(np.nan))
  v = jnp.clip(v, -np.float32(FP4_MAX), np.float32(FP4_MAX))
  q = round_e2m1(v, key)
  return Quantized(q.reshape(b, p, nb * bs), scale, enc)


def dequantize(t: Quantized, size: int | None = None) -> jax.Array:
  """``(q * scale) * enc`` in float32, ``(B, P, size)`` (padding dropped)."""
  b, p, _ = t.q.shape
  nb = t.scale.shape[2]
  q = t.q.astype(_F32).reshape(b, p, nb, -1)
  out = (q * t.scale[..., None]) * t.enc
  out = out.reshape(b, p, -1)
  return out if size is None else out[..., :size]


def hadamard_matrix(n: int) -> np.ndarray:
  """The ``n x n`` Sylvester Hadamard matrix (entries +-1), ``n`` a power of 2.

  Example:
    >>> from jmp_lite.fp4._quantize import hadamard_matrix
    >>> hadamard_matrix(2).tolist()
    [[1.0, 1.0], [1.0, -1.0]]
  """
  h = np.ones((1, 1), np.float32)
  while h.shape[0] < n:
    h = np.block([[h, h], [h, -h]])
  return h


def hadamard_signs(key: jax.Array | None, n: int) -> jax.Array:
  """The transform's random signs: from ``key``, else from ``key(0)``."""
  if key is None:
    key = jax.random.key(0)
  return jax.random.rademacher(key, (n,), _F32)


def rotate(x: jax.Array, signs: jax.Array) -> jax.Array:
  """``x``'s last axis, in chunks of ``n``, times ``diag(signs) H / sqrt(n)``.

  Orthogonal: two operands rotated alike along their contraction keep their
  product. The axis is zero-padded to whole chunks.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite.fp4._quantize import rotate
    >>> rotate(jnp.array([[4.0, 0.0, 0.0, 0.0]]), jnp.ones(4)).tolist()
    [[2.0, 2.0, 2.0, 2.0]]
  """
  n = signs.shape[0]
  x = pad_to(x.astype(_F32), x.ndim - 1, n)
  chunks = x.reshape(*x.shape[:-1], -1, n) * signs
  h = jnp.asarray(hadamard_matrix(n) / np.float32(math.sqrt(n)), _F32)
  # In float32 on every backend: at the default precision a TPU multiplies
  # in bfloat16 and a recent GPU in TF32, and the two rotated operands' product
  # would no longer be the unrotated one's.
  out = jnp.matmul(chunks, h, precision=jax.lax.Precision.HIGHEST)
  return out.reshape(x.shape)


def as_key(key: Any) -> jax.Array | None:
  """``key`` as a typed PRNG key (a raw ``uint32[2]`` one is wrapped).

  Raises:
    TypeError: for anything but ``None`` or one PRNG key.
  """
  if key is None:
    return None
  dtype = getattr(key, "dtype", None)
  if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
    if np.shape(key) != ():
      raise TypeError(f"key must be one PRNG key, got shape {np.shape(key)}")
    return key
  if dtype == np.uint32 and np.shape(key) == (2,):
    return jax.random.wrap_key_data(key)
  raise TypeError("key must be None or a PRNG key (jax.random.key(seed), or"
                  f" a raw jax.random.PRNGKey), got {type(key).__name__}:"
                  f" {key!r}")


def quantize_dequantize(x: jax.typing.ArrayLike, recipe: Format, *,
                        axis: int = -1, role: str = "activation",
                        key: Any = None) -> jax.Array:
  """``x`` quantised to FP4 and decoded: what a GEMM sees of it.

  Blocks run along ``axis`` (a GEMM's contraction), zero-padded to whole
  blocks and cropped again. ``role`` picks what :func:`dot_general` does to
  such an operand: ``"activation"`` (``1 x block_size`` blocks, round to
  nearest even), ``"weight"`` (NVFP4's 2-D tiles if ``weight_blocks``: the
  other axes, flattened, grouped ``block_size`` rows at a time) or
  ``"gradient"`` (1-D blocks, stochastically rounded when ``key`` is given
  and ``recipe.stochastic_gradients``). The values are exactly those of the
  formulas in :class:`NVFP4` / :class:`MXFP4` (float32 arithmetic); an
  NVFP4 tensor holding inf or NaN decodes to NaN everywhere, an MXFP4 block
  holding one to NaN in that block.

  Args:
    x: a floating array.
    recipe: :class:`NVFP4` or :class:`MXFP4`.
    axis: the axis the blocks run along.
    role: ``"activation"``, ``"weight"`` or ``"gradient"``.
    key: a PRNG key for stochastic rounding (gradients only).

  Returns:
    The decoded values, ``x``'s shape and dtype (float32 input is exact).

  Raises:
    TypeError: for a non-floating ``x``, a recipe that is not an FP4 format
      or a ``key`` that is not a PRNG key.
    ValueError: for an unknown ``role``, an ``axis`` out of range, or a key
      for a role that is never stochastically rounded.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> x = jnp.array([0.1, 1.0, 2.9, -6.2])
    >>> jmp_lite.fp4.quantize_dequantize(x, jmp_lite.fp4.MXFP4()).tolist()
    [0.0, 1.0, 3.0, -6.0]
    >>> y = jmp_lite.fp4.quantize_dequantize(x, jmp_lite.fp4.NVFP4())
    >>> [round(v, 3) for v in y.tolist()]
    [0.0, 1.033, 3.1, -6.2]
  """
  if not isinstance(recipe, (NVFP4, MXFP4)):
    raise TypeError("quantize_dequantize takes one format,"
                    " jmp_lite.fp4.NVFP4 or MXFP4, got"
                    f" {type(recipe).__name__}: {recipe!r}")
  if role not in ROLES:
    raise ValueError(f"role must be one of {ROLES}, got {role!r}")
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"quantize_dequantize expects a floating array, got"
                    f" {x.dtype}")
  if isinstance(axis, bool) or not isinstance(axis, int) or not (
      -max(x.ndim, 1) <= axis < max(x.ndim, 1)):
    raise ValueError(f"axis {axis!r} is out of range for shape {x.shape}")
  key = as_key(key)
  if key is not None and role != "gradient":
    raise ValueError(f"a key rounds gradients stochastically; role={role!r}"
                     " is always rounded to nearest even")
  if not recipe.stochastic_gradients:
    key = None
  tiles = role == "weight" and recipe.weight_blocks is not None

  def run(x: jax.Array) -> jax.Array:
    wide = x.reshape(1) if x.ndim == 0 else x
    moved = jnp.moveaxis(wide, axis, -1)
    c = moved.shape[-1]
    t = quantize_blocks(moved.reshape(1, -1, c), recipe, tiles=tiles,
                        key=key)
    out = dequantize(t, c).reshape(moved.shape)
    return jnp.moveaxis(out, -1, axis).reshape(x.shape).astype(x.dtype)

  # Sharded as x is, also under explicit mesh axes.
  return on_auto_axes(run, (x,), jax.typeof(x).sharding)
