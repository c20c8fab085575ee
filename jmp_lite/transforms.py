"""optax transformations: skip non-finite updates and keep a loss scale.

:func:`skip_nonfinite` and :func:`loss_scaled` ("guards") check the incoming
gradients once, run the inner optimizer, and on a non-finite step hand on
``-0.0`` updates and the inner state bit for bit unchanged. How the skip is
compiled is the guard's ``skip_with`` option:

* ``"cond"``: one ``lax.cond`` around "unscale, inner update"; nothing of the
  inner optimizer runs on a skipped step, and its state never passes through
  a select. On XLA:CPU this is what lets a donated train step update the
  optimizer's moments in place (a select there forces copies of every
  moment). :func:`jmp_lite.update_and_apply` goes further and puts the
  parameter update inside the same branch.
* ``"select"``: the inner optimizer always runs and ``lax.select`` keeps the
  previous state when the step is skipped: branch-free, no predicate for the
  host to read. Used whenever the decision is not known before the inner
  update runs (``check_updates``, a loss scale that may drop below 1).
* ``"auto"`` (default): ``"cond"`` on the CPU, where it is measured cheaper
  (``benchmarks/loss_scaling_overhead.py``); ``"select"`` on GPU and TPU.
  Measured on an H100 (``benchmarks/gpu_step.py``, Adam on an MLP), the two
  are the same program there: XLA:GPU turns the ``lax.cond`` into selects
  fused into the optimizer's kernels (no conditional, no predicate read by
  the host), with equal bytes and time. Other optimizers are unmeasured, and
  so is TPU: run ``benchmarks/gpu_step.py`` there and pass ``skip_with=``
  the faster one.

Skipped steps are bit-identical either way; applied steps agree up to float
rounding (XLA fuses the same arithmetic differently in the two programs).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite import _jaxpr, _optax, contract, struct
from jmp_lite import dtypes as _dtypes
from jmp_lite._checks import check_bool, check_count, check_transformation
from jmp_lite._nonfinite import nonfinite_counts
from jmp_lite.finite import all_finite, copy_arrays, select_tree, skip_updates
from jmp_lite.loss_scale import (
  DynamicLossScale,
  LossScale,
  NoOpLossScale,
  StaticLossScale,
)
from jmp_lite.master import half_precision_leaves
from jmp_lite.policy import Policy

__all__ = ["GuardConfig", "LossScaledState", "NonFiniteHaltError",
           "SkipNonfiniteState", "current_loss_scale", "default_loss_scale",
           "loss_scaled", "loss_scaled_state", "raise_if_halted",
           "skip_nonfinite"]

_SKIP_WITH = ("auto", "cond", "select")


class NonFiniteHaltError(RuntimeError):
  """Raised by :func:`raise_if_halted` once a skip budget has run out."""


@dataclasses.dataclass(frozen=True)
class GuardConfig:
  """A guard's static configuration, kept in its state's tree structure.

  :func:`jmp_lite.update_and_apply` reads it to decide a step itself.

  Attributes:
    axis_name: the mapped axis every device agrees over, or ``None``.
    skip_with: ``"auto"``, ``"cond"`` or ``"select"``, as requested.
    check_updates: whether non-finite *updates* skip the step too.
    may_amplify: whether the loss scale may drop below 1, so that unscaling
      can overflow gradients that were finite.
  """

  axis_name: Any = None
  skip_with: str = "auto"
  check_updates: bool = False
  may_amplify: bool = False

  def formulation(self) -> tuple[str, str]:
    """Returns ``("cond" | "select", why)`` for the current backend.

    Returns:
      The formulation a step with this guard compiles to, and the reason.

    Example:
      >>> from jmp_lite.transforms import GuardConfig
      >>> GuardConfig(check_updates=True).formulation()[0]
      'select'
    """
    if self.check_updates:
      return "select", ("check_updates=True: the decision needs the updates,"
                        " which exist only after the inner update ran")
    if self.may_amplify:
      return "select", ("the loss scale may drop below 1: unscaling can"
                        " overflow, so the unscaled gradients are checked too")
    if self.skip_with == "select":
      return "select", "skip_with='select'"
    if self.skip_with == "cond":
      return "cond", "skip_with='cond'"
    backend = jax.default_backend()
    if backend == "cpu":
      return "cond", "skip_with='auto' on the CPU (measured cheaper there)"
    if backend == "gpu":
      return "select", ("skip_with='auto' on gpu (fused into the optimizer's"
                        " kernels; XLA:GPU compiled a cond to the same"
                        " selects for Adam, measured on an H100)")
    return "select", (f"skip_with='auto' on {backend} (fuses into the"
                      " optimizer's kernels; unmeasured there: see"
                      " benchmarks/gpu_step.py)")


def _check_skip_with(skip_with: Any) -> str:
  if skip_with not in _SKIP_WITH:
    raise ValueError(
        f"skip_with must be one of {_SKIP_WITH}, got {skip_with!r}")
  return skip_with


def _check_axis_name(axis_name: Any) -> Any:
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


@struct.dataclass
class SkipNonfiniteState(contract.Gate):
  """State of :func:`skip_nonfinite`.

  Attributes:
    inner_state: the wrapped optimizer's state, untouched by skipped steps.
    total_skips: skipped steps since ``init`` (int32).
    consecutive_skips: skipped steps since the last applied one (int32).
    last_finite: whether the last step's gradients were finite (bool).
    halted: whether ``max_consecutive_skips`` ran out; sticky (bool).
    config: the static :class:`GuardConfig`.
    max_consecutive_skips: the halting limit, or ``None`` (static).
  """

  inner_state: Any
  total_skips: Any
  consecutive_skips: Any
  last_finite: Any
  halted: Any
  config: GuardConfig = struct.field(static=True, default=GuardConfig())
  max_consecutive_skips: int | None = struct.field(static=True, default=None)

  def applied(self) -> jax.Array:
    """Whether the last step was applied (see :class:`jmp_lite.contract.Gate`).

    Returns:
      A bool scalar: the gradients were finite and training had not halted.

    Example:
      >>> import jax.numpy as jnp, optax, jmp_lite
      >>> opt = jmp_lite.skip_nonfinite(optax.sgd(0.1))
      >>> bool(opt.init(jnp.ones(2)).applied())
      True
    """
    return jnp.asarray(self.last_finite & ~self.halted, jnp.bool_)

  def inner(self) -> Any:
    """The wrapped optimizer's state (see :class:`jmp_lite.contract.Gate`).

    Returns:
      ``inner_state``.

    Example:
      >>> import jax.numpy as jnp, optax, jmp_lite
      >>> opt = jmp_lite.skip_nonfinite(optax.sgd(0.1))
      >>> opt.init(jnp.ones(2)).inner()
      (EmptyState(), EmptyState())
    """
    return self.inner_state


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
  """

  inner_state: Any
  loss_scale: Any
  total_skips: Any
  consecutive_skips: Any
  last_finite: Any
  name: str | None = struct.field(static=True, default=None)
  nonfinite: Any = None
  config: GuardConfig = struct.field(static=True, default=GuardConfig())

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


def reduce_finite(finite: jax.Array, axis_name: Any) -> jax.Array:
  """Makes ``finite`` agree on every device of ``axis_name``.

  One device's overflow must make every device skip and back off alike, or
  replicated params and scales drift apart.

  Args:
    finite: a bool scalar.
    axis_name: a mapped axis name, or ``None`` (then ``finite`` is returned).

  Returns:
    The bool scalar, true only where it is true on every device.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite.transforms import reduce_finite
    >>> bool(reduce_finite(jnp.array(True), None))
    True
  """
  if axis_name is None:
    return finite
  return jax.lax.pmin(finite.astype(jnp.int32), axis_name) > 0


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
  if jnp.issubdtype(dtype, jnp.inexact):
    return jnp.full(shape.shape, -0.0, dtype)
  return jnp.zeros(shape.shape, dtype)


def _skipped_updates(inner: optax.GradientTransformation, grads: Any,
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
    >>> from jmp_lite.transforms import _skipped_updates
    >>> opt = optax.sgd(0.1)
    >>> p = jnp.ones(2)
    >>> _skipped_updates(opt, p, opt.init(p), p, {})
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
        + ", ".join(changed[:4]) + (" ..." if len(changed) > 4 else "")
        + "), which a skipped step, keeping the old state, cannot match."
        " Usually half-precision params with float32 gradients: give the"
        " gradients the params' dtype, keep float32 master weights"
        " (jmp_lite.master_weights(...) around the guard), or fix the"
        " moments' dtype (optax.adam(..., mu_dtype=...))")


def _guarded_update(inner: optax.GradientTransformation, grads: Any,
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
      return (_skipped_updates(inner, grads, inner_state, params, extra),
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


class _Decision(NamedTuple):
  """A skip decision taken outside the guard (by update_and_apply)."""

  finite: jax.Array   # the gradients were finite (agreed over axis_name)
  apply: bool         # this branch applies the step (static)


def _decided_update(inner: optax.GradientTransformation, grads: Any,
                    inner_state: Any, params: Any, decision: _Decision,
                    extra: dict[str, Any], prepare: Any = None
                    ) -> tuple[Any, Any, jax.Array]:
  """The guard's part of a step decided outside it (no check, no select)."""
  if decision.apply:
    g = grads if prepare is None else prepare(grads)
    new_updates, new_inner = inner.update(g, inner_state, params, **extra)
    _check_stable_state(inner_state, new_inner)
    return new_updates, new_inner, jnp.ones((), jnp.bool_)
  return (_skipped_updates(inner, grads, inner_state, params, extra),
          inner_state, jnp.zeros((), jnp.bool_))


def _check_config(state: Any, config: GuardConfig, who: str,
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


def skip_nonfinite(
    inner: optax.GradientTransformation,
    *,
    max_consecutive_skips: int | None = None,
    axis_name: Any = None,
    skip_with: str = "auto",
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` so that steps with non-finite gradients are skipped.

  When any floating leaf of the incoming updates (the gradients) is +-inf or
  NaN, ``update`` returns zero updates (``-0.0``, so that
  ``optax.apply_updates`` leaves every param bit for bit as it was, ``-0.0``
  included) and the inner state **bit for bit unchanged**: Adam's count and
  moments, schedules, EMAs, everything. The decision needs no host sync;
  ``skip_with`` picks how it is compiled (see the module docstring).

  Only the gradients are checked. Finite gradients can still make ``inner``
  compute non-finite values, which then enter its state: in float32, Adam's
  ``nu`` takes ``g**2``, which overflows to inf for ``|g|`` above about
  1.8e19, and that element's update, ``mu / sqrt(nu)``, is 0 from then on.
  :func:`loss_scaled`'s ``check_updates=True`` (skip non-finite *updates*)
  does not catch that either: the updates stay finite, and no guard checks
  the new inner state. A clip inside the guard, before the optimizer
  (``optax.clip``, or ``optax.clip_by_global_norm``, which hands on zeros
  when the norm itself overflows), bounds what reaches the moments.

  Only what passes through the optimizer is protected: what the train step
  updates outside it (Flax ``batch_stats``, an average of the params kept by
  hand) moves on a skipped step too, unless the step keeps the old value
  where ``state.last_finite & ~state.halted`` is false.

  ``max_consecutive_skips=N`` (opt-in) *halts* training on the N-th
  consecutive skip: ``state.halted`` becomes true and stays true, and from then
  on every step is skipped, finite or not, so that no non-finite gradient
  ever reaches the inner optimizer. Check it from the host where you already
  sync (logging) with :func:`raise_if_halted`. Without it, skipping goes on
  for as long as the gradients are non-finite.

  Args:
    inner: the optimizer to guard.
    max_consecutive_skips: ``None`` (default, never halt) or an int in
      ``[1, 2**31 - 1]`` (numpy integers too).
    axis_name: the mapped axis name under ``shard_map``/``pmap``; all devices
      then skip together when any device's shard is non-finite. Not needed
      under ``jax.jit`` with sharded arrays, where the check is global.
    skip_with: ``"auto"`` (default), ``"cond"`` or ``"select"``: how a skip
      is compiled (see the module docstring).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`SkipNonfiniteState`.

  Raises:
    TypeError: if ``inner`` is not a gradient transformation,
      ``max_consecutive_skips`` is not an int or ``axis_name`` not hashable.
    ValueError: if ``max_consecutive_skips`` is out of range or
      ``skip_with`` is unknown.

  Example:
    >>> import jax.numpy as jnp, optax, jmp_lite
    >>> opt = jmp_lite.skip_nonfinite(optax.adam(1e-3))
    >>> params = {"w": jnp.ones(2)}
    >>> state = opt.init(params)
    >>> grads = {"w": jnp.array([1.0, jnp.nan])}
    >>> updates, state = opt.update(grads, state, params)
    >>> updates["w"], int(state.total_skips)
    (Array([-0., -0.], dtype=float32), 1)
  """
  check_transformation(inner, "skip_nonfinite")
  if max_consecutive_skips is not None:
    max_consecutive_skips = check_count(max_consecutive_skips,
                                        "max_consecutive_skips")
  config = GuardConfig(axis_name=_check_axis_name(axis_name),
                       skip_with=_check_skip_with(skip_with))

  def init(params: Any) -> SkipNonfiniteState:
    return SkipNonfiniteState(
        inner_state=inner.init(params),
        total_skips=jnp.zeros((), jnp.int32),
        consecutive_skips=jnp.zeros((), jnp.int32),
        last_finite=jnp.ones((), jnp.bool_),
        halted=jnp.zeros((), jnp.bool_),
        config=config,
        max_consecutive_skips=max_consecutive_skips,
    )

  def check(state: Any) -> None:
    _check_own_state(state, SkipNonfiniteState, "skip_nonfinite")
    _check_config(state, config, "skip_nonfinite", max_consecutive_skips=(
        state.max_consecutive_skips, max_consecutive_skips))

  def blocked(state: Any) -> jax.Array:
    return jnp.asarray(state.halted, jnp.bool_)

  def run(updates: Any, state: SkipNonfiniteState, params: Any,
          extra: dict[str, Any], decision: _Decision | None
          ) -> tuple[Any, SkipNonfiniteState]:
    check(state)
    if decision is not None:
      finite = decision.finite
      new_updates, new_inner, apply = _decided_update(
          inner, updates, state.inner_state, params, decision, extra)
    else:
      finite = reduce_finite(all_finite(updates), axis_name)
      apply = finite & ~jnp.asarray(state.halted, jnp.bool_)
      new_updates, new_inner, _ = _guarded_update(
          inner, updates, state.inner_state, params, apply, extra,
          branch=config.formulation()[0] == "cond")
    halted = jnp.asarray(state.halted, jnp.bool_)
    counts = _count(apply, state.total_skips, state.consecutive_skips)
    if max_consecutive_skips is not None:
      halted = halted | (counts.consecutive_skips >= max_consecutive_skips)
    return new_updates, SkipNonfiniteState(
        inner_state=new_inner,
        total_skips=counts.total_skips,
        consecutive_skips=counts.consecutive_skips,
        last_finite=jnp.asarray(finite, jnp.bool_),
        halted=halted,
        config=config,
        max_consecutive_skips=max_consecutive_skips,
    )

  return _guard(init, run, config, check, blocked=blocked)


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
    from jmp_lite.policy import (
      get_policy,  # Local: keeps the import graph flat.
    )
    policy = get_policy(policy)
  if not isinstance(policy, Policy):
    raise TypeError(
        f"Expected a jmp_lite.Policy or policy string, got {policy!r}"
    )
  if policy.compute_dtype == np.dtype(jnp.float16):
    return DynamicLossScale(2.0**15)
  return NoOpLossScale()


def _guard(init: Any, run: Any, config: GuardConfig, check: Any,
           blocked: Any = None) -> optax.GradientTransformationExtraArgs:
  """A guard transformation from its ``run`` (see :class:`_Decision`),
  declared to :func:`jmp_lite.update_and_apply` (:mod:`jmp_lite.contract`).
  """
  def update(updates: Any, state: Any, params: Any = None,
             **extra: Any) -> tuple[Any, Any]:
    return run(updates, state, params, extra, None)

  def decided(finite: jax.Array, apply: bool) -> contract.UpdateFn:
    def update_decided(updates: Any, state: Any, params: Any = None,
                       **extra: Any) -> tuple[Any, Any]:
      return run(updates, state, params, extra, _Decision(finite, apply))
    return update_decided

  return _optax.transformation(init, contract.declare(
      update, contract.Guarding(config=config, decided=decided,
                                blocked=blocked, check=check)))


def _scale_kind(loss_scale: Any) -> Any:
  """A loss scale's class and static settings (``period``, ``factor``,
  ``hysteresis``...): its own pytree node, children as leaves."""
  return jax.tree.structure(loss_scale, is_leaf=lambda n: n is not loss_scale)


def _check_own_state(state: Any, cls: type, who: str) -> None:
  # The usual way here: loss_scaled(...) added to a script that kept the
  # opt_state (or TrainState) the bare optimizer made.
  if not isinstance(state, cls):
    raise TypeError(
        f"{who}(...).update got a {type(state).__name__} as its state, not"
        f" the {cls.__name__} its init makes: pass the state that"
        f" {who}(...).init(params) returned (after wrapping an optimizer,"
        " create its opt_state, or TrainState, again; a checkpoint restored"
        " as plain dicts needs the state from init as its restore target)")


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
      computes in float32).
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
      hashable, or a flag is not a bool; from ``init``, if the inner state
      holds half-precision leaves and ``allow_half_state`` is false.
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
  check_unscaled = _may_amplify(loss_scale)
  config = GuardConfig(axis_name=_check_axis_name(axis_name),
                       skip_with=_check_skip_with(skip_with),
                       check_updates=check_updates,
                       may_amplify=check_unscaled)

  def tracked(grads: Any) -> Any:
    if not track_nonfinite:
      return None
    return nonfinite_counts(grads)

  def init(params: Any) -> LossScaledState:
    inner_state = inner.init(params)
    half = half_precision_leaves(
        contract.without_half_by_design(inner, inner_state))
    if half and not allow_half_state:
      raise TypeError(
          "The optimizer state would hold half-precision leaves: "
          + ", ".join(half[:4]) + (" ..." if len(half) > 4 else "")
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
    )

  def check(state: Any) -> None:
    _check_own_state(state, LossScaledState, "loss_scaled")
    _check_config(state, config, "loss_scaled", name=(state.name, name),
                  loss_scale=(_scale_kind(state.loss_scale), scale_kind))

  def run(grads: Any, state: LossScaledState, params: Any,
          extra: dict[str, Any], decision: _Decision | None
          ) -> tuple[Any, LossScaledState]:
    check(state)
    scale = state.loss_scale
    if decision is not None:
      # Decided by update_and_apply from these very gradients.
      new_updates, new_inner, apply = _decided_update(
          inner, grads, state.inner_state, params, decision, extra,
          prepare=scale.unscale)
      finite = apply
      counted = grads
    elif config.formulation()[0] == "cond":
      # Checking the incoming (scaled) gradients, and unscaling inside the
      # branch, lets XLA fuse the unscale into the optimizer's kernels.
      # Unscaling by 1/scale <= 1 cannot overflow (may_amplify is false).
      finite = reduce_finite(all_finite(grads), axis_name)
      new_updates, new_inner, apply = _guarded_update(
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
      finite = reduce_finite(finite, axis_name)
      new_updates, new_inner, apply = _guarded_update(
          inner, grads, state.inner_state, params, finite, extra,
          check_updates=check_updates, axis_name=axis_name)
      counted = grads
    counts = _count(apply, state.total_skips, state.consecutive_skips)
    return new_updates, LossScaledState(
        inner_state=new_inner,
        # The scale answers to the gradients only: an update that overflows
        # inside the optimizer is not the loss scale's doing.
        loss_scale=scale.adjust(finite),
        total_skips=counts.total_skips,
        consecutive_skips=counts.consecutive_skips,
        last_finite=apply,
        name=name,
        nonfinite=_tracked_after(decision, counted),
        config=config,
    )

  def _tracked_after(decision: _Decision | None, grads: Any) -> Any:
    if track_nonfinite and decision is not None and decision.apply:
      # Finite by decision: the counts are zeros, no need to read them.
      return jax.tree.map(
          lambda x: jnp.zeros((), jnp.int32)
          if _dtypes.is_inexact_array(x) else None, grads)
    return tracked(grads)

  return _guard(init, run, config, check)


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


def loss_scaled_state(opt_state: Any,
                      name: str | None = None) -> LossScaledState:
  """Returns the :class:`LossScaledState` inside ``opt_state``.

  Finds it anywhere: inside ``optax.chain``, ``optax.MultiSteps``,
  ``optax.inject_hyperparams``, ``optax.multi_transform``, ``master_weights``
  or any other pytree of states. Its counters (``total_skips``,
  ``last_finite``, ...) are what a training loop logs. From a
  ``flax.nnx.Optimizer``'s ``opt_state`` (whose arrays are wrapped in nnx
  variables) the state comes back with plain arrays.

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
    >>> opt = jmp_lite.master_weights(
    ...     jmp_lite.loss_scaled(optax.sgd(0.1), "f32"))
    >>> int(jmp_lite.loss_scaled_state(opt.init(jnp.ones(2))).total_skips)
    0
  """
  every = struct.find_nodes(opt_state, LossScaledState)
  found = every if name is None else [s for s in every if s.name == name]
  if len(found) == 1:
    return unwrap_nnx(found[0])
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


def unwrap_nnx(tree: Any) -> Any:
  """Replaces Flax nnx variables in ``tree`` by the arrays they hold.

  ``flax.nnx.Optimizer`` keeps its ``opt_state`` with every array wrapped in
  an ``OptArray`` variable. Detected without importing Flax: a tree can only
  hold nnx variables once ``flax.nnx`` has been imported.

  Args:
    tree: any pytree.

  Returns:
    ``tree`` with plain arrays (``tree`` itself when nnx is not loaded).

  Example:
    >>> from jmp_lite.transforms import unwrap_nnx
    >>> unwrap_nnx({"a": 1.0})
    {'a': 1.0}
  """
  nnx = sys.modules.get("flax.nnx")
  if nnx is None:
    return tree
  variable = nnx.Variable

  def value(x: Any) -> Any:
    if isinstance(x, variable):
      return unwrap_nnx(x.get_value())
    return x

  return jax.tree.map(value, tree, is_leaf=lambda x: isinstance(x, variable))


def current_loss_scale(opt_state: Any, name: str | None = None) -> LossScale:
  """Returns the loss-scale state to scale the next loss with.

  Finds the :class:`LossScaledState` anywhere in ``opt_state``: inside
  ``optax.chain``, ``optax.MultiSteps``, ``optax.inject_hyperparams``,
  ``optax.multi_transform`` or any other pytree of states, and in a
  ``flax.nnx.Optimizer``'s ``opt_state`` (returning plain arrays).

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
    NonFiniteHaltError: if halted; it names the limit that halted training
      and how many steps have been skipped since.

  Example:
    >>> import jax.numpy as jnp, optax, jmp_lite
    >>> opt = jmp_lite.skip_nonfinite(optax.sgd(0.1), max_consecutive_skips=3)
    >>> jmp_lite.raise_if_halted(opt.init(jnp.ones(2)))  # nothing to report
  """
  for node in struct.find_nodes(opt_state, SkipNonfiniteState):
    if bool(node.halted):
      raise NonFiniteHaltError(_halt_message(node))


def _halt_message(node: SkipNonfiniteState) -> str:
  """What :func:`raise_if_halted` says: the facts that are in the state."""
  limit = node.max_consecutive_skips
  consecutive = int(node.consecutive_skips)
  total = int(node.total_skips)
  applied = ("; the params and optimizer state are those of the last applied"
             " step")
  if limit is None or consecutive < limit:
    # A halted state built by hand, or restored under another limit: when
    # the halt came is unknown.
    return (f"Training halted; {consecutive} consecutive steps skipped"
            f" ({total} in all)" + applied)
  # A halt comes on the limit-th consecutive non-finite step, and is sticky:
  # every later step is skipped too, and consecutive_skips counts on.
  after = consecutive - limit
  return (
      f"Training halted by {limit} consecutive steps with non-finite"
      f" gradients (max_consecutive_skips={limit}); every step since has"
      f" been skipped, finite or not ({after} so far; {total} skipped in"
      " all)" + applied)
