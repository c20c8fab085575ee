"""Tests for jmp_lite.diagnostics."""

from __future__ import annotations

import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite


def test_nonfinite_counts_jitted_and_paths():
  grads = {"enc": {"w": jnp.array([[1.0, jnp.inf], [jnp.nan, 2.0]])},
           "head": jnp.ones(3, jnp.bfloat16), "step": jnp.array(3)}
  counts = jax.jit(jmp_lite.nonfinite_counts)(grads)
  assert int(counts["enc"]["w"]) == 2 and int(counts["head"]) == 0
  assert counts["step"] is None
  assert jmp_lite.nonfinite_paths(counts) == {"enc/w": 2}


def test_loss_scaled_tracks_nonfinite_paths_inside_jit():
  params = {"a": jnp.ones(2), "b": {"c": jnp.ones(3)}}
  opt = jmp_lite.loss_scaled(optax.sgd(0.1), jmp_lite.DynamicLossScale(4.0),
                             track_nonfinite=True)
  state = opt.init(params)
  grads = {"a": jnp.ones(2), "b": {"c": jnp.array([1.0, jnp.nan, jnp.inf])}}
  _, state = jax.jit(opt.update)(grads, state, params)
  assert not bool(state.last_finite)
  assert jmp_lite.nonfinite_paths(state.nonfinite) == {"b/c": 2}
  untracked = jmp_lite.loss_scaled(optax.sgd(0.1), jmp_lite.NoOpLossScale())
  assert untracked.init(params).nonfinite is None


def test_gradient_health_underflow_overflow_headroom():
  grads = {"small": jnp.array([1e-9, 2e-9, 1e-3, 0.0], jnp.float32),
           "big": jnp.array([1.0, 30000.0], jnp.float32)}
  health = jax.jit(jmp_lite.gradient_health, static_argnums=2)(
      grads, 1.0, "float16")
  assert float(health.underflow["small"]) == pytest.approx(2 / 3)
  assert float(health.overflow["big"]) == 0.0
  assert int(health.zeros["small"]) == 3
  # 65504 / 30000: about 1.13 doublings left.
  assert float(health.headroom_bits) == pytest.approx(np.log2(65504 / 30000),
                                                      rel=1e-4)
  scaled = jmp_lite.gradient_health(grads, jmp_lite.StaticLossScale(2.0**4))
  assert float(scaled.overflow["big"]) == 0.5      # 30000 * 16 overflows
  assert float(scaled.headroom_bits) < 0
  # 1e-9 * 16 still underflows; 2e-9 * 16 rounds up to the smallest subnormal.
  assert float(scaled.underflow["small"]) == pytest.approx(1 / 3)
  bigger = jmp_lite.gradient_health(grads, 2.0**-4 * 2.0**30, "float16")
  assert float(bigger.underflow["small"]) == 0.0  # 1e-9 * 2**26 survives


def test_find_nonfinite_names_the_first_primitive():
  def inner(h):
    return jnp.log(h - 1.0)        # log(0) = -inf when h == 1

  def loss(x, w):
    h = jax.nn.relu(x @ w)
    z = jax.jit(inner)(h)
    return jnp.sum(z * 2)          # inf spreads here, but is not born here

  x = jnp.ones((1, 2))
  w = jnp.array([[0.5], [0.5]])
  origin = jmp_lite.find_nonfinite(loss, x, w)
  assert origin.primitive == "log"
  assert origin.within == ("jit",)
  assert origin.dtype == "float32"
  assert origin.input_ranges == ((0.0, 0.0),)
  assert "test_diagnostics.py" in origin.location and "inner" in origin.location
  assert "log" in str(origin)
  assert jmp_lite.find_nonfinite(loss, x, w * 3) is None


def test_find_nonfinite_names_a_call_whose_body_made_it_from_a_constant():
  """inf from a constant inside a jit: no primitive in the body had only
  finite inputs, so the jit call that returned it is named."""
  def loss(x):
    return jax.jit(lambda y: y * jnp.inf)(x).sum()

  origin = jmp_lite.find_nonfinite(loss, jnp.ones(3))
  assert origin is not None
  assert (origin.primitive, origin.within) == ("jit", ())
  assert origin.input_ranges == ((1.0, 1.0),) and origin.output_nonfinite == 3


def test_diagnostics_and_the_nonfinite_counts_import_no_cycle():
  """transforms and diagnostics share nonfinite_counts through a module that
  imports neither; diagnostics imports transforms at the top only."""
  import ast
  import pathlib

  import jmp_lite._nonfinite

  def imports(module, top_only):
    tree = ast.parse(pathlib.Path(module.__file__).read_text())
    nodes = tree.body if top_only else ast.walk(tree)
    return {n.module for n in nodes if isinstance(n, ast.ImportFrom)}

  assert not {"jmp_lite.transforms", "jmp_lite.diagnostics"} & imports(
      jmp_lite._nonfinite, top_only=False)
  from jmp_lite import diagnostics
  assert imports(diagnostics, top_only=False) == imports(
      diagnostics, top_only=True)   # No function-local imports.
  assert jmp_lite.nonfinite_counts is jmp_lite._nonfinite.nonfinite_counts


def test_find_nonfinite_names_the_layer_scope():
  """It named flax's Dense source line, the same for every layer; the name
  stack says which layer (found by a review)."""
  import flax.linen as nn

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      dense = lambda n, name: nn.Dense(n, dtype=jnp.float16, name=name)
      x = jax.nn.sigmoid(dense(8, "enc")(x))   # In (0, 1).
      x = dense(8, "blowup")(x)
      return dense(2, "head")(jnp.tanh(x))

  model = Net()
  x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 3)),
                  jnp.float16)
  params = model.init(jax.random.key(0), x)["params"]
  # Representable in float16, but 8 of them times ~0.5 are not.
  params = {**params, "blowup": {**params["blowup"], "kernel": jnp.full(
      params["blowup"]["kernel"].shape, 4e4)}}
  loss = lambda p: jnp.mean(model.apply({"params": p}, x) ** 2)
  origin = jmp_lite.find_nonfinite(loss, params)
  assert origin.primitive == "dot_general"
  assert origin.scope.endswith("blowup"), origin.scope
  assert "in scope " in str(origin) and "blowup" in str(origin)

  def named(x):   # Scopes a user names count too.
    with jax.named_scope("my_block"):
      return jnp.log(x).sum()

  assert jmp_lite.find_nonfinite(named, jnp.zeros(2)).scope == "my_block"


def test_find_nonfinite_under_jit_says_to_call_it_eagerly():
  f = lambda x: jnp.log(x).sum()
  with pytest.raises(TypeError, match="runs fn eagerly.*called under jit"):
    jax.jit(lambda x: jmp_lite.find_nonfinite(f, x))(jnp.zeros(2))
  with pytest.raises(TypeError, match="closes over traced values"):
    jax.jit(lambda x: jmp_lite.find_nonfinite(lambda: f(x)))(jnp.zeros(2))


def test_find_nonfinite_in_float16_overflow_and_gradients():
  def f(x):
    return (x * x).sum()
  origin = jmp_lite.find_nonfinite(f, jnp.full((3,), 300.0, jnp.float16))
  assert (origin.primitive, origin.dtype) == ("mul", "float16")
  assert origin.input_ranges == ((300.0, 300.0), (300.0, 300.0))
  grad_origin = jmp_lite.find_nonfinite(
      jax.grad(lambda x: jnp.sqrt(x).sum()), jnp.zeros(2))
  assert grad_origin is not None and grad_origin.primitive in ("div", "mul",
                                                               "integer_pow",
                                                               "pow", "rsqrt")


def test_check_alignment():
  def f(x, w1, w2, k):
    h = x @ w1
    y = jax.lax.conv_general_dilated(k, jnp.ones((12, 3, 3, 3)), (1, 1), "SAME")
    return h @ w2, y

  found = jmp_lite.check_alignment(
      f, jnp.ones((64, 1002)), jnp.ones((1002, 512)), jnp.ones((512, 10)),
      jnp.ones((1, 3, 8, 8)))
  dims = [m.dims for m in found]
  assert {"K": 1002} in dims
  assert {"N": 10} in dims
  assert {"out_channels": 12, "in_channels": 3} in dims
  hint = next(m.hint for m in found if m.dims == {"K": 1002})
  assert "K 1002 -> 1008" in hint
  assert all("test_diagnostics.py" in m.location for m in found)
  assert jmp_lite.check_alignment(lambda a, b: a @ b, jnp.ones((16, 32)),
                                  jnp.ones((32, 8))) == []
  assert [m.dims for m in jmp_lite.check_alignment(
      lambda a, b: a @ b, jnp.ones((16, 24)), jnp.ones((24, 8)),
      multiple=16)] == [{"K": 24, "N": 8}]
  with pytest.raises(ValueError, match="multiple must be >= 1"):
    jmp_lite.check_alignment(lambda a: a, jnp.ones(1), multiple=0)


def _device(platform, cc=None):
  d = types.SimpleNamespace(platform=platform)
  if cc is not None:
    d.compute_capability = cc
  return d


@pytest.mark.parametrize("dtype,device,expect", [
    ("f16", _device("gpu", "6.1"), "below 7.0"),
    ("bf16", _device("gpu", "7.5"), "below 8.0"),
    ("f16", _device("gpu", "7.5"), None),
    ("bf16", _device("gpu", "9.0"), None),
    ("f16", _device("tpu"), "no native TPU support"),
    ("bf16", _device("tpu"), None),
    ("bf16", _device("cpu"), "emulated"),
    ("f32", _device("gpu", "6.1"), None),
])
def test_check_hardware(dtype, device, expect):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    messages = jmp_lite.check_hardware(dtype, device)
  if expect is None:
    assert messages == [] and not caught
  else:
    assert len(messages) == 1 and expect in messages[0]
    assert caught and issubclass(caught[0].category, jmp_lite.PrecisionWarning)
  assert jmp_lite.check_hardware(jmp_lite.get_policy(f"c={dtype}"), device,
                                 warn=False) == messages


def test_diagnostics_take_equinox_modules_as_arguments():
  """Issue 9, point 10: arguments holding non-array leaves (functions)."""
  eqx = pytest.importorskip("equinox")
  mlp = eqx.nn.MLP(3, 2, 5, 1, activation=jax.nn.relu, key=jax.random.key(0))

  def loss(model, x):
    return jnp.log(jax.vmap(model)(x) - 1e9).sum()  # log of negatives: NaN.

  origin = jmp_lite.find_nonfinite(loss, mlp, jnp.ones((4, 3)))
  assert origin is not None and origin.primitive == "log"
  found = jmp_lite.check_alignment(lambda m, x: jax.vmap(m)(x), mlp,
                                   jnp.ones((4, 3)))
  assert found and all(m.primitive == "dot_general" for m in found)


@pytest.mark.parametrize("multiple,err,match", [
    (8.5, TypeError, "positive int, got float: 8.5"),
    (8.0, TypeError, "positive int, got float"),
    (True, TypeError, "positive int, got bool"),
    ("8", TypeError, "positive int, got str"),
    (0, ValueError, "multiple must be >= 1, got 0"),
    (-16, ValueError, "multiple must be >= 1, got -16"),
])
def test_check_alignment_takes_a_positive_int_multiple(multiple, err, match):
  f = lambda a: a @ a  # noqa: E731
  with pytest.raises(err, match=match):
    jmp_lite.check_alignment(f, jnp.ones((2, 2)), multiple=multiple)
  found = jmp_lite.check_alignment(f, jnp.ones((6, 6)), multiple=np.int64(4))
  assert found[0].hint == "pad to multiples of 4: M 6 -> 8, N 6 -> 8, K 6 -> 8"


@pytest.mark.parametrize("scale,err,match", [
    (-1.0, ValueError, "positive and finite, got -1.0"),
    (0, ValueError, "positive and finite, got 0.0"),
    (float("inf"), ValueError, "positive and finite, got inf"),
    (jnp.float32(jnp.nan), ValueError, "positive and finite, got nan"),
    (np.array(-2.0), ValueError, "positive and finite, got -2.0"),
    (jnp.ones(2), ValueError, "must be a scalar, got shape"),
    ("2", TypeError, "got str"),
    (None, TypeError, "got NoneType"),
    (True, TypeError, "got bool"),
])
def test_gradient_health_rejects_a_bad_loss_scale(scale, err, match):
  with pytest.raises(err, match=match):
    jmp_lite.gradient_health({"w": jnp.ones(2)}, scale)


def test_gradient_health_takes_traced_and_state_scales():
  grads = {"w": jnp.array([1.0, 2.0])}
  want = float(np.log2(65504 / 8.0))
  jitted = jax.jit(jmp_lite.gradient_health)
  static = jmp_lite.StaticLossScale(4.0)
  for scale in (4.0, jnp.float32(4.0), static,
                jmp_lite.loss_scaled(optax.sgd(0.1), static).init(grads)):
    for fn in (jmp_lite.gradient_health, jitted):
      assert float(fn(grads, scale).headroom_bits) == pytest.approx(
          want, rel=1e-5)


def test_gradient_health_takes_any_optimizer_state_holding_a_guard():
  """A master_weights state and an nnx.Optimizer's opt_state raised
  TypeError, though current_loss_scale reads both (found by a review)."""
  nnx = pytest.importorskip("flax.nnx")
  grads = {"w": jnp.array([1.0, 2.0])}
  want = float(np.log2(65504 / 8.0))
  guard = jmp_lite.loss_scaled(optax.sgd(0.1), jmp_lite.StaticLossScale(4.0))
  master = jmp_lite.master_weights(guard).init(
      {"w": jnp.ones(2, jnp.float16)})
  nnx_state = nnx.Optimizer(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), guard,
                            wrt=nnx.Param).opt_state
  for state in (master, nnx_state):
    assert float(jmp_lite.gradient_health(grads, state).headroom_bits) == (
        pytest.approx(want, rel=1e-5))
  with pytest.raises(TypeError, match="an optimizer state holding one"
                     " loss_scaled state, got tuple") as info:
    jmp_lite.gradient_health(grads, optax.adam(0.1).init(
        {"w": jnp.ones((256, 256))}))
  assert len(str(info.value)) < 500   # Not the state's whole repr.
  two = optax.multi_transform(
      {k: jmp_lite.loss_scaled(optax.sgd(0.1), jmp_lite.StaticLossScale(4.0),
                               name=k) for k in ("a", "b")},
      {"a": "a", "b": "b"})
  with pytest.raises(ValueError, match="2 loss_scaled states found.*"
                     r"current_loss_scale\(state, name\)"):
    jmp_lite.gradient_health(grads, two.init({"a": jnp.ones(2),
                                              "b": jnp.ones(2)}))


def test_diagnostics_bad_inputs_fail_early():
  with pytest.raises(TypeError, match="find_nonfinite expects a callable"):
    jmp_lite.find_nonfinite(3, jnp.ones(2))
  with pytest.raises(TypeError, match="check_alignment expects a callable"):
    jmp_lite.check_alignment(3, jnp.ones(2))
  with pytest.raises(ValueError, match="counts from nonfinite_counts"):
    jmp_lite.nonfinite_paths({"w": jnp.ones(2)})
  with pytest.raises(TypeError, match="device must be a jax.Device"):
    jmp_lite.check_hardware("bf16", "gpu")
  # A policy string, as autocast takes it.
  assert jmp_lite.check_hardware("p=f32,c=f16", _device("tpu"), warn=False) \
      == jmp_lite.check_hardware("f16", _device("tpu"), warn=False) != []


@pytest.mark.parametrize("counts,match", [
    ("x", r"got a str at 'the root': 'x'"),
    ({"w": jnp.float32(1.5)}, r"got a \w+ of dtype float32 at 'w'"),
    ({"w": True}, r"got a bool at 'w'"),
])
def test_nonfinite_paths_refuses_what_is_no_count(counts, match):
  """nonfinite_paths("x") failed with int()'s "invalid literal"; a float
  (gradients given by mistake) was truncated to a count."""
  with pytest.raises(TypeError, match=r"nonfinite_paths takes counts from"
                     r" nonfinite_counts \(an integer scalar per leaf.*"
                     + match):
    jmp_lite.nonfinite_paths(counts)
  # Python and numpy integers are counts.
  assert jmp_lite.nonfinite_paths({"a": 3, "b": np.int64(0)}) == {"a": 3}
