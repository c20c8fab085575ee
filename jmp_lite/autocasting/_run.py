"""One autocast call: trace ``fn``, rewrite its jaxpr, call the rewrite."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from jmp_lite import _jaxpr
from jmp_lite.autocasting import _writeback
from jmp_lite.autocasting._audit import AuditRecord
from jmp_lite.autocasting._fp8 import fp8_state_leaves
from jmp_lite.autocasting._options import AUTOCAST_SCOPE, Config
from jmp_lite.autocasting._retyper import AutocastRetyper


def run(fn: Callable[..., Any], cfg: Config, args: tuple, kwargs: dict,
        records: list[AuditRecord] | None = None,
        fp8_state: Any = None) -> Any:
  """Calls ``fn(*args, **kwargs)`` re-typed; array leaves are traced.

  Args:
    fn: the function.
    cfg: the checked options.
    args: its positional arguments.
    kwargs: its keyword arguments.
    records: for an audit, a list the records go to; nothing is computed
      and ``None`` is returned.
    fp8_state: with a delayed FP8 recipe, the states, whose arrays are
      traced as extra inputs (``fn`` never sees them) that the top-level
      matmuls read.

  Returns:
    ``fn``'s output (``None`` for an audit).

  Raises:
    ValueError: for an FP8 state of the wrong length.
    TypeError: for an FP8 state that is not a tuple of states.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite.autocasting._options import make_config
    >>> from jmp_lite.autocasting._run import run
    >>> run(lambda a: a @ a, make_config("bf16"), (jnp.ones((2, 2)),),
    ...     {}).dtype
    dtype('float32')
  """
  if _writeback.holds_nnx(args, kwargs):
    pure, pure_args, finish = _writeback.as_pure(fn, args, kwargs)
    # The states' variables are pytrees here: their arrays are traced.
    result = _run_arrays(pure, cfg, pure_args, {}, records, fp8_state)
    return None if records is not None else finish(result)
  return _run_arrays(fn, cfg, args, kwargs, records, fp8_state)


def _run_arrays(fn: Callable[..., Any], cfg: Config, args: tuple,
                kwargs: dict, records: list[AuditRecord] | None,
                fp8_state: Any) -> Any:
  """:func:`run` for arguments whose array leaves are all there is."""
  arrays, rebuild = _jaxpr.split_array_args((args, kwargs))
  state = [] if fp8_state is None else fp8_state_leaves(fp8_state)
  rebuild_out: list[Callable[[Sequence[Any]], Any]] = []

  def flat_fn(*xs: Any) -> list[Any]:
    a, k = rebuild(xs[:len(arrays)])
    out_arrays, rebuild_outputs = _jaxpr.split_array_args(fn(*a, **k))
    rebuild_out.append(rebuild_outputs)
    return out_arrays

  closed = _jaxpr.trace_flat(flat_fn, [*arrays, *state])
  jaxpr, consts = _jaxpr.jaxpr_and_consts(closed)
  state_vars = jaxpr.invars[len(arrays):]
  pairs = (list(zip(state_vars[0::2], state_vars[1::2], strict=True))
           if fp8_state is not None else None)
  retyper = AutocastRetyper(cfg, records, pairs)
  new = retyper.rewrite(jaxpr, "auto")
  if pairs is not None and retyper.fp8_delayed != len(pairs):
    raise ValueError(
        f"fp8_state holds {len(pairs)} scaling states, but fn has"
        f" {retyper.fp8_delayed} delayed-scaled matmuls; build the state with"
        " jmp_lite.autocast_fp8_state(fn, dtype, *args, fp8=...)")
  if records is not None:  # The audit needs the rewrite only.
    return None
  # Constants become explicit arguments: none is closed over (a traced
  # constant must be differentiated like any argument).
  call_jaxpr = _jaxpr.consts_as_args(new)
  values = [*consts, *arrays, *state]
  with jax.named_scope(AUTOCAST_SCOPE):
    if any(map(_jaxpr.is_tracer, values)):
      outs = _jaxpr.differentiable_call(call_jaxpr, values)
    else:  # Eager: nothing to differentiate.
      outs = _jaxpr.call(call_jaxpr, values)
  return rebuild_out[0](outs)
