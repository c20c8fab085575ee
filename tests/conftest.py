"""Shared fixtures: eager vs jit variants and dtype parameter lists."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
