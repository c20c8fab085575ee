"""Bad input to the public API gets a clear, early TypeError or ValueError.

One sweep over the top level's constructors and functions: wrong types,
NaN/inf/zero/negative values, mismatched trees. None may be accepted
silently, and each error names what was wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite

P = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
SGD = optax.sgd(0.1)
LS = jmp_lite.loss_scaled(SGD, jmp_lite.StaticLossScale(4.0))


def _step(grads: Any, params: Any = P) -> Any:
  return jmp_lite.update_and_apply(LS, grads, LS.init(P), params)


# name -> [(call, exception, what the message must mention)]
BAD: dict[str, list[tuple[Callable[[], Any], type, str]]] = {
    "Policy": [
        (lambda: jmp_lite.Policy(jnp.int32, jnp.float32, jnp.float32),
         TypeError, "param_dtype"),
        (lambda: jmp_lite.Policy(None, jnp.float32, jnp.float32), TypeError,
         "None"),
        (lambda: jmp_lite.Policy(jnp.float32, "bogus", jnp.float32),
         ValueError, "bogus"),
    ],
    "get_policy": [
        (lambda: jmp_lite.get_policy("p=f32,x=bf16"), ValueError, "x"),
        (lambda: jmp_lite.get_policy(3), TypeError, "3"),
        (lambda: jmp_lite.get_policy(","), ValueError, ","),
    ],
    "half_dtype": [(lambda: jmp_lite.half_dtype(3), TypeError, "jax.Device")],
    "StaticLossScale": [
        (lambda: jmp_lite.StaticLossScale(np.nan), ValueError, "nan"),
        (lambda: jmp_lite.StaticLossScale(np.inf), ValueError, "inf"),
        (lambda: jmp_lite.StaticLossScale(0.0), ValueError, "0"),
        (lambda: jmp_lite.StaticLossScale(-2.0), ValueError, "-2"),
        (lambda: jmp_lite.StaticLossScale("2"), TypeError, "2"),
        (lambda: jmp_lite.StaticLossScale(jnp.ones(2)), ValueError,
         "scalar"),
    ],
    "DynamicLossScale": [
        (lambda: jmp_lite.DynamicLossScale(np.nan), ValueError, "nan"),
        (lambda: jmp_lite.DynamicLossScale(-1.0), ValueError, "-1"),
        (lambda: jmp_lite.DynamicLossScale(8.0, period=0), ValueError,
         "period"),
        (lambda: jmp_lite.DynamicLossScale(8.0, period=2.5), TypeError,
         "period"),
        (lambda: jmp_lite.DynamicLossScale(8.0, factor=1.0), ValueError,
         "factor"),
        (lambda: jmp_lite.DynamicLossScale(8.0, hysteresis=0), ValueError,
         "hysteresis"),
        (lambda: jmp_lite.DynamicLossScale(8.0, min_loss_scale=16.0),
         ValueError, "min_loss_scale"),
        (lambda: jmp_lite.DynamicLossScale(8.0, hysteresis_reset="x"),
         ValueError, "hysteresis_reset"),
    ],
    "LossScale.scale": [
        (lambda: jmp_lite.StaticLossScale(2.0).scale({"a": "x"}), TypeError,
         "str"),
        (lambda: jmp_lite.NoOpLossScale().scale(["x"]), TypeError, "str"),
        (lambda: jmp_lite.StaticLossScale(2.0).unscale({"a": object()}),
         TypeError, "object"),
    ],
    "LossScale.adjust": [
        (lambda: jmp_lite.DynamicLossScale(8.0).adjust(1.0), TypeError,
         "bool"),
        (lambda: jmp_lite.DynamicLossScale(8.0).adjust(jnp.ones(2, bool)),
         ValueError, "scalar"),
    ],
    "all_finite": [
        (lambda: jmp_lite.all_finite({"a": "x"}), TypeError, "str"),
        (lambda: jmp_lite.all_finite({"a": object()}), TypeError, "object"),
    ],
    "select_tree": [
        (lambda: jmp_lite.select_tree(jnp.array(True), {"a": 1.0},
                                      {"b": 1.0}), ValueError, "structure"),
    ],
    "loss_scaled": [
        (lambda: jmp_lite.loss_scaled("adam", "f16"), TypeError, "adam"),
        (lambda: jmp_lite.loss_scaled(SGD, 2.0), TypeError, "2.0"),
        (lambda: jmp_lite.loss_scaled(SGD, "dynamic"), ValueError,
         "DynamicLossScale"),
        (lambda: jmp_lite.loss_scaled(SGD, "f16", axis_name=5), TypeError,
         "axis_name"),
        (lambda: jmp_lite.loss_scaled(SGD, "f16", skip_with="if"),
         ValueError, "skip_with"),
        (lambda: jmp_lite.loss_scaled(SGD, "f16", track_nonfinite="yes"),
         TypeError, "track_nonfinite"),
    ],
    "skip_nonfinite": [
        (lambda: jmp_lite.skip_nonfinite(SGD, max_consecutive_skips=0),
         ValueError, "max_consecutive_skips"),
        (lambda: jmp_lite.skip_nonfinite(SGD, max_consecutive_skips=-3),
         ValueError, "max_consecutive_skips"),
        (lambda: jmp_lite.skip_nonfinite(None), TypeError, "None"),
    ],
    "master_weights": [
        (lambda: jmp_lite.master_weights(SGD, dtype=jnp.int32), TypeError,
         "dtype"),
        (lambda: jmp_lite.master_weights(3), TypeError, "3"),
    ],
    "accumulate_gradients": [
        (lambda: jmp_lite.accumulate_gradients(SGD, every_k=0), ValueError,
         "every_k"),
        (lambda: jmp_lite.accumulate_gradients(SGD, every_k=2.0), TypeError,
         "every_k"),
    ],
    "kahan_summation": [(lambda: jmp_lite.kahan_summation(SGD.update),
                         TypeError, "kahan_summation")],
    "stochastic_rounding": [
        (lambda: jmp_lite.stochastic_rounding(SGD, seed=-1), ValueError,
         "seed"),
        (lambda: jmp_lite.stochastic_rounding(SGD, seed=1.5), TypeError,
         "seed"),
    ],
    "state_dtypes": [
        (lambda: jmp_lite.state_dtypes(SGD, "int8"), (TypeError, ValueError),
         "int8"),
    ],
    "update_and_apply": [
        (lambda: jmp_lite.update_and_apply("sgd", P, LS.init(P), P),
         TypeError, "sgd"),
        (lambda: jmp_lite.update_and_apply(LS, P, LS.init(P), None),
         ValueError, "params"),
        (lambda: jmp_lite.update_and_apply(LS, P, SGD.init(P), P),
         TypeError, "loss_scaled"),
        # Mismatched trees: gradients of another model.
        (lambda: _step({"w": jnp.ones((2, 3))}), ValueError, "structure"),
        (lambda: _step({"w": jnp.ones((3, 2)), "b": jnp.ones(3)}),
         ValueError, "shape"),
    ],
    "scaled_value_and_grad": [
        (lambda: jmp_lite.scaled_value_and_grad("f", jmp_lite.NoOpLossScale()),
         TypeError, "callable"),
        (lambda: jmp_lite.scaled_value_and_grad(jnp.sum, 1024.0), TypeError,
         "StaticLossScale"),
        (lambda: jmp_lite.scaled_value_and_grad(jnp.sum, SGD.init(P)),
         ValueError, "loss_scaled"),
    ],
    "current_loss_scale": [
        (lambda: jmp_lite.current_loss_scale(SGD.init(P)), ValueError,
         "loss_scaled"),
    ],
    "default_loss_scale": [
        (lambda: jmp_lite.default_loss_scale(3), TypeError, "3"),
    ],
    "autocast": [
        (lambda: jmp_lite.autocast(3, jnp.bfloat16), TypeError, "callable"),
        (lambda: jmp_lite.autocast(jnp.sin, jnp.int8), (TypeError,
                                                        ValueError), "int8"),
    ],
    "cast_by_path": [
        (lambda: jmp_lite.cast_by_path(P, "f32", [("w", "bogus")]),
         ValueError, "bogus"),
        (lambda: jmp_lite.cast_by_path(P, [("w", "bf16")]), TypeError,
         "policy"),
    ],
    "check_hardware": [
        (lambda: jmp_lite.check_hardware("int4"), ValueError, "int4"),
    ],
    # The core's second sweep: each was accepted silently, or failed with
    # JAX's or Python's own words.
    "Policy.float0": [
        (lambda: jmp_lite.Policy(jnp.float32, jax.dtypes.float0,
                                 jnp.float32), TypeError, "float0")],
    "DynamicLossScale.float32": [
        (lambda: jmp_lite.DynamicLossScale(8.0, factor=1.00000001),
         ValueError, "1.0 in float32"),
        (lambda: jmp_lite.DynamicLossScale(8.0, max_loss_scale=3e38),
         ValueError, "max_loss_scale")],
    "all_finite.object": [
        (lambda: jmp_lite.all_finite(np.array([np.nan], object)), TypeError,
         "dtype object")],
    "select_tree.object": [
        (lambda: jmp_lite.select_tree(True, np.array([1.0], object),
                                      np.array([2.0], object)), TypeError,
         "dtype object")],
    "cast_to_half.object": [
        (lambda: jmp_lite.cast_to_half({"w": np.array([1.0], object)}),
         TypeError, "object array")],
    "update_and_apply.dtypes": [
        (lambda: _step({"w": 0.5, "b": jnp.ones(3)}), ValueError,
         "shape ()"),
        (lambda: _step({"w": jnp.ones((2, 3), jnp.int32), "b": jnp.ones(3)}),
         TypeError, "int32"),
        (lambda: _step({"w": jnp.ones((2, 3), jnp.complex64),
                        "b": jnp.ones(3)}), TypeError, "complex64")],
    "step.apply_updates": [
        (lambda: jmp_lite.step.apply_updates(P, {"w": jnp.ones(3),
                                                 "b": jnp.ones(3)}),
         ValueError, "(2, 3)"),
        (lambda: jmp_lite.step.apply_updates(P, "u"), ValueError,
         "updates' tree structure differs")],
    "scaled_value_and_grad.argnums": [
        (lambda: jmp_lite.scaled_value_and_grad(
            lambda w: w.sum(), jmp_lite.NoOpLossScale(), argnums="0"),
         TypeError, "argnums")],
    "nonfinite_paths.counts": [
        (lambda: jmp_lite.nonfinite_paths("x"), TypeError, "'x'")],
    "raise_if_halted": [
        (lambda: jmp_lite.raise_if_halted(LS.init(P)), ValueError,
         "no skip_nonfinite"),
        (lambda: jmp_lite.raise_if_halted(None), ValueError, "NoneType")],
    "transforms.GuardConfig": [
        (lambda: jmp_lite.transforms.GuardConfig(check_updates="no"),
         TypeError, "check_updates"),
        (lambda: jmp_lite.transforms.GuardConfig(skip_with="x"), ValueError,
         "'x'"),
        (lambda: jmp_lite.transforms.GuardConfig(axis_name=3), TypeError,
         "axis_name")],
    "distributed.init_sharded": [
        (lambda: jmp_lite.distributed.init_sharded(SGD, {"w": "x"}),
         TypeError, "str leaf at ['w']"),
        (lambda: jmp_lite.distributed.state_shardings(SGD, "x"), TypeError,
         "the root")],
    "loss_scaled.state_config": [
        (lambda: jmp_lite.loss_scaled(SGD, jmp_lite.StaticLossScale(8.0)
                                      ).update(P, LS.init(P), P),
         ValueError, "another configuration"),
        (lambda: jmp_lite.loss_scaled(
            SGD, jmp_lite.StaticLossScale(4.0), track_nonfinite=True
        ).update(P, LS.init(P), P), ValueError, "track_nonfinite")],
}


@pytest.mark.parametrize("case", [
    (name, i) for name, calls in BAD.items() for i in range(len(calls))],
    ids=lambda c: f"{c[0]}-{c[1]}")
def test_bad_input_is_a_clear_error(case):
  name, i = case
  call, exc, needle = BAD[name][i]
  with pytest.raises(exc) as info:
    jax.block_until_ready(call())
  assert needle.lower() in str(info.value).lower(), str(info.value)


def test_the_sweep_covers_the_top_level():
  """Every top-level function and class is swept (or named here with the
  reason it takes no bad input worth sweeping)."""
  no_arguments_to_get_wrong = {
      "LossScale", "NoOpLossScale", "LossScaledState", "NonFiniteHaltError",
      "PrecisionWarning"}
  swept_elsewhere = {
      # Covered by their own modules' tests of bad input.
      "apply_gradients": "tests/test_step.py",
      "autocast_audit": "tests/test_autocast.py",
      "autocast_fp8_state": "tests/test_fp8_autocast.py",
      "float32_region": "tests/test_autocast.py",
      "half_region": "tests/test_autocast.py",
      "cast_to_full": "tests/test_policy.py",
      "cast_to_half": "tests/test_policy.py",
      "check_alignment": "tests/test_diagnostics.py",
      "find_nonfinite": "tests/test_diagnostics.py",
      "gradient_health": "tests/test_diagnostics.py",
      "nonfinite_counts": "tests/test_diagnostics.py",
      "nonfinite_paths": "tests/test_diagnostics.py",
      "loss_scaled_state": "current_loss_scale (same lookup)",
      "master_params": "tests/test_master.py",
      "raise_if_halted": "tests/test_transforms.py",
      "quantized_states": "tests/test_quantized_states.py",
  }
  swept = {name.split(".")[0] for name in BAD}
  missing = (set(jmp_lite.__all__) - swept - no_arguments_to_get_wrong
             - set(swept_elsewhere))
  assert not missing, sorted(missing)


def test_python_float_in_a_policy_is_jax_default_float():
  """Policy(float, ...) became float64 without x64, a dtype JAX then runs
  as float32: the policy said one thing and the computation did another.
  Python's float now means JAX's default float, as in jnp.zeros(3, float)."""
  policy = jmp_lite.Policy(float, float, float)
  assert policy.compute_dtype == jnp.zeros(3, float).dtype == np.float32
  assert str(policy) == "p=f32,c=f32,o=f32"
  with jax.enable_x64(True):
    assert jmp_lite.Policy(float, float, float).param_dtype == np.float64
  # Asked for by name, float64 stays float64 (numpy leaves keep it).
  assert jmp_lite.get_policy("f64").compute_dtype == np.float64


@pytest.mark.parametrize("wrapper", [
    "master_weights", "accumulate_gradients", "stochastic_rounding",
    "state_dtypes", "loss_scaled", "skip_nonfinite"])
def test_a_state_another_optimizer_made_names_the_fix(wrapper):
  """'LossScaledState' object has no attribute 'master' / 'poisoned': a
  wrapper handed another optimizer's state (a script that added the wrapper
  and kept its opt_state) says what it got and what to do."""
  opt = {
      "master_weights": lambda: jmp_lite.master_weights(SGD),
      "accumulate_gradients": lambda: jmp_lite.accumulate_gradients(SGD, 2),
      "stochastic_rounding": lambda: jmp_lite.stochastic_rounding(SGD),
      "state_dtypes": lambda: jmp_lite.state_dtypes(SGD, "bf16"),
      "loss_scaled": lambda: LS,
      "skip_nonfinite": lambda: jmp_lite.skip_nonfinite(SGD),
  }[wrapper]()
  other = (jmp_lite.skip_nonfinite(SGD) if wrapper != "skip_nonfinite"
           else LS).init(P)
  with pytest.raises(TypeError, match=rf"{wrapper}\(\.\.\.\)\.update got a"
                     r" \w+ as its state.*init\(params\)"):
    opt.update(P, other, P)


def test_integer_leaves_are_neither_scaled_nor_unscaled():
  """A documented decision: integer, bool and float0 leaves are no
  gradients of the scaled loss; they pass both ways unchanged."""
  scale = jmp_lite.StaticLossScale(8.0)
  tree = {"i": jnp.arange(3), "b": jnp.array([True]), "f": jnp.ones(2),
          "z": np.zeros((2,), jax.dtypes.float0)}
  scaled = scale.scale(tree)
  assert scaled["i"] is tree["i"] and scaled["b"] is tree["b"]
  assert scaled["z"] is tree["z"]
  np.testing.assert_array_equal(scaled["f"], 8.0)
  back = scale.unscale(scaled)
  assert back["i"] is tree["i"]
  np.testing.assert_array_equal(back["f"], 1.0)
