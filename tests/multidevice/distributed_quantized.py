"""init_sharded and state_shardings for quantized_states on 8 host devices.

Run by tests/test_distributed.py. A row-sharded param whose last axis is
shorter than a block puts several rows in one block: the quantizer's
reshape of rows into blocks spans devices, which JAX's Explicit sharding
types refuse (ShardingTypeError). The states must still be made: leaves
that cannot take their param's sharding get one they can take. Each check
prints "ok <name>"; any failure raises.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jmp_lite  # noqa: E402
from jmp_lite.distributed import init_sharded, state_shardings  # noqa: E402

# (devices, shape of the row-sharded param): 16 < block_size=256, so one
# block holds 16 rows; with 64 rows over 8 devices (8 rows each) a block
# spans two devices.
CASES = [(8, (64, 16)), (4, (8, 16))]


def _step_of(opt):
  def step(params, state):
    grads = jax.tree.map(jnp.ones_like, params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return step


def check(axis_type: AxisType, bits: int) -> None:
  for devices, shape in CASES:
    mesh = jax.make_mesh((devices,), ("data",),
                         devices=jax.devices()[:devices],
                         axis_types=(axis_type,))
    params = {
        "w": jax.device_put(jnp.linspace(-1, 1, np.prod(shape)).reshape(
            shape), NamedSharding(mesh, P("data"))),
        "b": jax.device_put(jnp.ones(16), NamedSharding(mesh, P())),
    }
    opt = jmp_lite.quantized_states(optax.adam(1e-3), bits=bits)
    shardings = state_shardings(opt, params)
    state = init_sharded(opt, params)
    want = opt.init(jax.device_get(params))
    assert jax.tree.structure(state) == jax.tree.structure(want)
    for got, ref, sharding in zip(jax.tree.leaves(state),
                                  jax.tree.leaves(want),
                                  jax.tree.leaves(shardings), strict=True):
      assert got.dtype == ref.dtype, (got.dtype, ref.dtype)
      np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
      assert got.sharding.is_equivalent_to(sharding, got.ndim), (
          got.sharding, sharding)
      assert got.sharding.mesh == mesh
    # Leaves shaped like the param keep its rows sharding; packed 4-bit
    # codes (one row per param row) may keep it too, where JAX's sharding
    # types carry it through the quantizer; the others (per-block scales,
    # counters) are replicated.
    for leaf in jax.tree.leaves(state):
      spec = leaf.sharding.spec
      if leaf.shape == shape:
        assert leaf.sharding.is_equivalent_to(params["w"].sharding, 2), spec
      elif leaf.shape == (shape[0], shape[1] // 2) and spec == P("data", None):
        pass
      else:
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, P()),
                                              leaf.ndim), (leaf.shape, spec)
    if axis_type == AxisType.Auto:
      # And the state steps with the params (Explicit meshes: the
      # quantizer's own update is outside what this script checks).
      step = jax.jit(_step_of(opt))
      new, _ = step(params, state)
      ref_new, _ = step(jax.device_get(params), want)
      for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(ref_new),
                      strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
  print(f"ok {axis_type.name} {bits} bits")


if __name__ == "__main__":
  check(AxisType.Explicit, 8)
  check(AxisType.Explicit, 4)
  check(AxisType.Auto, 8)
