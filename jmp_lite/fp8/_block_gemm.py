"""The block-scaled FP8 GEMM as one Pallas kernel (GPUs).

"block" scaling gives each operand one de-scale factor per row and
contracting block of ``bs`` elements (DeepSeek-V3's 1x128 activation and
128x128 weight tiles; a 128x128 tile's factor is repeated over its rows).
:func:`jmp_lite.fp8._blocked.looped_dot` computes that product as ``nb``
FP8 dots in a ``lax.scan``, each a full pass over the float32 output: on a
GPU ``nb`` thin GEMMs and as many read-modify-writes of the output. Here
one kernel program owns a ``bm x bn`` output tile in registers and walks
the contracting blocks: per block one tensor-core product of the FP8
operands into a fresh float32 tile, de-scaled by the block's row and
column factors and added to the accumulator, the structure of DeepGEMM's
FP8 GEMM. (Pallas' Triton lowering leaves the dot's ``maxNumImpreciseAcc``
at 0, so on Hopper Triton widens the operands to float16 and uses
``mma.sync``, not FP8 ``wgmma``: docs/fp8.md.) The sums
are :func:`looped_dot`'s, block by block in the same order; within a block
the tensor cores' order may differ (float32 rounding).

Pallas lowers it through Triton on GPUs; :func:`block_scaled_dot` runs it
in Pallas' interpreter elsewhere when asked (the tests), and the recipes
call it on GPUs only (:func:`jmp_lite.fp8._blocked.looped_dot` elsewhere).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jmp_lite._jaxpr import align_varying
from jmp_lite.fp8._matmul import descale

__all__ = ["block_scaled_dot", "tile_sizes"]

_F32 = np.dtype(np.float32)


def tile_sizes(p: int, q: int) -> tuple[int, int]:
  """The output tile ``(bm, bn)`` for a ``(P, Q)`` product: 128 x 64, or
  the dimension's next power of two (at least 16, the tensor cores'
  smallest) where it is shorter. Of the tiles tried on an H100 (64 to 256
  a side, ``benchmarks/fp8_block_gemm.py``), 128 x 64 with 4 warps and a
  4-stage pipeline ran fastest at both of a Transformer block's shapes.

  Example:
    >>> from jmp_lite.fp8._block_gemm import tile_sizes
    >>> tile_sizes(8192, 40)
    (128, 64)
  """
  def one(n: int, most: int) -> int:
    return min(most, max(16, 1 << (max(n, 1) - 1).bit_length()))
  return one(p, 128), one(q, 64)


def _kernel(a_ref, iat_ref, b_ref, ibt_ref, out_ref, *, nb: int, bs: int,
            scaling: str):
  """One ``bm x bn`` output tile: the contracting blocks in order."""
  def body(k, acc):
    a = a_ref[:, pl.ds(k * bs, bs)]
    b = b_ref[:, pl.ds(k * bs, bs)]
    if a.dtype != b.dtype:
      # E5M2 times E4M3 (a gradient times a weight): Triton's FP8 dot takes
      # one format, so both go to float16, which holds every value of each
      # exactly (the products are exact in float32 either way).
      a, b = a.astype(jnp.float16), b.astype(jnp.float16)
    part = jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)
    # The block's row factors (bm, 1) and column factors (1, bn), each
    # loaded as one contiguous row (factors are stored block-major).
    row = iat_ref[pl.ds(k, 1), :].T
    col = ibt_ref[pl.ds(k, 1), :]
    if scaling == "product":  # Measured only: overflows at extreme scales.
      return acc + part * (row * col)
    return acc + descale(part, row, col)

  out_ref[...] = jax.lax.fori_loop(
      0, nb, body, jnp.zeros(out_ref.shape, jnp.float32))


@functools.partial(jax.jit, static_argnames=(
    "interpret", "tiles", "num_warps", "num_stages", "scaling"))
def block_scaled_dot(qa: jax.Array, ia: jax.Array, qb: jax.Array,
                     ib: jax.Array, *, interpret: bool = False,
                     tiles: tuple[int, int] | None = None, num_warps: int = 4,
                     num_stages: int = 4, scaling: str = "safe"
                     ) -> jax.Array:
  """``qa (B, P, nb, bs)`` with de-scale factors ``ia (B, P, nb)`` times
  ``qb (B, Q, nb, bs)``, ``ib (B, Q, nb)``: float32 ``(B, P, Q)``, summed
  block by block as :func:`jmp_lite.fp8._blocked.looped_dot` does.

  ``interpret=True`` runs the kernel in Pallas' interpreter (any backend);
  otherwise Triton compiles it for the GPU, with output tiles ``tiles``
  (default :func:`tile_sizes`), ``num_warps`` and ``num_stages`` (its
  software pipeline's depth). ``scaling="product"`` de-scales by the
  plain product of the two factors (cheaper, but it leaves float32's range
  at extreme scales): for measurements only.

  Example:
    >>> import jax.numpy as jnp, numpy as np
    >>> from jmp_lite.fp8._block_gemm import block_scaled_dot
    >>> e4m3 = jnp.float8_e4m3fn
    >>> qa = jnp.ones((1, 16, 2, 16), e4m3)
    >>> ia = jnp.full((1, 16, 2), 0.5)
    >>> out = block_scaled_dot(qa, ia, qa, ia, interpret=True)
    >>> out.shape, float(out[0, 0, 0])  # 2 blocks x 16 x 0.25
    ((1, 16, 16), 8.0)
  """
  if scaling not in ("safe", "product"):
    raise ValueError(
        f"block_scaled_dot: scaling must be 'safe' or 'product', got"
        f" {scaling!r}")
  b, p, nb, bs = qa.shape
  q = qb.shape[1]
  bm, bn = tiles or tile_sizes(p, q)
  # Triton's tiles and slices are powers of two (the interpreter runs any).
  odd = {name: v for name, v in (("block size", bs), ("tile rows", bm),
                                  ("tile columns", bn)) if v & (v - 1)}
  if odd and not interpret:
    raise ValueError(
        f"block_scaled_dot: Triton needs powers of two, got {odd}; pad the"
        " blocks or pick other tiles (or use looped_dot)")
  pp, qp = -(-p // bm) * bm, -(-q // bn) * bn
  # Whole tiles: padding rows are zeros with factor 1, and cut off below.
  a = jnp.pad(qa.reshape(b, p, nb * bs), [(0, 0), (0, pp - p), (0, 0)])
  bq = jnp.pad(qb.reshape(b, q, nb * bs), [(0, 0), (0, qp - q), (0, 0)])
  # Factors as (B, nb, P) and (B, nb, Q): a block's load as one row.
  iat = jnp.pad(jnp.swapaxes(ia.astype(_F32), 1, 2),
                [(0, 0), (0, 0), (0, pp - p)], constant_values=1.0)
  ibt = jnp.pad(jnp.swapaxes(ib.astype(_F32), 1, 2),
                [(0, 0), (0, 0), (0, qp - q)], constant_values=1.0)
  # Under shard_map (check_vma) every operand and the output must carry the
  # mesh axes the product varies over.
  (a, iat, bq, ibt), varying = align_varying([a, iat, bq, ibt])
  out = pl.pallas_call(
      functools.partial(_kernel, nb=nb, bs=bs, scaling=scaling),
      grid=(b, pp // bm, qp // bn),
      in_specs=[
          pl.BlockSpec((None, bm, nb * bs), lambda i, j, k: (i, j, 0)),
          pl.BlockSpec((None, nb, bm), lambda i, j, k: (i, 0, j)),
          pl.BlockSpec((None, bn, nb * bs), lambda i, j, k: (i, k, 0)),
          pl.BlockSpec((None, nb, bn), lambda i, j, k: (i, 0, k)),
      ],
      out_specs=pl.BlockSpec((None, bm, bn), lambda i, j, k: (i, j, k)),
      out_shape=jax.ShapeDtypeStruct((b, pp, qp), _F32, **varying),
      interpret=interpret,
      compiler_params=None if interpret else pltriton.CompilerParams(
          num_warps=num_warps, num_stages=num_stages),
  )(a, iat, bq, ibt)
  return out[:, :p, :q]
