"""Flax nnx arguments of an autocast call: run pure, write changes back.

Traced as pure arrays, nnx modules would be copies: what ``fn`` changes in
them (RNG counts, batch statistics, caches) would be lost. So, as
``nnx.jit`` does, the arguments are split into their variables and the
rest, ``fn`` runs on the merged copy, and the variables it changed or
created are written back. Only those: writing back an unchanged one would
put this trace's values into a module closed over from outside it
(``jax.jit(lambda x: autocast(f)(model, x))``), which nnx refuses, as it
would for ``f``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jax

from jmp_lite._nnx_paths import same_leaves, set_at_path


def nnx_module() -> Any:
  """``flax.nnx`` if it is loaded (any nnx object exists), else ``None``.

  Example:
    >>> from jmp_lite.autocasting._writeback import nnx_module
    >>> nnx_module() is None or hasattr(nnx_module(), "Module")
    True
  """
  return sys.modules.get("flax.nnx")


def holds_nnx(args: tuple, kwargs: dict) -> bool:
  """Whether the call's arguments hold Flax nnx objects.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite.autocasting._writeback import holds_nnx
    >>> holds_nnx((jnp.ones(2),), {})
    False
  """
  nnx = nnx_module()
  return nnx is not None and any(
      nnx.graph.is_graph_node(x) for x in jax.tree.leaves(
          (args, kwargs), is_leaf=nnx.graph.is_graph_node))


def as_pure(fn: Callable[..., Any], args: tuple, kwargs: dict
            ) -> tuple[Callable[..., Any], tuple[Any, Any],
                       Callable[[Any], Any]]:
  """``fn`` on nnx arguments as a pure function of their state.

  Args:
    fn: the function.
    args: its positional arguments (holding nnx objects).
    kwargs: its keyword arguments.

  Returns:
    ``(pure, pure_args, finish)``: ``pure(*pure_args)`` runs ``fn`` and
    returns ``(output, changed variables)``; ``finish(that result)`` writes
    the changed variables back into ``args``/``kwargs`` and returns the
    output. ``pure`` must have run (been traced) before ``finish``.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jmp_lite.autocasting._writeback import as_pure
    >>> class Counter(nnx.Module):
    ...   def __init__(self):
    ...     self.n = nnx.BatchStat(jnp.zeros(()))
    >>> c = Counter()
    >>> def bump(m):
    ...   m.n[...] = m.n[...] + 1
    ...   return m.n[...]
    >>> pure, pure_args, finish = as_pure(bump, (c,), {})
    >>> float(finish(pure(*pure_args))), float(c.n[...])
    (1.0, 1.0)
  """
  nnx = nnx_module()
  assert nnx is not None  # Only called where holds_nnx was true.
  graphdef, variables, rest = nnx.split((args, kwargs), nnx.Variable, ...)
  given = {path for path, _ in nnx.to_flat_state(variables)}
  changed_paths: list[tuple[Any, ...]] = []   # Found while tracing.

  def pure(variables: Any, rest: Any) -> Any:
    inputs = {path: var.get_value()
              for path, var in nnx.to_flat_state(variables)}
    a, k = nnx.merge(graphdef, variables, rest)
    out = fn(*a, **k)
    changed = [(path, var) for path, var in nnx.to_flat_state(
        nnx.state((a, k), nnx.Variable))
               if path not in inputs
               or not same_leaves(var.get_value(), inputs[path])]
    changed_paths[:] = [path for path, _ in changed]
    return out, [var for _, var in changed]

  def finish(result: Any) -> Any:
    out, new_vars = result
    old = [(p, v) for p, v in zip(changed_paths, new_vars, strict=True)
           if p in given]
    if old:
      nnx.update((args, kwargs), nnx.from_flat_state(old))
    for path, var in zip(changed_paths, new_vars, strict=True):
      if path not in given:   # Created by fn where the module held none.
        set_at_path((args, kwargs), path, var)
    return out

  return pure, (variables, rest), finish
