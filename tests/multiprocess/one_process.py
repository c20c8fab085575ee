"""init_sharded and device_bytes on 4 forced host devices, one process.

Run by tests/test_distributed.py; prints "ok <name>" per check.
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jmp_lite  # noqa: E402
from jmp_lite.diagnostics import tree_bytes  # noqa: E402
from jmp_lite.distributed import (
  device_bytes,  # noqa: E402
  init_sharded,  # noqa: E402
  state_shardings,  # noqa: E402
)


def optimizers():
  scaled = lambda: jmp_lite.loss_scaled(  # noqa: E731
      optax.adam(1e-3), jmp_lite.DynamicLossScale(2.0 ** 15))
  return {
      "loss_scaled": scaled(),
      "master(accumulate(loss_scaled))": jmp_lite.master_weights(
          jmp_lite.accumulate_gradients(scaled(), every_k=2)),
      "kahan(sgd)": jmp_lite.kahan_summation(optax.sgd(1e-3)),
      "stochastic_rounding(adam)": jmp_lite.stochastic_rounding(
          optax.adam(1e-3)),
      "state_dtypes(adam)": jmp_lite.state_dtypes(optax.adam(1e-3), "bf16"),
      "skip_nonfinite(adafactor)": jmp_lite.skip_nonfinite(
          optax.adafactor(1e-3)),
      "optax chain": optax.chain(optax.clip_by_global_norm(1.0),
                                 optax.adamw(1e-3)),
  }


def make_params(mesh):
  return {"w": jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data"))),
          "b": jax.device_put(jnp.ones((4,)), NamedSharding(mesh, P()))}


def step_fn(opt):
  def step(params, state):
    grads = jax.tree.map(jnp.ones_like, params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return jax.jit(step)


def check_init_sharded(axis_type):
  mesh = jax.make_mesh((4,), ("data",), axis_types=(axis_type,))
  params = make_params(mesh)
  replicated = NamedSharding(mesh, P())
  for name, opt in optimizers().items():
    state = init_sharded(opt, params)
    want = opt.init(params)
    # Same values and dtypes as an eager init.
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want),
                    strict=True):
      assert np.asarray(a).dtype == np.asarray(b).dtype, name
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for leaf in jax.tree.leaves(state):
      assert isinstance(leaf, jax.Array), (name, type(leaf))
      if leaf.shape == (8, 4):
        assert leaf.sharding.is_equivalent_to(params["w"].sharding, 2), name
      else:
        assert leaf.sharding.is_equivalent_to(replicated, leaf.ndim), (
            name, leaf.shape, leaf.sharding)
    # The abstract shardings are those of the state.
    for leaf, sharding in zip(jax.tree.leaves(state),
                              jax.tree.leaves(state_shardings(opt, params)),
                              strict=True):
      assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), name
    step_fn(opt)(params, state)
  print(f"ok init_sharded {axis_type.name}")


def check_restore_recipe():
  # The defect: an eager init as restore target commits the scalars to one
  # device and the next jitted step refuses them; init_sharded's does not.
  mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,))
  params = make_params(mesh)
  opt = optimizers()["loss_scaled"]
  step = step_fn(opt)
  with tempfile.TemporaryDirectory() as tmp:
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(f"{tmp}/c", (params, init_sharded(opt, params)))
    checkpointer.wait_until_finished()
    p, s = checkpointer.restore(f"{tmp}/c", (params, opt.init(params)))
    try:
      step(p, s)
    except ValueError as e:
      assert "incompatible devices" in str(e), e
    else:
      raise AssertionError("the eager target was expected to fail")
    p, s = checkpointer.restore(f"{tmp}/c",
                                (params, init_sharded(opt, params)))
    want = step(params, init_sharded(opt, params))
    got = step(p, s)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  print("ok restore into init_sharded")


def check_unsharded_and_errors():
  params = {"w": jnp.ones((8, 4))}
  opt = optimizers()["loss_scaled"]
  assert state_shardings(opt, params) is None
  state = init_sharded(opt, params)
  device = next(iter(params["w"].devices()))
  assert all(leaf.devices() == {device} for leaf in jax.tree.leaves(state))
  a = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2],
                    axis_types=(AxisType.Auto,))
  b = jax.make_mesh((2,), ("data",), devices=jax.devices()[2:],
                    axis_types=(AxisType.Auto,))
  two = {"w": jax.device_put(jnp.ones(4), NamedSharding(a, P("data"))),
         "v": jax.device_put(jnp.ones(4), NamedSharding(b, P("data")))}
  try:
    init_sharded(opt, two)
  except ValueError as e:
    assert "one mesh" in str(e), e
  else:
    raise AssertionError("params on two meshes were accepted")
  print("ok unsharded params and params on two meshes")


def check_device_bytes():
  mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,))
  params = make_params(mesh)
  per_device = device_bytes(params)
  # w: 8*4 float32 split 4 ways = 32 bytes; b: 4 float32 replicated = 16.
  assert per_device == {d: 48 for d in jax.devices()}, per_device
  assert tree_bytes(params) == 8 * 4 * 4 + 4 * 4
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      params)
  assert device_bytes(abstract) == per_device
  tied = {"a": params["w"], "b": params["w"], "host": np.ones(100)}
  assert device_bytes(tied) == {d: 32 for d in jax.devices()}
  print("ok device_bytes")


if __name__ == "__main__":
  check_init_sharded(AxisType.Auto)
  check_init_sharded(AxisType.Explicit)
  check_restore_recipe()
  check_unsharded_and_errors()
  check_device_bytes()
