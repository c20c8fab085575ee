"""The FP4 matmul: three block-scaled GEMMs under one ``custom_vjp``.

Every ``dot_general`` is first put in one canonical form, ``x (B, M, K)``
times ``w (B, N, K)`` into ``(B, M, N)`` (batch, free, contracting), outside
the custom VJP so that JAX differentiates the transposes and reshapes. Then:

* forward ``y = x . w^T``: ``x`` in ``1 x bs`` blocks along K, ``w`` in
  ``bs x bs`` tiles (NVFP4's 2-D weights) or ``1 x bs`` blocks; round to
  nearest even; no key is read.
* input gradient ``dx = g . w``: ``g`` in blocks along N (stochastically
  rounded when a key is given); ``w`` is the forward's quantised weight
  itself when it was tiled (its tiles transposed: the same values, blocked
  along N), else requantised along N.
* weight gradient ``dw = g^T . x``: both rotated along the M tokens they
  contract over by the random Hadamard transform (``hadamard > 0``), then
  quantised in blocks along M, ``g`` stochastically rounded.

A GEMM multiplies FP4 codes block-scaled: the codes times their block
scales are exact in bfloat16 (2 significant bits times E4M3's 4, or a power
of two), their products exact in float32, so a bfloat16 dot with float32
accumulation, times the two per-tensor ``1 / s_enc``, gives what an FP4 GEMM
gives, up to the float32 summation order. That is the emulated route, used
on every backend but Blackwell GPUs; there ``jax.lax.scaled_dot`` takes the
codes and scales themselves (a native FP4 GEMM where XLA has one). Both
routes give the same numbers on XLA:CPU (``tests/test_fp4.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._jaxpr import varying_axes
from jmp_lite._lowbit import (
  check_like_lax,
  floating,
  normalize_dims,
  under_auto_axes,
)
from jmp_lite.fp4._quantize import (
  as_key,
  hadamard_signs,
  quantize_blocks,
  Quantized,
  rotate,
)
from jmp_lite.fp4._recipes import (
  check_recipe,
  directions,
  Format,
  MXFP4,
  Recipe,
)

__all__ = ["dot_general"]

_F32 = np.dtype(np.float32)
_BF16 = np.dtype(jnp.bfloat16)
_CANONICAL = (((2,), (2,)), ((0,), (0,)))


def native_fp4() -> bool:
  """Whether the default backend multiplies FP4 natively (Blackwell GPUs).

  Example:
    >>> from jmp_lite.fp4._dot import native_fp4
    >>> native_fp4()  # XLA:CPU emulates
    False
  """
  if jax.default_backend() != "gpu":
    return False
  try:
    capability = jax.devices()[0].compute_capability  # e.g. "10.0"
    return float(capability) >= 10
  except (AttributeError, TypeError, ValueError):
    return False


def gemm(a: Quantized, b: Quantized, fmt: Format,
         native: bool = False) -> jax.Array:
  """``a (B, P, C) . b (B, Q, C) -> (B, P, Q)``, float32, block-scaled FP4.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> from jmp_lite.fp4._dot import gemm
    >>> from jmp_lite.fp4._quantize import quantize_blocks
    >>> fmt = jmp_lite.fp4.NVFP4()
    >>> a = quantize_blocks(jnp.ones((1, 2, 16)), fmt)
    >>> gemm(a, a, fmt).tolist()
    [[[16.0, 16.0], [16.0, 16.0]]]
  """
  if native:
    kind = jnp.float8_e8m0fnu if isinstance(fmt, MXFP4) else jnp.float8_e4m3fn
    out = jax.lax.scaled_dot(
        a.q, b.q, lhs_scale=a.scale.astype(kind),
        rhs_scale=b.scale.astype(kind), dimension_numbers=_CANONICAL,
        preferred_element_type=_F32)
  else:
    def wide(t: Quantized) -> jax.Array:
      bb, p, c = t.q.shape
      q = t.q.astype(_BF16).reshape(bb, p, t.scale.shape[2], -1)
      return (q * t.scale.astype(_BF16)[..., None]).reshape(bb, p, c)
    out = jax.lax.dot_general(wide(a), wide(b), _CANONICAL,
                              preferred_element_type=_F32)
  return (out * a.enc) * b.enc


def _plain(a: jax.Array, b: jax.Array) -> jax.Array:
  """The canonical product in the operands' own (promoted) dtype."""
  dtype = jnp.result_type(a.dtype, b.dtype)

  def dot(a: jax.Array, b: jax.Array) -> jax.Array:
    return jax.lax.dot_general(a, b, _CANONICAL, preferred_element_type=_F32)

  a, b = a.astype(dtype), b.astype(dtype)
  if np.dtype(dtype) == _F32:
    return dot(a, b)
  # XLA:CPU rejects some half x half -> float32 dots (a transposed bf16
  # operand: "Unsupported element type for DotThunk"); it emulates half
  # matmuls in float32 anyway, and the products are exact there.
  return jax.lax.platform_dependent(
      a, b, cpu=lambda a, b: dot(a.astype(_F32), b.astype(_F32)),
      default=dot)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Everything about one FP4 matmul that is not an array (hashable)."""

  fwd: Format | None
  dgrad: Format | None
  wgrad: Format | None
  out_dtype: np.dtype
  native: bool

  @property
  def reuse(self) -> bool:
    """Whether the input gradient reads the forward's tiled weight."""
    return (self.fwd is not None and self.fwd == self.dgrad
            and self.fwd.weight_blocks is not None)


def _forward(x, w, plan: _Plan):
  if plan.fwd is None:
    return _plain(x, w).astype(plan.out_dtype), None
  tiled = plan.fwd.weight_blocks is not None
  qx = quantize_blocks(x, plan.fwd)
  qw = quantize_blocks(w, plan.fwd, tiles=tiled)
  y = gemm(qx, qw, plan.fwd, plan.native)
  return y.astype(plan.out_dtype), qw


def _transposed_tiles(qw: Quantized, bs: int) -> Quantized:
  """The forward's tiled weight ``(B, N, K)`` as ``(B, K, N)`` blocked along N.

  A tile's scale is shared by its ``bs`` rows: the transposed blocks read
  the tile scales transposed. N is zero-padded to whole tiles.
  """
  b, n, kp = qw.q.shape
  q = jnp.swapaxes(qw.q, 1, 2)
  extra = -n % bs
  if extra:
    q = jnp.pad(q, ((0, 0), (0, 0), (0, extra)))
  tiles = qw.scale[:, ::bs, :]  # (B, nN, nK), one row per tile.
  scale = jnp.repeat(jnp.swapaxes(tiles, 1, 2), bs, axis=1)[:, :kp]
  return Quantized(q, scale, qw.enc)


def _stochastic(fmt: Format, key: jax.Array | None) -> jax.Array | None:
  return key if fmt.stochastic_gradients else None


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _canonical(x: jax.Array, w: jax.Array, key: Any, plan: _Plan) -> jax.Array:
  del key  # Read by the backward pass only.
  return _forward(x, w, plan)[0]


def _canonical_fwd(x, w, key, plan):
  y, qw = _forward(x, w, plan)
  keep_w = None if plan.reuse else w
  # An empty slice of w: its dtype and the shard_map axes it varies over.
  return y, (x, keep_w, qw if plan.reuse else None, key, w.reshape(-1)[:0])


def _canonical_bwd(plan: _Plan, res, g):
  x, w, qw, key, w_like = res
  k_dgrad = k_wgrad = k_signs = None
  if key is not None:
    k_dgrad, k_wgrad, k_signs = jax.random.split(key, 3)
  n = g.shape[2]
  if plan.dgrad is None:
    dx = _plain(g, jnp.swapaxes(w, 1, 2))
  else:
    qg = quantize_blocks(g, plan.dgrad, key=_stochastic(plan.dgrad, k_dgrad))
    if plan.reuse:
      qwt = _transposed_tiles(qw, plan.dgrad.block_size)
    else:
      qwt = quantize_blocks(jnp.swapaxes(w, 1, 2), plan.dgrad)
    dx = gemm(qg, qwt, plan.dgrad, plan.native)[..., :x.shape[2]]
  gt, xt = jnp.swapaxes(g, 1, 2), jnp.swapaxes(x, 1, 2)
  if plan.wgrad is None:
    dw = _plain(gt, xt)
  else:
    if plan.wgrad.hadamard:
      signs = hadamard_signs(k_signs, plan.wgrad.hadamard)
      gt, xt = rotate(gt, signs), rotate(xt, signs)
    qgt = quantize_blocks(gt, plan.wgrad, key=_stochastic(plan.wgrad, k_wgrad))
    qxt = quantize_blocks(xt, plan.wgrad)
    dw = gemm(qgt, qxt, plan.wgrad, plan.native)[:, :n]
  key_ct = None if key is None else np.zeros(key.shape, jax.dtypes.float0)
  dx, dw = _like_primal(dx, x), _like_primal(dw, w_like)
  return dx.astype(x.dtype), dw.astype(w_like.dtype), key_ct


def _like_primal(ct: jax.Array, primal: jax.Array) -> jax.Array:
  """``ct`` summed over the ``shard_map`` axes it varies over and ``primal``
  does not: a weight replicated over the batch's axis gets the sum of the
  shards' gradients (the transpose of JAX's implicit broadcast)."""
  extra = tuple(sorted(varying_axes(ct) - varying_axes(primal)))
  return jax.lax.psum(ct, extra) if extra else ct


_canonical.defvjp(_canonical_fwd, _canonical_bwd)


def dot_general(recipe: Recipe, key: Any = None) -> Callable[..., jax.Array]:
  """An FP4 matmul with ``jax.lax.dot_general``'s signature.

  Usable wherever a ``dot_general`` is taken: ``flax.linen.Dense(...,
  dot_general=...)``, ``flax.nnx.Linear(..., dot_general=...)``,
  ``jnp.einsum(..., _dot_general=...)``, an Equinox module's ``__call__``,
  or called directly. The forward GEMM and both gradient GEMMs run on FP4
  operands as the module docstring of ``jmp_lite/fp4/_dot.py`` describes
  (per :class:`PerDirection`, a GEMM may instead run in the operands' own
  dtype); outputs and gradients come back in the operands' dtypes (the
  result in ``preferred_element_type`` when given).

  ``key`` drives the backward pass only: the gradients' stochastic rounding
  and the Hadamard transform's signs. The forward is the same with or
  without it. Without a key the backward pass is deterministic: gradients
  rounded to nearest even, and the signs of ``jax.random.key(0)``. Give
  every step (and every layer) a key of its own, e.g.
  ``jax.random.fold_in(key, step)``.

  Args:
    recipe: :class:`NVFP4`, :class:`MXFP4` or :class:`PerDirection`.
    key: ``None`` or a PRNG key (typed ``jax.random.key`` or a raw
      ``jax.random.PRNGKey``).

  Returns:
    ``f(lhs, rhs, dimension_numbers, precision=None,
    preferred_element_type=None, out_sharding=None)``; ``precision`` is
    accepted and ignored, ``out_sharding`` applied to the result.

  Raises:
    TypeError: for a recipe that is not one or a key that is not a key;
      from ``f``, for non-floating operands or malformed dimension numbers.

  Example:
    >>> import jax, jax.numpy as jnp, jmp_lite
    >>> dot = jmp_lite.fp4.dot_general(jmp_lite.fp4.NVFP4(), jax.random.key(0))
    >>> x = jnp.ones((2, 32), jnp.bfloat16)
    >>> w = jnp.full((32, 3), 0.5, jnp.bfloat16)
    >>> y = dot(x, w, (((1,), (0,)), ((), ())))
    >>> y.dtype, y[0, 0].item()
    (dtype(bfloat16), 16.0)
  """
  recipe = check_recipe(recipe)
  key = as_key(key)
  fwd, dgrad, wgrad = directions(recipe)

  def fp4_dot_general(lhs: jax.typing.ArrayLike, rhs: jax.typing.ArrayLike,
                      dimension_numbers: Any, precision: Any = None,
                      preferred_element_type: Any = None,
                      out_sharding: Any = None) -> jax.Array:
    del precision  # The FP4 formats and float32 accumulation decide it.
    lhs = floating(lhs, "lhs", who="fp4")
    rhs = floating(rhs, "rhs", who="fp4")
    if preferred_element_type is None:
      out_dtype = np.dtype(jnp.result_type(lhs.dtype, rhs.dtype))
    else:
      out_dtype = np.dtype(jnp.dtype(preferred_element_type))
    dims = normalize_dims(dimension_numbers)
    check_like_lax(lhs, rhs, dims, None, preferred_element_type, who="fp4")
    if key is None:
      return under_auto_axes(
          lambda a, b: _dot(a, b, None, dims, out_dtype), lhs, rhs, dims,
          out_dtype, out_sharding)
    return under_auto_axes(
        lambda a, b, k: _dot(a, b, k, dims, out_dtype), lhs, rhs, dims,
        out_dtype, out_sharding, key)

  def _dot(lhs: jax.Array, rhs: jax.Array, key: Any, dims: Any,
           out_dtype: np.dtype) -> jax.Array:
    (lc, rc), (lb, rb) = dims
    l_free = tuple(d for d in range(lhs.ndim) if d not in (*lc, *lb))
    r_free = tuple(d for d in range(rhs.ndim) if d not in (*rc, *rb))
    batch = tuple(lhs.shape[d] for d in lb)
    m_shape = tuple(lhs.shape[d] for d in l_free)
    n_shape = tuple(rhs.shape[d] for d in r_free)
    k = math.prod(lhs.shape[d] for d in lc)
    x = jnp.transpose(lhs, (*lb, *l_free, *lc)).reshape(
        math.prod(batch), math.prod(m_shape), k)
    w = jnp.transpose(rhs, (*rb, *r_free, *rc)).reshape(
        math.prod(batch), math.prod(n_shape), k)
    if 0 in x.shape or 0 in w.shape:
      # An empty batch (an expert given no tokens) or contraction: nothing
      # to quantize (the blocks have no rows), the product is zeros.
      return jax.lax.dot_general(
          lhs, rhs, dims, preferred_element_type=out_dtype).astype(out_dtype)
    plan = _Plan(fwd, dgrad, wgrad, out_dtype, native_fp4())
    out = cast(jax.Array, _canonical(x, w, key, plan))
    return out.reshape(*batch, *m_shape, *n_shape)

  return fp4_dot_general

