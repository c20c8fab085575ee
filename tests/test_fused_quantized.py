"""quantized_adam: the fused kernel (run in Pallas' interpreter on the CPU)
writes what quantized_states(optax.adam)'s XLA path writes."""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite
from jmp_lite.low_precision import quantized_adam, QuantizedArray
from tests.conftest import lowered_for_h100

# At XLA:CPU's default optimisation level, as users compile: at the suite's
# level 0, LLVM emits float32 sqrt differently in the interpreter's loop and
# in the whole-array program, an ulp apart in a few of nu's scales.
pytestmark = pytest.mark.usefixtures("optimized_codegen")

_SHAPES = {"w": (16, 256), "b": (70,), "c": (3, 5, 40), "s": ()}


def _params() -> dict[str, jax.Array]:
  rng = np.random.default_rng(0)
  return {k: jnp.asarray(rng.standard_normal(s), jnp.float32)
          for k, s in _SHAPES.items()}


def _grads(step: int) -> dict[str, jax.Array]:
  # Magnitudes that change by 100x over the steps, and a spike.
  rng = np.random.default_rng(step + 1)
  g = {k: jnp.asarray(rng.standard_normal(s) * 10.0 ** (step - 1),
                      jnp.float32) for k, s in _SHAPES.items()}
  g["w"] = g["w"].at[3, 7].set(1e20)
  return g


def _run(kernel: str, steps: int = 3, **kwargs: Any) -> tuple[list[Any], Any]:
  kwargs = {"block_size": 64, **kwargs}
  opt = quantized_adam(1e-2, kernel=kernel, **kwargs)
  params = _params()
  state = opt.init(params)
  update = jax.jit(opt.update)
  updates = []
  for i in range(steps):
    u, state = update(_grads(i), state, params)
    updates.append(u)
  return updates, state


@pytest.mark.parametrize("bits,rounding,scale_dtype,block_size", [
    (8, "stochastic", "float32", 64), (4, "stochastic", "float32", 64),
    (8, "nearest", "bfloat16", 64)])
def test_kernel_writes_the_xla_paths_state(bits, rounding, scale_dtype,
                                           block_size):
  kwargs = dict(bits=bits, rounding=rounding, scale_dtype=scale_dtype,
                block_size=block_size)
  u_xla, s_xla = _run("xla", **kwargs)
  u_kernel, s_kernel = _run("interpret", **kwargs)
  # Codes, scales, outliers, indices, forms and counters: bit for bit.
  a, b = jax.tree.leaves(s_xla), jax.tree.leaves(s_kernel)
  assert jax.tree.structure(s_xla) == jax.tree.structure(s_kernel)
  for x, y in zip(a, b, strict=True):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  mu = s_kernel.inner_state[0].mu["w"]
  assert isinstance(mu, QuantizedArray) and mu.bits == bits
  # The spike is its block's outlier, kept exactly.
  assert float(mu.outliers[3 // 1, 7 // 64]) != 0.0
  # Updates: XLA's simplifier rewrites m / c1 / (sqrt(v / c2) + eps) per
  # program (plain jitted optax.adam differs by an ulp between a one-leaf and
  # a two-leaf tree), so within an ulp or two, not bit for bit.
  for x, y in zip(u_xla, u_kernel, strict=True):
    jax.tree.map(lambda p, q: np.testing.assert_allclose(
        np.asarray(p), np.asarray(q), rtol=3e-7, atol=0), x, y)


def test_wide_blocks_write_the_xla_paths_state():
  # Blocks of 512 (and a last axis of 40 read as rows). XLA:CPU may
  # contract the moment's multiply-add differently in the two programs: an
  # outlier (kept exactly, as computed) may then differ by an ulp; the
  # codes, indices and scales may not.
  _, s_xla = _run("xla", block_size=512)
  _, s_kernel = _run("interpret", block_size=512)
  for x, y in zip(jax.tree.leaves(s_xla), jax.tree.leaves(s_kernel),
                  strict=True):
    if jnp.issubdtype(x.dtype, jnp.floating):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2.5e-7)
    else:
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("kernel", ["auto", "interpret"])
def test_data_parallel_step_inside_shard_map(kernel):
  # Replicated params and state, the gradient averaged over the mesh axis,
  # under shard_map's default check_vma: the kernel's outputs must say how
  # they vary ("auto" traces the kernel on every platform).
  from jax.sharding import PartitionSpec as P
  mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
  opt = quantized_adam(1e-2, block_size=64, kernel=kernel)
  params = _params()
  state = opt.init(params)

  def step(g, s, p):
    return opt.update(jax.lax.pmean(g, "data"), s, p)

  mapped = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P()),
                                 out_specs=(P(), P())))
  got = mapped(_grads(0), state, params)
  want = jax.jit(quantized_adam(1e-2, block_size=64, kernel="xla").update)(
      _grads(0), state, params)
  chex.assert_trees_all_close(got[1], want[1], rtol=0, atol=0)
  chex.assert_trees_all_close(got[0], want[0], rtol=3e-7)


def test_vmapped_over_states_writes_the_xla_paths_state():
  # An ensemble: one optimizer state per member, stepped under vmap.
  params = _params()
  g = _grads(0)

  def run(kernel: str) -> Any:
    opt = quantized_adam(1e-2, block_size=64, kernel=kernel)
    states = jax.vmap(lambda _: opt.init(params))(jnp.arange(3))
    return jax.jit(jax.vmap(lambda s: opt.update(g, s, params)))(states)

  (u_xla, s_xla), (u_kernel, s_kernel) = run("xla"), run("interpret")
  chex.assert_trees_all_close(s_kernel, s_xla, rtol=0, atol=0)
  chex.assert_trees_all_close(u_kernel, u_xla, rtol=3e-7)


def test_blocks_padded_to_a_power_of_two_ignore_their_padding():
  # A last axis of 40 in blocks of 64 is read as 64 wide (Triton's tiles):
  # the 24 padding elements must stay out of the block's statistics. Here
  # the second step about cancels the first's mu, leaving only its rounding
  # errors, while padding read as code 0 would decode to -scale.
  params = {"c": jnp.zeros((3, 5, 40), jnp.float32)}
  g = np.random.default_rng(3).standard_normal((3, 5, 40))
  g1 = {"c": jnp.asarray(g, jnp.float32)}
  g2 = {"c": jnp.asarray(-0.9 * g, jnp.float32)}
  states = {}
  for kernel in ("xla", "interpret"):
    opt = quantized_adam(1e-2, block_size=64, kernel=kernel)
    state = opt.init(params)
    for g in (g1, g2):
      _, state = jax.jit(opt.update)(g, state, params)
    states[kernel] = state
  for x, y in zip(jax.tree.leaves(states["xla"]),
                  jax.tree.leaves(states["interpret"]), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_skipped_step_is_bit_identical():
  scale = jmp_lite.DynamicLossScale(2.0**10)
  opt = jmp_lite.stochastic_rounding(jmp_lite.loss_scaled(
      quantized_adam(1e-2, block_size=64, kernel="interpret"), scale))
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), _params())
  state = opt.init(params)
  step = jax.jit(lambda g, s, p: jmp_lite.update_and_apply(opt, g, s, p))
  grads = jax.tree.map(lambda p: jnp.full_like(p, 2.0**10), params)
  params, state = step(grads, state, params)
  inner = lambda s: jax.tree.leaves(s.inner_state.inner_state)
  bad = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.inf), grads)
  new_params, new_state = step(bad, state, params)
  for x, y in zip(inner(state), inner(new_state), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(new_params),
                  strict=True):
    np.testing.assert_array_equal(np.asarray(x, np.float32),
                                  np.asarray(y, np.float32))


@pytest.mark.parametrize("kernel,fused", [("xla", False), ("interpret", True)])
def test_kernel_choice(kernel, fused):
  opt = quantized_adam(1e-3, kernel=kernel)
  params = {"w": jnp.ones((4, 256))}
  jaxpr = str(jax.make_jaxpr(opt.update)(params, opt.init(params), params))
  assert ("pallas_call" in jaxpr) == fused


@pytest.mark.skipif(jax.__version_info__ < (0, 11),
                    reason="JAX 0.10's CPU wheel has no Triton lowering")
def test_auto_picks_the_kernel_by_lowering_platform():
  # "auto": the kernel where the step is lowered for a CUDA GPU, the XLA
  # path where it is lowered for the CPU (a CPU computation on a GPU host),
  # whatever the process's default backend.
  opt = quantized_adam(1e-3)
  params = {"w": jnp.ones((4, 256))}
  state = opt.init(params)
  cuda = lowered_for_h100(opt.update, params, state, params)
  assert cuda.count("xla.gpu.triton") == 1
  cpu = jax.export.export(jax.jit(opt.update), platforms=["cpu"])(
      params, state, params)
  assert "triton" not in cpu.mlir_module()


def test_state_moves_to_and_from_quantized_states():
  # The same state: quantized_states(optax.adam) steps what the kernel made.
  plain = jmp_lite.quantized_states(optax.adam(1e-2), block_size=64)
  _, state = _run("interpret", steps=1)
  params = _params()
  _, s_plain = jax.jit(plain.update)(_grads(1), state, params)
  opt = quantized_adam(1e-2, block_size=64, kernel="interpret")
  _, s_kernel = jax.jit(opt.update)(_grads(1), state, params)
  for x, y in zip(jax.tree.leaves(s_plain), jax.tree.leaves(s_kernel),
                  strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(kernel="cuda"), ValueError, "kernel must be one of"),
    (dict(learning_rate=optax.constant_schedule(1e-3)), TypeError,
     "learning_rate must be a float"),
    (dict(bits=3), ValueError, "bits must be 8 or 4"),
    (dict(b2="x"), TypeError, "b2 must be a float, got str"),
    (dict(learning_rate=float("nan")), ValueError,
     "learning_rate must be finite and >= 0.0, got nan"),
    (dict(b1=1.5), ValueError, r"b1 must be finite and in \[0.0, 1.0\)"),
    (dict(eps=-1.0), ValueError, "eps must be finite and >= 0.0"),
    (dict(kernel="pallas", block_size=16384), ValueError,
     "blocks of at most 8192 elements, got block_size=16384"),
])
def test_bad_input_names_the_value(kwargs, error, match):
  kwargs = {"learning_rate": 1e-3, **kwargs}
  with pytest.raises(error, match=match):
    quantized_adam(**kwargs)


def test_another_configurations_state_is_refused():
  params = {"w": jnp.ones((4, 256))}
  state = quantized_adam(1e-3, seed=1).init(params)
  opt = quantized_adam(1e-3, kernel="interpret")
  with pytest.raises(ValueError, match="another configuration"):
    opt.update(params, state, params)


@pytest.mark.skipif(jax.__version_info__ < (0, 11),
                    reason="JAX 0.10's CPU wheel has no Triton lowering")
@pytest.mark.parametrize("bits,rounding,scale_dtype", [
    (8, "stochastic", "float32"), (4, "stochastic", "float32"),
    (8, "nearest", "float32"), (8, "stochastic", "bfloat16"),
    (4, "nearest", "bfloat16")])
def test_kernel_lowers_for_a_gpu(bits, rounding, scale_dtype):
  # Pallas' Triton lowering refuses what the interpreter runs (slices,
  # gathers, any-reductions, tiles that are not powers of two, round, a
  # bfloat16 nextafter): lower each leaf shape and every option for an
  # H100 from this host, as a GPU would compile it.
  opt = quantized_adam(1e-3, bits=bits, block_size=64, kernel="pallas",
                       rounding=rounding, scale_dtype=scale_dtype)
  params = _params()
  state = opt.init(params)
  module = lowered_for_h100(opt.update, params, state, params)
  # One kernel per quantized leaf (the scalar stays plain Adam), with the
  # kernel's own launch settings (not Pallas' defaults) though this host
  # is not a GPU.
  assert module.count("xla.gpu.triton") == 3
  assert module.count("num_warps = 8 : i32") == 3


@pytest.mark.skipif(jax.__version_info__ < (0, 11),
                    reason="JAX 0.10's CPU wheel has no Triton lowering")
def test_blocks_too_wide_for_the_kernel_take_the_xla_path_on_gpus():
  # 8 x 16384 elements per program spilled 47,000 registers to memory.
  opt = quantized_adam(1e-3, block_size=16384)
  params = {"w": jnp.ones((4, 16384))}
  state = opt.init(params)
  assert "triton" not in lowered_for_h100(opt.update, params, state, params)


@pytest.mark.skipif(jax.default_backend() != "gpu",
                    reason="the compiled Pallas kernel: a GPU")
@pytest.mark.parametrize("bits", [8, 4])
def test_compiled_kernel_matches_the_xla_path_on_gpu(bits):
  # Triton and XLA:GPU each contract multiply-adds into FMAs as they see
  # fit, so a code a hair from a rounding threshold may differ by one; the
  # rest (and every scale, outlier and index) must agree.
  u_xla, s_xla = _run("xla", bits=bits)
  u_kernel, s_kernel = _run("pallas", bits=bits)
  for name in ("mu", "nu"):
    for k in _SHAPES:
      x = getattr(s_xla.inner_state[0], name)[k]
      y = getattr(s_kernel.inner_state[0], name)[k]
      if not isinstance(x, QuantizedArray):
        continue
      cx, cy = np.asarray(x.codes), np.asarray(y.codes)
      if bits == 4:
        cx = np.stack([cx & 0xF, cx >> 4], -1)
        cy = np.stack([cy & 0xF, cy >> 4], -1)
      diff = np.abs(cx.astype(np.int32) - cy.astype(np.int32))
      assert diff.max() <= 1 and (diff > 0).mean() < 1e-2, (name, k)
      np.testing.assert_allclose(np.asarray(x.scales, np.float32),
                                 np.asarray(y.scales, np.float32), rtol=1e-5)
      np.testing.assert_array_equal(np.asarray(x.where), np.asarray(y.where))
  for x, y in zip(u_xla, u_kernel, strict=True):
    jax.tree.map(lambda p, q: np.testing.assert_allclose(
        np.asarray(p), np.asarray(q), rtol=1e-3, atol=1e-6), x, y)
