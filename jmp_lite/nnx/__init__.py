"""Apply a precision policy to a ``flax.nnx`` model without editing it.

:func:`mixed_precision` returns a :class:`MixedPrecision` module that holds a
*copy* of the model (the original is left as it is) with exactly the model's
state layout: ``wrapped.encoder.kernel``, ``nnx.state(wrapped, nnx.Param)``,
``nnx.Optimizer(wrapped, tx, wrt=nnx.Param)`` and checkpoints look as they
would for the bare model. Every ``nnx.Param`` is stored in its module's param
dtype; other variables (``BatchStat``, caches, RNG counts) keep theirs. The
stored modules are instances of their own classes, as the model built them.

Calling it — ``wrapped(x)``, or any method, ``wrapped.encode(x)`` — runs the
model's own code on a private copy made for that call, in which:

* every param is read in its module's compute dtype (the cast is traced, so
  ``nnx.grad`` gives gradients in the param dtype);
* Flax's own layers compute in their module's compute dtype whatever their
  ``dtype=`` says (a rule keeps a module in float32);
* every call of a submodule, and of its own methods (``Embed.attend``),
  casts its floating inputs to the module's compute dtype and its outputs to
  its output dtype (the rules of :mod:`jmp_lite.rules`; a carry, and state
  a call returns, such as a cache, keep their dtypes: see
  :func:`mixed_precision`);
* nnx objects passed as arguments (``Rngs``, caches, modules) are the
  caller's own objects, never copies.

A submodule reached through the wrapper (``wrapped.encoder``,
``wrapped.blocks[0]``) is a view of the stored one: calling it
(``wrapped.encoder(x)``, also inside ``nnx.jit`` or on an ``nnx.view`` of the
wrapper) runs it under the policy it has inside the model, with the same
per-call copy, casts and write-back, and returns its outputs in that
policy's output dtype, as the wrapper does; its attributes and other methods
(``set_view``, ``init_cache``, setters, ``wrapped.encoder.encode(x)``) are
the stored module's, run as written, without the policy. nnx functions
(``nnx.state``, ``nnx.jit``) take the wrapper, not a view.

Afterwards the variables the call changed (batch statistics, RNG counts,
caches, ``sow``-n intermediates) are written back into the wrapped model in
their stored dtypes; nothing else is written, so a call that changes nothing
traces under plain ``jax.jit``/``jax.make_jaxpr``/``jax.eval_shape`` just as
the bare model does.

How: one call on its copy is ``jmp_lite.nnx._call``; what it assumes of
``flax.nnx`` beyond the documented API is in ``jmp_lite._flax_compat``.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import jax
from flax import nnx

from jmp_lite import _flax_compat as _compat
from jmp_lite import _jaxpr
from jmp_lite import dtypes as _dtypes
from jmp_lite import report as _report
from jmp_lite import rules as _rules
from jmp_lite._nnx_paths import child
from jmp_lite.fp4._recipes import RECIPES as _FP4_RECIPES
from jmp_lite.nnx import _call
from jmp_lite.policy import Policy
from jmp_lite.report import DtypeReport
from jmp_lite.rules import Rule

NORM_LAYERS: tuple[type, ...] = (nnx.LayerNorm, nnx.BatchNorm, nnx.RMSNorm,
                                 nnx.GroupNorm)
"""The nnx layers kept in float32 by default."""

_CONFIG = _call.CONFIG

Path = tuple[str, ...]

__all__ = ["MixedPrecision", "NORM_LAYERS", "Rule", "dtype_report",
           "mixed_precision"]


def _viewable(value: Any) -> bool:
  """Whether ``value`` is reached through a view: a module (not a policy
  wrapper, which runs its own calls) or a plain container holding one."""
  if isinstance(value, nnx.Module):
    return not isinstance(value, MixedPrecision)
  if type(value) in (list, tuple):
    return any(_viewable(v) for v in value)
  if type(value) is dict:
    return any(_viewable(v) for v in value.values())
  return False


class _View:
  """A stored submodule (or container of them) seen through its wrapper.

  Calling it runs the submodule under the policy it has inside the model;
  indexing and iterating give views of the items; every other attribute is
  the stored object's. It is looked up again at each use, so it follows
  model surgery.
  """

  __slots__ = ("_at", "_wrapper")

  def __init__(self, wrapper: MixedPrecision, at: tuple[Any, ...]) -> None:
    object.__setattr__(self, "_wrapper", wrapper)
    object.__setattr__(self, "_at", at)

  def _stored(self) -> Any:
    node = vars(self._wrapper)[self._at[0]]
    for key in self._at[1:]:
      node = child(node, key)
    return node

  def _view(self, key: Any, value: Any) -> Any:
    return _View(self._wrapper, self._at + (key,)) if _viewable(value) \
        else value

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    return _run(self._wrapper, self._at, "__call__", args, kwargs)

  def __getattr__(self, name: str) -> Any:
    if name.startswith("__"):
      raise AttributeError(name)
    return self._view(name, getattr(self._stored(), name))

  def __setattr__(self, name: str, value: Any) -> None:
    setattr(self._stored(), name, value)

  def __getitem__(self, key: Any) -> Any:
    stored = self._stored()
    if isinstance(key, slice):
      return [self._view(i, stored[i]) for i in range(len(stored))[key]]
    return self._view(key, stored[key])

  def __setitem__(self, key: Any, value: Any) -> None:
    self._stored()[key] = value

  def __iter__(self) -> Iterator[Any]:
    stored = self._stored()
    if isinstance(stored, Mapping):
      return iter(stored)
    return (self._view(i, v) for i, v in enumerate(stored))

  def __len__(self) -> int:
    return len(self._stored())

  def __bool__(self) -> bool:
    return bool(self._stored())

  def __reduce__(self) -> tuple[Any, ...]:
    return _View, (self._wrapper, self._at)

  def __repr__(self) -> str:
    where = "/".join(map(str, self._at))
    return (f"<{type(self._stored()).__name__} at {where!r} under the"
            f" policy of a {self._wrapper.wrapped_class.__name__} wrapper>")


class MixedPrecision(nnx.Module):
  """An ``nnx`` model under a precision policy; see :func:`mixed_precision`.

  It holds the model's attributes (submodules, variables, static fields)
  with the model's own state layout; calls and methods run the model's code
  under the policy. ``isinstance(wrapped, Model)`` is false: this is not the
  model's class, it runs it.
  """

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    """Calls the model's ``__call__`` under the policy."""
    return _run(self, (), "__call__", args, kwargs)

  def __getattribute__(self, name: str) -> Any:
    value = super().__getattribute__(name)
    if (not name.startswith("__") and _viewable(value)
        and name in vars(self)):
      return _View(self, (name,))
    return value

  def __getattr__(self, name: str) -> Any:
    config: _call.Config | None = vars(self).get(_CONFIG)
    if config is None or name.startswith("__"):
      raise AttributeError(name)
    attr = getattr(config.cls, name, _MISSING)
    if isinstance(attr, types.FunctionType):
      @functools.wraps(attr)
      def method(*args: Any, **kwargs: Any) -> Any:
        return _run(self, (), name, args, kwargs)

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


def _copy(node: Any) -> Any:
  """A copy of an nnx graph whose variables are new objects (arrays shared)."""
  graphdef, state = nnx.split(node)
  return nnx.merge(graphdef, jax.tree.map(lambda x: x, state))


def _run(wrapper: MixedPrecision, at: Sequence[Any], method: str,
         args: tuple, kwargs: dict,
         recorder: _report.Recorder | None = None) -> Any:
  """Runs ``method`` of the module at ``at`` (``()``: the model) held by
  ``wrapper`` under its policy."""
  return _call.run(wrapper, at, method, args, kwargs, recorder, _run_nested)


def _run_nested(wrapper: MixedPrecision, method: str, args: tuple,
                kwargs: dict, recorder: _report.Recorder) -> Any:
  return _run(wrapper, (), method, args, kwargs, recorder)


def mixed_precision(
    model: nnx.Module,
    policy: Policy | str,
    *,
    rules: Sequence[Any] = (),
    float32_norms: bool = True,
    strict: bool = False,
    enabled: bool = True,
    remat_norms: bool = False,
    state_methods: Sequence[str] = (),
) -> MixedPrecision:
  """Returns an ``nnx`` model that runs under a precision policy.

  The output dtype governs the activations a call returns (logits,
  features), not the state it returns: a returned container laid out as a
  container argument (same tree and shapes: the cache a decode step hands
  back) comes back in the dtypes the caller passed it in, and a floating
  value in a dtype the call names among its arguments, defaults included
  (``init_cache(batch, size, dtype=jnp.bfloat16)``), as the method made it.

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
    state_methods: methods (the model's or a submodule's, by name) whose
      whole return is state, handed back as the method made it, never cast
      to the output dtype: a cache-making method the rule above misses.

  Returns:
    A :class:`MixedPrecision` module with the model's state layout. Passing
    one in replaces its policy.

  Raises:
    TypeError: for a model that is not an nnx module, or a bad rule or
      policy.
    ValueError: for a bad policy string or path regex; with ``strict``, for a
      rule matching nothing; for a state method no module has.

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
  if isinstance(model, _View):   # A submodule of another wrapper.
    model = model._stored()
  if isinstance(model, MixedPrecision):
    # The model it holds, as a plain instance of its own class again.
    model = _call.model_of(_copy(model))
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
  modules = _call.modules_of(model)
  classes = _call.classes_of(modules, type(model))
  rule_set.check_strict(classes)
  resolved = rule_set.resolve(classes)
  for path, var in nnx.to_flat_state(nnx.state(model)):
    value = var.get_value()
    if (isinstance(var, nnx.Param) and _dtypes.is_floating_array(value)
        and not _call.under_nested(_call.str_path(path), modules)):
      where = _call.owner(_call.str_path(path), modules)
      dtype = resolved[where].policy.param_dtype
      if value.dtype != dtype:
        var.set_value(value.astype(dtype))
  _install_fp8(modules, resolved)
  if not isinstance(remat_norms, bool):
    raise TypeError(f"remat_norms must be a bool, got {remat_norms!r}")
  config = _call.Config(type(model), rule_set, remat_norms,
                        _state_methods(state_methods, classes))
  wrapped = _compat.instance_with(MixedPrecision, vars(model))
  _compat.set_child(wrapped, _CONFIG, config)   # Static: in the graphdef.
  return wrapped


def _state_methods(names: Any, classes: Mapping[Path, type]
                   ) -> tuple[str, ...]:
  """``names`` checked: methods the policy governs in one of ``classes``."""
  if isinstance(names, str) or not isinstance(names, Sequence) or not all(
      isinstance(n, str) for n in names):
    raise TypeError("state_methods must be a sequence of method names, got"
                    f" {names!r}")
  known = {n for c in classes.values() for n in dir(c)
           if _call.is_method(c, n)}
  if missing := sorted(set(names) - known):
    raise ValueError(
        f"state_methods names {missing}, which no module of the model has;"
        f" expected some of: {', '.join(sorted(known))}")
  return tuple(names)


def _install_fp8(modules: dict[Path, nnx.Module],
                 resolved: dict[Path, _rules.Resolved]) -> None:
  """Gives the FP8-ruled linear layers of the (copied) model FP8 matmuls.

  Done once, when the policy is applied, so that delayed scaling's state
  (a :class:`jmp_lite.fp8.nnx.ScalingStat` in the layer's new
  ``dot_general`` submodule) lives in the model from then on.
  """
  ruled = [(p, m) for p, m in modules.items() if resolved[p].fp8 is not None
           and "dot_general" in vars(m) and _call.is_flax_layer(m)]
  if not ruled:
    return
  from jmp_lite.fp4 import nnx as fp4_nnx
  from jmp_lite.fp8 import nnx as fp8_nnx  # On demand: FP8 rules only.
  for path, module in ruled:
    recipe = resolved[path].fp8
    dot = (fp4_nnx.dot_general_for(recipe) if isinstance(recipe, _FP4_RECIPES)
           else fp8_nnx.dot_general_for(recipe))
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
    return _run(model, (), method, a, k, recorder)

  jaxpr = jax.make_jaxpr(f)(*arrays)
  # Every module, nested policies' included: they have rows too.
  modules = {_call.str_path(p): m for p, m in nnx.iter_graph(model)
             if isinstance(m, nnx.Module)}
  stored: dict[Path, dict[Any, Any]] = {}
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    where = _call.owner(_call.str_path(path), modules)
    stored.setdefault(where, {})[path[-1]] = var.get_value()
  return recorder.report(jaxpr, stored)
