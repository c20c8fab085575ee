"""FP4 matmuls for ``flax.nnx`` layers (imports Flax; load it on demand).

``nnx.Linear(..., dot_general=jmp_lite.fp4.nnx.Fp4DotGeneral(recipe,
rngs=nnx.Rngs(fp4=seed)))``: the module draws a new key from its stream at
every call (inside ``nnx.jit`` too), for stochastically rounded gradients
and fresh Hadamard signs; without ``rngs`` the backward pass is
deterministic.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from jmp_lite.fp4._dot import dot_general
from jmp_lite.fp4._recipes import check_recipe, Recipe

__all__ = ["Fp4DotGeneral", "dot_general_for"]


class Fp4DotGeneral(nnx.Module):
  """An nnx ``dot_general`` module that runs an FP4 recipe.

  Attributes:
    recipe: the FP4 recipe (static).
    rngs: an ``nnx.Rngs`` with an ``fp4`` stream (or ``None``).

  Example:
    >>> import jax, jax.numpy as jnp, jmp_lite
    >>> from flax import nnx
    >>> import jmp_lite.fp4.nnx as fp4_nnx
    >>> dot = fp4_nnx.Fp4DotGeneral(jmp_lite.fp4.NVFP4(), nnx.Rngs(fp4=0))
    >>> layer = nnx.Linear(16, 4, dot_general=dot, rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((2, 16))).shape
    (2, 4)
  """

  def __init__(self, recipe: Recipe, rngs: nnx.Rngs | None = None) -> None:
    self.recipe = check_recipe(recipe)
    if rngs is not None and not isinstance(rngs, nnx.Rngs):
      raise TypeError(
          "Fp4DotGeneral's rngs must be an nnx.Rngs with an 'fp4' stream"
          f" (nnx.Rngs(fp4=seed)), got {type(rngs).__name__}: {rngs!r}")
    if rngs is not None and "fp4" not in rngs:
      raise ValueError("Fp4DotGeneral's rngs needs an 'fp4' stream:"
                       " nnx.Rngs(fp4=seed)")
    self.rngs = rngs

  def __call__(self, lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any,
               precision: Any = None, preferred_element_type: Any = None,
               out_sharding: Any = None) -> jax.Array:
    """Runs :func:`jmp_lite.fp4.dot_general` with a fresh key.

    Args:
      lhs: the left operand.
      rhs: the right operand.
      dimension_numbers: as for ``jax.lax.dot_general``.
      precision: accepted and ignored.
      preferred_element_type: the result's dtype (default: the operands').
      out_sharding: applied to the result.

    Returns:
      The product.
    """
    key = None if self.rngs is None else self.rngs.fp4()
    return dot_general(self.recipe, key)(
        lhs, rhs, dimension_numbers, precision=precision,
        preferred_element_type=preferred_element_type,
        out_sharding=out_sharding)


def dot_general_for(recipe: Recipe, rngs: nnx.Rngs | None = None) -> Any:
  """The ``dot_general`` to give an nnx ``Linear``/``LinearGeneral``.

  Args:
    recipe: an FP4 recipe.
    rngs: an ``nnx.Rngs`` with an ``fp4`` stream, or ``None`` (a
      deterministic backward pass).

  Returns:
    A :class:`Fp4DotGeneral` with ``rngs``, or the stateless function.

  Raises:
    TypeError: if ``recipe`` is not an FP4 recipe.

  Example:
    >>> import jmp_lite, jmp_lite.fp4.nnx as fp4_nnx
    >>> callable(fp4_nnx.dot_general_for(jmp_lite.fp4.MXFP4()))
    True
  """
  recipe = check_recipe(recipe)
  if rngs is None:
    return dot_general(recipe)
  return Fp4DotGeneral(recipe, rngs)
