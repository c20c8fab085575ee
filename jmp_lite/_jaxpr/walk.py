"""The one walker over a jaxpr's equations, and the checking evaluator.

:func:`walk` visits every equation, those of sub-jaxprs included (nested
``jit``, ``scan``/``while`` bodies, ``cond`` branches, ``custom_jvp`` and
``custom_vjp`` functions, ``remat``), each with its full scope path and the
higher-order primitives around it. The report, the diagnostics and the
tests read jaxprs through it. :func:`interpret` evaluates a jaxpr
equation by equation on concrete values, entering call-like equations, and
shows each primitive's inputs and outputs to an observer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

from jax.extend import core as jex

from jmp_lite._jaxpr.names import join_scopes, name_stack_of
from jmp_lite._jaxpr.retype import (
  bind,
  inline_jaxpr,
  is_literal,
  jaxpr_and_consts,
)


class Site(NamedTuple):
  """One equation where the walker found it.

  Attributes:
    eqn: the equation (pass it to this package's helpers).
    scope: its full ``jax.named_scope`` path from the outermost jaxpr
      (``"model/block/dense"``; ``""`` where nothing was named), with the
      transformations around it (``transpose(jvp(...))``).
    within: the higher-order primitives it sits in, outermost first
      (``("jit", "scan")``).
  """

  eqn: Any
  scope: str
  within: tuple[str, ...]

  @property
  def primitive(self) -> str:
    """The equation's primitive name (``"dot_general"``)."""
    return self.eqn.primitive.name


def _open(jaxpr: Any) -> Any:
  return getattr(jaxpr, "jaxpr", jaxpr)


def walk(jaxpr: Any) -> Iterator[Site]:
  """Every equation of ``jaxpr`` and its sub-jaxprs, in program order.

  An equation holding sub-jaxprs comes before their equations.

  Args:
    jaxpr: a jaxpr, closed (``jax.make_jaxpr``'s result) or open.

  Yields:
    A :class:`Site` per equation.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jmp_lite._jaxpr import walk
    >>> def f(x):
    ...   with jax.named_scope("outer"):
    ...     return jax.jit(lambda y: jnp.sin(y))(x)
    >>> [(s.primitive, s.scope, s.within)
    ...  for s in walk(jax.make_jaxpr(f)(1.0))]
    [('jit', 'outer', ()), ('sin', 'outer', ('jit',))]
  """
  yield from _walk(_open(jaxpr), "", ())


def _walk(jaxpr: Any, outer: str, within: tuple[str, ...]) -> Iterator[Site]:
  for eqn in jaxpr.eqns:
    scope = join_scopes(outer, str(name_stack_of(eqn)))
    yield Site(eqn, scope, within)
    subs = list(jex.jaxprs_in_params(eqn.params))
    if subs:
      inner = (*within, eqn.primitive.name)
      for sub in subs:
        yield from _walk(_open(sub), scope, inner)


Observer = Callable[[Site, Sequence[Any], Sequence[Any]], None]


def interpret(closed: Any, args: Sequence[Any], observe: Observer
              ) -> list[Any]:
  """Evaluates a closed jaxpr primitive by primitive on concrete values.

  Call-like equations (nested ``jit``, ``custom_jvp``/``custom_vjp``
  functions, ``remat``) are entered; control flow (``scan``, ``while``,
  ``cond``) runs as one primitive. After each equation runs (a call-like
  one after the equations of its body), ``observe(site, inputs, outputs)``
  sees it; it may raise to stop.

  Args:
    closed: a closed jaxpr (``jax.make_jaxpr``'s result).
    args: its arguments.
    observe: called after every equation.

  Returns:
    The jaxpr's outputs.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jmp_lite._jaxpr import interpret
    >>> seen = []
    >>> closed = jax.make_jaxpr(lambda x: jax.jit(jnp.sin)(x) * 2)(1.0)
    >>> outs = interpret(closed, [0.0], lambda s, i, o: seen.append(
    ...     (s.primitive, s.within)))
    >>> seen, float(outs[0])
    ([('sin', ('jit',)), ('jit', ()), ('mul', ())], 0.0)
  """
  jaxpr, consts = jaxpr_and_consts(closed)
  return _interpret(jaxpr, consts, args, observe, "", ())


def _interpret(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any],
               observe: Observer, outer: str,
               within: tuple[str, ...]) -> list[Any]:
  env: dict[Any, Any] = {}
  read = lambda a: a.val if is_literal(a) else env[a]
  for var, value in zip(jaxpr.constvars, consts, strict=True):
    env[var] = value
  for var, value in zip(jaxpr.invars, args, strict=True):
    env[var] = value
  for eqn in jaxpr.eqns:
    invals = [read(a) for a in eqn.invars]
    scope = join_scopes(outer, str(name_stack_of(eqn)))
    inlined = inline_jaxpr(eqn)
    if inlined is not None:
      sub, sub_consts = inlined
      outs = _interpret(sub, sub_consts, invals, observe, scope,
                        (*within, eqn.primitive.name))
    else:
      outs = bind(eqn, dict(eqn.params), invals)
    observe(Site(eqn, scope, within), invals, outs)
    for var, value in zip(eqn.outvars, outs, strict=True):
      env[var] = value
  return [read(v) for v in jaxpr.outvars]
