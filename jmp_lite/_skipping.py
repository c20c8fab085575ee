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

from jmp_lite import _jaxpr
from jmp_lite import dtypes as _dtypes

T = TypeVar("T")


def reduce_finite(finite: jax.Array, axis_name: Any,
                  governs: Any = None) -> jax.Array:
  """Makes ``finite`` agree on every device of ``axis_name``.

  One device's overflow must make every device skip and back off alike, or
  replicated params and scales drift apart. Under ``shard_map`` with
  ``check_vma=True`` JAX types each value with the mesh axes it may vary
  over: a decision that still varies over an axis the state it ``governs``
  does not is a forgotten ``axis_name=``, and raises (``lax.cond`` would
  type its result as replicated, so nothing else would catch it).

  Args:
    finite: a bool scalar.
    axis_name: a mapped axis name, or ``None``.
    governs: the state the decision updates (a guard's counters and loss
      scale), or ``None`` to skip the check.

  Returns:
    The bool scalar, true only where it is true on every device.

  Raises:
    ValueError: if the decision varies over a mesh axis ``governs`` does
      not (see above).

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite._skipping import reduce_finite
    >>> bool(reduce_finite(jnp.array(True), None))
    True
  """
  if axis_name is not None:
    finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name) > 0
  if governs is not None:
    _check_agreed(finite, axis_name, governs)
  return finite


def _check_agreed(finite: jax.Array, axis_name: Any, governs: Any) -> None:
  loose = set(_jaxpr.varying_axes(finite))
  for leaf in jax.tree.leaves(governs):
    loose -= _jaxpr.varying_axes(leaf)
  if not loose:
    return
  names = sorted(loose)
  wanted = names[0] if len(names) == 1 else tuple(names)
  given = ("" if axis_name is None else
           f" (axis_name={axis_name!r} does not cover them)")
  raise ValueError(
      f"The skip decision varies over the shard_map axis {names} but the"
      " state it updates (loss scale, skip counters) does not"
      f"{given}: each device would decide alone, and the replicated"
      " copies would drift apart (one backs off, the others do not). Pass"
      f" axis_name={wanted!r} to loss_scaled / skip_nonfinite /"
      " accumulate_gradients (or Preset.optimizer), so that every device"
      " agrees")


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
