"""Tracing functions to jaxprs, and calling jaxprs from a caller's trace."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex


def trace(fn: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
  """Traces ``fn`` to a closed jaxpr and the pytree of its outputs' shapes.

  Example:
    >>> from jmp_lite._jaxpr import trace
    >>> closed, shape = trace(lambda x: (x, x * 2), 1.0)
    >>> len(closed.jaxpr.outvars), shape[1].dtype
    (2, dtype('float32'))
  """
  return jax.make_jaxpr(fn, return_shape=True)(*args)


def trace_flat(fn: Callable[..., Sequence[Any]],
               args: Sequence[Any]) -> Any:
  """Traces ``fn(*args)`` (arrays in, a flat list of arrays out) to a jaxpr.

  ``jax.jit(fn).trace`` does what ``jax.make_jaxpr`` does at lower cost
  (measured ~10% on a 12-layer Transformer).

  Example:
    >>> from jmp_lite._jaxpr import trace_flat
    >>> closed = trace_flat(lambda x: [x * 2], [1.0])
    >>> len(closed.jaxpr.invars), len(closed.jaxpr.outvars)
    (1, 1)
  """
  return jax.jit(fn).trace(*args).jaxpr


def traced_call(fn: Callable[..., Any], avals: Sequence[Any]) -> Any:
  """The equation of a call of ``jax.jit(fn)`` on values of types ``avals``.

  A template: emit it (with the operands of one's choosing) to call ``fn``
  from a rewritten jaxpr.

  Args:
    fn: the function (arrays in, arrays out).
    avals: ``jax.ShapeDtypeStruct`` of its arguments.

  Returns:
    A ``jit`` equation.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jmp_lite._jaxpr import traced_call
    >>> eqn = traced_call(jnp.sin, [jax.ShapeDtypeStruct((2,), jnp.float32)])
    >>> eqn.primitive.name, eqn.outvars[0].aval
    ('jit', ShapedArray(float32[2]))
  """
  return jax.jit(lambda *xs: jax.jit(fn)(*xs)).trace(*avals).jaxpr.eqns[0]


def evaluate(jaxpr: Any, args: Sequence[Any]) -> list[Any]:
  """Evaluates a closed jaxpr equation by equation on ``args``.

  Example:
    >>> import jax
    >>> from jmp_lite._jaxpr import evaluate
    >>> evaluate(jax.make_jaxpr(lambda x: x * 2)(1.0), [3.0])
    [Array(6., dtype=float32, weak_type=True)]
  """
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

  Example:
    >>> import jax
    >>> from jmp_lite._jaxpr import call, walk
    >>> closed = jax.make_jaxpr(lambda x: x * 2)(1.0)
    >>> [s.primitive for s in walk(jax.make_jaxpr(
    ...     lambda x: jax.jit(lambda y: call(closed, [y]))(x))(1.0))]
    ['jit', 'jit', 'mul']
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


def differentiable_call(jaxpr: Any, args: Sequence[Any]) -> list[Any]:
  """:func:`call`, differentiated as a whole.

  JAX linearizes a primitive bound on its own through a per-primitive
  fallback that costs a small trace each, and linearizing a nested ``jit``
  re-traces its whole jaxpr through partial evaluation; the plain function
  avoids both because ``jax.numpy`` wraps most operations in cached ``jit``
  functions. So the call carries a JVP rule: the equations evaluated one by
  one under forward mode, which ``jax.grad``/``jax.vjp`` linearize in one
  pass. Only non-zero tangents enter.

  Example:
    >>> import jax
    >>> from jmp_lite._jaxpr import consts_as_args, differentiable_call
    >>> closed = consts_as_args(jax.make_jaxpr(lambda x: x * x)(1.0).jaxpr)
    >>> jax.grad(lambda x: differentiable_call(closed, [x])[0])(3.0)
    Array(6., dtype=float32, weak_type=True)
  """
  fn = jax.custom_jvp(lambda *xs: call(jaxpr, xs))

  def jvp(primals: Sequence[Any], tangents: Sequence[Any]) -> Any:
    live = [not isinstance(t, jax.custom_derivatives.SymbolicZero)
            for t in tangents]

    def of_live(*live_primals: Any) -> list[Any]:
      it = iter(live_primals)
      return evaluate(jaxpr, [
          next(it) if keep else p
          for p, keep in zip(primals, live, strict=True)])

    return jax.jvp(
        of_live, [p for p, keep in zip(primals, live, strict=True) if keep],
        [t for t, keep in zip(tangents, live, strict=True) if keep])

  fn.defjvp(jvp, symbolic_zeros=True)
  return fn(*args)
