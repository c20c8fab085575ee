"""Flax linen models written the way Flax's public examples write them.

Every layer is handed the model's ``dtype`` field (``jnp.float32`` by
default), BatchNorm gets an ``axis_name``, the decoder scans remat-ted
layers and ties its logits to the embedding. These are our own models in
that style: the point is that jmp_lite's policy must govern them unedited.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

ModuleDef = Any


class ResidualUnit(nn.Module):
  """Two 3x3 convolutions with batch norm and a projected shortcut."""

  filters: int
  conv: ModuleDef
  norm: ModuleDef
  act: Callable[..., Any]
  strides: tuple[int, int] = (1, 1)

  @nn.compact
  def __call__(self, x):
    shortcut = x
    y = self.act(self.norm()(self.conv(self.filters, (3, 3), self.strides)(x)))
    y = self.norm(scale_init=nn.initializers.zeros_init())(
        self.conv(self.filters, (3, 3))(y))
    if shortcut.shape != y.shape:
      shortcut = self.norm(name="proj_norm")(
          self.conv(self.filters, (1, 1), self.strides, name="proj")(shortcut))
    return self.act(shortcut + y)


class ResNet(nn.Module):
  """An ImageNet-example-style ResNet: dtype passed to every layer."""

  stage_sizes: Sequence[int] = (1, 1)
  num_filters: int = 8
  num_classes: int = 10
  dtype: Any = jnp.float32
  act: Callable[..., Any] = nn.relu

  @nn.compact
  def __call__(self, x, train: bool = True):
    conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
    norm = functools.partial(nn.BatchNorm, use_running_average=not train,
                             momentum=0.9, epsilon=1e-5, dtype=self.dtype,
                             axis_name="batch")
    x = conv(self.num_filters, (3, 3), name="conv_init")(x)
    x = nn.relu(norm(name="bn_init")(x))
    for i, size in enumerate(self.stage_sizes):
      for j in range(size):
        strides = (2, 2) if i > 0 and j == 0 else (1, 1)
        x = ResidualUnit(self.num_filters * 2**i, conv=conv, norm=norm,
                         act=self.act, strides=strides)(x)
    x = jnp.mean(x, axis=(1, 2))
    x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
    return jnp.asarray(x, self.dtype)


class MlpBlock(nn.Module):
  mlp_dim: int
  dtype: Any = jnp.float32
  dropout_rate: float = 0.1

  @nn.compact
  def __call__(self, x, deterministic: bool):
    d = x.shape[-1]
    y = nn.gelu(nn.Dense(self.mlp_dim, dtype=self.dtype)(x))
    y = nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)
    return nn.Dense(d, dtype=self.dtype)(y)


class DecoderLayer(nn.Module):
  """Pre-LN self-attention + MLP.

  A ``nn.scan`` body: (carry, ...) -> (carry, None).
  """

  num_heads: int
  mlp_dim: int
  dtype: Any = jnp.float32
  dropout_rate: float = 0.1

  @nn.compact
  def __call__(self, x, mask, deterministic: bool):
    y = nn.LayerNorm(dtype=self.dtype)(x)
    y = nn.MultiHeadDotProductAttention(
        num_heads=self.num_heads, dtype=self.dtype,
        dropout_rate=self.dropout_rate, deterministic=deterministic)(
            y, mask=mask)
    x = x + nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)
    y = nn.LayerNorm(dtype=self.dtype)(x)
    return x + MlpBlock(self.mlp_dim, self.dtype, self.dropout_rate)(
        y, deterministic), None


class Decoder(nn.Module):
  """An LM1B-example-style decoder: scanned, remat-ted, tied logits."""

  vocab_size: int = 32
  emb_dim: int = 16
  num_heads: int = 2
  num_layers: int = 2
  mlp_dim: int = 32
  max_len: int = 16
  dtype: Any = jnp.float32
  dropout_rate: float = 0.1

  @nn.compact
  def __call__(self, tokens, train: bool = True):
    embed = nn.Embed(self.vocab_size, self.emb_dim, dtype=self.dtype,
                     name="shared_embedding")
    x = embed(tokens.astype(jnp.int32))
    pos = self.param("pos_embedding", nn.initializers.normal(0.02),
                     (1, self.max_len, self.emb_dim))
    x = x + pos[:, :tokens.shape[1]]
    x = nn.Dropout(self.dropout_rate)(x, deterministic=not train)
    mask = nn.make_causal_mask(tokens)
    layers = nn.scan(
        nn.remat(DecoderLayer, static_argnums=(3,)),
        variable_axes={"params": 0}, split_rngs={"params": True,
                                                 "dropout": True},
        in_axes=(nn.broadcast, nn.broadcast), length=self.num_layers)
    x, _ = layers(self.num_heads, self.mlp_dim, self.dtype,
                  self.dropout_rate, name="layers")(x, mask, not train)
    x = nn.LayerNorm(dtype=self.dtype, name="final_norm")(x)
    logits = embed.attend(x)
    return logits / jnp.sqrt(x.shape[-1]).astype(logits.dtype)


class Tagger(nn.Module):
  """A sequence tagger: embedding, ``nn.RNN(nn.LSTMCell)``, per-step logits."""

  vocab_size: int = 32
  hidden: int = 16
  num_tags: int = 5

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab_size, self.hidden)(tokens)
    x = nn.RNN(nn.LSTMCell(self.hidden))(x)
    return nn.Dense(self.num_tags)(x)
