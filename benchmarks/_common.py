"""Helpers shared by the benchmarks: sizes, HLO counts, memory, timing."""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Callable
from typing import Any

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


# Primitives whose jaxpr is counted inline (their body is the computation).
_INLINED = {"pjit", "jit", "closed_call", "core_call", "custom_jvp_call",
            "custom_vjp_call", "custom_vjp_call_jaxpr", "remat", "checkpoint"}


def _sub_jaxprs(eqn: Any) -> list[Any]:
  out = []
  for value in eqn.params.values():
    for v in value if isinstance(value, (tuple, list)) else (value,):
      if hasattr(v, "jaxpr") and hasattr(v, "consts"):   # ClosedJaxpr
        out.append(v.jaxpr)
      elif hasattr(v, "eqns"):                           # Jaxpr
        out.append(v)
  return out


def op_flops(fn: Callable, *args: Any,
             cache: dict[Any, tuple[float, float]] | None = None
             ) -> tuple[float, float]:
  """(flops, transcendentals) of ``fn(*args)`` by XLA's cost model, each
  operation of its jaxpr compiled and counted alone: once, however XLA
  fuses or recomputes it (XLA:CPU recomputes a producer in each fusion that
  reads it; a kernel computes each value once). A ``cond`` counts its
  costliest branch. ``cache`` (equation signature -> cost) spares
  recompiling equal equations across calls."""
  cache = {} if cache is None else cache

  def one(eqn: Any) -> tuple[float, float]:
    literal = [getattr(v, "val", None) if type(v).__name__ == "Literal"
               else None for v in eqn.invars]
    avals = [v.aval for v in eqn.invars]
    # Literal values are in the key: XLA simplifies x * 1 away.
    key = (str(eqn.primitive), repr(sorted(
        (k, str(v)) for k, v in eqn.params.items())),
           tuple((a.shape, str(a.dtype)) for a in avals),
           tuple(repr(x) for x in literal))
    if key not in cache:
      specs = [jax.ShapeDtypeStruct(a.shape, a.dtype)
               for a, x in zip(avals, literal, strict=True) if x is None]

      def alone(*xs: Any) -> Any:
        it = iter(xs)
        return eqn.primitive.bind(
            *[x if x is not None else next(it) for x in literal],
            **eqn.params)

      # On the CPU whatever the default backend: the count is the jaxpr's,
      # and a GPU compile per equation would take minutes.
      with jax.default_device(jax.devices("cpu")[0]):
        c = jax.jit(alone).lower(*specs).compile().cost_analysis()
      c = (c[0] if isinstance(c, list) else c) or {}
      cache[key] = (float(c.get("flops", 0.0)),
                    float(c.get("transcendentals", 0.0)))
    return cache[key]

  def walk(jaxpr: Any) -> tuple[float, float]:
    flops = trans = 0.0
    for eqn in jaxpr.eqns:
      name = str(eqn.primitive)
      subs = _sub_jaxprs(eqn)
      if name in _INLINED and subs:
        f, t = walk(subs[0])
      elif name == "cond" and subs:
        f, t = max(walk(b) for b in subs)
      else:
        f, t = one(eqn)
      flops += f
      trans += t
    return flops, trans

  return walk(jax.make_jaxpr(fn)(*args).jaxpr)


def peak_bytes(compiled: Any) -> int:
  """Peak device memory of a compiled step, from ``memory_analysis()``.

  Arguments plus outputs not aliased to a donated argument plus XLA's
  temporaries: what the step needs resident at once.
  """
  m = compiled.memory_analysis()
  return int(m.argument_size_in_bytes + m.output_size_in_bytes
             - m.alias_size_in_bytes + m.temp_size_in_bytes)


def tree_nbytes(tree: Any) -> int:
  """Bytes of the array leaves of ``tree``."""
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)
                 if hasattr(x, "dtype")))


def mlp(width: int, depth: int, dtype: Any) -> Any:
  """A Flax MLP: ``depth`` Dense layers, float32 params, ``dtype`` compute.

  Written the way Flax users write it (``dtype=`` on every layer); the last
  layer's output is returned in float32.
  """
  import flax.linen as nn
  import jax.numpy as jnp

  class MLP(nn.Module):

    @nn.compact
    def __call__(self, x):
      x = x.astype(dtype)
      for _ in range(depth - 1):
        x = nn.relu(nn.Dense(width, dtype=dtype)(x))
      return nn.Dense(width, dtype=dtype)(x).astype(jnp.float32)

  return MLP()


def compile_steps(variants: dict[str, tuple[Callable, Callable]], params: Any,
                  *args: Any, keep_hlo: bool = False
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
  """Jits every ``step(state, *args) -> state`` with the state donated.

  ``variants`` maps a name to ``(init(params) -> state, step)``. Returns
  ``(jitted steps, stats)`` where stats hold XLA's bytes accessed, the peak
  memory and a trace counter per variant; two warm-up steps have run (a
  state whose leaf types change after one step recompiles there, not in the
  timed loop); the state is in ``stats[name]["state"]``, and with
  ``keep_hlo`` the compiled HLO text in ``stats[name]["hlo"]``.
  """
  jitted, stats = {}, {}
  for name, (init, step) in variants.items():
    traces = [0]

    def counted(state, *a, step=step, traces=traces):
      traces[0] += 1
      return step(state, *a)

    fn = jax.jit(counted, donate_argnums=0)
    state = init(jax.tree.map(lambda x: x.copy(), params))
    compiled = fn.lower(state, *args).compile()
    stats[name] = {"bytes": bytes_accessed(compiled),
                   "peak": peak_bytes(compiled), "traces": traces}
    if keep_hlo:
      stats[name]["hlo"] = compiled.as_text()
    state = fn(fn(state, *args), *args)
    stats[name]["state"] = jax.block_until_ready(state)
    jitted[name] = fn
  return jitted, stats


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
