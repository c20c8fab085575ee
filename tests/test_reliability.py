"""Fault injection, checkpoint resume, accumulation and odd leaves."""

from __future__ import annotations

import pickle

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite
from tests.conftest import assert_dtype
from tests.test_loss_scale import reference_schedule


def _init_params():
  rng = np.random.default_rng(0)
  return {
      "dense": {"w": jnp.asarray(rng.standard_normal((6, 5)) * 0.3,
                                 jnp.float32),
                "b": jnp.zeros((5,), jnp.float32)},
      "out": {"w": jnp.asarray(rng.standard_normal((5, 2)) * 0.3, jnp.float32)},
  }


def _loss(params, x, y):
  h = jnp.tanh(x @ params["dense"]["w"] + params["dense"]["b"])
  return jnp.mean((h @ params["out"]["w"] - y) ** 2)


def _batches(n, seed=1):
  rng = np.random.default_rng(seed)
  return [(jnp.asarray(rng.standard_normal((8, 6)), jnp.float32),
           jnp.asarray(rng.standard_normal((8, 2)), jnp.float32))
          for _ in range(n)]


def _faults(n, rate, seed=2):
  """Per step: None, or (leaf index, flat position, bad value)."""
  rng = np.random.default_rng(seed)
  n_leaves = len(jax.tree.leaves(_init_params()))
  out = []
  for _ in range(n):
    if rng.random() < rate:
      out.append((int(rng.integers(n_leaves)), int(rng.integers(1 << 30)),
                  [np.inf, -np.inf, np.nan][rng.integers(3)]))
    else:
      out.append(None)
  return out


def _inject(grads, fault):
  if fault is None:
    return grads
  leaves, treedef = jax.tree.flatten(grads)
  i, pos, bad = fault
  flat = leaves[i].reshape(-1)
  leaves[i] = flat.at[pos % flat.size].set(bad).reshape(leaves[i].shape)
  return jax.tree.unflatten(treedef, leaves)


def _optimizer():
  return optax.chain(
      optax.clip_by_global_norm(1.0),
      optax.inject_hyperparams(optax.adamw)(
          learning_rate=optax.warmup_cosine_decay_schedule(
              0.0, 1e-2, 20, 400), weight_decay=1e-3),
  )


def _make_step(opt, scaled):
  @jax.jit
  def step(params, state, x, y, fault_mask, bad_value):
    if scaled:
      scale = jmp_lite.current_loss_scale(state)
      grads = jax.grad(lambda p: scale.scale(_loss(p, x, y)))(params)
    else:
      grads = jax.grad(_loss)(params, x, y)
    # fault_mask selects one element of one leaf (or none).
    grads = jax.tree.map(lambda g, m: jnp.where(m, bad_value, g), grads,
                         fault_mask)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def _mask(fault):
  leaves, treedef = jax.tree.flatten(_init_params())
  masks = [np.zeros(leaf.shape, bool) for leaf in leaves]
  if fault is not None:
    i, pos, _ = fault
    masks[i].reshape(-1)[pos % masks[i].size] = True
  return jax.tree.unflatten(treedef, masks)


@pytest.mark.parametrize("kind", ["loss_scaled", "skip_nonfinite"])
def test_fault_injection_over_hundreds_of_steps(kind):
  n = 300
  if kind == "loss_scaled":
    opt = jmp_lite.loss_scaled(_optimizer(), jmp_lite.DynamicLossScale(
        2.0**12, period=7, hysteresis=2, min_loss_scale=2.0**-4))
  else:
    opt = jmp_lite.skip_nonfinite(_optimizer())
  step = _make_step(opt, scaled=kind == "loss_scaled")
  plain_opt = _optimizer()
  plain_step = _make_step(plain_opt, scaled=False)
  batches, faults = _batches(n), _faults(n, rate=0.2)
  assert sum(f is not None for f in faults) > 30

  params, state = _init_params(), opt.init(_init_params())
  # Reference 1: the same compiled step, fed only the good batches.
  ref_params, ref_state = _init_params(), opt.init(_init_params())
  # Reference 2: the bare optimizer on the good batches (another XLA program,
  # so equal up to fusion-order rounding).
  plain_params, plain_state = _init_params(), plain_opt.init(_init_params())
  no_fault = _mask(None)
  scales = []
  for (x, y), fault in zip(batches, faults, strict=True):
    before = (params, state.inner_state)
    bad = jnp.float32(fault[2] if fault else 0.0)
    params, state = step(params, state, x, y, _mask(fault), bad)
    if fault is not None:
      chex.assert_trees_all_equal((params, state.inner_state), before)
    else:
      ref_params, ref_state = step(ref_params, ref_state, x, y, no_fault,
                                   jnp.float32(0.0))
      plain_params, plain_state = plain_step(
          plain_params, plain_state, x, y, no_fault, jnp.float32(0.0))
    if kind == "loss_scaled":
      scales.append(float(state.loss_scale.loss_scale))
  # Identical to a run that never saw the bad steps, bit for bit.
  chex.assert_trees_all_equal(params, ref_params)
  chex.assert_trees_all_equal(state.inner_state, ref_state.inner_state)
  chex.assert_trees_all_close(params, plain_params, rtol=1e-5, atol=1e-7)
  chex.assert_trees_all_close(state.inner_state, plain_state, rtol=1e-4,
                              atol=1e-7)
  assert int(state.total_skips) == sum(f is not None for f in faults)
  if kind == "loss_scaled":
    expected = reference_schedule(
        [f is None for f in faults], scale=2.0**12, period=7, factor=2,
        backoff=0.5, lo=2.0**-4, hi=2.0**24, hysteresis=2)
    assert scales == [e[0] for e in expected]


def test_checkpoint_resume_is_bit_identical(tmp_path):
  import orbax.checkpoint as ocp

  n, cut = 60, 27
  opt = jmp_lite.master_weights(jmp_lite.loss_scaled(
      _optimizer(), jmp_lite.DynamicLossScale(2.0**8, period=3)))
  step = _make_step(opt, scaled=True)
  batches, faults = _batches(n, seed=5), _faults(n, rate=0.25, seed=6)

  def run(params, state, lo, hi):
    for (x, y), fault in list(zip(batches, faults, strict=True))[lo:hi]:
      bad = jnp.float32(fault[2] if fault else 0.0)
      params, state = step(params, state, x, y, _mask(fault), bad)
    return params, state

  p0 = _init_params()
  full = run(p0, opt.init(p0), 0, n)
  half = run(p0, opt.init(p0), 0, cut)

  path = tmp_path / "ckpt"
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, half)
    ckptr.wait_until_finished()
    target = (p0, opt.init(p0))  # A fresh process knows only the structure.
    restored = ckptr.restore(path, target)
  chex.assert_trees_all_equal(restored, half)
  resumed = run(*restored, cut, n)
  chex.assert_trees_all_equal(resumed, full)
  # The loss scale (with its static fields) and skip counts came back too.
  scale = jmp_lite.current_loss_scale(resumed[1])
  assert scale.period == 3 and float(scale.loss_scale) == float(
      jmp_lite.current_loss_scale(full[1]).loss_scale)

  pickled = pickle.loads(pickle.dumps(jax.device_get(half)))
  chex.assert_trees_all_equal(run(*pickled, cut, n), full)


def test_skipped_step_does_not_advance_schedule_or_hyperparams():
  opt = jmp_lite.loss_scaled(
      optax.inject_hyperparams(optax.adam)(
          learning_rate=optax.linear_schedule(1.0, 0.0, 10)),
      jmp_lite.NoOpLossScale())
  params = _init_params()
  state = opt.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  _, state = opt.update(grads, state, params)
  count, lr = state.inner_state.count, state.inner_state.hyperparams[
      "learning_rate"]
  bad = jax.tree.map(lambda g: g * jnp.nan, grads)
  _, skipped = opt.update(bad, state, params)
  assert int(skipped.inner_state.count) == int(count) == 1
  assert float(skipped.inner_state.hyperparams["learning_rate"]) == float(lr)


@pytest.mark.parametrize("poison_at", [5, 4, 7])
def test_accumulation_one_adjustment_per_optimizer_step(poison_at):
  """Pinned: a non-finite micro-batch makes its whole optimizer step skip.

  The loss scale is adjusted once per optimizer step (every k micro-steps),
  every micro-batch of a window sees the same scale, and the next window
  starts clean (optax.MultiSteps would stay poisoned: 0 * inf is NaN).
  """
  k = 4
  opt = jmp_lite.master_weights(jmp_lite.accumulate_gradients(
      jmp_lite.loss_scaled(optax.adam(1e-2),
                           jmp_lite.DynamicLossScale(2.0**6, period=2)),
      every_k=k))
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), _init_params())
  state = opt.init(params)
  # Accumulators are float32 although the params are bfloat16.
  for acc in jax.tree.leaves(state.inner_state.acc):
    assert_dtype(acc, jnp.float32)

  def micro(params, state, x, y, poison):
    scale = jmp_lite.current_loss_scale(state)
    grads = jax.grad(lambda p: scale.scale(_loss(
        jax.tree.map(lambda a: a.astype(jnp.float32), p), x, y)))(params)
    grads = jax.tree.map(lambda g: jnp.where(poison, jnp.inf, g), grads)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  micro = jax.jit(micro)
  scales, skips, moved = [], [], []
  for i, (x, y) in enumerate(_batches(4 * k)):
    before = params
    params, state = micro(params, state, x, y, jnp.array(i == poison_at))
    scales.append(float(jmp_lite.current_loss_scale(state).loss_scale))
    skips.append(int(state.inner_state.inner_state.total_skips))
    moved.append(not all(bool(jnp.all(a == b)) for a, b in zip(
        jax.tree.leaves(params), jax.tree.leaves(before), strict=True)))
  # Window 2 (micro-steps 4..7) is poisoned: its step skips and backs off;
  # the scale only ever changes at window ends (3, 7, 11, 15).
  assert scales == [64.0] * 4 + [64.0] * 3 + [32.0] + [32.0] * 4 + [
      32.0] * 3 + [64.0]
  assert skips == [0] * 7 + [1] * 9
  # Params move only at the ends of the windows that were not poisoned.
  assert moved == [False, False, False, True, False, False, False, False,
                   False, False, False, True, False, False, False, True]
  assert_dtype(params["dense"]["w"], jnp.bfloat16)
  chex.assert_trees_all_equal(
      params, jax.tree.map(lambda m: m.astype(jnp.bfloat16),
                           jmp_lite.master_params(state)))


def test_accumulate_gradients_validation():
  with pytest.raises(ValueError, match="every_k must be >= 1"):
    jmp_lite.accumulate_gradients(optax.sgd(0.1), every_k=0)
  with pytest.raises(TypeError, match="every_k must be an int"):
    jmp_lite.accumulate_gradients(optax.sgd(0.1), every_k=2.0)
  for flag in (True, np.bool_(True)):
    with pytest.raises(TypeError, match="every_k must be an int"):
      jmp_lite.accumulate_gradients(optax.sgd(0.1), every_k=flag)
  with pytest.raises(ValueError, match="at most 2\\*\\*31 - 1"):
    jmp_lite.accumulate_gradients(optax.sgd(0.1), every_k=2**40)
  with pytest.raises(TypeError, match="accumulate_gradients expects an"
                     r" optax.GradientTransformation .* got str: 'adam'"):
    jmp_lite.accumulate_gradients("adam", 2)
  with pytest.raises(TypeError, match="dtype must be a floating dtype.*got"
                     " None"):
    jmp_lite.accumulate_gradients(optax.sgd(0.1), 2, dtype=None)


def test_accumulate_gradients_takes_numpy_integers():
  opt = jmp_lite.accumulate_gradients(optax.sgd(1.0), np.int64(2))
  params = jnp.zeros(1)
  state = opt.init(params)
  u1, state = opt.update(jnp.array([1.0]), state, params)
  u2, state = opt.update(jnp.array([3.0]), state, params)
  assert float(u1[0]) == 0.0 and float(u2[0]) == -2.0


def test_partitioned_optimizers_with_their_own_scales():
  opt = optax.multi_transform(
      {"gen": jmp_lite.loss_scaled(optax.sgd(0.1),
                                   jmp_lite.DynamicLossScale(8.0), name="gen"),
       "disc": jmp_lite.loss_scaled(
           optax.sgd(0.1), jmp_lite.DynamicLossScale(8.0), name="disc")},
      {"dense": "gen", "out": "disc"})
  params = _init_params()
  state = opt.init(params)
  grads = jax.tree.map(lambda p: jnp.full_like(p, 8.0), params)  # Scaled.
  grads["dense"]["w"] = grads["dense"]["w"].at[0, 0].set(jnp.nan)
  updates, state = jax.jit(opt.update)(grads, state, params)
  new = optax.apply_updates(params, updates)
  chex.assert_trees_all_equal(new["dense"], params["dense"])  # gen skipped
  np.testing.assert_allclose(new["out"]["w"], params["out"]["w"] - 0.1)
  assert float(jmp_lite.current_loss_scale(state, "gen").loss_scale) == 4.0
  assert float(jmp_lite.current_loss_scale(state, "disc").loss_scale) == 8.0


def test_int_bool_float0_and_none_leaves():
  params = {"w": jnp.ones((3,)), "step": jnp.array(7), "flag": jnp.array(True),
            "nothing": None}
  labels = {"w": "f", "step": "z", "flag": "z", "nothing": None}
  inner = optax.multi_transform({"f": optax.adam(0.1),
                                 "z": optax.set_to_zero()}, labels)
  opt = jmp_lite.loss_scaled(inner, jmp_lite.DynamicLossScale(4.0))

  @jax.jit
  def step(params, state, bad):
    scale = jmp_lite.current_loss_scale(state)
    loss = lambda p: scale.scale(jnp.sum(p["w"] ** 2) * p["step"])
    grads = jax.grad(loss, allow_int=True)(params)
    assert grads["step"].dtype == jax.dtypes.float0
    grads["w"] = jnp.where(bad, jnp.nan, grads["w"])
    updates, state = opt.update(grads, state, params)
    applied = optax.apply_updates({"w": params["w"]}, {"w": updates["w"]})
    return dict(params, w=applied["w"]), state

  state = opt.init(params)
  new, state = step(params, state, jnp.array(False))
  assert float(new["w"][0]) < 1.0 and int(new["step"]) == 7
  again, skipped = step(new, state, jnp.array(True))
  chex.assert_trees_all_equal(again, new)
  chex.assert_trees_all_equal(skipped.inner_state, state.inner_state)
  assert int(skipped.total_skips) == 1


def test_optax_multisteps_composition_and_its_pinned_poisoning():
  """optax.MultiSteps(loss_scaled(...)): what works, and the documented trap.

  It adjusts the scale once per optimizer step and accumulates in float32;
  but one non-finite micro-batch poisons every later window (its reset
  multiplies by 0, and 0 * inf is NaN). jmp_lite.accumulate_gradients is the
  fix (see test_accumulation_one_adjustment_per_optimizer_step).
  """
  k = 2
  opt = optax.MultiSteps(
      jmp_lite.loss_scaled(optax.sgd(0.1),
                           jmp_lite.DynamicLossScale(2.0**6, period=1)),
      every_k_schedule=k)
  params = _init_params()
  state = opt.init(params)
  for acc in jax.tree.leaves(state.acc_grads):
    assert_dtype(acc, jnp.float32)
  update = jax.jit(opt.update)
  grads = jax.tree.map(jnp.ones_like, params)
  scales = []
  for i in range(8):
    g = jax.tree.map(lambda x: x * jnp.inf, grads) if i == 2 else grads
    _, state = update(g, state, params)
    scales.append(float(jmp_lite.current_loss_scale(state).loss_scale))
  # Growth once per optimizer step (period=1), then the poisoned window backs
  # off, and every later window stays non-finite and keeps backing off.
  assert scales == [64.0, 128.0, 128.0, 64.0, 64.0, 32.0, 32.0, 16.0]


@pytest.mark.parametrize("dtype", [jnp.complex64, jnp.float32])
def test_accumulate_gradients_averages_complex_params(dtype):
  """Complex leaves kept only the last micro-batch (a real accumulator
  skipped them): with k=2 and gradients 1+1j, 3+3j the update was -(3+3j)."""
  opt = jmp_lite.accumulate_gradients(optax.sgd(1.0), every_k=2)
  params = jnp.zeros(2, dtype)
  state = opt.init(params)
  assert state.acc.dtype == dtype
  g1, g2 = (jnp.full(2, 1 + 1j), jnp.full(2, 3 + 3j))
  if dtype == jnp.float32:
    g1, g2 = g1.real, g2.real
  _, state = opt.update(g1.astype(dtype), state, params)
  updates, state = opt.update(g2.astype(dtype), state, params)
  chex.assert_trees_all_close(updates, -(g1 + g2).astype(dtype) / 2)


def test_a_nonfinite_complex_micro_batch_poisons_its_window():
  opt = jmp_lite.accumulate_gradients(
      jmp_lite.loss_scaled(optax.sgd(0.1), jmp_lite.DynamicLossScale(8.0)),
      every_k=2)
  params = jnp.ones(2, jnp.complex64)
  state = opt.init(params)
  for g in (jnp.array([1 + 1j, complex(np.nan, 0)], jnp.complex64),
            jnp.ones(2, jnp.complex64)):
    updates, state = opt.update(g, state, params)
    params = optax.apply_updates(params, updates)
  chex.assert_trees_all_equal(params, jnp.ones(2, jnp.complex64))
  guard = jmp_lite.loss_scaled_state(state)
  assert int(guard.total_skips) == 1
  assert float(guard.loss_scale.loss_scale) == 4.0


@pytest.mark.parametrize("via", ["update", "update_and_apply"])
@pytest.mark.parametrize("skip_with", ["cond", "select"])
def test_a_guard_whose_inner_state_changes_dtype_says_what_to_change(
    via, skip_with):
  """skip_nonfinite(adam) on bfloat16 params fed float32 gradients failed
  deep inside JAX ("cond branches must have equal output types")."""
  opt = jmp_lite.skip_nonfinite(optax.adam(1e-3), skip_with=skip_with)
  params = {"w": jnp.ones(3, jnp.bfloat16)}
  state = opt.init(params)
  grads = {"w": jnp.ones(3, jnp.float32)}
  with pytest.raises(TypeError, match=r"mu\['w'\]: bfloat16 -> float32.*"
                     r"master_weights"):
    if via == "update":
      opt.update(grads, state, params)
    else:
      jmp_lite.update_and_apply(opt, grads, state, params)
  # What the message says to do runs.
  fixed = jmp_lite.master_weights(opt)
  state = fixed.init(params)
  new, _ = jmp_lite.update_and_apply(fixed, grads, state, params)
  assert new["w"].dtype == jnp.bfloat16


@pytest.mark.parametrize("bad", [5, ["d"], ("d", 1), ()])
def test_axis_name_must_name_an_axis(bad):
  for build in (lambda: jmp_lite.loss_scaled(optax.sgd(0.1), "f32",
                                             axis_name=bad),
                lambda: jmp_lite.skip_nonfinite(optax.sgd(0.1),
                                                axis_name=bad)):
    with pytest.raises(TypeError, match="axis_name must be None, a str or a"
                       " tuple of str"):
      build()


@pytest.mark.parametrize("name", ["master+loss_scaled", "O3", "O3 8-bit"])
def test_flax_serialization_round_trips_every_state(name):
  # Flax users checkpoint with flax.serialization (to_bytes / from_bytes),
  # which walks its own registry, not JAX's: every jmp_lite state must be in
  # it, static configuration restored from the target.
  from flax import serialization

  import jmp_lite.presets
  params = {"w": jnp.full((8, 256), 0.5, jnp.bfloat16),
            "b": jnp.zeros((3,), jnp.bfloat16)}
  opt = {
      "master+loss_scaled": lambda: jmp_lite.master_weights(
          jmp_lite.loss_scaled(optax.adam(1e-3),
                               jmp_lite.DynamicLossScale(2.0**15))),
      "O3": lambda: jmp_lite.presets.preset("O3", half="bf16").optimizer(
          optax.adam(1e-3)),
      "O3 8-bit": lambda: jmp_lite.presets.preset(
          "O3", half="bf16", state_bits=8,
          compensation="stochastic").optimizer(optax.adam(1e-3)),
  }[name]()
  grads = jax.tree.map(lambda p: p * 0.1, params)
  _, state = jax.jit(lambda s: jmp_lite.update_and_apply(
      opt, grads, s, params))(opt.init(params))
  restored = serialization.from_bytes(opt.init(params),
                                      serialization.to_bytes(state))
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  chex.assert_trees_all_equal(restored, state)
  with pytest.raises(ValueError, match="saved from another class"):
    serialization.from_state_dict(
        opt.init(params), jax.tree.map(lambda x: x, {"unrelated": 1}))


@pytest.mark.parametrize("how", ["register", "import jmp_lite.nnx"])
def test_flax_serialization_when_flax_comes_after_jmp_lite(how):
  # jmp_lite's core imports no Flax, so its states join Flax's registry when
  # Flax arrives through jmp_lite's Flax layers, or when asked to.
  import subprocess
  import sys
  step = ("jmp_lite.struct.register_flax_serialization()"
          if how == "register" else "import jmp_lite.nnx")
  code = f"""
import sys, optax, jmp_lite
assert "flax" not in sys.modules
import flax.serialization as S
{step}
opt = jmp_lite.loss_scaled(optax.sgd(0.1), jmp_lite.DynamicLossScale(8.0))
state = opt.init({{"w": 1.0}})
back = S.from_bytes(state, S.to_bytes(state))
assert type(back) is type(state), type(back)
print("ok")
"""
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=300)
  assert out.stdout.strip() == "ok", out.stdout + out.stderr

