"""The step contract: what a transformation declares to the train step.

:func:`jmp_lite.update_and_apply` can compile a loss-scaled step as one
``lax.cond`` around "unscale, inner update, apply", deciding the skip from
the gradients it was handed. That is only right when every transformation
between the optimizer it was given and the guard
(:func:`~jmp_lite.loss_scaled`, :func:`~jmp_lite.skip_nonfinite`) hands the
guard those very gradients, finite exactly when they were. Nothing about
that can be read off an optimizer *state*: a user's wrapper whose state is
its inner state looks like no wrapper at all. So the decision is taken from
what the transformation *objects* declare here, and from nothing else:

* :class:`Guarding`: the transformation decides skips itself and can run
  with the decision taken outside it (the guards).
* :class:`Forwarding`: the transformation hands the gradients to one inner
  transformation, finite exactly when they were while they fit
  ``largest_gradient`` (:func:`~jmp_lite.master_weights`,
  :func:`~jmp_lite.kahan_summation`, :func:`~jmp_lite.stochastic_rounding`,
  :func:`~jmp_lite.state_dtypes`), and can run around another inner update.
* Nothing: every other transformation (``optax.chain``,
  ``inject_hyperparams``, any wrapper a user writes). A step through it runs
  ``optimizer.update`` and applies the updates: each guard inside decides on
  the gradients it really gets.

A declaration travels on the transformation's ``update`` function
(:class:`DeclaredUpdate`), so that it survives optax rebuilding the
transformation's ``NamedTuple`` and is never planted in a state.

States declare four things: :class:`Gate`, whether the step that made
them moved any param; :class:`Accumulates`, that they change on steps that
apply nothing; :class:`RoundsHalfParams`, that their transformation
rounds updates into half params (and so must see them);
:class:`HoldsMasterCopy`, that they hold a master copy of the params (which
no wrapper may store narrow). Wrappers that must not advance on skipped
steps (stochastic rounding's random stream, FP8's amax history) ask the
first.

Which module may use what: every optimizer module (``transforms``,
``master``, ``accumulation``, ``low_precision``) imports this one to
declare; ``step`` and :mod:`jmp_lite.fp8` import it to read declarations.
This module imports only optax, JAX and numpy.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

__all__ = ["Accumulates", "DeclaredUpdate", "Forwarding", "Gate", "Guarding",
           "HoldsMasterCopy", "RoundsHalfParams", "UpdateFn", "contract_of",
           "declare", "step_applied", "without_half_by_design"]

UpdateFn = Callable[..., tuple[Any, Any]]
"""``update(updates, state, params=None, **extra) -> (updates, state)``."""


@dataclasses.dataclass(frozen=True, eq=False)
class Forwarding:
  """Declares a wrapper that hands its gradients to one inner transformation.

  The promise: ``inner`` gets every gradient leaf, finite exactly when it was
  (cast or not), for gradients whose magnitudes fit ``largest_gradient``;
  and a ``-0.0`` update from ``inner`` moves no param. Then a guard inside
  may be decided from the gradients the wrapper was given.

  Attributes:
    inner: the wrapped transformation.
    rebind: ``rebind(inner_update)`` is this wrapper's ``update`` with
      ``inner_update`` run in place of ``inner.update``.
    inner_state: this wrapper's state -> ``inner``'s state.
    largest_gradient: the largest gradient magnitude that stays finite on
      its way to ``inner`` (a float16 master copy: 65504).
    half_by_design: this wrapper's state -> the same state with the leaves
      it keeps in half precision on purpose replaced by ``None`` (and
      ``inner``'s part left to ``inner``'s declaration), or ``None`` when it
      keeps none. :func:`~jmp_lite.loss_scaled` refuses half moments and
      leaves these be.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from jmp_lite import contract
    >>> def double(inner):  # hands on 2 * g: finite exactly when g was
    ...   def rebind(inner_update):
    ...     def update(g, s, p=None, **extra):
    ...       return inner_update(2 * g, s, p, **extra)
    ...     return update
    ...   return optax.GradientTransformationExtraArgs(
    ...       inner.init, contract.declare(rebind(inner.update),
    ...           contract.Forwarding(inner, rebind, lambda s: s,
    ...                               largest_gradient=3e38)))
    >>> type(contract.contract_of(double(optax.sgd(1.0)))).__name__
    'Forwarding'
  """

  inner: optax.GradientTransformation
  rebind: Callable[[UpdateFn], UpdateFn]
  inner_state: Callable[[Any], Any]
  largest_gradient: float = math.inf
  half_by_design: Callable[[Any], Any] | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class Guarding:
  """Declares a guard: a transformation that skips non-finite steps.

  Attributes:
    config: the guard's static configuration (a
      :class:`jmp_lite.transforms.GuardConfig`: ``axis_name``,
      ``skip_with``, ...); the step reads it from here, never from a state.
    blocked: the guard's state -> a bool scalar that skips the step whatever
      the gradients (a halted :func:`~jmp_lite.skip_nonfinite`), or
      ``None``.
    check: raises if a state was not made by this guard as configured (a
      ``TypeError`` for another kind of state, a ``ValueError`` naming both
      configurations); run before anything of the step.
    governs: the guard's state -> the part of it the decision updates (the
      loss scale, the skip counters): under ``shard_map`` a decision that
      varies per device where these do not is a forgotten ``axis_name``,
      refused with a ``ValueError``.
    decided: ``decided(finite, apply)`` is the guard's ``update`` with the
      decision taken outside it: ``finite`` (a bool scalar, agreed over the
      guard's ``axis_name``) says whether the gradients were finite, and the
      static ``apply`` whether this branch applies the step.

  Example:
    >>> import optax, jmp_lite
    >>> from jmp_lite import contract
    >>> guard = contract.contract_of(jmp_lite.skip_nonfinite(optax.sgd(1.0)))
    >>> guard.config.skip_with
    'auto'
  """

  config: Any
  decided: Callable[[jax.Array, bool], UpdateFn]
  blocked: Callable[[Any], jax.Array] | None = None
  check: Callable[[Any], None] | None = None
  governs: Callable[[Any], Any] | None = None


Contract = Forwarding | Guarding


@dataclasses.dataclass(frozen=True, eq=False)
class DeclaredUpdate:
  """An ``update`` function that carries its transformation's contract.

  Called like the function it wraps. Built by :func:`declare`.

  Attributes:
    fn: the update function.
    contract: what the transformation declares.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from jmp_lite import contract
    >>> sgd = optax.sgd(1.0)
    >>> declared = contract.declare(sgd.update, contract.Guarding(
    ...     config=None, decided=lambda finite, apply: sgd.update))
    >>> declared(jnp.ones(1), sgd.init(jnp.ones(1)))[0]
    Array([-1.], dtype=float32)
  """

  fn: UpdateFn
  contract: Contract

  def __call__(self, updates: Any, state: Any, params: Any = None,
               **extra: Any) -> tuple[Any, Any]:
    return self.fn(updates, state, params, **extra)


def declare(update: UpdateFn, contract: Contract) -> DeclaredUpdate:
  """Attaches ``contract`` to a transformation's ``update`` function.

  Args:
    update: the transformation's update function.
    contract: a :class:`Forwarding` or :class:`Guarding` declaration.

  Returns:
    The update function, declared.

  Raises:
    TypeError: if ``contract`` is neither.

  Example:
    >>> import optax
    >>> from jmp_lite import contract
    >>> sgd = optax.sgd(1.0)
    >>> d = contract.declare(sgd.update, contract.Guarding(
    ...     None, lambda finite, apply: sgd.update))
    >>> isinstance(d, contract.DeclaredUpdate)
    True
  """
  if not isinstance(contract, (Forwarding, Guarding)):
    raise TypeError(
        "contract must be a jmp_lite.contract.Forwarding or Guarding, got"
        f" {type(contract).__name__}: {contract!r}")
  return DeclaredUpdate(update, contract)


def contract_of(transformation: Any) -> Contract | None:
  """What ``transformation`` declares, or ``None`` if it declares nothing.

  Args:
    transformation: an optax gradient transformation.

  Returns:
    Its :class:`Forwarding` or :class:`Guarding` declaration, or ``None``.

  Example:
    >>> import optax, jmp_lite
    >>> from jmp_lite import contract
    >>> contract.contract_of(optax.adam(1e-3)) is None
    True
    >>> opt = jmp_lite.master_weights(optax.adam(1e-3))
    >>> type(contract.contract_of(opt)).__name__
    'Forwarding'
  """
  update = getattr(transformation, "update", None)
  if isinstance(update, DeclaredUpdate):
    return update.contract
  return None


def without_half_by_design(transformation: Any, state: Any) -> Any:
  """``state`` less the leaves its transformations keep half on purpose.

  Follows :class:`Forwarding` declarations inward: Kahan's compensation and
  what :func:`~jmp_lite.state_dtypes` stores are half by design; Adam's
  moments in bfloat16 are not. A transformation that declares nothing keeps
  nothing half on purpose.

  Args:
    transformation: the transformation that made ``state``.
    state: its state.

  Returns:
    The state with those leaves replaced by ``None``.

  Example:
    >>> import jax.numpy as jnp, optax, jmp_lite
    >>> from jmp_lite import contract
    >>> opt = jmp_lite.kahan_summation(optax.sgd(0.1))
    >>> state = opt.init(jnp.ones(2, jnp.bfloat16))
    >>> contract.without_half_by_design(opt, state).compensation is None
    True
  """
  declared = contract_of(transformation)
  if not isinstance(declared, Forwarding) or declared.half_by_design is None:
    return state
  return declared.half_by_design(state)


class Gate(abc.ABC):
  """A state that says whether the step that made it moved any param.

  The states of transformations that hand on ``-0.0`` updates when they
  skip (:class:`~jmp_lite.LossScaledState`,
  :class:`~jmp_lite.transforms.SkipNonfiniteState`,
  :class:`~jmp_lite.accumulation.AccumulateState`) subclass it. Wrappers
  that must advance only on applied steps (stochastic rounding's random
  stream, FP8's amax history) read it through :func:`step_applied`.

  Example:
    >>> import jmp_lite
    >>> from jmp_lite import contract
    >>> issubclass(jmp_lite.LossScaledState, contract.Gate)
    True
  """

  @abc.abstractmethod
  def applied(self) -> jax.Array:
    """Whether the step that produced this state applied its updates.

    Returns:
      A bool scalar.
    """

  @abc.abstractmethod
  def inner(self) -> Any:
    """The state of the transformation this gate wraps.

    Returns:
      The inner state (gates inside it are read too).
    """


class RoundsHalfParams:
  """A state whose transformation rounds updates into half-precision params.

  :func:`~jmp_lite.kahan_summation` and :func:`~jmp_lite.stochastic_rounding`
  must see the params as they are stored: inside a wrapper that hands its
  inner optimizer float32 params (:func:`~jmp_lite.master_weights`,
  :func:`~jmp_lite.quantized_states`, :func:`~jmp_lite.state_dtypes`) they
  would find nothing to round and silently do nothing, so those wrappers
  refuse an inner state holding one of these.

  Example:
    >>> import jmp_lite
    >>> from jmp_lite import contract
    >>> issubclass(jmp_lite.low_precision.KahanState, contract.RoundsHalfParams)
    True
  """


class Accumulates:
  """A state that changes on steps it does not apply: a gradient
  accumulator (:func:`~jmp_lite.accumulate_gradients`' state).

  A wrapper that keeps its stored state as it was on a step that applied
  nothing (:func:`~jmp_lite.quantized_states` keeps its codes bit for bit)
  would drop every micro-batch but a window's last; one that rounds its
  state on every step (:func:`~jmp_lite.state_dtypes`) would round the
  float32 accumulator. Both refuse an inner state holding one.

  Example:
    >>> import jmp_lite
    >>> from jmp_lite import contract
    >>> issubclass(jmp_lite.accumulation.AccumulateState, contract.Accumulates)
    True
  """


class HoldsMasterCopy(abc.ABC):
  """A state that holds a full-precision master copy of the params.

  :func:`~jmp_lite.master_weights`' state says so, so that a wrapper that
  would store its inner state narrow (:func:`~jmp_lite.quantized_states`,
  :func:`~jmp_lite.state_dtypes`) refuses to store the master copy in 8 bits
  or bfloat16.

  Example:
    >>> import jmp_lite
    >>> from jmp_lite import contract
    >>> issubclass(jmp_lite.master.MasterWeightsState,
    ...            contract.HoldsMasterCopy)
    True
  """

  @abc.abstractmethod
  def master_copy(self) -> Any:
    """The master copy.

    Returns:
      The params in the master dtype (a pytree of arrays).
    """


def step_applied(state: Any) -> jax.Array:
  """Whether the step that made ``state`` moved anything, as its gates say.

  A step counts as applied when *any* outermost :class:`Gate` applied (one
  partition of an ``optax.multi_transform`` is enough); a gate applied when
  it did and, if it has gates inside, any of those did. Without gates every
  step counts. Updates made outside every gate do not count.

  Args:
    state: an optimizer state.

  Returns:
    A bool scalar.

  Example:
    >>> import jax.numpy as jnp, optax, jmp_lite
    >>> from jmp_lite import contract
    >>> opt = jmp_lite.skip_nonfinite(optax.sgd(0.1))
    >>> p = jnp.ones(2)
    >>> _, s = opt.update(jnp.array([1.0, jnp.nan]), opt.init(p), p)
    >>> bool(contract.step_applied(s))
    False
  """
  gates = _outermost_gates(state)
  if not gates:
    return jnp.ones((), jnp.bool_)
  applied = jnp.zeros((), jnp.bool_)
  for gate in gates:
    own = jnp.asarray(gate.applied(), jnp.bool_)
    inner = gate.inner()
    if _outermost_gates(inner):
      own = own & step_applied(inner)
    applied = applied | own
  return applied


def _outermost_gates(tree: Any) -> list[Gate]:
  found: list[Gate] = []

  def visit(node: Any) -> bool:
    if isinstance(node, Gate):
      found.append(node)
      return True
    return False

  jax.tree_util.tree_flatten(tree, is_leaf=visit)
  return found
