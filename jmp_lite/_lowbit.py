"""What the FP8 and FP4 packages share: exact powers of two, MX (E8M0)
scale exponents, padding to whole blocks, the checks of a
``dot_general``'s arguments and running their matmuls on operands sharded
in their types (private; imports only JAX, numpy and ``_jaxpr``)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._jaxpr import type_sharding

# E8M0's exponent range (its 0xFF encoding is NaN).
E8M0_MIN, E8M0_MAX = -127, 127

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


def _exponent_bits(a: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(E, mantissa bits)`` of positive finite float32 ``a = 1.m * 2**E``.

  Subnormals are first scaled by ``2**64`` (exact) so that their leading
  bit is in the exponent field.
  """
  small = a < np.float32(2.0 ** -126)
  a = jnp.where(small, a * np.float32(2.0 ** 64), a)
  bits = jax.lax.bitcast_convert_type(a, jnp.int32)
  e = ((bits >> 23) & 0xFF) - 127 - jnp.where(small, 64, 0)
  return e, bits & 0x7FFFFF


def mx_exponent(amax: jax.Array, dtype: Any,
                rounding: str = "up") -> jax.Array:
  """The E8M0 scale exponent (int32) of blocks with these amaxes.

  ``"up"``: the smallest ``e`` with ``amax <= finfo(dtype).max * 2**e``.
  ``"floor"`` (OCP MX v1.0): ``floor(log2(amax)) - emax(dtype)``. Both come
  from the bits of ``amax`` and of the format's maximum; an amax of 0 gives
  the smallest exponent, -127. Non-finite amaxes give 128 (E8M0's NaN).

  Example:
    >>> import jax.numpy as jnp, numpy as np
    >>> from jmp_lite._lowbit import mx_exponent
    >>> above = np.nextafter(np.float32(448), np.float32(1000))
    >>> mx_exponent(jnp.array([448.0, above, 1.0, 0.0]),
    ...             jnp.float8_e4m3fn).tolist()
    [0, 1, -8, -127]
    >>> mx_exponent(jnp.array([6.0, 6.5, 1.0]), jnp.float4_e2m1fn).tolist()
    [0, 1, -2]
  """
  fmax = np.float32(jnp.finfo(dtype).max)
  fmax_bits = int(np.asarray(fmax).view(np.int32))
  fmax_e, fmax_m = ((fmax_bits >> 23) & 0xFF) - 127, fmax_bits & 0x7FFFFF
  amax = jnp.asarray(amax, jnp.float32)
  finite = jnp.isfinite(amax)
  safe = jnp.where(finite & (amax > 0), amax, np.float32(1))
  e, m = _exponent_bits(safe)
  if rounding == "up":
    # amax = 1.m * 2**E <= 1.fm * 2**(Ef + e) iff e >= E - Ef (+1 if m > fm).
    exp = e - fmax_e + jnp.where(m > fmax_m, 1, 0)
  else:
    exp = e - fmax_e
  exp = jnp.where(amax > 0, exp, E8M0_MIN)
  exp = jnp.clip(exp, E8M0_MIN, E8M0_MAX)
  return jnp.where(finite, exp, E8M0_MAX + 1).astype(jnp.int32)


def pad_to(x: jax.Array, axis: int, multiple: int) -> jax.Array:
  """``x`` zero-padded at the end of ``axis`` to a multiple of ``multiple``.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite._lowbit import pad_to
    >>> pad_to(jnp.ones((2, 5)), 1, 4).shape
    (2, 8)
  """
  extra = -x.shape[axis] % multiple
  if not extra:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths)


def floating(x: Any, what: str, *, who: str) -> jax.Array:
  """``x`` as an array, or a TypeError unless it is floating.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite._lowbit import floating
    >>> try:
    ...   floating(jnp.arange(3), "lhs", who="fp4")
    ... except TypeError as e:
    ...   print(e)
    fp4 dot_general: lhs must be a floating array, got int32
  """
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{who} dot_general: {what} must be a floating array,"
                    f" got {x.dtype}")
  return x


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


def on_auto_axes(fn: Any, args: tuple[Any, ...], out_sharding: Any) -> Any:
  """``fn(*args)``; where an argument's type is sharded (explicit mesh
  axes, under ``jax.set_mesh``), run with the mesh's axes as auto axes
  (XLA's sharding propagation, as under plain ``jit``), the result sharded
  as ``out_sharding`` says (a sharding or spec, or a pytree of them).

  The block-scaled formats reshape, pad and contract their operands in ways
  explicit axes would make every caller spell out; their values do not
  depend on the sharding.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite._lowbit import on_auto_axes
    >>> on_auto_axes(jnp.sum, (jnp.ones(3),), None).tolist()
    3.0
  """
  if not _explicit(args):
    return fn(*args)
  run: Any = jax.sharding.auto_axes(fn, out_sharding=out_sharding)
  return run(*args)


def _explicit(args: Any) -> bool:
  """Whether an array of ``args`` is sharded in its type, outside
  ``shard_map``: inside it (manual axes, all or some) the explicit axes
  left cannot be made auto, and calls run as written."""
  if getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()):
    return False
  return any(type_sharding(a) is not None for a in jax.tree.leaves(args))


def under_auto_axes(matmul: Any, lhs: jax.Array, rhs: jax.Array,
                    dims: DimensionNumbers, out_dtype: Any,
                    out_sharding: Any, *extra: Any) -> jax.Array:
  """``matmul(lhs, rhs, *extra)``, sharded as ``jax.lax.dot_general`` shards
  it. ``extra``: more arrays the matmul reads (a PRNG key), passed as
  arguments: an array closed over keeps its explicit type inside.

  Where an operand's type is sharded (explicit mesh axes), the matmul runs
  on auto axes (as :func:`on_auto_axes`; the gradient matmuls contract
  sharded dimensions, which explicit axes refuse), and its result takes
  ``out_sharding`` or else the sharding ``dot_general`` gives these
  operands (JAX's own error where that is ambiguous: pass
  ``out_sharding``, as ``dot_general`` asks). Elsewhere (inside
  ``shard_map`` too) it is a plain call, resharded to ``out_sharding`` if
  given.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite._lowbit import under_auto_axes
    >>> dims = (((1,), (0,)), ((), ()))
    >>> under_auto_axes(jnp.matmul, jnp.ones((2, 3)), jnp.ones((3, 4)),
    ...                 dims, jnp.float32, None).shape
    (2, 4)
  """
  if not _explicit((lhs, rhs)):
    out = matmul(lhs, rhs, *extra)
    return out if out_sharding is None else jax.sharding.reshard(
        out, out_sharding)
  if out_sharding is None:
    out_sharding = jax.eval_shape(
        functools.partial(jax.lax.dot_general, dimension_numbers=dims,
                          preferred_element_type=out_dtype), lhs, rhs
    ).sharding
  run: Any = jax.sharding.auto_axes(matmul, out_sharding=out_sharding)
  return run(lhs, rhs, *extra)
