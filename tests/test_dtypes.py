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


FLOAT8 = [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float8_e4m3fnuz,
          jnp.float8_e5m2fnuz]


@pytest.mark.parametrize("dtype", FLOAT8, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("wide", [jnp.float32, jnp.bfloat16],
                         ids=["f32", "bf16"])
def test_round_to_float8_equals_the_cast_round_trip_and_survives_xla_gpu(
    dtype, wide):
  x = jnp.asarray(_float32_cases()[::7]).astype(wide)
  want = np.asarray(x.astype(dtype).astype(wide), np.float32)
  for fn in (jax.jit(lambda v: round_to(v, dtype)),
             as_xla_gpu_simplifies(lambda v: round_to(v, dtype))):
    got = np.asarray(fn(x), np.float32)
    assert np.asarray(fn(x)).dtype == np.dtype(wide)
    np.testing.assert_array_equal(got, want)   # NaN where both are NaN.


@pytest.mark.parametrize("dtype,bits", [(jnp.bfloat16, 8), (jnp.float16, 11),
                                        (jnp.float32, 24)],
                         ids=["bf16", "f16", "f32"])
def test_round_to_rounds_float64_correctly(dtype, bits):
  """Against frexp arithmetic, not a cast (XLA:CPU's f64 casts and ml_dtypes'
  f64 -> bf16, through float32, can round twice)."""
  rng = np.random.default_rng(1)
  fi = jnp.finfo(dtype)
  v = np.exp2(rng.uniform(np.log2(float(fi.smallest_normal)),
                          np.log2(float(fi.max)) - 1, 20_000))
  v *= rng.choice([-1.0, 1.0], v.size)
  # Exact ties of dtype, and one float64 ulp either side of them.
  m, e = np.frexp(v)
  ties = np.ldexp(np.floor(m * 2**bits) + 0.5, e - bits)
  v = np.concatenate([v, ties, np.nextafter(ties, np.inf),
                      np.nextafter(ties, -np.inf)])
  m, e = np.frexp(v)
  want = np.ldexp(np.round(m * 2**bits), e - bits)   # Half to even.
  with jax.enable_x64(True):
    got = np.asarray(jax.jit(lambda x: round_to(x, dtype))(jnp.asarray(v)))
  assert got.dtype == np.float64
  np.testing.assert_array_equal(got, want)


def test_round_to_takes_array_likes_and_names():
  # A Python float is float32 (x64 off), as it is for the cast pair.
  assert float(round_to(1e-40, "bf16")) == float(
      jnp.float32(1e-40).astype(jnp.bfloat16).astype(jnp.float32)) != 0.0
  np.testing.assert_array_equal(
      round_to(np.asarray([1.0001, np.nan], np.float32), "float16"),
      [1.0, np.nan])


def test_the_xla_gpu_model_deletes_cast_chains_wherever_xla_would():
  """tests/conftest.py's interpreter, on the structures jmp_lite emits."""
  x = jnp.float32(1.0001)
  bf16 = lambda v: v.astype(jnp.bfloat16)
  f32 = lambda v: v.astype(jnp.float32)
  cases = {
      "pair": lambda v: f32(bf16(v)),
      "chain": lambda v: f32(bf16(v).astype(jnp.float16)),
      "narrowed in a jit, widened outside": lambda v: f32(jax.jit(bf16)(v)),
      "cond": lambda v: jax.lax.cond(v > 0, lambda u: f32(bf16(u)),
                                     lambda u: u, v),
      "checkpoint": jax.checkpoint(lambda v: f32(bf16(v))),
  }
  for name, fn in cases.items():
    modelled = float(as_xla_gpu_simplifies(fn)(x))
    assert modelled == float(x), name
    real = float(jax.jit(fn)(x))
    if jax.default_backend() == "gpu":
      assert real == modelled, name   # The model is what XLA:GPU does.
    else:
      assert real == 1.0, name        # XLA:CPU keeps every cast.
  loop = lambda v: jax.lax.scan(lambda c, _: (f32(bf16(c)), None), v,
                                None, length=2)[0]
  with pytest.raises(NotImplementedError, match="does not model scan"):
    as_xla_gpu_simplifies(loop)(x)


def test_round_to_wider_or_same_dtype_returns_x_and_rejects_the_rest():
  x = jnp.ones(3, jnp.bfloat16)
  assert round_to(x, jnp.float32) is x and round_to(x, jnp.bfloat16) is x
  with pytest.raises(ValueError, match="float16 is not narrower than x's"
                     " bfloat16"):
    round_to(x, jnp.float16)
  with pytest.raises(TypeError, match="x must be .* got float8_e4m3fn"):
    round_to(x.astype(jnp.float8_e4m3fn), jnp.float8_e5m2)
  with pytest.raises(TypeError, match="x must be .* got int32"):
    round_to(jnp.ones(3, jnp.int32), jnp.float16)
  with pytest.raises(TypeError, match="dtype must be a floating dtype"):
    round_to(jnp.ones(3), jnp.int8)
  if hasattr(jnp, "float8_e8m0fnu"):   # 2**127 is no float16 value.
    with pytest.raises(ValueError, match="float16 cannot hold every value"
                       " of float8_e8m0fnu"):
      round_to(jnp.ones(3, jnp.float16), jnp.float8_e8m0fnu)


def test_float8_values_decodes_every_bit_pattern():
  for dtype in FLOAT8:
    q = jnp.asarray(np.arange(256, dtype=np.uint8).view(np.dtype(dtype)))
    np.testing.assert_array_equal(jmp_lite.dtypes.float8_values(q),
                                  np.asarray(q).astype(np.float32))
  with pytest.raises(TypeError, match="8-bit float dtype, got bfloat16"):
    jmp_lite.dtypes.float8_values(jnp.ones(2, jnp.bfloat16))
