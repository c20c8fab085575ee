"""A small Transformer whose matmuls run in FP8: per-tensor and MXFP8.

Every projection (attention's query, key, value and output, the MLP's two
layers) takes ``jmp_lite.fp8.dot_general(recipe)``: operands quantised to
E4M3 forward and the incoming gradient to E5M2 (per-tensor) or E4M3 (MXFP8)
backward, float32 accumulation. The embedding, norms, attention scores and
the output head stay bfloat16. The same model trains with two recipes:
``CurrentScaling()`` (one scale per tensor) and ``MXFP8()`` (one power-of-two
scale per 32 elements along the contracting dimension). On an H100 or newer
the FP8 matmuls run on FP8 tensor cores; on a CPU XLA emulates them.

  python examples/fp8_transformer.py --steps 50
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite
import jmp_lite.fp8

VOCAB, LENGTH, DIM, HEADS = 32, 16, 64, 4


class Block(nn.Module):
  dot_general: object

  @nn.compact
  def __call__(self, x):
    dense = lambda n, name: nn.Dense(n, dtype=jnp.bfloat16, name=name,
                                     dot_general=self.dot_general)
    h = nn.LayerNorm(dtype=jnp.float32)(x).astype(jnp.bfloat16)
    q, k, v = (dense(DIM, n)(h).reshape(*h.shape[:-1], HEADS, -1)
               for n in ("query", "key", "value"))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(DIM // HEADS)
    causal = jnp.tril(jnp.ones((LENGTH, LENGTH), bool))
    weights = jax.nn.softmax(
        jnp.where(causal, scores.astype(jnp.float32), -1e9), axis=-1)
    attended = jnp.einsum("bhqk,bkhd->bqhd", weights.astype(jnp.bfloat16), v)
    x = x + dense(DIM, "out")(attended.reshape(h.shape))
    h = nn.LayerNorm(dtype=jnp.float32)(x).astype(jnp.bfloat16)
    return x + dense(DIM, "mlp_out")(nn.gelu(dense(4 * DIM, "mlp_in")(h)))


class Transformer(nn.Module):
  dot_general: object

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, DIM, dtype=jnp.bfloat16)(tokens)
    x = x + self.param("position", nn.initializers.normal(0.02),
                       (LENGTH, DIM)).astype(jnp.bfloat16)
    x = Block(self.dot_general)(x)
    return nn.Dense(VOCAB, dtype=jnp.bfloat16, name="head")(x)


def train(recipe, steps: int, tokens, targets) -> tuple[list[float], str]:
  model = Transformer(jmp_lite.fp8.dot_general(recipe))
  params = model.init(jax.random.key(0), tokens)["params"]
  optimizer = jmp_lite.loss_scaled(optax.adam(3e-3), "bf16")
  opt_state = optimizer.init(params)

  def loss_fn(params, tokens, targets):
    logits = model.apply({"params": params}, tokens).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, targets).mean()

  def train_step(params, opt_state, tokens, targets):
    loss, grads = jmp_lite.scaled_value_and_grad(loss_fn, opt_state)(
        params, tokens, targets)
    params, opt_state = jmp_lite.update_and_apply(optimizer, grads,
                                                  opt_state, params)
    return params, opt_state, loss

  step = jax.jit(train_step, donate_argnums=(0, 1))
  program = step.lower(params, opt_state, tokens, targets).as_text()
  losses = []
  for _ in range(steps):
    params, opt_state, loss = step(params, opt_state, tokens, targets)
    losses.append(float(loss))
  return losses, program


def main(steps: int) -> None:
  # The task: repeat the token before (a causal copy, one step back).
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, VOCAB, (32, LENGTH)))
  targets = jnp.roll(tokens, 1, axis=1)
  for name, recipe in (("per-tensor", jmp_lite.fp8.CurrentScaling()),
                       ("MXFP8", jmp_lite.fp8.MXFP8())):
    losses, program = train(recipe, steps, tokens, targets)
    # A dot_general on FP8 operands, or MXFP8's scaled dot (FP8 operands,
    # E8M0 scales) that XLA lowers to the GPU's block-scaled GEMM.
    fp8_dots = [line for line in program.splitlines()
                if ("stablehlo.dot_general" in line
                    or 'composite "xla.scaled_dot"' in line)
                and "f8E" in line]
    print(f"{name}: loss {losses[0]:.3f} -> {losses[-1]:.3f},"
          f" {len(fp8_dots)} FP8 matmuls in the step")
    # What this example demonstrates, checked: six projections, each with a
    # forward and two gradient matmuls, in FP8; and the model learns.
    assert len(fp8_dots) >= 18, len(fp8_dots)
    assert np.isfinite(losses).all() and losses[-1] < 0.8 * losses[0], losses
  print("ok")


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=30)
  main(parser.parse_args().steps)
