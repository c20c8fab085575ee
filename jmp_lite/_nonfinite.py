"""Jit-safe counts of non-finite gradient elements, and where they are.

A small module of its own so that the optax transformations
(``loss_scaled(..., track_nonfinite=True)``) and the diagnostics share it
without importing each other.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import dtypes as _dtypes
from jmp_lite._checks import check_numeric_leaf
from jmp_lite.path_rules import path_string

__all__ = ["nonfinite_counts", "nonfinite_paths"]


def nonfinite_counts(tree: Any) -> Any:
  """Counts the +-inf/NaN elements of every inexact leaf (int32 scalars).

  Args:
    tree: gradients (or any pytree).

  Returns:
    A pytree of the same structure: an int32 count per inexact leaf, ``None``
    elsewhere. Jit-safe.

  Raises:
    TypeError: for an array of a dtype that holds no numbers (a NumPy
      ``object`` array: convert it).

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> counts = jmp_lite.nonfinite_counts(
    ...     {"a": jnp.array([1., jnp.inf, jnp.nan]), "b": jnp.ones(2)})
    >>> int(counts["a"]), int(counts["b"])
    (2, 0)
  """
  for x in jax.tree.leaves(tree):
    check_numeric_leaf(x, "nonfinite_counts")
  return jax.tree.map(
      lambda x: jnp.sum(~jnp.isfinite(x), dtype=jnp.int32)
      if _dtypes.is_inexact_array(x) else None, tree)


def nonfinite_paths(counts: Any) -> dict[str, int]:
  """The paths with a non-zero count, from :func:`nonfinite_counts` (host).

  Args:
    counts: the counts pytree (device values are fetched: a host sync).

  Returns:
    ``{"layer/kernel": count}`` for every leaf with non-finite elements.

  Raises:
    ValueError: for a leaf that is not a scalar (gradients passed by
      mistake).
    TypeError: for a leaf that is no integer (a string, a float, a bool).

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> grads = {"dense": {"w": jnp.array([jnp.nan, 1.0])}, "b": jnp.ones(1)}
    >>> jmp_lite.nonfinite_paths(jmp_lite.nonfinite_counts(grads))
    {'dense/w': 1}
  """
  out = {}
  for path, value in jax.tree_util.tree_flatten_with_path(counts)[0]:
    if np.ndim(value) != 0:  # Say so, rather than numpy's scalar error.
      raise ValueError(
          f"nonfinite_paths takes counts from nonfinite_counts (a scalar per"
          f" leaf), got shape {np.shape(value)} at {path_string(path)!r}")
    dtype = getattr(value, "dtype", None)
    if isinstance(value, (bool, np.bool_)) or not (
        isinstance(value, numbers.Integral)
        or (dtype is not None and jnp.issubdtype(dtype, jnp.integer))):
      # Gradients or a string passed by mistake: int() would truncate the
      # one and fail on the other with Python's own message.
      raise TypeError(
          "nonfinite_paths takes counts from nonfinite_counts (an integer"
          " scalar per leaf, e.g. state.nonfinite of loss_scaled(...,"
          f" track_nonfinite=True)), got a {type(value).__name__}"
          + (f" of dtype {dtype}" if dtype is not None else "")
          + f" at {path_string(path) or 'the root'!r}: {value!r:.120}")
    n = int(value)
    if n:
      out[path_string(path)] = n
  return out


# Documented with the diagnostics, their public home.
nonfinite_counts.__module__ = nonfinite_paths.__module__ = (
    "jmp_lite.diagnostics")
