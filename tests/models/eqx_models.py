"""An Equinox CNN in the style of Equinox's MNIST tutorial (per example)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp


class CNN(eqx.Module):
  """Layers in a list, applied in turn to one unbatched image."""

  layers: list

  def __init__(self, key):
    k1, k2, k3 = jax.random.split(key, 3)
    self.layers = [
        eqx.nn.Conv2d(1, 4, kernel_size=3, key=k1),
        eqx.nn.MaxPool2d(kernel_size=2),
        jax.nn.relu,
        jnp.ravel,
        eqx.nn.Linear(4 * 9 * 9, 32, key=k2),
        jax.nn.sigmoid,
        eqx.nn.LayerNorm(32),
        eqx.nn.Linear(32, 10, key=k3),
        jax.nn.log_softmax,
    ]

  def __call__(self, x):
    for layer in self.layers:
      x = layer(x)
    return x
