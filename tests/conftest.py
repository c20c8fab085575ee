"""Shared fixtures: eager vs jit variants and dtype parameter lists."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Half of the suite's time is XLA:CPU compiling small programs once each. The
# expensive LLVM passes (vectorisation, unrolling) make that compile ~20%
# slower and buy nothing for programs that run a few steps; HLO passes, and so
# every dtype, fusion and buffer-assignment fact the tests check, are
# unaffected. XLA reads the flags when the first backend starts (after these
# imports, before any test); subprocesses (notebooks, demos,
# benchmarks) inherit it. Benchmarks run outside pytest and keep full codegen.
_FAST_COMPILE = "--xla_llvm_disable_expensive_passes=true"
if _FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = " ".join(
      filter(None, [os.environ.get("XLA_FLAGS", ""), _FAST_COMPILE]))

FLOAT_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
FLOAT_DTYPE_IDS = ["f32", "bf16", "f16"]


@pytest.fixture(params=["eager", "jit"])
def variant(request):
  """Runs a test once eagerly and once under ``jax.jit``."""
  if request.param == "eager":
    return lambda f, **kw: f
  return lambda f, **kw: jax.jit(f, **kw)


def assert_dtype(x, dtype) -> None:
  """Asserts an array's dtype exactly (``==`` on 0-d arrays ignores it)."""
  assert np.dtype(x.dtype) == np.dtype(dtype), (x.dtype, dtype)
