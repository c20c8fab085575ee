"""Finding a guard's state in an optimizer state, and halting on it."""

from __future__ import annotations

from typing import Any

from jmp_lite import struct
from jmp_lite._trees import unwrap_nnx
from jmp_lite.loss_scale import LossScale
from jmp_lite.transforms._loss_scaled import LossScaledState
from jmp_lite.transforms._skip_nonfinite import SkipNonfiniteState


class NonFiniteHaltError(RuntimeError):
  """Raised by :func:`raise_if_halted` once a skip budget has run out."""


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
    ValueError: if ``opt_state`` holds no :func:`skip_nonfinite` state
      (nothing in it can halt).

  Example:
    >>> import jax.numpy as jnp, optax, jmp_lite
    >>> opt = jmp_lite.skip_nonfinite(optax.sgd(0.1), max_consecutive_skips=3)
    >>> jmp_lite.raise_if_halted(opt.init(jnp.ones(2)))  # nothing to report
  """
  nodes = struct.find_nodes(opt_state, SkipNonfiniteState)
  if not nodes:
    # Nothing here can halt: checking it would always pass, silently.
    raise ValueError(
        "raise_if_halted found no skip_nonfinite(...) state in opt_state (a"
        f" {type(opt_state).__name__}): only skip_nonfinite halts (with"
        " max_consecutive_skips=N); pass the state its init made, or the"
        " optimizer state that holds it")
  for node in nodes:
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
