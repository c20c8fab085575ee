"""How well do the 8/4-bit maps keep Adam's moments? The maps' error table.

Trains the digits MLP (64-128-128-10, ``jmp_lite.examples``' data) with
float32 Adam (3e-4, batch 128) for ``--steps`` (300 by default), then stores
its moments with each map (linear absmax, power 1; the square maps, power 2,
which ``quantized_states`` uses) in 8 and 4 bits, blocks of 256, with nearest
and with stochastic codes, and reads them back. Printed, as a Markdown
table: ``mu``'s relative L2 error, the median relative error of ``sqrt(nu)``
over its positive elements, and the relative L2 error of Adam's direction
``m / (sqrt(v) + eps)`` (bias-corrected), what the step applies; and how many
positive ``nu`` elements came back as 0 (Adam would divide by them).

``python benchmarks/quantized_maps.py [--steps 300]``
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite.examples import load_digits_split
from jmp_lite.low_precision._blockwise import dequantize, quantize


def moments(steps: int, seed: int = 0) -> tuple[jax.Array, jax.Array, int]:
  """Adam's (mu, nu) after ``steps`` on the digits, flattened, and the
  step count."""
  x_tr, y_tr, _, _ = load_digits_split(seed)
  key = jax.random.key(seed)
  sizes = [64, 128, 128, 10]
  params: list[dict[str, Any]] = []
  for a, b in zip(sizes[:-1], sizes[1:], strict=True):
    key, k = jax.random.split(key)
    params.append({"w": jax.random.normal(k, (a, b)) / np.sqrt(a),
                   "b": jnp.zeros(b)})

  def loss(p: list[dict[str, Any]], x: jax.Array, y: jax.Array) -> jax.Array:
    for layer in p[:-1]:
      x = jax.nn.relu(x @ layer["w"] + layer["b"])
    logits = x @ p[-1]["w"] + p[-1]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  opt = optax.adam(3e-4)
  state = opt.init(params)

  @jax.jit
  def step(p: Any, s: Any, x: jax.Array, y: jax.Array) -> Any:
    updates, s = opt.update(jax.grad(loss)(p, x, y), s, p)
    return optax.apply_updates(p, updates), s

  rng = np.random.default_rng(seed + 1)
  for _ in range(steps):
    idx = rng.integers(0, len(x_tr), 128)
    params, state = step(params, state, jnp.asarray(x_tr[idx]),
                         jnp.asarray(y_tr[idx]))
  adam: Any = state[0]  # type: ignore[index]
  flat = lambda t: jnp.concatenate([v.ravel() for v in jax.tree.leaves(t)])
  return flat(adam.mu), flat(adam.nu), steps


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
  parser = argparse.ArgumentParser(
      description=(__doc__ or "").splitlines()[0])
  parser.add_argument("--steps", type=int, default=300)
  args = parser.parse_args(argv)
  mu, nu, t = moments(args.steps)
  bc1, bc2 = 1 - 0.9**t, 1 - 0.999**t
  n = mu.size // 256 * 256
  mu, nu = mu[:n].reshape(-1, 256), nu[:n].reshape(-1, 256)
  direction = (mu / bc1) / (jnp.sqrt(nu / bc2) + 1e-8)
  rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
  print(f"Adam's moments after {t} steps of the digits MLP ({n} elements)\n")
  print("| bits | power | codes | mu rel. L2 error | median rel. error of"
        " sqrt(nu) | Adam direction rel. L2 error | positive nu read as 0 |")
  print("| --- | --- | --- | --- | --- | --- | --- |")
  rows = []
  for bits in (8, 4):
    for power in (1.0, 2.0):
      for codes in ("nearest", "stochastic"):
        noise = None if codes == "nearest" else jax.random.uniform(
            jax.random.key(5), mu.shape)
        q_mu = dequantize(quantize(mu, bits=bits, block_size=256, signed=True,
                                   power=power, noise=noise))
        q_nu = dequantize(quantize(nu, bits=bits, block_size=256,
                                   signed=False, power=power, noise=noise))
        d = (q_mu / bc1) / (jnp.sqrt(q_nu / bc2) + 1e-8)
        pos = nu > 0
        med = float(jnp.median(jnp.abs(jnp.sqrt(q_nu[pos]) - jnp.sqrt(
            nu[pos])) / jnp.sqrt(nu[pos])))
        row = {"bits": bits, "power": power, "codes": codes,
               "mu": rel(q_mu, mu), "sqrt_nu": med,
               "direction": rel(d, direction),
               "zeros": int(jnp.sum((q_nu == 0) & pos))}
        rows.append(row)
        print(f"| {bits} | {power:g} | {codes} | {row['mu']:.4f} |"
              f" {row['sqrt_nu']:.4f} | {row['direction']:.4f} |"
              f" {row['zeros']} |", flush=True)
  return rows


if __name__ == "__main__":
  main()
