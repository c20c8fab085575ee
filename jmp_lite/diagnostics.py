"""Numerics diagnostics: where precision is lost and why a step was skipped.

All array functions here are jit-safe and never sync with the host (but
for reading a concrete loss scale to check it); the helpers that print or
return Python values say so.

* :func:`nonfinite_counts` — per parameter path, how many gradient elements
  are +-inf/NaN (also kept by ``loss_scaled(..., track_nonfinite=True)``).
* :func:`gradient_health` — per path, the fraction of gradient elements that
  underflow to zero or overflow in the compute dtype at the current scale
  (Colossal-AI's ``log_num_zeros_in_grad``), and how many powers of two the
  scale could still grow before the largest gradient overflows.
* :func:`find_nonfinite` — re-runs a function primitive by primitive and names
  the first one that produced inf/NaN, with its source line.
* :func:`check_alignment` — matmuls/convolutions whose dimensions are not
  multiples of 8 (tensor cores), with a fix.
* :func:`check_hardware` — warns when a half dtype runs slowly on the device.
"""

from __future__ import annotations

import dataclasses
import numbers
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jmp_lite import _jaxpr
from jmp_lite import dtypes as _dtypes
from jmp_lite._checks import (
  check_callable,
  check_not_object_array,
  check_numeric_tree,
  check_scale_range,
  floating_dtype,
)
from jmp_lite._nonfinite import nonfinite_counts, nonfinite_paths
from jmp_lite._trees import unwrap_nnx
from jmp_lite.policy import get_policy
from jmp_lite.transforms import current_loss_scale

__all__ = ["GradientHealth", "Misaligned", "NonfiniteOrigin",
           "PrecisionWarning", "check_alignment", "check_hardware",
           "find_nonfinite", "gradient_health", "nonfinite_counts",
           "nonfinite_paths", "tree_bytes"]


class PrecisionWarning(UserWarning):
  """A half-precision choice that is slow, unsupported or numerically unsafe.

  Raised for dtypes the device runs slowly or not at all, and for optimizer
  state stored in float16 (:func:`jmp_lite.state_dtypes`).
  """


def tree_bytes(tree: Any) -> int:
  """Global (logical) bytes of the array leaves of ``tree`` (no device access).

  The size of each array as a whole, wherever it lives: a sharded array
  counts once, however many devices hold its pieces, and a replicated one
  counts once, not once per device. For what each device holds, use
  :func:`jmp_lite.distributed.device_bytes`. An array object that appears
  twice (tied weights) is counted once; typed PRNG keys count their key
  data.

  Args:
    tree: any pytree (params, an optimizer state, a ``jax.vjp`` closure),
      of arrays or ``jax.ShapeDtypeStruct``.

  Returns:
    The sum of ``size * itemsize`` over distinct leaves that have a dtype.

  Raises:
    TypeError: for a NumPy ``object`` array (its itemsize is a pointer's).

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> w = jnp.ones((2, 3), jnp.bfloat16)
    >>> jmp_lite.diagnostics.tree_bytes({"w": w, "tied": w})
    12
  """
  seen: set[int] = set()
  total = 0
  for x in jax.tree.leaves(tree, is_leaf=_dtypes.is_live_state):
    if not (hasattr(x, "dtype") and hasattr(x, "shape")) or id(x) in seen:
      continue
    check_not_object_array(x, "tree_bytes")
    seen.add(id(x))
    total += int(np.prod(x.shape)) * x.dtype.itemsize
  return total


@dataclasses.dataclass(frozen=True)
class GradientHealth:
  """What a dtype and a loss scale do to a set of gradients.

  Attributes:
    underflow: per leaf, the fraction of non-zero gradient elements that
      become zero when scaled and cast to the compute dtype.
    overflow: per leaf, the fraction that become +-inf (or are not finite).
    zeros: per leaf, the number of elements that are zero in the compute dtype
      (Colossal-AI's ``log_num_zeros_in_grad``).
    headroom_bits: ``log2(largest finite value / largest scaled gradient)``:
      how many doublings of the scale are still safe (negative: already
      overflowing).
  """

  underflow: Any
  overflow: Any
  zeros: Any
  headroom_bits: Any


jax.tree_util.register_dataclass(
    GradientHealth, data_fields=["underflow", "overflow", "zeros",
                                 "headroom_bits"], meta_fields=[])


def gradient_health(grads: Any, loss_scale: Any = 1.0,
                    dtype: Any = jnp.float16) -> GradientHealth:
  """Measures underflow and overflow of (unscaled) gradients at a scale.

  Args:
    grads: the *unscaled* gradients, in float32 (say, from a float32 run or
      after ``unscale``).
    loss_scale: a positive number or scalar array, a loss-scale state, or
      an optimizer state holding one :func:`~jmp_lite.loss_scaled` state
      (its current scale, as :func:`~jmp_lite.current_loss_scale` finds it:
      in chains, ``master_weights``, a ``flax.nnx.Optimizer``'s
      ``opt_state``).
    dtype: the half dtype the scaled gradients would live in.

  Returns:
    A :class:`GradientHealth` (a pytree of arrays; jit-safe).

  Raises:
    TypeError: if ``loss_scale`` is not a real number, array or loss-scale
      state, or a leaf of ``grads`` is no number or numeric array.
    ValueError: if ``loss_scale`` is not a scalar, or is concrete and not
      positive and finite (a concrete ``jax.Array`` is read to check it;
      a traced one, under ``jit``, is not checked).

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> g = {"w": jnp.array([1e-9, 1e-3, 0.0])}
    >>> h = jmp_lite.gradient_health(g, 1.0)
    >>> float(h.underflow["w"])  # 1e-9 underflows float16, 1e-3 does not.
    0.5
    >>> round(float(jmp_lite.gradient_health(g, 2.0 ** 10).underflow["w"]), 2)
    0.0
  """
  dtype = floating_dtype(dtype, "dtype")
  check_numeric_tree(grads, "gradient_health")
  scale = jnp.asarray(_checked_scale(loss_scale), jnp.float32)
  fmax = float(jnp.finfo(dtype).max)

  def leaf_stats(x):
    if not _dtypes.is_floating_array(x):
      return None
    wide = x.astype(jnp.float32) * scale
    cast = wide.astype(dtype)
    nonzero = wide != 0
    n_nonzero = jnp.maximum(jnp.sum(nonzero), 1)
    under = jnp.sum(nonzero & (cast == 0)) / n_nonzero
    over = jnp.mean(~jnp.isfinite(cast))
    zeros = jnp.sum(cast == 0, dtype=jnp.int32)
    return under.astype(jnp.float32), over.astype(jnp.float32), zeros

  stats = jax.tree.map(leaf_stats, grads)
  is_stat = lambda s: isinstance(s, tuple)
  pick = lambda i: jax.tree.map(lambda s: s[i], stats, is_leaf=is_stat)
  biggest = [jnp.max(jnp.abs(x.astype(jnp.float32))) for x in
             jax.tree.leaves(grads) if _dtypes.is_floating_array(x)]
  largest = (jnp.max(jnp.stack(biggest)) * scale if biggest
             else jnp.float32(0))
  headroom = jnp.log2(fmax / jnp.maximum(largest, jnp.finfo(jnp.float32).tiny))
  return GradientHealth(underflow=pick(0), overflow=pick(1), zeros=pick(2),
                        headroom_bits=headroom)


def _checked_scale(loss_scale: Any) -> Any:
  """``loss_scale``'s scale value, checked where it is known (not traced)."""
  value: Any = unwrap_nnx(loss_scale)   # An nnx.Optimizer's variables.
  numeric = (numbers.Number, jax.Array, np.ndarray, np.generic)
  if not (hasattr(value, "loss_scale")
          or any(isinstance(value, t) for t in numeric)):
    # An optimizer state holding one (a chain, master_weights): as
    # current_loss_scale finds it.
    try:
      value = current_loss_scale(value)
    except ValueError as e:
      if not str(e).startswith("No loss_scaled state"):   # Several of them.
        raise ValueError(
            f"gradient_health: {e}; or pass"
            " loss_scale=jmp_lite.current_loss_scale(state, name)") from None
    except TypeError:
      pass   # Not one: the TypeError below names it.
  while hasattr(value, "loss_scale"):  # loss_scaled state > loss-scale state
    value = value.loss_scale
  dtype: Any = getattr(value, "dtype", None)
  if isinstance(value, (bool, np.bool_)) or not (
      isinstance(value, numbers.Real)
      or (isinstance(value, (jax.Array, np.ndarray, np.generic))
          and (jnp.issubdtype(dtype, jnp.floating)
               or jnp.issubdtype(dtype, jnp.integer)))):
    raise TypeError(  # An optimizer state's repr can be megabytes: cut.
        "loss_scale must be a positive number, a scalar array, a loss-scale"
        " state or an optimizer state holding one loss_scaled state, got"
        f" {type(value).__name__}: {value!r:.200}")
  checked: Any = value  # A real number or array, as checked above.
  if np.ndim(checked) != 0:
    raise ValueError(
        f"loss_scale must be a scalar, got shape {np.shape(checked)}")
  # The range a loss scale may take (its reciprocal a normal float32).
  check_scale_range(None if _jaxpr.is_tracer(value) else float(value),
                    "loss_scale")
  return value


@dataclasses.dataclass(frozen=True)
class NonfiniteOrigin:
  """The first primitive that produced inf/NaN, as :func:`find_nonfinite` saw.

  Attributes:
    primitive: its name.
    location: ``file:line:column (function)`` of the code that issued it.
    dtype: the float dtype it ran in.
    input_ranges: ``(min, max)`` of each floating input (NaN-aware).
    output_nonfinite: how many output elements are non-finite.
    within: the enclosing call-like primitives (``jit``, ``custom_jvp_call``).
    scope: the JAX name stack it ran under: which layer, where the model
      names its scopes (a linen module's path, e.g. ``.../module/blowup``;
      Equinox class names; ``jax.named_scope``), with the transformations
      around it (``transpose(jvp(...))`` in a backward pass). Empty where
      nothing was named (nnx modules name no scopes).
  """

  primitive: str
  location: str
  dtype: str
  input_ranges: tuple[tuple[float, float], ...]
  output_nonfinite: int
  within: tuple[str, ...]
  scope: str = ""

  def __str__(self) -> str:
    ranges = ", ".join(f"[{lo:.4g}, {hi:.4g}]" for lo, hi in self.input_ranges)
    where = " > ".join(self.within + (self.primitive,))
    scope = f" in scope {self.scope}" if self.scope else ""
    return (f"first non-finite value: {where} in {self.dtype}{scope} at"
            f" {self.location}; input ranges {ranges};"
            f" {self.output_nonfinite} non-finite output element(s)")


class _Found(Exception):
  def __init__(self, origin: NonfiniteOrigin):
    super().__init__(str(origin))
    self.origin = origin


def _ranges(values: Sequence[Any]) -> tuple[tuple[float, float], ...]:
  out = []
  for v in values:
    if _dtypes.is_floating_array(v) and np.size(v):
      a = np.asarray(v, np.float32)
      out.append((float(np.nanmin(a)), float(np.nanmax(a))))
  return tuple(out)


def _check_finite(site: _jaxpr.Site, invals: Sequence[Any],
                  outs: Sequence[Any]) -> None:
  """Raises :class:`_Found` if ``site`` made inf/NaN from finite inputs."""
  bad = sum(int(np.sum(~np.isfinite(np.asarray(o))))
            for o in outs if _dtypes.is_inexact_array(o))
  if not bad:
    return
  inputs_finite = all(
      bool(np.all(np.isfinite(np.asarray(v)))) for v in invals
      if _dtypes.is_inexact_array(v))
  if inputs_finite:
    floats = [np.dtype(v.dtype).name for v in invals
              if _dtypes.is_floating_array(v)]
    raise _Found(NonfiniteOrigin(
        primitive=site.primitive,
        location=_jaxpr.source_location(site.eqn),
        dtype=floats[0] if floats else "-",
        input_ranges=_ranges(invals), output_nonfinite=bad,
        within=site.within, scope=site.scope))


def _is_process_local(x: Any) -> bool:
  return not isinstance(x, jax.Array) or x.is_fully_addressable


def _process_local(x: Any) -> Any:
  """A global array spread over processes, gathered on this one (numpy)."""
  if _is_process_local(x):
    return x
  # A collective: every process calls find_nonfinite with the same inputs,
  # as it calls the step.
  return multihost_utils.process_allgather(x, tiled=True)


def find_nonfinite(fn: Callable[..., Any], *args: Any,
                   **kwargs: Any) -> NonfiniteOrigin | None:
  """Runs ``fn`` primitive by primitive; names the first to produce inf/NaN.

  Only a primitive whose *inputs* were all finite counts, so the report
  points at where non-finite values are born, not where they spread. Nested
  ``jit`` and ``custom_jvp``/``custom_vjp`` functions are entered; control
  flow (``scan``, ``while``, ``cond``) is reported as a whole. Runs eagerly
  (a host sync per primitive): a debugging tool, not for a training loop.

  Under ``jax.distributed.initialize()``, arguments that are global arrays
  sharded over several processes are first gathered whole onto every process
  (``multihost_utils.process_allgather``, a collective): call it on every
  process with the same inputs, as you call the step; each process then
  finds the same origin. Its host must hold the gathered arrays.

  Args:
    fn: the function (e.g. a loss, or ``jax.grad`` of one).
    *args: its arguments; array leaves are traced, other leaves (an Equinox
      module's functions and fields) are passed through.
    **kwargs: more arguments, likewise.

  Returns:
    A :class:`NonfiniteOrigin`, or ``None`` if everything stayed finite.

  Raises:
    TypeError: if ``fn`` is not callable, or for traced arguments (called
      under ``jit``): it needs concrete values.
    ValueError: if ``fn`` closes over an array sharded across processes
      (pass it as an argument).

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> def f(x):
    ...   return jnp.exp(x * 100.0).sum()
    >>> origin = jmp_lite.find_nonfinite(f, jnp.ones(3, jnp.float16))
    >>> origin.primitive, origin.dtype
    ('exp', 'float16')
  """
  check_callable(fn, "find_nonfinite")
  # Array leaves are traced; the rest (an Equinox module's functions and
  # static fields) is passed through as it is.
  arrays, rebuild = _jaxpr.split_array_args((args, kwargs))
  if any(_jaxpr.is_tracer(a) for a in arrays):
    raise TypeError(
        "find_nonfinite runs fn eagerly, primitive by primitive, on concrete"
        " values; it got traced arguments (it was called under jit, grad or"
        " vmap). Call it outside the jitted step, on the same inputs")
  arrays = [_process_local(a) for a in arrays]

  def flat(*xs):
    a, k = rebuild(xs)
    return fn(*a, **k)

  closed, _ = _jaxpr.trace(flat, *arrays)
  if any(map(_jaxpr.is_tracer, _jaxpr.jaxpr_and_consts(closed)[1])):
    # Closed over.
    raise TypeError(
        "find_nonfinite runs fn eagerly, primitive by primitive, on concrete"
        " values; fn closes over traced values (it was called under jit,"
        " grad or vmap). Call it outside the jitted step, on the same inputs")
  if any(not _is_process_local(c)
         for c in _jaxpr.jaxpr_and_consts(closed)[1]):
    raise ValueError(
        "find_nonfinite: fn closes over an array sharded across processes"
        " (jax.distributed), which this process cannot read. Pass it as an"
        " argument instead (find_nonfinite gathers arguments on every"
        " process), or close over its process-local value:"
        " jax.experimental.multihost_utils.process_allgather(x, tiled=True)")
  try:
    _jaxpr.interpret(closed, arrays, _check_finite)
  except _Found as found:
    return found.origin
  return None


@dataclasses.dataclass(frozen=True)
class Misaligned:
  """A matmul or convolution with dimensions tensor cores dislike.

  Attributes:
    primitive: ``dot_general`` or ``conv_general_dilated``.
    location: the source line.
    dims: ``{"M": 1000, ...}`` of the misaligned dimensions.
    hint: how to fix it.
  """

  primitive: str
  location: str
  dims: dict[str, int]
  hint: str


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def check_alignment(fn: Callable[..., Any], *args: Any, multiple: int = 8,
                    **kwargs: Any) -> list[Misaligned]:
  """Lists the matmuls/convolutions whose dimensions are not multiples of 8.

  Tensor cores run float16/bfloat16 matmuls fastest when M, N and K (and
  convolution channels) are multiples of 8 (PaddlePaddle's advice; 16 or more
  helps on A100 and newer: pass ``multiple=16``). Traces abstractly.

  Args:
    fn: the function.
    *args: example inputs.
    multiple: the required multiple.
    **kwargs: passed through.

  Returns:
    One :class:`Misaligned` per offending primitive (sub-computations
    included); empty if all are aligned. Batch sizes (M) are reported too:
    pad the batch or choose a multiple.

  Raises:
    TypeError: if ``fn`` is not callable, or ``multiple`` is not an int.
    ValueError: if ``multiple`` < 1.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> [m.dims for m in jmp_lite.check_alignment(
    ...     lambda x, w: x @ w, jnp.ones((64, 100)), jnp.ones((100, 10)))]
    [{'N': 10, 'K': 100}]
  """
  check_callable(fn, "check_alignment")
  # A bool is an int to Python, never a meant multiple; a float such as 8.5
  # would be "rounded up" to non-integer sizes.
  if isinstance(multiple, (bool, np.bool_)) or not isinstance(
      multiple, numbers.Integral):
    raise TypeError(f"multiple must be a positive int, got"
                    f" {type(multiple).__name__}: {multiple!r}")
  multiple = int(multiple)
  if multiple < 1:
    raise ValueError(f"multiple must be >= 1, got {multiple}")
  arrays, rebuild = _jaxpr.split_array_args((args, kwargs))
  closed = jax.make_jaxpr(lambda *xs: (lambda a, k: fn(*a, **k))(
      *rebuild(xs)))(*arrays)
  found: list[Misaligned] = []
  for site in _jaxpr.walk(closed):
    if not _jaxpr.is_matmul(site.eqn):
      continue
    dims = {k: v for k, v in _jaxpr.matmul_dims(site.eqn).items()
            if v % multiple}
    if dims:
      fixes = ", ".join(f"{k} {v} -> {_round_up(v, multiple)}"
                        for k, v in dims.items())
      found.append(Misaligned(
          primitive=site.primitive,
          location=_jaxpr.source_location(site.eqn), dims=dims,
          hint=f"pad to multiples of {multiple}: {fixes}"))
  return found


def check_hardware(dtype: Any, device: Any = None, *,
                   warn: bool = True) -> list[str]:
  """Warns when ``dtype`` runs slowly (or not at all) on ``device``.

  * float16 on NVIDIA GPUs below compute capability 7.0 (no tensor cores:
    PaddlePaddle's warning), bfloat16 below 8.0 (emulated);
  * float16 on TPUs (no native float16 matmuls: use bfloat16);
  * any half dtype on the CPU (emulated, usually slower than float32).

  Args:
    dtype: a dtype, name, :class:`~jmp_lite.Policy` or policy string such as
      ``"p=f32,c=bf16"`` (its compute dtype).
    device: a ``jax.Device``; defaults to the first local device.
    warn: also issue each message as a :class:`PrecisionWarning`.

  Returns:
    The messages (empty when the dtype suits the device).

  Example:
    >>> import jmp_lite
    >>> jmp_lite.check_hardware("f32")
    []
  """
  if isinstance(dtype, str) and "=" in dtype:
    dtype = get_policy(dtype)  # "p=f32,c=bf16", as autocast takes it.
  dtype = getattr(dtype, "compute_dtype", dtype)
  dtype = floating_dtype(dtype, "dtype")
  if device is None:
    device = jax.local_devices()[0]
  elif not isinstance(getattr(device, "platform", None), str):
    raise TypeError(f"device must be a jax.Device (e.g. jax.devices()[0]),"
                    f" got {type(device).__name__}: {device!r}")
  platform = device.platform.lower()
  name = dtype.name
  messages = []
  half = dtype in (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
  if half and platform == "cpu":
    messages.append(
        f"{name} on the CPU is emulated and usually slower than float32;"
        " mixed precision pays off on GPUs and TPUs")
  elif half and platform in ("gpu", "cuda"):
    cc = getattr(device, "compute_capability", None)
    if cc is not None:
      major, minor = (int(p) for p in str(cc).split(".")[:2])
      need = (7, 0) if dtype == np.dtype(jnp.float16) else (8, 0)
      if (major, minor) < need:
        messages.append(
            f"{name} on a GPU of compute capability {cc} (below"
            f" {need[0]}.{need[1]}) has no tensor-core support and runs"
            f" slowly; use float32"
            + (" or float16" if name == "bfloat16" and major >= 7 else ""))
  elif dtype == np.dtype(jnp.float16) and platform == "tpu":
    messages.append("float16 has no native TPU support; use bfloat16")
  if warn:
    for m in messages:
      warnings.warn(m, PrecisionWarning, stacklevel=2)
  return messages
