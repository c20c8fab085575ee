"""Which random stream each quantized state leaf's stochastic codes draw:
one hash per element of each param (``_rounding.pair_bits``), whose high
and low halves round two of its leaves' codes (Adam's ``mu`` and ``nu``).
The XLA path and the kernels assign them here, so they draw the same bits.
"""

from __future__ import annotations

from typing import Any

import jax

from jmp_lite.low_precision._blockwise import QuantizedArray
from jmp_lite.low_precision._leaves import mirrored_params


def is_quantized(x: Any) -> bool:
  """Whether ``x`` is a quantized state leaf."""
  return isinstance(x, QuantizedArray)


def param_of(path: tuple[Any, ...], x: QuantizedArray,
             params: list[tuple[tuple[Any, ...], Any]]) -> int | None:
  """The index of the param a state leaf belongs to: the param whose key
  path ends the leaf's (``0/mu/w`` ends with ``w``), the longest such match,
  among params of the leaf's (global) shape; else the first param of that
  shape; else ``None`` (Python scalar params have none)."""
  best, best_len = None, -1
  for i, (p_path, p) in enumerate(params):
    if not hasattr(p, "shape"):
      continue
    if tuple(p.shape) != x.shape and (*x.codes.shape[:-1],
                                      x.shape[-1]) != tuple(p.shape):
      continue
    n = len(p_path)
    if n <= len(path) and tuple(path[len(path) - n:]) == tuple(p_path) \
        and n > best_len:
      best, best_len = i, n
  if best is None:
    best = next((i for i, (_, p) in enumerate(params)
                 if hasattr(p, "shape") and tuple(p.shape) == x.shape), None)
  return best


def leaf_params(inner_state: Any, tree: Any) -> list[int | None]:
  """Per leaf of ``inner_state`` (flattened with quantized leaves as
  leaves), the index of the param (a leaf of ``tree``, which has the
  params' structure) a quantized leaf mirrors: by the state's structure
  (:func:`mirrored_params`), else by key path (:func:`param_of`); ``None``
  for a leaf not quantized or matched by no param."""
  flat = jax.tree_util.tree_flatten_with_path(inner_state,
                                              is_leaf=is_quantized)[0]
  p_leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  mirrored = mirrored_params(inner_state, tree, is_leaf=is_quantized)
  return [None if not is_quantized(x) else
          i if i is not None else param_of(tuple(path), x, p_leaves)
          for (path, x), (i, _) in zip(flat, mirrored, strict=True)]


def code_streams(inner_state: Any, tree: Any
                 ) -> list[tuple[int, int] | None]:
  """Per leaf of ``inner_state`` (flattened with quantized leaves as
  leaves), the random stream and half its stochastic codes take
  (:func:`~jmp_lite.low_precision._rounding.pair_bits`), ``None`` for a
  leaf not quantized: a param's quantized leaves, in their order in the
  state, take the high and low halves of one stream per pair (Adam's
  ``mu`` and ``nu`` share one hash per element). ``tree`` has the params'
  structure (the params, or the gradients); the params are found by
  :func:`leaf_params`."""
  flat = jax.tree.leaves(inner_state, is_leaf=is_quantized)
  n_params = len(jax.tree.leaves(tree))
  seen: dict[int, int] = {}
  out: list[tuple[int, int] | None] = []
  for n, (x, i) in enumerate(zip(flat, leaf_params(inner_state, tree),
                                 strict=True)):
    if not is_quantized(x):
      out.append(None)
    elif i is None:   # Matched by no param: a stream of its own.
      out.append((n_params * (len(flat) + 1) + n, 0))
    else:
      slot = seen.get(i, 0)
      seen[i] = slot + 1
      out.append((i + n_params * (slot // 2), slot % 2))
  return out


def paired_stream(streams: dict[int, tuple[int, int]], mu: QuantizedArray,
                  nu: QuantizedArray) -> int:
  """The stream a param's ``mu`` (high half) and ``nu`` (low) share."""
  (s, h), pair = streams[id(mu)], streams[id(nu)]
  if (h, pair) != (0, (s, 1)):
    raise ValueError(f"quantized_adam: mu and nu draw {streams[id(mu)]} and"
                     f" {pair}, not one stream's halves")
  return s
