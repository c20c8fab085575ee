"""The engine that re-types a jaxpr equation by equation; rules are plugged in.

A :class:`Rewriter` subclass says what each first-order equation should run
in (:meth:`Rewriter.plan`, given an :class:`Operands` view, returning a
:class:`Plan`); the engine does the rest: renaming, casts (each atom
converted to a dtype once), new output types from the primitive's abstract
evaluation, sub-computations rewritten with their signatures kept, loops'
records scaled. Nothing is re-traced, and equations keep their source
locations and named scopes.

Memo tables live on the rewriter, for one rewrite: a sub-computation that
appears several times as the same jaxpr object (the nested ``jit`` behind
``jnp.where``, a ``custom_jvp`` such as ``jax.nn.relu``, a scan body) is
rewritten once, and the result is the same object at every use, so JAX's own
caches (differentiation, lowering) hit as they do for the plain function.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from jmp_lite._jaxpr.names import name_stack_of, scope_names
from jmp_lite._jaxpr.retype import (
  abstract_eval,
  convert,
  has_subjaxprs,
  is_jaxpr,
  jaxpr_and_consts,
  Literal,
  new_eqn,
  new_var,
  rebuilt,
  rewrite,
  sub_context,
  with_operands,
)


class Operands:
  """A first-order equation as a rule sees it, operands as rewritten so far.

  Attributes:
    eqn: the equation as written (for :func:`matmul_flops` and the like).
    primitive: its primitive's name.
    params: its parameters.
    dtypes: its operands' current dtypes.
    avals: its operands' current types (shape, dtype, varying axes).
    scopes: the scope names it was traced under (:func:`scope_names`).
  """

  __slots__ = ("avals", "dtypes", "eqn", "params", "primitive", "scopes")

  def __init__(self, eqn: Any, invars: Sequence[Any], scopes: frozenset[str]):
    self.eqn = eqn
    self.primitive: str = eqn.primitive.name
    self.params: Mapping[str, Any] = eqn.params
    self.avals = tuple(a.aval for a in invars)
    self.dtypes: tuple[Any, ...] = tuple(
        getattr(a, "dtype", None) for a in self.avals)
    self.scopes = scopes

  @property
  def written(self) -> tuple[Any, ...]:
    """Dtypes of its operands and results as written."""
    return tuple(getattr(v.aval, "dtype", None)
                 for v in (*self.eqn.invars, *self.eqn.outvars))

  @property
  def follows(self) -> tuple[bool, ...]:
    """Per operand, whether it was written as a literal or weak-typed value
    (such operands take the dtype of the others; they never widen an op)."""
    return tuple(isinstance(v, Literal) or v.aval.weak_type
                 for v in self.eqn.invars)


class Plan(NamedTuple):
  """What one first-order equation runs in.

  Attributes:
    category: a name for what was decided (kept in the rewriter's log).
    operands: the dtype its float16/bfloat16/float32 operands are cast to;
      ``None``: the types they were written with.
    params: parameters to run it with instead of its own.
    result: the dtype its float results are cast to, or ``None``.
    call: a :func:`traced_call` equation to run instead (on the cast
      operands and ``extra``); it must have one output.
    extra: more operands for ``call``.
    logged_inputs: the input dtypes to log, instead of the operands'.
  """

  category: str
  operands: np.dtype | None = None
  params: dict[str, Any] | None = None
  result: np.dtype | None = None
  call: Any = None
  extra: tuple[Any, ...] = ()
  logged_inputs: tuple[Any, ...] | None = None


# Float dtypes a rewrite may cast between.
CASTABLE = frozenset({np.dtype(jnp.float32), np.dtype(jnp.bfloat16),
                      np.dtype(jnp.float16)})
_F32 = np.dtype(np.float32)


class Rewriter:
  """Rewrites jaxprs by a subclass's rules; state lives for one rewrite.

  Args:
    log: a list the subclass's :meth:`ran` appends to (``None``: nothing is
      logged); the entries of a sub-computation are repeated at each use.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jmp_lite._jaxpr import jaxpr_and_consts, Plan, Rewriter, walk
    >>> class AllHalf(Rewriter):
    ...   def plan(self, ops, mode):
    ...     return Plan("half", np.dtype(jnp.float16))
    >>> body, _ = jaxpr_and_consts(jax.make_jaxpr(jnp.sin)(jnp.ones(2)))
    >>> new = AllHalf().rewrite(body, "auto")
    >>> [(s.primitive, str(s.eqn.outvars[0].aval.dtype)) for s in walk(new)]
    [('convert_element_type', 'float16'), ('sin', 'float16'), \
('convert_element_type', 'float32')]
  """

  def __init__(self, log: list[Any] | None = None):
    self.log = log
    self.depth = 0  # How deep in sub-computations the rewrite is.
    # id(jaxpr), mode -> (jaxpr kept alive, rewritten jaxpr, log entries).
    self._subs: dict[tuple[int, str], tuple[Any, Any, tuple[Any, ...]]] = {}
    # id(name stack) -> (name stack kept alive, scope names, region mode).
    self._scopes: dict[int, tuple[Any, frozenset[str], str | None]] = {}
    self._higher: dict[Any, bool] = {}  # primitive -> has jaxpr params
    # (primitive, operand types, params) -> (output types, effects): the
    # layers of a deep model repeat the same few re-typed equations.
    self._types: dict[tuple[Any, ...], tuple[list[Any], Any]] = {}

  # The rules: what a subclass decides.

  def region(self, scopes: frozenset[str]) -> str | None:
    """The mode equations under ``scopes`` run in, or ``None`` (inherited).

    A higher-order equation's mode is its sub-computations' mode.
    """
    del scopes
    return None

  def plan(self, ops: Operands, mode: str) -> Plan:
    """What the first-order equation ``ops`` runs in, in ``mode``."""
    raise NotImplementedError

  def ran(self, ops: Operands, plan: Plan, category: str,
          inputs: Sequence[Any], outputs: Sequence[Any]) -> None:
    """Logs an equation that ran: ``category`` is ``plan.category``, or
    ``"original"`` where the primitive refused the planned types; the
    dtypes of its inputs and outputs (``None`` for a value without one)."""
    del ops, plan, category, inputs, outputs

  def repeated(self, entries: list[Any], loop: str,
               length: int | None) -> list[Any]:
    """Log entries of a loop body, for the loop (``"scan"`` of ``length``
    steps, or ``"while"``). Each loop scales what its body logged once."""
    del loop, length
    return entries

  # The engine.

  def rewrite(self, jaxpr: Any, mode: str) -> Any:
    """``jaxpr`` (open) rewritten; same inputs, outputs in the same types."""
    # Old variable -> new atom, where they differ.
    rename: dict[Any, Any] = {}
    # Casts, by (id(atom), dtype) -> (atom, cast): an atom is converted to a
    # dtype once, and a half value widened to float32 (exactly) is narrowed
    # back to the original rather than converted again.
    casts: dict[tuple[int, Any], tuple[Any, Any]] = {}
    eqns: list[Any] = []
    higher, known = self._higher, self._scopes
    for eqn in jaxpr.eqns:
      invars = [a if isinstance(a, Literal) else rename.get(a, a)
                for a in eqn.invars]
      stack = name_stack_of(eqn)
      hit = known.get(id(stack))
      if hit is None:
        names = frozenset(scope_names(stack))
        hit = known[id(stack)] = (stack, names, self.region(names))
      eqn_mode = hit[2] or mode
      is_higher = higher.get(eqn.primitive)
      if is_higher is None:
        is_higher = higher[eqn.primitive] = has_subjaxprs(eqn)
      if is_higher:
        outvars = self._higher_order(eqn, invars, eqn_mode, casts, eqns)
      else:
        outvars = self._first_order(eqn, invars, hit[1], eqn_mode, casts,
                                    eqns)
      for old, new in zip(eqn.outvars, outvars, strict=True):
        if new is not old:
          rename[old] = new
    outvars = [a if isinstance(a, Literal) else rename.get(a, a)
               for a in jaxpr.outvars]
    outvars = self._to_avals(outvars, jaxpr.outvars, casts, eqns,
                             jaxpr.eqns[-1] if jaxpr.eqns else None)
    return rewrite(jaxpr, eqns, outvars)

  def _cast(self, atom: Any, dtype: np.dtype, casts: dict, eqns: list,
            like: Any) -> Any:
    """``atom`` in ``dtype`` if it is a float16/bfloat16/float32 value."""
    have = atom.aval.dtype
    if have == dtype or have not in CASTABLE:
      return atom
    key = (id(atom), dtype)
    hit = casts.get(key)
    if hit is not None:
      return hit[1]
    eqn, out = convert(atom, dtype, like)
    if eqn is not None:
      eqns.append(eqn)
    casts[key] = (atom, out)
    if dtype == _F32:  # Exact: narrowing back gives ``atom`` itself.
      casts[(id(out), have)] = (out, atom)
    return out

  def _to_avals(self, atoms: Sequence[Any], like_atoms: Sequence[Any],
                casts: dict, eqns: list, like: Any) -> list[Any]:
    """Casts float atoms back to the dtypes of ``like_atoms``."""
    return [self._cast(a, o.aval.dtype, casts, eqns, like)
            if a is not o and a.aval.dtype in CASTABLE else a
            for a, o in zip(atoms, like_atoms, strict=True)]

  def _emit(self, eqn: Any, invars: list[Any], params: dict[str, Any],
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
        eqns.append(with_operands(eqn, invars))
        return eqn.outvars
    in_avals = [a.aval for a in invars]
    try:
      key: tuple[Any, ...] | None = (eqn.primitive, *in_avals,
                                     *params.items())
      hit = self._types.get(key)  # type: ignore[arg-type]
    except TypeError:  # Unhashable parameters: not memoised.
      key = hit = None
    if hit is None:
      hit = abstract_eval(eqn.primitive, in_avals, params)
      if key is not None:
        self._types[key] = hit
    out_avals, effects = hit
    outvars = [old if aval == old.aval else new_var(old, aval)
               for old, aval in zip(eqn.outvars, out_avals, strict=True)]
    eqns.append(new_eqn(eqn, invars, outvars, eqn.primitive, params, effects))
    return outvars

  def _first_order(self, eqn: Any, invars: list[Any], scopes: frozenset[str],
                   mode: str, casts: dict, eqns: list) -> list[Any]:
    ops = Operands(eqn, invars, scopes)
    plan = self.plan(ops, mode)
    if plan.operands is None:
      invars = self._to_avals(invars, eqn.invars, casts, eqns, eqn)
    else:
      invars = [self._cast(a, plan.operands, casts, eqns, eqn)
                for a in invars]
    category = plan.category
    if plan.call is not None:
      template = plan.call
      out = new_var(eqn.outvars[0], template.outvars[0].aval)
      eqns.append(new_eqn(eqn, [*invars, *plan.extra], [out],
                          template.primitive, template.params,
                          template.effects))
      outvars = [out]
    else:
      try:
        params = eqn.params if plan.params is None else plan.params
        outvars = self._emit(eqn, invars, params, eqns)
      except (TypeError, ValueError):
        # A primitive whose parameters pin its operand types: run it as
        # written (casts made for it are left unused; XLA removes them).
        category = "original"
        invars = self._to_avals(invars, eqn.invars, casts, eqns, eqn)
        outvars = self._emit(eqn, invars, eqn.params, eqns)
      if plan.result is not None and category == plan.category:
        outvars = [self._cast(a, plan.result, casts, eqns, eqn)
                   for a in outvars]
    if self.log is not None:
      inputs = (plan.logged_inputs if plan.logged_inputs is not None
                else [getattr(a.aval, "dtype", None) for a in invars])
      self.ran(ops, plan, category, inputs,
               [getattr(a.aval, "dtype", None) for a in outvars])
    return outvars

  def _higher_order(self, eqn: Any, invars: list[Any], mode: str,
                    casts: dict, eqns: list) -> list[Any]:
    # Values cross the boundary in the original types: signatures are kept,
    # so the outputs keep their types too.
    invars = self._to_avals(invars, eqn.invars, casts, eqns, eqn)
    log = self.log
    start = len(log) if log is not None else 0
    params = dict(eqn.params)
    for key, value in params.items():
      if is_jaxpr(value):
        params[key] = self._retyped(eqn, value, mode)
      elif (isinstance(value, tuple) and value
            and all(is_jaxpr(s) for s in value)):
        params[key] = tuple(self._retyped(eqn, s, mode) for s in value)
    if log is not None and len(log) > start:
      # Scaled here, not in _retyped, whose memo keeps a body's entries per
      # single run: the same body may sit in loops of different lengths,
      # and nested loops multiply as each scales what its body logged.
      name = eqn.primitive.name
      if name == "scan":
        log[start:] = self.repeated(log[start:], "scan",
                                    int(eqn.params["length"]))
      elif name == "while":   # The trip count is a run-time value.
        log[start:] = self.repeated(log[start:], "while", None)
    eqns.append(with_operands(eqn, invars, params))
    return eqn.outvars

  def _retyped(self, eqn: Any, sub: Any, mode: str) -> Any:
    """``sub`` (a jaxpr parameter of ``eqn``) rewritten, same signature."""
    key = (id(sub), mode)
    log = self.log
    hit = self._subs.get(key)
    if hit is not None:
      if log is not None:  # The log lists every use.
        log.extend(hit[2])
      return hit[1]
    start = len(log) if log is not None else 0
    inner, _ = jaxpr_and_consts(sub)
    self.depth += 1
    try:
      # Abstract evaluation inside a shard_map body needs its mesh axes.
      with sub_context(eqn):
        new = rebuilt(sub, self.rewrite(inner, mode))
    finally:
      self.depth -= 1
    recorded = tuple(log[start:]) if log is not None else ()
    self._subs[key] = (sub, new, recorded)
    return new
