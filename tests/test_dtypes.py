"""Tests for jmp_lite.dtypes: half_dtype per backend, parsing, round_to."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite
from jmp_lite.dtypes import round_to
from tests.conftest import as_xla_gpu_simplifies


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


def test_half_dtype_default_device_is_the_first_local_device():
  expected = jmp_lite.half_dtype(jax.local_devices()[0])
  assert jmp_lite.half_dtype() == expected
  if jax.default_backend() == "cpu":
    assert expected == np.dtype(jnp.float16)


@pytest.mark.parametrize("bad", [1, None, jnp.float32])
def test_parse_dtype_rejects_non_strings(bad):
  with pytest.raises(TypeError, match="Expected a dtype name"):
    jmp_lite.dtypes.parse_dtype(bad)


def test_to_floating_dtype_names_the_argument():
  with pytest.raises(TypeError, match="compute_dtype must be a floating dtype"):
    jmp_lite.dtypes.to_floating_dtype(jnp.int8, "compute_dtype")
  with pytest.raises(TypeError, match="param_dtype must be a floating dtype"):
    jmp_lite.dtypes.to_floating_dtype(object(), "param_dtype")


def _float32_cases() -> np.ndarray:
  """Random float32 bit patterns, half subnormals, ties and edges."""
  rng = np.random.default_rng(0)
  return np.concatenate([
      rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(
          np.uint32).view(np.float32),
      rng.uniform(-7e-5, 7e-5, 50_000).astype(np.float32),   # f16 subnormal
      rng.uniform(-1e-7, 1e-7, 10_000).astype(np.float32),   # below them
      # bfloat16 ties (the dropped half exactly 0x8000) and float16 ones.
      (np.arange(1, 1 << 12, dtype=np.uint32) << 16 | 0x8000).view(
          np.float32),
      np.float32(1 + 2.0**-11) * 2.0 ** np.arange(-24, 16, dtype=np.float32),
      np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519.99, 65520,
                2**-24, 2**-25, 3 * 2**-25, 2**-14, 2**-14 - 2**-25, 1e-45,
                3.4028235e38], np.float32)])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16],
                         ids=["bf16", "f16"])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_round_to_equals_the_cast_round_trip_bit_for_bit(dtype, mode):
  x = jnp.asarray(_float32_cases())
  fn = (lambda v: round_to(v, dtype))
  got = np.asarray(jax.jit(fn)(x) if mode == "jit" else fn(x))
  want = np.asarray(x.astype(dtype).astype(jnp.float32))
  assert got.dtype == np.float32
  same = (got.view(np.uint32) == want.view(np.uint32)) | (
      np.isnan(got) & np.isnan(want))
  assert same.all(), x[~same][:5]


def test_round_to_survives_deleting_cast_round_trips():
  """What XLA:GPU does to x.astype(bf16).astype(f32): returns x."""
  x = jnp.float32(1.0001)
  cast_pair = as_xla_gpu_simplifies(
      lambda v: v.astype(jnp.bfloat16).astype(jnp.float32))
  assert float(cast_pair(x)) == float(x)   # The rounding is gone.
  for dtype in (jnp.bfloat16, jnp.float16):
    assert float(as_xla_gpu_simplifies(
        lambda v, d=dtype: round_to(v, d))(x)) == float(round_to(x, dtype))
  assert float(round_to(x, jnp.bfloat16)) == 1.0


def test_round_to_wider_or_same_dtype_returns_x_and_rejects_the_rest():
  x = jnp.ones(3, jnp.bfloat16)
  assert round_to(x, jnp.float32) is x and round_to(x, jnp.bfloat16) is x
  with pytest.raises(ValueError, match="float16 is not narrower than x's"
                     " bfloat16"):
    round_to(x, jnp.float16)
  with pytest.raises(TypeError, match="dtype must be float16, bfloat16,"
                     " float32 or float64, got float8_e4m3fn"):
    round_to(jnp.ones(3), jnp.float8_e4m3fn)
  with pytest.raises(TypeError, match="x must be .* got int32"):
    round_to(jnp.ones(3, jnp.int32), jnp.float16)
