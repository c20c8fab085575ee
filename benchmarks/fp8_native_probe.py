"""Does this backend run JAX's native MXFP8 matmul, and against what?

Issue 32 asks ``jmp_lite.fp8`` to use JAX's native block-scaled matmul
(``jax.nn.scaled_dot_general``) where the backend has one. This script asks
the backend, rather than assuming: for one ``M x K @ K x N`` product (bf16
operands, float32 accumulation) it compiles and times, forward and backward
(``jax.grad`` of both operands)

* ``bf16``: ``jnp.dot``, the baseline;
* ``jmp_lite MXFP8``: ``jmp_lite.fp8.dot_general(MXFP8())`` (our own MX
  quantisation, then ``jax.lax.scaled_dot``, see ``jmp_lite/fp8/_blocked.py``),
  and, for comparison, ``jmp_lite row`` and ``jmp_lite block`` (one FP8 dot
  with per-row scales; DeepSeek-V3's tiles summed block by block);
* ``jax.nn mxfp8 (default)`` and ``(cudnn)``: ``jax.nn.scaled_dot_general``
  with ``get_scaled_dot_general_config("mxfp8")`` for its three dots and
  ``implementation=None`` or ``"cudnn"``.

and prints per variant whether it compiled (or the first line of the error),
the FP8 dots in the compiled HLO (``f8e4m3fn``/``f8e5m2`` operands, cuDNN
custom calls), the compiled step's temporary memory, the time per step
(median of interleaved rounds) and the ratio to ``bf16`` in the same run.
On the CPU the default sizes shrink to a smoke test and FP8 is emulated:
only the "compiled" and error columns mean anything there.

Run: ``python benchmarks/fp8_native_probe.py`` (``--size N`` for M=N=K).
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from _common import interleaved_seconds
from jmp_lite import fp8

DN = (((1,), (0,)), ((), ()))


def variants() -> dict[str, Callable[[jax.Array, jax.Array], jax.Array]]:
  """name -> ``f(x, w)`` computing ``x @ w`` in float32."""
  mx = fp8.dot_general(fp8.MXFP8())
  row = fp8.dot_general(fp8.CurrentScaling(granularity="row"))
  block = fp8.dot_general(fp8.CurrentScaling(granularity="block"))
  configs = [jax.nn.get_scaled_dot_general_config("mxfp8")] * 3

  def native(implementation: Any) -> Callable[..., jax.Array]:
    return lambda x, w: jax.nn.scaled_dot_general(
        x, w, DN, preferred_element_type=jnp.float32, configs=configs,
        implementation=implementation)

  return {
      "bf16": lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32),
      "jmp_lite MXFP8": lambda x, w: mx(x, w, DN,
                                        preferred_element_type=jnp.float32),
      "jmp_lite row": lambda x, w: row(x, w, DN,
                                       preferred_element_type=jnp.float32),
      "jmp_lite block": lambda x, w: block(x, w, DN,
                                           preferred_element_type=jnp.float32),
      "jax.nn mxfp8 (default)": native(None),
      "jax.nn mxfp8 (cudnn)": native("cudnn"),
  }


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
  on_cpu = jax.default_backend() == "cpu"
  parser.add_argument("--size", type=int, default=256 if on_cpu else 8192)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--rounds", type=int, default=5)
  args = parser.parse_args(argv)
  n = args.size
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (n, n), jnp.bfloat16)
  w = jax.random.normal(kw, (n, n), jnp.bfloat16) / n ** 0.5
  device = jax.devices()[0]
  print(f"device: {device.platform} ({device.device_kind}); jax"
        f" {jax.__version__}; x {n}x{n} @ w {n}x{n}, bf16 operands,"
        " forward + backward")

  steps, states, rows = {}, {}, {}
  reference = None
  for name, f in variants().items():
    def step(state, f=f):
      xs, ws = state
      gx, gw = jax.grad(lambda a, b: (f(a, b) ** 2).mean(),
                        argnums=(0, 1))(xs, ws)
      # Feed the step its own gradients (scaled down) so that nothing is
      # constant-folded or cached between calls.
      return xs - 1e-6 * gx.astype(xs.dtype), ws - 1e-6 * gw.astype(ws.dtype)

    start = time.perf_counter()
    try:
      compiled = jax.jit(step).lower((x, w)).compile()
      out = jax.jit(f)(x, w)
    except Exception as e:  # What the backend says is the point here.
      first = (str(e).strip().splitlines() or [""])[0]
      rows[name] = f"no: {type(e).__name__}: {first[:150]}"
      continue
    hlo = compiled.as_text()
    f8 = len(re.findall(r"(?:f8e4m3fn|f8e5m2)\[[^\]]*\][^\n]*?"
                        r"(?:custom-call|dot|fusion)\(", hlo))
    cudnn = len(re.findall(r'custom_call_target="__cudnn', hlo))
    if reference is None:
      reference = out
    err = float(jnp.linalg.norm(out - reference) / jnp.linalg.norm(reference))
    temp = compiled.memory_analysis().temp_size_in_bytes / 2 ** 20
    rows[name] = (f"yes | {f8} | {cudnn} | {err:.4f} | {temp:.0f}")
    # Progress as it goes: a run cut short by a time limit still says how
    # far it got and what each compile took.
    print(f"compiled {name} in {time.perf_counter() - start:.1f} s",
          flush=True)
    steps[name] = jax.jit(step)
    states[name] = (x, w)

  times = interleaved_seconds(steps, states, n_steps=args.steps,
                              rounds=args.rounds)
  base = statistics.median(times["bf16"])
  print("| variant | compiled | f8 ops in HLO | cuDNN calls | rel. error vs"
        " bf16 (forward) | temp MiB | ms/step | vs bf16 |")
  print("| --- | --- | --- | --- | --- | --- | --- | --- |")
  for name, row in rows.items():
    if name in times:
      t = statistics.median(times[name])
      print(f"| {name} | {row} | {t * 1e3:.3f} | {t / base:.2f}x |")
    else:
      print(f"| {name} | {row} | | | | | | |")


if __name__ == "__main__":
  main()
