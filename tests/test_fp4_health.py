"""fp4.quantization_health: per-leaf FP4 error, to pick the layers kept high."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmp_lite import fp4

NV, MX = fp4.NVFP4(), fp4.MXFP4()


def tree():
  rng = np.random.default_rng(0)
  w = rng.normal(size=(64, 48)).astype(np.float32)
  spiky = w.copy()
  spiky[::16, ::16] = 300.0  # one outlier per 16x16 tile
  return {"w": jnp.asarray(w), "spiky": jnp.asarray(spiky),
          "step": jnp.int32(3)}


@pytest.mark.parametrize("recipe", [NV, MX], ids=["nvfp4", "mxfp4"])
def test_health_matches_quantize_dequantize_and_flags_outliers(recipe):
  t = tree()
  h = jax.jit(lambda t: fp4.quantization_health(t, recipe))(t)
  assert h.error["step"] is None
  for name in ("w", "spiky"):
    x = np.asarray(t[name], np.float64)
    back = np.asarray(fp4.quantize_dequantize(t[name], recipe, axis=0,
                                              role="weight"), np.float64)
    want = np.linalg.norm(back - x) / np.linalg.norm(x)
    np.testing.assert_allclose(float(h.error[name]), want, rtol=1e-5)
    nonzero = x != 0
    np.testing.assert_allclose(float(h.flushed[name]),
                               (nonzero & (back == 0)).sum() / nonzero.sum(),
                               rtol=1e-6)
  assert float(h.flushed["spiky"]) > 1.5 * float(h.flushed["w"])
  # (The error is relative to the norm, which the outliers dominate.)
  assert float(h.flushed_blocks["spiky"]) >= float(h.flushed_blocks["w"])
  # 48 rows of 64 along the blocks' axis: 16x16 tiles (3 x 4) or 1-D
  # blocks (48 x 2).
  assert int(h.blocks["w"]) == (12 if recipe is NV else 96)
  assert float(h.amax["spiky"]) == 300.0


def test_health_roles_and_bad_arguments():
  x = {"g": jnp.ones((4, 40))}
  h = jax.jit(lambda x: fp4.quantization_health(x, NV, role="gradient"))(x)
  assert int(h.blocks["g"]) == 4 * 3 and float(h.error["g"]) == 0.0
  zeros = jax.jit(lambda x: fp4.quantization_health(x, MX))(jnp.zeros(5))
  assert float(zeros.error) == 0.0
  with pytest.raises(ValueError, match="role must be one of"):
    fp4.quantization_health(x, NV, role="bias")
  with pytest.raises(ValueError, match="out of range"):
    fp4.quantization_health(x, NV, axis=3)
  with pytest.raises(TypeError, match="Expected a jmp_lite.fp4"):
    fp4.quantization_health(x, "nvfp4")
  with pytest.raises(ValueError, match="forward is None"):
    fp4.quantization_health(x, fp4.PerDirection(None, NV, None))
