"""Pytree helpers the optimizer layer shares (private).

Copies that keep a train step's donated buffers apart, the half-precision
leaves of a state, and the Flax nnx variables of an ``nnx.Optimizer``'s
state taken off (and put back on) without importing Flax.
"""

from __future__ import annotations

import sys
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import dtypes as _dtypes

T = TypeVar("T")


def copy_arrays(tree: T) -> T:
  """Returns ``tree`` with every array leaf replaced by a copy of it.

  An optimizer state must not share a buffer with the params (or with
  another state): a train step jitted with ``donate_argnums`` for both would
  donate that buffer twice and fail. ``init`` functions that keep a leaf as
  given (a float32 master copy of float32 params, a loss-scale state built
  from JAX arrays) pass it through this. JAX arrays stay JAX arrays (with
  their sharding), numpy stays numpy; typed PRNG keys are copied too; other
  leaves are returned as they are.

  Args:
    tree: any pytree.

  Returns:
    The same structure with fresh array leaves.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite._trees import copy_arrays
    >>> w = jnp.ones(2)
    >>> copy_arrays({"w": w})["w"] is w
    False
  """
  def copy(x: Any) -> Any:
    if isinstance(x, jax.Array):
      return jnp.array(x, copy=True)
    if isinstance(x, np.ndarray):
      return x.copy()
    return x

  return jax.tree.map(copy, tree)


def half_precision_leaves(tree: Any) -> list[str]:
  """Key paths of the floating array leaves of ``tree`` narrower than float32.

  float16, bfloat16 and the FP8 formats.

  Args:
    tree: any pytree (an optimizer state, say).

  Returns:
    The paths, as ``jax.tree_util.keystr`` strings with their dtype.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite._trees import half_precision_leaves
    >>> half_precision_leaves({"mu": jnp.ones(2, jnp.bfloat16)})
    ["['mu'] (bfloat16)"]
  """
  return [
      f"{jax.tree_util.keystr(path)} ({np.dtype(x.dtype).name})"
      for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
      if _dtypes.is_floating_array(x) and np.dtype(x.dtype).itemsize < 4
  ]


def unwrap_nnx(tree: Any) -> Any:
  """Replaces Flax nnx variables in ``tree`` by the arrays they hold.

  ``flax.nnx.Optimizer`` keeps its ``opt_state`` with every array wrapped in
  an ``OptArray`` variable. Detected without importing Flax: a tree can only
  hold nnx variables once ``flax.nnx`` has been imported.

  Args:
    tree: any pytree.

  Returns:
    ``tree`` with plain arrays (``tree`` itself when nnx is not loaded).

  Example:
    >>> from jmp_lite._trees import unwrap_nnx
    >>> unwrap_nnx({"a": 1.0})
    {'a': 1.0}
  """
  nnx = sys.modules.get("flax.nnx")
  if nnx is None:
    return tree
  variable = nnx.Variable

  def value(x: Any) -> Any:
    if isinstance(x, variable):
      return unwrap_nnx(x.get_value())
    return x

  return jax.tree.map(value, tree, is_leaf=lambda x: isinstance(x, variable))


def rewrap_nnx(like: Any, tree: Any) -> Any:
  """``tree``'s leaves in ``like``'s structure, nnx variables included.

  The inverse of :func:`unwrap_nnx` for a tree computed from
  ``unwrap_nnx(like)``: a jitted step or a ``lax.scan`` carry must see the
  same pytree on every call, so what came in wrapped goes out wrapped.

  Args:
    like: the tree as given (it may hold nnx variables).
    tree: a tree shaped like ``unwrap_nnx(like)``.

  Returns:
    ``tree``'s leaves in ``like``'s structure when ``like`` holds nnx
    variables and unwrapping it gives ``tree``'s structure; else ``tree``.

  Example:
    >>> from jmp_lite._trees import rewrap_nnx
    >>> rewrap_nnx({"a": 1.0}, {"a": 2.0})   # No variables: tree as it is.
    {'a': 2.0}
  """
  nnx = sys.modules.get("flax.nnx")
  if nnx is None:
    return tree
  is_variable = lambda x: isinstance(x, nnx.Variable)
  nodes = jax.tree.leaves(like, is_leaf=is_variable)
  if not any(is_variable(x) for x in nodes):
    return tree
  leaves, treedef = jax.tree.flatten(tree)
  if jax.tree.structure(unwrap_nnx(like)) != treedef:
    return tree
  return jax.tree.unflatten(jax.tree.structure(like), leaves)
