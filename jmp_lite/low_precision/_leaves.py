"""Which optimizer-state leaf is which, for :func:`quantized_states`: the
state field holding it (Adam's ``nu``), whether it mirrors a param, and
Flax nnx ``Variable`` s (duck-typed: no Flax import) taken off the params
and put back around the updates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax


def _is_variable(node: Any) -> bool:
  """A Flax nnx ``Variable`` (duck-typed: no Flax import)."""
  return not isinstance(node, tuple) and callable(
      getattr(node, "get_value", None)) and hasattr(node, "set_value")


def unwrap_variables(tree: Any) -> Any:
  """``tree`` with each Flax nnx ``Variable`` replaced by its value.

  The state is built from (and read with) plain arrays: a
  :class:`QuantizedArray` inside a Variable did not survive
  ``nnx.Optimizer``, whose ``nnx.update`` put a ``State`` of its fields in
  the Variable's place on the second step.
  """
  return jax.tree.map(lambda x: x.get_value() if _is_variable(x) else x,
                      tree, is_leaf=_is_variable)


def rewrap_like(given: Any, computed: Any) -> Any:
  """``computed`` (plain arrays) in the structure of ``given`` (Variables
  included), leaf for leaf: updates shaped like the gradients passed in."""
  if not any(_is_variable(x) for x in jax.tree.leaves(
      given, is_leaf=_is_variable)):
    return computed
  return jax.tree.unflatten(jax.tree.structure(given),
                            jax.tree.leaves(computed))


def _field_of(tree: Any, path: Sequence[Any]) -> tuple[str, str] | None:
  """(class name, field) of the innermost attribute on ``path`` (the
  NamedTuple field holding the leaf: Adam's ``nu``; Adafactor's ``v``, whose
  class tells it from Adan's signed ``v``)."""
  node, found = tree, None
  for k in path:
    try:
      if isinstance(k, jax.tree_util.GetAttrKey):
        # Not a Flax nnx Variable's ``value``: with nnx params every state
        # leaf sits in one, and ``nu`` is the field above it.
        if _is_variable(node):
          node = node.get_value()  # Its ``.value`` is deprecated.
          continue
        found = (type(node).__name__, k.name)
        node = getattr(node, k.name)
      elif isinstance(k, jax.tree_util.DictKey):
        node = node[k.key]
      elif isinstance(k, jax.tree_util.SequenceKey):
        node = node[k.idx]
      else:
        return found
    except (AttributeError, KeyError, IndexError, TypeError):
      return found
  return found


def unsigned_leaf(tree: Any, path: Sequence[Any],
                   names: tuple[str, ...]) -> bool:
  # Attribute names only (a NamedTuple state's fields): a param called "nu"
  # inside mu's dict is a DictKey and does not count.
  field = _field_of(tree, path)
  return field is not None and (field[1] in names
                                or ".".join(field) in names)


def mirrors_a_param(path: Sequence[Any], shape: tuple[int, ...],
                     params: list[tuple[tuple[Any, ...], tuple[int, ...]]]
                     ) -> bool:
  """Whether a state leaf at ``path`` is per-parameter: some param's key
  path ends the leaf's (``0/mu/w`` ends with ``w``) and has its shape. A
  leaf that only shares a shape (Adafactor's ``v_col`` of ``w`` and a bias,
  a schedule's per-beta vector) is not."""
  path = tuple(path)
  return any(p_shape == shape and len(p_path) <= len(path)
             and path[len(path) - len(p_path):] == p_path
             for p_path, p_shape in params)
