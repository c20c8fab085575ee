"""How many bytes does an FSDP step's weight all-gather move with FP8?

One FSDP train step under ``shard_map`` (an MLP of ``--depth`` square
``--width`` layers, bfloat16 weights sharded along their first axis over
every device, the batch split the same way): each layer's weight is
all-gathered before its matmul, either with ``jax.lax.all_gather`` (bf16 on
the wire, the baseline) or with ``jmp_lite.fp8.all_gather`` under each
recipe (``CurrentScaling`` per tensor, ``"row"``, ``"block"`` and
``MXFP8``). The gradient of a gather is a reduce-scatter.

Reported per device, for the whole step (forward and backward):

* the all-gather bytes in the *lowered StableHLO* (the program as JAX asks
  for it, and as a GPU backend runs it): the FP8 payload and, separately,
  the scales (float32 per row or tile; one E8M0 byte per MX block);
  per-tensor scaling sends no scale, its global amax is a scalar ``pmax``;
* their ratio to the bf16 gather's (issue 32's target: <= 0.55x, scales
  included);
* the element type of the gradient's reduce-scatter (float32 with
  ``fp8.all_gather``, whatever the weights' dtype);
* the all-gather bytes of the *compiled* program on this backend. XLA:CPU
  has no 8-bit collectives: it widens an f8 gather to f16 between converts
  after lowering, so on the CPU this column is larger than the lowered one;
  on a GPU the two agree.

Nothing is run: the step is lowered and compiled only. On the CPU it needs
several host devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=4
python benchmarks/fp8_gather_bytes.py`` (the flag is added when absent).
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = " ".join(filter(None, [
      os.environ.get("XLA_FLAGS", ""),
      "--xla_force_host_platform_device_count=4"]))

import argparse  # noqa: E402
import re  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from multi_gpu_step import collectives  # noqa: E402

from jmp_lite import fp8  # noqa: E402

RECIPES: dict[str, Any] = {
    "fp8 tensor": fp8.CurrentScaling(),
    "fp8 row": fp8.CurrentScaling(granularity="row"),
    "fp8 block": fp8.CurrentScaling(granularity="block", block_size=128),
    "fp8 mx": fp8.MXFP8(),
}
_BITS = {"f8E4M3FN": 8, "f8E5M2": 8, "ui8": 8, "i8": 8, "bf16": 16,
         "f16": 16, "f32": 32, "i32": 32}
_TENSOR = re.compile(r"tensor<(?P<dims>(?:\d+x)*)(?P<dtype>\w+)>")


def stablehlo_ops(text: str, op: str) -> list[tuple[str, str]]:
  """``(operand type, result type)`` of every ``stablehlo.<op>``."""
  pattern = (r'"?stablehlo\.' + op + r'"?[^\n]*?(?:\n.*?)*?: \('
             r"(tensor<[^>]*>)\) -> (tensor<[^>]*>)")
  return re.findall(pattern, text)


def tensor_bytes(tensor_type: str) -> tuple[int, str]:
  """``(bytes, element type)`` of a ``tensor<AxBxT>`` type."""
  match = _TENSOR.fullmatch(tensor_type)
  if match is None:
    raise ValueError(f"not a ranked tensor type: {tensor_type}")
  dims = [int(d) for d in match.group("dims").split("x") if d]
  dtype = match.group("dtype")
  return int(np.prod(dims)) * _BITS[dtype] // 8, dtype


def fsdp_step(gather: Callable[[jax.Array], jax.Array], mesh: Any) -> Any:
  """The jitted ``shard_map``-ped gradient of an MLP whose weights are
  gathered by ``gather``."""

  def loss(weights: list[jax.Array], x: jax.Array) -> jax.Array:
    h = x
    for w in weights:
      h = jax.nn.relu(h @ gather(w))
    local = jnp.mean(jnp.square(h.astype(jnp.float32)))
    return jax.lax.psum(local, "fsdp")

  return jax.jit(jax.shard_map(jax.grad(loss), mesh=mesh,
                               in_specs=(P("fsdp"), P("fsdp")),
                               out_specs=P("fsdp")))


def measure(width: int, depth: int, batch: int) -> list[dict[str, Any]]:
  """One row per gather: bytes in the lowered and compiled programs."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))
  rng = np.random.default_rng(0)
  weights = [jnp.asarray(rng.standard_normal((width, width)) / width ** 0.5,
                         jnp.bfloat16) for _ in range(depth)]
  x = jnp.asarray(rng.standard_normal((batch, width)), jnp.bfloat16)
  gathers: dict[str, Callable[[jax.Array], jax.Array]] = {
      "bf16": lambda w: jax.lax.all_gather(w, "fsdp", axis=0, tiled=True)}
  for name, recipe in RECIPES.items():
    gathers[name] = lambda w, r=recipe: fp8.all_gather(w, "fsdp", r)
  rows = []
  for name, gather in gathers.items():
    lowered = fsdp_step(gather, mesh).lower(weights, x)
    text = lowered.as_text()
    payload = scales = 0
    for _, result in stablehlo_ops(text, "all_gather"):
      size, dtype = tensor_bytes(result)
      # The weight itself moves in its own dtype (bf16) or FP8; anything
      # else an FP8 gather moves is its scales.
      if dtype.startswith("f8") or name == "bf16":
        payload += size
      else:
        scales += size
    scatter = sorted({tensor_bytes(r)[1]
                      for _, r in stablehlo_ops(text, "reduce_scatter")})
    compiled = collectives(lowered.compile().as_text())
    rows.append({"gather": name, "payload": payload, "scales": scales,
                 "total": payload + scales,
                 "reduce_scatter": "/".join(scatter) or "none",
                 "compiled": compiled.get("all-gather", (0, 0))[1]})
  base = rows[0]["total"]
  for row in rows:
    row["ratio"] = row["total"] / base
  return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
  parser = argparse.ArgumentParser(
      description="All-gather bytes of an FSDP step with fp8.all_gather.")
  parser.add_argument("--width", type=int, default=4096)
  parser.add_argument("--depth", type=int, default=2)
  parser.add_argument("--batch", type=int, default=64)
  args = parser.parse_args(argv)
  n = jax.device_count()
  if args.width % (n * 128):
    parser.error(f"--width must be a multiple of {n} x 128 (each shard a"
                 " whole number of 128x128 tiles)")
  rows = measure(args.width, args.depth, args.batch)
  print(f"{n} x {jax.devices()[0].platform}, {args.depth} layers of"
        f" {args.width}x{args.width} bf16 weights, batch {args.batch}:"
        " all-gather bytes per device per step (lowered StableHLO)")
  print("| gather | payload B | scales B | total B | vs bf16 |"
        " reduce-scatter | compiled all-gather B |")
  print("|---|---:|---:|---:|---:|---|---:|")
  for r in rows:
    print(f"| {r['gather']} | {r['payload']} | {r['scales']} |"
          f" {r['total']} | {r['ratio']:.3f}x | {r['reduce_scatter']} |"
          f" {r['compiled']} |")
  return rows


if __name__ == "__main__":
  main()
