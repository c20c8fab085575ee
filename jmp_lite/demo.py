"""The demo behind ``python -m jmp_lite``: one model, three precisions.

Trains the same small Flax MLP on a synthetic regression task in float32,
bfloat16 and float16 (with dynamic loss scaling) on the default backend and
prints a comparison table.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite


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


def _make_model(policy: jmp_lite.Policy, width: int, depth: int, out: int):
  import flax.linen as nn  # Local: the core library never needs Flax.

  class MLP(nn.Module):

    @nn.compact
    def __call__(self, x):
      x = policy.cast_to_compute(x)
      for _ in range(depth):
        x = nn.Dense(width, dtype=policy.compute_dtype,
                     param_dtype=policy.param_dtype)(x)
        x = nn.gelu(x)
      x = nn.Dense(out, dtype=policy.compute_dtype,
                   param_dtype=policy.param_dtype)(x)
      return policy.cast_to_output(x)

  return MLP()


def _data(seed: int, n: int, features: int, out: int):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, features)).astype(np.float32)
  w = rng.standard_normal((features, out)).astype(np.float32) / np.sqrt(features)
  y = np.tanh(x @ w) + 0.05 * rng.standard_normal((n, out)).astype(np.float32)
  return x, y


def train(name: str, policy: jmp_lite.Policy, loss_scale: jmp_lite.LossScale,
          *, steps: int, width: int, depth: int, batch: int,
          seed: int = 0) -> Row:
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
  features, out = 32, 8
  x, y = _data(seed, batch * 8, features, out)
  model = _make_model(policy, width, depth, out)
  params = model.init(jax.random.key(seed), jnp.zeros((1, features)))
  opt = jmp_lite.loss_scaled(optax.adam(1e-3), loss_scale)
  opt_state = opt.init(params)

  @jax.jit
  def step(params, opt_state, xb, yb):
    scale = jmp_lite.current_loss_scale(opt_state)

    def loss_fn(p):
      pred = model.apply(p, xb)
      loss = jnp.mean((pred.astype(jnp.float32) - yb) ** 2)
      return scale.scale(loss), loss

    grads, loss = jax.grad(loss_fn, has_aux=True)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  n_batches = len(x) // batch

  def batch_at(i):
    j = i % n_batches
    return x[j * batch:(j + 1) * batch], y[j * batch:(j + 1) * batch]

  params, opt_state, loss = step(params, opt_state, *batch_at(0))  # Compile.
  jax.block_until_ready(loss)
  start = time.perf_counter()
  for i in range(steps):
    params, opt_state, loss = step(params, opt_state, *batch_at(i + 1))
  loss = float(loss)  # The one host sync, after the timed loop has queued.
  elapsed = time.perf_counter() - start
  param_bytes = sum(p.size * p.dtype.itemsize for p in jax.tree.leaves(params))
  return Row(
      name=name, policy=str(policy), loss_scale=type(loss_scale).__name__,
      ms_per_step=1000 * elapsed / max(steps, 1), final_loss=loss,
      param_bytes=int(param_bytes), skipped=int(opt_state.total_skips),
      final_scale=float(opt_state.loss_scale.loss_scale))


def format_table(rows: Sequence[Row]) -> str:
  """Formats rows as an aligned text table, with speed relative to the first.

  Args:
    rows: the rows; the first is the baseline.

  Returns:
    The table as a string.

  Example:
    >>> from jmp_lite.demo import Row, format_table
    >>> print(format_table([Row("f32", "p=f32,c=f32,o=f32", "NoOpLossScale",
    ...                         2.0, 0.5, 1024, 0, 1.0)]).splitlines()[0])
    run  policy             loss scale     ms/step  vs f32  final loss  param bytes  skipped  final scale
  """
  header = ("run", "policy", "loss scale", "ms/step", "vs " + rows[0].name,
            "final loss", "param bytes", "skipped", "final scale")
  base = rows[0].ms_per_step
  body = [(r.name, r.policy, r.loss_scale, f"{r.ms_per_step:.2f}",
           f"{base / r.ms_per_step:.2f}x" if r.ms_per_step else "-",
           f"{r.final_loss:.5f}", f"{r.param_bytes:,}", str(r.skipped),
           f"{r.final_scale:g}") for r in rows]
  widths = [max(len(h), *(len(b[i]) for b in body))
            for i, h in enumerate(header)]
  lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
  lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)).rstrip()
            for b in body]
  return "\n".join(lines)


RUNS = {
    "f32": ("p=f32,c=f32,o=f32", lambda: jmp_lite.NoOpLossScale()),
    "bf16": ("p=f32,c=bf16,o=f32", lambda: jmp_lite.NoOpLossScale()),
    "f16": ("p=f32,c=f16,o=f32",
            lambda: jmp_lite.DynamicLossScale(2.0**15, period=100)),
}


def main(argv: Sequence[str] | None = None) -> list[Row]:
  """Runs the demo and prints the table.

  Args:
    argv: command-line arguments (see ``python -m jmp_lite --help``).

  Returns:
    The table's rows.
  """
  parser = argparse.ArgumentParser(
      prog="python -m jmp_lite",
      description="Train one Flax MLP in float32, bfloat16 and float16 "
      "(dynamic loss scaling) and compare speed, loss and memory.")
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--width", type=int, default=256)
  parser.add_argument("--depth", type=int, default=2)
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--runs", nargs="+", choices=list(RUNS),
                      default=list(RUNS))
  args = parser.parse_args(argv)
  for name, value in (("steps", args.steps), ("width", args.width),
                      ("depth", args.depth), ("batch", args.batch)):
    if value < 1:
      parser.error(f"--{name} must be >= 1, got {value}")
  device = jax.devices()[0]
  print(f"jmp_lite {jmp_lite.__version__} demo on {device.platform}"
        f" ({device.device_kind}); MLP width {args.width}, depth {args.depth},"
        f" batch {args.batch}, {args.steps} Adam steps per run\n")
  rows = []
  for name in args.runs:
    policy, make_scale = RUNS[name]
    rows.append(train(name, jmp_lite.get_policy(policy), make_scale(),
                      steps=args.steps, width=args.width, depth=args.depth,
                      batch=args.batch))
  print(format_table(rows))
  return rows


