"""The one place jmp_lite touches JAX's jaxpr machinery.

Everything here goes through ``jax.extend.core`` (JAX's API for extensions)
and the ``get_bind_params``/``bind`` protocol every primitive implements.
Tested against the JAX versions in pyproject.toml.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import jax
from jax.extend import core as jex

ClosedJaxpr = jex.ClosedJaxpr
Jaxpr = jex.Jaxpr
Literal = jex.Literal


def trace(fn: Callable[..., Any], *args: Any) -> tuple[jex.ClosedJaxpr, Any]:
  """Traces ``fn`` to a closed jaxpr and the pytree of its outputs' shapes."""
  return jax.make_jaxpr(fn, return_shape=True)(*args)


def bind(eqn: Any, params: dict[str, Any], invals: Sequence[Any]) -> list[Any]:
  """Binds ``eqn``'s primitive with ``params`` to ``invals``; returns a list."""
  got = eqn.primitive.get_bind_params(params)
  if isinstance(got, tuple):  # JAX < 0.7 returned (subfuns, params).
    subfuns, bind_params = got
  else:
    subfuns, bind_params = (), got
  with eqn.ctx.manager:
    out = eqn.primitive.bind(*subfuns, *invals, **bind_params)
  return list(out) if eqn.primitive.multiple_results else [out]


def aval_of(atom: Any) -> Any:
  """The abstract value (shape, dtype, weak type) of a jaxpr variable."""
  return atom.aval


def is_literal(atom: Any) -> bool:
  """Whether a jaxpr operand is an inline constant rather than a variable."""
  return isinstance(atom, jex.Literal)


def rebuild_closed(closed: jex.ClosedJaxpr,
                   run: Callable[..., Sequence[Any]]) -> jex.ClosedJaxpr:
  """A jaxpr with ``closed``'s signature whose body is ``run(*args)``."""
  avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type)
           for a in closed.in_avals]
  return jax.make_jaxpr(run)(*avals)


def rebuild_open(jaxpr: jex.Jaxpr,
                 run: Callable[..., Sequence[Any]]) -> jex.Jaxpr:
  """As :func:`rebuild_closed`, for an open (const-free) jaxpr."""
  closed = rebuild_closed(jex.ClosedJaxpr(jaxpr, ()), run)
  if closed.consts:
    raise NotImplementedError(
        "autocast: a re-typed sub-computation captured constants where JAX"
        " allows none; please report this with the function that caused it")
  return closed.jaxpr


def sub_context(eqn: Any) -> Any:
  """The context a sub-computation of ``eqn`` must be re-traced in.

  ``shard_map`` bodies use collectives over the mesh's manual axes, which
  must be bound while tracing them (JAX internal, isolated here).
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


def rebuild_open_exact(jaxpr: jex.Jaxpr,
                       run: Callable[..., Sequence[Any]]) -> jex.Jaxpr:
  """As :func:`rebuild_open`, tracing with ``jaxpr``'s own avals.

  ``shard_map`` bodies' avals carry which mesh axes each value varies over,
  which ``ShapeDtypeStruct`` cannot express and collectives check (JAX
  internal, isolated here).
  """
  from jax._src import linear_util as _lu
  from jax._src.interpreters import partial_eval as _pe
  avals = [v.aval for v in jaxpr.invars]
  fun = _lu.wrap_init(lambda *a: list(run(*a)), debug_info=jaxpr.debug_info)
  new, _, consts = _pe.trace_to_jaxpr_dynamic(fun, avals)
  if consts:
    raise NotImplementedError(
        "autocast: a re-typed shard_map body captured constants; please"
        " report this with the function that caused it")
  return new


def name_stack(eqn: Any) -> str:
  """The ``jax.named_scope`` path an equation was traced under."""
  return str(eqn.source_info.name_stack)


def primitives_by_name() -> dict[str, Any]:
  """The primitives ``jax.lax`` exports (``jax.lax.exp_p`` and so on)."""
  out = {}
  for name in dir(jax.lax):
    if name.endswith("_p"):
      prim = getattr(jax.lax, name)
      if isinstance(prim, jex.Primitive):
        out[prim.name] = prim
  return out


def has_subjaxprs(eqn: Any) -> bool:
  """Whether ``eqn`` is higher-order (carries jaxprs in its parameters)."""
  return any(True for _ in jex.jaxprs_in_params(eqn.params))


def source_location(eqn: Any) -> str:
  """``file:line:column (function)`` of the user code behind ``eqn``."""
  from jax._src import source_info_util as _siu  # Internal (see module doc).
  try:
    return _siu.summarize(eqn.source_info)
  except Exception:  # Best effort: a location is a hint, never an error.
    return "<unknown>"


def inline_jaxpr(eqn: Any) -> tuple[Any, Sequence[Any]] | None:
  """The (jaxpr, consts) a call-like equation evaluates, or None.

  For ``jit``, ``custom_jvp_call``, ``custom_vjp_call``, ``remat2`` and
  ``closed_call``: evaluating that jaxpr on the equation's inputs gives its
  outputs. Control flow (``scan``, ``while``, ``cond``) is not call-like.
  """
  name = eqn.primitive.name
  if name not in ("jit", "pjit", "custom_jvp_call", "custom_vjp_call",
                  "remat2", "checkpoint", "closed_call", "core_call"):
    return None
  for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    sub = eqn.params.get(key)
    if isinstance(sub, jex.ClosedJaxpr):
      return sub.jaxpr, sub.consts
    if isinstance(sub, jex.Jaxpr):
      return sub, ()
  return None
