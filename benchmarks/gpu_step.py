"""Which skip formulation is cheaper on this accelerator: cond or select?

jmp_lite's guards compile a skipped step one of two ways (``skip_with=``):
one ``lax.cond`` around the update (nothing runs on a skipped step, but the
predicate decides a branch) or ``lax.select`` over the inner optimizer's
results (branch-free, fused into the optimizer's kernels where the backend
fuses it). ``skip_with="auto"`` picks ``"cond"`` on the CPU, where it is
measured cheaper, and ``"select"`` elsewhere, unmeasured. This script
measures both on whatever device JAX runs on, with the seeds' MLP (three
Dense layers of width 4096, batch 512, as in PyTorch's AMP recipe; smaller
on the CPU), every step jitted
with params and optimizer state donated, and prints for each formulation, of
``jmp_lite.update_and_apply`` and of ``loss_scaled.update`` +
``optax.apply_updates``: XLA's bytes accessed and peak memory against the
plain donated step, the ``conditional`` ops left in the compiled program
(on a GPU each one reads its predicate back to the host unless XLA puts it
in a CUDA graph), and interleaved wall-clock ratios (median, with the spread
over rounds). It then states which formulation was faster, or that the
difference is within the noise; it picks nothing by guess. A last row
times the 8-bit optimizer-state recipe (bfloat16 params, stochastic rounding,
``quantized_states(bits=8)``) against the same plain step.

Run: ``python benchmarks/gpu_step.py`` (``--help`` for sizes; ``--dump DIR``
writes each variant's compiled HLO there).
"""

from __future__ import annotations

import pathlib
import re
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

Q8 = "8-bit states + SR, bf16 params"
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}


def build_variants(loss: Callable, scale: Any,
                   lr: float = 1e-4) -> dict[str, tuple[Callable, Callable]]:
  """plain, update_and_apply and update in both formulations, then 8-bit.

  The last variant is issue 31's recipe, bfloat16 params with stochastic
  rounding over Adam's moments in 8 bits, stepped with ``update_and_apply``.
  """
  adam = optax.adam(lr)

  def plain_init(params):
    return params, adam.init(params)

  def plain_step(state, x, y):
    params, opt_state = state
    grads = jax.grad(loss)(params, x, y)
    updates, opt_state = adam.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  variants = {"plain": (plain_init, plain_step)}
  for api in ("update_and_apply", "update"):
    for skip_with in ("cond", "select"):
      opt = jmp_lite.loss_scaled(adam, scale, skip_with=skip_with)

      def init(params, opt=opt):
        return params, opt.init(params)

      def step(state, x, y, opt=opt, api=api):
        params, opt_state = state
        _, grads = jmp_lite.scaled_value_and_grad(loss, opt_state)(
            params, x, y)
        if api == "update_and_apply":
          return jmp_lite.update_and_apply(opt, grads, opt_state, params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

      variants[f"{api} {skip_with}"] = (init, step)

  # Issue 31's recipe: bfloat16 params with stochastic rounding over Adam
  # moments stored in 8 bits (about 4 bytes per parameter held), the loss
  # scale inside; its extra bytes are against the float32-param plain step.
  q8 = jmp_lite.stochastic_rounding(jmp_lite.quantized_states(
      jmp_lite.loss_scaled(adam, scale), bits=8), seed=0)

  def q8_init(params):
    half = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    return half, q8.init(half)

  def q8_step(state, x, y):
    params, opt_state = state
    _, grads = jmp_lite.scaled_value_and_grad(loss, opt_state)(params, x, y)
    return jmp_lite.update_and_apply(q8, grads, opt_state, params)

  variants[Q8] = (q8_init, q8_step)
  return variants


def conditionals(hlo_text: str) -> int:
  """``conditional`` ops in compiled HLO text."""
  return len(re.findall(r"[)\]] conditional\(", hlo_text))


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
  device = jax.devices()[0]
  on_cpu = device.platform == "cpu"
  parser = size_parser((__doc__ or "").splitlines()[0],
                       width=512 if on_cpu else 4096,
                       depth=2 if on_cpu else 3,
                       batch=128 if on_cpu else 512, steps=10,
                       rounds=5 if on_cpu else 10)
  parser.add_argument(
      "--compute", nargs="+", choices=list(DTYPES),
      default=["f32", "f16"] if on_cpu else ["f32", "bf16", "f16"],
      help="compute dtypes (f16 with dynamic loss scaling from 2**15)")
  parser.add_argument("--dump", type=pathlib.Path, default=None,
                      help="write each variant's compiled HLO text here")
  args = parser.parse_args(argv)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((args.batch, args.width)), jnp.float32)
  y = jnp.asarray(rng.standard_normal((args.batch, args.width)), jnp.float32)
  params = mlp(args.width, args.depth, jnp.float32).init(jax.random.key(0), x)
  grad_bytes = tree_nbytes(params)
  print(f"{device.platform} ({device.device_kind}); MLP {args.depth}x"
        f"{args.width}, batch {args.batch}, Adam, float32 params; gradients ="
        f" {grad_bytes / 2**20:.1f} MiB; donated jitted steps;"
        f" {args.rounds} interleaved rounds of {args.steps} steps")
  rows = []
  for compute in args.compute:
    model = mlp(args.width, args.depth, DTYPES[compute])

    def loss(p, x, y, model=model):
      return jnp.mean((model.apply(p, x) - y) ** 2)

    scale = (jmp_lite.DynamicLossScale(2.0**15) if compute == "f16"
             else jmp_lite.NoOpLossScale())
    variants = build_variants(loss, scale)
    jitted, stats = compile_steps(variants, params, x, y, keep_hlo=True)
    if args.dump is not None:
      args.dump.mkdir(parents=True, exist_ok=True)
      for name, st in stats.items():
        (args.dump / f"{compute}_{name.replace(' ', '_')}.hlo.txt"
         ).write_text(st["hlo"])
    states = {k: v.pop("state") for k, v in stats.items()}
    times = interleaved_seconds(
        {k: (lambda s, f=f: f(s, x, y)) for k, f in jitted.items()}, states,
        n_steps=args.steps, rounds=args.rounds)
    # Per-round ratios to the plain step of the same round: the spread says
    # how far apart two formulations must be to differ beyond noise.
    ratios = {k: [t / b for t, b in zip(v, times["plain"], strict=True)]
              for k, v in times.items()}
    base = stats["plain"]
    print(f"\n{compute} compute, {type(scale).__name__}:\n")
    print("| variant | extra bytes / grad bytes | peak vs plain |"
          " conditionals | time vs plain (median) | min-max over rounds |"
          " ms/step |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in variants:
      st, r = stats[name], ratios[name]
      row = {"compute": compute, "variant": name,
             "extra_bytes_per_grad_bytes": (st["bytes"] - base["bytes"])
             / grad_bytes,
             "peak_ratio": st["peak"] / base["peak"],
             "conditionals": conditionals(st["hlo"]),
             "time_ratio": statistics.median(r),
             "time_ratio_min": min(r), "time_ratio_max": max(r),
             "ms_per_step": 1000 * statistics.median(times[name])}
      rows.append(row)
      print(f"| {name} | {row['extra_bytes_per_grad_bytes']:.2f} |"
            f" {row['peak_ratio']:.3f} | {row['conditionals']} |"
            f" {row['time_ratio']:.3f} |"
            f" {row['time_ratio_min']:.3f}-{row['time_ratio_max']:.3f} |"
            f" {row['ms_per_step']:.2f} |")
    for api in ("update_and_apply", "update"):
      c, s = ratios[f"{api} cond"], ratios[f"{api} select"]
      if max(c) < min(s):
        verdict = "cond is faster in every round"
      elif max(s) < min(c):
        verdict = "select is faster in every round"
      else:
        verdict = ("within the noise (the rounds overlap): median cond"
                   f" {statistics.median(c):.3f} vs select"
                   f" {statistics.median(s):.3f}")
      print(f"{compute}, {api}: {verdict}")
  auto = jmp_lite.transforms.GuardConfig().formulation()
  print(f"\nskip_with='auto' compiles to {auto[0]!r} here ({auto[1]}).")
  return rows


if __name__ == "__main__":
  main()
