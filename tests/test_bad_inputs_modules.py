"""Bad input to the public submodules' constructors and functions.

The companion of ``tests/test_bad_inputs.py`` (the top level): every public
function and class of a public submodule is swept here, or named in
``ELSEWHERE`` with the test file that checks its bad input, or in
``NO_INPUT`` with why there is nothing to get wrong.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jmp_lite
import jmp_lite.equinox
import jmp_lite.linen
import jmp_lite.nnx
import jmp_lite.presets
from jmp_lite import contract, distributed, dtypes, fp8, rules, step, struct

SGD = optax.sgd(0.1)
DENSE = nn.Dense(2)
LINEAR = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

BAD: dict[str, list[tuple[Callable[[], Any], type | tuple[type, ...], str]]] = {
    "jmp_lite.linen.mixed_precision": [
        (lambda: jmp_lite.linen.mixed_precision(DENSE, "bogus"), ValueError,
         "bogus"),
        (lambda: jmp_lite.linen.mixed_precision(DENSE, 3), TypeError, "3"),
        (lambda: jmp_lite.linen.mixed_precision("Dense", "bf16"), TypeError,
         "Dense"),
        (lambda: jmp_lite.linen.mixed_precision(DENSE, "bf16",
                                                strict="yes"), TypeError,
         "strict"),
    ],
    "jmp_lite.nnx.mixed_precision": [
        (lambda: jmp_lite.nnx.mixed_precision(LINEAR, "bogus"), ValueError,
         "bogus"),
        (lambda: jmp_lite.nnx.mixed_precision(DENSE, "bf16"), TypeError,
         "nnx"),
        (lambda: jmp_lite.nnx.mixed_precision(LINEAR, "bf16",
                                              state_methods="init_cache"),
         TypeError, "state_methods"),
    ],
    "jmp_lite.equinox.mixed_precision": [
        (lambda: jmp_lite.equinox.mixed_precision(LINEAR, "bf16"), TypeError,
         "Module"),
        (lambda: jmp_lite.equinox.mixed_precision(
            jmp_lite.equinox.eqx.nn.Identity(), "bogus"), ValueError,
         "bogus"),
    ],
    "jmp_lite.presets.preset": [
        (lambda: jmp_lite.presets.preset("O4"), ValueError, "O4"),
        (lambda: jmp_lite.presets.preset("O3", half="int8"),
         (TypeError, ValueError), "int8"),
        (lambda: jmp_lite.presets.preset("O3", compensation="magic"),
         ValueError, "magic"),
    ],
    "jmp_lite.rules.Rule": [
        (lambda: rules.Rule(3, "bf16"), TypeError, "3"),
        (lambda: rules.Rule("(", "bf16"), ValueError, "("),
    ],
    "jmp_lite.fp8.CurrentScaling": [
        (lambda: fp8.CurrentScaling(fwd_dtype=jnp.bfloat16), (TypeError,
                                                             ValueError),
         "fwd_dtype"),
        (lambda: fp8.CurrentScaling(margin=-1), ValueError, "margin"),
    ],
    "jmp_lite.fp8.DelayedScaling": [
        (lambda: fp8.DelayedScaling(history=0), ValueError,
         "history must be >= 1, got 0"),
        (lambda: fp8.DelayedScaling(history=-3), ValueError,
         "history must be >= 1, got -3"),
        (lambda: fp8.DelayedScaling(amax_compute="mean"), ValueError,
         "amax_compute"),
    ],
    "jmp_lite.fp8.dot_general": [
        (lambda: fp8.dot_general("fp8"), TypeError, "fp8"),
    ],
    "jmp_lite.fp8.quantize": [
        (lambda: fp8.quantize(jnp.ones(2), jnp.int8), (TypeError,
                                                      ValueError), "int8"),
    ],
    "jmp_lite.step.formulation": [
        (lambda: step.formulation(SGD.init(jnp.ones(2))), TypeError,
         "optimizer"),
    ],
    "jmp_lite.step.apply_updates": [
        (lambda: step.apply_updates({"a": jnp.ones(2)}, {"b": jnp.ones(2)}),
         ValueError, ""),
    ],
    "jmp_lite.contract.declare": [
        (lambda: contract.declare(SGD.update, "forwarding"), TypeError,
         "Forwarding"),
    ],
    "jmp_lite.distributed.init_sharded": [
        (lambda: distributed.init_sharded("adam", jnp.ones(2)), TypeError,
         "adam"),
    ],
    "jmp_lite.distributed.state_shardings": [
        (lambda: distributed.state_shardings(None, jnp.ones(2)), TypeError,
         "None"),
    ],
    "jmp_lite.dtypes.parse_dtype": [
        (lambda: dtypes.parse_dtype("f13"), ValueError, "f13"),
    ],
    "jmp_lite.dtypes.to_floating_dtype": [
        (lambda: dtypes.to_floating_dtype(jnp.int32, "dtype"), TypeError,
         "int32"),
        (lambda: dtypes.to_floating_dtype(None, "dtype"), TypeError, "None"),
    ],
    "jmp_lite.struct.find_nodes": [
        (lambda: struct.find_nodes({}, "LossScaledState"), TypeError, ""),
    ],
}

# Checked for bad input in the test file named (or wherever noted).
ELSEWHERE = {
    "jmp_lite.linen.dtype_report": "tests/test_linen.py",
    "jmp_lite.nnx.dtype_report": "tests/test_nnx.py",
    "jmp_lite.equinox.dtype_report": "tests/test_equinox.py",
    "jmp_lite.linen.dot_product_attention_fp32": "tests/test_linen.py",
    "jmp_lite.fp8.MXFP8": "tests/test_fp8_granularity.py",
    "jmp_lite.fp8.all_gather": "tests/test_fp8_gather.py",
    "jmp_lite.fp8.commit": "tests/test_fp8_state.py",
    "jmp_lite.fp8.nnx.commit": "tests/test_fp8_state.py",
    "jmp_lite.fp8.quantization_health": "tests/test_fp8.py",
    "jmp_lite.fp8.step_outcome": "tests/test_fp8_state.py",
    "jmp_lite.low_precision.quantized_states": "tests/test_quantized_states.py",
    "jmp_lite.low_precision.quantized_adam": "tests/test_fused_quantized.py",
    "jmp_lite.fp4.NVFP4": "tests/test_fp4.py",
    "jmp_lite.fp4.MXFP4": "tests/test_fp4.py",
    "jmp_lite.fp4.PerDirection": "tests/test_fp4.py",
    "jmp_lite.fp4.dot_general": "tests/test_fp4.py",
    "jmp_lite.fp4.quantize_dequantize": "tests/test_fp4.py",
    "jmp_lite.fp4.all_gather": "tests/test_fp4_gather.py",
    "jmp_lite.fp4.quantization_health": "tests/test_fp4_health.py",
    "jmp_lite.fp4.linen.Fp4DotGeneral": "tests/test_fp4_flax.py",
    "jmp_lite.fp4.nnx.Fp4DotGeneral": "tests/test_fp4_flax.py",
    "jmp_lite.dtypes.round_to": "tests/test_dtypes.py",
    "jmp_lite.transforms.GuardConfig": "tests/test_transforms.py",
    "jmp_lite.contract.Forwarding": "tests/test_contract.py",
    "jmp_lite.contract.Guarding": "tests/test_contract.py",
    # The same object as jmp_lite.rules.Rule, swept above.
    "jmp_lite.linen.Rule": "jmp_lite.rules.Rule",
    "jmp_lite.nnx.Rule": "jmp_lite.rules.Rule",
    "jmp_lite.equinox.Rule": "jmp_lite.rules.Rule",
}


def _public() -> list[str]:
  names = []
  for info in pkgutil.walk_packages(jmp_lite.__path__, "jmp_lite."):
    parts = info.name.split(".")[1:]
    if any(p.startswith("_") for p in parts) or info.name in (
        "jmp_lite.demo", "jmp_lite.examples", "jmp_lite.__main__"):
      continue
    module = importlib.import_module(info.name)
    for name in getattr(module, "__all__", ()):
      obj = getattr(module, name)
      if (inspect.isfunction(obj) or inspect.isclass(obj)) and (
          name not in jmp_lite.__all__):
        names.append(f"{info.name}.{name}")
  return names


@pytest.mark.parametrize("case", [
    (name, i) for name, calls in BAD.items() for i in range(len(calls))],
    ids=lambda c: f"{c[0].removeprefix('jmp_lite.')}-{c[1]}")
def test_bad_input_is_a_clear_error(case):
  name, i = case
  call, exc, needle = BAD[name][i]
  with pytest.raises(exc) as info:
    jax.block_until_ready(call())
  assert needle.lower() in str(info.value).lower(), str(info.value)


def test_the_sweep_covers_the_public_submodules():
  """A new public function or class is swept, or named with where its bad
  input is checked, or with why it takes none worth sweeping: state classes
  (made by their transformation's init), reports and records (made by the
  library), helpers whose every input is valid."""
  swept = set(BAD) | set(ELSEWHERE)
  assert jmp_lite.linen.Rule is jmp_lite.nnx.Rule is rules.Rule
  unlisted = []
  for name in _public():
    obj_name = name.rsplit(".", 1)[1]
    made_by_library = obj_name.endswith(("State", "Record", "Report", "Row",
                                         "Health", "Origin", "Misaligned",
                                         "Array", "Stat", "Audit",
                                         "Resolved", "RuleSet",
                                         "DeclaredUpdate", "Gate",
                                         "MixedPrecision", "Preset",
                                         "Fp8DotGeneral", "Config"))
    if name not in swept and not made_by_library:
      unlisted.append(name)
  # Helpers that accept any value of their annotated type.
  any_input = {
      "jmp_lite.contract.contract_of", "jmp_lite.contract.step_applied",
      "jmp_lite.contract.without_half_by_design",
      # Marker classes a state subclasses: nothing to pass them.
      "jmp_lite.contract.Accumulates", "jmp_lite.contract.HoldsMasterCopy",
      "jmp_lite.contract.RoundsHalfParams",
      "jmp_lite.diagnostics.tree_bytes", "jmp_lite.distributed.device_bytes",
      "jmp_lite.dtypes.at_least_float32", "jmp_lite.dtypes.canonical_name",
      "jmp_lite.dtypes.cast_floating", "jmp_lite.dtypes.float8_values",
      "jmp_lite.dtypes.is_floating_array", "jmp_lite.dtypes.is_inexact_array",
      "jmp_lite.dtypes.is_live_state", "jmp_lite.dtypes.is_opaque",
      "jmp_lite.dtypes.update_between", "jmp_lite.fp8.history_amax",
      "jmp_lite.fp8.linen.dot_general_cls", "jmp_lite.fp8.linen.layer_fields",
      "jmp_lite.fp8.nnx.dot_general_for", "jmp_lite.path_rules.path_string",
      "jmp_lite.fp4.linen.dot_general_cls", "jmp_lite.fp4.linen.layer_fields",
      "jmp_lite.fp4.nnx.dot_general_for",
      "jmp_lite.struct.dataclass", "jmp_lite.struct.field",
      # Takes no arguments.
      "jmp_lite.struct.register_flax_serialization",
      "jmp_lite.struct.replace",
  }
  missing = sorted(set(unlisted) - any_input)
  assert not missing, missing
