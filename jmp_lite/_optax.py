"""The one place jmp_lite builds optax gradient transformations.

optax annotates a state as ``OptState``, an alias for nests of arrays in
tuples, lists and dicts. At run time optax takes any pytree as a state, and
every jmp_lite transformation keeps its state in a registered dataclass
(:func:`jmp_lite.struct.dataclass`), which that alias does not name. Typing
the state as a pytree (``Any``) here, once, keeps each transformation's own
``init``/``update`` annotated with its real state class.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optax


def transformation(
    init: Callable[..., Any],
    update: Callable[..., tuple[Any, Any]],
) -> optax.GradientTransformationExtraArgs:
  """An optax transformation from an ``init`` and an ``update`` function.

  Args:
    init: ``init(params) -> state``; the state may be any pytree.
    update: ``update(updates, state, params=None, **extra) -> (updates,
      state)``.

  Returns:
    ``optax.GradientTransformationExtraArgs(init, update)``.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite._optax import transformation
    >>> double = transformation(lambda params: (),
    ...                         lambda u, s, params=None, **extra: (2 * u, s))
    >>> double.update(jnp.ones(2), double.init(None))[0]
    Array([2., 2.], dtype=float32)
  """
  return optax.GradientTransformationExtraArgs(init, update)
