"""The trace behind :func:`jmp_lite.linen.dtype_report`.

The policy's call runs once under :func:`jax.make_jaxpr` with a
:class:`~jmp_lite.report.Recorder` in its
:class:`~jmp_lite.linen._intercept.PolicyCall`; the report reads the jaxpr.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax

from jmp_lite import _jaxpr
from jmp_lite import report as _report
from jmp_lite.diagnostics import tree_bytes
from jmp_lite.linen._intercept import PolicyCall

Path = tuple[str, ...]


def own_params(tree: Any) -> dict[Path, Any]:
  """Each module path's own params (leaves that are not submodule dicts).

  Args:
    tree: a ``"params"`` collection (a dict or ``FrozenDict``).

  Returns:
    Module path -> ``{name: param}`` of the params stored at that path.

  Example:
    >>> from jmp_lite.linen._report import own_params
    >>> own_params({"Dense_0": {"kernel": 1, "bias": 2}, "scale": 3})
    {(): {'scale': 3}, ('Dense_0',): {'kernel': 1, 'bias': 2}}
  """
  out: dict[Path, Any] = {}

  def walk(node: Any, path: Path) -> None:
    own = {k: v for k, v in node.items() if not isinstance(v, Mapping)}
    if own:
      out[path] = own
    for k, v in node.items():
      if isinstance(v, Mapping):
        walk(v, path + (str(k),))

  if isinstance(tree, Mapping):
    walk(tree, ())
  return out


def trace_report(model: nn.Module, variables: Any, method: Any, args: tuple,
                 kwargs: dict) -> _report.DtypeReport:
  """Traces ``model``'s policy call abstractly and builds its report.

  Args:
    model: a :class:`jmp_lite.linen.MixedPrecision`.
    variables: its variables.
    method: the wrapped model's method (``None``, a name or a function).
    args: example inputs.
    kwargs: more inputs.

  Returns:
    The :class:`~jmp_lite.report.DtypeReport`.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, jmp_lite.linen
    >>> from jmp_lite.linen._report import trace_report
    >>> model = jmp_lite.linen.mixed_precision(nn.Dense(2), "c=bf16")
    >>> v = model.init(jax.random.key(0), jnp.ones((1, 3)))
    >>> trace_report(model, v, None, (jnp.ones((1, 3)),), {}).rows[0].computed
    'bfloat16'
  """
  recorder = _report.Recorder()
  # Nested policies inside record their modules here too: the interceptor
  # hands each one `recorder.under(its path)` in its PolicyCall.
  run = PolicyCall(method, recorder)

  def f(v: Any, a: tuple, k: dict) -> Any:
    return nn.Module.apply(model, v, *a, method=run, mutable=True, **k)

  arrays, rebuild = _jaxpr.split_array_args((dict(variables), args, kwargs))
  jaxpr = jax.make_jaxpr(lambda *xs: f(*rebuild(xs)))(*arrays)
  params = variables.get("params", {})
  return recorder.report(jaxpr, own_params(params), tree_bytes(params))
