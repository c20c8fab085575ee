"""Dtype reports: what each module of a model actually computed in.

Shared by the linen, nnx and Equinox adapters. An adapter traces the model
once (abstractly) with every module call wrapped in a ``jax.named_scope``
whose name is a token of that module (``Recorder.scope``), and records
what crossed the module's boundary (``Recorder.call``). The report then
reads the traced jaxpr: each ``dot_general`` and convolution is attributed to
the innermost module whose scope it was traced in, and its operand dtypes are
what the module *computed* in — facts, not the policy's intent. A module whose
matmuls ran in another dtype than its policy's compute dtype is flagged (its
own code casts, or a layer's field overrides what jmp_lite can reach).
Float32 matmuls traced inside a :func:`jmp_lite.float32_region` of the
module's own code are deliberate (``dot_product_attention_fp32`` runs its
logits there) and not flagged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import html
import itertools
import re
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from jmp_lite import _jaxpr
from jmp_lite import dtypes as _dtypes
from jmp_lite.autocasting._options import FLOAT32_SCOPE
from jmp_lite.diagnostics import tree_bytes

__all__ = ["DtypeReport", "ReportRow"]

Path = tuple[str, ...]

_TOKEN = "jmp_lite_module_"
_TOKEN_RE = re.compile(_TOKEN + r"(\d+)")
# One per outermost call of a module, to count the calls that made it into
# the final computation.
_CALL = "jmp_lite_call_"
_CALL_RE = re.compile(_CALL + r"(\d+)")
# A scope name in a name stack, however transforms wrap it
# (`transpose(jvp(jmp_lite_float32))`).
_FLOAT32_RE = re.compile(r"(?<![\w])" + FLOAT32_SCOPE + r"(?![\w])")
_F32_NAME = np.dtype(np.float32).name


def _float_dtypes(tree: Any) -> str:
  """The sorted, comma-joined names of the floating dtypes in ``tree``.

  Args:
    tree: any pytree.

  Returns:
    E.g. ``"bfloat16,float32"``, or ``"-"`` for none.

  Example:
    >>> import jax.numpy as jnp, jmp_lite.report
    >>> jmp_lite.report._float_dtypes({"a": jnp.ones(1), "b": 2})
    'float32'
  """
  names = sorted({np.dtype(x.dtype).name
                  for x in jax.tree.leaves(tree, is_leaf=_dtypes.is_live_state)
                  if _dtypes.is_floating_array(x)})
  return ",".join(names) if names else "-"


@dataclasses.dataclass(frozen=True)
class ReportRow:
  """One module, as the traced computation saw it.

  Attributes:
    path: module path (``""`` for the root).
    cls: module class name.
    policy: the policy string the module resolved to.
    calls: how many of its calls are in the traced computation: a module
      shared by two places counts 2, a call into its own superclass's
      method (``SelfAttention``) is one, and a ``scan``-ned body counts
      once, as it is traced once (a trace the model discards, such as a
      lifted transform's shape pass, is not counted).
    stored: dtypes of its own params as stored.
    read: dtypes of its own params as the module read them.
    inputs: floating dtypes of its inputs after casting.
    outputs: floating dtypes of its outputs.
    computed: operand dtypes of the matmuls and convolutions traced in its
      own code (not its submodules'), or ``"-"`` if it has none.
    param_bytes: bytes of its own params as stored.
    note: why the computation disagrees with the policy, or ``""``.
  """

  path: str
  cls: str
  policy: str
  calls: int
  stored: str
  read: str
  inputs: str
  outputs: str
  computed: str
  param_bytes: int
  note: str = ""


@dataclasses.dataclass(frozen=True)
class DtypeReport:
  """The dtypes every module of a model used; print it, or show it in Jupyter.

  Attributes:
    rows: one :class:`ReportRow` per module, in first-call order.
    total_param_bytes: bytes of all params as stored, each counted once
      (shared weights and ``scan``-ned layers are not counted twice).
  """

  rows: tuple[ReportRow, ...]
  total_param_bytes: int

  _HEADER = ("module", "class", "policy", "calls", "params stored",
             "params read", "inputs", "outputs", "matmuls ran in",
             "param bytes")

  def mismatches(self) -> tuple[ReportRow, ...]:
    """The rows whose computation disagrees with their policy.

    Returns:
      The flagged rows (empty when the policy governs every matmul).
    """
    return tuple(r for r in self.rows if r.note)

  def _cells(self) -> list[tuple[str, ...]]:
    return [(r.path or "<root>", r.cls, r.policy, str(r.calls), r.stored,
             r.read, r.inputs, r.outputs,
             r.computed + (" (!)" if r.note else ""), f"{r.param_bytes:,}")
            for r in self.rows]

  def __str__(self) -> str:
    cells = self._cells()
    widths = [max([len(h)] + [len(c[i]) for c in cells])
              for i, h in enumerate(self._HEADER)]

    def fmt(row: tuple[str, ...]) -> str:
      return "  ".join(v.ljust(w)
                       for v, w in zip(row, widths, strict=True)).rstrip()

    lines = [fmt(self._HEADER), fmt(tuple("-" * w for w in widths))]
    lines += [fmt(c) for c in cells]
    lines.append(f"total param bytes: {self.total_param_bytes:,}")
    for r in self.mismatches():
      lines.append(f"(!) {r.path or '<root>'}: {r.note}")
    return "\n".join(lines)

  def _repr_html_(self) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in self._HEADER)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in c) + "</tr>"
        for c in self._cells())
    notes = "".join(
        f"<tr><td colspan={len(self._HEADER)}>(!) "
        f"{html.escape(r.path or '<root>')}: {html.escape(r.note)}</td></tr>"
        for r in self.mismatches())
    return (f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody>"
            f"<tfoot><tr><td colspan={len(self._HEADER)}>total param bytes:"
            f" {self.total_param_bytes:,}</td></tr>{notes}</tfoot></table>")


@dataclasses.dataclass
class _Module:
  token: int
  cls: type
  policy: Any
  fp8: Any = None
  calls: int = 0
  call_ids: set[int] = dataclasses.field(default_factory=set)
  inputs: set[str] = dataclasses.field(default_factory=set)
  outputs: set[str] = dataclasses.field(default_factory=set)
  read: set[str] = dataclasses.field(default_factory=set)


class Recorder:
  """Collects module calls while a model is traced for a report.

  One recorder lives for one :func:`jax.make_jaxpr` trace; it is never
  module-level state.

  Example:
    >>> import jax, jax.numpy as jnp, jmp_lite
    >>> from jmp_lite.report import Recorder
    >>> rec = Recorder()
    >>> def model(x):
    ...   with rec.scope(("dense",), object, jmp_lite.get_policy("bf16")):
    ...     y = x.astype(jnp.bfloat16) @ x.astype(jnp.bfloat16)
    ...   return y
    >>> report = rec.report(jax.make_jaxpr(model)(jnp.ones((2, 2))), {})
    >>> report.rows[0].computed
    'bfloat16'
  """

  def __init__(self) -> None:
    self.modules: dict[Path, _Module] = {}
    self.prefix: Path = ()
    # Shared with nested recorders: calls open per module path, and the
    # next call id.
    self.open: dict[Path, int] = {}
    self.ids = itertools.count()

  def under(self, prefix: Path) -> Recorder:
    """This recorder, for a nested policy's modules at ``prefix``.

    The nested policy records its modules by their paths from its own root;
    they become rows of this report, at their paths from this one's.

    Args:
      prefix: the nested model's path from this recorder's root.

    Returns:
      A recorder writing into this one.
    """
    nested = Recorder()
    nested.modules = self.modules
    nested.prefix = self.prefix + tuple(prefix)
    nested.open, nested.ids = self.open, self.ids
    return nested

  def _module(self, path: Path, cls: type, policy: Any,
              fp8: Any = None) -> _Module:
    path = self.prefix + tuple(path)
    if path not in self.modules:
      self.modules[path] = _Module(len(self.modules), cls, policy, fp8)
    return self.modules[path]

  @contextlib.contextmanager
  def scope(self, path: Path, cls: type, policy: Any,
            fp8: Any = None) -> Iterator[None]:
    """Traces a module call's code under the module's own name scope.

    Args:
      path: the module path.
      cls: its class.
      policy: its resolved policy.
      fp8: its FP8 recipe, if its matmuls are meant to run in FP8.

    Yields:
      Nothing; trace the module's call inside.
    """
    module = self._module(path, cls, policy, fp8)
    full = self.prefix + tuple(path)
    outermost = not self.open.get(full)
    self.open[full] = self.open.get(full, 0) + 1
    try:
      with jax.named_scope(f"{_TOKEN}{module.token}"):
        if outermost:   # A module calling its own super() is one call.
          call_id = next(self.ids)
          module.call_ids.add(call_id)
          with jax.named_scope(f"{_CALL}{call_id}"):
            yield
        else:
          yield
    finally:
      self.open[full] -= 1

  def call(self, path: Path, cls: type, policy: Any, inputs: Any,
           outputs: Any, params_read: Any) -> None:
    """Records what crossed a module call's boundary.

    Args:
      path: the module path.
      cls: its class.
      policy: its resolved policy.
      inputs: its arguments after casting.
      outputs: its outputs after casting.
      params_read: its own params as it read them.
    """
    module = self._module(path, cls, policy)
    if not self.open.get(self.prefix + tuple(path)):   # Outermost only.
      module.calls += 1
    module.inputs.add(_float_dtypes(inputs))
    module.outputs.add(_float_dtypes(outputs))
    module.read.add(_float_dtypes(params_read))

  def report(self, closed_jaxpr: Any, stored: dict[Path, Any],
             total_param_bytes: int | None = None) -> DtypeReport:
    """Builds the report from the traced jaxpr.

    Args:
      closed_jaxpr: the jaxpr traced with the scopes of :meth:`scope`.
      stored: each module's own params as stored, by path.
      total_param_bytes: bytes of all params as stored; defaults to the sum
        over ``stored`` (each array counted once).

    Returns:
      The :class:`DtypeReport`.
    """
    ops = _matmul_dtypes_by_scope(closed_jaxpr)
    in_jaxpr = _call_ids(closed_jaxpr)
    rows = []
    for path, m in self.modules.items():
      # Calls whose code is in the computation; a module that traced no
      # equation at all has only the count of calls made.
      kept = m.call_ids & in_jaxpr
      calls = len(kept) if kept else m.calls
      traced = ops.get(m.token, set())
      computed = {name for name, _ in traced}
      computed_names = ",".join(sorted(computed)) or "-"
      expected = {np.dtype(m.policy.compute_dtype).name}
      if m.fp8 is not None:
        # FP4 recipes have one format (no bwd_dtype); PerDirection none.
        expected |= {np.dtype(d).name for d in (
            getattr(m.fp8, "fwd_dtype", None),
            getattr(m.fp8, "bwd_dtype", None)) if d is not None}
      # Float32 that the module's code asked for by name is not a mismatch.
      checked = {name for name, region in traced
                 if not (region and name == _F32_NAME)}
      note = ""
      if checked and not checked <= expected:
        note = (f"matmuls ran in {computed_names} but the policy says"
                f" {','.join(sorted(expected))}: this module's own code"
                " chooses the dtype (an astype, a hard-coded dtype or its own"
                " dot_general) and jmp_lite cannot change it; make it explicit"
                " with a rule or, for deliberate float32, a"
                " jmp_lite.float32_region(); or remove the cast")
      own = stored.get(path, {})
      rows.append(ReportRow(
          path="/".join(path), cls=m.cls.__name__, policy=str(m.policy),
          calls=calls, stored=_float_dtypes(own),
          read=_join(m.read), inputs=_join(m.inputs),
          outputs=_join(m.outputs), computed=computed_names,
          param_bytes=tree_bytes(own), note=note))
    if total_param_bytes is None:
      total_param_bytes = tree_bytes(list(stored.values()))
    return DtypeReport(tuple(rows), total_param_bytes)


def _join(names: set[str]) -> str:
  parts = sorted({p for n in names for p in n.split(",") if p != "-"})
  return ",".join(parts) if parts else "-"


def _call_ids(closed_jaxpr: Any) -> set[int]:
  """The module call ids in any equation's scope path (sub-jaxprs too)."""
  return {int(m.group(1)) for site in _jaxpr.walk(closed_jaxpr)
          for m in _CALL_RE.finditer(site.scope)}


def _matmul_dtypes_by_scope(closed_jaxpr: Any
                            ) -> dict[int, set[tuple[str, bool]]]:
  """Operand dtypes of every matmul/convolution, by innermost module token.

  Sub-jaxprs (``jit``, ``scan``, ``cond``, ``remat``, custom derivatives)
  included, each equation under its full scope path.

  Args:
    closed_jaxpr: a traced jaxpr.

  Returns:
    ``{token: {("bfloat16", in_region), ...}}``, ``in_region`` telling
    whether the op was traced in a :func:`jmp_lite.float32_region` inside
    that module's scope; ops outside any module scope are under ``-1``.

  Example:
    >>> import jax, jax.numpy as jnp, jmp_lite
    >>> from jmp_lite.report import _matmul_dtypes_by_scope
    >>> def f(x):
    ...   with jmp_lite.float32_region():
    ...     return x @ x
    >>> _matmul_dtypes_by_scope(jax.make_jaxpr(f)(jnp.ones((2, 2))))
    {-1: {('float32', True)}}
  """
  out: dict[int, set[tuple[str, bool]]] = {}
  for site in _jaxpr.walk(closed_jaxpr):
    if not _jaxpr.is_matmul(site.eqn):
      continue
    tokens = list(_TOKEN_RE.finditer(site.scope))
    token = int(tokens[-1].group(1)) if tokens else -1
    # Only a region inside the module's own scope is its own choice.
    inner = site.scope[tokens[-1].end():] if tokens else site.scope
    region = _FLOAT32_RE.search(inner) is not None
    names = {(name, region) for name in _jaxpr.operand_dtype_names(site.eqn)}
    out.setdefault(token, set()).update(names)
  return out
