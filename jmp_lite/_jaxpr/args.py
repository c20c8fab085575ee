"""Which parts of a call's arguments are traced, and what a tracer is.

:func:`split_array_args` is the one rule for which leaves of a function's
arguments are traced (array leaves) and which are passed through as Python
values (everything else).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax import core as jax_core

_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)


def split_array_args(
    tree: Any) -> tuple[list[Any], Callable[[Sequence[Any]], Any]]:
  """Splits a pytree into its array leaves and a function that rebuilds it.

  Array leaves (``jax.Array`` including tracers, typed PRNG keys and
  ``float0`` arrays; numpy arrays and scalars; ``jax.ShapeDtypeStruct``) are
  what a tracing transformation should trace. Every other leaf (functions
  such as ``jax.nn.relu`` held by an Equinox module, Python numbers, strings,
  ``None``) is kept as it is and put back by ``rebuild``.

  Args:
    tree: any pytree, e.g. ``(args, kwargs)`` of a call.

  Returns:
    ``(arrays, rebuild)``: the array leaves in ``jax.tree.leaves`` order, and
    ``rebuild(new_arrays)`` giving ``tree`` with those leaves replaced.

  Raises:
    ValueError: from ``rebuild``, for a number of arrays other than the
      number taken out.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite._jaxpr import split_array_args
    >>> arrays, rebuild = split_array_args(({"w": jnp.ones(2), "act": abs}, 3))
    >>> len(arrays), rebuild([jnp.zeros(2)])[0]["act"] is abs
    (1, True)
  """
  leaves, treedef = jax.tree.flatten(tree)
  where = [i for i, x in enumerate(leaves) if isinstance(x, _ARRAY_TYPES)]
  arrays = [leaves[i] for i in where]

  def rebuild(new_arrays: Sequence[Any]) -> Any:
    if len(new_arrays) != len(where):
      raise ValueError(f"expected {len(where)} arrays, got {len(new_arrays)}")
    full = list(leaves)
    for i, x in zip(where, new_arrays, strict=True):
      full[i] = x
    return jax.tree.unflatten(treedef, full)

  return arrays, rebuild


def is_tracer(x: Any) -> bool:
  """Whether ``x`` is a value being traced by a JAX transformation.

  Args:
    x: any value.

  Returns:
    ``True`` for a tracer (under ``jit``, ``grad``, ``vmap``...).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jmp_lite._jaxpr import is_tracer
    >>> seen = []
    >>> _ = jax.jit(lambda x: seen.append(is_tracer(x)) or x)(1.0)
    >>> is_tracer(jnp.ones(2)), seen
    (False, [True])
  """
  return isinstance(x, jax_core.Tracer)


def varying_axes(x: Any) -> frozenset[str]:
  """The ``shard_map`` mesh axes over which ``x`` may differ per device.

  Read from the value's type under ``shard_map(..., check_vma=True)``
  (JAX's "varying manual axes"); empty outside ``shard_map``, under
  ``check_vma=False`` (where JAX does not track it), and for non-arrays.
  JAX has named the field ``vma``, ``manual_axis_type.varying`` and
  ``mat.varying``; all are read (``tests/test_jaxpr.py`` fails when none is
  found).

  Args:
    x: any value, or an abstract value (a jaxpr variable's ``aval``).

  Returns:
    The axis names, a frozenset.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite._jaxpr import varying_axes
    >>> varying_axes(jnp.ones(2))
    frozenset()
  """
  aval = x  # An abstract value already, or something without a type.
  if isinstance(x, (jax.Array, np.ndarray, np.generic)):
    try:
      aval = jax.typeof(x)
    except TypeError:
      return frozenset()
  vma = getattr(aval, "vma", None)
  for field in ("manual_axis_type", "mat"):
    if vma is None:
      vma = getattr(getattr(aval, field, None), "varying", None)
  return frozenset(vma or ())


def type_sharding(x: Any) -> Any:
  """``x``'s sharding when its type names a sharded mesh axis (explicit
  axes, under ``jax.set_mesh``), else None: outside a mesh, for replicated
  values, under classic ``jit`` sharding propagation (auto axes, which types
  do not carry) and inside ``shard_map``.

  Args:
    x: any value, or an abstract value (a jaxpr variable's ``aval``).

  Returns:
    A ``jax.sharding.NamedSharding`` or None.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite._jaxpr import type_sharding
    >>> type_sharding(jnp.ones(3)) is None
    True
  """
  aval = x
  if isinstance(x, (jax.Array, np.ndarray, np.generic)):
    try:
      aval = jax.typeof(x)
    except TypeError:
      return None
  sharding: Any = getattr(aval, "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or getattr(mesh, "empty", True) or all(
      e is None for e in getattr(sharding, "spec", ())):
    return None
  return sharding


def align_varying(arrays: Sequence[jax.Array]
                  ) -> tuple[list[jax.Array], dict[str, Any]]:
  """``arrays`` made to vary over the union of their ``shard_map`` mesh
  axes, and the keyword arguments a ``jax.ShapeDtypeStruct`` computed from
  all of them needs: what a ``pallas_call`` requires of its operands and
  ``out_shape`` under ``shard_map(..., check_vma=True)``. Outside
  ``shard_map`` (or with ``check_vma=False``) the arrays come back as they
  are.

  Args:
    arrays: the kernel's operands (at least one).

  Returns:
    The operands, each cast (``jax.lax.pcast``) to the axes it lacks, and
    ``{"manual_axis_type": ...}`` (empty where JAX has no such field).

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite._jaxpr.args import align_varying
    >>> xs, kw = align_varying([jnp.ones(2), jnp.zeros(3)])
    >>> [x.shape for x in xs]
    [(2,), (3,)]
  """
  axes = frozenset().union(*map(varying_axes, arrays))
  out = [x if varying_axes(x) >= axes else jax.lax.pcast(
      x, tuple(sorted(axes - varying_axes(x))), to="varying")
         for x in arrays]
  mat = getattr(jax.typeof(out[0]), "manual_axis_type", None)
  return out, {} if mat is None else {"manual_axis_type": mat}
