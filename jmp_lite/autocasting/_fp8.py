"""The FP8 swap: a half-precision matmul run as ``jmp_lite.fp8.dot_general``.

The swap itself is a :class:`jmp_lite._jaxpr.Plan` whose ``call`` is the
traced FP8 matmul made here; the delayed-scaling states are extra inputs of
the autocast function, read in order by the top-level matmuls.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jmp_lite import _jaxpr


def fp8_call(recipe: Any, lhs_shape: tuple[int, ...],
             rhs_shape: tuple[int, ...], dtype: np.dtype, dims: Any,
             delayed: bool, shardings: tuple[Any, Any] = (None, None)
             ) -> Any:
  """A traced ``jit`` equation computing one FP8 matmul on these types.

  Args:
    recipe: the :mod:`jmp_lite.fp8` recipe.
    lhs_shape: the left operand's shape.
    rhs_shape: the right operand's shape.
    dtype: the operands' dtype (the compute dtype).
    dims: ``dot_general`` dimension numbers.
    delayed: whether the call takes a delayed-scaling state's ``history``
      and ``pending`` arrays after the operands.
    shardings: the operands' shardings where their types have one
      (explicit mesh axes), else None: the call is traced on those types, so
      that its gradients come back sharded as the operands are.

  Returns:
    The equation (a template for :class:`jmp_lite._jaxpr.Plan`).

  Example:
    >>> import numpy as np, jmp_lite
    >>> from jmp_lite.autocasting._fp8 import fp8_call
    >>> eqn = fp8_call(jmp_lite.fp8.CurrentScaling(), (2, 4), (4, 3),
    ...                np.dtype("float32"), (((1,), (0,)), ((), ())), False)
    >>> aval = eqn.outvars[0].aval
    >>> aval.shape, aval.dtype
    ((2, 3), dtype('float32'))
  """
  from jmp_lite import fp4, fp8  # Imported on first use only.

  if isinstance(recipe, (fp4.NVFP4, fp4.MXFP4, fp4.PerDirection)):
    # No key in autocast: FP4's deterministic backward pass.
    return _jaxpr.traced_call(
        lambda a, b: fp4.dot_general(recipe)(a, b, dims),
        _operands(lhs_shape, rhs_shape, dtype, shardings))
  if not delayed and isinstance(recipe, fp8.DelayedScaling):
    # A matmul without a state of its own: the same formats, just in time.
    recipe = fp8.CurrentScaling(recipe.fwd_dtype, recipe.bwd_dtype,
                                recipe.margin)

  def run(*xs: Any) -> Any:
    state = fp8.ScalingState(*xs[2:]) if delayed else None
    return fp8.dot_general(recipe, state)(xs[0], xs[1], dims)

  n = len(fp8.ScalingState.__dataclass_fields__)
  avals = _operands(lhs_shape, rhs_shape, dtype, shardings)
  if delayed:
    avals += [jax.ShapeDtypeStruct((3, recipe.history), np.float32),
              jax.ShapeDtypeStruct((3,), np.float32)][:n]
  return _jaxpr.traced_call(run, avals)


def _operands(lhs_shape: tuple[int, ...], rhs_shape: tuple[int, ...],
              dtype: np.dtype, shardings: tuple[Any, Any]
              ) -> list[jax.ShapeDtypeStruct]:
  return [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
          for shape, sharding in zip((lhs_shape, rhs_shape), shardings,
                                     strict=True)]


def fp8_state_leaves(fp8_state: Any) -> list[Any]:
  """The (history, pending) arrays of a delayed-scaling autocast's state.

  Args:
    fp8_state: what :func:`jmp_lite.autocast_fp8_state` made.

  Returns:
    The arrays, two per state, in order.

  Raises:
    TypeError: for anything but a tuple or list of
      :class:`jmp_lite.fp8.ScalingState`.

  Example:
    >>> import jmp_lite
    >>> from jmp_lite.autocasting._fp8 import fp8_state_leaves
    >>> state = jmp_lite.fp8.DelayedScaling(history=4).init()
    >>> [a.shape for a in fp8_state_leaves((state,))]
    [(3, 4), (3,)]
  """
  from jmp_lite.fp8 import ScalingState
  if not isinstance(fp8_state, (tuple, list)) or not all(
      isinstance(s, ScalingState) for s in fp8_state):
    raise TypeError(
        "With fp8=DelayedScaling(...), the autocast function's first argument"
        " is its FP8 state: a tuple of jmp_lite.fp8.ScalingState (build it"
        " with jmp_lite.autocast_fp8_state), got"
        f" {type(fp8_state).__name__}")
  return [leaf for s in fp8_state for leaf in (s.history, s.pending)]
