"""Small real training tasks for the notebooks and the fidelity tests.

* :func:`train_digits` — an MLP on scikit-learn's bundled digits (1,797 8x8
  images; no download).
* :func:`train_char_lm` — a one-block character-level Transformer on 20,000
  characters of Python's own documentation (``pydoc_data.topics``, which
  ships with CPython).

Both train a Flax model under a policy with ``loss_scaled`` (and optionally
master weights) and return loss and loss-scale curves, evaluation loss and
timing. They need Flax, and :func:`train_digits` needs scikit-learn.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite
from jmp_lite.diagnostics import tree_bytes

__all__ = ["OptimizerBuilder", "TrainResult", "fit", "load_digits_split",
           "low_precision_optimizer", "python_docs_text", "train_char_lm",
           "train_digits"]


@dataclasses.dataclass(frozen=True)
class TrainResult:
  """What one training run produced.

  Attributes:
    losses: training loss at every step (float32 values; NaN where the loss
      itself was not finite).
    scales: the loss scale after every step.
    eval_loss: mean loss on held-out data after training.
    accuracy: held-out accuracy (digits) or next-character accuracy.
    ms_per_step: wall-clock per step after compilation.
    skipped: steps skipped for non-finite gradients.
    param_bytes: bytes of the params as stored.
    state_bytes: bytes of the optimizer state.
    activation_bytes: bytes the backward pass keeps from the forward pass
      (the residuals of ``jax.vjp`` of the loss on one batch).
  """

  losses: np.ndarray
  scales: np.ndarray
  eval_loss: float
  accuracy: float
  ms_per_step: float
  skipped: int
  param_bytes: int
  state_bytes: int
  activation_bytes: int = 0


OptimizerBuilder = Callable[[optax.GradientTransformation, jmp_lite.LossScale],
                            optax.GradientTransformation]
"""``builder(adam, loss_scale) -> optimizer``, for :func:`fit`."""


def fit(params: Any, loss_fn: Callable[[Any, Any], jax.Array],
        batches: Callable[[int], Any], *, steps: int, lr: float,
        loss_scale: jmp_lite.LossScale, master: bool,
        eval_fn: Callable[[Any], tuple[Any, Any]] | None = None,
        progress: Callable[[int], None] | None = None,
        optimizer: OptimizerBuilder | None = None) -> TrainResult:
  """Trains ``params`` with Adam under ``loss_scaled`` (and master weights).

  The one training loop behind the examples and ``python -m jmp_lite``. The
  step is jitted once; losses and scales stay on the device until the loop
  has been queued, so the timing includes no host syncs.

  Args:
    params: initial params (in their param dtypes).
    loss_fn: ``loss_fn(params, batch)``, a float32 scalar.
    batches: ``batches(i)``, the i-th batch.
    steps: optimizer steps (after one compiling call).
    lr: Adam's learning rate.
    loss_scale: the initial loss scale.
    master: keep float32 master weights (otherwise a half-precision
      optimizer state is allowed).
    eval_fn: ``eval_fn(params) -> (loss, accuracy)`` on held-out data;
      without it the last training loss is reported and accuracy is NaN.
    progress: called with the number of steps done, about 20 times.
    optimizer: ``optimizer(adam, loss_scale)`` builds the optimizer from
      ``optax.adam(lr)`` and ``loss_scale`` instead of the default
      ``loss_scaled`` (+ ``master_weights``); it must contain a
      ``loss_scaled``. See :func:`low_precision_optimizer`.

  Returns:
    A :class:`TrainResult`.

  Raises:
    ValueError: if both ``master`` and ``optimizer`` are given.
  """
  if optimizer is not None:
    if master:
      raise ValueError("Pass either master=True or optimizer=, not both")
    opt = optimizer(optax.adam(lr), loss_scale)
  else:
    opt = jmp_lite.loss_scaled(optax.adam(lr), loss_scale,
                               allow_half_state=not master)
    if master:
      opt = jmp_lite.master_weights(opt)
  state = opt.init(params)

  @jax.jit
  def step(params, state, batch):
    scale = jmp_lite.current_loss_scale(state)
    grads, loss = jax.grad(
        lambda p: (scale.scale(loss_fn(p, batch)), loss_fn(p, batch)),
        has_aux=True)(params)
    updates, state = opt.update(grads, state, params)
    return (optax.apply_updates(params, updates), state, loss,
            jmp_lite.current_loss_scale(state).loss_scale)

  # Abstractly: the residuals' shapes, without running the forward pass.
  first = batches(0)
  vjp_fn = jax.eval_shape(
      lambda q: jax.vjp(lambda r: loss_fn(r, first), q)[1], params)
  activation_bytes = max(tree_bytes(vjp_fn) - tree_bytes(params), 0)
  jax.block_until_ready(step(params, state, batches(0)))  # Compile.
  losses, scales = [], []
  every = max(steps // 20, 1)
  start = time.perf_counter()
  for i in range(steps):
    params, state, loss, scale = step(params, state, batches(i))
    losses.append(loss)
    scales.append(scale)
    if progress is not None and ((i + 1) % every == 0 or i + 1 == steps):
      progress(i + 1)
  losses = np.asarray(jax.device_get(losses), np.float32)
  elapsed = time.perf_counter() - start
  if eval_fn is None:
    eval_loss, accuracy = losses[-1], np.nan
  else:
    eval_loss, accuracy = eval_fn(params)
  return TrainResult(
      losses=losses, scales=np.asarray(jax.device_get(scales), np.float32),
      eval_loss=float(eval_loss), accuracy=float(accuracy),
      ms_per_step=1000 * elapsed / steps,
      skipped=int(jmp_lite.loss_scaled_state(state).total_skips),
      param_bytes=tree_bytes(params), state_bytes=tree_bytes(state),
      activation_bytes=activation_bytes)


def low_precision_optimizer(compensation: str | None, moments: Any = None,
                            *, rounding: str = "nearest",
                            seed: int = 0) -> OptimizerBuilder:
  """An :data:`OptimizerBuilder` for pure half-precision params.

  Builds ``compensation(state_dtypes(loss_scaled(adam, loss_scale),
  moments))``: Adam computes in float32 with its moments stored in
  ``moments``, and its updates are applied with Kahan summation or
  stochastic rounding (or plainly, to nearest, for ``None``).

  Args:
    compensation: ``"kahan"``, ``"stochastic"`` or ``None``.
    moments: the moments' storage dtype; ``None`` keeps Adam's own (the
      params' dtype, computed in it) and skips ``state_dtypes``.
    rounding: ``state_dtypes``' rounding of the moments.
    seed: the stochastic rounding seed.

  Returns:
    The builder.

  Raises:
    ValueError: for an unknown ``compensation``.
  """
  if compensation not in ("kahan", "stochastic", None):
    raise ValueError(
        "compensation must be 'kahan', 'stochastic' or None, got"
        f" {compensation!r}")

  def build(adam: optax.GradientTransformation,
            loss_scale: jmp_lite.LossScale) -> optax.GradientTransformation:
    opt = jmp_lite.loss_scaled(adam, loss_scale,
                               allow_half_state=moments is None)
    if moments is not None:
      opt = jmp_lite.state_dtypes(opt, moments, rounding=rounding,
                                  seed=seed + 1)
    if compensation == "kahan":
      opt = jmp_lite.kahan_summation(opt)
    elif compensation == "stochastic":
      opt = jmp_lite.stochastic_rounding(opt, seed=seed)
    return opt

  return build


def load_digits_split(seed: int = 0):
  """scikit-learn's digits, scaled to [0, 1], split 80/20.

  Args:
    seed: the shuffle seed.

  Returns:
    ``(x_train, y_train, x_test, y_test)`` as numpy arrays.
  """
  # scikit-learn comes with the test and notebooks extras, not with
  # jmp_lite itself (nor with the lint extra that runs pyright).
  from sklearn.datasets import load_digits  # pyright: ignore[reportMissingImports]
  features, labels = load_digits(return_X_y=True)
  x = (features / 16.0).astype(np.float32)
  y = labels.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(x))
  x, y = x[order], y[order]
  cut = int(0.8 * len(x))
  return x[:cut], y[:cut], x[cut:], y[cut:]


def train_digits(policy: Any, loss_scale: Any = None, *, steps: int = 400,
                 master: bool = False, batch: int = 128, width: int = 128,
                 lr: float = 3e-3, seed: int = 0,
                 optimizer: OptimizerBuilder | None = None) -> TrainResult:
  """Trains an MLP on the digits under ``policy``.

  Args:
    policy: a :class:`~jmp_lite.Policy` or policy string.
    loss_scale: the initial loss scale; default
      :func:`~jmp_lite.default_loss_scale` of the policy.
    steps: optimizer steps.
    master: float32 master weights (for half-precision params).
    batch: batch size.
    width: hidden width.
    lr: Adam's learning rate.
    seed: init and data-order seed.
    optimizer: as for :func:`fit`.

  Returns:
    A :class:`TrainResult`.
  """
  import flax.linen as nn

  from jmp_lite import linen as jl

  policy = jmp_lite.get_policy(policy) if isinstance(policy, str) else policy
  if loss_scale is None:
    loss_scale = jmp_lite.default_loss_scale(policy)
  x_tr, y_tr, x_te, y_te = load_digits_split(seed)

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.relu(nn.Dense(width)(x))
      x = nn.relu(nn.Dense(width)(x))
      return nn.Dense(10)(x)

  model = jl.mixed_precision(MLP(), policy)
  params = model.init(jax.random.key(seed), x_tr[:1])["params"]

  def loss_fn(p, b):
    logits = model.apply({"params": p}, b[0]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, b[1]).mean()

  rng = np.random.default_rng(seed + 1)
  epochs = steps * batch // len(x_tr) + 2
  order = [rng.permutation(len(x_tr)) for _ in range(epochs)]
  flat = np.concatenate(order)

  def batches(i):
    idx = flat[i * batch:(i + 1) * batch]
    return jnp.asarray(x_tr[idx]), jnp.asarray(y_tr[idx])

  @jax.jit
  def evaluate(p):
    logits = model.apply({"params": p}, x_te).astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y_te).mean()
    return loss, jnp.mean(jnp.argmax(logits, -1) == y_te)

  return fit(params, loss_fn, batches, eval_fn=evaluate, lr=lr,
             loss_scale=loss_scale, master=master, steps=steps,
             optimizer=optimizer)


def python_docs_text(n_chars: int = 20_000) -> str:
  """``n_chars`` of CPython's bundled documentation (``pydoc_data.topics``).

  Args:
    n_chars: how many characters to return.

  Returns:
    The text: topics concatenated in sorted-key order (deterministic for
    one Python version; each CPython release bundles its own text, so the
    char-LM's losses differ between Python versions).
  """
  from pydoc_data.topics import topics
  return "\n".join(topics[k] for k in sorted(topics))[:n_chars]


def train_char_lm(policy: Any, loss_scale: Any = None, *, steps: int = 300,
                  master: bool = False, seq: int = 32, batch: int = 32,
                  dim: int = 64, lr: float = 3e-3, seed: int = 0,
                  optimizer: OptimizerBuilder | None = None) -> TrainResult:
  """Trains a one-block character Transformer on Python's documentation.

  The last 15% of the text is held out for the evaluation loss.

  Args:
    policy: a :class:`~jmp_lite.Policy` or policy string.
    loss_scale: the initial loss scale; default from the policy.
    steps: optimizer steps.
    master: float32 master weights.
    seq: context length.
    batch: sequences per step.
    dim: model width.
    lr: Adam's learning rate.
    seed: init and sampling seed.
    optimizer: as for :func:`fit`.

  Returns:
    A :class:`TrainResult` (accuracy: next-character accuracy).
  """
  import flax.linen as nn

  from jmp_lite import linen as jl

  policy = jmp_lite.get_policy(policy) if isinstance(policy, str) else policy
  if loss_scale is None:
    loss_scale = jmp_lite.default_loss_scale(policy)
  text = python_docs_text()
  chars = sorted(set(text))
  ids = np.array([chars.index(c) for c in text], np.int32)
  cut = int(0.85 * len(ids))
  train_ids, test_ids = ids[:cut], ids[cut - seq:]
  vocab = len(chars)

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, mask):
      h = nn.LayerNorm()(x)
      h = nn.MultiHeadDotProductAttention(
          num_heads=4, attention_fn=jl.dot_product_attention_fp32)(
              h, h, mask=mask)
      x = x + h
      h = nn.Dense(4 * dim)(nn.LayerNorm()(x))
      return x + nn.Dense(dim)(nn.gelu(h))

  class CharLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      n = tokens.shape[-1]
      x = nn.Embed(vocab, dim)(tokens)
      x = x + self.param("pos", nn.initializers.normal(0.02), (seq, dim))[:n]
      mask = nn.make_causal_mask(tokens)
      x = Block()(x, mask)
      return nn.Dense(vocab)(nn.LayerNorm()(x))

  model = jl.mixed_precision(CharLM(), policy)
  params = model.init(jax.random.key(seed), jnp.zeros((1, seq), jnp.int32))[
      "params"]

  def windows(source, starts):
    return np.stack([source[s:s + seq + 1] for s in starts])

  def loss_fn(p, b):
    logits = model.apply({"params": p}, b[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, b[:, 1:]).mean()

  rng = np.random.default_rng(seed + 1)
  starts = rng.integers(0, len(train_ids) - seq - 1, (steps, batch))

  def batches(i):
    return jnp.asarray(windows(train_ids, starts[i]))

  test_batch = jnp.asarray(windows(test_ids, range(0, len(test_ids) - seq - 1)))

  @jax.jit
  def evaluate(p):
    logits = model.apply({"params": p}, test_batch[:, :-1]).astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits, test_batch[:, 1:]).mean()
    return loss, jnp.mean(jnp.argmax(logits, -1) == test_batch[:, 1:])

  return fit(params, loss_fn, batches, eval_fn=evaluate, lr=lr,
             loss_scale=loss_scale, master=master, steps=steps,
             optimizer=optimizer)
