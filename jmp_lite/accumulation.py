"""Gradient accumulation that survives non-finite micro-batches.

``optax.MultiSteps`` resets its accumulator by multiplying it with 0, and
``0 * inf`` is NaN: after one overflowing micro-batch every later window is
non-finite too, and a loss-scaled run skips forever. (Its
``should_skip_update_fn`` drops such micro-batches instead, so the loss scale
never sees the overflow and never backs off.) :func:`accumulate_gradients`
pins the behaviour mixed precision needs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite import _optax, contract, struct
from jmp_lite import dtypes as _dtypes
from jmp_lite._checks import (
  check_axis_name,
  check_count,
  check_own_state,
  check_transformation,
)
from jmp_lite._skipping import reduce_finite, skip_updates
from jmp_lite._trees import copy_arrays
from jmp_lite.finite import all_finite, select_tree

__all__ = ["AccumulateState", "accumulate_gradients"]


@struct.dataclass
class AccumulateState(contract.Gate, contract.Accumulates):
  """State of :func:`accumulate_gradients`.

  Attributes:
    acc: running sum of this window's gradients, in the accumulator dtype;
      only finite micro-batches are added.
    mini_step: micro-batches seen in this window (int32).
    poisoned: whether a micro-batch of this window was non-finite (bool).
    inner_state: the wrapped optimizer's state.
    config: ``every_k``, the accumulator dtype and ``axis_name`` it was made
      with (static; ``None`` in states pickled before it was recorded).
  """

  acc: Any
  mini_step: Any
  poisoned: Any
  inner_state: Any
  config: Any = struct.field(static=True, default=None)

  def applied(self) -> jax.Array:
    """Whether the last micro-batch ended a window and handed ``inner`` its
    mean (see :class:`jmp_lite.contract.Gate`; gates inside say whether it
    applied).

    Returns:
      A bool scalar.

    Example:
      >>> import jax.numpy as jnp, optax, jmp_lite
      >>> opt = jmp_lite.accumulate_gradients(optax.sgd(1.0), every_k=2)
      >>> p = jnp.zeros(1)
      >>> _, state = opt.update(jnp.ones(1), opt.init(p), p)
      >>> bool(state.applied())
      False
    """
    return jnp.asarray(self.mini_step, jnp.int32) == 0

  def inner(self) -> Any:
    """The wrapped optimizer's state (see :class:`jmp_lite.contract.Gate`).

    Returns:
      ``inner_state``.

    Example:
      >>> import jax.numpy as jnp, optax, jmp_lite
      >>> opt = jmp_lite.accumulate_gradients(optax.sgd(1.0), every_k=2)
      >>> opt.init(jnp.zeros(1)).inner()
      (EmptyState(), EmptyState())
    """
    return self.inner_state


def accumulate_gradients(
    inner: optax.GradientTransformation,
    every_k: int,
    *,
    dtype: Any = jnp.float32,
    axis_name: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """Averages gradients over ``every_k`` micro-batches, then updates once.

  The pinned behaviour, for mixed precision:

  * The accumulator is ``dtype`` (float32) whatever the params' dtype
    (complex params: the complex dtype of that precision, complex64).
  * On the last micro-batch of a window, ``inner`` gets the mean gradient; on
    the others updates are ``-0.0`` and the inner state is untouched, so a
    :func:`loss_scaled` inside adjusts its scale once per optimizer step and
    every micro-batch of a window is scaled alike.
  * A non-finite micro-batch *poisons its window*: it is not added, and at
    the window's end ``inner`` receives non-finite gradients, so a
    :func:`loss_scaled` or :func:`skip_nonfinite` inside skips that optimizer
    step (and backs the scale off once). The next window starts clean.

  Everything is branch-free; ``inner.update`` is traced once and its result
  selected, as ``optax.MultiSteps`` does.

  Args:
    inner: the optimizer to feed, typically ``loss_scaled(...)``.
    every_k: micro-batches per optimizer step, an int (numpy integers too)
      in ``[1, 2**31 - 1]``.
    dtype: accumulator dtype.
    axis_name: the mapped axis name under ``shard_map``/``pmap``: every
      device then agrees that a micro-batch was non-finite as soon as one
      device's shard was, so all poison the same window (under
      ``shard_map(check_vma=True)`` a forgotten one is a ``ValueError``).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is an
    :class:`AccumulateState`.

  Raises:
    TypeError: if ``inner`` is not a gradient transformation, ``every_k`` is
      not an int or ``dtype`` not a float dtype.
    ValueError: if ``every_k`` is out of range.

  Example:
    >>> import jax.numpy as jnp, optax, jmp_lite
    >>> opt = jmp_lite.accumulate_gradients(optax.sgd(1.0), every_k=2)
    >>> params = jnp.zeros(1)
    >>> state = opt.init(params)
    >>> u1, state = opt.update(jnp.array([1.0]), state, params)
    >>> u2, state = opt.update(jnp.array([3.0]), state, params)
    >>> u1, u2
    (Array([-0.], dtype=float32), Array([-2.], dtype=float32))
  """
  check_transformation(inner, "accumulate_gradients")
  every_k = check_count(every_k, "every_k")
  axis_name = check_axis_name(axis_name)
  dtype = _dtypes.to_floating_dtype(dtype, "dtype")
  if dtype.itemsize < 2:
    raise ValueError(
        f"accumulate_gradients: a {dtype.name} accumulator loses the"
        " micro-batches it sums (1e-3 gradients vanish in float8_e4m3fn);"
        " accumulate in float32")
  config = (f"accumulate_gradients(every_k={every_k}, dtype={dtype.name},"
            f" axis_name={axis_name!r})")

  def acc_dtype(x: Any) -> Any:
    # Complex leaves accumulate in the complex dtype of ``dtype``'s
    # precision: a real accumulator would drop their imaginary parts.
    if jnp.iscomplexobj(x):
      return jnp.promote_types(dtype, jnp.complex64)
    return dtype

  def to_acc(x: Any) -> Any:
    return x.astype(acc_dtype(x)) if _dtypes.is_inexact_array(x) else x

  def init(params: Any) -> AccumulateState:
    # Non-floating leaves are carried as copies: a state leaf must never be a
    # param's own buffer, which a donated step would donate twice. zeros_like:
    # the accumulator takes its param's sharding.
    acc = jax.tree.map(
        lambda p: jnp.zeros_like(p, dtype=acc_dtype(p))
        if _dtypes.is_inexact_array(p) else copy_arrays(p), params)
    return AccumulateState(
        acc=acc, mini_step=jnp.zeros((), jnp.int32),
        poisoned=jnp.zeros((), jnp.bool_), inner_state=inner.init(params),
        config=config)

  def update(grads: Any, state: AccumulateState, params: Any = None,
             **extra: Any) -> tuple[Any, AccumulateState]:
    check_own_state(state, AccumulateState, "accumulate_gradients")
    if state.config is not None and state.config != config:
      raise ValueError(
          "accumulate_gradients(...).update got a state made under another"
          f" configuration: the state was made with {state.config}, this"
          f" optimizer is {config}. Step a state with the optimizer whose"
          " init made it")
    # Agreed over axis_name: devices that disagreed about a micro-batch
    # would close different windows as poisoned.
    finite = reduce_finite(all_finite(grads), axis_name,
                           governs=(state.poisoned, state.mini_step))
    poisoned = state.poisoned | ~finite

    def add(acc: Any, g: Any) -> Any:
      if not _dtypes.is_inexact_array(acc):
        return acc
      return jnp.where(finite, acc + to_acc(g), acc)

    acc = jax.tree.map(add, state.acc, grads)
    # ">=": a window restored into a smaller every_k (a checkpoint) closes
    # on its next micro-batch instead of never.
    emit = state.mini_step >= every_k - 1
    seen = state.mini_step + 1

    def mean(a: Any, g: Any) -> Any:
      if not _dtypes.is_inexact_array(a):
        return g
      # The mean of what the window holds: every_k micro-batches, or more in
      # a window restored into a smaller every_k.
      m = jnp.where(seen == every_k, a / every_k, a / seen.astype(a.dtype))
      # A poisoned window hands on NaN so that the wrapped guard skips it.
      m = jnp.where(poisoned, jnp.asarray(np.nan, m.dtype), m)
      return m.astype(g.dtype) if _dtypes.is_inexact_array(g) else m

    mean_grads = jax.tree.map(mean, acc, grads)
    updates, new_inner = inner.update(mean_grads, state.inner_state, params,
                                      **extra)
    updates = skip_updates(emit, updates)
    inner_state = select_tree(emit, new_inner, state.inner_state)
    acc = jax.tree.map(
        lambda a: jnp.where(emit, jnp.zeros((), a.dtype), a)
        if _dtypes.is_inexact_array(a) else a, acc)
    return updates, AccumulateState(
        acc=acc,
        mini_step=jnp.where(emit, 0, state.mini_step + 1).astype(jnp.int32),
        poisoned=poisoned & ~emit,
        inner_state=inner_state, config=state.config)

  return _optax.transformation(init, update)
