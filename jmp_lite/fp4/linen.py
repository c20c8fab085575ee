"""FP4 matmuls for ``flax.linen`` layers (imports Flax; load it on demand).

``nn.Dense(..., dot_general_cls=jmp_lite.fp4.linen.dot_general_cls(recipe))``
runs the layer's matmul with :func:`jmp_lite.fp4.dot_general`, drawing the
backward pass's key from the :data:`RNG` stream: pass ``rngs={"fp4":
key}`` to ``apply`` (a new key each step) for stochastically rounded
gradients and fresh Hadamard signs. Without that stream (``init``, an
evaluation) the matmul takes no key: the same forward, a deterministic
backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax

from jmp_lite.fp4._dot import dot_general
from jmp_lite.fp4._recipes import check_recipe, Recipe

__all__ = ["RNG", "Fp4DotGeneral", "dot_general_cls", "layer_fields"]

RNG = "fp4"
"""The linen RNG stream the FP4 matmuls draw their keys from."""


class Fp4DotGeneral(nn.Module):
  """A linen ``dot_general`` module that runs an FP4 recipe.

  Flax's ``Dense``/``DenseGeneral``/``Einsum`` instantiate it through
  ``dot_general_cls``, so each layer's matmul draws its own key from the
  :data:`RNG` stream (when ``apply`` is given one).

  Attributes:
    recipe: an FP4 recipe.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, jmp_lite
    >>> import jmp_lite.fp4.linen as fp4_linen
    >>> layer = nn.Dense(4, dot_general_cls=fp4_linen.dot_general_cls(
    ...     jmp_lite.fp4.NVFP4()))
    >>> params = layer.init(jax.random.key(0), jnp.ones((2, 16)))
    >>> y = layer.apply(params, jnp.ones((2, 16)),
    ...                 rngs={"fp4": jax.random.key(1)})
    >>> y.shape
    (2, 4)
  """

  recipe: Recipe

  @nn.compact
  def __call__(self, lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any,
               precision: Any = None, preferred_element_type: Any = None,
               out_sharding: Any = None) -> jax.Array:
    """Runs :func:`jmp_lite.fp4.dot_general` with a key from :data:`RNG`.

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
    key = self.make_rng(RNG) if self.has_rng(RNG) else None
    return dot_general(self.recipe, key)(
        lhs, rhs, dimension_numbers, precision=precision,
        preferred_element_type=preferred_element_type,
        out_sharding=out_sharding)


def dot_general_cls(recipe: Recipe) -> Callable[[], Fp4DotGeneral]:
  """The zero-argument factory for a linen layer's ``dot_general_cls``.

  Args:
    recipe: an FP4 recipe.

  Returns:
    A callable returning a fresh :class:`Fp4DotGeneral` for ``recipe``.

  Raises:
    TypeError: if ``recipe`` is not an FP4 recipe.

  Example:
    >>> import jmp_lite, jmp_lite.fp4.linen as fp4_linen
    >>> fp4_linen.dot_general_cls(jmp_lite.fp4.MXFP4())().recipe.block_size
    32
  """
  return functools.partial(Fp4DotGeneral, check_recipe(recipe))


def layer_fields(recipe: Recipe, layer: Any = nn.Dense) -> dict[str, Any]:
  """The fields to set on a linen layer so that its matmuls run ``recipe``.

  ``Dense`` and ``DenseGeneral`` get ``dot_general_cls`` (and
  ``dot_general=None``); the attention layers their ``qkv_`` and ``out_``
  variants.

  Args:
    recipe: an FP4 recipe.
    layer: the linen layer class (or instance).

  Returns:
    Field name -> value.

  Raises:
    TypeError: if ``recipe`` is not an FP4 recipe, or ``layer`` has no
      ``dot_general`` field.

  Example:
    >>> import flax.linen as nn, jmp_lite, jmp_lite.fp4.linen as fp4_linen
    >>> sorted(fp4_linen.layer_fields(jmp_lite.fp4.NVFP4()))
    ['dot_general', 'dot_general_cls']
  """
  factory = dot_general_cls(recipe)
  cls = layer if isinstance(layer, type) else type(layer)
  names = getattr(cls, "__dataclass_fields__", {})
  if "qkv_dot_general" in names and "out_dot_general" in names:
    return {"qkv_dot_general": None, "qkv_dot_general_cls": factory,
            "out_dot_general": None, "out_dot_general_cls": factory}
  if "dot_general" in names and "dot_general_cls" in names:
    return {"dot_general": None, "dot_general_cls": factory}
  raise TypeError(
      f"{cls.__name__} has no dot_general/dot_general_cls fields to give an"
      " FP4 recipe (Dense, DenseGeneral and the attention layers have)")
