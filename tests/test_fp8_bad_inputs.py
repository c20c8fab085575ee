"""Bad input to jmp_lite.fp8 gets a clear, early TypeError or ValueError.

The FP8 layer's sweep, as ``tests/test_bad_inputs.py`` sweeps the core:
every argument of every public function and recipe, with wrong types,
out-of-range values and mismatched shapes. None may be accepted silently,
and each error names what was wrong. Dimension numbers are checked against
``jax.lax.dot_general`` itself: each recipe refuses exactly what it refuses
and computes what it computes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmp_lite import fp8
from jmp_lite.fp8 import linen as fp8_linen
from jmp_lite.fp8 import nnx as fp8_nnx

MATMUL = (((1,), (0,)), ((), ()))
X, W = jnp.ones((2, 3)), jnp.ones((3, 4))
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _call(recipe: Any = None, *args: Any, **kwargs: Any) -> Any:
  dot = fp8.dot_general(recipe or fp8.CurrentScaling())
  return dot(*(args or (X, W, MATMUL)), **kwargs)


def _gather(x: Any, axis_name: Any = "d", recipe: Any = None,
            axis: Any = 0) -> Any:
  """``fp8.all_gather`` under a one-device ``shard_map``."""
  mesh = jax.sharding.Mesh(jax.devices()[:1], ("d",))
  spec = jax.sharding.PartitionSpec("d")
  return jax.shard_map(
      lambda v: fp8.all_gather(v, axis_name, recipe or fp8.MXFP8(), axis),
      mesh=mesh, in_specs=spec, out_specs=spec)(x)


# name -> [(call, exception, what the message must mention)]
BAD: dict[str, list[tuple[Callable[[], Any], type, str]]] = {
    "CurrentScaling": [
        # Every element would round to zero (E4M3's amax at 448 / 2**20).
        (lambda: fp8.CurrentScaling(margin=20), ValueError, "[0, 14]"),
        (lambda: fp8.CurrentScaling(margin=200), ValueError, "margin=200"),
        (lambda: fp8.CurrentScaling(margin=10**6), ValueError, "[0, 14]"),
        (lambda: fp8.CurrentScaling(margin=15), ValueError, "float8_e4m3fn"),
        (lambda: fp8.CurrentScaling(fwd_dtype=E5M2, margin=30), ValueError,
         "[0, 29]"),
        (lambda: fp8.CurrentScaling(margin=-1), ValueError, "margin"),
        (lambda: fp8.CurrentScaling(margin=2.0), TypeError, "margin"),
        (lambda: fp8.CurrentScaling(margin=True), TypeError, "margin"),
        (lambda: fp8.CurrentScaling(fwd_dtype=jnp.bfloat16), TypeError,
         "fwd_dtype"),
        (lambda: fp8.CurrentScaling(bwd_dtype="e5"), TypeError, "bwd_dtype"),
        (lambda: fp8.CurrentScaling(granularity="tile"), ValueError,
         "granularity"),
        (lambda: fp8.CurrentScaling(granularity=1), ValueError,
         "granularity"),
        (lambda: fp8.CurrentScaling(granularity="block", block_size=0),
         ValueError, "block_size"),
        (lambda: fp8.CurrentScaling(block_size=2.5), TypeError, "block_size"),
        (lambda: fp8.CurrentScaling(block_size=True), TypeError,
         "block_size"),
    ],
    "DelayedScaling": [
        (lambda: fp8.DelayedScaling(margin=20), ValueError, "[0, 14]"),
        (lambda: fp8.DelayedScaling(margin=-2), ValueError, "margin"),
        (lambda: fp8.DelayedScaling(history=0), ValueError, "history"),
        (lambda: fp8.DelayedScaling(history=1.5), TypeError, "history"),
        (lambda: fp8.DelayedScaling(history=True), TypeError, "history"),
        (lambda: fp8.DelayedScaling(amax_compute="mean"), ValueError,
         "amax_compute"),
        (lambda: fp8.DelayedScaling(amax_compute=["max"]), ValueError,
         "amax_compute"),
        (lambda: fp8.DelayedScaling(fwd_dtype=jnp.float16), TypeError,
         "fwd_dtype"),
        (lambda: fp8.DelayedScaling(bwd_dtype=None), TypeError, "bwd_dtype"),
    ],
    "MXFP8": [
        (lambda: fp8.MXFP8(fwd_dtype=jnp.float8_e4m3fnuz), ValueError, "OCP"),
        (lambda: fp8.MXFP8(bwd_dtype=jnp.float8_e5m2fnuz), ValueError, "OCP"),
        (lambda: fp8.MXFP8(fwd_dtype=jnp.int8), TypeError, "fwd_dtype"),
        (lambda: fp8.MXFP8(bwd_dtype=jnp.bfloat16), TypeError, "bwd_dtype"),
        (lambda: fp8.MXFP8(scale_rounding="down"), ValueError,
         "scale_rounding"),
        (lambda: fp8.MXFP8(scale_rounding=None), ValueError,
         "scale_rounding"),
    ],
    "ScalingState": [
        (lambda: fp8.ScalingState(np.zeros(3), np.zeros(3)), ValueError,
         "history of shape"),
        (lambda: fp8.ScalingState(np.zeros((3, 4)), np.zeros(2)), ValueError,
         "pending of"),
        (lambda: fp8.ScalingState(np.zeros((3, 0)), np.zeros(3)), ValueError,
         "n >= 1"),
    ],
    "quantize": [
        (lambda: fp8.quantize(jnp.ones(3, jnp.int32)), TypeError, "int32"),
        (lambda: fp8.quantize(X, jnp.bfloat16), TypeError, "dtype"),
        (lambda: fp8.quantize(X, margin=15), ValueError, "[0, 14]"),
        (lambda: fp8.quantize(X, E5M2, margin=30), ValueError, "[0, 29]"),
        (lambda: fp8.quantize(X, margin=-1), ValueError, "margin"),
        (lambda: fp8.quantize(X, margin=1.0), TypeError, "margin"),
        # One amax per tensor; an array would broadcast silently.
        (lambda: fp8.quantize(jnp.ones(3), amax=jnp.ones(3)), ValueError,
         "scalar"),
    ],
    "dot_general": [
        (lambda: fp8.dot_general("e4m3"), TypeError, "recipe, got str"),
        (lambda: fp8.dot_general(fp8.DelayedScaling()), TypeError,
         "needs the matmul's state"),
        (lambda: fp8.dot_general(fp8.DelayedScaling(), {"history": 1}),
         TypeError, "needs the matmul's state"),
        (lambda: fp8.dot_general(fp8.CurrentScaling(),
                                 fp8.DelayedScaling().init()), TypeError,
         "stateless"),
        (lambda: fp8.dot_general(fp8.MXFP8(), fp8.DelayedScaling().init()),
         TypeError, "stateless"),
        # A state another recipe made (another history length).
        (lambda: fp8.dot_general(fp8.DelayedScaling(history=16),
                                 fp8.DelayedScaling(history=8).init()),
         ValueError, "history=16"),
    ],
    "dot_general(...)": [
        (lambda: _call(None, X.astype(jnp.int32), W, MATMUL), TypeError,
         "lhs must be a floating array"),
        (lambda: _call(None, X, W > 0, MATMUL), TypeError,
         "rhs must be a floating array"),
        (lambda: _call(None, X, W, (1, 0)), TypeError, "dimension_numbers"),
        (lambda: _call(None, X, W, (((0,), (0,)), ((), ()))), TypeError,
         "contracting dimensions to have the same shape"),
        (lambda: _call(fp8.MXFP8(), X, W, (((1,), (2,)), ((), ()))),
         TypeError, "rhs dimension numbers"),
        (lambda: _call(None, X, W, MATMUL, precision="bogus"), ValueError,
         "Precision"),
        (lambda: _call(None, X, W, MATMUL, preferred_element_type=jnp.int32),
         TypeError, "preferred_element_type"),
        (lambda: _call(None, X, W, MATMUL, preferred_element_type="bogus"),
         TypeError, "bogus"),
        (lambda: _call(None, X, W, MATMUL, foo=1), TypeError, "foo"),
    ],
    "all_gather": [
        (lambda: _gather(X, recipe="mx"), TypeError, "recipe, got str"),
        (lambda: _gather(X.astype(jnp.int32)), TypeError, "int32"),
        (lambda: _gather(X, axis_name=3), TypeError, "axis_name"),
        (lambda: _gather(X, axis_name=None), TypeError, "axis_name"),
        (lambda: _gather(X, axis_name=["d"]), TypeError, "axis_name"),
        (lambda: _gather(X, axis=2), ValueError, "out of range"),
        (lambda: _gather(X, axis=-3), ValueError, "out of range"),
        (lambda: _gather(X, axis=1.0), TypeError, "axis must be an int"),
        (lambda: _gather(X, axis=True), TypeError, "axis must be an int"),
        (lambda: _gather(X, recipe=fp8.CurrentScaling(granularity="row"),
                         axis=1), ValueError, "granularity='row'"),
        (lambda: _gather(jnp.ones((2, 33)), axis=1), ValueError,
         "multiple"),
    ],
    "quantization_health": [
        (lambda: fp8.quantization_health(X, operand="bias"), ValueError,
         "operand"),
        (lambda: fp8.quantization_health(X, axis=1.5), TypeError, "axis"),
        (lambda: fp8.quantization_health(
            X, recipe=fp8.CurrentScaling(granularity="row"), axis=5),
         ValueError, "axis 5"),
        (lambda: fp8.quantization_health(X, jnp.bfloat16), TypeError,
         "dtype"),
        (lambda: fp8.quantization_health(X, margin=15), ValueError,
         "[0, 14]"),
        (lambda: fp8.quantization_health(X, margin=-1), ValueError,
         "margin"),
        (lambda: fp8.quantization_health(X, E4M3, recipe=fp8.MXFP8()),
         ValueError, "recipe"),
        (lambda: fp8.quantization_health(X, recipe=fp8.MXFP8(), amax=1.0),
         ValueError, "per-tensor"),
        (lambda: fp8.quantization_health(X, recipe="mx"), TypeError,
         "recipe"),
    ],
    "commit": [
        (lambda: fp8.commit({"a": fp8.DelayedScaling(history=2).init()},
                            {"a": jnp.ones(3)}), ValueError,
         "gradient with respect to the fp8 state"),
        (lambda: fp8.commit({"a": fp8.DelayedScaling(history=2).init()},
                            {"a": fp8.DelayedScaling(history=2).init()},
                            applied="yes"), TypeError, "applied"),
    ],
    "fp8.linen": [
        (lambda: fp8_linen.dot_general_cls("e4m3"), TypeError, "recipe"),
        (lambda: fp8_linen.layer_fields(None, object), TypeError, "recipe"),
        (lambda: fp8_linen.layer_fields(fp8.CurrentScaling(), object),
         TypeError, "object"),
    ],
    "fp8.nnx": [
        (lambda: fp8_nnx.Fp8DotGeneral("e4m3"), TypeError, "recipe"),
        (lambda: fp8_nnx.dot_general_for(3), TypeError, "recipe"),
    ],
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


def test_the_sweep_covers_the_fp8_api():
  """Every public name of jmp_lite.fp8 is swept, or named here with why not."""
  no_arguments_to_get_wrong = {
      # Constants, and a result class the library builds.
      "AMAX_COMPUTE", "FP8_DTYPES", "GRANULARITIES", "QuantizationHealth"}
  swept_elsewhere = {
      # opt_state is any optimizer state; what it holds is read, never
      # required (tests/test_fp8_state.py covers two accumulators).
      "step_outcome": "tests/test_fp8_state.py",
      # Takes any pytree and reports on the ScalingStates in it.
      "history_amax": "tests/test_fp8_state.py",
  }
  swept = {name.split("(")[0] for name in BAD}
  missing = (set(fp8.__all__) - swept - no_arguments_to_get_wrong
             - set(swept_elsewhere))
  assert not missing, sorted(missing)


def test_the_largest_margins_are_accepted_and_keep_the_amax_normal():
  """The bound is the format's own: at the largest margin the amax still
  lands on a normal number (rounded to the format's precision), and
  elements a few powers of two below it are subnormals, not zeros."""
  x = jnp.asarray([1.0, 0.5, -0.25, 0.125])
  for dtype, limit in ((E4M3, 14), (E5M2, 29)):
    q, inv = fp8.quantize(x, dtype, margin=limit)
    back = np.asarray(q.astype(jnp.float32) * inv)
    assert abs(back[0] - 1.0) <= 2.0 ** -3
    assert np.all(np.sign(back) == np.sign(np.asarray(x)))
  recipe = fp8.CurrentScaling(fwd_dtype=E5M2, margin=29)
  y = fp8.dot_general(recipe)(x[None], x[:, None], MATMUL)
  assert 0.5 < float(y[0, 0]) / float(x @ x) < 1.5
  assert fp8.CurrentScaling(margin=14).margin == 14
  assert fp8.DelayedScaling(margin=14).margin == 14


# ------------------------------------------------- dimension numbers vs lax

# (lhs shape, rhs shape, dimension numbers): valid ones with batch dims,
# contraction on non-last axes, several contracting dims, no contraction,
# and invalid ones, some of which a transpose-and-reshape would accept.
DIMS = [
    ((4, 40), (40, 3), (((1,), (0,)), ((), ()))),
    ((40, 4), (40, 3), (((0,), (0,)), ((), ()))),
    ((4, 40), (3, 40), (((1,), (1,)), ((), ()))),
    ((2, 4, 40), (2, 40, 3), (((2,), (1,)), ((0,), (0,)))),
    ((4, 2, 40), (40, 3, 2), (((2,), (0,)), ((1,), (2,)))),
    ((2, 5, 3, 6), (6, 4, 5, 3), (((2, 3), (3, 0)), ((1,), (2,)))),
    ((3, 5, 8), (8, 3, 5), (((1, 2), (2, 0)), ((), ()))),
    ((2, 3, 4), (4, 2, 5), (((2,), (0,)), ((0,), (1,)))),
    ((4, 3), (5, 2), (((), ()), ((), ()))),               # an outer product
    ((2, 4), (2, 4), (((1,), (1,)), ((0,), (0,)))),       # no free dims
    # Invalid: sizes (2, 3) against (3, 2), equal products.
    ((2, 3, 4), (3, 2, 5), (((0, 1), (0, 1)), ((), ()))),
    ((2, 3, 5), (3, 2, 5), (((2,), (2,)), ((0, 1), (0, 1)))),
    ((4, 6), (6, 4), (((1,), (1,)), ((), ()))),
    ((4, 6), (6, 3), (((1,), (0, 1)), ((), ()))),         # unequal lengths
    ((4, 6), (6, 3), (((1, 1), (0, 0)), ((), ()))),       # duplicates
    ((4, 6), (6, 3), (((-1,), (0,)), ((), ()))),          # negative
    ((4, 6), (6, 3), (((2,), (0,)), ((), ()))),           # out of range
    ((2, 4, 6), (2, 6, 3), (((2,), (1,)), ((0,), ()))),   # batch lengths
    ((2, 4, 6), (2, 6, 3), (((2,), (1,)), ((2,), (1,)))),  # batch = contract
]

RECIPES = {
    "tensor": fp8.CurrentScaling(),
    "row": fp8.CurrentScaling(granularity="row"),
    "block": fp8.CurrentScaling(granularity="block", block_size=4),
    "mx": fp8.MXFP8(),
}


def _lax_error(lhs, rhs, dims) -> str | None:
  try:
    jax.eval_shape(lambda a, b: jax.lax.dot_general(a, b, dims), lhs, rhs)
  except TypeError as e:
    return str(e)
  return None


@pytest.mark.parametrize("case", range(len(DIMS)))
@pytest.mark.parametrize("name", list(RECIPES))
def test_dimension_numbers_are_checked_and_computed_as_lax_does(name, case):
  lhs_shape, rhs_shape, dims = DIMS[case]
  rng = np.random.default_rng(case)
  x = jnp.asarray(rng.standard_normal(lhs_shape), jnp.float32)
  w = jnp.asarray(rng.standard_normal(rhs_shape), jnp.float32)
  dot = fp8.dot_general(RECIPES[name])
  refused = _lax_error(x, w, dims)
  if refused is not None:
    with pytest.raises(TypeError) as info:
      jax.jit(lambda a, b: dot(a, b, dims))(x, w)
    assert refused in str(info.value)
    return
  want = jax.lax.dot_general(x, w, dims,
                             precision=jax.lax.Precision.HIGHEST)
  cot = jnp.cos(want)
  loss = lambda f: lambda a, b: jnp.sum(f(a, b, dims) * cot)

  @jax.jit
  def run(a, b):
    return dot(a, b, dims), jax.grad(loss(dot), (0, 1))(a, b)

  got, (gx, gw) = run(x, w)
  assert got.shape == want.shape and got.dtype == want.dtype
  # Relative to sum |x||w| (cancellation aside): E4M3's rounding, 2**-4 per
  # operand.
  scale = jax.lax.dot_general(jnp.abs(x), jnp.abs(w), dims)
  assert float(jnp.max(jnp.abs(got - want) / scale)) < 0.13
  rx, rw = jax.grad(loss(jax.lax.dot_general), (0, 1))(x, w)
  assert gx.shape == x.shape and gw.shape == w.shape
  for g, r in ((gx, rx), (gw, rw)):
    err = float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r))
    assert err < 0.2, err
