"""Apply a precision policy to a ``flax.nnx`` model without editing it.

:func:`mixed_precision` returns a :class:`MixedPrecision` module that holds a
*copy* of the model (the original is left as it is) with exactly the model's
state layout: ``wrapped.encoder.kernel``, ``nnx.state(wrapped, nnx.Param)``,
``nnx.Optimizer(wrapped, tx, wrt=nnx.Param)`` and checkpoints look as they
would for the bare model. Every ``nnx.Param`` is stored in its module's param
dtype; other variables (``BatchStat``, caches, RNG counts) keep theirs.

Calling it — ``wrapped(x)``, or any method, ``wrapped.encode(x)`` — runs the
model's own code on a private copy made for that call, in which:

* every param is read in its module's compute dtype (the cast is traced, so
  ``nnx.grad`` gives gradients in the param dtype);
* Flax's own layers compute in their module's compute dtype whatever their
  ``dtype=`` says (a rule keeps a module in float32);
* every method call of every module casts its floating inputs to the
  module's compute dtype and its outputs to its output dtype (the rules of
  :mod:`jmp_lite.rules`; a carry keeps its dtype);
* nnx objects passed as arguments (``Rngs``, caches, modules) are the
  caller's own objects, never copies.

The policy governs calls of the wrapper: a submodule reached through it
and called on its own (``wrapped.encoder(x)``) runs as the bare module
would, in its stored dtypes. Call the model's own methods through the
wrapper instead (``wrapped.encode(x)``).

Afterwards the variables the call changed (batch statistics, RNG counts,
caches, ``sow``-n intermediates) are written back into the wrapped model in
their stored dtypes; nothing else is written, so a call that changes nothing
traces under plain ``jax.jit``/``jax.make_jaxpr``/``jax.eval_shape`` just as
the bare model does.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
from flax import nnx

from jmp_lite import _jaxpr
from jmp_lite import dtypes as _dtypes
from jmp_lite import report as _report
from jmp_lite import rules as _rules
from jmp_lite.policy import Policy
from jmp_lite.report import DtypeReport
from jmp_lite.rules import Rule

NORM_LAYERS: tuple[type, ...] = (nnx.LayerNorm, nnx.BatchNorm, nnx.RMSNorm,
                                 nnx.GroupNorm)
"""The nnx layers kept in float32 by default."""

_CONTAINERS: tuple[type, ...] = (nnx.List, nnx.Dict)
_CONFIG = "_jmp_lite"
_SLOT = "_jmp_lite_call"
_REPORT = "_jmp_lite_report"

Path = tuple[str, ...]

__all__ = ["MixedPrecision", "NORM_LAYERS", "Rule", "dtype_report",
           "mixed_precision"]


@dataclasses.dataclass(frozen=True)
class _Config:
  """Static configuration of a :class:`MixedPrecision` (in the graphdef)."""

  cls: type
  rule_set: _rules.RuleSet
  remat_norms: bool = False


@dataclasses.dataclass(eq=False)
class _CallState:
  """Mutable state of one call (never shared between calls)."""

  recorder: _report.Recorder | None
  root_depth: int = 0  # Nesting of root calls: only the outermost casts out.


@dataclasses.dataclass(frozen=True, eq=False)
class _Slot:
  """What one module of the per-call copy does at its boundary."""

  path: Path
  resolved: _rules.Resolved
  state: _CallState
  remat: bool = False  # Recompute this island in the backward pass.


def _path(path: Sequence[Any]) -> Path:
  return tuple(str(p) for p in path)


def _is_flax_layer(module: nnx.Module) -> bool:
  """Whether ``module`` is (a subclass of) one of Flax's own dtype'd layers."""
  return "dtype" in vars(module) and any(
      c.__module__.startswith("flax.nnx.") for c in type(module).__mro__
      if c is not nnx.Module and issubclass(c, nnx.Module))


def _copy(node: Any) -> Any:
  """A copy of an nnx graph whose variables are new objects (arrays shared)."""
  graphdef, state = nnx.split(node)
  return nnx.merge(graphdef, jax.tree.map(lambda x: x, state))


def _modules(root: nnx.Module) -> dict[Path, nnx.Module]:
  """Every module of ``root`` by path, except those inside nested policies."""
  found = {_path(path): node for path, node in nnx.iter_graph(root)
           if isinstance(node, nnx.Module)}
  nested = [p for p, m in found.items() if p and isinstance(m, MixedPrecision)]
  return {p: m for p, m in found.items()
          if not any(p[:len(n)] == n and len(p) > len(n) for n in nested)}


def _classes(modules: dict[Path, nnx.Module], cls: type) -> dict[Path, type]:
  return {p: (cls if not p else type(m)) for p, m in modules.items()}


def _owner(path: Path, modules: dict[Path, Any]) -> Path:
  """The deepest module path that is a prefix of a variable's ``path``."""
  for n in range(len(path) - 1, -1, -1):
    if path[:n] in modules:
      return path[:n]
  return ()


def _public_methods(cls: type) -> dict[str, Callable[..., Any]]:
  """``__call__`` and the public plain methods of ``cls`` (not nnx's own)."""
  out: dict[str, Callable[..., Any]] = {}
  for klass in reversed(cls.__mro__):
    if not issubclass(klass, nnx.Module) or klass.__module__.startswith(
        ("flax.nnx.module", "flax.nnx.pytreelib", "flax.nnx.object")):
      continue
    for name, value in vars(klass).items():
      if isinstance(value, types.FunctionType) and (
          name == "__call__" or not name.startswith("_")):
        out[name] = value
  return out


def _run_method(fn: Callable[..., Any], self: nnx.Module, args: tuple,
                kwargs: dict) -> Any:
  """Runs a module's method under the policy held in its slot."""
  slot: _Slot | None = vars(self).get(_SLOT)
  if slot is None:  # A module the user's code created during the call.
    return fn(self, *args, **kwargs)
  policy = slot.resolved.policy
  recorder = slot.state.recorder
  cls = type(self).__mro__[1]  # The class the per-call copy was made from.
  cast_args, cast_kwargs = _rules.cast_inputs((args, kwargs),
                                              policy.compute_dtype)
  output = slot.resolved.output
  if not slot.path:
    # The root's own methods calling each other stay in compute dtype.
    output = output if slot.state.root_depth == 0 else policy.compute_dtype
    slot.state.root_depth += 1
  run = fn
  if slot.remat:
    run = nnx.remat(lambda m, *a: fn(m, *a, **cast_kwargs))
    cast_kwargs = {}
  try:
    if recorder is None:
      out = run(self, *cast_args, **cast_kwargs)
    else:
      with recorder.scope(slot.path, cls, policy, slot.resolved.fp8):
        out = run(self, *cast_args, **cast_kwargs)
  finally:
    if not slot.path:
      slot.state.root_depth -= 1
  out = _rules.cast_outputs(out, output, args, carry=bool(slot.path))
  if recorder is not None:
    own = {k: v.get_value() for k, v in vars(self).items()
           if isinstance(v, nnx.Param)}
    recorder.call(slot.path, cls, policy, (cast_args, cast_kwargs), out, own)
  return out


@functools.cache
def _policy_class(cls: type) -> type:
  """A subclass of ``cls`` whose methods run under the module's slot.

  Only ever the class of the private per-call copy, never of a user's object.
  """

  def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def method(self: nnx.Module, *args: Any, **kwargs: Any) -> Any:
      return _run_method(fn, self, args, kwargs)

    return method

  namespace: dict[str, Any] = {
      name: wrap(name, fn) for name, fn in _public_methods(cls).items()}
  namespace["__module__"] = cls.__module__
  kwds = {}
  if hasattr(cls, "_pytree__is_pytree"):
    kwds["pytree"] = cls._pytree__is_pytree
  return types.new_class(f"{cls.__name__}UnderPolicy", (cls,), kwds,
                         lambda ns: ns.update(namespace))


class MixedPrecision(nnx.Module):
  """An ``nnx`` model under a precision policy; see :func:`mixed_precision`.

  It holds the model's attributes (submodules, variables, static fields)
  with the model's own state layout; calls and methods run the model's code
  under the policy. ``isinstance(wrapped, Model)`` is false: this is not the
  model's class, it runs it.
  """

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    """Calls the model's ``__call__`` under the policy."""
    return _run(self, "__call__", args, kwargs)

  def __getattr__(self, name: str) -> Any:
    config: _Config | None = vars(self).get(_CONFIG)
    if config is None or name.startswith("__"):
      raise AttributeError(name)
    attr = getattr(config.cls, name, _MISSING)
    if isinstance(attr, types.FunctionType):
      @functools.wraps(attr)
      def method(*args: Any, **kwargs: Any) -> Any:
        return _run(self, name, args, kwargs)

      return method
    if isinstance(attr, property):
      return attr.__get__(self)
    if attr is not _MISSING:
      return attr
    raise AttributeError(
        f"{config.cls.__name__} (under a jmp_lite policy) has no attribute"
        f" {name!r}")

  @property
  def wrapped_class(self) -> type:
    """The class of the model this runs."""
    return vars(self)[_CONFIG].cls

  @property
  def rule_set(self) -> _rules.RuleSet:
    """The default policy and the rules."""
    return vars(self)[_CONFIG].rule_set

  @property
  def policy(self) -> Policy:
    """The default policy."""
    return self.rule_set.default


_MISSING = object()


def _as_model(wrapped: MixedPrecision) -> nnx.Module:
  """A plain copy of the model inside ``wrapped`` (its own class again)."""
  model = _copy(wrapped)
  object.__setattr__(model, "__class__", wrapped.wrapped_class)
  vars(model).pop(_CONFIG, None)
  return model


def _run(self: MixedPrecision, method: str, args: tuple, kwargs: dict,
         recorder: _report.Recorder | None = None) -> Any:
  """Runs ``method`` of the model held by ``self`` under its policy."""
  if recorder is None:
    # A nested policy inside a model a report traces records there too.
    recorder = vars(self).get(_REPORT)
  config: _Config = vars(self)[_CONFIG]
  graphdef, state = nnx.split(self)
  flat = list(nnx.to_flat_state(state))
  # Copy every variable, so the call's own mutations stay in the copy until
  # they are written back (nnx's split/merge would share variable objects).
  copies = {p: jax.tree.map(lambda x: x, v) for p, v in flat}
  tmp = nnx.merge(graphdef, nnx.from_flat_state(list(copies.items())))
  object.__setattr__(tmp, "__class__", config.cls)
  modules = _modules(tmp)
  resolved = config.rule_set.resolve(_classes(modules, config.cls))

  given = {}
  for path, var in copies.items():
    owner = _owner(_path(path), modules)
    value = var.get_value()
    if (isinstance(var, nnx.Param) and _dtypes.is_floating_array(value)
        and not _under_nested(_path(path), modules)):
      dtype = resolved[owner].policy.compute_dtype
      if value.dtype != dtype:
        value = value.astype(dtype)
        var.set_value(value)
    given[path] = value

  state = _CallState(recorder)
  for path, module in modules.items():
    if path and isinstance(module, MixedPrecision) and recorder is not None:
      object.__setattr__(module, _REPORT, recorder.under(path))
    if isinstance(module, (MixedPrecision,) + _CONTAINERS):
      continue
    if _is_flax_layer(module):
      object.__setattr__(module, "dtype", resolved[path].policy.compute_dtype)
    remat = config.remat_norms and config.rule_set.is_island(
        resolved[path].rule)
    object.__setattr__(module, _SLOT, _Slot(path, resolved[path], state,
                                             remat))
    object.__setattr__(module, "__class__", _policy_class(type(module)))

  out = getattr(tmp, method)(*args, **kwargs)
  if recorder is None:
    _write_back(self, tmp, given, dict(flat))
  return out


def _under_nested(path: Path, modules: dict[Path, nnx.Module]) -> bool:
  return any(path[:len(p)] == p and len(path) > len(p)
             and isinstance(m, MixedPrecision) for p, m in modules.items()
             if p)


def _unchanged(new: Any, old: Any) -> bool:
  """Whether the call left a variable's value as it was given (leaf by leaf).

  Variables may hold pytrees (delayed FP8 scaling states), which nnx rebuilds
  around the very same arrays.
  """
  if new is old:
    return True
  new_leaves, new_def = jax.tree.flatten(new)
  old_leaves, old_def = jax.tree.flatten(old)
  return new_def == old_def and all(
      a is b for a, b in zip(new_leaves, old_leaves, strict=True))


def _write_back(self: MixedPrecision, tmp: nnx.Module, given: dict,
                stored: dict) -> None:
  """Writes the variables the call changed back, in their stored dtypes."""
  changed = []
  for path, var in nnx.to_flat_state(nnx.state(tmp)):
    value = var.get_value()
    if path in given and _unchanged(value, given[path]):
      continue
    old = stored.get(path)
    if old is not None:
      old_value = old.get_value()
      if (_dtypes.is_floating_array(value)
          and _dtypes.is_floating_array(old_value)
          and value.dtype != old_value.dtype):
        var = jax.tree.map(lambda x, d=old_value.dtype: x.astype(d), var)
    changed.append((path, var))
  if changed:
    nnx.update(self, nnx.from_flat_state(changed))


def mixed_precision(
    model: nnx.Module,
    policy: Policy | str,
    *,
    rules: Sequence[Any] = (),
    float32_norms: bool = True,
    strict: bool = False,
    enabled: bool = True,
    remat_norms: bool = False,
) -> MixedPrecision:
  """Returns an ``nnx`` model that runs under a precision policy.

  Args:
    model: any ``flax.nnx.Module``; it is not modified. Its layers' own
      ``dtype=`` attributes are overridden by the policy.
    policy: the default :class:`~jmp_lite.Policy` or policy string.
    rules: ``(matcher, policy)`` pairs or :class:`~jmp_lite.rules.Rule`\\ s,
      with ``nnx.Module`` classes or path patterns; first match wins,
      children inherit. A rule's policy may be an FP8 recipe: the matched
      ``Linear``/``LinearGeneral`` layers (and those inside matched modules,
      such as attention's projections) get an FP8 ``dot_general`` (delayed
      scaling: a :class:`jmp_lite.fp8.nnx.Fp8DotGeneral` holding its state).
    float32_norms: keep LayerNorm, BatchNorm, RMSNorm and GroupNorm in
      float32 (after your rules), returning the model's compute dtype.
    strict: raise if one of your rules matches no module.
    enabled: ``False`` makes everything float32.
    remat_norms: recompute the float32 normalisation islands in the
      backward pass (``nnx.remat``) instead of saving their float32
      intermediates (about half of float32's residuals, as in
      :func:`jmp_lite.linen.mixed_precision`).

  Returns:
    A :class:`MixedPrecision` module with the model's state layout. Passing
    one in replaces its policy.

  Raises:
    TypeError: for a model that is not an nnx module, or a bad rule or
      policy.
    ValueError: for a bad policy string or path regex; with ``strict``, for a
      rule matching nothing.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import jmp_lite.nnx
    >>> layer = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    >>> half = jmp_lite.nnx.mixed_precision(layer, "p=bf16,c=bf16,o=f32")
    >>> half.kernel[...].dtype, half(jnp.ones((1, 3))).dtype
    (dtype(bfloat16), dtype('float32'))
    >>> layer.kernel[...].dtype  # The original is untouched.
    dtype('float32')
  """
  if isinstance(model, MixedPrecision):
    model = _as_model(model)
  elif isinstance(model, nnx.Module):
    model = _copy(model)
  else:
    raise TypeError(
        f"mixed_precision expects a flax.nnx.Module instance, got"
        f" {type(model).__name__}: {model!r}")
  rule_set = _rules.rule_set(policy, rules, (nnx.Module,), "flax.nnx",
                             norm_layers=NORM_LAYERS,
                             float32_norms=float32_norms, strict=strict,
                             enabled=enabled)
  modules = _modules(model)
  classes = _classes(modules, type(model))
  rule_set.check_strict(classes)
  resolved = rule_set.resolve(classes)
  for path, var in nnx.to_flat_state(nnx.state(model)):
    value = var.get_value()
    if (isinstance(var, nnx.Param) and _dtypes.is_floating_array(value)
        and not _under_nested(_path(path), modules)):
      dtype = resolved[_owner(_path(path), modules)].policy.param_dtype
      if value.dtype != dtype:
        var.set_value(value.astype(dtype))
  _install_fp8(modules, resolved)
  if not isinstance(remat_norms, bool):
    raise TypeError(f"remat_norms must be a bool, got {remat_norms!r}")
  config = _Config(type(model), rule_set, remat_norms)
  wrapped = object.__new__(MixedPrecision)
  wrapped.__setstate__(dict(vars(model)))
  object.__setattr__(wrapped, _CONFIG, config)
  return wrapped


def _install_fp8(modules: dict[Path, nnx.Module],
                 resolved: dict[Path, _rules.Resolved]) -> None:
  """Gives the FP8-ruled linear layers of the (copied) model FP8 matmuls.

  Done once, when the policy is applied, so that delayed scaling's state
  (a :class:`jmp_lite.fp8.nnx.ScalingStat` in the layer's new
  ``dot_general`` submodule) lives in the model from then on.
  """
  ruled = [(p, m) for p, m in modules.items() if resolved[p].fp8 is not None
           and "dot_general" in vars(m) and _is_flax_layer(m)]
  if not ruled:
    return
  from jmp_lite.fp8 import nnx as fp8_nnx  # On demand: FP8 rules only.
  for path, module in ruled:
    dot = fp8_nnx.dot_general_for(resolved[path].fp8)
    # A Flax linear layer, which has a dot_general attribute (checked above).
    layer = cast(Any, module)
    # A module (delayed scaling's state) must become a data attribute.
    layer.dot_general = nnx.data(dot) if isinstance(dot, nnx.Module) else dot


def dtype_report(model: MixedPrecision, *args: Any, method: str = "__call__",
                 **kwargs: Any) -> DtypeReport:
  """Traces ``model`` once (abstractly) and reports what every module computed.

  The same report as :func:`jmp_lite.linen.dtype_report`: per module, the
  dtypes its matmuls and convolutions ran in (read from the traced jaxpr),
  its params as stored and as read, its inputs and outputs, and a flag where
  the computation disagrees with the policy. Nothing is written back to
  ``model``.

  Args:
    model: a :class:`MixedPrecision` model.
    *args: example inputs.
    method: the method to trace.
    **kwargs: more inputs.

  Returns:
    A :class:`~jmp_lite.report.DtypeReport`.

  Raises:
    TypeError: if ``model`` is not a :class:`MixedPrecision`.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import jmp_lite.nnx
    >>> half = jmp_lite.nnx.mixed_precision(
    ...     nnx.Linear(3, 2, dtype=jnp.float32, rngs=nnx.Rngs(0)), "c=bf16")
    >>> row = jmp_lite.nnx.dtype_report(half, jnp.ones((1, 3))).rows[0]
    >>> row.stored, row.read, row.computed
    ('float32', 'bfloat16', 'bfloat16')
  """
  if not isinstance(model, MixedPrecision):
    raise TypeError(
        "dtype_report expects a jmp_lite.nnx.MixedPrecision (from"
        f" mixed_precision(...)), got {type(model).__name__}")
  recorder = _report.Recorder()
  # Arrays are traced; nnx arguments (Rngs) are rebuilt from their arrays
  # inside the trace, so the report changes nothing the caller holds.
  arrays, rebuild = _jaxpr.split_array_args((args, kwargs))

  def f(*xs: Any) -> Any:
    a, k = rebuild(xs)
    return _run(model, method, a, k, recorder)

  jaxpr = jax.make_jaxpr(f)(*arrays)
  # Every module, nested policies' included: they have rows too.
  modules = {_path(p): m for p, m in nnx.iter_graph(model)
             if isinstance(m, nnx.Module)}
  stored: dict[Path, dict[Any, Any]] = {}
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    stored.setdefault(_owner(_path(path), modules), {})[path[-1]] = \
        var.get_value()
  return recorder.report(jaxpr, stored)
