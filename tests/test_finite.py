"""Tests for jmp_lite.finite: all_finite and select_tree."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite
from tests.conftest import assert_dtype, FLOAT_DTYPE_IDS, FLOAT_DTYPES

# FP8 too: JAX refuses to promote it implicitly (e4m3fn has no inf at all,
# so an inf written to it is NaN).
ALL = FLOAT_DTYPES + [jnp.float64, jnp.complex64, jnp.float8_e4m3fn,
                      jnp.float8_e5m2]
ALL_IDS = FLOAT_DTYPE_IDS + ["f64", "c64", "e4m3fn", "e5m2"]


def _tree(dtype):
  return {"a": jnp.ones((4, 3), dtype), "b": [jnp.zeros(5, dtype)],
          "c": jnp.arange(3), "d": None}


@pytest.mark.parametrize("dtype", ALL, ids=ALL_IDS)
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan],
                         ids=["+inf", "-inf", "nan"])
@pytest.mark.parametrize("where", ["a", "b"])
def test_detects_nonfinite_in_any_leaf(dtype, bad, where, variant):
  with jax.enable_x64(dtype == jnp.float64):
    _check_detects(dtype, bad, where, variant)


def _check_detects(dtype, bad, where, variant):
  tree = _tree(dtype)
  f = variant(jmp_lite.all_finite)
  out = f(tree)
  assert_dtype(out, jnp.bool_)
  assert out.shape == ()
  assert bool(out)
  if where == "a":
    tree["a"] = tree["a"].at[2, 1].set(bad)
  else:
    tree["b"][0] = tree["b"][0].at[4].set(bad)
  assert not bool(f(tree))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + [jnp.float64],
                         ids=FLOAT_DTYPE_IDS + ["f64"])
def test_no_false_positive_for_large_finite_values(dtype, variant):
  with jax.enable_x64(dtype == jnp.float64):
    big = jnp.finfo(dtype).max
    # Many maximal values: any sum or norm of them would overflow to inf.
    tree = {"x": jnp.full((1000,), big, dtype),
            "y": -jnp.full((7,), big, dtype)}
    assert bool(variant(jmp_lite.all_finite)(tree))


def test_ignores_non_floating_leaves_and_empty_trees(variant):
  f = variant(jmp_lite.all_finite)
  assert bool(f({}))
  assert bool(f([]))
  assert bool(f({"i": jnp.array([1, 2]), "b": jnp.array([True])}))
  assert bool(jmp_lite.all_finite(
      {"f0": np.zeros(3, jax.dtypes.float0), "py": 3, "n": None}))


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan"),
                                 complex(0, float("nan"))])
def test_python_number_leaves_are_checked(bad, variant):
  # A Python float is a number: an inf there is no finite gradient.
  assert not bool(jmp_lite.all_finite({"py": bad, "w": jnp.ones(2)}))
  assert not bool(variant(lambda w: jmp_lite.all_finite([w, bad]))(
      jnp.ones(2)))
  assert bool(jmp_lite.all_finite({"py": 1.5, "c": 1j}))


def test_string_leaves_are_refused():
  with pytest.raises(TypeError, match="got a str leaf: 'abc'"):
    jmp_lite.all_finite({"name": "abc"})


def test_numpy_leaves():
  assert not bool(jmp_lite.all_finite([np.array([1.0, np.nan], np.float32)]))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=FLOAT_DTYPE_IDS)
def test_select_tree(dtype, variant):
  f0 = np.zeros((), jax.dtypes.float0)
  a = {"w": jnp.ones(3, dtype), "i": jnp.array(1), "f0": f0}
  b = {"w": jnp.zeros(3, dtype), "i": jnp.array(2), "f0": f0}
  sel = variant(jmp_lite.select_tree)
  t = sel(jnp.array(True), a, b)
  f = sel(jnp.array(False), a, b)
  assert_dtype(t["w"], dtype)
  np.testing.assert_array_equal(np.asarray(t["w"], np.float32), 1.0)
  np.testing.assert_array_equal(np.asarray(f["w"], np.float32), 0.0)
  assert int(t["i"]) == 1 and int(f["i"]) == 2


def test_select_tree_passes_identical_static_leaves():
  out = jmp_lite.select_tree(True, {"n": None, "s": "x", "w": jnp.ones(1)},
                             {"n": None, "s": "x", "w": jnp.zeros(1)})
  assert out["s"] == "x" and out["n"] is None


@pytest.mark.parametrize("pred,err,match", [
    (jnp.array([True, False]), ValueError, "shape"),
    (jnp.array(1), TypeError, "dtype int32"),
    (1.0, TypeError, "pred must be a scalar bool"),
])
def test_select_tree_bad_predicate(pred, err, match):
  with pytest.raises(err, match=match):
    jmp_lite.select_tree(pred, jnp.ones(1), jnp.zeros(1))


def test_select_tree_mismatches():
  with pytest.raises(ValueError, match="one structure"):
    jmp_lite.select_tree(True, {"a": jnp.ones(1)}, {"b": jnp.ones(1)})
  with pytest.raises(TypeError, match=r"dtypes differ at \['a'\]"):
    jmp_lite.select_tree(True, {"a": jnp.ones(1)},
                         {"a": jnp.ones(1, jnp.bfloat16)})
  with pytest.raises(ValueError, match="shapes differ"):
    jmp_lite.select_tree(True, {"a": jnp.ones(1)}, {"a": jnp.ones(2)})
  with pytest.raises(TypeError, match="non-array leaves"):
    jmp_lite.select_tree(True, {"a": "x"}, {"a": "y"})


@pytest.mark.parametrize("leaf", [
    np.array([1.0, np.nan], dtype=object),
    np.array([1.0, 2.0], dtype=object),
    np.array(["1.0"]),
    np.array(["2026-01-01"], dtype="datetime64[D]"),
], ids=["object-nan", "object-finite", "str", "datetime"])
def test_arrays_of_no_numeric_dtype_are_refused(leaf):
  """A NumPy object array holding NaN counted as finite (only floating
  leaves were read), and scaling passed it through unscaled: refused, a
  decision documented in docs/refusals.md (even when its elements are
  finite floats, which the caller converts)."""
  with pytest.raises(TypeError, match=r"all_finite expects numeric arrays,"
                     rf" got an array of dtype {re.escape(str(leaf.dtype))}"
                     r".*np.asarray"):
    jmp_lite.all_finite({"w": jnp.ones(2), "o": leaf})
  with pytest.raises(TypeError, match="A loss scale expects numeric arrays"):
    jmp_lite.StaticLossScale(2.0).unscale({"o": leaf})
  with pytest.raises(TypeError, match="nonfinite_counts expects numeric"):
    jmp_lite.nonfinite_counts({"o": leaf})
  # Converted, the same values are read.
  if leaf.dtype == object:
    assert bool(jmp_lite.all_finite(np.asarray(leaf, np.float32))) == bool(
        np.isfinite(np.asarray(leaf, np.float64)).all())


def test_typed_prng_keys_are_not_refused():
  """nnx models carry typed keys in their state; all_finite skips them
  (they hold no floating values) while it refuses NumPy object arrays."""
  tree = {"key": jax.random.key(0), "w": jnp.ones(2)}
  assert bool(jmp_lite.all_finite(tree))
  with pytest.raises(TypeError, match="expects numeric arrays"):
    jmp_lite.all_finite({"o": np.array([np.nan], dtype=object)})
