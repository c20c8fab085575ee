"""Shared fixtures: eager vs jit variants and dtype parameter lists."""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Most of the suite's time is XLA:CPU compiling small programs it runs a few
# steps, and much of that is LLVM optimising the generated kernels, which
# buys nothing for programs run a few times. So the tests compile at XLA:CPU's
# backend optimisation level 0 (LLVM -O0) without the expensive LLVM passes:
# compile-bound test files take 20-40% less time (tests/test_linen.py 170 ->
# 108 s). Both act after every HLO pass, so the dtypes, fusions, copies,
# buffer assignments and cost-model bytes the tests read are unchanged (the
# loss-scaling benchmark's bytes are identical at either level). The few
# tests that train for hundreds of steps run slower unoptimised; they ask for
# full code generation with the ``optimized_codegen`` fixture below. XLA
# reads the flags when the first backend starts (after these imports, before
# any test); the notebooks, demos and benchmark smoke tests the suite starts
# inherit them. Benchmarks run by hand keep full code generation.
_FAST_COMPILE = ("--xla_llvm_disable_expensive_passes=true",
                 "--xla_backend_optimization_level=0")
_flags = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join(filter(None, [
    _flags, *(f for f in _FAST_COMPILE if f.split("=")[0] not in _flags)]))

ROOT = pathlib.Path(__file__).resolve().parents[1]


def multidevice_env(devices: int) -> dict[str, str]:
  """The environment of a subprocess that sees ``devices`` CPU devices.

  The device count is added to the inherited ``XLA_FLAGS`` (the flag above
  included); the checkout is importable and JAX stays on the CPU.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  flags = " ".join(filter(None, [
      flags, f"--xla_force_host_platform_device_count={devices}"]))
  return dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=flags,
              JAX_PLATFORMS="cpu")


@contextlib.contextmanager
def full_codegen() -> Iterator[None]:
  """Compiles every ``jax.jit`` inside the block at XLA's default level (3).

  For code whose compiled kernels run long enough that LLVM's optimisation
  pays for itself: hundreds of training steps (the fidelity runs), or a few
  steps of a convolutional network in half precision (Haiku's ResNet-18:
  20 steps take 17 s at level 0 and 4 s at level 3, for 1.4 s more
  compilation). It wraps ``jax.jit``, adding ``compiler_options`` that
  override the suite-wide ``XLA_FLAGS`` level for those compilations only.
  A linen policy's traced apply is left as it is: it runs as a ``jax.jit``
  nested in the caller's, where JAX refuses ``compiler_options``.
  """
  from jmp_lite import linen
  jit = jax.jit

  def full_codegen_jit(fun, /, *args, **kwargs):
    if fun is linen._apply_arrays:  # noqa: SLF001 (nested by design)
      return jit(fun, *args, **kwargs)
    options = {"xla_backend_optimization_level": 3,
               **(kwargs.pop("compiler_options", None) or {})}
    return jit(fun, *args, compiler_options=options, **kwargs)

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(jax, "jit", full_codegen_jit)
    yield


@pytest.fixture(scope="module")
def optimized_codegen():
  """:func:`full_codegen` for the rest of the module.

  For the modules whose training fixtures run for hundreds of steps (the
  fidelity file, when it was measured: 415 s at level 0, 237 s at level 2;
  level 3 since).
  """
  with full_codegen():
    yield


# The training settings of every test that compares a recipe's held-out loss
# with a reference's (tests/test_fidelity.py, the FP8 fidelity runs): Adam
# 3e-4 for 300 steps. At the tasks' default 3e-3 two digits runs that differ
# only in rounding end up 0.85-1.18x apart by seed, so a 2% bound there
# tests the trajectory; here they stay within 0.6% (tests/test_fidelity.py's
# docstring has the measurement).
FIDELITY_SETTINGS = {"lr": 3e-4, "steps": 300}

# What skip_with="auto" compiles to on the backend the suite runs on: one
# lax.cond on the CPU, selects on GPU/TPU (GuardConfig.formulation), and the
# kind jmp_lite.step.formulation reports for it.
AUTO_SKIP_WITH = "cond" if jax.default_backend() == "cpu" else "select"
AUTO_KIND = "cond" if AUTO_SKIP_WITH == "cond" else "update"

FLOAT_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
FLOAT_DTYPE_IDS = ["f32", "bf16", "f16"]


def as_xla_gpu_simplifies(fn):
  """``fn``, evaluated with every float cast round trip removed.

  XLA:GPU, under its default ``--xla_allow_excess_precision``, deletes a
  conversion that narrows a float and the one that widens it straight back
  (f32 -> bf16 -> f32 becomes the f32 value), and XLA:CPU keeps both. This
  interprets ``fn``'s jaxpr op by op the GPU's way, nested ``jit``s
  included, so that code whose point is that rounding can be tested here.
  """
  from jax.extend import core as jex

  def run(jaxpr, consts, args, origins):
    env, wide_of = {}, {}

    def read(v):
      return v.val if isinstance(v, jex.Literal) else env[v]

    for var, value in zip(jaxpr.constvars, consts, strict=True):
      env[var] = value
    for var, value, origin in zip(jaxpr.invars, args, origins, strict=True):
      env[var] = value
      if origin is not None:
        wide_of[var] = origin
    for eqn in jaxpr.eqns:
      invals = [read(v) for v in eqn.invars]
      name = eqn.primitive.name
      # Nested jits, and custom_jvp/vjp functions (their primal program):
      # one XLA computation, so the GPU's simplification reaches into them.
      sub = eqn.params.get("jaxpr" if name in ("pjit", "jit") else
                           "call_jaxpr")
      if sub is not None:
        outs = run(sub.jaxpr, sub.consts, invals, [
            None if isinstance(v, jex.Literal) else wide_of.get(v)
            for v in eqn.invars])
      else:
        outs = eqn.primitive.bind(*invals, **eqn.params)
        outs = outs if eqn.primitive.multiple_results else [outs]
      if name == "convert_element_type" and not isinstance(
          eqn.invars[0], jex.Literal):
        (x,), (out,) = eqn.invars, eqn.outvars
        src, dst = np.dtype(x.aval.dtype), np.dtype(out.aval.dtype)
        if (jnp.issubdtype(src, jnp.floating) and jnp.issubdtype(dst,
            jnp.floating)):
          if x in wide_of and np.dtype(wide_of[x].dtype) == dst:
            outs = [wide_of[x]]   # The round trip, deleted.
          elif np.dtype(dst).itemsize < np.dtype(src).itemsize:
            wide_of[out] = invals[0]
      for var, value in zip(eqn.outvars, outs, strict=True):
        env[var] = value
    return [read(v) for v in jaxpr.outvars]

  def simplified(*args):
    closed = jax.make_jaxpr(fn)(*args)
    flat = jax.tree.leaves(args)
    outs = run(closed.jaxpr, closed.consts, flat, [None] * len(flat))
    shape = jax.eval_shape(fn, *args)
    return jax.tree.unflatten(jax.tree.structure(shape), outs)

  return simplified


@pytest.fixture(params=["eager", "jit"])
def variant(request):
  """Runs a test once eagerly and once under ``jax.jit``."""
  if request.param == "eager":
    return lambda f, **kw: f
  return lambda f, **kw: jax.jit(f, **kw)


def assert_dtype(x, dtype) -> None:
  """Asserts an array's dtype exactly (``==`` on 0-d arrays ignores it)."""
  assert np.dtype(x.dtype) == np.dtype(dtype), (x.dtype, dtype)
