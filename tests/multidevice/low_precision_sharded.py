"""Low-precision update rules on 8 forced host devices.

Run by tests/test_low_precision.py. Each check prints "ok <name>"; any
failure raises.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import chex  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jmp_lite  # noqa: E402

STEPS = 5


def make_opt(specs=None, state_specs=None):
  # Every rule at once: moments stored in bfloat16 with stochastic rounding,
  # params rounded stochastically and then compensated.
  return jmp_lite.kahan_summation(jmp_lite.stochastic_rounding(
      jmp_lite.state_dtypes(optax.adam(1e-3), "bf16", rounding="stochastic",
                            seed=4, specs=state_specs),
      seed=3, specs=specs))


def init_params():
  rng = np.random.default_rng(0)
  return {"w": jnp.asarray(rng.standard_normal((32, 6)), jnp.bfloat16),
          "b": jnp.asarray(rng.standard_normal(6), jnp.bfloat16)}


def grads_at(i):
  rng = np.random.default_rng(10 + i)
  return {"w": jnp.asarray(rng.standard_normal((32, 6)) * 1e-3, jnp.bfloat16),
          "b": jnp.asarray(rng.standard_normal(6) * 1e-3, jnp.bfloat16)}


def step_fn(opt):
  def step(params, state, grads):
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return step


def unsharded_run():
  opt = make_opt()
  step = jax.jit(step_fn(opt))
  params = init_params()
  state = opt.init(params)
  for i in range(STEPS):
    params, state = step(params, state, grads_at(i))
  return params, state


def param_specs():
  return {"w": P("data", None), "b": P()}


def state_specs(state):
  # Per-parameter arrays sharded like their params, scalars replicated.
  return jax.tree.map(lambda x: P("data", None) if x.ndim == 2 else P(),
                      state)


def check_jit_sharded(reference):
  mesh = jax.make_mesh((8,), ("data",))
  opt = make_opt()
  shard = lambda tree: jax.tree.map(
      lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree,
      state_specs(tree))
  params = shard(init_params())
  state = shard(opt.init(init_params()))
  step = jax.jit(step_fn(opt))
  for i in range(STEPS):
    params, state = step(params, state, shard(grads_at(i)))
  assert params["w"].sharding.is_equivalent_to(
      NamedSharding(mesh, P("data", None)), 2)
  chex.assert_trees_all_equal((params, state), reference)
  print("ok jit with sharded params equals unsharded")


def shard_map_run(with_specs):
  mesh = jax.make_mesh((8,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  params = init_params()
  plain_state = make_opt().init(params)
  inner_specs = state_specs(plain_state.inner_state.inner_state.inner_state)
  opt = (make_opt(param_specs(), inner_specs) if with_specs else make_opt())
  state = opt.init(params)
  specs = state_specs(state)
  step = jax.jit(jax.shard_map(
      step_fn(opt), mesh=mesh,
      in_specs=(param_specs(), specs, param_specs()),
      out_specs=(param_specs(), specs)))
  for i in range(STEPS):
    params, state = step(params, state, grads_at(i))
  return params, state


def check_shard_map_with_specs(reference):
  chex.assert_trees_all_equal(shard_map_run(True), reference)
  print("ok shard_map with specs equals unsharded")


def check_shard_map_without_specs(reference):
  params, _ = shard_map_run(False)
  assert not np.array_equal(np.asarray(params["w"]),
                            np.asarray(reference[0]["w"]))
  # The replicated bias needs no specs: it matches either way.
  np.testing.assert_array_equal(np.asarray(params["b"]),
                                np.asarray(reference[0]["b"]))
  # Each shard drew the same bits: identical shards round alike.
  mesh = jax.make_mesh((8,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  ones = {"w": jnp.ones((32, 6), jnp.bfloat16), "b": jnp.ones(6, jnp.bfloat16)}
  for specs, same in ((None, True), (param_specs(), False)):
    opt = jmp_lite.stochastic_rounding(optax.sgd(1e-3), specs=specs)
    state = opt.init(ones)
    step = jax.jit(jax.shard_map(
        step_fn(opt), mesh=mesh,
        in_specs=(param_specs(), P(), param_specs()),
        out_specs=(param_specs(), P())))
    new, _ = step(ones, state, ones)
    blocks = np.asarray(new["w"], np.float32).reshape(8, 4, 6)
    assert (blocks != 1).any()
    assert all(np.array_equal(blocks[0], b) for b in blocks) == same
  print("ok shard_map without specs repeats bits across shards")


def check_replicated_data_parallel():
  mesh = jax.make_mesh((8,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  opt = make_opt()
  params = init_params()
  state = opt.init(params)
  x = jnp.asarray(np.random.default_rng(5).standard_normal((64, 32)),
                  jnp.bfloat16)

  def local(params, state, x):
    grads = jax.grad(lambda p: jnp.mean(
        (x @ p["w"] + p["b"]).astype(jnp.float32) ** 2))(params)
    grads = jax.lax.pmean(grads, "data")
    params, state = step_fn(opt)(params, state, grads)
    return jax.tree.map(lambda a: a[None], (params, state))

  step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data")),
                               out_specs=P("data")))
  all_params, _ = step(params, state, x)
  for leaf in jax.tree.leaves(all_params):
    for i in range(1, 8):
      np.testing.assert_array_equal(np.asarray(leaf[i]), np.asarray(leaf[0]))
  assert not np.array_equal(np.asarray(all_params["w"][0]),
                            np.asarray(params["w"]))
  print("ok shard_map replicated params stay identical")


def check_init_keeps_param_sharding():
  """Buffers made by init() sit where their params do (they were whole
  arrays on device 0: a whole-model buffer on one device)."""
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  sharding = NamedSharding(mesh, P(None, "model"))
  params = {"w": jax.device_put(jnp.ones((16, 64), jnp.bfloat16), sharding)}
  kahan = make_opt().init(params)
  accumulated = jmp_lite.accumulate_gradients(optax.sgd(1e-3), every_k=2)
  for buffer in (kahan.compensation["w"],
                 accumulated.init(params).acc["w"]):
    assert buffer.sharding.is_equivalent_to(sharding, 2), buffer.sharding
  print("ok init buffers keep the params' sharding")


if __name__ == "__main__":
  assert jax.device_count() == 8, jax.devices()
  check_init_keeps_param_sharding()
  reference = unsharded_run()
  check_jit_sharded(reference)
  check_shard_map_with_specs(reference)
  check_shard_map_without_specs(reference)
  check_replicated_data_parallel()
