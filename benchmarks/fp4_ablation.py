"""Which ingredient of the NVFP4 recipe matters? An ablation on the char-LM.

Trains the one-block character Transformer of ``jmp_lite.examples`` (the
task of the FP8 fidelity tests: bfloat16 compute, float32 params, Adam 3e-4
for ``--steps``, 300 by default) with the q/k/v/out projections and both MLP
layers in FP4; the embedding and the logits layer stay bfloat16, as the
recipe keeps its first and last layers high. Each step draws a fresh key for
the FP4 layers. Rows: bfloat16; the full NVFP4 recipe; NVFP4 without
stochastic rounding, without the Hadamard transform, without 2-D weight
tiles; NVFP4 with a bfloat16 weight gradient (``PerDirection``); MXFP4;
NVFP4 and MXFP4 in the forward GEMM only (bfloat16 gradient GEMMs). Printed,
as a Markdown table: the held-out loss (mean and standard deviation over
``--seeds``), and each row's gap to bfloat16's and to full NVFP4's, paired
by seed (same initialisation and batches), as mean and standard error: the
seed-to-seed spread of the loss itself is as large as the gaps, the paired
gaps' much smaller.

``python benchmarks/fp4_ablation.py [--steps 300] [--seeds 2]
[--recipes NVFP4 MXFP4]``
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jmp_lite
from jmp_lite import examples, fp4

NV = fp4.NVFP4()
RECIPES: dict[str, Any] = {
    "bfloat16": None,
    "NVFP4": NV,
    "NVFP4 - stochastic rounding": fp4.NVFP4(stochastic_gradients=False),
    "NVFP4 - Hadamard": fp4.NVFP4(hadamard=0),
    "NVFP4 - 2-D weight tiles": fp4.NVFP4(weight_blocks=None),
    "NVFP4, bf16 weight gradient": fp4.PerDirection(NV, NV, None),
    "MXFP4": fp4.MXFP4(),
    # How much of each format's gap is its forward GEMM's (both gradient
    # GEMMs in bfloat16).
    "NVFP4 forward only": fp4.PerDirection(NV, None, None),
    "MXFP4 forward only": fp4.PerDirection(fp4.MXFP4(), None, None),
}


def char_lm(recipe: Any, *, steps: int, lr: float = 3e-4, seq: int = 32,
            batch: int = 32, dim: int = 64, seed: int = 0) -> tuple[float,
                                                                  float]:
  """Held-out (loss, accuracy) of the char-LM; ``recipe=None``: bfloat16."""
  import flax.linen as nn
  import optax

  import jmp_lite.fp4.linen as fp4_linen
  from jmp_lite.linen import dot_product_attention_fp32
  text = examples.python_docs_text()
  chars = sorted(set(text))
  ids = np.array([chars.index(c) for c in text], np.int32)
  cut = int(0.85 * len(ids))
  train_ids, test_ids = ids[:cut], ids[cut - seq:]
  fields = {} if recipe is None else fp4_linen.layer_fields(recipe)
  attn = {} if recipe is None else fp4_linen.layer_fields(
      recipe, nn.MultiHeadDotProductAttention)
  kw = {"dtype": jnp.bfloat16, "param_dtype": jnp.float32}

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, mask):
      h = nn.LayerNorm()(x)
      h = nn.MultiHeadDotProductAttention(
          num_heads=4, attention_fn=dot_product_attention_fp32, **kw,
          **attn)(h, h, mask=mask)
      x = x + h
      h = nn.Dense(4 * dim, **kw, **fields)(nn.LayerNorm()(x))
      return x + nn.Dense(dim, **kw, **fields)(nn.gelu(h))

  class CharLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      x = nn.Embed(len(chars), dim)(tokens)
      x = x + self.param("pos", nn.initializers.normal(0.02),
                         (seq, dim))[:tokens.shape[-1]]
      x = Block()(x, nn.make_causal_mask(tokens))
      return nn.Dense(len(chars), **kw)(nn.LayerNorm()(x))

  model = CharLM()
  params = model.init(jax.random.key(seed),
                      jnp.zeros((1, seq), jnp.int32))["params"]
  rng = np.random.default_rng(seed + 1)
  starts = rng.integers(0, len(train_ids) - seq - 1, (steps, batch))
  windows = lambda src, s: np.stack([src[i:i + seq + 1] for i in s])
  base = jax.random.key(seed + 100)

  def batches(i):
    return (jnp.asarray(windows(train_ids, starts[i])),
            jax.random.fold_in(base, i))

  def xent(p, b, rngs):
    logits = model.apply({"params": p}, b[:, :-1], rngs=rngs)
    logits = jnp.asarray(logits, jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, b[:, 1:]), logits

  test = jnp.asarray(windows(test_ids, range(0, len(test_ids) - seq - 1)))

  @jax.jit
  def evaluate(p):
    loss, logits = xent(p, test, {})
    return loss.mean(), jnp.mean(jnp.argmax(logits, -1) == test[:, 1:])

  result = examples.fit(
      params, lambda p, b: xent(p, b[0], {"fp4": b[1]})[0].mean(), batches,
      steps=steps, lr=lr, loss_scale=jmp_lite.NoOpLossScale(), master=False,
      eval_fn=evaluate)
  return result.eval_loss, result.accuracy


def paired(gaps: list[float]) -> str:
  """``mean +- standard error`` of per-seed percentage gaps."""
  mean = float(np.mean(gaps))
  if len(gaps) < 2:
    return f"{mean:+.2f}%"
  se = float(np.std(gaps, ddof=1)) / np.sqrt(len(gaps))
  return f"{mean:+.2f} ± {se:.2f}%"


def main() -> None:
  parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--seeds", type=int, default=2)
  parser.add_argument("--recipes", nargs="+", default=list(RECIPES),
                      help="the rows to run (bfloat16 always runs)")
  args = parser.parse_args()
  names = ["bfloat16", *(n for n in args.recipes if n != "bfloat16")]
  unknown = [n for n in names if n not in RECIPES]
  if unknown:
    parser.error(f"unknown recipes {unknown}; expected some of {list(RECIPES)}")
  losses, accs, secs = {}, {}, {}
  for name in names:
    start = time.perf_counter()
    runs = [char_lm(RECIPES[name], steps=args.steps, seed=s)
            for s in range(args.seeds)]
    losses[name] = [r[0] for r in runs]
    accs[name] = float(np.mean([r[1] for r in runs]))
    secs[name] = time.perf_counter() - start

  def gaps(name: str, ref: str) -> list[float]:
    # Per seed: both runs share the initialisation and the batches.
    return [100 * (a / b - 1) for a, b in zip(losses[name], losses[ref],
                                               strict=True)]

  print(f"char-LM, {args.steps} steps, {args.seeds} seeds (mean ± std of the"
        " loss; gaps per seed, mean ± standard error),"
        f" {jax.default_backend()}")
  nv = "NVFP4" if "NVFP4" in losses else None
  print("| recipe | held-out loss | vs bfloat16 | vs NVFP4 | accuracy |"
        " seconds |")
  print("| --- | --- | --- | --- | --- | --- |")
  for name in names:
    loss = losses[name]
    spread = f" ± {np.std(loss, ddof=1):.4f}" if len(loss) > 1 else ""
    vs_bf16 = "" if name == "bfloat16" else paired(gaps(name, "bfloat16"))
    vs_nv = "" if nv is None or name in ("bfloat16", nv) else paired(
        gaps(name, nv))
    print(f"| {name} | {np.mean(loss):.4f}{spread} | {vs_bf16} | {vs_nv} |"
          f" {accs[name]:.4f} | {secs[name]:.0f} |")


if __name__ == "__main__":
  main()
