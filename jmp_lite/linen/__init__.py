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

How: every module call goes through ``flax.linen.intercept_methods``, with an
interceptor made for that one ``init``/``apply``
(``jmp_lite.linen._intercept``); while a Flax layer runs, Flax's per-call
bound copy of it (never a module you hold) has the policy's
``dtype``/``param_dtype`` (the one Flax internal this takes is in
``jmp_lite._flax_compat``). Params are cast by
``flax.linen.map_variables``, which needs each module path's class up front:
the first call with new shapes traces the model abstractly once to learn
them, and remembers them for later calls (``jmp_lite.linen._cache``).
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax

from jmp_lite import _jaxpr
from jmp_lite import rules as _rules
from jmp_lite.linen._attention import dot_product_attention_fp32
from jmp_lite.linen._cache import apply_arrays as _apply_arrays  # noqa: F401
from jmp_lite.linen._cache import (
  aval_key,
  lookup,
  Memo,
  traced_apply,
  UNCACHED,
)
from jmp_lite.linen._intercept import (
  Call,
  cast_params,
  interceptor,
  PolicyCall,
  restore_dtypes,
)
from jmp_lite.linen._report import trace_report
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

# `_apply_arrays` (imported above) is the function a policy's traced applies
# are compiled from, under the name tests/conftest.py knows: it leaves that
# nested jax.jit's compiler options alone.


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
    return PolicyCall(self.name)(self.wrapper, *args, **kwargs)


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
    memo: the discovered module classes and traced applies (a cache of the
      fields above; no part of the wrapper's equality or hash, shared by
      Flax's clones of it).
  """

  module: nn.Module
  rule_set: _rules.RuleSet
  remat_norms: bool = False
  cache_traces: bool = True
  memo: Memo = dataclasses.field(default_factory=Memo, compare=False,
                                 repr=False)

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
    return PolicyCall(None)(self, *args, **kwargs)

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
  def _run(self, policy_call: PolicyCall, args: tuple, kwargs: dict) -> Any:
    # Not a Flax-wrapped method: interceptors and `tabulate` see the
    # wrapper's call (`jmp_lite_policy`) with the caller's arguments, never
    # our bookkeeping. That call ran `setup`.
    method = policy_call.method
    fn = _call_method(method)
    call = Call(self.rule_set, tuple(self.path), {}, self.is_initializing(),
                self.remat_norms, policy_call.recorder)
    if call.initializing:
      def trans_out(variables: Any) -> Any:
        variables = dict(variables)
        if "params" in variables:
          variables["params"] = cast_params(variables["params"], call,
                                             "param")
        return variables

      def trans_in(variables: Any) -> Any:
        variables = dict(variables)
        if "params" in variables:
          variables["params"] = cast_params(variables["params"], call,
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
        variables["params"] = cast_params(variables["params"], call,
                                           "compute")
      return variables

    def restore_out(variables: Any) -> Any:
      return {k: restore_dtypes(v, stored.get(k, {}))
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
  def _intercepted(self, call: Call, fn: Callable[..., Any], module: Any,
                   args: tuple, kwargs: dict) -> Any:
    with nn.intercept_methods(interceptor(call)):
      return fn(module, *args, **kwargs)

  @nn.nowrap
  def _discover(self, method: Any, args: tuple, kwargs: dict
                ) -> tuple[dict[Path, type], set[Path]]:
    """Each module path's class, from one abstract trace (memoised)."""
    variables = self.variables
    table, key = lookup(self.memo, method, (
        aval_key(dict(variables)), aval_key((args, kwargs))))
    if table is not None:
      with self.memo.lock:
        if key in table:
          classes, boundaries = table[key]
          return dict(classes), set(boundaries)
    fn = _call_method(method)
    rng_names = list(getattr(self.scope, "rngs", {}) or {})
    module = self.module.clone(parent=None)
    # A policy at the root of a fresh apply: paths from the model itself.
    call = Call(self.rule_set, (), {}, False)

    def trace(v: Any, a: tuple, k: dict) -> Any:
      with nn.intercept_methods(interceptor(call)):
        return module.apply(v, *a, method=lambda m, *a2, **k2: fn(m, *a2, **k2),
                            rngs={n: jax.random.key(0) for n in rng_names},
                            mutable=True, **k)

    # Arrays are traced; everything else (flags such as `train`) stays a
    # Python value, as the model's own code expects.
    arrays, rebuild = _jaxpr.split_array_args((dict(variables), args, kwargs))
    jax.eval_shape(lambda *xs: trace(*rebuild(xs)), *arrays)
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
    run = self._method(method)
    if self.cache_traces:
      out = traced_apply(self, variables, args, run, kwargs)
      if out is not UNCACHED:
        return out
    return super().apply(variables, *args, method=run, **kwargs)

  @nn.nowrap
  def _method(self, method: Any) -> PolicyCall:
    """``method=`` as Flax's ``init``/``apply`` of the wrapper take it."""
    if isinstance(method, PolicyCall):
      return method  # Already translated (Module.init calls init_with_output).
    method = _as_method(method)
    _call_method(method)  # Validates.
    return PolicyCall(method)

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
  return trace_report(model, variables, _as_method(method), args, kwargs)
