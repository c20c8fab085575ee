"""quantized_adam's CPU kernel: built from ``_quantized_adam_cpu.cc`` on first
use, loaded, registered with XLA as an FFI target, and called per param.

XLA:CPU cannot run the fused update as one pass: it forms no multi-output
fusions (each consumer of the new moments recomputes them) and runs the
block statistics' variadic reduction as a scalar loop (docs/benchmarks.md).
The kernel is C++ against the XLA FFI headers that jaxlib ships, compiled
with the machine's C++ compiler (``$CXX``, else ``c++``, ``g++`` or
``clang++``) into a cache directory (``$JMP_LITE_CACHE``, else
``~/.cache/jmp_lite``) keyed by the source, the compiler, jaxlib and the CPU,
so it is built once per machine; where it cannot be built,
``quantized_adam(kernel="auto")`` takes the XLA path and says why.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite._jaxpr import align_varying
from jmp_lite.low_precision._blockwise import (
  form_of,
  layout,
  QuantizedArray,
  stored_shapes,
)
from jmp_lite.low_precision._common import F32

TARGET = "jmp_lite_quantized_adam_cpu"
_SOURCE = pathlib.Path(__file__).with_name("_quantized_adam_cpu.cc")
# No -ffast-math and no contraction the source does not write (it writes
# the multiply-adds XLA:CPU contracts): the kernel's arithmetic is the XLA
# path's. -fno-math-errno and -fno-trapping-math change no result (errno and
# the floating-point exception flags only) and let gcc vectorize the loops
# (without the latter the codes' loop stayed scalar: 16x slower). -w:
# jaxlib's FFI headers warn under gcc 12.
_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno",
          "-fno-trapping-math", "-ffp-contract=off", "-w")
# Gradient dtypes the kernel reads.
GRAD_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16),
               np.dtype(jnp.float16))
# Steps traced on several threads at once build and register the kernel once.
_ONCE = threading.Lock()


def _compiler() -> str | None:
  for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
    if name and shutil.which(name):
      return shutil.which(name)
  return None


def _cpu_signature() -> str:
  # A cache shared between machines (a cluster's home directory) must not
  # hand one CPU a library built with another's instructions (-march=native).
  try:
    text = pathlib.Path("/proc/cpuinfo").read_text()
  except OSError:
    return platform.processor()
  flags = [line for line in text.splitlines() if line.startswith(
      ("flags", "Features", "model name"))]
  return "\n".join(sorted(set(flags)))


def _cache_dir() -> pathlib.Path:
  root = os.environ.get("JMP_LITE_CACHE") or os.path.join(
      os.path.expanduser("~"), ".cache", "jmp_lite")
  path = pathlib.Path(root)
  try:
    path.mkdir(parents=True, exist_ok=True)
    if os.access(path, os.W_OK):
      return path
  except OSError:
    pass
  # Per user where the platform has users' ids (not Windows).
  user = getattr(os, "getuid", lambda: "user")()
  path = pathlib.Path(tempfile.gettempdir()) / f"jmp_lite-{user}"
  path.mkdir(parents=True, exist_ok=True)
  return path


def _build() -> pathlib.Path:
  """The kernel's shared library, compiled if the cache lacks it."""
  cxx = _compiler()
  if cxx is None:
    raise RuntimeError("no C++ compiler found ($CXX, c++, g++, clang++)")
  include = jax.ffi.include_dir()
  version = subprocess.run([cxx, "--version"], capture_output=True,
                           text=True, check=False).stdout
  source = _SOURCE.read_bytes()
  digest = hashlib.sha256(b"\0".join([
      source, version.encode(), include.encode(),
      importlib.metadata.version("jaxlib").encode(),
      " ".join(_FLAGS).encode(), _cpu_signature().encode(),
      platform.machine().encode()])).hexdigest()[:20]
  target = _cache_dir() / f"quantized_adam_cpu-{digest}.so"
  if target.exists():
    return target
  errors = []
  # -march=native where the compiler takes it (AVX2 and FMA on x86), else
  # the compiler's baseline.
  for arch in (["-march=native"], []):
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [cxx, *_FLAGS, *arch, "-I", include, str(_SOURCE), "-o", tmp]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode == 0:
      # Readable by all (mkstemp made it private): a cache shared between
      # users. Atomic: processes building at once each write their own file.
      os.chmod(tmp, 0o755)
      os.replace(tmp, target)
      return target
    os.unlink(tmp)
    errors.append(f"{' '.join(cmd)}\n{done.stderr[-2000:]}")
  raise RuntimeError("compiling the kernel failed:\n" + "\n".join(errors))


@functools.cache
def _registered() -> tuple[Any, str]:
  """(the loaded library, "") once the target is registered, else
  (None, why). Once per process: XLA's registry is per process."""
  try:
    library = ctypes.cdll.LoadLibrary(str(_build()))
    jax.ffi.register_ffi_target(
        TARGET, jax.ffi.pycapsule(library.JmpLiteQuantizedAdam),
        platform="cpu")
  except (OSError, RuntimeError, AttributeError) as e:
    return None, f"{type(e).__name__}: {e}"
  return library, ""


def unavailable() -> str:
  """Why the kernel cannot run here ("" when it can): builds it if needed.

  Example:
    >>> from jmp_lite.low_precision._cpu_kernel import unavailable
    >>> isinstance(unavailable(), str)
    True
  """
  with _ONCE:
    return _registered()[1]


@functools.partial(jax.jit, static_argnums=(1, 2), inline=True)
def _bias_corrections(count: jax.Array, b1: float, b2: float) -> jax.Array:
  """optax's bias corrections (1 - decay**count), computed as it computes
  them: under an inlined jit, so that an eager step's float32 ``pow`` is
  the jitted one too."""
  count_inc = optax.safe_increment(count)
  return jnp.stack([1 - b1**count_inc, 1 - b2**count_inc]).astype(F32)


def leaf_step(g: jax.Array, mu: QuantizedArray, nu: QuantizedArray,
              meta: jax.Array, count: jax.Array, *,
              hyper: tuple[float, float, float, float], stochastic: bool
              ) -> tuple[jax.Array, QuantizedArray, QuantizedArray]:
  """One param's Adam step through the kernel: the updates and the new
  ``mu`` and ``nu``, from the state's own arrays (no blocked copies: the
  kernel walks the leaf's blocks in place). ``meta`` as :func:`step` reads
  it, ``count`` Adam's count before the step, ``hyper`` (learning rate, b1,
  b2, eps)."""
  lr, b1, b2, eps = hyper
  shape = (*mu.codes.shape[:-1], mu.shape[-1])
  rows, r, c = layout(shape, mu.block_size)
  # The kernel indexes every array by this layout: refuse any other here.
  codes, blocks = stored_shapes(shape, mu.bits, mu.block_size)
  for name, q in (("mu", mu), ("nu", nu)):
    got = [tuple(np.shape(x)) for x in (q.codes, q.scales, q.outliers,
                                        q.where)]
    if (got != [codes, blocks, blocks, blocks] or g.shape != shape
        or (q.bits, q.block_size) != (mu.bits, mu.block_size)):
      raise ValueError(
          f"quantized_adam: a {name} leaf's arrays (codes, scales, outliers,"
          f" where: {got}) do not fit a {tuple(g.shape)} gradient stored"
          f" with bits={mu.bits}, block_size={mu.block_size} (codes"
          f" {codes}, the rest {blocks})")
  coef = _bias_corrections(count, b1, b2)
  # As stored: a reshape of a donated buffer made XLA copy it first.
  side = lambda q: [q.codes, q.scales, q.outliers, q.where]
  out = step(meta, coef, g, side(mu), side(nu), rows=rows, n=shape[-1], r=r,
             c=c, bits=mu.bits, stochastic=stochastic, b1=b1, b2=b2, eps=eps,
             lr=lr)

  def back(q: QuantizedArray, parts: list[jax.Array], signed: bool
           ) -> QuantizedArray:
    return QuantizedArray(
        codes=parts[0], scales=parts[1], outliers=parts[2], where=parts[3],
        form=jnp.asarray(form_of(q.bits, q.block_size, signed)),
        shape=q.shape, dtype=q.dtype, bits=q.bits, block_size=q.block_size,
        signed=signed, power=q.power)

  return out[0], back(mu, out[1:5], True), back(nu, out[5:9], False)


def step(meta: jax.Array, coef: jax.Array, g: jax.Array,
         mu: list[jax.Array], nu: list[jax.Array], *, rows: int, n: int,
         r: int, c: int, bits: int, stochastic: bool, b1: float, b2: float,
         eps: float, lr: float) -> list[jax.Array]:
  """One param's Adam step through the kernel.

  ``meta`` is uint32[5] (the count, the param's random stream key, each
  form's map, the forms' check bits: as the Pallas kernel reads it),
  ``coef`` the bias corrections (float32[2]), ``g`` the gradient (the
  leaf's shape, read as ``rows`` rows of ``n``), ``mu`` and ``nu`` each
  (codes, scales, outliers, where) as stored (square maps: their power is
  2). Returns the float32 updates (``g``'s shape) and
  the eight new state arrays, written over the old ones (donated, in
  place).
  """
  why = unavailable()
  if why:
    raise RuntimeError(f"quantized_adam: the CPU kernel is unavailable: {why}")
  # Under shard_map every operand varies over the same mesh axes, and so do
  # the results: ffi_call refuses them in its result shapes and types its
  # results as varying over none, so they are cast after the call.
  operands, _ = align_varying([meta, coef, g, *mu, *nu])
  shapes = [jax.ShapeDtypeStruct(g.shape, jnp.float32)] + [
      jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (*mu, *nu)]
  call = jax.ffi.ffi_call(
      TARGET, shapes, vmap_method="sequential",
      input_output_aliases={i: i - 2 for i in range(3, 11)})
  results = call(
      *operands, rows=np.int64(rows), n=np.int64(n), r=np.int64(r),
      c=np.int64(c), bits=np.int32(bits), stochastic=bool(stochastic),
      omb1=np.float32(1 - b1), b1=np.float32(b1), omb2=np.float32(1 - b2),
      b2=np.float32(b2), eps=np.float32(eps), neg_lr=np.float32(-lr))
  # The gradient operand varies over every axis any operand does.
  return align_varying([operands[2], *results])[0][1:]
