"""Bytes per parameter and bytes moved per step of low-precision optimizers.

Builds one Flax MLP train step (Adam) per optimizer variant: float32 Adam,
O2 master weights, pure bfloat16 Adam, bfloat16 params with
``kahan_summation`` / ``stochastic_rounding`` and ``state_dtypes``, and
stochastic rounding over ``quantized_states`` (8 and 4 bits), by hand and as
``preset("O3", half="bf16", state_bits=8 | 4)``. For each:

* bytes per parameter of params + optimizer state, summed over the actual
  pytrees after a step;
* bytes per parameter from ``compiled.memory_analysis()`` of the jitted
  train step with params and optimizer state donated: arguments less the
  batch (params + state: what stays resident between steps) and that plus
  unaliased outputs and temporaries (the step's peak, gradients and
  activations included);
* extra bytes accessed per step against pure bfloat16 Adam, from XLA's cost
  model (``compiled.cost_analysis()``), in units of the bfloat16 gradients'
  size, for the full step and for the optimizer update + apply alone;
* the wall-clock ratio to pure bfloat16 Adam, timed interleaved.

Every variant steps with ``opt.update`` + ``optax.apply_updates``; the
rows marked ``[update_and_apply]`` step the same optimizer with
``jmp_lite.update_and_apply`` (the O3 presets and their hand-written
recipes, whose guard ``update_and_apply`` decides with one branch).

Run: ``python benchmarks/optimizer_memory.py`` (``--help`` for sizes).
"""

from __future__ import annotations

import pathlib
import statistics
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite
from _common import bytes_accessed, interleaved_seconds, size_parser
from jmp_lite.presets import preset

BASE = "pure bf16 Adam"
UAA = " [update_and_apply]"


def build_variants(lr: float) -> dict[str, tuple[Any, Callable[[], Any]]]:
  """name -> (param dtype, optimizer factory)."""
  adam = lambda: optax.adam(lr)
  kahan, sr = jmp_lite.kahan_summation, jmp_lite.stochastic_rounding
  sd, qs = jmp_lite.state_dtypes, jmp_lite.quantized_states
  o3 = lambda bits: preset("O3", half="bf16", state_bits=bits)
  bf16 = jnp.bfloat16
  return {
      "f32 Adam": (jnp.float32, adam),
      "O2: bf16 + f32 master weights": (
          bf16, lambda: jmp_lite.master_weights(adam())),
      BASE: (bf16, adam),
      "bf16 + state_dtypes(bf16)": (bf16, lambda: sd(adam(), "bf16")),
      "bf16 + Kahan": (bf16, lambda: kahan(adam())),
      "bf16 + Kahan + state_dtypes(bf16)": (
          bf16, lambda: kahan(sd(adam(), "bf16"))),
      "bf16 + Kahan + state_dtypes(mu bf16, nu f32)": (
          bf16, lambda: kahan(sd(adam(), {".*/mu/.*": "bf16"}))),
      "bf16 + SR": (bf16, lambda: sr(adam())),
      "bf16 + SR + state_dtypes(bf16)": (bf16, lambda: sr(sd(adam(), "bf16"))),
      "bf16 + SR + state_dtypes(bf16, stochastic)": (
          bf16, lambda: sr(sd(adam(), "bf16", rounding="stochastic"))),
      # Issue 31: Adam's moments block-quantized, about 4 (3) bytes/param.
      "bf16 + SR + quantized_states(8 bits)": (
          bf16, lambda: sr(qs(adam(), bits=8))),
      "bf16 + SR + quantized_states(4 bits)": (
          bf16, lambda: sr(qs(adam(), bits=4))),
      "preset O3 bf16 (Kahan)": (bf16, lambda: o3(None).optimizer(adam())),
      "preset O3 bf16 state_bits=8": (
          bf16, lambda: o3(8).optimizer(adam())),
      "preset O3 bf16 state_bits=4": (
          bf16, lambda: o3(4).optimizer(adam())),
      # The same optimizers, stepped by update_and_apply.
      "bf16 + Kahan + state_dtypes(bf16)" + UAA: (
          bf16, lambda: kahan(sd(adam(), "bf16"))),
      "bf16 + SR + quantized_states(8 bits)" + UAA: (
          bf16, lambda: sr(qs(adam(), bits=8))),
      "preset O3 bf16 (Kahan)" + UAA: (
          bf16, lambda: o3(None).optimizer(adam())),
      "preset O3 bf16 state_bits=8" + UAA: (
          bf16, lambda: o3(8).optimizer(adam())),
  }


class MLP(nn.Module):
  width: int
  depth: int
  dtype: Any

  @nn.compact
  def __call__(self, x):
    x = x.astype(self.dtype)
    for i in range(self.depth):
      x = nn.Dense(self.width, dtype=self.dtype, param_dtype=self.dtype)(x)
      if i < self.depth - 1:
        x = nn.relu(x)
    return x.astype(jnp.float32)


def tree_nbytes(tree: Any) -> int:
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)
                 if hasattr(x, "dtype")))


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
  parser = size_parser((__doc__ or "").splitlines()[0], width=1024, depth=4,
                       batch=256)
  parser.add_argument("--dump", type=pathlib.Path, default=None,
                      help="write each variant's compiled full step here")
  args = parser.parse_args(argv)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((args.batch, args.width)), jnp.float32)
  y = jnp.asarray(rng.standard_normal((args.batch, args.width)), jnp.float32)
  variants = build_variants(1e-4)
  device = jax.devices()[0]

  full, stats, states = {}, {}, {}
  # Every variant's MLP has the same parameter count, whatever its dtype.
  n_params = sum(p.size for p in jax.tree.leaves(jax.eval_shape(
      MLP(args.width, args.depth, jnp.float32).init, jax.random.key(0), x)))
  for name, (dtype, make) in variants.items():
    model = MLP(args.width, args.depth, dtype)
    opt = make()
    params = model.init(jax.random.key(0), x)
    loss = lambda p, x, y, model=model: jnp.mean((model.apply(p, x) - y) ** 2)

    uaa = name.endswith(UAA)

    def apply(state, grads, opt=opt, uaa=uaa):
      params, opt_state = state
      if uaa:
        return jmp_lite.update_and_apply(opt, grads, opt_state, params)
      updates, opt_state = opt.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    def step(state, x, y, apply=apply, loss=loss):
      return apply(state, jax.grad(loss)(state[0], x, y))

    state = (params, opt.init(params))
    grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)
    full[name] = jax.jit(step, donate_argnums=0)
    compiled = full[name].lower(state, x, y).compile()
    if args.dump is not None:
      args.dump.mkdir(parents=True, exist_ok=True)
      safe = "".join(c if c.isalnum() else "_" for c in name)
      (args.dump / f"optmem_{safe}.hlo.txt").write_text(compiled.as_text())
    compiled_update = jax.jit(apply, donate_argnums=0).lower(
        state, grads).compile()
    mem = compiled.memory_analysis()
    data = x.nbytes + y.nbytes   # The batch is an argument too; not counted.
    state = full[name](state, x, y)   # The pytrees after a real step.
    states[name] = jax.block_until_ready(state)
    stats[name] = {
        "tree": tree_nbytes(state) / n_params,
        "resident": (mem.argument_size_in_bytes - data) / n_params,
        "peak": (mem.argument_size_in_bytes - data + mem.output_size_in_bytes
                 - mem.alias_size_in_bytes + mem.temp_size_in_bytes)
        / n_params,
        "aliased": mem.alias_size_in_bytes / n_params,
        "bytes": bytes_accessed(compiled),
        "update_bytes": bytes_accessed(compiled_update),
    }

  times = interleaved_seconds(
      {k: (lambda s, f=f: f(s, x, y)) for k, f in full.items()}, states,
      n_steps=args.steps, rounds=args.rounds)
  grad_bytes = 2 * n_params   # bfloat16 gradients.
  base, base_time = stats[BASE], statistics.median(times[BASE])
  print(f"MLP {args.depth}x{args.width} ({n_params / 1e6:.2f}M params), batch"
        f" {args.batch}, Adam, on {device.platform} ({device.device_kind});"
        f" steps jitted with params and optimizer state donated;"
        f" {args.rounds} interleaved rounds of {args.steps} steps. Extra"
        f" bytes and time against {BASE}; unit = bf16 gradient bytes.\n")
  print("| variant | bytes/param (pytrees) | bytes/param resident"
        " (memory_analysis args) | bytes/param peak (memory_analysis) |"
        " extra bytes/grad bytes: full step | extra bytes/grad bytes:"
        " update+apply | time vs pure bf16 |")
  print("| --- | --- | --- | --- | --- | --- | --- |")
  rows = []
  for name in variants:
    st = stats[name]
    row = {
        "variant": name, "tree": st["tree"], "resident": st["resident"],
        "peak": st["peak"],
        "extra_full": (st["bytes"] - base["bytes"]) / grad_bytes,
        "extra_update": (st["update_bytes"] - base["update_bytes"])
        / grad_bytes,
        "time": statistics.median(times[name]) / base_time,
    }
    rows.append(row)
    print(f"| {name} | {row['tree']:.2f} | {row['resident']:.2f} |"
          f" {row['peak']:.2f} | {row['extra_full']:.2f} |"
          f" {row['extra_update']:.2f} | {row['time']:.2f} |")
  return rows


if __name__ == "__main__":
  main()
