"""Op-level autocast for JAX: re-type every primitive by rule (torch.autocast).

:func:`autocast` returns a function with ``fn``'s signature that runs ``fn``
with each primitive re-typed:

* **lower** list (default: ``dot_general``, ``conv_general_dilated``, the
  primitives behind ``@``, ``jnp.einsum``, ``jnp.matmul``, attention): float
  inputs cast to the compute dtype, accumulation in float32
  (``preferred_element_type``), result in the compute dtype;
* **float32** list (PyTorch's CUDA float32 list mapped to ``lax``
  primitives: ``exp``, ``log``, ``log1p``, ``expm1``, ``pow``, ``rsqrt``,
  ``logistic``, reductions ``reduce_sum``/``cumsum``/..., the pieces of
  softmax, logsumexp, norms and losses): float inputs cast to float32;
* every other primitive runs in the widest float dtype among its (non-literal)
  inputs (**promote**).

Integer, bool and float64 values are never touched, and outputs come back in
the dtypes ``fn`` would return. It works eagerly and under ``jax.jit``,
``jax.grad``, ``jax.vmap`` and ``jax.checkpoint``, and recurses into nested
``jit``, ``custom_jvp``/``custom_vjp`` functions, ``lax.scan``,
``lax.while_loop``, ``lax.cond``/``switch`` and ``jax.checkpoint``. Each
sub-computation keeps its original signature (values crossing its boundary
are cast back), so control-flow typing stays valid.

Regions: code under ``jax.named_scope(name)`` with ``name`` in
``exclude_scopes`` (or inside :func:`float32_region`) runs exactly as
written; code under a name in ``force_scopes`` (or :func:`half_region`) runs
every float primitive in the compute dtype.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import math
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _jaxpr
from jmp_lite import dtypes as _dtypes
from jmp_lite.policy import Policy

LOWER_PRECISION: tuple[str, ...] = ("dot_general", "conv_general_dilated")
"""Primitives run in the compute dtype by default."""

FLOAT32: tuple[str, ...] = (
    "exp", "exp2", "log", "log1p", "expm1", "pow", "integer_pow", "rsqrt",
    "acos", "asin", "cosh", "sinh", "tan", "erf_inv", "logistic",
    "reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp",
)
"""Primitives run in float32 by default (PyTorch's CUDA float32 list)."""

FLOAT32_SCOPE = "jmp_lite_float32"
HALF_SCOPE = "jmp_lite_half"

_INTEGER_ONLY = {"and", "or", "not", "xor", "shift_left",
                 "shift_right_logical", "shift_right_arithmetic",
                 "population_count", "clz"}
_CASTABLE = {np.dtype(jnp.float32), np.dtype(jnp.bfloat16),
             np.dtype(jnp.float16)}
_F32 = np.dtype(jnp.float32)


def float32_region() -> Any:
  """A ``jax.named_scope`` whose code autocast leaves exactly as written.

  Returns:
    A context manager.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> def f(x):
    ...   with jmp_lite.float32_region():
    ...     y = x @ x
    ...   return y
    >>> jmp_lite.autocast(f, jnp.bfloat16)(jnp.ones((2, 2))).dtype
    dtype('float32')
  """
  return jax.named_scope(FLOAT32_SCOPE)


def half_region() -> Any:
  """A ``jax.named_scope`` in which autocast runs every float op in half.

  Returns:
    A context manager.

  Example:
    >>> import jax, jax.numpy as jnp, jmp_lite
    >>> def f(x):
    ...   with jmp_lite.half_region():
    ...     return jnp.exp(x)  # exp is on the float32 list, but forced here
    >>> [r.dtype for r in jmp_lite.autocast_audit(f, "bf16", jnp.ones(2)).records]
    ['bfloat16']
  """
  return jax.named_scope(HALF_SCOPE)


@dataclasses.dataclass(frozen=True)
class _Config:
  compute: np.dtype
  lower: frozenset[str]
  fp32: frozenset[str]
  exclude: tuple[str, ...]
  force: tuple[str, ...]
  accumulate_f32: bool
  record: Callable[..., None] | None = None


def _check_names(names: Iterable[Any], what: str) -> set[str]:
  known = _jaxpr.primitives_by_name()
  out = set()
  for item in names:
    name = item if isinstance(item, str) else getattr(item, "name", None)
    if not isinstance(name, str):
      raise TypeError(
          f"{what} entries must be primitive names or jax primitives, got"
          f" {item!r}")
    if name in ("scan", "while", "cond", "pjit", "jit", "custom_jvp_call",
                "custom_vjp_call", "remat2", "checkpoint", "closed_call",
                "shard_map"):
      raise ValueError(
          f"{what}: {name!r} is a higher-order primitive; autocast recurses"
          " into its body, so list the primitives inside it instead")
    if name in _INTEGER_ONLY:
      raise ValueError(
          f"{what}: {name!r} works only on integers and booleans, which"
          " autocast never re-types")
    if name not in known:
      close = difflib.get_close_matches(name, known, n=3)
      hint = f"; did you mean {close}?" if close else ""
      raise ValueError(f"{what}: unknown primitive {name!r}{hint}")
    out.add(name)
  return out


def _castable(x: Any) -> bool:
  return _dtypes.is_floating_array(x) and np.dtype(x.dtype) in _CASTABLE


def _cast(x: Any, dtype: np.dtype) -> Any:
  if _castable(x) and np.dtype(x.dtype) != dtype:
    return jax.lax.convert_element_type(x, dtype)
  return x


def _to_avals(values: Sequence[Any], avals: Sequence[Any]) -> list[Any]:
  """Casts float values back to the dtypes ``avals`` expect."""
  out = []
  for v, a in zip(values, avals):
    dtype = getattr(a, "dtype", None)
    if dtype is not None and _dtypes.is_floating_array(v) and v.dtype != dtype:
      v = jax.lax.convert_element_type(v, dtype)
    out.append(v)
  return out


def _mode(eqn: Any, mode: str, cfg: _Config) -> str:
  scopes = _jaxpr.name_stack(eqn).split("/")
  if FLOAT32_SCOPE in scopes or any(s in scopes for s in cfg.exclude):
    return "off"
  if HALF_SCOPE in scopes or any(s in scopes for s in cfg.force):
    return "force"
  return mode


def _flops(eqn: Any) -> float:
  name = eqn.primitive.name
  if name == "dot_general":
    (lc, _), (lb, _) = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    out = eqn.outvars[0].aval.shape
    return 2.0 * math.prod(out) * math.prod(lhs[d] for d in lc)
  if name == "conv_general_dilated":
    rhs = eqn.invars[1].aval.shape
    out = eqn.outvars[0].aval.shape
    dn = eqn.params["dimension_numbers"]
    out_features = rhs[dn.rhs_spec[0]]
    # MACs per output element = product of the kernel's other dimensions.
    per_output = math.prod(rhs) / out_features
    return 2.0 * math.prod(out) * per_output
  return 0.0


def _first_order(eqn: Any, invals: list[Any], cfg: _Config,
                 mode: str) -> list[Any]:
  name = eqn.primitive.name
  orig_avals = [_jaxpr.aval_of(a) for a in eqn.invars]
  params = dict(eqn.params)
  if mode == "off":
    category = "original"
    invals = _to_avals(invals, orig_avals)
  elif name in cfg.lower or (mode == "force" and any(map(_castable, invals))):
    category = "lower"
    invals = [_cast(v, cfg.compute) for v in invals]
    if ("preferred_element_type" in params and cfg.accumulate_f32
        and any(_castable(v) for v in invals)):
      params["preferred_element_type"] = _F32
  elif name in cfg.fp32:
    category = "float32"
    invals = [_cast(v, _F32) for v in invals]
  else:
    category = "promote"
    # Literals and weak-typed scalars follow; they never widen an op.
    strong = [np.dtype(v.dtype) for v, a in zip(invals, eqn.invars)
              if _castable(v) and not _jaxpr.is_literal(a)
              and not getattr(a.aval, "weak_type", False)]
    if strong:
      target = functools.reduce(jnp.promote_types, strong)
      invals = [_cast(v, np.dtype(target)) for v in invals]
    else:
      invals = _to_avals(invals, orig_avals)
  try:
    outs = _jaxpr.bind(eqn, params, invals)
  except (TypeError, ValueError):
    # A primitive whose parameters pin its operand types: run it as written.
    category = "original"
    outs = _jaxpr.bind(eqn, dict(eqn.params), _to_avals(invals, orig_avals))
  if category == "lower":
    outs = [_cast(o, cfg.compute) for o in outs]
  if cfg.record is not None:
    cfg.record(eqn, category, invals, outs)
  return outs


def _retyped(sub: Any, cfg: _Config, mode: str, exact: bool = False) -> Any:
  """``sub`` (a jaxpr param) rebuilt through autocast, same signature."""
  if isinstance(sub, _jaxpr.ClosedJaxpr):
    def run(*args):
      outs = _eval(sub.jaxpr, sub.consts, args, cfg, mode)
      return _to_avals(outs, sub.out_avals)
    return _jaxpr.rebuild_closed(sub, run)
  if isinstance(sub, _jaxpr.Jaxpr):
    out_avals = [v.aval for v in sub.outvars]
    def run_open(*args):
      outs = _eval(sub, (), args, cfg, mode)
      return _to_avals(outs, out_avals)
    if exact:
      return _jaxpr.rebuild_open_exact(sub, run_open)
    return _jaxpr.rebuild_open(sub, run_open)
  if isinstance(sub, tuple) and sub and all(
      isinstance(s, (_jaxpr.ClosedJaxpr, _jaxpr.Jaxpr)) for s in sub):
    return tuple(_retyped(s, cfg, mode, exact) for s in sub)
  return sub


def _higher_order(eqn: Any, invals: list[Any], cfg: _Config,
                  mode: str) -> list[Any]:
  invals = _to_avals(invals, [_jaxpr.aval_of(a) for a in eqn.invars])
  exact = eqn.primitive.name == "shard_map"
  with _jaxpr.sub_context(eqn):
    params = {k: _retyped(v, cfg, mode, exact) for k, v in eqn.params.items()}
  return _jaxpr.bind(eqn, params, invals)


def _eval(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any],
          cfg: _Config, mode: str) -> list[Any]:
  env: dict[Any, Any] = {}

  def read(atom: Any) -> Any:
    return atom.val if _jaxpr.is_literal(atom) else env[atom]

  for var, value in zip(jaxpr.constvars, consts):
    env[var] = value
  for var, value in zip(jaxpr.invars, args):
    env[var] = value
  for eqn in jaxpr.eqns:
    eqn_mode = _mode(eqn, mode, cfg)
    invals = [read(a) for a in eqn.invars]
    if _jaxpr.has_subjaxprs(eqn):
      outs = _higher_order(eqn, invals, cfg, eqn_mode)
    else:
      outs = _first_order(eqn, invals, cfg, eqn_mode)
    for var, value in zip(eqn.outvars, outs):
      env[var] = value
  return [read(v) for v in jaxpr.outvars]


def _is_traced_leaf(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _make_config(policy_or_dtype: Any, *, allow: Iterable[Any] = (),
                 deny: Iterable[Any] = (), use_default_lists: bool = True,
                 exclude_scopes: Sequence[str] = (),
                 force_scopes: Sequence[str] = (),
                 accumulate_in_float32: bool = True) -> _Config:
  """Validates :func:`autocast`'s options (shared with the audit)."""
  if isinstance(policy_or_dtype, Policy):
    compute = policy_or_dtype.compute_dtype
  elif policy_or_dtype is None:
    compute = _dtypes.half_dtype()
  else:
    compute = _dtypes.to_floating_dtype(policy_or_dtype, "policy_or_dtype")
  if compute not in _CASTABLE:
    raise TypeError(
        f"autocast's compute dtype must be float16, bfloat16 or float32, got"
        f" {compute.name}")
  allow_set = _check_names(allow, "allow")
  deny_set = _check_names(deny, "deny")
  both = allow_set & deny_set
  if both:
    raise ValueError(f"Primitives in both allow and deny: {sorted(both)}")
  lower = set(LOWER_PRECISION) if use_default_lists else set()
  fp32 = set(FLOAT32) if use_default_lists else set()
  lower = (lower - deny_set) | allow_set
  fp32 = (fp32 - allow_set) | deny_set
  for what, scopes in (("exclude_scopes", exclude_scopes),
                       ("force_scopes", force_scopes)):
    if isinstance(scopes, str) or not all(isinstance(s, str) for s in scopes):
      raise TypeError(f"{what} must be a sequence of scope names, got"
                      f" {scopes!r}")
  return _Config(compute=compute, lower=frozenset(lower),
                 fp32=frozenset(fp32), exclude=tuple(exclude_scopes),
                 force=tuple(force_scopes),
                 accumulate_f32=accumulate_in_float32)


def _run(fn: Callable[..., Any], cfg: _Config, args: tuple, kwargs: dict
         ) -> Any:
  leaves, treedef = jax.tree.flatten(args)
  traced = [i for i, x in enumerate(leaves) if _is_traced_leaf(x)]

  def flat_fn(*traced_vals):
    full = list(leaves)
    for i, v in zip(traced, traced_vals):
      full[i] = v
    return fn(*jax.tree.unflatten(treedef, full), **kwargs)

  traced_vals = [leaves[i] for i in traced]
  closed, out_shape = _jaxpr.trace(flat_fn, *traced_vals)
  outs = _eval(closed.jaxpr, closed.consts, traced_vals, cfg, "auto")
  outs = _to_avals(outs, closed.out_avals)
  return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


def autocast(
    fn: Callable[..., Any],
    policy_or_dtype: Any = None,
    *,
    allow: Iterable[Any] = (),
    deny: Iterable[Any] = (),
    use_default_lists: bool = True,
    exclude_scopes: Sequence[str] = (),
    force_scopes: Sequence[str] = (),
    accumulate_in_float32: bool = True,
) -> Callable[..., Any]:
  """Returns ``fn`` with every primitive re-typed by the autocast rules.

  Args:
    fn: the function to transform.
    policy_or_dtype: a :class:`~jmp_lite.Policy` (its compute dtype is used)
      or a dtype/name; ``None`` means :func:`~jmp_lite.half_dtype`.
    allow: primitives (names or ``jax.lax.*_p``) to add to the lower-precision
      list (Paddle's ``custom_white_list``); removed from the float32 list.
    deny: primitives to add to the float32 list (``custom_black_list``);
      removed from the lower-precision list.
    use_default_lists: start from :data:`LOWER_PRECISION` and
      :data:`FLOAT32` (``False``: only your lists).
    exclude_scopes: ``jax.named_scope`` names whose code runs as written.
    force_scopes: ``jax.named_scope`` names whose float ops all run in the
      compute dtype.
    accumulate_in_float32: lower-precision matmuls and convolutions
      accumulate in float32 (``preferred_element_type``).

  Returns:
    A function with ``fn``'s signature. Array arguments (``jax.Array``,
    numpy) are traced; other positional arguments and all keyword arguments
    are passed through as Python values.

  Raises:
    ValueError: for unknown, higher-order or integer-only primitives in the
      lists, or one listed in both.
    TypeError: for a compute dtype that is not float16/bfloat16/float32.

  Example:
    >>> import jax, jax.numpy as jnp, jmp_lite
    >>> def f(x, w):
    ...   return jax.nn.softmax(x @ w)
    >>> g = jmp_lite.autocast(f, jnp.bfloat16)
    >>> g(jnp.ones((2, 3)), jnp.ones((3, 4))).dtype  # As f would return.
    dtype('float32')
    >>> [r.dtype for r in jmp_lite.autocast_audit(f, jnp.bfloat16,
    ...     jnp.ones((2, 3)), jnp.ones((3, 4))).records if r.primitive == "dot_general"]
    ['bfloat16']
  """
  if not callable(fn):
    raise TypeError(f"autocast expects a callable, got {fn!r}")
  cfg = _make_config(policy_or_dtype, allow=allow, deny=deny,
                     use_default_lists=use_default_lists,
                     exclude_scopes=exclude_scopes, force_scopes=force_scopes,
                     accumulate_in_float32=accumulate_in_float32)

  @functools.wraps(fn)
  def wrapped(*args: Any, **kwargs: Any) -> Any:
    return _run(fn, cfg, args, kwargs)

  return wrapped


@dataclasses.dataclass(frozen=True)
class AuditRecord:
  """One primitive as autocast ran it.

  Attributes:
    primitive: the primitive's name.
    category: ``"lower"``, ``"float32"``, ``"promote"`` or ``"original"``.
    dtype: the float dtype it ran in (``"-"`` for none).
    input_dtypes: dtypes of its inputs after casting.
    output_dtypes: dtypes of its outputs.
    flops: floating-point operations (matmuls and convolutions only).
  """

  primitive: str
  category: str
  dtype: str
  input_dtypes: tuple[str, ...]
  output_dtypes: tuple[str, ...]
  flops: float


@dataclasses.dataclass(frozen=True)
class Audit:
  """What autocast did to a function: every primitive and its dtype.

  Attributes:
    records: one :class:`AuditRecord` per primitive executed (sub-computations
      included).
    compute_dtype: the autocast compute dtype.
  """

  records: tuple[AuditRecord, ...]
  compute_dtype: str

  def matmul_flops(self) -> dict[str, float]:
    """Matmul/convolution FLOPs by the dtype they ran in."""
    out: dict[str, float] = {}
    for r in self.records:
      if r.flops:
        out[r.dtype] = out.get(r.dtype, 0.0) + r.flops
    return out

  def half_flop_fraction(self) -> float:
    """The fraction of matmul/convolution FLOPs run in half precision."""
    flops = self.matmul_flops()
    total = sum(flops.values())
    half = sum(v for k, v in flops.items() if k in ("bfloat16", "float16"))
    return half / total if total else 0.0

  def __str__(self) -> str:
    counts: dict[tuple[str, str, str], int] = {}
    for r in self.records:
      key = (r.primitive, r.category, r.dtype)
      counts[key] = counts.get(key, 0) + 1
    lines = [f"{'primitive':24} {'rule':9} {'dtype':9} count"]
    for (p, c, d), n in sorted(counts.items()):
      lines.append(f"{p:24} {c:9} {d:9} {n}")
    lines.append(f"matmul/conv FLOPs in half precision:"
                 f" {100 * self.half_flop_fraction():.1f}%")
    return "\n".join(lines)


def autocast_audit(fn: Callable[..., Any], policy_or_dtype: Any, *args: Any,
                   **options: Any) -> Audit:
  """Lists the primitives ``autocast(fn)`` runs, their dtypes and FLOPs.

  Traces abstractly (nothing is computed).

  Args:
    fn: the function.
    policy_or_dtype: as for :func:`autocast`.
    *args: example inputs.
    **options: :func:`autocast`'s keyword options.

  Returns:
    An :class:`Audit`; ``audit.half_flop_fraction()`` is the share of
    matmul/convolution FLOPs run in half precision.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> audit = jmp_lite.autocast_audit(lambda a, b: a @ b, "bf16",
    ...                                 jnp.ones((4, 8)), jnp.ones((8, 2)))
    >>> audit.half_flop_fraction(), audit.matmul_flops()
    (1.0, {'bfloat16': 128.0})
  """
  records: list[AuditRecord] = []

  def record(eqn, category, invals, outs):
    ins = tuple(np.dtype(v.dtype).name for v in invals if hasattr(v, "dtype"))
    out_dtypes = tuple(np.dtype(o.dtype).name for o in outs
                       if hasattr(o, "dtype"))
    floats = [d for d in ins if jnp.issubdtype(np.dtype(d), jnp.floating)]
    records.append(AuditRecord(
        primitive=eqn.primitive.name, category=category,
        dtype=floats[0] if floats else "-", input_dtypes=ins,
        output_dtypes=out_dtypes, flops=_flops(eqn)))

  unknown = set(options) - set(inspect.signature(_make_config).parameters)
  if unknown:
    raise TypeError(f"Unknown autocast options: {sorted(unknown)}")
  cfg = dataclasses.replace(_make_config(policy_or_dtype, **options),
                            record=record)
  jax.eval_shape(lambda *a: _run(fn, cfg, a, {}), *args)
  return Audit(tuple(records), cfg.compute.name)
