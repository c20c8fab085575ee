"""quantized_adam: the fused kernels (the Pallas kernel run in Pallas'
interpreter, and the C++ CPU kernel) write what quantized_states(optax.adam)'s
XLA path writes."""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
import sys
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite
from jmp_lite.low_precision import _cpu_kernel, quantized_adam, QuantizedArray
from jmp_lite.low_precision._blockwise import UNSIGNED_MAP
from tests.conftest import lowered_for_h100, ROOT

# At XLA:CPU's default optimisation level, as users compile: at the suite's
# level 0, LLVM emits float32 sqrt differently in the interpreter's loop and
# in the whole-array program, an ulp apart in a few of nu's scales.
pytestmark = pytest.mark.usefixtures("optimized_codegen")

# The kernels that run on this host: Pallas' interpreter and the C++ kernel.
KERNELS = ["interpret", pytest.param("cpu", marks=pytest.mark.skipif(
    bool(_cpu_kernel.unavailable()),
    reason=f"no C++ kernel here: {_cpu_kernel.unavailable()}"))]

# Whole-row blocks, a short 1-D leaf, blocks of several short rows, a 3-D
# leaf of rows longer than a block (its last block partial), a scalar.
_SHAPES = {"w": (16, 256), "b": (70,), "c": (3, 5, 40), "h": (2, 3, 300),
           "s": ()}


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


def _assert_state_matches(want: Any, got: Any, kernel: str) -> None:
  """``got`` (a kernel's state) against ``want`` (the XLA path's).

  Bit for bit from Pallas' interpreter, which XLA compiles as it compiles
  the XLA path. The C++ kernel computes each new moment once, as XLA:CPU's
  optimized code does (one multiply-add each); but XLA:CPU contracts
  multiply-adds in some fusions and not in others depending on its flags
  (this suite's among them) and rewrites ``q / sqrt`` with its own rsqrt,
  so a scale or outlier may differ by an ulp (more where the new moment
  cancels: 1e-6 relative in the padding test), a code a hair from a
  rounding threshold by one, and, a step later, that code's block's scale
  or outlier by part of a code step. test_cpu_kernel_agrees_with_the_xla_
  path_at_default_flags bounds that at XLA's default flags.
  """
  is_q = lambda x: isinstance(x, QuantizedArray)
  assert jax.tree.structure(want) == jax.tree.structure(got)
  paths = jax.tree_util.tree_flatten_with_path(want, is_leaf=is_q)[0]
  for (path, x), y in zip(paths, jax.tree.leaves(got, is_leaf=is_q),
                          strict=True):
    name = jax.tree_util.keystr(path)
    if kernel != "cpu" or not is_q(x):
      for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True):
        assert a.dtype == b.dtype, name
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                      err_msg=name)
      continue
    codes = [np.asarray(q.codes).astype(np.int32) for q in (x, y)]
    if x.bits == 4:
      codes = [np.stack([c & 0xF, c >> 4]) for c in codes]
    diff = np.abs(codes[0] - codes[1])
    assert diff.max() <= 1 and (diff > 0).mean() < 1e-2, name
    # A code one apart moves its element's next moment by part of a code
    # step: that block's scale or outlier (within 2%, one top code), in as
    # many blocks at most as codes differed.
    moved = np.zeros(np.shape(x.scales), bool)
    for field in ("scales", "outliers"):
      a, b = (np.asarray(getattr(q, field), np.float32) for q in (x, y))
      assert getattr(x, field).dtype == getattr(y, field).dtype, name
      np.testing.assert_allclose(a, b, rtol=2e-2, err_msg=f"{name}.{field}")
      moved |= ~np.isclose(a, b, rtol=1e-5, atol=0)
    assert moved.sum() <= max(1, int((diff > 0).sum())), (name, moved.sum())
    for field in ("where", "form"):
      a, b = (np.asarray(getattr(q, field)) for q in (x, y))
      if field == "where":
        a, b = a[~moved], b[~moved]
      np.testing.assert_array_equal(a, b, err_msg=f"{name}.{field}")


def _assert_updates_match(want: Any, got: Any, kernel: str) -> None:
  # Within an ulp or two; for the C++ kernel also within 1e-6 of the
  # learning rate, where a moment's FMA (above) meets cancellation.
  chex.assert_trees_all_close(got, want, rtol=3e-7,
                              atol=1e-8 if kernel == "cpu" else 0.0)


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
@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_writes_the_xla_paths_state(bits, rounding, scale_dtype,
                                           block_size, kernel):
  kwargs = dict(bits=bits, rounding=rounding, scale_dtype=scale_dtype,
                block_size=block_size)
  u_xla, s_xla = _run("xla", **kwargs)
  u_kernel, s_kernel = _run(kernel, **kwargs)
  # Codes, scales, outliers, indices, forms and counters.
  _assert_state_matches(s_xla, s_kernel, kernel)
  mu = s_kernel.inner_state[0].mu["w"]
  assert isinstance(mu, QuantizedArray) and mu.bits == bits
  # The spike is its block's outlier, kept exactly.
  assert float(mu.outliers[3 // 1, 7 // 64]) != 0.0
  # Updates: XLA's simplifier rewrites m / c1 / (sqrt(v / c2) + eps) per
  # program (plain jitted optax.adam differs by an ulp between a one-leaf and
  # a two-leaf tree), so within an ulp or two, not bit for bit.
  for x, y in zip(u_xla, u_kernel, strict=True):
    _assert_updates_match(x, y, kernel)


@pytest.mark.parametrize("kernel", KERNELS)
def test_wide_blocks_write_the_xla_paths_state(kernel):
  # Blocks of 512 (and a last axis of 40 read as rows). XLA:CPU may
  # contract the moment's multiply-add differently in the two programs: an
  # outlier (kept exactly, as computed) may then differ by an ulp; the
  # codes, indices and scales may not.
  _, s_xla = _run("xla", block_size=512)
  _, s_kernel = _run(kernel, block_size=512)
  if kernel == "cpu":
    _assert_state_matches(s_xla, s_kernel, kernel)
    return
  for x, y in zip(jax.tree.leaves(s_xla), jax.tree.leaves(s_kernel),
                  strict=True):
    if jnp.issubdtype(x.dtype, jnp.floating):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2.5e-7)
    else:
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("kernel", ["auto", *KERNELS])
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
  _assert_state_matches(want[1], got[1], kernel)
  _assert_updates_match(want[0], got[0], kernel)


@pytest.mark.parametrize("kernel", KERNELS)
def test_vmapped_over_states_writes_the_xla_paths_state(kernel):
  # An ensemble: one optimizer state per member, stepped under vmap.
  params = _params()
  g = _grads(0)

  def run(kernel: str) -> Any:
    opt = quantized_adam(1e-2, block_size=64, kernel=kernel)
    states = jax.vmap(lambda _: opt.init(params))(jnp.arange(3))
    return jax.jit(jax.vmap(lambda s: opt.update(g, s, params)))(states)

  (u_xla, s_xla), (u_kernel, s_kernel) = run("xla"), run(kernel)
  _assert_state_matches(s_xla, s_kernel, kernel)
  _assert_updates_match(u_xla, u_kernel, kernel)


@pytest.mark.parametrize("kernel", KERNELS)
def test_blocks_padded_to_a_power_of_two_ignore_their_padding(kernel):
  # A last axis of 40 in blocks of 64 is read as 64 wide (Triton's tiles):
  # the 24 padding elements must stay out of the block's statistics. Here
  # the second step about cancels the first's mu, leaving only its rounding
  # errors, while padding read as code 0 would decode to -scale.
  params = {"c": jnp.zeros((3, 5, 40), jnp.float32)}
  g = np.random.default_rng(3).standard_normal((3, 5, 40))
  g1 = {"c": jnp.asarray(g, jnp.float32)}
  g2 = {"c": jnp.asarray(-0.9 * g, jnp.float32)}
  states = {}
  for name in ("xla", kernel):
    opt = quantized_adam(1e-2, block_size=64, kernel=name)
    state = opt.init(params)
    for g in (g1, g2):
      _, state = jax.jit(opt.update)(g, state, params)
    states[name] = state
  _assert_state_matches(states["xla"], states[kernel], kernel)


@pytest.mark.parametrize("kernel", KERNELS)
def test_skipped_step_is_bit_identical(kernel):
  scale = jmp_lite.DynamicLossScale(2.0**10)
  opt = jmp_lite.stochastic_rounding(jmp_lite.loss_scaled(
      quantized_adam(1e-2, block_size=64, kernel=kernel), scale))
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


@pytest.mark.parametrize("kernel,pallas,cpu", [
    ("xla", False, False), ("interpret", True, False),
    *[pytest.param(*v, marks=KERNELS[1].marks)
      for v in [("cpu", False, True), ("auto", True, True)]]])
def test_kernel_choice(kernel, pallas, cpu):
  # "auto" on a CPU host traces both kernels: platform_dependent lowers the
  # one for the platform the step is compiled for.
  opt = quantized_adam(1e-3, kernel=kernel)
  params = {"w": jnp.ones((4, 256))}
  jaxpr = str(jax.make_jaxpr(opt.update)(params, opt.init(params), params))
  assert ("pallas_call" in jaxpr) == pallas
  assert (_cpu_kernel.TARGET in jaxpr) == cpu


@pytest.mark.skipif(jax.__version_info__ < (0, 11),
                    reason="JAX 0.10's CPU wheel has no Triton lowering")
def test_auto_picks_the_kernel_by_lowering_platform():
  # "auto": the Pallas kernel where the step is lowered for a CUDA GPU, the
  # C++ kernel (on this CPU host) where it is lowered for the CPU, whatever
  # the process's default backend. An export for the CPU names the C++
  # kernel's custom call, which jax.export accepts only when told to.
  opt = quantized_adam(1e-3)
  params = {"w": jnp.ones((4, 256))}
  state = opt.init(params)
  cuda = lowered_for_h100(opt.update, params, state, params)
  assert cuda.count("xla.gpu.triton") == 1
  assert _cpu_kernel.TARGET not in cuda
  export = functools.partial(jax.export.export, jax.jit(opt.update),
                             platforms=["cpu"])
  if not _cpu_kernel.unavailable():
    with pytest.raises(ValueError, match=_cpu_kernel.TARGET):
      export()(params, state, params)
  cpu = export(disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(
      _cpu_kernel.TARGET)])(params, state, params).mlir_module()
  assert "triton" not in cpu
  assert (_cpu_kernel.TARGET in cpu) == (not _cpu_kernel.unavailable())


@pytest.mark.parametrize("kernel", KERNELS)
def test_state_moves_to_and_from_quantized_states(kernel):
  # The same state: quantized_states(optax.adam) steps what the kernel made.
  plain = jmp_lite.quantized_states(optax.adam(1e-2), block_size=64)
  _, state = _run(kernel, steps=1)
  params = _params()
  _, s_plain = jax.jit(plain.update)(_grads(1), state, params)
  opt = quantized_adam(1e-2, block_size=64, kernel=kernel)
  _, s_kernel = jax.jit(opt.update)(_grads(1), state, params)
  _assert_state_matches(s_plain, s_kernel, kernel)


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
  quantized = sum(len(s) > 0 for s in _SHAPES.values())
  assert module.count("xla.gpu.triton") == quantized
  assert module.count("num_warps = 8 : i32") == quantized


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


# The C++ kernel on what users hand it.


def _both(params: Any, grads: list[Any], **kwargs: Any) -> list[Any]:
  # (last updates, state) of the XLA path and of the C++ kernel.
  out = []
  for kernel in ("xla", "cpu"):
    opt = quantized_adam(1e-2, kernel=kernel, **kwargs)
    state, u = opt.init(params), None
    update = jax.jit(opt.update)
    for g in grads:
      u, state = update(g, state, params)
    out.append((u, state))
  return out


@pytest.mark.parametrize("kernel", KERNELS[1:])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_cpu_kernel_reads_gradients_in_their_dtype(kernel, dtype):
  # Half-precision gradients (and params), as a bfloat16 or float16 model
  # hands them, are read and widened in the kernel.
  params = jax.tree.map(lambda p: p.astype(dtype), _params())
  grads = [jax.tree.map(lambda g: jnp.clip(g, -6e4, 6e4).astype(dtype),
                        _grads(i)) for i in range(2)]
  (u_xla, s_xla), (u_cpu, s_cpu) = _both(params, grads, block_size=64)
  _assert_state_matches(s_xla, s_cpu, kernel)
  _assert_updates_match(u_xla, u_cpu, kernel)


@pytest.mark.parametrize("kernel", KERNELS[1:])
@pytest.mark.parametrize("bits", [8, 4])
def test_cpu_kernel_walks_every_block_layout(kernel, bits):
  # Blocks of several whole rows (a last axis of 7: 9 rows of 7 in a block
  # of 64, odd widths packing 4-bit pairs across no block boundary), a
  # partial last block, and a leaf of many blocks (several threads' tasks).
  rng = np.random.default_rng(5)
  shapes = {"rows": (6, 5, 7), "odd": (3, 99), "big": (160, 640),
            "vec": (1,)}
  params = {k: jnp.asarray(rng.standard_normal(s), jnp.float32)
            for k, s in shapes.items()}
  grads = [{k: jnp.asarray(rng.standard_normal(s) * 10.0**i, jnp.float32)
            for k, s in shapes.items()} for i in range(3)]
  (u_xla, s_xla), (u_cpu, s_cpu) = _both(params, grads, bits=bits,
                                         block_size=64)
  _assert_state_matches(s_xla, s_cpu, kernel)
  _assert_updates_match(u_xla, u_cpu, kernel)


class _Head(NamedTuple):
  weight: jax.Array


class _Actor(NamedTuple):
  """A trunk ``weight`` beside a head named ``mu``: the head's key path
  (mu, weight) ends the trunk's Adam state path (0, mu, weight)."""
  mu: _Head
  weight: jax.Array


@pytest.mark.parametrize("kernel", KERNELS)
def test_params_named_like_a_moment_draw_their_own_streams(kernel):
  # Before: the kernels gave the trunk the head's random stream (identical
  # codes for equal gradients) and differed from the XLA path.
  params = _Actor(mu=_Head(jnp.zeros((8, 256))), weight=jnp.zeros((8, 256)))
  g = jax.random.normal(jax.random.key(0), (8, 256)) * 1e-3
  grads = _Actor(mu=_Head(g), weight=g)
  states = []
  for name in ("xla", kernel):
    opt = quantized_adam(1e-3, kernel=name)
    states.append(jax.jit(opt.update)(grads, opt.init(params), params)[1])
  _assert_state_matches(*states, kernel)
  adam = states[1].inner_state[0]
  for moment in (adam.mu, adam.nu):
    same = np.mean(np.asarray(moment.mu.weight.codes)
                   == np.asarray(moment.weight.codes))
    assert same < 0.9, same


@pytest.mark.parametrize("kernel", KERNELS)
def test_nans_of_different_payloads_keep_the_same_outlier(kernel):
  # Of two NaN moments in a block, every path keeps the one with the
  # larger bits (the Pallas kernel kept the first).
  nans = [jax.lax.bitcast_convert_type(jnp.uint32(b), jnp.float32)
          for b in (0x7FC00001, 0x7FC00123)]
  params = {"w": jnp.zeros((1, 64))}
  g = {"w": jnp.linspace(-1.0, 1.0, 64)[None].at[0, 3].set(nans[0]).at[
      0, 40].set(nans[1])}
  wheres = []
  for name in ("xla", kernel):
    opt = quantized_adam(1e-2, kernel=name, block_size=64)
    _, state = jax.jit(opt.update)(g, opt.init(params), params)
    wheres.append(int(state.inner_state[0].mu["w"].where[0, 0]))
  assert wheres == [40, 40]


@pytest.mark.parametrize("kernel", KERNELS[1:])
def test_cpu_kernel_reads_each_moment_with_the_map_it_was_written_with(
    kernel):
  # nu's codes written with the signed map (a checkpoint of another
  # ``unsigned=``): both paths read them by their form and convert.
  params = _params()
  _, state = _run("xla", steps=1)
  adam_state = state.inner_state[0]
  flipped = jax.tree.map(
      lambda q: dataclasses.replace(q, form=q.form.at[2].set(1))
      if isinstance(q, QuantizedArray) else q,
      adam_state.nu, is_leaf=lambda x: isinstance(x, QuantizedArray))
  state = dataclasses.replace(state, inner_state=(
      adam_state._replace(nu=flipped), *state.inner_state[1:]))
  outs = []
  for name in ("xla", "cpu"):
    opt = quantized_adam(1e-2, block_size=64, kernel=name)
    outs.append(jax.jit(opt.update)(_grads(1), state, params))
  assert int(outs[1][1].inner_state[0].nu["w"].form[2]) == UNSIGNED_MAP
  _assert_state_matches(outs[0][1], outs[1][1], kernel)
  _assert_updates_match(outs[0][0], outs[1][0], kernel)


@pytest.mark.parametrize("kernel", KERNELS[1:])
def test_cpu_kernel_writes_a_donated_state_in_place(kernel):
  # A train step donates the state: the kernel writes the new codes into
  # the old buffers (the XLA path copies every donated code array first).
  opt = quantized_adam(1e-2, block_size=64, kernel=kernel)
  params = _params()
  state = opt.init(params)
  step = jax.jit(opt.update, donate_argnums=1)
  hlo = step.lower(_grads(0), state, params).compile().as_text() or ""
  assert not re.search(r"= u8\[[0-9,]*\]\{[0-9,]*\} copy\(", hlo)
  want = jax.jit(opt.update)(_grads(0), state, params)
  got = step(_grads(0), jax.tree.map(jnp.copy, state), params)
  # The same kernel, donated or not: bit for bit.
  chex.assert_trees_all_equal(want[1], got[1])


def test_without_a_compiler_auto_warns_and_takes_the_xla_path(monkeypatch):
  why = "RuntimeError: no C++ compiler found (a test)"
  monkeypatch.setattr(_cpu_kernel, "unavailable", lambda: why)
  with pytest.raises(RuntimeError, match="cannot be built here .*a test"):
    quantized_adam(1e-3, kernel="cpu")
  opt = quantized_adam(1e-2, block_size=64)
  params = _params()
  state = opt.init(params)
  with pytest.warns(UserWarning, match="takes the XLA path"):
    jaxpr = str(jax.make_jaxpr(opt.update)(_grads(0), state, params))
  assert _cpu_kernel.TARGET not in jaxpr


@pytest.mark.parametrize("kernel", KERNELS[1:])
def test_cpu_kernel_refuses_gradients_it_cannot_read(kernel):
  with jax.enable_x64(True):
    params = {"w": jnp.ones((4, 64), jnp.float64)}
    opt = quantized_adam(1e-2, block_size=64, kernel="cpu")
    state = opt.init(params)
    with pytest.raises(ValueError, match="cannot take this step .gradients"
                       " of dtype float64"):
      opt.update(params, state, params)
    # "auto" takes the XLA path for them.
    auto = quantized_adam(1e-2, block_size=64)
    jaxpr = str(jax.make_jaxpr(auto.update)(params, state, params))
    assert _cpu_kernel.TARGET not in jaxpr


@pytest.mark.slow
@pytest.mark.parametrize("kernel", KERNELS[1:])
def test_cpu_kernel_is_built_once_into_the_cache(kernel, tmp_path,
                                                  monkeypatch):
  monkeypatch.setenv("JMP_LITE_CACHE", str(tmp_path))
  built = _cpu_kernel._build()
  assert built.parent == tmp_path and built.suffix == ".so"
  stamp = built.stat().st_mtime_ns
  assert _cpu_kernel._build() == built
  assert built.stat().st_mtime_ns == stamp
  assert [p.name for p in tmp_path.iterdir()] == [built.name]


# Run in a fresh process that imports no test module: this suite's conftest
# sets compile flags in XLA_FLAGS, and this compares at XLA's defaults.
_DEFAULT_FLAGS_CHECK = """
import os
import numpy as np, jax, jax.numpy as jnp
from jmp_lite.low_precision import QuantizedArray, quantized_adam
assert not os.environ.get("XLA_FLAGS")
SHAPES = {"w": (16, 256), "b": (70,), "c": (3, 5, 40), "big": (512, 1024)}
def run(kernel, **kw):
  opt = quantized_adam(1e-2, kernel=kernel, **kw)
  rng = np.random.default_rng(0)
  p = {k: jnp.asarray(rng.standard_normal(s), jnp.float32)
       for k, s in SHAPES.items()}
  state, update = opt.init(p), jax.jit(opt.update)
  for i in range(3):
    r = np.random.default_rng(i + 1)
    g = {k: jnp.asarray(r.standard_normal(s) * 10.0 ** (i - 1), jnp.float32)
         for k, s in SHAPES.items()}
    _, state = update(g, state, p)
  return state
is_q = lambda x: isinstance(x, QuantizedArray)
differ = total = moved = 0
for kw in [dict(bits=8), dict(bits=4), dict(rounding="nearest",
           scale_dtype="bfloat16"), dict(block_size=512)]:
  kw = {"block_size": 64, **kw}
  want, got = run("xla", **kw), run("cpu", **kw)
  for x, y in zip(jax.tree.leaves(want, is_leaf=is_q),
                  jax.tree.leaves(got, is_leaf=is_q), strict=True):
    if not is_q(x):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
      continue
    a, b = (np.asarray(q.codes).astype(np.int32) for q in (x, y))
    if x.bits == 4:
      a, b = (np.stack([c & 15, c >> 4]) for c in (a, b))
    assert np.abs(a - b).max() <= 1, kw
    differ += int((a != b).sum())
    total += a.size
    # Scales and outliers to an ulp, but in a block where a code differed
    # a step before (its element's new moment differs by a part of that
    # code's step): there within 2%, one top code.
    for f in ("scales", "outliers"):
      a, b = (np.asarray(getattr(q, f), np.float32) for q in (x, y))
      np.testing.assert_allclose(a, b, rtol=2e-2, err_msg=f"{kw} {f}")
      moved += int((~np.isclose(a, b, rtol=1e-6, atol=0)).sum())
print(differ, total, moved)
"""


@pytest.mark.slow
@pytest.mark.parametrize("kernel", KERNELS[1:])
def test_cpu_kernel_agrees_with_the_xla_path_at_default_flags(kernel):
  # A user's process has XLA's default flags: there a code differs by one
  # only where XLA's rsqrt or a contraction rounds a value a hair from a
  # threshold the other way (measured: a few per million), and a block's
  # scale or outlier by more than an ulp only where such a code moved its
  # element's next moment.
  env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu",
             PYTHONPATH=str(ROOT))
  done = subprocess.run([sys.executable, "-c", _DEFAULT_FLAGS_CHECK],
                        env=env, cwd="/", capture_output=True, text=True,
                        timeout=600, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  differ, total, moved = map(int, done.stdout.split())
  assert total > 4_000_000 and differ / total < 1e-5, (differ, total)
  assert moved <= differ, (moved, differ)


@pytest.mark.parametrize("kernel", KERNELS[1:])
def test_cpu_kernel_refuses_arrays_that_do_not_fit_the_layout(kernel):
  # The kernel indexes the state's arrays by the leaf's layout: a state
  # whose arrays were cut to another shape is refused before it runs.
  params = {"w": jnp.ones((4, 256))}
  opt = quantized_adam(1e-2, block_size=64, kernel=kernel)
  state: Any = opt.init(params)
  mu = state.inner_state[0].mu["w"]
  cut = dataclasses.replace(mu, scales=mu.scales[:, :2])
  state = dataclasses.replace(state, inner_state=(
      state.inner_state[0]._replace(mu={"w": cut}), *state.inner_state[1:]))
  with pytest.raises(ValueError, match=r"a mu leaf's arrays .* do not fit"):
    jax.jit(opt.update)(params, state, params)


@pytest.mark.parametrize("kernel", ["auto", *KERNELS[1:]])
def test_sharded_state_inside_shard_map(kernel):
  # Params and state split along rows over the mesh axis: every operand and
  # result varies over it, and "auto"'s branches must agree on that type.
  # (Pallas' interpreter itself fails here, in its dynamic_slice: JAX's.)
  from jax.sharding import PartitionSpec as P
  mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
  params = {"w": jnp.asarray(np.random.default_rng(2).standard_normal(
      (32, 128)), jnp.float32)}
  opt = quantized_adam(1e-2, block_size=64, kernel=kernel)
  state = opt.init(params)
  spec = jax.tree.map(lambda x: P("data") if getattr(x, "ndim", 0) >= 2
                      else P(), state)
  mapped = jax.jit(jax.shard_map(
      opt.update, mesh=mesh, in_specs=({"w": P("data")}, spec,
                                       {"w": P("data")}),
      out_specs=({"w": P("data")}, spec)))
  got = mapped(params, state, params)
  want = jax.jit(quantized_adam(1e-2, block_size=64, kernel="xla").update)(
      params, state, params)
  _assert_state_matches(want[1], got[1], kernel)
  _assert_updates_match(want[0], got[0], kernel)
