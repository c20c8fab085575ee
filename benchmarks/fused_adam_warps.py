"""The fused 8-bit Adam kernel's optimizer step at 4 and 8 warps per program.

``quantized_adam``'s Triton kernel runs 8 blocks of 256 per program. ptxas
gives each thread 191 registers at 4 warps (8 warps resident per
multiprocessor) and 78 at 8 warps (24 resident): this times the donated
optimizer step (update + apply) of ``stochastic_rounding(quantized_adam(8))``
at both settings, interleaved with ``stochastic_rounding(optax.adam)`` on the
same bfloat16 params (3 x 4096 x 4096 and their biases by default).

The warp count is a private constant of the kernel's module, set here
before each variant is traced (a benchmark's knob, not an API).

Run on a GPU: ``python benchmarks/fused_adam_warps.py`` (``--width``,
``--layers``). On the CPU it says so and exits: the kernel is GPU-only.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite
from _common import interleaved_seconds
from jmp_lite.low_precision import _fused, quantized_adam


def main() -> None:
  parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
  parser.add_argument("--width", type=int, default=4096)
  parser.add_argument("--layers", type=int, default=3)
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--steps", type=int, default=10)
  args = parser.parse_args()
  if jax.default_backend() != "gpu":
    print("fused_adam_warps.py times a GPU kernel; this backend is"
          f" {jax.default_backend()}.")
    return
  rng = np.random.default_rng(0)
  w = args.width
  params = {f"l{i}": {"w": jnp.asarray(rng.standard_normal((w, w)) * 0.02,
                                       jnp.bfloat16),
                      "b": jnp.zeros((w,), jnp.bfloat16)}
            for i in range(args.layers)}
  grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)
  n = sum(p.size for p in jax.tree.leaves(params))
  steps: dict[str, Any] = {}
  states: dict[str, Any] = {}
  makers = {"SR(adam)": (None, lambda: optax.adam(1e-4)),
            "SR(quantized_adam(8)), 4 warps": (4, lambda: quantized_adam(1e-4)),
            "SR(quantized_adam(8)), 8 warps": (8, lambda: quantized_adam(1e-4))}
  default = _fused._WARPS
  for name, (warps, make) in makers.items():
    if warps is not None:
      _fused._WARPS = warps  # Read when the kernel is traced, just below.
    opt = jmp_lite.stochastic_rounding(make())

    def apply(state, g, opt=opt):
      p, s = state
      u, s = opt.update(g, s, p)
      return optax.apply_updates(p, u), s

    p = jax.tree.map(lambda x: x.copy(), params)
    compiled = jax.jit(apply, donate_argnums=0).lower(
        (p, opt.init(p)), grads).compile()
    _fused._WARPS = default
    steps[name] = lambda s, f=compiled: f(s, grads)
    states[name] = jax.block_until_ready(compiled((p, opt.init(p)), grads))
  times = interleaved_seconds(steps, states, n_steps=args.steps,
                              rounds=args.rounds)
  base = statistics.median(times["SR(adam)"])
  print(f"{jax.devices()[0].device_kind}: {n / 1e6:.1f}M bf16 params;"
        f" optimizer step (update + apply, donated), median of"
        f" {args.rounds} interleaved rounds")
  print("| optimizer | ms | vs SR(adam) |")
  print("| --- | --- | --- |")
  for name, t in times.items():
    print(f"| {name} | {1e3 * statistics.median(t):.3f} |"
          f" {statistics.median(t) / base:.2f} |")


if __name__ == "__main__":
  main()
