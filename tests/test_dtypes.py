"""Tests for jmp_lite.dtypes: half_dtype per backend, parsing."""

from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite


def _device(platform, capability=None):
  dev = types.SimpleNamespace(platform=platform)
  if capability is not None:
    dev.compute_capability = capability
  return dev


@pytest.mark.parametrize("device,expected", [
    (_device("tpu"), jnp.bfloat16),
    (_device("gpu", "9.0"), jnp.bfloat16),   # H100
    (_device("gpu", "8.0"), jnp.bfloat16),   # A100
    (_device("cuda", "8.6"), jnp.bfloat16),  # RTX 30xx
    (_device("gpu", "7.5"), jnp.float16),    # T4
    (_device("gpu", "7.0"), jnp.float16),    # V100
    (_device("gpu"), jnp.bfloat16),          # ROCm reports no capability
    (_device("rocm"), jnp.bfloat16),
    (_device("cpu"), jnp.float16),
])
def test_half_dtype_per_backend(device, expected):
  assert jmp_lite.half_dtype(device) == np.dtype(expected)


def test_half_dtype_default_device_is_cpu_here():
  assert jmp_lite.half_dtype() == np.dtype(jnp.float16)


@pytest.mark.parametrize("bad", [1, None, jnp.float32])
def test_parse_dtype_rejects_non_strings(bad):
  with pytest.raises(TypeError, match="Expected a dtype name"):
    jmp_lite.dtypes.parse_dtype(bad)


def test_to_floating_dtype_names_the_argument():
  with pytest.raises(TypeError, match="compute_dtype must be a floating dtype"):
    jmp_lite.dtypes.to_floating_dtype(jnp.int8, "compute_dtype")
  with pytest.raises(TypeError, match="param_dtype must be a floating dtype"):
    jmp_lite.dtypes.to_floating_dtype(object(), "param_dtype")
