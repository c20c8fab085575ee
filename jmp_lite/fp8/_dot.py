"""An FP8 ``dot_general`` with a custom VJP: E4M3 forward, E5M2 backward.

How it is written, and why (XLA:GPU on H100): the matmul is a
``lax.dot_general`` whose *operands are FP8 arrays* and whose result is
float32 (``preferred_element_type``), followed by the de-scale: two
multiplies by scalars formed from the two de-scale factors, in an order
that cannot under- or overflow float32 (``_matmul.descale``). XLA's GEMM
rewriter turns an FP8 x FP8 dot into a cuBLASLt FP8 GEMM
(``__cublas$lt$matmul$f8``) and folds a following multiply by a broadcast
scalar into the GEMM's scale operand (openxla
``gemm_rewriter_fp8_test.cc``: ``UnscaledABUnscaledDF8``,
``ScaledABUnscaledDColMajorLhsF8``). The alternative, quantise-dequantise
(cast to FP8, back to bf16/f32, multiply by the scale, then a *higher
precision* dot), is matched by the same pass only while the
convert-multiply chain survives the simplifier untouched; when it does not,
the dot silently runs in bf16/f32 and the program still "works". With FP8
operands in the jaxpr there is nothing to fall back to silently: the dot is
FP8 in the program (tests check the jaxpr), a real FP8 GEMM on Hopper/Ada,
and emulated (converted to float32 around the dot) on XLA:CPU and on GPUs
without FP8 units. cuBLASLt accepts E4M3 x E4M3, E4M3 x E5M2 and E5M2 x
E4M3 (never E5M2 x E5M2), which is exactly what the three GEMMs here use.

The backward pass keeps the *FP8* operands as residuals (half the bytes of
bf16 ones) and quantises the incoming cotangent to ``bwd_dtype`` once, for
both gradient GEMMs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._lowbit import (
  check_like_lax,
  DimensionNumbers,
  floating,
  normalize_dims,
  under_auto_axes,
)
from jmp_lite.fp8._blocked import fine_dot
from jmp_lite.fp8._matmul import descale, fp8_matmul, like_primal
from jmp_lite.fp8._quantize import (
  amax_of,
  cast_saturating,
  scale_for,
  scale_inv_for,
)
from jmp_lite.fp8._recipes import (
  check_recipe,
  CurrentScaling,
  DelayedScaling,
  is_fine,
  MXFP8,
  ROLES,
  ScalingState,
)

__all__ = ["dot_general"]

_F32 = np.dtype(np.float32)

@dataclasses.dataclass(frozen=True)
class _Static:
  """Everything about one FP8 dot that is not an array (hashable)."""

  dims: DimensionNumbers
  fwd_dtype: np.dtype
  bwd_dtype: np.dtype
  margin: int
  delayed: bool
  out_dtype: np.dtype
  lhs_dtype: np.dtype
  rhs_dtype: np.dtype
  out_sharding: Any = None


def _free(ndim: int, *used: Sequence[int]) -> tuple[int, ...]:
  taken = set().union(*map(set, used))
  return tuple(d for d in range(ndim) if d not in taken)


def _out_sharding(like: jax.Array, order: Sequence[int]) -> Any:
  """``like``'s sharding with its dimensions in ``order``, or None.

  A gradient matmul contracts dimensions the operands may be sharded along
  (the batch, for the weight gradient); under sharding in types JAX then
  needs the result's sharding spelled out: the operand's own, laid out as
  the matmul produces it (as JAX's own dot_general transpose does).
  """
  sharding = getattr(jax.typeof(like), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if sharding is None or mesh is None or getattr(mesh, "empty", True):
    # An unsharded operand: replicated over the mesh in context, if any.
    context = jax.sharding.get_abstract_mesh()
    if getattr(context, "empty", True):
      return None
    return jax.sharding.NamedSharding(
        context, jax.sharding.PartitionSpec(*[None] * like.ndim))
  spec = tuple(sharding.spec) + (None,) * (like.ndim - len(sharding.spec))
  return sharding.update(spec=jax.sharding.PartitionSpec(
      *(spec[d] for d in order)))


def _permuted(x: jax.Array, perm: tuple[int, ...]) -> jax.Array:
  # No transpose at all for the usual layouts (x @ W): the de-scale multiply
  # then follows the dot directly, the form XLA folds into the FP8 GEMM.
  if perm == tuple(range(x.ndim)):
    return x
  return jax.lax.transpose(x, perm)


def _grad_lhs(g: jax.Array, rhs: jax.Array, dims: DimensionNumbers,
              lhs: jax.Array) -> jax.Array:
  """The dot_general transpose for the lhs: f32 ``d out / d lhs`` contracted.

  ``out`` is laid out as (batch, lhs free, rhs free). Contracting ``g``'s rhs
  free dims with ``rhs``'s free dims leaves (batch, lhs free, rhs
  contracting in rhs order), which a transpose puts back into lhs order.
  ``lhs`` (any array of the lhs's shape and sharding) gives the layout.
  """
  (lc, rc), (lb, rb) = dims
  nb = len(lb)
  lhs_free = _free(lhs.ndim, lc, lb)
  rhs_free = _free(rhs.ndim, rc, rb)
  g_rhs_free = tuple(range(nb + len(lhs_free), g.ndim))
  rc_sorted = sorted(rc)
  position = {}
  for i, d in enumerate(lb):
    position[d] = i
  for j, d in enumerate(lhs_free):
    position[d] = nb + j
  for l_dim, r_dim in zip(lc, rc, strict=True):
    position[l_dim] = nb + len(lhs_free) + rc_sorted.index(r_dim)
  order = sorted(range(lhs.ndim), key=position.__getitem__)
  out = fp8_matmul(g, rhs, ((g_rhs_free, rhs_free), (tuple(range(nb)), rb)),
                out_sharding=_out_sharding(lhs, order))
  return _permuted(out, tuple(position[d] for d in range(lhs.ndim)))


def _grad_rhs(lhs: jax.Array, g: jax.Array, dims: DimensionNumbers,
              rhs: jax.Array) -> jax.Array:
  """The dot_general transpose for the rhs (mirror of :func:`_grad_lhs`)."""
  (lc, rc), (lb, rb) = dims
  nb = len(lb)
  lhs_free = _free(lhs.ndim, lc, lb)
  rhs_free = _free(rhs.ndim, rc, rb)
  g_lhs_free = tuple(range(nb, nb + len(lhs_free)))
  lc_sorted = sorted(lc)
  position = {}
  for i, d in enumerate(rb):
    position[d] = i
  for l_dim, r_dim in zip(lc, rc, strict=True):
    position[r_dim] = nb + lc_sorted.index(l_dim)
  for j, d in enumerate(rhs_free):
    position[d] = nb + len(lc) + j
  order = sorted(range(rhs.ndim), key=position.__getitem__)
  # lhs first, so that the result is (batch, lhs contracting, rhs free):
  # already close to rhs order for the usual x @ W (no transpose at all).
  out = fp8_matmul(lhs, g, ((lhs_free, g_lhs_free), (lb, tuple(range(nb)))),
                out_sharding=_out_sharding(rhs, order))
  return _permuted(out, tuple(position[d] for d in range(rhs.ndim)))


def _scaled(x: jax.Array, own_amax: jax.Array, delayed_amax: jax.Array,
            dtype: np.dtype, st: _Static) -> tuple[jax.Array, jax.Array]:
  """FP8 ``x`` and its de-scale factor, from the history or just in time."""
  if st.delayed:
    # An empty history (0) falls back to the tensor's own amax.
    use = jax.lax.select(delayed_amax > 0, delayed_amax, own_amax)
  else:
    use = own_amax
  scale = scale_for(use, dtype, st.margin)
  return cast_saturating(x, scale, dtype), scale_inv_for(scale, own_amax)


def _forward(lhs, rhs, delayed_amax, st: _Static):
  a_l, a_r = amax_of(lhs), amax_of(rhs)
  q_l, inv_l = _scaled(lhs, a_l, delayed_amax[0], st.fwd_dtype, st)
  q_r, inv_r = _scaled(rhs, a_r, delayed_amax[1], st.fwd_dtype, st)
  kwargs = {} if st.out_sharding is None else {"out_sharding": st.out_sharding}
  out = fp8_matmul(q_l, q_r, st.dims, **kwargs)
  out = descale(out, inv_l, inv_r).astype(st.out_dtype)
  return out, (q_l, q_r, inv_l, inv_r, a_l, a_r, delayed_amax)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fp8_dot(lhs, rhs, delayed_amax, probe, st: _Static):
  del probe  # Only its cotangent matters: the amaxes this step observed.
  return _forward(lhs, rhs, delayed_amax, st)[0]


def _fp8_dot_fwd(lhs, rhs, delayed_amax, probe, st: _Static):
  out, res = _forward(lhs, rhs, delayed_amax, st)
  return out, (*res, probe)


def _fp8_dot_bwd(st: _Static, res, g):
  q_l, q_r, inv_l, inv_r, a_l, a_r, delayed_amax, probe = res
  a_g = amax_of(g)
  q_g, inv_g = _scaled(g, a_g, delayed_amax[2], st.bwd_dtype, st)
  d_lhs = descale(_grad_lhs(q_g, q_r, st.dims, q_l), inv_g, inv_r)
  d_rhs = descale(_grad_rhs(q_l, q_g, st.dims, q_r), inv_l, inv_g)
  d_lhs = like_primal(d_lhs, q_l, jax.lax.psum)
  d_rhs = like_primal(d_rhs, q_r, jax.lax.psum)
  observed = like_primal(jnp.stack([a_l, a_r, a_g]), probe, jax.lax.pmax)
  return (d_lhs.astype(st.lhs_dtype), d_rhs.astype(st.rhs_dtype),
          jnp.zeros_like(delayed_amax), observed)


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


def dot_general(recipe: CurrentScaling | DelayedScaling | MXFP8,
                state: ScalingState | None = None) -> Callable[..., jax.Array]:
  """An FP8 matmul with ``jax.lax.dot_general``'s signature.

  Usable wherever a ``dot_general`` is taken: ``flax.linen.Dense(...,
  dot_general=...)``, ``flax.nnx.Linear(..., dot_general=...)``,
  ``jnp.einsum(..., _dot_general=...)`` or called directly.

  Forward: both operands are quantised to ``recipe.fwd_dtype`` with one scale
  each, multiplied with float32 accumulation and de-scaled; the result has
  the operands' (promoted) dtype, or ``preferred_element_type``. Backward (a
  ``custom_vjp``): the incoming cotangent is quantised to
  ``recipe.bwd_dtype`` before both gradient matmuls; gradients come back in
  the operands' dtypes. An all-zero operand gives zeros; an operand holding
  inf or NaN makes the result NaN (so ``loss_scaled`` skips the step rather
  than FP8 saturation hiding the overflow).

  With :class:`DelayedScaling`, ``state`` (from ``recipe.init()``) supplies
  the scales, and the gradient with respect to ``state`` is a
  :class:`ScalingState` whose ``pending`` field holds the amaxes observed
  (lhs, rhs, cotangent): hand it to :func:`jmp_lite.fp8.commit`.

  Finer recipes (``CurrentScaling(granularity="row" | "block")``,
  :class:`MXFP8`) scale each row or block of every operand of the three
  matmuls separately; the FP8 x FP8 dot then runs with the blocks as a batch
  dimension, each block's float32 partial product de-scaled and the blocks
  summed in float32, the numbers a block-scaled FP8 GEMM gives (see
  ``jmp_lite/fp8/_blocked.py``). Their backward pass keeps the operands in
  their own dtype (each gradient matmul re-quantises along its own
  contracting dimension), and ``out_sharding`` is applied to the result
  with ``jax.sharding.reshard``.

  Args:
    recipe: a :class:`CurrentScaling`, :class:`DelayedScaling` or
      :class:`MXFP8`.
    state: the matmul's :class:`ScalingState` (delayed scaling only).

  Returns:
    ``f(lhs, rhs, dimension_numbers, precision=None,
    preferred_element_type=None, out_sharding=None)``. ``precision`` is
    checked as ``dot_general`` checks it, then ignored (the FP8 formats
    decide the precision); ``preferred_element_type`` must be floating;
    ``out_sharding`` is passed on to the forward matmul.

  Raises:
    TypeError: for a recipe that is not one, a missing or unexpected
      ``state``; from ``f``, for non-floating operands, a non-floating
      ``preferred_element_type``, malformed ``dimension_numbers``, any that
      ``jax.lax.dot_general`` rejects for these shapes (with its message),
      or an unknown keyword.
    ValueError: for a ``state`` whose history length is not the recipe's;
      from ``f``, for a ``precision`` ``dot_general`` rejects.

  Example:
    >>> import jax, jax.numpy as jnp, jmp_lite
    >>> dot = jmp_lite.fp8.dot_general(jmp_lite.fp8.CurrentScaling())
    >>> x = jnp.ones((2, 3), jnp.bfloat16)
    >>> w = jnp.full((3, 4), 0.5, jnp.bfloat16)
    >>> y = dot(x, w, (((1,), (0,)), ((), ())))
    >>> y.dtype, y[0, 0].item()
    (dtype(bfloat16), 1.5)
  """
  recipe = check_recipe(recipe)
  # Delayed scaling's recipe and state, checked once for the closure below.
  scaling: tuple[DelayedScaling, ScalingState] | None = None
  if isinstance(recipe, DelayedScaling):
    if not isinstance(state, ScalingState):
      raise TypeError(
          "DelayedScaling needs the matmul's state: fp8.dot_general(recipe,"
          f" state) with state = recipe.init(), got {state!r}")
    length = getattr(state.history, "shape", (None,))[-1]
    if length is not None and length != recipe.history:
      # The history's length is how the state was made: one made for
      # another recipe (say, restored from a checkpoint of another run)
      # would otherwise be read silently by this one's rule.
      raise ValueError(
          f"This ScalingState holds a history of {length} steps, the recipe"
          f" DelayedScaling(history={recipe.history}) keeps"
          f" {recipe.history}: make the state with this recipe's init()")
    scaling = (recipe, state)
  elif state is not None:
    raise TypeError(f"{type(recipe).__name__} is stateless; pass no state"
                    f" (got {type(state).__name__})")
  fine = is_fine(recipe)

  def fp8_dot_general(lhs: jax.typing.ArrayLike, rhs: jax.typing.ArrayLike,
                      dimension_numbers: Any, precision: Any = None,
                      preferred_element_type: Any = None,
                      out_sharding: Any = None) -> jax.Array:
    lhs = floating(lhs, "lhs", who="fp8")
    rhs = floating(rhs, "rhs", who="fp8")
    dims = normalize_dims(dimension_numbers)
    check_like_lax(lhs, rhs, dims, precision, preferred_element_type,
                   who="fp8")
    if preferred_element_type is None:
      out_dtype = np.dtype(jnp.result_type(lhs.dtype, rhs.dtype))
    else:
      out_dtype = np.dtype(jnp.dtype(preferred_element_type))
    if fine:
      return under_auto_axes(
          lambda a, b: fine_dot(a, b, dims, recipe, out_dtype), lhs, rhs,
          dims, out_dtype, out_sharding)
    assert not isinstance(recipe, MXFP8)
    st = _Static(dims=dims,
                 fwd_dtype=recipe.fwd_dtype, bwd_dtype=recipe.bwd_dtype,
                 margin=recipe.margin, delayed=scaling is not None,
                 out_dtype=out_dtype,
                 lhs_dtype=np.dtype(lhs.dtype), rhs_dtype=np.dtype(rhs.dtype),
                 out_sharding=out_sharding)
    if scaling is not None:
      delayed_recipe, delayed_state = scaling
      delayed_amax = delayed_recipe.amax(delayed_state)
      probe = jnp.asarray(delayed_state.pending, _F32)
    else:
      # jnp, not numpy: traced into a jaxpr, zeros are an equation rather
      # than a captured constant.
      delayed_amax = probe = jnp.zeros((len(ROLES),), _F32)
    return _fp8_dot(lhs, rhs, delayed_amax, probe, st)

  return fp8_dot_general
