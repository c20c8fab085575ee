"""The block-scaled FP8 GEMM kernel against bfloat16 and the scan it replaces.

Times one matmul of a Transformer block's shapes (tokens x d times d x d,
and the MLP's down projection, d x 4d), its operands already quantised in
"block" layout (1 x 128 activation blocks, 128 x 128 weight tiles):

* ``bf16``: ``jnp.dot`` of bfloat16 operands, float32 accumulation (cuBLAS);
* ``fp8 per-tensor``: one E4M3 x E4M3 ``dot_general`` into float32, what
  per-tensor scaling runs (cuBLASLt's FP8 GEMM): the FP8 ceiling here;
* ``looped_dot``: the ``lax.scan`` over contracting blocks, one thin FP8
  GEMM and one pass over the float32 output per block (the XLA path);
* ``kernel ...``: ``block_scaled_dot``, the Pallas kernel (Triton), with
  E4M3 x E4M3 operands (forward) and E5M2 x E4M3 (gradients: float16
  tensor cores), at a few tile and pipeline settings.

Printed: ms per matmul (median of interleaved rounds), TFLOP/s, and the
ratio to ``bf16`` of the same shape in the same run. On the CPU the kernel
runs in Pallas' interpreter at a small size (a smoke test, not a timing).

Run: ``python benchmarks/fp8_block_gemm.py`` (``--tokens``, ``--width``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from _common import interleaved_seconds
from jmp_lite.fp8._block_gemm import block_scaled_dot
from jmp_lite.fp8._blocked import Layout, looped_dot, quantize_blocks

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
# (tiles, num_warps, num_stages, scaling) tried on a GPU.
CONFIGS = [((128, 128), 8, 4, "safe"), ((128, 128), 8, 4, "product"),
           ((128, 128), 8, 3, "safe"), ((128, 256), 8, 4, "safe"),
           ((256, 128), 8, 4, "safe"), ((64, 128), 4, 4, "safe"),
           ((128, 64), 4, 4, "safe")]


def main() -> None:
  on_gpu = jax.default_backend() == "gpu"
  parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
  parser.add_argument("--tokens", type=int, default=8192 if on_gpu else 64)
  parser.add_argument("--width", type=int, default=4096 if on_gpu else 256)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--steps", type=int, default=10 if on_gpu else 1)
  parser.add_argument("--no-references", action="store_true",
                      help="leave out the per-tensor FP8 dot and the scan")
  args = parser.parse_args()
  m, d = args.tokens, args.width
  rng = np.random.default_rng(0)
  print(f"device: {jax.devices()[0].device_kind}; tokens {m}, d {d}; ms per"
        " matmul, ratio to bf16 of the same shape in this run", flush=True)
  for n, k in ((d, d), (d, 4 * d)):
    x = jnp.asarray(rng.standard_normal((1, m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((1, n, k)), jnp.bfloat16)
    qa, ia = quantize_blocks(x, Layout("vector", E4M3))
    ga, ga_inv = quantize_blocks(x, Layout("vector", E5M2))
    qb, ib = quantize_blocks(w, Layout("square", E4M3))
    t8a, t8b = x.astype(E4M3)[0], w.astype(E4M3)[0]
    fns: dict[str, tuple[Any, tuple[jax.Array, ...]]] = {
        "bf16": (jax.jit(lambda a, b: jnp.einsum(
            "mk,nk->mn", a, b, preferred_element_type=jnp.float32).astype(
                jnp.bfloat16)), (x[0], w[0])),
    }
    if not args.no_references:
      fns["fp8 per-tensor"] = (jax.jit(lambda a, b: jax.lax.dot_general(
          a, b, (((1,), (1,)), ((), ())),
          preferred_element_type=jnp.float32)), (t8a, t8b))
      fns["looped_dot"] = (jax.jit(looped_dot), (qa, ia, qb, ib))
    if on_gpu:
      for tiles, warps, stages, scaling in CONFIGS:
        for name, lhs in (("e4m3", (qa, ia)), ("e5m2", (ga, ga_inv))):
          fns[f"kernel {name} {tiles} w{warps} s{stages} {scaling}"] = (
              jax.jit(lambda a, ai, b, bi, t=tiles, nw=warps, ns=stages,
                      sc=scaling: block_scaled_dot(
                          a, ai, b, bi, tiles=t, num_warps=nw, num_stages=ns,
                          scaling=sc)), (*lhs, qb, ib))
    else:
      fns["kernel e4m3 (interpreter)"] = (jax.jit(
          lambda a, ai, b, bi: block_scaled_dot(a, ai, b, bi, interpret=True)),
          (qa, ia, qb, ib))
    flops = 2.0 * m * n * k
    steps, states = {}, {}
    for name, (fn, operands) in fns.items():
      start = time.perf_counter()
      try:
        jax.block_until_ready(fn(*operands))
      except Exception as e:  # noqa: BLE001 (a config Triton refuses)
        print(f"  {name}: failed: {type(e).__name__}: {str(e)[:200]}",
              flush=True)
        continue
      print(f"  compiled {name} in {time.perf_counter() - start:.1f} s",
            flush=True)
      # The state is the operands; each step's result is dropped.
      steps[name] = lambda s, f=fn: (jax.block_until_ready(f(*s)), s)[1]
      states[name] = operands
    times = interleaved_seconds(steps, states, n_steps=args.steps,
                                rounds=args.rounds)
    base = statistics.median(times["bf16"])
    print(f"\n{m} x {k} . {k} x {n}:")
    print(f"| {'variant':44} | ms | TFLOP/s | vs bf16 |")
    print("| --- | --- | --- | --- |")
    for name in steps:
      t = statistics.median(times[name])
      print(f"| {name:44} | {1e3 * t:.3f} | {flops / t / 1e12:.0f} |"
            f" {t / base:.2f} |", flush=True)


if __name__ == "__main__":
  main()
