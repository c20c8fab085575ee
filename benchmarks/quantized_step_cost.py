"""Cost of 8/4-bit optimizer states against the bfloat16 step they replace.

For bfloat16 params of a Flax MLP (default 4 x 1024, batch 256), compares
``stochastic_rounding(quantized_states(adam, bits=8 | 4))`` with
``stochastic_rounding(adam)``, and the same optimizers with a
``loss_scaled`` guard inside stepped by ``jmp_lite.update_and_apply``:

* bytes accessed and flops per parameter of the jitted optimizer step
  (update + apply, params and state donated), from XLA's cost model
  (``compiled.cost_analysis()``), and the fusions the compiled step holds.
  XLA's model marks a custom call's cost unknown, so it does not see inside
  ``quantized_adam``'s kernels (the C++ kernel on the CPU, Triton's on GPUs):
  their bytes are added as the sizes of the calls' operands and results
  (the kernels read each once and write each once), and their flops are
  not counted (such rows are marked "+ kernel");
* the step's operations per parameter, each counted once by XLA's cost
  model (``_common.op_flops``: what a kernel that computes each value once
  performs, where the compiled flops above count what XLA:CPU recomputes
  in each fusion that reads a value). A kernel row counts the operations of
  its ``kernel="xla"`` twin, which the kernels compute (the tests hold them
  to its codes, scales and outliers);
* the wall time of that optimizer step alone and of the full donated train
  step (forward, backward, update), each timed interleaved with the
  baseline's.

Each row is printed as it finishes, as ratios to its baseline measured in the
same run; ``--budget SECONDS`` skips the rows that would start after it.
The ``quantized_adam`` rows (the fused Adam kernels,
:mod:`jmp_lite.low_precision`) run its Pallas kernel on a GPU and its C++
kernel on the CPU; ``--xla-path`` adds them with ``kernel="xla"``.

Run: ``python benchmarks/quantized_step_cost.py`` (``--help`` for sizes).
"""

from __future__ import annotations

import pathlib
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite
from _common import interleaved_seconds, mlp, op_flops, size_parser
from jmp_lite.low_precision import _cpu_kernel

SCALE = 2.0**15


_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
             "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
             "f64": 8}


def _shape_bytes(text: str) -> int:
  """Bytes of the arrays an HLO shape (a tuple too) names."""
  total = 0
  for dtype, dims in re.findall(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]", text):
    if dtype in _ITEMSIZE:
      total += _ITEMSIZE[dtype] * int(np.prod([int(d) for d in dims.split(
          ",") if d], dtype=np.int64))
  return total


# The kernels XLA's cost model sees as opaque custom calls: the C++ CPU
# kernel and (on GPUs) Triton kernels, the Pallas kernel's.
KERNEL_TARGETS = (_cpu_kernel.TARGET, "__gpu$xla.gpu.triton")


def custom_call_bytes(hlo: str, target: str) -> int:
  """Operand and result bytes of every custom call to ``target``."""
  shapes = dict(re.findall(r"^\s*(?:ROOT )?(%[\w.\-]+) = (\S+|\([^=]*?\)) ",
                           hlo, re.M))
  total = 0
  for line in hlo.splitlines():
    if f'custom_call_target="{target}"' not in line:
      continue
    result = line.split(" = ", 1)[1].split(" custom-call(", 1)[0]
    operands = line.split(" custom-call(", 1)[1].split(")", 1)[0]
    total += _shape_bytes(result) + sum(
        _shape_bytes(shapes.get(name.strip(), ""))
        for name in operands.split(","))
  return total


def cost(compiled: Any) -> tuple[float, float, bool]:
  """(bytes accessed, flops, whether a kernel runs) from XLA's cost model,
  the kernels' operand and result bytes added."""
  c = compiled.cost_analysis()
  if isinstance(c, list):  # Older JAX returned one dict per device.
    c = c[0]
  hlo = compiled.as_text() or ""
  kernel = sum(custom_call_bytes(hlo, t) for t in KERNEL_TARGETS)
  return (float(c["bytes accessed"]) + kernel, float(c.get("flops", 0.0)),
          kernel > 0)


def fusions(hlo: str) -> int:
  """Fusion kernels the entry computation launches (about one pass each)."""
  entry = hlo[hlo.index("\nENTRY"):]
  entry = entry[:entry.find("\n}") + 1]
  return len(re.findall(r"= \S+ fusion\(", entry))


def variants(lr: float, xla_path: bool
             ) -> dict[str, tuple[str, bool, Callable, Callable | None]]:
  """name -> (baseline name, through update_and_apply, optimizer factory,
  the factory whose operations are counted: ``None`` for the same)."""
  sr, qs = jmp_lite.stochastic_rounding, jmp_lite.quantized_states
  adam = lambda: optax.adam(lr)
  # The baseline's moments are bfloat16 (pure bfloat16 Adam): deliberate.
  scaled = lambda inner, half=False: jmp_lite.loss_scaled(
      inner, jmp_lite.DynamicLossScale(SCALE), allow_half_state=half)
  out: dict[str, tuple[str, bool, Callable, Callable | None]] = {
      "SR(adam)": ("SR(adam)", False, lambda: sr(adam()), None),
      "SR(quantized_states(adam, 8))": (
          "SR(adam)", False, lambda: sr(qs(adam(), bits=8)), None),
      "SR(quantized_states(adam, 4))": (
          "SR(adam)", False, lambda: sr(qs(adam(), bits=4)), None),
      "UAA SR(loss_scaled(adam))": (
          "UAA SR(loss_scaled(adam))", True, lambda: sr(scaled(adam(), True)),
          None),
      "UAA SR(quantized_states(loss_scaled(adam), 8))": (
          "UAA SR(loss_scaled(adam))", True,
          lambda: sr(qs(scaled(adam()), bits=8)), None),
      "UAA SR(quantized_states(loss_scaled(adam), 4))": (
          "UAA SR(loss_scaled(adam))", True,
          lambda: sr(qs(scaled(adam()), bits=4)), None),
  }
  qa = jmp_lite.low_precision.quantized_adam
  kernels = ["auto", "xla"] if xla_path else ["auto"]
  for kernel in kernels:
    tag = "" if kernel == "auto" else ", xla"
    for bits in (8, 4):
      out[f"SR(quantized_adam({bits}{tag}))"] = (
          "SR(adam)", False,
          lambda bits=bits, kernel=kernel: sr(qa(lr, bits=bits,
                                                 kernel=kernel)),
          lambda bits=bits: sr(qa(lr, bits=bits, kernel="xla")))
    out[f"UAA SR(loss_scaled(quantized_adam(8{tag})))"] = (
        "UAA SR(loss_scaled(adam))", True,
        lambda kernel=kernel: sr(scaled(qa(lr, bits=8, kernel=kernel))),
        lambda: sr(scaled(qa(lr, bits=8, kernel="xla"))))
  return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
  parser = size_parser((__doc__ or "").splitlines()[0], width=1024, depth=4,
                       batch=256, steps=5, rounds=7)
  parser.add_argument("--budget", type=float, default=float("inf"),
                      help="seconds; rows that would start later are skipped")
  parser.add_argument("--xla-path", action="store_true",
                      help="also quantized_adam's rows with kernel='xla'")
  parser.add_argument("--only", default="",
                      help="semicolon-separated substrings of the rows to run")
  parser.add_argument("--dump", type=pathlib.Path, default=None,
                      help="write each row's compiled optimizer step here")
  args = parser.parse_args(argv)
  start = time.perf_counter()
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((args.batch, args.width)), jnp.float32)
  y = jnp.asarray(rng.standard_normal((args.batch, args.width)), jnp.float32)
  model = mlp(args.width, args.depth, jnp.bfloat16)
  params0 = jax.tree.map(lambda p: p.astype(jnp.bfloat16),
                         model.init(jax.random.key(0), x))
  n_params = sum(p.size for p in jax.tree.leaves(params0))
  device = jax.devices()[0]
  print(f"MLP {args.depth}x{args.width} ({n_params / 1e6:.2f}M bf16 params),"
        f" batch {args.batch}, on {device.platform} ({device.device_kind});"
        f" {args.rounds} interleaved rounds of {args.steps} steps; ratios to"
        " the row's baseline in this run.\n")
  print("| optimizer | opt step bytes/param | ratio | opt step flops/param |"
        " ratio | ops/param, each once | ratio | fusions (opt step) |"
        " opt step ms | ratio | full step ms | ratio |")
  print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
        " --- |", flush=True)

  built: dict[str, dict[str, Any]] = {}
  op_cache: dict[Any, tuple[float, float]] = {}

  def stepper(opt: Any, uaa: bool) -> Callable:
    def apply(state, grads):
      params, opt_state = state
      if uaa:
        return jmp_lite.update_and_apply(opt, grads, opt_state, params)
      updates, opt_state = opt.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state
    return apply

  def build(name: str, uaa: bool, make: Callable,
            counted: Callable | None) -> dict[str, Any]:
    opt = make()
    scale = SCALE if uaa else 1.0
    apply = stepper(opt, uaa)

    def loss(p, x, y):
      return jnp.mean((model.apply(p, x) - y) ** 2) * scale

    def step(state, x, y):
      return apply(state, jax.grad(loss)(state[0], x, y))

    params = jax.tree.map(lambda p: p.copy(), params0)
    state = (params, opt.init(params))
    grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3 * scale), params)
    compiled = jax.jit(apply, donate_argnums=0).lower(state, grads).compile()
    hlo = compiled.as_text() or ""
    if args.dump is not None:
      args.dump.mkdir(parents=True, exist_ok=True)
      safe = "".join(c if c.isalnum() else "_" for c in name)
      (args.dump / f"qcost_{safe}.hlo.txt").write_text(hlo)
    nbytes, flops, kernel = cost(compiled)
    twin = opt if counted is None else counted()
    ops, _ = op_flops(stepper(twin, uaa), (params, twin.init(params)), grads,
                      cache=op_cache)
    # The optimizer step alone (update + apply, donated) on its own copy.
    own = jax.tree.map(lambda p: p.copy(), params0)
    opt_state = jax.block_until_ready(compiled((own, opt.init(own)), grads))
    full = jax.jit(step, donate_argnums=0)
    state = jax.block_until_ready(full(full(state, x, y), x, y))
    return {"bytes": nbytes / n_params, "flops": flops / n_params,
            "ops": ops / n_params, "kernel": kernel,
            "fusions": fusions(hlo), "step": lambda s: full(s, x, y),
            "state": state, "opt": lambda s: compiled(s, grads),
            "opt_state": opt_state}

  rows = []
  table = variants(1e-4, args.xla_path)
  chosen = [n for n in table if not args.only
            or any(s in n for s in args.only.split(";"))]
  # A baseline runs where a chosen row needs it, and first.
  needed = {table[n][0] for n in chosen}
  for name, (base, uaa, make, counted) in table.items():
    if name not in chosen and name not in needed:
      continue
    if time.perf_counter() - start > args.budget:
      print(f"| {name} | skipped: budget of {args.budget:.0f} s spent |",
            flush=True)
      continue
    try:
      built[name] = build(name, uaa, make, counted)
    except Exception as e:  # noqa: BLE001 (a kernel that fails to lower)
      print(f"| {name} | failed: {type(e).__name__}: {str(e)[:300]} |",
            flush=True)
      continue
    b, r = built[base], built[name]
    steps = {base: b["step"]} if name == base else {
        base: b["step"], name: r["step"]}
    states = {k: built[k]["state"] for k in steps}
    times = interleaved_seconds(steps, states, n_steps=args.steps,
                                rounds=args.rounds)
    for k in steps:
      built[k]["state"] = states[k]
    opts = {k: built[k]["opt"] for k in steps}
    opt_states = {k: built[k]["opt_state"] for k in steps}
    opt_times = interleaved_seconds(opts, opt_states, n_steps=args.steps,
                                    rounds=args.rounds)
    for k in steps:
      built[k]["opt_state"] = opt_states[k]
    t_base = statistics.median(times[base])
    t = statistics.median(times[name])
    o_base = statistics.median(opt_times[base])
    o = statistics.median(opt_times[name])
    row = {"optimizer": name, "bytes": r["bytes"], "kernel": r["kernel"],
           "bytes_ratio": r["bytes"] / b["bytes"], "flops": r["flops"],
           "flops_ratio": r["flops"] / max(b["flops"], 1e-30),
           "ops": r["ops"], "ops_ratio": r["ops"] / max(b["ops"], 1e-30),
           "fusions": r["fusions"], "ms": t * 1e3, "time_ratio": t / t_base,
           "opt_ms": o * 1e3, "opt_ratio": o / o_base}
    rows.append(row)
    plus = " + kernel" if r["kernel"] else ""
    print(f"| {name} | {row['bytes']:.1f} | {row['bytes_ratio']:.2f} |"
          f" {row['flops']:.1f}{plus} | {row['flops_ratio']:.2f}{plus} |"
          f" {row['ops']:.1f} | {row['ops_ratio']:.2f} | {row['fusions']} |"
          f" {row['opt_ms']:.3f} | {row['opt_ratio']:.2f} |"
          f" {row['ms']:.2f} | {row['time_ratio']:.2f} |",
          flush=True)
  return rows


if __name__ == "__main__":
  main()
