"""Per-path precision rules for plain parameter pytrees (no Flax needed).

For Equinox, Haiku or hand-written JAX: choose each leaf's policy by a regex on
its key path (``"encoder/layer_0/w"``), first match wins.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, TypeVar

import jax

from jmp_lite import dtypes as _dtypes
from jmp_lite.policy import get_policy, Policy

__all__ = ["cast_by_path", "path_string"]

T = TypeVar("T")

_WHICH = ("param", "compute", "output")


def path_string(path: Sequence[Any]) -> str:
  """Joins a JAX key path into ``"a/b/0/c"``.

  Args:
    path: a key path from ``jax.tree_util.tree_flatten_with_path``.

  Returns:
    The ``/``-joined names (dict keys, attribute names, sequence indices).

  Example:
    >>> import jax, jmp_lite
    >>> [jmp_lite.path_rules.path_string(p) for p, _ in
    ...  jax.tree_util.tree_flatten_with_path({"a": [1, {"b": 2}]})[0]]
    ['a/0', 'a/1/b']
  """
  parts = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return "/".join(parts)


def cast_by_path(tree: T, default: Policy | str,
                 rules: Sequence[tuple[str, Policy | str]] = (), *,
                 to: str = "compute", strict: bool = False) -> T:
  """Casts each floating leaf by the first rule whose regex matches its path.

  Args:
    tree: any pytree of params (or activations).
    default: the policy for leaves no rule matches.
    rules: ``(pattern, policy)`` pairs; ``pattern`` is a regex searched
      (``re.search``) in the leaf's ``/``-joined key path.
    to: which dtype of the chosen policy to cast to: ``"param"``,
      ``"compute"`` or ``"output"``.
    strict: raise if a rule matches no leaf.

  Returns:
    The cast tree (non-floating leaves untouched).

  Raises:
    ValueError: for an unknown ``to``, a bad regex, or (``strict``) a rule
      matching nothing.
    TypeError: for a policy that is not a policy.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> params = {"encoder": {"w": jnp.ones(2)}, "norm": {"scale": jnp.ones(2)}}
    >>> out = jmp_lite.cast_by_path(params, "bf16", [("norm", "f32")])
    >>> out["encoder"]["w"].dtype, out["norm"]["scale"].dtype
    (dtype(bfloat16), dtype('float32'))
  """
  if to not in _WHICH:
    raise ValueError(f"to must be one of {_WHICH}, got {to!r}")
  default = _policy(default)
  compiled = []
  for pattern, policy in rules:
    try:
      compiled.append((re.compile(pattern), _policy(policy)))
    except re.error as e:
      raise ValueError(f"Bad path pattern {pattern!r}: {e}") from None
  used = set()

  def cast(path: Any, leaf: Any) -> Any:
    if not _dtypes.is_floating_array(leaf):
      return leaf
    name = path_string(path)
    policy = default
    for i, (regex, rule_policy) in enumerate(compiled):
      if regex.search(name):
        used.add(i)
        policy = rule_policy
        break
    dtype = getattr(policy, f"{to}_dtype")
    return leaf if leaf.dtype == dtype else leaf.astype(dtype)

  out = jax.tree_util.tree_map_with_path(cast, tree,
                                        is_leaf=_dtypes.is_opaque)
  if strict:
    unused = [p for i, (p, _) in enumerate(rules) if i not in used]
    if unused:
      raise ValueError(f"strict=True: pattern(s) matched no leaf: {unused}")
  return out


def _policy(policy: Any) -> Policy:
  if isinstance(policy, str):
    policy = get_policy(policy)
  if not isinstance(policy, Policy):
    raise TypeError(
        f"Expected a jmp_lite.Policy or policy string, got {policy!r}")
  return policy
