"""Flax nnx models written the way nnx's public examples write them.

The CNN takes its ``Rngs`` at call time (as the MNIST tutorial does); the
language model ties its output layer to its embedding with ``Embed.attend``
and exposes ``encode``; the stateful block holds what a call changes (batch
statistics, a dropout RNG stream).
"""

from __future__ import annotations

import functools

from flax import nnx


class CNN(nnx.Module):
  """An MNIST-tutorial-style CNN: dropout randomness passed per call."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
    self.conv2 = nnx.Conv(8, 16, kernel_size=(3, 3), rngs=rngs)
    self.avg_pool = functools.partial(nnx.avg_pool, window_shape=(2, 2),
                                      strides=(2, 2))
    self.dropout = nnx.Dropout(rate=0.1)
    self.linear1 = nnx.Linear(16 * 3 * 3, 32, rngs=rngs)
    self.linear2 = nnx.Linear(32, 10, rngs=rngs)

  def __call__(self, x, rngs: nnx.Rngs | None = None):
    x = self.avg_pool(nnx.relu(self.conv1(x)))
    x = self.avg_pool(nnx.relu(self.conv2(x)))
    x = x.reshape(x.shape[0], -1)
    x = self.dropout(nnx.relu(self.linear1(x)), rngs=rngs)
    return self.linear2(x)


class StatefulBlock(nnx.Module):
  """Linear, BatchNorm, Dropout: a call moves statistics and RNG counts."""

  def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs):
    self.lin = nnx.Linear(din, dout, rngs=rngs)
    self.bn = nnx.BatchNorm(dout, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x):
    return self.drop(self.bn(self.lin(x)))


class TiedLM(nnx.Module):
  """A small LM whose logits are ``embed.attend`` of the final features."""

  def __init__(self, vocab: int = 32, dim: int = 16, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, dim, rngs=rngs)
    self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=dim,
                                       decode=False, rngs=rngs)
    self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
    self.up = nnx.Linear(dim, 2 * dim, rngs=rngs)
    self.down = nnx.Linear(2 * dim, dim, rngs=rngs)
    self.final_norm = nnx.RMSNorm(dim, rngs=rngs)

  def encode(self, tokens):
    x = self.embed(tokens)
    mask = nnx.make_causal_mask(tokens)
    x = x + self.attn(self.norm1(x), mask=mask)
    return x + self.down(nnx.gelu(self.up(self.norm2(x))))

  def __call__(self, tokens):
    return self.embed.attend(self.final_norm(self.encode(tokens)))
