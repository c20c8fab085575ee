"""``loss_scaled``: unscale, check, skip and adjust a loss scale."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite import _jaxpr, contract, struct
from jmp_lite import dtypes as _dtypes
from jmp_lite._checks import (
  check_axis_name,
  check_bool,
  check_own_state,
  check_transformation,
  integer_gradients,
  listing,
)
from jmp_lite._nonfinite import nonfinite_counts
from jmp_lite._skipping import reduce_finite
from jmp_lite._trees import copy_arrays, half_precision_leaves
from jmp_lite.finite import all_finite
from jmp_lite.loss_scale import (
  DynamicLossScale,
  LossScale,
  NoOpLossScale,
  StaticLossScale,
)
from jmp_lite.policy import get_policy, Policy
from jmp_lite.transforms._config import (
  check_skip_with,
  GuardConfig,
)
from jmp_lite.transforms._skip import (
  check_config,
  count_skips,
  decided_update,
  Decision,
  guard,
  guarded_update,
)


@struct.dataclass
class LossScaledState(contract.Gate):
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
    config: the static :class:`GuardConfig`.
    scale_settings: the loss scale's configured values, which are leaves
      of the scale itself (static): ``(("loss_scale", 128.0),)`` for a
      :class:`StaticLossScale`, its ``min_loss_scale`` and
      ``max_loss_scale`` for a :class:`DynamicLossScale`, ``()`` for none.
      A state pickled before they were recorded derives them from its
      leaves when it is loaded.
    allow_half_state: whether it was made with ``allow_half_state=True``
      (static; ``False`` in a state pickled before it was recorded).
  """

  inner_state: Any
  loss_scale: Any
  total_skips: Any
  consecutive_skips: Any
  last_finite: Any
  name: str | None = struct.field(static=True, default=None)
  nonfinite: Any = None
  config: GuardConfig = struct.field(static=True, default=GuardConfig())
  scale_settings: tuple[tuple[str, float | None], ...] | None = struct.field(
      static=True, default=None)
  allow_half_state: bool = struct.field(static=True, default=False)

  def __setstate__(self, state: dict[str, Any]) -> None:
    # Pickled before the settings were recorded: its leaves are concrete
    # (a pickle holds values), so they say what its scale was made with,
    # and the state keeps the tree structure its optimizer's init makes.
    if state.get("scale_settings") is None and "loss_scale" in state:
      state = dict(state, scale_settings=_scale_settings(state["loss_scale"]))
    for key, value in state.items():
      object.__setattr__(self, key, value)

  def applied(self) -> jax.Array:
    """Whether the last step was applied (see :class:`jmp_lite.contract.Gate`).

    Returns:
      ``last_finite``, a bool scalar.

    Example:
      >>> import jax.numpy as jnp, optax, jmp_lite
      >>> opt = jmp_lite.loss_scaled(optax.sgd(0.1), "f32")
      >>> bool(opt.init(jnp.ones(2)).applied())
      True
    """
    return jnp.asarray(self.last_finite, jnp.bool_)

  def inner(self) -> Any:
    """The wrapped optimizer's state (see :class:`jmp_lite.contract.Gate`).

    Returns:
      ``inner_state``.

    Example:
      >>> import jax.numpy as jnp, optax, jmp_lite
      >>> opt = jmp_lite.loss_scaled(optax.sgd(0.1), "f32")
      >>> opt.init(jnp.ones(2)).inner()
      (EmptyState(), EmptyState())
    """
    return self.inner_state


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
    policy = get_policy(policy)
  if not isinstance(policy, Policy):
    raise TypeError(
        f"Expected a jmp_lite.Policy or policy string, got {policy!r}"
    )
  if policy.compute_dtype == np.dtype(jnp.float16):
    return DynamicLossScale(2.0**15)
  return NoOpLossScale()


_CONFIGURED = {StaticLossScale: ("loss_scale",),
               DynamicLossScale: ("min_loss_scale", "max_loss_scale")}


def _scale_settings(loss_scale: LossScale
                    ) -> tuple[tuple[str, float | None], ...]:
  """The configured values a loss scale keeps as leaves (a static scale's
  value, a dynamic scale's bounds), as Python floats; ``None`` for one
  traced when the optimizer was built."""
  return tuple(
      (n, None if _jaxpr.is_tracer(getattr(loss_scale, n))
       else float(getattr(loss_scale, n)))
      for n in _CONFIGURED.get(type(loss_scale), ()))


def _conform(loss_scale: LossScale, configured: LossScale) -> LossScale:
  """``loss_scale`` with the configured values of ``configured``.

  A state restored into this optimizer by orbax takes its static settings
  from the restore target (this optimizer's ``init``) but its leaves from
  the checkpoint: a static scale's value or a dynamic scale's bounds of
  another configuration. The step that consumes such a state unscales by
  the scale its loss was scaled with (the state's); from then on the
  configured values hold, the dynamic scale clipped into its new bounds.
  """
  changes = {n: jnp.asarray(getattr(configured, n), jnp.float32)
             for n in _CONFIGURED.get(type(configured), ())
             if not _jaxpr.is_tracer(getattr(configured, n))}
  if isinstance(loss_scale, DynamicLossScale) and changes:
    changes["loss_scale"] = jnp.clip(
        jnp.asarray(loss_scale.loss_scale, jnp.float32),
        changes.get("min_loss_scale", loss_scale.min_loss_scale),
        changes.get("max_loss_scale", loss_scale.max_loss_scale))
  return struct.replace(loss_scale, **changes) if changes else loss_scale


def _scale_kind(loss_scale: Any) -> str:
  """A loss scale's class and static settings (``period``, ``factor``,
  ``hysteresis``...), as it would be written: what its pytree node holds."""
  static = ", ".join(
      f"{f.name}={getattr(loss_scale, f.name)!r}"
      for f in dataclasses.fields(loss_scale)
      if f.metadata.get("jmp_lite.static"))
  return f"{type(loss_scale).__name__}({static})"


def loss_scaled(
    inner: optax.GradientTransformation,
    loss_scale: LossScale | Policy | str,
    *,
    axis_name: Any = None,
    name: str | None = None,
    allow_half_state: bool = False,
    track_nonfinite: bool = False,
    check_updates: bool | None = None,
    skip_with: str = "auto",
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` with loss scaling: unscale, check, skip, adjust.

  Keeps the loss-scale state inside the optimizer state. ``update`` takes the
  gradients of the *scaled* loss, unscales them, checks their finiteness once,
  runs ``inner`` on the unscaled gradients (so a clipping or weight-decay step
  inside ``inner`` sees true gradient values), skips the step as
  :func:`skip_nonfinite` does when they are not finite, and adjusts the scale.
  Use :func:`current_loss_scale` to fetch the scale for the next loss (or
  :func:`jmp_lite.scaled_value_and_grad`, which takes the optimizer state),
  and :func:`jmp_lite.update_and_apply` instead of ``update`` +
  ``optax.apply_updates`` for the cheapest donated train step.

  Args:
    inner: the optimizer to wrap; put every transformation that must see
      unscaled gradients (clipping!) inside it.
    loss_scale: the initial :class:`NoOpLossScale`, :class:`StaticLossScale` or
      :class:`DynamicLossScale`; or a :class:`Policy`/policy string, to use
      :func:`default_loss_scale`.
    axis_name: the mapped axis name under ``shard_map``/``pmap``; every device
      then skips and backs off together.
    name: a label for :func:`current_loss_scale` when several loss-scaled
      optimizers live in one state. Each guard unscales the gradients it
      gets by *its own* scale: they must be gradients of a loss multiplied
      by exactly that scale. Several dynamic scales over *one* loss (a guard
      per ``optax.multi_transform`` partition, say) drift apart as soon as
      one backs off alone, and from then on the other guards unscale by the
      wrong factor, silently (their updates are off by the ratio of the
      scales). Give each scale its own loss, scaled by
      ``current_loss_scale(state, name)``, or put one ``loss_scaled``
      around the whole ``multi_transform`` for one loss.
    allow_half_state: ``init`` refuses an inner state with float16,
      bfloat16 or FP8 leaves (Adam's moments take the dtype of
      half-precision params, and then small updates vanish) unless this is
      ``True``. The usual fix is :func:`master_weights` around this
      transformation. Leaves half by design do not count: the compensation
      of :func:`kahan_summation` and what :func:`state_dtypes` stores (it
      computes in float32). ``update`` likewise refuses float16 (and FP8)
      *gradients* under a scale other than :class:`NoOpLossScale` unless
      this is ``True``: unscaled in their own dtype, true gradients below
      float16's 6e-8 vanish and those below 6e-5 keep few bits (3e-8 came
      back 99% off, 1e-7 19%), as PyTorch's ``GradScaler`` refuses to
      unscale them. :func:`master_weights` around this transformation hands
      it float32 gradients.
    track_nonfinite: keep per-leaf counts of non-finite gradient elements in
      ``state.nonfinite`` (costs one more read of the gradients).
    check_updates: also skip a step whose *updates* are non-finite although
      its gradients were finite: an optimizer running in half precision can
      overflow on its own (Adam's ``eps=1e-8`` is 0 in float16). Costs one
      read of the updates. ``None`` (default) turns it on exactly when
      ``allow_half_state`` is true. The new inner state is not checked: a
      moment that overflowed to inf can still give finite (zero) updates
      (see :func:`skip_nonfinite`).
    skip_with: ``"auto"`` (default), ``"cond"`` or ``"select"``: how a skip
      is compiled (see the module docstring). ``check_updates`` and a scale
      that may drop below 1 always select.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`LossScaledState`.

  Raises:
    TypeError: if ``inner`` is not a gradient transformation,
      ``loss_scale`` is not a loss scale or policy, ``axis_name`` is not
      hashable, or a flag is not a bool; from ``update``, for integer or
      bool gradients of floating params (unscaling passes them, so they
      would be applied ``loss_scale`` times too large); from ``init``, if
      the inner state
      holds half-precision leaves, and from ``update``, if float16 or FP8
      gradients are to be unscaled, while ``allow_half_state`` is false.
    ValueError: if ``skip_with`` is unknown.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jmp_lite
    >>> opt = jmp_lite.loss_scaled(optax.sgd(0.1),
    ...                            jmp_lite.StaticLossScale(4.0))
    >>> params = jnp.ones(2)
    >>> state = opt.init(params)
    >>> scale = jmp_lite.current_loss_scale(state)
    >>> grads = jax.grad(lambda p: scale.scale((p ** 2).sum()))(params)
    >>> updates, state = opt.update(grads, state, params)
    >>> updates
    Array([-0.2, -0.2], dtype=float32)
  """
  check_transformation(inner, "loss_scaled")
  if isinstance(loss_scale, str):
    try:
      loss_scale = default_loss_scale(loss_scale)
    except ValueError as e:
      raise ValueError(
          f"loss_scaled: the loss_scale string {loss_scale!r} is read as a"
          " policy (e.g. 'p=f32,c=f16,o=f32' or 'bf16'), whose compute dtype"
          f" picks the default scale, and it is not one: {e}. For a chosen"
          " schedule pass a state: jmp_lite.DynamicLossScale(2.0**15),"
          " jmp_lite.StaticLossScale(...) or jmp_lite.NoOpLossScale()"
      ) from None
  elif isinstance(loss_scale, Policy):
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
  allow_half_state = check_bool(allow_half_state, "allow_half_state")
  track_nonfinite = check_bool(track_nonfinite, "track_nonfinite")
  check_updates = check_bool(check_updates, "check_updates", optional=True)
  if check_updates is None:
    check_updates = allow_half_state
  initial_scale = loss_scale
  scale_kind = _scale_kind(loss_scale)
  scale_settings = _scale_settings(loss_scale)
  check_unscaled = _may_amplify(loss_scale)
  config = GuardConfig(axis_name=check_axis_name(axis_name),
                       skip_with=check_skip_with(skip_with),
                       check_updates=check_updates,
                       may_amplify=check_unscaled)

  def tracked(grads: Any) -> Any:
    if not track_nonfinite:
      return None
    counts = nonfinite_counts(grads)
    # Never None when tracking: that is how a state says it was not made so.
    return () if counts is None else counts

  def init(params: Any) -> LossScaledState:
    inner_state = inner.init(params)
    half = half_precision_leaves(
        contract.without_half_by_design(inner, inner_state))
    if half and not allow_half_state:
      raise TypeError(
          "The optimizer state would hold half-precision leaves: "
          + listing(half)
          + ". Moments in float16/bfloat16/FP8 silently lose small updates."
          " Keep float32 master weights with"
          " jmp_lite.master_weights(loss_scaled(...)), or pass"
          " allow_half_state=True to loss_scaled if this is deliberate."
      )
    return LossScaledState(
        inner_state=inner_state,
        # A copy: a donated step must not find one buffer in two states.
        loss_scale=copy_arrays(initial_scale),
        total_skips=jnp.zeros((), jnp.int32),
        consecutive_skips=jnp.zeros((), jnp.int32),
        last_finite=jnp.ones((), jnp.bool_),
        name=name,
        nonfinite=tracked(params),
        config=config,
        scale_settings=scale_settings,
        allow_half_state=allow_half_state,
    )

  def check(state: Any) -> None:
    check_own_state(state, LossScaledState, "loss_scaled")
    # Tracking is read from what the state holds (counts or none), so that
    # pickles of every version and orbax restores are judged alike.
    more: dict[str, tuple[Any, Any]] = {
        "track_nonfinite": (state.nonfinite is not None, track_nonfinite)}
    if state.scale_settings is not None:
      more["loss scale's settings"] = (state.scale_settings, scale_settings)
    check_config(state, config, "loss_scaled", name=(state.name, name),
                  loss_scale=(_scale_kind(state.loss_scale), scale_kind),
                  **more)
    if state.allow_half_state and not allow_half_state:
      # One way only: a state made without it is one this optimizer could
      # have made too.
      raise ValueError(
          "loss_scaled(...).update got a state made with"
          " allow_half_state=True (it may hold half-precision moments); this"
          " optimizer has allow_half_state=False and would refuse them at"
          " init. Step it with the optimizer whose init made it, or pass"
          " allow_half_state=True")

  def governs(state: LossScaledState) -> Any:
    # What the decision updates: a decision varying per device where these
    # do not is a forgotten axis_name (jmp_lite._skipping.reduce_finite).
    return (state.loss_scale, state.total_skips, state.consecutive_skips)

  def run(grads: Any, state: LossScaledState, params: Any,
          extra: dict[str, Any], decision: Decision | None
          ) -> tuple[Any, LossScaledState]:
    check(state)
    scale = state.loss_scale
    if not isinstance(scale, NoOpLossScale):
      _refuse_integer_grads(grads, params)
      if not allow_half_state:
        _refuse_narrow_unscale(grads)
    if decision is not None:
      # Decided by update_and_apply from these very gradients.
      new_updates, new_inner, apply = decided_update(
          inner, grads, state.inner_state, params, decision, extra,
          prepare=scale.unscale)
      finite = apply
      counted = grads
    elif config.formulation()[0] == "cond":
      # Checking the incoming (scaled) gradients, and unscaling inside the
      # branch, lets XLA fuse the unscale into the optimizer's kernels.
      # Unscaling by 1/scale <= 1 cannot overflow (may_amplify is false).
      finite = reduce_finite(all_finite(grads), axis_name,
                             governs=governs(state))
      new_updates, new_inner, apply = guarded_update(
          inner, grads, state.inner_state, params, finite, extra,
          prepare=scale.unscale, branch=True)
      counted = grads
    else:
      # The scaled gradients are checked for the same reason; a scale that
      # may drop below 1 needs the unscaled ones checked too.
      finite = all_finite(grads)
      grads = scale.unscale(grads)
      if check_unscaled:
        finite = finite & all_finite(grads)
      finite = reduce_finite(finite, axis_name, governs=governs(state))
      new_updates, new_inner, apply = guarded_update(
          inner, grads, state.inner_state, params, finite, extra,
          check_updates=check_updates, axis_name=axis_name)
      counted = grads
    counts = count_skips(apply, state.total_skips, state.consecutive_skips)
    return new_updates, LossScaledState(
        inner_state=new_inner,
        # The scale answers to the gradients only: an update that overflows
        # inside the optimizer is not the loss scale's doing.
        loss_scale=_conform(scale.adjust(finite), initial_scale),
        total_skips=counts.total_skips,
        consecutive_skips=counts.consecutive_skips,
        last_finite=apply,
        name=name,
        nonfinite=_tracked_after(decision, counted),
        config=config,
        scale_settings=scale_settings,
        allow_half_state=allow_half_state,
    )

  def _tracked_after(decision: Decision | None, grads: Any) -> Any:
    if track_nonfinite and decision is not None and decision.apply:
      # Finite by decision: the counts are zeros, no need to read them.
      zeros = jax.tree.map(
          lambda x: jnp.zeros((), jnp.int32)
          if _dtypes.is_inexact_array(x) else None, grads)
      return () if zeros is None else zeros
    return tracked(grads)

  return guard(init, run, config, check, governs=governs)


def _refuse_integer_grads(grads: Any, params: Any) -> None:
  """Raises for integer or bool gradients of floating params: unscaling
  passes integer leaves, so they reached the optimizer ``loss_scale`` times
  too large. Without params every integer gradient is refused."""
  bad = integer_gradients(grads, params)
  if bad:
    raise TypeError(
        "loss_scaled got integer or bool gradients (" + listing(bad)
        + "), which unscaling passes unchanged: the update would be"
        " loss_scale times too large. Gradients of the scaled loss are"
        " floating: cast them to the params' dtypes"
        + ("" if params is not None else
           " (or pass params to update, so that an integer param's gradient"
           " can be told apart)"))


def _refuse_narrow_unscale(grads: Any) -> None:
  """Raises for float16/FP8 gradients: unscaled in their own dtype, small
  true gradients underflow (bfloat16 has float32's range: exact)."""
  narrow = [
      f"{jax.tree_util.keystr(path)} ({np.dtype(g.dtype).name})"
      for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]
      if _dtypes.is_floating_array(g) and np.dtype(g.dtype).itemsize <= 2
      and np.dtype(g.dtype) != np.dtype(jnp.bfloat16)]
  if narrow:
    raise TypeError(
        "loss_scaled would unscale float16/FP8 gradients in their own dtype ("
        + listing(narrow)
        + "): true gradients below 6e-8 vanish and those below 6e-5 keep"
        " few bits. Keep float32 master weights,"
        " jmp_lite.master_weights(jmp_lite.loss_scaled(...)), which hands"
        " loss_scaled float32 gradients; or pass allow_half_state=True if"
        " pure half precision is deliberate")


def _may_amplify(loss_scale: LossScale) -> bool:
  """Whether unscaling can ever multiply by more than 1 (scale below 1)."""
  if isinstance(loss_scale, NoOpLossScale):
    return False
  lowest = (loss_scale.min_loss_scale
            if isinstance(loss_scale, DynamicLossScale)
            else loss_scale.loss_scale)
  if _jaxpr.is_tracer(lowest):
    return True  # Unknown while tracing: take the safe path.
  return bool(float(lowest) < 1.0)


# The class names jmp_lite.transforms as its module (see __init__), where
# doctest would not find its methods' examples; they run with this module.
__test__ = {"LossScaledState": LossScaledState}
