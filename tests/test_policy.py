"""Tests for jmp_lite.policy: Policy casting, get_policy grammar, errors."""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite
from tests.conftest import assert_dtype, FLOAT_DTYPE_IDS, FLOAT_DTYPES

ALL_FLOATS = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64]


@pytest.mark.parametrize("src", FLOAT_DTYPES, ids=FLOAT_DTYPE_IDS)
@pytest.mark.parametrize("dst", FLOAT_DTYPES, ids=FLOAT_DTYPE_IDS)
@pytest.mark.parametrize("method", ["param", "compute", "output"])
def test_casts_floating_jax_leaves(src, dst, method, variant):
  policy = jmp_lite.Policy(jnp.float32, jnp.float32, jnp.float32)
  policy = getattr(policy, f"with_{method}_dtype")(dst)
  cast = variant(getattr(policy, f"cast_to_{method}"))
  tree = {"a": jnp.arange(4, dtype=src) / 3, "b": [jnp.ones((2, 2), src)]}
  out = cast(tree)
  for leaf, ref in zip(jax.tree.leaves(out), jax.tree.leaves(tree),
                       strict=True):
    assert isinstance(leaf, jax.Array)
    assert_dtype(leaf, dst)
    np.testing.assert_array_equal(
        np.asarray(leaf, np.float32), np.asarray(ref.astype(dst), np.float32))


@pytest.mark.parametrize("dst", FLOAT_DTYPES, ids=FLOAT_DTYPE_IDS)
def test_numpy_stays_numpy(dst):
  policy = jmp_lite.Policy(dst, dst, dst)
  out = policy.cast_to_compute({"x": np.ones(3, np.float32),
                                "s": np.float32(2.0)})
  assert type(out["x"]) is np.ndarray
  assert_dtype(out["x"], dst)
  assert isinstance(out["s"], np.generic)
  assert_dtype(out["s"], dst)


def test_non_floating_leaves_pass_through_untouched(variant):
  policy = jmp_lite.get_policy("bf16")
  obj = object()
  ints = jnp.arange(3)
  bools = jnp.array([True, False])
  cplx = jnp.ones(2, jnp.complex64)
  f0 = np.zeros((2,), jax.dtypes.float0)
  tree = {"i": ints, "b": bools, "c": cplx, "n": None, "py": 1.5, "pyi": 3}
  out = variant(policy.cast_to_compute)(tree)
  assert_dtype(out["i"], jnp.int32)
  assert_dtype(out["b"], jnp.bool_)
  assert_dtype(out["c"], jnp.complex64)
  assert out["n"] is None
  # Eagerly, non-array leaves come back as the very same objects.
  eager = policy.cast_to_compute({"o": obj, "py": 1.5, "f0": f0, "i": ints})
  assert eager["o"] is obj and eager["py"] == 1.5 and eager["f0"] is f0
  assert eager["i"] is ints


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=FLOAT_DTYPE_IDS)
def test_leaf_already_in_target_dtype_is_returned_as_is(dtype):
  policy = jmp_lite.Policy(dtype, dtype, dtype)
  x = jnp.ones(3, dtype)
  y = np.ones(3, dtype)
  assert policy.cast_to_compute(x) is x
  assert policy.cast_to_param(y) is y
  # ...and no convert op is traced.
  jaxpr = jax.make_jaxpr(policy.cast_to_output)(x)
  assert not any(e.primitive.name == "convert_element_type"
                 for e in jaxpr.eqns)


def test_policy_canonicalises_dtypes_and_is_hashable():
  a = jmp_lite.Policy(jnp.float32, "bf16", np.dtype("float16"))
  b = jmp_lite.Policy(np.float32, jnp.bfloat16, jnp.float16)
  assert a == b and hash(a) == hash(b)
  assert a.compute_dtype == np.dtype(jnp.bfloat16)
  # Usable as a static argument to jit.
  f = jax.jit(lambda x, p: p.cast_to_compute(x), static_argnums=1)
  assert_dtype(f(jnp.ones(2), a), jnp.bfloat16)


def test_policy_is_frozen():
  policy = jmp_lite.get_policy("f32")
  with pytest.raises(AttributeError):
    policy.compute_dtype = jnp.bfloat16


@pytest.mark.parametrize("bad", [jnp.int32, jnp.bool_, jnp.complex64, "int8"])
@pytest.mark.parametrize("field", ["param_dtype", "compute_dtype",
                                   "output_dtype"])
def test_policy_rejects_non_float_dtypes(bad, field):
  kwargs = dict(param_dtype=jnp.float32, compute_dtype=jnp.float32,
                output_dtype=jnp.float32)
  kwargs[field] = bad
  err = ValueError if isinstance(bad, str) else TypeError
  with pytest.raises(err, match="float32 .f32, fp32, full."):
    jmp_lite.Policy(**kwargs)


@pytest.mark.parametrize("field", ["param_dtype", "compute_dtype",
                                   "output_dtype"])
def test_policy_refuses_float0_naming_it(field):
  """A float0 policy said "got void" (numpy's name for float0)."""
  kwargs = dict(param_dtype=jnp.float32, compute_dtype=jnp.float32,
                output_dtype=jnp.float32)
  kwargs[field] = jax.dtypes.float0
  with pytest.raises(TypeError, match=rf"{field} must be a floating dtype.*"
                     r"got jax.dtypes.float0, the dtype of integer params'"
                     r" gradients"):
    jmp_lite.Policy(**kwargs)


# "half" is the backend's half dtype (jmp_lite.half_dtype()).
_HALF = jmp_lite.dtypes.canonical_name(jmp_lite.half_dtype())


@pytest.mark.parametrize("name,expected", [
    ("f32", ("f32", "f32", "f32")),
    ("full", ("f32", "f32", "f32")),
    ("fp32", ("f32", "f32", "f32")),
    ("float32", ("f32", "f32", "f32")),
    ("bf16", ("bf16", "bf16", "bf16")),
    ("bfloat16", ("bf16", "bf16", "bf16")),
    ("f16", ("f16", "f16", "f16")),
    ("fp16", ("f16", "f16", "f16")),
    ("float16", ("f16", "f16", "f16")),
    ("f64", ("f64", "f64", "f64")),
    ("float64", ("f64", "f64", "f64")),
    ("half", (_HALF, _HALF, _HALF)),   # f16 on the CPU, bf16 on an H100.
    ("c=bf16", ("f32", "bf16", "bf16")),
    ("p=f16", ("f16", "f16", "f16")),
    ("o=f16", ("f32", "f32", "f16")),
    ("p=f32,c=bf16,o=f32", ("f32", "bf16", "f32")),
    ("params=float32,compute=bfloat16,output=float32", ("f32", "bf16", "f32")),
    ("p=f16,c=bf16", ("f16", "bf16", "bf16")),
    (" p = f32 , c = half ", ("f32", _HALF, _HALF)),
    ("P=F32,C=BF16", ("f32", "bf16", "bf16")),
    ("c=float8_e4m3fn", ("f32", "float8_e4m3fn", "float8_e4m3fn")),
])
def test_get_policy_grammar(name, expected):
  policy = jmp_lite.get_policy(name)
  names = tuple(jmp_lite.dtypes.canonical_name(d) for d in
                (policy.param_dtype, policy.compute_dtype, policy.output_dtype))
  assert names == expected


_DTYPE_NAMES = ["f32", "bf16", "f16", "f64", "float8_e5m2"]


@hypothesis.given(st.sampled_from(_DTYPE_NAMES), st.sampled_from(_DTYPE_NAMES),
                  st.sampled_from(_DTYPE_NAMES))
def test_str_round_trips_through_get_policy(p, c, o):
  policy = jmp_lite.Policy(p, c, o)
  text = str(policy)
  assert text == f"p={p},c={c},o={o}"
  assert jmp_lite.get_policy(text) == policy


@pytest.mark.parametrize("name,err,match", [
    ("x=f32", ValueError, r"Unknown key 'x'.*'params' \(or 'p'\)"),
    ("p=f17", ValueError, r"'p=f17'.*Unknown dtype 'f17'.*bfloat16 \(bf16\)"),
    ("f17", ValueError, r"Unknown dtype 'f17'; expected one of"),
    ("f", ValueError, r"Unknown dtype 'f'"),
    ("p=f32,params=bf16", ValueError, r"Duplicated key 'params'"),
    ("p=f32,,c=bf16", ValueError, r"Empty part"),
    ("p=f32,", ValueError, r"Empty part"),
    ("", ValueError, r"Empty policy"),
    ("p=f32=bf16", ValueError, r"Malformed part 'p=f32=bf16'"),
    ("f32,c=bf16", ValueError, r"Malformed part 'f32'"),
    ("c=int8", ValueError, r"Unknown dtype 'int8'"),
    ("c=bool", ValueError, r"Unknown dtype 'bool'"),
    # numpy reads ',' as a struct spec: a SyntaxError escaped before.
    (",", ValueError, r"Unknown dtype ','"),
    (" , ", ValueError, r"Unknown dtype ' , '"),
    (",f16", ValueError, r"Unknown dtype ',f16'"),
    (None, TypeError, r"expects a string"),
    (jnp.float32, TypeError, r"expects a string"),
])
def test_get_policy_errors(name, err, match):
  with pytest.raises(err, match=match):
    jmp_lite.get_policy(name)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=FLOAT_DTYPE_IDS)
def test_cast_to_full_and_half(dtype, variant):
  tree = {"w": jnp.ones(3, dtype), "i": jnp.arange(2)}
  full = variant(jmp_lite.cast_to_full)(tree)
  half = variant(jmp_lite.cast_to_half)(tree)
  assert_dtype(full["w"], jnp.float32)
  assert_dtype(half["w"], jmp_lite.half_dtype())
  assert_dtype(full["i"], jnp.int32)
  assert_dtype(half["i"], jnp.int32)


@hypothesis.settings(deadline=None, max_examples=60)
@hypothesis.given(
    leaves=st.lists(st.sampled_from(
        ["f32", "bf16", "f16", "f64np", "i32", "bool", "c64", "none", "py"]),
        min_size=0, max_size=6),
    target=st.sampled_from(["f32", "bf16", "f16"]),
)
def test_casting_rules_property(leaves, target):
  """Only floating array leaves change, and only their dtype."""
  makers = {
      "f32": lambda: jnp.linspace(-2, 2, 5, dtype=jnp.float32),
      "bf16": lambda: jnp.linspace(-2, 2, 5, dtype=jnp.bfloat16),
      "f16": lambda: jnp.linspace(-2, 2, 5, dtype=jnp.float16),
      "f64np": lambda: np.linspace(-2, 2, 5),
      "i32": lambda: jnp.arange(5),
      "bool": lambda: jnp.ones(5, bool),
      "c64": lambda: jnp.ones(5, jnp.complex64),
      "none": lambda: None,
      "py": lambda: 0.25,
  }
  tree = [makers[k]() for k in leaves]
  policy = jmp_lite.get_policy(target)
  out = policy.cast_to_compute(tree)
  for kind, before, after in zip(leaves, tree, out, strict=True):
    if kind in ("f32", "bf16", "f16", "f64np"):
      assert type(after) is type(before)
      assert_dtype(after, policy.compute_dtype)
      np.testing.assert_allclose(np.asarray(after, np.float32),
                                 np.asarray(before, np.float32), rtol=1e-2)
    else:
      assert after is before
