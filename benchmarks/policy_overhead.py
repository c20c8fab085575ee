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

Run: ``python benchmarks/policy_overhead.py`` (``--help`` for sizes).
"""

from __future__ import annotations

import statistics
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from _common import bytes_accessed, count_converts, interleaved_seconds, size_parser
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


def main(argv: list[str] | None = None) -> dict[str, Any]:
  args = size_parser(__doc__.splitlines()[0], width=512, depth=4,
                     batch=256).parse_args(argv)

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
  return {"stats": stats,
          "residuals": (res32, res16, res16_pure, res_nn32, res_nn16),
          "time_ratio": statistics.median(times["jmp_lite policy"]) / base}


if __name__ == "__main__":
  main()
