"""optax transformations: skip non-finite updates and keep a loss scale.

Both transformations decide *without branching*: the inner optimizer always
runs, and ``lax.select`` keeps its previous state when the gradients were not
finite. On GPU and TPU XLA fuses that select into the optimizer's own
elementwise kernels, so a skip costs no extra pass; a ``lax.cond`` (as in
``optax.apply_if_finite``) would stop that fusion.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite import struct
from jmp_lite.finite import all_finite, select_tree, skip_updates
from jmp_lite.loss_scale import (DynamicLossScale, LossScale, NoOpLossScale,
                                 StaticLossScale)
from jmp_lite.master import half_precision_leaves
from jmp_lite.policy import Policy


class NonFiniteHaltError(RuntimeError):
  """Raised by :func:`raise_if_halted` once a skip budget has run out."""


@struct.dataclass
class SkipNonfiniteState:
  """State of :func:`skip_nonfinite`.

  Attributes:
    inner_state: the wrapped optimizer's state, untouched by skipped steps.
    total_skips: skipped steps since ``init`` (int32).
    consecutive_skips: skipped steps since the last applied one (int32).
    last_finite: whether the last step's gradients were finite (bool).
    halted: whether ``max_consecutive_skips`` ran out; sticky (bool).
  """

  inner_state: Any
  total_skips: Any
  consecutive_skips: Any
  last_finite: Any
  halted: Any


@struct.dataclass
class LossScaledState:
  """State of :func:`loss_scaled`.

  Attributes:
    inner_state: the wrapped optimizer's state, untouched by skipped steps.
    loss_scale: the loss-scale state to scale the *next* loss with.
    total_skips: skipped steps since ``init`` (int32).
    consecutive_skips: skipped steps since the last applied one (int32).
    last_finite: whether the last step was applied: its gradients (and, with
      ``check_updates``, its updates) were finite (bool).
    name: a label that tells several loss-scaled optimizers apart (static).
    nonfinite: with ``track_nonfinite=True``, the last step's per-leaf counts
      of non-finite gradient elements (see ``jmp_lite.nonfinite_paths``);
      otherwise ``None``.
  """

  inner_state: Any
  loss_scale: Any
  total_skips: Any
  consecutive_skips: Any
  last_finite: Any
  name: str | None = struct.field(static=True, default=None)
  nonfinite: Any = None


class _Counters(NamedTuple):
  total_skips: jax.Array
  consecutive_skips: jax.Array
  last_finite: jax.Array


def _count(finite: jax.Array, total: Any, consecutive: Any) -> _Counters:
  skipped = (~finite).astype(jnp.int32)
  return _Counters(
      total_skips=jnp.asarray(total, jnp.int32) + skipped,
      consecutive_skips=jnp.where(
          finite, 0, jnp.asarray(consecutive, jnp.int32) + 1
      ).astype(jnp.int32),
      last_finite=finite,
  )


def _reduce_finite(finite: jax.Array, axis_name: Any) -> jax.Array:
  """Makes ``finite`` agree on every device of ``axis_name``.

  One device's overflow must make every device skip and back off alike, or
  replicated params and scales drift apart.
  """
  if axis_name is None:
    return finite
  return jax.lax.pmin(finite.astype(jnp.int32), axis_name) > 0


def _guarded_update(inner: optax.GradientTransformation, updates: Any,
                    inner_state: Any, params: Any, apply: jax.Array,
                    extra: dict[str, Any], check_updates: bool = False,
                    axis_name: Any = None) -> tuple[Any, Any, jax.Array]:
  """Runs ``inner`` and keeps its result only where ``apply``.

  With ``check_updates``, a step whose updates came out non-finite is not
  applied either. Returns ``(updates, inner_state, applied)``.
  """
  new_updates, new_inner = inner.update(updates, inner_state, params, **extra)
  if check_updates:
    apply = apply & _reduce_finite(all_finite(new_updates), axis_name)
  new_updates = skip_updates(apply, new_updates)
  new_inner = select_tree(apply, new_inner, inner_state)
  return new_updates, new_inner, apply


def _check_transformation(inner: Any) -> None:
  if not (callable(getattr(inner, "init", None))
          and callable(getattr(inner, "update", None))):
    raise TypeError(
        "Expected an optax.GradientTransformation (with init and update), got"
        f" {type(inner).__name__}: {inner!r}"
    )


def skip_nonfinite(
    inner: optax.GradientTransformation,
    *,
    max_consecutive_skips: int | None = None,
    axis_name: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` so that steps with non-finite gradients change nothing.

  When any floating leaf of the incoming updates is +-inf or NaN, ``update``
  returns zero updates (``-0.0``, so that ``optax.apply_updates`` leaves every
  param bit for bit as it was, ``-0.0`` included) and the inner state **bit for
  bit unchanged**: Adam's
  count and moments, schedules, EMAs, everything. The decision is branch-free
  and needs no host sync.

  ``max_consecutive_skips=N`` (opt-in) *halts* training after the N-th
  consecutive skip: ``state.halted`` becomes true and stays true, and from then
  on every step is skipped, finite or not, so nothing non-finite ever reaches
  the inner state or the params. Check it from the host where you already sync
  (logging) with :func:`raise_if_halted`. Without it, skipping goes on for as
  long as the gradients are non-finite.

  Args:
    inner: the optimizer to guard.
    max_consecutive_skips: ``None`` (default, never halt) or an int >= 1.
    axis_name: the mapped axis name under ``shard_map``/``pmap``; all devices
      then skip together when any device's shard is non-finite. Not needed
      under ``jax.jit`` with sharded arrays, where the check is global.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`SkipNonfiniteState`.

  Raises:
    TypeError: if ``inner`` is not a gradient transformation or
      ``max_consecutive_skips`` is not an int.
    ValueError: if ``max_consecutive_skips`` < 1.

  Example:
    >>> import jax.numpy as jnp, optax, jmp_lite
    >>> opt = jmp_lite.skip_nonfinite(optax.adam(1e-3))
    >>> params = {"w": jnp.ones(2)}
    >>> state = opt.init(params)
    >>> updates, state = opt.update({"w": jnp.array([1.0, jnp.nan])}, state, params)
    >>> updates["w"], int(state.total_skips)
    (Array([-0., -0.], dtype=float32), 1)
  """
  _check_transformation(inner)
  if max_consecutive_skips is not None:
    if (isinstance(max_consecutive_skips, bool)
        or not isinstance(max_consecutive_skips, int)):
      raise TypeError(
          "max_consecutive_skips must be None or an int, got"
          f" {type(max_consecutive_skips).__name__}: {max_consecutive_skips!r}"
      )
    if max_consecutive_skips < 1:
      raise ValueError(
          f"max_consecutive_skips must be >= 1, got {max_consecutive_skips}"
      )

  def init(params: Any) -> SkipNonfiniteState:
    return SkipNonfiniteState(
        inner_state=inner.init(params),
        total_skips=jnp.zeros((), jnp.int32),
        consecutive_skips=jnp.zeros((), jnp.int32),
        last_finite=jnp.ones((), jnp.bool_),
        halted=jnp.zeros((), jnp.bool_),
    )

  def update(updates: Any, state: SkipNonfiniteState, params: Any = None,
             **extra: Any) -> tuple[Any, SkipNonfiniteState]:
    finite = _reduce_finite(all_finite(updates), axis_name)
    halted = jnp.asarray(state.halted, jnp.bool_)
    apply = finite & ~halted
    new_updates, new_inner, _ = _guarded_update(
        inner, updates, state.inner_state, params, apply, extra)
    counts = _count(apply, state.total_skips, state.consecutive_skips)
    if max_consecutive_skips is not None:
      halted = halted | (counts.consecutive_skips >= max_consecutive_skips)
    return new_updates, SkipNonfiniteState(
        inner_state=new_inner,
        total_skips=counts.total_skips,
        consecutive_skips=counts.consecutive_skips,
        last_finite=finite,
        halted=halted,
    )

  return optax.GradientTransformationExtraArgs(init, update)


def default_loss_scale(policy: Policy | str) -> LossScale:
  """Chooses a loss scale for a policy.

  Dynamic scaling (from 2**15, as ``jmp`` recommends) when the policy computes
  in float16, whose narrow range makes small gradients underflow; no scaling
  for bfloat16, float32 and float64, which share float32's range.

  Args:
    policy: a :class:`Policy` or a policy string.

  Returns:
    A :class:`DynamicLossScale` or a :class:`NoOpLossScale`.

  Example:
    >>> import jmp_lite
    >>> type(jmp_lite.default_loss_scale("c=f16")).__name__
    'DynamicLossScale'
    >>> type(jmp_lite.default_loss_scale("c=bf16")).__name__
    'NoOpLossScale'
  """
  if isinstance(policy, str):
    from jmp_lite.policy import get_policy  # Local: keeps the import graph flat.
    policy = get_policy(policy)
  if not isinstance(policy, Policy):
    raise TypeError(
        f"Expected a jmp_lite.Policy or policy string, got {policy!r}"
    )
  if policy.compute_dtype == np.dtype(jnp.float16):
    return DynamicLossScale(2.0**15)
  return NoOpLossScale()


def loss_scaled(
    inner: optax.GradientTransformation,
    loss_scale: LossScale | Policy | str,
    *,
    axis_name: Any = None,
    name: str | None = None,
    allow_half_state: bool = False,
    track_nonfinite: bool = False,
    check_updates: bool | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` with loss scaling: unscale, check, skip, adjust.

  Keeps the loss-scale state inside the optimizer state. ``update`` takes the
  gradients of the *scaled* loss, unscales them, checks their finiteness once,
  runs ``inner`` on the unscaled gradients (so a clipping or weight-decay step
  inside ``inner`` sees true gradient values), skips the step as
  :func:`skip_nonfinite` does when they are not finite, and adjusts the scale.
  Use :func:`current_loss_scale` to fetch the scale for the next loss.

  Args:
    inner: the optimizer to wrap; put every transformation that must see
      unscaled gradients (clipping!) inside it.
    loss_scale: the initial :class:`NoOpLossScale`, :class:`StaticLossScale` or
      :class:`DynamicLossScale`; or a :class:`Policy`/policy string, to use
      :func:`default_loss_scale`.
    axis_name: the mapped axis name under ``shard_map``/``pmap``; every device
      then skips and backs off together.
    name: a label for :func:`current_loss_scale` when several loss-scaled
      optimizers live in one state.
    allow_half_state: ``init`` refuses an inner state with float16/bfloat16
      leaves (Adam's moments take the dtype of half-precision params, and
      then small updates vanish) unless this is ``True``. The usual fix is
      :func:`master_weights` around this transformation.
    track_nonfinite: keep per-leaf counts of non-finite gradient elements in
      ``state.nonfinite`` (costs one more read of the gradients).
    check_updates: also skip a step whose *updates* are non-finite although
      its gradients were finite: an optimizer running in half precision can
      overflow on its own (Adam's ``eps=1e-8`` is 0 in float16). Costs one
      read of the updates. ``None`` (default) turns it on exactly when
      ``allow_half_state`` is true.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`LossScaledState`.

  Raises:
    TypeError: if ``inner`` is not a gradient transformation or
      ``loss_scale`` is not a loss scale or policy; from ``init``, if the
      inner state holds half-precision leaves and ``allow_half_state`` is
      false.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jmp_lite
    >>> opt = jmp_lite.loss_scaled(optax.sgd(0.1), jmp_lite.StaticLossScale(4.0))
    >>> params = jnp.ones(2)
    >>> state = opt.init(params)
    >>> scale = jmp_lite.current_loss_scale(state)
    >>> grads = jax.grad(lambda p: scale.scale((p ** 2).sum()))(params)
    >>> updates, state = opt.update(grads, state, params)
    >>> updates
    Array([-0.2, -0.2], dtype=float32)
  """
  _check_transformation(inner)
  if isinstance(loss_scale, (Policy, str)):
    loss_scale = default_loss_scale(loss_scale)
  if not isinstance(loss_scale, (NoOpLossScale, StaticLossScale,
                                 DynamicLossScale)):
    raise TypeError(
        "loss_scale must be a NoOpLossScale, StaticLossScale,"
        " DynamicLossScale, Policy or policy string, got"
        f" {type(loss_scale).__name__}: {loss_scale!r}"
    )
  if name is not None and not isinstance(name, str):
    raise TypeError(f"name must be a str or None, got {name!r}")
  initial_scale = loss_scale
  check_unscaled = _may_amplify(loss_scale)
  if check_updates is None:
    check_updates = allow_half_state

  def tracked(grads: Any) -> Any:
    if not track_nonfinite:
      return None
    from jmp_lite.diagnostics import nonfinite_counts  # Avoids an import cycle.
    return nonfinite_counts(grads)

  def init(params: Any) -> LossScaledState:
    inner_state = inner.init(params)
    half = half_precision_leaves(inner_state)
    if half and not allow_half_state:
      raise TypeError(
          "The optimizer state would hold half-precision leaves: "
          + ", ".join(half[:4]) + (" ..." if len(half) > 4 else "")
          + ". Moments in float16/bfloat16 silently lose small updates. Keep"
          " float32 master weights with jmp_lite.master_weights(loss_scaled("
          "...)), or pass allow_half_state=True to loss_scaled if this is"
          " deliberate."
      )
    return LossScaledState(
        inner_state=inner_state,
        loss_scale=initial_scale,
        total_skips=jnp.zeros((), jnp.int32),
        consecutive_skips=jnp.zeros((), jnp.int32),
        last_finite=jnp.ones((), jnp.bool_),
        name=name,
        nonfinite=tracked(params),
    )

  def update(grads: Any, state: LossScaledState, params: Any = None,
             **extra: Any) -> tuple[Any, LossScaledState]:
    scale = state.loss_scale
    # Checking the incoming (scaled) gradients lets XLA fuse the unscale into
    # the optimizer's kernels instead of materialising it for the reduction.
    # Unscaling by 1/scale <= 1 cannot overflow, so this is exact unless the
    # scale may drop below 1; then the unscaled gradients are checked too.
    finite = all_finite(grads)
    grads = scale.unscale(grads)
    if check_unscaled:
      finite = finite & all_finite(grads)
    finite = _reduce_finite(finite, axis_name)
    new_updates, new_inner, apply = _guarded_update(
        inner, grads, state.inner_state, params, finite, extra,
        check_updates, axis_name)
    counts = _count(apply, state.total_skips, state.consecutive_skips)
    return new_updates, LossScaledState(
        inner_state=new_inner,
        # The scale answers to the gradients only: an update that overflows
        # inside the optimizer is not the loss scale's doing.
        loss_scale=scale.adjust(finite),
        total_skips=counts.total_skips,
        consecutive_skips=counts.consecutive_skips,
        last_finite=apply,
        name=state.name,
        nonfinite=tracked(grads),
    )

  return optax.GradientTransformationExtraArgs(init, update)


def _may_amplify(loss_scale: LossScale) -> bool:
  """Whether unscaling can ever multiply by more than 1 (scale below 1)."""
  if isinstance(loss_scale, NoOpLossScale):
    return False
  lowest = (loss_scale.min_loss_scale
            if isinstance(loss_scale, DynamicLossScale)
            else loss_scale.loss_scale)
  if isinstance(lowest, jax.core.Tracer):
    return True  # Unknown while tracing: take the safe path.
  return bool(float(lowest) < 1.0)


def loss_scaled_state(opt_state: Any,
                      name: str | None = None) -> LossScaledState:
  """Returns the :class:`LossScaledState` inside ``opt_state``.

  Finds it anywhere: inside ``optax.chain``, ``optax.MultiSteps``,
  ``optax.inject_hyperparams``, ``optax.multi_transform``, ``master_weights``
  or any other pytree of states. Its counters (``total_skips``,
  ``last_finite``, ...) are what a training loop logs.

  Args:
    opt_state: an optimizer state containing one (or, with ``name``, several)
      :class:`LossScaledState`.
    name: the ``name=`` given to :func:`loss_scaled`, to pick one of several.

  Returns:
    The state.

  Raises:
    ValueError: if no loss-scaled state is found, or several are and ``name``
      does not single one out.

  Example:
    >>> import jax.numpy as jnp, optax, jmp_lite
    >>> opt = jmp_lite.master_weights(jmp_lite.loss_scaled(optax.sgd(0.1), "f32"))
    >>> int(jmp_lite.loss_scaled_state(opt.init(jnp.ones(2))).total_skips)
    0
  """
  every = struct.find_nodes(opt_state, LossScaledState)
  found = every if name is None else [s for s in every if s.name == name]
  if len(found) == 1:
    return found[0]
  names = [s.name for s in every]
  if not found:
    raise ValueError(
        "No loss_scaled state"
        + (f" named {name!r}" if name is not None else "")
        + f" in the optimizer state (names found: {names}); build the"
        " optimizer with jmp_lite.loss_scaled(...)"
    )
  raise ValueError(
      f"{len(found)} loss_scaled states found (names: {names}); pass name= to"
      " current_loss_scale and give each loss_scaled(...) its own name="
  )


def current_loss_scale(opt_state: Any, name: str | None = None) -> LossScale:
  """Returns the loss-scale state to scale the next loss with.

  Finds the :class:`LossScaledState` anywhere in ``opt_state``: inside
  ``optax.chain``, ``optax.MultiSteps``, ``optax.inject_hyperparams``,
  ``optax.multi_transform`` or any other pytree of states.

  Args:
    opt_state: an optimizer state containing one (or, with ``name``, several)
      :class:`LossScaledState`.
    name: the ``name=`` given to :func:`loss_scaled`, to pick one of several.

  Returns:
    The loss-scale state (``NoOpLossScale``, ``StaticLossScale`` or
    ``DynamicLossScale``).

  Raises:
    ValueError: if no loss-scaled state is found, or several are and ``name``
      does not single one out.

  Example:
    >>> import jax.numpy as jnp, optax, jmp_lite
    >>> opt = optax.chain(jmp_lite.loss_scaled(optax.sgd(0.1), "c=f16"))
    >>> scale = jmp_lite.current_loss_scale(opt.init(jnp.ones(2)))
    >>> float(scale.loss_scale)
    32768.0
  """
  return loss_scaled_state(opt_state, name).loss_scale


def raise_if_halted(opt_state: Any) -> None:
  """Raises if a :func:`skip_nonfinite` in ``opt_state`` has halted.

  Reads device values, so it syncs with the host: call it where you already
  do (e.g. when logging), outside ``jax.jit``.

  Args:
    opt_state: any optimizer state.

  Raises:
    NonFiniteHaltError: naming the skip counts, if halted.

  Example:
    >>> import jax.numpy as jnp, optax, jmp_lite
    >>> opt = jmp_lite.skip_nonfinite(optax.sgd(0.1), max_consecutive_skips=3)
    >>> jmp_lite.raise_if_halted(opt.init(jnp.ones(2)))  # nothing to report
  """
  for node in struct.find_nodes(opt_state, SkipNonfiniteState):
    if bool(node.halted):
      raise NonFiniteHaltError(
          f"Training halted after {int(node.consecutive_skips)} consecutive"
          f" non-finite steps ({int(node.total_skips)} skipped in all); the"
          " params and optimizer state are those of the last finite step"
      )
