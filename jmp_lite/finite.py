"""Finiteness checks and predicate selection over pytrees, jit-safe."""

from __future__ import annotations

import cmath
import functools
import numbers
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import dtypes as _dtypes
from jmp_lite._checks import check_numeric_leaf, check_scalar_bool

__all__ = ["all_finite", "select_tree"]

T = TypeVar("T")


def all_finite(tree: Any) -> jax.Array:
  """Returns one scalar bool: whether every inexact leaf of ``tree`` is finite.

  Detects +inf, -inf and NaN in any floating (or complex) leaf of any dtype,
  and in Python ``float``/``complex`` leaves (checked on the host: they are
  constants even under ``jax.jit``). Integer, bool and ``float0`` leaves
  (and ``None``, which is no leaf) are ignored; an empty tree is finite.

  Each leaf costs exactly one fused read: ``sum(x - x)`` is ``0`` when every
  element is finite and NaN as soon as one is +-inf or NaN (``inf - inf`` is
  NaN). A sum of zeros cannot overflow, so large finite values never give a
  false non-finite, and unlike ``all(isfinite(x))`` no boolean array is
  materialised (XLA:CPU's cost model charges that 1.5 reads).

  Args:
    tree: a pytree of gradients (or anything).

  Returns:
    A ``bool`` scalar ``jax.Array``.

  Raises:
    TypeError: for a leaf that is no number or array (a string, an
      object: a tree of names or paths passed by mistake would otherwise
      count as finite), or an array of a dtype that holds no numbers (a
      NumPy ``object`` array, even one holding floats: convert it).

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> bool(jmp_lite.all_finite({"a": jnp.ones(3), "b": jnp.array([1, 2])}))
    True
    >>> bool(jmp_lite.all_finite([jnp.array([1.0, jnp.inf])]))
    False
  """
  leaves = jax.tree.leaves(tree)
  for x in leaves:
    if isinstance(x, (str, bytes)) or not isinstance(
        x, (numbers.Number, np.ndarray, np.generic, jax.Array)):
      # A tree of names, or of objects, given by mistake would otherwise
      # count as finite: the step it guards would never skip.
      raise TypeError(
          "all_finite expects a pytree of arrays or numbers, got a"
          f" {type(x).__name__} leaf: {x!r:.200}")
    check_numeric_leaf(x, "all_finite")
    if isinstance(x, (float, complex)) and not cmath.isfinite(x):
      return jnp.array(False)
  partials = [
      # x - x is 0 for finite x and NaN for +-inf and NaN (like x * 0, but
      # with no broadcast constant, which XLA:CPU would materialise).
      jnp.sum(x - x).astype(_dtypes.at_least_float32(x.dtype))
      for x in leaves
      if _dtypes.is_inexact_array(x)
  ]
  if not partials:
    return jnp.array(True)
  return jnp.isfinite(functools.reduce(jnp.add, partials))


def select_tree(pred: Any, a: T, b: T) -> T:
  """Returns ``a`` where ``pred`` is true, else ``b``, leaf by leaf.

  Branch-free (``lax.select``), so XLA can fuse it into the producers and
  consumers of ``a`` and ``b``, unlike ``lax.cond``. Array leaves must agree in
  shape and dtype; ``float0`` leaves (which hold no values) come from ``a``;
  identical non-array leaves are passed through.

  Args:
    pred: a scalar bool (``jax.Array``, numpy, or Python ``bool``).
    a: the pytree chosen when ``pred`` is true.
    b: a pytree of the same structure, chosen when ``pred`` is false.

  Returns:
    A pytree of the structure of ``a``.

  Raises:
    TypeError: if ``pred`` is not a bool scalar, leaves differ in dtype, two
      different non-array leaves meet, or an array holds no numbers (a
      NumPy ``object`` array).
    ValueError: if ``pred`` is not a scalar, the trees differ in structure, or
      leaves differ in shape.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> jmp_lite.select_tree(jnp.array(False), {"w": jnp.ones(2)},
    ...                      {"w": jnp.zeros(2)})
    {'w': Array([0., 0.], dtype=float32)}
  """
  pred = check_scalar_bool(pred, "select_tree's pred")
  a_leaves, a_def = jax.tree_util.tree_flatten_with_path(a)
  b_leaves, b_def = jax.tree.flatten(b)
  if a_def != b_def:
    raise ValueError(
        f"select_tree needs trees of one structure; got {a_def} and {b_def}"
    )

  def select(path: Any, x: Any, y: Any) -> Any:
    x_is_array = isinstance(x, (jax.Array, np.ndarray, np.generic))
    y_is_array = isinstance(y, (jax.Array, np.ndarray, np.generic))
    if x_is_array or y_is_array:
      check_numeric_leaf(x, "select_tree")
      check_numeric_leaf(y, "select_tree")
      x_arr, y_arr = jnp.asarray(x), jnp.asarray(y)
      where = jax.tree_util.keystr(path) or "the root"
      if x_arr.shape != y_arr.shape:
        raise ValueError(
            f"select_tree: shapes differ at {where}: {x_arr.shape} vs"
            f" {y_arr.shape}"
        )
      if x_arr.dtype != y_arr.dtype:
        raise TypeError(
            f"select_tree: dtypes differ at {where}: {x_arr.dtype} vs"
            f" {y_arr.dtype}"
        )
      if x_arr.dtype == jax.dtypes.float0:
        return x
      return jax.lax.select(pred, x_arr, y_arr)
    if x is y or x == y:
      return x
    where = jax.tree_util.keystr(path) or "the root"
    raise TypeError(
        f"select_tree: cannot select between non-array leaves {x!r} and {y!r}"
        f" at {where}"
    )

  out = [select(p, x, y) for (p, x), y in zip(a_leaves, b_leaves, strict=True)]
  return jax.tree.unflatten(a_def, out)
