"""What the low-precision wrappers share: dtypes, upcasts, the declaration."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite import _optax, contract, struct
from jmp_lite import dtypes as _dtypes

F32 = np.dtype(jnp.float32)
BF16 = np.dtype(jnp.bfloat16)


def need_params(params: Any, who: str) -> None:
  """Raises a ``ValueError`` naming ``who`` when ``params`` is ``None``."""
  if params is None:
    raise ValueError(
        f"{who} needs the current params to round against: call"
        " opt.update(grads, state, params)")


def is_narrow(x: Any) -> bool:
  """Floating arrays narrower than float32: bfloat16, float16, float8."""
  return _dtypes.is_floating_array(x) and np.dtype(x.dtype).itemsize < 4


def wide_dtype(*xs: Any) -> np.dtype:
  """float32, or wider if an operand is (float64 updates under x64)."""
  dtype = F32
  for x in xs:
    if _dtypes.is_floating_array(x):
      dtype = jnp.promote_types(dtype, _dtypes.at_least_float32(x.dtype))
  return np.dtype(dtype)


def upcast(tree: Any) -> Any:
  """Narrow floating leaves to float32; everything else as it is."""
  return jax.tree.map(lambda x: x.astype(F32) if is_narrow(x) else x, tree)


def unaliased(state: Any, *trees: Any) -> Any:
  """``state`` with a copy of every leaf that *is* a leaf of ``trees``.

  A train step donates params and optimizer state; a state leaf sharing the
  params' buffer would be donated twice.
  """
  ids = {id(x) for t in trees for x in jax.tree.leaves(t)}
  return jax.tree.map(
      lambda x: jnp.array(x, copy=True)
      if isinstance(x, jax.Array) and id(x) in ids else x, state)


def forwarding(init: Any, rebind: Any, inner: optax.GradientTransformation,
                half_by_design: Any = None
                ) -> optax.GradientTransformationExtraArgs:
  """A wrapper that hands ``inner`` the gradients (upcast at most), declared
  so that jmp_lite.update_and_apply may decide a guard inside it up front
  (the skipped branch's ``-0.0`` updates move nothing here)."""
  return _optax.transformation(init, contract.declare(
      rebind(inner.update), contract.Forwarding(
          inner=inner, rebind=rebind, inner_state=lambda s: s.inner_state,
          half_by_design=half_by_design)))


def update_dtype(p: Any, wide: np.dtype) -> np.dtype:
  """The dtype of the updates handed on for param ``p``: ``wide``, or the
  param's own FP8 dtype."""
  # Updates of half params are exact in float32; FP8 params need FP8 ones
  # (JAX adds no float32 update to them).
  return np.dtype(p.dtype) if np.dtype(p.dtype).itemsize == 1 else wide


def check_made_by(state_config: Any, config: Any, who: str) -> None:
  """Raises a ``ValueError`` naming both when a state's recorded
  configuration is not the optimizer's.

  ``None`` is a state from before states recorded their configuration
  (an old pickle): it is taken as it is.
  """
  if state_config is not None and state_config != config:
    raise ValueError(
        f"{who}(...).update got a state made under another configuration: the"
        f" state was made with {state_config}, this optimizer is {config}."
        " Step a state with the optimizer whose init made it (or rebuild the"
        " optimizer with the state's settings)")


def check_inner_structure(inner: optax.GradientTransformation,
                          inner_state: Any, params: Any, who: str,
                          is_leaf: Any = None) -> None:
  """Raises a ``ValueError`` when ``inner_state`` is not the structure
  ``inner.init(params)`` makes (a state of another optimizer).

  Abstract (``jax.eval_shape``): it costs a trace of ``init``, once per
  trace of the step.
  """
  if contract.contract_of(inner) is not None:
    # A jmp_lite transformation checks its own state (and tracing its init
    # here, a quantizer's, cost seconds on models of hundreds of leaves).
    return
  if params is None:
    return
  # Key paths, not treedefs: static settings a guard records (None in
  # states pickled before it recorded them) are that guard's to check.
  def paths(tree: Any) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in
            jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]]
  expected = paths(jax.eval_shape(inner.init, upcast(params)))
  got = paths(inner_state)
  if expected != got:
    extra = sorted(set(got) - set(expected))[:3]
    lacking = sorted(set(expected) - set(got))[:3]
    raise ValueError(
        f"{who}(...).update got an inner state that its inner optimizer did"
        f" not make (its leaves {extra} are not the inner optimizer's, which"
        f" needs {lacking}; {len(got)} leaves against {len(expected)}): the"
        " state was made by a wrapper around another optimizer. Create it"
        f" again with this {who}(...).init(params)")


def refuse_inside(inner_state: Any, who: str, kinds: tuple[type, ...],
                  why: str) -> None:
  """Raises a ``ValueError`` when ``inner_state`` holds a state of one of
  ``kinds`` (a composition that cannot work), naming the working order."""
  found = struct.find_nodes(inner_state, kinds)
  if found:
    name = type(found[0]).__name__
    raise ValueError(f"{who}: the optimizer inside holds a {name}; {why}")


def check_updates_fit(updates: Any, params: Any, who: str) -> None:
  """A ``ValueError`` naming the first gradient whose structure or shape is
  not its param's (instead of an error from deep inside the update)."""
  if params is None:
    return
  g_flat, g_def = jax.tree_util.tree_flatten_with_path(updates)
  p_leaves, p_def = jax.tree.flatten(params)
  if g_def != p_def:
    raise ValueError(
        f"{who}: the gradients' structure is not the params' ({g_def} against"
        f" {p_def})")
  for (path, g), p in zip(g_flat, p_leaves, strict=True):
    # np.shape: a Python number is a scalar, as JAX reads it.
    if np.shape(g) != np.shape(p):
      raise ValueError(
          f"{who}: the gradient at {jax.tree_util.keystr(path)} has shape"
          f" {np.shape(g)}, its param {np.shape(p)}")

