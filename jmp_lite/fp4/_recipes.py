"""FP4 recipes: NVFP4, MXFP4 and per-direction choices (frozen values)."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np

__all__ = ["E2M1", "MXFP4", "NVFP4", "PerDirection", "ROLES"]

E2M1: np.dtype = np.dtype(jnp.float4_e2m1fn)
"""The FP4 element format: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives."""

ROLES: tuple[str, ...] = ("activation", "weight", "gradient")
"""What a quantised tensor is to its matmul (decides its blocks, rounding)."""


def _int(value: Any, what: str, low: int) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{what} must be a Python int, got"
                    f" {type(value).__name__}: {value!r}")
  if value < low:
    raise ValueError(f"{what} must be >= {low}, got {value}")
  return int(value)


def _hadamard(value: Any) -> int:
  size = _int(value, "hadamard", 0)
  if size and (size < 2 or size > 256 or size & (size - 1)):
    raise ValueError("hadamard must be 0 (no transform) or a power of two"
                     f" from 2 to 256 (the transform's size), got {size}")
  return size


def _flag(value: Any, what: str) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{what} must be a bool, got {type(value).__name__}:"
                    f" {value!r}")
  return bool(value)


def _check_common(recipe: Any) -> None:
  """Validates (and normalises) the fields NVFP4 and MXFP4 share."""
  object.__setattr__(recipe, "block_size",
                     _int(recipe.block_size, "block_size", 1))
  object.__setattr__(recipe, "hadamard", _hadamard(recipe.hadamard))
  object.__setattr__(recipe, "stochastic_gradients",
                     _flag(recipe.stochastic_gradients,
                           "stochastic_gradients"))


class _E2M1Operands:
  """What every FP4 recipe tells autocast: its operands are E2M1."""

  @property
  def fwd_dtype(self) -> np.dtype:
    """The operands' element format, E2M1 (autocast's audit logs it)."""
    return E2M1


@dataclasses.dataclass(frozen=True)
class NVFP4(_E2M1Operands):
  """NVIDIA's NVFP4 training recipe (arXiv 2509.25149).

  E2M1 elements in ``block_size``-element blocks, one E4M3 scale per block
  and one float32 scale per tensor. With ``amax`` the tensor's largest
  magnitude and ``amax_b`` the block's:

  * ``s_enc = 6 * 448 / amax`` (float32; 1 for an all-zero tensor),
  * ``s_b = e4m3(amax_b / 6 * s_enc)`` (round to nearest even, saturating,
    no lower clamp: a scale that rounds to zero decodes its block to zeros),
  * ``q = e2m1(x * s_enc / s_b)`` (round to nearest even, saturating at 6),
    decoded as ``q * s_b / s_enc``.

  Evaluated in float32 as ``s_b = e4m3(amax_b * (s_enc / 6))``, ``q =
  e2m1((x * s_enc) * (1 / s_b))``, decoded ``(q * s_b) * (1 / s_enc)``,
  with ``s_enc`` at most ``2**126`` (so that ``1 / s_enc`` is a normal
  number): codes and scales are the formulas' except within a float32
  rounding of a rounding boundary, and identical wherever the scales are
  powers of two.

  In a matmul (:func:`jmp_lite.fp4.dot_general`): activations and gradients
  in ``1 x block_size`` blocks along each GEMM's contraction; the weight in
  ``weight_blocks`` tiles, so that the forward's quantised weight is the
  very weight of the input-gradient GEMM; the weight-gradient GEMM's two
  operands rotated by a ``hadamard``-point random Hadamard transform along
  the tokens they contract over; gradients stochastically rounded (when a
  key is given).

  Attributes:
    block_size: elements per scale (16 in NVIDIA's format), >= 1.
    weight_blocks: ``(block_size, block_size)``: 2-D weight tiles; ``None``:
      1-D weight blocks, requantised along each GEMM's contraction.
    hadamard: the transform's size (a power of two), 0 for none.
    stochastic_gradients: round the gradients stochastically (given a key).

  Example:
    >>> import jmp_lite
    >>> r = jmp_lite.fp4.NVFP4()
    >>> r.block_size, r.weight_blocks, r.hadamard, r.stochastic_gradients
    (16, (16, 16), 16, True)
    >>> r == jmp_lite.fp4.NVFP4() and hash(r) == hash(jmp_lite.fp4.NVFP4())
    True
  """

  block_size: int = 16
  weight_blocks: tuple[int, int] | None = (16, 16)
  hadamard: int = 16
  stochastic_gradients: bool = True

  scale_format: ClassVar[str] = "e4m3"
  """The block scales' format (with a float32 scale per tensor)."""

  def __post_init__(self) -> None:
    _check_common(self)
    size = self.block_size
    tiles = self.weight_blocks
    if tiles is not None:
      if not isinstance(tiles, (tuple, list)) or len(tiles) != 2:
        raise TypeError("weight_blocks must be None or a pair of ints, got"
                        f" {tiles!r}")
      tiles = tuple(_int(t, "weight_blocks", 1) for t in tiles)
      if tiles != (size, size):
        raise ValueError(
            f"weight_blocks must be (block_size, block_size) = ({size},"
            f" {size}) or None, got {tiles}: the input-gradient GEMM reads"
            " the forward's tiles along their other edge")
    object.__setattr__(self, "weight_blocks", tiles)


@dataclasses.dataclass(frozen=True)
class MXFP4(_E2M1Operands):
  """OCP microscaling FP4: E2M1 elements, power-of-two (E8M0) block scales.

  Each ``block_size`` elements along a GEMM's contraction share the scale
  ``2**e``, the smallest power of two with ``amax_b / 2**e <= 6`` (the
  rounded-up MX rule, as for :class:`jmp_lite.fp8.MXFP8`), ``e`` clipped to
  E8M0's ``[-127, 127]``; ``q = e2m1(x / 2**e)`` (round to nearest even),
  decoded ``q * 2**e``. No per-tensor scale; weights use 1-D blocks (each
  GEMM requantises along its own contraction). A block holding inf or NaN
  decodes to NaN.

  Attributes:
    block_size: elements per scale (32 in the OCP format), >= 1.
    hadamard: the weight-gradient transform's size, 0 for none (default).
    stochastic_gradients: round the gradients stochastically (given a key).

  Example:
    >>> import jmp_lite
    >>> r = jmp_lite.fp4.MXFP4()
    >>> r.block_size, r.hadamard, r.weight_blocks, r.scale_format
    (32, 0, None, 'e8m0')
  """

  block_size: int = 32
  hadamard: int = 0
  stochastic_gradients: bool = True

  scale_format: ClassVar[str] = "e8m0"
  """The block scales' format (no per-tensor scale)."""

  weight_blocks: ClassVar[None] = None
  """Always 1-D weight blocks."""

  def __post_init__(self) -> None:
    _check_common(self)


Format = NVFP4 | MXFP4


@dataclasses.dataclass(frozen=True)
class PerDirection(_E2M1Operands):
  """A format per GEMM: forward, input gradient, weight gradient.

  ``None`` runs that GEMM in the operands' own dtype (bfloat16, say), so
  ``PerDirection(NVFP4(), NVFP4(), None)`` is NVFP4 forward and input
  gradient with a bfloat16 weight gradient. Each GEMM uses its own format's
  blocks, rounding and transform: the forward's weight is reused by the
  input gradient only when both are the same format with 2-D weight tiles.

  Attributes:
    forward: ``y = x . w``.
    input_grad: ``dx = g . w^T``.
    weight_grad: ``dw = x^T . g``.

  Example:
    >>> import jmp_lite
    >>> nv = jmp_lite.fp4.NVFP4()
    >>> r = jmp_lite.fp4.PerDirection(nv, nv, None)
    >>> r.weight_grad is None, r == jmp_lite.fp4.PerDirection(nv, nv, None)
    (True, True)
  """

  forward: Format | None
  input_grad: Format | None
  weight_grad: Format | None

  def __post_init__(self) -> None:
    for name in ("forward", "input_grad", "weight_grad"):
      value = getattr(self, name)
      if value is not None and not isinstance(value, (NVFP4, MXFP4)):
        raise TypeError(
            f"PerDirection's {name} must be a jmp_lite.fp4.NVFP4, MXFP4 or"
            f" None (the operands' own dtype), got {type(value).__name__}:"
            f" {value!r}")
    if self.forward is self.input_grad is self.weight_grad is None:
      raise ValueError("PerDirection needs an FP4 format for at least one"
                       " GEMM; for none, use jax.lax.dot_general itself")

Recipe = NVFP4 | MXFP4 | PerDirection

RECIPES: tuple[type, ...] = (NVFP4, MXFP4, PerDirection)
"""The FP4 recipe classes (policy rules and autocast accept them)."""


def check_recipe(recipe: Any) -> Recipe:
  """Returns ``recipe`` if it is an FP4 recipe, else raises a TypeError."""
  if not isinstance(recipe, RECIPES):
    raise TypeError(
        "Expected a jmp_lite.fp4.NVFP4, MXFP4 or PerDirection recipe, got"
        f" {type(recipe).__name__}: {recipe!r}")
  return recipe


def directions(recipe: Recipe) -> tuple[Format | None, Format | None,
                                        Format | None]:
  """``(forward, input_grad, weight_grad)`` formats of a recipe."""
  if isinstance(recipe, PerDirection):
    return recipe.forward, recipe.input_grad, recipe.weight_grad
  return recipe, recipe, recipe
