"""The demo behind ``python -m jmp_lite``: one model, several precisions.

Trains the same Flax MLP (written with no dtype arguments; precision comes
from :func:`jmp_lite.linen.mixed_precision`) on a synthetic regression task on
the default backend and prints a comparison table: time per step and
speed-up over float32, final loss, skipped steps, and memory (params +
optimizer state, and the activations saved for the backward pass).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

import jax
import jax.numpy as jnp
import numpy as np

import jmp_lite

__all__ = ["DEFAULT_RUNS", "RUNS", "Row", "Run", "format_table",
           "hardware_notes", "main", "train"]


@dataclasses.dataclass(frozen=True)
class Run:
  """One precision recipe of the demo.

  Attributes:
    policy: the policy string.
    loss_scale: makes the initial loss scale.
    master: keep float32 master weights (half params).
    description: one line for ``--help``.
  """

  policy: str
  loss_scale: Callable[[], jmp_lite.LossScale]
  master: bool
  description: str


RUNS: dict[str, Run] = {
    "f32": Run("p=f32,c=f32,o=f32", jmp_lite.NoOpLossScale, False,
               "float32 everywhere (O0)"),
    "bf16": Run("p=f32,c=bf16,o=f32", jmp_lite.NoOpLossScale, False,
                "float32 params, bfloat16 compute"),
    "f16": Run("p=f32,c=f16,o=f32",
               lambda: jmp_lite.DynamicLossScale(2.0**15, period=100), False,
               "float32 params, float16 compute, dynamic loss scaling"),
    "o2-bf16": Run("p=bf16,c=bf16,o=f32", jmp_lite.NoOpLossScale, True,
                   "bfloat16 params and compute, float32 master weights (O2)"),
    "o2-f16": Run("p=f16,c=f16,o=f32",
                  lambda: jmp_lite.DynamicLossScale(2.0**15, period=100), True,
                  "float16 params and compute, master weights, dynamic"
                  " scaling (O2)"),
    "pure-f16": Run("p=f16,c=f16,o=f16", jmp_lite.NoOpLossScale, False,
                    "float16 everything, no loss scaling, no master weights"
                    " (what goes wrong)"),
}
DEFAULT_RUNS = ("f32", "bf16", "f16")


@dataclasses.dataclass(frozen=True)
class Row:
  """One line of the comparison table."""

  name: str
  policy: str
  loss_scale: str
  ms_per_step: float
  final_loss: float
  param_bytes: int
  skipped: int
  final_scale: float
  state_bytes: int = 0
  activation_bytes: int = 0


def _make_model(width: int, depth: int, out: int):
  import flax.linen as nn  # Local: the core library never needs Flax.

  class MLP(nn.Module):

    @nn.compact
    def __call__(self, x):
      for _ in range(depth):
        x = nn.gelu(nn.Dense(width)(x))
      return nn.Dense(out)(x)

  return MLP()


def _data(seed: int, n: int, features: int, out: int):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, features)).astype(np.float32)
  w = rng.standard_normal((features, out)).astype(np.float32)
  w = w / np.sqrt(features)
  y = np.tanh(x @ w) + 0.05 * rng.standard_normal((n, out)).astype(np.float32)
  return x, y


def _progress(out: TextIO | None, label: str, i: int, n: int) -> None:
  if out is None:
    return
  width = 30
  done = width * i // max(n, 1)
  bar = f"{label:10s} [{'#' * done}{'.' * (width - done)}] {i}/{n}"
  isatty = getattr(out, "isatty", None)
  if callable(isatty) and isatty():
    out.write("\r" + bar + ("\n" if i == n else ""))
  elif i == n or 4 * i // max(n, 1) != 4 * (i - 1) // max(n, 1):
    # A log file or a pipe: whole lines, at each quarter (carriage returns
    # would run the bar into one long line).
    out.write(bar + "\n")
  out.flush()


def train(name: str, policy: jmp_lite.Policy, loss_scale: jmp_lite.LossScale,
          *, steps: int, width: int, depth: int, batch: int, seed: int = 0,
          master: bool = False, progress: TextIO | None = None) -> Row:
  """Trains the demo MLP with one policy and returns its table row.

  Args:
    name: the row's label.
    policy: the precision policy.
    loss_scale: the initial loss scale.
    steps: optimizer steps (after one warm-up step that compiles).
    width: hidden width.
    depth: hidden layers.
    batch: batch size.
    seed: data and init seed.
    master: keep float32 master weights for half-precision params.
    progress: a stream for the progress bar (``None``: no bar).

  Returns:
    A :class:`Row`.

  Example:
    >>> import jmp_lite
    >>> from jmp_lite import demo
    >>> row = demo.train("f32", jmp_lite.get_policy("f32"),
    ...                  jmp_lite.NoOpLossScale(), steps=3, width=8, depth=1,
    ...                  batch=4)
    >>> row.skipped
    0
  """
  from jmp_lite import examples
  from jmp_lite import linen as jl

  features, out = 32, 8
  x, y = _data(seed, batch * 8, features, out)
  model = jl.mixed_precision(_make_model(width, depth, out), policy)
  params = model.init(jax.random.key(seed), jnp.zeros((1, features)))["params"]

  def loss_fn(p, b):
    pred = model.apply({"params": p}, b[0])
    return jnp.mean((pred.astype(jnp.float32) - b[1]) ** 2)

  n_batches = len(x) // batch

  def batches(i):
    j = i % n_batches
    return x[j * batch:(j + 1) * batch], y[j * batch:(j + 1) * batch]

  report = None if progress is None else (
      lambda done: _progress(progress, name, done, steps))
  result = examples.fit(params, loss_fn, batches, steps=steps, lr=1e-3,
                        loss_scale=loss_scale, master=master, progress=report)
  return Row(
      name=name, policy=str(policy), loss_scale=type(loss_scale).__name__,
      ms_per_step=result.ms_per_step, final_loss=result.eval_loss,
      param_bytes=result.param_bytes, skipped=result.skipped,
      final_scale=float(result.scales[-1]), state_bytes=result.state_bytes,
      activation_bytes=result.activation_bytes)


def format_table(rows: Sequence[Row]) -> str:
  """Formats rows as an aligned text table, with speed relative to the first.

  Args:
    rows: the rows; the first is the baseline.

  Returns:
    The table as a string.

  Example:
    >>> from jmp_lite.demo import Row, format_table
    >>> table = format_table([Row("f32", "p=f32,c=f32,o=f32", "NoOpLossScale",
    ...                           2.0, 0.5, 1024, 0, 1.0)])
    >>> table.splitlines()[1].split()[:5]
    ['f32', 'p=f32,c=f32,o=f32', 'NoOpLossScale', '2.00', '1.00x']
  """
  header = ("run", "policy", "loss scale", "ms/step", "speed-up", "final loss",
            "skipped", "final scale", "param bytes", "optimizer bytes",
            "activation bytes")
  base = rows[0].ms_per_step
  body = [(r.name, r.policy, r.loss_scale, f"{r.ms_per_step:.2f}",
           f"{base / r.ms_per_step:.2f}x" if r.ms_per_step else "-",
           f"{r.final_loss:.5f}", str(r.skipped), f"{r.final_scale:g}",
           f"{r.param_bytes:,}", f"{r.state_bytes:,}",
           f"{r.activation_bytes:,}") for r in rows]
  widths = [max(len(h), *(len(b[i]) for b in body))
            for i, h in enumerate(header)]
  lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)
                     ).rstrip()]
  lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths, strict=True)
                      ).rstrip()
            for b in body]
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[Row]:
  """Runs the demo and prints the table.

  Args:
    argv: command-line arguments (see ``python -m jmp_lite --help``).

  Returns:
    The table's rows.
  """
  on_gpu = jax.devices()[0].platform == "gpu"
  runs_help = "; ".join(f"{k}: {v.description}" for k, v in RUNS.items())
  parser = argparse.ArgumentParser(
      prog="python -m jmp_lite",
      description="Train one Flax MLP in several precisions (float32,"
      " bfloat16, float16 with dynamic loss scaling, ...) and compare speed,"
      " loss and memory on the default backend.")
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--width", type=int, default=4096 if on_gpu else 256,
                      help="hidden width (default: 4096 on a GPU)")
  parser.add_argument("--depth", type=int, default=2)
  parser.add_argument("--batch", type=int, default=512 if on_gpu else 128)
  parser.add_argument("--runs", "--policies", nargs="+", choices=list(RUNS),
                      default=list(DEFAULT_RUNS), help=runs_help)
  parser.add_argument("--no-progress", action="store_true",
                      help="no progress bar")
  args = parser.parse_args(argv)
  for name, value in (("steps", args.steps), ("width", args.width),
                      ("depth", args.depth), ("batch", args.batch)):
    if value < 1:
      parser.error(f"--{name} must be >= 1, got {value}")
  device = jax.devices()[0]
  print(f"jmp_lite {jmp_lite.__version__} demo on {device.platform}"
        f" ({device.device_kind}); MLP width {args.width}, depth {args.depth},"
        f" batch {args.batch}, {args.steps} Adam steps per run\n")
  progress = None if args.no_progress else sys.stderr
  rows = []
  for name in args.runs:
    run = RUNS[name]
    rows.append(train(name, jmp_lite.get_policy(run.policy), run.loss_scale(),
                      steps=args.steps, width=args.width, depth=args.depth,
                      batch=args.batch, master=run.master, progress=progress))
  print(format_table(rows))
  speedups: dict[str, list[float]] = {}
  base = jmp_lite.get_policy(rows[0].policy)
  if base.compute_dtype == jnp.float32 and rows[0].ms_per_step:
    for r in rows[1:]:
      compute = jmp_lite.get_policy(r.policy).compute_dtype
      if r.ms_per_step:
        speedups.setdefault(compute.name, []).append(
            rows[0].ms_per_step / r.ms_per_step)
  for note in hardware_notes([jmp_lite.get_policy(RUNS[n].policy)
                              for n in args.runs], speedups=speedups):
    print(f"note: {note}")
  return rows


_CPU_SLOWER = " on the CPU is emulated and usually slower than float32"


def hardware_notes(policies: Sequence[jmp_lite.Policy],
                   device: object = None,
                   speedups: Mapping[str, Sequence[float]] | None = None
                   ) -> list[str]:
  """Why a run's speed-up may be below 1 here: :func:`check_hardware`'s reasons.

  On the CPU half precision is emulated, so float16/bfloat16 runs are
  usually slower than float32; without this note a 0.6-0.9x speed-up reads
  like a defect. Given the measured speed-ups, the note says what was
  measured: a half-precision run that was not slower (small models can be,
  on some CPUs) is not reported as slower.

  Args:
    policies: the runs' policies (their compute dtypes are checked).
    device: the device; default the first local device.
    speedups: the measured speed-ups over float32 of the runs computing in
      each dtype, by dtype name (``{"bfloat16": [1.12]}``).

  Returns:
    The distinct messages, in order of first appearance.

  Example:
    >>> import jmp_lite
    >>> from jmp_lite.demo import hardware_notes
    >>> hardware_notes([jmp_lite.get_policy("f32")])
    []
    >>> notes = hardware_notes([jmp_lite.get_policy("p=f32,c=bf16,o=f32")])
    >>> notes[0].split(";")[0]  # on the CPU
    'bfloat16 on the CPU is emulated and usually slower than float32'
    >>> hardware_notes([jmp_lite.get_policy("p=f32,c=bf16,o=f32")],
    ...                speedups={"bfloat16": [1.12]})[0].split(";")[0][33:]
    "yet this run measured 1.12x float32's speed"
  """
  notes: list[str] = []
  for policy in policies:
    for message in jmp_lite.check_hardware(policy, device, warn=False):
      message = _measured(message, speedups or {})
      if message not in notes:
        notes.append(message)
  return notes


def _measured(message: str, speedups: Mapping[str, Sequence[float]]) -> str:
  # The CPU note, rewritten to agree with the table above it.
  name, slower, _ = message.partition(_CPU_SLOWER)
  if not slower or not speedups.get(name):
    return message
  shown = ", ".join(f"{x:.2f}x" for x in speedups[name])
  if min(speedups[name]) < 1:
    return f"{message} (measured here: {shown})"
  return (f"{name} on the CPU is emulated, yet this run measured {shown}"
          " float32's speed; on a CPU that depends on the model's size and"
          " the machine, while on GPUs and TPUs half precision pays off by"
          " its hardware")
