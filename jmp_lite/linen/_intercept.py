"""The method interceptor that puts each linen module call under its policy.

One :class:`Call` holds what one ``init``/``apply`` of a policy learns (the
module classes by path, nested policies' subtrees, the report's recorder); the
interceptor :func:`interceptor` captures it, so nothing is shared between
calls and nothing lives at module level. Used by :mod:`jmp_lite.linen`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _flax_compat as compat
from jmp_lite import dtypes as _dtypes
from jmp_lite import report as _report
from jmp_lite import rules as _rules
from jmp_lite.fp4._recipes import RECIPES as _FP4_RECIPES
from jmp_lite.policy import Policy

Path = tuple[str, ...]

POLICY_CALL = "jmp_lite_policy"
"""The method name interceptors see for a policy's call."""


def jmp_lite_policy(wrapper: Any, call: PolicyCall, *args: Any,
                    **kwargs: Any) -> Any:
  """The policy's call, as Flax runs it: ``wrapper._run(call, args, kwargs)``.

  Wrapped as a Flax method of the wrapper (:func:`_flax_linen_compat
  .wrap_method`): Flax runs the wrapper's ``setup`` (which shares the
  wrapped model's scope) before it, and interceptors see it, with the
  caller's arguments after ``call``. Under this name, which is no attribute
  of the wrapper, ``tabulate`` lists the wrapped model's own call in its
  place (as for the bare model), and ``capture_intermediates`` (which
  captures ``__call__``) records the model's output once.

  Args:
    wrapper: the bound :class:`jmp_lite.linen.MixedPrecision`.
    call: what to run.
    *args: the method's arguments.
    **kwargs: its keyword arguments.

  Returns:
    The method's output under the policy.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, jmp_lite.linen
    >>> from jmp_lite.linen._intercept import PolicyCall
    >>> model = jmp_lite.linen.mixed_precision(nn.Dense(2), "c=bf16")
    >>> v = model.init(jax.random.key(0), jnp.ones((1, 3)))
    >>> nn.Module.apply(model, v, jnp.ones((1, 3)),
    ...                 method=PolicyCall(None)).dtype
    dtype(bfloat16)
  """
  return wrapper._run(call, args, kwargs)


_FLAX_POLICY_CALL = compat.wrap_method(jmp_lite_policy)


@dataclasses.dataclass(frozen=True)
class PolicyCall:
  """What a policy's call runs; Flax's ``method=`` for the wrapper.

  Calling it runs :func:`jmp_lite_policy`, which it is the first argument
  of: an enclosing policy's interceptor sees it when a nested policy is
  called and hands its report's recorder down in it (see
  :func:`interceptor`). Hashable: the traced-apply cache keys on it.

  Attributes:
    method: the wrapped model's method (``None``, a name or a function).
    recorder: set when tracing for a :func:`jmp_lite.linen.dtype_report`.

  Example:
    >>> from jmp_lite.linen._intercept import PolicyCall
    >>> PolicyCall("encode") == PolicyCall("encode")
    True
  """

  method: Any = None
  recorder: _report.Recorder | None = None

  def __call__(self, wrapper: Any, *args: Any, **kwargs: Any) -> Any:
    """Runs the wrapped model's method under ``wrapper``'s policy."""
    return _FLAX_POLICY_CALL(wrapper, self, *args, **kwargs)


def is_flax_layer(module: nn.Module) -> bool:
  """Whether ``module`` is (a subclass of) one of Flax's own dtype'd layers.

  Args:
    module: a linen module.

  Returns:
    Whether its class descends from a ``flax.linen`` class with ``dtype``.

  Example:
    >>> import flax.linen as nn
    >>> from jmp_lite.linen._intercept import is_flax_layer
    >>> is_flax_layer(nn.Dense(2)), is_flax_layer(nn.Dropout(0.1))
    (True, False)
  """
  fields = getattr(type(module), "__dataclass_fields__", {})
  if "dtype" not in fields:
    return False
  return any(c.__module__.startswith("flax.linen.")
             for c in type(module).__mro__
             if c is not nn.Module and issubclass(c, nn.Module))


def _is_real_call(context: Any) -> bool:
  name = context.method_name
  return not (name == "setup" or name.startswith("<"))


@dataclasses.dataclass
class Call:
  """Bookkeeping for one ``init``/``apply`` of a policy (never shared).

  Attributes:
    rule_set: the policy and rules.
    root: the wrapped model's absolute module path.
    classes: relative module path -> class, as seen (or discovered).
    initializing: whether params are being created.
    remat_norms: recompute float32 islands in the backward pass.
    recorder: set when tracing for a report.
    resolved: relative path -> resolution, filled lazily from ``classes``.
    rematting: islands whose recomputed inner call comes next.
    boundaries: paths of nested policies (they run their own subtrees).
    root_depth: nesting of root calls: only the outermost casts out.
    nested: how many nested policies' calls are open. Interceptors are
      global: everything a nested policy runs (its model, and the abstract
      trace it makes of it from a fresh root) passes this interceptor too.

  Example:
    >>> import flax.linen as nn, jmp_lite.rules
    >>> from jmp_lite.linen._intercept import Call
    >>> rs = jmp_lite.rules.rule_set("c=bf16", [], (nn.Module,), "linen",
    ...                              norm_layers=(nn.LayerNorm,))
    >>> call = Call(rs, root=("model",), classes={}, initializing=False)
    >>> str(call.policy_at(("LayerNorm_0",)))
    'p=f32,c=bf16,o=bf16'
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
  root_depth: int = 0
  nested: int = 0

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
    """Whether ``path`` belongs to a nested policy."""
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


def creation_dtype(policy: Policy) -> np.dtype:
  """The dtype Flax layers draw their params in under ``policy``.

  At least float32, then stored in the param dtype, so that every policy
  starts from the same (rounded) weights.

  Args:
    policy: the layer's policy.

  Returns:
    ``promote_types(param_dtype, float32)``.

  Example:
    >>> import jmp_lite
    >>> from jmp_lite.linen._intercept import creation_dtype
    >>> creation_dtype(jmp_lite.get_policy("bf16"))
    dtype('float32')
  """
  return np.dtype(jnp.promote_types(policy.param_dtype, jnp.float32))


def interceptor(call: Call) -> Callable[..., Any]:
  """The ``nn.intercept_methods`` interceptor of one policy call.

  Casts each call's inputs to its module's compute dtype and its outputs to
  its output dtype, runs Flax's layers with the policy's ``dtype`` and
  ``param_dtype``, and records calls for a report.

  Args:
    call: the bookkeeping of this ``init``/``apply``.

  Returns:
    The interceptor.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, jmp_lite.rules
    >>> from jmp_lite.linen._intercept import Call, interceptor
    >>> rs = jmp_lite.rules.rule_set("c=bf16", [], (nn.Module,), "linen")
    >>> layer = nn.Dense(2, dtype=jnp.float32)
    >>> v = layer.init(jax.random.key(0), jnp.ones((1, 3)))
    >>> with nn.intercept_methods(interceptor(Call(rs, (), {}, False))):
    ...   y = layer.apply(v, jnp.ones((1, 3)))
    >>> y.dtype
    dtype(bfloat16)
  """

  def intercept(next_fun: Callable[..., Any], args: tuple, kwargs: dict,
                context: Any) -> Any:
    module = context.module
    if not _is_real_call(context) or call.nested:
      return next_fun(*args, **kwargs)
    if (context.method_name == POLICY_CALL and args
        and isinstance(args[0], PolicyCall)):
      return _nested_policy(call, module, next_fun, args, kwargs)
    path = call.relative(module)
    if path is None:
      return next_fun(*args, **kwargs)
    resolved = call.resolve(path, type(module))
    policy = resolved.policy
    cast_args, cast_kwargs = _rules.cast_inputs((args, kwargs),
                                                policy.compute_dtype)
    if path in call.rematting:
      # The inner call of a recomputed island casts its inputs itself: the
      # cast is recomputed too, so the backward pass saves the input as
      # given (bfloat16), not its float32 copy.
      call.rematting.discard(path)
      return _run_layer(module, resolved, next_fun, cast_args, cast_kwargs)
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
              module, *args, **kwargs)
        else:
          out = _run_layer(module, resolved, next_fun, cast_args,
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


def _nested_policy(call: Call, module: nn.Module,
                   next_fun: Callable[..., Any], args: tuple,
                   kwargs: dict) -> Any:
  """A policy's call seen by another's interceptor: ours runs its own.

  A policy nested in our model gets inputs in our compute dtype; its modules
  follow its own rules and it casts its own outputs. While it runs, this
  interceptor stands aside (see :attr:`Call.nested`): everything it runs is
  its own, the abstract trace it makes of its model from a fresh root
  included. A report's recorder goes down to it in its :class:`PolicyCall`,
  so that its modules become rows of this report at their paths from ours.
  """
  spec, rest = args[0], args[1:]
  full = tuple(module.path)
  if full[:len(call.root)] != call.root:
    return next_fun(*args, **kwargs)  # Not in our model (a fresh root).
  path = full[len(call.root):]
  if not path:
    # Our own policy's call (a method of the wrapper calling another).
    return next_fun(*args, **kwargs)
  policy = call.resolve(path, type(module)).policy
  cast_args, cast_kwargs = _rules.cast_inputs((rest, kwargs),
                                              policy.compute_dtype)
  if call.recorder is not None:
    spec = dataclasses.replace(spec, recorder=call.recorder.under(path))
  call.boundaries.add(path)
  call.nested += 1
  try:
    return next_fun(spec, *cast_args, **cast_kwargs)
  finally:
    call.nested -= 1


def _run_layer(module: nn.Module, resolved: _rules.Resolved,
               next_fun: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
  if not is_flax_layer(module):
    return next_fun(*args, **kwargs)
  policy = resolved.policy
  values = {"dtype": policy.compute_dtype,
            "param_dtype": creation_dtype(policy)}
  if resolved.fp8 is not None:
    if isinstance(resolved.fp8, _FP4_RECIPES):
      from jmp_lite.fp4 import linen as fp8_linen  # FP4: the same fields.
    else:
      from jmp_lite.fp8 import linen as fp8_linen  # Flax, on demand.
    try:
      values.update(fp8_linen.layer_fields(resolved.fp8, type(module)))
    except TypeError:
      pass  # No matmul to put in FP8 (norms, convolutions, embeddings).
  with compat.fields_overridden(module, values):
    return next_fun(*args, **kwargs)


def cast_params(params: Any, call: Call, which: str) -> Any:
  """Casts each param to its module's param (or compute) dtype, by path.

  Args:
    params: the ``"params"`` collection.
    call: the bookkeeping holding each path's class.
    which: ``"param"`` or ``"compute"``.

  Returns:
    The params, cast; a nested policy's are left to it.

  Example:
    >>> import jax.numpy as jnp, flax.linen as nn, jmp_lite.rules
    >>> from jmp_lite.linen._intercept import Call, cast_params
    >>> rs = jmp_lite.rules.rule_set("c=bf16", [], (nn.Module,), "linen")
    >>> call = Call(rs, (), {(): nn.Dense}, False)
    >>> cast_params({"kernel": jnp.ones(2)}, call, "compute")["kernel"].dtype
    dtype(bfloat16)
  """

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


def restore_dtypes(new: Any, old: Any) -> Any:
  """Casts written collections back to the dtypes they were stored in.

  Args:
    new: a collection as the call left it.
    old: the same collection as stored before the call.

  Returns:
    ``new``, each floating leaf in its stored dtype (new leaves as made).

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite.linen._intercept import restore_dtypes
    >>> new = {"mean": jnp.ones(2, jnp.bfloat16)}
    >>> restore_dtypes(new, {"mean": jnp.zeros(2)})["mean"].dtype
    dtype('float32')
  """
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
