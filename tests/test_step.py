"""Tests for jmp_lite.step: update_and_apply and scaled_value_and_grad."""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite
from tests.conftest import assert_dtype, AUTO_KIND, AUTO_SKIP_WITH


def _params(dtype=jnp.float32):
  rng = np.random.default_rng(0)
  params = {
      "dense": {"w": jnp.asarray(rng.standard_normal((6, 5)) * 0.3, dtype),
                # A -0.0 entry: a skipped step must keep its sign bit.
                "b": jnp.zeros((5,), dtype).at[2].set(-0.0)},
      "out": {"w": jnp.asarray(rng.standard_normal((5, 2)) * 0.3, dtype)},
  }
  return params


def _loss(params, x, y):
  p = jax.tree.map(lambda a: a.astype(jnp.float32), params)
  h = jnp.tanh(x @ p["dense"]["w"] + p["dense"]["b"])
  return jnp.mean((h @ p["out"]["w"] - y) ** 2)


def _batches(n, seed=1):
  rng = np.random.default_rng(seed)
  return [(jnp.asarray(rng.standard_normal((8, 6)), jnp.float32),
           jnp.asarray(rng.standard_normal((8, 2)), jnp.float32))
          for _ in range(n)]


# Step -> (leaf index, flat position, value): +-inf and NaN in every leaf.
FAULTS = {2: (0, 3, np.inf), 3: (1, 0, np.nan), 6: (2, 5, -np.inf),
          9: (1, 4, np.inf)}
N_STEPS = 11


def _mask(fault):
  leaves, treedef = jax.tree.flatten(_params())
  masks = [np.zeros(leaf.shape, bool) for leaf in leaves]
  if fault is not None:
    i, pos, _ = fault
    masks[i].reshape(-1)[pos % masks[i].size] = True
  return jax.tree.unflatten(treedef, masks)


def _inner():
  return optax.chain(
      optax.clip_by_global_norm(1.0),
      optax.adamw(optax.linear_schedule(1e-2, 1e-3, 40), weight_decay=1e-2))


def _scale():
  return jmp_lite.DynamicLossScale(2.0**8, period=3, hysteresis=2)


def _ls(**kw):
  return jmp_lite.loss_scaled(_inner(), _scale(), **kw)


# name -> (optimizer factory, param dtype, scaled loss, formulation,
#          whether a skipped step changes nothing outside the guard's counters)
# The guards keep skip_with="auto": AUTO_KIND is what that compiles to here.
COMPOSITIONS = {
    "loss_scaled": (_ls, jnp.float32, True, AUTO_KIND, True),
    "skip_nonfinite": (
        lambda: jmp_lite.skip_nonfinite(_inner(), max_consecutive_skips=50),
        jnp.float32, False, AUTO_KIND, True),
    # optax.chain declares nothing (jmp_lite.contract): its guard decides
    # for itself, inside the chain's update.
    "chain": (lambda: optax.chain(_ls(), optax.scale(1.0)), jnp.float32, True,
              "update", True),
    "master_weights": (lambda: jmp_lite.master_weights(_ls()), jnp.bfloat16,
                       True, AUTO_KIND, True),
    # inject_hyperparams *around* the guard counts every step, as it does
    # with opt.update: equal to the update path, not to a good-steps-only run.
    "inject_hyperparams": (
        lambda: optax.inject_hyperparams(
            lambda learning_rate: jmp_lite.loss_scaled(
                optax.adam(learning_rate), _scale()))(
                    learning_rate=optax.linear_schedule(1e-2, 1e-3, 40)),
        jnp.float32, True, "update", False),
    "accumulate_gradients": (
        lambda: jmp_lite.accumulate_gradients(_ls(), every_k=2), jnp.float32,
        True, "update", False),
    "MultiSteps": (lambda: optax.MultiSteps(_ls(), every_k_schedule=2),
                   jnp.float32, True, "update", False),
    "multi_transform": (
        lambda: optax.multi_transform(
            {"g": _ls(name="g"), "d": _ls(name="d")},
            {"dense": "g", "out": "d"}),
        jnp.float32, True, "update", False),
    # A chain element before the guard changes what it sees (NaN steps are
    # applied here, inf ones skipped): the guard must decide on its own.
    "chain(zero_nans, guard)": (
        lambda: optax.chain(optax.zero_nans(), jmp_lite.skip_nonfinite(
            _inner(), max_consecutive_skips=50)),
        jnp.float32, False, "update", False),
    # A float16 master (of float16 params: a master narrower than its
    # params is refused) hands the guard float16 gradients to unscale: it
    # must be asked for, allow_half_state=True.
    "master_weights(float16 master)": (
        lambda: jmp_lite.master_weights(jmp_lite.loss_scaled(
            optax.sgd(1e-2), _scale(), allow_half_state=True,
            check_updates=False), dtype=jnp.float16),
        jnp.float16, True, "update", True),
}


def _scaled_grads(opt_state, params, x, y, scaled, fault_mask, bad):
  if scaled:
    scale = jmp_lite.current_loss_scale(
        opt_state, name="g" if "g" in _names(opt_state) else None)
    loss, grads = jmp_lite.scaled_value_and_grad(_loss, scale)(params, x, y)
  else:
    loss, grads = jax.value_and_grad(_loss)(params, x, y)
  grads = jax.tree.map(lambda g, m: jnp.where(m, bad, g).astype(g.dtype),
                       grads, fault_mask)
  return loss, grads


def _names(opt_state):
  return [s.name for s in jmp_lite.struct.find_nodes(
      opt_state, jmp_lite.LossScaledState)]


def _steps(opt, scaled):
  def new_way(params, opt_state, x, y, fault_mask, bad):
    loss, grads = _scaled_grads(opt_state, params, x, y, scaled, fault_mask,
                                bad)
    return (*jmp_lite.update_and_apply(opt, grads, opt_state, params), loss)

  def old_way(params, opt_state, x, y, fault_mask, bad):
    loss, grads = _scaled_grads(opt_state, params, x, y, scaled, fault_mask,
                                bad)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return (jax.jit(new_way, donate_argnums=(0, 1)), jax.jit(old_way))


def _assert_close_to_ulps(got, want, old, ulps=2):
  """Floats within ``ulps`` ulps of the larger of old and new; rest exact."""
  for g, w, o in zip(jax.tree.leaves(got), jax.tree.leaves(want),
                     jax.tree.leaves(old), strict=True):
    g, w, o = np.asarray(g), np.asarray(w), np.asarray(o)
    assert g.dtype == w.dtype
    if not np.issubdtype(g.dtype, np.floating) and g.dtype != jnp.bfloat16:
      np.testing.assert_array_equal(g, w)
      continue
    g32, w32, o32 = (v.astype(np.float32) for v in (g, w, o))
    big = np.maximum(np.maximum(abs(g32), abs(w32)), abs(o32))
    spacing = np.spacing(big.astype(g.dtype)).astype(np.float32)
    # NaN where both are NaN (MultiSteps' poisoned accumulator).
    np.testing.assert_array_equal(np.isnan(g32), np.isnan(w32))
    ok = np.isnan(g32) | (abs(g32 - w32) <= ulps * spacing)
    assert np.all(ok), np.nanmax(abs(g32 - w32) / spacing)


@pytest.mark.parametrize("name", list(COMPOSITIONS))
def test_update_and_apply_matches_the_update_path(name):
  """Fault injection: skipped steps bit-identical, applied ones within ulps."""
  factory, dtype, scaled, kind, _ = COMPOSITIONS[name]
  opt = factory()
  new_step, old_step = _steps(opt, scaled)
  params = _params(dtype)
  state = opt.init(params)
  assert jmp_lite.step.formulation(opt)[0] == kind
  for i, (x, y) in enumerate(_batches(N_STEPS)):
    fault = FAULTS.get(i)
    args = (x, y, _mask(fault), jnp.float32(fault[2] if fault else 0.0))
    want = old_step(params, state, *args)
    old = jax.device_get((params, state))
    got = new_step(params, state, *args)  # Donates params and state.
    if fault is not None:
      chex.assert_trees_all_equal(got, want)
    else:
      _assert_close_to_ulps(got[:2], want[:2], old)
    params, state = got[:2]
    for p in jax.tree.leaves(params):
      assert_dtype(p, dtype)


GOOD_ONLY = [n for n, c in COMPOSITIONS.items() if c[4]]


@pytest.mark.parametrize("name", GOOD_ONLY)
def test_skips_leave_everything_as_a_run_without_the_bad_steps(name):
  factory, dtype, scaled, _, _ = COMPOSITIONS[name]
  opt = factory()
  step, _ = _steps(opt, scaled)
  params, ref_params = _params(dtype), _params(dtype)
  state, ref_state = opt.init(params), opt.init(ref_params)
  no_fault = _mask(None)
  for i, (x, y) in enumerate(_batches(N_STEPS)):
    fault = FAULTS.get(i)
    if fault is None:
      ref_params, ref_state, _ = step(ref_params, ref_state, x, y, no_fault,
                                      jnp.float32(0.0))
      params, state, _ = step(params, state, x, y, no_fault, jnp.float32(0))
      continue
    before = jax.device_get((params, state))
    params, state, loss = step(params, state, x, y, _mask(fault),
                               jnp.float32(fault[2]))
    # Bit for bit, -0.0 included (assert_trees_all_equal compares values).
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(before[0]),
                    strict=True):
      np.testing.assert_array_equal(np.signbit(a), np.signbit(b))
    chex.assert_trees_all_equal(params, before[0])
    # Everything but the guard's counters and scale: inner state, master
    # copy, wrappers' states.
    chex.assert_trees_all_equal(_without_counters(state),
                                _without_counters(before[1]))
    assert not bool(_guard(state).last_finite)
    assert np.isfinite(float(loss))  # The fault was in the gradients only.
  chex.assert_trees_all_equal(params, ref_params)
  chex.assert_trees_all_equal(_guard(state).inner_state,
                              _guard(ref_state).inner_state)
  assert int(_guard(state).total_skips) == len(FAULTS)


def _without_counters(state):
  kinds = (jmp_lite.LossScaledState, jmp_lite.transforms.SkipNonfiniteState)
  return jax.tree.map(lambda n: n.inner_state if isinstance(n, kinds) else n,
                      state, is_leaf=lambda n: isinstance(n, kinds))


def _guard(state):
  skip_state = jmp_lite.transforms.SkipNonfiniteState
  found = (jmp_lite.struct.find_nodes(state, jmp_lite.LossScaledState)
           + jmp_lite.struct.find_nodes(state, skip_state))
  assert len(found) == 1
  return found[0]


def test_loss_scale_moves_without_recompiling():
  opt = jmp_lite.master_weights(jmp_lite.loss_scaled(
      optax.adam(1e-2), jmp_lite.DynamicLossScale(2.0**6, period=2)))

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(params, state, x, y, bad):
    _, grads = jmp_lite.scaled_value_and_grad(_loss, state)(params, x, y)
    grads = jax.tree.map(lambda g: jnp.where(bad, jnp.nan, g), grads)
    return jmp_lite.update_and_apply(opt, grads, state, params)

  params = _params(jnp.float16)
  state = opt.init(params)
  scales = []
  for i, (x, y) in enumerate(_batches(12)):
    params, state = step(params, state, x, y, jnp.array(i in (5, 6)))
    scales.append(float(jmp_lite.current_loss_scale(state).loss_scale))
  assert scales == [64.0, 128.0, 128.0, 256.0, 256.0, 128.0, 64.0, 64.0,
                    128.0, 128.0, 256.0, 256.0]
  chex.assert_trees_all_equal(
      params, jax.tree.map(lambda m: m.astype(jnp.float16),
                           jmp_lite.master_params(state)))


def _top_level_primitives(fn, *args):
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  return [(e.primitive.name, [v.aval.ndim for v in e.outvars])
          for e in jaxpr.eqns]


@pytest.mark.parametrize("skip_with", ["auto", "cond", "select"])
def test_the_formulation_is_what_runs(skip_with):
  """A cond plan is one lax.cond around everything; select has no cond."""
  opt = jmp_lite.loss_scaled(optax.adam(1e-3), _scale(), skip_with=skip_with)
  params = _params()
  state = opt.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  kind, why = jmp_lite.step.formulation(opt)
  prims = _top_level_primitives(
      lambda p, s, g: jmp_lite.update_and_apply(opt, g, s, p), params, state,
      grads)
  array_selects = [p for p, nd in prims if p == "select_n" and max(nd) > 0]
  if (skip_with if skip_with != "auto" else AUTO_SKIP_WITH) == "select":
    assert kind == "update" and f"skip_with='{skip_with}'" in why
    assert array_selects and "cond" not in [p for p, _ in prims]
  else:
    assert kind == "cond" and "lax.cond" in why
    assert [p for p, _ in prims].count("cond") == 1 and not array_selects
    # Parameter additions happen only inside the branches.
    assert "add" not in [p for p, nd in prims if max(nd, default=0) > 0]


def test_formulation_reasons():
  """Read from what the transformations declare, never from a state."""
  kind_and_why = jmp_lite.step.formulation
  kind, why = kind_and_why(optax.adam(1e-3))
  assert kind == "update" and "declares no guard" in why
  kind, why = kind_and_why(jmp_lite.loss_scaled(
      optax.adam(1e-3), _scale(), check_updates=True))
  assert kind == "update" and "check_updates" in why
  kind, why = kind_and_why(jmp_lite.loss_scaled(
      optax.adam(1e-3), jmp_lite.DynamicLossScale(4.0, min_loss_scale=0.25)))
  assert kind == "update" and "below 1" in why
  # The outer guard decides up front; the inner one decides for itself.
  assert kind_and_why(jmp_lite.skip_nonfinite(_ls()))[0] == AUTO_KIND
  for undeclared in (
      jmp_lite.accumulate_gradients(_ls(), every_k=2),
      optax.chain(optax.clip(1.0), _ls()),
      optax.chain(_ls(), optax.scale(0.5)),
      optax.named_chain(("guarded", _ls()), ("scale", optax.scale(0.5))),
      optax.MultiSteps(_ls(), every_k_schedule=2).gradient_transformation()):
    kind, why = kind_and_why(undeclared)
    assert kind == "update" and "declares no guard" in why
  kind, why = kind_and_why(jmp_lite.master_weights(optax.adam(1e-3)))
  assert kind == "update" and "declares nothing" in why
  assert kind_and_why(jmp_lite.master_weights(_ls()))[0] == AUTO_KIND
  kind, why = kind_and_why(jmp_lite.master_weights(
      jmp_lite.loss_scaled(optax.sgd(0.1), _scale()), dtype=jnp.float16))
  assert kind == "update" and "65504" in why
  assert kind_and_why(jmp_lite.master_weights(_ls()),
                      grads_dtype=jnp.float16)[0] == AUTO_KIND
  with pytest.raises(TypeError, match="takes the optimizer"):
    kind_and_why(_ls().init(_params()))


@pytest.mark.parametrize("case", ["scale before", "float16 master",
                                  "float64 grads, float32 master"])
def test_finite_gradients_the_guard_sees_as_inf_are_skipped(case):
  """update_and_apply decides what the guard would: the gradients as they
  reach it. Here they are finite as given and overflow on the way in."""
  with jax.enable_x64(case.startswith("float64")):
    ls = jmp_lite.loss_scaled(optax.sgd(0.1), jmp_lite.NoOpLossScale())
    opt, params, big = {
        "scale before": lambda: (optax.chain(optax.scale(1e10), ls),
                                 {"w": jnp.ones(3)}, 1e30),
        # float32 gradients of float16 params (a master narrower than its
        # params is refused).
        "float16 master": lambda: (
            jmp_lite.master_weights(ls, dtype=jnp.float16),
            {"w": jnp.ones(3, jnp.float16)}, 1e5),
        "float64 grads, float32 master": lambda: (
            jmp_lite.master_weights(ls), {"w": jnp.ones(3, jnp.float32)},
            1e300),
    }[case]()
    wide = jnp.float64 if case.startswith("float64") else jnp.float32
    grads = {"w": jnp.asarray([big, 1.0, 1.0], wide)}
    state = opt.init(params)
    assert jmp_lite.step._plan(
        opt, jmp_lite.step._largest_gradient(grads)).kind == "update"
    updates, want_state = opt.update(grads, state, params)
    want = optax.apply_updates(params, updates)
    got, got_state = jax.jit(jmp_lite.update_and_apply, static_argnums=0)(
        opt, grads, state, params)
    chex.assert_trees_all_equal(got, want, params)
    chex.assert_trees_all_equal(got_state, want_state)
    assert int(jmp_lite.struct.find_nodes(
        got_state, jmp_lite.LossScaledState)[0].total_skips) == 1


def test_check_updates_and_low_scales_still_skip_through_update_and_apply():
  params = {"w": jnp.ones((4,), jnp.float16)}
  grads = {"w": jnp.array([1e-3, 0.0, 0.0, 0.0], jnp.float16)}
  opt = jmp_lite.loss_scaled(optax.adam(1e-3), jmp_lite.NoOpLossScale(),
                             allow_half_state=True)  # check_updates on
  state = opt.init(params)
  new_params, new_state = jax.jit(jmp_lite.update_and_apply, static_argnums=0)(
      opt, grads, state, params)
  chex.assert_trees_all_equal(new_params, params)
  assert int(new_state.total_skips) == 1


def test_halted_skip_nonfinite_skips_finite_steps():
  opt = jmp_lite.skip_nonfinite(optax.sgd(0.1), max_consecutive_skips=2)
  params = {"w": jnp.ones(3)}
  state = opt.init(params)
  step = jax.jit(lambda p, s, g: jmp_lite.update_and_apply(opt, g, s, p))
  nan = {"w": jnp.array([1.0, jnp.nan, 1.0])}
  for _ in range(2):
    params, state = step(params, state, nan)
  assert bool(state.halted)
  params, state = step(params, state, {"w": jnp.ones(3)})
  np.testing.assert_array_equal(np.asarray(params["w"]), 1.0)
  assert int(state.total_skips) == 3 and bool(state.last_finite)


def test_extra_args_reach_the_inner_optimizer():
  seen = []

  def inner_update(updates, state, params=None, *, factor):
    seen.append(factor)
    return jax.tree.map(lambda u: -factor * u, updates), state

  inner = optax.GradientTransformationExtraArgs(
      lambda p: optax.EmptyState(), inner_update)
  opt = jmp_lite.loss_scaled(inner, jmp_lite.StaticLossScale(2.0))
  params = {"w": jnp.ones(2)}
  new, _ = jmp_lite.update_and_apply(opt, {"w": jnp.full(2, 2.0)},
                                     opt.init(params), params, factor=0.5)
  np.testing.assert_allclose(np.asarray(new["w"]), 0.5)
  assert seen


def test_int_and_float0_leaves_pass_through():
  params = {"w": jnp.ones((3,)), "step": jnp.array(7)}
  opt = jmp_lite.loss_scaled(
      optax.multi_transform({"f": optax.adam(0.1), "z": optax.set_to_zero()},
                            {"w": "f", "step": "z"}),
      jmp_lite.DynamicLossScale(4.0))
  state = opt.init(params)

  @jax.jit
  def step(params, state, bad):
    scale = jmp_lite.current_loss_scale(state)
    # allow_int gives the int leaf a float0 gradient.
    grads = jax.grad(
        lambda p: scale.scale(jnp.sum(p["w"] ** 2) * p["step"]),
        allow_int=True)(params)
    grads["w"] = jnp.where(bad, jnp.nan, grads["w"])
    return jmp_lite.update_and_apply(opt, grads, state, params)

  new, state = step(params, state, jnp.array(False))
  assert float(new["w"][0]) < 1.0 and int(new["step"]) == 7
  assert_dtype(new["step"], jnp.int32)
  again, state = step(new, state, jnp.array(True))
  chex.assert_trees_all_equal(again, new)
  assert int(state.total_skips) == 1


def test_update_and_apply_validation():
  with pytest.raises(TypeError, match="optax.GradientTransformation"):
    jmp_lite.update_and_apply(lambda g: g, {}, {}, {})
  opt = optax.sgd(0.1)
  with pytest.raises(ValueError, match="needs the params"):
    jmp_lite.update_and_apply(opt, jnp.ones(2), opt.init(jnp.ones(2)), None)


@pytest.mark.parametrize("grad,match", [
    # A Python float had no .shape, so the check let it through and the
    # scalar was broadcast into every element of the (2, 3) param.
    (0.5, r"gradient at \['w'\] has shape \(\) \(float\), its param"
          r" \(2, 3\)"),
    (np.float32(0.5), r"gradient at \['w'\] has shape \(\)"),
    (3, r"gradient at \['w'\] has shape \(\) \(int\)"),
])
def test_update_and_apply_refuses_a_scalar_gradient_for_an_array(grad, match):
  params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
  opt = optax.sgd(0.1)
  with pytest.raises(ValueError, match=match):
    jmp_lite.update_and_apply(opt, {"w": grad, "b": jnp.ones(3)},
                              opt.init(params), params)
  # A Python float for a scalar param fits.
  new, _ = jmp_lite.update_and_apply(opt, {"s": 1.0}, opt.init({"s": 2.0}),
                                     {"s": 2.0})
  assert float(new["s"]) == pytest.approx(1.9)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8, jnp.bool_])
@pytest.mark.parametrize("via", ["update_and_apply", "update"])
def test_integer_gradients_of_float_params_are_refused(dtype, via):
  """Integer or bool gradients skipped the unscale (integer leaves pass
  it): with a scale of 1024 the update was 1024 times too large."""
  params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3),
            "i": jnp.arange(2)}
  opt = jmp_lite.loss_scaled(optax.sgd(0.1),
                             jmp_lite.StaticLossScale(1024.0))
  grads = {"w": jnp.ones((2, 3), dtype), "b": jnp.ones(3),
           # An integer param's integer gradient is no floating one.
           "i": jnp.zeros(2, jnp.int32)}
  state = opt.init(params)
  name = np.dtype(dtype).name
  if via == "update_and_apply":
    with pytest.raises(TypeError, match=rf"gradient at \['w'\] is {name},"
                       r" its param float32.*never unscaled"):
      jmp_lite.update_and_apply(opt, grads, state, params)
  else:
    with pytest.raises(TypeError, match=rf"integer or bool gradients"
                       rf" \(\['w'\] \({name} for a float32 param\)\)"):
      opt.update(grads, state, params)
    # Without params whose gradient it is cannot be told: refused too.
    with pytest.raises(TypeError, match=r"\['i'\] \(int32\).*pass params"):
      opt.update(grads, state)
  # Floating gradients of the same values are unscaled.
  grads["w"] = grads["w"].astype(jnp.float32)
  new, _ = jmp_lite.update_and_apply(opt, grads, state, params)
  np.testing.assert_allclose(np.asarray(new["w"]), 1 - 0.1 / 1024,
                             rtol=1e-6)


def test_integer_gradients_under_a_noop_scale_pass():
  """A documented decision: with no scale there is no unscale to skip."""
  opt = jmp_lite.loss_scaled(optax.sgd(0.5), jmp_lite.NoOpLossScale())
  params = {"w": jnp.ones(2)}
  updates, _ = opt.update({"w": jnp.array([2, 4])}, opt.init(params), params)
  np.testing.assert_array_equal(np.asarray(updates["w"]), [-1.0, -2.0])


@pytest.mark.parametrize("argnums", ["0", (0, "1"), 1.0, (), True])
def test_scaled_value_and_grad_refuses_argnums_that_are_no_positions(
    argnums):
  """argnums="0" said "'str' object cannot be interpreted as an integer";
  True differentiated argument 1, () failed inside max()."""
  with pytest.raises(TypeError, match=r"argnums must be None, an int or a"
                     r" non-empty tuple of ints.*got \w+: "):
    jmp_lite.scaled_value_and_grad(lambda w: (w ** 2).sum(),
                                   jmp_lite.StaticLossScale(2.0),
                                   argnums=argnums)


def test_apply_updates_equals_optax():
  params = {"w": jnp.ones(3, jnp.bfloat16), "v": jnp.full(2, 3.0),
            "none": None}
  updates = {"w": jnp.full(3, 1e-3, jnp.float32), "v": jnp.full(2, -0.5),
             "none": None}
  chex.assert_trees_all_equal(jmp_lite.step.apply_updates(params, updates),
                              optax.apply_updates(params, updates))


# ------------------------------------------------------------- donation


def _buffers(tree):
  out = []
  for x in jax.tree.leaves(tree):
    if isinstance(x, jax.Array):
      out.extend(s.data.unsafe_buffer_pointer() for s in x.addressable_shards)
  return out


TRANSFORMATIONS = {
    "skip_nonfinite": lambda: jmp_lite.skip_nonfinite(optax.adam(1e-3)),
    "loss_scaled": lambda: jmp_lite.loss_scaled(
        optax.adam(1e-3), jmp_lite.DynamicLossScale(jnp.float32(2.0**8))),
    "master_weights": lambda: jmp_lite.master_weights(
        jmp_lite.loss_scaled(optax.adam(1e-3), _scale())),
    "accumulate_gradients": lambda: jmp_lite.accumulate_gradients(
        jmp_lite.loss_scaled(optax.adam(1e-3), _scale()), every_k=2),
    "tracked": lambda: jmp_lite.loss_scaled(
        optax.adam(1e-3), _scale(), track_nonfinite=True),
    "O2": lambda: jmp_lite.master_weights(jmp_lite.accumulate_gradients(
        jmp_lite.loss_scaled(optax.adam(1e-3), _scale()), every_k=2)),
}


@pytest.mark.parametrize("name,via", [
    *((n, "update_and_apply") for n in TRANSFORMATIONS),
    ("master_weights", "update"), ("O2", "update")])
def test_donated_step_runs(name, via):
  """No state leaf is a param's buffer (or another leaf's): donation works."""
  opt = TRANSFORMATIONS[name]()
  # float32 leaves (a float32 master copy would alias them), an int leaf
  # (passed through by master weights and accumulation), bfloat16 ones.
  with_int = {"w": jnp.ones((3, 2)), "n": jnp.array(3)}
  state = opt.init(with_int)
  state_buffers = _buffers(state)
  assert not set(state_buffers) & set(_buffers(with_int))
  assert len(set(state_buffers)) == len(state_buffers)

  master = name in ("master_weights", "O2")
  params = {"w": jnp.ones((3, 2)),
            "h": jnp.ones((2,), jnp.bfloat16 if master else jnp.float32)}
  state = opt.init(params)
  assert not set(_buffers(state)) & set(_buffers(params))

  def loss(p):
    return jnp.sum(p["w"] ** 2) + jnp.sum(p["h"].astype(jnp.float32) ** 2)

  @jax.jit
  def grads_of(params, state):
    g = jax.grad(loss)(params)
    found = jmp_lite.struct.find_nodes(state, jmp_lite.LossScaledState)
    if found:
      g = found[0].loss_scale.scale(g)
    return g

  def step(params, state, grads):
    if via == "update_and_apply":
      return jmp_lite.update_and_apply(opt, grads, state, params)
    updates, state = opt.update(grads, state, params)
    return jmp_lite.step.apply_updates(params, updates), state

  step = jax.jit(step, donate_argnums=(0, 1))
  for _ in range(3):
    grads = grads_of(params, state)
    old = params
    params, state = step(params, state, grads)
    assert old["w"].is_deleted()  # Donated, and the step still ran.
  assert float(params["w"][0, 0]) < 1.0


# ----------------------------------------------------- scaled_value_and_grad


def _fun(w, x, k=1.0):
  return k * jnp.sum((w * x) ** 2)


@pytest.mark.parametrize("jit", [False, True])
def test_scaled_value_and_grad_values(jit):
  w, x = jnp.array([1.0, -2.0]), jnp.array([0.5, 3.0])
  scale = jmp_lite.StaticLossScale(256.0)
  fn = jmp_lite.scaled_value_and_grad(_fun, scale)
  fn = jax.jit(fn) if jit else fn
  loss, grads = fn(w, x, k=2.0)
  ref_loss, ref_grads = jax.value_and_grad(_fun)(w, x, k=2.0)
  assert float(loss) == float(ref_loss)  # Unscaled, exactly as fun gave it.
  assert_dtype(loss, jnp.float32)
  chex.assert_trees_all_close(grads, jax.tree.map(lambda g: 256.0 * g,
                                                  ref_grads), rtol=1e-7)


def test_scaled_value_and_grad_aux_and_argnums():
  def fun(w, x):
    return jnp.sum(w * x), {"mean": jnp.mean(w)}

  scale = jmp_lite.StaticLossScale(4.0)
  (loss, aux), (gw, gx) = jmp_lite.scaled_value_and_grad(
      fun, scale, argnums=(0, 1), has_aux=True)(jnp.ones(2), jnp.full(2, 3.0))
  assert float(loss) == 6.0 and float(aux["mean"]) == 1.0
  np.testing.assert_array_equal(np.asarray(gw), 12.0)
  np.testing.assert_array_equal(np.asarray(gx), 4.0)


def test_scaled_value_and_grad_half_precision_loss():
  w = jnp.full((2,), 0.5, jnp.float16)
  loss_fn = lambda w: jnp.sum(w * w)  # float16 loss
  loss, grads = jmp_lite.scaled_value_and_grad(
      loss_fn, jmp_lite.StaticLossScale(2.0**10))(w)
  assert_dtype(loss, jnp.float16)
  assert_dtype(grads, jnp.float16)
  assert float(loss) == 0.5
  np.testing.assert_array_equal(np.asarray(grads, np.float32), 2.0**10)


def test_scaled_value_and_grad_takes_an_optimizer_state():
  opt = jmp_lite.master_weights(jmp_lite.loss_scaled(
      optax.sgd(0.1), jmp_lite.StaticLossScale(8.0)))
  state = opt.init({"w": jnp.ones(2)})
  _, grads = jmp_lite.scaled_value_and_grad(
      lambda p: jnp.sum(p["w"]), state)({"w": jnp.ones(2)})
  np.testing.assert_array_equal(np.asarray(grads["w"]), 8.0)
  # A no-op scale gives jax.value_and_grad's gradients.
  plain = jmp_lite.loss_scaled(optax.sgd(0.1), "f32").init(jnp.ones(2))
  _, g = jmp_lite.scaled_value_and_grad(lambda w: jnp.sum(w ** 3), plain)(
      jnp.full(2, 2.0))
  np.testing.assert_array_equal(np.asarray(g), 12.0)


def test_scaled_value_and_grad_errors():
  with pytest.raises(TypeError, match="fun must be callable"):
    jmp_lite.scaled_value_and_grad(3.0, jmp_lite.NoOpLossScale())
  with pytest.raises(TypeError, match=r"StaticLossScale\(value\)"):
    jmp_lite.scaled_value_and_grad(_fun, 2.0**15)
  with pytest.raises(TypeError, match="loss-scale state"):
    jmp_lite.scaled_value_and_grad(_fun, "f16")
  with pytest.raises(ValueError, match="No loss_scaled state"):
    jmp_lite.scaled_value_and_grad(_fun, optax.adam(1e-3).init(jnp.ones(2)))
  two = optax.multi_transform(
      {"a": jmp_lite.loss_scaled(optax.sgd(0.1), "f32", name="a"),
       "b": jmp_lite.loss_scaled(optax.sgd(0.1), "f32", name="b")},
      {"x": "a", "y": "b"}).init({"x": jnp.ones(1), "y": jnp.ones(1)})
  with pytest.raises(ValueError, match="pass name="):
    jmp_lite.scaled_value_and_grad(_fun, two)
  with pytest.raises(TypeError, match="has_aux must be a bool"):
    jmp_lite.scaled_value_and_grad(_fun, jmp_lite.NoOpLossScale(), has_aux=1)
  with pytest.raises(TypeError, match="pair"):
    jmp_lite.scaled_value_and_grad(
        lambda w: jnp.sum(w), jmp_lite.NoOpLossScale(),
        has_aux=True)(jnp.ones(2))


def test_scaled_value_and_grad_passes_argnums_only_when_given():
  """argnums was always passed, so Equinox's filter_value_and_grad (which
  takes none) could not be used."""
  seen = []

  def recording(f, **kwargs):
    seen.append(sorted(kwargs))
    return jax.value_and_grad(f, **kwargs)

  scale = jmp_lite.StaticLossScale(2.0)
  jmp_lite.scaled_value_and_grad(_fun, scale, value_and_grad=recording)
  jmp_lite.scaled_value_and_grad(_fun, scale, argnums=1,
                                 value_and_grad=recording)
  assert seen == [["has_aux"], ["argnums", "has_aux"]]
  # The default still differentiates the first argument.
  _, g = jmp_lite.scaled_value_and_grad(_fun, scale)(jnp.ones(2), jnp.ones(2))
  np.testing.assert_array_equal(np.asarray(g), 4.0)


def test_scaled_value_and_grad_with_equinox_filter_value_and_grad():
  eqx = pytest.importorskip("equinox")
  import jmp_lite.equinox as jeqx

  model = jeqx.mixed_precision(
      eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0)), "p=f32,c=f16,o=f32")
  opt = jmp_lite.loss_scaled(optax.adam(1e-2), "p=f32,c=f16,o=f32")
  opt_state = opt.init(eqx.filter(model, eqx.is_inexact_array))
  x, y = jnp.ones((8, 4)), jnp.zeros((8, 2))

  def loss(m, x, y):
    return jnp.mean((jax.vmap(m)(x) - y) ** 2)

  def aux_loss(m, x, y):
    return loss(m, x, y), {"n": x.shape[0]}

  fn = jmp_lite.scaled_value_and_grad(
      loss, opt_state, value_and_grad=eqx.filter_value_and_grad)
  value, grads = fn(model, x, y)
  ref_value, ref_grads = eqx.filter_value_and_grad(loss)(model, x, y)
  assert float(value) == float(ref_value)
  scale = float(jmp_lite.current_loss_scale(opt_state).loss_scale)
  chex.assert_trees_all_close(
      grads, jax.tree.map(lambda g: scale * g, ref_grads), rtol=1e-2)
  (_, aux), _ = jmp_lite.scaled_value_and_grad(
      aux_loss, opt_state, has_aux=True,
      value_and_grad=eqx.filter_value_and_grad)(model, x, y)
  assert aux == {"n": 8}

  @eqx.filter_jit(donate="all")
  def step(model, opt_state, x, y):
    value, grads = jmp_lite.scaled_value_and_grad(
        loss, opt_state, value_and_grad=eqx.filter_value_and_grad)(model, x, y)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    params, opt_state = jmp_lite.update_and_apply(opt, grads, opt_state,
                                                  params)
    return eqx.combine(params, static), opt_state, value

  first = None
  for _ in range(5):
    model, opt_state, value = step(model, opt_state, x, y)
    first = float(value) if first is None else first
  assert float(value) < first
  assert int(jmp_lite.loss_scaled_state(opt_state).total_skips) == 0


def test_two_line_change_from_a_float32_step():
  """The docs' claim: only the optimizer line and the gradient line change."""
  x, y = _batches(1)[0]

  opt = optax.adam(1e-2)

  @jax.jit
  def f32_step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(_loss)(params, x, y)
    params, opt_state = jmp_lite.update_and_apply(opt, grads, opt_state,
                                                  params)
    return params, opt_state, loss

  scaled_opt = jmp_lite.loss_scaled(optax.adam(1e-2), "p=f32,c=f16,o=f32")

  @jax.jit
  def scaled_step(params, opt_state, x, y):
    loss, grads = jmp_lite.scaled_value_and_grad(_loss, opt_state)(params, x, y)
    params, opt_state = jmp_lite.update_and_apply(scaled_opt, grads, opt_state,
                                                  params)
    return params, opt_state, loss

  p1, s1, l1 = f32_step(_params(), opt.init(_params()), x, y)
  p2, s2, l2 = scaled_step(_params(), scaled_opt.init(_params()), x, y)
  assert float(l1) == float(l2)
  chex.assert_trees_all_close(p1, p2, rtol=1e-6)
  assert float(jmp_lite.current_loss_scale(s2).loss_scale) == 2.0**15


# ------------------------------------------------------------------ nnx


def test_nnx_optimizer_state_gives_plain_arrays():
  nnx = pytest.importorskip("flax.nnx")

  class Model(nnx.Module):

    def __init__(self, rngs):
      self.l1 = nnx.Linear(3, 4, rngs=rngs)
      self.l2 = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
      return self.l2(jnp.tanh(self.l1(x)))

  model = Model(nnx.Rngs(0))
  tx = jmp_lite.loss_scaled(optax.adam(1e-2),
                            jmp_lite.DynamicLossScale(2.0**8, period=2))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  scale = jmp_lite.current_loss_scale(optimizer.opt_state)
  assert isinstance(scale, jmp_lite.DynamicLossScale)
  for leaf in jax.tree.leaves(scale) + jax.tree.leaves(
      jmp_lite.loss_scaled_state(optimizer.opt_state)):
    assert isinstance(leaf, (jax.Array, np.ndarray)), type(leaf)
  assert float(scale.loss_scale) == 256.0

  x, y = jnp.ones((5, 3)), jnp.zeros((5, 2))

  def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)

  # The nnx way: nnx.Optimizer.update runs tx.update (the guard skips inside).
  @nnx.jit
  def step(model, optimizer, x, y):
    loss, grads = jmp_lite.scaled_value_and_grad(
        loss_fn, optimizer.opt_state, value_and_grad=nnx.value_and_grad)(
            model, x, y)
    optimizer.update(model, grads)
    return loss

  # update_and_apply on an nnx model: one cond, params and state donated.
  @nnx.jit(donate_argnums=(0, 1))
  def fused_step(model, optimizer, x, y):
    loss, grads = jmp_lite.scaled_value_and_grad(
        loss_fn, optimizer.opt_state, value_and_grad=nnx.value_and_grad)(
            model, x, y)
    params = nnx.state(model, nnx.Param)
    params, opt_state = jmp_lite.update_and_apply(
        optimizer.tx, grads, optimizer.opt_state, params)
    nnx.update(model, params)
    nnx.update(optimizer.opt_state, nnx.state(opt_state))
    optimizer.step[...] += 1
    return loss

  losses = []
  for fn in (step, fused_step):
    for _ in range(2):
      losses.append(float(fn(model, optimizer, x, y)))
  assert losses == sorted(losses, reverse=True)
  assert float(jmp_lite.current_loss_scale(
      optimizer.opt_state).loss_scale) == 1024.0
  before = jax.device_get(jax.tree.leaves(nnx.state(model, nnx.Param)))
  fused_step(model, optimizer, x.at[0, 0].set(jnp.inf), y)
  chex.assert_trees_all_equal(
      jax.device_get(jax.tree.leaves(nnx.state(model, nnx.Param))), before)
  state = jmp_lite.loss_scaled_state(optimizer.opt_state)
  assert int(state.total_skips) == 1 and not bool(state.last_finite)
  assert isinstance(state.total_skips, jax.Array)


@pytest.mark.parametrize("skip_with", ["cond", "select", None])
def test_nnx_split_states_keep_their_structure(skip_with):
  """update_and_apply returned nnx.split params and state with the Param
  wrappers stripped: a jitted functional step traced twice and a lax.scan
  over steps raised (found by a review helper)."""
  nnx = pytest.importorskip("flax.nnx")
  model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
  _, params, _ = nnx.split(model, nnx.Param, ...)
  tx = (optax.adam(1e-3) if skip_with is None else jmp_lite.loss_scaled(
      optax.adam(1e-3), jmp_lite.DynamicLossScale(2.0**4),
      skip_with=skip_with))
  opt_state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  new_params, new_state = jmp_lite.update_and_apply(tx, grads, opt_state,
                                                    params)
  updates, ref_state = tx.update(grads, opt_state, params)
  ref_params = optax.apply_updates(params, updates)
  assert jax.tree.structure(new_params) == jax.tree.structure(params)
  assert jax.tree.structure(new_state) == jax.tree.structure(opt_state)
  chex.assert_trees_all_close((new_params, new_state), (ref_params, ref_state),
                              rtol=1e-6)

  chex.clear_trace_counter()   # Counted per code location, across params.

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(params, opt_state):
    return jmp_lite.update_and_apply(
        tx, jax.tree.map(jnp.ones_like, params), opt_state, params)

  p, s = params, opt_state
  for _ in range(3):
    p, s = step(p, s)

  def body(carry, _):
    p, s = carry
    return jmp_lite.update_and_apply(
        tx, jax.tree.map(jnp.ones_like, p), s, p), None

  (scanned, _), _ = jax.lax.scan(body, (params, opt_state), None, length=3)
  chex.assert_trees_all_close(scanned, p, rtol=1e-6)


# ------------------------------------------------------------------ docs


def _docs_blocks():
  import re
  from pathlib import Path
  text = (Path(__file__).resolve().parents[1] / "docs" / "train_step.md"
          ).read_text()
  return re.findall(r"```python\n(.*?)```", text, re.S)


def test_docs_float32_to_loss_scaled_is_two_lines():
  import difflib

  def step_lines(block):
    lines = block.splitlines()
    start = lines.index("params = init_params()")
    end = next(i for i, line in enumerate(lines)
               if line.startswith("params, opt_state, loss = train_step("))
    return [line.split("  # changed")[0].rstrip()
            for line in lines[start:end + 1]]

  f32, scaled = (step_lines(b) for b in _docs_blocks()[:2])
  changed = [line for line in difflib.unified_diff(f32, scaled, lineterm="",
                                                   n=0)
             if line.startswith("+") and not line.startswith("+++")]
  assert len(changed) == 2, changed
  assert "loss_scaled" in changed[0] and "scaled_value_and_grad" in changed[1]


# -- Flax TrainState ----------------------------------------------------------

def _train_state(level, half):
  """A Flax-example-style TrainState (with batch_stats) under a preset."""
  from flax.training import train_state

  from jmp_lite.presets import preset

  class TrainState(train_state.TrainState):
    batch_stats: Any

  p = preset(level, half=half)
  params = jax.tree.map(lambda x: x.astype(p.policy.param_dtype), _params())
  tx = p.optimizer(_inner())
  stats = {"mean": jnp.zeros((5,), jnp.float32)}
  return TrainState.create(apply_fn=None, params=params, tx=tx,
                           batch_stats=stats), p


def _state_grads(state, x, y):
  scale = jmp_lite.current_loss_scale(state.opt_state)
  return jax.grad(lambda p: scale.scale(_loss(p, x, y)))(state.params)


@pytest.mark.parametrize("level,half", [("O1", "f16"), ("O2", "bf16"),
                                        ("O3", "bf16"), ("O3", "f16")])
def test_apply_gradients_is_the_train_state_method_through_one_cond(level,
                                                                    half):
  ours, _ = _train_state(level, half)
  theirs = ours
  stats = {"mean": jnp.arange(5.0)}
  batches = _batches(6)
  method = jax.jit(lambda s, g: s.apply_gradients(grads=g, batch_stats=stats))
  helper = jax.jit(lambda s, g: jmp_lite.apply_gradients(s, grads=g,
                                                         batch_stats=stats),
                   donate_argnums=0)
  for i, (x, y) in enumerate(batches):
    grads = _state_grads(theirs, x, y)
    if i == 2:  # A non-finite step: skipped, the step count still moves.
      grads = jax.tree.map(lambda g: g.at[0].set(jnp.inf), grads)
    before = jax.tree.map(jnp.copy, ours.params)
    theirs = method(theirs, grads)
    ours = helper(ours, grads)
    chex.assert_trees_all_close(ours.params, theirs.params,
                                rtol=1e-2 if level == "O3" else 1e-6)
    chex.assert_trees_all_equal_dtypes(ours.params, theirs.params)
    assert int(ours.step) == int(theirs.step) == i + 1
    chex.assert_trees_all_equal(ours.batch_stats, stats)
    if i == 2:
      chex.assert_trees_all_equal(ours.params, before)
  guard = jmp_lite.loss_scaled_state(ours.opt_state)
  assert int(guard.total_skips) == 1
  assert jmp_lite.step.formulation(ours.tx)[0] == AUTO_KIND


def test_apply_gradients_never_recompiles_and_checks_its_input():
  state, _ = _train_state("O1", "f16")

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(state, x, y):
    return jmp_lite.apply_gradients(state, grads=_state_grads(state, x, y))

  for x, y in _batches(4):
    state = step(state, x, y)
  assert int(state.step) == 4
  with pytest.raises(TypeError,
                     match="dict has no tx, params, opt_state, step, replace"):
    jmp_lite.apply_gradients(_params(), grads=_params())
  with pytest.raises(ValueError, match="_overwrite_with_gradient"):
    jmp_lite.apply_gradients(
        state, grads={"params": _params(), "_overwrite_with_gradient": {}})
