"""Name stacks: the ``jax.named_scope`` path and source line of equations.

An equation inside a sub-jaxpr (a nested ``jit``, a loop body, a custom
derivative) carries a name stack relative to the equation that holds it;
:func:`join_scopes` makes the full path. Transformations wrap the scope
names of the code they transform (``transpose(jvp(block))`` in a backward
pass); :func:`scope_names` unwraps them.
"""

from __future__ import annotations

import re
from typing import Any

# Transformations JAX writes around the scope names of the code they
# transform ("transpose(jvp(my_block))" in a backward pass).
_TRANSFORM_WRAPPER = re.compile(
    r"^(?:jvp|transpose|vmap|remat|checkpoint)\((.*)\)$")


def name_stack_of(eqn: Any) -> Any:
  """The ``jax.named_scope`` path ``eqn`` was traced under (``str`` it).

  Equations traced in the same scope share the object, so per-scope work can
  be memoised by its identity.

  Args:
    eqn: a jaxpr equation.

  Returns:
    JAX's name-stack object; ``str()`` gives ``"outer/inner"``.

  Example:
    >>> import jax
    >>> from jmp_lite._jaxpr import name_stack_of, walk
    >>> def f(x):
    ...   with jax.named_scope("block"):
    ...     return x * 2
    >>> [str(name_stack_of(s.eqn)) for s in walk(jax.make_jaxpr(f)(1.0))]
    ['block']
  """
  return eqn.source_info.name_stack


def join_scopes(outer: str, inner: str) -> str:
  """The full scope path of an equation with ``inner`` scopes under ``outer``.

  Args:
    outer: the path of the equation holding the sub-jaxpr (``""`` at the
      top).
    inner: the equation's own (relative) name stack, as a string.

  Returns:
    ``"outer/inner"``, without empty parts.

  Example:
    >>> from jmp_lite._jaxpr import join_scopes
    >>> join_scopes("model/block", "dense"), join_scopes("", "dense")
    ('model/block/dense', 'dense')
  """
  return "/".join(s for s in (outer, inner) if s)


def scope_names(stack: Any) -> set[str]:
  """The scope names in a name stack, unwrapped from transformations.

  A region differentiated inside an autocast is still that region:
  ``transpose(jvp(block))`` names ``block``.

  Args:
    stack: a name stack (or its string).

  Returns:
    The set of scope names.

  Example:
    >>> from jmp_lite._jaxpr import scope_names
    >>> sorted(scope_names("transpose(jvp(model))/dense"))
    ['dense', 'model']
  """
  names = set()
  for part in str(stack).split("/"):
    while (m := _TRANSFORM_WRAPPER.match(part)) is not None:
      part = m.group(1)
    names.add(part)
  return names


def source_location(eqn: Any) -> str:
  """``file:line:column (function)`` of the user code behind ``eqn``.

  Args:
    eqn: a jaxpr equation.

  Returns:
    The location, or ``"<unknown>"`` where JAX recorded none.

  Example:
    >>> import jax
    >>> from jmp_lite._jaxpr import source_location, walk
    >>> def f(x):
    ...   return x * 2
    >>> "(f)" in source_location(next(walk(jax.make_jaxpr(f)(1.0))).eqn)
    True
  """
  # JAX internal (no public equivalent); a location is a hint, never an
  # error, so any failure reads as unknown.
  from jax._src import source_info_util as _siu
  try:
    return _siu.summarize(eqn.source_info)
  except Exception:
    return "<unknown>"
