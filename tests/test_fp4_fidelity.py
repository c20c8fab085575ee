"""FP4 training against bfloat16 on the digits MLP (held-out loss).

The digits task of ``tests/test_fp8.py``'s fidelity test (bfloat16 compute,
float32 params, Adam 3e-4 for 300 steps; ``FIDELITY_SETTINGS``), with the
hidden 128x128 layer's matmuls in FP4 and the first and last layers kept in
bfloat16, as the NVFP4 recipe keeps its sensitive layers high. Each step
draws a fresh key for the FP4 layer (``rngs={"fp4": ...}``): stochastic
gradient rounding and Hadamard signs. The held-out loss, averaged over
seeds, must stay within 5% of bfloat16's for NVFP4 and 12% for MXFP4.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite
from jmp_lite import fp4
from tests.conftest import FIDELITY_SETTINGS

SEEDS = (0, 1)
BOUNDS = {"nvfp4": (fp4.NVFP4(), 1.05), "mxfp4": (fp4.MXFP4(), 1.12)}


def digits_task(recipe, *, steps, lr, batch=128, width=128, seed=0):
  """Held-out (loss, accuracy) of the digits MLP; ``recipe=None``: bf16."""
  import flax.linen as nn
  import optax

  import jmp_lite.fp4.linen as fp4_linen
  from jmp_lite import examples
  x_tr, y_tr, x_te, y_te = examples.load_digits_split(seed)
  fields = {} if recipe is None else fp4_linen.layer_fields(recipe)

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      kw = {"dtype": jnp.bfloat16, "param_dtype": jnp.float32}
      x = nn.relu(nn.Dense(width, **kw)(x))
      x = nn.relu(nn.Dense(width, **kw, **fields)(x))
      return nn.Dense(10, **kw)(x)

  model = MLP()
  params = model.init(jax.random.key(seed), x_tr[:1])["params"]
  rng = np.random.default_rng(seed + 1)
  flat = np.concatenate([rng.permutation(len(x_tr))
                         for _ in range(steps * batch // len(x_tr) + 2)])
  base = jax.random.key(seed + 100)

  def batches(i):
    idx = flat[i * batch:(i + 1) * batch]
    return (jnp.asarray(x_tr[idx]), jnp.asarray(y_tr[idx]),
            jax.random.fold_in(base, i))

  def loss_fn(p, b):
    x, y, key = b
    logits = model.apply({"params": p}, x, rngs={"fp4": key})
    logits = logits.astype(jnp.float32)  # pyright: ignore[reportAttributeAccessIssue]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  @jax.jit
  def evaluate(p):
    logits = model.apply({"params": p}, x_te)
    logits = logits.astype(jnp.float32)  # pyright: ignore[reportAttributeAccessIssue]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y_te)
    return loss.mean(), jnp.mean(jnp.argmax(logits, -1) == y_te)

  result = examples.fit(params, loss_fn, batches, steps=steps, lr=lr,
                        loss_scale=jmp_lite.NoOpLossScale(), master=False,
                        eval_fn=evaluate)
  assert result.skipped == 0
  return result.eval_loss, result.accuracy


@pytest.fixture(scope="module")
def reference(optimized_codegen):
  pytest.importorskip("sklearn")
  return np.mean([digits_task(None, seed=s, **FIDELITY_SETTINGS)[0]
                  for s in SEEDS])


@pytest.mark.slow   # 300-step trainings, as tests/test_fp8.py's fidelity
@pytest.mark.parametrize("name", list(BOUNDS))
def test_fp4_training_stays_near_bfloat16(reference, name):
  recipe, bound = BOUNDS[name]
  loss = np.mean([digits_task(recipe, seed=s, **FIDELITY_SETTINGS)[0]
                  for s in SEEDS])
  print(f"\nfp4 fidelity digits {name}: eval loss {loss:.4f} (bf16"
        f" {reference:.4f}, {100 * (loss / reference - 1):+.1f}%)")
  assert np.isfinite(loss)
  assert loss <= bound * reference, (name, loss, reference)
