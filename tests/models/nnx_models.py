"""Flax nnx models written the way nnx's public examples write them.

The CNN takes its ``Rngs`` at call time (as the MNIST tutorial does); the
language model ties its output layer to its embedding with ``Embed.attend``
and exposes ``encode``; the stateful block holds what a call changes (batch
statistics, a dropout RNG stream); the decoder, shaped like Flax's gemma
example, returns its key/value cache from ``init_cache`` and from each call
instead of holding it.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
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


class DecoderBlock(nnx.Module):
  """Pre-norm causal self-attention and an MLP, reading and returning a
  key/value cache it is handed (``None``: no cache, a whole sequence)."""

  def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs):
    self.heads = heads
    self.norm1 = nnx.RMSNorm(dim, rngs=rngs)
    self.qkv = nnx.Linear(dim, 3 * dim, use_bias=False, rngs=rngs)
    self.proj = nnx.Linear(dim, dim, rngs=rngs)
    self.drop = nnx.Dropout(0.1)
    self.norm2 = nnx.RMSNorm(dim, rngs=rngs)
    self.up = nnx.Linear(dim, 2 * dim, rngs=rngs)
    self.down = nnx.Linear(2 * dim, dim, rngs=rngs)

  def __call__(self, x, start, cache=None, *, rngs=None):
    batch, length, dim = x.shape
    split = (batch, length, self.heads, dim // self.heads)
    q, k, v = (a.reshape(split) for a in
               jnp.split(self.qkv(self.norm1(x)), 3, axis=-1))
    q_pos = start + jnp.arange(length)
    if cache is None:
      keys, values, k_pos = k, v, q_pos
    else:
      # Written in the cache's dtype, as Flax's gemma example does.
      where = (0, start, 0, 0)
      keys = jax.lax.dynamic_update_slice(
          cache["k"], k.astype(cache["k"].dtype), where)
      values = jax.lax.dynamic_update_slice(
          cache["v"], v.astype(cache["v"].dtype), where)
      k_pos = jnp.arange(keys.shape[1])
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, keys) / math.sqrt(split[-1])
    causal = k_pos[None, :] <= q_pos[:, None]
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    mixed = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores), values)
    h = self.proj(mixed.reshape(batch, length, dim))
    x = x + self.drop(h, deterministic=rngs is None, rngs=rngs)
    x = x + self.down(nnx.gelu(self.up(self.norm2(x))))
    return x, (None if cache is None else {"k": keys, "v": values})


class CachedLM(nnx.Module):
  """A tiny decoder-only Transformer shaped like Flax's gemma example:
  ``init_cache`` returns a cache (K/V per layer and the next position), and
  ``__call__(tokens, cache)`` returns ``(logits, new_cache)``; dropout's
  ``Rngs`` come at call time; the logits are tied to the embedding."""

  def __init__(self, vocab: int = 32, dim: int = 16, heads: int = 2,
               layers: int = 2, max_len: int = 16, *, rngs: nnx.Rngs):
    self.heads = heads
    self.embed = nnx.Embed(vocab, dim, rngs=rngs)
    self.pos = nnx.Embed(max_len, dim, rngs=rngs)
    self.blocks = nnx.List([DecoderBlock(dim, heads, rngs=rngs)
                            for _ in range(layers)])
    self.norm = nnx.RMSNorm(dim, rngs=rngs)

  def init_cache(self, batch: int, max_len: int, dtype=jnp.bfloat16):
    dim = self.embed.features
    shape = (batch, max_len, self.heads, dim // self.heads)
    return {"index": jnp.zeros((), jnp.int32),
            "layers": [{"k": jnp.zeros(shape, dtype),
                        "v": jnp.zeros(shape, dtype)} for _ in self.blocks]}

  def __call__(self, tokens, cache=None, *, rngs=None):
    start = 0 if cache is None else cache["index"]
    x = self.embed(tokens) + self.pos(start + jnp.arange(tokens.shape[1]))
    layers = []
    for i, block in enumerate(self.blocks):
      x, kv = block(x, start, None if cache is None else cache["layers"][i],
                    rngs=rngs)
      layers.append(kv)
    logits = self.embed.attend(self.norm(x))
    if cache is None:
      return logits, None
    return logits, {"index": start + tokens.shape[1], "layers": layers}
