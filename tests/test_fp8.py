"""jmp_lite.fp8: recipes, quantisation, the FP8 dot_general, its gradients."""

from __future__ import annotations

import functools
import pickle
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex

import jmp_lite
from jmp_lite import fp8
from tests.conftest import (
  as_xla_gpu_simplifies,
  assert_dtype,
  FIDELITY_SETTINGS,
  FLOAT_DTYPE_IDS,
  FLOAT_DTYPES,
)

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
MATMUL = (((1,), (0,)), ((), ()))


def dot_operand_dtypes(jaxpr) -> list[tuple[str, str]]:
  """(lhs, rhs) dtype names of every dot_general and scaled_dot (MX blocks'
  block-scaled dot), sub-jaxprs included."""
  found = []

  def walk(j):
    for eqn in j.eqns:
      if eqn.primitive.name in ("dot_general", "scaled_dot"):
        found.append(tuple(np.dtype(v.aval.dtype).name
                           for v in eqn.invars[:2]))
      for sub in jex.jaxprs_in_params(eqn.params):
        walk(sub)

  walk(jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr)
  return found


def rel_err(a, b) -> float:
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def normal(seed, shape, dtype=jnp.float32, scale=1.0):
  # numpy: eager jax.random would compile a kernel per shape.
  x = scale * np.random.default_rng(seed).standard_normal(shape)
  return jnp.asarray(x.astype(np.float32), dtype)


# ------------------------------------------------------------------ recipes


def test_recipe_defaults_are_transformer_engine_s():
  cur = fp8.CurrentScaling()
  assert (cur.fwd_dtype, cur.bwd_dtype, cur.margin) == (E4M3, E5M2, 0)
  delayed = fp8.DelayedScaling()
  assert (delayed.history, delayed.margin, delayed.amax_compute) == (
      1024, 0, "max")
  assert (delayed.fwd_dtype, delayed.bwd_dtype) == (E4M3, E5M2)
  # Frozen, hashable (a static argument of the custom_vjp) and picklable.
  assert hash(cur) == hash(fp8.CurrentScaling("float8_e4m3fn"))
  assert pickle.loads(pickle.dumps(delayed)) == delayed
  with pytest.raises(Exception, match="cannot assign"):
    cur.margin = 1  # pyright: ignore[reportAttributeAccessIssue]


@pytest.mark.parametrize("kwargs, error, match", [
    ({"fwd_dtype": jnp.bfloat16}, TypeError, "fwd_dtype must be one of"),
    ({"bwd_dtype": "int8"}, TypeError, "bwd_dtype must be one of the FP8"),
    ({"margin": -1}, ValueError, "margin must be >= 0, got -1"),
    ({"margin": 1.5}, TypeError, "margin must be a Python int"),
    ({"margin": True}, TypeError, "margin must be a Python int"),
])
def test_current_scaling_validation(kwargs, error, match):
  with pytest.raises(error, match=match):
    fp8.CurrentScaling(**kwargs)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"history": 0}, ValueError, "history must be >= 1, got 0"),
    ({"history": 2.0}, TypeError, "history must be a Python int"),
    ({"amax_compute": "mean"}, ValueError,
     r"amax_compute must be one of \('max', 'most_recent'\), got 'mean'"),
    ({"fwd_dtype": jnp.float16}, TypeError, "fwd_dtype must be one of"),
])
def test_delayed_scaling_validation(kwargs, error, match):
  with pytest.raises(error, match=match):
    fp8.DelayedScaling(**kwargs)


# ------------------------------------------------------------- quantisation


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=FLOAT_DTYPE_IDS)
@pytest.mark.parametrize("magnitude", [1e-4, 1.0, 1e4])
def test_quantize_round_trip_error_is_bounded(fmt, dtype, magnitude):
  x = normal(0, (256,), dtype, magnitude)
  q, scale_inv = jax.jit(lambda x: fp8.quantize(x, fmt))(x)
  assert_dtype(q, fmt)
  assert_dtype(scale_inv, jnp.float32)
  back = np.asarray(q, np.float32) * float(scale_inv)
  ref = np.asarray(x, np.float32)
  # The amax lands on the format's maximum exactly: nothing saturates.
  assert float(np.abs(np.asarray(q, np.float32)).max()) == float(
      jnp.finfo(fmt).max)
  # Normal-range values round to within half a unit in the last place.
  mantissa = jnp.finfo(fmt).nmant
  normal_range = np.abs(ref) * float(1 / scale_inv) >= float(
      jnp.finfo(fmt).smallest_normal)
  err = np.abs(back - ref)[normal_range] / np.abs(ref)[normal_range]
  assert err.max() <= 2.0 ** -(mantissa + 1) * 1.0001
  # Neither overflow nor a flush of the bulk: under 1% of values are zero.
  assert np.isfinite(back).all()
  assert np.mean(back == 0) < 0.01


def test_quantize_zero_and_nonfinite_and_margin():
  q, scale_inv = fp8.quantize(jnp.zeros(4))
  assert not np.asarray(q, np.float32).any() and float(scale_inv) == 1.0
  _, scale_inv = fp8.quantize(jnp.array([1.0, jnp.inf]))
  assert np.isnan(float(scale_inv))
  _, scale_inv = fp8.quantize(jnp.array([1.0, jnp.nan]))
  assert np.isnan(float(scale_inv))
  q, _ = fp8.quantize(jnp.array([1.0, -2.0]), margin=1)
  assert np.asarray(q, np.float32).tolist() == [112.0, -224.0]
  # A given amax (a delayed history) smaller than the data saturates.
  q, scale_inv = fp8.quantize(jnp.array([1.0, 4.0]), amax=2.0)
  assert np.asarray(q, np.float32).tolist() == [224.0, 448.0]
  with pytest.raises(TypeError, match="quantize expects a floating array"):
    fp8.quantize(jnp.arange(3))
  with pytest.raises(TypeError, match="dtype must be one of the FP8 dtypes"):
    fp8.quantize(jnp.ones(3), jnp.float16)


# --------------------------------------------------------- the FP8 matmul


def current_dot():
  return fp8.dot_general(fp8.CurrentScaling())


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=FLOAT_DTYPE_IDS)
def test_output_dtypes(dtype, variant):
  dot = current_dot()
  x, w = normal(0, (8, 16), dtype), normal(1, (16, 4), dtype)

  def outputs(x, w):
    return (dot(x, w, MATMUL),
            dot(x, w, MATMUL, preferred_element_type=jnp.float32),
            # Mixed operand dtypes promote.
            dot(x.astype(jnp.bfloat16), w.astype(jnp.float32), MATMUL))

  y, y32, mixed = variant(outputs)(x, w)
  assert_dtype(y, dtype)
  assert_dtype(y32, jnp.float32)
  assert_dtype(mixed, jnp.float32)


def test_gradients_come_back_in_each_operands_dtype():
  dot = current_dot()

  @jax.jit
  def grads(x, w):
    return jax.grad(lambda x, w: dot(x, w, MATMUL).astype(
        jnp.float32).sum(), argnums=(0, 1))(x, w)

  for lhs, rhs in [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.bfloat16),
                   (jnp.float16, jnp.float16), (jnp.bfloat16, jnp.float32)]:
    gx, gw = grads(normal(0, (8, 16), lhs), normal(1, (16, 4), rhs))
    assert_dtype(gx, lhs)
    assert_dtype(gw, rhs)


def test_jaxpr_of_loss_and_gradient_has_fp8_dots():
  dot = current_dot()
  # Every GEMM here, gradients included, has >= 100 operand elements: none
  # is small enough for the GPU's float32 fallback (next test).
  x, w = normal(0, (16, 16)), normal(1, (16, 8))

  def loss(x, w):
    return jnp.sum(dot(x, w, MATMUL) ** 2)

  fwd = dot_operand_dtypes(jax.make_jaxpr(loss)(x, w))
  assert fwd == [("float8_e4m3fn", "float8_e4m3fn")]
  grad = dot_operand_dtypes(jax.make_jaxpr(jax.grad(loss, (0, 1)))(x, w))
  assert sorted(grad) == sorted([
      ("float8_e4m3fn", "float8_e4m3fn"),   # forward
      ("float8_e5m2", "float8_e4m3fn"),     # d lhs = g . w
      ("float8_e4m3fn", "float8_e5m2"),     # d rhs = x . g
  ])
  # The program XLA receives: every dot in StableHLO has FP8 operands and a
  # float32 result (XLA:CPU then emulates; XLA:GPU calls cuBLASLt FP8).
  text = jax.jit(jax.grad(loss, (0, 1))).lower(x, w).as_text()
  dots = [s for s in text.splitlines() if "stablehlo.dot_general" in s]
  assert len(dots) == 3, dots
  for line in dots:
    assert "f8E" in line and "-> tensor<" in line and "xf32>" in line, line


def test_dots_too_small_for_a_gpu_gemm_run_in_float32_there(monkeypatch):
  """XLA:GPU multiplies tiny FP8 dots in float16, where they overflow."""
  dot = current_dot()
  x, w = exact_values(0, (4, 8)), exact_values(1, (8, 3))   # 32 + 24 < 100
  c = exact_values(2, (4, 3))
  # Values that E4M3 rounds (1.1 and its neighbours are no E4M3 numbers).
  xs, ws = normal(3, (4, 8)) + 1.1, normal(4, (8, 3)) + 1.1

  def loss(x, w):
    return jnp.sum(dot(x, w, MATMUL) * c)

  fp8_dot = lambda a, b: dot(a, b, MATMUL)
  want = jax.jit(jax.value_and_grad(loss, (0, 1)))(x, w)
  rounded = jax.jit(fp8_dot)(xs, ws)
  assert not np.allclose(rounded, xs @ ws, rtol=1e-3)   # FP8 did round.
  # JAX caches traced custom_vjp bodies: trace afresh for the "GPU", and
  # leave no GPU trace behind for the tests after this one.
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  jax.clear_caches()
  try:
    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, (0, 1)))(x, w)
    assert dot_operand_dtypes(jaxpr) == [("float32", "float32")] * 3
    # The FP8-rounded values in float32: the same numbers as the FP8 dots,
    # also where XLA:GPU deletes f32 -> f8 -> f32 casts.
    chex.assert_trees_all_equal(
        jax.jit(jax.value_and_grad(loss, (0, 1)))(x, w), want)
    chex.assert_trees_all_equal(as_xla_gpu_simplifies(fp8_dot)(xs, ws),
                                rounded)
    # At 100 operand elements and more the operands stay FP8 on a GPU too.
    big = jax.make_jaxpr(fp8_dot)(normal(0, (4, 16)), normal(1, (16, 3)))
    assert dot_operand_dtypes(big) == [("float8_e4m3fn", "float8_e4m3fn")]
  finally:
    monkeypatch.undo()
    jax.clear_caches()


def test_relative_error_against_float32_is_bounded_and_nonzero():
  dot = current_dot()
  x, w = normal(0, (64, 256)), normal(1, (256, 32))
  c = normal(2, (64, 32))

  def loss(x, w, dot_fn):
    return jnp.sum(dot_fn(x, w, MATMUL) * c)

  y = dot(x, w, MATMUL)
  ref = jax.lax.dot_general(x, w, MATMUL)
  err = rel_err(y, ref)
  # E4M3 rounds each operand to 3 mantissa bits (about 2.6% RMS each; 3.7%
  # measured for the product): bounded, and not float32 in disguise.
  assert 0.01 < err < 0.05, err
  grad = jax.jit(jax.grad(loss, (0, 1)), static_argnums=2)
  gx, gw = grad(x, w, dot)
  rx, rw = grad(x, w, jax.lax.dot_general)
  for got, want in ((gx, rx), (gw, rw)):
    err = rel_err(got, want)
    # The cotangent is E5M2 (2 mantissa bits, about 5% RMS), the operands
    # E4M3: about 6% measured.
    assert 0.02 < err < 0.08, err


# Operands whose values times their scale are exactly representable: the FP8
# matmul must then equal float32's up to float32 rounding of the scales. This
# pins the transposes of arbitrary dimension numbers exactly.
EXACT_DIMS = [
    ((4, 8), (8, 6), (((1,), (0,)), ((), ()))),
    ((8, 4), (8, 6), (((0,), (0,)), ((), ()))),
    ((3, 4, 8), (3, 8, 5), (((2,), (1,)), ((0,), (0,)))),
    ((2, 5, 3, 6), (6, 4, 5, 3), (((2, 3), (3, 0)), ((1,), (2,)))),
    ((2, 3, 4), (4, 2, 5), (((2,), (0,)), ((0,), (1,)))),
]


def exact_values(seed, shape):
  # {0, +-1, +-2, +-4} with the amax 4 present: x * (448 / 4) and
  # g * (57344 / 4) are E4M3 / E5M2 numbers.
  values = np.array([0.0, 1.0, -1.0, 2.0, -2.0, 4.0, -4.0], np.float32)
  x = np.random.default_rng(seed).choice(values, shape)
  x.reshape(-1)[0] = 4.0
  return jnp.asarray(x)


@pytest.mark.parametrize("lhs_shape, rhs_shape, dims", EXACT_DIMS)
def test_any_dimension_numbers_forward_and_backward(lhs_shape, rhs_shape,
                                                    dims):
  dot = current_dot()
  x, w = exact_values(0, lhs_shape), exact_values(1, rhs_shape)
  out_shape = jax.eval_shape(
      lambda a, b: jax.lax.dot_general(a, b, dims), x, w).shape
  c = exact_values(2, out_shape)

  def loss(x, w, dot_fn):
    return jnp.sum(dot_fn(x, w, dims) * c)

  @jax.jit
  def both(x, w):
    return (dot(x, w, dims), jax.lax.dot_general(x, w, dims),
            jax.grad(loss, (0, 1))(x, w, dot),
            jax.grad(loss, (0, 1))(x, w, jax.lax.dot_general))

  y, ref, got, want = both(x, w)
  np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-6)
  for g, r in zip(got, want, strict=True):
    assert g.shape == r.shape
    np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("zero", ["lhs", "rhs", "cotangent"])
def test_all_zero_operands_give_zeros_never_nan(zero):
  dot = current_dot()
  x, w = normal(0, (4, 8)), normal(1, (8, 3))
  c = normal(2, (4, 3))
  if zero == "lhs":
    x = jnp.zeros_like(x)
  elif zero == "rhs":
    w = jnp.zeros_like(w)
  else:
    c = jnp.zeros_like(c)

  def loss(x, w):
    return jnp.sum(dot(x, w, MATMUL) * c)

  y = jax.jit(dot, static_argnums=2)(x, w, MATMUL)
  gx, gw = jax.jit(jax.grad(loss, (0, 1)))(x, w)
  for t in (y, gx, gw):
    assert np.isfinite(np.asarray(t)).all()
  if zero != "cotangent":
    assert not np.asarray(y).any()
  else:
    assert not np.asarray(gx).any() and not np.asarray(gw).any()


@pytest.mark.parametrize("magnitude", [1e4, 1e-4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16],
                         ids=["f32", "bf16"])
def test_large_and_small_magnitudes_neither_overflow_nor_flush(magnitude,
                                                               dtype):
  dot = current_dot()
  x = normal(0, (16, 64), dtype, magnitude)
  w = normal(1, (64, 8), dtype, magnitude)
  c = normal(2, (16, 8), jnp.float32, magnitude)

  def loss(x, w, dot_fn):
    return jnp.sum(dot_fn(x, w, MATMUL).astype(jnp.float32) * c)

  wide = lambda t: t.astype(jnp.float32)
  y = dot(x, w, MATMUL)
  ref = jax.lax.dot_general(wide(x), wide(w), MATMUL)
  assert np.isfinite(np.asarray(y, np.float32)).all()
  assert rel_err(y, ref) < 0.05
  grad = jax.jit(jax.grad(loss, (0, 1)), static_argnums=2)
  gx, gw = grad(x, w, dot)
  rx, rw = grad(wide(x), wide(w), jax.lax.dot_general)
  for g, r in ((gx, rx), (gw, rw)):
    g = np.asarray(g, np.float32)
    assert np.isfinite(g).all()
    assert np.mean(g == 0) < 0.01
    assert rel_err(g, r) < 0.08


@pytest.mark.parametrize("bad", [jnp.inf, jnp.nan])
def test_nonfinite_operand_makes_the_result_nan(bad):
  # Saturating casts must not hide an overflow from loss_scaled.
  dot = current_dot()
  x = jnp.ones((2, 4)).at[0, 0].set(bad)

  @jax.jit
  def run(x, w):
    return (dot(x, w, MATMUL),
            jax.grad(lambda w: jnp.sum(dot(x, w, MATMUL)))(w))

  y, gw = run(x, jnp.ones((4, 3)))
  assert np.isnan(np.asarray(y)).all()
  assert not np.isfinite(np.asarray(gw)).all()


def test_call_signature_matches_lax_dot_general():
  dot = current_dot()
  x, w = normal(0, (4, 8)), normal(1, (8, 3))
  y = dot(x, w, MATMUL, jax.lax.Precision.HIGHEST, None)
  chex.assert_trees_all_equal(y, dot(x, w, MATMUL))
  chex.assert_trees_all_equal(dot(x, w, MATMUL, out_sharding=None), y)
  # jnp.einsum takes it as its dot_general.
  z = jnp.einsum("ij,jk->ik", x, w, _dot_general=dot)
  np.testing.assert_allclose(z, y, rtol=1e-6)
  # List-valued dimension numbers (as some callers build them).
  chex.assert_trees_all_equal(dot(x, w, [[[1], [0]], [[], []]]), y)


def test_bad_arguments_raise_clear_errors():
  dot = current_dot()
  x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
  with pytest.raises(TypeError,
                     match="lhs must be a floating array, got int32"):
    dot(jnp.ones((2, 3), jnp.int32), w, MATMUL)
  with pytest.raises(TypeError, match="dimension_numbers must be"):
    dot(x, w, (1, 0))
  with pytest.raises(TypeError, match="unexpected keyword argument 'foo'"):
    dot(x, w, MATMUL, foo=1)
  with pytest.raises(TypeError, match="Expected a jmp_lite.fp8.CurrentScaling"
                     " or DelayedScaling recipe, got str"):
    fp8.dot_general("e4m3")  # pyright: ignore[reportArgumentType]
  with pytest.raises(TypeError,
                     match="DelayedScaling needs the matmul's state"):
    fp8.dot_general(fp8.DelayedScaling())
  with pytest.raises(TypeError, match="CurrentScaling is stateless"):
    fp8.dot_general(fp8.CurrentScaling(), fp8.DelayedScaling().init())


def test_vmap_and_remat_compose():
  dot = current_dot()
  xs, w = normal(0, (3, 4, 8)), normal(1, (8, 2))

  @jax.jit
  def run(xs, w):
    ys = jax.vmap(lambda x: dot(x, w, MATMUL))(xs)
    remat = lambda w: jnp.sum(jax.checkpoint(lambda w: dot(xs[0], w, MATMUL))(
        w))
    plain = lambda w: jnp.sum(dot(xs[0], w, MATMUL))
    return ys[1], dot(xs[1], w, MATMUL), jax.grad(remat)(w), jax.grad(plain)(w)

  a, b, c, d = run(xs, w)
  np.testing.assert_allclose(a, b, rtol=1e-6)
  np.testing.assert_allclose(c, d, rtol=1e-6)


@pytest.mark.slow   # a benchmark script in a subprocess, as in test_demo.py
def test_gpu_fp8_benchmark_runs_small_on_cpu():
  import os
  import pathlib
  root = pathlib.Path(__file__).resolve().parents[1]
  out = subprocess.run(
      [sys.executable, "benchmarks/gpu_fp8.py", "--width", "32", "--seq", "8",
       "--heads", "2", "--batch", "1", "--steps", "1", "--rounds", "1"],
      capture_output=True, text=True, check=True, cwd=root,
      env=dict(os.environ, PYTHONPATH=str(root), JAX_PLATFORMS="cpu"))
  rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()
          if line.startswith(("bf16 ", "fp8-"))}
  # FP8 operands in 12 dots (4 projections x forward, d-input, d-weight);
  # none in bf16; no library or Triton GEMM at all on the CPU.
  assert [rows[n][1:3] for n in ("bf16", "fp8-current", "fp8-delayed")] == [
      ["0", "0/0"], ["12", "0/0"], ["12", "0/0"]], out.stdout
  assert "XLA:CPU emulates FP8" in out.stdout


# Compiled GPU HLO as XLA prints it: operands by name only, their types where
# they are defined (the shape of an H100 dump of the benchmark, abridged; a
# backslash joins a long line).
_GPU_HLO = """\
  %bitcast.1 = f8e4m3fn[64,32]{1,0} bitcast(%fusion.1)
  %bitcast.2 = f8e4m3fn[32,48]{1,0} bitcast(%fusion.2)
  %bitcast.3 = f8e5m2[64,48]{1,0} bitcast(%fusion.3)
  %fusion.4 = f32[] fusion(%p.1), kind=kLoop, calls=%fused_scale
  %cublas-gemm.1 = (f32[64,48]{1,0}, s8[1024]{0}) custom-call(%bitcast.1, \
%bitcast.2, %fusion.4, %fusion.4), custom_call_target="__cublas$lt$matmul$f8"
  %cublas-gemm.2 = (f32[64,32]{1,0}, s8[1024]{0}) custom-call(%bitcast.3, \
%bitcast.2, %fusion.4), custom_call_target="__cublas$lt$matmul$f8"
  %bitcast.5 = bf16[8,16,4]{2,1,0} bitcast(%p.2)
  %bitcast.6 = bf16[8,4,16]{2,1,0} bitcast(%p.3)
  %custom-call.1 = (f32[8,16,16]{2,1,0}, s8[1024]{0}) custom-call(%bitcast.5, \
%bitcast.6), custom_call_target="__cublas$lt$matmul"
  %gemm_fusion_dot.1 = bf16[8,16,4]{2,1,0} fusion(%bitcast.5, %bitcast.6), \
kind=kCustom, calls=%gemm_fusion_dot.1_computation, \
backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %fusion.9 = bf16[8,16,4]{2,1,0} fusion(%bitcast.5), kind=kLoop, calls=%f
"""


def test_gpu_fp8_benchmark_counts_the_gemms_of_compiled_gpu_hlo(monkeypatch):
  import importlib
  import pathlib
  monkeypatch.syspath_prepend(
      str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
  gpu_fp8 = importlib.import_module("gpu_fp8")
  counts = gpu_fp8.gemm_operands(_GPU_HLO)
  assert counts == {"f8e4m3fn x f8e4m3fn": 1, "f8e5m2 x f8e4m3fn": 1,
                    "bf16 x bf16": 2}
  assert gpu_fp8.fp8_gemms(counts) == 2


def test_importing_fp8_does_not_import_flax():
  code = ("import sys, jmp_lite, jmp_lite.fp8; "
          "assert 'flax' not in sys.modules, sorted("
          "m for m in sys.modules if m.startswith('flax'))")
  subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------- health


def test_quantization_health_counts_saturation_flush_and_subnormals():
  x = {"w": jnp.array([1.0, 1e-6, 1e-5, 0.0, 2.0]), "step": jnp.int32(3)}
  h = jax.jit(fp8.quantization_health)(x)
  assert h.amax["step"] is None
  assert float(h.amax["w"]) == 2.0
  assert float(h.saturated["w"]) == 0.0
  # Scale 224: 1e-6 -> 2.2e-4 flushes, 1e-5 -> 2.2e-3 is subnormal.
  assert float(h.flushed["w"]) == 0.25
  assert float(h.subnormal["w"]) == 0.25
  # A stale, smaller amax (from a history) saturates values beyond it.
  h = fp8.quantization_health(x, amax={"w": 1.0, "step": None})
  assert float(h.saturated["w"]) == pytest.approx(0.2)
  # E5M2 has more range: nothing flushes there.
  h = fp8.quantization_health(x, jnp.float8_e5m2)
  assert float(h.flushed["w"]) == 0.0
  with pytest.raises(TypeError, match="dtype must be one of the FP8"):
    fp8.quantization_health(x, jnp.bfloat16)


# ---------------------------------------------------------------- fidelity
#
# The digits MLP and the char-level Transformer of jmp_lite.examples, written
# with Flax layers whose compute dtype is bfloat16 (float32 params), trained
# with examples.fit; the FP8 variants replace the matmuls of every layer but
# the first and the last by FP8 ones (digits: the hidden 128x128 layer;
# char-LM: q/k/v/out projections and both MLP layers; the embedding is a
# gather and the logits layer stays bfloat16). Delayed scaling needs its
# state threaded through the step, which examples.fit has no hook for: it
# runs in fit_delayed below, the same step plus fp8.commit.

FIDELITY_RECIPES = {"current": fp8.CurrentScaling(),
                    "delayed": fp8.DelayedScaling(history=16)}


def fit_delayed(model, params, fp8_state, loss_of, batches, evaluate, *,
                steps, lr):
  """examples.fit's step (Adam under loss_scaled, jitted) plus fp8.commit."""
  import optax
  opt = jmp_lite.loss_scaled(optax.adam(lr), jmp_lite.NoOpLossScale(),
                             allow_half_state=True)
  opt_state = opt.init(params)

  @jax.jit
  def step(params, fp8_state, opt_state, batch):
    grads, observed = jax.grad(loss_of, argnums=(0, 1))(params, fp8_state,
                                                        batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    fp8_state = fp8.commit(fp8_state, observed, opt_state)
    return optax.apply_updates(params, updates), fp8_state, opt_state

  for i in range(steps):
    params, fp8_state, opt_state = step(params, fp8_state, opt_state,
                                        batches(i))
  assert int(jmp_lite.loss_scaled_state(opt_state).total_skips) == 0
  # Every FP8 matmul's history filled up.
  for amax in jax.tree.leaves(fp8.history_amax(fp8_state)):
    assert (np.asarray(amax) > 0).all()
  return evaluate(params, fp8_state)


def digits_task(recipe, *, steps, lr, batch=128, width=128, seed=0):
  """Held-out (loss, accuracy) of the digits MLP; ``recipe=None``: bf16.

  ``steps`` and ``lr``: ``FIDELITY_SETTINGS`` (conftest says why).
  """
  import flax.linen as nn

  import jmp_lite.fp8.linen as fp8_linen
  from jmp_lite import examples
  x_tr, y_tr, x_te, y_te = examples.load_digits_split(seed)
  fields = {} if recipe is None else fp8_linen.layer_fields(recipe)

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      kw = {"dtype": jnp.bfloat16, "param_dtype": jnp.float32}
      x = nn.relu(nn.Dense(width, **kw)(x))
      x = nn.relu(nn.Dense(width, **kw, **fields)(x))
      return nn.Dense(10, **kw)(x)

  model = MLP()
  variables = model.init(jax.random.key(seed), x_tr[:1])
  rng = np.random.default_rng(seed + 1)
  flat = np.concatenate([rng.permutation(len(x_tr))
                         for _ in range(steps * batch // len(x_tr) + 2)])

  def batches(i):
    idx = flat[i * batch:(i + 1) * batch]
    return jnp.asarray(x_tr[idx]), jnp.asarray(y_tr[idx])

  def xent(variables, x, y):
    import optax
    # apply without mutable= returns the output alone (pyright sees the
    # union with the (output, state) pair).
    logits = model.apply(variables, x)
    logits = logits.astype(jnp.float32)  # pyright: ignore[reportAttributeAccessIssue]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y), logits

  @jax.jit
  def evaluate(params, fp8_state=None):
    extra = {} if fp8_state is None else {"fp8": fp8_state}
    loss, logits = xent({"params": params, **extra}, x_te, y_te)
    return loss.mean(), jnp.mean(jnp.argmax(logits, -1) == y_te)

  if isinstance(recipe, fp8.DelayedScaling):
    return fit_delayed(
        model, variables["params"], variables["fp8"],
        lambda p, s, b: xent({"params": p, "fp8": s}, *b)[0].mean(),
        batches, evaluate, steps=steps, lr=lr)
  result = examples.fit(
      variables["params"], lambda p, b: xent({"params": p}, *b)[0].mean(),
      batches, steps=steps, lr=lr, loss_scale=jmp_lite.NoOpLossScale(),
      master=False, eval_fn=evaluate)
  assert result.skipped == 0
  return result.eval_loss, result.accuracy


def char_lm_task(recipe, *, steps, lr, seq=32, batch=32, dim=64, seed=0):
  """Held-out (loss, accuracy) of the one-block char Transformer.

  ``steps`` and ``lr``: ``FIDELITY_SETTINGS`` (conftest says why).
  """
  import flax.linen as nn
  import optax

  import jmp_lite.fp8.linen as fp8_linen
  from jmp_lite import examples
  from jmp_lite.linen import dot_product_attention_fp32
  text = examples.python_docs_text()
  chars = sorted(set(text))
  ids = np.array([chars.index(c) for c in text], np.int32)
  cut = int(0.85 * len(ids))
  train_ids, test_ids = ids[:cut], ids[cut - seq:]
  vocab = len(chars)
  fields = {} if recipe is None else fp8_linen.layer_fields(recipe)
  attn_fields = {} if recipe is None else fp8_linen.layer_fields(
      recipe, nn.MultiHeadDotProductAttention)
  kw = {"dtype": jnp.bfloat16, "param_dtype": jnp.float32}

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, mask):
      h = nn.LayerNorm()(x)
      h = nn.MultiHeadDotProductAttention(
          num_heads=4, attention_fn=dot_product_attention_fp32, **kw,
          **attn_fields)(h, h, mask=mask)
      x = x + h
      h = nn.Dense(4 * dim, **kw, **fields)(nn.LayerNorm()(x))
      return x + nn.Dense(dim, **kw, **fields)(nn.gelu(h))

  class CharLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      n = tokens.shape[-1]
      x = nn.Embed(vocab, dim)(tokens)
      x = x + self.param("pos", nn.initializers.normal(0.02), (seq, dim))[:n]
      x = Block()(x, nn.make_causal_mask(tokens))
      return nn.Dense(vocab, **kw)(nn.LayerNorm()(x))

  model = CharLM()
  variables = model.init(jax.random.key(seed), jnp.zeros((1, seq), jnp.int32))

  def windows(source, starts):
    return np.stack([source[s:s + seq + 1] for s in starts])

  rng = np.random.default_rng(seed + 1)
  starts = rng.integers(0, len(train_ids) - seq - 1, (steps, batch))

  def batches(i):
    return jnp.asarray(windows(train_ids, starts[i]))

  test_batch = jnp.asarray(windows(test_ids, range(0, len(test_ids) - seq - 1)))

  def xent(variables, b):
    logits = model.apply(variables, b[:, :-1])  # the output alone
    logits = logits.astype(jnp.float32)  # pyright: ignore[reportAttributeAccessIssue]
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, b[:, 1:]), logits

  @jax.jit
  def evaluate(params, fp8_state=None):
    extra = {} if fp8_state is None else {"fp8": fp8_state}
    loss, logits = xent({"params": params, **extra}, test_batch)
    return loss.mean(), jnp.mean(jnp.argmax(logits, -1) == test_batch[:, 1:])

  if isinstance(recipe, fp8.DelayedScaling):
    assert len(jax.tree.leaves(variables["fp8"])) == 6 * 2  # 6 FP8 matmuls
    return fit_delayed(
        model, variables["params"], variables["fp8"],
        lambda p, s, b: xent({"params": p, "fp8": s}, b)[0].mean(),
        batches, evaluate, steps=steps, lr=lr)
  result = examples.fit(
      variables["params"], lambda p, b: xent({"params": p}, b)[0].mean(),
      batches, steps=steps, lr=lr, loss_scale=jmp_lite.NoOpLossScale(),
      master=False, eval_fn=evaluate)
  assert result.skipped == 0
  return result.eval_loss, result.accuracy


FIDELITY_TASKS = {"digits": digits_task, "char_lm": char_lm_task}


@pytest.fixture(scope="module", params=list(FIDELITY_TASKS))
def fidelity_task(request, optimized_codegen):
  if request.param == "digits":
    pytest.importorskip("sklearn")
  task = functools.partial(FIDELITY_TASKS[request.param], **FIDELITY_SETTINGS)
  return request.param, task, task(None)


@pytest.mark.slow   # 300-step trainings, as tests/test_fidelity.py
@pytest.mark.parametrize("recipe", list(FIDELITY_RECIPES))
def test_fp8_training_matches_bfloat16(fidelity_task, recipe):
  name, task, (ref_loss, ref_acc) = fidelity_task
  loss, acc = task(FIDELITY_RECIPES[recipe])
  print(f"\nfp8 fidelity {name} {recipe}: eval loss {float(loss):.4f}"
        f" (bf16 {float(ref_loss):.4f}), accuracy {float(acc):.4f}"
        f" (bf16 {float(ref_acc):.4f})")
  assert np.isfinite(float(loss))
  assert float(loss) <= 1.02 * float(ref_loss), (name, recipe, loss, ref_loss)
  assert float(acc) >= float(ref_acc) - 0.02
