"""What both FP8 matmul formulations share: the FP8 x FP8 dot, de-scaling,
argument checks and the ``shard_map`` cotangent rule.

Per-tensor scaling (``_dot``) and the finer recipes (``_blocked``, which
``_dot`` dispatches to) both build on these; keeping them below both keeps
the import graph one-way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._jaxpr import varying_axes
from jmp_lite._lowbit import DimensionNumbers
from jmp_lite.dtypes import float8_values

__all__ = ["descale", "fp8_matmul", "like_primal"]

_F32 = np.dtype(np.float32)

# XLA:GPU runs a dot whose two operands hold fewer elements than this, batch
# dimensions aside, in its loop emitter instead of a GEMM library
# (``--xla_gpu_gemm_rewrite_size_threshold``, default 100). There FP8 operands
# are converted to float16 and multiplied in float16, where products of
# scaled FP8 values (up to 448 * 448) overflow: measured on an H100, a
# 4x8 @ 8x3 FP8 dot came back inf and NaN.
GPU_LOOP_DOT_ELEMENTS = 100


def fp8_matmul(lhs: jax.Array, rhs: jax.Array, dims: DimensionNumbers,
               **kwargs: Any) -> jax.Array:
  """``dot_general`` of two FP8 arrays, accumulated and returned in float32.

  On a GPU, a dot too small for a GEMM library (see above) runs on the FP8
  values in float32 instead: the same products, never overflowing.
  """
  (_, _), (lb, rb) = dims
  if jax.default_backend() == "gpu":
    per_batch = sum(
        int(np.prod([n for d, n in enumerate(x.shape) if d not in batch]))
        for x, batch in ((lhs, lb), (rhs, rb)))
    if per_batch < GPU_LOOP_DOT_ELEMENTS:
      # Decoded from the bits: a cast to float32 would be deleted with the
      # quantising cast before it (XLA:GPU's excess precision), leaving
      # unrounded values.
      lhs, rhs = float8_values(lhs), float8_values(rhs)
  return jax.lax.dot_general(lhs, rhs, dims, preferred_element_type=_F32,
                             **kwargs)


def descale(x: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
  """``x * a * b`` (broadcasting), never under- or overflowing on the way.

  ``x`` is a float32 product of FP8 values, ``a`` and ``b`` the operands'
  de-scale factors (normal positive numbers, or NaN). ``x * (a * b)``
  fails where ``a * b`` leaves float32's normal range (operands near 1e-34
  or near its maximum), and ``(x * a) * b`` where ``x * a`` does. Split
  each factor at 1 instead, ``a = a_hi * a_lo`` with ``a_hi = max(a, 1)``
  and ``a_lo = min(a, 1)``, and multiply by ``a_hi * b_lo``, then by
  ``a_lo * b_hi``: each factor pairs a number >= 1 with one <= 1, so it is
  normal, and the intermediate result lies between ``x`` and the result
  (in magnitude), so neither step leaves the range where the result is a
  normal float32. No selects: two more multiplies, fused with the two the
  plain product needs.

  Example:
    >>> import jax.numpy as jnp, numpy as np
    >>> from jmp_lite.fp8._matmul import descale
    >>> x, a, b = jnp.float32(448 * 448), jnp.float32(1e-36), jnp.float32(1e-4)
    >>> bool(np.isclose(descale(x, a, b), 448 * 448 * 1e-40, rtol=1e-6))
    True
    >>> float(x * (a * b))  # a * b = 1e-40 is flushed to zero first
    0.0
  """
  one = np.float32(1)
  first = jnp.maximum(a, one) * jnp.minimum(b, one)
  second = jnp.minimum(a, one) * jnp.maximum(b, one)
  return x * first * second


def like_primal(ct: jax.Array, primal: jax.Array,
                reduce: Callable[..., jax.Array]) -> jax.Array:
  """``ct`` reduced over the mapped axes it varies over and ``primal`` not.

  Inside ``shard_map`` an operand replicated over an axis (a weight) meets
  one that varies over it (the batch): its cotangent is the sum over that
  axis (the transpose of JAX's implicit broadcast), and an observed amax the
  maximum.
  """
  extra = tuple(sorted(varying_axes(ct) - varying_axes(primal)))
  return reduce(ct, extra) if extra else ct
