"""Does applying a policy through jmp_lite cost anything over Flax's dtype=?

The same MLP (Dense + LayerNorm + GELU blocks) is built twice:

* ``jmp_lite``: written with no dtype arguments, wrapped with
  ``jmp_lite.linen.mixed_precision(model, "p=f32,c=bf16,o=f32")``;
* ``by hand``: every layer given ``dtype=``/``param_dtype=`` (LayerNorm kept in
  float32), inputs cast to bfloat16 and the output to float32 by hand.

For a jitted loss-and-gradient step it reports, from the compiled HLO, the
number of convert ops and XLA's bytes accessed; an interleaved wall-clock
ratio; and the bytes saved for the backward pass (the residuals of
``jax.vjp``) under a float32 and a bfloat16 policy.

Then, on pre-LN Transformers (our own, written with a ``dtype`` field as
Flax's examples do):

* the residuals a 4-layer Transformer (d=512, seq 256, batch 16) saves for
  its backward pass under a bfloat16 policy, as a fraction of float32's, with
  and without ``remat_norms=True`` (read from JAX's saved-residual analysis,
  abstractly: nothing is run), and how far its gradients move;
* the time to lower (trace) the loss and gradient of a 12-layer Transformer
  under the policy, against the same model with Flax ``dtype=`` by hand: the
  first lowering, and later ones (inside a trace the policy's ``apply`` is a
  nested ``jax.jit`` that later traces reuse; ``cache_traces=False``, also
  measured, traces every call afresh).

Run: ``python benchmarks/policy_overhead.py`` (``--help`` for sizes).
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from _common import (
  bytes_accessed,
  count_converts,
  interleaved_seconds,
  size_parser,
)
from jmp_lite import linen as jl


class PlainMLP(nn.Module):
  width: int
  depth: int

  @nn.compact
  def __call__(self, x):
    for _ in range(self.depth):
      x = nn.gelu(nn.LayerNorm()(nn.Dense(self.width)(x)))
    return nn.Dense(self.width)(x)


class NoNormMLP(nn.Module):
  width: int
  depth: int

  @nn.compact
  def __call__(self, x):
    for _ in range(self.depth):
      x = nn.gelu(nn.Dense(self.width)(x))
    return nn.Dense(self.width)(x)


class HandMLP(nn.Module):
  width: int
  depth: int

  @nn.compact
  def __call__(self, x):
    x = x.astype(jnp.bfloat16)
    for _ in range(self.depth):
      x = nn.Dense(self.width, dtype=jnp.bfloat16, param_dtype=jnp.float32)(x)
      x = nn.LayerNorm(dtype=jnp.float32, param_dtype=jnp.float32)(x)
      x = nn.gelu(x.astype(jnp.bfloat16))
    x = nn.Dense(self.width, dtype=jnp.bfloat16, param_dtype=jnp.float32)(x)
    return x.astype(jnp.float32)


def _loss_and_grad(apply):
  def f(params, x, y):
    return jax.value_and_grad(
        lambda p: jnp.mean((apply({"params": p}, x) - y) ** 2))(params)
  return jax.jit(f)


def residual_bytes(apply, params, x) -> int:
  """Bytes the backward pass keeps from the forward (``jax.vjp`` residuals)."""
  _, vjp_fn = jax.vjp(lambda p: apply({"params": p}, x), params)
  param_ids = {id(p) for p in jax.tree.leaves(params)}
  return int(sum(r.size * r.dtype.itemsize for r in jax.tree.leaves(vjp_fn)
                 if hasattr(r, "dtype") and id(r) not in param_ids
                 and r.dtype != jax.dtypes.float0))


class TransformerBlock(nn.Module):
  """Pre-LN block; ``dtype`` goes to every layer (None: left to the policy)."""

  heads: int
  dtype: Any = None
  norm_dtype: Any = None

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    h = nn.LayerNorm(dtype=self.norm_dtype)(x)
    if self.dtype is not None:
      h = h.astype(self.dtype)
    h = nn.SelfAttention(num_heads=self.heads, dtype=self.dtype,
                         deterministic=True)(h)
    x = x + h
    h = nn.LayerNorm(dtype=self.norm_dtype)(x)
    if self.dtype is not None:
      h = h.astype(self.dtype)
    h = nn.gelu(nn.Dense(4 * d, dtype=self.dtype)(h))
    return x + nn.Dense(d, dtype=self.dtype)(h)


class Transformer(nn.Module):
  layers: int
  heads: int = 8
  dtype: Any = None
  norm_dtype: Any = None

  @nn.compact
  def __call__(self, x):
    if self.dtype is not None:
      x = x.astype(self.dtype)
    for _ in range(self.layers):
      x = TransformerBlock(self.heads, self.dtype, self.norm_dtype)(x)
    x = nn.LayerNorm(dtype=self.norm_dtype)(x)
    return x.astype(jnp.float32)


def saved_residual_bytes(apply, params, x) -> int:
  """Bytes of the intermediates saved for the backward pass (abstract)."""
  from jax._src.ad_checkpoint import saved_residuals  # JAX's own analysis.
  loss = lambda p: apply({"params": p}, x).astype(jnp.float32).mean()
  return int(sum(np.prod(aval.shape) * aval.dtype.itemsize
                 for aval, where in saved_residuals(loss, params)
                 if "from the argument" not in where))


def transformer_residuals(d: int = 512, seq: int = 256, batch: int = 16,
                          layers: int = 4) -> dict[str, float]:
  x = jnp.asarray(np.random.default_rng(0).standard_normal((batch, seq, d)),
                  jnp.float32)
  f32 = jl.mixed_precision(Transformer(layers), "f32")
  params = jax.eval_shape(f32.init, jax.random.key(0), x)["params"]
  out = {"float32": saved_residual_bytes(f32.apply, params, x)}
  for name, remat in (("bfloat16", False), ("bfloat16, remat_norms", True)):
    model = jl.mixed_precision(Transformer(layers), "p=f32,c=bf16,o=f32",
                               remat_norms=remat)
    out[name] = saved_residual_bytes(model.apply, params, x)
  # Same function, only the backward schedule differs: gradients agree.
  # (Jitted: op by op, the two gradients cost 13 s of dispatch.)
  small = x[:2, :32]
  p = jax.jit(f32.init)(jax.random.key(0), small)["params"]
  models = [jl.mixed_precision(Transformer(layers), "p=f32,c=bf16,o=f32",
                               remat_norms=r) for r in (False, True)]
  grads = [jax.jit(jax.grad(
      lambda p, m=m: m.apply({"params": p}, small).mean()))(p)
           for m in models]
  out["max grad difference"] = max(
      float(jnp.max(jnp.abs(a - b)))
      for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1]),
                      strict=True))
  return out


def lowering_seconds(layers: int = 12, d: int = 256, seq: int = 128,
                     batch: int = 8, rounds: int = 11) -> dict[str, Any]:
  """Seconds to lower the loss and gradient, first and later (median).

  Each lowering is a new ``jax.jit`` (no JAX trace cache), preceded by a
  garbage collection so that no variant pays for another's garbage. Later
  lowerings are interleaved round by round, so machine noise hits both
  alike, and timed twice: this thread's CPU time (lowering is
  single-threaded Python, which other processes on a busy machine inflate
  far less than wall-clock time) and wall-clock time.
  """
  x = jnp.ones((batch, seq, d), jnp.float32)
  ours = jl.mixed_precision(Transformer(layers), "p=f32,c=bf16,o=f32")
  uncached = jl.mixed_precision(Transformer(layers), "p=f32,c=bf16,o=f32",
                                cache_traces=False)
  hand = Transformer(layers, dtype=jnp.bfloat16, norm_dtype=jnp.float32)
  params = jax.eval_shape(hand.init, jax.random.key(0), x)["params"]
  fns = {"jmp_lite policy": ours.apply,
         "jmp_lite policy, cache_traces=False": uncached.apply,
         "flax dtype= by hand": hand.apply}

  def lower(apply) -> tuple[float, float]:
    f = lambda p: jax.value_and_grad(
        lambda p: apply({"params": p}, x).mean())(p)
    gc.collect()
    start, start_cpu = time.perf_counter(), time.thread_time()
    jax.jit(f).lower(params)  # A new jit each time: no JAX trace cache.
    return time.thread_time() - start_cpu, time.perf_counter() - start

  first = {name: lower(apply) for name, apply in fns.items()}
  later: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
  for _ in range(rounds):
    for name, apply in fns.items():
      later[name].append(lower(apply))
  med = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
  return {"first": {k: v[0] for k, v in first.items()},
          "first_wall": {k: v[1] for k, v in first.items()},
          "later": {k: med(v, 0) for k, v in later.items()},
          "later_wall": {k: med(v, 1) for k, v in later.items()},
          "rounds": rounds}


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = size_parser(__doc__.splitlines()[0], width=512, depth=4,
                       batch=256)
  parser.add_argument("--model-dim", type=int, default=512,
                      help="Transformer width for the residual measurement")
  parser.add_argument("--seq", type=int, default=256,
                      help="Transformer sequence length (residuals)")
  parser.add_argument("--seq-batch", type=int, default=16,
                      help="Transformer batch (residuals)")
  parser.add_argument("--lower-layers", type=int, default=12,
                      help="Transformer depth for the lowering measurement")
  parser.add_argument("--lower-dim", type=int, default=256,
                      help="Transformer width for the lowering measurement")
  parser.add_argument("--lower-repeats", type=int, default=11,
                      help="interleaved repeats of the later lowerings")
  args = parser.parse_args(argv)

  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((args.batch, args.width)), jnp.float32)
  y = jnp.asarray(rng.standard_normal((args.batch, args.width)), jnp.float32)
  ours = jl.mixed_precision(PlainMLP(args.width, args.depth),
                            "p=f32,c=bf16,o=f32")
  hand = HandMLP(args.width, args.depth)
  params = ours.init(jax.random.key(0), x)["params"]
  hand_params = hand.init(jax.random.key(0), x)["params"]
  chex_same = jax.tree.structure(params) == jax.tree.structure(hand_params)
  assert chex_same, "the two models must have the same params"

  fns = {"jmp_lite policy": _loss_and_grad(ours.apply),
         "flax dtype= by hand": _loss_and_grad(hand.apply)}
  stats = {}
  for name, f in fns.items():
    compiled = f.lower(params, x, y).compile()
    stats[name] = {"converts": count_converts(compiled.as_text()),
                   "bytes": bytes_accessed(compiled)}
    jax.block_until_ready(f(params, x, y))

  times = interleaved_seconds(
      {k: (lambda _, f=f: f(params, x, y)) for k, f in fns.items()},
      {k: None for k in fns}, n_steps=args.steps, rounds=args.rounds)

  f32 = jl.mixed_precision(PlainMLP(args.width, args.depth), "f32")
  res32 = residual_bytes(f32.apply, params, x)
  res16 = residual_bytes(ours.apply, params, x)
  no_islands = jl.mixed_precision(PlainMLP(args.width, args.depth),
                                  "p=f32,c=bf16,o=f32", float32_norms=False)
  res16_pure = residual_bytes(no_islands.apply, params, x)
  nn32 = jl.mixed_precision(NoNormMLP(args.width, args.depth), "f32")
  nn16 = jl.mixed_precision(NoNormMLP(args.width, args.depth),
                            "p=f32,c=bf16,o=f32")
  nn_params = nn32.init(jax.random.key(0), x)["params"]
  res_nn32 = residual_bytes(nn32.apply, nn_params, x)
  res_nn16 = residual_bytes(nn16.apply, nn_params, x)

  base = statistics.median(times["flax dtype= by hand"])
  print(f"MLP {args.depth}x{args.width} (Dense+LayerNorm+GELU), batch"
        f" {args.batch}, loss and gradient, on {jax.devices()[0].platform}\n")
  print("| variant | convert ops | bytes accessed | time vs by hand |")
  print("| --- | --- | --- | --- |")
  for name in fns:
    ratio = statistics.median(times[name]) / base
    print(f"| {name} | {stats[name]['converts']} |"
          f" {stats[name]['bytes'] / 2**20:.2f} MiB | {ratio:.2f} |")
  print(f"\nResiduals saved for backward: float32 policy {res32 / 2**20:.2f}"
        f" MiB; bfloat16 policy {res16 / 2**20:.2f} MiB (ratio"
        f" {res16 / res32:.2f}, LayerNorm kept in float32); bfloat16 without"
        f" float32 norms {res16_pure / 2**20:.2f} MiB (ratio"
        f" {res16_pure / res32:.2f}); Flax's LayerNorm saves float32"
        f" intermediates whatever its input. Without LayerNorm (Dense+GELU):"
        f" float32 {res_nn32 / 2**20:.2f} MiB, bfloat16"
        f" {res_nn16 / 2**20:.2f} MiB (ratio {res_nn16 / res_nn32:.2f})")
  res = transformer_residuals(args.model_dim, args.seq, args.seq_batch)
  print(f"\nTransformer, 4 layers, d={args.model_dim}, seq {args.seq}, batch"
        f" {args.seq_batch}: residuals saved for the backward pass")
  print("| policy | residuals | vs float32 |")
  print("| --- | --- | --- |")
  for name in ("float32", "bfloat16", "bfloat16, remat_norms"):
    print(f"| {name} | {res[name] / 2**20:.1f} MiB |"
          f" {res[name] / res['float32']:.2f} |")
  print(f"remat_norms moves gradients by at most"
        f" {res['max grad difference']:.2g} (same function, another backward"
        " schedule)")
  low = lowering_seconds(args.lower_layers, args.lower_dim,
                         rounds=args.lower_repeats)
  hand = "flax dtype= by hand"
  print(f"\nTransformer, {args.lower_layers} layers: time to lower loss and"
        f" gradient (CPU time of the lowering thread; later lowerings: median"
        f" of {low['rounds']} interleaved repeats; wall-clock ratio too)")
  print("| variant | first lowering | later lowerings | later, wall-clock |")
  print("| --- | --- | --- | --- |")
  for name in low["first"]:
    print(f"| {name} | {low['first'][name]:.2f} s"
          f" ({low['first'][name] / low['first'][hand]:.2f}x) |"
          f" {low['later'][name]:.2f} s"
          f" ({low['later'][name] / low['later'][hand]:.2f}x) |"
          f" {low['later_wall'][name]:.2f} s"
          f" ({low['later_wall'][name] / low['later_wall'][hand]:.2f}x) |")
  return {"stats": stats,
          "residuals": (res32, res16, res16_pure, res_nn32, res_nn16),
          "transformer_residuals": res, "lowering": low,
          "time_ratio": statistics.median(times["jmp_lite policy"]) / base}


if __name__ == "__main__":
  main()
