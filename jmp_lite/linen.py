"""Apply a precision policy to any ``flax.linen`` module without editing it.

:func:`mixed_precision` wraps a module (a model you wrote, or one you import)
in an object with the module's own ``init``/``apply`` signatures. Nothing in
the module needs a ``dtype=`` argument:

* **params** are stored in the param dtype and cast to the compute dtype when
  the model is applied (the cast is part of the differentiated function, so
  gradients come back in the param dtype);
* **inputs** of every module call are cast to that module's compute dtype
  (through ``flax.linen.intercept_methods``);
* **outputs**: the root module's are cast to the policy's output dtype, a
  module that has a rule of its own returns its rule's output dtype, and
  every other module returns its compute dtype;
* **mutable collections** (``batch_stats``) keep the dtype they were stored in.

Rules give modules other policies: ``(nn.LayerNorm, "f32")`` by class, or
``("decoder/logits", "f32")`` by path (``re.fullmatch`` on the ``/``-joined
module path). The first matching rule wins; a module without a match inherits
the policy of its nearest ancestor that has one (ancestors found by path, so
``nn.scan``/``nn.remat``/``nn.jit``-lifted modules behave like the others).
By default normalisation layers are float32 islands.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Iterable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import dtypes as _dtypes
from jmp_lite.diagnostics import tree_bytes
from jmp_lite.policy import Policy, get_policy

NORM_LAYERS: tuple[type, ...] = (nn.LayerNorm, nn.BatchNorm, nn.RMSNorm,
                                 nn.GroupNorm)
"""The layers kept in float32 by default (Paddle O2, Apex keep_batchnorm_fp32)."""

Matcher = Any  # A flax Module subclass, a tuple of them, a str or re.Pattern.


@dataclasses.dataclass(frozen=True)
class Rule:
  """Gives the modules that match ``matcher`` their own policy.

  Attributes:
    matcher: a ``flax.linen.Module`` subclass (or tuple of them), matched with
      ``isinstance``; or a path pattern (``str`` or ``re.Pattern``), matched
      with ``re.fullmatch`` against the ``/``-joined module path.
    policy: the :class:`~jmp_lite.Policy` (or policy string) for them.

  Example:
    >>> import flax.linen as nn, jmp_lite.linen
    >>> rule = jmp_lite.linen.Rule(nn.LayerNorm, "f32")
    >>> str(rule.policy)
    'p=f32,c=f32,o=f32'
  """

  matcher: Matcher
  policy: Any

  def __post_init__(self) -> None:
    m = self.matcher
    if isinstance(m, str):
      try:
        m = re.compile(m)
      except re.error as e:
        raise ValueError(f"Bad module path pattern {self.matcher!r}: {e}") from None
    elif isinstance(m, type):
      m = (m,)
    if isinstance(m, tuple):
      bad = [c for c in m if not (isinstance(c, type) and issubclass(
          c, _module_bases()))]
      if bad or not m:
        raise TypeError(
            f"Rule matcher classes must be flax.linen.Module (or flax.nnx."
            f"Module) subclasses, got {bad or m!r}"
        )
    elif not isinstance(m, re.Pattern):
      raise TypeError(
          "Rule matcher must be a flax.linen.Module subclass, a tuple of them,"
          f" or a path pattern (str / re.Pattern); got {type(m).__name__}:"
          f" {m!r}"
      )
    policy = self.policy
    if isinstance(policy, str):
      policy = get_policy(policy)
    if not isinstance(policy, Policy):
      raise TypeError(
          f"Rule policy must be a jmp_lite.Policy or policy string, got"
          f" {policy!r}"
      )
    object.__setattr__(self, "matcher", m)
    object.__setattr__(self, "policy", policy)

  def matches(self, path: tuple[str, ...], cls: type) -> bool:
    """Whether the module at ``path`` of class ``cls`` matches.

    Args:
      path: the module path, e.g. ``("encoder", "Dense_0")``.
      cls: the module's class.

    Returns:
      The match.
    """
    if isinstance(self.matcher, re.Pattern):
      return self.matcher.fullmatch("/".join(path)) is not None
    return issubclass(cls, self.matcher)

  def describe(self) -> str:
    """A short text for error messages and reports."""
    if isinstance(self.matcher, re.Pattern):
      return f"path {self.matcher.pattern!r} -> {self.policy}"
    names = ", ".join(c.__name__ for c in self.matcher)
    return f"class {names} -> {self.policy}"


def _module_bases() -> tuple[type, ...]:
  from flax import nnx  # Local: nnx is only needed when nnx rules are used.
  return (nn.Module, nnx.Module)


def _to_rules(rules: Iterable[Any]) -> tuple[Rule, ...]:
  out = []
  for r in rules:
    if isinstance(r, Rule):
      out.append(r)
    elif isinstance(r, tuple) and len(r) == 2:
      out.append(Rule(*r))
    else:
      raise TypeError(
          f"Each rule must be a jmp_lite.linen.Rule or a (matcher, policy)"
          f" pair, got {r!r}"
      )
  return tuple(out)


@dataclasses.dataclass
class _Resolver:
  """Per-call bookkeeping: path -> class, and the policy each path resolves to.

  Lives only for one init/apply call (never module-level state).
  """

  default: Policy
  rules: tuple[Rule, ...]
  classes: dict[tuple[str, ...], type] = dataclasses.field(default_factory=dict)
  used: set[int] = dataclasses.field(default_factory=set)
  depth: int = 0  # Nesting of intercepted calls: 0 is the root call.

  def own_rule(self, path: tuple[str, ...]) -> Rule | None:
    cls = self.classes.get(path)
    if cls is None:
      return None
    for i, rule in enumerate(self.rules):
      if rule.matches(path, cls):
        self.used.add(i)
        return rule
    return None

  def policy_for(self, path: tuple[str, ...]) -> Policy:
    for n in range(len(path), -1, -1):
      rule = self.own_rule(path[:n])
      if rule is not None:
        return rule.policy
    return self.default


def _is_real_call(context: Any) -> bool:
  name = context.method_name
  return not (name == "setup" or name.startswith("<"))


def _interceptor(resolver: _Resolver,
                 record: Callable[..., None] | None = None) -> Callable:
  def intercept(next_fun, args, kwargs, context):
    if not _is_real_call(context):
      return next_fun(*args, **kwargs)
    module = context.module
    path = tuple(module.path)
    is_root = resolver.depth == 0
    resolver.classes.setdefault(path, type(module))
    policy = resolver.policy_for(path)
    args, kwargs = policy.cast_to_compute((args, kwargs))
    resolver.depth += 1
    try:
      out = next_fun(*args, **kwargs)
    finally:
      resolver.depth -= 1
    rule = resolver.own_rule(path)
    if is_root:
      out = resolver.default.cast_to_output(out)
    elif rule is not None:
      out = rule.policy.cast_to_output(out)
    else:
      # A no-op in apply; in init (params not yet cast) it keeps dtypes the
      # same as in apply, which lax.scan carries require.
      out = policy.cast_to_compute(out)
    if record is not None:
      record(path, type(module), policy, args, kwargs, out,
             dict(module.variables.get("params", {})))
    return out

  return intercept


def _cast_params(params: Any, resolver: _Resolver, which: str) -> Any:
  """Casts each param to its module's param or compute dtype."""

  def cast(path, leaf):
    names = tuple(getattr(k, "key", getattr(k, "name", str(k))) for k in path)
    module_path = names[:-1]  # The last key names the param itself.
    policy = resolver.policy_for(module_path)
    dtype = policy.param_dtype if which == "param" else policy.compute_dtype
    if _dtypes.is_floating_array(leaf) and leaf.dtype != dtype:
      return leaf.astype(dtype)
    return leaf

  return jax.tree_util.tree_map_with_path(cast, params)


def _restore_dtypes(new: Any, old: Any) -> Any:
  """Casts mutated collections back to the dtypes they were stored in."""
  old_dtypes = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(old)[0]:
    if hasattr(leaf, "dtype"):
      old_dtypes[jax.tree_util.keystr(path)] = leaf.dtype

  def cast(path, leaf):
    dtype = old_dtypes.get(jax.tree_util.keystr(path))
    if dtype is not None and _dtypes.is_floating_array(leaf) and leaf.dtype != dtype:
      return leaf.astype(dtype)
    return leaf

  return jax.tree_util.tree_map_with_path(cast, new)


FLOAT32 = Policy(jnp.float32, jnp.float32, jnp.float32)


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
  """A ``flax.linen`` module under a precision policy; see :func:`mixed_precision`.

  Attributes:
    module: the wrapped module (unchanged).
    policy: the default policy.
    rules: per-class and per-path rules, first match wins; the float32
      normalisation islands come after the user's rules.
    strict: if true, every user rule must match some module.
    enabled: if false, everything runs in float32.
  """

  module: nn.Module
  policy: Policy
  rules: tuple[Rule, ...]
  strict: bool
  enabled: bool
  n_user_rules: int

  def _resolver(self) -> _Resolver:
    if not self.enabled:
      return _Resolver(FLOAT32, ())
    return _Resolver(self.policy, self.rules)

  def _discover(self, variables: Any, args: tuple, kwargs: dict,
                method: Any, rngs: Any) -> _Resolver:
    """Traces the model once (abstractly) to learn each module path's class."""
    resolver = self._resolver()
    # Inputs are closed over, not traced: Python flags such as
    # `deterministic` must stay Python values.
    with nn.intercept_methods(_interceptor(resolver)):
      jax.eval_shape(
          lambda v: self.module.apply(v, *args, rngs=rngs, method=method,
                                      mutable=True, **kwargs),
          variables)
    self._check_strict(resolver)
    return resolver

  def _check_strict(self, resolver: _Resolver) -> None:
    if not (self.strict and self.enabled):
      return
    unused = [self.rules[i].describe() for i in range(self.n_user_rules)
              if i not in resolver.used]
    if unused:
      seen = ", ".join(
          f"{'/'.join(p) or '<root>'} ({c.__name__})"
          for p, c in sorted(resolver.classes.items()))
      raise ValueError(
          f"strict=True: rule(s) matched no module: {unused}; modules seen:"
          f" {seen}"
      )

  def init(self, rngs: Any, *args: Any, method: Any = None,
           **kwargs: Any) -> Any:
    """Like ``module.init``; params come back in their param dtypes.

    Args:
      rngs: a PRNG key or dict of keys, as for ``flax.linen.Module.init``.
      *args: example inputs.
      method: the method to trace, as for ``init``.
      **kwargs: more inputs, as for ``init``.

    Returns:
      The variables; ``params`` are in each module's param dtype, other
      collections as the module created them.
    """
    resolver = self._resolver()
    with nn.intercept_methods(_interceptor(resolver)):
      variables = self.module.init(rngs, *args, method=method, **kwargs)
    self._check_strict(resolver)
    if "params" in variables:
      variables = dict(variables)
      variables["params"] = _cast_params(variables["params"], resolver, "param")
    return variables

  def apply(self, variables: Any, *args: Any, rngs: Any = None,
            method: Any = None, mutable: Any = False, **kwargs: Any) -> Any:
    """Like ``module.apply``, under the policy.

    Args:
      variables: variables from :meth:`init` (or any with the same structure).
      *args: inputs.
      rngs: PRNG keys, as for ``apply``.
      method: the method to call, as for ``apply``.
      mutable: collections to return updated, as for ``apply``; their updates
        keep the stored dtypes (``batch_stats`` stay float32).
      **kwargs: more inputs.

    Returns:
      What ``module.apply`` returns.
    """
    resolver = self._discover(variables, args, kwargs, method, rngs)
    cast_vars = dict(variables)
    if "params" in cast_vars:
      cast_vars["params"] = _cast_params(cast_vars["params"], resolver,
                                         "compute")
    with nn.intercept_methods(_interceptor(resolver)):
      out = self.module.apply(cast_vars, *args, rngs=rngs, method=method,
                              mutable=mutable, **kwargs)
    if mutable is False:
      return out
    out, updated = out
    return out, _restore_dtypes(updated, variables)

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
    resolver = self._discover(variables, args, kwargs, method, None)
    return {"/".join(p): str(resolver.policy_for(p))
            for p in sorted(resolver.classes)}


def mixed_precision(
    module: nn.Module,
    policy: Policy | str,
    *,
    rules: Sequence[Any] = (),
    float32_norms: bool = True,
    strict: bool = False,
    enabled: bool = True,
) -> MixedPrecision:
  """Puts a ``flax.linen`` module under a precision policy.

  Args:
    module: any linen module; it is not modified.
    policy: the default :class:`~jmp_lite.Policy` or policy string.
    rules: ``(matcher, policy)`` pairs or :class:`Rule`\\ s: by module class or
      by path pattern; first match wins, children inherit.
    float32_norms: append ``Rule(NORM_LAYERS, p=f32,c=f32,o=<compute>)``
      after your rules: LayerNorm, BatchNorm, RMSNorm and GroupNorm compute
      (and keep their params and statistics) in float32 and hand their output
      back in the model's compute dtype.
    strict: raise if one of *your* rules matches no module.
    enabled: ``False`` runs everything in float32, without changing your code
      (PyTorch's ``autocast(enabled=False)``).

  Returns:
    A :class:`MixedPrecision` with ``init`` and ``apply``.

  Raises:
    TypeError: for a matcher that is not a linen Module subclass, str or
      regex, or a policy that is not a policy.
    ValueError: for a bad path regex; with ``strict``, from ``init``/``apply``
      when a rule matches nothing.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, jmp_lite.linen
    >>> class MLP(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     return nn.Dense(2)(nn.LayerNorm()(nn.Dense(4)(x)))
    >>> model = jmp_lite.linen.mixed_precision(MLP(), "p=f32,c=bf16,o=f32")
    >>> variables = model.init(jax.random.key(0), jnp.ones((1, 3)))
    >>> model.apply(variables, jnp.ones((1, 3))).dtype
    dtype('float32')
    >>> model.policy_for(variables, jnp.ones((1, 3)))["LayerNorm_0"]
    'p=f32,c=f32,o=bf16'
  """
  if not isinstance(module, nn.Module):
    raise TypeError(
        f"mixed_precision expects a flax.linen.Module, got"
        f" {type(module).__name__}"
    )
  policy, user, all_rules = policy_and_rules(policy, rules, float32_norms,
                                             NORM_LAYERS)
  return MixedPrecision(module=module, policy=policy, rules=all_rules,
                        strict=strict, enabled=enabled, n_user_rules=len(user))


def policy_and_rules(policy: Policy | str, rules: Sequence[Any],
                     float32_norms: bool, norm_layers: tuple[type, ...]
                     ) -> tuple[Policy, tuple[Rule, ...], tuple[Rule, ...]]:
  """Validates a policy and rules; appends the float32 norm island if asked.

  Shared by the linen and nnx adapters.

  Args:
    policy: a :class:`~jmp_lite.Policy` or policy string.
    rules: ``(matcher, policy)`` pairs or :class:`Rule` objects.
    float32_norms: whether to append the island rule for ``norm_layers``.
    norm_layers: the normalisation classes of the framework.

  Returns:
    ``(policy, user_rules, all_rules)``.

  Raises:
    TypeError: for a policy that is not a policy, or a malformed rule.
  """
  if isinstance(policy, str):
    policy = get_policy(policy)
  if not isinstance(policy, Policy):
    raise TypeError(f"policy must be a Policy or policy string, got {policy!r}")
  user = _to_rules(rules)
  all_rules = user
  if float32_norms:
    island = Policy(jnp.float32, jnp.float32, policy.compute_dtype)
    all_rules = user + (Rule(norm_layers, island),)
  return policy, user, all_rules


def dot_product_attention_fp32(query: jax.Array, key: jax.Array,
                               value: jax.Array, bias: Any = None,
                               mask: Any = None, **kwargs: Any) -> jax.Array:
  """``nn.dot_product_attention`` with logits and softmax in float32.

  Pass it as ``attention_fn=`` to ``nn.MultiHeadDotProductAttention`` (or use
  it in your own attention) to keep the numerically sensitive part of
  attention in float32 while the projections run in half precision. The
  weighted sum of values runs in the values' dtype.

  Args:
    query: ``[..., q, heads, depth]``.
    key: ``[..., k, heads, depth]``.
    value: ``[..., k, heads, depth_v]``.
    bias: optional additive logits bias.
    mask: optional boolean mask.
    **kwargs: forwarded to ``nn.dot_product_attention_weights``
      (``dropout_rng``, ``dropout_rate``, ``deterministic``, ...); ``dtype``
      and ``precision`` are ignored.

  Returns:
    ``[..., q, heads, depth_v]`` in ``value``'s dtype.

  Example:
    >>> import jax.numpy as jnp, jmp_lite.linen
    >>> q = jnp.ones((1, 4, 2, 8), jnp.bfloat16)
    >>> jmp_lite.linen.dot_product_attention_fp32(q, q, q).dtype
    dtype(bfloat16)
  """
  kwargs.pop("dtype", None)
  kwargs.pop("precision", None)
  kwargs.pop("module", None)
  kwargs.pop("force_fp32_for_softmax", None)
  weights = nn.dot_product_attention_weights(
      query.astype(jnp.float32), key.astype(jnp.float32),
      bias=bias, mask=mask, dtype=jnp.float32, **kwargs)
  return jnp.einsum("...hqk,...khd->...qhd", weights.astype(value.dtype), value)


def _float_dtypes(tree: Any) -> str:
  names = sorted({np.dtype(x.dtype).name for x in jax.tree.leaves(tree)
                  if _dtypes.is_floating_array(x)})
  return ",".join(names) if names else "-"


def _own(tree: Any) -> Any:
  """The leaves of a module's variable dict that are not submodules'."""
  if not isinstance(tree, dict):
    return {}
  return {k: v for k, v in tree.items() if not isinstance(v, dict)}


@dataclasses.dataclass(frozen=True)
class ReportRow:
  """One module call seen while tracing.

  Attributes:
    path: module path (``""`` for the root).
    cls: module class name.
    policy: the policy string the module resolved to.
    stored: dtypes of its own params as stored.
    read: dtypes of its own params as the module read them.
    inputs: floating dtypes of its inputs after casting.
    outputs: floating dtypes of its outputs.
    param_bytes: bytes of its own params as stored.
  """

  path: str
  cls: str
  policy: str
  stored: str
  read: str
  inputs: str
  outputs: str
  param_bytes: int


@dataclasses.dataclass(frozen=True)
class DtypeReport:
  """The dtypes every module of a model sees; print it, or show it in Jupyter.

  Attributes:
    rows: one :class:`ReportRow` per module call, in call order.
  """

  rows: tuple[ReportRow, ...]

  _HEADER = ("module", "class", "policy", "params stored", "params read",
             "inputs", "outputs", "param bytes")

  def _cells(self) -> list[tuple[str, ...]]:
    return [(r.path or "<root>", r.cls, r.policy, r.stored, r.read, r.inputs,
             r.outputs, f"{r.param_bytes:,}") for r in self.rows]

  def total_param_bytes(self) -> int:
    """Bytes of all params as stored."""
    return sum(r.param_bytes for r in self.rows)

  def __str__(self) -> str:
    cells = self._cells()
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h)
              for i, h in enumerate(self._HEADER)]
    fmt = lambda row: "  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip()
    lines = [fmt(self._HEADER), fmt(tuple("-" * w for w in widths))]
    lines += [fmt(c) for c in cells]
    lines.append(f"total param bytes: {self.total_param_bytes():,}")
    return "\n".join(lines)

  def _repr_html_(self) -> str:
    import html
    head = "".join(f"<th>{html.escape(h)}</th>" for h in self._HEADER)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in c) + "</tr>"
        for c in self._cells())
    return (f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody>"
            f"<tfoot><tr><td colspan=8>total param bytes:"
            f" {self.total_param_bytes():,}</td></tr></tfoot></table>")


def dtype_report(model: MixedPrecision, variables: Any, *args: Any,
                 method: Any = None, **kwargs: Any) -> DtypeReport:
  """Traces ``model`` once (abstractly) and reports what every module saw.

  Nothing is guessed: input, output and param dtypes are captured inside each
  module call.

  Args:
    model: a :class:`MixedPrecision` model.
    variables: its variables (from ``model.init``).
    *args: example inputs.
    method: the method to trace.
    **kwargs: more inputs.

  Returns:
    A :class:`DtypeReport`.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, jmp_lite.linen
    >>> model = jmp_lite.linen.mixed_precision(nn.Dense(2), "c=bf16")
    >>> v = model.init(jax.random.key(0), jnp.ones((1, 3)))
    >>> report = jmp_lite.linen.dtype_report(model, v, jnp.ones((1, 3)))
    >>> (report.rows[0].stored, report.rows[0].read, report.rows[0].outputs)
    ('float32', 'bfloat16', 'bfloat16')
  """
  resolver = model._discover(variables, args, kwargs, method, None)
  stored = variables.get("params", {})
  rows: list[ReportRow] = []

  def record(path, cls, policy, call_args, call_kwargs, out, module_vars):
    own_stored = stored
    for name in path:
      own_stored = own_stored.get(name, {}) if isinstance(own_stored, dict) else {}
    rows.append(ReportRow(
        path="/".join(path), cls=cls.__name__, policy=str(policy),
        stored=_float_dtypes(_own(own_stored)),
        read=_float_dtypes(_own(module_vars)),
        inputs=_float_dtypes((call_args, call_kwargs)),
        outputs=_float_dtypes(out), param_bytes=tree_bytes(_own(own_stored))))

  def run(v):
    cast_vars = dict(v)
    if "params" in cast_vars:
      cast_vars["params"] = _cast_params(cast_vars["params"], resolver,
                                         "compute")
    with nn.intercept_methods(_interceptor(resolver, record)):
      return model.module.apply(cast_vars, *args, method=method, mutable=True,
                                **kwargs)

  jax.eval_shape(run, variables)
  return DtypeReport(tuple(rows))
