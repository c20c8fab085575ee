"""FP8 quantisation finer than per tensor (row, block, MX) and its matmul.

Every matmul here is first put in one canonical form, ``a (B, P, C)`` times
``b (B, Q, C)`` into ``(B, P, Q)``: batch, free, contracting (flattened).
Each operand is quantised in blocks along ``C`` (one block of all of ``C``
for "row"), giving FP8 values ``(B, P, nb, bs)`` and float32 de-scale
factors ``(B, P, nb)``. The product is, block by block, one FP8 x FP8
``dot_general`` accumulated in float32, multiplied by the block's two
de-scale factors and added to a float32 sum: exactly what a block-scaled
FP8 GEMM computes (the products of FP8 values are exact in float32, the
per-block scaling is the same, only the float32 summation order may
differ), with 8-bit operands in the program. "block" runs the blocks in a
``lax.scan`` into one accumulator (:func:`looped_dot`; on GPUs one Pallas
kernel that walks the blocks per output tile, ``_block_gemm``); the first
version ran them as one dot with the block index as a batch dimension
(:func:`batched_dot`, kept as the tests' reference), whose float32
intermediate was ``nb`` times the output (16 GiB for one 8192-token
projection with a 16384-wide contracting dimension) and which ran 2.6-4x
slower on XLA:CPU.

MX blocks (E8M0 scales) go to ``jax.lax.scaled_dot`` instead, XLA's
block-scaled dot (a StableHLO composite): a backend with block-scaled FP8
GEMMs (Blackwell's MXFP8) can run it natively, any other expands it into a
dequantisation (exact: FP8 values times powers of two) and one dot, with no
``nb``-fold intermediate. Its numbers equal the batched formulation's up to
the float32 summation order (``tests/test_fp8_granularity.py``). Measured
on an H200 at 8192^3, forward and backward (``benchmarks/fp8_native_probe.py``,
2026-11-26): the batched formulation took 13.5x bfloat16's time with a
64 GiB float32 intermediate; ``jax.nn.scaled_dot_general``, which XLA:GPU
expands the same way on Hopper, 1.2x, with the same forward error. Row and
block scales are not powers of two; there ``lax.scaled_dot``'s expansion
rounds the de-scaled operands (to bfloat16 on XLA:CPU, 0.4% off), so they
keep the FP8 dots above. ``jax.nn.scaled_dot_general`` itself is not used:
it quantises by its own rules (scales from a bfloat16 division, no padding
of the contracting dimension, E4M3 gradients), and the custom VJP here
already chooses each matmul's operands.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._jaxpr import varying_axes
from jmp_lite._lowbit import E8M0_MAX, mx_exponent, pad_to, pow2
from jmp_lite.fp8._block_gemm import block_scaled_dot
from jmp_lite.fp8._matmul import descale, fp8_matmul, like_primal
from jmp_lite.fp8._quantize import cast_limit, scale_for, scale_inv_for
from jmp_lite.fp8._recipes import MXFP8

__all__ = ["Layout", "batched_dot", "fine_dot", "looped_dot",
           "quantize_blocks", "scaled_dot"]

_F32 = np.dtype(np.float32)
# The smallest scale exponent quantisation uses (2**-126: float32's smallest
# normal number).
_SCALE_MIN_EXP = -126


@dataclasses.dataclass(frozen=True)
class Layout:
  """How one operand of one canonical matmul is quantised (hashable).

  Attributes:
    kind: ``"row"`` (one scale per row), ``"vector"`` (``1 x bs`` blocks
      along the contracting dimension), ``"square"`` (``bs x bs`` tiles) or
      ``"mx"`` (``1 x bs`` blocks with E8M0 scales).
    dtype: the FP8 format.
    margin: powers of two of headroom (not for ``"mx"``).
    bs: the block size (unused for ``"row"``).
    rounding: ``"up"`` or ``"floor"``, for ``"mx"``.
  """

  kind: str
  dtype: np.dtype
  margin: int = 0
  bs: int = 128
  rounding: str = "up"


def _cast(x: jax.Array, scale: jax.Array, dtype: np.dtype) -> jax.Array:
  """``x * scale`` (one scale per block) cast to ``dtype``, saturating."""
  limit = cast_limit(scale, dtype)
  return jnp.clip(x.astype(_F32) * scale, -limit, limit).astype(dtype)


def _cast_mx(x: jax.Array, scale: jax.Array, dtype: np.dtype) -> jax.Array:
  """:func:`_cast` for MX blocks, whose dequantised values stay finite.

  Near float32's maximum, rounding to the FP8 grid can round a block's
  largest elements up to a value that times the block's scale is 2**128
  (1.99 * 2**127 rounds to 2 * 2**127 with E4M3's 3 mantissa bits). Those
  elements are clipped instead to the largest FP8 value whose dequantised
  value is finite, ``(2 - 2**-mantissa) * 2**127 * scale`` (exact: the
  scales are powers of two), one FP8 ulp below.
  """
  fmax = np.float32(jnp.finfo(dtype).max)
  nmant = int(jnp.finfo(dtype).nmant)
  top = np.float32((2.0 - 2.0 ** -nmant) * 2.0 ** 127)
  limit = jnp.minimum(fmax, top * scale)[..., None]
  return jnp.clip(x.astype(_F32) * scale[..., None], -limit, limit
                  ).astype(dtype)


def quantize_blocks(x: jax.Array, layout: Layout
                    ) -> tuple[jax.Array, jax.Array]:
  """Quantises ``x (B, P, C)`` in blocks along its last (contracting) axis.

  Args:
    x: a floating array of rank 3.
    layout: how.

  Returns:
    ``(q, scale_inv)``: FP8 ``(B, P, nb, bs)`` (``C`` zero-padded to
    ``nb * bs``) and float32 ``(B, P, nb)``, with ``x ~= q * scale_inv``
    block by block. A block holding inf or NaN has a NaN ``scale_inv``.

  Example:
    >>> import jax.numpy as jnp, numpy as np
    >>> from jmp_lite.fp8._blocked import Layout, quantize_blocks
    >>> x = jnp.array([[[1.0, 2.0, 300.0, 0.5]]])
    >>> q, inv = quantize_blocks(x, Layout("mx", np.dtype(jnp.float8_e4m3fn),
    ...                                    bs=2))
    >>> q.shape, inv.tolist()
    ((1, 1, 2, 2), [[[0.0078125, 1.0]]])
  """
  b, p, c = x.shape
  if layout.kind == "row":
    bs, nb = max(c, 1), 1
  else:
    bs = layout.bs
    nb = max(math.ceil(c / bs), 1)
  # Zero-padded to whole blocks, and to one block where C is 0 (a matmul
  # over an empty contracting dimension: zeros, as lax.dot_general gives).
  if nb * bs != c:
    x = jnp.pad(x, [(0, 0), (0, 0), (0, nb * bs - c)])
  blocks = x.reshape(b, p, nb, bs)
  absx = jnp.abs(blocks).astype(_F32)
  if layout.kind == "square":
    tiles = pad_to(absx, 1, bs)
    mp = tiles.shape[1] // bs
    amax = jnp.max(tiles.reshape(b, mp, bs, nb, bs), axis=(2, 4))
    amax = jnp.repeat(amax, bs, axis=1)[:, :p]
  else:
    amax = jnp.max(absx, axis=3)
  if layout.kind == "mx":
    exp = mx_exponent(amax, layout.dtype, layout.rounding)
    nan = exp > E8M0_MAX
    # 2**-127, E8M0's smallest scale, is a float32 subnormal, which XLA
    # flushes to zero (a block of tiny values would dequantise to 0): the
    # scales stop at 2**-126, as per-tensor ones do.
    exp = jnp.clip(exp, _SCALE_MIN_EXP, E8M0_MAX)
    inv = jnp.where(nan, np.float32(np.nan), pow2(exp))
    scale = pow2(-exp)
    return _cast_mx(blocks, scale, layout.dtype), inv
  scale = scale_for(amax, layout.dtype, layout.margin)
  inv = scale_inv_for(scale, amax)
  return _cast(blocks, scale[..., None], layout.dtype), inv


def dequantize_blocks(q: jax.Array, scale_inv: jax.Array,
                      size: int) -> jax.Array:
  """The float32 values ``q * scale_inv`` of :func:`quantize_blocks`, unpadded.

  Example:
    >>> import jax.numpy as jnp, numpy as np
    >>> from jmp_lite.fp8._blocked import Layout, dequantize_blocks
    >>> from jmp_lite.fp8._blocked import quantize_blocks
    >>> x = jnp.array([[[1.0, 3.0, -0.3]]])
    >>> q, inv = quantize_blocks(x, Layout("row", np.dtype(jnp.float8_e4m3fn)))
    >>> back = dequantize_blocks(q, inv, 3)[0, 0].tolist()  # 3 -> 448
    >>> [round(v, 3) for v in back]
    [0.964, 3.0, -0.295]
  """
  b, p, nb, bs = q.shape
  out = q.astype(_F32) * scale_inv[..., None]
  return out.reshape(b, p, nb * bs)[..., :size]


def _qdot(a: jax.Array, b: jax.Array, la: Layout, lb: Layout) -> jax.Array:
  """``a (B, P, C) . b (B, Q, C) -> (B, P, Q)`` float32, block-scaled FP8."""
  qa, ia = quantize_blocks(a, la)
  qb, ib = quantize_blocks(b, lb)
  if la.kind == lb.kind == "mx":
    return scaled_dot(qa, ia, qb, ib)
  if qa.shape[2] == 1:
    # "row": one block, so one FP8 dot without the block axis (a second
    # batch dimension of size 1 buys nothing), de-scaled per row and column
    # after.
    part = fp8_matmul(qa[:, :, 0], qb[:, :, 0], (((2,), (2,)), ((0,), (0,))))
    return descale(part, ia[:, :, :1], jnp.swapaxes(ib, 1, 2))
  if not _gemm_fits(qa, qb):
    return looped_dot(qa, ia, qb, ib)
  # The kernel where the program is lowered for a CUDA GPU, the scan
  # elsewhere: decided per lowering platform, not by the default backend
  # (a CPU computation on a GPU host must not get a GPU kernel).
  return jax.lax.platform_dependent(
      qa, ia, qb, ib,
      cuda=lambda *a: _varying_as(block_scaled_dot(*a), qa, qb),
      default=looped_dot)


def _gemm_fits(qa: jax.Array, qb: jax.Array) -> bool:
  """Whether "block" can run as one Pallas GEMM kernel: dots large enough
  for a GEMM (the tensor cores' tiles are 16 wide) with power-of-two
  blocks (Triton's tiles)."""
  bs = qa.shape[3]
  nv = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))
  if qa.dtype not in nv or qb.dtype not in nv:
    return False  # fnuz: Pallas' Triton lowering cannot convert them
  return (min(qa.shape[1], qb.shape[1]) >= 16 and bs >= 16
          and bs & (bs - 1) == 0)


def batched_dot(qa: jax.Array, ia: jax.Array, qb: jax.Array,
                ib: jax.Array) -> jax.Array:
  """Quantised blocks' product, one FP8 dot with the blocks as a batch.

  ``qa (B, P, nb, bs)`` with de-scale factors ``ia (B, P, nb)`` times ``qb
  (B, Q, nb, bs)``, ``ib (B, Q, nb)``, into float32 ``(B, P, Q)``.
  """
  # (B, nb, P, Q): one exact FP8 product per block, accumulated in float32.
  part = fp8_matmul(qa, qb, (((3,), (3,)), ((0, 2), (0, 2))))
  scaled = descale(part, jnp.transpose(ia, (0, 2, 1))[..., None],
                   jnp.transpose(ib, (0, 2, 1))[:, :, None, :])
  return jnp.sum(scaled, axis=1)


def looped_dot(qa: jax.Array, ia: jax.Array, qb: jax.Array,
               ib: jax.Array) -> jax.Array:
  """:func:`batched_dot`, one block at a time into one float32 accumulator.

  The same products and sums (in block order) without the ``nb``-fold
  float32 intermediate: a ``lax.scan`` over the blocks, each step one FP8
  dot of ``bs``-long rows, de-scaled and added.
  """
  def step(acc: jax.Array, block: tuple[jax.Array, ...]
           ) -> tuple[jax.Array, None]:
    qa_k, ia_k, qb_k, ib_k = block
    part = fp8_matmul(qa_k, qb_k, (((2,), (2,)), ((0,), (0,))))
    return acc + descale(part, ia_k[:, :, None], ib_k[:, None, :]), None

  b, p, _, _ = qa.shape
  blocks = (jnp.moveaxis(qa, 2, 0), jnp.moveaxis(ia, 2, 0),
            jnp.moveaxis(qb, 2, 0), jnp.moveaxis(ib, 2, 0))
  # The carry must vary over the mesh axes its sums will (under shard_map).
  acc = _varying_as(jnp.zeros((b, p, qb.shape[1]), _F32), *blocks)
  return jax.lax.scan(step, acc, blocks)[0]


def scaled_dot(qa: jax.Array, ia: jax.Array, qb: jax.Array,
               ib: jax.Array) -> jax.Array:
  """:func:`batched_dot` for MX blocks, through XLA's block-scaled dot.

  The de-scale factors must be powers of two (or NaN), as MX's are.
  """
  b, p, nb, bs = qa.shape
  # E8M0 holds the powers of two exactly, and a non-finite block's NaN.
  e8m0 = jnp.float8_e8m0fnu
  out = jax.lax.scaled_dot(
      qa.reshape(b, p, nb * bs), qb.reshape(b, qb.shape[1], nb * bs),
      lhs_scale=ia.astype(e8m0), rhs_scale=ib.astype(e8m0),
      dimension_numbers=(((2,), (2,)), ((0,), (0,))),
      preferred_element_type=_F32)
  # Inside shard_map (check_vma) lax.scaled_dot's result forgets the mesh
  # axes its operands vary over (JAX 0.10); a custom VJP then refuses the
  # gradient's type. Say them again.
  return _varying_as(out, qa, qb)


def _varying_as(x: jax.Array, *operands: jax.Array) -> jax.Array:
  """``x``, typed as varying over every ``shard_map`` axis the operands
  vary over (a no-op outside ``shard_map``)."""
  axes = frozenset().union(*map(varying_axes, operands)) - varying_axes(x)
  if not axes:
    return x
  return jax.lax.pcast(x, tuple(sorted(axes)), to="varying")


@dataclasses.dataclass(frozen=True)
class _Plan:
  """The layouts of the three matmuls' operands, and the result's dtype."""

  fwd: tuple[Layout, Layout]
  dgrad: tuple[Layout, Layout]
  wgrad: tuple[Layout, Layout]
  out_dtype: np.dtype


def plan_for(recipe: Any, out_dtype: np.dtype) -> _Plan:
  """The layouts a fine-grained recipe gives each operand of each matmul.

  Forward ``x . w``: x is the lhs, w the rhs. Input gradient ``g . w^T``:
  g the lhs, w the rhs. Weight gradient ``g^T . x`` (contracting the
  rows): both are lhs-like (``1 x bs`` blocks along the rows), as in
  DeepSeek-V3.
  """
  if isinstance(recipe, MXFP8):
    f = Layout("mx", recipe.fwd_dtype, 0, MXFP8.BLOCK, recipe.scale_rounding)
    g = dataclasses.replace(f, dtype=recipe.bwd_dtype)
    return _Plan((f, f), (g, f), (g, f), out_dtype)
  fwd, bwd, m = recipe.fwd_dtype, recipe.bwd_dtype, recipe.margin
  bs = recipe.block_size
  if recipe.granularity == "row":
    f, g = Layout("row", fwd, m), Layout("row", bwd, m)
    return _Plan((f, f), (g, f), (g, f), out_dtype)
  vec, sq = Layout("vector", fwd, m, bs), Layout("square", fwd, m, bs)
  gv = Layout("vector", bwd, m, bs)
  return _Plan((vec, sq), (gv, sq), (gv, vec), out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _canonical(x: jax.Array, w: jax.Array, plan: _Plan) -> jax.Array:
  """``x (B, M, K) . w (B, N, K) -> (B, M, N)`` under ``plan``."""
  return _qdot(x, w, *plan.fwd).astype(plan.out_dtype)


def _canonical_fwd(x, w, plan):
  return _canonical(x, w, plan), (x, w)


def _canonical_bwd(plan, res, g):
  x, w = res
  # d x = g (B, M, N) . w^T (B, K, N); d w = g^T (B, N, M) . x^T (B, K, M).
  dx = _qdot(g, jnp.swapaxes(w, 1, 2), *plan.dgrad)
  dw = _qdot(jnp.swapaxes(g, 1, 2), jnp.swapaxes(x, 1, 2), *plan.wgrad)
  dx = like_primal(dx, x, jax.lax.psum)
  dw = like_primal(dw, w, jax.lax.psum)
  return dx.astype(x.dtype), dw.astype(w.dtype)


_canonical.defvjp(_canonical_fwd, _canonical_bwd)


def fine_dot(lhs: jax.Array, rhs: jax.Array, dims: Any, recipe: Any,
             out_dtype: np.dtype) -> jax.Array:
  """``lax.dot_general(lhs, rhs, dims)`` with a row/block/MX FP8 recipe.

  The operands are transposed and reshaped (outside the custom VJP, so JAX
  differentiates that part) to the canonical ``(B, M, K)`` and
  ``(B, N, K)``, multiplied, and the result reshaped to ``dot_general``'s
  ``(batch..., lhs free..., rhs free...)``.

  Example:
    >>> import jax.numpy as jnp, numpy as np, jmp_lite
    >>> from jmp_lite.fp8._blocked import fine_dot
    >>> y = fine_dot(jnp.ones((2, 40)), jnp.ones((40, 3)),
    ...              (((1,), (0,)), ((), ())), jmp_lite.fp8.MXFP8(),
    ...              np.dtype("float32"))
    >>> y.tolist()
    [[40.0, 40.0, 40.0], [40.0, 40.0, 40.0]]
  """
  (lc, rc), (lb, rb) = dims
  l_free = tuple(d for d in range(lhs.ndim) if d not in (*lc, *lb))
  r_free = tuple(d for d in range(rhs.ndim) if d not in (*rc, *rb))
  batch = tuple(lhs.shape[d] for d in lb)
  nbat = math.prod(batch)
  m_shape = tuple(lhs.shape[d] for d in l_free)
  n_shape = tuple(rhs.shape[d] for d in r_free)
  k = math.prod(lhs.shape[d] for d in lc)
  x = jnp.transpose(lhs, (*lb, *l_free, *lc)).reshape(
      nbat, math.prod(m_shape), k)
  w = jnp.transpose(rhs, (*rb, *r_free, *rc)).reshape(
      nbat, math.prod(n_shape), k)
  out = cast(jax.Array, _canonical(x, w, plan_for(recipe, out_dtype)))
  return out.reshape(*batch, *m_shape, *n_shape)
