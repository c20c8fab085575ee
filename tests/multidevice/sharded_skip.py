"""Runs on 8 forced host devices (see tests/test_sharding.py).

Each check prints one line "ok <name>"; any failure raises.
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


def make_opt(axis_name=None):
  return jmp_lite.loss_scaled(
      optax.adam(1e-2), jmp_lite.DynamicLossScale(2.0**10, period=3),
      axis_name=axis_name)


def loss_fn(params, x, y):
  return jnp.mean((jnp.tanh(x @ params["w"]) @ params["v"] - y) ** 2)


def init_params():
  rng = np.random.default_rng(0)
  return {"w": jnp.asarray(rng.standard_normal((16, 32)) * 0.2, jnp.float32),
          "v": jnp.asarray(rng.standard_normal((32, 8)) * 0.2, jnp.float32)}


def batch(n=64):
  rng = np.random.default_rng(1)
  return (jnp.asarray(rng.standard_normal((n, 16)), jnp.float32),
          jnp.asarray(rng.standard_normal((n, 8)), jnp.float32))


def jit_step(opt):
  @jax.jit
  def step(params, state, x, y):
    scale = jmp_lite.current_loss_scale(state)
    grads = jax.grad(lambda p: scale.scale(loss_fn(p, x, y)))(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return step


def check_data_parallel():
  mesh = jax.make_mesh((8,), ("data",))
  repl = NamedSharding(mesh, P())
  opt = make_opt()
  params = jax.device_put(init_params(), repl)
  state = jax.device_put(opt.init(params), repl)
  x, y = batch()
  x = x.at[0, 0].set(jnp.inf)        # Only device 0's shard of the batch.
  x = jax.device_put(x, NamedSharding(mesh, P("data")))
  y = jax.device_put(y, NamedSharding(mesh, P("data")))
  step = jit_step(opt)
  new_params, new_state = step(params, state, x, y)
  chex.assert_trees_all_equal(new_params, params)
  chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
  assert float(new_state.loss_scale.loss_scale) == 2.0**9
  assert new_params["w"].sharding.is_equivalent_to(repl, 2)
  print("ok data-parallel jit")


def check_data_model_mesh():
  # Auto axes: the classic GSPMD path (the data-parallel check above uses
  # jax.make_mesh's default, Explicit axes).
  mesh = jax.make_mesh((4, 2), ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  w_sharding = NamedSharding(mesh, P(None, "model"))
  v_sharding = NamedSharding(mesh, P("model", None))
  opt = make_opt()
  params = init_params()
  params = {"w": jax.device_put(params["w"], w_sharding),
            "v": jax.device_put(params["v"], v_sharding)}
  state = opt.init(params)
  update = jax.jit(opt.update)
  grads = jax.tree.map(lambda p: jnp.full_like(p, 2.0**10 * 1e-3), params)
  # A NaN in one model shard of one gradient: columns 16..31 of w live on the
  # model=1 devices only.
  bad = dict(grads, w=grads["w"].at[3, 20].set(jnp.nan))
  bad = {"w": jax.device_put(bad["w"], w_sharding),
         "v": jax.device_put(bad["v"], v_sharding)}
  assert not all(np.isfinite(np.asarray(s.data)).all()
                 for s in bad["w"].addressable_shards)
  assert sum(np.isfinite(np.asarray(s.data)).all()
             for s in bad["w"].addressable_shards) == 4
  updates, new_state = update(bad, state, params)
  for u in jax.tree.leaves(updates):
    np.testing.assert_array_equal(np.asarray(u), -0.0)
  chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
  assert float(new_state.loss_scale.loss_scale) == 2.0**9
  assert updates["w"].sharding.is_equivalent_to(w_sharding, 2)
  good_updates, good_state = update(grads, state, params)
  assert int(good_state.total_skips) == 0
  assert float(jnp.abs(good_updates["w"]).max()) > 0
  print("ok data x model mesh jit")


def shard_map_step(opt, axis_name):
  mesh = jax.make_mesh((8,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))

  def local(params, state, x, y):
    scale = jmp_lite.current_loss_scale(state)
    grads = jax.grad(lambda p: scale.scale(loss_fn(p, x, y)))(params)
    # Only device 3 overflows; the gradients are NOT averaged across devices,
    # so without axis_name each device would decide on its own.
    bad = jax.lax.axis_index("data") == 3
    grads = jax.tree.map(lambda g: jnp.where(bad, jnp.inf, g), grads)
    updates, state = opt.update(grads, state, params)
    new_params = optax.apply_updates(params, updates)
    stacked = lambda t: jax.tree.map(lambda a: a[None], t)
    return stacked(new_params), stacked(state)

  return jax.jit(jax.shard_map(
      local, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
      out_specs=(P("data"), P("data")), check_vma=False))


def check_shard_map(axis_name):
  opt = make_opt(axis_name)
  params = init_params()
  state = opt.init(params)
  x, y = batch()
  all_params, all_states = shard_map_step(opt, axis_name)(params, state, x, y)
  scales = np.asarray(all_states.loss_scale.loss_scale)
  skips = np.asarray(all_states.total_skips)
  if axis_name is None:
    # Demonstrates the failure axis_name prevents: devices disagree.
    assert sorted(set(scales.tolist())) == [2.0**9, 2.0**10], scales
    print("ok shard_map without axis_name diverges")
    return
  assert (scales == 2.0**9).all(), scales
  assert (skips == 1).all(), skips
  for leaf, ref in zip(jax.tree.leaves(all_params), jax.tree.leaves(params),
                       strict=True):
    for i in range(8):
      np.testing.assert_array_equal(np.asarray(leaf[i]), np.asarray(ref))
  print("ok shard_map with axis_name")


def check_update_and_apply_data_parallel():
  """Donated update_and_apply, NamedSharding: one device's NaN skips all."""
  mesh = jax.make_mesh((8,), ("data",))
  repl = NamedSharding(mesh, P())
  opt = make_opt()
  params = jax.device_put(init_params(), repl)
  state = jax.device_put(opt.init(params), repl)
  assert jmp_lite.step.formulation(opt)[0] == "cond"

  def step(params, state, x, y):
    loss, grads = jmp_lite.scaled_value_and_grad(loss_fn, state)(params, x, y)
    params, state = jmp_lite.update_and_apply(opt, grads, state, params)
    return params, state, loss

  def reference(params, state, x, y):
    _, grads = jmp_lite.scaled_value_and_grad(loss_fn, state)(params, x, y)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(step, donate_argnums=(0, 1))
  reference = jax.jit(reference)
  x0, y = batch()
  x = jax.device_put(x0, NamedSharding(mesh, P("data")))
  y = jax.device_put(y, NamedSharding(mesh, P("data")))
  want = reference(params, state, x, y)
  params, state, loss = step(params, state, x, y)
  chex.assert_trees_all_close((params, state), want, rtol=1e-6, atol=1e-8)
  assert params["w"].sharding.is_equivalent_to(repl, 2)
  bad_x = jax.device_put(x0.at[0, 0].set(jnp.inf),
                         NamedSharding(mesh, P("data")))
  before = jax.device_get((params, state.inner_state))
  params, state, _ = step(params, state, bad_x, y)
  chex.assert_trees_all_equal((params, state.inner_state), before)
  assert float(state.loss_scale.loss_scale) == 2.0**9
  assert int(state.total_skips) == 1
  print("ok update_and_apply data-parallel donated jit")


def check_update_and_apply_model_sharded():
  mesh = jax.make_mesh((4, 2), ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  shardings = {"w": NamedSharding(mesh, P(None, "model")),
               "v": NamedSharding(mesh, P("model", None))}
  opt = jmp_lite.master_weights(make_opt())
  params = jax.tree.map(jax.device_put, init_params(), shardings)
  state = opt.init(params)
  step = jax.jit(lambda p, s, g: jmp_lite.update_and_apply(opt, g, s, p),
                 donate_argnums=(0, 1))
  grads = jax.tree.map(lambda p: jnp.full_like(p, 2.0**10 * 1e-3), params)
  bad = jax.device_put(grads["w"].at[3, 20].set(jnp.nan), shardings["w"])
  before = jax.device_get(params)
  params, state = step(params, state, dict(grads, w=bad))
  chex.assert_trees_all_equal(params, before)
  assert int(jmp_lite.loss_scaled_state(state).total_skips) == 1
  assert params["w"].sharding.is_equivalent_to(shardings["w"], 2)
  params, state = step(params, state, grads)
  assert float(jnp.abs(params["w"] - before["w"]).max()) > 0
  assert params["v"].sharding.is_equivalent_to(shardings["v"], 2)
  print("ok update_and_apply model-sharded master weights")


def check_update_and_apply_shard_map():
  mesh = jax.make_mesh((8,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  opt = make_opt("data")

  def local(params, state, x, y):
    _, grads = jmp_lite.scaled_value_and_grad(loss_fn, state)(params, x, y)
    bad = jax.lax.axis_index("data") == 3
    grads = jax.tree.map(lambda g: jnp.where(bad, jnp.inf, g), grads)
    params, state = jmp_lite.update_and_apply(opt, grads, state, params)
    stacked = lambda t: jax.tree.map(lambda a: a[None], t)
    return stacked(params), stacked(state)

  step = jax.jit(jax.shard_map(
      local, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
      out_specs=(P("data"), P("data")), check_vma=False))
  params = init_params()
  state = opt.init(params)
  assert jmp_lite.step.formulation(opt)[0] == "cond"
  all_params, all_states = step(params, state, *batch())
  assert (np.asarray(all_states.loss_scale.loss_scale) == 2.0**9).all()
  assert (np.asarray(all_states.total_skips) == 1).all()
  for leaf, ref in zip(jax.tree.leaves(all_params), jax.tree.leaves(params),
                       strict=True):
    for i in range(8):
      np.testing.assert_array_equal(np.asarray(leaf[i]), np.asarray(ref))
  print("ok update_and_apply shard_map with axis_name")


def check_skip_nonfinite_pmap():
  opt = jmp_lite.skip_nonfinite(optax.sgd(0.1), axis_name="i")
  params = jnp.ones((8, 4))
  state = jax.pmap(opt.init)(params)

  def step(p, s, g):
    g = jnp.where(jax.lax.axis_index("i") == 5, jnp.nan, g)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s

  new_p, new_s = jax.pmap(step, axis_name="i")(params, state, jnp.ones((8, 4)))
  np.testing.assert_array_equal(np.asarray(new_p), np.asarray(params))
  assert np.asarray(new_s.total_skips).tolist() == [1] * 8
  print("ok pmap skip_nonfinite with axis_name")


def _fsdp_step(opt, via):
  """A shard_map step over 8 devices, check_vma on: each device holds a
  slice of the params and its gradients (FSDP-style); the optimizer state
  (loss scale, counters) is replicated. Device 3's gradients hold an inf."""
  mesh = jax.make_mesh((8,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  params = {"w": jnp.ones((16, 4))}
  state = opt.init(params)
  state_specs = jax.tree.map(lambda x: P("data") if jnp.ndim(x) else P(),
                             state)

  def local(params, state):
    bad = jax.lax.axis_index("data") == 3
    grads = jax.tree.map(lambda p: jnp.where(bad, jnp.inf, 8.0 * p), params)
    if via == "update":
      updates, state = opt.update(grads, state, params)
      return optax.apply_updates(params, updates), state
    return jmp_lite.update_and_apply(opt, grads, state, params)

  step = jax.jit(jax.shard_map(
      local, mesh=mesh, in_specs=(P("data"), state_specs),
      out_specs=(P("data"), state_specs)))
  return step(params, state), params


def check_forgotten_axis_name_is_an_error():
  """Without axis_name device 3 backed off alone (its copy of the scale
  halved, the others' not) and lax.cond typed the result replicated, so
  check_vma did not catch it: now a ValueError naming axis_name=."""
  for via in ("update_and_apply", "update"):
    try:
      _fsdp_step(make_opt(), via)
    except ValueError as e:
      assert "axis_name='data'" in str(e), e
    else:
      raise AssertionError(f"{via}: a forgotten axis_name was accepted")
    (new, state), params = _fsdp_step(make_opt("data"), via)
    chex.assert_trees_all_equal(jax.device_get(new), params)
    assert float(state.loss_scale.loss_scale) == 2.0**9
    assert int(state.total_skips) == 1
  print("ok shard_map check_vma: forgotten axis_name raises, given agrees")


def check_accumulate_gradients_agree_under_shard_map():
  """accumulate_gradients took no axis_name: devices could disagree about a
  bad micro-batch. With it, device 3's inf poisons every device's window."""
  def acc(axis_name):
    return jmp_lite.accumulate_gradients(make_opt("data"), every_k=2,
                                         axis_name=axis_name)

  try:
    _fsdp_step(acc(None), "update_and_apply")
  except ValueError as e:
    assert "axis_name='data'" in str(e), e
  else:
    raise AssertionError("accumulate_gradients without axis_name accepted")
  (new, state), params = _fsdp_step(acc("data"), "update_and_apply")
  chex.assert_trees_all_equal(jax.device_get(new), params)
  assert bool(state.poisoned) and int(state.mini_step) == 1
  print("ok accumulate_gradients axis_name under shard_map")


def check_explicit_axes_skip_keeps_shardings():
  """Under explicit mesh axes (jax.set_mesh) a guard over an optimizer whose
  updates differ from the gradients in dtype (float32 state for bfloat16
  params): the skipped branch's -0.0 updates failed the step branch's
  sharded types. A bad step now skips, a good one steps, shardings kept."""
  mesh = jax.make_mesh((4, 2), ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  specs = {"w": P("data", "model"), "v": P("model", None)}
  opt = jmp_lite.loss_scaled(
      jmp_lite.state_dtypes(optax.adam(1e-2), "float32"),
      jmp_lite.DynamicLossScale(2.0**10))

  def step(params, state, grads):
    # optax's own protocol (update_and_apply's own path skips otherwise).
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  with jax.set_mesh(mesh):
    params = jax.tree.map(
        lambda x, s: jax.device_put(x.astype(jnp.bfloat16),
                                    NamedSharding(mesh, s)),
        init_params(), specs)
    state = opt.init(params)
    step = jax.jit(step)
    good = jax.tree.map(lambda x: x * 1e-2, params)
    bad = {"w": good["w"] * jnp.inf, "v": good["v"]}
    kept, state = step(params, state, bad)
    chex.assert_trees_all_equal(jax.device_get(kept),
                                jax.device_get(params))
    assert int(state.total_skips) == 1
    moved, state = step(kept, state, good)
    assert not np.array_equal(np.asarray(moved["w"]), np.asarray(kept["w"]))
    for k, spec in specs.items():
      assert moved[k].sharding.spec == spec, (k, moved[k].sharding)
      assert state.inner_state.inner_state[0].mu[k].sharding.spec == spec
  print("ok explicit axes skip keeps shardings")


if __name__ == "__main__":
  assert jax.device_count() == 8, jax.devices()
  check_data_parallel()
  check_data_model_mesh()
  check_shard_map(None)
  check_shard_map("data")
  check_skip_nonfinite_pmap()
  check_update_and_apply_data_parallel()
  check_update_and_apply_model_sharded()
  check_update_and_apply_shard_map()
  check_forgotten_axis_name_is_an_error()
  check_accumulate_gradients_agree_under_shard_map()
  check_explicit_axes_skip_keeps_shardings()
