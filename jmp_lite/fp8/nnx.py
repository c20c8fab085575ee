"""FP8 matmuls for ``flax.nnx`` layers (imports Flax; load it on demand).

* Current scaling: ``nnx.Linear(..., dot_general=jmp_lite.fp8.dot_general(
  jmp_lite.fp8.CurrentScaling()))``.
* Delayed scaling: ``nnx.Linear(..., dot_general=
  jmp_lite.fp8.nnx.Fp8DotGeneral(recipe))``: the module is an attribute of
  the layer, so its :class:`ScalingStat` variable is part of the model's
  state (``nnx.state(model, ScalingStat)``). Differentiate with respect to
  it (``nnx.DiffState(0, nnx.Any(nnx.Param, ScalingStat))``) and fold the
  result in with :func:`commit`.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from jmp_lite.fp8 import _commit
from jmp_lite.fp8._dot import dot_general
from jmp_lite.fp8._recipes import check_recipe, DelayedScaling, Recipe


class ScalingStat(nnx.Variable):
  """An nnx variable holding one matmul's :class:`~jmp_lite.fp8.ScalingState`.

  Not a ``nnx.Param``: optimizers built with ``wrt=nnx.Param`` leave it alone.

  Example:
    >>> import jmp_lite, jmp_lite.fp8.nnx as fp8_nnx
    >>> v = fp8_nnx.ScalingStat(jmp_lite.fp8.DelayedScaling(history=4).init())
    >>> v.get_value().history.shape
    (3, 4)
  """


class Fp8DotGeneral(nnx.Module):
  """An nnx ``dot_general`` module that runs an FP8 recipe.

  Pass an instance as ``nnx.Linear(..., dot_general=...)`` or
  ``nnx.LinearGeneral(..., dot_general=...)``; one instance per layer (each
  matmul has its own scaling state).

  Attributes:
    recipe: the FP8 recipe (static).
    scaling: a :class:`ScalingStat` with the delayed-scaling state, or
      ``None`` for the stateless recipes (:class:`~jmp_lite.fp8.CurrentScaling`
      at any granularity, :class:`~jmp_lite.fp8.MXFP8`).

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> from flax import nnx
    >>> import jmp_lite.fp8.nnx as fp8_nnx
    >>> recipe = jmp_lite.fp8.DelayedScaling(history=8)
    >>> layer = nnx.Linear(3, 4, dot_general=fp8_nnx.Fp8DotGeneral(recipe),
    ...                    rngs=nnx.Rngs(0))
    >>> y = layer(jnp.ones((2, 3)))
    >>> y.shape, list(nnx.state(layer, fp8_nnx.ScalingStat))
    ((2, 4), ['dot_general'])
  """

  def __init__(self, recipe: Recipe) -> None:
    self.recipe = check_recipe(recipe)
    self.scaling = (ScalingStat(recipe.init())
                    if isinstance(recipe, DelayedScaling) else None)

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
    state = None if self.scaling is None else self.scaling.get_value()
    return dot_general(self.recipe, state)(
        lhs, rhs, dimension_numbers, precision=precision,
        preferred_element_type=preferred_element_type,
        out_sharding=out_sharding)


def commit(model: nnx.Module, grads: nnx.State, opt_state: Any = None, *,
           applied: Any = None) -> None:
  """Folds a step's observed amaxes into ``model``'s scaling states, in place.

  :func:`jmp_lite.fp8.commit` for nnx: reads the :class:`ScalingStat` part
  of ``grads`` (from ``nnx.grad`` with a ``DiffState`` that includes
  :class:`ScalingStat`) and updates the model's variables (nnx's own
  in-place style; works inside ``nnx.jit``).

  Args:
    model: the model holding :class:`Fp8DotGeneral` modules.
    grads: the gradient state returned by ``nnx.grad``.
    opt_state: the optimizer state after this step's update (an
      ``nnx.Optimizer``'s ``opt_state``), or ``None``.
    applied: as for :func:`jmp_lite.fp8.commit`.

  Raises:
    ValueError: if ``grads`` holds no :class:`ScalingStat` gradient while
      the model has scaling states (the ``DiffState`` left them out).

  Example:
    >>> import jax.numpy as jnp, jmp_lite, optax
    >>> from flax import nnx
    >>> import jmp_lite.fp8.nnx as fp8_nnx
    >>> recipe = jmp_lite.fp8.DelayedScaling(history=4)
    >>> model = nnx.Linear(3, 1, dot_general=fp8_nnx.Fp8DotGeneral(recipe),
    ...                    rngs=nnx.Rngs(0))
    >>> wrt = nnx.Any(nnx.Param, fp8_nnx.ScalingStat)
    >>> grads = nnx.grad(lambda m: m(jnp.ones((2, 3))).sum(),
    ...                  argnums=nnx.DiffState(0, wrt))(model)
    >>> fp8_nnx.commit(model, grads)
    >>> model.dot_general.scaling.get_value().history[:, 0].tolist()[::2]
    [1.0, 1.0]
  """
  state = nnx.state(model, ScalingStat)
  observed = nnx.filter_state(grads, ScalingStat)
  if jax.tree.leaves(state) and not jax.tree.leaves(observed):
    raise ValueError(
        "grads holds no gradient for the fp8 scaling states: differentiate"
        " with nnx.DiffState(0, nnx.Any(nnx.Param, fp8.nnx.ScalingStat))")
  nnx.update(model, _commit.commit(state, observed, opt_state,
                                   applied=applied))


def dot_general_for(recipe: Recipe) -> Any:
  """The ``dot_general`` to give an nnx ``Linear``/``LinearGeneral``.

  Args:
    recipe: an FP8 recipe.

  Returns:
    A stateless function for :class:`~jmp_lite.fp8.CurrentScaling` and
    :class:`~jmp_lite.fp8.MXFP8`, a fresh
    :class:`Fp8DotGeneral` module (one per layer!) for delayed scaling.

  Raises:
    TypeError: if ``recipe`` is not an FP8 recipe.

  Example:
    >>> import jmp_lite, jmp_lite.fp8.nnx as fp8_nnx
    >>> type(fp8_nnx.dot_general_for(jmp_lite.fp8.DelayedScaling())).__name__
    'Fp8DotGeneral'
  """
  recipe = check_recipe(recipe)
  if isinstance(recipe, DelayedScaling):
    return Fp8DotGeneral(recipe)
  return dot_general(recipe)


__all__ = ["Fp8DotGeneral", "ScalingStat", "commit", "dot_general_for"]
