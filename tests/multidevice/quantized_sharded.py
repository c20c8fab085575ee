"""quantized_states on 4 forced host devices, params sharded by rows.

Run by tests/test_quantized_states.py. Each check prints "ok <name>"; any
failure raises.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import chex  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jmp_lite  # noqa: E402
from jmp_lite.low_precision import QuantizedArray  # noqa: E402

STEPS = 4
ROWS = P("data", None)
# A last axis of two blocks, one shorter than a block (two rows per block:
# each device's 8 rows hold 4 whole blocks) and a replicated bias.
SHAPES = {"w": (32, 512), "v": (32, 128), "b": (512,)}


def param_specs():
  return {"w": ROWS, "v": ROWS, "b": P()}


def make_opt(bits, specs=None):
  # The issue 31 recipe: bfloat16 params rounded stochastically over Adam
  # moments stored in `bits`, the codes rounded stochastically too.
  return jmp_lite.stochastic_rounding(
      jmp_lite.quantized_states(optax.adam(1e-3), bits=bits, seed=5,
                                specs=specs),
      seed=3, specs=specs)


def init_params():
  rng = np.random.default_rng(0)
  return {k: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
          for k, s in SHAPES.items()}


def grads_at(i):
  rng = np.random.default_rng(10 + i)
  return {k: jnp.asarray(rng.standard_normal(s) * 1e-2, jnp.bfloat16)
          for k, s in SHAPES.items()}


def state_specs(state):
  # A quantized moment's codes and scales are split by rows like its param
  # (the blocks follow the last axis); scalars and 1-D leaves replicate.
  def spec(x):
    if isinstance(x, QuantizedArray):
      s = ROWS if len(x.shape) == 2 else P()
      return dataclasses.replace(x, codes=s, scales=s, outliers=s, where=s,
                                 form=P())
    return P()
  return jax.tree.map(spec, state,
                      is_leaf=lambda x: isinstance(x, QuantizedArray))


def adam_state(state: Any) -> Any:
  """Adam's (quantized) state inside stochastic_rounding's and ours."""
  return state.inner_state.inner_state[0]


def step_fn(opt):
  def step(params, state, grads):
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return step


def unsharded_run(bits):
  opt = make_opt(bits)
  step = jax.jit(step_fn(opt))
  params = init_params()
  state = opt.init(params)
  for i in range(STEPS):
    params, state = step(params, state, grads_at(i))
  return params, state


def mesh():
  return jax.make_mesh((4,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))


def check_shard_map(bits, reference):
  opt = make_opt(bits, param_specs())
  params = init_params()
  state = opt.init(params)
  specs = state_specs(state)
  step = jax.jit(jax.shard_map(
      step_fn(opt), mesh=mesh(),
      in_specs=(param_specs(), specs, param_specs()),
      out_specs=(param_specs(), specs)))
  for i in range(STEPS):
    params, state = step(params, state, grads_at(i))
  # The codes changed from init's and every moment is quantized: the
  # comparison below is of real codes, not of untouched buffers.
  mu = adam_state(state).mu
  assert isinstance(mu["w"], QuantizedArray) and mu["w"].bits == bits
  assert np.any(np.asarray(mu["w"].codes) != np.asarray(
      adam_state(make_opt(bits).init(init_params())).mu["w"].codes))
  chex.assert_trees_all_equal((params, state), reference)
  print(f"ok shard_map {bits} bits equals unsharded")


def check_shard_map_without_specs_differs(bits, reference):
  opt = make_opt(bits)
  params = init_params()
  state = opt.init(params)
  specs = state_specs(state)
  step = jax.jit(jax.shard_map(
      step_fn(opt), mesh=mesh(),
      in_specs=(param_specs(), specs, param_specs()),
      out_specs=(param_specs(), specs)))
  for i in range(STEPS):
    params, state = step(params, state, grads_at(i))
  # Without specs every shard draws the bits of shard 0's indices: the
  # sharded codes differ from the unsharded run's; the replicated bias's
  # match.
  ref_mu = adam_state(reference[1]).mu
  mu = adam_state(state).mu
  assert not np.array_equal(np.asarray(mu["w"].codes),
                            np.asarray(ref_mu["w"].codes))
  np.testing.assert_array_equal(np.asarray(mu["b"].codes),
                                np.asarray(ref_mu["b"].codes))
  print(f"ok shard_map {bits} bits without specs differs")


def check_jit_sharded(bits, reference):
  m = mesh()
  opt = make_opt(bits)
  put = lambda tree, specs: jax.tree.map(
      lambda x, s: jax.device_put(x, NamedSharding(m, s)), tree, specs)
  params = put(init_params(), param_specs())
  state = opt.init(init_params())
  state = put(state, state_specs(state))
  step = jax.jit(step_fn(opt))
  for i in range(STEPS):
    params, state = step(params, state, put(grads_at(i), param_specs()))
  chex.assert_trees_all_equal((params, state), reference)
  print(f"ok jit with sharded params {bits} bits equals unsharded")


def check_preset(bits):
  # preset("O3", state_bits=...) passes specs (and a seed of its own) to
  # its quantized states: it drew shard 0's bits on every shard.
  import jmp_lite.presets
  pre = jmp_lite.presets.preset("O3", half="bf16", state_bits=bits,
                                compensation="stochastic")

  def run(specs):
    opt = pre.optimizer(optax.adam(1e-3), seed=7, specs=specs,
                        axis_name=None if specs is None else "data")
    step = step_fn(opt)
    params = init_params()
    state = opt.init(params)
    if specs is None:
      step = jax.jit(step)
    else:
      st = state_specs(state)
      step = jax.jit(jax.shard_map(
          step, mesh=mesh(), in_specs=(specs, st, specs),
          out_specs=(specs, st)))
    for i in range(STEPS):
      params, state = step(params, state, grads_at(i))
    return params, state

  # Leaves: the guard's static axis_name differs between the two.
  chex.assert_trees_all_equal(jax.tree.leaves(run(param_specs())),
                              jax.tree.leaves(run(None)))
  print(f"ok preset O3 {bits} bits with specs equals unsharded")


# Under explicit mesh axes (jax.make_mesh's default, with jax.set_mesh) the
# sharding is in each array's type: shapes split along every kind of axis,
# each shard a whole number of blocks.
EXPLICIT = {"cols": ((32, 1024), P(None, "data")),
            "rows": ((32, 128), P("data", None)),
            "bias": ((1024,), P("data")),
            "heads": ((2, 8, 256), P(None, "data", None))}


def check_explicit_sharded(bits):
  shapes = {k: s for k, (s, _) in EXPLICIT.items()}
  specs = {k: p for k, (_, p) in EXPLICIT.items()}
  rng = np.random.default_rng(1)
  params0 = {k: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
             for k, s in shapes.items()}
  grads = [{k: jnp.asarray(rng.standard_normal(s) * 1e-2, jnp.bfloat16)
            for k, s in shapes.items()} for _ in range(STEPS)]

  def run(opt, m=None):
    # Copies: the step donates its params.
    put = (lambda t: jax.tree.map(jnp.copy, t)) if m is None else (
        lambda t: jax.tree.map(
            lambda x, s: jax.device_put(x, NamedSharding(m, s)), t, specs))
    params = put(params0)
    state = jax.jit(opt.init)(params)
    step = jax.jit(step_fn(opt), donate_argnums=(0, 1))
    for g in grads:
      params, state = step(params, state, put(g))
    return params, state

  explicit = jax.make_mesh((4,), ("data",),
                           axis_types=(jax.sharding.AxisType.Explicit,))
  for name, make in (
      ("quantized_states", lambda: make_opt(bits)),
      ("quantized_adam", lambda: jmp_lite.low_precision.quantized_adam(
          1e-3, bits=bits, kernel="xla"))):
    reference = run(make())
    with jax.set_mesh(explicit):
      # quantized_adam's default kernel takes the XLA path here.
      opt = make() if name == "quantized_states" else (
          jmp_lite.low_precision.quantized_adam(1e-3, bits=bits))
      params, state = run(opt, explicit)
    chex.assert_trees_all_equal(jax.device_get((params, state)),
                                jax.device_get(reference))
    # Each moment's codes are split as its param is: no device holds all.
    mu = (adam_state(state) if name == "quantized_states"
          else state.inner_state[0]).mu
    for k, spec in specs.items():
      assert mu[k].codes.sharding.spec == spec, (name, k, mu[k].codes.sharding)
      assert params[k].sharding.spec == spec, (name, k, params[k].sharding)
    print(f"ok explicit axes {name} {bits} bits equals unsharded, codes"
          " sharded like the params")


def main():
  assert jax.device_count() == 4, jax.devices()
  references = {bits: unsharded_run(bits) for bits in (8, 4)}
  for bits in (8, 4):
    check_shard_map(bits, references[bits])
    check_jit_sharded(bits, references[bits])
  check_shard_map_without_specs_differs(8, references[8])
  for bits in (8, 4):
    check_explicit_sharded(bits)
  check_preset(8)


if __name__ == "__main__":
  main()
