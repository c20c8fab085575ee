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

A submodule reached through the wrapper and called on its own
(``wrapped.encoder(x)``, ``wrapped.blocks[0](x)``, also inside ``nnx.jit``
or on an ``nnx.view`` of the wrapper) runs under the policy it has inside
the model, with the same per-call copy, casts and write-back, and returns
its outputs in that policy's output dtype, as the wrapper does. Only calls
are guarded: a submodule's other methods (``wrapped.encoder.encode(x)``,
``init_cache``, setters, ``set_view``) run on the stored module without the
policy's casts (their own matmuls in stored dtypes; the submodules they
*call* are guarded calls). Call a model's own methods through the wrapper
(``wrapped.encode(x)``). The stored submodules are instances of a subclass
of their own class, ``<Name>UnderPolicy`` (``isinstance`` holds; pickle
finds it by name), and :func:`mixed_precision` of the wrapper, or of a model
holding such a submodule, gives them their own classes back. Guards are
set when the policy is applied: after model surgery (a module added, moved,
or taken from another wrapper) a direct call of it follows the place and
policy it had then, or runs bare, until the model is wrapped again.

Afterwards the variables the call changed (batch statistics, RNG counts,
caches, ``sow``-n intermediates) are written back into the wrapped model in
their stored dtypes; nothing else is written, so a call that changes nothing
traces under plain ``jax.jit``/``jax.make_jaxpr``/``jax.eval_shape`` just as
the bare model does.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import types
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
from flax import nnx

from jmp_lite import _jaxpr
from jmp_lite import dtypes as _dtypes
from jmp_lite import report as _report
from jmp_lite import rules as _rules
from jmp_lite._nnx_paths import same_leaves, set_at_path
from jmp_lite.policy import Policy
from jmp_lite.report import DtypeReport
from jmp_lite.rules import Rule

NORM_LAYERS: tuple[type, ...] = (nnx.LayerNorm, nnx.BatchNorm, nnx.RMSNorm,
                                 nnx.GroupNorm)
"""The nnx layers kept in float32 by default."""

_CONTAINERS: tuple[type, ...] = (nnx.List, nnx.Dict)
_CONFIG = "_jmp_lite"
_SLOT = "_jmp_lite_call"
_GUARD = "_jmp_lite_guard"
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


@dataclasses.dataclass(frozen=True)
class _Guard:
  """Where a stored submodule sits under its wrapper (static: in the graphdef).

  ``ancestors`` are the ``(path, class)`` of the modules above it, the root
  first as its model's class: rules are resolved on the full path and
  inherited from ancestors, so a direct call resolves exactly as a call
  from inside the model.
  """

  config: _Config
  path: Path
  ancestors: tuple[tuple[Path, type], ...]


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
  # The module the call entered through (the model, or a submodule called
  # directly): its output leaves in the policy's output dtype.
  root: bool = False


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
  return {p: (cls if not p else _own_class(type(m)))
          for p, m in modules.items()}


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
  cls = _own_class(type(self).__mro__[1])  # The class it was made from.
  cast_args, cast_kwargs = _rules.cast_inputs((args, kwargs),
                                              policy.compute_dtype)
  output = slot.resolved.output
  if slot.root:
    # The root's own methods calling each other stay in compute dtype. A
    # submodule called directly returns its policy's output dtype, as the
    # model does (inside the model it returns its compute dtype).
    top = output if not slot.path else policy.output_dtype
    output = top if slot.state.root_depth == 0 else policy.compute_dtype
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
    if slot.root:
      slot.state.root_depth -= 1
  out = _rules.cast_outputs(out, output, args, carry=not slot.root)
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
      # Looked up per call, not kept: a method patched on ``cls`` since
      # (``nnx.tabulate`` patches every module class's methods) runs.
      return _run_method(getattr(cls, name), self, args, kwargs)

    return method

  namespace: dict[str, Any] = {
      name: wrap(name, fn) for name, fn in _public_methods(cls).items()}
  namespace["__module__"] = cls.__module__
  kwds = {}
  if hasattr(cls, "_pytree__is_pytree"):
    kwds["pytree"] = cls._pytree__is_pytree
  return types.new_class(f"{_own_class(cls).__name__}UnderPolicy", (cls,),
                         kwds, lambda ns: ns.update(namespace))


_GUARDED_FROM = "_jmp_lite_guarded_from"


def _own_class(cls: type) -> type:
  """The user's class of a stored submodule (its guard class's base)."""
  return vars(cls).get(_GUARDED_FROM, cls)


def _callable_class(cls: type) -> bool:
  return any("__call__" in vars(k) for k in cls.__mro__ if k is not object)


def _guard_name(cls: type) -> str:
  # One attribute name of _guarded per class, without dots (pickle
  # splits a qualname at them).
  return f"{cls.__module__}:{cls.__qualname__}".replace(".", "/")


class _GuardClasses:
  """Where pickle finds a guard class, by name (``jmp_lite.nnx._guarded.*``).

  Stored submodules are instances of a class made at run time; a graphdef
  or a pickled model names it as ``_guarded.<module>:<qualname of the
  user's class>``, and loading it imports the user's class and makes the
  guard class again.
  """

  def __getattr__(self, name: str) -> type:
    module, sep, qualname = name.replace("/", ".").partition(":")
    if not sep or "<locals>" in qualname:  # Dunder lookups have no ":".
      raise AttributeError(name)
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
      obj = getattr(obj, part)
    return _guard_class(obj)


_guarded = _GuardClasses()


@functools.cache
def _guard_class(cls: type) -> type:
  """A subclass of ``cls`` whose ``__call__`` runs under the stored guard.

  The class of a stored submodule of a :class:`MixedPrecision`, named
  ``<cls name>UnderPolicy``, found by pickle as ``_guarded.<cls path>``.
  """

  @functools.wraps(cls.__call__)  # Its signature (jit's static_argnames).
  def __call__(self: nnx.Module, *args: Any, **kwargs: Any) -> Any:
    guard: _Guard | None = vars(self).get(_GUARD)
    if guard is None or _SLOT in vars(self):
      return cls.__call__(self, *args, **kwargs)
    return _run_node(self, cls, guard.config, guard.path, guard.ancestors,
                     "__call__", args, kwargs)

  namespace: dict[str, Any] = {
      "__call__": __call__, "__module__": __name__,
      "__qualname__": "_guarded." + _guard_name(cls), _GUARDED_FROM: cls}
  kwds = {}
  if hasattr(cls, "_pytree__is_pytree"):
    kwds["pytree"] = cls._pytree__is_pytree
  # Not the user's own name: an __init_subclass__ registry keyed by name
  # would map it to this class.
  return types.new_class(f"{cls.__name__}UnderPolicy", (cls,), kwds,
                         lambda ns: ns.update(namespace))


def _guard(root: nnx.Module, config: _Config) -> None:
  """Makes every callable stored submodule of ``root`` run under ``config``."""
  modules = _modules(root)
  for path, module in modules.items():
    if (not path or isinstance(module, (MixedPrecision,) + _CONTAINERS)
        or not _callable_class(type(module))):
      continue
    ancestors = tuple(
        (path[:n], config.cls if not n else _own_class(type(modules[path[:n]])))
        for n in range(len(path)) if path[:n] in modules)
    object.__setattr__(module, _GUARD, _Guard(config, path, ancestors))
    object.__setattr__(module, "__class__",
                       _guard_class(_own_class(type(module))))


def _unguard(root: nnx.Module) -> None:
  """Gives ``root`` and its stored submodules their own classes back."""
  for module in _modules(root).values():
    if _GUARD in vars(module):
      vars(module).pop(_GUARD)
      object.__setattr__(module, "__class__", _own_class(type(module)))


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
  _unguard(model)
  return model


def _run(self: MixedPrecision, method: str, args: tuple, kwargs: dict,
         recorder: _report.Recorder | None = None) -> Any:
  """Runs ``method`` of the model held by ``self`` under its policy."""
  if recorder is None:
    # A nested policy inside a model a report traces records there too.
    recorder = vars(self).get(_REPORT)
  config: _Config = vars(self)[_CONFIG]
  return _run_node(self, config.cls, config, (), (), method, args, kwargs,
                   recorder)


def _run_node(node: nnx.Module, cls: type, config: _Config, prefix: Path,
              ancestors: tuple[tuple[Path, type], ...], method: str,
              args: tuple, kwargs: dict,
              recorder: _report.Recorder | None = None) -> Any:
  """Runs ``method`` of ``node`` (class ``cls``, at ``prefix`` under the
  wrapper whose ``config`` it is) under the policy, on a per-call copy."""
  graphdef, state = nnx.split(node)
  flat = list(nnx.to_flat_state(state))
  # Copy every variable, so the call's own mutations stay in the copy until
  # they are written back (nnx's split/merge would share variable objects).
  copies = {p: jax.tree.map(lambda x: x, v) for p, v in flat}
  tmp = nnx.merge(graphdef, nnx.from_flat_state(list(copies.items())))
  object.__setattr__(tmp, "__class__", cls)
  modules = _modules(tmp)
  # Resolved on full paths, with the ancestors' classes, as the whole
  # model's call resolves them: a module shared with another part of the
  # model (a tied embedding) at the path the model's call sees it.
  where = {p: prefix + p for p in modules}
  full = dict(ancestors)
  for p in sorted(modules, key=len):
    guard = vars(modules[p]).get(_GUARD)
    if prefix and p and guard is not None and guard.config == config:
      where[p] = guard.path
      full.update(guard.ancestors)
    elif p:
      # Below its nearest module, as that module is placed.
      parent = _owner(p, modules)
      where[p] = where[parent] + p[len(parent):]
  classes = _classes(modules, cls)
  full.update({where[p]: classes[p] for p in modules})
  every = config.rule_set.resolve(full)
  resolved = {p: every[where[p]] for p in modules}

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
    object.__setattr__(module, _SLOT, _Slot(where[path], resolved[path],
                                             state, remat, root=not path))
    object.__setattr__(module, "__class__", _policy_class(type(module)))

  out = getattr(tmp, method)(*args, **kwargs)
  if recorder is None:
    _write_back(node, tmp, given, dict(flat))
  return out


def _under_nested(path: Path, modules: dict[Path, nnx.Module]) -> bool:
  return any(path[:len(p)] == p and len(path) > len(p)
             and isinstance(m, MixedPrecision) for p, m in modules.items()
             if p)


def _write_back(self: nnx.Module, tmp: nnx.Module, given: dict,
                stored: dict) -> None:
  """Writes the variables the call changed back, in their stored dtypes."""
  changed = []
  for path, var in nnx.to_flat_state(nnx.state(tmp)):
    value = var.get_value()
    if path in given and same_leaves(value, given[path]):
      continue
    if path not in stored:
      # Made by the call (an attention layer's init_cache fills attributes
      # declared as nnx.data(None)): nnx.update cannot put a variable where
      # the stored module holds no subgraph, so it is set in place.
      set_at_path(self, path, var)
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
    # A submodule of another wrapper (or a model holding one) is itself
    # again before this policy guards it.
    _unguard(model)
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
  _guard(model, config)
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
