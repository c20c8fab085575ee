"""What does the loss-scaled step cost on many devices, and what does it add
to the communication?

Builds one Flax MLP train step (Adam) over every visible device, sharded as
multi-GPU scripts shard it (``jax.jit`` with ``NamedSharding``, donated params
and optimizer state), two layouts:

* ``dp``: params replicated, the batch split over the ``data`` axis;
* ``fsdp``: params (and so Adam's moments) split along their first axis too.

For each it compares the plain step with the loss-scaled one
(``jmp_lite.loss_scaled`` + ``jmp_lite.update_and_apply``, the optimizer
state made by ``jmp_lite.distributed.init_sharded``) and reports:

* extra bytes accessed over the plain step (XLA's cost model, one device's
  program), in units of one device's gradient bytes;
* peak memory per device (``memory_analysis``) and its ratio;
* the wall-clock ratio, timed interleaved;
* the collectives in the compiled program (all-reduce, all-gather,
  reduce-scatter, ...): their count and the bytes they move, for each step,
  and what loss scaling adds. The skip decision is one ``bool`` agreed over
  the devices: it should add at most a scalar all-reduce.

Run on a multi-GPU node: ``python benchmarks/multi_gpu_step.py``. On the CPU,
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` gives 8 host devices
(the numbers then describe XLA:CPU's program, not a GPU's).
"""

from __future__ import annotations

import re
import statistics
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jmp_lite
from _common import (
  compile_steps,
  interleaved_seconds,
  mlp,
  size_parser,
  tree_nbytes,
)

_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter",
                "collective-permute", "all-to-all")
# "%name = <result shape> op(" or "op-start(": the shape may be a tuple
# whose printout holds "/*index=5*/" comments, so lines are split at the op.
_OP = re.compile(r" (?P<op>" + "|".join(_COLLECTIVES) + r")(?:-start)?\(")
_ARRAY = re.compile(r"\b(?P<dtype>[a-z]+[0-9a-z]*)\[(?P<dims>[0-9,]*)\]")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
             "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
             "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1}


def collectives(hlo_text: str) -> dict[str, tuple[int, int]]:
  """Collective op -> (count, bytes of its results), from compiled HLO."""
  found: dict[str, list[int]] = {}
  for line in hlo_text.splitlines():
    match = _OP.search(line)
    if match is None or " = " not in line[:match.start()]:
      continue
    shape = line[line.index(" = ") + 3:match.start()]
    size = 0
    for array in _ARRAY.finditer(shape):
      dims = [int(d) for d in array.group("dims").split(",") if d]
      size += _ITEMSIZE.get(array.group("dtype"), 4) * int(np.prod(dims))
    entry = found.setdefault(match.group("op"), [0, 0])
    entry[0] += 1
    entry[1] += size
  return {op: (n, b) for op, (n, b) in sorted(found.items())}


def _describe(found: dict[str, tuple[int, int]]) -> str:
  if not found:
    return "none"
  return ", ".join(f"{op} x{n} ({b} B)" for op, (n, b) in found.items())


def build(layout: str, width: int, depth: int, batch: int, lr: float
          ) -> tuple[dict[str, Any], Any, tuple[Any, Any], int]:
  """The two variants, the sharded params and batch, one device's grad bytes."""
  mesh = jax.make_mesh((jax.device_count(),), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  model = mlp(width, depth, jnp.float32)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((batch, width)), jnp.float32)
  y = jnp.asarray(rng.standard_normal((batch, width)), jnp.float32)
  params = model.init(jax.random.key(0), x[:1])["params"]

  def spec(p: Any) -> P:
    if layout == "fsdp" and p.ndim and p.shape[0] % jax.device_count() == 0:
      return P("data")
    return P()

  params = jax.tree.map(
      lambda p: jax.device_put(p, NamedSharding(mesh, spec(p))), params)
  data = NamedSharding(mesh, P("data"))
  x, y = jax.device_put(x, data), jax.device_put(y, data)

  def loss(params, x, y):
    return jnp.mean((model.apply({"params": params}, x) - y) ** 2)

  adam = optax.adam(lr)
  scaled = jmp_lite.loss_scaled(adam, jmp_lite.DynamicLossScale(2.0**15))

  def plain_init(params):
    return params, jmp_lite.distributed.init_sharded(adam, params)

  def plain_step(state, x, y):
    params, opt_state = state
    grads = jax.grad(loss)(params, x, y)
    updates, opt_state = adam.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def scaled_init(params):
    return params, jmp_lite.distributed.init_sharded(scaled, params)

  def scaled_step(state, x, y):
    params, opt_state = state
    _, grads = jmp_lite.scaled_value_and_grad(loss, opt_state)(params, x, y)
    return jmp_lite.update_and_apply(scaled, grads, opt_state, params)

  variants = {"plain": (plain_init, plain_step),
              "loss-scaled update_and_apply": (scaled_init, scaled_step)}
  per_device = sum(
      int(np.prod(s.data.shape)) * s.data.dtype.itemsize
      for p in jax.tree.leaves(params) for s in p.addressable_shards[:1])
  return variants, params, (x, y), per_device


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
  parser = size_parser(__doc__.splitlines()[0], width=1024, depth=4,
                       batch=512)
  parser.add_argument("--layouts", nargs="+", default=["dp", "fsdp"],
                      choices=["dp", "fsdp"])
  args = parser.parse_args(argv)
  device = jax.devices()[0]
  print(f"{jax.device_count()} x {device.platform} ({device.device_kind});"
        f" MLP {args.depth} x {args.width}, global batch {args.batch}, Adam,"
        " donated, jitted with NamedSharding")
  rows = []
  for layout in args.layouts:
    variants, params, batch, grad_bytes = build(
        layout, args.width, args.depth, args.batch, 1e-4)
    steps, stats = compile_steps(variants, params, *batch, keep_hlo=True)
    times = interleaved_seconds(
        {n: (lambda s, f=f, b=batch: f(s, *b)) for n, f in steps.items()},
        {n: stats[n]["state"] for n in steps}, n_steps=args.steps,
        rounds=args.rounds)
    base = stats["plain"]
    base_coll = collectives(base["hlo"])
    print(f"\n{layout}: one device's gradients {grad_bytes} B;"
          f" params {tree_nbytes(params)} B in all")
    print("| step | extra bytes / grad bytes | peak MiB | peak vs plain |"
          " time vs plain (median) | collectives |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in steps:
      s = stats[name]
      ratio = statistics.median(
          t / b for t, b in zip(times[name], times["plain"], strict=True))
      found = collectives(s["hlo"])
      row = {"layout": layout, "step": name,
             "extra_bytes_per_grad_bytes":
                 (s["bytes"] - base["bytes"]) / grad_bytes,
             "peak_mib": s["peak"] / 2**20,
             "peak_ratio": s["peak"] / base["peak"],
             "time_ratio": ratio, "collectives": found,
             "traces": s["traces"][0]}
      rows.append(row)
      print(f"| {name} | {row['extra_bytes_per_grad_bytes']:.2f} |"
            f" {row['peak_mib']:.1f} | {row['peak_ratio']:.3f} |"
            f" {ratio:.2f} | {_describe(found)} |")
    added = {op: (n - base_coll.get(op, (0, 0))[0],
                  b - base_coll.get(op, (0, 0))[1])
             for op, (n, b) in collectives(
                 stats["loss-scaled update_and_apply"]["hlo"]).items()}
    added = {op: v for op, v in added.items() if v != (0, 0)}
    print(f"{layout}: loss scaling adds {_describe(added)}")
  return rows


if __name__ == "__main__":
  main()
