"""Does jmp_lite.autocast cost anything over casting by hand?

One MLP loss-and-gradient step (ReLU layers, a logsumexp cross-entropy) is
written once in float32 and run through ``jmp_lite.autocast(..., bfloat16)``,
and once more with every cast written by hand the way autocast would place
them (matmuls in bfloat16 with float32 accumulation; exp, log and the
reductions in float32). Reported: convert ops and bytes accessed in the
compiled HLO, an interleaved wall-clock ratio, and the tracing overhead (time
to ``lower``) of autocast relative to the plain float32 function.

Run: ``python benchmarks/autocast_overhead.py`` (``--help`` for sizes).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jmp_lite
from _common import bytes_accessed, count_converts, interleaved_seconds, size_parser

BF16, F32 = jnp.bfloat16, jnp.float32


def loss_f32(params, x, labels):
  h = x
  for w, b in params[:-1]:
    h = jax.nn.relu(h @ w + b)
  w, b = params[-1]
  logits = h @ w + b
  picked = jnp.take_along_axis(logits, labels[:, None], axis=1)[:, 0]
  return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)


def loss_by_hand(params, x, labels):
  h = x.astype(BF16)
  for w, b in params[:-1]:
    h = jnp.dot(h, w.astype(BF16), preferred_element_type=F32).astype(BF16)
    h = jax.nn.relu(h + b.astype(BF16))
  w, b = params[-1]
  logits = jnp.dot(h, w.astype(BF16), preferred_element_type=F32).astype(BF16)
  logits = (logits + b.astype(BF16)).astype(F32)
  picked = jnp.take_along_axis(logits, labels[:, None], axis=1)[:, 0]
  return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)


def _lower_seconds(fn, args, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    fresh = lambda *a: fn(*a)  # A new function: no tracing cache hit.
    start = time.perf_counter()
    jax.jit(jax.value_and_grad(fresh)).lower(*args)
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main(argv: list[str] | None = None) -> dict[str, Any]:
  args = size_parser(__doc__.splitlines()[0], width=512, depth=4,
                     batch=256).parse_args(argv)

  rng = np.random.default_rng(0)
  params = [(jnp.asarray(rng.standard_normal((args.width, args.width))
                         / np.sqrt(args.width), F32),
             jnp.zeros((args.width,), F32)) for _ in range(args.depth)]
  x = jnp.asarray(rng.standard_normal((args.batch, args.width)), F32)
  labels = jnp.asarray(rng.integers(0, args.width, (args.batch,)))
  call = (params, x, labels)

  fns = {"jmp_lite.autocast": jmp_lite.autocast(loss_f32, BF16),
         "cast by hand": loss_by_hand}
  jitted = {k: jax.jit(jax.value_and_grad(f)) for k, f in fns.items()}
  stats = {}
  for name, f in jitted.items():
    compiled = f.lower(*call).compile()
    stats[name] = (count_converts(compiled.as_text()), bytes_accessed(compiled))
    jax.block_until_ready(f(*call))
  times = interleaved_seconds(
      {k: (lambda _, f=f: f(*call)) for k, f in jitted.items()},
      {k: None for k in jitted}, n_steps=args.steps, rounds=args.rounds)

  # Interleaved, median of 9: lowering times are noisy on a busy machine.
  lowers = {"plain": [], "auto": []}
  for _ in range(9):
    lowers["plain"].append(_lower_seconds(loss_f32, call, 1))
    lowers["auto"].append(_lower_seconds(jmp_lite.autocast(loss_f32, BF16),
                                         call, 1))
  plain_lower = statistics.median(lowers["plain"])
  auto_lower = statistics.median(lowers["auto"])
  base = statistics.median(times["cast by hand"])
  print(f"MLP {args.depth}x{args.width}, batch {args.batch}, loss and"
        f" gradient, on {jax.devices()[0].platform}\n")
  print("| variant | convert ops | bytes accessed | time vs by hand |")
  print("| --- | --- | --- | --- |")
  for name in jitted:
    converts, nbytes = stats[name]
    ratio = statistics.median(times[name]) / base
    print(f"| {name} | {converts} | {nbytes / 2**20:.2f} MiB | {ratio:.2f} |")
  print(f"\nTime to lower: float32 function {1000 * plain_lower:.1f} ms,"
        f" autocast {1000 * auto_lower:.1f} ms (ratio"
        f" {auto_lower / plain_lower:.2f})")
  audit = jmp_lite.autocast_audit(loss_f32, BF16, *call)
  print(f"Matmul FLOPs in bfloat16: {100 * audit.half_flop_fraction():.0f}%")
  return {"stats": stats, "lower_ratio": auto_lower / plain_lower}


if __name__ == "__main__":
  main()
