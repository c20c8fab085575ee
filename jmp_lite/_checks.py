"""Argument checks the optimizer wrappers share (private).

Bad configuration fails where it is given, naming the value, rather than at
``init`` or, worse, silently (a truthy string switching a flag on).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def listing(items: Sequence[str], most: int = 4) -> str:
  """The first ``most`` items, comma-separated, `` ...`` if there are more.

  Error messages name a few offenders, not hundreds of leaves.

  Example:
    >>> from jmp_lite._checks import listing
    >>> listing(["a", "b", "c", "d", "e"])
    'a, b, c, d ...'
  """
  return ", ".join(items[:most]) + (" ..." if len(items) > most else "")


def check_transformation(inner: Any, who: str) -> None:
  """Raises unless ``inner`` looks like an optax gradient transformation.

  Wrappers call it when they are built, so that ``master_weights("adam")``
  fails there, naming the value, rather than at ``init``.

  Args:
    inner: the value given as the optimizer to wrap.
    who: the wrapper's name, for the message.

  Raises:
    TypeError: if ``inner`` has no callable ``init`` and ``update``.

  Example:
    >>> import optax
    >>> from jmp_lite._checks import check_transformation
    >>> check_transformation(optax.sgd(0.1), "master_weights")
  """
  if not (callable(getattr(inner, "init", None))
          and callable(getattr(inner, "update", None))):
    raise TypeError(
        f"{who} expects an optax.GradientTransformation (with init and"
        f" update), got {type(inner).__name__}: {inner!r}")


INT32_MAX = int(np.iinfo(np.int32).max)


def check_count(value: Any, what: str) -> int:
  """``value`` as a Python int in ``[1, 2**31 - 1]``.

  Such settings bound an int32 counter in the state (which must be able to
  reach them); numpy integers are taken, bools are not.

  Args:
    value: the setting (``every_k``, ``max_consecutive_skips``).
    what: the argument's name, for the message.

  Returns:
    ``int(value)``.

  Raises:
    TypeError: if ``value`` is not an integer (or is a bool).
    ValueError: if it is out of range.

  Example:
    >>> import numpy as np
    >>> from jmp_lite._checks import check_count
    >>> check_count(np.int64(4), "every_k")
    4
  """
  if isinstance(value, (bool, np.bool_)) or not isinstance(
      value, (int, np.integer)):
    raise TypeError(
        f"{what} must be an int, got {type(value).__name__}: {value!r}")
  if not 1 <= value <= INT32_MAX:
    raise ValueError(
        f"{what} must be >= 1 and at most 2**31 - 1 (an int32 counter reaches"
        f" it), got {value}")
  return int(value)


def check_bool(value: Any, what: str, optional: bool = False) -> Any:
  """``value`` as a Python bool (or ``None`` where ``optional``).

  Anything else is refused: a truthy string such as ``"no"`` would otherwise
  switch a flag *on*.

  Args:
    value: the flag's value: ``True``, ``False`` (numpy bools too).
    what: the argument's name, for the message.
    optional: whether ``None`` is accepted (and returned).

  Returns:
    ``bool(value)``, or ``None``.

  Raises:
    TypeError: for anything else.

  Example:
    >>> from jmp_lite._checks import check_bool
    >>> check_bool(True, "strict")
    True
  """
  if optional and value is None:
    return None
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(
        f"{what} must be {'None or ' if optional else ''}a bool (True or"
        f" False), got {type(value).__name__}: {value!r}")
  return bool(value)


def check_scalar_bool(x: Any, what: str) -> jax.Array:
  """Returns ``x`` as a JAX bool scalar, or raises naming ``what``.

  Checks only dtype and shape, so tracers pass.

  Args:
    x: a Python ``bool`` or a 0-d bool array.
    what: the argument's name, for the message.

  Returns:
    ``jnp.asarray(x)``.

  Raises:
    TypeError: if ``x`` is not a bool (the message shows its type and dtype).
    ValueError: if ``x`` is not a scalar.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite._checks import check_scalar_bool
    >>> check_scalar_bool(jnp.array(True), "pred").dtype
    dtype('bool')
  """
  if isinstance(x, bool):
    return jnp.asarray(x)
  dtype = getattr(x, "dtype", None)
  if dtype is None or np.dtype(dtype) != np.bool_:
    raise TypeError(
        f"{what} must be a scalar bool (e.g. from jmp_lite.all_finite), got"
        f" {type(x).__name__} with dtype {dtype}")
  if tuple(x.shape) != ():
    raise ValueError(
        f"{what} must be a scalar bool, got shape {tuple(x.shape)}")
  return jnp.asarray(x)


def check_numeric_leaf(x: Any, who: str) -> None:
  """Raises a ``TypeError`` for an array whose dtype holds no numbers.

  A NumPy ``object`` array holding ``nan`` is no floating array: checks
  that read only floating leaves passed it as finite, and scaling passed
  it through unscaled. Strings, bytes, datetimes and structured dtypes are
  refused alike; ``float0`` (the gradient of an integer param) is numeric
  enough: it holds no values at all.

  Example:
    >>> import numpy as np
    >>> from jmp_lite._checks import check_numeric_leaf
    >>> check_numeric_leaf(np.ones(2), "all_finite")
  """
  dtype = getattr(x, "dtype", None)
  if not isinstance(x, (np.ndarray, np.generic, jax.Array)) or dtype is None:
    return
  if (jnp.issubdtype(dtype, jnp.number) or dtype == np.bool_
      or dtype == jax.dtypes.float0):
    return
  raise TypeError(
      f"{who} expects numeric arrays, got an array of dtype {dtype} (shape"
      f" {np.shape(x)}): {x!r:.120}. Its elements are not numbers it can"
      " read on a device; convert it first, e.g. np.asarray(x, np.float32)")


def check_axis_name(axis_name: Any) -> Any:
  """``axis_name`` if it can name a mapped axis, else a ``TypeError``.

  Example:
    >>> from jmp_lite._checks import check_axis_name
    >>> check_axis_name(("data", "model"))
    ('data', 'model')
  """
  # A mapped axis is named by a string (or a tuple of them for several mesh
  # axes); a number or a list is a mistake that would fail only at the
  # first pmin, deep inside a jitted step.
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  if axis_name is not None and not (
      names and all(isinstance(n, str) for n in names)):
    raise TypeError(
        "axis_name must be None, a str or a tuple of str (the mapped axis"
        " name given to shard_map/pmap), got"
        f" {type(axis_name).__name__}: {axis_name!r}")
  return axis_name


def check_own_state(state: Any, cls: type, who: str) -> None:
  """Raises a ``TypeError`` unless ``state`` is a ``cls``, the wrapper's own.

  Example:
    >>> from jmp_lite._checks import check_own_state
    >>> check_own_state((), tuple, "master_weights")
  """
  # The usual way here: loss_scaled(...) added to a script that kept the
  # opt_state (or TrainState) the bare optimizer made.
  if not isinstance(state, cls):
    raise TypeError(
        f"{who}(...).update got a {type(state).__name__} as its state, not"
        f" the {cls.__name__} its init makes: pass the state that"
        f" {who}(...).init(params) returned (after wrapping an optimizer,"
        " create its opt_state, or TrainState, again; a checkpoint restored"
        " as plain dicts needs the state from init as its restore target)")
