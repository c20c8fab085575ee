"""quantized_states: optimizer state in 8 and 4 bits (issue 31)."""

from __future__ import annotations

import pickle
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite
from jmp_lite.low_precision import QuantizedArray, QuantizedStatesState
from jmp_lite.low_precision._blockwise import (
  _bfloat16_ceiling,
  _round_half_up,
)
from jmp_lite.low_precision._blockwise import POWERS as _POWERS
from jmp_lite.low_precision._quantized import (
  bytes_per_element,
  dequantize,
  quantize,
)
from tests.conftest import AUTO_KIND, run_multidevice

tree_bytes = jmp_lite.diagnostics.tree_bytes


def _params(dtype: Any = jnp.bfloat16) -> dict[str, jax.Array]:
  """Layers of a few thousand elements, and a last axis that is not a
  multiple of the block size (300 = 256 + 44: a partial last block)."""
  k1, k2 = jax.random.split(jax.random.key(0))
  return {"w1": (0.1 * jax.random.normal(k1, (24, 300))).astype(dtype),
          "b1": jnp.zeros(300, dtype),
          "w2": (0.1 * jax.random.normal(k2, (300, 16))).astype(dtype)}


def _grads(i: int, dtype: Any = jnp.bfloat16, bad: bool = False) -> Any:
  keys = jax.random.split(jax.random.key(100 + i), 3)
  g = {n: (jax.random.normal(k, p.shape) * 10.0 ** -(j + 1)).astype(dtype)
       for j, ((n, p), k) in enumerate(zip(_params().items(), keys,
                                           strict=True))}
  if bad:
    g["b1"] = g["b1"].at[3].set(jnp.nan)
  return g


def _quantized(state: Any) -> list[QuantizedArray]:
  return [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(
      x, QuantizedArray)) if isinstance(x, QuantizedArray)]


# ------------------------------------------------------------------ the maps


# Bounds on the round trip of 4096 elements, per (bits, signed): for the
# signed map, the L2 error relative to the data's; for the unsigned map, the
# largest error of sqrt(v) relative to the block's largest sqrt(v).
_BOUNDS = {(8, True): 0.01, (8, False): 0.02, (4, True): 0.15,
           (4, False): 0.2}


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("signed", [True, False])
def test_round_trip_error_per_map(bits, signed):
  key = jax.random.key(1)
  if signed:
    x = jax.random.normal(key, (16, 256)) * 1e-3
  else:   # Squared gradients: log-normal, many orders of magnitude.
    x = jnp.exp(2.0 * jax.random.normal(key, (16, 256))) * 1e-8
  q = quantize(x, bits=bits, block_size=256, signed=signed,
               power=_POWERS[(bits, signed)])
  back = dequantize(q)
  assert back.dtype == jnp.float32 and back.shape == x.shape
  if signed:
    err = float(jnp.linalg.norm(back - x) / jnp.linalg.norm(x))
  else:
    root, root_back = jnp.sqrt(x), jnp.sqrt(back)
    err = float(jnp.max(jnp.abs(root_back - root)
                        / jnp.max(root, axis=-1, keepdims=True)))
    # A positive second moment never comes back as 0 (Adam would divide by
    # eps alone).
    assert bool(jnp.all(back > 0))
  assert err <= _BOUNDS[(bits, signed)], err


def test_second_moment_is_never_zero_where_positive():
  v = jnp.array([[1.0, 1e-12, 1e-30, 0.0, 3e-5]])
  for bits in (8, 4):
    back = dequantize(quantize(v, bits=bits, block_size=4, signed=False,
                               power=_POWERS[(bits, False)]))
    assert bool(jnp.all(back[0, :3] > 0)) and float(back[0, 4]) > 0
  # A block of zeros stays zero (its scale is 0).
  zeros = quantize(jnp.zeros((2, 8)), bits=8, block_size=4, signed=False,
                   power=2.0)
  chex.assert_trees_all_equal(dequantize(zeros), jnp.zeros((2, 8)))


def test_signed_map_keeps_zero_and_signs_and_extremes():
  x = jnp.array([[-2.0, -1e-9, 0.0, 1e-9, 0.5, 2.0, 7.0]])
  for bits in (8, 4):
    back = dequantize(quantize(x, bits=bits, block_size=4, signed=True,
                               power=_POWERS[(bits, True)]))
    assert float(back[0, 2]) == 0.0
    # Each block's largest magnitude is exact.
    assert float(back[0, 0]) == -2.0 and float(back[0, 6]) == 7.0
    assert bool(jnp.all(jnp.sign(back) * jnp.sign(x) >= 0))


# Jitted for the layout tests: eagerly each op of the codec compiles alone for
# every shape (seconds per case); jit traces the same code.
_jit_quantize = jax.jit(quantize, static_argnames=(
    "bits", "block_size", "signed", "power", "scale_dtype"))
_jit_dequantize = jax.jit(dequantize)


@pytest.mark.parametrize("bits,shape,codes,scales", [
    (8, (3, 300), (3, 300), (3, 2)),    # partial last block
    (4, (3, 301), (3, 151), (3, 2)),    # two codes per byte, odd last axis
    (8, (5,), (5,), (1, 1)),
    (8, (40, 16), (40, 16), (3, 1)),    # 16 rows of 16 per block
    (4, (2, 2, 512), (2, 2, 256), (4, 2))])
def test_storage_layout(bits, shape, codes, scales):
  x = jax.random.normal(jax.random.key(2), shape)
  q = _jit_quantize(x, bits=bits, block_size=256, signed=True, power=2.0)
  assert q.codes.dtype == jnp.uint8 and q.codes.shape == codes
  assert q.scales.dtype == jnp.float32 and q.scales.shape == scales
  if shape[-1] >= 256:   # Rows at least a block long: each row alone.
    row = _jit_quantize(x[..., :1, :] if x.ndim > 1 else x, bits=bits,
                        block_size=256, signed=True, power=2.0)
    np.testing.assert_array_equal(
        _jit_dequantize(row),
        _jit_dequantize(q)[..., :1, :] if x.ndim > 1 else _jit_dequantize(q))
  # Half the widest gap of the power-2 map, of the largest magnitude.
  np.testing.assert_allclose(_jit_dequantize(q), x,
                             atol=float(jnp.abs(x).max())
                             * (0.14 if bits == 4 else 0.008))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("signed", [True, False])
def test_stochastic_codes_are_unbiased(bits, signed):
  # One block of values between codes, rounded 4096 times: the mean decoded
  # value is the value (mu), or its square root is (nu: what Adam divides
  # by); nearest-code rounding misses both by far more.
  x = jnp.linspace(0.05, 1.0, 64) ** 2
  x = x * jnp.where(jnp.arange(64) % 2, -1.0, 1.0) if signed else x
  draws = 4096
  noise = jax.random.uniform(jax.random.key(7), (draws, 64))
  power = _POWERS[(bits, signed)]
  one = lambda u: dequantize(quantize(x, bits=bits, block_size=64,
                                      signed=signed, power=power, noise=u))
  back = jax.vmap(one)(noise)
  target = x if signed else jnp.sqrt(x)
  mean = jnp.mean(back if signed else jnp.sqrt(back), axis=0)
  # Within 4 standard errors of a draw between two codes (gap < 0.3).
  np.testing.assert_allclose(mean, target, atol=4 * 0.15 / draws**0.5)
  nearest = dequantize(quantize(x, bits=bits, block_size=64, signed=signed,
                                power=power))
  near = nearest if signed else jnp.sqrt(nearest)
  assert float(jnp.max(jnp.abs(near - target))) > 4 * float(
      jnp.max(jnp.abs(mean - target)))
  # The block's largest value stays exact, whatever the draw.
  assert bool(jnp.all(back[:, -1] == back[0, -1]))
  np.testing.assert_allclose(back[0, -1], x[-1], rtol=1e-6)


def test_nearest_rounding_is_deterministic_and_has_no_stream():
  params = _params(jnp.float32)
  states = []
  for seed in (0, 1):
    opt = jmp_lite.quantized_states(optax.adam(1e-3), rounding="nearest",
                                    seed=seed)
    state = opt.init(params)
    update = jax.jit(opt.update)
    for i in range(3):
      state = update(_grads(i, jnp.float32), state, params)[1]
    states.append(_quantized(state))
  chex.assert_trees_all_equal(*states)
  # Stochastic codes depend on the seed, and the counter moves per step.
  sto = [jmp_lite.quantized_states(optax.adam(1e-3), seed=seed)
         for seed in (0, 1)]
  runs: list[Any] = [jax.jit(o.update)(_grads(0, jnp.float32),
                                      o.init(params), params)[1] for o in sto]
  assert int(runs[0].count) == 1 and int(runs[0].seed) == 0
  assert not np.array_equal(_quantized(runs[0])[0].codes,
                            _quantized(runs[1])[0].codes)


def test_bfloat16_scales():
  x = jax.random.normal(jax.random.key(3), (4, 256)) * 3.3
  q = quantize(x, bits=8, block_size=64, signed=True, power=2.0,
               scale_dtype=jnp.bfloat16)
  assert q.scales.dtype == jnp.bfloat16
  back = dequantize(q)
  # Scales round up, so nothing is clipped.
  assert float(jnp.linalg.norm(back - x) / jnp.linalg.norm(x)) < 0.01
  # Per block: a bfloat16 scale, the float32 outlier and its uint8 index.
  assert bytes_per_element(8, 64, jnp.bfloat16) == 1 + (2 + 4 + 1) / 64



@pytest.mark.parametrize("x", [
    0.0, 1.0, 1.0000001, 3.3, 1e-30, 3.3e38, 3.3895314e38, 3.39e38,
    float(np.finfo(np.float32).max)])
def test_bfloat16_scales_round_up_by_their_bits(x):
  # The scale is the least bfloat16 at or above the block's magnitude (up
  # to bfloat16's largest), computed from float32 bits: the kernel's
  # Triton lowering has no bfloat16 nextafter.
  x32 = np.float32(x)
  got = float(jax.jit(_bfloat16_ceiling)(x32))
  largest = float(jnp.finfo(jnp.bfloat16).max)
  grid_ = np.arange(0, 2**15, dtype=np.uint32) << 16
  values = grid_.view(np.float32)
  want = float(values[values >= x32].min()) if x32 <= largest else largest
  assert got == want
  assert float(jnp.asarray(got, jnp.bfloat16)) == got


def test_nearest_codes_round_halves_up_without_round():
  # floor(x + 0.5) would take 0.49999997 to 1; Triton has no round.
  x = np.array([0.49999997, 0.5, 1.5, 2.5, -0.5, -0.7, 254.49998, 254.5],
               np.float32)
  np.testing.assert_array_equal(
      np.asarray(jax.jit(_round_half_up)(x)),
      [0.0, 1.0, 2.0, 3.0, 0.0, -1.0, 254.0, 255.0])


# ----------------------------------------------------------- the transform


def test_state_layout_and_counts_untouched():
  opt = jmp_lite.quantized_states(optax.adam(1e-3), bits=4, block_size=128)
  state = opt.init(_params())
  assert isinstance(state, QuantizedStatesState)
  adam = state.inner_state[0]
  assert adam.count.dtype == jnp.int32 and adam.count.shape == ()
  assert isinstance(adam.mu["w1"], QuantizedArray)
  assert adam.mu["w1"].signed and not adam.nu["w1"].signed
  assert adam.mu["w1"].codes.shape == (24, 150)
  assert adam.mu["w1"].scales.shape == (24, 3)
  assert adam.nu["w2"].codes.shape == (300, 8)
  # The inner optimizer runs on float32 whatever the params' dtype.
  assert adam.mu["b1"].dtype == jnp.float32


def test_updates_follow_float32_adam():
  params = _params(jnp.float32)
  ref, opt = optax.adam(1e-3), jmp_lite.quantized_states(optax.adam(1e-3))
  ref_state, state = ref.init(params), opt.init(params)
  update = jax.jit(opt.update)
  u: Any = None
  ref_u: Any = None
  for i in range(20):
    g = _grads(i, jnp.float32)
    ref_u, ref_state = ref.update(g, ref_state, params)
    u, state = update(g, state, params)
    chex.assert_trees_all_equal_dtypes(u, ref_u)
  for name in params:
    err = jnp.linalg.norm(u[name] - ref_u[name]) / jnp.linalg.norm(
        ref_u[name])
    assert float(err) < 0.05, (name, float(err))


class _Linear(NamedTuple):
  weight: jax.Array
  bias: jax.Array


@pytest.mark.parametrize("kernel", ["xla", "cpu"])
def test_attribute_params_store_nu_unsigned(kernel):
  """Equinox-style params (attributes, not dict keys): Adam's ``nu`` took
  the signed map, read off the param's own attribute (``weight``), so a
  positive second moment could come back as 0."""
  params = _Linear(weight=jnp.ones((4, 256)), bias=jnp.ones(256))
  opt = jmp_lite.low_precision.quantized_adam(1e-3, kernel=kernel)
  state = opt.init(params)
  for _ in range(2):   # The kernels write the map init chose.
    adam = state.inner_state[0]
    assert not adam.nu.weight.signed and not adam.nu.bias.signed
    assert adam.mu.weight.signed
    _, state = jax.jit(opt.update)(params, state, params)


def test_python_scalar_params_step_eagerly():
  # Before: code_streams read the float's shape (AttributeError).
  params = {"w": jnp.ones((4, 64)), "t": 1.0}
  grads = {"w": jnp.full((4, 64), 0.1), "t": 0.5}
  opt = jmp_lite.quantized_states(optax.adam(1e-2), block_size=32)
  updates, _ = opt.update(grads, opt.init(params), params)
  assert np.isfinite(np.asarray(updates["w"])).all()


def test_a_param_named_nu_is_not_a_second_moment():
  opt = jmp_lite.quantized_states(optax.adam(1e-3))
  state: Any = opt.init({"nu": jnp.ones(8)})
  assert state.inner_state[0].mu["nu"].signed
  assert not state.inner_state[0].nu["nu"].signed


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(bits=3), ValueError, "bits must be 8 or 4, got 3"),
    (dict(bits=16), ValueError, "got 16"),
    (dict(bits=8.0), TypeError, "bits must be an int, got float: 8.0"),
    (dict(bits=True), TypeError, "bits must be an int"),
    (dict(block_size=0), ValueError, "block_size must be >= 1, got 0"),
    (dict(block_size=-4), ValueError, "got -4"),
    (dict(block_size=2.5), TypeError, "block_size must be an int.*2.5"),
    (dict(block_size="256"), TypeError, "'256'"),
    (dict(bits=4, block_size=255), ValueError, "must be even, got 255"),
    (dict(scale_dtype="float16"), ValueError, "float32 or bfloat16"),
    (dict(scale_dtype="int8"), ValueError, "int8"),
    (dict(unsigned="nu"), TypeError, "sequence of field names"),
    (dict(rounding="up"), ValueError, "'stochastic' or 'nearest', got 'up'"),
    (dict(seed=-1), ValueError, r"seed must be in \[0, 2\*\*32\), got -1"),
    (dict(seed=1.5), TypeError, "seed must be an int"),
])
def test_bad_input_names_the_value(kwargs, error, match):
  with pytest.raises(error, match=match):
    jmp_lite.quantized_states(optax.adam(1e-3), **kwargs)


@pytest.mark.parametrize("grads,match", [
    ({"w": jnp.ones((4, 9))}, r"gradient at \['w'\] has shape \(4, 9\),"
     r" its param \(4, 8\)"),
    ({"v": jnp.ones((4, 8))}, "the gradients' structure is not the params'")])
def test_gradients_that_do_not_fit_the_params_are_named(grads, match):
  params = {"w": jnp.ones((4, 8))}
  opt = jmp_lite.quantized_states(optax.adam(1e-3))
  with pytest.raises(ValueError, match=match):
    opt.update(grads, opt.init(params), params)


def test_specs_outside_shard_map_say_so():
  # An evaluation step under plain jit with the training optimizer.
  specs = {"w": jax.sharding.PartitionSpec("data")}
  params = {"w": jnp.ones((8, 256), jnp.bfloat16)}
  opt = jmp_lite.stochastic_rounding(
      jmp_lite.quantized_states(optax.adam(1e-3), specs=specs), specs=specs)
  with pytest.raises(ValueError, match="names the mesh axis 'data', which"
                     " is not bound here"):
    jax.jit(opt.update)(params, opt.init(params), params)


def test_a_non_transformation_inner_is_refused():
  with pytest.raises(TypeError, match="quantized_states expects an optax.*"
                     "'adam'"):
    jmp_lite.quantized_states("adam")  # pyright: ignore[reportArgumentType]


def test_another_wrappers_state_is_refused():
  opt = jmp_lite.quantized_states(optax.adam(1e-3))
  other = jmp_lite.state_dtypes(optax.adam(1e-3), "bf16")
  params = _params()
  with pytest.raises(TypeError, match="quantized_states"):
    opt.update(_grads(0), other.init(params), params)


# ------------------------------------------------------------- composition


def _compositions() -> dict[str, Any]:
  """Recipes on bfloat16 params, each with a loss_scaled guard inside."""
  qs, sr = jmp_lite.quantized_states, jmp_lite.stochastic_rounding
  scaled = lambda: jmp_lite.loss_scaled(
      optax.adam(1e-3), jmp_lite.DynamicLossScale(2.0**10))
  return {
      "sr-8": sr(qs(scaled(), bits=8), seed=0),
      "sr-4": sr(qs(scaled(), bits=4), seed=0),
      "kahan-8": jmp_lite.kahan_summation(qs(scaled())),
      "sr-8-state-dtypes": sr(qs(jmp_lite.state_dtypes(scaled(), "bf16"))),
      "state-dtypes-sr-8": sr(jmp_lite.state_dtypes(
          qs(scaled(), scale_dtype="bf16"), "bf16", rounding="stochastic")),
      "master-8": jmp_lite.master_weights(qs(scaled())),
      "sr-8-bf16-scales": sr(qs(scaled(), scale_dtype="bfloat16")),
  }


def _held(state: Any) -> Any:
  """What a skipped step must leave bit-identical: the quantized leaves and
  the random streams' counters."""
  lp = jmp_lite.low_precision
  kinds = (lp.KahanState, lp.StochasticRoundingState, lp.StateDtypesState)
  nodes = [n for k in kinds for n in jmp_lite.struct.find_nodes(state, k)]
  return (_quantized(state), [getattr(n, "count", None) for n in nodes],
          [n.compensation for n in jmp_lite.struct.find_nodes(
              state, lp.KahanState)])


def _jitted(opt: Any, how: str) -> Any:
  def step(params, state, grads):
    if how == "update_and_apply":
      return jmp_lite.update_and_apply(opt, grads, state, params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return jax.jit(step, donate_argnums=(0, 1))


@pytest.mark.parametrize("name", list(_compositions()))
@pytest.mark.parametrize("how", ["update", "update_and_apply"])
def test_skipped_step_is_bit_identical(name, how):
  opt = _compositions()[name]
  if how == "update_and_apply":
    # One lax.cond around the whole step (on the CPU): the guard inside is
    # decided from the gradients, through every wrapper's declaration.
    assert jmp_lite.step.formulation(opt, jnp.bfloat16)[0] == AUTO_KIND
  step = _jitted(opt, how)
  params = _params()
  state = opt.init(params)
  for i in range(3):
    params, state = step(params, state, _grads(i))
  assert _quantized(state)
  before = jax.device_get((params, _held(state)))
  params, state = step(params, state, _grads(99, bad=True))
  # (Only the loss scale and the skip counters move.)
  chex.assert_trees_all_equal((params, _held(state)), before)
  assert int(jmp_lite.loss_scaled_state(state).total_skips) == 1
  # And training goes on from there.
  params, state = step(params, state, _grads(4))
  assert not np.array_equal(np.asarray(params["w1"], np.float32),
                            np.asarray(before[0]["w1"], np.float32))
  chex.assert_trees_all_equal_dtypes(params, _params())


def test_loss_scaled_outside_accepts_the_quantized_state():
  # The codes and bfloat16 scales are narrow by design: loss_scaled's check
  # for half moments leaves them be, and still sees inner's own leaves.
  inner = jmp_lite.quantized_states(optax.adam(1e-3), scale_dtype="bf16")
  opt = jmp_lite.loss_scaled(inner, jmp_lite.StaticLossScale(2.0**8))
  state: Any = opt.init(_params(jnp.float32))
  held = jmp_lite.contract.without_half_by_design(inner, state.inner_state)
  assert not _quantized(held)
  with pytest.raises(TypeError, match="half-precision leaves"):
    # A scalar param's moment is not quantized: bfloat16 by inner's choice.
    jmp_lite.loss_scaled(jmp_lite.quantized_states(
        optax.adam(1e-3, mu_dtype=jnp.bfloat16)),
        jmp_lite.StaticLossScale(2.0)).init({"w": jnp.ones(())})
  params = _params(jnp.float32)
  grads = jax.tree.map(lambda g: g * 2.0**8, _grads(0, jnp.float32))
  params, state = jmp_lite.update_and_apply(opt, grads, state, params)
  assert all(bool(jnp.isfinite(p).all()) for p in jax.tree.leaves(params))


def test_accumulate_gradients_outside_steps_and_inside_is_refused():
  qs = jmp_lite.quantized_states
  inside = jmp_lite.stochastic_rounding(qs(jmp_lite.accumulate_gradients(
      optax.adam(1e-3), every_k=2)))
  with pytest.raises(ValueError, match="Accumulate outside"):
    inside.init(_params())
  opt = jmp_lite.accumulate_gradients(jmp_lite.stochastic_rounding(
      qs(optax.adam(1e-3))), every_k=2)
  step = _jitted(opt, "update")
  params = _params()
  state = opt.init(params)
  params, state = step(params, state, _grads(0))
  before = jax.device_get((params, _quantized(state)))
  # The first micro-batch applies nothing: params and codes stay.
  chex.assert_trees_all_equal((params, _quantized(state)), before)
  params, state = step(params, state, _grads(1))
  assert not np.array_equal(np.asarray(params["w1"], np.float32),
                            np.asarray(before[0]["w1"], np.float32))


# ------------------------------------------------- jit, pytrees, checkpoints


def test_jit_with_donation_never_recompiles():
  opt = _compositions()["sr-8"]
  chex.clear_trace_counter()

  @chex.assert_max_traces(n=1)
  def step(params, state, grads):
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(step, donate_argnums=(0, 1))
  params = _params()
  state = opt.init(params)
  for i in range(4):   # Warnings are errors: an unusable donation would fail.
    params, state = step(params, state, _grads(i))
  params, state = step(params, state, _grads(5, bad=True))


def test_state_round_trips_through_pytree_tools_and_pickle():
  opt = _compositions()["sr-4"]
  params = _params()
  state = opt.init(params)
  state = opt.update(_grads(0), state, params)[1]
  chex.assert_trees_all_equal(jax.tree.map(lambda x: x, state), state)
  chex.assert_trees_all_equal(pickle.loads(pickle.dumps(state)), state)
  shapes = jax.eval_shape(opt.init, params)
  chex.assert_trees_all_equal_shapes_and_dtypes(shapes, state)
  assert jax.tree.structure(shapes) == jax.tree.structure(state)
  lowered = jax.jit(opt.update).lower(_grads(0), state, params)
  assert "xui8>" in lowered.as_text()   # the codes, as uint8
  # Static config lives in the treedef: no config leaf to lose.
  q = _quantized(state)[0]
  leaves = jax.tree.leaves(q)
  # codes, scales, outliers, their indices, and the form the codes were
  # written in (data, so a checkpoint keeps it).
  assert [x.dtype for x in leaves] == [jnp.uint8, jnp.float32, jnp.float32,
                                       jnp.uint8, jnp.int32]
  restored = jax.tree.unflatten(jax.tree.structure(state),
                                [np.asarray(x) for x in jax.tree.leaves(
                                    state)])
  updates, _ = jax.jit(opt.update)(_grads(1), restored, params)
  chex.assert_trees_all_equal(
      updates, jax.jit(opt.update)(_grads(1), state, params)[0])


@pytest.mark.parametrize("name", ["sr-8", "sr-4"])
def test_orbax_save_restore_resume_is_bit_identical(tmp_path, name):
  import orbax.checkpoint as ocp

  # A fresh optimizer for each run: the donated step must own its buffers.
  step = _jitted(_compositions()[name], "update")
  n, cut = 8, 3

  def run(params, state, lo, hi):
    for i in range(lo, hi):   # A NaN batch in each half: skips resume too.
      params, state = step(params, state, _grads(i, bad=i in (1, 5)))
    return params, state

  opt = _compositions()[name]
  full = jax.device_get(run(_params(), opt.init(_params()), 0, n))
  half = run(_params(), opt.init(_params()), 0, cut)
  path = tmp_path / "ckpt"
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, half)
    ckptr.wait_until_finished()
    # A fresh process knows only the structure.
    restored = ckptr.restore(path, (_params(), opt.init(_params())))
  chex.assert_trees_all_equal(restored, jax.device_get(half))
  assert _quantized(restored[1])[0].codes.dtype == jnp.uint8
  # The codes' random stream continues: the resumed run equals the full one.
  params, state = restored
  chex.assert_trees_all_equal(jax.device_get(run(params, state, cut, n)),
                              full)


# ------------------------------------------------------------------- bytes


# Per block of 256: a float32 scale, the float32 outlier and its uint8 index
# (0.035 bytes per element and moment; more in these small layers' partial
# blocks).
@pytest.mark.parametrize("bits,limit", [(8, 4.12), (4, 3.12)])
def test_bytes_per_parameter(bits, limit):
  opt = jmp_lite.stochastic_rounding(jmp_lite.quantized_states(
      jmp_lite.loss_scaled(optax.adam(1e-3), jmp_lite.NoOpLossScale()),
      bits=bits), seed=0)
  params = _params()
  n = sum(p.size for p in jax.tree.leaves(params))
  params, state = _jitted(opt, "update")(params, opt.init(params), _grads(0))
  per_param = tree_bytes((params, state)) / n
  assert per_param <= limit, per_param
  assert tree_bytes(params) / n == 2.0
  moments = sum(tree_bytes(q.codes) for q in _quantized(state)) / n
  assert moments == bits / 4


# --------------------------------------------------------------- sharding


def test_blocks_follow_the_last_axis():
  """A block never crosses rows of the last axis (nor groups of
  ``block_size // n`` rows of a shorter one), so a param sharded along its
  leading axes is quantized shard by shard exactly as whole: under
  ``shard_map`` no specs are needed."""
  opt = _compositions()["sr-8"]
  k1, k2 = jax.random.split(jax.random.key(5))
  params = {"w1": jax.random.normal(k1, (24, 300), jnp.bfloat16),
            "w2": jax.random.normal(k2, (288, 16), jnp.bfloat16)}
  grads = jax.tree.map(lambda p: (p * 1e-2).astype(p.dtype), params)
  first = lambda t: jax.tree.map(lambda x: x[: x.shape[0] // 2], t)
  update = jax.jit(opt.update)
  whole = update(grads, opt.init(params), params)[1]
  part = update(first(grads), opt.init(first(params)), first(params))[1]
  for qw, qp in zip(_quantized(whole), _quantized(part), strict=True):
    rows = qp.codes.shape[0]
    np.testing.assert_array_equal(qw.codes[:rows], qp.codes)
    np.testing.assert_array_equal(qw.scales[:qp.scales.shape[0]], qp.scales)


def test_max_reduction_stats_survive_a_recomputed_moment():
  """The fused kernel's max/min reductions, in a program where XLA
  computes the new moment once for the block's top and again for the match
  (at the suite's optimisation level 0 the two differ by an ulp, and no
  element equalled the top: the index ran past the block and the gathered
  outlier was NaN). The outlier must stay in the block and finite."""
  from jmp_lite.low_precision import _blockwise as bw
  from jmp_lite.low_precision._block_stats import outlier_and_scale_max
  rng = np.random.default_rng(0)
  old = bw.quantize(jnp.asarray(rng.standard_normal((256, 512)) * 1e-3),
                    bits=8, block_size=256, signed=True, power=2.0)
  grads = jnp.asarray(rng.standard_normal((256, 512)) * 1e-2, jnp.bfloat16)

  @jax.jit
  def encode(q, g):
    m = 0.9 * bw.dequantize(q) + 0.1 * g.astype(jnp.float32)
    return bw.encode_blocks(bw._blocks(m, 256), None, bits=8, signed=True,
                            power=2.0, stats=outlier_and_scale_max)

  _, scales, outliers, where = encode(old, grads)
  assert int(where.max()) < 256
  assert np.isfinite(np.asarray(outliers)).all()
  exact = np.asarray(bw._blocks(
      0.9 * bw.dequantize(old) + 0.1 * grads.astype(jnp.float32), 256))
  # The kept element is the block's largest (to within the recomputation's
  # ulp), and the scale is the largest of the others.
  top = np.abs(exact).max(-1)
  np.testing.assert_allclose(np.abs(np.asarray(outliers)), top, rtol=1e-6)
  np.testing.assert_array_less(np.asarray(scales), top * (1 + 1e-6))


# ---------------------------------------------------------------- fidelity


@pytest.fixture(scope="module", params=["digits", "char_lm"])
def fidelity_task(request, optimized_codegen):
  """(name, train with ``FIDELITY_SETTINGS``, float32 Adam's result)."""
  pytest.importorskip("sklearn")
  import functools

  from jmp_lite import examples
  from tests.conftest import FIDELITY_SETTINGS
  train = functools.partial({"digits": examples.train_digits,
                             "char_lm": examples.train_char_lm}[request.param],
                            **FIDELITY_SETTINGS)
  return request.param, train, train("f32")


@pytest.mark.slow
@pytest.mark.parametrize("bits,tolerance", [(8, 1.02), (4, 1.05)])
@pytest.mark.parametrize("params", ["f32", "bf16"])
def test_fidelity_against_float32_adam(fidelity_task, bits, tolerance,
                                       params):
  task_name, train, ref = fidelity_task

  def build(adam, loss_scale):
    opt = jmp_lite.quantized_states(jmp_lite.loss_scaled(adam, loss_scale),
                                    bits=bits)
    return jmp_lite.stochastic_rounding(opt) if params == "bf16" else opt

  result = train(params, optimizer=build)
  print(f"\nfidelity {task_name} {bits}-bit states, {params} params: eval"
        f" loss {result.eval_loss:.4f} ({result.eval_loss / ref.eval_loss:.3f}x"
        f" float32 {ref.eval_loss:.4f})")
  assert result.skipped == 0
  # Two-sided: a run far *below* float32 Adam would mean the quantized
  # moments changed the trajectory (nearest-code rounding did: 4-bit states
  # ended at 0.67x on the digits), not that they are more exact.
  assert (2 - tolerance) * ref.eval_loss <= result.eval_loss <= (
      tolerance * ref.eval_loss), (
      task_name, bits, params, result.eval_loss, ref.eval_loss)
  n_params = ref.param_bytes / 4
  # Moments: bits / 4 bytes per parameter, plus the blocks' scales.
  assert result.state_bytes / n_params <= bits / 4 + 0.1


def test_sharded_codes_equal_the_unsharded_run():
  """Params split by rows on 4 devices, stepped under ``jax.shard_map``
  with ``specs=`` and under ``jax.jit`` with sharded inputs: params, codes
  and scales, gathered, equal the unsharded run's bit for bit at 8 and 4
  bits; without specs the shards repeat shard 0's bits. Under explicit
  mesh axes (``jax.set_mesh``), params split along rows, columns, a 1-D
  bias and a 3-D weight's middle axis: the same equality, and the codes
  keep the params' shardings (``quantized_adam``'s default kernel takes
  the XLA path there)."""
  proc = run_multidevice("multidevice/quantized_sharded.py", 4)
  assert proc.stdout.splitlines() == [
      "ok shard_map 8 bits equals unsharded",
      "ok jit with sharded params 8 bits equals unsharded",
      "ok shard_map 4 bits equals unsharded",
      "ok jit with sharded params 4 bits equals unsharded",
      "ok shard_map 8 bits without specs differs",
      *(f"ok explicit axes {name} {bits} bits equals unsharded, codes"
        " sharded like the params" for bits in (8, 4)
        for name in ("quantized_states", "quantized_adam")),
      "ok preset O3 8 bits with specs equals unsharded",
  ], proc.stdout + proc.stderr


@pytest.mark.parametrize("kernel", [None, "xla", "interpret"])
def test_nnx_params_store_second_moments_unsigned(kernel):
  # nnx hands the optimizer its params inside Variables: nu must still be
  # found by its field (the signed map decoded 109 of 256 positive nu as 0),
  # and the updates come back in the gradients' structure.
  from flax import nnx

  from jmp_lite.low_precision import quantized_adam
  params = nnx.state(nnx.Linear(1, 256, rngs=nnx.Rngs(0)), nnx.Param)
  grads = jax.tree.map(
      lambda x: jnp.broadcast_to(jnp.logspace(-4, 0, 256), x.shape), params)
  opt = (jmp_lite.quantized_states(optax.adam(1e-3)) if kernel is None
         else quantized_adam(1e-3, kernel=kernel))
  new_params, state = jax.jit(lambda s: jmp_lite.update_and_apply(
      opt, grads, s, params))(opt.init(params))
  assert jax.tree.structure(new_params) == jax.tree.structure(params)
  nu = state.inner_state[0].nu["kernel"]
  assert isinstance(nu, QuantizedArray)
  assert not nu.signed and state.inner_state[0].mu["kernel"].signed
  assert bool((dequantize(nu) > 0).all())


@pytest.mark.parametrize("make", ["quantized_states", "quantized_adam"])
def test_nnx_optimizer_steps_under_nnx_jit(make):
  # nnx.Optimizer writes the new state back with nnx.update: a
  # QuantizedArray held in a Variable came back as a State of its fields
  # on the second step, which the next update refused.
  from flax import nnx

  from jmp_lite.low_precision import quantized_adam
  model = nnx.Linear(4, 300, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
  inner = (jmp_lite.quantized_states(optax.adam(1e-2))
           if make == "quantized_states" else quantized_adam(1e-2))
  opt = nnx.Optimizer(model, jmp_lite.stochastic_rounding(inner),
                      wrt=nnx.Param)
  x = jnp.linspace(-1, 1, 8).reshape(2, 4)

  @nnx.jit
  def step(model, opt):
    loss, grads = nnx.value_and_grad(
        lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2))(model)
    opt.update(model, grads)
    return loss

  losses = [float(step(model, opt)) for _ in range(4)]
  assert losses[-1] < losses[0]
  assert model.kernel[...].dtype == jnp.bfloat16
  mu = opt.opt_state.inner_state.inner_state[0].mu["kernel"]
  assert isinstance(mu, QuantizedArray) and mu.bits == 8
  assert mu.codes[...].dtype == jnp.uint8


@pytest.mark.parametrize("bits", [8, 4])
def test_jitted_init_quantizes_at_run_time_not_by_constant_folding(bits):
  # Adam's zero moments do not depend on the params' values, so XLA
  # constant-folded their quantization (its block reduction) on its slow
  # evaluator: jit(init) of 5M params took 73 s to compile. The compiled
  # init must still compute the blocks' statistics.
  params = {"w": jnp.ones((64, 512), jnp.bfloat16)}
  opt = jmp_lite.quantized_states(optax.adam(1e-3), bits=bits)
  hlo = jax.jit(opt.init).lower(params).compile().as_text()
  assert " reduce(" in hlo, hlo[:2000]
  chex.assert_trees_all_equal(jax.jit(opt.init)(params), opt.init(params))
