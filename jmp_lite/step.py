"""The optimizer step as one call, and the gradients of a scaled loss.

:func:`update_and_apply` replaces ``opt.update`` + ``optax.apply_updates``.
With a loss-scaled optimizer it decides the step *once*, up front: one
``lax.cond`` around "unscale, inner update, apply updates", with the unscale
inside the taken branch. In a train step jitted with donated params and
optimizer state that is the cheapest formulation measured on XLA:CPU (one
read of the gradients more than a plain step, no copies; see
``benchmarks/loss_scaling_overhead.py`` and ``docs/train_step.md``).

:func:`scaled_value_and_grad` is ``jax.value_and_grad`` of the scaled loss,
returning the unscaled loss: with both, a float32 train step becomes a
loss-scaled one by changing two lines.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite import contract
from jmp_lite import dtypes as _dtypes
from jmp_lite._checks import check_argnums, check_grads_fit, shape_of
from jmp_lite._skipping import reduce_finite
from jmp_lite._trees import rewrap_nnx, unwrap_nnx
from jmp_lite.finite import all_finite
from jmp_lite.loss_scale import (
  DynamicLossScale,
  LossScale,
  NoOpLossScale,
  StaticLossScale,
)
from jmp_lite.transforms import current_loss_scale

_LOSS_SCALES = (NoOpLossScale, StaticLossScale, DynamicLossScale)
_FLOAT32_MAX = float(jnp.finfo(jnp.float32).max)


def _largest_gradient(grads: Any) -> float:
  """The largest finite magnitude ``grads``' dtypes can hold."""
  return max((float(jnp.finfo(g.dtype).max) for g in jax.tree.leaves(grads)
              if _dtypes.is_floating_array(g)), default=0.0)


class _Plan(NamedTuple):
  kind: str                                 # "cond" or "update"
  why: str
  wrappers: tuple[contract.Forwarding, ...] = ()   # outside in
  guard: contract.Guarding | None = None


def _plan(optimizer: Any, largest_gradient: float = _FLOAT32_MAX) -> _Plan:
  """How to compile a step of ``optimizer``, from what it declares.

  Follows :class:`~jmp_lite.contract.Forwarding` declarations inward to a
  :class:`~jmp_lite.contract.Guarding` one; anything undeclared on the way
  (a user's wrapper, ``optax.chain``) means the optimizer's own update.
  """
  wrappers: list[contract.Forwarding] = []
  tx = optimizer
  while True:
    declared = contract.contract_of(tx)
    if declared is None:
      if wrappers:
        return _Plan("update", (
            "the innermost declared wrapper wraps a transformation that"
            " declares nothing (jmp_lite.contract): no guard to decide"))
      return _Plan("update", (
          "the optimizer declares no guard (jmp_lite.contract): optax.chain,"
          " inject_hyperparams and user-written wrappers run their own"
          " update, and any guard inside decides on what it gets"))
    if isinstance(declared, contract.Guarding):
      break
    if largest_gradient > declared.largest_gradient:
      return _Plan("update", (
          f"a wrapper keeps gradients finite only up to"
          f" {declared.largest_gradient:g} (a narrower master copy), and"
          f" these may reach {largest_gradient:g}: the guard decides"
          " itself"))
    wrappers.append(declared)
    tx = declared.inner
  kind, why = declared.config.formulation()
  if kind == "select":
    return _Plan("update", why)
  return _Plan("cond", "one lax.cond around unscale, update and apply ("
               + why + ")", tuple(wrappers), declared)


def formulation(optimizer: optax.GradientTransformation,
                grads_dtype: Any = jnp.float32) -> tuple[str, str]:
  """Says how :func:`update_and_apply` will compile a step of ``optimizer``.

  Read from what the transformations declare (:mod:`jmp_lite.contract`),
  never from a state.

  Args:
    optimizer: the optimizer.
    grads_dtype: the gradients' floating dtype (float64 gradients into a
      float32 :func:`master_weights` take ``"update"``).

  Returns:
    ``("cond", why)`` when the step is decided up front with one
    ``lax.cond``; ``("update", why)`` when it runs ``optimizer.update`` and
    applies the updates (each guard inside then skips on its own).

  Raises:
    TypeError: if ``optimizer`` is not a gradient transformation (an
      optimizer *state*, say: the formulation is read from what the
      transformation declares).

  Example:
    >>> import optax, jmp_lite
    >>> jmp_lite.step.formulation(
    ...     jmp_lite.loss_scaled(optax.adam(1e-3), "c=f16"))[0]  # on the CPU
    'cond'
    >>> jmp_lite.step.formulation(optax.adam(1e-3))[0]
    'update'
  """
  if not (callable(getattr(optimizer, "init", None))
          and callable(getattr(optimizer, "update", None))):
    raise TypeError(
        "formulation takes the optimizer (an optax.GradientTransformation),"
        f" got {type(optimizer).__name__}: the step is planned from what the"
        " transformations declare, not from a state; pass"
        " formulation(optimizer)")
  largest = float(jnp.finfo(_dtypes.to_floating_dtype(
      grads_dtype, "grads_dtype")).max)
  plan = _plan(optimizer, largest)
  return plan.kind, plan.why


def apply_updates(params: Any, updates: Any) -> Any:
  """``optax.apply_updates``, which also leaves params with ``float0`` updates.

  ``float0`` updates (the gradients of integer params under
  ``jax.grad(..., allow_int=True)``) leave their params as they are.

  Args:
    params: the params.
    updates: updates of the same structure.

  Returns:
    ``(p + u).astype(p.dtype)`` leaf by leaf, exactly as optax computes it.

  Raises:
    ValueError: if ``updates`` has another tree structure, or a leaf
      another shape, than ``params`` (optax broadcasts it).

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> jmp_lite.step.apply_updates({"w": jnp.ones(2)}, {"w": jnp.ones(2)})
    {'w': Array([2., 2.], dtype=float32)}
  """
  is_none = lambda x: x is None  # noqa: E731
  p_def = jax.tree.structure(params, is_leaf=is_none)
  u_def = jax.tree.structure(updates, is_leaf=is_none)
  if p_def != u_def:
    raise ValueError(
        "apply_updates: the updates' tree structure differs from the"
        f" params': updates {str(u_def):.300}, params {str(p_def):.300}")

  def apply(path: Any, p: Any, u: Any) -> Any:
    if p is None:
      return None
    u_shape, p_shape = shape_of(u), shape_of(p)
    if u_shape is not None and p_shape is not None and u_shape != p_shape:
      # p + u would broadcast: one update row added to every row.
      raise ValueError(
          f"apply_updates: the update at {jax.tree_util.keystr(path)} has"
          f" shape {u_shape}, its param {p_shape}")
    if getattr(u, "dtype", None) == jax.dtypes.float0:
      return p
    return jnp.asarray(p + u).astype(jnp.asarray(p).dtype)

  return jax.tree_util.tree_map_with_path(apply, params, updates,
                                          is_leaf=is_none)


def _check_optimizer(optimizer: Any) -> None:
  if not (callable(getattr(optimizer, "init", None))
          and callable(getattr(optimizer, "update", None))):
    raise TypeError(
        "update_and_apply expects an optax.GradientTransformation (with init"
        f" and update) as optimizer, got {type(optimizer).__name__}:"
        f" {optimizer!r}")


def update_and_apply(optimizer: optax.GradientTransformation, grads: Any,
                     opt_state: Any, params: Any,
                     **extra: Any) -> tuple[Any, Any]:
  """Runs one optimizer step: ``optimizer.update``, then apply the updates.

  Returns what ``u, s = optimizer.update(grads, opt_state, params, **extra)``
  followed by ``(optax.apply_updates(params, u), s)`` returns: bit for bit on
  skipped steps, within an ulp on applied ones (XLA may fuse the arithmetic
  differently). Any optimizer works. How the step compiles is read from
  what the optimizer's transformations *declare* (:mod:`jmp_lite.contract`),
  never from the state:

  * **One** ``lax.cond`` **for the whole step** when the optimizer is a
    :func:`~jmp_lite.loss_scaled` or :func:`~jmp_lite.skip_nonfinite`
    ("guard"), or reaches one through declared forwarding wrappers
    (:func:`~jmp_lite.master_weights` whose master dtype holds the
    gradients' range, :func:`~jmp_lite.kahan_summation`,
    :func:`~jmp_lite.stochastic_rounding`, :func:`~jmp_lite.state_dtypes`),
    and the guard's formulation is ``"cond"`` (``skip_with="auto"`` on the
    CPU; not with ``check_updates`` or a scale that may drop below 1). The
    finiteness of ``grads`` is read once (and agreed over the guard's
    ``axis_name``); the taken branch unscales, runs the inner update and
    applies it, fused, with no select and no copy of a donated buffer; the
    skipped branch runs the wrappers around the guard on its ``-0.0``
    updates, so params and the guard's inner state come back bit-identical
    and only the guard's counters and loss scale move.
  * ``optimizer.update`` + apply otherwise: a transformation that declares
    nothing (``optax.chain``, ``inject_hyperparams``, ``MultiSteps``,
    :func:`~jmp_lite.accumulate_gradients`, any wrapper you write: it may
    change which gradients the guard sees finite), or a ``"select"`` guard.
    Each guard then skips inside its own ``update``.

  :func:`jmp_lite.step.formulation` says which path a state takes, and why.
  No host syncs either way. Jit the train step with ``donate_argnums`` for
  params and optimizer state: nothing here keeps the old buffers alive.
  Params and state come back in the pytree structure they were given in,
  nnx variables included (``nnx.split`` states, a ``flax.nnx.Optimizer``'s
  ``opt_state``), as optax returns them: a jitted step traces once and a
  ``lax.scan`` carry keeps its structure.

  Args:
    optimizer: an ``optax.GradientTransformation``.
    grads: the gradients (of the *scaled* loss with a loss-scaled optimizer,
      e.g. from :func:`scaled_value_and_grad`).
    opt_state: the optimizer's state.
    params: the params the gradients were taken at.
    **extra: extra keyword arguments for ``optimizer.update``.

  Returns:
    ``(new_params, new_opt_state)``.

  Raises:
    TypeError: if ``optimizer`` is not a gradient transformation, or a
      floating param's gradient is an integer or bool array (or a real
      param's a complex one).
    ValueError: if ``params`` is ``None``, or ``grads`` has another tree
      structure or other shapes than ``params`` (a Python number is a
      scalar).

  Example:
    >>> import jax, jax.numpy as jnp, optax, jmp_lite
    >>> opt = jmp_lite.loss_scaled(optax.sgd(0.1),
    ...                            jmp_lite.StaticLossScale(4.0))
    >>> params = jnp.ones(2)
    >>> state = opt.init(params)
    >>> grads = jax.grad(lambda p: 4.0 * (p ** 2).sum())(params)
    >>> params, state = jmp_lite.update_and_apply(opt, grads, state, params)
    >>> params
    Array([0.8, 0.8], dtype=float32)
    >>> bad = jnp.array([1.0, jnp.inf])
    >>> same, state = jmp_lite.update_and_apply(opt, bad, state, params)
    >>> bool((same == params).all()), int(state.total_skips)
    (True, 1)
  """
  _check_optimizer(optimizer)
  if params is None:
    raise ValueError(
        "update_and_apply needs the params to apply the updates to: call"
        " update_and_apply(optimizer, grads, opt_state, params)")
  given_params, given_state = params, opt_state
  grads, opt_state, params = unwrap_nnx((grads, opt_state, params))
  check_grads_fit(grads, params, "update_and_apply")
  new_params, new_state = _step(optimizer, grads, opt_state, params, extra)
  # Back in the structures they came in (nnx variables included): a jitted
  # step or a lax.scan carry must see the same pytree on every call.
  return (rewrap_nnx(given_params, new_params),
          rewrap_nnx(given_state, new_state))


def _step(optimizer: optax.GradientTransformation, grads: Any,
          opt_state: Any, params: Any,
          extra: dict[str, Any]) -> tuple[Any, Any]:
  """:func:`update_and_apply` on plain pytrees."""
  plan = _plan(optimizer, _largest_gradient(grads))
  if plan.guard is None:
    updates, new_state = optimizer.update(grads, opt_state, params, **extra)
    return apply_updates(params, updates), new_state

  guard = plan.guard
  guard_state = opt_state
  for wrapper in plan.wrappers:
    guard_state = wrapper.inner_state(guard_state)
  if guard.check is not None:
    guard.check(guard_state)
  finite = reduce_finite(
      all_finite(grads), guard.config.axis_name,
      governs=None if guard.governs is None else guard.governs(guard_state))
  apply = finite
  if guard.blocked is not None:
    apply = finite & ~guard.blocked(guard_state)

  def branch(decision: bool) -> Callable[[], tuple[Any, Any]]:
    def run() -> tuple[Any, Any]:
      update = guard.decided(finite, decision)
      for wrapper in reversed(plan.wrappers):
        update = wrapper.rebind(update)
      updates, new_state = update(grads, opt_state, params, **extra)
      return apply_updates(params, updates), new_state
    return run

  return jax.lax.cond(apply, branch(True), branch(False))


_TRAIN_STATE_FIELDS = ("tx", "params", "opt_state", "step", "replace")


def apply_gradients(state: Any, *, grads: Any, **kwargs: Any) -> Any:
  """A train state's ``apply_gradients``, stepped by :func:`update_and_apply`.

  ``jmp_lite.apply_gradients(state, grads=g, **kw)`` stands for
  ``state.apply_gradients(grads=g, **kw)``.

  For a ``flax.training.train_state.TrainState`` (or a subclass, or any
  struct with ``tx``, ``params``, ``opt_state``, ``step`` and ``replace``),
  as Flax's examples step it: the same result as the method, but compiled
  the way :func:`update_and_apply` compiles a loss-scaled step (one
  ``lax.cond`` for the whole update where the optimizer allows it; on
  XLA:CPU with donation the method's ``update`` + apply path moves about two
  gradient-sizes more). ``step`` counts calls, as the method's does;
  schedules inside the optimizer follow its own count, which a skipped step
  does not advance.

  Args:
    state: the train state.
    grads: the gradients (of the scaled loss with a loss-scaled ``tx``).
    **kwargs: other fields to replace (``batch_stats=...``); they are
      replaced on a skipped step too (the guard protects only what goes
      through the optimizer).

  Returns:
    The new state.

  Raises:
    TypeError: if ``state`` lacks a train state's fields.
    ValueError: for Flax's ``_overwrite_with_gradient`` collection, which
      only ``TrainState.apply_gradients`` knows (use :mod:`jmp_lite.fp8` for
      FP8 scaling state).

  Example:
    >>> import jax, jax.numpy as jnp, optax, jmp_lite
    >>> from flax.training import train_state
    >>> tx = jmp_lite.loss_scaled(optax.sgd(0.1),
    ...                           jmp_lite.StaticLossScale(4.0))
    >>> state = train_state.TrainState.create(
    ...     apply_fn=None, params=jnp.ones(2), tx=tx)
    >>> grads = jax.grad(lambda p: 4.0 * (p ** 2).sum())(state.params)
    >>> state = jmp_lite.apply_gradients(state, grads=grads)
    >>> state.params, int(state.step)
    (Array([0.8, 0.8], dtype=float32), 1)
  """
  missing = [f for f in _TRAIN_STATE_FIELDS if not hasattr(state, f)]
  if missing:
    raise TypeError(
        "apply_gradients expects a train state (flax.training.train_state."
        f"TrainState or alike); {type(state).__name__} has no"
        f" {', '.join(missing)}")
  if isinstance(grads, Mapping) and "_overwrite_with_gradient" in grads:
    raise ValueError(
        "apply_gradients: grads hold Flax's '_overwrite_with_gradient'"
        " collection, which only TrainState.apply_gradients handles; call the"
        " method, or keep FP8 scaling state with jmp_lite.fp8")
  params, opt_state = update_and_apply(state.tx, grads, state.opt_state,
                                       state.params)
  return state.replace(step=state.step + 1, params=params,
                       opt_state=opt_state, **kwargs)


def _loss_scale_of(loss_scale: Any) -> LossScale:
  if isinstance(loss_scale, _LOSS_SCALES):
    return unwrap_nnx(loss_scale)
  if loss_scale is None or isinstance(
      loss_scale, (numbers.Number, np.ndarray, np.generic, jax.Array, str)):
    raise TypeError(
        "loss_scale must be a loss-scale state (NoOpLossScale,"
        " StaticLossScale or DynamicLossScale) or an optimizer state holding"
        " a jmp_lite.loss_scaled(...) state, got"
        f" {type(loss_scale).__name__}: {loss_scale!r}; for a fixed number"
        " pass jmp_lite.StaticLossScale(value)")
  try:
    return current_loss_scale(loss_scale)
  except ValueError as e:
    raise ValueError(f"scaled_value_and_grad: {e}") from None


def scaled_value_and_grad(
    fun: Callable[..., Any],
    loss_scale: Any,
    *,
    argnums: int | tuple[int, ...] | None = None,
    has_aux: bool = False,
    value_and_grad: Callable[..., Any] | None = None,
) -> Callable[..., tuple[Any, Any]]:
  """``jax.value_and_grad`` of the scaled loss; returns the unscaled loss.

  Differentiates ``loss_scale.scale(fun(...))``, so the gradients are those
  of the scaled loss (what :func:`~jmp_lite.loss_scaled` and
  :func:`update_and_apply` expect), and returns the loss as ``fun`` computed
  it, unscaled, with ``aux`` when ``has_aux``: the true loss to log, with no
  ``has_aux`` trick. With a no-op scale it is ``jax.value_and_grad``.

  Args:
    fun: the loss function; returns a real scalar (or ``(loss, aux)`` with
      ``has_aux=True``).
    loss_scale: a loss-scale state (``NoOpLossScale``, ``StaticLossScale``,
      ``DynamicLossScale``), or an optimizer state holding one
      :func:`~jmp_lite.loss_scaled` state (its current scale is used, as
      :func:`~jmp_lite.current_loss_scale` finds it; a
      ``flax.nnx.Optimizer``'s ``opt_state`` works too). With several named
      loss-scaled states pass ``current_loss_scale(state, name)``.
    argnums: which positional argument(s) to differentiate, as for
      ``jax.value_and_grad``; ``None`` (the default) passes none, so the
      transformation's own default applies (``jax.value_and_grad``'s: the
      first argument).
    has_aux: whether ``fun`` returns ``(loss, aux)``.
    value_and_grad: the transformation to use, called as
      ``value_and_grad(f, has_aux=True)``, plus ``argnums=argnums`` when
      ``argnums`` is given; default ``jax.value_and_grad``. Pass
      ``flax.nnx.value_and_grad`` for nnx modules, or
      ``equinox.filter_value_and_grad`` for an Equinox model (it
      differentiates the first argument's inexact arrays and takes no
      ``argnums``).

  Returns:
    A function with ``fun``'s signature returning ``(loss, grads)``, or
    ``((loss, aux), grads)`` with ``has_aux``.

  Raises:
    TypeError: if ``fun`` or ``value_and_grad`` is not callable,
      ``has_aux`` is not a bool, ``argnums`` is neither ``None``, an int
      nor a non-empty tuple of ints, or ``loss_scale`` is neither a loss-scale
      state nor an optimizer state; when called, if ``has_aux`` is set and
      ``fun`` does not return a pair.
    ValueError: if ``loss_scale`` is an optimizer state without a loss-scaled
      state (or with several and no way to pick one).

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> scale = jmp_lite.StaticLossScale(1024.0)
    >>> loss, grads = jmp_lite.scaled_value_and_grad(
    ...     lambda w: (w ** 2).sum(), scale)(jnp.ones(2))
    >>> float(loss), grads
    (2.0, Array([2048., 2048.], dtype=float32))

    With an Equinox model, ``equinox.filter_value_and_grad`` differentiates
    its inexact arrays (gradients shaped like the model):

    >>> import equinox as eqx, jax
    >>> model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    >>> loss, grads = jmp_lite.scaled_value_and_grad(
    ...     lambda m, x: m(x).sum(), scale,
    ...     value_and_grad=eqx.filter_value_and_grad)(model, jnp.ones(2))
    >>> bool((grads.bias == 1024.0).all())
    True
  """
  if not callable(fun):
    raise TypeError(
        f"fun must be callable, got {type(fun).__name__}: {fun!r}")
  if not isinstance(has_aux, bool):
    raise TypeError(f"has_aux must be a bool, got {has_aux!r}")
  if value_and_grad is None:
    value_and_grad = jax.value_and_grad
  if not callable(value_and_grad):
    raise TypeError(
        "value_and_grad must be callable (e.g. jax.value_and_grad), got"
        f" {value_and_grad!r}")
  check_argnums(argnums, "scaled_value_and_grad")
  scale = _loss_scale_of(loss_scale)

  def scaled(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    out = fun(*args, **kwargs)
    if has_aux:
      if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TypeError(
            "scaled_value_and_grad(has_aux=True): fun must return a pair"
            f" (loss, aux), got {type(out).__name__}")
      loss, aux = out
    else:
      loss, aux = out, None
    return scale.scale(loss), (loss, aux)

  # argnums only when asked for: transformations such as Equinox's
  # filter_value_and_grad take none (and reject one).
  options: dict[str, Any] = {"has_aux": True}
  if argnums is not None:
    options["argnums"] = argnums
  grad_fn = value_and_grad(scaled, **options)

  @functools.wraps(fun)
  def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    (_, (loss, aux)), grads = grad_fn(*args, **kwargs)
    return ((loss, aux) if has_aux else loss), grads

  return wrapped


__all__ = ["apply_gradients", "apply_updates", "formulation",
           "scaled_value_and_grad", "update_and_apply"]
