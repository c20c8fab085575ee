"""Many devices and hosts: sharded optimizer states and per-device memory.

An optimizer state made by calling ``optimizer.init(params)`` eagerly puts
its scalar leaves (optax's ``count``, the loss scale's counters, numpy
loss-scale leaves) on one device, or leaves them in host memory. A jitted
step then fails on sharded params with "Received incompatible devices for
jitted computation", and an orbax restore into such a target commits the
scalars to that one device. :func:`init_sharded` makes the state the way a
sharded step wants it: every leaf that mirrors a parameter sharded like that
parameter, everything else (scalars included) replicated on the params'
devices. :func:`state_shardings` gives those shardings without allocating
anything (for an orbax restore target, or ``jax.jit``'s ``out_shardings``).
:func:`device_bytes` reports memory per device, where
:func:`jmp_lite.diagnostics.tree_bytes` reports the global (logical) size.

Everything here works the same under ``jax.distributed.initialize()``: every
process calls it with its global arrays and gets the same global state.
"""

from __future__ import annotations

import collections
import numbers
from typing import Any, TypeVar

import jax
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jmp_lite import dtypes as _dtypes
from jmp_lite._checks import check_transformation

__all__ = ["device_bytes", "init_sharded", "state_shardings"]

_T = TypeVar("_T")


def _check_params(params: Any, who: str) -> None:
  """Raises for a leaf that is no array, number or ``ShapeDtypeStruct`` (a
  string: JAX said only that it could not interpret an argument)."""
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    if isinstance(x, (str, bytes)) or not (
        isinstance(x, (jax.Array, np.ndarray, np.generic, numbers.Number,
                       jax.ShapeDtypeStruct))):
      where = jax.tree_util.keystr(path) or "the root"
      raise TypeError(
          f"{who} expects params as a pytree of arrays (or"
          f" jax.ShapeDtypeStruct s), got a {type(x).__name__} leaf at"
          f" {where}: {x!r:.120}")


def _mesh_of(params: Any) -> Mesh | None:
  """The one mesh the params' ``NamedSharding`` leaves live on, if any."""
  meshes = []
  for x in jax.tree.leaves(params):
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding):
      mesh = sharding.mesh
      if not isinstance(mesh, Mesh):
        raise ValueError(
            "init_sharded needs params placed on devices (a concrete Mesh),"
            f" got a leaf sharded over an abstract mesh {mesh}")
      if all(mesh != m for m in meshes):
        meshes.append(mesh)
  if len(meshes) > 1:
    raise ValueError(
        "init_sharded expects the params on one mesh; they are on"
        f" {len(meshes)}: {meshes}. Put every parameter on the same mesh"
        " (jax.device_put(params, shardings))")
  return meshes[0] if meshes else None


def _spec(x: Any) -> PartitionSpec:
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, NamedSharding):
    return sharding.spec
  return PartitionSpec()  # an unsharded leaf: replicated


def _unsharded(params: Any) -> Any:
  """The params' shapes and dtypes, without their shardings (whose types
  ``Explicit`` axes would carry into the trace)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype),
                      params)


def _by_shape(params: Any, state_shapes: Any, mesh: Mesh) -> Any:
  """Fallback: a state leaf shaped like params of one spec gets that spec."""
  specs: dict[tuple[int, ...], set[PartitionSpec]] = collections.defaultdict(
      set)
  for x in jax.tree.leaves(params):
    specs[tuple(np.shape(x))].add(_spec(x))

  def pick(leaf: Any) -> NamedSharding:
    found = specs.get(tuple(leaf.shape), set())
    spec = next(iter(found)) if len(found) == 1 else PartitionSpec()
    return NamedSharding(mesh, spec)

  return jax.tree.map(pick, state_shapes)


def state_shardings(optimizer: optax.GradientTransformation,
                    params: Any) -> Any:
  """The shardings :func:`init_sharded` gives ``optimizer``'s state.

  Every state leaf computed from a parameter (optax's moments, a master
  copy, a Kahan compensation) is sharded like that parameter; every other
  leaf (step counts, the loss scale and its counters, seeds) is replicated
  over the params' mesh. Nothing is allocated: use it for an orbax restore
  target (``jax.ShapeDtypeStruct(shape, dtype, sharding=...)``) or for
  ``jax.jit``'s ``out_shardings``.

  How: ``optimizer.init`` is traced (``jax.eval_shape``) on the params'
  shapes with the params' ``PartitionSpec`` s on an ``Explicit``-axes copy
  of their mesh, where each array's sharding is part of its type and flows
  through ``zeros_like``, casts and reductions. If the trace is refused
  there (an op without a sharding rule, or a state that cannot take its
  params' sharding: :func:`jmp_lite.quantized_states` on a row-sharded
  param whose blocks span devices), a state leaf with the shape of
  parameters that share one spec gets that spec, and any other leaf (a
  quantized leaf's per-block scales, packed 4-bit codes) is replicated.

  Args:
    optimizer: any optax ``GradientTransformation`` (jmp_lite's included).
    params: the params (arrays, or ``jax.ShapeDtypeStruct`` s with a
      ``sharding``), ``NamedSharding`` on one mesh; leaves without a
      ``NamedSharding`` count as replicated.

  Returns:
    A pytree like the state, of ``NamedSharding`` on the params' mesh; or,
    if no parameter has a ``NamedSharding``, ``None`` (JAX places the state
    where ``jax.jit`` puts it: with the params).

  Raises:
    TypeError: if ``optimizer`` is not a gradient transformation, or a
      leaf of ``params`` is no array, number or ``jax.ShapeDtypeStruct``.
    ValueError: if the params are on more than one mesh.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jmp_lite
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from jmp_lite.distributed import state_shardings
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> params = jax.device_put({"w": jnp.ones((8, 2))},
    ...                         NamedSharding(mesh, P("data")))
    >>> opt = jmp_lite.loss_scaled(optax.adam(1e-3),
    ...                            jmp_lite.DynamicLossScale(2.0 ** 15))
    >>> shardings = state_shardings(opt, params)
    >>> shardings.inner_state[0].mu["w"].spec
    P('data', None)
    >>> shardings.loss_scale.loss_scale.spec
    P()
  """
  check_transformation(optimizer, "state_shardings")
  _check_params(params, "state_shardings")
  mesh = _mesh_of(params)
  if mesh is None:
    return None
  explicit = Mesh(mesh.devices, mesh.axis_names,
                  axis_types=(AxisType.Explicit,) * len(mesh.axis_names))
  typed = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(
          np.shape(x), x.dtype, sharding=NamedSharding(explicit, _spec(x))),
      params)
  try:
    with jax.set_mesh(explicit):
      shapes = jax.eval_shape(optimizer.init, typed)
  except Exception:
    # An init whose ops have no sharding rule under Explicit axes, or whose
    # state cannot take its params' sharding (JAX's ShardingTypeError, not
    # public: a quantizer's reshape of rows into blocks that span devices).
    # A real error in init recurs in the unsharded trace below.
    return _by_shape(params, jax.eval_shape(optimizer.init, _unsharded(
        params)), mesh)

  def on_mesh(leaf: Any) -> NamedSharding:
    sharding = getattr(leaf, "sharding", None)
    spec = (sharding.spec if isinstance(sharding, NamedSharding)
            else PartitionSpec())
    return NamedSharding(mesh, PartitionSpec(*spec))

  return jax.tree.map(on_mesh, shapes)


def init_sharded(optimizer: optax.GradientTransformation, params: Any) -> Any:
  """``optimizer.init(params)``, already sharded like the params.

  Use it wherever a sharded training loop makes an optimizer state: before
  the first step, and as the target of a checkpoint restore (orbax restores
  each leaf with its target's sharding). Leaves that mirror a parameter
  are sharded like it; scalars and other leaves (optax's ``count``, the
  loss scale and its counters, numpy loss-scale leaves, seeds) are
  replicated on the params' devices, so the state goes into a jitted step
  with the params without "incompatible devices" errors. It is one jitted
  call of ``optimizer.init`` with :func:`state_shardings` as its output
  shardings; under ``jax.distributed.initialize()`` every process calls it
  with the same global params.

  Args:
    optimizer: any optax ``GradientTransformation`` (jmp_lite's included).
    params: the params, sharded (``NamedSharding`` on one mesh) or not.

  Returns:
    The optimizer state. With params on no mesh, the state is where
    ``jax.jit(optimizer.init)`` puts it (with single-device params, on
    their device).

  Raises:
    TypeError: if ``optimizer`` is not a gradient transformation, or a
      leaf of ``params`` is no array, number or ``jax.ShapeDtypeStruct``.
    ValueError: if the params are on more than one mesh.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jmp_lite
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from jmp_lite.distributed import init_sharded
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> params = jax.device_put({"w": jnp.ones((8, 2))},
    ...                         NamedSharding(mesh, P("data")))
    >>> opt = jmp_lite.loss_scaled(optax.adam(1e-3),
    ...                            jmp_lite.DynamicLossScale(2.0 ** 15))
    >>> state = init_sharded(opt, params)
    >>> state.loss_scale.loss_scale.sharding.spec
    P()
    >>> state.inner_state[0].mu["w"].sharding.spec
    P('data', None)
  """
  check_transformation(optimizer, "init_sharded")
  _check_params(params, "init_sharded")
  shardings = state_shardings(optimizer, params)
  if shardings is None:
    return jax.jit(optimizer.init)(params)
  mesh = _mesh_of(params)
  if mesh is None or all(t != AxisType.Explicit for t in mesh.axis_types):
    return jax.jit(optimizer.init, out_shardings=shardings)(params)
  try:
    return jax.jit(optimizer.init, out_shardings=shardings)(params)
  except Exception:
    # Under Explicit axes a state that cannot take its params' sharding
    # fails the trace (see state_shardings). Run init on an Auto-axes view
    # of the same devices, where the compiler places what the types cannot
    # say, and put the state on the shardings found above.
    auto = Mesh(mesh.devices, mesh.axis_names,
                axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    moved = jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(auto, _spec(x))), params)
    on_auto = jax.tree.map(lambda n: NamedSharding(auto, n.spec), shardings)
    state = jax.jit(optimizer.init, out_shardings=on_auto)(moved)
    return jax.device_put(state, shardings)


def device_bytes(tree: Any) -> dict[Any, int]:
  """Bytes the array leaves of ``tree`` hold on each addressable device.

  :func:`jmp_lite.diagnostics.tree_bytes` reports the global (logical)
  size; this reports what each device holds: a leaf sharded 4 ways counts
  a quarter of its bytes on each of its devices, a replicated one its
  whole size on each. Computed from the shardings, with no device access;
  under ``jax.distributed.initialize()`` only this process's devices are
  listed. An array object that appears twice (tied weights) is counted
  once; numpy leaves (host memory) and leaves without a sharding count on
  no device.

  Args:
    tree: any pytree of ``jax.Array`` or ``jax.ShapeDtypeStruct`` (with a
      ``sharding``) leaves; other leaves are ignored.

  Returns:
    ``{device: bytes}`` over the devices that hold some leaf; the largest
    value is the per-device memory the tree needs.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from jmp_lite.distributed import device_bytes
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> w = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data")))
    >>> per_device = device_bytes({"w": w})
    >>> sum(per_device.values())  # 8 * 4 float32, split over the devices
    128
  """
  seen: set[int] = set()
  totals: dict[Any, int] = collections.defaultdict(int)
  for x in jax.tree.leaves(tree, is_leaf=_dtypes.is_live_state):
    sharding = getattr(x, "sharding", None)
    if (sharding is None or not hasattr(x, "dtype")
        or isinstance(x, np.ndarray) or id(x) in seen):
      continue
    seen.add(id(x))
    shard = int(np.prod(sharding.shard_shape(x.shape))) * x.dtype.itemsize
    for device in sharding.addressable_devices:
      totals[device] += shard
  return dict(totals)
