"""One check for every model and setting: jaxpr dtypes, training, donation.

A model enters as a :class:`Case`: its trainable params, the rest of its
state, and a loss as a plain function of pytrees. :func:`check` then, for a
:class:`Setting` (f32, bf16, f16 with dynamic loss scaling, O2):

* walks the jaxpr of the loss *and* of its gradient and asserts the operand
  dtypes of every ``dot_general`` and convolution;
* asserts the dtypes of params, gradients, optimizer state and outputs;
* trains ``STEPS`` steps with a train step jitted with ``donate_argnums`` on
  params, optimizer state and model state, as real scripts do, and returns
  the losses for comparison with float32.

The ``O3`` settings keep params in bfloat16 or float16 (norm islands
float32) and train them the way ``preset("O3")`` does: Kahan summation or
stochastic rounding over Adam whose moments are stored in bfloat16, stepped
with :func:`jmp_lite.update_and_apply` as the README's first step is.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend import core as jex

import jmp_lite
from jmp_lite.path_rules import path_string
from jmp_lite.presets import O3_STATE_DTYPE, preset

STEPS = 20
F32 = np.dtype(jnp.float32)
BF16 = np.dtype(jnp.bfloat16)
F16 = np.dtype(jnp.float16)


@dataclasses.dataclass(frozen=True)
class Setting:
  """A mixed-precision recipe as a user would pick it."""

  name: str
  policy: str
  compute: np.dtype
  param: np.dtype
  dynamic_scale: bool = False
  master: bool = False
  compensation: str | None = None  # O3: "kahan" or "stochastic".

  def loss_scale(self) -> jmp_lite.LossScale:
    if self.dynamic_scale:
      return jmp_lite.DynamicLossScale(2.0**15)
    return jmp_lite.NoOpLossScale()


SETTINGS = {
    "f32": Setting("f32", "p=f32,c=f32,o=f32", F32, F32),
    "bf16": Setting("bf16", "p=f32,c=bf16,o=f32", BF16, F32),
    "f16": Setting("f16", "p=f32,c=f16,o=f32", F16, F32, dynamic_scale=True),
    "O2": Setting("O2", "p=bf16,c=bf16,o=f32", BF16, BF16, master=True),
}

# Pure half precision: half params (norm islands float32), no master copy.
O3_SETTINGS = {
    "O3": Setting("O3", "p=bf16,c=bf16,o=f32", BF16, BF16,
                  compensation="kahan"),
    "O3-sr": Setting("O3-sr", "p=bf16,c=bf16,o=f32", BF16, BF16,
                     compensation="stochastic"),
    "O3-f16": Setting("O3-f16", "p=f16,c=f16,o=f32", F16, F16,
                      dynamic_scale=True, compensation="kahan"),
}


@dataclasses.dataclass
class Case:
  """A model under a setting, as functions of pytrees.

  Attributes:
    params: the trainable params.
    state: other state threaded through steps (batch statistics), or ``{}``.
    loss: ``(params, state, batch, rng) -> (loss, (output, new_state))``.
    batch: one batch.
    island: whether a param path is a float32 normalisation island.
    apply_updates: how the framework applies updates (``eqx.apply_updates``).
    lr: Adam's learning rate.
    float32_cotangents: name-stack fragments of ops whose *backward* takes a
      float32 cotangent by the library's own design (JAX's
      ``jax.nn.dot_product_attention`` keeps the softmax cotangent in
      float32): there, and only there, the gradient may multiply a float32
      operand with a compute-dtype one.
  """

  params: Any
  state: Any
  loss: Callable[..., Any]
  batch: Any
  island: Callable[[str], bool]
  apply_updates: Callable[[Any, Any], Any] = optax.apply_updates
  lr: float = 3e-3
  float32_cotangents: tuple[str, ...] = ()


def matmul_dtypes(closed_jaxpr: Any
                  ) -> list[tuple[str, tuple[np.dtype, ...], str]]:
  """``(primitive, operand dtypes, name stack)`` of every dot/conv.

  Sub-jaxprs (scan, remat, jit, custom derivatives) included.
  """
  out = []

  def walk(jaxpr: Any, prefix: str) -> None:
    for eqn in jaxpr.eqns:
      stack = prefix + "/" + str(eqn.source_info.name_stack)
      if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
        out.append((eqn.primitive.name,
                    tuple(np.dtype(v.aval.dtype) for v in eqn.invars[:2]),
                    stack))
      for sub in jex.jaxprs_in_params(eqn.params):
        walk(sub, stack)

  walk(closed_jaxpr.jaxpr, "")
  return out


def float_leaves(tree: Any) -> dict[str, np.dtype]:
  """``{path: dtype}`` of the floating array leaves of ``tree``."""
  return {path_string(p): np.dtype(x.dtype)
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
          if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)}


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), labels).mean()


def optimizer(setting: Setting, lr: float) -> optax.GradientTransformation:
  if setting.compensation is not None:
    o3 = preset("O3", half=setting.param, compensation=setting.compensation)
    return o3.optimizer(optax.adam(lr))
  opt = jmp_lite.loss_scaled(optax.adam(lr), setting.loss_scale())
  return jmp_lite.master_weights(opt) if setting.master else opt


def _check_optimizer_state(setting: Setting, params: Any,
                           opt_state: Any) -> None:
  """Optimizer state is never silently half; O3's half state is by design."""
  if setting.compensation is None:
    # Moments (and the master copy) float32.
    for path, dtype in float_leaves(opt_state).items():
      assert dtype == F32, (setting.name, path, dtype)
    return
  # O3: every moment stored in bfloat16 (float16 params too: float16 lacks
  # the range for Adam's second moment); a Kahan buffer in the param's dtype
  # for exactly the half params (float32 islands take their updates as they
  # are).
  inner = jmp_lite.loss_scaled_state(opt_state).inner_state
  for path, dtype in float_leaves(inner).items():
    assert dtype == O3_STATE_DTYPE, (setting.name, path, dtype)
  if setting.compensation == "kahan":
    half = {p for p, d in float_leaves(params).items() if d == setting.param}
    buffers = float_leaves(opt_state.compensation)
    assert set(buffers) == half, (setting.name, set(buffers) ^ half)
    assert set(buffers.values()) <= {setting.param}, buffers


def check(case: Case, setting: Setting, *, matmuls: int = 1) -> np.ndarray:
  """Runs every check of the module docstring; returns the training losses."""
  # Param storage: the policy's param dtype, norm islands float32.
  for path, dtype in float_leaves(case.params).items():
    expected = F32 if case.island(path) else setting.param
    assert dtype == expected, (setting.name, path, dtype, expected)

  rng = jax.random.key(1)
  loss_only = lambda p: case.loss(p, case.state, case.batch, rng)[0]
  grad_fn = jax.grad(loss_only)
  for what, fn in (("loss", loss_only), ("grad", grad_fn)):
    found = matmul_dtypes(jax.make_jaxpr(fn)(case.params))
    assert len(found) >= matmuls, (what, found)
    def allowed(prim: str, dtypes: tuple, stack: str, what: str = what) -> bool:
      if set(dtypes) == {setting.compute}:
        return True
      return (what == "grad" and set(dtypes) == {setting.compute, F32}
              and any(s in stack for s in case.float32_cotangents))

    wrong = [f for f in found if not allowed(*f)]
    assert not wrong, (setting.name, what, wrong[:4], len(wrong), len(found))

  # Outputs come back in the policy's output dtype (float32 here); gradients
  # in the params' dtypes.
  _, (output, _) = jax.eval_shape(
      lambda p: case.loss(p, case.state, case.batch, rng), case.params)
  for leaf in jax.tree.leaves(output):
    assert np.dtype(leaf.dtype) == F32, (setting.name, leaf.dtype)
  chex.assert_trees_all_equal_dtypes(jax.eval_shape(grad_fn, case.params),
                                     case.params)

  opt = optimizer(setting, case.lr)
  opt_state = opt.init(case.params)
  _check_optimizer_state(setting, case.params, opt_state)

  def step(params, opt_state, state, batch, rng):
    scale = jmp_lite.current_loss_scale(opt_state)

    def scaled(p):
      loss, (_, new_state) = case.loss(p, state, batch, rng)
      return scale.scale(loss), (loss, new_state)

    grads, (loss, new_state) = jax.grad(scaled, has_aux=True)(params)
    if setting.compensation is not None:
      params, opt_state = jmp_lite.update_and_apply(opt, grads, opt_state,
                                                    params)
      return params, opt_state, new_state, loss
    updates, opt_state = opt.update(grads, opt_state, params)
    return case.apply_updates(params, updates), opt_state, new_state, loss

  # Donating params, optimizer state and model state is what real training
  # scripts do; a state that aliases a param fails here.
  step = jax.jit(step, donate_argnums=(0, 1, 2))
  params, state = case.params, case.state
  losses = []
  for i in range(STEPS):
    params, opt_state, state, loss = step(
        params, opt_state, state, case.batch, jax.random.fold_in(rng, i))
    losses.append(float(loss))
  # Training keeps every dtype where the policy put it.
  for path, dtype in float_leaves(params).items():
    expected = F32 if case.island(path) else setting.param
    assert dtype == expected, (setting.name, "after training", path, dtype)
  _check_optimizer_state(setting, params, opt_state)
  # Dynamic scaling may skip while it backs off from 2**15; not for long.
  skips = int(jmp_lite.loss_scaled_state(opt_state).total_skips)
  assert skips <= STEPS // 4, (setting.name, skips)
  return np.asarray(losses)


def assert_trains_like_float32(losses: np.ndarray, reference: np.ndarray,
                               rtol: float = 0.15) -> None:
  """Learns (final loss well below the first) and ends near float32's run."""
  assert np.all(np.isfinite(losses)), losses
  assert losses[-1] < 0.8 * losses[0], losses
  np.testing.assert_allclose(losses[-1], reference[-1], rtol=rtol)


def island_paths(*patterns: str) -> Callable[[str], bool]:
  """A predicate: the param path matches one of the regexes (search)."""
  compiled = [re.compile(p) for p in patterns]
  return lambda path: any(c.search(path) for c in compiled)
