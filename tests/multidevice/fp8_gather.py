"""Runs on 4 forced host devices (see tests/test_fp8_gather.py).

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

from jmp_lite import fp8  # noqa: E402
from jmp_lite.fp8._blocked import Layout, quantize_blocks  # noqa: E402
from jmp_lite.fp8._quantize import amax_of, scale_for  # noqa: E402

MESH = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("fsdp",))
RECIPES = {
    "tensor": fp8.CurrentScaling(),
    "row": fp8.CurrentScaling(granularity="row"),
    "block": fp8.CurrentScaling(granularity="block", block_size=16),
    "mx": fp8.MXFP8(),
}


def qdq_global(w: np.ndarray, name: str, block: int = 16) -> np.ndarray:
  """Quantise-dequantise of the whole (unsharded) tensor, one device."""
  x = jnp.asarray(w)
  if name == "tensor":
    scale = scale_for(amax_of(x), np.dtype(jnp.float8_e4m3fn), 0)
    q = jnp.clip(x * scale, -448, 448).astype(jnp.float8_e4m3fn)
    return np.asarray(q.astype(jnp.float32) * (1 / scale))
  kind = {"row": "row", "block": "square", "mx": "mx"}[name]
  bs = block if name == "block" else 32
  q, inv = quantize_blocks(x[None], Layout(kind, np.dtype(jnp.float8_e4m3fn),
                                           bs=bs))
  out = np.asarray(q.astype(jnp.float32) * inv[..., None])
  return out.reshape(w.shape[0], -1)[:, :w.shape[1]]


def op_types(text: str, op: str) -> list[str]:
  """The operand types of every ``stablehlo.<op>`` in lowered text."""
  pattern = r'"?stablehlo\.' + op + r'"?[^\n]*?(?:\n.*?)*?: \((tensor<[^>]*>)'
  return re.findall(pattern, text)


def main() -> None:
  rng = np.random.default_rng(0)
  w = (rng.standard_normal((64, 96)) * np.logspace(-3, 2, 96)).astype(
      np.float32)
  x = rng.standard_normal((16, 64)).astype(np.float32)
  for name, recipe in RECIPES.items():

    def loss(w, x, recipe=recipe):
      full = fp8.all_gather(w, "fsdp", recipe)
      return jax.lax.psum(jnp.sum((x @ full) ** 2), "fsdp")

    def gathered(w, recipe=recipe):
      return fp8.all_gather(w, "fsdp", recipe)

    g = jax.jit(jax.shard_map(gathered, mesh=MESH, in_specs=P("fsdp"),
                              out_specs=P("fsdp")))
    got = np.asarray(g(w)).reshape(4, 64, 96)
    want = qdq_global(w, name)
    for shard in got:  # Every device holds the global tensor's qdq.
      np.testing.assert_array_equal(shard, want)

    step = jax.jit(jax.shard_map(jax.grad(loss), mesh=MESH,
                                 in_specs=(P("fsdp"), P("fsdp")),
                                 out_specs=P("fsdp")))
    text = step.lower(w, x).as_text()
    gathers = op_types(text, "all_gather")
    # The weight's gather moves E4M3; only the scales (at most 1/16 of its
    # elements) travel in float32.
    assert any("xf8E4M3FN>" in t for t in gathers), gathers
    assert not any(t.startswith("tensor<16x96xf32") for t in gathers), gathers
    scatters = op_types(text, "reduce_scatter")
    assert scatters and all(t.endswith("xf32>") for t in scatters), scatters
    # The gradient: the float32 reduce-scatter of every shard's dL/dw.
    grad = np.asarray(step(w, x))
    xs = x.reshape(4, 4, 64)
    full = jnp.asarray(want)
    ref = sum(np.asarray(jax.grad(lambda f, xi: jnp.sum((xi @ f) ** 2))(
        full, xs[i])) for i in range(4))
    np.testing.assert_allclose(grad, ref, rtol=1e-5, atol=1e-5)
    print(f"ok {name}")

  bf16 = jnp.asarray(w, jnp.bfloat16)
  g = jax.jit(jax.shard_map(lambda w: fp8.all_gather(w, "fsdp",
                                                     RECIPES["mx"]),
                            mesh=MESH, in_specs=P("fsdp"),
                            out_specs=P("fsdp")))
  assert g(bf16).dtype == jnp.bfloat16
  dw = jax.jit(jax.shard_map(
      jax.grad(lambda w: jnp.sum(fp8.all_gather(w, "fsdp", RECIPES["mx"])
                                 .astype(jnp.float32))),
      mesh=MESH, in_specs=P("fsdp"), out_specs=P("fsdp")))
  text = dw.lower(bf16).as_text()
  assert op_types(text, "reduce_scatter") == ["tensor<64x96xf32>"]
  assert dw(bf16).dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(dw(bf16), np.float32), 4.0)
  print("ok bfloat16 params, float32 reduce-scatter")

  # Block tiles gathered along the last axis: 24 columns a shard, 3 tiles.
  recipe = fp8.CurrentScaling(granularity="block", block_size=8)
  g = jax.jit(jax.shard_map(
      lambda w: fp8.all_gather(w, "fsdp", recipe, axis=1), mesh=MESH,
      in_specs=P(None, "fsdp"), out_specs=P(None, "fsdp")))
  got = np.asarray(g(w)).reshape(64, 4, 96)
  want = qdq_global(w, "block", block=8)
  for i in range(4):
    np.testing.assert_array_equal(got[:, i], want)
  print("ok block along the last axis")


if __name__ == "__main__":
  main()
