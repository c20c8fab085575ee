"""Building blocks for rewriting a jaxpr's equations with new types.

Everything here goes through ``jax.extend.core`` (JAX's API for extensions:
variables, equations, jaxprs), each primitive's ``abstract_eval`` and the
``get_bind_params``/``bind`` protocol; the few internals still needed are
imported inside the function that needs them. Differences between JAX
versions are detected by what objects are and have (for example whether a
jaxpr carries its own constants), never by version number.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex

# JAX 0.12 merged closed and open jaxprs into one class; ClosedJaxpr stays as
# an alias that type checkers do not count as exported.
from jax.extend.core import (
    ClosedJaxpr,  # pyright: ignore[reportPrivateImportUsage]
)

Literal = jex.Literal

# The call-like primitives: evaluating their jaxpr on the equation's inputs
# gives its outputs.
_CALL_LIKE = frozenset({"jit", "pjit", "custom_jvp_call", "custom_vjp_call",
                        "remat2", "checkpoint", "closed_call", "core_call"})


def bind(eqn: Any, params: dict[str, Any], invals: Sequence[Any]) -> list[Any]:
  """Binds ``eqn``'s primitive with ``params`` to ``invals``; returns a list.

  Example:
    >>> import jax
    >>> from jmp_lite._jaxpr import bind, walk
    >>> eqn = next(walk(jax.make_jaxpr(lambda x: x * 2)(1.0))).eqn
    >>> bind(eqn, eqn.params, [3.0, 2.0])
    [Array(6., dtype=float32, weak_type=True)]
  """
  got = eqn.primitive.get_bind_params(params)
  if isinstance(got, tuple):  # JAX < 0.7 returned (subfuns, params).
    subfuns, bind_params = got
  else:
    subfuns, bind_params = (), got
  with eqn.ctx.manager:
    out = eqn.primitive.bind(*subfuns, *invals, **bind_params)
  return list(out) if eqn.primitive.multiple_results else [out]


def is_literal(atom: Any) -> bool:
  """Whether a jaxpr operand is an inline constant rather than a variable.

  Example:
    >>> import jax
    >>> from jmp_lite._jaxpr import is_literal, walk
    >>> eqn = next(walk(jax.make_jaxpr(lambda x: x * 2)(1.0))).eqn
    >>> [is_literal(a) for a in eqn.invars]
    [False, True]
  """
  return isinstance(atom, Literal)


def is_jaxpr(obj: Any) -> bool:
  """Whether ``obj`` is a jaxpr (open or closed) held in a parameter.

  Example:
    >>> import jax
    >>> from jmp_lite._jaxpr import is_jaxpr
    >>> is_jaxpr(jax.make_jaxpr(lambda x: x)(1.0)), is_jaxpr(1.0)
    (True, False)
  """
  return isinstance(obj, (ClosedJaxpr, jex.Jaxpr))


def has_subjaxprs(eqn: Any) -> bool:
  """Whether ``eqn`` is higher-order (carries jaxprs in its parameters).

  Example:
    >>> import jax
    >>> from jmp_lite._jaxpr import has_subjaxprs, walk
    >>> closed = jax.make_jaxpr(lambda x: jax.jit(lambda y: y + 1)(x))(1.0)
    >>> [has_subjaxprs(s.eqn) for s in walk(closed)]
    [True, False]
  """
  return any(True for _ in jex.jaxprs_in_params(eqn.params))


def jaxpr_and_consts(sub: Any) -> tuple[Any, Sequence[Any]]:
  """The open jaxpr and constants that evaluate ``sub``, of any kind.

  Three kinds exist, told apart by what the object has, never by version: a
  closed jaxpr wrapping a distinct open one (``sub.jaxpr is not sub``), a
  jaxpr carrying its own constants (JAX 0.12 unified the classes:
  ``sub.jaxpr is sub``, its ``constvars`` are the attached ones), and an open
  jaxpr with no ``consts`` at all.

  Example:
    >>> import jax
    >>> from jmp_lite._jaxpr import jaxpr_and_consts
    >>> jaxpr, consts = jaxpr_and_consts(jax.make_jaxpr(lambda x: x)(1.0))
    >>> len(jaxpr.invars), len(consts)
    (1, 0)
  """
  consts = getattr(sub, "consts", None)
  if consts is None:
    return sub, ()
  return sub.jaxpr, consts


def rebuilt(sub: Any, body: Any) -> Any:
  """``body`` (a rewrite of ``sub``'s open jaxpr) as a jaxpr of ``sub``'s kind.

  ``body`` must have been made with :func:`rewrite` from
  ``jaxpr_and_consts(sub)[0]``, so it has the same inputs and constants.

  Example:
    >>> import jax
    >>> from jmp_lite._jaxpr import jaxpr_and_consts, rebuilt, rewrite
    >>> closed = jax.make_jaxpr(lambda x: x * 2)(1.0)
    >>> body, _ = jaxpr_and_consts(closed)
    >>> same = rebuilt(closed, rewrite(body, body.eqns, body.outvars))
    >>> jax.extend.core.jaxpr_as_fun(same)(3.0)
    [Array(6., dtype=float32, weak_type=True)]
  """
  consts = getattr(sub, "consts", None)
  if consts is None or sub.jaxpr is sub:  # Open, or carries its constants.
    return body
  return ClosedJaxpr(body, consts)


def rewrite(jaxpr: Any, eqns: Sequence[Any], outvars: Sequence[Any]) -> Any:
  """``jaxpr`` with a new body, keeping its inputs, constants and effects.

  Example:
    >>> import jax
    >>> from jmp_lite._jaxpr import rewrite
    >>> body = jax.make_jaxpr(lambda x: x * 2)(1.0).jaxpr
    >>> len(rewrite(body, [], body.invars).eqns)  # The identity.
    0
  """
  return jaxpr.replace(eqns=list(eqns), outvars=list(outvars))


def consts_as_args(jaxpr: Any) -> Any:
  """A closed, constant-free jaxpr of ``jaxpr`` taking its constants first.

  Example:
    >>> import jax, numpy as np
    >>> from jmp_lite._jaxpr import consts_as_args
    >>> c = np.arange(3.0)
    >>> body = jax.make_jaxpr(lambda x: x + c)(np.ones(3)).jaxpr
    >>> len(body.constvars), len(consts_as_args(body).in_avals)
    (1, 2)
  """
  return ClosedJaxpr(
      jaxpr.replace(constvars=[], invars=[*jaxpr.constvars, *jaxpr.invars],
                    debug_info=jaxpr.debug_info.with_unknown_names()), ())


def new_var(like: Any, aval: Any) -> Any:
  """A fresh variable of type ``aval`` (dropped if ``like`` is dropped).

  Example:
    >>> import jax
    >>> from jmp_lite._jaxpr import new_var
    >>> body = jax.make_jaxpr(lambda x: x * 2)(1.0).jaxpr
    >>> new_var(body.invars[0], body.invars[0].aval).aval
    ShapedArray(float32[], weak_type=True)
  """
  return jex.DropVar(aval) if isinstance(like, jex.DropVar) else jex.Var(aval)


def abstract_eval(primitive: Any, avals: Sequence[Any],
                  params: dict[str, Any]) -> tuple[list[Any], Any]:
  """Output types and effects of ``primitive`` applied to ``avals``.

  Raises what binding would raise for unsupported operand types.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jmp_lite._jaxpr import abstract_eval
    >>> aval = jax.core.ShapedArray((2,), jnp.bfloat16)
    >>> abstract_eval(jax.lax.exp_p, [aval], {"accuracy": None})[0]
    [ShapedArray(bfloat16[2])]
  """
  out, effects = primitive.abstract_eval(*avals, **params)
  return (list(out) if primitive.multiple_results else [out]), effects


def new_eqn(like: Any, invars: Sequence[Any], outvars: Sequence[Any],
            primitive: Any, params: dict[str, Any], effects: Any) -> Any:
  """An equation with ``like``'s source location and context.

  Example:
    >>> import jax
    >>> from jmp_lite._jaxpr import new_eqn
    >>> eqn = jax.make_jaxpr(lambda x: x * 2)(1.0).jaxpr.eqns[0]
    >>> copy = new_eqn(eqn, eqn.invars, eqn.outvars, eqn.primitive,
    ...                eqn.params, eqn.effects)
    >>> copy.source_info is eqn.source_info
    True
  """
  return jex.new_jaxpr_eqn(list(invars), list(outvars), primitive, params,
                           effects, like.source_info, like.ctx)


def with_operands(eqn: Any, invars: Sequence[Any],
                  params: dict[str, Any] | None = None) -> Any:
  """``eqn`` on other operands of the same types (and ``params``, if given).

  Example:
    >>> import jax
    >>> from jmp_lite._jaxpr import with_operands
    >>> eqn = jax.make_jaxpr(lambda x, y: x * y)(1.0, 2.0).jaxpr.eqns[0]
    >>> swapped = with_operands(eqn, eqn.invars[::-1])
    >>> swapped.invars == eqn.invars[::-1], swapped.outvars == eqn.outvars
    (True, True)
  """
  if params is None:
    return eqn.replace(invars=list(invars))
  return eqn.replace(invars=list(invars), params=params)


def convert(atom: Any, dtype: np.dtype, like: Any) -> tuple[Any, Any]:
  """``(eqn or None, new atom)``: ``atom`` converted to ``dtype``.

  As ``lax.convert_element_type(x, dtype)``: the result is not weak-typed; a
  literal is converted on the host into a new literal (no equation).

  Example:
    >>> import jax, numpy as np
    >>> from jmp_lite._jaxpr import convert
    >>> eqn = jax.make_jaxpr(lambda x: x * 2)(1.0).jaxpr.eqns[0]
    >>> cast, out = convert(eqn.invars[0], np.dtype("float16"), eqn)
    >>> cast.primitive.name, out.aval
    ('convert_element_type', ShapedArray(float16[]))
  """
  if isinstance(atom, Literal):
    aval = atom.aval.update(dtype=dtype, weak_type=False)
    value = np.asarray(atom.val, dtype)
    if hasattr(atom.val, "aval"):  # JAX's typed host arrays carry their type.
      value = type(atom.val)(value, aval)
    return None, Literal(value, aval)
  # The type convert_element_type's abstract evaluation gives: the new
  # dtype, strong, everything else (shape, sharding, varying axes) kept.
  out = jex.Var(atom.aval.update(dtype=dtype, weak_type=False))
  params = dict(new_dtype=dtype, weak_type=False, sharding=None)
  return new_eqn(like, [atom], [out], jax.lax.convert_element_type_p, params,
                 jex.no_effects), out


def sub_context(eqn: Any) -> Any:
  """The context a sub-computation of ``eqn`` must be rewritten in.

  ``shard_map`` bodies use collectives over the mesh's manual axes, whose
  abstract evaluation needs those axes bound, and their values' types carry
  the axes they vary over (JAX internal, isolated here).

  Example:
    >>> import jax
    >>> from jmp_lite._jaxpr import sub_context
    >>> eqn = jax.make_jaxpr(lambda x: jax.jit(abs)(x))(1.0).jaxpr.eqns[0]
    >>> with sub_context(eqn):  # Nothing to bind outside shard_map.
    ...   pass
  """
  if eqn.primitive.name == "shard_map":
    from jax._src import config as _config  # Internal (see module doc).
    from jax._src import core as _core
    mesh = eqn.params["mesh"]
    axes = eqn.params.get("newly_manual_axes") or mesh.axis_names
    stack = contextlib.ExitStack()
    stack.enter_context(
        _core.extend_axis_env_nd([(a, mesh.shape[a]) for a in axes]))
    # Varying-axes types propagate only while the check is on, as when
    # shard_map traced the body in the first place.
    stack.enter_context(
        _config._check_vma(bool(eqn.params.get("check_vma", True))))
    return stack
  return contextlib.nullcontext()


def primitives_by_name() -> dict[str, Any]:
  """The primitives ``jax.lax`` exports (``jax.lax.exp_p`` and so on).

  Example:
    >>> import jax
    >>> from jmp_lite._jaxpr import primitives_by_name
    >>> primitives_by_name()["exp"] is jax.lax.exp_p
    True
  """
  out = {}
  for name in dir(jax.lax):
    if name.endswith("_p"):
      prim = getattr(jax.lax, name)
      if isinstance(prim, jex.Primitive):
        out[prim.name] = prim
  return out


def inline_jaxpr(eqn: Any) -> tuple[Any, Sequence[Any]] | None:
  """The (jaxpr, consts) a call-like equation evaluates, or None.

  For ``jit``, ``custom_jvp_call``, ``custom_vjp_call``, ``remat2`` and
  ``closed_call``: evaluating that jaxpr on the equation's inputs gives its
  outputs. Control flow (``scan``, ``while``, ``cond``) is not call-like.

  Example:
    >>> import jax
    >>> from jmp_lite._jaxpr import inline_jaxpr
    >>> eqn = jax.make_jaxpr(lambda x: jax.jit(abs)(x))(1.0).jaxpr.eqns[0]
    >>> [e.primitive.name for e in inline_jaxpr(eqn)[0].eqns]
    ['abs']
  """
  if eqn.primitive.name not in _CALL_LIKE:
    return None
  for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    sub = eqn.params.get(key)
    if is_jaxpr(sub):
      return jaxpr_and_consts(sub)
  return None
