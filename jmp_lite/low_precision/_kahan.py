"""``kahan_summation``: carry each half param's rounding error to the next
step."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite import contract, struct
from jmp_lite import dtypes as _dtypes
from jmp_lite._checks import check_own_state, check_transformation
from jmp_lite.low_precision._common import (
  check_inner_structure,
  F32,
  forwarding,
  is_narrow,
  need_params,
  unaliased,
  update_dtype,
  wide_dtype,
)


@struct.dataclass
class KahanState(contract.RoundsHalfParams):
  """State of :func:`kahan_summation`.

  Attributes:
    compensation: per param leaf, the rounding error not yet applied, in the
      param's dtype (bfloat16 for FP8 params); ``None`` for float32/float64
      and non-floating leaves. float16 buffers hold the error times
      ``2**11``, which keeps it out of float16's subnormal range;
      :meth:`residual` gives the error itself.
    inner_state: the wrapped optimizer's state.
    compensation_scale: per compensated leaf, a float32 scalar: what its
      buffer holds the error times (``2**11`` for float16, ``1`` otherwise).
      It is a value, not read off the buffer's dtype, so a state restored
      under another dtype (a float16 run's checkpoint into bfloat16 params)
      still reads its buffers right; the next step rewrites each buffer with
      its own dtype's scale. ``None`` in states made before the field
      existed: their buffers hold what their dtype says.
  """

  compensation: Any
  inner_state: Any
  # Last and defaulted: KahanState(compensation, inner_state) still builds,
  # and an orbax checkpoint saved without the field restores into a target
  # that has None here.
  compensation_scale: Any = None

  def residual(self) -> Any:
    """The rounding error carried for each param leaf, in float32.

    ``params + state.residual()`` is what the params would be without
    rounding (to about one ulp of a float32 run); the stored buffers are
    scaled for float16 (see ``compensation`` and ``compensation_scale``).

    Returns:
      A tree like ``compensation`` with float32 leaves (``None`` kept).

    Example:
      >>> import jax.numpy as jnp, optax, jmp_lite
      >>> opt = jmp_lite.kahan_summation(optax.sgd(2.0**-14))
      >>> p = jnp.ones(2, jnp.float16)
      >>> u, state = opt.update(jnp.ones(2, jnp.float16), opt.init(p), p)
      >>> state.residual() * 2**14   # Under half a float16 step of 1.0.
      Array([-1., -1.], dtype=float32)
      >>> state.compensation   # What is stored: 2**-14 times 2**11.
      Array([-0.125, -0.125], dtype=float16)
      >>> state.compensation_scale
      Array(2048., dtype=float32)
    """
    return jax.tree.map(
        lambda c, k: _read(c, k, F32), self.compensation,
        _scales_like(self.compensation, self.compensation_scale),
        is_leaf=lambda x: x is None)

  def __setstate__(self, state: dict[str, Any]) -> None:
    """Unpickles, giving a state pickled before ``compensation_scale``
    existed the scales its buffers were written with.

    A pickle keeps each buffer's dtype, and that dtype's scale is what the
    old code wrote it with: read now, it is right; after a later cast to
    another dtype, it would not be.

    Args:
      state: the pickled instance's attributes.

    Example:
      >>> import pickle, jax.numpy as jnp, optax, jmp_lite
      >>> opt = jmp_lite.kahan_summation(optax.sgd(0.1))
      >>> state = opt.init(jnp.ones(2, jnp.float16))
      >>> pickle.loads(pickle.dumps(state)).compensation_scale
      Array(2048., dtype=float32)
    """
    state = dict(state)
    if state.get("compensation_scale") is None:
      state["compensation_scale"] = jax.tree.map(
          lambda c: np.asarray(_compensation_scale(c.dtype), F32),
          state["compensation"])
    for name, value in state.items():
      object.__setattr__(self, name, value)


# What float16 compensation buffers hold the error times. The error is at
# most half an ulp of its param, which for params below 2**-3 is a float16
# subnormal (measured: 100 updates of 0.1 ulp moved a param of 2e-4 by 0
# ulps, not 10). Times 2**11 it is normal for every normal param and finite
# for the largest (half an ulp of 65504 is 16; 16 * 2**11 = 32768).
_F16_COMPENSATION_SCALE = 2.0**11


def _compensation_dtype(dtype: Any) -> np.dtype:
  # FP8's 2-3 mantissa bits stall a residual long before it is worth an ulp
  # of the param; bfloat16 holds FP8's whole range with 8 bits.
  dtype = np.dtype(dtype)
  return np.dtype(jnp.bfloat16) if dtype.itemsize == 1 else dtype


def _compensation_scale(dtype: Any) -> float:
  # Only float16 needs it: bfloat16 has float32's exponent range.
  return (_F16_COMPENSATION_SCALE if np.dtype(dtype) == np.float16
          else 1.0)


def _scales_like(compensation: Any, scales: Any) -> Any:
  # A state from before compensation_scale existed has None there: a tree
  # of Nones that maps like its compensation.
  if scales is None:
    return jax.tree.map(lambda _: None, compensation)
  return scales


def _read(c: Any, k: Any, wide: Any) -> Any:
  """The error buffer ``c`` holds, in ``wide``: ``c / k``, where ``k`` is
  the scale it was written with (its dtype's when ``k`` is ``None``)."""
  if c is None:
    return None
  if k is None:
    return c.astype(wide) / _compensation_scale(c.dtype)
  # A power of two: its reciprocal, and multiplying by it, are exact (one
  # scalar divide, not one per element).
  return c.astype(wide) * (1 / k.astype(wide))


def kahan_summation(
    inner: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
  """Applies ``inner``'s updates to half-precision params with compensation.

  For every bfloat16/float16 param leaf the state keeps a compensation buffer
  ``c`` of the param's dtype (bfloat16 for an FP8 param: two or three
  mantissa bits cannot carry the residual, and it would stop growing long
  before it reached the param's half ulp; float16 buffers hold it times
  ``2**11``, clear of float16's subnormals: :meth:`KahanState.residual`).
  The state records that scale per buffer, as a value
  (``KahanState.compensation_scale``), so a checkpoint restored under
  another dtype (float16 to bfloat16 or back) continues correctly.
  Each step computes, in float32, ``s = p + (u + c)`` (``u``: ``inner``'s
  update), the new param ``round(s)`` and the new buffer ``s - round(s)``,
  and returns the update that makes ``optax.apply_updates(params,
  updates)`` land exactly on ``round(s)``. The rounding error is carried
  into the next step, so updates far below half an ulp accumulate instead
  of vanishing: ``p + c`` follows a float32 run to about one ulp of the
  param's dtype.

  Returned updates are float32 for half-precision leaves (the exact
  difference of two half values) and FP8 for FP8 leaves (JAX adds no
  float32 update to an FP8 param; exact while the param moves by less than
  a factor of two). float32/float64 and non-floating leaves
  have no buffer and pass ``inner``'s updates through unchanged. An element
  whose update is exactly zero keeps its param and buffer as they were.

  Composition: compute the moments in float32 and store them in bfloat16
  with ``kahan_summation(state_dtypes(inner, "bf16"))`` (8 bytes per
  parameter with Adam). A step skipped by :func:`~jmp_lite.loss_scaled` or
  :func:`~jmp_lite.skip_nonfinite` leaves params and buffers bit-identical
  whether the guard is inside (its ``-0.0`` updates move nothing) or
  outside (it keeps this state).

  Args:
    inner: the optimizer whose updates to apply.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`KahanState`. Its ``update`` requires ``params``.

  Raises:
    TypeError: if ``inner`` is not a gradient transformation.
    ValueError: from ``update``, when called without ``params``.

  Example:
    >>> import jax.numpy as jnp, optax, jmp_lite
    >>> opt = jmp_lite.kahan_summation(optax.sgd(1e-4))
    >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> state = opt.init(params)
    >>> state.compensation["w"].dtype
    dtype(bfloat16)
    >>> grads = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> for _ in range(100):  # 100 updates of 1e-4: bf16 alone would not move
    ...   updates, state = opt.update(grads, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> params["w"]
    Array([0.988281, 0.988281], dtype=bfloat16)
  """
  check_transformation(inner, "kahan_summation")

  def init(params: Any) -> KahanState:
    compensation = jax.tree.map(
        # zeros_like: the buffer takes its param's sharding (jnp.zeros put a
        # whole-model buffer on device 0).
        lambda p: jnp.zeros_like(p, dtype=_compensation_dtype(p.dtype))
        if is_narrow(p) else None,
        params)
    scales = jax.tree.map(
        lambda c: jnp.asarray(_compensation_scale(c.dtype), F32),
        compensation)
    return KahanState(compensation=compensation,
                      inner_state=unaliased(inner.init(params), params),
                      compensation_scale=scales)

  def leaf(p: Any, u: Any, c: Any, k: Any) -> tuple[Any, Any, Any]:
    if c is None or not _dtypes.is_floating_array(u):
      return u, c, k
    wide = wide_dtype(p, u)
    # The buffer is read with the scale it was written with (k) and written
    # with its own dtype's: they differ once, after a restore under another
    # dtype, and the new scale is stored with it.
    scale = _compensation_scale(c.dtype)   # A power of two: exact.
    err = _read(c, k, wide)
    p_wide, u_wide = p.astype(wide), u.astype(wide)
    s = p_wide + (u_wide + err)
    # Not s.astype(p.dtype).astype(wide): XLA:GPU deletes that pair, and
    # the compensation would stay zero (round_to's docstring).
    new_wide = _dtypes.round_to(s, p.dtype)
    # |s - new| <= half an ulp of new: exact in float32, rounded into c.
    # Unmoved elements keep their error: err * scale is c bit for bit when
    # the scale has not changed.
    moved = u_wide != 0
    new_c = (jnp.where(moved, s - new_wide, err) * scale).astype(c.dtype)
    # k's own dtype: a state's leaves keep their dtypes across a step (a
    # guard outside keeps the old state on a skip).
    new_k = None if k is None else jnp.asarray(scale, k.dtype)
    return _dtypes.update_between(new_wide, p_wide, update_dtype(p, wide),
                                  moved), new_c, new_k

  def rebind(inner_update: contract.UpdateFn) -> contract.UpdateFn:
    def update(updates: Any, state: KahanState, params: Any = None,
               **extra: Any) -> tuple[Any, KahanState]:
      check_own_state(state, KahanState, "kahan_summation")
      need_params(params, "kahan_summation")
      check_inner_structure(inner, state.inner_state, params,
                            "kahan_summation")
      inner_updates, inner_state = inner_update(
          updates, state.inner_state, params, **extra)
      p_leaves, treedef = jax.tree.flatten(params)
      u_leaves = treedef.flatten_up_to(inner_updates)
      c_leaves = treedef.flatten_up_to(state.compensation)
      k_leaves = treedef.flatten_up_to(
          _scales_like(state.compensation, state.compensation_scale))
      out = [leaf(p, u, c, k) for p, u, c, k in zip(
          p_leaves, u_leaves, c_leaves, k_leaves, strict=True)]
      new_updates = treedef.unflatten([o[0] for o in out])
      compensation = treedef.unflatten([o[1] for o in out])
      # A state from before the field existed keeps its structure (None):
      # a guard outside would refuse a state that changes it.
      scales = (None if state.compensation_scale is None
                else treedef.unflatten([o[2] for o in out]))
      return new_updates, KahanState(compensation=compensation,
                                     inner_state=inner_state,
                                     compensation_scale=scales)
    return update

  # The compensation is half on purpose (loss_scaled's check for half
  # moments leaves it be; the inner state is still checked).
  return forwarding(init, rebind, inner, half_by_design=lambda s: KahanState(
      compensation=None,
      inner_state=contract.without_half_by_design(inner, s.inner_state),
      compensation_scale=None))


# The class names jmp_lite.low_precision as its module (see __init__), where
# doctest would not find its methods' examples; they run with this module.
__test__ = {"KahanState": KahanState}
