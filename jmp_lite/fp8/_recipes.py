"""FP8 recipes (frozen configuration) and the delayed-scaling state pytree."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import struct

__all__ = ["AMAX_COMPUTE", "CurrentScaling", "DelayedScaling", "FP8_DTYPES",
           "ScalingState"]

FP8_DTYPES: tuple[np.dtype, ...] = tuple(np.dtype(d) for d in (
    jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float8_e4m3fnuz,
    jnp.float8_e5m2fnuz))
"""The FP8 formats a recipe accepts (``fnuz``: AMD MI300's variants)."""

AMAX_COMPUTE: tuple[str, ...] = ("max", "most_recent")
"""How :class:`DelayedScaling` reduces an amax history to one amax."""

ROLES: tuple[str, ...] = ("lhs", "rhs", "grad")
"""The rows of a :class:`ScalingState`: both operands and the cotangent."""


def _fp8_dtype(value: Any, what: str) -> np.dtype:
  try:
    dtype = np.dtype(jnp.dtype(value))
  except TypeError:
    dtype = None
  if dtype is None or dtype not in FP8_DTYPES:
    names = ", ".join(d.name for d in FP8_DTYPES)
    raise TypeError(f"{what} must be one of the FP8 dtypes ({names}), got"
                    f" {value!r}")
  return dtype


def _non_negative_int(value: Any, what: str) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{what} must be a Python int, got"
                    f" {type(value).__name__}: {value!r}")
  if value < 0:
    raise ValueError(f"{what} must be >= 0, got {value}")
  return int(value)


@dataclasses.dataclass(frozen=True)
class CurrentScaling:
  """Per-tensor FP8 scaling from each tensor's own amax, computed just in time.

  Each operand of a matmul is multiplied by ``finfo(dtype).max / amax /
  2**margin`` (its largest magnitude lands on the format's largest finite
  value, less ``margin`` powers of two of headroom), cast to FP8, multiplied
  with float32 accumulation and the product de-scaled. Stateless: nothing to
  thread, checkpoint or commit.

  Attributes:
    fwd_dtype: the operands' format in the forward pass (E4M3: more mantissa).
    bwd_dtype: the incoming cotangent's format in the backward pass (E5M2:
      more range, for gradients).
    margin: powers of two of headroom below the format's maximum.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> recipe = jmp_lite.fp8.CurrentScaling()
    >>> recipe.fwd_dtype, recipe.bwd_dtype, recipe.margin
    (dtype(float8_e4m3fn), dtype(float8_e5m2), 0)
  """

  fwd_dtype: Any = jnp.float8_e4m3fn
  bwd_dtype: Any = jnp.float8_e5m2
  margin: int = 0

  def __post_init__(self) -> None:
    object.__setattr__(self, "fwd_dtype",
                       _fp8_dtype(self.fwd_dtype, "fwd_dtype"))
    object.__setattr__(self, "bwd_dtype",
                       _fp8_dtype(self.bwd_dtype, "bwd_dtype"))
    object.__setattr__(self, "margin",
                       _non_negative_int(self.margin, "margin"))


@struct.dataclass
class ScalingState:
  """The delayed-scaling state of one matmul: amax histories, immutable.

  Also the type of what ``jax.grad`` returns for it: that cotangent carries
  the amaxes the step *observed* in its ``pending`` field, for
  :func:`jmp_lite.fp8.commit` (its ``history`` is zeros).

  Attributes:
    history: float32 ``(3, history)``: per row (``lhs``, ``rhs``, ``grad``),
      the amaxes of earlier optimizer steps, most recent first; ``0`` means
      no observation yet.
    pending: float32 ``(3,)``: the largest amaxes seen in the current
      accumulation window, not yet committed to the history.

  Example:
    >>> import jax, jmp_lite
    >>> state = jmp_lite.fp8.DelayedScaling(history=8).init()
    >>> [x.shape for x in jax.tree.leaves(state)]
    [(3, 8), (3,)]
  """

  history: Any
  pending: Any

  def __post_init__(self) -> None:
    h, p = np.shape(self.history), np.shape(self.pending)
    if len(h) != 2 or h[0] != len(ROLES) or h[1] < 1 or p != (len(ROLES),):
      raise ValueError(
          "ScalingState needs history of shape (3, n >= 1) and pending of"
          f" shape (3,) (rows {ROLES}), got {h} and {p}")


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
  """FP8 scaling from an amax history of earlier steps (TransformerEngine's).

  Each matmul keeps a :class:`ScalingState`; the scale of an operand (and of
  the cotangent in the backward pass) is ``finfo(dtype).max / amax /
  2**margin`` with ``amax`` the maximum (or the most recent entry) of its
  history. Values beyond it saturate at the format's maximum. While a
  history is still empty (a fresh state, or one whose steps were all
  skipped) the tensor's own amax is used, as :class:`CurrentScaling` would.

  Threading the state: pass it to :func:`jmp_lite.fp8.dot_general`,
  differentiate the loss with respect to it (the "gradient" is what the
  step observed) and fold that in with :func:`jmp_lite.fp8.commit`, which
  advances the history once per *applied* optimizer step.

  Attributes:
    history: the amax history length (>= 1).
    margin: powers of two of headroom below the format's maximum.
    amax_compute: ``"max"`` (of the history) or ``"most_recent"``.
    fwd_dtype: the operands' FP8 format in the forward pass.
    bwd_dtype: the cotangent's FP8 format in the backward pass.

  Example:
    >>> import jmp_lite
    >>> recipe = jmp_lite.fp8.DelayedScaling(history=16)
    >>> state = recipe.init()
    >>> state.history.shape, state.pending.shape
    ((3, 16), (3,))
  """

  history: int = 1024
  margin: int = 0
  amax_compute: str = "max"
  fwd_dtype: Any = jnp.float8_e4m3fn
  bwd_dtype: Any = jnp.float8_e5m2

  def __post_init__(self) -> None:
    length = _non_negative_int(self.history, "history")
    if length < 1:
      raise ValueError(f"history must be >= 1, got {length}")
    object.__setattr__(self, "history", length)
    object.__setattr__(self, "margin",
                       _non_negative_int(self.margin, "margin"))
    if self.amax_compute not in AMAX_COMPUTE:
      raise ValueError(f"amax_compute must be one of {AMAX_COMPUTE}, got"
                       f" {self.amax_compute!r}")
    object.__setattr__(self, "fwd_dtype",
                       _fp8_dtype(self.fwd_dtype, "fwd_dtype"))
    object.__setattr__(self, "bwd_dtype",
                       _fp8_dtype(self.bwd_dtype, "bwd_dtype"))

  def init(self) -> ScalingState:
    """A fresh :class:`ScalingState` for one matmul (empty histories).

    Returns:
      The state, with numpy zeros (nothing is put on a device).

    Example:
      >>> import jmp_lite
      >>> float(jmp_lite.fp8.DelayedScaling(history=4).init().history.sum())
      0.0
    """
    return ScalingState(
        history=np.zeros((len(ROLES), self.history), np.float32),
        pending=np.zeros((len(ROLES),), np.float32))

  def amax(self, state: ScalingState) -> jax.Array:
    """The amaxes ``state`` gives this step's scales: float32 ``(3,)``.

    Args:
      state: a :class:`ScalingState`.

    Returns:
      Per row (``lhs``, ``rhs``, ``grad``) the history's maximum (or most
      recent entry); ``0`` where the history is empty.

    Example:
      >>> import jax.numpy as jnp, jmp_lite
      >>> recipe = jmp_lite.fp8.DelayedScaling(history=2)
      >>> history = jnp.array([[1., 3.], [2., 0.], [0., 0.]])
      >>> s = jmp_lite.fp8.ScalingState(history, jnp.zeros(3))
      >>> recipe.amax(s)
      Array([3., 2., 0.], dtype=float32)
    """
    history = jnp.asarray(state.history, jnp.float32)
    if self.amax_compute == "most_recent":
      return history[:, 0]
    return jnp.max(history, axis=1)


Recipe = CurrentScaling | DelayedScaling


def check_recipe(recipe: Any) -> Recipe:
  """Returns ``recipe`` if it is an FP8 recipe, else raises a TypeError."""
  if not isinstance(recipe, (CurrentScaling, DelayedScaling)):
    raise TypeError(
        "Expected a jmp_lite.fp8.CurrentScaling or DelayedScaling recipe, got"
        f" {type(recipe).__name__}: {recipe!r}")
  return recipe
