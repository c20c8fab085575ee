"""Per-module precision rules, shared by the linen, nnx and Equinox adapters.

A :class:`Rule` gives the modules it matches a policy of their own: by class
(``isinstance``) or by path (``re.fullmatch`` on the ``/``-joined module
path, ``"decoder/logits"``). The first matching rule wins; a module without a
match inherits the policy of its nearest ancestor that has one, and the root
falls back to the default policy. :class:`RuleSet` is that resolution, written
once: each adapter only says which classes count as modules of its framework
and which paths and classes it saw.

What a module's resolution means at its boundary (the same in every adapter):

* its floating inputs are cast to its policy's compute dtype;
* its params are stored in the param dtype and read in the compute dtype;
* its outputs are cast to the default policy's output dtype (the root), to
  its own rule's output dtype (a module with a rule), or else to its compute
  dtype — except a *carry*: when a module inside the model is called as
  ``f(carry, ...)`` and returns ``(new_carry, ...)`` with ``new_carry``
  shaped like ``carry``, the new carry keeps the dtypes ``carry`` came in
  with, as ``lax.scan`` requires of ``nn.scan``/``nn.RNN`` bodies (the
  Equinox adapter also knows its cells' ``cell(x, hidden) -> hidden``). The
  root's outputs always take the policy's output dtype.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jmp_lite import dtypes as _dtypes
from jmp_lite.fp4._recipes import RECIPES as _FP4_RECIPES
from jmp_lite.fp8._recipes import CurrentScaling, DelayedScaling, MXFP8
from jmp_lite.policy import get_policy, Policy

__all__ = ["FLOAT32", "Resolved", "Rule", "RuleSet"]

# FP8 and FP4 recipes: a rule's low-precision matmul format.
_RECIPES = (CurrentScaling, DelayedScaling, MXFP8, *_FP4_RECIPES)

Path = tuple[str, ...]

FLOAT32 = Policy(jnp.float32, jnp.float32, jnp.float32)
"""The policy of ``enabled=False``: float32 everywhere."""


def as_policy(policy: Any, what: str = "policy") -> Policy:
  """A :class:`~jmp_lite.Policy` from a policy or policy string.

  Args:
    policy: a ``Policy`` or a string for :func:`~jmp_lite.get_policy`.
    what: the argument's name, for the error message.

  Returns:
    The policy.

  Raises:
    TypeError: for anything else.
    ValueError: for a malformed policy string.

  Example:
    >>> import jmp_lite.rules
    >>> str(jmp_lite.rules.as_policy("c=bf16"))
    'p=f32,c=bf16,o=bf16'
  """
  if isinstance(policy, str):
    return get_policy(policy)
  if not isinstance(policy, Policy):
    raise TypeError(
        f"{what} must be a jmp_lite.Policy or a policy string such as"
        f" 'p=f32,c=bf16,o=f32', got {type(policy).__name__}: {policy!r}")
  return policy


@dataclasses.dataclass(frozen=True)
class Rule:
  """Gives the modules that match ``matcher`` their own policy or FP8 recipe.

  Attributes:
    matcher: a module class (or tuple of classes), matched with
      ``isinstance``; or a path pattern (``str`` or ``re.Pattern``), matched
      with ``re.fullmatch`` against the ``/``-joined module path (``""`` is the
      root).
    policy: the :class:`~jmp_lite.Policy` (or policy string) for them, or
      ``None`` to keep the inherited one. An FP8 recipe given here
      (``Rule(nn.Dense, jmp_lite.fp8.CurrentScaling())``) is taken as ``fp8``.
    fp8: a :class:`jmp_lite.fp8.CurrentScaling` or
      :class:`~jmp_lite.fp8.DelayedScaling`: the matched modules' (and their
      children's) matmuls run in FP8 with it, in the (inherited) policy's
      compute dtype around them. A rule without ``fp8`` ends an FP8 region
      (a float32 rule is not FP8). A :mod:`jmp_lite.fp4` recipe
      (``NVFP4``, ``MXFP4``, ``PerDirection``) runs them in FP4 instead.

  Example:
    >>> import flax.linen as nn, jmp_lite, jmp_lite.rules
    >>> rule = jmp_lite.rules.Rule(nn.LayerNorm, "f32")
    >>> str(rule.policy), rule.matches(("encoder", "norm"), nn.LayerNorm)
    ('p=f32,c=f32,o=f32', True)
    >>> jmp_lite.rules.Rule(nn.Dense, jmp_lite.fp8.CurrentScaling()).describe()
    'class Dense -> fp8 CurrentScaling'
  """

  matcher: Any
  policy: Any = None
  fp8: Any = None

  def __post_init__(self) -> None:
    m = self.matcher
    if isinstance(m, str):
      try:
        m = re.compile(m)
      except re.error as e:
        raise ValueError(
            f"Bad module path pattern {self.matcher!r}: {e}") from None
    elif isinstance(m, type):
      m = (m,)
    if isinstance(m, tuple):
      bad = [c for c in m if not isinstance(c, type)]
      if bad or not m:
        raise TypeError(
            "A rule's matcher must be a module class, a tuple of module"
            " classes, or a path pattern (str or re.Pattern); got"
            f" {bad or m!r}")
    elif not isinstance(m, re.Pattern):
      raise TypeError(
          "A rule's matcher must be a module class, a tuple of module classes,"
          f" or a path pattern (str or re.Pattern); got {type(m).__name__}:"
          f" {m!r}")
    policy, fp8 = self.policy, self.fp8
    if isinstance(policy, _RECIPES):
      if fp8 is not None:
        raise TypeError(f"Rule for {self.matcher!r} got two FP8 recipes")
      policy, fp8 = None, policy
    if policy is None and fp8 is None:
      raise TypeError(
          f"Rule for {self.matcher!r} needs a policy (or policy string) or an"
          " FP8 recipe (jmp_lite.fp8.CurrentScaling / DelayedScaling /"
          " MXFP8) or FP4 recipe (jmp_lite.fp4.NVFP4 / MXFP4 /"
          " PerDirection)")
    if policy is not None:
      policy = as_policy(policy, "A rule's policy")
    if fp8 is not None and not isinstance(fp8, _RECIPES):
      raise TypeError(
          "A rule's fp8 must be a jmp_lite.fp8.CurrentScaling,"
          " DelayedScaling or MXFP8 recipe (or a jmp_lite.fp4 NVFP4,"
          " MXFP4 or PerDirection one), got"
          f" {type(fp8).__name__}: {fp8!r}")
    object.__setattr__(self, "matcher", m)
    object.__setattr__(self, "policy", policy)
    object.__setattr__(self, "fp8", fp8)

  def matches(self, path: Path, cls: type) -> bool:
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

  def _format(self) -> str:
    return "fp4" if isinstance(self.fp8, _FP4_RECIPES) else "fp8"

  def describe(self) -> str:
    """A short text for error messages and reports."""
    what = " ".join(
        part for part in (str(self.policy) if self.policy else "",
                          f"{self._format()} {type(self.fp8).__name__}"
                          if self.fp8 else "")
        if part)
    if isinstance(self.matcher, re.Pattern):
      return f"path {self.matcher.pattern!r} -> {what}"
    names = ", ".join(c.__name__ for c in self.matcher)
    return f"class {names} -> {what}"


def to_rules(rules: Iterable[Any], bases: tuple[type, ...],
             framework: str, fp8: bool = True) -> tuple[Rule, ...]:
  """Validates ``rules`` for one framework.

  Args:
    rules: :class:`Rule` objects or ``(matcher, policy)`` pairs.
    bases: the module base classes of the framework (``flax.linen.Module``).
    framework: its name, for error messages.
    fp8: whether the framework's adapter can run FP8 rules.

  Returns:
    The rules.

  Raises:
    TypeError: for an entry that is not a rule or pair, a class matcher
      that is not a module class of ``bases``, or an FP8 rule where FP8
      rules are not supported.

  Example:
    >>> import flax.linen as nn, jmp_lite.rules
    >>> rules = jmp_lite.rules.to_rules(
    ...     [(nn.Dense, "bf16")], (nn.Module,), "linen")
    >>> rules[0].describe()
    'class Dense -> p=bf16,c=bf16,o=bf16'
  """
  if isinstance(rules, (Rule, str)) or (
      isinstance(rules, tuple) and len(rules) == 2
      and not isinstance(rules[0], (tuple, Rule))):
    raise TypeError(
        f"rules must be a sequence of (matcher, policy) pairs, got {rules!r};"
        f" wrap a single rule in a list: rules=[{rules!r}]")
  out = []
  for r in rules:
    if isinstance(r, tuple) and len(r) == 2:
      r = Rule(*r)
    if not isinstance(r, Rule):
      raise TypeError(
          "Each rule must be a jmp_lite.rules.Rule or a (matcher, policy) pair"
          f" such as (nn.LayerNorm, 'f32') or ('decoder/.*', 'f32'), got {r!r}")
    if not isinstance(r.matcher, re.Pattern):
      wrong = [c for c in r.matcher if not issubclass(c, bases)]
      if wrong:
        expected = " or ".join(f"{b.__module__}.{b.__qualname__}"
                               for b in bases)
        raise TypeError(
            f"{framework} rule matcher {wrong[0].__qualname__} is not a"
            f" subclass of {expected}; match {framework} module classes, or"
            " module paths with a regex string")
    if r.fp8 is not None and not fp8:
      raise TypeError(
          f"{framework} rules cannot give FP8 recipes ({r.describe()}): use"
          " jmp_lite.autocast(fn, jnp.bfloat16, fp8=recipe) for FP8 matmuls")
    out.append(r)
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class Resolved:
  """What the policy means for one module.

  Attributes:
    policy: the module's effective policy (its own rule's, or inherited).
    output: the dtype its outputs are cast to (see the module docstring).
    rule: the index of its own rule in the rule set, or ``None``.
    fp8: the FP8 recipe its matmuls run with, or ``None``.
  """

  policy: Policy
  output: Any
  rule: int | None
  fp8: Any = None


@dataclasses.dataclass(frozen=True)
class RuleSet:
  """A default policy and rules, resolved per module path.

  Attributes:
    default: the policy of modules no rule reaches.
    rules: the rules, first match wins (the user's, then the islands).
    n_user: how many of ``rules`` are the user's (for ``strict``).
    strict: whether a user rule that matches nothing is an error.

  Example:
    >>> import flax.linen as nn, jmp_lite.rules
    >>> rs = jmp_lite.rules.rule_set("p=f32,c=bf16,o=f32", [], (nn.Module,),
    ...                              "linen", norm_layers=(nn.LayerNorm,))
    >>> resolved = rs.resolve({(): nn.Module, ("LayerNorm_0",): nn.LayerNorm})
    >>> str(resolved[("LayerNorm_0",)].policy), resolved[()].output
    ('p=f32,c=f32,o=bf16', dtype('float32'))
  """

  default: Policy
  rules: tuple[Rule, ...]
  n_user: int
  strict: bool = False

  def is_island(self, index: int | None) -> bool:
    """Whether rule ``index`` is the float32 normalisation island."""
    return index is not None and index >= self.n_user

  def own_rule(self, path: Path, cls: type) -> int | None:
    """The index of the first rule matching the module, or ``None``."""
    for i, rule in enumerate(self.rules):
      if rule.matches(path, cls):
        return i
    return None

  def resolve(self, classes: Mapping[Path, type]) -> dict[Path, Resolved]:
    """Resolves every module of ``classes`` (path -> class).

    Ancestors missing from ``classes`` (modules never seen) are skipped in
    the inheritance chain.

    Args:
      classes: the modules, by path; ``()`` is the root.

    Returns:
      A :class:`Resolved` per path.
    """
    own = {p: self.own_rule(p, c) for p, c in classes.items()}
    out = {}
    for path in classes:
      # The nearest rule with a policy sets the policy; the nearest rule of
      # any kind sets FP8 (a policy-only rule ends an FP8 region).
      policy, fp8, fp8_found = self.default, None, False
      for n in range(len(path), -1, -1):
        i = own.get(path[:n])
        if i is None:
          continue
        if not fp8_found:
          fp8, fp8_found = self.rules[i].fp8, True
        if self.rules[i].policy is not None:
          policy = self.rules[i].policy
          break
      rule = own[path]
      if not path:
        output = self.default.output_dtype
      elif rule is not None and self.rules[rule].policy is not None:
        output = self.rules[rule].policy.output_dtype
      else:
        output = policy.compute_dtype
      out[path] = Resolved(policy=policy, output=output, rule=rule, fp8=fp8)
    return out

  def check_strict(self, classes: Mapping[Path, type]) -> None:
    """With ``strict``, raises if a user rule matches none of ``classes``.

    Args:
      classes: every module seen, by path.

    Raises:
      ValueError: naming the unused rules and the modules seen.
    """
    if not self.strict:
      return
    used = {self.own_rule(p, c) for p, c in classes.items()}
    unused = [self.rules[i].describe() for i in range(self.n_user)
              if i not in used]
    if unused:
      seen = ", ".join(f"{'/'.join(p) or '<root>'} ({c.__name__})"
                       for p, c in sorted(classes.items()))
      raise ValueError(
          f"strict=True: rule(s) matched no module: {unused}; modules seen:"
          f" {seen}")


def rule_set(policy: Any, rules: Sequence[Any], bases: tuple[type, ...],
             framework: str, *, norm_layers: tuple[type, ...] = (),
             float32_norms: bool = True, strict: bool = False,
             enabled: bool = True, fp8: bool = True) -> RuleSet:
  """Validates an adapter's arguments into a :class:`RuleSet`.

  Args:
    policy: the default policy (or string).
    rules: the user's rules.
    bases: the framework's module base classes.
    framework: its name, for errors.
    norm_layers: the framework's normalisation layers.
    float32_norms: append ``Rule(norm_layers, p=f32,c=f32,o=<compute>)``
      after the user's rules.
    strict: a user rule matching nothing is an error.
    enabled: ``False`` gives float32 everywhere and no rules.
    fp8: whether the adapter runs FP8 rules.

  Returns:
    The rule set.

  Raises:
    TypeError, ValueError: for a bad policy or rule (naming it).

  Example:
    >>> import flax.linen as nn, jmp_lite.rules
    >>> rs = jmp_lite.rules.rule_set(
    ...     "bf16", [("head", "f32")], (nn.Module,), "linen")
    >>> [r.describe() for r in rs.rules]
    ["path 'head' -> p=f32,c=f32,o=f32"]
  """
  policy = as_policy(policy)
  user = to_rules(rules, bases, framework, fp8)
  if not isinstance(strict, bool) or not isinstance(enabled, bool):
    raise TypeError(
        f"strict and enabled must be bools, got {strict!r} and {enabled!r}")
  if not enabled:
    return RuleSet(FLOAT32, (), 0, False)
  all_rules = user
  if float32_norms and norm_layers:
    island = Policy(jnp.float32, jnp.float32, policy.compute_dtype)
    all_rules = user + (Rule(norm_layers, island),)
  return RuleSet(policy, all_rules, len(user), strict)


def cast_inputs(tree: Any, dtype: Any) -> Any:
  """Casts the floating array leaves of call arguments to ``dtype``.

  nnx objects and variables, typed keys and every non-floating leaf pass
  through as the same objects (see :func:`jmp_lite.dtypes.is_live_state`).

  Args:
    tree: the arguments.
    dtype: the compute dtype.

  Returns:
    The cast arguments.

  Example:
    >>> import jax.numpy as jnp, jmp_lite.rules
    >>> jmp_lite.rules.cast_inputs((jnp.ones(2), 3), jnp.bfloat16)[0].dtype
    dtype(bfloat16)
  """
  def cast(x: Any) -> Any:
    if _dtypes.is_floating_array(x) and x.dtype != dtype:
      return x.astype(dtype)
    return x

  return jax.tree.map(cast, tree, is_leaf=_dtypes.is_live_state)


def cast_outputs(out: Any, dtype: Any, args: Sequence[Any],
                 carry: bool = True) -> Any:
  """Casts a module call's outputs to ``dtype``, keeping a carry's dtypes.

  If ``args[0]`` is a carry — ``out`` is a tuple whose first element has the
  tree structure and shapes of ``args[0]`` — that first element is cast back
  to the dtypes ``args[0]`` had (as given by the caller, before any cast),
  and the rest to ``dtype``. A call that returns live state (an Equinox
  stateful layer's ``(y, state)``) has no carry: its ``y`` is an activation.
  Everything else goes to ``dtype``.

  Args:
    out: the outputs.
    dtype: the module's output dtype.
    args: the positional arguments as the caller passed them.
    carry: whether the carry exception applies (not to the root, whose
      outputs are the user's and always take the policy's output dtype).

  Returns:
    The cast outputs.

  Example:
    >>> import jax.numpy as jnp, jmp_lite.rules
    >>> carry, x = jnp.zeros(2), jnp.ones(3)
    >>> new_carry, y = jmp_lite.rules.cast_outputs(
    ...     (jnp.ones(2, jnp.bfloat16), jnp.ones(3, jnp.bfloat16)),
    ...     jnp.bfloat16, (carry, x))
    >>> new_carry.dtype, y.dtype
    (dtype('float32'), dtype(bfloat16))
  """
  if (carry and args and isinstance(out, tuple) and out
      and same_shapes(out[0], args[0])
      and not any(_dtypes.is_live_state(x) for x in jax.tree.leaves(
          out[1:], is_leaf=_dtypes.is_live_state))):
    return (keep_dtypes(out[0], args[0]),) + tuple(cast_inputs(out[1:], dtype))
  return cast_inputs(out, dtype)


def keep_dtypes(new: Any, old: Any) -> Any:
  """``new`` with each floating leaf cast to the dtype of ``old``'s leaf.

  Args:
    new: a carry as a module returned it.
    old: the carry as the caller passed it (same tree and shapes).

  Returns:
    ``new`` in ``old``'s dtypes (non-floating leaves as they are).

  Example:
    >>> import jax.numpy as jnp, jmp_lite.rules
    >>> half = jnp.ones(2, jnp.bfloat16)
    >>> jmp_lite.rules.keep_dtypes(half, jnp.zeros(2)).dtype
    dtype('float32')
  """
  return jax.tree.map(
      lambda n, o: n.astype(o.dtype)
      if _dtypes.is_floating_array(n) and _dtypes.is_floating_array(o)
      and n.dtype != o.dtype else n,
      new, old, is_leaf=_dtypes.is_live_state)


def same_shapes(a: Any, b: Any) -> bool:
  """Whether ``a`` and ``b`` are one tree of floating arrays, equal shapes.

  Args:
    a: a tree.
    b: another tree.

  Returns:
    Whether the trees match (and hold at least one array).

  Example:
    >>> import jax.numpy as jnp, jmp_lite.rules
    >>> jmp_lite.rules.same_shapes((jnp.ones(2),), (jnp.zeros(2),))
    True
  """
  la, ta = jax.tree.flatten(a, is_leaf=_dtypes.is_live_state)
  lb, tb = jax.tree.flatten(b, is_leaf=_dtypes.is_live_state)
  if ta != tb or not la:
    return False
  return all(_dtypes.is_floating_array(x) and _dtypes.is_floating_array(y)
             and x.shape == y.shape for x, y in zip(la, lb, strict=True))
