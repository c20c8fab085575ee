"""``quantized_states``: an optimizer's state in 8 or 4 bits per element.

Each per-parameter floating state leaf (Adam's ``mu`` and ``nu``) is stored
as a :class:`QuantizedArray` (``_blockwise``: the maps, the blocks, each
block's outlier kept exactly); ``inner`` computes in float32 on the
dequantized state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite import contract, struct
from jmp_lite import dtypes as _dtypes
from jmp_lite._checks import check_own_state, check_transformation
from jmp_lite._jaxpr import depends_on_inputs
from jmp_lite._nnx_paths import rewrap_like, unwrap_variables
from jmp_lite.low_precision._blockwise import (
  bytes_per_element,
  dequantize,
  POWERS,
  quantize,
  QuantizedArray,
  stored_shapes,
)
from jmp_lite.low_precision._common import (
  check_inner_structure,
  check_made_by,
  check_updates_fit,
  F32,
  forwarding,
  refuse_inside,
  unaliased,
  upcast,
)
from jmp_lite.low_precision._leaves import (
  mirrored_params,
  mirrors_a_param,
  unsigned_leaf,
)
from jmp_lite.low_precision._rounding import (
  check_seed,
  half_noise,
  NOISE_SCALE,
  specs_per_leaf,
  step_key,
  stream_bits,
)
from jmp_lite.low_precision._streams import (
  code_streams,
  is_quantized,
  leaf_params,
)

_BITS = (8, 4)
# State fields that hold non-negative statistics an optimizer divides by (or
# takes the root of): Adam's and RMSProp's ``nu``, AMSGrad's ``nu_max``,
# Adan's ``n``, Adagrad's ``sum_of_squares``, Adadelta's ``e_g``/``e_x``,
# D-Adaptation's ``exp_avg_sq``. The signed map's zero code would make them
# come back as 0.
_UNSIGNED = ("nu", "nu_max", "n", "sum_of_squares", "grad_sum_of_squares",
             "e_g", "e_x", "exp_avg_sq", "v_row", "v_col", "FactoredState.v")
# First moments and gradient copies: signed by nature (``unsigned=`` naming
# one would store it without its sign).
_SIGNED = ("mu", "m", "trace", "exp_avg", "g", "momentum")
_ROUNDINGS = ("stochastic", "nearest")


@dataclasses.dataclass(frozen=True)
class QuantizedConfig:
  """What decides how a :func:`quantized_states` state is written and read.

  Recorded in :class:`QuantizedStatesState` (static), compared by
  ``update``.

  Attributes:
    bits: 8 or 4.
    block_size: elements per block.
    scale_dtype: the scales' dtype name.
    unsigned: the state fields stored with the unsigned map.
    rounding: ``"stochastic"`` or ``"nearest"``.
    seed: the stochastic codes' seed.
  """

  bits: int
  block_size: int
  scale_dtype: str
  unsigned: tuple[str, ...]
  rounding: str
  seed: int


@struct.dataclass
class QuantizedStatesState:
  """State of :func:`quantized_states`.

  Attributes:
    seed: the stochastic rounding stream's seed (uint32 scalar).
    count: steps so far that applied updates (uint32 scalar); with
      ``seed`` it picks the step's random bits, so a restored checkpoint
      continues the stream.
    inner_state: the wrapped optimizer's state, each quantized leaf replaced
      by a :class:`QuantizedArray` (the rest as ``inner`` keeps it).
    config: the :class:`QuantizedConfig` the state was made with (static;
      ``None`` in states pickled before it was recorded).
  """

  seed: Any
  count: Any
  inner_state: Any
  config: Any = struct.field(static=True, default=None)


def _state_specs(specs: Any, params: Any, inner_state: Any) -> list[Any]:
  """One ``PartitionSpec`` (or ``None``) per stored state leaf: a quantized
  leaf takes the spec of its param (:func:`leaf_params`: by the state's
  structure, else by key path; not by shape: under ``shard_map`` a
  replicated param and a shard of another can share one)."""
  if specs is None:
    return [None] * len(jax.tree.leaves(inner_state, is_leaf=is_quantized))
  p_specs = specs_per_leaf(specs, params, "params")
  return [None if i is None else p_specs[i]
          for i in leaf_params(inner_state, params)]


def _check_int(value: Any, what: str, low: int) -> int:
  if isinstance(value, (bool, np.bool_)) or not isinstance(
      value, (int, np.integer)):
    raise TypeError(
        f"quantized_states: {what} must be an int, got"
        f" {type(value).__name__}: {value!r}")
  if value < low:
    raise ValueError(f"quantized_states: {what} must be >= {low}, got {value}")
  return int(value)


def quantized_states(
    inner: optax.GradientTransformation,
    bits: int = 8,
    block_size: int = 256,
    *,
    scale_dtype: Any = "float32",
    unsigned: Sequence[str] | None = None,
    rounding: str = "stochastic",
    seed: int = 0,
    specs: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """Stores ``inner``'s state block-quantized; ``inner`` computes in float32.

  ``init`` runs ``inner.init`` on the params upcast to float32 and stores
  every floating state leaf that has the shape of a param (and at least one
  dimension) as a :class:`QuantizedArray`: ``bits`` per element (8: one byte;
  4: two codes per byte) and one scale per block of ``block_size`` elements
  along the last axis. Blocks follow the last axis so that a param sharded
  along its leading axes keeps each block within a shard (under ``jax.jit``
  the codes take the param's sharding; under ``shard_map`` each shard's
  blocks are the whole array's, and with ``rounding="stochastic"`` pass
  ``specs=`` so each shard draws its own bits), and a last axis that is
  not a multiple of ``block_size`` ends in a partial block. A last axis ``n``
  shorter than a block takes ``block_size // n`` whole rows per block (a
  shard then keeps its blocks when it holds a multiple of that many rows).
  Counts and other leaves are kept as ``inner`` makes them. ``update``
  dequantizes to float32, runs ``inner`` on float32 gradients and params,
  and quantizes the new state (stochastically by default); its updates are
  float32 (wrap this in :func:`stochastic_rounding` or
  :func:`kahan_summation` for half params).

  Each block keeps its largest element exactly (float32, with its index)
  and scales the others by the largest of them: one gradient spike (a
  ``1e20`` gradient, whose square overflows to ``inf``) changes that
  element's moments alone, as in a float32 state, instead of rounding its
  255 neighbours to zero or to the map's floor for as long as the spike
  lasts.

  With Adam that is 1 + 1 bytes per parameter for the moments at 8 bits
  (0.5 + 0.5 at 4 bits) plus 9 bytes per block (scale, outlier, index):
  params plus optimizer state with bfloat16 params and
  :func:`stochastic_rounding`, about 4.07 bytes per parameter (3.07 with 4
  bits).

  Only per-parameter statistics are stored quantized: a floating state leaf
  whose key path ends with a param's and which has its shape (a leaf that
  only shares a shape, such as Adafactor's factored ``v_col``, stays as
  ``inner`` makes it), and which ``inner.init`` does not compute from the
  params' values (copies of the params, such as schedule-free's ``z`` or
  Prodigy's ``params0``, stay float32). Second moments take the unsigned
  square-root map with no zero code, so a positive one never comes back
  as 0; the rest the signed map. optax's second moments are known (``nu``,
  ``nu_max``, Adan's ``n``, ``sum_of_squares``, Adafactor's ``v``,
  ...); name others in ``unsigned``. A
  step that a guard inside (:func:`~jmp_lite.loss_scaled`) skips leaves the
  codes and scales bit-identical.

  The state records its configuration (:class:`QuantizedConfig`) and each
  quantized leaf how it was written (``QuantizedArray.form``): ``update``
  refuses a state made under another configuration, and a checkpoint
  restored into another ``unsigned=`` or ``scale_dtype`` is read as it was
  written and rewritten in the new one on the next step (another ``bits``
  or ``block_size`` is refused: see ``docs/refusals.md``).

  Order: :func:`stochastic_rounding` and :func:`kahan_summation` go
  outside (inside, they would get float32 params and round nothing), and
  so do :func:`~jmp_lite.master_weights` (inside, its float32 master copy
  would be stored in 8 bits) and :func:`~jmp_lite.accumulate_gradients` or
  ``optax.MultiSteps`` (inside, the accumulator would be stored in 8 bits,
  and kept as it was on each micro-batch that applies nothing); ``init``
  refuses them inside.

  Args:
    inner: the optimizer; put a :func:`~jmp_lite.loss_scaled` *inside* so
      that it unscales float32 gradients.
    bits: 8 or 4.
    block_size: elements per block, a positive int (even for 4 bits).
    scale_dtype: ``"float32"`` or ``"bfloat16"`` for the scales.
    unsigned: names of further state fields holding non-negative
      statistics, beyond optax's second moments (known already, see above);
      each must be a field of ``inner``'s state, and first moments (``mu``,
      ``m``, ``trace``, ...) are refused.
    rounding: ``"stochastic"`` (each code rounds up or down at random,
      unbiased in ``mu`` and in ``sqrt(nu)``) or ``"nearest"`` (the nearest
      code in the companded domain). Nearest codes change the trajectory: a
      moment's per-step change smaller than half a code's gap is lost, so
      4-bit Adam on the digits MLP took steps up to 2.9 times float32's
      along the same gradients, see ``docs/low_precision.md``.
    seed: an int in ``[0, 2**32)`` for the stochastic codes' bits; the
      state keeps a step counter, so a restored checkpoint continues the
      stream.
    specs: under ``jax.shard_map`` with ``rounding="stochastic"`` only: the
      params' ``PartitionSpec`` s (a pytree prefix of the params), so each
      element draws the bits of its global index and a sharded run's codes
      equal the unsharded run's. Not needed under ``jax.jit``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`QuantizedStatesState`.

  Raises:
    TypeError: if ``inner`` is not a gradient transformation, or
      ``bits``/``block_size``/``seed`` not an int.
    ValueError: for ``bits`` other than 8 or 4, a ``block_size`` below 1 (or
      odd with 4 bits), another ``scale_dtype`` or ``rounding``, or a
      ``seed`` out of range; from ``init``, for an ``unsigned`` name that no
      state field has or an order that cannot work (above); from
      ``update``, for a state made under another configuration.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jmp_lite
    >>> opt = jmp_lite.stochastic_rounding(
    ...     jmp_lite.quantized_states(optax.adam(1e-3), bits=8), seed=0)
    >>> params = {"w": jnp.ones((8, 512), jnp.bfloat16)}
    >>> state = opt.init(params)
    >>> updates, state = jax.jit(opt.update)(params, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> bytes_ = jmp_lite.diagnostics.tree_bytes((params, state))
    >>> round(bytes_ / 4096, 2)  # params 2, moments 1 + 1, per block more
    4.08
  """
  check_transformation(inner, "quantized_states")
  bits = _check_int(bits, "bits", 1)
  if bits not in _BITS:
    raise ValueError(f"quantized_states: bits must be 8 or 4, got {bits}")
  block_size = _check_int(block_size, "block_size", 1)
  if bits == 4 and block_size % 2:
    raise ValueError(
        "quantized_states: with bits=4 two codes share a byte, so block_size"
        f" must be even, got {block_size}")
  scale_dtype = _dtypes.to_floating_dtype(scale_dtype, "scale_dtype")
  if scale_dtype not in (F32, np.dtype(jnp.bfloat16)):
    raise ValueError(
        "quantized_states: scale_dtype must be float32 or bfloat16, got"
        f" {scale_dtype.name}")
  if unsigned is None:
    unsigned = ()
  if isinstance(unsigned, str) or not isinstance(unsigned, Sequence) or not (
      all(isinstance(n, str) for n in unsigned)):
    raise TypeError(
        "quantized_states: unsigned must be a sequence of field names, got"
        f" {unsigned!r}")
  extra_unsigned = tuple(unsigned)
  signed_named = [n for n in extra_unsigned if n in _SIGNED]
  if signed_named:
    raise ValueError(
        f"quantized_states: unsigned names {signed_named}, but those fields"
        " hold signed values (first moments, gradients); the unsigned map"
        " would store them without their sign. Name only non-negative"
        " statistics (optax's second moments are known already)")
  unsigned = _UNSIGNED + extra_unsigned
  if rounding not in _ROUNDINGS:
    raise ValueError(
        "quantized_states: rounding must be 'stochastic' or 'nearest', got"
        f" {rounding!r}")
  seed = check_seed(seed)
  config = QuantizedConfig(bits=bits, block_size=block_size,
                           scale_dtype=scale_dtype.name,
                           unsigned=extra_unsigned, rounding=rounding,
                           seed=seed)

  def store(tree: Any, path: Any, x: Any, copy: bool,
            params: list[tuple[tuple[Any, ...], tuple[int, ...]]],
            above: int) -> Any:
    # Per-parameter statistics only: not a copy of the params that the
    # optimizer keeps (schedule-free's z, Prodigy's params0: computed from
    # the params' values at init), not a leaf that merely shares a shape.
    if not (_dtypes.is_floating_array(x) and x.ndim >= 1 and x.size
            and not copy and mirrors_a_param(path, tuple(x.shape), params)):
      return x
    # The state's field: on the path above the params' subtree (an
    # equinox param's own attributes, ``Linear.weight``, are not fields).
    signed = not unsigned_leaf(tree, path[:above], unsigned)
    # Adam's zeros do not depend on the params' values: under jax.jit, XLA
    # constant-folded their quantization on its slow evaluator (73 s to
    # compile the init of 5M params). Behind a barrier it runs as one pass.
    x = jax.lax.optimization_barrier(x)
    return quantize(x, bits=bits, block_size=block_size, signed=signed,
                    power=POWERS[(bits, signed)], scale_dtype=scale_dtype)

  def check_names(inner_state: Any) -> None:
    # A name given by hand that no state field has is a typo: its moments
    # would silently take the signed map.
    fields = {k.name for path, _ in
              jax.tree_util.tree_flatten_with_path(inner_state)[0]
              for k in path if isinstance(k, jax.tree_util.GetAttrKey)}
    missing = [n for n in extra_unsigned if n not in fields]
    if missing:
      raise ValueError(
          f"quantized_states: unsigned names {missing} match no field of the"
          f" inner optimizer's state; its fields are {sorted(fields)}")

  def init(params: Any) -> QuantizedStatesState:
    params = unwrap_variables(params)
    wide_params = upcast(params)
    inner_state = unaliased(inner.init(wide_params), params, wide_params)
    refuse_inside(
        inner_state, "quantized_states", (contract.HoldsMasterCopy,),
        "its float32 master copy would be stored in"
        f" {bits} bits. Put the master copy outside:"
        " master_weights(quantized_states(...))")
    refuse_inside(
        inner_state, "quantized_states", (contract.RoundsHalfParams,),
        "quantized_states hands its inner optimizer float32 params, so it"
        " would round nothing. Put it outside:"
        " stochastic_rounding(quantized_states(...)) or"
        " kahan_summation(quantized_states(...))")
    refuse_inside(
        inner_state, "quantized_states",
        (contract.Accumulates, optax.MultiStepsState),
        "its float32 gradient accumulator would be stored in"
        f" {bits} bits and keep only a window's last micro-batch. Accumulate"
        " outside: accumulate_gradients(quantized_states(...))")
    check_names(inner_state)
    params_at = [(tuple(p), tuple(x.shape)) for p, x in
                 jax.tree_util.tree_flatten_with_path(params)[0]
                 if hasattr(x, "shape")]
    copies = iter(depends_on_inputs(inner.init, wide_params))
    above = iter(n for _, n in mirrored_params(inner_state, params))
    return QuantizedStatesState(
        seed=jnp.asarray(seed, jnp.uint32), count=jnp.zeros((), jnp.uint32),
        inner_state=jax.tree_util.tree_map_with_path(
            lambda path, x: store(inner_state, path, x, next(copies),
                                  params_at, next(above)), inner_state),
        config=config)

  def check_layout(x: QuantizedArray) -> None:
    # Bits and block size decide the arrays' shapes: a leaf whose shapes
    # another configuration made is refused while tracing, before it is read.
    want = stored_shapes((*x.codes.shape[:-1], x.shape[-1]), x.bits,
                         x.block_size)
    got = (tuple(x.codes.shape), tuple(x.scales.shape))
    if (x.bits, x.block_size) != (bits, block_size) or got != want:
      raise ValueError(
          f"quantized_states(...).update got a state leaf stored with"
          f" bits={x.bits}, block_size={x.block_size} (codes {got[0]},"
          f" scales {got[1]}); this optimizer has bits={bits},"
          f" block_size={block_size}. Restore it into the configuration it"
          " was saved with")

  def rebind(inner_update: contract.UpdateFn) -> contract.UpdateFn:
    def update(updates: Any, state: QuantizedStatesState, params: Any = None,
               **extra: Any) -> tuple[Any, QuantizedStatesState]:
      given = updates
      updates, params = unwrap_variables((updates, params))
      check_own_state(state, QuantizedStatesState, "quantized_states")
      check_updates_fit(updates, params, "quantized_states(...).update")
      check_made_by(state.config, config, "quantized_states")
      # Without params, the gradients have their structure.
      check_inner_structure(
          inner, state.inner_state, updates if params is None else params,
          "quantized_states", is_leaf=is_quantized)
      stored, treedef = jax.tree.flatten(state.inner_state,
                                         is_leaf=is_quantized)
      for x in stored:
        if is_quantized(x):
          check_layout(x)
      wide = treedef.unflatten([dequantize(x) if is_quantized(x) else x
                                for x in stored])
      new_updates, new_inner = inner_update(
          upcast(updates), wide, upcast(params), **extra)
      # A step a guard inside skipped keeps the old codes bit for bit
      # (requantizing what was dequantized may move a scale by an ulp).
      applied = contract.step_applied(new_inner)
      # The state's seed: the stream it started (a vmap over seeds, a
      # restored checkpoint); init takes the optimizer's.
      key = step_key(state.seed, state.count)
      leaf_specs = _state_specs(specs, params, state.inner_state)
      streams = code_streams(state.inner_state,
                             updates if params is None else params)
      hashed: dict[Any, jax.Array] = {}

      def back(i: int, old: Any, new: Any) -> Any:
        if not is_quantized(old):
          return new
        noise = None
        if rounding == "stochastic":
          # 16 random bits per element, half of its param's pair's hash.
          stream, half = streams[i]  # type: ignore[misc]
          where = (stream, tuple(new.shape), str(leaf_specs[i]))
          if where not in hashed:   # Hashed once for both halves.
            hashed[where] = stream_bits(key, stream, new.shape,
                                        leaf_specs[i])
          noise = half_noise(hashed[where], half)
        fresh = quantize(new, bits=old.bits, block_size=old.block_size,
                         signed=old.signed, power=old.power,
                         scale_dtype=old.scales.dtype, noise=noise,
                         noise_scale=NOISE_SCALE)
        # Keep the static (global) shape: quantize saw the local shard.
        fresh = dataclasses.replace(fresh, shape=old.shape)
        return jax.tree.map(lambda a, b: jnp.where(applied, a, b), fresh, old)

      new_leaves = treedef.flatten_up_to(new_inner)
      return rewrap_like(given, new_updates), QuantizedStatesState(
          seed=state.seed,
          count=state.count + applied.astype(jnp.uint32),
          inner_state=treedef.unflatten(
              [back(i, o, n) for i, (o, n) in enumerate(
                  zip(stored, new_leaves, strict=True))]),
          config=state.config)

    return update

  def half_by_design(state: QuantizedStatesState) -> QuantizedStatesState:
    # The quantized leaves (codes, and scales perhaps in bfloat16) are
    # narrow on purpose and computed in float32; inner's part is inner's.
    rest = jax.tree.map(lambda x: None if is_quantized(x) else x,
                        state.inner_state, is_leaf=is_quantized)
    return struct.replace(
        state, inner_state=contract.without_half_by_design(inner, rest))

  return forwarding(init, rebind, inner, half_by_design=half_by_design)


__all__ = ["QuantizedArray", "QuantizedConfig", "QuantizedStatesState",
           "bytes_per_element", "dequantize", "quantize", "quantized_states"]
