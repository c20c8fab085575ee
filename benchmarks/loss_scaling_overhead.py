"""What does loss scaling + non-finite skipping cost in a jitted train step?

Builds one jitted Flax MLP train step (Adam) several ways and reports, for each:

* extra bytes accessed over the plain step, in units of the gradients' bytes,
  from XLA's cost model (``jit(...).lower(...).compile().cost_analysis()``);
* the wall-clock ratio to the plain step, timed interleaved (plain, a, b, ...,
  plain, a, b, ...) so that machine noise hits every variant alike;
* whether moving scale values ever recompile (traces over the timed steps).

Run: ``python benchmarks/loss_scaling_overhead.py`` (``--help`` for sizes).
Needs the bench extra (``pip install -e ".[bench]"``) for the ``jmp`` anchor.
"""

from __future__ import annotations

import functools
import statistics
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite
from _common import bytes_accessed, interleaved_seconds, size_parser


class MLP(nn.Module):
  width: int
  depth: int

  @nn.compact
  def __call__(self, x):
    for _ in range(self.depth - 1):
      x = nn.relu(nn.Dense(self.width)(x))
    return nn.Dense(self.width)(x)


def _loss(model, params, x, y):
  return jnp.mean((model.apply(params, x) - y) ** 2)


def build_variants(model, lr: float) -> dict[str, tuple[Callable, Callable]]:
  """Returns name -> (init(params) -> state, step(state, x, y) -> state)."""
  adam = optax.adam(lr)
  loss = functools.partial(_loss, model)
  variants = {}

  # 1. Plain: no scaling, no check.
  def plain_init(params):
    return params, adam.init(params)

  def plain_step(state, x, y):
    params, opt_state = state
    grads = jax.grad(loss)(params, x, y)
    updates, opt_state = adam.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  variants["plain"] = (plain_init, plain_step)

  # 0. The finiteness check alone: plain step that also returns all_finite.
  def check_init(params):
    return params, adam.init(params), jnp.array(True)

  def check_step(state, x, y):
    params, opt_state, _ = state
    grads = jax.grad(loss)(params, x, y)
    finite = jmp_lite.all_finite(grads)
    updates, opt_state = adam.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, finite

  variants["all_finite only"] = (check_init, check_step)

  # 2. jmp_lite.loss_scaled with a dynamic scale.
  opt = jmp_lite.loss_scaled(adam, jmp_lite.DynamicLossScale(2.0**15))

  def ls_init(params):
    return params, opt.init(params)

  def ls_step(state, x, y):
    params, opt_state = state
    scale = jmp_lite.current_loss_scale(opt_state)
    grads = jax.grad(lambda p: scale.scale(loss(p, x, y)))(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  variants["jmp_lite.loss_scaled"] = (ls_init, ls_step)

  # 3. The manual, jmp-style path with jmp_lite's own states.
  def manual_init(params):
    return params, adam.init(params), jmp_lite.DynamicLossScale(2.0**15)

  def manual_step(state, x, y):
    params, opt_state, scale = state
    grads = jax.grad(lambda p: scale.scale(loss(p, x, y)))(params)
    grads = scale.unscale(grads)
    finite = jmp_lite.all_finite(grads)
    updates, new_opt_state = adam.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params, opt_state = jmp_lite.select_tree(
        finite, (new_params, new_opt_state), (params, opt_state))
    return params, opt_state, scale.adjust(finite)

  variants["jmp_lite manual"] = (manual_init, manual_step)

  # 4. DeepMind jmp (the anchor), same recipe with its own classes.
  try:
    import jmp
  except ImportError:
    jmp = None
  if jmp is not None:
    # jmp's own state cannot be passed through jit(...).lower() (its
    # __post_init__ validates placeholder leaves), so its two arrays travel
    # and the state is rebuilt inside the step.
    def jmp_init(params):
      return (params, adam.init(params), jnp.asarray(2.0**15, jnp.float32),
              jnp.zeros((), jnp.int32))

    def jmp_step(state, x, y):
      params, opt_state, scale_value, counter = state
      scale = jmp.DynamicLossScale(scale_value, counter)
      grads = jax.grad(lambda p: scale.scale(loss(p, x, y)))(params)
      grads = scale.unscale(grads)
      finite = jmp.all_finite(grads)
      updates, new_opt_state = adam.update(grads, opt_state, params)
      new_params = optax.apply_updates(params, updates)
      params, opt_state = jmp.select_tree(
          finite, (new_params, new_opt_state), (params, opt_state))
      scale = scale.adjust(finite)
      return params, opt_state, scale.loss_scale, scale.counter

    variants["jmp (anchor)"] = (jmp_init, jmp_step)

  # 5. Flax DynamicScale, as in Flax's own examples.
  from flax.training.dynamic_scale import DynamicScale

  def flax_init(params):
    return params, adam.init(params), DynamicScale()

  def flax_step(state, x, y):
    params, opt_state, dyn = state
    dyn, finite, _, grads = dyn.value_and_grad(loss)(params, x, y)
    updates, new_opt_state = adam.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    pick = functools.partial(jnp.where, finite)
    params = jax.tree.map(pick, new_params, params)
    opt_state = jax.tree.map(pick, new_opt_state, opt_state)
    return params, opt_state, dyn

  variants["flax DynamicScale"] = (flax_init, flax_step)

  # 6. optax.apply_if_finite (skips, no scaling).
  aif = optax.apply_if_finite(adam, max_consecutive_errors=5)

  def aif_init(params):
    return params, aif.init(params)

  def aif_step(state, x, y):
    params, opt_state = state
    grads = jax.grad(loss)(params, x, y)
    updates, opt_state = aif.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  variants["optax.apply_if_finite"] = (aif_init, aif_step)
  return variants


def update_only_costs(params: Any) -> dict[str, float]:
  """Bytes accessed by the optimizer update alone (gradients given as inputs).

  This isolates each wrapper's own cost from how XLA happens to fuse it with
  the backward pass.
  """
  adam = optax.adam(1e-4)

  def with_opt(opt):
    def f(p, s, g):
      u, s = opt.update(g, s, p)
      return optax.apply_updates(p, u), s
    return f, opt.init

  def manual(p, s, g):
    params_in = p
    opt_state, scale = s
    g = scale.unscale(g)
    finite = jmp_lite.all_finite(g)
    u, new_s = adam.update(g, opt_state, p)
    p, opt_state = jmp_lite.select_tree(
        finite, (optax.apply_updates(p, u), new_s), (params_in, opt_state))
    return p, (opt_state, scale.adjust(finite))

  fns = {
      "plain": with_opt(adam),
      "all_finite only": (
          lambda p, s, g: (*with_opt(adam)[0](p, s, g),
                           jmp_lite.all_finite(g)), adam.init),
      "jmp_lite.skip_nonfinite": with_opt(jmp_lite.skip_nonfinite(adam)),
      "jmp_lite.loss_scaled": with_opt(jmp_lite.loss_scaled(
          adam, jmp_lite.DynamicLossScale(2.0**15))),
      "jmp_lite manual": (manual, lambda p: (
          adam.init(p), jmp_lite.DynamicLossScale(2.0**15))),
      "optax.apply_if_finite": with_opt(
          optax.apply_if_finite(adam, max_consecutive_errors=5)),
  }
  out = {}
  for name, (f, init) in fns.items():
    out[name] = bytes_accessed(
        jax.jit(f).lower(params, init(params), params).compile())
  return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
  args = size_parser(__doc__.splitlines()[0], width=1024, depth=4,
                     batch=256).parse_args(argv)

  model = MLP(args.width, args.depth)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((args.batch, args.width)), jnp.float32)
  y = jnp.asarray(rng.standard_normal((args.batch, args.width)), jnp.float32)
  params = model.init(jax.random.key(0), x)
  grad_bytes = sum(p.size * p.dtype.itemsize for p in jax.tree.leaves(params))

  variants = build_variants(model, 1e-4)
  compiled, states, traces, costs = {}, {}, {}, {}
  for name, (init, step) in variants.items():
    traces[name] = 0

    def counted(state, x, y, step=step, name=name):
      traces[name] += 1
      return step(state, x, y)

    jitted = jax.jit(counted, donate_argnums=0)
    state = init(jax.tree.map(jnp.copy, params))
    costs[name] = bytes_accessed(jitted.lower(state, x, y).compile())
    compiled[name] = jitted
    states[name] = jax.block_until_ready(jitted(state, x, y))  # Warm-up.

  times = interleaved_seconds(
      {k: (lambda s, f=f: f(s, x, y)) for k, f in compiled.items()}, states,
      n_steps=args.steps, rounds=args.rounds)

  base_bytes = costs["plain"]
  base_time = statistics.median(times["plain"])
  rows = []
  for name in variants:
    rows.append({
        "variant": name,
        "extra_bytes_per_grad_bytes": (costs[name] - base_bytes) / grad_bytes,
        "time_ratio": statistics.median(times[name]) / base_time,
        "ms_per_step": 1000 * statistics.median(times[name]),
        "traces": traces[name],
    })
  print(f"MLP {args.depth}x{args.width}, batch {args.batch}, Adam, on"
        f" {jax.devices()[0].platform}; gradients = {grad_bytes / 2**20:.1f}"
        f" MiB; {args.rounds} interleaved rounds of {args.steps} steps\n")
  print(f"| {'variant':24} | extra bytes / grad bytes | time vs plain |"
        f" ms/step | compilations |")
  print(f"|{'-' * 26}|--------------------------|---------------|---------|"
        f"--------------|")
  for r in rows:
    print(f"| {r['variant']:24} | {r['extra_bytes_per_grad_bytes']:24.2f} |"
          f" {r['time_ratio']:13.2f} | {r['ms_per_step']:7.1f} |"
          f" {r['traces']:12d} |")
  update_costs = update_only_costs(params)
  print("\nOptimizer update alone (gradients as inputs):\n")
  print(f"| {'variant':24} | extra bytes / grad bytes |")
  print(f"|{'-' * 26}|--------------------------|")
  for name, value in update_costs.items():
    extra = (value - update_costs["plain"]) / grad_bytes
    print(f"| {name:24} | {extra:24.2f} |")
    rows.append({"variant": name + " (update only)",
                 "extra_bytes_per_grad_bytes": extra})
  return rows


if __name__ == "__main__":
  main()
