"""Apply a precision policy to an Equinox model without editing it.

:func:`mixed_precision` returns a :class:`MixedPrecision` ``eqx.Module`` that
holds the model (its floating arrays stored in each module's param dtype) and
is called with the model's own signature. Each call runs the model's code on
a copy made for that call, in which

* every module's own floating arrays are read in its compute dtype (the cast
  is traced, so ``eqx.filter_grad`` gives gradients in the stored dtype);
* every submodule is a *boundary*: calling it (or any of its methods) casts
  its floating inputs to its compute dtype and its outputs to its output
  dtype (the rules of :mod:`jmp_lite.rules`; a carry keeps its dtype);
  attribute reads go through to the submodule, and ``isinstance`` sees the
  submodule's own class (``eqx.nn.Sequential`` finds its stateful layers,
  a model's ``isinstance(layer, eqx.nn.Dropout)`` takes the same branch);
* a recurrent cell's hidden state keeps the dtype it came in with, as a
  ``lax.scan`` carry must: Equinox's ``GRUCell``/``LSTMCell``, and any
  module called as ``cell(x, ..., hidden)`` whose output is shaped like its
  last argument (and not like its first: ``attention(x, x, x)`` is no
  cell) and that no rule of its own matches (a rule's ``o=`` wins); a cell
  of your own whose input and hidden share a shape needs a rule with ``o=``
  the carry's dtype;
* ``eqx.nn.State`` arguments (batch statistics) pass through uncast.

Rules select modules by class (``(eqx.nn.LayerNorm, "f32")``) or by path
(``"layers/0"``, ``re.fullmatch`` on the ``/``-joined field path); by default
normalisation layers are float32 islands. Everything is a pytree: the wrapper
works under ``eqx.filter_jit``, ``eqx.filter_grad``, ``eqx.filter_vmap`` and
inside plain ``jax.jit``, and ``eqx.apply_updates`` updates the wrapped model
in place of the bare one.

Equinox is an optional dependency: ``pip install "jmp-lite[equinox]"``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, cast

import equinox as eqx
import jax

from jmp_lite import dtypes as _dtypes
from jmp_lite import report as _report
from jmp_lite import rules as _rules
from jmp_lite.diagnostics import tree_bytes
from jmp_lite.policy import Policy
from jmp_lite.report import DtypeReport
from jmp_lite.rules import Rule

NORM_LAYERS: tuple[type, ...] = (eqx.nn.LayerNorm, eqx.nn.GroupNorm,
                                 eqx.nn.RMSNorm, eqx.nn.BatchNorm)
"""The Equinox layers kept in float32 by default."""

Path = tuple[str, ...]

__all__ = ["MixedPrecision", "NORM_LAYERS", "Rule", "dtype_report",
           "mixed_precision"]


def _key_name(key: Any) -> str:
  for attr in ("name", "key", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _children(node: eqx.Module) -> tuple[list[tuple[str, Any]], Any]:
  """One level of ``node``: its leaves and direct submodules, by name."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(
      node, is_leaf=lambda x: x is not node and (
          isinstance(x, eqx.Module) or _dtypes.is_live_state(x)))
  return [("/".join(_key_name(k) for k in path), leaf)
          for path, leaf in flat], treedef


def _modules(root: eqx.Module) -> dict[Path, eqx.Module]:
  """Every module of ``root`` by path (``()`` is the root)."""
  out: dict[Path, eqx.Module] = {}

  def walk(node: eqx.Module, path: Path) -> None:
    out[path] = node
    if isinstance(node, MixedPrecision) and path:
      return  # A nested policy resolves its own modules.
    for name, child in _children(node)[0]:
      if isinstance(child, eqx.Module) and not isinstance(
          child, eqx.nn.StateIndex):
        walk(child, path + tuple(name.split("/")))

  walk(root, ())
  return out


def _is_layer(node: Any) -> bool:
  """Whether ``node`` is a module that is called (not a data container)."""
  return isinstance(node, eqx.Module) and callable(node)


def _rebuild(node: eqx.Module, path: Path,
             leaf_fn: Callable[[Path, Any], Any],
             module_fn: Callable[[Path, eqx.Module], Any]) -> Any:
  """``node`` with its own leaves mapped and its submodules replaced.

  ``eqx.nn.StateIndex`` (a key into ``eqx.nn.State``) is kept as it is.
  """
  children, treedef = _children(node)
  new = []
  for name, child in children:
    child_path = path + tuple(name.split("/"))
    if isinstance(child, eqx.nn.StateIndex) or _dtypes.is_live_state(child):
      new.append(child)
    elif isinstance(child, eqx.Module):
      new.append(module_fn(child_path, child))
    else:
      new.append(leaf_fn(path, child))
  return jax.tree.unflatten(treedef, new)


def _cast_leaf(dtype: Any) -> Callable[[Any], Any]:
  def cast(x: Any) -> Any:
    if _dtypes.is_floating_array(x) and x.dtype != dtype:
      return x.astype(dtype)
    return x

  return cast


@dataclasses.dataclass(eq=False)
class _CallState:
  """Mutable state of one call (never shared between calls)."""

  recorder: _report.Recorder | None
  root_depth: int = 0


@dataclasses.dataclass(frozen=True, eq=False)
class _Slot:
  """What one module does at its boundary during one call."""

  path: Path
  cls: type
  resolved: _rules.Resolved
  state: _CallState


# Equinox's cells take ``(input, hidden)`` and return the new hidden state.
_CELLS: tuple[type, ...] = (eqx.nn.GRUCell, eqx.nn.LSTMCell)


def _hidden(cls: type, out: Any, args: tuple, kwargs: dict) -> Any:
  """The argument whose dtypes ``out`` keeps, for a cell; else ``None``."""
  if issubclass(cls, _CELLS):
    hidden = args[1] if len(args) > 1 else kwargs.get("hidden")
  elif len(args) > 1 and not _rules.same_shapes(out, args[0]):
    hidden = args[-1]
  else:
    return None
  return hidden if _rules.same_shapes(out, hidden) else None


def _boundary_call(slot: _Slot, fn: Callable[..., Any], args: tuple,
                   kwargs: dict, own: Any) -> Any:
  policy = slot.resolved.policy
  recorder = slot.state.recorder
  cast_args, cast_kwargs = _rules.cast_inputs((args, kwargs),
                                              policy.compute_dtype)
  output = slot.resolved.output
  if not slot.path:
    output = output if slot.state.root_depth == 0 else policy.compute_dtype
    slot.state.root_depth += 1
  try:
    if recorder is None:
      out = fn(*cast_args, **cast_kwargs)
    else:
      with recorder.scope(slot.path, slot.cls, policy):
        out = fn(*cast_args, **cast_kwargs)
  finally:
    if not slot.path:
      slot.state.root_depth -= 1
  # A rule's own output dtype wins over the cell check (see _hidden).
  hidden = (_hidden(slot.cls, out, args, kwargs)
            if slot.path and slot.resolved.rule is None else None)
  if hidden is not None:
    out = _rules.keep_dtypes(out, hidden)
  else:
    out = _rules.cast_outputs(out, output, args, carry=bool(slot.path))
  if recorder is not None:
    recorder.call(slot.path, slot.cls, policy, (cast_args, cast_kwargs), out,
                  own)
  return out


class _ReadThrough(eqx.Module):
  """Stands in for a module during a call; ``isinstance`` sees its class.

  Model code dispatches on layer types (``eqx.nn.Sequential`` checks
  ``isinstance(layer, StatefulLayer)``), so the stand-in reports the
  module's class as its ``__class__``, as object proxies do; ``type()``
  still names the stand-in.
  """

  inner: eqx.Module

  @property
  def __class__(self) -> type:  # pyright: ignore[reportIncompatibleMethodOverride]
    return type(self.inner)

  def __getattr__(self, name: str) -> Any:
    inner = self.__dict__.get("inner")
    if inner is None or name.startswith("__"):
      raise AttributeError(name)
    return getattr(inner, name)

  # Containers (``eqx.nn.Sequential``) are indexed and iterated by model
  # code; the items are the stand-ins of their layers.
  def __getitem__(self, index: Any) -> Any:
    return self.inner[index]  # pyright: ignore[reportIndexIssue]

  def __iter__(self) -> Any:
    return iter(self.inner)  # pyright: ignore[reportCallIssue,reportArgumentType]

  def __len__(self) -> int:
    return len(self.inner)  # pyright: ignore[reportArgumentType]

  def __bool__(self) -> bool:
    return True  # A module, not an empty container.

  def __reduce_ex__(self, protocol: Any) -> Any:
    # Pickled inside a call, a layer is the layer as its code reads it.
    return self.inner.__reduce_ex__(protocol)


class _Boundary(_ReadThrough):
  """A submodule of the per-call copy: casts at its calls, reads through."""

  slot: _Slot = eqx.field(static=True)

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    # A layer: only callable modules get a boundary (see _is_layer).
    layer = cast(Callable[..., Any], self.inner)
    return _boundary_call(self.slot, layer, args, kwargs,
                          _own_arrays(self.inner))

  def __getattr__(self, name: str) -> Any:
    attr = super().__getattr__(name)
    inner = self.__dict__["inner"]
    fields = {f.name for f in dataclasses.fields(inner)}
    if name not in fields and callable(attr):
      # A method (Equinox binds methods as modules themselves).
      slot = self.__dict__["slot"]
      return lambda *a, **k: _boundary_call(slot, attr, a, k,
                                            _own_arrays(inner))
    return attr


class _NestedRun(_ReadThrough):
  """A nested :class:`MixedPrecision` during a reported call.

  It runs under its own policy and records its modules under its path.
  """

  recorder: _report.Recorder = eqx.field(static=True)

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    return cast(MixedPrecision, self.inner)._run(None, args, kwargs,
                                                 self.recorder)

  def method(self, name: str) -> Callable[..., Any]:
    cast(MixedPrecision, self.inner).method(name)  # Checks the name.
    return lambda *a, **k: cast(MixedPrecision, self.inner)._run(
        name, a, k, self.recorder)


def _own_arrays(node: eqx.Module) -> dict[str, Any]:
  return {name: leaf for name, leaf in _children(node)[0]
          if _dtypes.is_floating_array(leaf)}


class MixedPrecision(eqx.Module):
  """An Equinox model under a precision policy; see :func:`mixed_precision`.

  Attributes:
    module: the model, its floating arrays in their param dtypes.
    rule_set: the default policy and the rules (static).
  """

  module: eqx.Module
  rule_set: _rules.RuleSet = eqx.field(static=True)

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    """Calls the model under the policy, with the model's own signature."""
    return self._run(None, args, kwargs)

  @property
  def policy(self) -> Policy:
    """The default policy."""
    return self.rule_set.default

  def method(self, name: str) -> Callable[..., Any]:
    """The model's method ``name``, run under the policy.

    Args:
      name: the method's name.

    Returns:
      A function with the method's signature.

    Raises:
      AttributeError: if the model has no such method.
    """
    if not callable(getattr(self.module, name, None)):
      raise AttributeError(
          f"{type(self.module).__name__} has no method {name!r}")
    return lambda *a, **k: self._run(name, a, k)

  def _run(self, method: str | None, args: tuple, kwargs: dict,
           recorder: _report.Recorder | None = None) -> Any:
    modules = _modules(self.module)
    resolved = self.rule_set.resolve({p: type(m) for p, m in modules.items()})
    state = _CallState(recorder)

    def convert(path: Path, node: eqx.Module) -> Any:
      if isinstance(node, MixedPrecision):
        # A nested policy casts its own model (and reports under its path).
        return node if recorder is None else _NestedRun(
            node, recorder.under(path))
      res = resolved[path]
      body = _rebuild(node, path,
                      lambda _, x: _cast_leaf(res.policy.compute_dtype)(x),
                      convert)
      if not _is_layer(node):
        return body  # Data, not a layer: nothing is called on it.
      return _Boundary(body, _Slot(path, type(node), res, state))

    root = convert((), self.module)
    fn = root if method is None else getattr(root, method)
    return fn(*args, **kwargs)


def mixed_precision(
    model: eqx.Module,
    policy: Policy | str,
    *,
    rules: Sequence[Any] = (),
    float32_norms: bool = True,
    strict: bool = False,
    enabled: bool = True,
) -> MixedPrecision:
  """Puts an Equinox model under a precision policy.

  Args:
    model: any ``eqx.Module``; it is not modified (Equinox modules are
      immutable: a new one is returned).
    policy: the default :class:`~jmp_lite.Policy` or policy string.
    rules: ``(matcher, policy)`` pairs or :class:`~jmp_lite.rules.Rule`\\ s,
      with ``eqx.Module`` classes or field-path patterns (``"layers/0"``);
      first match wins, children inherit.
    float32_norms: keep LayerNorm, GroupNorm, RMSNorm and BatchNorm in
      float32 (after your rules), returning the model's compute dtype.
    strict: raise if one of your rules matches no module.
    enabled: ``False`` makes everything float32.

  Returns:
    A :class:`MixedPrecision` module. Passing one in replaces its policy.

  Raises:
    TypeError: for a model that is not an ``eqx.Module``, or a bad rule or
      policy.
    ValueError: for a bad policy string or regex; with ``strict``, for a rule
      matching nothing.

  Example:
    >>> import jax, jax.numpy as jnp, equinox as eqx
    >>> import jmp_lite.equinox
    >>> mlp = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0))
    >>> half = jmp_lite.equinox.mixed_precision(mlp, "p=bf16,c=bf16,o=f32")
    >>> half.module.layers[0].weight.dtype, half(jnp.ones(3)).dtype
    (dtype(bfloat16), dtype('float32'))
  """
  if isinstance(model, MixedPrecision):
    model = model.module
  if not isinstance(model, eqx.Module):
    raise TypeError(
        f"mixed_precision expects an equinox.Module instance, got"
        f" {type(model).__name__}: {model!r}")
  rule_set = _rules.rule_set(policy, rules, (eqx.Module,), "equinox",
                             norm_layers=NORM_LAYERS,
                             float32_norms=float32_norms, strict=strict,
                             enabled=enabled, fp8=False)
  modules = _modules(model)
  classes = {p: type(m) for p, m in modules.items()}
  rule_set.check_strict(classes)
  resolved = rule_set.resolve(classes)

  def store(path: Path, node: eqx.Module) -> Any:
    if isinstance(node, MixedPrecision) and path:
      return node
    dtype = resolved[path].policy.param_dtype
    return _rebuild(node, path, lambda _, x: _cast_leaf(dtype)(x), store)

  return MixedPrecision(store((), model), rule_set)


def dtype_report(model: MixedPrecision, *args: Any, method: str | None = None,
                 **kwargs: Any) -> DtypeReport:
  """Traces ``model`` once (abstractly) and reports what every module computed.

  The same report as :func:`jmp_lite.linen.dtype_report`: per module, the
  dtypes its matmuls and convolutions ran in (read from the traced jaxpr),
  its arrays as stored and as read, its inputs and outputs, and a flag where
  the computation disagrees with the policy.

  Args:
    model: a :class:`MixedPrecision` model.
    *args: example inputs.
    method: a method of the model to trace instead of ``__call__``.
    **kwargs: more inputs.

  Returns:
    A :class:`~jmp_lite.report.DtypeReport`.

  Raises:
    TypeError: if ``model`` is not a :class:`MixedPrecision`.

  Example:
    >>> import jax, jax.numpy as jnp, equinox as eqx
    >>> import jmp_lite.equinox
    >>> half = jmp_lite.equinox.mixed_precision(
    ...     eqx.nn.Linear(3, 2, key=jax.random.key(0)), "c=bf16")
    >>> row = jmp_lite.equinox.dtype_report(half, jnp.ones(3)).rows[0]
    >>> row.stored, row.read, row.computed
    ('float32', 'bfloat16', 'bfloat16')
  """
  if not isinstance(model, MixedPrecision):
    raise TypeError(
        "dtype_report expects a jmp_lite.equinox.MixedPrecision (from"
        f" mixed_precision(...)), got {type(model).__name__}")
  recorder = _report.Recorder()
  dynamic, static = eqx.partition((model, args, kwargs), eqx.is_array)

  def f(dyn: Any) -> Any:
    m, a, k = eqx.combine(dyn, static)
    return m._run(method, a, k, recorder)

  jaxpr = jax.make_jaxpr(f)(dynamic)
  stored: dict[Path, Any] = {}

  def collect(m: MixedPrecision, prefix: Path) -> None:
    for path, node in _modules(m.module).items():
      if isinstance(node, MixedPrecision) and path:
        collect(node, prefix + path)
      elif own := _own_arrays(node):
        stored[prefix + path] = own

  collect(model, ())
  # Floating arrays only, as in each row: a PRNG key or an integer table
  # held by a module is no param.
  return recorder.report(jaxpr, stored, tree_bytes(
      [x for x in jax.tree.leaves(model.module)
       if _dtypes.is_floating_array(x)]))
