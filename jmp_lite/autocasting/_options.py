"""Autocast's options: the primitive lists, region scopes, checked config."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from jmp_lite import _jaxpr
from jmp_lite import dtypes as _dtypes
from jmp_lite._checks import check_bool
from jmp_lite.policy import get_policy, Policy

LOWER_PRECISION: tuple[str, ...] = ("dot_general", "conv_general_dilated")

FLOAT32_PRIMITIVES: tuple[str, ...] = (
    "exp", "exp2", "log", "log1p", "expm1", "pow", "integer_pow", "square",
    "rsqrt", "acos", "asin", "cosh", "sinh", "tan", "erf_inv", "logistic",
    "reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp",
)

# Scope names of the regions (jax.named_scope names).
FLOAT32_SCOPE = "jmp_lite_float32"
HALF_SCOPE = "jmp_lite_half"
# What an autocast call runs in: an autocast around it leaves it as written
# (the innermost autocast decides, as nested torch.autocast regions do).
AUTOCAST_SCOPE = "jmp_lite_autocast"

_INTEGER_ONLY = {"and", "or", "not", "xor", "shift_left",
                 "shift_right_logical", "shift_right_arithmetic",
                 "population_count", "clz"}
_HIGHER_ORDER = {"scan", "while", "cond", "pjit", "jit", "custom_jvp_call",
                 "custom_vjp_call", "remat2", "checkpoint", "closed_call",
                 "shard_map"}


@dataclasses.dataclass(frozen=True)
class Config:
  """Autocast's checked options (made by :func:`make_config`).

  Example:
    >>> from jmp_lite.autocasting._options import make_config
    >>> cfg = make_config("bf16", deny=["dot_general"])
    >>> cfg.compute.name, "dot_general" in cfg.fp32, cfg.delayed
    ('bfloat16', True, False)
  """

  compute: np.dtype
  lower: frozenset[str]
  fp32: frozenset[str]
  exclude: tuple[str, ...]
  force: tuple[str, ...]
  accumulate_f32: bool
  fp8: Any = None  # A jmp_lite.fp8 recipe, or None.
  fp8_scopes: tuple[str, ...] | None = None
  fp8_exclude: tuple[str, ...] = ()

  @property
  def delayed(self) -> bool:
    """Whether the FP8 recipe is delayed scaling (autocast takes a state)."""
    from jmp_lite.fp8 import DelayedScaling  # fp8 imports optax users' code.
    return isinstance(self.fp8, DelayedScaling)


def check_names(names: Iterable[Any], what: str) -> set[str]:
  """The primitive names in ``names`` (names or primitives), checked.

  Args:
    names: primitive names or ``jax.lax.*_p`` primitives.
    what: the option's name, for errors.

  Returns:
    The set of names.

  Raises:
    TypeError: for one name instead of a list, or entries that are neither.
    ValueError: for unknown, higher-order or integer-only primitives.

  Example:
    >>> import jax
    >>> from jmp_lite.autocasting._options import check_names
    >>> sorted(check_names(["exp", jax.lax.log_p], "allow"))
    ['exp', 'log']
  """
  if isinstance(names, str) or hasattr(names, "name"):
    # One name or primitive, not a list of them (a str would be iterated
    # letter by letter).
    raise TypeError(f"{what} takes a list of primitive names or jax"
                    f" primitives; wrap the one given in a list: [{names!r}]")
  if not isinstance(names, Iterable):
    raise TypeError(f"{what} takes a list of primitive names or jax"
                    f" primitives, got {type(names).__name__}: {names!r}")
  out: set[str] = set()
  known: dict[str, Any] | None = None
  for item in names:
    name = item if isinstance(item, str) else getattr(item, "name", None)
    if not isinstance(name, str):
      raise TypeError(
          f"{what} entries must be primitive names or jax primitives, got"
          f" {item!r}")
    if name in _HIGHER_ORDER:
      raise ValueError(
          f"{what}: {name!r} is a higher-order primitive; autocast recurses"
          " into its body, so list the primitives inside it instead")
    if name in _INTEGER_ONLY:
      raise ValueError(
          f"{what}: {name!r} works only on integers and booleans, which"
          " autocast never re-types")
    if known is None:  # Looked up only when there are names to check.
      known = _jaxpr.primitives_by_name()
    if name not in known:
      close = difflib.get_close_matches(name, known, n=3)
      hint = f"; did you mean {close}?" if close else ""
      raise ValueError(f"{what}: unknown primitive {name!r}{hint}")
    out.add(name)
  return out


def make_config(policy_or_dtype: Any, *, allow: Iterable[Any] = (),
                deny: Iterable[Any] = (), use_default_lists: bool = True,
                exclude_scopes: Sequence[str] = (),
                force_scopes: Sequence[str] = (),
                accumulate_in_float32: bool = False, fp8: Any = None,
                fp8_scopes: Sequence[str] | None = None,
                fp8_exclude_scopes: Sequence[str] = ()) -> Config:
  """Validates :func:`jmp_lite.autocast`'s options (shared with the audit).

  Args:
    policy_or_dtype: as for :func:`jmp_lite.autocast`.
    allow: as for :func:`jmp_lite.autocast`.
    deny: likewise.
    use_default_lists: likewise.
    exclude_scopes: likewise.
    force_scopes: likewise.
    accumulate_in_float32: likewise.
    fp8: likewise.
    fp8_scopes: likewise.
    fp8_exclude_scopes: likewise.

  Returns:
    The :class:`Config`.

  Raises:
    TypeError, ValueError: as :func:`jmp_lite.autocast` documents.

  Example:
    >>> from jmp_lite.autocasting._options import make_config
    >>> make_config("p=f32,c=f16,o=f32").compute.name
    'float16'
  """
  for what, flag in (("use_default_lists", use_default_lists),
                     ("accumulate_in_float32", accumulate_in_float32)):
    check_bool(flag, what)  # "no" would read as True.
  if isinstance(policy_or_dtype, str) and "=" in policy_or_dtype:
    policy_or_dtype = get_policy(policy_or_dtype)  # "p=f32,c=bf16,o=f32"
  if isinstance(policy_or_dtype, Policy):
    compute = policy_or_dtype.compute_dtype
  elif policy_or_dtype is None:
    compute = _dtypes.half_dtype()
  else:
    compute = _dtypes.to_floating_dtype(policy_or_dtype, "policy_or_dtype")
  if compute not in _jaxpr.CASTABLE:
    raise TypeError(
        f"autocast's compute dtype must be float16, bfloat16 or float32, got"
        f" {compute.name}")
  allow_set = check_names(allow, "allow")
  deny_set = check_names(deny, "deny")
  both = allow_set & deny_set
  if both:
    raise ValueError(f"Primitives in both allow and deny: {sorted(both)}")
  lower = set(LOWER_PRECISION) if use_default_lists else set()
  fp32 = set(FLOAT32_PRIMITIVES) if use_default_lists else set()
  lower = (lower - deny_set) | allow_set
  fp32 = (fp32 - allow_set) | deny_set
  for what, scopes in (("exclude_scopes", exclude_scopes),
                       ("force_scopes", force_scopes),
                       ("fp8_scopes", () if fp8_scopes is None else fp8_scopes),
                       ("fp8_exclude_scopes", fp8_exclude_scopes)):
    if (isinstance(scopes, str) or not isinstance(scopes, Iterable)
        or not all(isinstance(s, str) for s in scopes)):
      raise TypeError(f"{what} must be a sequence of scope names, got"
                      f" {scopes!r}")
  if fp8 is not None:
    from jmp_lite.fp4._recipes import RECIPES as FP4_RECIPES
    from jmp_lite.fp8._recipes import check_recipe
    if not isinstance(fp8, FP4_RECIPES):  # FP4 recipes run the same way.
      check_recipe(fp8)
  elif fp8_scopes is not None or fp8_exclude_scopes:
    raise ValueError("fp8_scopes/fp8_exclude_scopes need an fp8= recipe")
  return Config(compute=compute, lower=frozenset(lower),
                fp32=frozenset(fp32), exclude=tuple(exclude_scopes),
                force=tuple(force_scopes),
                accumulate_f32=accumulate_in_float32, fp8=fp8,
                fp8_scopes=None if fp8_scopes is None else tuple(fp8_scopes),
                fp8_exclude=tuple(fp8_exclude_scopes))


def check_options(fn: Any, options: dict[str, Any]) -> None:
  """The checks :func:`jmp_lite.autocast_audit` and
  :func:`jmp_lite.autocast_fp8_state` share.

  Raises:
    TypeError: for a ``fn`` that is not callable, or unknown options.

  Example:
    >>> from jmp_lite.autocasting._options import check_options
    >>> check_options(abs, {"allow": ["exp"]})
  """
  if not callable(fn):
    raise TypeError(f"autocast expects a callable, got {fn!r}")
  unknown = set(options) - set(inspect.signature(make_config).parameters)
  if unknown:
    raise TypeError(
        f"Unknown autocast options: {sorted(unknown)} (keyword arguments are"
        " autocast's options; bind fn's own with functools.partial)")
