"""Which outputs of a policy-run ``flax.nnx`` call the output dtype casts.

The output dtype governs the activations a call returns (logits,
features), not the state it returns: a cache must come back in the dtype
its method made it in, or a ``p=f32,c=bf16,o=f32`` decode loop would carry
float32 K/V (twice the bare model's cache) and convert them every step.
State is recognised by two rules (:func:`keep_state`): a returned container
laid out as a container argument (the cache a decode step hands back), and
a floating value in a dtype the call names among its arguments
(:func:`chosen_dtypes`: ``init_cache(batch, size, dtype=jnp.bfloat16)``).
Methods named in ``mixed_precision(..., state_methods=...)`` skip the cast
altogether (:func:`jmp_lite.nnx._call.invoke`).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import dtypes as _dtypes
from jmp_lite import rules as _rules


def chosen_dtypes(module: Any, method: str, args: tuple,
                  kwargs: dict) -> frozenset[np.dtype]:
  """The floating dtypes a call names among its arguments, the method's
  defaults included.

  Args:
    module: the module called.
    method: the method's name.
    args: the positional arguments.
    kwargs: the keyword arguments.

  Returns:
    Each argument that is a floating dtype or scalar type, as a dtype.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jmp_lite.nnx._outputs import chosen_dtypes
    >>> class M(nnx.Module):
    ...   def init_cache(self, n, dtype=jnp.bfloat16): ...
    >>> sorted(map(str, chosen_dtypes(M(), "init_cache", (4,), {})))
    ['bfloat16']
    >>> chosen_dtypes(M(), "init_cache", (4, jnp.int8), {})
    frozenset()
  """
  values = [*args, *kwargs.values()]
  with contextlib.suppress(TypeError, ValueError, AttributeError):
    bound = inspect.signature(getattr(module, method)).bind(*args, **kwargs)
    bound.apply_defaults()
    values = [*bound.arguments.values()]
  found = set()
  for value in values:
    # np.dtype reads dtypes and scalar types (jnp.bfloat16); other classes
    # read as object or raise.
    with contextlib.suppress(TypeError):
      if isinstance(value, (np.dtype, type)):
        found.add(np.dtype(value))
  return frozenset(d for d in found if jnp.issubdtype(d, jnp.floating))


def same_layout(out: Any, arg: Any) -> bool:
  """Whether ``out`` is laid out as the container ``arg``.

  Args:
    out: part of a call's outputs.
    arg: one of its arguments.

  Returns:
    Whether both are one tree (not a bare array) whose floating arrays pair
    up, equal in shape, with at least one such pair; other leaves (an
    integer index) may differ.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite.nnx._outputs import same_layout
    >>> cache = {"k": jnp.zeros(3, jnp.bfloat16), "i": 0}
    >>> same_layout({"k": jnp.ones(3), "i": jnp.array(1)}, cache)
    True
    >>> same_layout(jnp.ones(3), jnp.zeros(3))   # Not a container.
    False
  """
  lo, to = jax.tree.flatten(out, is_leaf=_dtypes.is_live_state)
  la, ta = jax.tree.flatten(arg, is_leaf=_dtypes.is_live_state)
  if to != ta or ta.num_nodes == 1:
    return False
  floats = [_dtypes.is_floating_array(o) for o in lo]
  return any(floats) and all(
      f == _dtypes.is_floating_array(a) and (not f or o.shape == a.shape)
      for o, a, f in zip(lo, la, floats, strict=True))


class _Kept(int):
  """Where :func:`keep_state` took out a piece of state (its index)."""


def keep_state(out: Any, cast: Callable[[Any], Any],
               given: tuple[tuple, dict], chosen: frozenset[np.dtype]) -> Any:
  """``out`` cast by ``cast``, except for the state in it.

  A part of ``out`` laid out as a container argument (:func:`same_layout`)
  comes back in the dtypes the caller passed that argument in; a floating
  leaf in one of the ``chosen`` dtypes comes back as it is. The state is
  taken out before ``cast`` runs, so it is not converted at all (not even
  converted and dropped, which an eager call would pay for).

  Args:
    out: a call's outputs, as the method returned them.
    cast: the policy's cast of outputs (the tree in, the same tree out).
    given: ``(args, kwargs)`` as the caller passed them, before any cast.
    chosen: the floating dtypes the call named (:func:`chosen_dtypes`).

  Returns:
    The outputs to hand back.

  Example:
    >>> import jax.numpy as jnp, jmp_lite.rules
    >>> from jmp_lite.nnx._outputs import keep_state
    >>> cache = {"k": jnp.zeros(3, jnp.bfloat16)}
    >>> out = (jnp.ones(2, jnp.bfloat16), cache)
    >>> to_f32 = lambda o: jmp_lite.rules.cast_inputs(o, jnp.float32)
    >>> y, new = keep_state(out, to_f32, ((cache,), {}), frozenset())
    >>> y.dtype, new["k"].dtype
    (dtype('float32'), dtype(bfloat16))
  """
  containers = [a for a in (*given[0], *given[1].values())
                if not _dtypes.is_live_state(a)]
  kept: list[Any] = []

  def take(value: Any) -> _Kept:
    kept.append(value)
    return _Kept(len(kept) - 1)

  def mark(o: Any) -> Any:
    if _dtypes.is_live_state(o):
      return o
    for arg in containers:
      if same_layout(o, arg):
        return take(_rules.keep_dtypes(o, arg))
    # One level down: every child is taken as a leaf.
    children, tree = jax.tree.flatten(o, is_leaf=lambda x: x is not o)
    if len(children) == 1 and children[0] is o:   # A leaf.
      keep = _dtypes.is_floating_array(o) and o.dtype in chosen
      return take(o) if keep else o
    return tree.unflatten([mark(c) for c in children])

  marked = mark(out)
  if not kept:
    return cast(out)
  return jax.tree.map(
      lambda x: kept[x] if type(x) is _Kept else x, cast(marked),
      is_leaf=lambda x: type(x) is _Kept or _dtypes.is_live_state(x))
