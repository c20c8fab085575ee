"""Tests for jmp_lite.autocast: op-level re-typing by rule."""

from __future__ import annotations

import functools
from collections.abc import Callable

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jmp_lite
from tests.conftest import assert_dtype

HALF = [jnp.bfloat16, jnp.float16]
# Per-dtype tolerances against float32 (bfloat16 has 8 mantissa bits).
TOL = {jnp.bfloat16: 5e-2, jnp.float16: 1e-2}


def _eqn_dtypes(jaxpr, name):
  """The float input dtypes of every ``name`` equation, recursively."""
  out = []

  def walk(j):
    for eqn in j.eqns:
      if eqn.primitive.name == name:
        out.append(tuple(str(v.aval.dtype) for v in eqn.invars
                         if jnp.issubdtype(v.aval.dtype, jnp.floating)))
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)

  walk(jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr)
  return out


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.gelu(nn.Dense(32)(x))
    return nn.Dense(4)(x)


class CNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(8, (3, 3))(x))
    x = nn.LayerNorm()(x)
    return nn.Dense(3)(x.mean(axis=(1, 2)))


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    h = nn.MultiHeadDotProductAttention(num_heads=2)(h, h)
    x = x + h
    return x + nn.Dense(16)(nn.gelu(nn.Dense(32)(nn.LayerNorm()(x))))


MODELS = {
    "mlp": (MLP(), lambda: jnp.asarray(
        np.random.default_rng(0).standard_normal((8, 16)), jnp.float32)),
    "cnn": (CNN(), lambda: jnp.asarray(
        np.random.default_rng(0).standard_normal((2, 8, 8, 3)), jnp.float32)),
    "block": (Block(), lambda: jnp.asarray(
        np.random.default_rng(0).standard_normal((2, 5, 16)), jnp.float32)),
}


@functools.cache  # Shared by both half dtypes: eager init compiles per op.
def _model_case(name):
  model, make_x = MODELS[name]
  x = make_x()
  return model, x, jax.jit(model.init)(jax.random.key(0), x)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("half", HALF, ids=["bf16", "f16"])
def test_models_dtypes_outputs_and_grads(name, half):
  model, x, params = _model_case(name)

  def loss(params, x):
    out = model.apply(params, x)
    return jnp.mean(jax.nn.log_softmax(out) ** 2)

  cast = jmp_lite.autocast(loss, half)
  jaxpr = jax.make_jaxpr(cast)(params, x)
  hname = np.dtype(half).name
  matmuls = _eqn_dtypes(jaxpr, "dot_general") + _eqn_dtypes(
      jaxpr, "conv_general_dilated")
  assert matmuls and all(d == (hname, hname) for d in matmuls), matmuls
  for deny in ("exp", "log", "reduce_sum", "rsqrt"):
    for dtypes in _eqn_dtypes(jaxpr, deny):
      assert all(d == "float32" for d in dtypes), (deny, dtypes)
  assert _eqn_dtypes(jaxpr, "exp")
  # The float32 reference under jit: eagerly each of its ops compiles alone.
  ref, ref_grads = jax.jit(jax.value_and_grad(loss))(params, x)
  # Eagerly every op of the model compiles alone (about 2 s for the block);
  # eager and jit interpret the same jaxpr whatever the half dtype, so the
  # eager run is for bfloat16 only.
  fns = (cast, jax.jit(cast)) if half == jnp.bfloat16 else (jax.jit(cast),)
  for fn in fns:
    val, grads = jax.value_and_grad(fn)(params, x)
    assert_dtype(val, jnp.float32)
    np.testing.assert_allclose(float(val), float(ref), rtol=TOL[half])
    chex.assert_trees_all_equal_dtypes(grads, ref_grads)
    chex.assert_trees_all_close(grads, ref_grads, rtol=10 * TOL[half],
                                atol=TOL[half] * 0.1)


@jax.custom_vjp
def _scaled_sin(x):
  return jnp.sin(x) * 2


_scaled_sin.defvjp(lambda x: (_scaled_sin(x), jnp.cos(x)),
                   lambda c, g: (2 * c * g,))


def _kitchen_sink(x, w):
  h = jax.nn.relu(x @ w)                                   # custom_jvp
  h = jax.lax.scan(lambda c, a: (c + jnp.tanh(a @ w), None),
                   jnp.zeros(w.shape[1]), h)[0]            # scan
  h = jax.checkpoint(lambda t: jnp.exp(t * 0.1) @ w)(h)    # remat
  h = jax.lax.cond(h.sum() > 0, lambda t: t * 2, lambda t: t @ w, h)
  h = jax.lax.switch(1, [lambda t: t, lambda t: t @ w], h)
  h = jax.jit(lambda q: jax.nn.softmax(q @ w))(h)          # nested jit
  h = _scaled_sin(h)                                       # custom_vjp
  return optax.softmax_cross_entropy(h[None] * 3, jnp.array([[1., 0, 0]])).sum()


def _xw():
  rng = np.random.default_rng(0)
  return (jnp.asarray(rng.standard_normal((4, 3)), jnp.float32),
          jnp.asarray(rng.standard_normal((3, 3)), jnp.float32))


@pytest.mark.parametrize("half", HALF, ids=["bf16", "f16"])
def test_recurses_into_control_flow_and_custom_rules(half):
  x, w = _xw()
  g = jmp_lite.autocast(_kitchen_sink, half)
  jaxpr = jax.make_jaxpr(g)(x, w)
  dots = _eqn_dtypes(jaxpr, "dot_general")
  assert len(dots) == 6  # Top level, scan, remat, cond, switch and jit.
  hname = np.dtype(half).name
  assert all(d == (hname, hname) for d in dots), dots
  ref = jax.jit(_kitchen_sink)(x, w)
  for fn in (g, jax.jit(g)):
    np.testing.assert_allclose(float(fn(x, w)), float(ref), rtol=TOL[half])
  # Gradients and vmap under jit: the eager call above already runs the
  # interpreted jaxpr op by op (each op compiling alone, seconds in all).
  grads = jax.jit(jax.grad(g, argnums=1))(x, w)
  ref_grads = jax.jit(jax.grad(_kitchen_sink, argnums=1))(x, w)
  assert_dtype(grads, jnp.float32)
  np.testing.assert_allclose(grads, ref_grads, rtol=20 * TOL[half],
                             atol=TOL[half])
  batched = jax.jit(jax.vmap(g, in_axes=(0, None)))(jnp.stack([x, 2 * x]), w)
  ref_batched = jax.jit(jax.vmap(_kitchen_sink, in_axes=(0, None)))(
      jnp.stack([x, 2 * x]), w)
  np.testing.assert_allclose(batched, ref_batched, rtol=TOL[half])


def test_while_loop_and_shard_map():
  x, w = _xw()
  loop = lambda h: jax.lax.while_loop(
      lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] @ w), (0, h))[1]
  out = jmp_lite.autocast(loop, "bf16")(x)
  assert_dtype(out, jnp.float32)
  ref_loop = loop(x)
  np.testing.assert_allclose(out, ref_loop, rtol=5e-2,
                             atol=1e-2 * float(jnp.abs(ref_loop).max()))
  assert jmp_lite.autocast_audit(loop, "bf16", x).matmul_flops() == {
      "bfloat16": 72.0}
  mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  sm = jax.shard_map(lambda a: jax.lax.psum(jnp.exp(a @ a.T), "d"),
                     mesh=mesh, in_specs=P("d"), out_specs=P())
  g = jmp_lite.autocast(sm, "bf16")
  ref = sm(x)
  np.testing.assert_allclose(jax.jit(g)(x), ref, rtol=5e-2,
                             atol=1e-2 * float(jnp.abs(ref).max()))
  audit = jmp_lite.autocast_audit(sm, "bf16", x)
  assert [(r.primitive, r.dtype) for r in audit.records
          if r.primitive in ("dot_general", "exp")] == [
              ("dot_general", "bfloat16"), ("exp", "float32")]
  ref_grad = jax.grad(lambda a: sm(a).sum())(x)
  np.testing.assert_allclose(jax.grad(lambda a: g(a).sum())(x), ref_grad,
                             rtol=5e-2,
                             atol=1e-2 * float(jnp.abs(ref_grad).max()))


def test_int_bool_float64_untouched_and_output_dtypes():
  def f(x, i, b, d):
    return x @ x.T, i * 2, ~b, d * 2.0, (x.sum() > 0)

  x = jnp.ones((2, 2))
  i, b = jnp.arange(3), jnp.array([True, False])
  with jax.enable_x64(True):
    d = jnp.ones(2, jnp.float64)
    outs = jmp_lite.autocast(f, "bf16")(x, i, b, d)
    jaxpr = jax.make_jaxpr(jmp_lite.autocast(f, "bf16"))(x, i, b, d)
  assert [o.dtype for o in outs] == [jnp.float32, jnp.int32, jnp.bool_,
                                     jnp.float64, jnp.bool_]
  assert _eqn_dtypes(jaxpr, "dot_general") == [("bfloat16", "bfloat16")]
  # The float64 multiply stays float64.
  assert ("float64",) in [d[:1] for d in _eqn_dtypes(jaxpr, "mul")]


def test_custom_lists_change_the_result_as_documented():
  x, w = _xw()
  f = lambda x, w: jnp.exp(x @ w).sum()
  cast = lambda **kw: jmp_lite.autocast(f, "bf16", **kw)
  deny_dot = jax.make_jaxpr(cast(deny=["dot_general"]))(x, w)
  assert _eqn_dtypes(deny_dot, "dot_general") == [("float32", "float32")]
  allow_exp = jax.make_jaxpr(cast(allow=[jax.lax.exp_p]))(x, w)
  assert _eqn_dtypes(allow_exp, "exp") == [("bfloat16",)]
  bare = jax.make_jaxpr(cast(use_default_lists=False))(x, w)
  assert _eqn_dtypes(bare, "dot_general") == [("float32", "float32")]
  # Values: deny reproduces float32 exactly, the default does not.
  assert float(cast(deny=["dot_general"])(x, w)) == float(f(x, w))
  assert float(jmp_lite.autocast(f, "bf16")(x, w)) != float(f(x, w))


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(allow=["not_a_prim"]), ValueError, "unknown primitive 'not_a_prim'"),
    (dict(allow=["dot_generl"]), ValueError, r"did you mean \['dot_general'"),
    (dict(deny=["scan"]), ValueError, "higher-order primitive"),
    (dict(allow=["shift_left"]), ValueError, "only on integers"),
    (dict(allow=["exp"], deny=["exp"]), ValueError, "both allow and deny"),
    (dict(allow=[3]), TypeError, "primitive names or jax primitives"),
    (dict(exclude_scopes="loss"), TypeError, "sequence of scope names"),
    (dict(deny="tanh"), TypeError, r"wrap the one given in a list: \['tanh'\]"),
    (dict(allow=jax.lax.exp_p), TypeError, "deny|allow takes a list"),
])
def test_bad_lists(kwargs, err, match):
  with pytest.raises(err, match=match):
    jmp_lite.autocast(lambda x: x, "bf16", **kwargs)


def test_policy_string_gives_its_compute_dtype():
  f = lambda a: a @ a  # noqa: E731
  audit = jmp_lite.autocast_audit(f, "p=f32,c=bf16,o=f32", jnp.ones((2, 2)))
  assert [(r.primitive, str(r.dtype)) for r in audit.records] == [
      ("dot_general", "bfloat16")]
  assert jmp_lite.autocast(f, "p=f32,c=bf16,o=f32")(jnp.ones((2, 2))).dtype \
      == jnp.float32


def test_bad_dtype_and_callable():
  with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
    jmp_lite.autocast(lambda x: x, "f64")
  with pytest.raises(TypeError, match="compute_dtype|policy_or_dtype"):
    jmp_lite.autocast(lambda x: x, jnp.int8)
  with pytest.raises(TypeError, match="expects a callable"):
    jmp_lite.autocast(3, "bf16")


def test_scopes_exclude_and_force():
  def f(x):
    with jax.named_scope("keep"):
      a = x @ x
    with jax.named_scope("hot"):
      b = jnp.exp(x)
    with jmp_lite.float32_region():
      c = x @ x
    with jmp_lite.half_region():
      d = jnp.exp(x)
    return a, b, c, d

  x = jnp.ones((2, 2))
  jaxpr = jax.make_jaxpr(jmp_lite.autocast(
      f, "bf16", exclude_scopes=["keep"], force_scopes=["hot"]))(x)
  assert _eqn_dtypes(jaxpr, "dot_general") == [("float32", "float32")] * 2
  assert _eqn_dtypes(jaxpr, "exp") == [("bfloat16",)] * 2


def test_works_under_vmap_jit_grad_and_in_scan_of_autocast():
  x, w = _xw()
  f = lambda x: jnp.tanh(x @ w).sum()
  g = jmp_lite.autocast(f, "bf16")
  vg = jax.jit(jax.vmap(jax.grad(g)))(jnp.stack([x, x]))
  ref = jax.vmap(jax.grad(f))(jnp.stack([x, x]))
  np.testing.assert_allclose(vg, ref, rtol=5e-2, atol=1e-2)
  carry = jax.lax.scan(lambda c, a: (c + g(a), None), 0.0,
                       jnp.stack([x, x]))[0]
  np.testing.assert_allclose(carry, 2 * f(x), rtol=5e-2)


def test_python_arguments_stay_static():
  def f(x, scale, flag):
    return x * scale if flag else x
  g = jmp_lite.autocast(f, "bf16")
  np.testing.assert_allclose(g(jnp.ones(2), 3.0, True), 3.0)
  np.testing.assert_allclose(g(jnp.ones(2), 3.0, False), 1.0)


def test_audit_reports_flop_share():
  def f(x, w1, w2):
    with jmp_lite.float32_region():
      h = x @ w1                 # 2*4*8*8 = 512 FLOPs in float32
    return h @ w2                # 2*4*8*2 = 128 FLOPs in bfloat16

  audit = jmp_lite.autocast_audit(f, "bf16", jnp.ones((4, 8)),
                                  jnp.ones((8, 8)), jnp.ones((8, 2)))
  assert audit.matmul_flops() == {"float32": 512.0, "bfloat16": 128.0}
  assert audit.half_flop_fraction() == pytest.approx(0.2)
  assert "matmul/conv FLOPs in half precision: 20.0%" in str(audit)
  conv = jmp_lite.autocast_audit(
      lambda x, k: jax.lax.conv(x, k, (1, 1), "VALID"), "bf16",
      jnp.ones((1, 3, 5, 5)), jnp.ones((4, 3, 3, 3)))
  # 2 * out elements (1*4*3*3) * MACs per output (3*3*3).
  assert conv.matmul_flops() == {"bfloat16": 2.0 * 36 * 27}
  with pytest.raises(TypeError, match="Unknown autocast options"):
    jmp_lite.autocast_audit(f, "bf16", jnp.ones((4, 8)), jnp.ones((8, 8)),
                            jnp.ones((8, 2)), colour="red")


def test_o1_preset_combines_policy_and_autocast():
  from jmp_lite.presets import preset
  model, make_x = MODELS["mlp"]
  x = make_x()
  params = model.init(jax.random.key(0), x)
  fn = preset("O1", half="bf16").autocast(model.apply)
  assert_dtype(fn(params, x), jnp.float32)
  audit = jmp_lite.autocast_audit(model.apply, "bf16", params, x)
  assert audit.half_flop_fraction() == 1.0
  for leaf in jax.tree.leaves(params):
    assert_dtype(leaf, jnp.float32)  # float32 params


# Functions whose arguments hold more than arrays.

eqx = pytest.importorskip("equinox")


class EqxMLP(eqx.Module):
  """Equinox-tutorial style: layers in a list, activation a field."""

  layers: list
  activation: Callable
  name: str = eqx.field(static=True)
  depth: int

  def __init__(self, key, sizes=(6, 16, 3), name="mlp"):
    keys = jax.random.split(key, len(sizes) - 1)
    self.layers = [eqx.nn.Linear(i, o, key=k)
                   for i, o, k in zip(sizes[:-1], sizes[1:], keys, strict=True)]
    self.activation = jax.nn.relu
    self.name = name
    self.depth = len(self.layers)  # A Python int leaf.

  def __call__(self, x):
    for layer in self.layers[:-1]:
      x = self.activation(layer(x))
    return self.layers[-1](x)


class EqxCNN(eqx.Module):
  conv: eqx.nn.Conv2d
  head: eqx.nn.Linear
  norm: eqx.nn.LayerNorm
  pool: Callable

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.conv = eqx.nn.Conv2d(2, 4, kernel_size=3, key=k1)
    self.norm = eqx.nn.LayerNorm(4 * 4 * 4)
    self.head = eqx.nn.Linear(4 * 4 * 4, 3, key=k2)
    self.pool = jnp.ravel

  def __call__(self, x):
    return self.head(self.norm(self.pool(jax.nn.relu(self.conv(x)))))


@functools.cache  # Shared by both half dtypes: eager init compiles per op.
def _eqx_case(kind):
  rng = np.random.default_rng(1)
  if kind == "mlp":
    model = EqxMLP(jax.random.key(0))
    x = jnp.asarray(rng.standard_normal((5, 6)), jnp.float32)
  else:
    model = EqxCNN(jax.random.key(0))
    x = jnp.asarray(rng.standard_normal((5, 2, 6, 6)), jnp.float32)
  y = jnp.asarray(rng.standard_normal((5, 3)), jnp.float32)
  return model, x, y


def _eqx_loss(model, x, y):
  return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def _rel_err(a, b):
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("half", HALF, ids=["bf16", "f16"])
def test_equinox_module_arguments(kind, half):
  model, x, y = _eqx_case(kind)
  cast = jmp_lite.autocast(_eqx_loss, half)
  # The float32 references under jit: eagerly each op compiles alone.
  ref = eqx.filter_jit(_eqx_loss)(model, x, y)
  params, static = eqx.partition(model, eqx.is_array)
  by_jit = jax.jit(lambda p, x, y: cast(eqx.combine(p, static), x, y))
  for out in (cast(model, x, y), eqx.filter_jit(cast)(model, x, y),
              by_jit(params, x, y)):
    assert_dtype(out, jnp.float32)
    np.testing.assert_allclose(float(out), float(ref), rtol=TOL[half])
  # Gradients: eqx.filter_grad on the module, jax.grad on its arrays; the
  # error against float32 is half-precision noise (relative to the norm).
  ref_grads = eqx.filter(
      eqx.filter_jit(eqx.filter_grad(_eqx_loss))(model, x, y), eqx.is_array)
  grads = eqx.filter(eqx.filter_jit(eqx.filter_grad(cast))(model, x, y),
                     eqx.is_array)
  jax_grads = jax.jit(jax.grad(
      lambda p: cast(eqx.combine(p, static), x, y)))(params)
  bound = {jnp.bfloat16: 0.3, jnp.float16: 0.01}[half]
  for g in (grads, jax_grads):
    chex.assert_trees_all_equal_dtypes(g, ref_grads)
    errs = jax.tree.map(_rel_err, g, ref_grads)
    assert max(jax.tree.leaves(errs)) < bound, errs
  # The audit takes the module as it is; its matmuls ran in half precision.
  audit = jmp_lite.autocast_audit(_eqx_loss, half, model, x, y)
  hname = np.dtype(half).name
  mat = [r for r in audit.records
         if r.primitive in ("dot_general", "conv_general_dilated")]
  assert mat and all(r.input_dtypes == (hname, hname) for r in mat)
  assert {r.primitive for r in mat} == (
      {"dot_general", "conv_general_dilated"} if kind == "cnn"
      else {"dot_general"})
  assert audit.half_flop_fraction() == 1.0


def test_non_array_leaves_pass_through_and_outputs_may_hold_them():
  def f(params, config, x, *, scale, label):
    h = x @ params["w"] + params["b"]
    if config["act"] is not None:
      h = config["act"](h)
    return {"y": h * scale * config["n"], "label": label, "n": config["n"]}

  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.standard_normal((4, 3)), jnp.float32),
            "b": jnp.zeros(3, jnp.float32)}
  config = {"act": jax.nn.relu, "n": 2, "unused": None, "tag": "x"}
  x = jnp.asarray(rng.standard_normal((2, 4)), jnp.float32)
  g = jmp_lite.autocast(f, "bf16")
  want = f(params, config, x, scale=0.5, label="")["y"]
  out = g(params, config, x, scale=jnp.float32(0.5), label="out")
  assert out["label"] == "out" and out["n"] == 2
  # jax.jit itself takes and returns arrays only: the rest stays inside.
  jitted = jax.jit(lambda p, x, scale: g(p, config, x, scale=scale,
                                          label="out")["y"])
  for y in (out["y"], jitted(params, x, jnp.float32(0.5))):
    assert_dtype(y, jnp.float32)
    np.testing.assert_allclose(y, want, rtol=5e-2, atol=1e-2)
  # Arrays in keyword arguments are traced and re-typed like positional ones.
  jaxpr = jax.make_jaxpr(lambda w, s: g(
      {"w": w, "b": params["b"]}, config, x, scale=s, label="")["y"])(
          params["w"], jnp.float32(0.5))
  assert _eqn_dtypes(jaxpr, "dot_general") == [("bfloat16", "bfloat16")]
  grad = jax.grad(lambda s: g(params, config, x, scale=s, label="")["y"].sum())
  ref = jax.grad(lambda s: f(params, config, x, scale=s, label="")["y"].sum())
  np.testing.assert_allclose(grad(jnp.float32(0.5)), ref(jnp.float32(0.5)),
                             rtol=5e-2)


def test_typed_key_passes_through_untouched():
  def f(key, x):
    noise = jax.random.normal(key, x.shape)
    return jax.random.split(key)[0], x @ x.T + noise

  key, x = jax.random.key(3), jnp.ones((2, 2))
  g = jmp_lite.autocast(f, "bf16")
  ref_key, ref = f(key, x)
  for fn in (g, jax.jit(g)):
    new_key, out = fn(key, x)
    assert new_key.dtype == key.dtype  # key<fry>, never cast
    np.testing.assert_array_equal(jax.random.key_data(new_key),
                                  jax.random.key_data(ref_key))
    np.testing.assert_allclose(out, ref, rtol=1e-2)
  # The random bits and their float transform ran as written (float32).
  np.testing.assert_array_equal(
      jmp_lite.autocast(lambda k: jax.random.normal(k, (3,)), "bf16")(key),
      jax.random.normal(key, (3,)))
  records = jmp_lite.autocast_audit(f, "bf16", key, x).records
  assert any("key<fry>" in r.input_dtypes for r in records)


def test_float0_and_integer_arguments():
  def f(x, n, tangent_like):
    return (x * n).sum(), tangent_like

  x, n = jnp.ones(3), jnp.asarray(2, jnp.int32)
  z = np.zeros((3,), jax.dtypes.float0)
  g = jmp_lite.autocast(f, "bf16")
  for fn in (g, jax.jit(g)):
    out, passed = fn(x, n, z)
    assert_dtype(out, jnp.float32)
    assert passed.dtype == jax.dtypes.float0 and passed.shape == (3,)
  gx, gn = jax.grad(lambda x, n: g(x, n, z)[0], argnums=(0, 1),
                    allow_int=True)(x, n)
  assert gn.dtype == jax.dtypes.float0
  np.testing.assert_allclose(gx, 2.0 * np.ones(3))


def test_repeated_sub_computations_rewritten_once_and_audited_per_use():
  @jax.jit
  def proj(h, w):
    return jnp.tanh(h @ w)

  def f(x, w):
    for _ in range(3):
      x = jax.nn.relu(proj(x, w))  # One jaxpr object, three uses.
    return x.sum()

  x, w = _xw()
  jaxpr = jax.make_jaxpr(jmp_lite.autocast(f, "bf16"))(x, w)
  subs = []

  def walk(j):
    for eqn in j.eqns:
      if eqn.primitive.name in ("jit", "pjit") and eqn.params["name"] == "proj":
        subs.append(eqn.params["jaxpr"])
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub.jaxpr if hasattr(sub, "jaxpr") else sub)

  walk(jaxpr.jaxpr)
  assert len(subs) == 3 and all(s is subs[0] for s in subs[1:])
  assert _eqn_dtypes(jaxpr, "dot_general") == [("bfloat16", "bfloat16")] * 3
  # The audit still counts every call: 3 x 2*4*3*3 FLOPs.
  audit = jmp_lite.autocast_audit(f, "bf16", x, w)
  assert audit.matmul_flops() == {"bfloat16": 3 * 72.0}
  np.testing.assert_allclose(jmp_lite.autocast(f, "bf16")(x, w), f(x, w),
                             rtol=5e-2)


def test_rewritten_jaxprs_type_check():
  x, w = _xw()
  g = jmp_lite.autocast(_kitchen_sink, "bf16")
  cases = [(g, (x, w)), (jax.grad(g, argnums=1), (x, w)),
           (jax.vmap(g, in_axes=(0, None)), (jnp.stack([x, x]), w))]
  for fn, args in cases:
    jax.extend.core.check_jaxpr(jax.make_jaxpr(fn)(*args).jaxpr)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_gradient_matmuls_run_in_the_compute_dtype(dtype):
  """The backward pass's matmuls take compute-dtype cotangents, not float32."""
  from tests.models.harness import matmul_dtypes

  def loss(w1, w2, x):
    return jax.nn.logsumexp(jnp.tanh(x @ w1) @ w2, axis=-1).mean()

  args = (jnp.ones((8, 16)) * 0.1, jnp.ones((16, 4)) * 0.1, jnp.ones((2, 8)))
  half = np.dtype(dtype)
  grad = jax.grad(jmp_lite.autocast(loss, dtype), argnums=(0, 1))
  found = [d for _, d, _ in matmul_dtypes(jax.make_jaxpr(grad)(*args))]
  assert len(found) == 5 and set(found) == {(half, half)}, found
  # Asking for float32 results brings float32 cotangents back, as documented.
  wide = jax.grad(jmp_lite.autocast(loss, dtype, accumulate_in_float32=True),
                  argnums=(0, 1))
  found = {d for _, d, _ in matmul_dtypes(jax.make_jaxpr(wide)(*args))}
  assert (np.dtype(jnp.float32), half) in found
  # Same values as float32 within half-precision rounding.
  ref = jax.jit(jax.grad(loss, argnums=(0, 1)))(*args)
  chex.assert_trees_all_close(jax.jit(grad)(*args), ref, rtol=2e-2,
                              atol=2e-3)



@pytest.mark.parametrize("square", [jnp.square, lambda h: h ** 2],
                         ids=["square", "integer_pow"])
def test_norms_and_losses_of_representable_activations_do_not_overflow(
    square, variant):
  """Activations of 300 fit float16, their squares (90000) do not: squares
  run in float32, lax.square (jnp.square) as integer_pow (x ** 2) does.
  Before, RMS norms of such activations came out inf, and Flax's RMSNorm
  silently returned zeros."""
  w = jnp.eye(4) * 300.0
  x = jnp.array([[1.0, -1.0, 1.0, -1.0]])

  def rms(w, x):
    return jnp.sqrt(jnp.mean(square(x @ w)))

  def linen_rms_norm(w, x):
    m = nn.RMSNorm()
    return m.apply(m.init(jax.random.key(0), x), x @ w)

  got = variant(jmp_lite.autocast(rms, jnp.float16))(w, x)
  np.testing.assert_allclose(float(got), 300.0, rtol=1e-3)
  out = variant(jmp_lite.autocast(linen_rms_norm, jnp.float16))(w, x)
  np.testing.assert_allclose(np.abs(np.asarray(out, np.float32)), 1.0,
                             rtol=1e-2)


def _dots(closed):
  """``(operand dtypes, preferred_element_type, result dtype)`` of each
  ``dot_general``, sub-jaxprs included."""
  out = []

  def walk(j):
    for eqn in j.eqns:
      if eqn.primitive.name == "dot_general":
        out.append((tuple(str(v.aval.dtype) for v in eqn.invars),
                    str(np.dtype(eqn.params["preferred_element_type"])),
                    str(eqn.outvars[0].aval.dtype)))
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)

  walk(closed.jaxpr)
  return out


def test_float64_matmuls_run_as_in_plain_jax():
  """A float64 @ float32 matmul was rounded through bfloat16: its float32
  operand was cast and a bfloat16 product asked for. Equations that read or
  make float64 now run as written; the float32 matmul beside them does not."""
  def f(a, b, c):
    return (a @ b, jnp.matmul(b, c, preferred_element_type=jnp.float64),
            b @ c)

  with jax.enable_x64(True):
    a64 = jnp.full((1, 2), 1.0 + 2.0**-20, jnp.float64)
    b32 = jnp.full((2, 2), 1.0 + 2.0**-12, jnp.float32)
    c32 = jnp.ones((2, 1), jnp.float32)
    g = jmp_lite.autocast(f, "bf16")
    assert _dots(jax.make_jaxpr(g)(a64, b32, c32)) == [
        (("float64", "float32"), "float64", "float64"),
        (("float32", "float32"), "float64", "float64"),
        (("bfloat16", "bfloat16"), "bfloat16", "bfloat16")]
    for got, want in zip(g(a64, b32, c32)[:2], f(a64, b32, c32)[:2],
                         strict=True):
      assert_dtype(got, jnp.float64)
      np.testing.assert_array_equal(got, want)
    grad = jax.grad(lambda a, b: g(a, b, c32)[0].sum(), argnums=(0, 1))
    ref = jax.grad(lambda a, b: f(a, b, c32)[0].sum(), argnums=(0, 1))
    chex.assert_trees_all_equal(grad(a64, b32), ref(a64, b32))
    audit = jmp_lite.autocast_audit(f, "bf16", a64, b32, c32)
  assert [(r.category, r.dtype) for r in audit.records] == [
      ("original", "float64"), ("original", "float32"),
      ("lower", "bfloat16")]
  assert not jax.config.jax_enable_x64  # The context did not leak.


def test_audit_counts_scan_steps_and_marks_while_loops():
  """A scan body's matmuls were counted once, not once per step."""
  w, x = jnp.ones((8, 8)) * 0.1, jnp.ones((4, 8))  # one x @ w: 512 FLOPs

  def f(w, x):
    def outer(c, _):
      c, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), c, None,
                          length=3)
      return c, None
    c, _ = jax.lax.scan(outer, x, None, length=5)
    with jmp_lite.float32_region():
      return (c @ w).sum()

  audit = jmp_lite.autocast_audit(f, "bf16", w, x)
  assert audit.matmul_flops() == {"bfloat16": 15 * 512.0, "float32": 512.0}
  assert audit.half_flop_fraction() == pytest.approx(15 / 16)
  dots = [(r.dtype, r.repeats, r.flops) for r in audit.records
          if r.primitive == "dot_general"]
  assert dots == [("bfloat16", 15, 15 * 512.0), ("float32", 1, 512.0)]
  assert "dot_general              lower     bfloat16  15" in str(audit)
  # The same body in scans of different lengths: counted per scan.
  body = lambda c, _: (c @ w, None)  # noqa: E731
  twice = lambda x: jax.lax.scan(body, jax.lax.scan(body, x, None, 2)[0],  # noqa: E731
                                 None, 7)[0]
  assert jmp_lite.autocast_audit(twice, "bf16", x).matmul_flops() == {
      "bfloat16": 9 * 512.0}

  # A while loop's trip count is unknown when tracing: one run, marked.
  def loop(n, x):
    return jax.lax.fori_loop(0, n, lambda i, c: c @ w, x)

  audit = jmp_lite.autocast_audit(loop, "bf16", jnp.int32(4), x)
  (dot,) = [r for r in audit.records if r.primitive == "dot_general"]
  assert dot.in_while_loop and dot.repeats == 1 and dot.flops == 512.0
  assert "in while loops counted once per loop" in str(audit)
  assert "while loops" not in str(jmp_lite.autocast_audit(f, "bf16", w, x))


def _overflowing_loss(w, x):
  return jnp.tanh(x @ w).sum()  # The matmul overflows float16.


_OVERFLOW_LINE = _overflowing_loss.__code__.co_firstlineno + 1


@pytest.mark.parametrize("wrap", ["plain", "jit", "grad"])
def test_rewritten_equations_keep_the_users_source_location(wrap):
  """find_nonfinite and check_alignment pointed at jmp_lite/_jaxpr."""
  g = jmp_lite.autocast(_overflowing_loss, jnp.float16)
  g = {"plain": g, "jit": jax.jit(g), "grad": jax.grad(g)}[wrap]
  w, x = jnp.full((4, 4), 300.0), jnp.full((2, 4), 100.0)
  origin = jmp_lite.find_nonfinite(g, w, x)
  assert (origin.primitive, origin.dtype) == ("dot_general", "float16")
  where = f"test_autocast.py:{_OVERFLOW_LINE}:"
  assert where in origin.location and "_overflowing_loss" in origin.location
  found = jmp_lite.check_alignment(g, jnp.ones((3, 3)), jnp.ones((2, 3)))
  assert found and all(where in m.location for m in found), found
  # XLA's op metadata names the user's line too.
  hlo = jax.jit(g).lower(w, x).as_text(debug_info=True)
  assert f'test_autocast.py":{_OVERFLOW_LINE}:' in hlo


@pytest.mark.parametrize("call,err,match", [
    (lambda: jmp_lite.autocast(lambda x: x, "bf16", allow=None), TypeError,
     "allow takes a list"),
    (lambda: jmp_lite.autocast(lambda x: x, "bf16", deny=3), TypeError,
     "deny takes a list"),
    (lambda: jmp_lite.autocast(lambda x: x, "bf16", exclude_scopes=None),
     TypeError, "sequence of scope names"),
    (lambda: jmp_lite.autocast(lambda x: x, "bf16", use_default_lists="no"),
     TypeError, "use_default_lists must be a bool"),
    (lambda: jmp_lite.autocast(lambda x: x, "bf16",
                               accumulate_in_float32="yes"),
     TypeError, "accumulate_in_float32 must be a bool"),
    (lambda: jmp_lite.autocast_audit(3, "bf16", jnp.ones(2)), TypeError,
     "expects a callable"),
    (lambda: jmp_lite.autocast_fp8_state(
        3, "bf16", jnp.ones(2), fp8=jmp_lite.fp8.DelayedScaling()),
     TypeError, "expects a callable"),
    (lambda: jmp_lite.autocast_audit(lambda x, k=1: x, "bf16", jnp.ones(2),
                                     k=2),
     TypeError, "functools.partial"),
])
def test_bad_inputs_fail_early_with_a_clear_error(call, err, match):
  with pytest.raises(err, match=match):
    call()


def test_audit_table_fits_fp8_names():
  audit = jmp_lite.autocast_audit(
      lambda w, x: x @ w, "bf16", jnp.ones((8, 4)), jnp.ones((2, 8)),
      fp8=jmp_lite.fp8.DelayedScaling())
  header, row = str(audit).splitlines()[:2]
  assert row.split() == ["dot_general", "fp8-delayed", "float8_e4m3fn", "1"]
  assert row.rindex(" 1") == header.rindex(" count")  # Columns line up.


# --------------------------------------------- review findings (stop 26)


def test_nnx_module_arguments_keep_what_the_call_changes():
  """nnx modules were traced as copies: dropout drew the same mask on every
  call (the Rngs count never moved) and BatchNorm never updated its
  statistics, silently."""
  nnx = pytest.importorskip("flax.nnx")
  from tests.models.nnx_models import StatefulBlock

  x = jax.random.normal(jax.random.key(0), (8, 4)) + 3.0
  plain, cast = (StatefulBlock(4, 16, rngs=nnx.Rngs(0, dropout=1))
                 for _ in range(2))
  run = jmp_lite.autocast(lambda m, x: m(x), jnp.float16)
  masks = []
  for _ in range(2):
    want, got = plain(x), run(cast, x)
    assert_dtype(got, jnp.float32)
    np.testing.assert_array_equal(np.asarray(got == 0), np.asarray(want == 0))
    masks.append(np.asarray(got == 0))
  assert (masks[0] != masks[1]).any()   # The RNG stream moved.
  np.testing.assert_allclose(np.asarray(cast.bn.mean[...]),
                             np.asarray(plain.bn.mean[...]), rtol=1e-2,
                             atol=1e-3)
  assert_dtype(cast.bn.mean[...], jnp.float32)
  # Under nnx.jit too, and the audit still sees the half matmul.
  jitted = nnx.jit(run)
  before = np.asarray(cast.bn.mean[...])
  jitted(cast, x + 1.0)
  assert not np.allclose(np.asarray(cast.bn.mean[...]), before)
  audit = jmp_lite.autocast_audit(lambda m, x: m(x), jnp.float16, cast, x)
  assert [r.dtype for r in audit.records
          if r.primitive == "dot_general"] == ["float16"]


def test_dtype_exact_primitives_and_callbacks_run_as_written():
  """An op autocast runs in float32 (exp) fed nextafter, bitcast and host
  callbacks its float32 result where the code wrote float16."""
  x = jnp.asarray([0.5, 1.0, 2.0], jnp.float16)

  def bits(x):
    return jax.lax.bitcast_convert_type(jnp.exp(x), jnp.int16)

  def toward_zero(x):
    return jnp.nextafter(jnp.exp(x), jnp.zeros_like(x))

  def host(x):
    return jax.pure_callback(lambda v: np.asarray(v) * 2,
                             jax.ShapeDtypeStruct(x.shape, x.dtype),
                             jnp.exp(x))

  for fn in (bits, toward_zero, host):
    got = jmp_lite.autocast(fn, jnp.float16)(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(fn(x)))
    assert got.dtype == fn(x).dtype and got.shape == fn(x).shape


@pytest.mark.parametrize("inner", [jnp.bfloat16, jnp.float32])
def test_the_innermost_autocast_decides(inner):
  """An autocast inside another one was re-typed by the outer: its matmuls
  ran in the outer's dtype."""
  def f(x, w):
    return jnp.tanh(x @ w) @ w

  outer = jmp_lite.autocast(
      lambda x, w: jmp_lite.autocast(f, inner)(x, w) + x @ w, jnp.float16)
  x = jnp.ones((4, 4))
  found = _eqn_dtypes(jax.make_jaxpr(outer)(x, x), "dot_general")
  name = jnp.dtype(inner).name
  assert sorted(found) == sorted([(name, name)] * 2 + [("float16",) * 2])


def test_nnx_modules_closed_over_by_jit_grad_and_loops_still_work():
  """Writing back every variable put inner-trace values into a module
  closed over from outside (TraceContextError); only changed ones go back."""
  nnx = pytest.importorskip("flax.nnx")
  model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
  run = jmp_lite.autocast(lambda m, x: m(x), jnp.bfloat16)
  x = jnp.ones((2, 4))
  want = run(model, x)
  for traced in (jax.jit(lambda x: run(model, x)),
                 lambda x: jax.lax.fori_loop(0, 1, lambda i, c: run(model, c),
                                             x),
                 jax.vmap(lambda xi: run(model, xi))):
    chex.assert_trees_all_close(traced(x), want, atol=2e-2)   # bf16.
  assert jax.grad(lambda x: run(model, x).sum())(x).shape == x.shape
  assert isinstance(model.kernel[...], jax.Array)   # Not a leaked tracer.


def test_variables_fn_creates_in_nnx_arguments_are_kept():
  """A variable made where the module declared nnx.data(None) raised
  'Expected a subgraph' (it was silently lost before that)."""
  nnx = pytest.importorskip("flax.nnx")
  attn = nnx.MultiHeadAttention(2, 16, decode=True, rngs=nnx.Rngs(0))
  jmp_lite.autocast(lambda m: m.init_cache((1, 4, 16), dtype=jnp.bfloat16),
                    jnp.bfloat16)(attn)
  assert_dtype(attn.cached_key[...], jnp.bfloat16)
  assert int(attn.cache_index[...]) == 0


@pytest.mark.parametrize("region", ["autocast", "float32_region"])
def test_regions_hold_when_differentiated_inside_autocast(region):
  """Backward matmuls of an inner float32 region ran in the outer dtype when
  jax.grad was taken inside the outer autocast (JAX names them
  'transpose(jvp(<scope>))')."""
  def loss(w, x):
    return jnp.sum(jnp.tanh(x @ w) @ w)

  if region == "autocast":
    inner = jmp_lite.autocast(loss, jnp.float32)
  else:
    def inner(w, x):
      with jmp_lite.float32_region():
        return loss(w, x)

  step = lambda w, x: jax.grad(inner)(w, x)
  w, x = jnp.ones((8, 8)), jnp.ones((4, 8))
  audit = jmp_lite.autocast_audit(step, jnp.bfloat16, w, x)
  dots = [r.dtype for r in audit.records if r.primitive == "dot_general"]
  assert len(dots) == 5 and set(dots) == {"float32"}, dots
