"""FP8 vs bfloat16 matmuls in a Transformer block: FP8 dots, bytes, time.

One pre-LN Transformer block (d=4096, 32 heads, GELU MLP of 4d; plain JAX,
float32 params cast to bfloat16, attention scores and softmax in float32) is
trained with SGD, every step jitted with its state donated, six ways:

* ``bf16``: the four projections (qkv, out, up, down) as bfloat16 matmuls
  with float32 accumulation;
* ``fp8-current``: the same four through ``jmp_lite.fp8.dot_general`` with
  ``CurrentScaling`` (E4M3 forward, E5M2 cotangent);
* ``fp8-delayed``: with ``DelayedScaling``, the scaling states threaded
  through the step and committed with ``jmp_lite.fp8.commit``.
* ``fp8-row``, ``fp8-block``, ``fp8-mx``: finer scales, stateless like
  ``fp8-current``: ``CurrentScaling(granularity="row")`` (one scale per
  row: one FP8 dot, de-scaled after), ``CurrentScaling(granularity="block")``
  (DeepSeek-V3's 1x128 activation and 128x128 weight tiles: on a GPU one
  Pallas kernel per matmul that de-scales each 128-wide block inside the
  accumulation, ``jmp_lite/fp8/_block_gemm.py``) and ``MXFP8()``
  (32-element blocks, power-of-two scales: ``jax.lax.scaled_dot``, which
  Hopper expands into a dequantisation and a dot).

The attention score and value matmuls stay bfloat16 in all six. Printed
per variant:

1. ``fp8 dots``: matmuls with FP8 operands in the program JAX hands to XLA
   (StableHLO ``dot_general`` with ``f8E4M3FN``/``f8E5M2`` operands, or
   MX's ``xla.scaled_dot`` composite of FP8 operands and E8M0 scales), and
   ``gemms f8/all``: the GEMMs XLA actually emitted with FP8 operands, out
   of all its GEMMs (cuBLAS/cuBLASLt custom calls and Triton GEMM fusions in
   the compiled HLO: 0/0 on the CPU, which converts FP8 to float32 around
   an ordinary dot; on a Hopper GPU 12 FP8 ones per FP8 variant if XLA takes
   them all: forward, input and weight gradient of each projection);
2. XLA's cost-model bytes accessed and peak memory of the compiled step, and
   the bytes the backward pass keeps from the forward (FP8 residuals are
   half the size of bfloat16 ones);
3. wall-clock per step (median of rounds interleaved with ``bf16``'s,
   run as soon as the variant is built, so that a run cut short keeps the
   rows it printed) and the ratio to that ``bf16`` time. On the CPU FP8 is
   emulated: its time says nothing about FP8 hardware.

Run on a GPU: ``python benchmarks/gpu_fp8.py`` (defaults d=4096, seq=2048,
batch=4). On the CPU the defaults shrink to a smoke-test size; ``--help``
(``--dump DIR`` writes each variant's compiled HLO there).
"""

from __future__ import annotations

import collections
import pathlib
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from _common import bytes_accessed, interleaved_seconds, peak_bytes, size_parser
from jmp_lite import fp8
from jmp_lite.diagnostics import tree_bytes

BF16, F32 = jnp.bfloat16, jnp.float32
PROJECTIONS = ("qkv", "out", "up", "down")
LR = 1e-3


def init_params(d: int, seed: int = 0) -> dict[str, jax.Array]:
  rng = np.random.default_rng(seed)

  def dense(n_in: int, n_out: int) -> jax.Array:
    return jnp.asarray(rng.standard_normal((n_in, n_out)) / np.sqrt(n_in), F32)

  return {"qkv": dense(d, 3 * d), "out": dense(d, d), "up": dense(d, 4 * d),
          "down": dense(4 * d, d), "ln1": jnp.ones((d,), F32),
          "ln2": jnp.ones((d,), F32)}


def layer_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
  x = x.astype(F32)
  x = (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(
      x.var(-1, keepdims=True) + 1e-5)
  return (x * scale).astype(BF16)


def bf16_dot(lhs: jax.Array, rhs: jax.Array, dims: Any) -> jax.Array:
  # A bfloat16 result: the GEMM still accumulates in float32, and the
  # cotangents stay bfloat16, so both gradient GEMMs run in bfloat16 too.
  # (A float32 result cast to bfloat16 sends float32 cotangents back, and
  # JAX's transpose then runs the gradient GEMMs with float32 operands.)
  return jax.lax.dot_general(lhs, rhs, dims)


def block(params: dict[str, jax.Array], x: jax.Array, heads: int,
          dots: dict[str, Callable[..., jax.Array]]) -> jax.Array:
  """A pre-LN block; ``dots[name]`` runs projection ``name``."""
  b, t, d = x.shape

  def proj(name: str, h: jax.Array) -> jax.Array:
    w = params[name].astype(BF16)
    return dots[name](h, w, (((h.ndim - 1,), (0,)), ((), ())))

  h = layer_norm(x, params["ln1"])
  q, k, v = jnp.split(proj("qkv", h), 3, axis=-1)
  split = lambda z: z.reshape(b, t, heads, d // heads)
  q, k, v = split(q), split(k), split(v)
  # bfloat16 products (float32 accumulation inside the GEMM), the softmax
  # in float32.
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(F32) / np.sqrt(d // heads)
  causal = jnp.tril(jnp.ones((t, t), bool))
  weights = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
  attn = jnp.einsum("bhqk,bkhd->bqhd", weights.astype(BF16), v)
  x = x + proj("out", attn.reshape(b, t, d)).astype(F32)
  h = layer_norm(x, params["ln2"])
  h = jax.nn.gelu(proj("up", h))
  return x + proj("down", h).astype(F32)


def loss_of(params, fp8_state, x, heads: int, recipe) -> jax.Array:
  if recipe is None:
    dots = {n: bf16_dot for n in PROJECTIONS}
  elif isinstance(recipe, (fp8.CurrentScaling, fp8.MXFP8)):
    dots = {n: fp8.dot_general(recipe) for n in PROJECTIONS}
  else:
    dots = {n: fp8.dot_general(recipe, fp8_state[n]) for n in PROJECTIONS}
  y = block(params, x, heads, dots)
  return jnp.mean(jnp.square(y))


def variants(heads: int) -> dict[str, tuple[Callable, Callable, Any]]:
  """name -> (init(params) -> state, step(state, x) -> state, recipe)."""
  out = {}
  for name, recipe in (
      ("bf16", None), ("fp8-current", fp8.CurrentScaling()),
      ("fp8-delayed", fp8.DelayedScaling()),
      ("fp8-row", fp8.CurrentScaling(granularity="row")),
      ("fp8-block", fp8.CurrentScaling(granularity="block")),
      ("fp8-mx", fp8.MXFP8())):
    def init(params, recipe=recipe):
      state = ({n: recipe.init() for n in PROJECTIONS}
               if isinstance(recipe, fp8.DelayedScaling) else {})
      return params, jax.tree.map(jnp.asarray, state)

    def step(state, x, recipe=recipe):
      params, fp8_state = state
      grads, observed = jax.grad(loss_of, argnums=(0, 1))(
          params, fp8_state, x, heads, recipe)
      params = jax.tree.map(lambda p, g: p - LR * g, params, grads)
      if fp8_state:
        fp8_state = fp8.commit(fp8_state, observed)
      return params, fp8_state

    out[name] = (init, step, recipe)
  return out


def fp8_dot_count(lowered_text: str) -> int:
  """FP8 ``dot_general``s plus MX's block-scaled dots (``xla.scaled_dot``
  composites of FP8 operands; the dot inside their decomposition, on
  dequantised values, is not counted)."""
  count = 0
  for line in lowered_text.splitlines():
    dot = ("stablehlo.dot_general" in line
           or 'stablehlo.composite "xla.scaled_dot"' in line)
    count += dot and ("f8E4M3FN" in line or "f8E5M2" in line)
  return count


_GEMM = re.compile(r'custom_call_target="__cublas[^"]*"'
                   r'|"kind":"__(?:triton_gemm|triton_nested_gemm_fusion'
                   r'|cudnn\$fusion)"')
_F8 = re.compile(r"f8e4m3fn|f8e5m2")


def gemm_operands(compiled_text: str) -> collections.Counter[str]:
  """GEMMs in compiled HLO text, counted by their operands' dtypes.

  A GEMM is a cuBLAS/cuBLASLt custom call or a Triton or cuDNN GEMM fusion
  (compiled HLO names operands without their types, so they are looked up
  where they are defined); keys read like ``"bf16 x bf16"``. Empty on the
  CPU: dots stay ``dot`` ops inside ordinary fusions.
  """
  types = dict(re.findall(r"^\s*(?:ROOT )?%(\S+) = (\([^)]*\)|\S+) ",
                          compiled_text, re.M))
  counts: collections.Counter[str] = collections.Counter()
  for line in compiled_text.splitlines():
    call = re.search(r" (?:custom-call|fusion)\(([^)]*)\)", line)
    if _GEMM.search(line) is None or call is None:
      continue
    dtypes = [re.split(r"[\[{]", types.get(op.strip().lstrip("%"), "?"))[0]
              for op in call.group(1).split(",")[:2]]
    counts[" x ".join(dtypes)] += 1
  return counts


def fp8_gemms(counts: collections.Counter[str]) -> int:
  """GEMMs of :func:`gemm_operands` with an FP8 operand."""
  return sum(n for key, n in counts.items() if _F8.search(key))


def main() -> None:
  on_cpu = jax.default_backend() == "cpu"
  parser = size_parser(str(__doc__).splitlines()[0],
                       width=128 if on_cpu else 4096, depth=1,
                       batch=2 if on_cpu else 4, steps=2 if on_cpu else 10,
                       rounds=3 if on_cpu else 5)
  parser.add_argument("--seq", type=int, default=64 if on_cpu else 2048)
  parser.add_argument("--heads", type=int, default=4 if on_cpu else 32)
  parser.add_argument("--dump", type=pathlib.Path, default=None,
                      help="write each variant's compiled HLO text here")
  parser.add_argument("--variants", nargs="+", default=None,
                      help="only these variants, in this order (bf16"
                      " always runs first: the baseline)")
  args = parser.parse_args()
  d, heads = args.width, args.heads
  if d % heads:
    parser.error(f"--width {d} is not a multiple of --heads {heads}")
  params = init_params(d)
  x = jnp.asarray(np.random.default_rng(1).standard_normal(
      (args.batch, args.seq, d)), F32)
  print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()});"
        f" d={d}, heads={heads}, seq={args.seq}, batch={args.batch}")
  if on_cpu:
    print("XLA:CPU emulates FP8 (converts to float32 around the dot): the"
          " times below say nothing about FP8 hardware.")

  specs = variants(heads)
  if args.variants is not None:
    unknown = set(args.variants) - set(specs)
    if unknown:
      parser.error(f"unknown variants {sorted(unknown)}; known: {list(specs)}")
    # bf16 first, then the variants in the order given.
    specs = {n: specs[n] for n in dict.fromkeys(["bf16", *args.variants])}
  rows, compiled, states = [], {}, {}
  header = (f"{'variant':12} {'fp8 dots':>8} {'gemms f8/all':>12}"
            f" {'bytes (MB)':>10} {'peak (MB)':>9} {'residuals (MB)':>14}"
            f" {'bf16 ms':>9} {'ms/step':>9} {'vs bf16':>8}")
  for name, (init, step, recipe) in specs.items():
    start = time.perf_counter()
    state = init(jax.tree.map(lambda p: p.copy(), params))
    lowered = jax.jit(step, donate_argnums=0).lower(state, x)
    compiled[name] = lowered.compile()
    text = compiled[name].as_text()
    if args.dump is not None:
      args.dump.mkdir(parents=True, exist_ok=True)
      (args.dump / f"fp8_{name}.hlo.txt").write_text(text)
    # The backward pass's residuals, abstractly (nothing is computed).
    vjp = jax.eval_shape(lambda p, s, r=recipe: jax.vjp(
        lambda p: loss_of(p, s, x, heads, r), p)[1], params, state[1])
    row = (name, fp8_dot_count(lowered.as_text()), gemm_operands(text),
           bytes_accessed(compiled[name]), peak_bytes(compiled[name]),
           max(tree_bytes(vjp) - tree_bytes(params), 0))
    rows.append(row)
    # Two warm-up steps, as the timed loop runs them (state donated).
    states[name] = jax.block_until_ready(
        compiled[name](compiled[name](state, x), x))
    print(f"compiled and warmed up {name} in"
          f" {time.perf_counter() - start:.1f} s", flush=True)
    # Each variant timed against bf16 as soon as it is built, interleaved,
    # and printed: a run cut short by a time limit keeps its rows.
    pair = {n: compiled[n] for n in dict.fromkeys(("bf16", name))}
    times = interleaved_seconds(
        {n: (lambda s, f=f: f(s, x)) for n, f in pair.items()}, states,
        n_steps=args.steps, rounds=args.rounds)
    base = statistics.median(times["bf16"])
    t = statistics.median(times[name])
    _, n_fp8, gemms, nbytes, peak, residual = row
    f8_of_all = f"{fp8_gemms(gemms)}/{sum(gemms.values())}"
    if len(rows) == 1:
      print(header)
    # "bf16 ms": the baseline's time in this variant's own interleaved pair.
    print(f"{name:12} {n_fp8:8d} {f8_of_all:>12} {nbytes / 1e6:10.1f}"
          f" {peak / 1e6:9.1f} {residual / 1e6:14.2f} {1e3 * base:9.2f}"
          f" {1e3 * t:9.2f} {t / base:7.2f}x", flush=True)
  for name, _, gemms, *_ in rows:
    if gemms:
      print(f"{name} GEMM operands: " + ", ".join(
          f"{n} {key}" for key, n in sorted(gemms.items())))


if __name__ == "__main__":
  main()
