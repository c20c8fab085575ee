"""Runs on 4 forced host devices (see tests/test_fp4_gather.py).

Each check prints one line "ok <name>"; any failure raises.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jmp_lite import fp4  # noqa: E402

MESH = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("fsdp",))
RECIPES = {"nvfp4": fp4.NVFP4(), "nvfp4-1d": fp4.NVFP4(weight_blocks=None),
           "mxfp4": fp4.MXFP4()}
BITS = {"f4E2M1FN": 4, "f8E4M3FN": 8, "f8E8M0FNU": 8, "bf16": 16, "f32": 32}


def gathered_bits(text: str) -> int:
  """The bits every ``stablehlo.all_gather`` of lowered text receives."""
  total = 0
  for shape in re.findall(r'stablehlo\.all_gather"?[^\n]*: \(tensor<([^>]*)>',
                          text):
    *dims, kind = shape.split("x")
    total += int(np.prod([int(d) for d in dims])) * BITS[kind]
  return total


def gather_fn(recipe, axis):
  def f(w):
    if recipe is None:
      return jax.lax.all_gather(w, "fsdp", axis=axis, tiled=True)
    return fp4.all_gather(w, "fsdp", recipe, axis=axis)
  spec = P("fsdp") if axis == 0 else P(None, "fsdp")
  return jax.jit(jax.shard_map(f, mesh=MESH, in_specs=spec, out_specs=P(),
                               check_vma=False))


rng = np.random.default_rng(0)
for name, recipe in RECIPES.items():
  # Gathered along the rows, the blocks' axis is padded (104 columns); along
  # the columns, each shard holds whole blocks (32 of 128).
  for axis, shape in ((0, (128, 104)), (1, (64, 128))):
    w = rng.normal(size=shape).astype(np.float32)
    w[5, 7] = 40.0  # an outlier: its block (or tile) only
    got = np.asarray(gather_fn(recipe, axis)(w))
    want = np.asarray(fp4.quantize_dequantize(w, recipe, role="weight"))
    np.testing.assert_array_equal(got, want)
    assert got.shape == shape
    print(f"ok {name} axis {axis}")

wb = jnp.asarray(rng.normal(size=(256, 256)), jnp.bfloat16)
base = gathered_bits(gather_fn(None, 0).lower(wb).as_text())
for name, recipe in RECIPES.items():
  text = gather_fn(recipe, 0).lower(wb).as_text()
  ratio = gathered_bits(text) / base
  assert "f4E2M1FN" in text and ratio <= 0.30, (name, ratio)
  print(f"ok {name} bytes {ratio:.4f}x bf16")


def loss(w):
  g = jax.shard_map(lambda s: fp4.all_gather(s, "fsdp", fp4.NVFP4()),
                    mesh=MESH, in_specs=P("fsdp"), out_specs=P(),
                    check_vma=False)
  return jnp.sum(g(w).astype(jnp.float32) * 2)


text = jax.jit(jax.grad(loss)).lower(wb).as_text()
# The reduce-scatter's region is on the next lines: match across them.
assert re.search(r"reduce_scatter(.|\n)*?: \(tensor<[0-9x]*xf32>\)", text), (
    text[-2000:])
grad = jax.jit(jax.grad(loss))(wb)
assert grad.dtype == jnp.bfloat16
print("ok float32 reduce-scatter")


# fp4.dot_general inside shard_map: the batch split over the devices, the
# weight replicated. Its gradient is the sum over the shards (a psum the
# custom VJP adds), the unsharded matmul's. MXFP4 without the transform has
# no tensor-wide scale and its 32-token blocks fit a 32-row shard, so the
# numbers are the unsharded ones up to the float32 summation order.
mx = fp4.MXFP4(hadamard=0)
dims = (((1,), (0,)), ((), ()))
x = jnp.asarray(rng.normal(size=(128, 64)), jnp.float32)
wr = jnp.asarray(rng.normal(size=(64, 16)), jnp.float32)


def sharded_loss(w, x):
  f = jax.shard_map(lambda w, x: fp4.dot_general(mx)(x, w, dims), mesh=MESH,
                    in_specs=(P(), P("fsdp")), out_specs=P("fsdp"))
  return jnp.sum(f(w, x) ** 2)


def plain_loss(w, x):
  return jnp.sum(fp4.dot_general(mx)(x, w, dims) ** 2)


got = jax.jit(jax.grad(sharded_loss, argnums=(0, 1)))(wr, x)
want = jax.jit(jax.grad(plain_loss, argnums=(0, 1)))(wr, x)
for a, b in zip(got, want, strict=True):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                             atol=1e-4)
print("ok matmul in shard_map")
