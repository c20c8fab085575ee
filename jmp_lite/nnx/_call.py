"""One call of a policy-wrapped ``flax.nnx`` model, on a copy made for it.

:func:`run` splits the wrapper, copies every variable, merges the copy
into a plain instance of the model's own class and reads each param in its
module's compute dtype. Inside that copy every reference to a submodule is
replaced by a :class:`Boundary`, an ``nnx.Module`` holding the submodule
and its resolved policy, whose calls and methods cast their inputs and
outputs (the rules of :mod:`jmp_lite.rules`). Flax's own layers get their
``dtype`` attribute set to the compute dtype. Afterwards the references are
put back and the variables the call changed or created are written into the
wrapper, in their stored dtypes.

Nothing here changes an object the caller holds, except for that final
write-back, and no class is created or reassigned: the copy's modules are
instances of the user's classes; the boundaries are the one class below.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from flax import nnx

from jmp_lite import _flax_compat as _compat
from jmp_lite import dtypes as _dtypes
from jmp_lite import report as _report
from jmp_lite import rules as _rules
from jmp_lite._nnx_paths import child, same_leaves, set_at_path
from jmp_lite.nnx import _outputs

Path = tuple[str, ...]
Key = str | int

CONFIG = "_jmp_lite"
"""The wrapper's attribute holding its :class:`Config` (static)."""

CONTAINERS: tuple[type, ...] = (nnx.List, nnx.Dict)
"""nnx's container modules: never given a boundary (they are not called)."""

# Methods defined by these classes are nnx's own (set_view, sow, eval, ...):
# they act on the module itself and run without the policy.
_NNX_BASES = frozenset(nnx.Module.__mro__)


@dataclasses.dataclass(frozen=True)
class Config:
  """Static configuration of a policy wrapper (kept in its graphdef).

  Attributes:
    cls: the model's class.
    rule_set: the default policy and the rules.
    remat_norms: recompute the float32 islands in the backward pass.
    state_methods: methods whose return is state, never cast.
  """

  cls: type
  rule_set: _rules.RuleSet
  remat_norms: bool = False
  state_methods: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, eq=False)
class Slot:
  """What one module of a call's copy does at its boundary.

  Attributes:
    path: the module's path from the model's root (its first, for a module
      reached at several).
    resolved: its policy and output dtype.
    recorder: the dtype report being traced, or ``None``.
    remat: recompute this module (a float32 island) in the backward pass.
    state_methods: methods whose return is state, never cast.
  """

  path: Path
  resolved: _rules.Resolved
  recorder: _report.Recorder | None = None
  remat: bool = False
  state_methods: tuple[str, ...] = ()


def is_method(cls: type, name: str) -> bool:
  """Whether ``name`` is a public method (or ``__call__``) of ``cls`` that
  the policy governs: one defined below nnx's own base classes.

  Example:
    >>> from flax import nnx
    >>> from jmp_lite.nnx._call import is_method
    >>> is_method(nnx.Embed, "attend"), is_method(nnx.Embed, "set_view")
    (True, False)
  """
  if name.startswith("_") and name != "__call__":
    return False
  for klass in cls.__mro__:
    if name in vars(klass):
      return (isinstance(vars(klass)[name], types.FunctionType)
              and issubclass(klass, nnx.Module) and klass not in _NNX_BASES)
  return False


def invoke(module: Any, slot: Slot, method: str, args: tuple, kwargs: dict,
           entry: bool) -> Any:
  """Runs ``module.<method>`` under the policy in ``slot``.

  Floating inputs are cast to the module's compute dtype, outputs to its
  output dtype (a carry keeps its dtypes; so does state, see
  :mod:`jmp_lite.nnx._outputs`). The ``entry`` module (the one the caller
  called: the model, or a submodule called through the wrapper) returns the
  policy's output dtype and has no carry.
  """
  policy = slot.resolved.policy
  cast_args, cast_kwargs = _rules.cast_inputs((args, kwargs),
                                              policy.compute_dtype)
  output = slot.resolved.output
  if entry and slot.path:
    output = policy.output_dtype

  def run(m: Any, *a: Any) -> Any:
    return getattr(m, method)(*a, **cast_kwargs)

  given = cast_args
  if slot.remat:
    # The cast is recomputed with the island, so that the backward pass
    # saves the input as given (bfloat16), not its float32 copy.
    def cast_then_run(m: Any, *a: Any) -> Any:
      a, k = _rules.cast_inputs((a, kwargs), policy.compute_dtype)
      return getattr(m, method)(*a, **k)

    run = nnx.remat(cast_then_run)
    given = args
  recorder = slot.recorder
  scope = (contextlib.nullcontext() if recorder is None else
           recorder.scope(slot.path, type(module), policy, slot.resolved.fp8))
  with scope:
    out = run(module, *given)
  if method not in slot.state_methods:
    out = _outputs.keep_state(
        out, lambda o: _rules.cast_outputs(o, output, args, carry=not entry),
        (args, kwargs), _outputs.chosen_dtypes(module, method, args, kwargs))
  if recorder is not None:
    own = {k: v.get_value() for k, v in vars(module).items()
           if isinstance(v, nnx.Param)}
    recorder.call(slot.path, type(module), policy, (cast_args, cast_kwargs),
                  out, own)
  return out


class Boundary(nnx.Module):
  """A submodule of a call's copy, as the model's code meets it.

  Calling it, or one of its module's own methods (``attend``,
  ``init_cache``), runs under the module's policy; every other attribute
  is the module's, and ``isinstance`` sees the module's class. Only ever
  part of a per-call copy, never of a user's model.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import jmp_lite, jmp_lite.rules
    >>> from jmp_lite.nnx._call import Boundary, Slot
    >>> layer = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    >>> resolved = jmp_lite.rules.Resolved(jmp_lite.get_policy("f16"),
    ...                                    jnp.float16, None)
    >>> bound = Boundary(layer, Slot(("layer",), resolved))
    >>> bound(jnp.ones((1, 2))).dtype, bound.in_features
    (dtype('float16'), 2)
  """

  def __init__(self, module: nnx.Module, slot: Slot | None,
               nested: Callable[..., Any] | None = None) -> None:
    self.module = module
    self.slot = slot
    # For a nested policy wrapper: runs one of its methods, recording.
    self.nested = nested

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    """Calls the module under its policy."""
    return self._run("__call__", args, kwargs)

  def _module_class(self) -> type:
    module = vars(self).get("module")
    return Boundary if module is None else type(module)

  # The model's code branches on isinstance(self.block, Block) as without
  # the policy. type(...) stays Boundary, which is what nnx dispatches on
  # (jmp_lite._flax_compat).
  __class__ = property(_module_class)  # type: ignore[assignment]

  def _run(self, name: str, args: tuple, kwargs: dict) -> Any:
    own = vars(self)
    if own["nested"] is not None:
      return own["nested"](own["module"], name, args, kwargs)
    return invoke(own["module"], own["slot"], name, args, kwargs,
                  entry=False)

  def __getattr__(self, name: str) -> Any:
    module = vars(self).get("module")
    if module is None or name.startswith("__"):
      raise AttributeError(name)
    nested = vars(self)["nested"]
    cls = module.wrapped_class if nested is not None else type(module)
    if nested is not None and hasattr(type(module), name):
      return getattr(module, name)   # The wrapper's own attribute.
    if not is_method(cls, name):
      return getattr(module, name)

    @functools.wraps(getattr(cls, name))
    def method(*args: Any, **kwargs: Any) -> Any:
      return self._run(name, args, kwargs)

    return method

  def __setattr__(self, name: str, value: Any) -> None:
    if name in ("module", "slot", "nested") or "module" not in vars(self):
      super().__setattr__(name, value)
    else:
      setattr(vars(self)["module"], name, value)

  # A module that is itself a container (indexed, iterated) stays one.
  def __getitem__(self, key: Any) -> Any:
    return vars(self)["module"][key]

  def __iter__(self) -> Any:
    return iter(vars(self)["module"])

  def __len__(self) -> int:
    return len(vars(self)["module"])

  def __bool__(self) -> bool:
    return bool(vars(self)["module"])


def relink(root: Any, swap: Callable[[Any], Any]) -> None:
  """Replaces every reference below ``root`` to an nnx object ``x`` by
  ``swap(x)`` (itself, to keep it).

  Modules and nnx objects are rewritten in place, ``nnx.List``/``nnx.Dict``
  through their item API; a plain list, tuple or dict holding a replaced
  reference is rebuilt. Nested policy wrappers are left to themselves.
  """
  seen: set[int] = set()

  def fix(value: Any) -> Any:
    if type(value) in (list, tuple):
      items = [fix(v) for v in value]
      if all(a is b for a, b in zip(items, value, strict=True)):
        return value
      return type(value)(items)
    if type(value) is dict:
      fixed = {k: fix(v) for k, v in value.items()}
      if all(fixed[k] is v for k, v in value.items()):
        return value
      return fixed
    if isinstance(value, nnx.Pytree):
      value = swap(value)
      visit(value)
    return value

  def visit(node: Any) -> None:
    if id(node) in seen:
      return
    seen.add(id(node))
    if isinstance(node, Boundary):
      if vars(node)["nested"] is None:
        visit(vars(node)["module"])
      return
    if is_wrapper(node):
      return   # A nested policy wrapper: it runs its own calls.
    if isinstance(node, nnx.List):
      for i in range(len(node)):
        if (new := fix(node[i])) is not node[i]:
          node[i] = new
    elif isinstance(node, nnx.Dict):
      for key in list(node):
        if (new := fix(node[key])) is not node[key]:
          node[key] = new
    else:
      for key, value in _compat.attributes(node):
        if (new := fix(value)) is not value:
          _compat.set_child(node, key, new)

  visit(root)


def unbound(value: Any) -> Any:
  """The module a :class:`Boundary` stands for (anything else as it is)."""
  return vars(value)["module"] if isinstance(value, Boundary) else value


def str_path(path: Sequence[Any]) -> Path:
  """An nnx path as the ``/``-joined strings rules match."""
  return tuple(str(p) for p in path)


def owner(path: Path, modules: Mapping[Path, Any]) -> Path:
  """The deepest module path that is a prefix of a variable's ``path``."""
  for n in range(len(path) - 1, -1, -1):
    if path[:n] in modules:
      return path[:n]
  return ()


def is_wrapper(node: Any) -> bool:
  """Whether ``node`` is a policy wrapper (it has a ``wrapped_class``)."""
  return isinstance(node, nnx.Module) and isinstance(
      getattr(type(node), "wrapped_class", None), property)


def modules_of(root: Any) -> dict[Path, Any]:
  """Every module of ``root`` by path, except those inside nested wrappers."""
  found = {str_path(path): node for path, node in nnx.iter_graph(root)
           if isinstance(node, nnx.Module)}
  nested = [p for p, m in found.items() if p and is_wrapper(m)]
  return {p: m for p, m in found.items()
          if not any(p[:len(n)] == n and len(p) > len(n) for n in nested)}


def under_nested(path: Path, modules: Mapping[Path, Any]) -> bool:
  """Whether a variable at ``path`` belongs to a nested policy wrapper."""
  return any(path[:len(p)] == p and len(path) > len(p) and is_wrapper(m)
             for p, m in modules.items() if p)


def classes_of(modules: Mapping[Path, Any], cls: type) -> dict[Path, type]:
  """The class of every module, the root's as ``cls``."""
  return {p: (cls if not p else type(m)) for p, m in modules.items()}


def is_flax_layer(module: Any) -> bool:
  """Whether ``module`` is (a subclass of) one of Flax's own dtype'd layers."""
  return "dtype" in vars(module) and any(
      c.__module__.startswith("flax.nnx.") for c in type(module).__mro__
      if c is not nnx.Module and issubclass(c, nnx.Module))


def model_of(wrapper: Any) -> Any:
  """An instance of the model's class holding ``wrapper``'s attributes (the
  same objects, not copies); the class's ``__init__`` does not run."""
  state = dict(vars(wrapper))
  config: Config = state.pop(CONFIG)
  return _compat.instance_with(config.cls, state)


def run(wrapper: Any, at: Sequence[Key], method: str, args: tuple,
        kwargs: dict, recorder: _report.Recorder | None,
        nested: Callable[..., Any]) -> Any:
  """Runs ``method`` of the module at ``at`` below ``wrapper`` (``()``: the
  model) under the policy, on a copy; writes back what the call changed.

  ``nested(wrapper, method, args, kwargs, recorder)`` runs a nested policy
  wrapper's method (only used while a report records).
  """
  config: Config = vars(wrapper)[CONFIG]
  graphdef, state = nnx.split(wrapper)
  flat = list(nnx.to_flat_state(state))
  # New variable objects (arrays shared): what the call changes stays in
  # the copy until it is written back.
  copies = {p: jax.tree.map(lambda x: x, v) for p, v in flat}
  copied = nnx.merge(graphdef, nnx.from_flat_state(list(copies.items())))
  model = model_of(copied)
  entry = model
  for key in at:
    entry = child(entry, key)
  modules = modules_of(model)
  resolved = config.rule_set.resolve(classes_of(modules, config.cls))

  given = {}
  for path, var in copies.items():
    value = var.get_value()
    where = str_path(path)
    if (isinstance(var, nnx.Param) and _dtypes.is_floating_array(value)
        and not under_nested(where, modules)):
      dtype = resolved[owner(where, modules)].policy.compute_dtype
      if value.dtype != dtype:
        value = value.astype(dtype)
        var.set_value(value)
    given[path] = value

  boundaries: dict[int, Boundary] = {}
  slots: dict[int, Slot] = {}
  for path, module in modules.items():
    if is_wrapper(module):
      if path and recorder is not None:
        sub = recorder.under(path)
        boundaries[id(module)] = Boundary(
            module, None, functools.partial(nested, recorder=sub))
      continue
    if isinstance(module, CONTAINERS):
      continue
    if is_flax_layer(module):
      _compat.set_child(module, "dtype", resolved[path].policy.compute_dtype)
    remat = config.remat_norms and config.rule_set.is_island(
        resolved[path].rule)
    slots[id(module)] = slot = Slot(path, resolved[path], recorder, remat,
                                    config.state_methods)
    if path:
      boundaries[id(module)] = Boundary(module, slot)
  if id(entry) not in slots:
    raise TypeError(
        f"{type(entry).__name__} at {'/'.join(map(str, at))!r} is not a"
        " module this policy runs")
  relink(model, lambda x: boundaries.get(id(x), x))
  out = invoke(entry, slots[id(entry)], method, args, kwargs, entry=True)
  relink(model, unbound)
  if recorder is None:
    write_back(wrapper, model, given, dict(flat))
  return out


def write_back(wrapper: Any, copy: Any, given: Mapping[Any, Any],
               stored: Mapping[Any, Any]) -> None:
  """Writes the variables the call changed into ``wrapper``, in their
  stored dtypes; variables it created are set where it made them."""
  changed = []
  for path, var in nnx.to_flat_state(nnx.state(copy)):
    value = var.get_value()
    if path in given and same_leaves(value, given[path]):
      continue
    old = stored.get(path)
    if old is None:
      # Made by the call (attention's init_cache fills attributes declared
      # nnx.data(None)): nnx.update cannot put a variable where the stored
      # module holds no subgraph, so it is set in place.
      if len(path) == 1:
        setattr(wrapper, str(path[0]), var)
      else:
        set_at_path(vars(wrapper)[path[0]], path[1:], var)
      continue
    old_value = old.get_value()
    if (_dtypes.is_floating_array(value)
        and _dtypes.is_floating_array(old_value)
        and value.dtype != old_value.dtype):
      var = jax.tree.map(lambda x, d=old_value.dtype: x.astype(d), var)
    changed.append((path, var))
  if changed:
    nnx.update(wrapper, nnx.from_flat_state(changed))
