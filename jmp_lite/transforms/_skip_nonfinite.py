"""``skip_nonfinite``: skip the steps whose gradients are not finite."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jmp_lite import contract, struct
from jmp_lite._checks import (
  check_axis_name,
  check_count,
  check_own_state,
  check_transformation,
)
from jmp_lite._skipping import reduce_finite
from jmp_lite.finite import all_finite
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
  config = GuardConfig(axis_name=check_axis_name(axis_name),
                       skip_with=check_skip_with(skip_with))

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
    check_own_state(state, SkipNonfiniteState, "skip_nonfinite")
    check_config(state, config, "skip_nonfinite", max_consecutive_skips=(
        state.max_consecutive_skips, max_consecutive_skips))

  def blocked(state: Any) -> jax.Array:
    return jnp.asarray(state.halted, jnp.bool_)

  def governs(state: SkipNonfiniteState) -> Any:
    # What the decision updates: a decision varying per device where these
    # do not is a forgotten axis_name (jmp_lite._skipping.reduce_finite).
    return (state.total_skips, state.consecutive_skips, state.halted)

  def run(updates: Any, state: SkipNonfiniteState, params: Any,
          extra: dict[str, Any], decision: Decision | None
          ) -> tuple[Any, SkipNonfiniteState]:
    check(state)
    if decision is not None:
      finite = decision.finite
      new_updates, new_inner, apply = decided_update(
          inner, updates, state.inner_state, params, decision, extra)
    else:
      finite = reduce_finite(all_finite(updates), axis_name,
                             governs=governs(state))
      apply = finite & ~jnp.asarray(state.halted, jnp.bool_)
      new_updates, new_inner, _ = guarded_update(
          inner, updates, state.inner_state, params, apply, extra,
          branch=config.formulation()[0] == "cond")
    halted = jnp.asarray(state.halted, jnp.bool_)
    counts = count_skips(apply, state.total_skips, state.consecutive_skips)
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

  return guard(init, run, config, check, blocked=blocked, governs=governs)


# The class names jmp_lite.transforms as its module (see __init__), where
# doctest would not find its methods' examples; they run with this module.
__test__ = {"SkipNonfiniteState": SkipNonfiniteState}
