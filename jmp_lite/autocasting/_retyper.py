"""The autocast rules, as a :class:`jmp_lite._jaxpr.Rewriter`.

Per first-order equation: a region (``float32_region``, an excluded scope,
an inner autocast) or a primitive that depends on exact float types runs as
written; a matmul on the lower-precision list runs in the compute dtype (in
FP8 if a recipe says so); one on the float32 list in float32; any other
runs in the widest float dtype among its operands (literals and weak-typed
scalars follow).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jmp_lite import _jaxpr
from jmp_lite.autocasting import _audit
from jmp_lite.autocasting._fp8 import fp8_call
from jmp_lite.autocasting._options import (
  AUTOCAST_SCOPE,
  Config,
  FLOAT32_SCOPE,
  HALF_SCOPE,
)

# Primitives whose result depends on the exact float dtype of their inputs
# (bit patterns, ulps) or that hand values to host code expecting the types
# the function was written with: they run on the as-written types.
_AS_WRITTEN = frozenset({
    "bitcast_convert_type", "nextafter", "pure_callback", "io_callback",
    "debug_callback", "reduce_precision"})
_CASTABLE = _jaxpr.CASTABLE
_F32 = np.dtype(np.float32)
# Float dtypes autocast never touches (wider than float32; with
# ``jax_enable_x64``).
_WIDE = frozenset({np.dtype(np.float64)})


class AutocastRetyper(_jaxpr.Rewriter):
  """Rewrites jaxprs by the autocast rules; state lives for one call only.

  Args:
    cfg: the checked options.
    records: a list for the audit's records, or ``None``.
    fp8_vars: with delayed FP8 scaling, the states' (history, pending)
      input variables, taken in order by the top-level matmuls; ``None``
      counts those matmuls only (``fp8_delayed``).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jmp_lite import _jaxpr
    >>> from jmp_lite.autocasting._options import make_config
    >>> from jmp_lite.autocasting._retyper import AutocastRetyper
    >>> body, _ = _jaxpr.jaxpr_and_consts(
    ...     jax.make_jaxpr(lambda a: a @ a)(jnp.ones((2, 2))))
    >>> records = []
    >>> _ = AutocastRetyper(make_config("bf16"), records).rewrite(body, "auto")
    >>> [(r.primitive, r.category, r.dtype) for r in records]
    [('dot_general', 'lower', 'bfloat16')]
  """

  def __init__(self, cfg: Config, records: list[_audit.AuditRecord] | None,
               fp8_vars: Sequence[tuple[Any, Any]] | None = None):
    super().__init__(records)
    self.cfg = cfg
    self.fp8_vars = list(fp8_vars) if fp8_vars is not None else None
    self.fp8_delayed = 0  # Delayed-scaled matmuls met (states asked for).
    # One traced FP8 call per operand types (the same at every use).
    self.fp8_calls: dict[tuple[Any, ...], Any] = {}

  def region(self, scopes: frozenset[str]) -> str | None:
    """``"off"``/``"force"`` for code in such a named scope, else None."""
    cfg = self.cfg
    if (FLOAT32_SCOPE in scopes or AUTOCAST_SCOPE in scopes
        or not scopes.isdisjoint(cfg.exclude)):
      return "off"
    if HALF_SCOPE in scopes or not scopes.isdisjoint(cfg.force):
      return "force"
    return None

  def plan(self, ops: _jaxpr.Operands, mode: str) -> _jaxpr.Plan:
    """The autocast rule for one first-order equation."""
    cfg = self.cfg
    name = ops.primitive
    if mode == "off" or name in _AS_WRITTEN or any(
        d in _WIDE for d in ops.written):
      # float64 is never touched, so an equation that reads or makes it runs
      # as written, float32 operands beside it included, as in plain JAX
      # (``dot_general`` takes mixed operands): re-typing only the float32
      # operand, or asking for a half product, would round a float64 result
      # through the compute dtype.
      return _jaxpr.Plan("original")
    if (cfg.fp8 is not None and name == "dot_general" and name in cfg.lower
        and self._fp8_eligible(ops)):
      return self._fp8_plan(ops)
    if name in cfg.lower or (mode == "force" and any(
        d in _CASTABLE for d in ops.dtypes)):
      params = None
      if ("preferred_element_type" in ops.params
          and any(d in _CASTABLE for d in ops.dtypes)):
        # The product comes out in the compute dtype, so the backward pass's
        # matmuls take compute-dtype cotangents too (a float32 result would
        # send float32 cotangents into both gradient matmuls). XLA
        # accumulates half-precision products in float32 on GPU, TPU and
        # CPU either way; accumulate_in_float32 asks for a float32 result.
        params = dict(ops.params, preferred_element_type=(
            _F32 if cfg.accumulate_f32 else cfg.compute))
      return _jaxpr.Plan("lower", cfg.compute, params, cfg.compute)
    if name in cfg.fp32:
      return _jaxpr.Plan("float32", _F32)
    # Promote. Literals and weak-typed scalars follow; they never widen an op.
    target = None
    for have, follows in zip(ops.dtypes, ops.follows, strict=True):
      if have in _CASTABLE and have != target and not follows:
        # Among float16, bfloat16 and float32, any two differ -> float32.
        target = have if target is None else _F32
    return _jaxpr.Plan("promote", target)

  def ran(self, ops: _jaxpr.Operands, plan: _jaxpr.Plan, category: str,
          inputs: Sequence[Any], outputs: Sequence[Any]) -> None:
    """Appends the audit record of one equation."""
    assert self.log is not None  # Called only when there is a log.
    self.log.append(_audit.audit_record(
        ops.primitive, category, _jaxpr.matmul_flops(ops.eqn), inputs,
        outputs))

  def repeated(self, entries: list[Any], loop: str,
               length: int | None) -> list[Any]:
    """A loop body's audit records, counted for the loop."""
    return _audit.repeated(entries, loop, length)

  def _fp8_eligible(self, ops: _jaxpr.Operands) -> bool:
    """Whether this (half-precision) matmul runs in FP8 instead."""
    if not all(d in _CASTABLE for d in ops.dtypes):
      return False  # float64, integers: as written.
    if any(_jaxpr.varying_axes(a) for a in ops.avals):
      return False  # Inside shard_map: per-device types; kept in half.
    cfg = self.cfg
    return ops.scopes.isdisjoint(cfg.fp8_exclude) and (
        cfg.fp8_scopes is None or not ops.scopes.isdisjoint(cfg.fp8_scopes))

  def _fp8_plan(self, ops: _jaxpr.Operands) -> _jaxpr.Plan:
    """The matmul as one call of :func:`jmp_lite.fp8.dot_general`.

    Operands are first cast to the compute dtype, as for a half-precision
    matmul, and the result is in the compute dtype. A matmul of ``fn``'s own
    jaxpr takes the next delayed-scaling state; one inside a sub-computation
    (a nested ``jit``, a loop body) runs current scaling, since one state
    would be shared by every iteration.
    """
    cfg = self.cfg
    delayed = cfg.delayed and self.depth == 0
    state: tuple[Any, ...] = ()
    if delayed:
      self.fp8_delayed += 1
      if self.fp8_vars:
        state = tuple(self.fp8_vars.pop(0))
      elif self.fp8_vars is not None:  # Too few states: counted, reported.
        delayed = False
    dims = ops.params["dimension_numbers"]
    lhs, rhs = ops.avals
    # Shardings in the operands' types (explicit mesh axes) are part of
    # them: the call's gradients must come back with them.
    shardings = (_jaxpr.type_sharding(lhs), _jaxpr.type_sharding(rhs))
    key = (lhs.shape, rhs.shape, dims, bool(state), shardings)
    template = self.fp8_calls.get(key)
    if template is None:
      template = self.fp8_calls[key] = fp8_call(
          cfg.fp8, lhs.shape, rhs.shape, cfg.compute, dims, bool(state),
          shardings)
    fmt = np.dtype(cfg.fp8.fwd_dtype)
    return _jaxpr.Plan("fp8-delayed" if delayed else "fp8", cfg.compute,
                       call=template, extra=state, logged_inputs=(fmt, fmt))
