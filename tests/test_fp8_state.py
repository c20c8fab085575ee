"""Delayed scaling: scales from the history, and when the history advances."""

from __future__ import annotations

import copy
import pickle

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite
from jmp_lite import fp8

MATMUL = (((1,), (0,)), ((), ()))
RECIPE = fp8.DelayedScaling(history=4)


def normal(seed, shape, scale=1.0):
  x = scale * np.random.default_rng(seed).standard_normal(shape)
  return jnp.asarray(x.astype(np.float32))


def loss_fn(recipe):
  def loss(w, state, x, c):
    return jnp.sum(fp8.dot_general(recipe, state)(x, w, MATMUL) * c)
  return loss


def state_with(history, pending=(0.0, 0.0, 0.0)):
  return fp8.ScalingState(jnp.asarray(history, jnp.float32),
                          jnp.asarray(pending, jnp.float32))


X, W, C = normal(0, (8, 16)), normal(1, (16, 4)), normal(2, (8, 4))


# ------------------------------------------------------ scales from history


def test_empty_history_is_current_scaling_exactly():
  @jax.jit
  def both(w, state, x, c):
    delayed = jax.value_and_grad(loss_fn(RECIPE))(w, state, x, c)
    current = jax.value_and_grad(
        lambda w, x, c: jnp.sum(fp8.dot_general(fp8.CurrentScaling())(
            x, w, MATMUL) * c))(w, x, c)
    return delayed, current

  delayed, current = both(W, RECIPE.init(), X, C)
  chex.assert_trees_all_equal(delayed, current)


def manual_fp8_dot(x, w, amax_x, amax_w):
  qx, ix = fp8.quantize(x, amax=amax_x)
  qw, iw = fp8.quantize(w, amax=amax_w)
  return jax.lax.dot_general(qx.astype(jnp.float32), qw.astype(jnp.float32),
                             MATMUL) * (ix * iw)


@pytest.mark.parametrize("amax_compute, used", [("max", 0), ("most_recent", 1)])
def test_history_supplies_the_scales(amax_compute, used):
  recipe = fp8.DelayedScaling(history=2, amax_compute=amax_compute)
  ax, aw = float(jnp.max(jnp.abs(X))), float(jnp.max(jnp.abs(W)))
  # Column 0 (most recent) is small, column 1 large: "max" takes the large.
  hist = [[ax / 4, 2 * ax], [aw / 4, 2 * aw], [1.0, 1.0]]
  y = jax.jit(lambda s: fp8.dot_general(recipe, s)(X, W, MATMUL))(
      state_with(hist))
  big = manual_fp8_dot(X, W, 2 * ax, 2 * aw)
  small = manual_fp8_dot(X, W, ax / 4, aw / 4)
  np.testing.assert_allclose(y, [big, small][used], rtol=1e-6, atol=1e-6)
  # A stale (too small) amax saturates: the result is visibly clipped.
  assert float(jnp.max(jnp.abs(small))) < 0.5 * float(
      jnp.max(jnp.abs(X @ W)))


def test_cotangent_scale_comes_from_the_grad_row():
  # With a grad-row amax far below the cotangent's, the cotangent saturates
  # and the gradient shrinks; with a matching one it is close to float32.
  ac = float(jnp.max(jnp.abs(C)))
  grad = jax.jit(jax.grad(loss_fn(RECIPE)))
  ref = jax.grad(lambda w: jnp.sum((X @ w) * C))(W)
  def grad_row(amax):
    return state_with(np.zeros((3, 4), np.float32)).history.at[2, 0].set(amax)

  good = grad(W, state_with(grad_row(ac)), X, C)
  clipped = grad(W, state_with(grad_row(ac / 100)), X, C)
  assert float(jnp.linalg.norm(good - ref) / jnp.linalg.norm(ref)) < 0.1
  assert float(jnp.linalg.norm(clipped)) < 0.5 * float(jnp.linalg.norm(ref))


def test_the_gradient_of_the_state_is_the_observed_amaxes():
  observed = jax.jit(jax.grad(loss_fn(RECIPE), argnums=1))(
      W, RECIPE.init(), X, C)
  assert isinstance(observed, fp8.ScalingState)
  assert observed.pending.dtype == np.float32
  np.testing.assert_array_equal(
      observed.pending,
      [jnp.max(jnp.abs(X)), jnp.max(jnp.abs(W)), jnp.max(jnp.abs(C))])
  assert not np.asarray(observed.history).any()


# ------------------------------------------------------------ commit rules


def observe(state, x, c=C):
  return jax.grad(loss_fn(RECIPE), argnums=1)(W, state, x, c)


def test_commit_without_an_optimizer_rolls_the_history():
  state = {"dense": RECIPE.init()}
  commit = jax.jit(fp8.commit)
  for k in range(1, 6):
    obs = {"dense": observe(state["dense"], k * X)}
    state = commit(state, obs)
  amax_x = float(jnp.max(jnp.abs(X)))
  # Five steps into a 4-long history: most recent first, oldest dropped.
  np.testing.assert_allclose(state["dense"].history[0],
                             [5 * amax_x, 4 * amax_x, 3 * amax_x, 2 * amax_x],
                             rtol=1e-6)
  assert not np.asarray(state["dense"].pending).any()
  np.testing.assert_allclose(fp8.history_amax(state)["dense"][0], 5 * amax_x,
                             rtol=1e-6)


def make_step(opt, api="update"):
  """A jitted train step as users write it: loss, update, then commit."""

  @jax.jit
  def step(w, fp8_state, opt_state, x):
    grads, observed = jax.grad(loss_fn(RECIPE), argnums=(0, 1))(
        w, fp8_state, x, C)
    if api == "update":
      updates, opt_state = opt.update(grads, opt_state, w)
      w = optax.apply_updates(w, updates)
    else:
      w, opt_state = jmp_lite.update_and_apply(opt, grads, opt_state, w)
    fp8_state = fp8.commit(fp8_state, observed, opt_state)
    return w, fp8_state, opt_state

  return step


@pytest.mark.parametrize("api", ["update", "update_and_apply"])
def test_a_skipped_step_leaves_the_history_bit_identical(api):
  opt = jmp_lite.loss_scaled(optax.sgd(0.1), "bf16")
  step = make_step(opt, api)
  w, state, opt_state = W, RECIPE.init(), opt.init(W)
  w, state, opt_state = step(w, state, opt_state, X)
  before = state
  bad = X.at[0, 0].set(jnp.inf)  # NaN gradients: loss_scaled skips.
  w2, state, opt_state = step(w, state, opt_state, bad)
  assert int(jmp_lite.loss_scaled_state(opt_state).total_skips) == 1
  chex.assert_trees_all_equal(w2, w)
  chex.assert_trees_all_equal(state.history, before.history)
  assert not np.asarray(state.pending).any()
  # The next applied step advances by exactly one entry.
  _, state, _ = step(w, state, opt_state, 2 * X)
  np.testing.assert_array_equal(state.history[:, 1], before.history[:, 0])
  np.testing.assert_allclose(state.history[0, 0], 2 * before.history[0, 0],
                             rtol=1e-6)


@pytest.mark.parametrize("accumulator", ["jmp_lite", "optax"])
def test_an_accumulation_window_advances_once_with_its_max(accumulator):
  inner = jmp_lite.loss_scaled(optax.sgd(0.1), "bf16")
  if accumulator == "jmp_lite":
    opt = jmp_lite.accumulate_gradients(inner, every_k=3)
  else:
    opt = optax.MultiSteps(inner, every_k_schedule=3)
  step = make_step(opt)
  w, state, opt_state = W, RECIPE.init(), opt.init(W)
  amax_x = float(jnp.max(jnp.abs(X)))
  for scale in (1.0, 5.0):  # two micro-batches: nothing committed yet
    w, state, opt_state = step(w, state, opt_state, scale * X)
    assert not np.asarray(state.history).any()
  np.testing.assert_allclose(state.pending[0], 5 * amax_x, rtol=1e-6)
  w, state, opt_state = step(w, state, opt_state, 2 * X)  # window closes
  np.testing.assert_allclose(state.history[0], [5 * amax_x, 0, 0, 0],
                             rtol=1e-6)
  assert not np.asarray(state.history[:, 1:]).any()
  assert not np.asarray(state.pending).any()
  assert float(state.history[2, 0]) > 0  # the cotangents' amax, too


def test_a_poisoned_window_does_not_advance():
  opt = jmp_lite.accumulate_gradients(
      jmp_lite.loss_scaled(optax.sgd(0.1), "bf16"), every_k=2)
  step = make_step(opt)
  w, state, opt_state = W, RECIPE.init(), opt.init(W)
  w, state, opt_state = step(w, state, opt_state, X.at[0, 0].set(jnp.nan))
  w, state, opt_state = step(w, state, opt_state, X)
  assert int(jmp_lite.loss_scaled_state(opt_state).total_skips) == 1
  assert not np.asarray(state.history).any()
  assert not np.asarray(state.pending).any()
  w, state, opt_state = step(w, state, opt_state, X)
  w, state, opt_state = step(w, state, opt_state, X)
  assert float(state.history[0, 0]) > 0 and not np.asarray(
      state.history[:, 1:]).any()


def test_applied_override_and_nonfinite_observations():
  state = {"a": RECIPE.init()}
  obs = {"a": state_with(np.zeros((3, 4)), (jnp.inf, 2.0, jnp.nan))}
  kept = fp8.commit(state, obs, applied=jnp.array(False))
  chex.assert_trees_all_equal(kept["a"].history, state["a"].history)
  new = fp8.commit(state, obs, applied=True)
  # Non-finite amaxes are recorded as "no observation".
  np.testing.assert_array_equal(new["a"].history[:, 0], [0.0, 2.0, 0.0])
  with pytest.raises(ValueError, match="commit's applied must be a scalar"):
    fp8.commit(state, obs, applied=jnp.array([True, False]))
  with pytest.raises(TypeError, match="commit's applied must be a scalar"):
    fp8.commit(state, obs, applied=1.0)


def test_commit_rejects_the_wrong_gradient_and_two_accumulators():
  state = {"a": RECIPE.init()}
  with pytest.raises(ValueError, match="observed must be the gradient with"
                     " respect to the fp8 state"):
    fp8.commit(state, {"a": jnp.zeros(3)})
  opt = optax.chain(jmp_lite.accumulate_gradients(optax.sgd(1.0), 2),
                    optax.MultiSteps(optax.sgd(1.0), 2))
  with pytest.raises(ValueError, match="2 gradient accumulators"):
    fp8.commit(state, state, opt.init(jnp.ones(2)))


def test_scaling_state_validation():
  with pytest.raises(ValueError,
                     match=r"history of shape \(\.\.\., 3, n >= 1\)"):
    fp8.ScalingState(np.zeros((2, 4), np.float32), np.zeros(3, np.float32))
  with pytest.raises(ValueError, match=r"pending of shape \(\.\.\., 3\)"):
    fp8.ScalingState(np.zeros((3, 4), np.float32), np.zeros(4, np.float32))
  with pytest.raises(ValueError, match=r"got \(2, 3, 4\) and \(3,\)"):
    fp8.ScalingState(np.zeros((2, 3, 4), np.float32),
                     np.zeros(3, np.float32))
  # Layers stacked by a scan: one leading axis on both.
  fp8.ScalingState(np.zeros((2, 3, 4), np.float32),
                   np.zeros((2, 3), np.float32))
  # Unflattening (jit, eval_shape) never validates placeholder leaves.
  leaves, treedef = jax.tree.flatten(RECIPE.init())
  assert jax.tree.unflatten(treedef, [object()] * len(leaves)) is not None


# --------------------------------------------------------------- round trips


def test_state_round_trips(tmp_path):
  import orbax.checkpoint as ocp
  state = {"l1": RECIPE.init(), "l2": RECIPE.init()}
  state = fp8.commit(state, {"l1": observe(state["l1"], X),
                             "l2": observe(state["l2"], 3 * X)})
  chex.assert_trees_all_equal(jax.tree.map(lambda x: x, state), state)
  chex.assert_trees_all_equal(jax.jit(lambda s: s)(state), state)
  chex.assert_trees_all_equal(copy.deepcopy(state), state)
  chex.assert_trees_all_equal(pickle.loads(pickle.dumps(state)), state)
  grad = lambda s: jax.grad(loss_fn(RECIPE), argnums=1)(W, s["l1"], X, C)
  jax.jit(grad).lower(state).compile()
  shapes = jax.eval_shape(lambda s: fp8.commit(s, {"l1": grad(s),
                                                   "l2": grad(s)}), state)
  assert jax.tree.structure(shapes) == jax.tree.structure(state)
  chex.assert_trees_all_equal_dtypes(shapes, state)

  def body(s, scale):
    obs = jax.grad(loss_fn(RECIPE), argnums=1)(W, s["l1"], scale * X, C)
    return fp8.commit(s, {"l1": obs, "l2": obs}), None

  final, _ = jax.lax.scan(body, state, jnp.arange(1.0, 4.0))
  assert jax.tree.structure(final) == jax.tree.structure(state)
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(tmp_path / "ckpt", state)
    ckptr.wait_until_finished()
    restored = ckptr.restore(tmp_path / "ckpt",
                             {"l1": RECIPE.init(), "l2": RECIPE.init()})
  chex.assert_trees_all_equal(restored, state)
  assert isinstance(restored["l1"], fp8.ScalingState)


def test_a_train_step_with_moving_state_compiles_once():
  opt = jmp_lite.loss_scaled(optax.adam(1e-2), "bf16")

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(w, fp8_state, opt_state, x):
    grads, observed = jax.grad(loss_fn(RECIPE), argnums=(0, 1))(
        w, fp8_state, x, C)
    updates, opt_state = opt.update(grads, opt_state, w)
    return (optax.apply_updates(w, updates),
            fp8.commit(fp8_state, observed, opt_state), opt_state)

  w, state, opt_state = W, RECIPE.init(), opt.init(W)
  for k in range(4):
    w, state, opt_state = step(w, state, opt_state, (k + 1) * X)
  assert int(jnp.sum(state.history[0] > 0)) == 4


def test_commit_takes_layers_stacked_by_scan():
  # nn.scan over layers stacks each layer's ScalingState along a leading
  # axis: commit rolled a (3, n) history only (concatenate failed), and
  # history_amax took the max over the roles.
  import flax.linen as nn

  import jmp_lite.fp8.linen as fl
  recipe = jmp_lite.fp8.DelayedScaling(history=4)

  class Layer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      return x + nn.Dense(16, dtype=jnp.float32,
                          dot_general_cls=fl.dot_general_cls(recipe))(x), None

  stack = nn.scan(Layer, variable_axes={"params": 0, "fp8": 0},
                  split_rngs={"params": True}, length=3)
  x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 16)),
                  jnp.float32)
  v = stack().init(jax.random.key(0), x, None)

  def loss(p, f):
    return (stack().apply({"params": p, "fp8": f}, x, None)[0] ** 2).sum()

  _, observed = jax.jit(jax.grad(loss, argnums=(0, 1)))(v["params"], v["fp8"])
  new = jmp_lite.fp8.commit(v["fp8"], observed)
  state = jax.tree.leaves(new, is_leaf=lambda s: isinstance(
      s, jmp_lite.fp8.ScalingState))[0]
  assert np.shape(state.history) == (3, 3, 4)
  amax = np.asarray(jax.tree.leaves(jmp_lite.fp8.history_amax(new))[0])
  assert amax.shape == (3, 3)
  # Each layer committed its own observation: the lhs amax grows with
  # depth (a residual stack), and every role saw something.
  assert (amax > 0).all() and amax[2, 0] > amax[0, 0]

