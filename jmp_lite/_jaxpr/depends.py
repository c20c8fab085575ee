"""Which outputs of a function are computed from its inputs' values."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jmp_lite._jaxpr.retype import is_literal


def _abstract(x: Any) -> Any:
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype)
  return x


def depends_on_inputs(fn: Any, *args: Any) -> list[bool]:
  """For each output leaf of ``fn(*args)``: whether its value is computed
  from the values of the array leaves of ``args``.

  Data flow through the traced jaxpr, conservative across sub-jaxprs (an
  equation with one dependent operand makes all its outputs dependent).
  ``jnp.zeros_like(p)`` depends on ``p``'s shape only: not dependent; a
  copy of ``p`` is. Abstract arguments are enough.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite._jaxpr.depends import depends_on_inputs
    >>> depends_on_inputs(lambda p: (jnp.zeros_like(p), p * 1.0, 3.0),
    ...                   jnp.ones(2))
    [False, True, False]
  """
  closed = jax.make_jaxpr(fn)(*jax.tree.map(_abstract, args))
  jaxpr = closed.jaxpr
  dependent = set(jaxpr.invars)
  for eqn in jaxpr.eqns:
    if any(not is_literal(v) and v in dependent for v in eqn.invars):
      dependent.update(eqn.outvars)
  return [not is_literal(v) and v in dependent for v in jaxpr.outvars]
