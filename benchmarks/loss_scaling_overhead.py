"""What does loss scaling + non-finite skipping cost in a donated train step?

Builds one Flax MLP train step (Adam) several ways, each jitted as real
training scripts jit it: ``jax.jit(step, donate_argnums=0)`` with params and
optimizer state in the donated state. For each variant it reports:

* extra bytes accessed over the plain donated step of the same compute dtype,
  in units of the gradients' bytes (XLA's cost model,
  ``compiled.cost_analysis()``);
* peak memory (``compiled.memory_analysis()``: arguments + unaliased outputs
  + temporaries) and its ratio to the plain step's;
* the wall-clock ratio to the plain step, timed interleaved (plain, a, b, ...,
  plain, a, b, ...) so that machine noise hits every variant alike: the
  median of the per-round ratios, with their range;
* how many times the step was traced over the whole run (moving loss-scale
  values must never recompile).

Run: ``python benchmarks/loss_scaling_overhead.py`` (``--help`` for sizes).
Needs the bench extra (``pip install -e ".[bench]"``) for the ``jmp`` anchor.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite
from _common import (
  compile_steps,
  interleaved_seconds,
  mlp,
  size_parser,
  tree_nbytes,
)

SCALE = 2.0**15


def build_variants(loss: Callable, compute: str,
                   lr: float) -> dict[str, tuple[Callable, Callable]]:
  """Returns name -> (init(params) -> state, step(state, x, y) -> state)."""
  adam = optax.adam(lr)
  variants: dict[str, tuple[Callable, Callable]] = {}

  def plain_init(params):
    return params, adam.init(params)

  def plain_step(state, x, y):
    params, opt_state = state
    grads = jax.grad(loss)(params, x, y)
    updates, opt_state = adam.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  variants["plain"] = (plain_init, plain_step)

  def with_opt(opt, uaa):
    def init(params):
      return params, opt.init(params)

    def step(state, x, y):
      params, opt_state = state
      _, grads = jmp_lite.scaled_value_and_grad(loss, opt_state)(params, x, y)
      if uaa:
        return jmp_lite.update_and_apply(opt, grads, opt_state, params)
      updates, opt_state = opt.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    return init, step

  def scaled(skip_with="auto"):
    return jmp_lite.loss_scaled(adam, jmp_lite.DynamicLossScale(SCALE),
                                skip_with=skip_with)

  variants["jmp_lite.update_and_apply"] = with_opt(scaled(), True)
  variants["update_and_apply, skip_with=select"] = with_opt(
      scaled("select"), True)
  variants["loss_scaled.update + apply_updates"] = with_opt(scaled(), False)

  # The manual, jmp-style recipe with jmp_lite's own states.
  def manual_init(params):
    return params, adam.init(params), jmp_lite.DynamicLossScale(SCALE)

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

  variants["manual jmp-style (jmp_lite)"] = (manual_init, manual_step)

  try:
    import jmp
  except ImportError:
    jmp = None
  if jmp is not None:
    # jmp's own state cannot go through jit(...).lower() (its __post_init__
    # validates placeholder leaves): its two arrays travel, the state is
    # rebuilt inside the step.
    def jmp_init(params):
      return (params, adam.init(params), jnp.asarray(SCALE, jnp.float32),
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

    variants["DeepMind jmp"] = (jmp_init, jmp_step)

  from flax.training.dynamic_scale import DynamicScale

  def flax_init(params):
    return params, adam.init(params), DynamicScale(scale=SCALE)

  def flax_step(state, x, y):
    params, opt_state, dyn = state
    dyn, finite, _, grads = dyn.value_and_grad(loss)(params, x, y)
    updates, new_opt_state = adam.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    pick = functools.partial(jnp.where, finite)
    params = jax.tree.map(pick, new_params, params)
    opt_state = jax.tree.map(pick, new_opt_state, opt_state)
    return params, opt_state, dyn

  variants["Flax DynamicScale"] = (flax_init, flax_step)

  aif = optax.apply_if_finite(adam, max_consecutive_errors=5)

  def aif_init(params):
    return params, aif.init(params)

  def aif_step(state, x, y):
    params, opt_state = state
    grads = jax.grad(loss)(params, x, y)
    updates, opt_state = aif.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  variants["optax.apply_if_finite (no scaling)"] = (aif_init, aif_step)
  return variants


DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
  parser = size_parser(__doc__.splitlines()[0], width=1024, depth=4,
                       batch=256)
  parser.add_argument("--compute", nargs="+", default=["f32", "f16"],
                      choices=["f32", "f16"],
                      help="compute dtypes to tabulate")
  args = parser.parse_args(argv)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((args.batch, args.width)), jnp.float32)
  y = jnp.asarray(rng.standard_normal((args.batch, args.width)), jnp.float32)

  def loss_for(dtype):
    model = mlp(args.width, args.depth, dtype)
    return model, (lambda p, x, y: jnp.mean((model.apply(p, x) - y) ** 2))

  model, _ = loss_for(jnp.float32)
  params = model.init(jax.random.key(0), x)
  grad_bytes = tree_nbytes(params)
  device = jax.devices()[0]
  print(f"MLP {args.depth}x{args.width}, batch {args.batch}, Adam, float32"
        f" params, on {device.platform} ({device.device_kind}); gradients ="
        f" {grad_bytes / 2**20:.1f} MiB; every step jitted with params and"
        f" optimizer state donated; {args.rounds} interleaved rounds of"
        f" {args.steps} steps")
  rows = []
  for compute in args.compute:
    variants = build_variants(loss_for(DTYPES[compute])[1], compute, 1e-4)
    if compute == "f32":
      # The bfloat16 plain step, for reference (needs no loss scaling).
      variants = dict(variants)
      variants["plain, bf16 compute"] = build_variants(
          loss_for(jnp.bfloat16)[1], "bf16", 1e-4)["plain"]
    jitted, stats = compile_steps(variants, params, x, y)
    states = {k: v.pop("state") for k, v in stats.items()}
    times = interleaved_seconds(
        {k: (lambda s, f=f: f(s, x, y)) for k, f in jitted.items()}, states,
        n_steps=args.steps, rounds=args.rounds)
    base = stats["plain"]
    # Per-round ratios: each round runs every variant back to back, so a
    # ratio within one round cancels most of the machine's load drift.
    ratios = {k: [t / b for t, b in zip(v, times["plain"], strict=True)]
              for k, v in times.items()}
    print(f"\n{compute} compute (extra bytes and ratios against the plain"
          f" donated {compute} step):\n")
    print("| variant | extra bytes / grad bytes | peak MiB | peak vs plain"
          " | time vs plain (median, min-max) | ms/step | traces |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in variants:
      st = stats[name]
      t = statistics.median(times[name])
      row = {
          "compute": compute, "variant": name,
          "extra_bytes_per_grad_bytes": (st["bytes"] - base["bytes"])
          / grad_bytes,
          "peak_mib": st["peak"] / 2**20,
          "peak_ratio": st["peak"] / base["peak"],
          "time_ratio": statistics.median(ratios[name]),
          "time_ratio_min": min(ratios[name]),
          "time_ratio_max": max(ratios[name]),
          "ms_per_step": 1000 * t, "traces": st["traces"][0],
      }
      rows.append(row)
      print(f"| {name} | {row['extra_bytes_per_grad_bytes']:.2f} |"
            f" {row['peak_mib']:.1f} | {row['peak_ratio']:.3f} |"
            f" {row['time_ratio']:.2f} ({row['time_ratio_min']:.2f}-"
            f"{row['time_ratio_max']:.2f}) | {row['ms_per_step']:.1f} |"
            f" {row['traces']} |")
  kind, why = jmp_lite.step.formulation(
      jmp_lite.loss_scaled(optax.adam(1e-4), jmp_lite.DynamicLossScale(
          SCALE)))
  print(f"\njmp_lite.update_and_apply on {device.platform}: {kind} ({why})")
  return rows


if __name__ == "__main__":
  main()
