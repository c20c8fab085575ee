"""The FP8 matmul on 4 forced host devices: sharded jit and shard_map.

Runs in a subprocess: the device count is fixed when JAX starts.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import multidevice_env, ROOT

SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax import shard_map
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jmp_lite import fp8

    mesh = jax.make_mesh((4,), ("data",))
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((16, 32)).astype(np.float32)
    w_np = rng.standard_normal((32, 8)).astype(np.float32)
    dims = (((1,), (0,)), ((), ()))
    dot = fp8.dot_general(fp8.CurrentScaling())

    def loss(w, x):
      return jnp.sum(dot(x, w, dims) ** 2)

    # One device: the reference.
    ref_v, (ref_gw, ref_gx) = jax.jit(jax.value_and_grad(loss, (0, 1)))(
        jnp.asarray(w_np), jnp.asarray(x_np))

    # Data-parallel jit (sharding in types): a per-tensor amax is global, so
    # the numbers are the single device's; the weight gradient contracts the
    # sharded batch and comes back replicated.
    x = jax.device_put(x_np, NamedSharding(mesh, P("data")))
    w = jax.device_put(w_np, NamedSharding(mesh, P()))
    v, (gw, gx) = jax.jit(jax.value_and_grad(loss, (0, 1)))(w, x)
    np.testing.assert_allclose(v, ref_v, rtol=1e-5)
    np.testing.assert_allclose(gw, ref_gw, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(gx, ref_gx, rtol=1e-5, atol=1e-4)
    assert gw.sharding.spec == P(None, None), gw.sharding
    assert gx.sharding.spec == P("data", None), gx.sharding
    print("ok sharded jit")

    # shard_map: per-device scales; the replicated weight's gradient is
    # summed over the devices inside the backward pass.
    def sm_loss(w, x, dot_fn):
      body = lambda x, w: dot_fn(x, w, dims)
      y = shard_map(body, mesh=mesh, in_specs=(P("data"), P()),
                    out_specs=P("data"))(x, w)
      return jnp.sum(y ** 2)

    grad = jax.jit(jax.grad(sm_loss), static_argnums=2)
    g8 = grad(w, x, dot)
    g32 = grad(w, x, jax.lax.dot_general)
    err = float(jnp.linalg.norm(g8 - g32) / jnp.linalg.norm(g32))
    assert 0.005 < err < 0.1, err
    print("ok shard_map")

    # Delayed scaling under shard_map: the observed amaxes are the maxima
    # over the devices (a replicated state gets one value).
    recipe = fp8.DelayedScaling(history=4)

    def delayed_loss(w, state, x):
      body = lambda x, w, s: fp8.dot_general(recipe, s)(x, w, dims)
      y = shard_map(body, mesh=mesh, in_specs=(P("data"), P(), P()),
                    out_specs=P("data"))(x, w, state)
      return jnp.sum(y ** 2)

    observed = jax.jit(jax.grad(delayed_loss, argnums=1))(w, recipe.init(), x)
    np.testing.assert_allclose(observed.pending[:2],
                               [np.abs(x_np).max(), np.abs(w_np).max()])
    print("ok shard_map delayed")

    # A dot too small for a GPU GEMM (4x8 @ 8x3) takes its FP8 values in
    # float32 on a GPU: with a batch-sharded operand too. Traced as on a GPU
    # (JAX caches custom_vjp traces: cleared around the switch).
    xs, ws = x_np[:4, :8], w_np[:8, :3]
    small_ref = jax.jit(jax.value_and_grad(loss, (0, 1)))(
        jnp.asarray(ws), jnp.asarray(xs))
    jax.default_backend = lambda: "gpu"
    jax.clear_caches()
    v, (gw, gx) = jax.jit(jax.value_and_grad(loss, (0, 1)))(
        jax.device_put(ws, NamedSharding(mesh, P())),
        jax.device_put(xs, NamedSharding(mesh, P("data"))))
    np.testing.assert_allclose(v, small_ref[0], rtol=1e-6)
    np.testing.assert_allclose(gw, small_ref[1][0], rtol=1e-6, atol=1e-6)
    assert gx.sharding.spec == P("data", None), gx.sharding
    print("ok small dot, gpu fallback, sharded")
""")


def test_fp8_dot_on_four_devices():
  env = multidevice_env(4)
  proc = subprocess.run([sys.executable, "-W", "error", "-c", SCRIPT],
                        capture_output=True, text=True, cwd=ROOT, env=env,
                        timeout=600)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert proc.stdout.splitlines() == [
      "ok sharded jit", "ok shard_map", "ok shard_map delayed",
      "ok small dot, gpu fallback, sharded"], proc.stdout + proc.stderr
