"""Floating dtypes: names, aliases, parsing, and the backend's half dtype.

Also the one definition of which pytree leaves mixed-precision casts touch
(:func:`is_floating_array`, :func:`is_inexact_array`) and which they must
never enter (:func:`is_opaque`): every cast in jmp_lite goes through here;
and :func:`round_to`, rounding that no compiler simplifies away.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["at_least_float32", "canonical_name", "cast_floating",
           "float8_values", "half_dtype", "is_floating_array",
           "is_inexact_array", "is_live_state", "is_opaque", "parse_dtype",
           "round_to", "to_floating_dtype", "update_between"]

# Canonical short name first: it is what ``str(Policy)`` prints.
_ALIASES: dict[np.dtype, tuple[str, ...]] = {
    np.dtype(jnp.float32): ("f32", "float32", "full", "fp32"),
    np.dtype(jnp.bfloat16): ("bf16", "bfloat16"),
    np.dtype(jnp.float16): ("f16", "float16", "fp16"),
    np.dtype(jnp.float64): ("f64", "float64"),
}
_NAME_TO_DTYPE: dict[str, np.dtype] = {
    name: dtype for dtype, names in _ALIASES.items() for name in names
}

_VALID_DTYPE_NAMES = (
    "float32 (f32, fp32, full), bfloat16 (bf16), float16 (f16, fp16, half),"
    " float64 (f64)"
)


def half_dtype(device: Any = None) -> np.dtype:
  """Returns the half-precision dtype that runs fast on ``device``.

  bfloat16 on TPUs, on NVIDIA GPUs of compute capability 8.0 or newer
  (Ampere, Hopper, Blackwell: bfloat16 tensor cores and float32's range, so no
  loss scaling is needed) and on ROCm GPUs; float16 on older NVIDIA GPUs and,
  as in ``jmp``, on the CPU.

  Args:
    device: a ``jax.Device``; defaults to ``jax.local_devices()[0]``.

  Returns:
    ``np.dtype(jnp.bfloat16)`` or ``np.dtype(jnp.float16)``.

  Example:
    >>> import jmp_lite
    >>> jmp_lite.half_dtype()  # on the CPU backend
    dtype('float16')
  """
  if device is None:
    device = jax.local_devices()[0]
  if not isinstance(getattr(device, "platform", None), str):
    raise TypeError(
        "half_dtype expects a jax.Device (e.g. jax.devices()[0]) or None,"
        f" got {type(device).__name__}: {device!r}")
  platform = device.platform.lower()
  if platform == "tpu":
    return np.dtype(jnp.bfloat16)
  if platform in ("gpu", "cuda"):
    capability = getattr(device, "compute_capability", None)
    if capability is None:  # Not CUDA (ROCm reports platform "gpu" too).
      return np.dtype(jnp.bfloat16)
    major = int(str(capability).split(".")[0])
    return np.dtype(jnp.bfloat16 if major >= 8 else jnp.float16)
  if platform == "rocm":
    return np.dtype(jnp.bfloat16)
  return np.dtype(jnp.float16)


def parse_dtype(value: str) -> np.dtype:
  """Parses a dtype name or alias into a floating ``np.dtype``.

  Accepts ``float32/f32/fp32/full``, ``bfloat16/bf16``,
  ``float16/f16/fp16``, ``float64/f64``, ``half`` (the backend's
  :func:`half_dtype`), and the full name of any other JAX floating dtype
  (for example ``float8_e4m3fn``). Case and surrounding spaces are ignored.

  Args:
    value: the name to parse.

  Returns:
    The parsed ``np.dtype``.

  Raises:
    TypeError: if ``value`` is not a string.
    ValueError: if ``value`` names no floating dtype; the message lists the
      valid names.

  Example:
    >>> import jmp_lite
    >>> jmp_lite.dtypes.parse_dtype("bf16")
    dtype(bfloat16)
  """
  if not isinstance(value, str):
    raise TypeError(
        f"Expected a dtype name (str), got {type(value).__name__}: {value!r}"
    )
  name = value.strip().lower()
  if name == "half":
    return half_dtype()
  if name in _NAME_TO_DTYPE:
    return _NAME_TO_DTYPE[name]
  # Full names of the other floating dtypes (fp8 kinds), but not numpy's
  # one-letter codes such as 'f' or 'e', which would be easy typos.
  try:
    dtype = jnp.dtype(name)
  except (TypeError, SyntaxError):   # numpy parses ',' as a struct spec.
    dtype = None
  if dtype is not None and dtype.name == name and _is_floating(dtype):
    return dtype
  raise ValueError(
      f"Unknown dtype {value!r}; expected one of: {_VALID_DTYPE_NAMES}"
  )


def canonical_name(dtype: Any) -> str:
  """Returns the short name ``str(Policy)`` uses for ``dtype`` (``'bf16'``).

  Args:
    dtype: any dtype-like.

  Returns:
    ``f32``, ``bf16``, ``f16``, ``f64``, or the dtype's full name for others.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> jmp_lite.dtypes.canonical_name(jnp.bfloat16)
    'bf16'
  """
  dtype = np.dtype(dtype)
  names = _ALIASES.get(dtype)
  return names[0] if names else dtype.name


def to_floating_dtype(value: Any, what: str) -> np.dtype:
  """Canonicalises a dtype-like or alias string, requiring a real float.

  Args:
    value: a dtype, scalar type, or name accepted by :func:`parse_dtype`.
    what: the argument's name, for error messages.

  Returns:
    The canonical ``np.dtype``.

  Raises:
    TypeError: if ``value`` is ``None``, not a dtype, or an integer, bool or
      complex dtype.
    ValueError: if ``value`` is a string naming no floating dtype.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> jmp_lite.dtypes.to_floating_dtype(jnp.float16, "compute_dtype")
    dtype('float16')
  """
  if isinstance(value, str):
    return parse_dtype(value)
  if value is None:
    # np.dtype(None) is float64: taken silently, and float32 without x64.
    raise TypeError(
        f"{what} must be a floating dtype ({_VALID_DTYPE_NAMES}), got None")
  try:
    dtype = jnp.dtype(value)
  except TypeError:
    raise TypeError(
        f"{what} must be a floating dtype ({_VALID_DTYPE_NAMES}), got"
        f" {value!r}"
    ) from None
  if not _is_floating(dtype):
    raise TypeError(
        f"{what} must be a floating dtype ({_VALID_DTYPE_NAMES}), got"
        f" {dtype.name}"
    )
  return dtype


def _is_extended(dtype: Any) -> bool:
  # Typed PRNG keys (``key<fry>``) and other extended dtypes: numpy cannot
  # even interpret them, and they are never numbers to cast or check.
  return jnp.issubdtype(dtype, jax.dtypes.extended)


def _is_floating(dtype: Any) -> bool:
  if _is_extended(dtype):
    return False
  return dtype != jax.dtypes.float0 and jnp.issubdtype(dtype, jnp.floating)


def is_opaque(x: Any) -> bool:
  """True for nnx objects, which casts pass through whole.

  Flax nnx objects (modules, ``Rngs``, containers) are pytrees, so
  ``jax.tree.map`` would rebuild them: the caller's ``Rngs`` would stop
  advancing and a module would be silently copied. jmp_lite's casts hand
  them on as the very same objects. (A ``Variable`` inside a pytree of state,
  such as an ``nnx.State`` of params, is cast by value; the adapters pass
  variables given as call arguments through too, see :func:`is_live_state`.)
  Detected without importing Flax.

  Args:
    x: any pytree node.

  Returns:
    Whether ``x`` is an nnx object.

  Example:
    >>> import jmp_lite
    >>> jmp_lite.dtypes.is_opaque({"w": 1.0})
    False
  """
  nnx = sys.modules.get("flax.nnx")
  return nnx is not None and isinstance(x, nnx.Pytree)


def is_live_state(x: Any) -> bool:
  """True for state a model call must neither copy nor cast.

  nnx objects and variables (the caller's ``Rngs`` must advance), and
  Equinox's ``eqx.nn.State`` (batch statistics keep their dtype).

  Args:
    x: any pytree node.

  Returns:
    Whether ``x`` is such state.

  Example:
    >>> import jmp_lite
    >>> jmp_lite.dtypes.is_live_state([1.0])
    False
  """
  nnx = sys.modules.get("flax.nnx")
  if nnx is not None and isinstance(x, (nnx.Pytree, nnx.Variable)):
    return True
  eqx_nn = sys.modules.get("equinox.nn")
  return eqx_nn is not None and isinstance(x, eqx_nn.State)


def is_floating_array(x: Any) -> bool:
  """True for numpy/JAX arrays (and numpy scalars) of a real floating dtype.

  Python scalars, ``None``, integer, bool, complex and ``float0`` arrays,
  typed PRNG keys (any extended dtype) and arbitrary objects are not floating
  arrays: casts leave them alone.

  Args:
    x: any pytree leaf.

  Returns:
    Whether mixed-precision casts apply to ``x``.

  Example:
    >>> import numpy as np, jmp_lite
    >>> is_float = jmp_lite.dtypes.is_floating_array
    >>> is_float(np.ones(2)), is_float(1.0)
    (True, False)
  """
  if not isinstance(x, (jax.Array, np.ndarray, np.generic)):
    return False
  return _is_floating(x.dtype)


def cast_floating(tree: Any, dtype: Any) -> Any:
  """Casts the floating array leaves of ``tree`` to ``dtype``.

  Leaves already in ``dtype`` are returned as they are (no copy, and no
  convert op in the jaxpr); numpy stays numpy, JAX stays JAX; every other
  leaf passes through untouched, and so do nnx objects (:func:`is_opaque`),
  which are handed on as the very same objects.

  Args:
    tree: any pytree.
    dtype: the target floating dtype.

  Returns:
    The cast tree.

  Example:
    >>> import numpy as np, jmp_lite
    >>> jmp_lite.dtypes.cast_floating({"w": np.ones(2), "i": 3}, np.float16)
    {'i': 3, 'w': array([1., 1.], dtype=float16)}
  """
  dtype = np.dtype(dtype)

  def cast(x: Any) -> Any:
    if is_floating_array(x) and x.dtype != dtype:
      return x.astype(dtype)
    return x

  return jax.tree.map(cast, tree, is_leaf=is_opaque)


def is_inexact_array(x: Any) -> bool:
  """True for array leaves of a floating or complex dtype (never ``float0``).

  These are the leaves loss scaling multiplies and finiteness checks read.

  Args:
    x: any pytree leaf.

  Returns:
    Whether ``x`` is an inexact array.

  Example:
    >>> import numpy as np, jmp_lite
    >>> jmp_lite.dtypes.is_inexact_array(np.ones(2, np.complex64))
    True
  """
  if not isinstance(x, (jax.Array, np.ndarray, np.generic)):
    return False
  if _is_extended(x.dtype):
    return False
  return x.dtype != jax.dtypes.float0 and jnp.issubdtype(x.dtype, jnp.inexact)


def update_between(new: jax.Array, current: jax.Array, dtype: Any,
                   moved: jax.Array | None = None) -> jax.Array:
  """The update that takes ``current`` to ``new`` under ``apply_updates``.

  Shared by the transformations that round a param themselves (Kahan,
  stochastic rounding, master weights). ``new`` and ``current`` are values
  of the param's dtype held in a wider float, so their difference is exact
  unless they are 2**16 (bfloat16) / 2**13 (float16) binades apart, and
  ``p + update`` lands exactly on ``new``. ``-0.0`` where nothing moves (or
  ``moved`` is false): ``p + -0.0`` is ``p`` bit for bit. In an FP8 ``dtype``
  (JAX adds no float32 update to an FP8 param) the difference is exact
  while ``new`` is within a factor of two of ``current`` (Sterbenz); a
  bigger leap is rounded, and clipped to the format's finite range
  (``float8_e4m3fn`` has no infinity), so it may stop short.

  Args:
    new: the values to land on.
    current: the param's values, in ``new``'s dtype.
    dtype: the dtype of the update.
    moved: where to move at all (``None``: wherever ``new != current``).

  Returns:
    The update, in ``dtype``.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> jmp_lite.dtypes.update_between(
    ...     jnp.array([1.5, 2.0]), jnp.array([1.0, 2.0]), jnp.float32)
    Array([ 0.5, -0. ], dtype=float32)
  """
  step = new != current if moved is None else moved & (new != current)
  delta = jnp.where(step, new - current, jnp.asarray(-0.0, new.dtype))
  if np.dtype(dtype).itemsize == 1:
    top = float(jnp.finfo(dtype).max)
    delta = jnp.clip(delta, -top, top)
  return delta.astype(dtype)


def at_least_float32(dtype: Any) -> np.dtype:
  """``dtype`` widened to float32 precision: where half and FP8 values compute.

  ``jnp.promote_types(dtype, float32)``, except that FP8 dtypes, which JAX
  refuses to promote implicitly, give float32 too.

  Args:
    dtype: a floating or complex dtype.

  Returns:
    float32 for narrower real floats; ``dtype`` itself when it is at least
    as wide (float64, complex64, complex128).

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> jmp_lite.dtypes.at_least_float32(jnp.float8_e4m3fn)
    dtype('float32')
  """
  dtype = np.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
    return np.dtype(np.float32)
  return np.dtype(jnp.promote_types(dtype, jnp.float32))


# The dtypes round_to rounds in, and the IEEE-style targets (an infinity,
# subnormals) that lax.reduce_precision models exactly in the normal range.
_IEEE_FLOATS = tuple(np.dtype(d) for d in (jnp.float16, jnp.bfloat16,
                                           jnp.float32, jnp.float64))


def _float8_table(dtype: np.dtype) -> np.ndarray | None:
  """float32 value of each of an 8-bit float format's 256 bit patterns."""
  if dtype.itemsize != 1 or jnp.finfo(dtype).bits != 8:
    return None
  return np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)


def float8_values(q: jax.Array) -> jax.Array:
  """An 8-bit float array's values in float32, decoded from its bits.

  Equal to ``q.astype(jnp.float32)``, but a table lookup rather than a cast,
  so that no compiler can fuse it with the cast that produced ``q``: XLA:GPU
  (``--xla_allow_excess_precision``) replaces ``x.astype(f8).astype(f32)``
  by ``x``, dropping the FP8 rounding.

  Args:
    q: an array of an 8-bit float dtype (``float8_e4m3fn``, ``float8_e5m2``,
      ...).

  Returns:
    A float32 array of ``q``'s shape and sharding.

  Raises:
    TypeError: ``q`` is not of an 8-bit float dtype.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> q = jnp.asarray([0.3, -448.0]).astype(jnp.float8_e4m3fn)
    >>> jmp_lite.dtypes.float8_values(q).tolist()
    [0.3125, -448.0]
  """
  table = _float8_table(np.dtype(q.dtype))
  if table is None:
    raise TypeError(
        f"float8_values: q must be of an 8-bit float dtype, got {q.dtype}")
  bits = jax.lax.bitcast_convert_type(q, jnp.uint8).astype(jnp.int32)
  # Laid out as the indices are: a sharded q stays sharded (JAX cannot infer
  # that from a gather of a replicated table).
  return jnp.asarray(table).at[bits].get(
      out_sharding=jax.typeof(bits).sharding)


def round_to(x: jax.typing.ArrayLike, dtype: Any) -> jax.Array:
  """Rounds ``x`` to the nearest value of ``dtype``, keeping ``x``'s dtype.

  The value of ``x.astype(dtype).astype(x.dtype)`` correctly rounded (round
  to nearest even, overflow as the cast does, ``dtype``'s subnormals kept,
  NaN stays NaN), but without the conversion pair, which compilers may
  delete: XLA:GPU does, under its default ``--xla_allow_excess_precision``,
  treating the dropped rounding as a free gain in precision. Code whose
  *point* is that rounding (compensated summation, stochastic rounding, a
  param pinned to its master copy's rounded value) silently stops working
  there. For float16 and bfloat16 this is ``lax.reduce_precision``, which
  survives that simplification, plus a branch for ``dtype``'s subnormals,
  which ``reduce_precision`` flushes to zero (rounded on the grid of the
  smallest subnormal: exact, a power-of-two scaling). For 8-bit floats it
  is the cast to ``dtype`` and a table lookup back (:func:`float8_values`).

  Args:
    x: a float16, bfloat16, float32 or float64 array (or array-like).
    dtype: a dtype or name (``"bf16"``): one whose values are all values of
      ``x``'s dtype (float16 in float32, FP8 in bfloat16...), or one that
      holds all of ``x``'s dtype.

  Returns:
    ``x``'s values rounded to ``dtype``, in ``x``'s dtype; ``x`` itself when
    ``dtype`` holds every value of ``x``'s dtype.

  Raises:
    TypeError: ``x``'s dtype is not one of those four, or ``dtype`` is not a
      floating dtype.
    ValueError: ``dtype``'s values are not all values of ``x``'s dtype, and
      not the other way round either (float16 and bfloat16).

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> x = jnp.float32(1.0001)
    >>> float(jmp_lite.dtypes.round_to(x, jnp.bfloat16))
    1.0
    >>> tiny = jmp_lite.dtypes.round_to(jnp.float32(3e-6), "f16")
    >>> float(tiny) * 2**24  # a float16 subnormal: 50 of its smallest steps
    50.0
  """
  x = jnp.asarray(x)
  narrow, wide = to_floating_dtype(dtype, "dtype"), np.dtype(x.dtype)
  if wide not in _IEEE_FLOATS:
    raise TypeError(
        "round_to: x must be float16, bfloat16, float32 or float64, got"
        f" {wide}")
  table = _float8_table(narrow)
  if table is not None:
    # Every value of the format must survive x's dtype (float8_e8m0fnu's
    # 2**127 does not survive float16).
    with np.errstate(over="ignore", invalid="ignore"):   # What we test.
      kept = table.astype(wide).astype(np.float32)
    if not np.array_equal(kept, table, equal_nan=True):
      raise ValueError(
          f"round_to: x's {wide} cannot hold every value of {narrow}")
    return float8_values(x.astype(narrow)).astype(wide)
  if narrow not in _IEEE_FLOATS:
    raise TypeError(
        "round_to: dtype must be float16, bfloat16, float32, float64 or an"
        f" 8-bit float, got {narrow}")
  fn, fw = jnp.finfo(narrow), jnp.finfo(wide)
  if fn.nexp >= fw.nexp and fn.nmant >= fw.nmant:
    return x  # Every value of x's dtype is a value of dtype.
  if fn.nexp > fw.nexp or fn.nmant > fw.nmant:
    raise ValueError(
        f"round_to: {narrow} is not narrower than x's {wide} (neither holds"
        " every value of the other), so its values cannot be kept in x's"
        " dtype")
  out = jax.lax.reduce_precision(x, exponent_bits=fn.nexp,
                                 mantissa_bits=fn.nmant)
  if fn.nexp < fw.nexp:
    # dtype's subnormals are normal numbers of x's dtype: round them on the
    # grid of dtype's smallest subnormal (round half to even, like a cast).
    step = float(fn.smallest_subnormal)
    tiny = jnp.round(x * (1 / step)) * step
    out = jnp.where(jnp.abs(x) < float(fn.smallest_normal), tiny, out)
  return out
