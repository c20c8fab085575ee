"""What the FP8 and FP4 packages share: exact powers of two, and the checks
of a ``dot_general``'s arguments (private; imports only JAX and numpy)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

DimensionNumbers = tuple[tuple[tuple[int, ...], tuple[int, ...]],
                         tuple[tuple[int, ...], tuple[int, ...]]]


def pow2(e: jax.Array) -> jax.Array:
  """``2.0 ** e`` in float32, exact (from the bits), for ints in [-149, 127].

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite._lowbit import pow2
    >>> pow2(jnp.array([-127, 0, 3])).tolist() == [2.0 ** -127, 1.0, 8.0]
    True
  """
  e = jnp.asarray(e, jnp.int32)
  normal = jax.lax.bitcast_convert_type((jnp.maximum(e, -126) + 127) << 23,
                                        jnp.float32)
  sub = jax.lax.bitcast_convert_type(
      jnp.left_shift(jnp.int32(1), jnp.clip(e + 149, 0, 22)), jnp.float32)
  return jnp.where(e >= -126, normal, sub)


def normalize_dims(dimension_numbers: Any) -> DimensionNumbers:
  """``((lc, rc), (lb, rb))`` as tuples of ints, or a TypeError.

  Example:
    >>> from jmp_lite._lowbit import normalize_dims
    >>> normalize_dims((([1], [0]), ([], [])))
    (((1,), (0,)), ((), ()))
  """
  try:
    (lc, rc), (lb, rb) = dimension_numbers
    return ((tuple(int(d) for d in lc), tuple(int(d) for d in rc)),
            (tuple(int(d) for d in lb), tuple(int(d) for d in rb)))
  except (TypeError, ValueError):
    raise TypeError(
        "dimension_numbers must be ((lhs_contracting, rhs_contracting),"
        f" (lhs_batch, rhs_batch)), got {dimension_numbers!r}") from None


def check_like_lax(lhs: jax.Array, rhs: jax.Array, dims: DimensionNumbers,
                   precision: Any, preferred_element_type: Any, *,
                   who: str) -> None:
  """Refuses what ``jax.lax.dot_general`` refuses, with its message.

  The low-bit matmuls transpose and reshape their operands before any dot,
  so dimension numbers that ``dot_general`` rejects (unequal or out-of-range
  dimension lists, duplicates, mismatched sizes) would otherwise reach a
  reshape that may happen to succeed and contract the wrong elements. An
  abstract evaluation of ``dot_general`` itself on the operands' shapes
  checks them exactly as it does (and ``precision``), at no run-time cost.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite._lowbit import check_like_lax
    >>> x, w = jnp.ones((2, 6)), jnp.ones((3, 2))
    >>> try:
    ...   check_like_lax(x, w, (((1,), (0,)), ((), ())), None, None,
    ...                  who="fp8")
    ... except TypeError as e:
    ...   print(str(e).split(" to have")[0])
    fp8 dot_general: dot_general requires contracting dimensions
  """
  if preferred_element_type is not None and not jnp.issubdtype(
      preferred_element_type, jnp.floating):
    raise TypeError(
        f"{who} dot_general: preferred_element_type must be a floating dtype"
        f" (the {who.upper()} product is a float), got"
        f" {preferred_element_type!r}")
  spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
  try:
    jax.eval_shape(functools.partial(jax.lax.dot_general,
                                     dimension_numbers=dims,
                                     precision=precision), spec(lhs),
                   spec(rhs))
  except (TypeError, ValueError) as e:
    raise type(e)(f"{who} dot_general: {e} (lhs shape {lhs.shape}, rhs shape"
                  f" {rhs.shape}, dimension_numbers {dims})") from None
