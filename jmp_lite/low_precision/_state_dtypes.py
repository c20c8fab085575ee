"""``state_dtypes``: store an optimizer's state narrow, compute in float32."""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite import contract, struct
from jmp_lite import dtypes as _dtypes
from jmp_lite._checks import (
  check_bool,
  check_own_state,
  check_transformation,
)
from jmp_lite._jaxpr import depends_on_inputs
from jmp_lite.diagnostics import PrecisionWarning
from jmp_lite.low_precision._common import (
  check_inner_structure,
  check_made_by,
  F32,
  forwarding,
  is_narrow,
  refuse_inside,
  unaliased,
  upcast,
)
from jmp_lite.low_precision._rounding import (
  check_seed,
  random_bits,
  round_stochastic,
  specs_per_leaf,
  step_key,
)
from jmp_lite.path_rules import path_string

_ROUNDINGS = ("nearest", "stochastic")


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
    config: what the state was made with (static): the storage dtypes (a
      dtype name, or ``(pattern, dtype name)`` pairs), the rounding and the
      seed; ``None`` in states pickled before it was recorded.
  """

  inner_state: Any
  seed: Any = None
  count: Any = None
  config: Any = struct.field(static=True, default=None)


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
  narrow = [d.name for d in chosen if d.itemsize == 1]
  if narrow:
    warnings.warn(
        f"state_dtypes: storing optimizer state in {narrow[0]}, with no"
        " per-block scale: 2-3 mantissa bits and a narrow range lose most of"
        " a moment (Adam's update came out 1.35 to 8.9 times float32's after"
        " 200 steps). For one byte per element use"
        " jmp_lite.quantized_states(inner, bits=8), which scales each block;"
        " else store 'bf16'.", PrecisionWarning, stacklevel=2)
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
  seed = check_seed(seed)
  stochastic = rounding == "stochastic"
  stored_as = ({p: d.name for _, p, d in rules} if isinstance(rules, list)
               else rules.name)
  config = (f"state_dtypes(dtypes={stored_as!r}, rounding={rounding!r}"
            + (f", seed={seed})" if stochastic else ")"))

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
    wide_params = upcast(params)
    inner_state = unaliased(inner.init(wide_params), params, wide_params)
    refuse_inside(
        inner_state, "state_dtypes", (contract.RoundsHalfParams,),
        "state_dtypes hands its inner optimizer float32 params, so it would"
        " round nothing. Put it outside:"
        " kahan_summation(state_dtypes(...)) or"
        " stochastic_rounding(state_dtypes(...))")
    refuse_inside(
        inner_state, "state_dtypes",
        (contract.Accumulates, optax.MultiStepsState),
        "its float32 gradient accumulator would be rounded to the storage"
        " dtype on every micro-batch. Accumulate outside:"
        " accumulate_gradients(state_dtypes(...))")
    masters = {id(x) for node in struct.find_nodes(
        inner_state, contract.HoldsMasterCopy)
               for x in jax.tree.leaves(node.master_copy())}
    # Copies of the params an optimizer keeps (schedule-free's z, Prodigy's
    # params0: computed from the params' values at init) are no statistics:
    # a single storage dtype leaves them as inner makes them.
    copies = iter(depends_on_inputs(inner.init, wide_params))
    used: set[int] = set()
    leaves, treedef = jax.tree_util.tree_flatten_with_path(inner_state)
    stored = []
    for path, x in leaves:
      dtype = storage(path, x, used)
      if next(copies) and not isinstance(rules, list):
        dtype = None
      if dtype is not None and id(x) in masters and dtype != x.dtype:
        raise ValueError(
            f"state_dtypes: {path_string(path)} is a master_weights copy of"
            f" the params; storing it in {dtype.name} would undo it. Put the"
            " master copy outside (master_weights(state_dtypes(...))) or"
            " choose only the moments with a {regex: dtype} mapping")
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
        count=jnp.zeros((), jnp.uint32) if stochastic else None,
        config=config)

  def rebind(inner_update: contract.UpdateFn) -> contract.UpdateFn:
    def update(updates: Any, state: StateDtypesState, params: Any = None,
               **extra: Any) -> tuple[Any, StateDtypesState]:
      check_own_state(state, StateDtypesState, "state_dtypes")
      check_made_by(state.config, config, "state_dtypes")
      check_inner_structure(inner, state.inner_state,
                            updates if params is None else params,
                            "state_dtypes")
      stored, treedef = jax.tree.flatten(state.inner_state)
      new_updates, new_inner = inner_update(
          upcast(updates), treedef.unflatten([
              x.astype(F32) if is_narrow(x) else x for x in stored]),
          upcast(params), **extra)
      new_leaves = treedef.flatten_up_to(new_inner)
      seed_, count = state.seed, state.count
      # (key, leaf specs) with stochastic rounding, else None.
      rounding: tuple[jax.Array, list[Any]] | None = None
      if stochastic:
        rounding = (step_key(seed_, count),
                    specs_per_leaf(specs, state.inner_state, "optimizer state"))

      def back(i: int, old: Any, new: Any) -> Any:
        if not _dtypes.is_floating_array(old) or new.dtype == old.dtype:
          return new
        if rounding is not None and np.dtype(new.dtype).itemsize > np.dtype(
            old.dtype).itemsize:
          key, leaf_specs = rounding
          bits = random_bits(key, i, old.shape, leaf_specs[i])
          return round_stochastic(new, old.dtype, bits)
        return new.astype(old.dtype)

      rounded = [back(i, o, n) for i, (o, n)
                 in enumerate(zip(stored, new_leaves, strict=True))]
      if stochastic:
        applied = contract.step_applied(new_inner)
        count = count + applied.astype(jnp.uint32)
      return new_updates, StateDtypesState(
          inner_state=treedef.unflatten(rounded), seed=seed_, count=count,
          config=state.config)

    return update

  # What is stored here is half on purpose and computed in float32:
  # loss_scaled's check for half moments leaves it be.
  return forwarding(
      init, rebind, inner,
      half_by_design=lambda s: struct.replace(s, inner_state=None))
