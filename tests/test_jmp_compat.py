"""``import jmp_lite as jmp`` runs code written for DeepMind's jmp 0.0.4."""

from __future__ import annotations

import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite

jmp = pytest.importorskip("jmp")


def test_every_public_jmp_name_exists():
  missing = [n for n in jmp.__all__ if not hasattr(jmp_lite, n)]
  assert not missing


def _positional(fn):
  return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()
          if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


@pytest.mark.parametrize("name", [
    "Policy", "StaticLossScale", "get_policy", "cast_to_full", "cast_to_half",
    "half_dtype", "all_finite", "select_tree",
])
def test_positional_parameters_match(name):
  ours, theirs = _positional(getattr(jmp_lite, name)), _positional(
      getattr(jmp, name))
  assert [n for n, _ in ours[:len(theirs)]] == [n for n, _ in theirs]


def test_dynamic_loss_scale_positional_order_and_defaults():
  ours = _positional(jmp_lite.DynamicLossScale)
  theirs = _positional(jmp.DynamicLossScale)
  assert [n for n, _ in ours] == [n for n, _ in theirs]
  s = jmp_lite.DynamicLossScale(jnp.float32(2**15))
  t = jmp.DynamicLossScale(jnp.float32(2**15))
  assert s.period == t.period == 2000 and s.factor == t.factor == 2
  assert float(s.min_loss_scale) == float(t.min_loss_scale) == 1.0
  assert int(s.counter) == int(t.counter) == 0


@pytest.mark.parametrize("method", ["scale", "unscale", "adjust"])
@pytest.mark.parametrize("cls", ["NoOpLossScale", "StaticLossScale",
                                 "DynamicLossScale"])
def test_method_parameters_match(cls, method):
  ours = inspect.signature(getattr(getattr(jmp_lite, cls), method))
  theirs = inspect.signature(getattr(getattr(jmp, cls), method))
  assert list(ours.parameters) == list(theirs.parameters)


@pytest.mark.parametrize("name", ["f32", "bf16", "f16", "full", "float32",
                                  "c=bf16", "p=f16,c=bf16", "p=f32,c=f16,o=f32",
                                  "params=float32,compute=bfloat16,output=float32"])
def test_get_policy_agrees_with_jmp(name):
  ours, theirs = jmp_lite.get_policy(name), jmp.get_policy(name)
  for f in ("param_dtype", "compute_dtype", "output_dtype"):
    assert np.dtype(getattr(ours, f)) == np.dtype(getattr(theirs, f))
  assert str(ours) == str(theirs).replace("full", "f32")


def test_errors_users_match_on_are_value_errors():
  for bad in ("x=f32", "p=f17"):
    with pytest.raises(ValueError):
      jmp.get_policy(bad)
    with pytest.raises(ValueError):
      jmp_lite.get_policy(bad)


def test_jmp_docstring_loop_gives_the_same_trajectory():
  """The loop from jmp's DynamicLossScale docstring, run on both."""
  rng = np.random.default_rng(1)
  finite_seq = rng.random(300) < 0.9
  trajectories = []
  for lib in (jmp, jmp_lite):
    # jmp has no upper bound; jmp_lite caps at 2**24 unless told otherwise
    # (at most 2**126, whose reciprocal is still a normal float32).
    extra = {} if lib is jmp else {"max_loss_scale": 2.0 ** 126}
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      loss_scale = lib.DynamicLossScale(jnp.asarray(2.0**15), period=5,
                                        **extra)
    scales = []
    adjust = jax.jit(lambda s, f: s.adjust(f))
    for finite in finite_seq:
      loss = loss_scale.scale(jnp.float32(0.5))
      grads = loss_scale.unscale({"w": jnp.full((3,), loss)})
      grads_finite = lib.all_finite(grads) & jnp.asarray(finite)
      loss_scale = adjust(loss_scale, grads_finite)
      scales.append(float(loss_scale.loss_scale))
    trajectories.append(scales)
  assert trajectories[0] == trajectories[1]
  assert max(trajectories[0]) > 2.0**24  # The run did reach the default cap.


def test_default_cap_is_the_one_difference_from_jmp():
  state = jmp_lite.DynamicLossScale(jnp.asarray(2.0**24), period=1)
  assert float(state.adjust(jnp.array(True)).loss_scale) == 2.0**24


def test_select_tree_and_policy_casts_agree():
  a, b = {"w": jnp.ones(3)}, {"w": jnp.zeros(3)}
  for pred in (jnp.array(True), jnp.array(False)):
    np.testing.assert_array_equal(jmp.select_tree(pred, a, b)["w"],
                                  jmp_lite.select_tree(pred, a, b)["w"])
  tree = {"w": jnp.ones(2), "i": jnp.arange(2), "n": np.ones(2)}
  for name in ("bf16", "f16"):
    ours = jmp_lite.get_policy(name).cast_to_compute(tree)
    theirs = jmp.get_policy(name).cast_to_compute(tree)
    for k in tree:
      assert ours[k].dtype == theirs[k].dtype
      assert type(ours[k]) is type(theirs[k])
