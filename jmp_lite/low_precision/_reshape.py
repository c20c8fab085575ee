"""Reshapes of state arrays that keep the shardings in their types.

Under ``jax.set_mesh`` with ``Explicit`` mesh axes (what ``jax.make_mesh``
gives by default), a sharded array's sharding is part of its type, and JAX
refuses a reshape whose result sharding it cannot infer (merging a sharded
dimension with others, splitting one across two). The block layout of
:mod:`._blockwise` does both, so its reshapes go through :func:`reshape`,
which names the result's sharding: a group of dimensions merged or split
keeps the sharding of its leading dimension when the shards stay contiguous
runs of elements; otherwise that group comes out replicated (JAX moves the
data; the values are the same). Without a sharded type (one device, classic
``jit`` sharding propagation, inside ``shard_map``), it is a plain reshape.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jmp_lite._jaxpr import type_sharding


def _parts(mesh: Any, entry: Any) -> int:
  """How many shards a spec entry (an axis name or a tuple of them) makes."""
  names = entry if isinstance(entry, tuple) else (entry,)
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
  return int(np.prod([sizes[n] for n in names]))


def _groups(old: tuple[int, ...], new: tuple[int, ...]
            ) -> list[tuple[list[int], list[int]]]:
  """The reshape's groups: the fewest consecutive dimensions of ``old`` and
  ``new`` with equal products (sizes at least 1)."""
  groups = []
  i = j = 0
  while i < len(old) or j < len(new):
    gi, gj, a, b = [], [], 1, 1
    if i < len(old):
      a, i = a * old[i], i + 1
      gi.append(i - 1)
    if j < len(new):
      b, j = b * new[j], j + 1
      gj.append(j - 1)
    while a != b:
      if a < b:
        a, i = a * old[i], i + 1
        gi.append(i - 1)
      else:
        b, j = b * new[j], j + 1
        gj.append(j - 1)
    groups.append((gi, gj))
  return groups


def reshaped_spec(old: tuple[int, ...], new: tuple[int, ...],
                  spec: tuple[Any, ...], mesh: Any) -> tuple[Any, ...]:
  """The spec of ``new``-shaped data laid out as ``old``-shaped data sharded
  by ``spec``: per group of dimensions the reshape merges or splits, the
  leading old dimension's entry on the leading new one, when it is the only
  sharded one in the group and the new dimension divides into its shards.

  Example:
    >>> import jax
    >>> from jmp_lite.low_precision._reshape import reshaped_spec
    >>> mesh = jax.sharding.AbstractMesh((4,), ("x",))
    >>> reshaped_spec((64, 4096), (64, 16, 256), (None, "x"), mesh)
    (None, 'x', None)
    >>> reshaped_spec((2, 64, 512), (128, 512), (None, "x", None), mesh)
    (None, None)
  """
  out: list[Any] = [None] * len(new)
  for gi, gj in _groups(old, new):
    sharded = [d for d in gi if spec[d] is not None]
    lead_old = next((d for d in gi if old[d] != 1), None)
    lead_new = next((d for d in gj if new[d] != 1), None)
    # A shard of the old group is a contiguous run of its elements; it is
    # one of the new group's when the leading new dimension splits evenly.
    if (len(sharded) == 1 and sharded[0] == lead_old and lead_new is not None
        and new[lead_new] % _parts(mesh, spec[sharded[0]]) == 0):
      out[lead_new] = spec[sharded[0]]
  return tuple(out)


def reshape(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """``x.reshape(shape)``, naming the result's sharding where ``x``'s type
  has one (:func:`reshaped_spec`).

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite.low_precision._reshape import reshape
    >>> reshape(jnp.arange(6), (2, 3)).shape
    (2, 3)
  """
  shape = tuple(int(s) for s in shape)
  sharding = type_sharding(x)
  if sharding is None or tuple(x.shape) == shape or 0 in shape:
    return x.reshape(shape)
  mesh = sharding.mesh
  spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
  out = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
      *reshaped_spec(tuple(x.shape), shape, spec, mesh)))
  return jax.lax.reshape(x, shape, out_sharding=out)


def sharded_like(y: jax.Array, x: jax.Array) -> jax.Array:
  """``y`` resharded to ``x``'s type sharding, dimension by dimension where
  ``y``'s size divides into the same shards (a dimension that does not is
  left unsharded); ``y`` itself where ``x``'s type has none.

  Codes computed from blocks that span devices come out of
  :func:`reshape` replicated; stored, they take their param's sharding
  (from a replicated array, a local slice).

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite.low_precision._reshape import sharded_like
    >>> sharded_like(jnp.ones(2), jnp.zeros(4)).shape
    (2,)
  """
  sharding = type_sharding(x)
  if sharding is None or y.ndim != x.ndim:
    return y
  mesh = sharding.mesh
  spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
  spec = tuple(e if e is None or y.shape[d] % _parts(mesh, e) == 0 else None
               for d, e in enumerate(spec))
  current = type_sharding(y)
  have = (() if current is None else tuple(current.spec))
  if have + (None,) * (y.ndim - len(have)) == spec:
    return y
  return jax.sharding.reshard(y, jax.sharding.PartitionSpec(*spec))
