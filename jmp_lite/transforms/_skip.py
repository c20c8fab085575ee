"""The skip machinery both guards share.

Counting skips, the ``-0.0`` updates of a skipped step, the guarded update
(one ``lax.cond`` or a select), the update with the decision taken outside
(by :func:`jmp_lite.update_and_apply`), the checks of a state against its
guard, and :func:`guard`, which declares a guard to the step
(:class:`jmp_lite.contract.Guarding`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite import _jaxpr, _optax, contract
from jmp_lite._checks import listing
from jmp_lite._skipping import reduce_finite, skip_updates
from jmp_lite.finite import all_finite, select_tree
from jmp_lite.transforms._config import GuardConfig


class Counters(NamedTuple):
  """A guard's skip counters after one step (int32, int32, bool)."""

  total_skips: jax.Array
  consecutive_skips: jax.Array
  last_finite: jax.Array


def count_skips(finite: jax.Array, total: Any, consecutive: Any) -> Counters:
  """A guard's skip counters after a step that was applied where ``finite``.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite.transforms._skip import count_skips
    >>> int(count_skips(jnp.array(False), 3, 1).consecutive_skips)
    2
  """
  skipped = (~finite).astype(jnp.int32)
  return Counters(
      total_skips=jnp.asarray(total, jnp.int32) + skipped,
      consecutive_skips=jnp.where(
          finite, 0, jnp.asarray(consecutive, jnp.int32) + 1
      ).astype(jnp.int32),
      last_finite=finite,
  )


def _same_avals(shapes: Any, tree: Any) -> bool:
  s_leaves, s_def = jax.tree.flatten(shapes)
  t_leaves, t_def = jax.tree.flatten(tree)
  if s_def != t_def:
    return False
  return all(
      hasattr(t, "dtype") and tuple(s.shape) == tuple(jnp.shape(t))
      and s.dtype == t.dtype for s, t in zip(s_leaves, t_leaves, strict=True))


def _minus_zero(shape: Any) -> Any:
  dtype = shape.dtype
  if dtype == jax.dtypes.float0:
    return np.zeros(shape.shape, dtype)
  # With the sharding the updates' type has (explicit mesh axes): the skip
  # branch must return the step branch's types.
  fill = -0.0 if jnp.issubdtype(dtype, jnp.inexact) else 0
  return jax.lax.full(shape.shape, fill, dtype,
                      sharding=_jaxpr.type_sharding(shape))


def skipped_updates(inner: optax.GradientTransformation, grads: Any,
                    inner_state: Any, params: Any,
                    extra: dict[str, Any]) -> Any:
  """The updates a skipped step hands on: ``-0.0`` shaped like ``inner``'s.

  ``inner`` is only traced abstractly (``jax.eval_shape``), never run.

  Args:
    inner: the guarded optimizer.
    grads: the gradients it would get.
    inner_state: its state.
    params: the params.
    extra: its extra keyword arguments.

  Returns:
    ``-0.0`` in every inexact leaf (``x + -0.0`` is ``x`` bit for bit),
    zeros elsewhere.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from jmp_lite.transforms._skip import skipped_updates
    >>> opt = optax.sgd(0.1)
    >>> p = jnp.ones(2)
    >>> skipped_updates(opt, p, opt.init(p), p, {})
    Array([-0., -0.], dtype=float32)
  """
  shapes = jax.eval_shape(
      lambda: inner.update(grads, inner_state, params, **extra)[0])
  if _same_avals(shapes, grads):
    # Built from the gradients, so that the result carries their sharding.
    return skip_updates(False, grads)
  return jax.tree.map(_minus_zero, shapes)


def _check_stable_state(old: Any, new: Any) -> None:
  """Raises unless ``inner``'s new state has its old one's dtypes.

  A skipped step keeps the old state, so both must be one type: optax's Adam
  on bfloat16 params fed float32 gradients promotes its moments to float32
  on the first step, which a skip cannot match (JAX said only "cond branches
  must have equal output types").
  """
  old_leaves, old_def = jax.tree_util.tree_flatten_with_path(old)
  new_leaves, new_def = jax.tree.flatten(new)
  if old_def != new_def:
    raise TypeError(
        "The inner optimizer's update changed its state's structure"
        f" ({old_def} -> {new_def}); a guard keeps the old state on a skipped"
        " step, so both must be one type")
  changed = [
      f"{jax.tree_util.keystr(path)}: {np.dtype(a.dtype).name} ->"
      f" {np.dtype(b.dtype).name}"
      for (path, a), b in zip(old_leaves, new_leaves, strict=True)
      if hasattr(a, "dtype") and hasattr(b, "dtype") and a.dtype != b.dtype]
  if changed:
    raise TypeError(
        "The inner optimizer's update changes its state's dtypes ("
        + listing(changed)
        + "), which a skipped step, keeping the old state, cannot match."
        " Usually half-precision params with float32 gradients: give the"
        " gradients the params' dtype, keep float32 master weights"
        " (jmp_lite.master_weights(...) around the guard), or fix the"
        " moments' dtype (optax.adam(..., mu_dtype=...))")


def guarded_update(inner: optax.GradientTransformation, grads: Any,
                   inner_state: Any, params: Any, apply: jax.Array,
                   extra: dict[str, Any], *, prepare: Any = None,
                   check_updates: bool = False, axis_name: Any = None,
                   branch: bool = False) -> tuple[Any, Any, jax.Array]:
  """Runs ``inner`` on ``prepare(grads)``; keeps its result where ``apply``.

  With ``branch``, one ``lax.cond``: ``prepare`` (the unscale) and ``inner``
  run only inside the taken branch, so neither the prepared gradients nor a
  select of the inner state is materialised. Otherwise ``inner`` always runs
  and its result is selected; with ``check_updates`` a step whose updates
  came out non-finite is not applied either. Returns
  ``(updates, inner_state, applied)``.
  """
  if prepare is None:
    prepare = lambda g: g  # noqa: E731
  if branch:
    def taken() -> tuple[Any, Any]:
      out = inner.update(prepare(grads), inner_state, params, **extra)
      _check_stable_state(inner_state, out[1])
      return out

    def skipped() -> tuple[Any, Any]:
      return (skipped_updates(inner, grads, inner_state, params, extra),
              inner_state)

    new_updates, new_inner = jax.lax.cond(apply, taken, skipped)
    return new_updates, new_inner, apply
  new_updates, new_inner = inner.update(prepare(grads), inner_state, params,
                                        **extra)
  _check_stable_state(inner_state, new_inner)
  if check_updates:
    apply = apply & reduce_finite(all_finite(new_updates), axis_name)
  new_updates = skip_updates(apply, new_updates)
  new_inner = select_tree(apply, new_inner, inner_state)
  return new_updates, new_inner, apply


class Decision(NamedTuple):
  """A skip decision taken outside the guard (by update_and_apply)."""

  finite: jax.Array   # the gradients were finite (agreed over axis_name)
  apply: bool         # this branch applies the step (static)


def decided_update(inner: optax.GradientTransformation, grads: Any,
                   inner_state: Any, params: Any, decision: Decision,
                   extra: dict[str, Any], prepare: Any = None
                   ) -> tuple[Any, Any, jax.Array]:
  """The guard's part of a step decided outside it (no check, no select)."""
  if decision.apply:
    g = grads if prepare is None else prepare(grads)
    new_updates, new_inner = inner.update(g, inner_state, params, **extra)
    _check_stable_state(inner_state, new_inner)
    return new_updates, new_inner, jnp.ones((), jnp.bool_)
  return (skipped_updates(inner, grads, inner_state, params, extra),
          inner_state, jnp.zeros((), jnp.bool_))


def check_config(state: Any, config: GuardConfig, who: str,
                 **more: tuple[Any, Any]) -> None:
  """Raises unless ``state`` was made by a guard configured as this one.

  The guard's configuration is read from the optimizer, never from the
  state: a state made under another one (a checkpoint of another run, an
  optimizer rebuilt with another ``axis_name``) would otherwise mix the
  two, e.g. one device deciding alone while the others agree.
  """
  mismatched = [("config", state.config, config)] if state.config != config \
      else []
  mismatched += [(k, got, want) for k, (got, want) in more.items()
                 if got != want]
  if mismatched:
    what = "; ".join(f"the state's {k} is {got!r}, the optimizer's {want!r}"
                     for k, got, want in mismatched)
    raise ValueError(
        f"{who}(...).update got a state that another configuration made:"
        f" {what}. Step a state with the optimizer whose init made it (or"
        " rebuild the optimizer with the state's settings)")


def guard(init: Any, run: Any, config: GuardConfig, check: Any,
          blocked: Any = None, governs: Any = None
          ) -> optax.GradientTransformationExtraArgs:
  """A guard transformation from its ``run`` (see :class:`Decision`),
  declared to :func:`jmp_lite.update_and_apply` (:mod:`jmp_lite.contract`).
  """
  def update(updates: Any, state: Any, params: Any = None,
             **extra: Any) -> tuple[Any, Any]:
    return run(updates, state, params, extra, None)

  def decided(finite: jax.Array, apply: bool) -> contract.UpdateFn:
    def update_decided(updates: Any, state: Any, params: Any = None,
                       **extra: Any) -> tuple[Any, Any]:
      return run(updates, state, params, extra, Decision(finite, apply))
    return update_decided

  return _optax.transformation(init, contract.declare(
      update, contract.Guarding(config=config, decided=decided,
                                blocked=blocked, check=check,
                                governs=governs)))
