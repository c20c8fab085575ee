"""Master weights: half-precision params, a float32 copy in the optimizer.

Apex's O2 / ``FP16_Optimizer``, PaddlePaddle's O2 and Colossal-AI's naive AMP
keep a float32 master copy of half-precision params: small updates that would
round away in float16/bfloat16 accumulate in float32, and the optimizer's
moments live in float32 too. :func:`master_weights` does this as an optax
transformation.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite import _optax, contract, struct
from jmp_lite import dtypes as _dtypes
from jmp_lite._checks import check_own_state, check_transformation
from jmp_lite._trees import copy_arrays
from jmp_lite.low_precision._common import check_inner_structure

__all__ = ["MasterWeightsState", "master_params", "master_weights"]


@struct.dataclass
class MasterWeightsState(contract.HoldsMasterCopy):
  """State of :func:`master_weights`.

  Attributes:
    master: the params in the master dtype (non-floating leaves copied as
      given); never the params' own buffers.
    inner_state: the wrapped optimizer's state, built from ``master``.
    config: the master dtype and update dtype it was made with (static;
      ``None`` in states pickled before it was recorded).
  """

  master: Any
  inner_state: Any
  config: Any = struct.field(static=True, default=None)

  def master_copy(self) -> Any:
    """The master copy (:class:`jmp_lite.contract.HoldsMasterCopy`).

    Returns:
      ``master``.

    Example:
      >>> import jax.numpy as jnp, optax, jmp_lite
      >>> opt = jmp_lite.master_weights(optax.sgd(0.1))
      >>> opt.init(jnp.ones(2, jnp.bfloat16)).master_copy().dtype
      dtype('float32')
    """
    return self.master


def _holds(wide: Any, narrow: Any) -> bool:
  """Whether every value of ``narrow`` is a value of ``wide`` (its mantissa
  and exponent range both at least as large)."""
  w, n = jnp.finfo(wide), jnp.finfo(narrow)
  return w.nmant >= n.nmant and w.maxexp >= n.maxexp and w.minexp <= n.minexp


def _apply(master: Any, update: Any) -> Any:
  # optax.apply_updates, less its failure on float0 updates of int leaves.
  if not _dtypes.is_inexact_array(update) or not _dtypes.is_inexact_array(
      master):
    return master
  return (master + update).astype(master.dtype)


def _param_update(new_master: Any, old_master: Any, update: Any,
                  param: Any, update_dtype: Any = None) -> Any:
  """The update that takes ``param`` to ``new_master`` cast to its dtype.

  In ``update_dtype``, or the param's own dtype when it is ``None``. Only
  where the master moved: elsewhere (every element of a skipped step) the
  update is ``-0.0``, and ``p + -0.0`` is ``p`` bit for bit.
  """
  if not _dtypes.is_floating_array(param):
    return update
  if param.dtype == new_master.dtype:
    return update  # Same dtype: the master *is* the param; pass through.
  # target and current are both values of the param's dtype, so their
  # difference is exact in float32, and (param + update) lands exactly on
  # the cast master value whenever the update holds it exactly: always in
  # float32; in the param's own dtype whenever the two are within a factor
  # of two of each other. A bigger leap (a param crossing towards zero)
  # lands within one rounding, and the next step that moves that master
  # element, computed against the param as it is, closes the gap.
  wide = _dtypes.at_least_float32(param.dtype)
  # round_to, not a cast pair, which XLA:GPU deletes: the delta would then
  # be rounded twice on its way into the param. Rounded from the master's
  # own values (float64 ones too: no double rounding), held in a dtype that
  # holds both (a bfloat16 master of float16 params: float32).
  master = new_master.astype(
      jnp.promote_types(_dtypes.at_least_float32(new_master.dtype), wide))
  target = _dtypes.round_to(master, param.dtype).astype(wide)
  current = jnp.asarray(param).astype(wide)
  return _dtypes.update_between(
      target, current, param.dtype if update_dtype is None else update_dtype,
      moved=new_master != old_master)


def master_weights(
    inner: optax.GradientTransformation, *, dtype: Any = jnp.float32,
    update_dtype: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """Keeps a master copy of the params in ``dtype`` (float32) for ``inner``.

  ``init`` copies the params into ``dtype`` and initialises ``inner`` from that
  copy, so the optimizer's moments are float32 whatever the params' dtype.
  ``update`` casts the gradients to ``dtype`` (exactly), runs ``inner`` on the
  master copy, applies its updates there, and returns the updates that take
  the half-precision params to the new master values cast to their dtype.
  Leaves already in ``dtype`` pass through unchanged.

  By default the updates are in each param's own dtype, so every way of
  applying them keeps half params half: ``optax.apply_updates`` and
  ``eqx.apply_updates`` (which adds without casting back) alike. The params
  then equal the master copy cast to their dtype after every step in which
  no param leaps by more than a factor of two; a leap towards zero lands
  within one rounding of it and is closed on the next step. With
  ``update_dtype=jnp.float32`` and ``optax.apply_updates`` (which casts back
  to each param's dtype) the params equal the cast master after *every* step.

  Compose it *outside* :func:`loss_scaled`, so that unscaling happens in
  float32 where small gradients cannot underflow::

      opt = jmp_lite.master_weights(
          jmp_lite.loss_scaled(optax.adam(1e-3), scale))

  A step that :func:`loss_scaled` skips leaves the master copy untouched.

  Args:
    inner: the optimizer to run on the master copy.
    dtype: the master dtype; float32 unless you have a reason.
    update_dtype: the dtype of the returned updates of half-precision params;
      ``None`` (default) for each param's own dtype.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`MasterWeightsState`. Its ``update`` requires ``params``.

  Raises:
    TypeError: if ``inner`` is not a gradient transformation, ``dtype`` is
      not a floating dtype or ``update_dtype`` neither that nor ``None``.
    ValueError: for an FP8 ``dtype``; from ``init``, for a param that the
      master dtype cannot hold (float16 masters of bfloat16 params) or a
      :func:`~jmp_lite.kahan_summation` / :func:`~jmp_lite.stochastic_rounding`
      inside (it would see float32 params and round nothing); from
      ``update``, for a state made under another configuration.

  Example:
    >>> import jax.numpy as jnp, optax, jmp_lite
    >>> opt = jmp_lite.master_weights(optax.sgd(1e-4))
    >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> state = opt.init(params)
    >>> state.master["w"].dtype
    dtype('float32')
    >>> for _ in range(100):  # 100 updates of 1e-4: bf16 alone would not move
    ...   grads = {"w": jnp.ones(2, jnp.bfloat16)}
    ...   updates, state = opt.update(grads, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> params["w"]
    Array([0.988281, 0.988281], dtype=bfloat16)
  """
  check_transformation(inner, "master_weights")
  dtype = _dtypes.to_floating_dtype(dtype, "dtype")
  if np.dtype(dtype).itemsize < 2:
    raise ValueError(
        f"master_weights: a {np.dtype(dtype).name} master copy cannot hold"
        " the small updates it exists to accumulate; use float32")
  if update_dtype is not None:
    update_dtype = _dtypes.to_floating_dtype(update_dtype, "update_dtype")
    if np.dtype(update_dtype).itemsize < 2:
      raise ValueError(
          f"master_weights: update_dtype {np.dtype(update_dtype).name} cannot"
          " carry a param's update (JAX adds no FP8 update to a half param);"
          " use None (each param's own dtype) or float32")
  config = (f"master_weights(dtype={np.dtype(dtype).name}, update_dtype="
            f"{None if update_dtype is None else np.dtype(update_dtype).name})")

  def check_wide_enough(params: Any) -> None:
    # A master narrower than its param (float16 for bfloat16, whose range is
    # float32's; float8 for anything) would round the param itself.
    for path, p in jax.tree_util.tree_flatten_with_path(params)[0]:
      if (update_dtype is not None and _dtypes.is_floating_array(p)
          and not _holds(update_dtype, p.dtype)):
        raise ValueError(
            f"master_weights: update_dtype {np.dtype(update_dtype).name}"
            f" cannot hold the updates of param {jax.tree_util.keystr(path)}"
            f" ({np.dtype(p.dtype).name}): a bfloat16 param's update"
            " overflows float16, and a small one rounds to zero. Use None"
            " (each param's own dtype) or float32")
      if _dtypes.is_floating_array(p) and not _holds(dtype, p.dtype):
        raise ValueError(
            f"master_weights: the master dtype {np.dtype(dtype).name} cannot"
            f" hold every value of param {jax.tree_util.keystr(path)}"
            f" ({np.dtype(p.dtype).name}): a master copy must be at least as"
            " wide as its params. Use float32 (the default)")

  def init(params: Any) -> MasterWeightsState:
    def to_master(p: Any) -> Any:
      if _dtypes.is_floating_array(p) and p.dtype != dtype:
        return p.astype(dtype)
      # Already in the master dtype (or not floating): a copy, never the
      # param's own buffer, which a donated step would donate twice.
      return copy_arrays(p)

    check_wide_enough(params)
    master = jax.tree.map(to_master, params)
    inner_state = inner.init(master)
    if struct.find_nodes(inner_state, contract.RoundsHalfParams):
      raise ValueError(
          "master_weights: the optimizer inside rounds updates into half"
          " params (kahan_summation or stochastic_rounding), but"
          " master_weights hands it the float32 master copy, so it would"
          " round nothing. Use one or the other: master_weights keeps the"
          " small updates itself")
    return MasterWeightsState(master=master, inner_state=inner_state,
                              config=config)

  def rebind(inner_update: contract.UpdateFn) -> contract.UpdateFn:
    def update(grads: Any, state: MasterWeightsState, params: Any = None,
               **extra: Any) -> tuple[Any, MasterWeightsState]:
      check_own_state(state, MasterWeightsState, "master_weights")
      if params is None:
        raise ValueError(
            "master_weights needs the current params: call"
            " opt.update(grads, state, params)"
        )
      if state.config is not None and state.config != config:
        raise ValueError(
            "master_weights(...).update got a state made under another"
            f" configuration: the state was made with {state.config}, this"
            f" optimizer is {config}. Step a state with the optimizer whose"
            " init made it")
      check_inner_structure(inner, state.inner_state, state.master,
                            "master_weights")
      updates, inner_state = inner_update(
          _dtypes.cast_floating(grads, dtype), state.inner_state,
          state.master, **extra)
      new_master = jax.tree.map(_apply, state.master, updates)
      param_updates = jax.tree.map(
          lambda m, o, u, p: _param_update(m, o, u, p, update_dtype),
          new_master, state.master,
          updates, params)
      return param_updates, MasterWeightsState(
          master=new_master, inner_state=inner_state, config=state.config)
    return update

  # Gradients reach ``inner`` cast to the master dtype: finite exactly when
  # they were while they fit its range, so update_and_apply may decide a
  # guard inside up front (jmp_lite.contract).
  return _optax.transformation(init, contract.declare(
      rebind(inner.update), contract.Forwarding(
          inner=inner, rebind=rebind,
          inner_state=lambda s: s.inner_state,
          largest_gradient=float(jnp.finfo(dtype).max))))


def master_params(opt_state: Any) -> Any:
  """Returns the master copy of the params held in ``opt_state``.

  Args:
    opt_state: a state containing exactly one :class:`MasterWeightsState`.

  Returns:
    The params in the master dtype.

  Raises:
    ValueError: if there is not exactly one master-weights state.

  Example:
    >>> import jax.numpy as jnp, optax, jmp_lite
    >>> opt = jmp_lite.master_weights(optax.sgd(0.1))
    >>> state = opt.init({"w": jnp.ones(2, jnp.float16)})
    >>> jmp_lite.master_params(state)["w"].dtype
    dtype('float32')
  """
  found = struct.find_nodes(opt_state, MasterWeightsState)
  if len(found) != 1:
    raise ValueError(
        f"Expected one master_weights state in the optimizer state, found"
        f" {len(found)}; build the optimizer with jmp_lite.master_weights(...)"
    )
  return found[0].master
