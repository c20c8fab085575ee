"""Tests for jmp_lite.contract: the step is planned from what optimizers
declare, never from the shape of a state; and states say whether a step
applied."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite
from jmp_lite import contract
from tests.conftest import AUTO_KIND


def _params():
  return {"w": jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32).reshape(2, 3),
          "b": jnp.zeros((3,), jnp.float32)}


def normalize_per_leaf(inner):
  """A user's wrapper, written the usual way: its state *is* its inner
  state. It divides each leaf by its norm, so an all-zero leaf (here the
  bias, whenever its gradient vanishes) becomes NaN: the guard inside must
  see that and skip."""
  def update(grads, state, params=None, **extra):
    grads = jax.tree.map(lambda g: g / jnp.linalg.norm(g), grads)
    return inner.update(grads, state, params, **extra)
  return optax.GradientTransformation(inner.init, update)


def _grads(step):
  # Steps 1 and 3: the bias gradient is exactly zero (finite as given).
  bias = jnp.zeros(3) if step in (1, 3) else jnp.full((3,), 0.5)
  return {"w": jnp.full((2, 3), 0.25 * (step + 1)), "b": bias}


def _by_update(opt):
  def step(params, state, grads):
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return jax.jit(step)


def _by_update_and_apply(opt):
  return jax.jit(lambda p, s, g: jmp_lite.update_and_apply(opt, g, s, p),
                 donate_argnums=(0, 1))


@pytest.mark.parametrize("guard", ["loss_scaled", "skip_nonfinite",
                                   "master_weights(loss_scaled)"])
def test_a_transparent_user_wrapper_skips_as_its_update_does(guard):
  """The defect this contract fixes: the wrapper's state looks exactly like
  the guard's, and a step planned from the state decided "finite" from the
  raw gradients and wrote NaN into params and Adam's nu."""
  inner = {
      "loss_scaled": lambda: jmp_lite.loss_scaled(
          optax.adam(1e-2), jmp_lite.DynamicLossScale(2.0**4)),
      "skip_nonfinite": lambda: jmp_lite.skip_nonfinite(optax.adam(1e-2)),
      "master_weights(loss_scaled)": lambda: jmp_lite.master_weights(
          jmp_lite.loss_scaled(optax.adam(1e-2), "f32")),
  }[guard]()
  opt = normalize_per_leaf(inner)
  assert jmp_lite.step.formulation(opt)[0] == "update"
  want_step, got_step = _by_update(opt), _by_update_and_apply(opt)
  params = _params()
  want = (params, opt.init(params))
  got = jax.tree.map(jnp.copy, want)
  for i in range(5):
    want = want_step(*want, _grads(i))
    got = got_step(*got, _grads(i))
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=0)
    for leaf in jax.tree.leaves(got):
      if jnp.issubdtype(leaf.dtype, jnp.floating):
        assert bool(jnp.isfinite(leaf).all()), (i, leaf)
  found = jmp_lite.struct.find_nodes(got[1], (
      jmp_lite.LossScaledState, jmp_lite.transforms.SkipNonfiniteState))
  assert [int(s.total_skips) for s in found] == [2]


def test_nothing_is_planted_in_the_state_a_wrapper_sees():
  """update_and_apply hands every transformation exactly the state the
  user holds (no marker objects): a wrapper that checks its state's type
  sees a LossScaledState on both branches of the decided step."""
  seen = []
  ls = jmp_lite.loss_scaled(optax.sgd(0.1), "f32")

  def spy(inner):
    def update(grads, state, params=None, **extra):
      seen.append(type(state))
      return inner.update(grads, state, params, **extra)
    return optax.GradientTransformation(inner.init, update)

  opt = jmp_lite.master_weights(ls)
  # Through the declared path: the guard's own update is rebound, and the
  # state it is handed is the user's.
  params = {"w": jnp.ones(2, jnp.bfloat16)}
  state = opt.init(params)
  jmp_lite.update_and_apply(opt, {"w": jnp.ones(2, jnp.bfloat16)}, state,
                            params)
  wrapped = spy(ls)
  jmp_lite.update_and_apply(wrapped, jnp.ones(2), wrapped.init(jnp.ones(2)),
                            jnp.ones(2))
  assert seen == [jmp_lite.LossScaledState]


@pytest.mark.parametrize("how", ["update", "update_and_apply"])
@pytest.mark.parametrize("setting,made,used", [
    ("axis_name", {"axis_name": None}, {"axis_name": "d"}),
    ("skip_with", {"skip_with": "cond"}, {"skip_with": "select"}),
    ("name", {"name": "a"}, {"name": "b"}),
    ("loss scale", {"loss_scale": jmp_lite.DynamicLossScale(8.0, period=10)},
     {"loss_scale": jmp_lite.DynamicLossScale(8.0, period=20)}),
])
def test_a_state_another_configuration_made_is_a_value_error(how, setting,
                                                             made, used):
  """A state built with axis_name=None stepped by an optimizer built with
  axis_name="d" let device 0 skip alone: now both paths refuse it."""
  def build(kw):
    kw = {"loss_scale": jmp_lite.StaticLossScale(4.0), **kw}
    return jmp_lite.loss_scaled(optax.sgd(0.1), kw.pop("loss_scale"), **kw)

  params = jnp.ones(2)
  state = build(made).init(params)
  opt = build(used)
  match = "another configuration made"
  with pytest.raises(ValueError, match=match) as info:
    if how == "update":
      opt.update(jnp.ones(2), state, params)
    else:
      jmp_lite.update_and_apply(opt, jnp.ones(2), state, params)
  if setting in ("axis_name", "skip_with", "name"):
    assert repr(made[setting]) in str(info.value)
    assert repr(used[setting]) in str(info.value)


@pytest.mark.parametrize("how", ["update", "update_and_apply"])
def test_a_skip_nonfinite_state_of_another_limit_is_a_value_error(how):
  state = jmp_lite.skip_nonfinite(
      optax.sgd(0.1), max_consecutive_skips=3).init(jnp.ones(2))
  opt = jmp_lite.skip_nonfinite(optax.sgd(0.1), max_consecutive_skips=5)
  with pytest.raises(ValueError, match="max_consecutive_skips is 3.*5"):
    if how == "update":
      opt.update(jnp.ones(2), state, jnp.ones(2))
    else:
      jmp_lite.update_and_apply(opt, jnp.ones(2), state, jnp.ones(2))


def test_declarations():
  ls = jmp_lite.loss_scaled(optax.adam(1e-3), "f16")
  assert isinstance(contract.contract_of(ls), contract.Guarding)
  assert contract.contract_of(ls).config.skip_with == "auto"
  for wrapper in (jmp_lite.master_weights, jmp_lite.kahan_summation,
                  jmp_lite.stochastic_rounding,
                  lambda t: jmp_lite.state_dtypes(t, "bf16")):
    declared = contract.contract_of(wrapper(ls))
    assert isinstance(declared, contract.Forwarding)
    assert declared.inner is ls
  assert contract.contract_of(
      jmp_lite.master_weights(ls, dtype=jnp.float16)).largest_gradient == 65504
  for undeclared in (optax.adam(1e-3), optax.chain(ls),
                     jmp_lite.accumulate_gradients(ls, every_k=2)):
    assert contract.contract_of(undeclared) is None
  # optax rebuilding the NamedTuple keeps the declaration (it rides on
  # the update function).
  rebuilt = jax.tree.unflatten(*reversed(jax.tree.flatten(
      ls, is_leaf=callable)))
  assert isinstance(contract.contract_of(rebuilt), contract.Guarding)
  with pytest.raises(TypeError, match="Forwarding or Guarding"):
    contract.declare(ls.update, "forwards")


def test_a_declared_user_wrapper_takes_the_single_cond():
  """A user who declares Forwarding gets the decided step, and the result
  still equals the update path."""
  def double(inner):
    def rebind(inner_update):
      def update(g, s, p=None, **extra):
        return inner_update(jax.tree.map(lambda x: 2 * x, g), s, p, **extra)
      return update
    return optax.GradientTransformationExtraArgs(
        inner.init, contract.declare(rebind(inner.update), contract.Forwarding(
            inner, rebind, lambda s: s, largest_gradient=np.inf)))

  opt = double(jmp_lite.loss_scaled(optax.adam(1e-2), "f32"))
  assert jmp_lite.step.formulation(opt)[0] == AUTO_KIND
  want_step, got_step = _by_update(opt), _by_update_and_apply(opt)
  params = _params()
  want = (params, opt.init(params))
  got = jax.tree.map(jnp.copy, want)
  for i in range(4):
    grads = _grads(i)
    if i == 2:
      grads = {**grads, "w": grads["w"].at[0, 0].set(jnp.inf)}
    want = want_step(*want, grads)
    got = got_step(*got, grads)
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=0)
  assert int(jmp_lite.loss_scaled_state(got[1]).total_skips) == 1


def test_the_step_gates_say_whether_a_step_applied():
  """A halted skip_nonfinite skips finite steps: its state says so, and
  FP8's delayed-scaling histories do not advance (they advanced while the
  params were frozen, reading 'gradients were finite')."""
  opt = jmp_lite.skip_nonfinite(optax.sgd(0.1), max_consecutive_skips=1)
  p = jnp.ones(2)
  _, state = opt.update(jnp.array([jnp.nan, 1.0]), opt.init(p), p)
  assert bool(state.halted)
  _, state = opt.update(jnp.ones(2), state, p)   # finite, but halted
  assert bool(state.last_finite) and not bool(state.applied())
  assert not bool(contract.step_applied(state))
  window_end, applied = jmp_lite.fp8.step_outcome(state)
  assert bool(window_end) and not bool(applied)
  recipe = jmp_lite.fp8.DelayedScaling(history=4)
  fp8_state = {"d": recipe.init()}
  observed = jax.tree.map(lambda x: jnp.ones_like(x), fp8_state)
  kept = jmp_lite.fp8.commit(fp8_state, observed, state)
  chex.assert_trees_all_equal(kept["d"].history, fp8_state["d"].history)


def test_step_applied_reads_gates_inside_gates():
  acc = jmp_lite.accumulate_gradients(
      jmp_lite.loss_scaled(optax.sgd(0.1), "f32"), every_k=2)
  p = jnp.ones(2)
  state = acc.init(p)
  _, state = acc.update(jnp.ones(2), state, p)
  assert not bool(contract.step_applied(state))           # mid-window
  _, state = acc.update(jnp.ones(2), state, p)
  assert bool(contract.step_applied(state))               # applied
  _, state = acc.update(jnp.array([1.0, np.nan]), state, p)
  _, state = acc.update(jnp.ones(2), state, p)
  assert not bool(contract.step_applied(state))           # poisoned window
  assert bool(contract.step_applied(optax.adam(1e-3).init(p)))  # no gate
