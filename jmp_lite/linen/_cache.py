"""What a linen policy remembers between calls: discovered classes, traces.

A :class:`Memo` is a field of :class:`jmp_lite.linen.MixedPrecision` that
takes no part in its equality or hash (``compare=False``): Flax's clones of
the wrapper share it, and two wrappers with the same model and rules are
equal whatever their memos hold. It is a cache of pure functions of the
wrapper's fields and the call's shapes, so sharing it changes no result.
"""

from __future__ import annotations

import threading
import types
import weakref
from typing import Any, TYPE_CHECKING

import flax.linen as nn
import jax

from jmp_lite import _flax_compat as compat
from jmp_lite import _jaxpr

if TYPE_CHECKING:
  from jmp_lite.linen import MixedPrecision

Path = tuple[str, ...]
Discovered = tuple[dict[Path, type], set[Path]]


class _NotArrays(Exception):
  """Raised inside a cached trace whose output holds a non-array leaf."""


def apply_arrays(spec: tuple, dynamic: list[Any]) -> Any:
  """``apply`` rebuilt from a :func:`traced_apply` key and the arrays.

  Args:
    spec: the static key (model, the policy's ``method=`` for Flax's
      ``apply``, tree structure, Python values).
    dynamic: the array leaves.

  Returns:
    The model's output.

  Raises:
    _NotArrays: if the output holds a non-array leaf.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, jmp_lite.linen
    >>> from jmp_lite.linen._cache import apply_arrays
    >>> from jmp_lite.linen._intercept import PolicyCall
    >>> model = jmp_lite.linen.mixed_precision(nn.Dense(2), "c=bf16")
    >>> v = model.init(jax.random.key(0), jnp.ones((1, 3)))
    >>> leaves, tree = jax.tree.flatten((v, (jnp.ones((1, 3)),), {}))
    >>> run = PolicyCall(None)
    >>> spec = (model, run, tree, (True,) * len(leaves), (), None)
    >>> apply_arrays(spec, leaves).dtype
    dtype(bfloat16)
  """
  model, run, treedef, where, static, _ = spec
  arrays, statics = iter(dynamic), iter(static)
  leaves = [next(arrays) if is_array else next(statics) for is_array in where]
  variables, args, kwargs = jax.tree.unflatten(treedef, leaves)
  out = nn.Module.apply(model, variables, *args, method=run, **kwargs)
  if not all(isinstance(x, jax.Array) for x in jax.tree.leaves(out)):
    raise _NotArrays  # A Python value would come back as an array.
  return out


class Memo:
  """A policy's caches: module classes per call shape, traced applies.

  Attributes:
    classes: ``(method name or None, variables key, inputs key)`` ->
      discovered module classes and nested policies' paths.
    by_function: the same per function passed as ``method=``, held weakly
      (a freed lambda's entries go with it; keyed by ``id``, a new lambda
      reusing the id got the old one's module classes).
    uncacheable: keys of traced applies whose outputs were not all arrays.
    lock: guards the dicts (threads may share a model).
    apply: the traced applies, one per key (see :func:`traced_apply`):
      JAX's own trace cache, which also keeps each one's linearisation and
      transpose.

  Example:
    >>> from jmp_lite.linen._cache import Memo
    >>> memo = Memo()
    >>> memo.classes, memo.uncacheable
    ({}, set())
  """

  def __init__(self) -> None:
    self.classes: dict[Any, Discovered] = {}
    self.by_function: weakref.WeakKeyDictionary[
        Any, dict[Any, Discovered]] = weakref.WeakKeyDictionary()
    self.uncacheable: set[Any] = set()
    self.lock = threading.Lock()
    self.apply = jax.jit(apply_arrays, static_argnums=0)

  def __repr__(self) -> str:
    return f"Memo({len(self.classes)} shapes)"

  def __reduce__(self) -> Any:
    # A cache: an unpickled model starts with an empty one (locks and
    # jitted functions do not pickle).
    return (Memo, ())


def aval_key(tree: Any) -> Any:
  """A hashable key of ``tree``'s structure, shapes, dtypes, static leaves.

  Args:
    tree: any pytree.

  Returns:
    The key, or ``None`` if a static leaf is unhashable.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite.linen._cache import aval_key
    >>> aval_key({"x": jnp.ones((2, 3))})[1]
    (((2, 3), 'float32'),)
  """
  leaves, treedef = jax.tree.flatten(tree)
  key = []
  for x in leaves:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
      key.append((tuple(x.shape), str(x.dtype)))
    else:
      try:
        hash(x)
      except TypeError:
        return None  # Unhashable static argument: do not memoise.
      key.append(("static", type(x), x))
  return treedef, tuple(key)


def lookup(memo: Memo, method: Any, key: Any) -> tuple[Any, Any]:
  """The memo table for ``method`` and its key there (``None``: uncached).

  Args:
    memo: the policy's memo.
    method: ``None``, a method name or a function.
    key: the variables' and inputs' :func:`aval_key`\\ s.

  Returns:
    ``(table, key)``; the table is ``None`` for a call that is traced each
    time (a bound method is a new object at every access; an unhashable
    argument).

  Example:
    >>> from jmp_lite.linen._cache import Memo, lookup
    >>> memo = Memo()
    >>> lookup(memo, "encode", ("v", "x"))[1]
    ('encode', 'v', 'x')
  """
  if None in key:
    return None, key
  if method is None or isinstance(method, str):
    return memo.classes, (method, *key)
  if isinstance(method, types.FunctionType):
    with memo.lock:
      return memo.by_function.setdefault(method, {}), key
  return None, key


UNCACHED = object()
"""What :func:`traced_apply` returns when the plain apply must run."""


def traced_apply(model: MixedPrecision, variables: Any, args: tuple,
                 run: Any, kwargs: dict) -> Any:
  """``model.apply`` through a traced program reused per shapes and statics.

  Inside a trace (``jax.jit``, ``grad``, ``vmap``...), the policy's apply is
  a nested ``jax.jit`` keyed by the model, the method, the arguments' tree
  structure and Python values, and Flax's logical axis rules; JAX keys it on
  the arrays' shapes and dtypes. A later trace with the same key (a new
  ``jax.jit`` of an eval step, a re-jit in a notebook) reuses the model's
  traced program, and JAX's cached linearisation and transpose of it,
  instead of running Flax's method interception again. XLA inlines the
  nested call, so the compiled step is the same.

  Args:
    model: the policy.
    variables: its variables.
    args: the inputs.
    run: the policy's ``method=`` for Flax's ``apply``, a
      :class:`~jmp_lite.linen._intercept.PolicyCall` (hashable: it names the
      wrapped model's method).
    kwargs: more inputs and ``apply``'s options.

  Returns:
    The output, or :data:`UNCACHED` (the caller runs the plain apply)
    outside any trace (eager calls stay op by op), while a Flax method
    interceptor is open (its effects are not part of any key), for an
    unhashable Python argument or one that is not a ``jax.Array`` but an
    array (a NumPy array stays a constant), and for a model whose output
    holds a non-array leaf.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, jmp_lite.linen
    >>> from jmp_lite.linen._cache import UNCACHED, traced_apply
    >>> from jmp_lite.linen._intercept import PolicyCall
    >>> model = jmp_lite.linen.mixed_precision(nn.Dense(2), "c=bf16")
    >>> v = model.init(jax.random.key(0), jnp.ones((1, 3)))
    >>> run = PolicyCall(None)
    >>> traced_apply(model, v, (jnp.ones((1, 3)),), run, {}) is UNCACHED
    True
  """
  leaves, treedef = jax.tree.flatten((variables, args, kwargs))
  if not any(map(_jaxpr.is_tracer, leaves)):
    return UNCACHED
  if compat.interceptors_active():
    return UNCACHED
  where = tuple(isinstance(x, jax.Array) for x in leaves)
  static = tuple(x for x, is_array in zip(leaves, where, strict=True)
                 if not is_array)
  # Types too: `train=1` and `train=True` are equal and hash alike.
  spec = (model, run, treedef, where, static,
          (tuple(map(type, static)), nn.get_logical_axis_rules()))
  try:
    hash(spec)
  except TypeError:
    return UNCACHED
  memo = model.memo
  with memo.lock:
    if spec in memo.uncacheable:
      return UNCACHED
  dynamic = [x for x, is_array in zip(leaves, where, strict=True) if is_array]
  try:
    return memo.apply(spec, dynamic)
  except _NotArrays:
    with memo.lock:
      memo.uncacheable.add(spec)
    return UNCACHED
