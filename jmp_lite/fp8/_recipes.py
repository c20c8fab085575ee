"""FP8 recipes (frozen configuration) and the delayed-scaling state pytree."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import struct

__all__ = ["AMAX_COMPUTE", "CurrentScaling", "DelayedScaling", "FP8_DTYPES",
           "GRANULARITIES", "MXFP8", "MX_ROUNDINGS", "ScalingState"]

FP8_DTYPES: tuple[np.dtype, ...] = tuple(np.dtype(d) for d in (
    jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float8_e4m3fnuz,
    jnp.float8_e5m2fnuz))
"""The FP8 formats a recipe accepts (``fnuz``: AMD MI300's variants)."""

AMAX_COMPUTE: tuple[str, ...] = ("max", "most_recent")
"""How :class:`DelayedScaling` reduces an amax history to one amax."""

GRANULARITIES: tuple[str, ...] = ("tensor", "row", "block")
"""What one scale of :class:`CurrentScaling` covers (see its docstring)."""

MX_ROUNDINGS: tuple[str, ...] = ("up", "floor")
"""How :class:`MXFP8` rounds a block's scale exponent (see its docstring)."""

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


def max_margin(dtype: np.dtype) -> int:
  """The largest margin that keeps a scaled amax a normal ``dtype`` number.

  ``finfo(dtype).max / 2**margin`` is where the amax lands; below the
  format's smallest normal number every element is a subnormal or zero
  (``margin=20`` with E4M3 turned every product into 0).

  Example:
    >>> import jax.numpy as jnp, numpy as np
    >>> from jmp_lite.fp8._recipes import max_margin
    >>> max_margin(np.dtype(jnp.float8_e4m3fn)), max_margin(
    ...     np.dtype(jnp.float8_e5m2))
    (14, 29)
  """
  info = jnp.finfo(dtype)
  return int(np.floor(np.log2(float(info.max) / float(info.smallest_normal))))


def check_margin(value: Any, *dtypes: np.dtype) -> int:
  """``margin`` as an int in ``[0, min(max_margin(d) for d in dtypes)]``."""
  margin = _non_negative_int(value, "margin")
  limit, fmt = min((max_margin(d), d) for d in dtypes)
  if margin > limit:
    raise ValueError(
        f"margin={margin} is too large for {fmt.name}: the amax would land"
        f" at {float(jnp.finfo(fmt).max)} / 2**{margin}, below the format's"
        f" smallest normal number {float(jnp.finfo(fmt).smallest_normal)}"
        " (every element would be a subnormal or zero); margin must be in"
        f" [0, {limit}] for {fmt.name}")
  return margin


@dataclasses.dataclass(frozen=True)
class CurrentScaling:
  """FP8 scaling from each tensor's (row's, block's) own amax, just in time.

  Each operand of a matmul is multiplied by ``finfo(dtype).max / amax /
  2**margin`` (its largest magnitude lands on the format's largest finite
  value, less ``margin`` powers of two of headroom), cast to FP8, multiplied
  with float32 accumulation and the product de-scaled. Stateless: nothing to
  thread, checkpoint or commit.

  ``granularity`` says what one scale covers, in each of the three matmuls
  (forward, input gradient, weight gradient):

  * ``"tensor"`` (the default): one scale per operand.
  * ``"row"``: one scale per row of each operand, that is per index of its
    non-contracting dimensions, over the whole contracting dimension
    (torchao's rowwise recipe; each gradient matmul scales its operands
    along its own contracting dimension).
  * ``"block"``: DeepSeek-V3's recipe: the right-hand operand (the weight)
    in ``block_size x block_size`` tiles, every other operand (activations,
    the cotangent) in ``1 x block_size`` tiles along the matmul's
    contracting dimension. Edge tiles may be partial.

  Attributes:
    fwd_dtype: the operands' format in the forward pass (E4M3: more mantissa).
    bwd_dtype: the incoming cotangent's format in the backward pass (E5M2:
      more range, for gradients).
    margin: powers of two of headroom below the format's maximum, from 0
      to the most that keeps the amax a normal number of both formats
      (14 for E4M3, 29 for E5M2).
    granularity: ``"tensor"``, ``"row"`` or ``"block"``.
    block_size: the tile edge of ``"block"`` (ignored otherwise), >= 1.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> recipe = jmp_lite.fp8.CurrentScaling()
    >>> recipe.fwd_dtype, recipe.bwd_dtype, recipe.margin, recipe.granularity
    (dtype(float8_e4m3fn), dtype(float8_e5m2), 0, 'tensor')
    >>> jmp_lite.fp8.CurrentScaling(granularity="block").block_size
    128
  """

  fwd_dtype: Any = jnp.float8_e4m3fn
  bwd_dtype: Any = jnp.float8_e5m2
  margin: int = 0
  granularity: str = "tensor"
  block_size: int = 128

  def __post_init__(self) -> None:
    object.__setattr__(self, "fwd_dtype",
                       _fp8_dtype(self.fwd_dtype, "fwd_dtype"))
    object.__setattr__(self, "bwd_dtype",
                       _fp8_dtype(self.bwd_dtype, "bwd_dtype"))
    object.__setattr__(self, "margin", check_margin(
        self.margin, self.fwd_dtype, self.bwd_dtype))
    if not isinstance(self.granularity, str) or (
        self.granularity not in GRANULARITIES):
      raise ValueError(f"granularity must be one of {GRANULARITIES}, got"
                       f" {self.granularity!r}")
    size = _non_negative_int(self.block_size, "block_size")
    if size < 1:
      raise ValueError(f"block_size must be >= 1, got {size}")
    object.__setattr__(self, "block_size", size)


_MX_DTYPES = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))


@dataclasses.dataclass(frozen=True)
class MXFP8:
  """OCP microscaling FP8: 32-element blocks with power-of-two scales.

  Every operand of each of the three matmuls (forward, input gradient,
  weight gradient) is cut into blocks of :attr:`BLOCK` consecutive elements
  along that matmul's contracting dimension; each block gets one E8M0
  scale (a power of two, ``2**-127`` to ``2**127``), and its elements are
  stored in ``fwd_dtype`` (``bwd_dtype`` for the incoming cotangent). A
  contracting size that is not a multiple of 32 is zero-padded (zeros
  change no block's maximum and add nothing to the product).

  The scale exponent is computed exactly from the float32 bits of the
  block's amax, never with a float ``log2``:

  * ``scale_rounding="up"`` (the default; arXiv 2506.08027): the smallest
    power of two ``s`` with ``amax / s <= finfo(dtype).max``, so no element
    overflows (a block whose amax lies one ulp above ``max * 2**k`` gets
    ``2**(k+1)``).
  * ``scale_rounding="floor"``: the OCP MX v1.0 rule, ``2**(floor(log2(
    amax)) - emax)`` with ``emax`` the element format's largest exponent (8
    for E4M3); elements beyond the format's maximum saturate.

  A block holding inf or NaN gets the NaN scale (so does the product).

  Attributes:
    fwd_dtype: E4M3 (``float8_e4m3fn``) or E5M2, the operands' elements.
    bwd_dtype: the cotangent's elements; E4M3 by default, as the paper above
      found best with rounded-up scales.
    scale_rounding: ``"up"`` or ``"floor"``.

  Example:
    >>> import jmp_lite
    >>> recipe = jmp_lite.fp8.MXFP8()
    >>> recipe == jmp_lite.fp8.MXFP8(), recipe.BLOCK, recipe.scale_rounding
    (True, 32, 'up')
  """

  fwd_dtype: Any = jnp.float8_e4m3fn
  bwd_dtype: Any = jnp.float8_e4m3fn
  scale_rounding: str = "up"

  BLOCK: ClassVar[int] = 32
  """Elements per block (fixed by the OCP MX specification)."""

  margin: ClassVar[int] = 0
  """The headroom, always 0 (the scale exponent rule sets it); shared code
  paths read it."""

  def __post_init__(self) -> None:
    for name in ("fwd_dtype", "bwd_dtype"):
      dtype = _fp8_dtype(getattr(self, name), name)
      if dtype not in _MX_DTYPES:
        raise ValueError(f"MXFP8 {name} must be float8_e4m3fn or"
                         f" float8_e5m2 (the OCP MX FP8 formats), got"
                         f" {dtype.name}")
      object.__setattr__(self, name, dtype)
    if not isinstance(self.scale_rounding, str) or (
        self.scale_rounding not in MX_ROUNDINGS):
      raise ValueError(f"scale_rounding must be one of {MX_ROUNDINGS}, got"
                       f" {self.scale_rounding!r}")


@struct.dataclass
class ScalingState:
  """The delayed-scaling state of one matmul: amax histories, immutable.

  Also the type of what ``jax.grad`` returns for it: that cotangent carries
  the amaxes the step *observed* in its ``pending`` field, for
  :func:`jmp_lite.fp8.commit` (its ``history`` is zeros).

  Attributes:
    history: float32 ``(3, history)``: per row (``lhs``, ``rhs``, ``grad``),
      the amaxes of earlier optimizer steps, most recent first; ``0`` means
      no observation yet. Layers stacked by a scan add leading axes.
    pending: float32 ``(3,)`` (with the same leading axes): the largest
      amaxes seen in the current accumulation window, not yet committed to
      the history.

  Example:
    >>> import jax, jmp_lite
    >>> state = jmp_lite.fp8.DelayedScaling(history=8).init()
    >>> [x.shape for x in jax.tree.leaves(state)]
    [(3, 8), (3,)]
  """

  history: Any
  pending: Any

  def __post_init__(self) -> None:
    # Leading axes: layers stacked by nn.scan / nnx.scan, one state each.
    h, p = np.shape(self.history), np.shape(self.pending)
    if (len(h) < 2 or h[-2] != len(ROLES) or h[-1] < 1
        or p != h[:-1]):
      raise ValueError(
          "ScalingState needs history of shape (..., 3, n >= 1) and pending"
          f" of shape (..., 3) (rows {ROLES}; leading axes stack layers),"
          f" got {h} and {p}")


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
    margin: powers of two of headroom below the format's maximum, from 0
      to the most that keeps the amax a normal number of both formats
      (14 for E4M3, 29 for E5M2).
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
    if isinstance(self.history, numbers.Integral) and not isinstance(
        self.history, bool) and self.history < 1:
      raise ValueError(f"history must be >= 1, got {self.history}")
    length = _non_negative_int(self.history, "history")
    object.__setattr__(self, "history", length)
    if not isinstance(self.amax_compute, str) or (
        self.amax_compute not in AMAX_COMPUTE):
      raise ValueError(f"amax_compute must be one of {AMAX_COMPUTE}, got"
                       f" {self.amax_compute!r}")
    object.__setattr__(self, "fwd_dtype",
                       _fp8_dtype(self.fwd_dtype, "fwd_dtype"))
    object.__setattr__(self, "bwd_dtype",
                       _fp8_dtype(self.bwd_dtype, "bwd_dtype"))
    object.__setattr__(self, "margin", check_margin(
        self.margin, self.fwd_dtype, self.bwd_dtype))

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
      return history[..., 0]
    return jnp.max(history, axis=-1)


Recipe = CurrentScaling | DelayedScaling | MXFP8


def check_recipe(recipe: Any) -> Recipe:
  """Returns ``recipe`` if it is an FP8 recipe, else raises a TypeError."""
  if not isinstance(recipe, (CurrentScaling, DelayedScaling, MXFP8)):
    raise TypeError(
        "Expected a jmp_lite.fp8.CurrentScaling or DelayedScaling recipe, got"
        f" {type(recipe).__name__}: {recipe!r} (jmp_lite.fp8.MXFP8 is one"
        " too)")
  return recipe


def is_fine(recipe: Recipe) -> bool:
  """Whether ``recipe`` scales finer than per tensor (row, block, MX)."""
  return isinstance(recipe, MXFP8) or (
      isinstance(recipe, CurrentScaling) and recipe.granularity != "tensor")
