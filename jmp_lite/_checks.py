"""Argument checks the optimizer wrappers share (private).

Bad configuration fails where it is given, naming the value, rather than at
``init`` or, worse, silently (a truthy string switching a flag on).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import dtypes as _dtypes


def listing(items: Sequence[str], most: int = 4) -> str:
  """The first ``most`` items, comma-separated, `` ...`` if there are more.

  Error messages name a few offenders, not hundreds of leaves.

  Example:
    >>> from jmp_lite._checks import listing
    >>> listing(["a", "b", "c", "d", "e"])
    'a, b, c, d ...'
  """
  return ", ".join(items[:most]) + (" ..." if len(items) > most else "")


def check_callable(fn: Any, what: str) -> None:
  """Raises a ``TypeError`` now, rather than from deep inside tracing.

  Example:
    >>> from jmp_lite._checks import check_callable
    >>> check_callable(len, "find_nonfinite")
  """
  if not callable(fn):
    raise TypeError(f"{what} expects a callable, got {type(fn).__name__}:"
                    f" {fn!r:.200}")


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
      or dtype == jax.dtypes.float0
      # JAX's own extended dtypes (typed PRNG keys, carried in models'
      # state) hold no floating values: nothing to check or scale.
      or jnp.issubdtype(dtype, jax.dtypes.extended)):
    return
  raise TypeError(
      f"{who} expects numeric arrays, got an array of dtype {dtype} (shape"
      f" {np.shape(x)}): {x!r:.120}. Its elements are not numbers it can"
      " read on a device; convert it first, e.g. np.asarray(x, np.float32)")


def check_numeric_tree(tree: Any, who: str) -> None:
  """Raises a ``TypeError`` for a leaf that is no number or numeric array.

  A tree of names, paths or objects given by mistake would otherwise be
  read as having no floating leaves at all.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite._checks import check_numeric_tree
    >>> check_numeric_tree({"w": jnp.ones(2), "n": 3}, "gradient_health")
  """
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if isinstance(x, (str, bytes)) or not isinstance(
        x, (numbers.Number, np.ndarray, np.generic, jax.Array)):
      raise TypeError(
          f"{who} expects a pytree of arrays or numbers, got a"
          f" {type(x).__name__} leaf at"
          f" {jax.tree_util.keystr(path) or 'the root'}: {x!r:.200}")
    check_numeric_leaf(x, who)


def check_not_float0(value: Any, what: str) -> None:
  """Raises a ``TypeError`` naming ``float0`` for a dtype argument that is
  JAX's ``float0`` (numpy calls it "void", which said nothing).

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite._checks import check_not_float0
    >>> check_not_float0(jnp.float16, "dtype")
  """
  if isinstance(value, str):
    return
  try:
    is_float0 = np.dtype(value) == jax.dtypes.float0
  except (TypeError, ValueError):
    return
  if is_float0:
    raise TypeError(
        f"{what} must be a floating dtype (float32, bfloat16, float16,"
        " float64), got jax.dtypes.float0, the dtype of integer params'"
        " gradients under jax.grad(..., allow_int=True), which holds no"
        " values and is no dtype to compute or store in")


def floating_dtype(value: Any, what: str) -> np.dtype:
  """:func:`jmp_lite.dtypes.to_floating_dtype`, naming ``float0`` itself.

  Example:
    >>> from jmp_lite._checks import floating_dtype
    >>> floating_dtype("bf16", "dtype").name
    'bfloat16'
  """
  check_not_float0(value, what)
  return _dtypes.to_floating_dtype(value, what)


def check_not_object_array(x: Any, who: str) -> None:
  """Raises for a NumPy ``object`` array, whose elements are Python objects
  (its itemsize is a pointer's, and no cast or check reads its values).

  Example:
    >>> import numpy as np
    >>> from jmp_lite._checks import check_not_object_array
    >>> check_not_object_array(np.ones(2), "tree_bytes")
  """
  if isinstance(x, np.ndarray) and x.dtype == np.dtype(object):
    raise TypeError(
        f"{who} got a NumPy object array (shape {x.shape}), whose elements"
        f" are Python objects: {x!r:.120}; convert it first, e.g."
        " np.asarray(x, np.float32)")


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


# A loss scale must be a normal float32 whose reciprocal (what unscales) is
# one too: XLA:CPU flushes subnormals to zero, so 1 / 3e38 would unscale
# every gradient to 0, and a scale below 2**-126 would back off to 0.
SMALLEST_SCALE, LARGEST_SCALE = 2.0 ** -126, 2.0 ** 126


def check_scale_range(v: float | None, what: str, given: Any = None) -> None:
  """Raises unless a loss scale's float32 value ``v`` is in [2**-126,
  2**126] (``None``: traced, unknown, not checked).

  ``given`` is the value as the user wrote it, for the message (float32
  may have rounded it to 0 or inf).

  Example:
    >>> from jmp_lite._checks import check_scale_range
    >>> check_scale_range(2.0 ** 15, "loss_scale")
  """
  if v is None:
    return
  shown = (given if isinstance(given, numbers.Real)
           and not isinstance(given, bool) else v)
  if not (math.isfinite(v) and v > 0):
    raise ValueError(f"{what} must be positive and finite, got {shown}"
                     + (f" ({v} in float32)" if math.isfinite(float(shown))
                        and float(shown) != v else ""))
  if not SMALLEST_SCALE <= v <= LARGEST_SCALE:
    raise ValueError(
        f"{what} must be in [2**-126, 2**126] (float32's normal range, with"
        " a normal reciprocal: XLA flushes subnormals to zero, so the scale"
        f" or its unscaling factor 1/scale would become 0), got {shown}")


def check_float32_factor(value: float, what: str, low: float,
                         high: float) -> None:
  """Raises unless ``value`` stored as float32 lies strictly in (low, high).

  A loss scale is multiplied by its factors in float32: a factor that
  rounds to 1 (``1.00000001``) never moves the scale, one that rounds to 0
  or inf is not the number asked for.

  Example:
    >>> from jmp_lite._checks import check_float32_factor
    >>> check_float32_factor(2.0, "factor", 1.0, float("inf"))
  """
  with np.errstate(over="ignore", under="ignore"):
    f32 = float(np.float32(value))
  if not low < f32 < high:
    raise ValueError(
        f"{what}={value!r} is {f32!r} in float32, the dtype the scale is"
        f" stored and multiplied in; it must be in ({low:g}, {high:g}) there"
        + (" (a factor that rounds to 1 never moves the scale)"
           if f32 == 1.0 else ""))


def shape_of(x: Any) -> tuple[int, ...] | None:
  """A leaf's shape; ``()`` for a Python number, ``None`` for no array.

  Example:
    >>> from jmp_lite._checks import shape_of
    >>> shape_of(0.5)
    ()
  """
  if isinstance(x, numbers.Number):
    return ()
  shape = getattr(x, "shape", None)
  return None if shape is None else tuple(shape)


def _dtype_of(x: Any) -> np.dtype | None:
  # Python scalars by kind (bool is an int, so it comes first).
  for kind, dtype in ((bool, np.bool_), (int, np.int32),
                      (float, np.float32), (complex, np.complex64)):
    if isinstance(x, kind):
      return np.dtype(dtype)
  dtype = getattr(x, "dtype", None)
  return None if dtype is None else np.dtype(dtype)


def check_grads_fit(grads: Any, params: Any, who: str) -> None:
  """Raises unless ``grads`` has the params' tree, shapes and dtype kinds.

  Gradients of another model, or transposed, failed deep inside optax or
  XLA; a Python number for an array param was broadcast into it; integer
  or bool gradients of floating params pass unscaling (``loss_scale`` times
  too large); complex ones of real params lose their imaginary part.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite._checks import check_grads_fit
    >>> check_grads_fit({"w": jnp.ones(2)}, {"w": jnp.ones(2)}, "step")
  """
  g_leaves, g_def = jax.tree_util.tree_flatten_with_path(grads)
  p_leaves, p_def = jax.tree.flatten(params)
  if g_def != p_def:
    raise ValueError(
        f"{who}: the gradients' tree structure differs from the params'"
        f" (gradients of another model or of a part of it?):"
        f" grads {str(g_def):.300}, params {str(p_def):.300}")
  for (path, g), p in zip(g_leaves, p_leaves, strict=True):
    g_shape, p_shape = shape_of(g), shape_of(p)
    where = jax.tree_util.keystr(path) or "the root"
    if g_shape is not None and p_shape is not None and g_shape != p_shape:
      raise ValueError(
          f"{who}: the gradient at {where} has shape {g_shape}"
          f" ({type(g).__name__}), its param {p_shape}")
    g_dtype, p_dtype = _dtype_of(g), _dtype_of(p)
    if g_dtype is None or p_dtype is None:
      continue
    if jnp.issubdtype(p_dtype, jnp.floating) and jnp.issubdtype(
        g_dtype, jnp.complexfloating):
      raise TypeError(
          f"{who}: the gradient at {where} is {g_dtype.name}, its param"
          f" {p_dtype.name}: a real param's gradient must be real (the"
          " imaginary part would be dropped)")
    if jnp.issubdtype(p_dtype, jnp.inexact) and (
        jnp.issubdtype(g_dtype, jnp.integer) or g_dtype == np.bool_):
      raise TypeError(
          f"{who}: the gradient at {where} is {g_dtype.name}, its param"
          f" {p_dtype.name}: a floating param's gradient must be floating"
          " (an integer one is never unscaled); cast the gradients, e.g."
          " jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)")


def check_argnums(argnums: Any, who: str) -> None:
  """Raises unless ``argnums`` is None, an int or a non-empty tuple (or
  list) of ints (JAX said "'str' object cannot be interpreted as an
  integer", and differentiated argument 1 for ``True``).

  Example:
    >>> from jmp_lite._checks import check_argnums
    >>> check_argnums((0, 1), "scaled_value_and_grad")
  """
  def index(a: Any) -> bool:
    return isinstance(a, numbers.Integral) and not isinstance(
        a, (bool, np.bool_))

  if argnums is None or index(argnums) or (
      isinstance(argnums, (tuple, list)) and argnums
      and all(index(a) for a in argnums)):
    return
  raise TypeError(
      f"{who}: argnums must be None, an int or a non-empty tuple of ints"
      " (the positions of the arguments to differentiate, as for"
      f" jax.value_and_grad), got {type(argnums).__name__}: {argnums!r}")


def integer_gradients(grads: Any, params: Any) -> list[str]:
  """The integer or bool gradients of floating params, as ``path (dtype)``.

  With ``params`` of another structure, or ``None``, whose gradient a leaf
  is cannot be told: every integer or bool gradient is listed.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite._checks import integer_gradients
    >>> integer_gradients({"w": jnp.ones(2, int)}, {"w": jnp.ones(2)})
    ["['w'] (int32 for a float32 param)"]
  """
  g_leaves, g_def = jax.tree_util.tree_flatten_with_path(grads)
  p_leaves: list[Any] = [None] * len(g_leaves)
  if params is not None and jax.tree.structure(params) == g_def:
    p_leaves = jax.tree.leaves(params)
  bad = []
  for (path, g), p in zip(g_leaves, p_leaves, strict=True):
    g_dtype, p_dtype = getattr(g, "dtype", None), getattr(p, "dtype", None)
    if g_dtype is None or not (jnp.issubdtype(g_dtype, jnp.integer)
                               or g_dtype == np.bool_):
      continue
    if p_dtype is not None and not jnp.issubdtype(p_dtype, jnp.inexact):
      continue  # An integer param's own integer gradient: never unscaled.
    bad.append(f"{jax.tree_util.keystr(path) or 'the root'}"
               f" ({np.dtype(g_dtype).name}" + (
                   f" for a {np.dtype(p_dtype).name} param)"
                   if p_dtype is not None else ")"))
  return bad
