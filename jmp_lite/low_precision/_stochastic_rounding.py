"""``stochastic_rounding``: round ``p + u`` up or down at random, unbiased."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite import contract, struct
from jmp_lite import dtypes as _dtypes
from jmp_lite._checks import check_own_state, check_transformation
from jmp_lite.low_precision._common import (
  check_inner_structure,
  check_made_by,
  forwarding,
  is_narrow,
  need_params,
  unaliased,
  update_dtype,
  wide_dtype,
)
from jmp_lite.low_precision._rounding import (
  check_seed,
  random_bits,
  round_stochastic,
  specs_per_leaf,
  step_key,
)

_SALT = np.uint32(0x5352)  # "SR"


@struct.dataclass
class StochasticRoundingState(contract.RoundsHalfParams):
  """State of :func:`stochastic_rounding`.

  Attributes:
    seed: the stream's seed (uint32 scalar).
    count: steps so far that applied updates (uint32 scalar; see
      :func:`stochastic_rounding`); with ``seed`` it picks this
      step's random bits, so a restored checkpoint continues the stream.
    inner_state: the wrapped optimizer's state.
    config: the seed it was made with (static; ``None`` in states pickled
      before it was recorded).
  """

  seed: Any
  count: Any
  inner_state: Any
  config: Any = struct.field(static=True, default=None)


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
  seed = check_seed(seed)
  config = f"stochastic_rounding(seed={seed})"

  def init(params: Any) -> StochasticRoundingState:
    return StochasticRoundingState(
        seed=jnp.asarray(seed, jnp.uint32), count=jnp.zeros((), jnp.uint32),
        inner_state=unaliased(inner.init(params), params),
        config=config)

  def rebind(inner_update: contract.UpdateFn) -> contract.UpdateFn:
    def update(updates: Any, state: StochasticRoundingState, params: Any = None,
               **extra: Any) -> tuple[Any, StochasticRoundingState]:
      check_own_state(state, StochasticRoundingState, "stochastic_rounding")
      need_params(params, "stochastic_rounding")
      check_made_by(state.config, config, "stochastic_rounding")
      check_inner_structure(inner, state.inner_state, params,
                            "stochastic_rounding")
      inner_updates, inner_state = inner_update(
          updates, state.inner_state, params, **extra)
      # The state's seed: the stream it started (a vmap over seeds, a
      # restored checkpoint); init takes the optimizer's. Salted: a
      # quantized_states or state_dtypes inside, with the same seed and
      # counter, would otherwise round its leaf i with param i's bits.
      seed_ = state.seed
      key = step_key(seed_ ^ _SALT, state.count)
      p_leaves, treedef = jax.tree.flatten(params)
      u_leaves = treedef.flatten_up_to(inner_updates)
      leaf_specs = specs_per_leaf(specs, params, "params")

      def leaf(i: int, p: Any, u: Any) -> Any:
        if not is_narrow(p) or not _dtypes.is_floating_array(u):
          return u
        wide = wide_dtype(p, u)
        p_wide = p.astype(wide)
        s = p_wide + u.astype(wide)
        bits = random_bits(key, i, p.shape, leaf_specs[i])
        new_wide = round_stochastic(s, p.dtype, bits).astype(wide)
        return _dtypes.update_between(new_wide, p_wide, update_dtype(p, wide))

      new_updates = treedef.unflatten(
          [leaf(i, p, u)
           for i, (p, u) in enumerate(zip(p_leaves, u_leaves, strict=True))])
      applied = contract.step_applied(inner_state)
      count = state.count + applied.astype(jnp.uint32)
      return new_updates, StochasticRoundingState(
          seed=seed_, count=count, inner_state=inner_state,
          config=state.config)

    return update

  # Holds nothing half itself; what its inner transformation declares holds.
  return forwarding(init, rebind, inner, half_by_design=lambda s: (
      struct.replace(s, inner_state=contract.without_half_by_design(
          inner, s.inner_state))))
