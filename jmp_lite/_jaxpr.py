"""The one place jmp_lite touches JAX's jaxpr machinery.

Everything here goes through ``jax.extend.core`` (JAX's API for extensions:
variables, equations, jaxprs, ``jit_p``), each primitive's
``abstract_eval`` and the ``get_bind_params``/``bind`` protocol; the few
internals still needed are imported inside the function that needs them.
Differences between JAX versions are detected by what objects are and have
(for example whether a jaxpr carries its own constants), never by version
number. Tested on jax 0.10.2 and 0.12.0.1.

Also :func:`split_array_args`, the one rule for which parts of a function's
arguments are traced (array leaves) and which are passed through as Python
values (everything else).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax import core as jax_core
from jax.extend import core as jex

# JAX 0.12 merged closed and open jaxprs into one class; ClosedJaxpr stays as
# an alias that type checkers do not count as exported.
from jax.extend.core import (
    ClosedJaxpr,  # pyright: ignore[reportPrivateImportUsage]
)

Literal = jex.Literal

_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)


def split_array_args(
    tree: Any) -> tuple[list[Any], Callable[[Sequence[Any]], Any]]:
  """Splits a pytree into its array leaves and a function that rebuilds it.

  Array leaves (``jax.Array`` including tracers, typed PRNG keys and
  ``float0`` arrays; numpy arrays and scalars; ``jax.ShapeDtypeStruct``) are
  what a tracing transformation should trace. Every other leaf (functions
  such as ``jax.nn.relu`` held by an Equinox module, Python numbers, strings,
  ``None``) is kept as it is and put back by ``rebuild``.

  Args:
    tree: any pytree, e.g. ``(args, kwargs)`` of a call.

  Returns:
    ``(arrays, rebuild)``: the array leaves in ``jax.tree.leaves`` order, and
    ``rebuild(new_arrays)`` giving ``tree`` with those leaves replaced.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite._jaxpr import split_array_args
    >>> arrays, rebuild = split_array_args(({"w": jnp.ones(2), "act": abs}, 3))
    >>> len(arrays), rebuild([jnp.zeros(2)])[0]["act"] is abs
    (1, True)
  """
  leaves, treedef = jax.tree.flatten(tree)
  where = [i for i, x in enumerate(leaves) if isinstance(x, _ARRAY_TYPES)]
  arrays = [leaves[i] for i in where]

  def rebuild(new_arrays: Sequence[Any]) -> Any:
    if len(new_arrays) != len(where):
      raise ValueError(f"expected {len(where)} arrays, got {len(new_arrays)}")
    full = list(leaves)
    for i, x in zip(where, new_arrays, strict=True):
      full[i] = x
    return jax.tree.unflatten(treedef, full)

  return arrays, rebuild


def trace(fn: Callable[..., Any], *args: Any) -> tuple[ClosedJaxpr, Any]:
  """Traces ``fn`` to a closed jaxpr and the pytree of its outputs' shapes."""
  return jax.make_jaxpr(fn, return_shape=True)(*args)


def trace_flat(fn: Callable[..., Sequence[Any]],
               args: Sequence[Any]) -> ClosedJaxpr:
  """Traces ``fn(*args)`` (arrays in, a flat list of arrays out) to a jaxpr.

  ``jax.jit(fn).trace`` does what ``jax.make_jaxpr`` does at lower cost
  (measured ~10% on a 12-layer Transformer).
  """
  return jax.jit(fn).trace(*args).jaxpr


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


def is_literal(atom: Any) -> bool:
  """Whether a jaxpr operand is an inline constant rather than a variable."""
  return isinstance(atom, Literal)


def is_jaxpr(obj: Any) -> bool:
  """Whether ``obj`` is a jaxpr (open or closed) held in a parameter."""
  return isinstance(obj, (ClosedJaxpr, jex.Jaxpr))


def jaxpr_and_consts(sub: Any) -> tuple[Any, Sequence[Any]]:
  """The open jaxpr and constants that evaluate ``sub``, of any kind.

  Three kinds exist, told apart by what the object has, never by version: a
  closed jaxpr wrapping a distinct open one (``sub.jaxpr is not sub``), a
  jaxpr carrying its own constants (JAX 0.12 unified the classes:
  ``sub.jaxpr is sub``, its ``constvars`` are the attached ones), and an open
  jaxpr with no ``consts`` at all.
  """
  consts = getattr(sub, "consts", None)
  if consts is None:
    return sub, ()
  return sub.jaxpr, consts


def rebuilt(sub: Any, body: Any) -> Any:
  """``body`` (a rewrite of ``sub``'s open jaxpr) as a jaxpr of ``sub``'s kind.

  ``body`` must have been made with ``jaxpr.replace`` from
  ``jaxpr_and_consts(sub)[0]``, so it has the same inputs and constants.
  """
  consts = getattr(sub, "consts", None)
  if consts is None or sub.jaxpr is sub:  # Open, or carries its constants.
    return body
  return ClosedJaxpr(body, consts)


def rewrite(jaxpr: Any, eqns: Sequence[Any], outvars: Sequence[Any]) -> Any:
  """``jaxpr`` with a new body, keeping its inputs, constants and effects."""
  return jaxpr.replace(eqns=list(eqns), outvars=list(outvars))


def consts_as_args(jaxpr: Any) -> Any:
  """A closed, constant-free jaxpr of ``jaxpr`` taking its constants first."""
  return ClosedJaxpr(
      jaxpr.replace(constvars=[], invars=[*jaxpr.constvars, *jaxpr.invars],
                    debug_info=jaxpr.debug_info.with_unknown_names()), ())


def new_var(like: Any, aval: Any) -> Any:
  """A fresh variable of type ``aval`` (dropped if ``like`` is dropped)."""
  return jex.DropVar(aval) if isinstance(like, jex.DropVar) else jex.Var(aval)


def abstract_eval(primitive: Any, avals: Sequence[Any],
                  params: dict[str, Any]) -> tuple[list[Any], Any]:
  """Output types and effects of ``primitive`` applied to ``avals``.

  Raises what binding would raise for unsupported operand types.
  """
  out, effects = primitive.abstract_eval(*avals, **params)
  return (list(out) if primitive.multiple_results else [out]), effects


def new_eqn(like: Any, invars: Sequence[Any], outvars: Sequence[Any],
            primitive: Any, params: dict[str, Any], effects: Any) -> Any:
  """An equation with ``like``'s source location and context."""
  return jex.new_jaxpr_eqn(list(invars), list(outvars), primitive, params,
                           effects, like.source_info, like.ctx)


def convert(atom: Any, dtype: np.dtype, like: Any) -> tuple[Any, Any]:
  """``(eqn or None, new atom)``: ``atom`` converted to ``dtype``.

  As ``lax.convert_element_type(x, dtype)``: the result is not weak-typed; a
  literal is converted on the host into a new literal (no equation).
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


def is_tracer(x: Any) -> bool:
  """Whether ``x`` is a value being traced by a JAX transformation."""
  return isinstance(x, jax_core.Tracer)


def evaluate(jaxpr: Any, args: Sequence[Any]) -> list[Any]:
  """Evaluates a closed jaxpr equation by equation on ``args``."""
  return list(jex.jaxpr_as_fun(jaxpr)(*args))


def call(jaxpr: Any, args: Sequence[Any]) -> list[Any]:
  """Evaluates a closed, constant-free ``jaxpr`` on ``args``.

  Under ``jit`` it is bound as one nested ``jit`` equation (named
  ``autocast``) that holds ``jaxpr`` as it is: nothing is re-bound equation
  by equation (which added ~4x as much lowering time to a 12-layer
  Transformer's loss), and each equation keeps its own source location, which
  :func:`jmp_lite.find_nonfinite`, :func:`jmp_lite.check_alignment` and
  XLA's op metadata report. It is not inlined while tracing: JAX's inlining
  gives every copied equation the location of this ``bind`` call. XLA
  inlines the call when compiling (the same program either way). Elsewhere
  (eagerly, or under a transformation outside any ``jit``), it is evaluated
  equation by equation, which keeps the locations too, so nothing is
  compiled per call.
  """
  under_jit = getattr(jex, "unsafe_am_i_under_a_jit_DO_NOT_USE", None)
  if under_jit is not None and not under_jit():
    return evaluate(jaxpr, args)
  # The parameters of a nested jit, copied from one JAX makes here (so they
  # carry the current mesh context and whatever this JAX version expects).
  probe = jax.jit(lambda x: jax.jit(lambda y: y)(x)).trace(
      np.float32(0)).jaxpr.eqns[0].params
  n_in, n_out = len(jaxpr.in_avals), len(jaxpr.out_avals)
  params = dict(probe, jaxpr=jaxpr, name="autocast")
  for key, value in probe.items():
    if isinstance(value, tuple) and len(value) == 1:  # One entry per value.
      params[key] = value * (n_out if key.startswith("out_") else n_in)
  # ``inline`` stays as the probe has it: a plain nested jit, not inlined.
  return list(jex.primitives.jit_p.bind(*args, **params))


def sub_context(eqn: Any) -> Any:
  """The context a sub-computation of ``eqn`` must be rewritten in.

  ``shard_map`` bodies use collectives over the mesh's manual axes, whose
  abstract evaluation needs those axes bound, and their values' types carry
  the axes they vary over (JAX internal, isolated here).
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


def name_stack_of(eqn: Any) -> Any:
  """The ``jax.named_scope`` path ``eqn`` was traced under (``str`` it).

  Equations traced in the same scope share the object, so per-scope work can
  be memoised by its identity.
  """
  return eqn.source_info.name_stack


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
    if is_jaxpr(sub):
      return jaxpr_and_consts(sub)
  return None
