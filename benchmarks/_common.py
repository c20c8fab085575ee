"""Helpers shared by the benchmarks: sizes, HLO counts, interleaved timing."""

from __future__ import annotations

import argparse
import re
import time
from typing import Any, Callable

import jax


def size_parser(description: str, *, width: int, depth: int, batch: int,
                steps: int = 10, rounds: int = 5) -> argparse.ArgumentParser:
  """An argument parser with the model sizes and timing repeats."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--width", type=int, default=width)
  parser.add_argument("--depth", type=int, default=depth)
  parser.add_argument("--batch", type=int, default=batch)
  parser.add_argument("--steps", type=int, default=steps,
                      help="steps per timed block")
  parser.add_argument("--rounds", type=int, default=rounds,
                      help="interleaved rounds of timed blocks")
  return parser


def count_converts(hlo_text: str) -> int:
  """Convert ops in compiled HLO text (fused computations included)."""
  return len(re.findall(r"= \S+ convert\(", hlo_text))


def bytes_accessed(compiled: Any) -> float:
  """XLA's cost-model bytes accessed for a compiled computation."""
  cost = compiled.cost_analysis()
  if isinstance(cost, list):  # Older JAX returned one dict per device.
    cost = cost[0]
  return float(cost["bytes accessed"])


def interleaved_seconds(steps: dict[str, Callable[[Any], Any]],
                        states: dict[str, Any], *, n_steps: int,
                        rounds: int) -> dict[str, list[float]]:
  """Times each ``steps[name](state) -> state`` in interleaved rounds.

  Round r runs every variant once (n_steps steps each), so that machine noise
  hits all of them alike. Returns seconds per step, one entry per round; the
  final states are written back into ``states``.
  """
  times: dict[str, list[float]] = {name: [] for name in steps}
  for _ in range(rounds):
    for name, step in steps.items():
      state = states[name]
      start = time.perf_counter()
      for _ in range(n_steps):
        state = step(state)
      jax.block_until_ready(state)
      times[name].append((time.perf_counter() - start) / n_steps)
      states[name] = state
  return times
