"""Shared fixtures: eager vs jit variants and dtype parameter lists."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import pathlib
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

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
# XLA:CPU's MLIR fusion emitters (its default) take about twice as long to
# compile as its older LLVM IR emitters, which the third flag keeps: the
# default suite ran in 491 CPU-s instead of 841 (2 cores, one file at a
# time). Unlike the two above it can change XLA:CPU's fusion decisions
# (scatter), but no test reads the compiled program (only dtypes, jaxprs,
# StableHLO and values), and every test passes either way. The fourth
# compiles each program as one LLVM module rather than split in parts for
# threads, whose overhead small programs do not repay (test_step.py and
# test_linen.py: 8% less CPU time, the whole default set about 2%); it
# leaves the program as it is.
_FAST_COMPILE = ("--xla_llvm_disable_expensive_passes=true",
                 "--xla_backend_optimization_level=0",
                 "--xla_cpu_use_fusion_emitters=false",
                 "--xla_cpu_parallel_codegen_split_count=1")
# jaxlib 0.11 dropped the fusion-emitter flag (and its older emitters): an
# unknown flag in XLA_FLAGS aborts the process, so it goes to jaxlib 0.10.
if tuple(int(p) for p in importlib.metadata.version("jaxlib").split(".")[:2]
         ) >= (0, 11):
  _FAST_COMPILE = tuple(f for f in _FAST_COMPILE
                        if "use_fusion_emitters" not in f)
_flags = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join(filter(None, [
    _flags, *(f for f in _FAST_COMPILE if f.split("=")[0] not in _flags)]))

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Scripts the tests start in subprocesses (8 forced host devices, several
# processes under jax.distributed): importing them in the test process, as
# --doctest-modules would, parses their command line and initialises JAX's
# distributed runtime there.
collect_ignore_glob = ["multidevice/*.py", "multiprocess/*.py"]


def lowered_for_h100(fn: Callable[..., Any], *args: Any) -> str:
  """``jax.jit(fn)`` lowered for an H100 from this (CPU) host, as a GPU
  would compile it: the exported module's text (Triton kernels appear as
  ``xla.gpu.triton`` custom calls). JAX >= 0.11."""
  device = jax.sharding.AbstractDevice(
      device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
  with jax.sharding.use_abstract_mesh(mesh):
    return jax.export.export(jax.jit(fn), platforms=["cuda"],
                             disabled_checks=[triton])(*args).mlir_module()


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


def run_multidevice(script: str, devices: int, timeout: int = 600
                    ) -> subprocess.CompletedProcess[str]:
  """Runs ``tests/<script>`` in a subprocess that sees
  ``devices`` CPU devices (:func:`multidevice_env`), warnings as errors;
  fails the calling test, with the script's output, unless it exits 0."""
  proc = subprocess.run(
      [sys.executable, "-W", "error",
       str(ROOT / "tests" / script)],
      capture_output=True, text=True, cwd=ROOT, env=multidevice_env(devices),
      timeout=timeout)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  return proc


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


def as_xla_gpu_simplifies(fn: Callable[..., Any]) -> Callable[..., Any]:
  """``fn``, evaluated with float cast chains collapsed as XLA:GPU does.

  XLA:GPU, under its default ``--xla_allow_excess_precision``, rewrites a
  chain of float conversions into one conversion of the chain's input
  (``SimplifyFPConversions``): ``x.astype(bf16).astype(f32)`` becomes ``x``
  and the bfloat16 rounding is gone; XLA:CPU keeps every conversion. This
  interprets ``fn``'s jaxpr op by op that way, through nested ``jit``s,
  ``custom_jvp``/``custom_vjp`` functions (their primal program),
  ``lax.cond`` (the branch taken) and ``jax.checkpoint``, so that code whose
  point is a rounding can be tested on the CPU. It reproduces what an H100
  did to a cast-based Kahan summation (params stuck at 1.0, compensation 0).
  Loops (``scan``, ``while``) are not modelled: a float conversion inside
  one raises ``NotImplementedError`` instead of passing untested.

  Args:
    fn: a function of arrays (pytrees of them) to evaluate.

  Returns:
    A function with ``fn``'s signature and output structure, evaluated the
    way XLA:GPU simplifies it.

  Example:
    >>> f = as_xla_gpu_simplifies(
    ...     lambda x: x.astype(jnp.bfloat16).astype(jnp.float32) - x)
    >>> float(f(jnp.float32(1.0001)))
    0.0
  """
  from jax.extend import core as jex

  def is_float_convert(eqn: Any) -> bool:
    return (eqn.primitive.name == "convert_element_type"
            and jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.floating)
            and jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.floating))

  def has_float_convert(jaxpr: Any) -> bool:
    return any(is_float_convert(e) or any(
        has_float_convert(getattr(sub, "jaxpr", sub))
        for sub in jex.jaxprs_in_params(e.params)) for e in jaxpr.eqns)

  def run(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any],
          origins: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """(outputs, the value each output's cast chain started from or None)."""
    env: dict[Any, Any] = {}
    chain_start: dict[Any, Any] = {}

    def read(v: Any) -> Any:
      return v.val if isinstance(v, jex.Literal) else env[v]

    def origin(v: Any) -> Any:
      return None if isinstance(v, jex.Literal) else chain_start.get(v)

    for var, value in zip(jaxpr.constvars, consts, strict=True):
      env[var] = value
    for var, value, start in zip(jaxpr.invars, args, origins, strict=True):
      env[var] = value
      if start is not None:
        chain_start[var] = start
    for eqn in jaxpr.eqns:
      invals = [read(v) for v in eqn.invars]
      name, params = eqn.primitive.name, eqn.params
      sub, sub_in = None, eqn.invars
      if name in ("pjit", "jit", "checkpoint", "remat", "remat2"):
        sub = params["jaxpr"]
      elif "call_jaxpr" in params:   # custom_jvp_call, custom_vjp_call
        sub = params["call_jaxpr"]
      elif name == "cond":
        sub, sub_in = params["branches"][int(invals[0])], eqn.invars[1:]
        invals = invals[1:]
      elif any(has_float_convert(getattr(j, "jaxpr", j))
               for j in jex.jaxprs_in_params(params)):
        raise NotImplementedError(
            f"as_xla_gpu_simplifies does not model {name}: a float"
            " conversion inside it would go untested")
      if sub is not None:
        outs, starts = run(getattr(sub, "jaxpr", sub),
                           getattr(sub, "consts", ()), invals,
                           [origin(v) for v in sub_in])
      elif is_float_convert(eqn) and origin(eqn.invars[0]) is not None:
        # The chain collapses into one conversion of its input.
        start = origin(eqn.invars[0])
        dst = eqn.outvars[0].aval.dtype
        outs = [start if start.dtype == dst else start.astype(dst)]
        starts = [start]
      else:
        outs = eqn.primitive.bind(*invals, **params)
        outs = outs if eqn.primitive.multiple_results else [outs]
        starts = [invals[0] if is_float_convert(eqn) else None]
        starts += [None] * (len(outs) - 1)
      for var, value, start in zip(eqn.outvars, outs, starts, strict=True):
        env[var] = value
        if start is not None:
          chain_start[var] = start
    return ([read(v) for v in jaxpr.outvars],
            [origin(v) for v in jaxpr.outvars])

  def simplified(*args: Any) -> Any:
    closed = jax.make_jaxpr(fn)(*args)
    flat = jax.tree.leaves(args)
    outs, _ = run(closed.jaxpr, closed.consts, flat, [None] * len(flat))
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
