"""What autocast did to a function: :class:`Audit` and :class:`AuditRecord`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class AuditRecord:
  """One primitive as autocast ran it.

  Attributes:
    primitive: the primitive's name.
    category: ``"lower"``, ``"float32"``, ``"promote"``, ``"original"``, or
      for FP8 matmuls ``"fp8"`` (current scaling) / ``"fp8-delayed"``.
    dtype: the float dtype it ran in (``"-"`` for none).
    input_dtypes: dtypes of its inputs after casting.
    output_dtypes: dtypes of its outputs.
    flops: floating-point operations of all its runs (``repeats`` times one
      run's; matmuls and convolutions only).
    repeats: how many times it runs per call: the product of the lengths of
      the ``lax.scan`` loops around it (``fori_loop`` with static bounds
      and ``lax.map`` are scans), 1 outside loops.
    in_while_loop: it sits in a ``lax.while_loop`` (or a ``fori_loop`` with
      traced bounds), whose trip count is unknown when tracing: ``repeats``
      and ``flops`` count one run per loop.

  Example:
    >>> import jax, jax.numpy as jnp, jmp_lite
    >>> def f(x):
    ...   return jax.lax.scan(lambda c, _: (c @ c, None), x, length=3)[0]
    >>> [(r.primitive, r.dtype, r.repeats, r.flops) for r in
    ...  jmp_lite.autocast_audit(f, "bf16", jnp.ones((2, 2))).records]
    [('dot_general', 'bfloat16', 3, 48.0)]
  """

  primitive: str
  category: str
  dtype: str
  input_dtypes: tuple[str, ...]
  output_dtypes: tuple[str, ...]
  flops: float
  repeats: int = 1
  in_while_loop: bool = False


def _dtype_name(dtype: Any) -> str:
  if dtype == jax.dtypes.float0:
    return "float0"
  return dtype.name if isinstance(dtype, np.dtype) else str(dtype)


def audit_record(primitive: str, category: str, flops: float,
                 inputs: Sequence[Any], outputs: Sequence[Any]
                 ) -> AuditRecord:
  """One run of a primitive, from its input and output dtypes.

  Args:
    primitive: its name.
    category: the rule it ran by.
    flops: one run's FLOPs.
    inputs: its inputs' dtypes after casting (``None`` for a value with
      none); the first float one is the dtype it ran in.
    outputs: its outputs' dtypes, likewise.

  Returns:
    The :class:`AuditRecord`.

  Example:
    >>> import numpy as np
    >>> from jmp_lite.autocasting._audit import audit_record
    >>> audit_record("exp", "float32", 0.0, [np.dtype("float32")],
    ...              [np.dtype("float32")]).dtype
    'float32'
  """
  ins = tuple(_dtype_name(d) for d in inputs if d is not None)
  floats = [_dtype_name(d) for d in inputs
            if d is not None and jnp.issubdtype(d, jnp.floating)]
  return AuditRecord(
      primitive=primitive, category=category,
      dtype=floats[0] if floats else "-", input_dtypes=ins,
      output_dtypes=tuple(_dtype_name(d) for d in outputs if d is not None),
      flops=flops)


def repeated(records: Sequence[AuditRecord], loop: str,
             length: int | None) -> list[AuditRecord]:
  """Records of a loop body, counted for the loop.

  Args:
    records: what one run of the body recorded.
    loop: ``"scan"`` or ``"while"``.
    length: the scan's length (``None`` for ``while``).

  Returns:
    For a scan, repeats and FLOPs times ``length``; for a while loop (whose
    trip count is a run-time value), the records marked ``in_while_loop``.

  Example:
    >>> from jmp_lite.autocasting._audit import AuditRecord, repeated
    >>> r = AuditRecord("dot_general", "lower", "bfloat16", (), (), 8.0)
    >>> repeated([r], "scan", 3)[0].flops
    24.0
  """
  if loop == "scan":
    n = int(length or 0)
    return [dataclasses.replace(r, repeats=r.repeats * n, flops=r.flops * n)
            for r in records]
  return [dataclasses.replace(r, in_while_loop=True) for r in records]


@dataclasses.dataclass(frozen=True)
class Audit:
  """What autocast did to a function: every primitive and its dtype.

  Attributes:
    records: one :class:`AuditRecord` per primitive equation, sub-computations
      included (once per use of one); a loop body's are listed once, with
      the number of runs in ``repeats``.
    compute_dtype: the autocast compute dtype.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> audit = jmp_lite.autocast_audit(lambda a: jnp.exp(a @ a), "bf16",
    ...                                 jnp.ones((2, 2)))
    >>> print(audit)
    primitive                rule      dtype     count
    dot_general              lower     bfloat16  1
    exp                      float32   float32   1
    matmul/conv FLOPs in half precision: 100.0%
  """

  records: tuple[AuditRecord, ...]
  compute_dtype: str

  def matmul_flops(self) -> dict[str, float]:
    """Matmul/convolution FLOPs by the dtype they ran in (all loop runs)."""
    out: dict[str, float] = {}
    for r in self.records:
      if r.flops:
        out[r.dtype] = out.get(r.dtype, 0.0) + r.flops
    return out

  def half_flop_fraction(self) -> float:
    """The fraction of matmul/convolution FLOPs run in half precision."""
    flops = self.matmul_flops()
    total = sum(flops.values())
    half = sum(v for k, v in flops.items() if k in ("bfloat16", "float16"))
    return half / total if total else 0.0

  def fp8_flop_fraction(self) -> float:
    """The fraction of matmul/convolution FLOPs run in FP8."""
    flops = self.matmul_flops()
    total = sum(flops.values())
    fp8 = sum(v for k, v in flops.items() if k.startswith("float8"))
    return fp8 / total if total else 0.0

  def __str__(self) -> str:
    counts: dict[tuple[str, str, str], int] = {}
    for r in self.records:  # Runs per call: a scan body's once per step.
      key = (r.primitive, r.category, r.dtype)
      counts[key] = counts.get(key, 0) + r.repeats
    # Wide enough for FP8 names (fp8-delayed, float8_e4m3fn).
    wc = max([9, *(len(c) for _, c, _ in counts)])
    wd = max([9, *(len(d) for _, _, d in counts)])
    lines = [f"{'primitive':24} {'rule':{wc}} {'dtype':{wd}} count"]
    for (p, c, d), n in sorted(counts.items()):
      lines.append(f"{p:24} {c:{wc}} {d:{wd}} {n}")
    lines.append(f"matmul/conv FLOPs in half precision:"
                 f" {100 * self.half_flop_fraction():.1f}%")
    if any(r.category.startswith("fp8") for r in self.records):
      lines.append(f"matmul/conv FLOPs in FP8:"
                   f" {100 * self.fp8_flop_fraction():.1f}%")
    in_while = sum(r.in_while_loop for r in self.records)
    if in_while:
      lines.append(f"{in_while} primitive(s) in while loops counted once per"
                   " loop (trip counts are unknown when tracing)")
    return "\n".join(lines)


# Documented as jmp_lite.autocasting's (their public home).
AuditRecord.__module__ = Audit.__module__ = "jmp_lite.autocasting"
