"""FP8 matmuls for ``flax.linen`` layers (imports Flax; load it on demand).

* Current scaling needs no module: ``nn.Dense(..., dot_general=
  jmp_lite.fp8.dot_general(jmp_lite.fp8.CurrentScaling()))``.
* Delayed scaling keeps a :class:`~jmp_lite.fp8.ScalingState` per matmul in
  the :data:`COLLECTION` variable collection: ``nn.Dense(...,
  dot_general_cls=jmp_lite.fp8.linen.dot_general_cls(recipe))``. ``init``
  creates the collection next to ``params``; ``apply`` reads it (it is never
  written in the forward pass, so it needs no ``mutable=``). Differentiate
  the loss with respect to it and pass that gradient to
  :func:`jmp_lite.fp8.commit`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax

from jmp_lite.fp8._dot import dot_general
from jmp_lite.fp8._recipes import check_recipe, DelayedScaling, Recipe

COLLECTION = "fp8"
"""The linen variable collection holding delayed-scaling states."""

VARIABLE = "scaling"
"""The variable's name inside its :class:`Fp8DotGeneral` module."""


class Fp8DotGeneral(nn.Module):
  """A linen ``dot_general`` module that runs an FP8 recipe.

  Flax's ``Dense``/``DenseGeneral``/``Einsum`` instantiate it through
  ``dot_general_cls`` inside their own call, so it becomes their child
  (``Dense_0/Fp8DotGeneral_0``) and its state lives at that path in the
  :data:`COLLECTION` collection, under :data:`VARIABLE`.

  Attributes:
    recipe: a :class:`~jmp_lite.fp8.CurrentScaling` or
      :class:`~jmp_lite.fp8.MXFP8` (no variables), or a
      :class:`~jmp_lite.fp8.DelayedScaling`.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, jmp_lite
    >>> import jmp_lite.fp8.linen as fp8_linen
    >>> recipe = jmp_lite.fp8.DelayedScaling(history=8)
    >>> layer = nn.Dense(4, dot_general_cls=fp8_linen.dot_general_cls(recipe))
    >>> variables = layer.init(jax.random.key(0), jnp.ones((2, 3)))
    >>> state = variables["fp8"]["Fp8DotGeneral_0"]["scaling"]
    >>> sorted(variables), state.history.shape
    (['fp8', 'params'], (3, 8))
  """

  recipe: Recipe

  @nn.compact
  def __call__(self, lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any,
               precision: Any = None, preferred_element_type: Any = None,
               out_sharding: Any = None) -> jax.Array:
    """Runs :func:`jmp_lite.fp8.dot_general` with this module's state.

    Args:
      lhs: the left operand.
      rhs: the right operand.
      dimension_numbers: as for ``jax.lax.dot_general``.
      precision: checked as ``jax.lax.dot_general`` checks it, then ignored.
      preferred_element_type: the result's dtype (default: the operands').
      out_sharding: passed to the forward matmul.

    Returns:
      The product.
    """
    recipe = check_recipe(self.recipe)
    state = None
    if isinstance(recipe, DelayedScaling):
      state = self.variable(COLLECTION, VARIABLE, recipe.init).value
    return dot_general(recipe, state)(
        lhs, rhs, dimension_numbers, precision=precision,
        preferred_element_type=preferred_element_type,
        out_sharding=out_sharding)


def dot_general_cls(recipe: Recipe
                    ) -> Callable[[], Fp8DotGeneral]:
  """The zero-argument factory to pass as a linen layer's ``dot_general_cls``.

  Args:
    recipe: an FP8 recipe.

  Returns:
    A callable returning a fresh :class:`Fp8DotGeneral` for ``recipe``.

  Raises:
    TypeError: if ``recipe`` is not an FP8 recipe.

  Example:
    >>> import jmp_lite, jmp_lite.fp8.linen as fp8_linen
    >>> fp8_linen.dot_general_cls(jmp_lite.fp8.CurrentScaling())().recipe.margin
    0
  """
  return functools.partial(Fp8DotGeneral, check_recipe(recipe))


def layer_fields(recipe: Recipe,
                 layer: Any = nn.Dense) -> dict[str, Any]:
  """The fields to set on a linen layer so that its matmuls run ``recipe``.

  For policy engines that configure layers by field. ``Dense`` and
  ``DenseGeneral`` get ``dot_general``/``dot_general_cls``; the attention
  layers (``MultiHeadDotProductAttention``, ``SelfAttention``) get the
  ``qkv_`` and ``out_`` variants, which their query/key/value/out
  ``DenseGeneral`` layers receive (one scaling state each). Current scaling sets
  the stateless function, delayed scaling the module factory (state in
  :data:`COLLECTION`); the other field is set to ``None`` so that it cannot
  take precedence.

  Args:
    recipe: an FP8 recipe.
    layer: the linen layer class (or instance) the fields are for.

  Returns:
    Field name -> value, for ``layer(**fields)`` or a ``dataclasses.replace``.

  Raises:
    TypeError: if ``recipe`` is not an FP8 recipe, or ``layer`` has no
      ``dot_general`` field.

  Example:
    >>> import flax.linen as nn, jmp_lite, jmp_lite.fp8.linen as fp8_linen
    >>> fields = fp8_linen.layer_fields(jmp_lite.fp8.DelayedScaling())
    >>> fields["dot_general"] is None, callable(fields["dot_general_cls"])
    (True, True)
    >>> for name in sorted(fp8_linen.layer_fields(
    ...     jmp_lite.fp8.CurrentScaling(), nn.MultiHeadDotProductAttention)):
    ...   print(name)
    out_dot_general
    out_dot_general_cls
    qkv_dot_general
    qkv_dot_general_cls
  """
  recipe = check_recipe(recipe)
  cls = layer if isinstance(layer, type) else type(layer)
  names = getattr(cls, "__dataclass_fields__", {})
  if isinstance(recipe, DelayedScaling):
    plain, factory = None, dot_general_cls(recipe)
  else:
    plain, factory = dot_general(recipe), None
  if "qkv_dot_general" in names and "out_dot_general" in names:
    return {"qkv_dot_general": plain, "qkv_dot_general_cls": factory,
            "out_dot_general": plain, "out_dot_general_cls": factory}
  if "dot_general" in names and "dot_general_cls" in names:
    return {"dot_general": plain, "dot_general_cls": factory}
  raise TypeError(
      f"{cls.__name__} has no dot_general/dot_general_cls fields to give an"
      " FP8 recipe (Dense, DenseGeneral and the attention layers have)")


__all__ = ["COLLECTION", "Fp8DotGeneral", "VARIABLE", "dot_general_cls",
           "layer_fields"]
