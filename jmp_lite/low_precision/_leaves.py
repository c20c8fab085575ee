"""Which optimizer-state leaf is which, for :func:`quantized_states`: the
state field holding it (Adam's ``nu``, looked up through Flax nnx
``Variable`` s), and whether it mirrors a param.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from jmp_lite._nnx_paths import is_variable


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
        if is_variable(node):
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
  """Whether the state leaf at ``path`` in ``tree`` is held by a field named
  in ``names`` (``nu``, or ``Class.field`` as Adafactor's
  ``FactoredState.v``): a statistic stored with the unsigned map.

  Attribute names only (a NamedTuple state's fields): a param called
  ``nu`` inside ``mu``'s dict is a dict key and does not count.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from jmp_lite.low_precision._leaves import unsigned_leaf
    >>> state = optax.adam(1e-3).init({"nu": jnp.ones(2)})
    >>> paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    >>> [unsigned_leaf(state, p, ("nu",)) for p in paths]
    [False, False, True]
  """
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


def mirrored_params(tree: Any, params: Any, is_leaf: Any = None
                    ) -> list[tuple[int | None, int]]:
  """Per leaf of ``tree`` (flattened with ``is_leaf``): the index of the
  param it mirrors, by its place in a subtree with the params' structure
  (Adam's ``mu`` and ``nu``), and the length of its path above that
  subtree, which holds the state's own fields; ``(None, len(path))`` for a
  leaf in no such subtree. By structure, not by key path: a param whose
  path ends another's state path (an equinox head named ``mu`` beside a
  trunk) is not mistaken for it.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from jmp_lite.low_precision._leaves import mirrored_params
    >>> params = {"a": jnp.ones(2), "b": jnp.ones(3)}
    >>> mirrored_params(optax.adam(1e-3).init(params), params)
    [(None, 2), (0, 2), (1, 2), (0, 2), (1, 2)]
  """
  p_def = jax.tree.structure(params)
  mirror = lambda x: jax.tree.structure(x, is_leaf=is_leaf) == p_def
  out: list[tuple[int | None, int]] = []
  for path, node in jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: (is_leaf is not None and is_leaf(x))
      or mirror(x))[0]:
    if mirror(node):
      out.extend((i, len(path)) for i in range(p_def.num_leaves))
    else:
      out.append((None, len(path)))
  return out

