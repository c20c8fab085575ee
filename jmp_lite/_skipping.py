"""What every skipped step shares (private): one decision, no movement.

The guards (:mod:`jmp_lite.transforms`), gradient accumulation and
:func:`jmp_lite.update_and_apply` skip steps the same way: every device
agrees on whether the gradients were finite (:func:`reduce_finite`), and a
skipped step hands on ``-0.0`` updates (:func:`skip_updates`), which move no
param by a single bit.
"""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import jax.numpy as jnp

from jmp_lite import dtypes as _dtypes

T = TypeVar("T")


def reduce_finite(finite: jax.Array, axis_name: Any) -> jax.Array:
  """Makes ``finite`` agree on every device of ``axis_name``.

  One device's overflow must make every device skip and back off alike, or
  replicated params and scales drift apart.

  Args:
    finite: a bool scalar.
    axis_name: a mapped axis name, or ``None`` (then ``finite`` is returned).

  Returns:
    The bool scalar, true only where it is true on every device.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite._skipping import reduce_finite
    >>> bool(reduce_finite(jnp.array(True), None))
    True
  """
  if axis_name is None:
    return finite
  return jax.lax.pmin(finite.astype(jnp.int32), axis_name) > 0


def skip_updates(apply: jax.typing.ArrayLike, updates: T) -> T:
  """``updates`` where ``apply`` is true, else ``-0.0`` in every inexact leaf.

  ``-0.0``, not ``+0.0``: ``x + (-0.0) == x`` bit for bit for every ``x``,
  ``-0.0`` included (``+0.0`` would turn it into ``+0.0``), so
  ``optax.apply_updates`` leaves skipped params exactly as they were.

  Args:
    apply: a scalar bool.
    updates: an updates pytree.

  Returns:
    The selected updates (non-inexact leaves untouched).

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite._skipping import skip_updates
    >>> skip_updates(jnp.array(False), jnp.ones(2))
    Array([-0., -0.], dtype=float32)
  """
  def pick(u: Any) -> Any:
    if not _dtypes.is_inexact_array(u):
      return u
    return jnp.where(apply, u, jnp.asarray(-0.0, u.dtype))

  return jax.tree.map(pick, updates)
