"""Property tests of the block-quantized state (hypothesis): the invariants
users rely on, over shapes, magnitudes and non-finite placements nobody
listed. Fast profile by default; a deeper one under ``slow``."""

from __future__ import annotations

from typing import Any

import chex
import hypothesis
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import strategies as st

import jmp_lite
from jmp_lite.low_precision._blockwise import (
  _blocks,
  dequantize,
  grid,
  POWERS,
  quantize,
)

_FAST = hypothesis.settings(max_examples=12, deadline=None, derandomize=True)
# Each example of a training property compiles its own step.
_FAST_STEPS = hypothesis.settings(max_examples=5, deadline=None,
                                  derandomize=True)
_DEEP = hypothesis.settings(max_examples=80, deadline=None)

_quantize = jax.jit(quantize, static_argnames=(
    "bits", "block_size", "signed", "power", "scale_dtype"))
_dequantize = jax.jit(dequantize)
_shapes = hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=70)


@st.composite
def _arrays(draw: Any) -> np.ndarray:
  """float32 arrays with magnitudes across float32's range, some exact
  zeros, and now and then one inf or NaN."""
  shape = draw(_shapes)
  exponent = draw(st.integers(-120, 120))
  spread = draw(st.integers(0, 20))
  rng = np.random.default_rng(draw(st.integers(0, 2**31)))
  x = rng.standard_normal(shape) * 10.0 ** rng.integers(
      -spread, spread + 1, shape).astype(np.float64)
  x = np.clip(x * 2.0**exponent, -3e38, 3e38).astype(np.float32)
  x[rng.random(shape) < 0.1] = 0.0
  if draw(st.booleans()):
    x.flat[draw(st.integers(0, x.size - 1))] = draw(
        st.sampled_from([np.inf, -np.inf, np.nan]))
  return x


def _check_round_trip(x: np.ndarray, bits: int, block_size: int,
                      signed: bool, stochastic: bool) -> None:
  if not signed:
    x = np.abs(x)
  power = POWERS[(bits, signed)]
  noise = (jax.random.uniform(jax.random.key(0), x.shape) if stochastic
           else None)
  # Jitted: one compile per example, not one per operation.
  q = _quantize(jnp.asarray(x), bits=bits, block_size=block_size,
                signed=signed, power=power, noise=noise)
  assert q.codes.dtype == jnp.uint8
  assert q.scales.shape == grid(x.shape, block_size)
  back = np.asarray(_dequantize(q))
  assert back.shape == x.shape and back.dtype == np.float32
  # Per block: the outlier is exact (inf and NaN too), nothing else is
  # non-finite unless it was, and every finite element is within one code
  # gap (in the companded domain) of itself, relative to the block's scale.
  scales = np.asarray(q.scales, np.float64)
  # As stored: one row of blocks per scale.
  xb = np.asarray(_blocks(jnp.asarray(x), block_size)).reshape(
      *scales.shape, -1)
  bb = np.asarray(_blocks(jnp.asarray(back), block_size)).reshape(
      *scales.shape, -1)
  where = np.asarray(q.where, np.int64)
  for g, c in np.ndindex(*scales.shape):
    xs, bs, s = xb[g, c], bb[g, c], scales[g, c]
    i = where[g, c]
    np.testing.assert_array_equal(bs[i], xs[i])
    rest = np.arange(xs.size) != i
    finite = rest & np.isfinite(xs)
    assert np.isfinite(bs[finite]).all()
    # Below float32's normal range XLA:CPU flushes to zero, on the way in
    # and out: such an element may come back as 0, and is checked no
    # further (the unsigned map's floor, squared, is one when the block's
    # largest is below about 1e-25).
    tiny = np.finfo(np.float32).tiny
    floor_v = ((1.0 / 2**bits) ** power * s) ** 2 if not signed else 0.0
    flushed = (bs == 0) & ((np.abs(xs) < 2 * tiny) | (floor_v < 2 * tiny))
    finite &= ~flushed
    if not finite.any() or s == 0:
      continue
    if signed:
      top = 2 ** (bits - 1) - 1
      unit_x = np.abs(xs[finite]) / s
      unit_b = np.abs(bs[finite]) / s
      gap = 1.0 / top
      # Signs survive wherever the code is not zero.
      nz = bs[finite] != 0
      assert (np.sign(bs[finite][nz]) == np.sign(xs[finite][nz])).all()
    else:
      # The unsigned map stores sqrt(v) with no zero: its floor is the
      # lowest code, (1 / 2**bits) ** power of the block's scale.
      levels = 2**bits
      unit_x = np.sqrt(xs[finite]) / s
      unit_b = np.sqrt(bs[finite]) / s
      gap = 1.0 / levels
      floor = (1.0 / levels) ** power
      unit_x = np.maximum(unit_x, floor)
    err = np.abs(unit_x ** (1 / power) - unit_b ** (1 / power))
    assert (err <= gap * (1 + 1e-5) + 1e-6).all(), (err.max(), gap)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("signed", [True, False])
@_FAST
@hypothesis.given(x=_arrays(), block=st.sampled_from([2, 16, 64, 256]),
                  stochastic=st.booleans())
def test_round_trip_within_a_code_of_every_element(bits, signed, x, block,
                                                   stochastic):
  _check_round_trip(x, bits, block, signed, stochastic)


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("signed", [True, False])
@_DEEP
@hypothesis.given(x=_arrays(), block=st.integers(1, 300).map(
    lambda b: b + b % 2), stochastic=st.booleans())
def test_round_trip_deep(bits, signed, x, block, stochastic):
  _check_round_trip(x, bits, block, signed, stochastic)


@st.composite
def _problems(draw: Any) -> tuple[dict[str, np.ndarray], list[Any]]:
  shape = draw(hnp.array_shapes(min_dims=1, max_dims=2, min_side=1,
                                max_side=40))
  rng = np.random.default_rng(draw(st.integers(0, 2**31)))
  params = {"w": rng.standard_normal(shape).astype(np.float32)}
  steps = []
  for _ in range(4):
    g = (rng.standard_normal(shape) * 10.0 ** draw(st.integers(-6, 3))
         ).astype(np.float32)
    if draw(st.integers(0, 3)) == 0:
      g.flat[draw(st.integers(0, g.size - 1))] = draw(
          st.sampled_from([np.nan, np.inf]))
    steps.append(g)
  return params, steps


def _skips_and_restores(problem: Any, bits: int, block: int) -> None:
  """A guard inside skips non-finite steps: the codes, scales, outliers and
  params are bit-identical to a run that never saw them; a state restored
  from its leaves (a checkpoint) continues exactly."""
  params, steps = problem
  opt = jmp_lite.quantized_states(
      jmp_lite.loss_scaled(optax.adam(1e-2), jmp_lite.NoOpLossScale()),
      bits=bits, block_size=block)

  @jax.jit  # Once per example: each run reuses the compiled step.
  def step(p: Any, s: Any, g: Any) -> tuple[Any, Any]:
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s

  def run(p: Any, state: Any, grads: list[Any]) -> tuple[Any, Any]:
    for g in grads:
      p, state = step(p, state, {"w": g})
    return p, state

  finite = [g for g in steps if np.isfinite(g).all()]
  p0 = jax.tree.map(jnp.asarray, params)
  with_bad = run(p0, opt.init(p0), steps)
  without = run(p0, opt.init(p0), finite)
  # The counters differ (skips are counted); params and codes do not.
  chex.assert_trees_all_equal(with_bad[0], without[0])
  q = lambda s: [x for x in jax.tree.leaves(s, is_leaf=lambda y: isinstance(
      y, jmp_lite.low_precision.QuantizedArray)) if isinstance(
          x, jmp_lite.low_precision.QuantizedArray)]
  chex.assert_trees_all_equal(q(with_bad[1]), q(without[1]))
  # A restore of the leaves into a fresh structure resumes exactly.
  half = run(p0, opt.init(p0), finite[:2])
  restored = jax.tree.unflatten(jax.tree.structure(half),
                                [np.asarray(x) for x in jax.tree.leaves(half)])
  chex.assert_trees_all_equal(run(*restored, finite[2:]),
                              run(*half, finite[2:]))


@_FAST_STEPS
@hypothesis.given(problem=_problems(), bits=st.sampled_from([8, 4]),
                  block=st.sampled_from([8, 32, 256]))
def test_skipped_steps_are_bit_identical_and_restores_resume(problem, bits,
                                                             block):
  _skips_and_restores(problem, bits, block)


@pytest.mark.slow
@hypothesis.settings(max_examples=20, deadline=None)
@hypothesis.given(problem=_problems(), bits=st.sampled_from([8, 4]),
                  block=st.integers(1, 300).map(lambda b: b + b % 2))
def test_skipped_steps_and_restores_deep(problem, bits, block):
  _skips_and_restores(problem, bits, block)
