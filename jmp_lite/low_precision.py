"""Low-precision update rules: pure half-precision params that still learn.

A bfloat16 param of 1.0 ignores every update smaller than 2**-9: plain
``optax.apply_updates`` rounds ``p + u`` to the nearest bfloat16, and small
updates round away step after step. Float32 master weights fix that at 14
bytes per parameter. These transformations fix it at 6-8:

* :func:`kahan_summation` keeps each half-precision param's rounding error in
  a compensation buffer of the param's dtype and adds it back on the next
  step (Kahan's compensated summation).
* :func:`stochastic_rounding` rounds ``p + u`` up or down at random, with the
  probabilities that make the expected result exact.
* :func:`state_dtypes` stores an optimizer's state (Adam's moments) in narrow
  dtypes while the optimizer computes in float32; optax alone cannot choose
  the dtype of ``nu`` (optax issue 1552).

Together (``kahan_summation(state_dtypes(adam, "bf16"))``) they are the
``O3`` preset's default recipe; see ``docs/low_precision.md``.

The random bits of stochastic rounding come from a counter-based hash of
(seed, step counter, leaf, element index) computed inside the fused update
kernel: no random array is materialised and no key is passed per call.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite import _optax, contract, struct
from jmp_lite import dtypes as _dtypes
from jmp_lite._checks import check_bool, check_transformation
from jmp_lite.diagnostics import PrecisionWarning
from jmp_lite.path_rules import path_string

__all__ = ["KahanState", "StateDtypesState", "StochasticRoundingState",
           "kahan_summation", "state_dtypes", "stochastic_rounding"]

_F32 = np.dtype(jnp.float32)
_BF16 = np.dtype(jnp.bfloat16)
_ROUNDINGS = ("nearest", "stochastic")


@struct.dataclass
class KahanState:
  """State of :func:`kahan_summation`.

  Attributes:
    compensation: per param leaf, the rounding error not yet applied, in the
      param's dtype (bfloat16 for FP8 params); ``None`` for float32/float64
      and non-floating leaves. float16 buffers hold the error times
      ``2**11``, which keeps it out of float16's subnormal range;
      :meth:`residual` gives the error itself.
    inner_state: the wrapped optimizer's state.
  """

  compensation: Any
  inner_state: Any

  def residual(self) -> Any:
    """The rounding error carried for each param leaf, in float32.

    ``params + state.residual()`` is what the params would be without
    rounding (to about one ulp of a float32 run); the stored buffers are
    scaled for float16 (see ``compensation``).

    Returns:
      A tree like ``compensation`` with float32 leaves (``None`` kept).

    Example:
      >>> import jax.numpy as jnp, optax, jmp_lite
      >>> opt = jmp_lite.kahan_summation(optax.sgd(2.0**-14))
      >>> p = jnp.ones(2, jnp.float16)
      >>> u, state = opt.update(jnp.ones(2, jnp.float16), opt.init(p), p)
      >>> state.residual() * 2**14   # Under half a float16 step of 1.0.
      Array([-1., -1.], dtype=float32)
      >>> state.compensation   # What is stored: 2**-14 times 2**11.
      Array([-0.125, -0.125], dtype=float16)
    """
    return jax.tree.map(
        lambda c: c.astype(_F32) / _compensation_scale(c.dtype),
        self.compensation)


@struct.dataclass
class StochasticRoundingState:
  """State of :func:`stochastic_rounding`.

  Attributes:
    seed: the stream's seed (uint32 scalar).
    count: steps so far that applied updates (uint32 scalar; see
      :func:`stochastic_rounding`); with ``seed`` it picks this
      step's random bits, so a restored checkpoint continues the stream.
    inner_state: the wrapped optimizer's state.
  """

  seed: Any
  count: Any
  inner_state: Any


@struct.dataclass
class StateDtypesState:
  """State of :func:`state_dtypes`.

  Attributes:
    inner_state: the wrapped optimizer's state, its floating leaves stored in
      their storage dtypes.
    seed: with ``rounding="stochastic"``, the seed (uint32 scalar); else
      ``None``.
    count: with ``rounding="stochastic"``, steps so far that applied
      updates, counted as :func:`stochastic_rounding` counts them (uint32
      scalar); else ``None``.
  """

  inner_state: Any
  seed: Any = None
  count: Any = None


# ---------------------------------------------------------------- helpers


def _check_seed(seed: Any) -> int:
  if isinstance(seed, (bool, np.bool_)) or not isinstance(
      seed, (int, np.integer)):
    raise TypeError(f"seed must be an int, got {type(seed).__name__}: {seed!r}")
  if not 0 <= int(seed) < 2**32:
    raise ValueError(f"seed must be in [0, 2**32), got {seed}")
  return int(seed)


def _need_params(params: Any, who: str) -> None:
  if params is None:
    raise ValueError(
        f"{who} needs the current params to round against: call"
        " opt.update(grads, state, params)")


def _is_narrow(x: Any) -> bool:
  """Floating arrays narrower than float32: bfloat16, float16, float8."""
  return _dtypes.is_floating_array(x) and np.dtype(x.dtype).itemsize < 4


def _wide(*xs: Any) -> np.dtype:
  """float32, or wider if an operand is (float64 updates under x64)."""
  dtype = _F32
  for x in xs:
    if _dtypes.is_floating_array(x):
      dtype = jnp.promote_types(dtype, _dtypes.at_least_float32(x.dtype))
  return np.dtype(dtype)


def _upcast(tree: Any) -> Any:
  """Narrow floating leaves to float32; everything else as it is."""
  return jax.tree.map(lambda x: x.astype(_F32) if _is_narrow(x) else x, tree)


def _unaliased(state: Any, *trees: Any) -> Any:
  """``state`` with a copy of every leaf that *is* a leaf of ``trees``.

  A train step donates params and optimizer state; a state leaf sharing the
  params' buffer would be donated twice.
  """
  ids = {id(x) for t in trees for x in jax.tree.leaves(t)}
  return jax.tree.map(
      lambda x: jnp.array(x, copy=True)
      if isinstance(x, jax.Array) and id(x) in ids else x, state)


def _forwarding(init: Any, rebind: Any, inner: optax.GradientTransformation,
                half_by_design: Any = None
                ) -> optax.GradientTransformationExtraArgs:
  """A wrapper that hands ``inner`` the gradients (upcast at most), declared
  so that jmp_lite.update_and_apply may decide a guard inside it up front
  (the skipped branch's ``-0.0`` updates move nothing here)."""
  return _optax.transformation(init, contract.declare(
      rebind(inner.update), contract.Forwarding(
          inner=inner, rebind=rebind, inner_state=lambda s: s.inner_state,
          half_by_design=half_by_design)))


def _update_dtype(p: Any, wide: np.dtype) -> np.dtype:
  # Updates of half params are exact in float32; FP8 params need FP8 ones
  # (JAX adds no float32 update to them).
  return np.dtype(p.dtype) if np.dtype(p.dtype).itemsize == 1 else wide


# ------------------------------------------------------- random bits (hash)

_M1, _M2 = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35)
_GOLDEN = 0x9E3779B9
_C0, _C1 = np.uint32(0x68E31DA4), np.uint32(0xB5297A4D)


def _mix(x: jax.Array) -> jax.Array:
  """A bijective 32-bit avalanche (MurmurHash3's finaliser); uint32 in/out."""
  x = x ^ (x >> 16)
  x = x * _M1
  x = x ^ (x >> 13)
  x = x * _M2
  return x ^ (x >> 16)


def _step_key(seed: jax.Array, count: jax.Array) -> jax.Array:
  return _mix(_mix(jnp.asarray(seed, jnp.uint32) ^ _C0)
              ^ jnp.asarray(count, jnp.uint32))


def _global_index(shape: tuple[int, ...], spec: Any) -> jax.Array:
  """Each element's flat index in the *global* array (uint32, wrapping).

  Under ``shard_map`` a leaf is a local shard; ``spec`` (its
  ``PartitionSpec``) says which mesh axes split each dimension, and
  ``axis_index`` gives this shard's offset. So shards draw different bits
  and replicated copies draw the same ones, as the unsharded run would.
  """
  index = jnp.zeros(shape, jnp.uint32)
  stride = 1
  entries = tuple(spec) if spec is not None else ()
  for d in reversed(range(len(shape))):
    coord = jax.lax.broadcasted_iota(jnp.uint32, shape, d)
    names = entries[d] if d < len(entries) else None
    parts = 1
    if names is not None:
      parts = int(jax.lax.axis_size(names))
      offset = jax.lax.axis_index(names).astype(jnp.uint32)
      coord = coord + offset * np.uint32(shape[d] % 2**32)
    index = index + coord * np.uint32(stride % 2**32)
    stride *= shape[d] * parts
  return index


def _random_bits(key: jax.Array, leaf: int, shape: tuple[int, ...],
                 spec: Any = None) -> jax.Array:
  """Uniform uint32 bits for one leaf, elementwise (fuses into the update)."""
  k1 = _mix(key + np.uint32((leaf * _GOLDEN) % 2**32))
  k2 = _mix(k1 ^ _C1)
  return _mix(_mix(_global_index(shape, spec) ^ k1) + k2)


def _round_stochastic(x: jax.Array, dtype: Any, bits: jax.Array) -> jax.Array:
  """``x`` rounded to ``dtype`` up or down, unbiased: E[result] == x."""
  dtype = np.dtype(dtype)
  if np.dtype(x.dtype) == _F32 and dtype == _BF16:
    # bfloat16 is float32's top 16 bits: add 16 random bits below them and
    # truncate. Carries round the magnitude up with probability equal to the
    # dropped fraction; the sign bit is never touched.
    raw = jax.lax.bitcast_convert_type(x, jnp.uint32)
    raw = (raw + (bits >> 16)) & np.uint32(0xFFFF0000)
    out = jax.lax.bitcast_convert_type(raw, jnp.float32)
    return jnp.where(jnp.isnan(x), x, out).astype(dtype)
  # Any other pair (float16's subnormals and narrower exponent included):
  # between the nearest value and its neighbour on the far side of x. The
  # nearest value comes from round_to: a cast pair there would be deleted
  # by XLA:GPU, leaving err == 0 and plain round-to-nearest.
  near_wide = _dtypes.round_to(x, dtype)
  near = near_wide.astype(dtype)
  err = x - near_wide
  # Toward the largest finite value, not infinity: FP8 formats without one
  # (float8_e4m3fn) cast infinity to NaN, and then nothing ever rounded away.
  top = float(jnp.finfo(dtype).max)
  toward = jnp.where(err > 0, top, -top).astype(dtype)
  other = jnp.nextafter(near, toward)
  gap = other.astype(x.dtype) - near_wide
  uniform = (bits >> 8).astype(x.dtype) * (2.0**-24)
  # err / gap is in [0, 1/2]; NaN (never taken) where near is +-inf.
  return jnp.where(uniform < err / gap, other, near)


def _leaf_specs(specs: Any, tree: Any, what: str) -> list[Any]:
  """One ``PartitionSpec`` (or ``None``) per leaf of ``tree``."""
  leaves = jax.tree.leaves(tree)
  if specs is None:
    return [None] * len(leaves)
  is_spec = lambda s: s is None or isinstance(s, jax.sharding.PartitionSpec)
  spec_leaves, spec_def = jax.tree.flatten(specs, is_leaf=is_spec)
  try:
    subtrees = spec_def.flatten_up_to(tree)
  except (ValueError, TypeError) as e:
    raise ValueError(
        f"specs must be a pytree prefix of the {what} (PartitionSpecs as given"
        f" to shard_map's in_specs): {e}") from None
  out = []
  for spec, sub in zip(spec_leaves, subtrees, strict=True):
    if not is_spec(spec):
      raise TypeError(
          f"specs leaves must be jax.sharding.PartitionSpec or None, got"
          f" {spec!r}")
    out.extend([spec] * len(jax.tree.leaves(sub)))
  return out


# ----------------------------------------------------------- kahan_summation


# What float16 compensation buffers hold the error times. The error is at
# most half an ulp of its param, which for params below 2**-3 is a float16
# subnormal (measured: 100 updates of 0.1 ulp moved a param of 2e-4 by 0
# ulps, not 10). Times 2**11 it is normal for every normal param and finite
# for the largest (half an ulp of 65504 is 16; 16 * 2**11 = 32768).
_F16_COMPENSATION_SCALE = 2.0**11


def _compensation_dtype(dtype: Any) -> np.dtype:
  # FP8's 2-3 mantissa bits stall a residual long before it is worth an ulp
  # of the param; bfloat16 holds FP8's whole range with 8 bits.
  dtype = np.dtype(dtype)
  return np.dtype(jnp.bfloat16) if dtype.itemsize == 1 else dtype


def _compensation_scale(dtype: Any) -> float:
  # Only float16 needs it: bfloat16 has float32's exponent range.
  return (_F16_COMPENSATION_SCALE if np.dtype(dtype) == np.float16
          else 1.0)


def kahan_summation(
    inner: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
  """Applies ``inner``'s updates to half-precision params with compensation.

  For every bfloat16/float16 param leaf the state keeps a compensation buffer
  ``c`` of the param's dtype (bfloat16 for an FP8 param: two or three
  mantissa bits cannot carry the residual, and it would stop growing long
  before it reached the param's half ulp; float16 buffers hold it times
  ``2**11``, clear of float16's subnormals: :meth:`KahanState.residual`).
  Each step computes, in float32, ``s = p + (u + c)`` (``u``: ``inner``'s
  update), the new param ``round(s)`` and the new buffer ``s - round(s)``,
  and returns the update that makes ``optax.apply_updates(params,
  updates)`` land exactly on ``round(s)``. The rounding error is carried
  into the next step, so updates far below half an ulp accumulate instead
  of vanishing: ``p + c`` follows a float32 run to about one ulp of the
  param's dtype.

  Returned updates are float32 for half-precision leaves (the exact
  difference of two half values) and FP8 for FP8 leaves (JAX adds no
  float32 update to an FP8 param; exact while the param moves by less than
  a factor of two). float32/float64 and non-floating leaves
  have no buffer and pass ``inner``'s updates through unchanged. An element
  whose update is exactly zero keeps its param and buffer as they were.

  Composition: compute the moments in float32 and store them in bfloat16
  with ``kahan_summation(state_dtypes(inner, "bf16"))`` (8 bytes per
  parameter with Adam). A step skipped by :func:`~jmp_lite.loss_scaled` or
  :func:`~jmp_lite.skip_nonfinite` leaves params and buffers bit-identical
  whether the guard is inside (its ``-0.0`` updates move nothing) or
  outside (it keeps this state).

  Args:
    inner: the optimizer whose updates to apply.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`KahanState`. Its ``update`` requires ``params``.

  Raises:
    TypeError: if ``inner`` is not a gradient transformation.
    ValueError: from ``update``, when called without ``params``.

  Example:
    >>> import jax.numpy as jnp, optax, jmp_lite
    >>> opt = jmp_lite.kahan_summation(optax.sgd(1e-4))
    >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> state = opt.init(params)
    >>> state.compensation["w"].dtype
    dtype(bfloat16)
    >>> grads = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> for _ in range(100):  # 100 updates of 1e-4: bf16 alone would not move
    ...   updates, state = opt.update(grads, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> params["w"]
    Array([0.988281, 0.988281], dtype=bfloat16)
  """
  check_transformation(inner, "kahan_summation")

  def init(params: Any) -> KahanState:
    compensation = jax.tree.map(
        # zeros_like: the buffer takes its param's sharding (jnp.zeros put a
        # whole-model buffer on device 0).
        lambda p: jnp.zeros_like(p, dtype=_compensation_dtype(p.dtype))
        if _is_narrow(p) else None,
        params)
    return KahanState(compensation=compensation,
                      inner_state=_unaliased(inner.init(params), params))

  def leaf(p: Any, u: Any, c: Any) -> tuple[Any, Any]:
    if c is None or not _dtypes.is_floating_array(u):
      return u, c
    wide = _wide(p, u)
    scale = _compensation_scale(c.dtype)   # A power of two: exact.
    p_wide, u_wide = p.astype(wide), u.astype(wide)
    s = p_wide + (u_wide + c.astype(wide) / scale)
    # Not s.astype(p.dtype).astype(wide): XLA:GPU deletes that pair, and
    # the compensation would stay zero (round_to's docstring).
    new_wide = _dtypes.round_to(s, p.dtype)
    # |s - new| <= half an ulp of new: exact in float32, rounded into c.
    moved = u_wide != 0
    new_c = jnp.where(moved, ((s - new_wide) * scale).astype(c.dtype), c)
    return _dtypes.update_between(new_wide, p_wide, _update_dtype(p, wide),
                                  moved), new_c

  def rebind(inner_update: contract.UpdateFn) -> contract.UpdateFn:
    def update(updates: Any, state: KahanState, params: Any = None,
               **extra: Any) -> tuple[Any, KahanState]:
      _need_params(params, "kahan_summation")
      inner_updates, inner_state = inner_update(
          updates, state.inner_state, params, **extra)
      p_leaves, treedef = jax.tree.flatten(params)
      u_leaves = treedef.flatten_up_to(inner_updates)
      c_leaves = treedef.flatten_up_to(state.compensation)
      out = [leaf(p, u, c)
             for p, u, c in zip(p_leaves, u_leaves, c_leaves, strict=True)]
      new_updates = treedef.unflatten([o[0] for o in out])
      compensation = treedef.unflatten([o[1] for o in out])
      return new_updates, KahanState(compensation=compensation,
                                     inner_state=inner_state)
    return update

  # The compensation is half on purpose (loss_scaled's check for half
  # moments leaves it be; the inner state is still checked).
  return _forwarding(init, rebind, inner, half_by_design=lambda s: KahanState(
      compensation=None,
      inner_state=contract.without_half_by_design(inner, s.inner_state)))


# ------------------------------------------------------- stochastic_rounding


def stochastic_rounding(
    inner: optax.GradientTransformation,
    *,
    seed: int = 0,
    specs: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """Applies ``inner``'s updates to half-precision params, rounding at random.

  ``optax.apply_updates(params, updates)`` equals ``params + u`` (``u``:
  ``inner``'s update, summed in float32) rounded to each param's dtype *up or
  down at random*, with the probability of rounding up equal to the dropped
  fraction of an ulp: the expectation is the exact sum, so updates far below
  half an ulp still move the param on average. No extra buffer: 6 bytes per
  parameter with Adam's moments in bfloat16 (see :func:`state_dtypes`).

  The random bits are a hash of ``seed``, a step counter kept in the state,
  the leaf and the element's index, computed inside the update's fused
  kernel. A run is reproducible, and a restored checkpoint continues the same
  stream. The counter advances on every step that applies updates, as the
  :func:`~jmp_lite.loss_scaled`, :func:`~jmp_lite.skip_nonfinite` and
  :func:`~jmp_lite.accumulate_gradients` ("guards") inside say: a step that
  a guard outside skips, or that every guard inside skips, leaves the state
  bit-identical; a step that one guard applies while another skips (one
  per ``optax.multi_transform`` partition) advances it, so that the applied
  partition draws fresh bits. Only guards are read: a partition without a
  guard, beside partitions with one, does not advance the counter on a step
  they all skipped. float32/float64 and non-floating leaves pass ``inner``'s
  updates through unchanged. Updates of FP8 params are FP8 (JAX adds no
  float32 update to them); of half-precision params, float32.

  Args:
    inner: the optimizer whose updates to apply.
    seed: an int in ``[0, 2**32)``; stored in the state.
    specs: under ``jax.shard_map`` only: the params' ``PartitionSpec`` s (a
      pytree prefix of the params, as given to ``in_specs``). Each element
      then draws the bits of its *global* index, so shards of a sharded param
      draw different bits and the result equals the unsharded run's bit for
      bit. Not needed under ``jax.jit`` with sharded arrays.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`StochasticRoundingState`. Its ``update`` requires ``params``.

  Raises:
    TypeError: if ``inner`` is not a gradient transformation or ``seed`` not
      an int.
    ValueError: if ``seed`` is out of range; from ``update``, when called
      without ``params`` or with ``specs`` that do not fit the params.

  Example:
    >>> import jax.numpy as jnp, optax, jmp_lite
    >>> opt = jmp_lite.stochastic_rounding(optax.sgd(1e-4), seed=0)
    >>> params = {"w": jnp.ones(1000, jnp.bfloat16)}
    >>> state = opt.init(params)
    >>> grads = {"w": jnp.ones(1000, jnp.bfloat16)}
    >>> for _ in range(100):  # 100 updates of 1e-4: bf16 alone would not move
    ...   updates, state = opt.update(grads, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> mean = float(params["w"].astype(jnp.float32).mean())
    >>> params["w"].dtype, round(mean, 3)
    (dtype(bfloat16), 0.99)
  """
  check_transformation(inner, "stochastic_rounding")
  seed = _check_seed(seed)

  def init(params: Any) -> StochasticRoundingState:
    return StochasticRoundingState(
        seed=jnp.asarray(seed, jnp.uint32), count=jnp.zeros((), jnp.uint32),
        inner_state=_unaliased(inner.init(params), params))

  def rebind(inner_update: contract.UpdateFn) -> contract.UpdateFn:
    def update(updates: Any, state: StochasticRoundingState, params: Any = None,
               **extra: Any) -> tuple[Any, StochasticRoundingState]:
      _need_params(params, "stochastic_rounding")
      inner_updates, inner_state = inner_update(
          updates, state.inner_state, params, **extra)
      key = _step_key(state.seed, state.count)
      p_leaves, treedef = jax.tree.flatten(params)
      u_leaves = treedef.flatten_up_to(inner_updates)
      leaf_specs = _leaf_specs(specs, params, "params")

      def leaf(i: int, p: Any, u: Any) -> Any:
        if not _is_narrow(p) or not _dtypes.is_floating_array(u):
          return u
        wide = _wide(p, u)
        p_wide = p.astype(wide)
        s = p_wide + u.astype(wide)
        bits = _random_bits(key, i, p.shape, leaf_specs[i])
        new_wide = _round_stochastic(s, p.dtype, bits).astype(wide)
        return _dtypes.update_between(new_wide, p_wide, _update_dtype(p, wide))

      new_updates = treedef.unflatten(
          [leaf(i, p, u)
           for i, (p, u) in enumerate(zip(p_leaves, u_leaves, strict=True))])
      applied = contract.step_applied(inner_state)
      count = state.count + applied.astype(jnp.uint32)
      return new_updates, StochasticRoundingState(
          seed=state.seed, count=count, inner_state=inner_state)

    return update

  # Holds nothing half itself; what its inner transformation declares holds.
  return _forwarding(init, rebind, inner, half_by_design=lambda s: (
      struct.replace(s, inner_state=contract.without_half_by_design(
          inner, s.inner_state))))


# --------------------------------------------------------------- state_dtypes


def _parse_dtypes(dtypes: Any) -> Any:
  """One ``np.dtype``, or a list of (compiled regex, pattern, dtype)."""
  if isinstance(dtypes, Mapping):
    if not dtypes:
      raise ValueError("state_dtypes: the dtypes mapping is empty")
    rules = []
    for pattern, dtype in dtypes.items():
      if not isinstance(pattern, str):
        raise TypeError(
            f"state_dtypes: pattern keys must be str, got {pattern!r}")
      try:
        regex = re.compile(pattern)
      except re.error as e:
        raise ValueError(
            f"state_dtypes: bad pattern {pattern!r}: {e}") from None
      rules.append((regex, pattern, _dtypes.to_floating_dtype(
          dtype, f"dtypes[{pattern!r}]")))
    return rules
  return _dtypes.to_floating_dtype(dtypes, "dtypes")


def state_dtypes(
    inner: optax.GradientTransformation,
    dtypes: Any,
    *,
    strict: bool = False,
    rounding: str = "nearest",
    seed: int = 0,
    specs: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """Stores ``inner``'s state in narrow dtypes; ``inner`` computes in float32.

  ``init`` runs ``inner.init`` on the params upcast to float32 and casts the
  chosen floating state leaves to their storage dtypes. ``update`` upcasts
  every narrower-than-float32 state leaf, gradient and param to float32, runs
  ``inner``, and rounds each new state leaf back to the dtype it is stored in
  (to nearest, or stochastically). So Adam's moments can live in bfloat16
  while its arithmetic, and its updates, stay float32: optax cannot choose
  ``nu``'s dtype (only ``mu_dtype`` exists, optax issue 1552).

  Leaves are chosen by ``dtypes``:

  * one dtype: every floating state leaf with at least one dimension (the
    per-parameter arrays; scalar hyperparameters and loss scales stay);
  * ``{regex: dtype}``: the first pattern that ``re.fullmatch`` es the leaf's
    ``/``-joined key path inside ``inner``'s state (``"0/mu/w"`` for
    ``optax.adam``) gives the dtype; unmatched leaves stay as ``inner``
    makes them.

  Prefer bfloat16 to float16 for storage, whatever the params' dtype:
  float16 cannot hold a second moment (squared gradients underflow, and
  Adam divides by their square root), so a float16 storage dtype warns
  (:class:`~jmp_lite.PrecisionWarning`).

  The updates are float32 for half-precision params: wrap this in
  :func:`kahan_summation` or :func:`stochastic_rounding` to apply them
  without losing what rounds away. Nearest rounding of a bfloat16 ``nu``
  cannot follow Adam's ``b2=0.999`` decay (a 0.1% change is below half an
  ulp); ``rounding="stochastic"`` can, in expectation.

  Args:
    inner: the optimizer; put a :func:`~jmp_lite.loss_scaled` *inside* so
      that it unscales float32 gradients.
    dtypes: a dtype (or name such as ``"bf16"``) or a ``{regex: dtype}``
      mapping.
    strict: raise if a pattern matches no floating state leaf.
    rounding: ``"nearest"`` or ``"stochastic"`` (unbiased; the state then
      holds a seed and a step counter, advanced as
      :func:`stochastic_rounding`'s is).
    seed: the stochastic rounding seed, an int in ``[0, 2**32)``.
    specs: with stochastic rounding under ``jax.shard_map`` only: the
      ``PartitionSpec`` s of ``inner``'s state (a pytree prefix of it), as for
      :func:`stochastic_rounding`'s ``specs``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`StateDtypesState`.

  Raises:
    TypeError: if ``inner`` is not a gradient transformation, a dtype is not
      a floating dtype, or a pattern is not a string.
    ValueError: for a bad regex, an unknown ``rounding``, a bad ``seed``; from
      ``init``, with ``strict=True``, for a pattern that matches no floating
      state leaf.

  Example:
    >>> import jax.numpy as jnp, optax, jmp_lite
    >>> opt = jmp_lite.state_dtypes(optax.adam(1e-3), {".*/mu/.*": "bf16"})
    >>> state = opt.init({"w": jnp.ones(3, jnp.bfloat16)})
    >>> state.inner_state[0].mu["w"].dtype, state.inner_state[0].nu["w"].dtype
    (dtype(bfloat16), dtype('float32'))
  """
  check_transformation(inner, "state_dtypes")
  strict = check_bool(strict, "strict")
  rules = _parse_dtypes(dtypes)
  chosen = ([d for _, _, d in rules] if isinstance(rules, list) else [rules])
  if np.dtype(jnp.float16) in chosen:
    warnings.warn(
        "state_dtypes: storing optimizer state in float16. float16 cannot"
        " hold Adam-style second moments: 0.001 * g**2 rounds to 0 for"
        " gradients below about 5e-3, and the update, divided by its square"
        " root, grows many times too large. Store moments in 'bf16' (float32's"
        " range; any params' dtype), as preset('O3') does.",
        PrecisionWarning, stacklevel=2)
  if rounding not in _ROUNDINGS:
    raise ValueError(
        f"rounding must be one of {_ROUNDINGS}, got {rounding!r}")
  seed = _check_seed(seed)
  stochastic = rounding == "stochastic"

  def storage(path: Any, x: Any, used: set[int]) -> Any:
    if not _dtypes.is_floating_array(x):
      return None
    if not isinstance(rules, list):
      return rules if x.ndim >= 1 else None
    name = path_string(path)
    for i, (regex, _, dtype) in enumerate(rules):
      if regex.fullmatch(name):
        used.add(i)
        return dtype
    return None

  def init(params: Any) -> StateDtypesState:
    wide_params = _upcast(params)
    inner_state = _unaliased(inner.init(wide_params), params, wide_params)
    used: set[int] = set()
    leaves, treedef = jax.tree_util.tree_flatten_with_path(inner_state)
    stored = []
    for path, x in leaves:
      dtype = storage(path, x, used)
      stored.append(x if dtype is None or x.dtype == dtype else x.astype(dtype))
    if strict and isinstance(rules, list):
      unused = [p for i, (_, p, _) in enumerate(rules) if i not in used]
      if unused:
        names = [path_string(p) for p, x in leaves
                 if _dtypes.is_floating_array(x)]
        raise ValueError(
            f"state_dtypes(strict=True): pattern(s) {unused} matched no"
            f" floating state leaf; the floating leaves are {names[:12]}"
            + (" ..." if len(names) > 12 else ""))
    return StateDtypesState(
        inner_state=treedef.unflatten(stored),
        seed=jnp.asarray(seed, jnp.uint32) if stochastic else None,
        count=jnp.zeros((), jnp.uint32) if stochastic else None)

  def rebind(inner_update: contract.UpdateFn) -> contract.UpdateFn:
    def update(updates: Any, state: StateDtypesState, params: Any = None,
               **extra: Any) -> tuple[Any, StateDtypesState]:
      stored, treedef = jax.tree.flatten(state.inner_state)
      new_updates, new_inner = inner_update(
          _upcast(updates), treedef.unflatten([
              x.astype(_F32) if _is_narrow(x) else x for x in stored]),
          _upcast(params), **extra)
      new_leaves = treedef.flatten_up_to(new_inner)
      seed_, count = state.seed, state.count
      # (key, leaf specs) with stochastic rounding, else None.
      rounding: tuple[jax.Array, list[Any]] | None = None
      if stochastic:
        rounding = (_step_key(seed_, count),
                    _leaf_specs(specs, state.inner_state, "optimizer state"))

      def back(i: int, old: Any, new: Any) -> Any:
        if not _dtypes.is_floating_array(old) or new.dtype == old.dtype:
          return new
        if rounding is not None and np.dtype(new.dtype).itemsize > np.dtype(
            old.dtype).itemsize:
          key, leaf_specs = rounding
          bits = _random_bits(key, i, old.shape, leaf_specs[i])
          return _round_stochastic(new, old.dtype, bits)
        return new.astype(old.dtype)

      rounded = [back(i, o, n) for i, (o, n)
                 in enumerate(zip(stored, new_leaves, strict=True))]
      if stochastic:
        applied = contract.step_applied(new_inner)
        count = count + applied.astype(jnp.uint32)
      return new_updates, StateDtypesState(
          inner_state=treedef.unflatten(rounded), seed=seed_, count=count)

    return update

  # What is stored here is half on purpose and computed in float32:
  # loss_scaled's check for half moments leaves it be.
  return _forwarding(
      init, rebind, inner,
      half_by_design=lambda s: struct.replace(s, inner_state=None))
