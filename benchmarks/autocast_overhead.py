"""Does jmp_lite.autocast cost anything over casting by hand?

1. Run time. One MLP loss-and-gradient step (ReLU layers, a logsumexp
   cross-entropy) is written once in float32 and run through
   ``jmp_lite.autocast(..., bfloat16)``, and once more with every cast written
   by hand the way autocast would place them (matmuls in bfloat16 with float32
   accumulation and a bfloat16 product; bias adds and ReLU in the promoted
   type, float32; exp, log and the reductions in float32). Reported: convert
   ops and bytes accessed in the compiled HLO, and an interleaved wall-clock
   ratio.
2. Tracing. Autocast traces the function, then re-binds every primitive
   re-typed, so ``jax.jit(...).lower(...)`` takes longer than for the plain
   function. Reported: the time to lower the plain float32 function and its
   autocast version (median of interleaved repeats, a fresh function each
   time so no tracing cache hits), for the MLP step and for a 12-layer pre-LN
   Transformer decoder (written here in plain JAX), its loss alone
   (``jax.jit(autocast(loss)).lower``) and its loss and gradient.

Run: ``python benchmarks/autocast_overhead.py`` (``--help`` for sizes).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jmp_lite
from _common import (
  bytes_accessed,
  count_converts,
  interleaved_seconds,
  size_parser,
)

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
  # Autocast's placement: matmul operands in bfloat16, the product in
  # bfloat16 (so the backward matmuls take bfloat16 cotangents too), and
  # elementwise ops in their operands' promoted type (bfloat16 product +
  # float32 bias: float32), as torch.autocast promotes.
  h = x
  for w, b in params[:-1]:
    h = jnp.dot(h.astype(BF16), w.astype(BF16)).astype(F32)
    h = jax.nn.relu(h + b)
  w, b = params[-1]
  logits = jnp.dot(h.astype(BF16), w.astype(BF16)).astype(F32) + b
  picked = jnp.take_along_axis(logits, labels[:, None], axis=1)[:, 0]
  return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)


# A pre-LN decoder-only Transformer in plain JAX: token and position
# embeddings, `layers` blocks of causal multi-head attention and a GELU MLP,
# a final LayerNorm and logits tied to the embedding.


def transformer_params(*, vocab: int, d: int, layers: int, seq: int,
                       seed: int = 0) -> dict[str, Any]:
  rng = np.random.default_rng(seed)

  def dense(n_in: int, n_out: int) -> jax.Array:
    return jnp.asarray(rng.standard_normal((n_in, n_out)) / np.sqrt(n_in), F32)

  def norm() -> dict[str, jax.Array]:
    return {"scale": jnp.ones((d,), F32), "bias": jnp.zeros((d,), F32)}

  blocks = [{"ln1": norm(), "qkv": dense(d, 3 * d), "out": dense(d, d),
             "ln2": norm(), "up": dense(d, 4 * d),
             "up_b": jnp.zeros((4 * d,), F32),
             "down": dense(4 * d, d), "down_b": jnp.zeros((d,), F32)}
            for _ in range(layers)]
  return {"embed": dense(vocab, d), "pos": dense(seq, d), "blocks": blocks,
          "ln_f": norm()}


def _layer_norm(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
  mean = x.mean(-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-6) * p["scale"] + p["bias"]


def _attention(x: jax.Array, blk: dict[str, jax.Array],
               heads: int) -> jax.Array:
  b, t, d = x.shape
  q, k, v = (a.reshape(b, t, heads, d // heads)
             for a in jnp.split(x @ blk["qkv"], 3, axis=-1))
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads)
  causal = jnp.tril(jnp.ones((t, t), bool))
  weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
  return jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d) @ blk["out"]


def transformer_loss(params: dict[str, Any], tokens: jax.Array,
                     heads: int = 4) -> jax.Array:
  """Next-token cross-entropy of the decoder on ``tokens`` (batch, seq)."""
  x = params["embed"][tokens] + params["pos"][: tokens.shape[1]]
  for blk in params["blocks"]:
    x = x + _attention(_layer_norm(x, blk["ln1"]), blk, heads)
    h = jax.nn.gelu(_layer_norm(x, blk["ln2"]) @ blk["up"] + blk["up_b"])
    x = x + h @ blk["down"] + blk["down_b"]
  logits = _layer_norm(x, params["ln_f"]) @ params["embed"].T
  logp = jax.nn.log_softmax(logits[:, :-1])
  return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))


def lowering_seconds(make: dict[str, Callable[[], Callable[..., Any]]],
                     args: tuple, repeats: int
                     ) -> dict[str, tuple[float, float]]:
  """Median (CPU, wall) seconds of ``jax.jit(make[k]()).lower(*args)``.

  ``make[k]()`` returns a fresh function each time (no tracing cache hit;
  making it is timed too), and each round lowers every variant once so
  machine noise hits all alike. CPU time is this thread's (lowering is
  single-threaded Python), which other processes on a busy machine inflate
  far less than wall-clock time.
  """
  cpu: dict[str, list[float]] = {k: [] for k in make}
  wall: dict[str, list[float]] = {k: [] for k in make}
  for m in make.values():  # Warm-up: JAX's own first-use costs.
    jax.jit(m()).lower(*args)
  for _ in range(repeats):
    for k, m in make.items():
      start, start_cpu = time.perf_counter(), time.thread_time()
      jax.jit(m()).lower(*args)
      cpu[k].append(time.thread_time() - start_cpu)
      wall[k].append(time.perf_counter() - start)
  return {k: (statistics.median(cpu[k]), statistics.median(wall[k]))
          for k in make}


def _fresh(fn: Callable[..., Any], *, grad: bool, cast: bool
           ) -> Callable[[], Callable[..., Any]]:
  def make() -> Callable[..., Any]:
    f = (lambda *a: fn(*a))  # A new function object: no cache hit.
    if cast:
      f = jmp_lite.autocast(f, BF16)
    return jax.value_and_grad(f) if grad else f
  return make


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = size_parser(__doc__.splitlines()[0], width=512, depth=4, batch=256)
  parser.add_argument("--layers", type=int, default=12,
                      help="Transformer blocks")
  parser.add_argument("--d-model", type=int, default=128)
  parser.add_argument("--seq", type=int, default=64)
  parser.add_argument("--lower-repeats", type=int, default=None,
                      help="interleaved repeats of each lowering"
                      " (default: 2 * rounds + 1)")
  args = parser.parse_args(argv)
  if args.lower_repeats is None:
    args.lower_repeats = 2 * args.rounds + 1

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

  base = statistics.median(times["cast by hand"])
  print(f"MLP {args.depth}x{args.width}, batch {args.batch}, loss and"
        f" gradient, on {jax.devices()[0].platform}\n")
  print("| variant | convert ops | bytes accessed | time vs by hand |")
  print("| --- | --- | --- | --- |")
  for name in jitted:
    converts, nbytes = stats[name]
    ratio = statistics.median(times[name]) / base
    print(f"| {name} | {converts} | {nbytes / 2**20:.2f} MiB | {ratio:.2f} |")
  audit = jmp_lite.autocast_audit(loss_f32, BF16, *call)
  print(f"\nMatmul FLOPs in bfloat16: {100 * audit.half_flop_fraction():.0f}%")

  vocab = 256
  tparams = transformer_params(vocab=vocab, d=args.d_model, layers=args.layers,
                               seq=args.seq)
  tokens = jnp.asarray(rng.integers(0, vocab, (8, args.seq)), jnp.int32)
  cases = {
      f"MLP {args.depth}x{args.width}, loss and gradient":
          (loss_f32, call, True),
      f"Transformer {args.layers} layers d={args.d_model}, loss":
          (transformer_loss, (tparams, tokens), False),
      f"Transformer {args.layers} layers d={args.d_model}, loss and gradient":
          (transformer_loss, (tparams, tokens), True),
  }
  print(f"\nTime to lower (`jax.jit(f).lower`, median of"
        f" {args.lower_repeats} interleaved repeats; ratio = autocast /"
        f" float32 function):\n")
  print("| function | float32 (CPU) | autocast (CPU) | ratio (CPU) |"
        " ratio (wall) |")
  print("| --- | --- | --- | --- | --- |")
  ratios = {}
  for label, (fn, fargs, grad) in cases.items():
    secs = lowering_seconds(
        {"plain": _fresh(fn, grad=grad, cast=False),
         "autocast": _fresh(fn, grad=grad, cast=True)},
        fargs, args.lower_repeats)
    (plain_cpu, plain_wall), (auto_cpu, auto_wall) = (
        secs["plain"], secs["autocast"])
    ratios[label] = auto_cpu / plain_cpu
    print(f"| {label} | {1000 * plain_cpu:.0f} ms | {1000 * auto_cpu:.0f} ms"
          f" | {auto_cpu / plain_cpu:.2f} | {auto_wall / plain_wall:.2f} |")
  return {"stats": stats, "lower_ratios": ratios}


if __name__ == "__main__":
  main()
