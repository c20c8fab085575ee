"""Op-level autocast for JAX: re-type every primitive by rule (torch.autocast).

:func:`autocast` returns a function with ``fn``'s signature that runs ``fn``
with each primitive re-typed:

* **lower** list (default: ``dot_general``, ``conv_general_dilated``, the
  primitives behind ``@``, ``jnp.einsum``, ``jnp.matmul``, attention): float
  inputs cast to the compute dtype, result in the compute dtype (XLA
  accumulates in float32), and so are the gradient's matmuls;
* **float32** list (PyTorch's CUDA float32 list mapped to ``lax``
  primitives: ``exp``, ``log``, ``log1p``, ``expm1``, ``pow``, ``rsqrt``,
  ``logistic``, reductions ``reduce_sum``/``cumsum``/..., the pieces of
  softmax, logsumexp, norms and losses): float inputs cast to float32;
* every other primitive runs in the widest float dtype among its (non-literal)
  inputs (**promote**).

Integer, bool and float64 values are never touched, and outputs come back in
the dtypes ``fn`` would return. It works eagerly and under ``jax.jit``,
``jax.grad``, ``jax.vmap`` and ``jax.checkpoint``, and recurses into nested
``jit``, ``custom_jvp``/``custom_vjp`` functions, ``lax.scan``,
``lax.while_loop``, ``lax.cond``/``switch`` and ``jax.checkpoint``. Each
sub-computation keeps its original signature (values crossing its boundary
are cast back), so control-flow typing stays valid.

Regions: code under ``jax.named_scope(name)`` with ``name`` in
``exclude_scopes`` (or inside :func:`float32_region`) runs exactly as
written; code under a name in ``force_scopes`` (or :func:`half_region`) runs
every float primitive in the compute dtype.

Arguments: the array leaves of the positional and keyword arguments are
traced (typed PRNG keys and ``float0`` arrays too, which pass through
untouched); every other leaf (an Equinox module's functions and Python
fields, strings, ``None``) is handed to ``fn`` as it is. Outputs may hold
non-array leaves likewise.

How: ``fn`` is traced once to a jaxpr, which is rewritten equation by
equation (an equation whose operand types do not change is kept as it is,
a sub-computation used several times is rewritten once per call) and then
called from the caller's trace as one nested ``jit`` named ``autocast``
(which XLA inlines), each equation keeping the source location of the one it
replaces. Its derivative is the forward-mode derivative of the rewritten
equations, so ``jax.grad`` sees the same re-typed computation.

This package's ``__init__`` is autocast's public face; its parts, one
concept per module, are private to it, and the jaxpr machinery they use lives
in ``jmp_lite._jaxpr``:

* ``_options`` — the primitive lists, region scope names, and the checked
  options (``Config``);
* ``_retyper`` — the autocast rules, plugged into
  ``jmp_lite._jaxpr.Rewriter``;
* ``_fp8`` — the FP8 swap: a matmul as one ``jmp_lite.fp8.dot_general``
  call, and the delayed-scaling state's arrays;
* ``_audit`` — ``Audit`` and its records;
* ``_writeback`` — Flax nnx arguments: run as a pure function, changed
  variables written back;
* ``_run`` — one autocast call: trace, rewrite, call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax

from jmp_lite.autocasting import _options
from jmp_lite.autocasting._audit import Audit, AuditRecord
from jmp_lite.autocasting._options import check_options, make_config
from jmp_lite.autocasting._run import run

__all__ = ["Audit", "AuditRecord", "FLOAT32_PRIMITIVES", "LOWER_PRECISION",
           "autocast", "autocast_audit", "autocast_fp8_state",
           "float32_region", "half_region"]

LOWER_PRECISION: tuple[str, ...] = _options.LOWER_PRECISION
"""Primitives run in the compute dtype by default."""

FLOAT32_PRIMITIVES: tuple[str, ...] = _options.FLOAT32_PRIMITIVES
"""Primitives run in float32 by default (PyTorch's CUDA float32 list).

A list of primitive names, not a policy (hence not plain ``FLOAT32``).
"""


def float32_region() -> Any:
  """A ``jax.named_scope`` whose code autocast leaves exactly as written.

  Returns:
    A context manager.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> def f(x):
    ...   with jmp_lite.float32_region():
    ...     y = x @ x
    ...   return y
    >>> jmp_lite.autocast(f, jnp.bfloat16)(jnp.ones((2, 2))).dtype
    dtype('float32')
  """
  return jax.named_scope(_options.FLOAT32_SCOPE)


def half_region() -> Any:
  """A ``jax.named_scope`` in which autocast runs every float op in half.

  Returns:
    A context manager.

  Example:
    >>> import jax, jax.numpy as jnp, jmp_lite
    >>> def f(x):
    ...   with jmp_lite.half_region():
    ...     return jnp.exp(x)  # exp is on the float32 list, but forced here
    >>> audit = jmp_lite.autocast_audit(f, "bf16", jnp.ones(2))
    >>> [r.dtype for r in audit.records]
    ['bfloat16']
  """
  return jax.named_scope(_options.HALF_SCOPE)


def autocast(
    fn: Callable[..., Any],
    policy_or_dtype: Any = None,
    *,
    allow: Iterable[Any] = (),
    deny: Iterable[Any] = (),
    use_default_lists: bool = True,
    exclude_scopes: Sequence[str] = (),
    force_scopes: Sequence[str] = (),
    accumulate_in_float32: bool = False,
    fp8: Any = None,
    fp8_scopes: Sequence[str] | None = None,
    fp8_exclude_scopes: Sequence[str] = (),
) -> Callable[..., Any]:
  """Returns ``fn`` with every primitive re-typed by the autocast rules.

  Args:
    fn: the function to transform.
    policy_or_dtype: a :class:`~jmp_lite.Policy` or policy string such as
      ``"p=f32,c=bf16,o=f32"`` (its compute dtype is used), or a
      dtype/name; ``None`` means :func:`~jmp_lite.half_dtype`.
    allow: primitives (names or ``jax.lax.*_p``) to add to the lower-precision
      list (Paddle's ``custom_white_list``); removed from the float32 list.
    deny: primitives to add to the float32 list (``custom_black_list``);
      removed from the lower-precision list.
    use_default_lists: start from :data:`LOWER_PRECISION` and
      :data:`FLOAT32_PRIMITIVES` (``False``: only your lists).
    exclude_scopes: ``jax.named_scope`` names whose code runs as written.
    force_scopes: ``jax.named_scope`` names whose float ops all run in the
      compute dtype.
    accumulate_in_float32: ask lower-precision matmuls and convolutions for
      a float32 result (``preferred_element_type``), rounded to the compute
      dtype right after. Off by default: XLA accumulates half-precision
      products in float32 on GPU, TPU and CPU anyway, and a float32 result
      makes the backward pass's matmuls take float32 cotangents (which then
      run in float32). With it off, products come out in the compute dtype
      and the gradient's matmuls run in it too.
    fp8: a :class:`jmp_lite.fp8.CurrentScaling` or
      :class:`~jmp_lite.fp8.DelayedScaling` recipe: every ``dot_general``
      that would run in the compute dtype runs as
      :func:`jmp_lite.fp8.dot_general` instead (E4M3 operands, E5M2
      cotangent, float32 accumulation, result in the compute dtype);
      convolutions stay in the compute dtype. With ``DelayedScaling`` the
      returned function takes the FP8 state (from
      :func:`autocast_fp8_state`) as its first argument: the matmuls of
      ``fn``'s own jaxpr read it in order, those inside nested ``jit`` calls,
      loops and other sub-computations use current scaling. Differentiate
      with respect to it and pass that gradient to
      :func:`jmp_lite.fp8.commit`. Apply autocast to the loss and then
      differentiate (the backward matmuls are the FP8 function's own).
    fp8_scopes: if given, only matmuls under one of these
      ``jax.named_scope`` names (Flax module names are scopes too) run in
      FP8.
    fp8_exclude_scopes: matmuls under these scopes stay in the compute
      dtype (the first and last layers, commonly).

  Returns:
    A function with ``fn``'s signature (with ``DelayedScaling``, the FP8
    state first). The array leaves of its positional
    and keyword arguments (``jax.Array`` including typed PRNG keys and
    ``float0``, numpy arrays and scalars) are traced; every other leaf (a
    function or Python number held by an Equinox module, a string, ``None``,
    a Python float) is passed to ``fn`` as a Python value, as ``jax.jit``'s
    static arguments are. Outputs may hold non-array leaves too.

  Raises:
    ValueError: for unknown, higher-order or integer-only primitives in the
      lists, or one listed in both; FP8 scopes without a recipe; from the
      returned function, an FP8 state of the wrong length.
    TypeError: for a ``fn`` that is not callable, a compute dtype that is
      not float16/bfloat16/float32, an ``fp8`` that is not a recipe, lists
      or scopes that are not lists (of names), flags that are not bools;
      from the returned function, an FP8 state that is not a tuple of
      :class:`jmp_lite.fp8.ScalingState`.

  Example:
    >>> import jax, jax.numpy as jnp, jmp_lite
    >>> def f(x, w):
    ...   return jax.nn.softmax(x @ w)
    >>> g = jmp_lite.autocast(f, jnp.bfloat16)
    >>> g(jnp.ones((2, 3)), jnp.ones((3, 4))).dtype  # As f would return.
    dtype('float32')
    >>> audit = jmp_lite.autocast_audit(f, jnp.bfloat16, jnp.ones((2, 3)),
    ...                                 jnp.ones((3, 4)))
    >>> [r.dtype for r in audit.records if r.primitive == "dot_general"]
    ['bfloat16']
    >>> fp8 = jmp_lite.fp8.CurrentScaling()
    >>> g8 = jmp_lite.autocast(f, jnp.bfloat16, fp8=fp8)  # FP8 matmuls
    >>> jmp_lite.autocast_audit(f, jnp.bfloat16, jnp.ones((2, 3)),
    ...                         jnp.ones((3, 4)), fp8=fp8).fp8_flop_fraction()
    1.0
  """
  if not callable(fn):
    raise TypeError(f"autocast expects a callable, got {fn!r}")
  cfg = make_config(policy_or_dtype, allow=allow, deny=deny,
                    use_default_lists=use_default_lists,
                    exclude_scopes=exclude_scopes, force_scopes=force_scopes,
                    accumulate_in_float32=accumulate_in_float32, fp8=fp8,
                    fp8_scopes=fp8_scopes,
                    fp8_exclude_scopes=fp8_exclude_scopes)

  if cfg.delayed:
    @functools.wraps(fn)
    def with_state(fp8_state: Any, *args: Any, **kwargs: Any) -> Any:
      return run(fn, cfg, args, kwargs, fp8_state=fp8_state)

    return with_state

  @functools.wraps(fn)
  def wrapped(*args: Any, **kwargs: Any) -> Any:
    return run(fn, cfg, args, kwargs)

  return wrapped



def autocast_audit(fn: Callable[..., Any], policy_or_dtype: Any, *args: Any,
                   **options: Any) -> Audit:
  """Lists the primitives ``autocast(fn)`` runs, their dtypes and FLOPs.

  Traces abstractly (nothing is computed). A sub-computation used several
  times is listed once per use. A ``lax.scan`` body is listed once and
  counted once per step (nested scans multiply: ``AuditRecord.repeats``),
  in the FLOPs and in the printed counts. A ``lax.while_loop``'s trip count
  is unknown when tracing, so its body counts once per loop
  (``AuditRecord.in_while_loop``; the printed audit says how many such
  primitives there are). Every branch of a ``lax.cond``/``switch`` counts,
  as though each ran.

  Args:
    fn: the function.
    policy_or_dtype: as for :func:`autocast`.
    *args: example inputs: pytrees whose array leaves (arrays, typed keys,
      ``jax.ShapeDtypeStruct``) are traced and whose other leaves (an
      Equinox module's functions and fields, Python values) are passed as
      they are. Bind keyword arguments with ``functools.partial``.
    **options: :func:`autocast`'s keyword options.

  Returns:
    An :class:`Audit`; ``audit.half_flop_fraction()`` is the share of
    matmul/convolution FLOPs run in half precision.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> audit = jmp_lite.autocast_audit(lambda a, b: a @ b, "bf16",
    ...                                 jnp.ones((4, 8)), jnp.ones((8, 2)))
    >>> audit.half_flop_fraction(), audit.matmul_flops()
    (1.0, {'bfloat16': 128.0})
  """
  check_options(fn, options)
  cfg = make_config(policy_or_dtype, **options)
  records: list[AuditRecord] = []
  run(fn, cfg, args, {}, records)
  return Audit(tuple(records), cfg.compute.name)


def autocast_fp8_state(fn: Callable[..., Any], policy_or_dtype: Any,
                       *args: Any, **options: Any) -> tuple[Any, ...]:
  """A fresh FP8 state for ``autocast(fn, ..., fp8=DelayedScaling(...))``.

  One :class:`jmp_lite.fp8.ScalingState` per matmul of ``fn``'s own jaxpr
  that runs in FP8, in the order the autocast function reads them. Traces
  abstractly.

  Args:
    fn: the function (without the state argument).
    policy_or_dtype: as for :func:`autocast`.
    *args: example inputs, as for :func:`autocast_audit`.
    **options: :func:`autocast`'s keyword options, ``fp8=`` a
      :class:`~jmp_lite.fp8.DelayedScaling` among them.

  Returns:
    A tuple of states (numpy zeros: nothing is put on a device).

  Raises:
    ValueError: if ``fp8`` is not a ``DelayedScaling`` recipe.

  Example:
    >>> import jax, jax.numpy as jnp, jmp_lite
    >>> def loss(w, x):
    ...   return jnp.sum(jnp.tanh(x @ w[0]) @ w[1])
    >>> recipe = jmp_lite.fp8.DelayedScaling(history=8)
    >>> w, x = (jnp.full((4, 4), 0.25), jnp.ones((4, 2))), jnp.ones((3, 4))
    >>> state = jmp_lite.autocast_fp8_state(loss, "bf16", w, x, fp8=recipe)
    >>> g = jmp_lite.autocast(loss, jnp.bfloat16, fp8=recipe)
    >>> observed, grads = jax.grad(g, argnums=(0, 1))(state, w, x)
    >>> state = jmp_lite.fp8.commit(state, observed)
    >>> len(state), state[1].history[:, 0].tolist()  # x@w0, w1, cotangent
    (2, [0.76171875, 1.0, 1.0])
  """
  check_options(fn, options)
  cfg = make_config(policy_or_dtype, **options)
  if not cfg.delayed:
    raise ValueError(
        "autocast_fp8_state needs fp8=jmp_lite.fp8.DelayedScaling(...), got"
        f" fp8={cfg.fp8!r}")
  records: list[AuditRecord] = []
  run(fn, cfg, args, {}, records)
  count = sum(r.category == "fp8-delayed" for r in records)
  return tuple(cfg.fp8.init() for _ in range(count))
