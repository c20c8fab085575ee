"""nnx state paths and values, shared by the nnx adapter and autocast.

No Flax import: duck-typed.

nnx's ``update`` writes variables into a module only where the module
already holds one. A call that creates a variable (attention's
``init_cache`` filling slots declared ``nnx.data(None)``) leaves a path the
stored module lacks; both the nnx adapter and autocast put such variables
in place with :func:`set_at_path`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax


def _indexed(node: Any, key: Any) -> bool:
  # Integer keys index lists (nnx.List, plain lists, the args tuple);
  # string keys index plain dicts; a module's attributes are attributes.
  return isinstance(key, int) or isinstance(node, Mapping)


def child(node: Any, key: Any) -> Any:
  """``node``'s child at one path key."""
  return node[key] if _indexed(node, key) else getattr(node, key)


def set_at_path(root: Any, path: Sequence[Any], value: Any) -> None:
  """Sets ``value`` at ``path`` (an nnx flat-state path) below ``root``.

  Args:
    root: the graph the path starts at.
    path: the keys, as ``nnx.to_flat_state`` gives them.
    value: what to put there (a variable).

  Example:
    >>> from jmp_lite._nnx_paths import set_at_path
    >>> tree = {"blocks": [{}, {}]}
    >>> set_at_path(tree, ("blocks", 1, "cache"), 3)
    >>> tree
    {'blocks': [{}, {'cache': 3}]}
  """
  owner = root
  for key in path[:-1]:
    owner = child(owner, key)
  last = path[-1]
  if _indexed(owner, last):
    owner[last] = value
  else:
    setattr(owner, last, value)


def same_leaves(new: Any, old: Any) -> bool:
  """Whether ``new`` holds exactly ``old``'s arrays: a call left it as given.

  Variables may hold pytrees (delayed FP8 scaling states), which nnx
  rebuilds around the very same arrays, so leaves are compared by identity.

  Args:
    new: a variable's value after a call.
    old: its value as the call was given it.

  Returns:
    Whether every leaf is the very same object.

  Example:
    >>> from jmp_lite._nnx_paths import same_leaves
    >>> a = object()
    >>> same_leaves({"x": a}, {"x": a}), same_leaves({"x": a}, {"x": 1})
    (True, False)
  """
  if new is old:
    return True
  new_leaves, new_def = jax.tree.flatten(new)
  old_leaves, old_def = jax.tree.flatten(old)
  return new_def == old_def and all(
      a is b for a, b in zip(new_leaves, old_leaves, strict=True))


def is_variable(node: Any) -> bool:
  """Whether ``node`` is a Flax nnx ``Variable`` (duck-typed).

  Example:
    >>> from jmp_lite._nnx_paths import is_variable
    >>> is_variable(1.0)
    False
  """
  return not isinstance(node, tuple) and callable(
      getattr(node, "get_value", None)) and hasattr(node, "set_value")


def unwrap_variables(tree: Any) -> Any:
  """``tree`` with each Flax nnx ``Variable`` replaced by its value: what
  an optimizer whose state holds pytrees per param (a ``QuantizedArray``)
  builds from, since ``nnx.update`` replaces a pytree held in a Variable by
  a ``State`` of its fields.

  Example:
    >>> from jmp_lite._nnx_paths import unwrap_variables
    >>> unwrap_variables({"w": 1.0})
    {'w': 1.0}
  """
  return jax.tree.map(lambda x: x.get_value() if is_variable(x) else x,
                      tree, is_leaf=is_variable)


def rewrap_like(given: Any, computed: Any) -> Any:
  """``computed`` (plain arrays) in the structure of ``given`` (Variables
  included), leaf for leaf: updates shaped like the gradients passed in.

  Example:
    >>> from jmp_lite._nnx_paths import rewrap_like
    >>> rewrap_like({"w": 1.0}, {"w": 2.0})
    {'w': 2.0}
  """
  if not any(is_variable(x) for x in jax.tree.leaves(
      given, is_leaf=is_variable)):
    return computed
  return jax.tree.unflatten(jax.tree.structure(given),
                            jax.tree.leaves(computed))
