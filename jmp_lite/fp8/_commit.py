"""Advancing delayed-scaling histories once per applied optimizer step."""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import optax

from jmp_lite import contract, struct
from jmp_lite._checks import check_scalar_bool
from jmp_lite._trees import unwrap_nnx
from jmp_lite.accumulation import AccumulateState
from jmp_lite.fp8._recipes import ScalingState

T = TypeVar("T")

_ACCUMULATORS = (AccumulateState, optax.MultiStepsState)


def _is_state(x: Any) -> bool:
  return isinstance(x, ScalingState)


def _guards(tree: Any) -> list[contract.Gate]:
  """The outermost gates that are not accumulators (whose word is the
  window's end), looking inside accumulators."""
  found: list[contract.Gate] = []
  for gate in struct.find_nodes(tree, contract.Gate):
    if isinstance(gate, AccumulateState):
      found += _guards(gate.inner())
    else:
      found.append(gate)
  return found


def step_outcome(opt_state: Any) -> tuple[jax.Array, jax.Array]:
  """``(window_end, applied)`` of the step that returned ``opt_state``.

  ``window_end``: the update call closed an accumulation window (always true
  without ``accumulate_gradients``/``optax.MultiSteps``: their ``mini_step``
  is back at 0 exactly when the window's update was emitted). ``applied``:
  every ``loss_scaled``/``skip_nonfinite`` guard in it applied that step, as
  its state says (:class:`jmp_lite.contract.Gate`: a halted
  ``skip_nonfinite`` applies nothing; true without a guard). Jit-safe.

  Args:
    opt_state: the optimizer state *returned* by this step's ``update``.

  Returns:
    Two bool scalars.

  Raises:
    ValueError: if ``opt_state`` holds more than one accumulator.

  Example:
    >>> import jax.numpy as jnp, optax, jmp_lite
    >>> opt = jmp_lite.accumulate_gradients(
    ...     jmp_lite.loss_scaled(optax.sgd(0.1), "bf16"), every_k=2)
    >>> state = opt.init(jnp.ones(1))
    >>> _, state = opt.update(jnp.ones(1), state, jnp.ones(1))
    >>> [bool(b) for b in jmp_lite.fp8.step_outcome(state)]
    [False, True]
  """
  opt_state = unwrap_nnx(opt_state)
  accumulators = struct.find_nodes(opt_state, _ACCUMULATORS)
  if len(accumulators) > 1:
    raise ValueError(
        f"The optimizer state holds {len(accumulators)} gradient accumulators"
        " (accumulate_gradients / optax.MultiSteps); fp8.commit needs one"
        " window to count")
  if accumulators:
    window_end = jnp.asarray(accumulators[0].mini_step) == 0
  else:
    window_end = jnp.ones((), jnp.bool_)
  applied = jnp.ones((), jnp.bool_)
  # Every gate's own word (jmp_lite.contract.Gate): a halted
  # skip_nonfinite skips finite steps, which its last_finite does not say.
  for guard in _guards(opt_state):
    applied = applied & jnp.asarray(guard.applied(), jnp.bool_)
  return window_end, applied


def commit(state: T, observed: Any, opt_state: Any = None, *,
           applied: Any = None) -> T:
  """Folds one step's observed amaxes into delayed-scaling states.

  The rules, for every :class:`ScalingState` in ``state``:

  * the amaxes observed by every micro-batch of an accumulation window are
    combined by ``max`` in ``pending``;
  * the history advances by one entry (the window's ``pending``) only when
    the window closes *and* the optimizer applied that step: a step that
    ``loss_scaled``/``skip_nonfinite`` skipped leaves the history exactly as
    it was, and so does every micro-batch but the last;
  * ``pending`` is cleared when a window closes, applied or not;
  * a non-finite observation is recorded as 0 ("no observation").

  Call it after ``opt.update`` with the optimizer state that ``update``
  returned: that is where whether the step was applied, and whether the
  window closed, are read (see :func:`step_outcome`).

  Args:
    state: a pytree holding :class:`ScalingState` nodes (a dict, a linen
      ``"fp8"`` collection, an ``nnx.State``).
    observed: the gradient of the loss with respect to ``state`` (the same
      structure).
    opt_state: the optimizer state returned by this step's update; ``None``:
      every call is a whole, applied step.
    applied: a bool scalar that overrides the guards' decision (for a
      training loop without ``loss_scaled``).

  Returns:
    The new state, with ``state``'s structure.

  Raises:
    ValueError: if ``observed`` does not have ``state``'s structure (e.g.
      the gradient with respect to the params was passed).

  Example:
    >>> import jax, jax.numpy as jnp, jmp_lite
    >>> recipe = jmp_lite.fp8.DelayedScaling(history=4)
    >>> state = {"dense": recipe.init()}
    >>> def loss(w, state, x):
    ...   dot = jmp_lite.fp8.dot_general(recipe, state["dense"])
    ...   return dot(x, w, (((1,), (0,)), ((), ()))).sum()
    >>> x, w = jnp.full((2, 3), 2.0), jnp.full((3, 1), 0.5)
    >>> grads, observed = jax.grad(loss, argnums=(0, 1))(w, state, x)
    >>> state = jmp_lite.fp8.commit(state, observed)
    >>> state["dense"].history[:, 0]  # lhs, rhs, cotangent amaxes
    Array([2. , 0.5, 1. ], dtype=float32)
  """
  s_leaves, s_struct = jax.tree.flatten(state, is_leaf=_is_state)
  o_leaves, o_struct = jax.tree.flatten(observed, is_leaf=_is_state)
  if s_struct != o_struct or any(
      _is_state(s) != _is_state(o)
      for s, o in zip(s_leaves, o_leaves, strict=True)):
    raise ValueError(
        "observed must be the gradient with respect to the fp8 state (the"
        f" same structure as state); got {o_struct} with leaves"
        f" {[type(o).__name__ for o in o_leaves]} for state {s_struct}")
  if opt_state is None:
    window_end = jnp.ones((), jnp.bool_)
    guards = jnp.ones((), jnp.bool_)
  else:
    window_end, guards = step_outcome(opt_state)
  if applied is not None:
    guards = check_scalar_bool(applied, "commit's applied")
  advance = window_end & guards

  def one(s: Any, o: Any) -> Any:
    if not _is_state(s):
      return s
    seen = jnp.asarray(o.pending, jnp.float32)
    seen = jnp.where(jnp.isfinite(seen), seen, 0.0)
    pending = jnp.maximum(jnp.asarray(s.pending, jnp.float32), seen)
    history = jnp.asarray(s.history, jnp.float32)
    # Leading axes are layers stacked by nn.scan / nnx.scan (a history
    # (L, 3, n)): the window is the last axis.
    rolled = jnp.concatenate([pending[..., None], history[..., :-1]],
                             axis=-1)
    return ScalingState(
        history=jnp.where(advance, rolled, history),
        pending=jnp.where(window_end, jnp.zeros_like(pending), pending))

  return jax.tree.map(one, state, observed, is_leaf=_is_state)


def history_amax(state: Any) -> Any:
  """Per matmul, the amaxes its history holds: for logging.

  Args:
    state: a pytree holding :class:`ScalingState` nodes.

  Returns:
    The same structure with a float32 ``(3,)`` array (``lhs``, ``rhs``,
    ``grad``: each row's maximum; 0 while empty) per state, ``(L, 3)`` for
    ``L`` layers stacked by a scan.

  Example:
    >>> import jmp_lite
    >>> state = {"a": jmp_lite.fp8.DelayedScaling(history=2).init()}
    >>> jmp_lite.fp8.history_amax(state)
    {'a': Array([0., 0., 0.], dtype=float32)}
  """
  return jax.tree.map(
      lambda s: jnp.max(jnp.asarray(s.history, jnp.float32), axis=-1)
      if _is_state(s) else s, state, is_leaf=_is_state)


__all__ = ["commit", "history_amax", "step_outcome"]
