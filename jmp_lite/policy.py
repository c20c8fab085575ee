"""Precision policies: which dtype params, computation and outputs use."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import dtypes as _dtypes
from jmp_lite._checks import check_not_float0, check_not_object_array

__all__ = ["Policy", "cast_to_full", "cast_to_half", "get_policy"]

T = TypeVar("T")

_KEYS = {
    "p": "param_dtype", "params": "param_dtype",
    "c": "compute_dtype", "compute": "compute_dtype",
    "o": "output_dtype", "output": "output_dtype",
}
_VALID_KEYS = "'params' (or 'p'), 'compute' (or 'c'), 'output' (or 'o')"


def _cast(tree: Any, dtype: Any) -> Any:
  """Casts the floating leaves; refuses NumPy ``object`` arrays, which the
  cast passed as "not floating" even when they held floats: a policy that
  said bfloat16 left them in Python floats."""
  for x in jax.tree.leaves(tree, is_leaf=_dtypes.is_opaque):
    check_not_object_array(x, "A policy's cast")
  return _dtypes.cast_floating(tree, dtype)


@dataclasses.dataclass(frozen=True)
class Policy:
  """A mixed-precision policy: the dtypes of params, computation and outputs.

  A frozen, hashable dataclass (usable as a static argument to ``jax.jit``).
  Dtypes may be given as dtypes, scalar types or names (``"bf16"``); they are
  stored as canonical ``np.dtype`` so that equal policies compare equal.
  Python's ``float`` is JAX's default float, as for ``jnp.zeros(3, float)``:
  float32 unless x64 is enabled (ask for ``"f64"`` to mean float64).
  Casting touches only floating-point array leaves (numpy stays numpy, JAX
  stays JAX); ints, bools, complex, ``float0``, ``None``, Python scalars and
  other objects pass through untouched, and a leaf already in the target dtype
  is returned as is.

  Attributes:
    param_dtype: dtype parameters are stored in.
    compute_dtype: dtype the computation runs in.
    output_dtype: dtype of the returned outputs.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> policy = jmp_lite.Policy(jnp.float32, jnp.bfloat16, jnp.float32)
    >>> policy.cast_to_compute(jnp.ones(2)).dtype
    dtype(bfloat16)
    >>> str(policy)
    'p=f32,c=bf16,o=f32'
  """

  param_dtype: Any
  compute_dtype: Any
  output_dtype: Any

  def __post_init__(self) -> None:
    for name in ("param_dtype", "compute_dtype", "output_dtype"):
      value = getattr(self, name)
      check_not_float0(value, name)
      dtype = _dtypes.to_floating_dtype(value, name)
      if getattr(self, name) is float:
        # Python's float is JAX's default float, as in jnp.zeros(3, float):
        # float32 unless x64 is on (numpy would read it as float64, a dtype
        # JAX then computes in float32: the policy would say one thing and
        # the computation do another).
        dtype = np.dtype(jax.dtypes.canonicalize_dtype(float))
      object.__setattr__(self, name, dtype)

  def cast_to_param(self, x: T) -> T:
    """Casts the floating leaves of ``x`` to ``param_dtype``.

    Args:
      x: any pytree.

    Returns:
      ``x`` with floating array leaves in ``param_dtype``.

    Example:
      >>> import numpy as np, jmp_lite
      >>> jmp_lite.get_policy("p=f16").cast_to_param(np.ones(2)).dtype
      dtype('float16')
    """
    return _cast(x, self.param_dtype)

  def cast_to_compute(self, x: T) -> T:
    """Casts the floating leaves of ``x`` to ``compute_dtype``.

    Args:
      x: any pytree.

    Returns:
      ``x`` with floating array leaves in ``compute_dtype``.

    Example:
      >>> import jax.numpy as jnp, jmp_lite
      >>> jmp_lite.get_policy("c=bf16").cast_to_compute(jnp.ones(2)).dtype
      dtype(bfloat16)
    """
    return _cast(x, self.compute_dtype)

  def cast_to_output(self, x: T) -> T:
    """Casts the floating leaves of ``x`` to ``output_dtype``.

    Args:
      x: any pytree.

    Returns:
      ``x`` with floating array leaves in ``output_dtype``.

    Example:
      >>> import jax.numpy as jnp, jmp_lite
      >>> p = jmp_lite.get_policy("c=bf16,o=f32")
      >>> p.cast_to_output(jnp.ones(2, jnp.bfloat16)).dtype
      dtype('float32')
    """
    return _cast(x, self.output_dtype)

  def with_param_dtype(self, param_dtype: Any) -> Policy:
    """Returns a copy with ``param_dtype`` replaced.

    Args:
      param_dtype: the new param dtype.

    Returns:
      A new :class:`Policy`.

    Example:
      >>> import jmp_lite
      >>> str(jmp_lite.get_policy("f32").with_param_dtype("bf16"))
      'p=bf16,c=f32,o=f32'
    """
    return dataclasses.replace(self, param_dtype=param_dtype)

  def with_compute_dtype(self, compute_dtype: Any) -> Policy:
    """Returns a copy with ``compute_dtype`` replaced.

    Args:
      compute_dtype: the new compute dtype.

    Returns:
      A new :class:`Policy`.

    Example:
      >>> import jmp_lite
      >>> str(jmp_lite.get_policy("f32").with_compute_dtype("f16"))
      'p=f32,c=f16,o=f32'
    """
    return dataclasses.replace(self, compute_dtype=compute_dtype)

  def with_output_dtype(self, output_dtype: Any) -> Policy:
    """Returns a copy with ``output_dtype`` replaced.

    Args:
      output_dtype: the new output dtype.

    Returns:
      A new :class:`Policy`.

    Example:
      >>> import jmp_lite
      >>> str(jmp_lite.get_policy("c=bf16").with_output_dtype("f32"))
      'p=f32,c=bf16,o=f32'
    """
    return dataclasses.replace(self, output_dtype=output_dtype)

  def __str__(self) -> str:
    name = _dtypes.canonical_name
    return (f"p={name(self.param_dtype)},c={name(self.compute_dtype)},"
            f"o={name(self.output_dtype)}")


def get_policy(policy_name: str) -> Policy:
  """Parses a policy from a string, in ``jmp``'s grammar.

  Either a single dtype for all three (``"bf16"``, ``"half"``), or
  comma-separated ``key=dtype`` parts with keys ``params``/``p``,
  ``compute``/``c`` and ``output``/``o``. Params default to float32, compute
  follows params, output follows compute: ``"c=bf16"`` is
  ``p=f32,c=bf16,o=bf16``. ``str(policy)`` parses back to an equal policy.

  Args:
    policy_name: the policy string.

  Returns:
    The parsed :class:`Policy`.

  Raises:
    TypeError: if ``policy_name`` is not a string.
    ValueError: on an unknown key or dtype, a duplicated key, an empty part,
      or a part without ``=``; the message names the bad part and lists the
      valid choices.

  Example:
    >>> import jmp_lite
    >>> str(jmp_lite.get_policy("params=float32,compute=bfloat16"))
    'p=f32,c=bf16,o=bf16'
  """
  if not isinstance(policy_name, str):
    raise TypeError(
        "get_policy expects a string such as 'p=f32,c=bf16,o=f32', got"
        f" {type(policy_name).__name__}: {policy_name!r}"
    )
  if "=" not in policy_name:
    if not policy_name.strip():
      raise ValueError(
          "Empty policy string; expected a dtype such as 'bf16' or parts such"
          " as 'p=f32,c=bf16,o=f32'"
      )
    dtype = _dtypes.parse_dtype(policy_name)
    return Policy(dtype, dtype, dtype)

  given: dict[str, np.dtype] = {}
  for part in policy_name.split(","):
    if not part.strip():
      raise ValueError(
          f"Empty part in policy {policy_name!r}; expected comma-separated"
          " 'key=dtype' parts such as 'p=f32,c=bf16'"
      )
    if part.count("=") != 1:
      raise ValueError(
          f"Malformed part {part.strip()!r} in policy {policy_name!r};"
          f" expected 'key=dtype' with key one of {_VALID_KEYS}"
      )
    key, value = (s.strip() for s in part.split("="))
    field_name = _KEYS.get(key.lower())
    if field_name is None:
      raise ValueError(
          f"Unknown key {key!r} in policy {policy_name!r}; expected one of"
          f" {_VALID_KEYS}"
      )
    if field_name in given:
      raise ValueError(
          f"Duplicated key {key!r} in policy {policy_name!r}: "
          f"{field_name.removesuffix('_dtype')} is set twice"
      )
    try:
      given[field_name] = _dtypes.parse_dtype(value)
    except ValueError as e:
      raise ValueError(
          f"In part {part.strip()!r} of {policy_name!r}: {e}") from None

  param = given.get("param_dtype", np.dtype(jnp.float32))
  compute = given.get("compute_dtype", param)
  output = given.get("output_dtype", compute)
  return Policy(param, compute, output)


def cast_to_full(tree: T) -> T:
  """Casts the floating leaves of ``tree`` to float32.

  Args:
    tree: any pytree.

  Returns:
    ``tree`` with floating array leaves in float32.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> jmp_lite.cast_to_full({"w": jnp.ones(2, jnp.bfloat16)})["w"].dtype
    dtype('float32')
  """
  return _cast(tree, np.dtype(jnp.float32))


def cast_to_half(tree: T) -> T:
  """Casts the floating leaves of ``tree`` to the backend's :func:`half_dtype`.

  Args:
    tree: any pytree.

  Returns:
    ``tree`` with floating array leaves in bfloat16 or float16.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> jmp_lite.cast_to_half(jnp.ones(2)).dtype == jmp_lite.half_dtype()
    True
  """
  return _cast(tree, _dtypes.half_dtype())
