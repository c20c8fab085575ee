"""FP8 and FP4 under explicit mesh axes, on 8 forced host devices.

``jax.make_mesh`` makes ``Explicit`` axes by default: under ``jax.set_mesh``
each array's sharding is in its type. Run by tests/test_sharding.py. Each
check prints "ok <name>"; any failure raises.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import chex  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jmp_lite  # noqa: E402
from jmp_lite import fp4, fp8  # noqa: E402

DIMS = (((1,), (0,)), ((), ()))
# (x spec, w spec): a data-parallel batch times a column-split weight, and a
# replicated batch times a weight split along its contraction (FSDP-like).
LAYOUTS = {"data x columns": (P("x", None), P(None, "y")),
           "contraction split": (P(), P("x", None))}
RECIPES = {
    "fp8 tensor": lambda: fp8.dot_general(fp8.CurrentScaling()),
    "fp8 row": lambda: fp8.dot_general(fp8.CurrentScaling(granularity="row")),
    "fp8 block": lambda: fp8.dot_general(
        fp8.CurrentScaling(granularity="block")),
    "mxfp8": lambda: fp8.dot_general(fp8.MXFP8()),
    "nvfp4": lambda: fp4.dot_general(fp4.NVFP4(), jax.random.key(0)),
    "mxfp4": lambda: fp4.dot_general(fp4.MXFP4()),
}


def mesh():
  return jax.make_mesh((4, 2), ("x", "y"),
                       axis_types=(jax.sharding.AxisType.Explicit,) * 2)


def operands():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((32, 256)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((256, 128)) * 0.1, jnp.float32)
  return x, w


def value_and_grads(dot, x, w):
  def loss(x, w):
    return jnp.sum(jnp.tanh(dot(x, w, DIMS)))
  out = jax.jit(lambda x, w: dot(x, w, DIMS))(x, w)
  return out, jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)


def spec(a):
  """``a``'s spec, one entry per dimension (P() is P(None, None))."""
  got = tuple(a.sharding.spec)
  return got + (None,) * (a.ndim - len(got))


def close(got, want):
  # The sharded matmuls sum their contraction in another order (partial
  # sums, then a reduction): the quantized values are the same, the float32
  # sums a few ulps apart.
  chex.assert_trees_all_close(jax.device_get(got), jax.device_get(want),
                              rtol=1e-4, atol=1e-5)


def check_matmuls():
  m = mesh()
  x0, w0 = operands()
  for name, make in RECIPES.items():
    want = value_and_grads(make(), x0, w0)
    for layout, (xs, ws) in LAYOUTS.items():
      with jax.set_mesh(m):
        x = jax.device_put(x0, NamedSharding(m, xs))
        w = jax.device_put(w0, NamedSharding(m, ws))
        plain = jax.eval_shape(
            lambda x, w: jax.lax.dot_general(x, w, DIMS), x, w)
        out, (dx, dw) = value_and_grads(make(), x, w)
      close((out, (dx, dw)), want)
      # Sharded as the plain matmul's result and the operands are.
      assert spec(out) == spec(plain), (name, layout, out.sharding)
      assert spec(dx) == spec(x), (name, layout, dx.sharding)
      assert spec(dw) == spec(w), (name, layout, dw.sharding)
  print("ok fp8 and fp4 matmuls under explicit axes")


def check_autocast():
  m = mesh()
  x0, w0 = operands()

  def loss(w, x):
    return jnp.sum(jnp.tanh(x @ w))

  for recipe in (fp8.CurrentScaling(), fp8.CurrentScaling(granularity="row"),
                 fp4.MXFP4()):
    fast = jax.jit(jax.grad(jmp_lite.autocast(loss, jnp.float32,
                                              fp8=recipe)))
    want = fast(w0, x0)
    with jax.set_mesh(m):
      w = jax.device_put(w0, NamedSharding(m, P("x", None)))
      x = jax.device_put(x0, NamedSharding(m, P()))
      got = fast(w, x)
    close(got, want)
    assert spec(got) == spec(w), (recipe, got.sharding)
  print("ok autocast fp8 grads under explicit axes")


def check_quantizers_and_health():
  m = mesh()
  _, w0 = operands()
  w3 = jnp.asarray(np.random.default_rng(1).standard_normal((2, 16, 64)),
                   jnp.float32)
  row = fp8.CurrentScaling(granularity="row")
  reports = {
      "fp4 quantize_dequantize": lambda t: fp4.quantize_dequantize(
          t["w"], fp4.MXFP4()),
      "fp8 row health": lambda t: fp8.quantization_health(t, recipe=row),
      "fp8 tensor health": lambda t: fp8.quantization_health(
          t, jnp.float8_e4m3fn, amax=2.0),
      "mxfp8 health": lambda t: fp8.quantization_health(t,
                                                        recipe=fp8.MXFP8()),
      "nvfp4 health": lambda t: fp4.quantization_health(t, fp4.NVFP4()),
  }
  for name, report in reports.items():
    want = report({"w": w0, "w3": w3})
    with jax.set_mesh(m):
      tree = {"w": jax.device_put(w0, NamedSharding(m, P(None, "x"))),
              "w3": jax.device_put(w3, NamedSharding(m, P(None, "x", None)))}
      got = report(tree)
    if name == "fp4 quantize_dequantize":
      # Elementwise: the same values bit for bit, sharded as the input.
      chex.assert_trees_all_equal(jax.device_get(got), jax.device_get(want))
      assert spec(got) == spec(tree["w"]), got.sharding
    else:
      # Means over the leaves: summed in another order.
      close(got, want)
  print("ok fp8 and fp4 quantizers and health under explicit axes")


def check_partial_shard_map():
  """Inside ``jax.shard_map`` over one axis ("x" manual) with the other
  still explicit ("y", splitting the weight): the matmuls and quantizers
  run as written (explicit axes cannot become auto under manual ones).
  ("block" and NVFP4 do not run there: a scan carry's and ``jnp.repeat``'s
  explicit sharding rules.)"""
  m = mesh()
  x0, w0 = operands()
  for name in ("fp8 row", "mxfp8", "mxfp4"):
    dot = RECIPES[name]()
    want = jax.jit(lambda x, w, dot=dot: dot(x, w, DIMS))(x0, w0)
    with jax.set_mesh(m):
      x = jax.device_put(x0, NamedSharding(m, P("x", None)))
      w = jax.device_put(w0, NamedSharding(m, P(None, "y")))
      step = jax.jit(jax.shard_map(
          lambda x, w, dot=dot: dot(x, w, DIMS), in_specs=(P("x", None), P()),
          out_specs=P("x", None), axis_names={"x"}))
      got = step(x, w)
      qdq = jax.jit(jax.shard_map(
          lambda w: fp4.quantize_dequantize(w, fp4.MXFP4()), in_specs=P(),
          out_specs=P(), axis_names={"x"}))(w)
    # Each shard's rows have the whole rows' scales: the unsharded values.
    close(got, want)
    # The row recipe's ops all have explicit sharding rules: its result
    # keeps the weight's "y" split.
    assert spec(got)[0] == "x", (name, got.sharding)
    if name == "fp8 row":
      assert spec(got) == ("x", "y"), (name, got.sharding)
    chex.assert_trees_all_equal(
        jax.device_get(qdq),
        jax.device_get(fp4.quantize_dequantize(w0, fp4.MXFP4())))
  print("ok fp8 and fp4 inside a partial shard_map")


if __name__ == "__main__":
  assert jax.device_count() == 8, jax.devices()
  check_matmuls()
  check_autocast()
  check_quantizers_and_health()
  check_partial_shard_map()
