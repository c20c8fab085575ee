"""Op-level autocast for JAX: re-type every primitive by rule (torch.autocast).

:func:`autocast` returns a function with ``fn``'s signature that runs ``fn``
with each primitive re-typed:

* **lower** list (default: ``dot_general``, ``conv_general_dilated``, the
  primitives behind ``@``, ``jnp.einsum``, ``jnp.matmul``, attention): float
  inputs cast to the compute dtype, result in the compute dtype (XLA
  accumulates in float32), and so are the gradient's matmuls;
* **float32** list (PyTorch's CUDA float32 list mapped to ``lax``
  primitives: ``exp``, ``log``, ``log1p``, ``expm1``, ``pow``, ``rsqrt``,
  ``logistic``, reductions ``reduce_sum``/``cumsum``/..., the pieces of
  softmax, logsumexp, norms and losses): float inputs cast to float32;
* every other primitive runs in the widest float dtype among its (non-literal)
  inputs (**promote**).

Integer, bool and float64 values are never touched, and outputs come back in
the dtypes ``fn`` would return. It works eagerly and under ``jax.jit``,
``jax.grad``, ``jax.vmap`` and ``jax.checkpoint``, and recurses into nested
``jit``, ``custom_jvp``/``custom_vjp`` functions, ``lax.scan``,
``lax.while_loop``, ``lax.cond``/``switch`` and ``jax.checkpoint``. Each
sub-computation keeps its original signature (values crossing its boundary
are cast back), so control-flow typing stays valid.

Regions: code under ``jax.named_scope(name)`` with ``name`` in
``exclude_scopes`` (or inside :func:`float32_region`) runs exactly as
written; code under a name in ``force_scopes`` (or :func:`half_region`) runs
every float primitive in the compute dtype.

Arguments: the array leaves of the positional and keyword arguments are
traced (typed PRNG keys and ``float0`` arrays too, which pass through
untouched); every other leaf (an Equinox module's functions and Python
fields, strings, ``None``) is handed to ``fn`` as it is. Outputs may hold
non-array leaves likewise.

How: ``fn`` is traced once to a jaxpr, which is rewritten equation by
equation (an equation whose operand types do not change is kept as it is,
a sub-computation used several times is rewritten once per call) and then
called from the caller's trace as one nested ``jit`` named ``autocast``
(which XLA inlines), each equation keeping the source location of the one it
replaces. Its derivative is the forward-mode derivative of the rewritten
equations, so ``jax.grad`` sees the same re-typed computation.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import math
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from jmp_lite import _jaxpr
from jmp_lite import dtypes as _dtypes
from jmp_lite._checks import check_bool
from jmp_lite._nnx_paths import same_leaves, set_at_path
from jmp_lite.policy import get_policy, Policy

__all__ = ["Audit", "AuditRecord", "FLOAT32", "LOWER_PRECISION", "autocast",
           "autocast_audit", "autocast_fp8_state", "float32_region",
           "half_region"]

LOWER_PRECISION: tuple[str, ...] = ("dot_general", "conv_general_dilated")
"""Primitives run in the compute dtype by default."""

FLOAT32: tuple[str, ...] = (
    "exp", "exp2", "log", "log1p", "expm1", "pow", "integer_pow", "square",
    "rsqrt", "acos", "asin", "cosh", "sinh", "tan", "erf_inv", "logistic",
    "reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp",
)
"""Primitives run in float32 by default (PyTorch's CUDA float32 list)."""

_FLOAT32_SCOPE = "jmp_lite_float32"
_HALF_SCOPE = "jmp_lite_half"
# What an autocast call runs in: an autocast around it leaves it as written
# (the innermost autocast decides, as nested torch.autocast regions do).
_AUTOCAST_SCOPE = "jmp_lite_autocast"

_INTEGER_ONLY = {"and", "or", "not", "xor", "shift_left",
                 "shift_right_logical", "shift_right_arithmetic",
                 "population_count", "clz"}
# Primitives whose result depends on the exact float dtype of their inputs
# (bit patterns, ulps) or that hand values to host code expecting the types
# the function was written with: they run on the as-written types.
_AS_WRITTEN = frozenset({
    "bitcast_convert_type", "nextafter", "pure_callback", "io_callback",
    "debug_callback", "reduce_precision"})
_CASTABLE = frozenset({np.dtype(jnp.float32), np.dtype(jnp.bfloat16),
                       np.dtype(jnp.float16)})
_F32 = np.dtype(jnp.float32)
# Float dtypes autocast never touches (wider than float32; with
# ``jax_enable_x64``).
_WIDE = frozenset({np.dtype(np.float64)})
_Literal = _jaxpr.Literal


def float32_region() -> Any:
  """A ``jax.named_scope`` whose code autocast leaves exactly as written.

  Returns:
    A context manager.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> def f(x):
    ...   with jmp_lite.float32_region():
    ...     y = x @ x
    ...   return y
    >>> jmp_lite.autocast(f, jnp.bfloat16)(jnp.ones((2, 2))).dtype
    dtype('float32')
  """
  return jax.named_scope(_FLOAT32_SCOPE)


def half_region() -> Any:
  """A ``jax.named_scope`` in which autocast runs every float op in half.

  Returns:
    A context manager.

  Example:
    >>> import jax, jax.numpy as jnp, jmp_lite
    >>> def f(x):
    ...   with jmp_lite.half_region():
    ...     return jnp.exp(x)  # exp is on the float32 list, but forced here
    >>> audit = jmp_lite.autocast_audit(f, "bf16", jnp.ones(2))
    >>> [r.dtype for r in audit.records]
    ['bfloat16']
  """
  return jax.named_scope(_HALF_SCOPE)


@dataclasses.dataclass(frozen=True)
class _Config:
  compute: np.dtype
  lower: frozenset[str]
  fp32: frozenset[str]
  exclude: tuple[str, ...]
  force: tuple[str, ...]
  accumulate_f32: bool
  fp8: Any = None  # A jmp_lite.fp8 recipe, or None.
  fp8_scopes: tuple[str, ...] | None = None
  fp8_exclude: tuple[str, ...] = ()

  @property
  def delayed(self) -> bool:
    from jmp_lite.fp8 import DelayedScaling  # fp8 imports optax users' code.
    return isinstance(self.fp8, DelayedScaling)


def _check_names(names: Iterable[Any], what: str) -> set[str]:
  if isinstance(names, str) or hasattr(names, "name"):
    # One name or primitive, not a list of them (a str would be iterated
    # letter by letter).
    raise TypeError(f"{what} takes a list of primitive names or jax"
                    f" primitives; wrap the one given in a list: [{names!r}]")
  if not isinstance(names, Iterable):
    raise TypeError(f"{what} takes a list of primitive names or jax"
                    f" primitives, got {type(names).__name__}: {names!r}")
  out: set[str] = set()
  known: dict[str, Any] | None = None
  for item in names:
    name = item if isinstance(item, str) else getattr(item, "name", None)
    if not isinstance(name, str):
      raise TypeError(
          f"{what} entries must be primitive names or jax primitives, got"
          f" {item!r}")
    if name in ("scan", "while", "cond", "pjit", "jit", "custom_jvp_call",
                "custom_vjp_call", "remat2", "checkpoint", "closed_call",
                "shard_map"):
      raise ValueError(
          f"{what}: {name!r} is a higher-order primitive; autocast recurses"
          " into its body, so list the primitives inside it instead")
    if name in _INTEGER_ONLY:
      raise ValueError(
          f"{what}: {name!r} works only on integers and booleans, which"
          " autocast never re-types")
    if known is None:  # Looked up only when there are names to check.
      known = _jaxpr.primitives_by_name()
    if name not in known:
      close = difflib.get_close_matches(name, known, n=3)
      hint = f"; did you mean {close}?" if close else ""
      raise ValueError(f"{what}: unknown primitive {name!r}{hint}")
    out.add(name)
  return out


def _flops(eqn: Any) -> float:
  name = eqn.primitive.name
  if name == "dot_general":
    (lc, _), (lb, _) = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    out = eqn.outvars[0].aval.shape
    return 2.0 * math.prod(out) * math.prod(lhs[d] for d in lc)
  if name == "conv_general_dilated":
    rhs = eqn.invars[1].aval.shape
    out = eqn.outvars[0].aval.shape
    dn = eqn.params["dimension_numbers"]
    out_features = rhs[dn.rhs_spec[0]]
    # MACs per output element = product of the kernel's other dimensions.
    per_output = math.prod(rhs) / out_features
    return 2.0 * math.prod(out) * per_output
  return 0.0


# Transformations JAX writes around the scope names of the code they
# transform ("transpose(jvp(my_block))" in a backward pass).
_TRANSFORM_WRAPPER = re.compile(
    r"^(?:jvp|transpose|vmap|remat|checkpoint)\((.*)\)$")


def _scope_names(stack: Any) -> set[str]:
  """The scope names in a name stack, unwrapped from transformations: a
  region differentiated inside an autocast is still that region."""
  names = set()
  for part in str(stack).split("/"):
    while (m := _TRANSFORM_WRAPPER.match(part)) is not None:
      part = m.group(1)
    names.add(part)
  return names


class _Retyper:
  """Rewrites jaxprs by the autocast rules; state lives for one call only.

  Works on the jaxpr itself: an equation whose operand types do not change
  is kept as it is, a changed one gets its new output types from the
  primitive's abstract evaluation, and casts are new ``convert_element_type``
  equations. Nothing is re-traced, and equations keep their source locations
  and named scopes.

  Memo tables (never module-level): a sub-computation that appears several
  times as the same jaxpr object (the nested ``jit`` behind ``jnp.where``,
  a ``custom_jvp`` such as ``jax.nn.relu``, a scan body) is rewritten once,
  and the result is the same object at every use, so JAX's own caches
  (differentiation, lowering) hit as they do for the plain function.
  """

  def __init__(self, cfg: _Config, records: list[AuditRecord] | None,
               fp8_vars: Sequence[tuple[Any, Any]] | None = None):
    self.cfg = cfg
    self.records = records
    # id(jaxpr), mode -> (jaxpr kept alive, rewritten jaxpr, audit records).
    self.subs: dict[tuple[int, str], tuple[Any, Any, tuple[Any, ...]]] = {}
    # id(name stack) -> (name stack kept alive, region mode or None).
    self.regions: dict[int, tuple[Any, str | None]] = {}
    self.higher: dict[Any, bool] = {}  # primitive -> has jaxpr params
    # (primitive, operand types, params) -> (output types, effects): the
    # layers of a deep model repeat the same few re-typed equations.
    self.types: dict[tuple[Any, ...], tuple[list[Any], Any]] = {}
    # FP8: the delayed-scaling states' (history, pending) input variables,
    # consumed in order by the top-level matmuls (None: count them only);
    # how many were asked for; the nesting depth; one traced FP8 call per
    # operand types (the same sub-jaxpr at every use).
    self.fp8_vars = list(fp8_vars) if fp8_vars is not None else None
    self.fp8_delayed = 0
    self.depth = 0
    self.fp8_calls: dict[tuple[Any, ...], Any] = {}
    self.fp8_scopes: dict[int, tuple[Any, bool]] = {}

  def region(self, eqn: Any) -> str | None:
    """``"off"``/``"force"`` if ``eqn`` is in such a named scope, else None."""
    stack = _jaxpr.name_stack_of(eqn)
    hit = self.regions.get(id(stack))
    if hit is not None:
      return hit[1]
    scopes = _scope_names(stack)
    cfg = self.cfg
    if (_FLOAT32_SCOPE in scopes or _AUTOCAST_SCOPE in scopes
        or not scopes.isdisjoint(cfg.exclude)):
      found: str | None = "off"
    elif _HALF_SCOPE in scopes or not scopes.isdisjoint(cfg.force):
      found = "force"
    else:
      found = None
    self.regions[id(stack)] = (stack, found)
    return found

  def jaxpr(self, jaxpr: Any, mode: str) -> Any:
    """``jaxpr`` (open) rewritten; same inputs, outputs in the same types."""
    # Old variable -> new atom, where they differ.
    rename: dict[Any, Any] = {}
    # Casts, by (id(atom), dtype) -> (atom, cast): an atom is converted to a
    # dtype once, and a half value widened to float32 (exactly) is narrowed
    # back to the original rather than converted again.
    casts: dict[tuple[int, Any], tuple[Any, Any]] = {}
    eqns: list[Any] = []
    higher, regions = self.higher, self.regions
    for eqn in jaxpr.eqns:
      invars = [a if isinstance(a, _Literal) else rename.get(a, a)
                for a in eqn.invars]
      hit = regions.get(id(_jaxpr.name_stack_of(eqn)))
      eqn_mode = (hit[1] if hit is not None else self.region(eqn)) or mode
      is_higher = higher.get(eqn.primitive)
      if is_higher is None:
        is_higher = higher[eqn.primitive] = _jaxpr.has_subjaxprs(eqn)
      if is_higher:
        outvars = self.higher_order(eqn, invars, eqn_mode, casts, eqns)
      else:
        outvars = self.first_order(eqn, invars, eqn_mode, casts, eqns)
      for old, new in zip(eqn.outvars, outvars, strict=True):
        if new is not old:
          rename[old] = new
    outvars = [a if isinstance(a, _Literal) else rename.get(a, a)
               for a in jaxpr.outvars]
    outvars = self.to_avals(outvars, jaxpr.outvars, casts, eqns,
                            jaxpr.eqns[-1] if jaxpr.eqns else None)
    return _jaxpr.rewrite(jaxpr, eqns, outvars)

  def cast(self, atom: Any, dtype: np.dtype, casts: dict, eqns: list,
           like: Any) -> Any:
    """``atom`` in ``dtype`` if it is a float16/bfloat16/float32 value."""
    have = atom.aval.dtype
    if have == dtype or have not in _CASTABLE:
      return atom
    key = (id(atom), dtype)
    hit = casts.get(key)
    if hit is not None:
      return hit[1]
    eqn, out = _jaxpr.convert(atom, dtype, like)
    if eqn is not None:
      eqns.append(eqn)
    casts[key] = (atom, out)
    if dtype == _F32:  # Exact: narrowing back gives ``atom`` itself.
      casts[(id(out), have)] = (out, atom)
    return out

  def to_avals(self, atoms: Sequence[Any], like_atoms: Sequence[Any],
               casts: dict, eqns: list, like: Any) -> list[Any]:
    """Casts float atoms back to the dtypes of ``like_atoms``."""
    return [self.cast(a, o.aval.dtype, casts, eqns, like)
            if a is not o and a.aval.dtype in _CASTABLE else a
            for a, o in zip(atoms, like_atoms, strict=True)]

  def emit(self, eqn: Any, invars: list[Any], params: dict[str, Any],
           eqns: list) -> list[Any]:
    """Appends ``eqn`` on ``invars``; returns its (possibly new) outputs."""
    if params is eqn.params:
      pairs = list(zip(invars, eqn.invars, strict=True))
      if all(new is old for new, old in pairs):
        eqns.append(eqn)
        return eqn.outvars
      if all(new.aval.dtype == old.aval.dtype
             and new.aval.weak_type == old.aval.weak_type
             for new, old in pairs):
        # Same operand types (casts change only dtypes): same output types.
        eqns.append(eqn.replace(invars=invars))
        return eqn.outvars
    in_avals = [a.aval for a in invars]
    try:
      key: tuple[Any, ...] | None = (eqn.primitive, *in_avals,
                                     *params.items())
      hit = self.types.get(key)  # type: ignore[arg-type]
    except TypeError:  # Unhashable parameters: not memoised.
      key = hit = None
    if hit is None:
      hit = _jaxpr.abstract_eval(eqn.primitive, in_avals, params)
      if key is not None:
        self.types[key] = hit
    out_avals, effects = hit
    outvars = [old if aval == old.aval else _jaxpr.new_var(old, aval)
               for old, aval in zip(eqn.outvars, out_avals, strict=True)]
    eqns.append(_jaxpr.new_eqn(eqn, invars, outvars, eqn.primitive, params,
                               effects))
    return outvars

  def first_order(self, eqn: Any, invars: list[Any], mode: str, casts: dict,
                  eqns: list) -> list[Any]:
    cfg = self.cfg
    name = eqn.primitive.name
    params = eqn.params
    if mode == "off" or name in _AS_WRITTEN or any(
        v.aval.dtype in _WIDE for v in (*eqn.invars, *eqn.outvars)):
      # float64 is never touched, so an equation that reads or makes it runs
      # as written, float32 operands beside it included, as in plain JAX
      # (``dot_general`` takes mixed operands): re-typing only the float32
      # operand, or asking for a half product, would round a float64 result
      # through the compute dtype.
      category = "original"
      invars = self.to_avals(invars, eqn.invars, casts, eqns, eqn)
    elif (cfg.fp8 is not None and name == "dot_general" and name in cfg.lower
          and self.fp8_eligible(eqn, invars)):
      return self.fp8_dot(eqn, invars, casts, eqns)
    elif name in cfg.lower or (mode == "force" and any(
        a.aval.dtype in _CASTABLE for a in invars)):
      category = "lower"
      invars = [self.cast(a, cfg.compute, casts, eqns, eqn) for a in invars]
      if ("preferred_element_type" in params
          and any(a.aval.dtype in _CASTABLE for a in invars)):
        # The product comes out in the compute dtype, so the backward pass's
        # matmuls take compute-dtype cotangents too (a float32 result would
        # send float32 cotangents into both gradient matmuls). XLA
        # accumulates half-precision products in float32 on GPU, TPU and
        # CPU either way; accumulate_in_float32 asks for a float32 result.
        params = dict(params, preferred_element_type=(
            _F32 if cfg.accumulate_f32 else cfg.compute))
    elif name in cfg.fp32:
      category = "float32"
      invars = [self.cast(a, _F32, casts, eqns, eqn) for a in invars]
    else:
      category = "promote"
      # Literals and weak-typed scalars follow; they never widen an op.
      target = None
      for a, old in zip(invars, eqn.invars, strict=True):
        have = a.aval.dtype
        if (have in _CASTABLE and have != target
            and not isinstance(old, _Literal) and not old.aval.weak_type):
          # Among float16, bfloat16 and float32, any two differ -> float32.
          target = have if target is None else _F32
      if target is not None:
        invars = [self.cast(a, target, casts, eqns, eqn) for a in invars]
      else:
        invars = self.to_avals(invars, eqn.invars, casts, eqns, eqn)
    try:
      outvars = self.emit(eqn, invars, params, eqns)
    except (TypeError, ValueError):
      # A primitive whose parameters pin its operand types: run it as
      # written (casts made for it are left unused; XLA removes them).
      category = "original"
      invars = self.to_avals(invars, eqn.invars, casts, eqns, eqn)
      outvars = self.emit(eqn, invars, eqn.params, eqns)
    if category == "lower":
      outvars = [self.cast(a, cfg.compute, casts, eqns, eqn) for a in outvars]
    if self.records is not None:
      self.records.append(_audit_record(
          eqn, category, [a.aval for a in invars], [a.aval for a in outvars]))
    return outvars

  def higher_order(self, eqn: Any, invars: list[Any], mode: str, casts: dict,
                   eqns: list) -> list[Any]:
    # Values cross the boundary in the original types: signatures are kept,
    # so the outputs keep their types too.
    invars = self.to_avals(invars, eqn.invars, casts, eqns, eqn)
    start = len(self.records) if self.records is not None else 0
    params = dict(eqn.params)
    for key, value in params.items():
      if _jaxpr.is_jaxpr(value):
        params[key] = self.retyped(eqn, value, mode)
      elif (isinstance(value, tuple) and value
            and all(_jaxpr.is_jaxpr(s) for s in value)):
        params[key] = tuple(self.retyped(eqn, s, mode) for s in value)
    if self.records is not None and len(self.records) > start:
      self.repeat_records(eqn, start)
    eqns.append(eqn.replace(invars=invars, params=params))
    return eqn.outvars

  def repeat_records(self, eqn: Any, start: int) -> None:
    """Scales the audit records from ``start`` on by ``eqn``'s trip count.

    Applied here, not in :meth:`retyped`, whose memo keeps a body's records
    per single run: the same body may sit in scans of different lengths,
    and nested scans multiply as each one scales what its body recorded.
    """
    records = self.records
    assert records is not None
    name = eqn.primitive.name
    if name == "scan":
      n = int(eqn.params["length"])
      records[start:] = [dataclasses.replace(
          r, repeats=r.repeats * n, flops=r.flops * n) for r in records[start:]]
    elif name == "while":
      # The trip count is a run-time value: the body counts once per loop,
      # and is marked so the audit can say so.
      records[start:] = [dataclasses.replace(r, in_while_loop=True)
                         for r in records[start:]]

  def retyped(self, eqn: Any, sub: Any, mode: str) -> Any:
    """``sub`` (a jaxpr parameter of ``eqn``) rewritten, same signature."""
    key = (id(sub), mode)
    hit = self.subs.get(key)
    if hit is not None:
      if self.records is not None:  # The audit lists every use.
        self.records.extend(hit[2])
      return hit[1]
    start = len(self.records) if self.records is not None else 0
    inner, _ = _jaxpr.jaxpr_and_consts(sub)
    # Abstract evaluation inside a shard_map body needs its mesh axes.
    self.depth += 1
    try:
      with _jaxpr.sub_context(eqn):
        new = _jaxpr.rebuilt(sub, self.jaxpr(inner, mode))
    finally:
      self.depth -= 1
    recorded = (tuple(self.records[start:]) if self.records is not None
                else ())
    self.subs[key] = (sub, new, recorded)
    return new


  def fp8_eligible(self, eqn: Any, invars: list[Any]) -> bool:
    """Whether this (half-precision) matmul runs in FP8 instead."""
    if not all(a.aval.dtype in _CASTABLE for a in invars):
      return False  # float64, integers: as written.
    from jmp_lite.fp8._dot import varying_axes
    if any(varying_axes(a.aval) for a in invars):
      return False  # Inside shard_map: per-device types; kept in half.
    stack = _jaxpr.name_stack_of(eqn)
    hit = self.fp8_scopes.get(id(stack))
    if hit is None:
      scopes = _scope_names(stack)
      cfg = self.cfg
      ok = scopes.isdisjoint(cfg.fp8_exclude) and (
          cfg.fp8_scopes is None or not scopes.isdisjoint(cfg.fp8_scopes))
      hit = self.fp8_scopes[id(stack)] = (stack, ok)
    return hit[1]

  def fp8_dot(self, eqn: Any, invars: list[Any], casts: dict,
              eqns: list) -> list[Any]:
    """Emits ``eqn`` as one call of :func:`jmp_lite.fp8.dot_general`.

    Operands are first cast to the compute dtype, as for a half-precision
    matmul, and the result is in the compute dtype. A matmul of ``fn``'s own
    jaxpr takes the next delayed-scaling state; one inside a sub-computation
    (a nested ``jit``, a loop body) runs current scaling, since one state
    would be shared by every iteration.
    """
    cfg = self.cfg
    lhs, rhs = (self.cast(a, cfg.compute, casts, eqns, eqn) for a in invars)
    delayed = cfg.delayed and self.depth == 0
    state: list[Any] = []
    if delayed:
      self.fp8_delayed += 1
      if self.fp8_vars:
        state = list(self.fp8_vars.pop(0))
      elif self.fp8_vars is not None:  # Too few states: counted, reported.
        delayed = False
    dims = eqn.params["dimension_numbers"]
    key = (lhs.aval, rhs.aval, dims, bool(state))
    template = self.fp8_calls.get(key)
    if template is None:
      template = self.fp8_calls[key] = _fp8_call(
          cfg.fp8, lhs.aval, rhs.aval, dims, bool(state))
    out = _jaxpr.new_var(eqn.outvars[0], template.outvars[0].aval)
    eqns.append(_jaxpr.new_eqn(eqn, [lhs, rhs, *state], [out],
                               template.primitive, template.params,
                               template.effects))
    if self.records is not None:
      fmt = cfg.fp8.fwd_dtype
      self.records.append(_audit_record(
          eqn, "fp8-delayed" if delayed else "fp8",
          [jax.core.ShapedArray(lhs.aval.shape, fmt),
           jax.core.ShapedArray(rhs.aval.shape, fmt)], [out.aval]))
    return [out]


def _fp8_call(recipe: Any, lhs: Any, rhs: Any, dims: Any,
              delayed: bool) -> Any:
  """A traced ``jit`` equation computing one FP8 matmul on these types."""
  from jmp_lite import fp8  # Imported on first use only.

  if not delayed and isinstance(recipe, fp8.DelayedScaling):
    # A matmul without a state of its own: the same formats, just in time.
    recipe = fp8.CurrentScaling(recipe.fwd_dtype, recipe.bwd_dtype,
                                recipe.margin)

  def run(*xs: Any) -> Any:
    state = fp8.ScalingState(*xs[2:]) if delayed else None
    return fp8.dot_general(recipe, state)(xs[0], xs[1], dims)

  n = len(fp8.ScalingState.__dataclass_fields__)
  avals = [jax.ShapeDtypeStruct(lhs.shape, lhs.dtype),
           jax.ShapeDtypeStruct(rhs.shape, rhs.dtype)]
  if delayed:
    avals += [jax.ShapeDtypeStruct((3, recipe.history), np.float32),
              jax.ShapeDtypeStruct((3,), np.float32)][:n]
  # The equation of a call of ``jax.jit(run)``, taken from a trace.
  return jax.jit(lambda *xs: jax.jit(run)(*xs)).trace(*avals).jaxpr.eqns[0]


def _make_config(policy_or_dtype: Any, *, allow: Iterable[Any] = (),
                 deny: Iterable[Any] = (), use_default_lists: bool = True,
                 exclude_scopes: Sequence[str] = (),
                 force_scopes: Sequence[str] = (),
                 accumulate_in_float32: bool = False, fp8: Any = None,
                 fp8_scopes: Sequence[str] | None = None,
                 fp8_exclude_scopes: Sequence[str] = ()) -> _Config:
  """Validates :func:`autocast`'s options (shared with the audit)."""
  for what, flag in (("use_default_lists", use_default_lists),
                     ("accumulate_in_float32", accumulate_in_float32)):
    check_bool(flag, what)  # "no" would read as True.
  if isinstance(policy_or_dtype, str) and "=" in policy_or_dtype:
    policy_or_dtype = get_policy(policy_or_dtype)  # "p=f32,c=bf16,o=f32"
  if isinstance(policy_or_dtype, Policy):
    compute = policy_or_dtype.compute_dtype
  elif policy_or_dtype is None:
    compute = _dtypes.half_dtype()
  else:
    compute = _dtypes.to_floating_dtype(policy_or_dtype, "policy_or_dtype")
  if compute not in _CASTABLE:
    raise TypeError(
        f"autocast's compute dtype must be float16, bfloat16 or float32, got"
        f" {compute.name}")
  allow_set = _check_names(allow, "allow")
  deny_set = _check_names(deny, "deny")
  both = allow_set & deny_set
  if both:
    raise ValueError(f"Primitives in both allow and deny: {sorted(both)}")
  lower = set(LOWER_PRECISION) if use_default_lists else set()
  fp32 = set(FLOAT32) if use_default_lists else set()
  lower = (lower - deny_set) | allow_set
  fp32 = (fp32 - allow_set) | deny_set
  for what, scopes in (("exclude_scopes", exclude_scopes),
                       ("force_scopes", force_scopes),
                       ("fp8_scopes", () if fp8_scopes is None else fp8_scopes),
                       ("fp8_exclude_scopes", fp8_exclude_scopes)):
    if (isinstance(scopes, str) or not isinstance(scopes, Iterable)
        or not all(isinstance(s, str) for s in scopes)):
      raise TypeError(f"{what} must be a sequence of scope names, got"
                      f" {scopes!r}")
  if fp8 is not None:
    from jmp_lite.fp8._recipes import check_recipe
    check_recipe(fp8)
  elif fp8_scopes is not None or fp8_exclude_scopes:
    raise ValueError("fp8_scopes/fp8_exclude_scopes need an fp8= recipe")
  return _Config(compute=compute, lower=frozenset(lower),
                 fp32=frozenset(fp32), exclude=tuple(exclude_scopes),
                 force=tuple(force_scopes),
                 accumulate_f32=accumulate_in_float32, fp8=fp8,
                 fp8_scopes=None if fp8_scopes is None else tuple(fp8_scopes),
                 fp8_exclude=tuple(fp8_exclude_scopes))


def _fp8_state_leaves(fp8_state: Any) -> list[Any]:
  """The (history, pending) arrays of a delayed-scaling autocast's state."""
  from jmp_lite.fp8 import ScalingState
  if not isinstance(fp8_state, (tuple, list)) or not all(
      isinstance(s, ScalingState) for s in fp8_state):
    raise TypeError(
        "With fp8=DelayedScaling(...), the autocast function's first argument"
        " is its FP8 state: a tuple of jmp_lite.fp8.ScalingState (build it"
        " with jmp_lite.autocast_fp8_state), got"
        f" {type(fp8_state).__name__}")
  return [leaf for s in fp8_state for leaf in (s.history, s.pending)]


def _run(fn: Callable[..., Any], cfg: _Config, args: tuple, kwargs: dict,
         records: list[AuditRecord] | None = None,
         fp8_state: Any = None) -> Any:
  """Calls ``fn(*args, **kwargs)`` re-typed; array leaves are traced.

  With a delayed FP8 recipe, ``fp8_state``'s arrays are traced as extra
  inputs (``fn`` never sees them) that the top-level matmuls read.
  """
  nnx = sys.modules.get("flax.nnx")   # Loaded if any nnx object exists.
  if nnx is not None and any(
      nnx.graph.is_graph_node(x) for x in jax.tree.leaves(
          (args, kwargs), is_leaf=nnx.graph.is_graph_node)):
    return _run_nnx(nnx, fn, cfg, args, kwargs, records, fp8_state)
  return _run_arrays(fn, cfg, args, kwargs, records, fp8_state)


def _run_arrays(fn: Callable[..., Any], cfg: _Config, args: tuple,
                kwargs: dict, records: list[AuditRecord] | None,
                fp8_state: Any) -> Any:
  """:func:`_run` for arguments whose array leaves are all there is."""
  arrays, rebuild = _jaxpr.split_array_args((args, kwargs))
  state = [] if fp8_state is None else _fp8_state_leaves(fp8_state)
  rebuild_out: list[Callable[[Sequence[Any]], Any]] = []

  def flat_fn(*xs: Any) -> list[Any]:
    a, k = rebuild(xs[:len(arrays)])
    out_arrays, rebuild_outputs = _jaxpr.split_array_args(fn(*a, **k))
    rebuild_out.append(rebuild_outputs)
    return out_arrays

  closed = _jaxpr.trace_flat(flat_fn, [*arrays, *state])
  jaxpr, consts = _jaxpr.jaxpr_and_consts(closed)
  state_vars = jaxpr.invars[len(arrays):]
  pairs = (list(zip(state_vars[0::2], state_vars[1::2], strict=True))
           if fp8_state is not None else None)
  retyper = _Retyper(cfg, records, pairs)
  new = retyper.jaxpr(jaxpr, "auto")
  if pairs is not None and retyper.fp8_delayed != len(pairs):
    raise ValueError(
        f"fp8_state holds {len(pairs)} scaling states, but fn has"
        f" {retyper.fp8_delayed} delayed-scaled matmuls; build the state with"
        " jmp_lite.autocast_fp8_state(fn, dtype, *args, fp8=...)")
  if records is not None:  # The audit needs the rewrite only.
    return None
  # Constants become explicit arguments: none is closed over (a traced
  # constant must be differentiated like any argument).
  call_jaxpr = _jaxpr.consts_as_args(new)
  values = [*consts, *arrays, *state]
  with jax.named_scope(_AUTOCAST_SCOPE):
    if any(map(_jaxpr.is_tracer, values)):
      outs = _differentiable_call(call_jaxpr, values)
    else:  # Eager: nothing to differentiate.
      outs = _jaxpr.call(call_jaxpr, values)
  return rebuild_out[0](outs)


def _run_nnx(nnx: Any, fn: Callable[..., Any], cfg: _Config, args: tuple,
             kwargs: dict, records: list[AuditRecord] | None,
             fp8_state: Any) -> Any:
  """:func:`_run` for arguments holding Flax nnx objects, as ``nnx.jit``.

  Traced as pure arrays, nnx modules would be copies: what ``fn`` changes
  in them (RNG counts, batch statistics, caches) would be lost. So the
  arguments are split into their variables and the rest, ``fn`` runs on
  the merged copy, and the variables it changed or created are written
  back. Only those: writing back an unchanged one would put this trace's
  values into a module closed over from outside it (``jax.jit(lambda x:
  autocast(f)(model, x))``), which nnx refuses, as it would for ``f``.
  """
  graphdef, variables, rest = nnx.split((args, kwargs), nnx.Variable, ...)
  given = {path for path, _ in nnx.to_flat_state(variables)}
  changed_paths: list[tuple[Any, ...]] = []   # Found while tracing.

  def pure(variables: Any, rest: Any) -> Any:
    inputs = {path: var.get_value()
              for path, var in nnx.to_flat_state(variables)}
    a, k = nnx.merge(graphdef, variables, rest)
    out = fn(*a, **k)
    changed = [(path, var) for path, var in nnx.to_flat_state(
        nnx.state((a, k), nnx.Variable))
               if path not in inputs
               or not same_leaves(var.get_value(), inputs[path])]
    changed_paths[:] = [path for path, _ in changed]
    return out, [var for _, var in changed]

  # The states' variables are pytrees here: their arrays are traced.
  result = _run_arrays(pure, cfg, (variables, rest), {}, records, fp8_state)
  if records is not None:   # An audit: nothing ran.
    return None
  out, new_vars = result
  old = [(p, v) for p, v in zip(changed_paths, new_vars, strict=True)
         if p in given]
  if old:
    nnx.update((args, kwargs), nnx.from_flat_state(old))
  for path, var in zip(changed_paths, new_vars, strict=True):
    if path not in given:   # Created by fn where the module held none.
      set_at_path((args, kwargs), path, var)
  return out


def _differentiable_call(jaxpr: Any, args: Sequence[Any]) -> list[Any]:
  """Evaluates ``jaxpr`` on ``args``, differentiated as a whole.

  JAX linearizes a primitive bound on its own through a per-primitive
  fallback that costs a small trace each, and linearizing a nested ``jit``
  re-traces its whole jaxpr through partial evaluation; the plain function
  avoids both because ``jax.numpy`` wraps most operations in cached ``jit``
  functions. So the call carries a JVP rule: the equations evaluated one by
  one under forward mode, which ``jax.grad``/``jax.vjp`` linearize in one
  pass. Only non-zero tangents enter.
  """
  call = jax.custom_jvp(lambda *xs: _jaxpr.call(jaxpr, xs))

  def jvp(primals: Sequence[Any], tangents: Sequence[Any]) -> Any:
    live = [not isinstance(t, jax.custom_derivatives.SymbolicZero)
            for t in tangents]

    def of_live(*live_primals: Any) -> list[Any]:
      it = iter(live_primals)
      return _jaxpr.evaluate(jaxpr, [
          next(it) if keep else p
          for p, keep in zip(primals, live, strict=True)])

    return jax.jvp(
        of_live, [p for p, keep in zip(primals, live, strict=True) if keep],
        [t for t, keep in zip(tangents, live, strict=True) if keep])

  call.defjvp(jvp, symbolic_zeros=True)
  return call(*args)


def autocast(
    fn: Callable[..., Any],
    policy_or_dtype: Any = None,
    *,
    allow: Iterable[Any] = (),
    deny: Iterable[Any] = (),
    use_default_lists: bool = True,
    exclude_scopes: Sequence[str] = (),
    force_scopes: Sequence[str] = (),
    accumulate_in_float32: bool = False,
    fp8: Any = None,
    fp8_scopes: Sequence[str] | None = None,
    fp8_exclude_scopes: Sequence[str] = (),
) -> Callable[..., Any]:
  """Returns ``fn`` with every primitive re-typed by the autocast rules.

  Args:
    fn: the function to transform.
    policy_or_dtype: a :class:`~jmp_lite.Policy` or policy string such as
      ``"p=f32,c=bf16,o=f32"`` (its compute dtype is used), or a
      dtype/name; ``None`` means :func:`~jmp_lite.half_dtype`.
    allow: primitives (names or ``jax.lax.*_p``) to add to the lower-precision
      list (Paddle's ``custom_white_list``); removed from the float32 list.
    deny: primitives to add to the float32 list (``custom_black_list``);
      removed from the lower-precision list.
    use_default_lists: start from :data:`LOWER_PRECISION` and
      :data:`FLOAT32` (``False``: only your lists).
    exclude_scopes: ``jax.named_scope`` names whose code runs as written.
    force_scopes: ``jax.named_scope`` names whose float ops all run in the
      compute dtype.
    accumulate_in_float32: ask lower-precision matmuls and convolutions for
      a float32 result (``preferred_element_type``), rounded to the compute
      dtype right after. Off by default: XLA accumulates half-precision
      products in float32 on GPU, TPU and CPU anyway, and a float32 result
      makes the backward pass's matmuls take float32 cotangents (which then
      run in float32). With it off, products come out in the compute dtype
      and the gradient's matmuls run in it too.
    fp8: a :class:`jmp_lite.fp8.CurrentScaling` or
      :class:`~jmp_lite.fp8.DelayedScaling` recipe: every ``dot_general``
      that would run in the compute dtype runs as
      :func:`jmp_lite.fp8.dot_general` instead (E4M3 operands, E5M2
      cotangent, float32 accumulation, result in the compute dtype);
      convolutions stay in the compute dtype. With ``DelayedScaling`` the
      returned function takes the FP8 state (from
      :func:`autocast_fp8_state`) as its first argument: the matmuls of
      ``fn``'s own jaxpr read it in order, those inside nested ``jit`` calls,
      loops and other sub-computations use current scaling. Differentiate
      with respect to it and pass that gradient to
      :func:`jmp_lite.fp8.commit`. Apply autocast to the loss and then
      differentiate (the backward matmuls are the FP8 function's own).
    fp8_scopes: if given, only matmuls under one of these
      ``jax.named_scope`` names (Flax module names are scopes too) run in
      FP8.
    fp8_exclude_scopes: matmuls under these scopes stay in the compute
      dtype (the first and last layers, commonly).

  Returns:
    A function with ``fn``'s signature (with ``DelayedScaling``, the FP8
    state first). The array leaves of its positional
    and keyword arguments (``jax.Array`` including typed PRNG keys and
    ``float0``, numpy arrays and scalars) are traced; every other leaf (a
    function or Python number held by an Equinox module, a string, ``None``,
    a Python float) is passed to ``fn`` as a Python value, as ``jax.jit``'s
    static arguments are. Outputs may hold non-array leaves too.

  Raises:
    ValueError: for unknown, higher-order or integer-only primitives in the
      lists, or one listed in both; FP8 scopes without a recipe; from the
      returned function, an FP8 state of the wrong length.
    TypeError: for a ``fn`` that is not callable, a compute dtype that is
      not float16/bfloat16/float32, an ``fp8`` that is not a recipe, lists
      or scopes that are not lists (of names), flags that are not bools;
      from the returned function, an FP8 state that is not a tuple of
      :class:`jmp_lite.fp8.ScalingState`.

  Example:
    >>> import jax, jax.numpy as jnp, jmp_lite
    >>> def f(x, w):
    ...   return jax.nn.softmax(x @ w)
    >>> g = jmp_lite.autocast(f, jnp.bfloat16)
    >>> g(jnp.ones((2, 3)), jnp.ones((3, 4))).dtype  # As f would return.
    dtype('float32')
    >>> audit = jmp_lite.autocast_audit(f, jnp.bfloat16, jnp.ones((2, 3)),
    ...                                 jnp.ones((3, 4)))
    >>> [r.dtype for r in audit.records if r.primitive == "dot_general"]
    ['bfloat16']
    >>> fp8 = jmp_lite.fp8.CurrentScaling()
    >>> g8 = jmp_lite.autocast(f, jnp.bfloat16, fp8=fp8)  # FP8 matmuls
    >>> jmp_lite.autocast_audit(f, jnp.bfloat16, jnp.ones((2, 3)),
    ...                         jnp.ones((3, 4)), fp8=fp8).fp8_flop_fraction()
    1.0
  """
  if not callable(fn):
    raise TypeError(f"autocast expects a callable, got {fn!r}")
  cfg = _make_config(policy_or_dtype, allow=allow, deny=deny,
                     use_default_lists=use_default_lists,
                     exclude_scopes=exclude_scopes, force_scopes=force_scopes,
                     accumulate_in_float32=accumulate_in_float32, fp8=fp8,
                     fp8_scopes=fp8_scopes,
                     fp8_exclude_scopes=fp8_exclude_scopes)

  if cfg.delayed:
    @functools.wraps(fn)
    def with_state(fp8_state: Any, *args: Any, **kwargs: Any) -> Any:
      return _run(fn, cfg, args, kwargs, fp8_state=fp8_state)

    return with_state

  @functools.wraps(fn)
  def wrapped(*args: Any, **kwargs: Any) -> Any:
    return _run(fn, cfg, args, kwargs)

  return wrapped


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


def _audit_record(eqn: Any, category: str, invals: Sequence[Any],
                  outs: Sequence[Any]) -> AuditRecord:
  ins = tuple(_dtype_name(v.dtype) for v in invals if hasattr(v, "dtype"))
  floats = [_dtype_name(v.dtype) for v in invals if hasattr(v, "dtype")
            and jnp.issubdtype(v.dtype, jnp.floating)]
  return AuditRecord(
      primitive=eqn.primitive.name, category=category,
      dtype=floats[0] if floats else "-", input_dtypes=ins,
      output_dtypes=tuple(_dtype_name(o.dtype) for o in outs
                          if hasattr(o, "dtype")),
      flops=_flops(eqn))


@dataclasses.dataclass(frozen=True)
class Audit:
  """What autocast did to a function: every primitive and its dtype.

  Attributes:
    records: one :class:`AuditRecord` per primitive equation, sub-computations
      included (once per use of one); a loop body's are listed once, with
      the number of runs in ``repeats``.
    compute_dtype: the autocast compute dtype.
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


def _check_options(fn: Any, options: dict[str, Any]) -> None:
  """The checks :func:`autocast_audit` and :func:`autocast_fp8_state` share."""
  if not callable(fn):
    raise TypeError(f"autocast expects a callable, got {fn!r}")
  unknown = set(options) - set(inspect.signature(_make_config).parameters)
  if unknown:
    raise TypeError(
        f"Unknown autocast options: {sorted(unknown)} (keyword arguments are"
        " autocast's options; bind fn's own with functools.partial)")


def autocast_audit(fn: Callable[..., Any], policy_or_dtype: Any, *args: Any,
                   **options: Any) -> Audit:
  """Lists the primitives ``autocast(fn)`` runs, their dtypes and FLOPs.

  Traces abstractly (nothing is computed). A sub-computation used several
  times is listed once per use. A ``lax.scan`` body is listed once and
  counted once per step (nested scans multiply: ``AuditRecord.repeats``),
  in the FLOPs and in the printed counts. A ``lax.while_loop``'s trip count
  is unknown when tracing, so its body counts once per loop
  (``AuditRecord.in_while_loop``; the printed audit says how many such
  primitives there are). Every branch of a ``lax.cond``/``switch`` counts,
  as though each ran.

  Args:
    fn: the function.
    policy_or_dtype: as for :func:`autocast`.
    *args: example inputs: pytrees whose array leaves (arrays, typed keys,
      ``jax.ShapeDtypeStruct``) are traced and whose other leaves (an
      Equinox module's functions and fields, Python values) are passed as
      they are. Bind keyword arguments with ``functools.partial``.
    **options: :func:`autocast`'s keyword options.

  Returns:
    An :class:`Audit`; ``audit.half_flop_fraction()`` is the share of
    matmul/convolution FLOPs run in half precision.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> audit = jmp_lite.autocast_audit(lambda a, b: a @ b, "bf16",
    ...                                 jnp.ones((4, 8)), jnp.ones((8, 2)))
    >>> audit.half_flop_fraction(), audit.matmul_flops()
    (1.0, {'bfloat16': 128.0})
  """
  _check_options(fn, options)
  cfg = _make_config(policy_or_dtype, **options)
  records: list[AuditRecord] = []
  _run(fn, cfg, args, {}, records)
  return Audit(tuple(records), cfg.compute.name)


def autocast_fp8_state(fn: Callable[..., Any], policy_or_dtype: Any,
                       *args: Any, **options: Any) -> tuple[Any, ...]:
  """A fresh FP8 state for ``autocast(fn, ..., fp8=DelayedScaling(...))``.

  One :class:`jmp_lite.fp8.ScalingState` per matmul of ``fn``'s own jaxpr
  that runs in FP8, in the order the autocast function reads them. Traces
  abstractly.

  Args:
    fn: the function (without the state argument).
    policy_or_dtype: as for :func:`autocast`.
    *args: example inputs, as for :func:`autocast_audit`.
    **options: :func:`autocast`'s keyword options, ``fp8=`` a
      :class:`~jmp_lite.fp8.DelayedScaling` among them.

  Returns:
    A tuple of states (numpy zeros: nothing is put on a device).

  Raises:
    ValueError: if ``fp8`` is not a ``DelayedScaling`` recipe.

  Example:
    >>> import jax, jax.numpy as jnp, jmp_lite
    >>> def loss(w, x):
    ...   return jnp.sum(jnp.tanh(x @ w[0]) @ w[1])
    >>> recipe = jmp_lite.fp8.DelayedScaling(history=8)
    >>> w, x = (jnp.full((4, 4), 0.25), jnp.ones((4, 2))), jnp.ones((3, 4))
    >>> state = jmp_lite.autocast_fp8_state(loss, "bf16", w, x, fp8=recipe)
    >>> g = jmp_lite.autocast(loss, jnp.bfloat16, fp8=recipe)
    >>> observed, grads = jax.grad(g, argnums=(0, 1))(state, w, x)
    >>> state = jmp_lite.fp8.commit(state, observed)
    >>> len(state), state[1].history[:, 0].tolist()  # x@w0, w1, cotangent
    (2, [0.76171875, 1.0, 1.0])
  """
  _check_options(fn, options)
  cfg = _make_config(policy_or_dtype, **options)
  if not cfg.delayed:
    raise ValueError(
        "autocast_fp8_state needs fp8=jmp_lite.fp8.DelayedScaling(...), got"
        f" fp8={cfg.fp8!r}")
  records: list[AuditRecord] = []
  _run(fn, cfg, args, {}, records)
  count = sum(r.category == "fp8-delayed" for r in records)
  return tuple(cfg.fp8.init() for _ in range(count))
