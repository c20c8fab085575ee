"""Apply a precision policy to any ``flax.linen`` module without editing it.

:func:`mixed_precision` wraps a module (a model you wrote, or one you import)
in a :class:`MixedPrecision` module: use it at the top (``init``/``apply``
with the model's own signatures, ``method=`` included) or as a submodule of
another model, whose code calls it, or any of the wrapped model's methods
(``self.backbone.encode(x)``), under the policy. Its params live exactly
where the wrapped model's would; ``tabulate``, ``capture_intermediates`` and
``nn.intercept_methods`` see the model's calls as they would without it.

* **params** are stored in the param dtype and read in the compute dtype (the
  cast is part of the differentiated function, so gradients come back in the
  param dtype);
* **Flax's own layers** (``Dense``, ``Conv``, ``Embed``, attention, norms,
  RNN cells, ...) compute in their module's compute dtype *whatever their
  ``dtype=``/``param_dtype=`` fields say*: Flax's example models pass
  ``dtype=jnp.float32`` to every layer, and the policy overrides it. A rule is
  how you keep a module in float32. Code you wrote that casts on its own
  (``x.astype(jnp.float32)``) is run as written; :func:`dtype_report` flags
  it;
* **inputs** of every module call are cast to that module's compute dtype,
  and **outputs** to its output dtype (see :mod:`jmp_lite.rules`; a carry
  keeps its dtype, so ``nn.RNN`` and ``nn.scan`` bodies type-check);
* **mutable collections** (``batch_stats``, caches) keep the dtype they were
  stored in.

Rules give modules other policies: ``(nn.LayerNorm, "f32")`` by class, or
``("decoder/logits", "f32")`` by path (``re.fullmatch`` on the ``/``-joined
module path, relative to the wrapped model). The first matching rule wins; a
module without a match inherits its nearest ancestor's. By default
normalisation layers are float32 islands.

How: every module call goes through ``flax.linen.intercept_methods``; while a
Flax layer runs, its ``dtype``/``param_dtype`` fields are set on Flax's
per-call bound copy of it (never on your module objects) and restored after.
Params are cast by ``flax.linen.map_variables``, which needs each module
path's class up front: the first call with new shapes traces the model
abstractly once to learn them, and remembers them for later calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading
import types
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _jaxpr
from jmp_lite import dtypes as _dtypes
from jmp_lite import report as _report
from jmp_lite import rules as _rules
from jmp_lite.autocasting import float32_region
from jmp_lite.diagnostics import tree_bytes
from jmp_lite.policy import Policy
from jmp_lite.report import DtypeReport, ReportRow
from jmp_lite.rules import FLOAT32, Rule

NORM_LAYERS: tuple[type, ...] = (nn.LayerNorm, nn.BatchNorm, nn.RMSNorm,
                                 nn.GroupNorm, nn.InstanceNorm)
"""The layers kept in float32 by default.

As Paddle's O2 and Apex's ``keep_batchnorm_fp32`` do.
"""

Path = tuple[str, ...]

__all__ = ["DtypeReport", "FLOAT32", "MixedPrecision", "NORM_LAYERS",
           "ReportRow", "Rule", "dot_product_attention_fp32", "dtype_report",
           "mixed_precision"]


def _is_flax_layer(module: nn.Module) -> bool:
  """Whether ``module`` is (a subclass of) one of Flax's own dtype'd layers."""
  fields = getattr(type(module), "__dataclass_fields__", {})
  if "dtype" not in fields:
    return False
  return any(c.__module__.startswith("flax.linen.")
             for c in type(module).__mro__
             if c is not nn.Module and issubclass(c, nn.Module))


@contextlib.contextmanager
def _fields_set(module: nn.Module, values: Mapping[str, Any]) -> Iterator[None]:
  """Sets dataclass fields of a bound module for one call, then restores them.

  The module is Flax's bound copy made for this ``init``/``apply`` (Flax
  clones every module when it binds it), so nothing a user holds changes.
  """
  fields = getattr(type(module), "__dataclass_fields__", {})
  old = {k: getattr(module, k) for k in values if k in fields}
  for k in old:
    object.__setattr__(module, k, values[k])
  try:
    yield
  finally:
    for k, v in old.items():
      object.__setattr__(module, k, v)


def _is_real_call(context: Any) -> bool:
  name = context.method_name
  return not (name == "setup" or name.startswith("<"))


@dataclasses.dataclass
class _Call:
  """Bookkeeping for one traced call of a :class:`MixedPrecision` (not shared).

  Attributes:
    rule_set: the policy and rules.
    root: the wrapped model's absolute module path.
    classes: relative module path -> class, as seen (or discovered).
    resolved: relative path -> resolution, filled lazily from ``classes``.
    initializing: whether params are being created.
    remat_norms: recompute float32 islands in the backward pass.
    recorder: set when tracing for a :func:`dtype_report`.
  """

  rule_set: _rules.RuleSet
  root: Path
  classes: dict[Path, type]
  initializing: bool
  remat_norms: bool = False
  recorder: _report.Recorder | None = None
  resolved: dict[Path, _rules.Resolved] = dataclasses.field(
      default_factory=dict)
  rematting: set[Path] = dataclasses.field(default_factory=set)
  boundaries: set[Path] = dataclasses.field(default_factory=set)
  root_depth: int = 0  # Nesting of root calls: only the outermost casts out.
  # How many discovery traces were open when this call began (see
  # `_ThreadState`).
  discovery_depth: int = dataclasses.field(
      default_factory=lambda: _STATE.depth)

  def relative(self, module: nn.Module) -> Path | None:
    """The path of ``module`` relative to the wrapped root, or ``None``."""
    path = tuple(module.path)
    if path[:len(self.root)] != self.root:
      return None
    rel = path[len(self.root):]
    if self.under_boundary(rel):
      return None
    return rel

  def under_boundary(self, path: Path) -> bool:
    """Whether ``path`` belongs to a nested :class:`MixedPrecision`."""
    return any(path[:len(b)] == b for b in self.boundaries)

  def policy_at(self, path: Path) -> Policy:
    """The policy of ``path``: its own class's, else its nearest ancestor's."""
    for n in range(len(path), -1, -1):
      if path[:n] in self.classes:
        return self.resolve(path[:n], self.classes[path[:n]]).policy
    return self.rule_set.default

  def resolve(self, path: Path, cls: type) -> _rules.Resolved:
    """The resolution of ``path``, from the classes of it and its ancestors."""
    if path not in self.resolved or self.classes.get(path) is not cls:
      self.classes[path] = cls
      chain = {p: c for p, c in self.classes.items() if path[:len(p)] == p}
      self.resolved[path] = self.rule_set.resolve(chain)[path]
    return self.resolved[path]


class _ThreadState(threading.local):
  """What nested policies need to know of the ones around them (per thread).

  Attributes:
    depth: how many :meth:`MixedPrecision._discover` traces are open. Method
      interceptors are global: a nested policy's discovery trace runs under
      the outer policy's interceptor too, with paths from its own root.
    report: ``(recorder, root path, depth)`` while :func:`dtype_report`
      traces a model, so that nested policies record their modules in it.
  """

  depth: int = 0
  report: tuple[_report.Recorder, Path, int] | None = None


_STATE = _ThreadState()


def _nested_recorder(path: Path) -> _report.Recorder | None:
  """The enclosing :func:`dtype_report`'s recorder, for a policy at ``path``.

  Without it a nested policy's matmuls count as its parent's own code.
  """
  active = _STATE.report
  if active is None:
    return None
  recorder, root, depth = active
  if depth != _STATE.depth or path[:len(root)] != root:
    return None  # In a discovery trace, or not under the reported model.
  return recorder.under(path[len(root):])


def _creation_dtype(policy: Policy) -> np.dtype:
  # Params are drawn in (at least) float32 and then stored in the param
  # dtype, so that every policy starts from the same (rounded) weights.
  return np.dtype(jnp.promote_types(policy.param_dtype, jnp.float32))


def _interceptor(call: _Call) -> Callable[..., Any]:
  def intercept(next_fun, args, kwargs, context):
    module = context.module
    if not _is_real_call(context) or (
        _STATE.depth != call.discovery_depth):
      # A nested policy's discovery trace (its own model from a fresh root)
      # is not ours: its paths are not our modules'.
      return next_fun(*args, **kwargs)
    path = call.relative(module)
    if path is None:
      return next_fun(*args, **kwargs)
    resolved = call.resolve(path, type(module))
    policy = resolved.policy
    cast_args, cast_kwargs = _rules.cast_inputs((args, kwargs),
                                                policy.compute_dtype)
    if isinstance(module, MixedPrecision):
      # A nested policy: hand it inputs in our compute dtype; it casts its
      # outputs itself and its modules follow its own rules.
      call.boundaries.add(path)
      return next_fun(*cast_args, **cast_kwargs)
    if path in call.rematting:
      # The inner call of a recomputed island: the outer call cast already.
      call.rematting.discard(path)
      return _run_layer(call, module, resolved, next_fun, args, kwargs)
    scope = (call.recorder.scope(path, type(module), policy, resolved.fp8)
             if call.recorder is not None else contextlib.nullcontext())
    output = resolved.output
    if not path:
      # The root's own methods calling each other stay in compute dtype.
      output = output if call.root_depth == 0 else policy.compute_dtype
      call.root_depth += 1
    try:
      with scope:
        if (call.remat_norms and not call.initializing
            and call.rule_set.is_island(resolved.rule)):
          call.rematting.add(path)
          method = context.method_name
          out = nn.remat(lambda m, *a, **k: getattr(m, method)(*a, **k))(
              module, *cast_args, **cast_kwargs)
        else:
          out = _run_layer(call, module, resolved, next_fun, cast_args,
                           cast_kwargs)
        out = _rules.cast_outputs(out, output, args, carry=bool(path))
    finally:
      if not path:
        call.root_depth -= 1
    if call.recorder is not None:
      own = {k: v for k, v in module.variables.get("params", {}).items()
             if not isinstance(v, Mapping)}
      call.recorder.call(path, type(module), policy, (cast_args, cast_kwargs),
                         out, own)
    return out

  return intercept


def _run_layer(call: _Call, module: nn.Module, resolved: _rules.Resolved,
               next_fun: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
  if not _is_flax_layer(module):
    return next_fun(*args, **kwargs)
  policy = resolved.policy
  values = {"dtype": policy.compute_dtype,
            "param_dtype": _creation_dtype(policy)}
  if resolved.fp8 is not None:
    from jmp_lite.fp8 import linen as fp8_linen  # Flax-dependent, on demand.
    try:
      values.update(fp8_linen.layer_fields(resolved.fp8, type(module)))
    except TypeError:
      pass  # No matmul to put in FP8 (norms, convolutions, embeddings).
  with _fields_set(module, values):
    return next_fun(*args, **kwargs)


def _cast_params(params: Any, call: _Call, which: str) -> Any:
  """Casts each param to its module's param (or compute) dtype, by path."""

  def cast(path: Any, leaf: Any) -> Any:
    if not _dtypes.is_floating_array(leaf):
      return leaf
    names = tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
    module_path = names[:-1]  # The last key names the param itself.
    if call.under_boundary(module_path):
      return leaf  # A nested policy casts its own params.
    policy = call.policy_at(module_path)
    dtype = policy.param_dtype if which == "param" else policy.compute_dtype
    return leaf if leaf.dtype == dtype else leaf.astype(dtype)

  return jax.tree_util.tree_map_with_path(cast, params)


def _restore_dtypes(new: Any, old: Any) -> Any:
  """Casts written collections back to the dtypes they were stored in."""
  old_dtypes = {jax.tree_util.keystr(p): x.dtype
                for p, x in jax.tree_util.tree_flatten_with_path(old)[0]
                if _dtypes.is_floating_array(x)}

  def cast(path: Any, leaf: Any) -> Any:
    dtype = old_dtypes.get(jax.tree_util.keystr(path))
    if (dtype is not None and _dtypes.is_floating_array(leaf)
        and leaf.dtype != dtype):
      return leaf.astype(dtype)
    return leaf

  return jax.tree_util.tree_map_with_path(cast, new)


class _Memo:
  """Per-model memo of discovered module classes (compares equal to all).

  A field of :class:`MixedPrecision` so that Flax's clones share it; it does
  not take part in comparisons or hashing, which Flax's lifted transforms do.
  """

  def __init__(self) -> None:
    self.classes: dict[Any, tuple[dict[Path, type], set[Path]]] = {}
    # The same, per function passed as ``method=``: held weakly, so that a
    # freed lambda's entries go with it (keyed by id, a new lambda reusing
    # the id got the old one's module classes).
    self.by_function: weakref.WeakKeyDictionary[
        Any, dict[Any, tuple[dict[Path, type], set[Path]]]] = (
            weakref.WeakKeyDictionary())
    self.lock = threading.Lock()
    # Keys of traced applies whose outputs were not all arrays: those run
    # uncached from then on.
    self.uncacheable: set[Any] = set()
    # Traced applies, one per key (see `_traced_apply`): JAX's own trace
    # cache, which also keeps the linearisation and transpose of each.
    self.apply = jax.jit(_apply_arrays, static_argnums=0)

  def __eq__(self, other: object) -> bool:
    return isinstance(other, _Memo)

  def __hash__(self) -> int:
    return 0

  def __repr__(self) -> str:
    return "_Memo()"

  def __reduce__(self) -> Any:
    return (_Memo, ())


def _aval_key(tree: Any) -> Any:
  """A hashable key of ``tree``'s structure, shapes, dtypes, static leaves."""
  leaves, treedef = jax.tree.flatten(tree)
  key = []
  for x in leaves:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
      key.append((tuple(x.shape), str(x.dtype)))
    else:
      try:
        hash(x)
      except TypeError:
        return None  # Unhashable static argument: do not memoise.
      key.append(("static", type(x), x))
  return treedef, tuple(key)


class _NotArrays(Exception):
  """Raised inside a cached trace whose output holds a non-array leaf."""


def _apply_arrays(spec: tuple, dynamic: list[Any]) -> Any:
  """``apply`` rebuilt from a :func:`_traced_apply` key and the arrays."""
  model, method, treedef, where, static, _ = spec
  arrays, statics = iter(dynamic), iter(static)
  leaves = [next(arrays) if is_array else next(statics) for is_array in where]
  variables, args, kwargs = jax.tree.unflatten(treedef, leaves)
  out = nn.Module.apply(model, variables, *args, method=model._method(method),
                        **kwargs)
  if not all(isinstance(x, jax.Array) for x in jax.tree.leaves(out)):
    raise _NotArrays  # A Python value would come back as an array.
  return out


def _interceptors_active() -> bool:
  """Whether a ``nn.intercept_methods`` context is open (unknown: True)."""
  stack = getattr(nn.module, "_global_interceptor_stack", None)
  return stack is None or len(stack) > 0


_UNCACHED = object()


def _traced_apply(model: MixedPrecision, variables: Any, args: tuple,
                  method: Any, kwargs: dict) -> Any:
  """``model.apply`` through a traced program reused per shapes and statics.

  Inside a trace (``jax.jit``, ``grad``, ``vmap``...), the policy's apply is
  a nested ``jax.jit`` keyed by the model, ``method``, the arguments' tree
  structure and Python values, and Flax's logical axis rules; JAX keys it on
  the arrays' shapes and dtypes. A later trace with the same key (a new
  ``jax.jit`` of an eval step, a re-jit in a notebook) reuses the model's
  traced program, and JAX's cached linearisation and transpose of it,
  instead of running Flax's method interception again. XLA inlines the
  nested call, so the compiled step is the same.

  Returns ``_UNCACHED`` (the caller runs the plain apply) outside any trace
  (eager calls stay op by op), while a Flax method interceptor is open (its
  effects are not part of any key), for an unhashable Python argument or one
  that is not a ``jax.Array`` but an array (a NumPy array stays a constant),
  and for a model whose output holds a non-array leaf.
  """
  leaves, treedef = jax.tree.flatten((variables, args, kwargs))
  if not any(map(_jaxpr.is_tracer, leaves)):
    return _UNCACHED
  if _interceptors_active():
    return _UNCACHED
  where = tuple(isinstance(x, jax.Array) for x in leaves)
  static = tuple(x for x, is_array in zip(leaves, where, strict=True)
                 if not is_array)
  # Types too: `train=1` and `train=True` are equal and hash alike.
  spec = (model, method, treedef, where, static,
          (tuple(map(type, static)), nn.get_logical_axis_rules()))
  try:
    hash(spec)
  except TypeError:
    return _UNCACHED
  with model.memo.lock:
    if spec in model.memo.uncacheable:
      return _UNCACHED
  dynamic = [x for x, is_array in zip(leaves, where, strict=True) if is_array]
  try:
    return model.memo.apply(spec, dynamic)
  except _NotArrays:
    with model.memo.lock:
      model.memo.uncacheable.add(spec)
    return _UNCACHED


def _call_method(method: Any) -> Callable[..., Any]:
  """``method`` (None, a name, or a function of the module) as a function."""
  if method is None:
    return lambda m, *a, **k: m(*a, **k)
  if isinstance(method, str):
    return lambda m, *a, **k: getattr(m, method)(*a, **k)
  if callable(method):
    return method
  raise TypeError(
      f"method must be None, a method name or a function taking the module,"
      f" got {method!r}")


def _as_method(method: Any) -> Any:
  """``method=`` as :func:`_call_method` takes it.

  ``wrapper.encode`` (a :class:`_BoundMethod`) is the name ``"encode"`` and
  ``wrapper.__call__`` is ``None``; another module's bound method is its
  function, as Flax's own ``apply`` takes ``method=model.encode``.
  """
  if isinstance(method, _BoundMethod):
    return method.name
  if inspect.ismethod(method) and isinstance(method.__self__, nn.Module):
    if isinstance(method.__self__, MixedPrecision):
      if method.__name__ == "__call__":
        return None
      raise TypeError(
          f"method={method.__name__!r} is the wrapper's own method, not the"
          " wrapped model's")
    return method.__func__
  return method


@dataclasses.dataclass(frozen=True, eq=False)
class _BoundMethod:
  """``wrapper.encode``: a method of the wrapped model, under the policy.

  Attributes:
    wrapper: the :class:`MixedPrecision` it was read from.
    name: the wrapped model's method.
  """

  wrapper: MixedPrecision
  name: str

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    return _policy_call(self.name)(self.wrapper, *args, **kwargs)


_POLICY_CALL = "jmp_lite_policy"


def _policy_call(method: Any, recorder: _report.Recorder | None = None
                 ) -> Callable[..., Any]:
  """A Flax-wrapped method of :class:`MixedPrecision` running ``method``.

  Every call of the wrapper goes through one: Flax runs ``setup`` (which
  shares the scope) before it, and method interceptors see it with the
  caller's arguments. Its name, ``jmp_lite_policy``, is no attribute of the
  wrapper, so ``tabulate`` lists the wrapped model's own call in its place
  (as for the bare model), and ``capture_intermediates`` (which captures
  ``__call__``) records the model's output once.

  Args:
    method: the wrapped model's method (``None``, a name or a function).
    recorder: set when tracing for a :func:`dtype_report`.

  Returns:
    A function of the wrapper and the method's arguments.
  """

  def run(mp: MixedPrecision, *args: Any, **kwargs: Any) -> Any:
    return mp._run(method, args, kwargs, recorder)

  run.__name__ = run.__qualname__ = _POLICY_CALL
  return nn.module.wrap_method_once(run)


class MixedPrecision(nn.Module):
  """A ``flax.linen`` module under a precision policy.

  Built by :func:`mixed_precision`.

  Use it like the module it wraps: ``init``/``apply`` take the same arguments
  (``method=``, ``rngs=``, ``mutable=``), or call it inside another module's
  ``setup``/``nn.compact`` as a submodule: ``self.backbone(x)``, or any
  method of the wrapped model, ``self.backbone.encode(x)``.

  Attributes:
    module: the wrapped module (unchanged).
    rule_set: the default policy and the rules.
    remat_norms: recompute float32 normalisation islands in the backward pass
      instead of saving their float32 internals.
    cache_traces: inside a trace, run ``apply`` as a nested ``jax.jit`` that
      later traces with the same shapes and Python arguments reuse.
  """

  module: nn.Module
  rule_set: _rules.RuleSet
  remat_norms: bool = False
  cache_traces: bool = True
  memo: _Memo = dataclasses.field(default_factory=_Memo)

  def setup(self) -> None:
    # The wrapped model's variables live where they would without us.
    nn.share_scope(self, self.module)

  @property
  def policy(self) -> Policy:
    """The default policy."""
    return self.rule_set.default

  @property
  def rules(self) -> tuple[Rule, ...]:
    """The rules, the user's first, then the float32 islands."""
    return self.rule_set.rules

  @nn.nowrap
  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    """Calls the wrapped module's ``__call__`` under the policy."""
    return _policy_call(None)(self, *args, **kwargs)

  @nn.nowrap
  def __getattr__(self, name: str) -> Any:
    """The wrapped module's other methods, run under the policy.

    So that a parent calls ``self.backbone.encode(x)`` as it would on the
    bare model. Only plain methods of the wrapped module's class that the
    wrapper does not have itself; anything else is Flax's lookup.

    Args:
      name: the attribute.

    Returns:
      The method, bound to this wrapper.

    Raises:
      AttributeError: for anything that is not such a method.
    """
    try:
      return super().__getattr__(name)
    except AttributeError:
      module = vars(self).get("module")
      if (name.startswith("_") or not isinstance(module, nn.Module)
          # A field's default (`attention_fn=`) is no method.
          or name in getattr(type(module), "__dataclass_fields__", {})
          or not isinstance(getattr(type(module), name, None),
                            types.FunctionType)):
        raise
    return _BoundMethod(self, name)

  @nn.nowrap
  def _run(self, method: Any, args: tuple, kwargs: dict,
           recorder: _report.Recorder | None = None) -> Any:
    # Not a Flax-wrapped method: interceptors and `tabulate` see the
    # wrapper's call (`_policy_call`) with the caller's arguments, never our
    # bookkeeping. That call ran `setup`.
    fn = _call_method(method)
    if recorder is None:
      recorder = _nested_recorder(tuple(self.path))
    call = _Call(self.rule_set, tuple(self.path), {},
                 self.is_initializing(), self.remat_norms, recorder)
    if call.initializing:
      def trans_out(variables: Any) -> Any:
        variables = dict(variables)
        if "params" in variables:
          variables["params"] = _cast_params(variables["params"], call,
                                             "param")
        return variables

      def trans_in(variables: Any) -> Any:
        variables = dict(variables)
        if "params" in variables:
          variables["params"] = _cast_params(variables["params"], call,
                                             "compute")
        return variables

      mapped = nn.map_variables(
          lambda m, *a, **k: self._intercepted(call, fn, m, a, k),
          "params", trans_in_fn=trans_in, trans_out_fn=trans_out, init=True,
          mutable=True)
      out = mapped(self.module, *args, **kwargs)
      self.rule_set.check_strict(call.classes)
      return out
    call.classes, call.boundaries = self._discover(method, args, kwargs)
    stored = self.variables

    def cast_in(variables: Any) -> Any:
      variables = dict(variables)
      if "params" in variables:
        variables["params"] = _cast_params(variables["params"], call,
                                           "compute")
      return variables

    def restore_out(variables: Any) -> Any:
      return {k: _restore_dtypes(v, stored.get(k, {}))
              for k, v in dict(variables).items()}

    mutable = [c for c in stored if c != "params"
               and self.is_mutable_collection(c)]
    inner = lambda m, *a, **k: self._intercepted(call, fn, m, a, k)
    if mutable:
      inner = nn.map_variables(inner, mutable, trans_in_fn=lambda v: v,
                               trans_out_fn=restore_out, mutable=True)
    mapped = nn.map_variables(inner, "params", trans_in_fn=cast_in)
    return mapped(self.module, *args, **kwargs)

  @nn.nowrap
  def _intercepted(self, call: _Call, fn: Callable[..., Any], module: Any,
                   args: tuple, kwargs: dict) -> Any:
    with nn.intercept_methods(_interceptor(call)):
      return fn(module, *args, **kwargs)

  @nn.nowrap
  def _discover(self, method: Any, args: tuple, kwargs: dict
                ) -> tuple[dict[Path, type], set[Path]]:
    """Each module path's class, from one abstract trace (memoised)."""
    variables = self.variables
    key: Any = (_aval_key(dict(variables)), _aval_key((args, kwargs)))
    table: Any = None
    with self.memo.lock:
      # Anything else (a bound method is a new object at every access, an
      # unhashable argument) is traced each time.
      if None not in key and isinstance(method, (str, type(None))):
        table, key = self.memo.classes, (method, *key)
      elif None not in key and isinstance(method, types.FunctionType):
        table = self.memo.by_function.setdefault(method, {})
      if table is not None and key in table:
        classes, boundaries = table[key]
        return dict(classes), set(boundaries)
    fn = _call_method(method)
    rng_names = list(getattr(self.scope, "rngs", {}) or {})
    module = self.module.clone(parent=None)

    def trace(v: Any, a: tuple, k: dict) -> Any:
      with nn.intercept_methods(_interceptor(call)):
        return module.apply(v, *a, method=lambda m, *a2, **k2: fn(m, *a2, **k2),
                            rngs={n: jax.random.key(0) for n in rng_names},
                            mutable=True, **k)

    # Arrays are traced; everything else (flags such as `train`) stays a
    # Python value, as the model's own code expects.
    arrays, rebuild = _jaxpr.split_array_args((dict(variables), args, kwargs))
    _STATE.depth += 1
    try:
      call = _Call(self.rule_set, (), {}, False)
      jax.eval_shape(lambda *xs: trace(*rebuild(xs)), *arrays)
    finally:
      _STATE.depth -= 1
    self.rule_set.check_strict(call.classes)
    if table is not None:
      with self.memo.lock:
        table[key] = (dict(call.classes), set(call.boundaries))
    return call.classes, call.boundaries

  @nn.nowrap
  def init(self, rngs: Any, *args: Any, method: Any = None,
           **kwargs: Any) -> Any:
    """Like ``flax.linen.Module.init``; params come back in their param dtypes.

    Args:
      rngs: a PRNG key or dict of keys.
      *args: example inputs.
      method: the wrapped module's method to trace (name or function).
      **kwargs: more inputs, and ``init``'s own options (``mutable=``).

    Returns:
      The variables.
    """
    return super().init(rngs, *args, method=self._method(method), **kwargs)

  @nn.nowrap
  def init_with_output(self, rngs: Any, *args: Any, method: Any = None,
                       **kwargs: Any) -> Any:
    """Like ``flax.linen.Module.init_with_output``, under the policy.

    Args:
      rngs: a PRNG key or dict of keys.
      *args: example inputs.
      method: the wrapped module's method to trace (name or function).
      **kwargs: more inputs and ``init_with_output``'s options.

    Returns:
      ``(output, variables)``.
    """
    return super().init_with_output(rngs, *args, method=self._method(method),
                                    **kwargs)

  @nn.nowrap
  def apply(self, variables: Any, *args: Any, method: Any = None,
            **kwargs: Any) -> Any:
    """Like ``flax.linen.Module.apply``, under the policy.

    Args:
      variables: variables from :meth:`init` (or any with the same structure).
      *args: inputs.
      method: the wrapped module's method to call (name or function).
      **kwargs: more inputs, and ``apply``'s own options (``rngs=``,
        ``mutable=``: updated collections keep their stored dtypes).

    Returns:
      What the wrapped module's ``apply`` returns.
    """
    method = _as_method(method)
    if self.cache_traces:
      out = _traced_apply(self, variables, args, method, kwargs)
      if out is not _UNCACHED:
        return out
    return super().apply(variables, *args, method=self._method(method),
                         **kwargs)

  @nn.nowrap
  def _method(self, method: Any) -> Callable[..., Any]:
    if getattr(method, "_jmp_lite_run", False):
      return method  # Already translated (Module.init calls init_with_output).
    method = _as_method(method)
    _call_method(method)  # Validates.

    def run(mp: MixedPrecision, *a: Any, **k: Any) -> Any:
      return _policy_call(method)(mp, *a, **k)

    run._jmp_lite_run = True  # type: ignore[attr-defined]
    return run

  @nn.nowrap
  def policy_for(self, variables: Any, *args: Any, method: Any = None,
                 **kwargs: Any) -> dict[str, str]:
    """The policy of every module path, as ``{"a/b": "p=..,c=..,o=.."}``.

    Args:
      variables: the model's variables.
      *args: example inputs.
      method: the method to trace.
      **kwargs: more inputs.

    Returns:
      A dict from module path (``""`` for the root) to policy string.
    """
    method = _as_method(method)

    def discover(mp: MixedPrecision, *a: Any, **k: Any) -> Any:
      return mp._discover(method, a, k)

    classes, _ = nn.Module.apply(self, variables, *args, method=discover,
                                 **kwargs)
    resolved = self.rule_set.resolve(classes)
    return {"/".join(p): str(r.policy) for p, r in sorted(resolved.items())}


def mixed_precision(
    module: nn.Module,
    policy: Policy | str,
    *,
    rules: Sequence[Any] = (),
    float32_norms: bool = True,
    strict: bool = False,
    enabled: bool = True,
    remat_norms: bool = False,
    cache_traces: bool = True,
) -> MixedPrecision:
  """Puts a ``flax.linen`` module under a precision policy.

  Args:
    module: any linen module; it is not modified. Its layers' own
      ``dtype=``/``param_dtype=`` fields are overridden by the policy.
    policy: the default :class:`~jmp_lite.Policy` or policy string.
    rules: ``(matcher, policy)`` pairs or :class:`Rule`\\ s: by module class or
      by path pattern; first match wins, children inherit. The policy of a
      rule may be an FP8 recipe (``(nn.Dense, jmp_lite.fp8.CurrentScaling())``):
      the matched ``Dense``/``DenseGeneral``/attention layers then run their
      matmuls in FP8 (delayed scaling keeps its state in the ``"fp8"``
      collection, created by ``init``; see :mod:`jmp_lite.fp8`).
    float32_norms: append ``Rule(NORM_LAYERS, p=f32,c=f32,o=<compute>)``
      after your rules: LayerNorm, BatchNorm, RMSNorm, GroupNorm and
      InstanceNorm compute (and keep their params and statistics) in float32
      and hand their output back in the model's compute dtype.
    strict: raise if one of *your* rules matches no module.
    enabled: ``False`` runs everything in float32, without changing your code
      (PyTorch's ``autocast(enabled=False)``).
    remat_norms: recompute the float32 normalisation islands in the backward
      pass (``nn.remat``) instead of saving their float32 intermediates: the
      residuals a half-precision model keeps for the backward pass shrink to
      about half of float32's, for one more normalisation per layer.
    cache_traces: inside a trace (``jax.jit``, ``grad``...), ``apply`` runs
      as a nested ``jax.jit`` keyed by the model, ``method``, the arguments'
      shapes, dtypes and Python values and Flax's logical axis rules, so a
      later trace of the same call (another ``jax.jit`` of an eval step, a
      re-jit in a notebook) reuses the traced model instead of tracing it
      again; the compiled step is the same (XLA inlines the call). Like any
      ``jax.jit``, it assumes the model's Python code is pure: ``False``
      traces every call afresh. Eager calls, calls inside
      ``nn.intercept_methods``, unhashable Python arguments, NumPy array
      arguments and models returning non-array values are never cached.

  Returns:
    A :class:`MixedPrecision` module.

  Raises:
    TypeError: for a model that is not a linen module, a rule matcher that
      is not a linen Module subclass, str or regex, or a policy that is not a
      policy.
    ValueError: for a bad path regex or policy string; with ``strict``, from
      ``init``/``apply`` when a rule matches nothing.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, jmp_lite.linen
    >>> class MLP(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):  # dtype=float32 is overridden by the policy.
    ...     x = nn.Dense(4, dtype=jnp.float32)(x)
    ...     return nn.Dense(2)(nn.LayerNorm()(x))
    >>> model = jmp_lite.linen.mixed_precision(MLP(), "p=f32,c=bf16,o=f32")
    >>> variables = model.init(jax.random.key(0), jnp.ones((1, 3)))
    >>> model.apply(variables, jnp.ones((1, 3))).dtype
    dtype('float32')
    >>> model.policy_for(variables, jnp.ones((1, 3)))["LayerNorm_0"]
    'p=f32,c=f32,o=bf16'
  """
  if isinstance(module, MixedPrecision):
    module = module.module  # Re-wrapping replaces the policy.
  if not isinstance(module, nn.Module):
    raise TypeError(
        f"mixed_precision expects a flax.linen.Module instance, got"
        f" {type(module).__name__}: {module!r}"
        + ("; instantiate the class first, e.g. Model()"
           if isinstance(module, type) else ""))
  rule_set = _rules.rule_set(policy, rules, (nn.Module,), "flax.linen",
                             norm_layers=NORM_LAYERS,
                             float32_norms=float32_norms, strict=strict,
                             enabled=enabled)
  if not isinstance(remat_norms, bool):
    raise TypeError(f"remat_norms must be a bool, got {remat_norms!r}")
  if not isinstance(cache_traces, bool):
    raise TypeError(f"cache_traces must be a bool, got {cache_traces!r}")
  return MixedPrecision(module=module, rule_set=rule_set,
                        remat_norms=remat_norms, cache_traces=cache_traces)


def dot_product_attention_fp32(
    query: jax.Array, key: jax.Array, value: jax.Array, bias: Any = None,
    mask: Any = None, broadcast_dropout: bool = True, dropout_rng: Any = None,
    dropout_rate: float = 0.0, deterministic: bool = False, dtype: Any = None,
    precision: Any = None, module: Any = None,
    force_fp32_for_softmax: bool = False, is_causal: bool = False,
) -> jax.Array:
  """``nn.dot_product_attention`` with logits and softmax in float32.

  Pass it as ``attention_fn=`` to ``nn.MultiHeadDotProductAttention`` or
  ``nnx.MultiHeadAttention`` (or use it in your own attention) to keep the
  numerically sensitive part of attention in float32 while the projections
  run in half precision. The weighted sum of values runs in the values'
  dtype. The float32 part runs in a :func:`jmp_lite.float32_region`, so
  :func:`dtype_report` shows its float32 matmul without flagging it.

  The parameters are Flax's own, by name: linen's attention passes only the
  keyword arguments its ``attention_fn`` names, so attention dropout works
  as with ``nn.dot_product_attention``.

  Args:
    query: ``[..., q, heads, depth]``.
    key: ``[..., k, heads, depth]``.
    value: ``[..., k, heads, depth_v]``.
    bias: optional additive logits bias.
    mask: optional boolean mask.
    broadcast_dropout: one dropout mask for all batch dimensions.
    dropout_rng: the dropout key (``None``: no dropout).
    dropout_rate: the attention weights' dropout rate.
    deterministic: no dropout when true.
    dtype: ignored (the weights are float32; the output has ``value``'s
      dtype).
    precision: ignored (float32 logits need no precision flag).
    module: given by both attention layers when called with
      ``sow_weights=True``: the float32 attention weights are sown as Flax's
      own function sows them, before dropout, into ``"intermediates"`` for a
      linen module or ``nnx.Intermediate`` for an nnx one, named
      ``attention_weights``.
    force_fp32_for_softmax: ignored (always float32 here).
    is_causal: mask keys after each query position (query ``i`` sees keys
      ``0..i``), combined with ``mask``; ``nnx.MultiHeadAttention`` passes it.

  Returns:
    ``[..., q, heads, depth_v]`` in ``value``'s dtype.

  Raises:
    TypeError: for a ``module`` that is not a Flax linen or nnx module.

  Example:
    >>> import jax.numpy as jnp, jmp_lite.linen
    >>> q = jnp.ones((1, 4, 2, 8), jnp.bfloat16)
    >>> jmp_lite.linen.dot_product_attention_fp32(q, q, q).dtype
    dtype(bfloat16)
  """
  del dtype, precision, force_fp32_for_softmax  # float32 by construction.
  if is_causal:
    q_len, k_len = query.shape[-3], key.shape[-3]
    causal = jnp.tril(jnp.ones((q_len, k_len), jnp.bool_))
    mask = causal if mask is None else jnp.logical_and(mask, causal)
  # Flax's own weights function for the module's kind: it sows where that
  # kind reads intermediates, before dropout, as Flax's attention does.
  weights_fn = (nn.dot_product_attention_weights if module is None
                else _weights_fn_for(module))
  # A named float32 region: `dtype_report` reads it as deliberate (no
  # mismatch) and `jmp_lite.autocast` leaves it as written.
  with float32_region():
    weights = weights_fn(
        query.astype(jnp.float32), key.astype(jnp.float32), bias=bias,
        mask=mask, broadcast_dropout=broadcast_dropout,
        dropout_rng=dropout_rng, dropout_rate=dropout_rate,
        deterministic=deterministic, dtype=jnp.float32, module=module)
  return jnp.einsum("...hqk,...khd->...qhd", weights.astype(value.dtype), value)


def _weights_fn_for(module: Any) -> Callable[..., jax.Array]:
  """Flax's attention-weights function that sows into ``module``'s kind."""
  if isinstance(module, nn.Module):
    return nn.dot_product_attention_weights
  from flax import nnx  # Imported here: linen users need not load nnx.
  if not isinstance(module, nnx.Module):
    raise TypeError("dot_product_attention_fp32: module= must be a flax"
                    " linen or nnx Module (it sows the attention weights),"
                    f" got {type(module).__name__}: {module!r}")
  from flax.nnx.nn.attention import dot_product_attention_weights
  return dot_product_attention_weights


def _own_params(tree: Any) -> dict[Path, Any]:
  """Each module path's own params (leaves that are not submodule dicts)."""
  out: dict[Path, Any] = {}

  def walk(node: Any, path: Path) -> None:
    own = {k: v for k, v in node.items() if not isinstance(v, Mapping)}
    if own:
      out[path] = own
    for k, v in node.items():
      if isinstance(v, Mapping):
        walk(v, path + (str(k),))

  if isinstance(tree, Mapping):
    walk(tree, ())
  return out


def dtype_report(model: MixedPrecision, variables: Any, *args: Any,
                 method: Any = None, **kwargs: Any) -> DtypeReport:
  """Traces ``model`` once (abstractly) and reports what every module computed.

  Nothing is guessed: the dtypes each module's matmuls and convolutions ran in
  are read from the traced jaxpr, and its input, output and param dtypes are
  captured inside each call. A module whose matmuls ran in another dtype than
  its policy says is flagged (:meth:`DtypeReport.mismatches`).

  Args:
    model: a :class:`MixedPrecision` model.
    variables: its variables (from ``model.init``; a ``FrozenDict`` works).
    *args: example inputs.
    method: the method to trace.
    **kwargs: more inputs.

  Returns:
    A :class:`DtypeReport`.

  Raises:
    TypeError: if ``model`` is not a :class:`MixedPrecision`.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, jmp_lite.linen
    >>> model = jmp_lite.linen.mixed_precision(
    ...     nn.Dense(2, dtype=jnp.float32), "c=bf16")
    >>> v = model.init(jax.random.key(0), jnp.ones((1, 3)))
    >>> row = jmp_lite.linen.dtype_report(model, v, jnp.ones((1, 3))).rows[0]
    >>> (row.stored, row.read, row.computed, row.outputs)
    ('float32', 'bfloat16', 'bfloat16', 'bfloat16')
  """
  if not isinstance(model, MixedPrecision):
    raise TypeError(
        "dtype_report expects a jmp_lite.linen.MixedPrecision (from"
        f" mixed_precision(...)), got {type(model).__name__}")
  recorder = _report.Recorder()
  method = _as_method(method)

  def run(mp: MixedPrecision, *a: Any, **k: Any) -> Any:
    # Nested policies inside record their modules here too.
    outer = _STATE.report
    _STATE.report = (recorder, tuple(mp.path), _STATE.depth)
    try:
      return _policy_call(method, recorder)(mp, *a, **k)
    finally:
      _STATE.report = outer

  def f(v: Any, a: tuple, k: dict) -> Any:
    return nn.Module.apply(model, v, *a, method=run, mutable=True, **k)

  arrays, rebuild = _jaxpr.split_array_args((dict(variables), args, kwargs))
  jaxpr = jax.make_jaxpr(lambda *xs: f(*rebuild(xs)))(*arrays)
  stored = _own_params(variables.get("params", {}))
  return recorder.report(jaxpr, stored,
                         tree_bytes(variables.get("params", {})))
