"""Tests for jmp_lite.equinox: policies on Equinox models, unedited."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite
from tests.conftest import assert_dtype

pytest.importorskip("equinox")
import equinox as eqx  # noqa: E402

import jmp_lite.equinox as jeqx  # noqa: E402

BF16 = np.dtype(jnp.bfloat16)


def _dots(fn, *args):
  from tests.models.harness import matmul_dtypes
  return {d for _, d, _ in matmul_dtypes(jax.make_jaxpr(fn)(*args))}


class Encoder(eqx.Module):
  """A user's module with a method besides __call__ and a norm island."""

  proj: eqx.nn.Linear
  norm: eqx.nn.LayerNorm
  head: eqx.nn.Linear

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.proj = eqx.nn.Linear(4, 8, key=k1)
    self.norm = eqx.nn.LayerNorm(8)
    self.head = eqx.nn.Linear(8, 3, key=k2)

  def features(self, x):
    return self.norm(jax.nn.gelu(self.proj(x)))

  def __call__(self, x):
    return self.head(self.features(x))


def test_storage_islands_rules_and_outputs():
  model = jeqx.mixed_precision(Encoder(jax.random.key(0)),
                               "p=bf16,c=bf16,o=f32",
                               rules=[("head", "p=f32,c=f32,o=f32")])
  encoder: Any = model.module   # An Encoder, typed as eqx.Module.
  assert_dtype(encoder.proj.weight, jnp.bfloat16)
  assert_dtype(encoder.norm.weight, jnp.float32)  # Island.
  assert_dtype(encoder.head.weight, jnp.float32)  # Rule.
  x = jnp.ones(4)
  assert_dtype(model(x), jnp.float32)
  f32 = np.dtype(jnp.float32)
  assert _dots(model, x) == {(BF16, BF16), (f32, f32)}
  assert _dots(model.method("features"), x) == {(BF16, BF16)}
  assert_dtype(model.method("features")(x), jnp.float32)  # Root output dtype.
  report = jeqx.dtype_report(model, x)
  rows = {r.path: r for r in report.rows}
  assert rows["proj"].computed == "bfloat16"
  assert rows["head"].computed == "float32"
  assert rows["norm"].inputs == "float32" and rows["norm"].outputs == "bfloat16"
  assert not report.mismatches()


def test_transforms_grads_and_vmap():
  model = jeqx.mixed_precision(Encoder(jax.random.key(0)), "p=f32,c=bf16,o=f32")
  x = jnp.ones((5, 4))
  loss = lambda m, x: jax.vmap(m)(x).sum()
  grads = eqx.filter_jit(eqx.filter_grad(loss))(model, x)
  chex.assert_trees_all_equal_dtypes(eqx.filter(grads, eqx.is_array),
                                     eqx.filter(model, eqx.is_array))
  assert _dots(jax.grad(lambda x: loss(model, x)), x) == {(BF16, BF16)}
  # Eager and jitted runs round differently (XLA fuses; on a GPU the jitted
  # one keeps more in float32 and lands nearer the float32 model), so each
  # is held to the float32 model: within bf16 compute's error, a few
  # roundings at the outputs' scale (measured: eager 0.0046, CPU jit 0.0051,
  # H100 jit 0.0019 against a bound of 0.0068).
  reference = jax.vmap(Encoder(jax.random.key(0)))(x)
  bound = 2.0**-5 * float(jnp.max(jnp.abs(reference)))
  eager = jax.vmap(model)(x)
  for out in (eager, jax.jit(lambda x: jax.vmap(model)(x))(x)):
    assert float(jnp.max(jnp.abs(out - reference))) <= bound
  # Equinox's own vmap, eager too: the same rounding as jax.vmap's.
  chex.assert_trees_all_close(eqx.filter_vmap(model)(x), eager,
                              atol=4e-3, rtol=2 ** -7)


def test_o2_master_weights_keep_half_params_through_eqx_apply_updates():
  """Point 10: eqx.apply_updates must not turn half params into float32."""
  model = jeqx.mixed_precision(Encoder(jax.random.key(0)),
                               "p=bf16,c=bf16,o=f32")
  params, static = eqx.partition(model, eqx.is_array)
  opt = jmp_lite.master_weights(jmp_lite.loss_scaled(
      optax.adam(1e-2), jmp_lite.NoOpLossScale()))
  opt_state = opt.init(params)
  x, y = jnp.ones((6, 4)), jnp.zeros((6, 3))

  @eqx.filter_jit
  def step(params, opt_state):
    def loss(p):
      m = eqx.combine(p, static)
      return jnp.mean((jax.vmap(m)(x) - y) ** 2)
    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return eqx.apply_updates(params, updates), opt_state, value

  losses = []
  for _ in range(5):
    params, opt_state, value = step(params, opt_state)
    losses.append(float(value))
  chex.assert_trees_all_equal_dtypes(params, eqx.filter(model, eqx.is_array))
  assert losses[-1] < losses[0]
  master = jmp_lite.master_params(opt_state)
  chex.assert_trees_all_close(  # The master copy, within one rounding.
      jax.tree.map(lambda m, p: m.astype(jnp.float32), master, params),
      jax.tree.map(lambda p: p.astype(jnp.float32), params),
      rtol=2**-7, atol=2**-14)


def test_batch_norm_state_passes_through_in_float32():
  net, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(
      3, axis_name="batch", mode="batch")
  model = jeqx.mixed_precision(net, "p=f32,c=bf16,o=bf16")
  x = jnp.ones((4, 3)) * jnp.arange(4.0)[:, None]
  out, new_state = jax.vmap(model, axis_name="batch", in_axes=(0, None),
                            out_axes=(0, None))(x, state)
  assert_dtype(out, jnp.bfloat16)
  for leaf in jax.tree.leaves(new_state):
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      assert_dtype(leaf, jnp.float32)


def test_enabled_strict_and_bad_inputs():
  off = jeqx.mixed_precision(Encoder(jax.random.key(0)), "bf16", enabled=False)
  assert _dots(off, jnp.ones(4)) == {(np.dtype(jnp.float32),) * 2}
  with pytest.raises(ValueError,
                     match=r"matched no module: \[\"path 'decoder'"):
    jeqx.mixed_precision(Encoder(jax.random.key(0)), "bf16",
                         rules=[("decoder", "f32")], strict=True)
  with pytest.raises(TypeError, match=r"expects an equinox.Module instance"):
    jeqx.mixed_precision(lambda x: x, "bf16")  # pyright: ignore
  import flax.linen as nn
  with pytest.raises(TypeError, match=r"rule matcher Dense is not a subclass"
                     r" of equinox"):
    jeqx.mixed_precision(Encoder(jax.random.key(0)), "bf16",
                         rules=[(nn.Dense, "f32")])
  with pytest.raises(AttributeError, match="has no method 'decode'"):
    jeqx.mixed_precision(Encoder(jax.random.key(0)), "bf16").method("decode")
  rewrapped = jeqx.mixed_precision(
      jeqx.mixed_precision(Encoder(jax.random.key(0)), "bf16"), "f16")
  assert _dots(rewrapped, jnp.ones(4)) == {(np.dtype(jnp.float16),) * 2}


def test_layer_types_dispatch_as_unwrapped_sequential_with_batch_norm():
  """Model code that dispatches on layer classes takes the same branch."""
  key = jax.random.key(0)
  k1, k2 = jax.random.split(key)
  seq, state = eqx.nn.make_with_state(eqx.nn.Sequential)([
      eqx.nn.Linear(4, 8, key=k1),
      eqx.nn.BatchNorm(8, axis_name="batch", mode="batch"),
      eqx.nn.Lambda(jax.nn.relu),
      eqx.nn.Linear(8, 2, key=k2)])
  model = jeqx.mixed_precision(seq, "p=f32,c=bf16,o=f32")
  x = jax.random.normal(jax.random.key(1), (6, 4))
  run = lambda m, s: jax.vmap(m, axis_name="batch", in_axes=(0, None),
                              out_axes=(0, None))(x, s)
  out, new_state = run(model, state)
  reference, ref_state = run(seq, state)
  assert_dtype(out, jnp.float32)
  chex.assert_trees_all_close(out, reference, atol=0.05, rtol=0.05)
  # Batch statistics: float32, and equal to the float32 model's up to the
  # bf16 rounding of the first layer's output.
  chex.assert_trees_all_equal_dtypes(new_state, ref_state)
  chex.assert_trees_all_close(new_state, ref_state, atol=0.02, rtol=0.02)
  assert _dots(lambda s: run(model, s), state) == {(BF16, BF16)}

  class Net(eqx.Module):
    layers: list

    def __call__(self, x, *, key):
      for layer in self.layers:
        if isinstance(layer, eqx.nn.Dropout):
          key, sub = jax.random.split(key)
          x = layer(x, key=sub)
        else:
          x = layer(x)
      return x

  net = Net([eqx.nn.Linear(4, 8, key=k1), eqx.nn.Dropout(0.5), jax.nn.relu,
             eqx.nn.Linear(8, 2, key=k2)])
  wrapped = jeqx.mixed_precision(net, "p=f32,c=bf16,o=f32")
  drop_key = jax.random.key(2)
  chex.assert_trees_all_close(wrapped(x[0], key=drop_key),
                              net(x[0], key=drop_key), atol=0.05, rtol=0.05)


class _RNN(eqx.Module):
  """Scans a cell over a sequence, as Equinox's RNN examples do."""

  cell: Callable[..., Any]   # an eqx.Module: a cell
  hidden: int

  def __call__(self, xs):
    h0 = jnp.zeros(self.hidden)
    if isinstance(self.cell, eqx.nn.LSTMCell):
      h0 = (h0, h0)

    def step(h, x):
      h = self.cell(x, h)
      return h, (h[0] if isinstance(h, tuple) else h)

    return jax.lax.scan(step, h0, xs)


class _MyCell(eqx.Module):
  """A user's cell in Equinox's convention: cell(input, hidden) -> hidden."""

  proj: eqx.nn.Linear

  def __call__(self, x, h):
    return jnp.tanh(self.proj(x)) * 0.5 + h * 0.5


_CELLS = [("GRUCell", 8), ("GRUCell", 16), ("LSTMCell", 8), ("LSTMCell", 16),
          ("mine", 8)]


# Eagerly, every op of Equinox's cells compiles alone (5-9 s a case): the
# eager path is checked on the small cell by default, on all in CI's slow set.
@pytest.mark.parametrize("jit,cell,in_size", [
    *[pytest.param(False, cell, n, marks=[] if cell == "mine"
                   else [pytest.mark.slow]) for cell, n in _CELLS],
    *[(True, cell, n) for cell, n in _CELLS]])
def test_recurrent_cells_keep_their_hidden_dtype_in_a_scan(jit, cell,
                                                            in_size):
  key = jax.random.key(0)
  if cell == "mine":
    module = _MyCell(eqx.nn.Linear(in_size, 16, key=key))
  else:
    module = getattr(eqx.nn, cell)(in_size, 16, key=key)
  rnn = _RNN(module, 16)
  model = jeqx.mixed_precision(rnn, "p=f32,c=bf16,o=f32")
  xs = jax.random.normal(jax.random.key(1), (5, in_size))
  run = eqx.filter_jit(lambda m, xs: m(xs)) if jit else (lambda m, xs: m(xs))
  carry, ys = run(model, xs)
  # The unwrapped reference under jit (eagerly each op compiles alone); the
  # gradient through the wrapper runs as the forward pass does.
  ref_carry, ref_ys = eqx.filter_jit(rnn)(xs)
  chex.assert_trees_all_equal_dtypes(carry, ref_carry)
  assert_dtype(ys, jnp.float32)
  assert _dots(model, xs) == {(BF16, BF16)}
  chex.assert_trees_all_close(ys, ref_ys, atol=0.03, rtol=0.03)
  grad = eqx.filter_grad(lambda m: m(xs)[1].sum())
  grads = (eqx.filter_jit(grad) if jit else grad)(model)
  chex.assert_trees_all_equal_dtypes(eqx.filter(grads, eqx.is_array),
                                     eqx.filter(model, eqx.is_array))


def test_a_rules_output_dtype_holds_for_stateful_blocks_and_attention():
  """Neither ``(x, state) -> (y, state)`` nor ``mha(x, x, x)`` is a carry."""
  key = jax.random.key(0)

  class Block(eqx.Module):
    lin: eqx.nn.Linear
    bn: eqx.nn.BatchNorm

    def __init__(self, key):
      self.lin = eqx.nn.Linear(8, 8, key=key)
      self.bn = eqx.nn.BatchNorm(8, "batch", mode="batch")

    def __call__(self, x, state):
      return self.bn(self.lin(x), state)

  class Net(eqx.Module):
    stem: eqx.nn.Linear
    block: Block
    seen: list = eqx.field(static=True)

    def __init__(self, key):
      self.stem = eqx.nn.Linear(8, 8, key=key)
      self.block = Block(key)
      self.seen = []

    def __call__(self, x, state):
      y, state = self.block(self.stem(x), state)
      self.seen.append(y.dtype)
      return y, state

  net, state = eqx.nn.make_with_state(Net)(key)
  model = jeqx.mixed_precision(net, "p=f32,c=bf16,o=bf16",
                               rules=[("block", "p=f32,c=f32,o=f32")])
  jax.vmap(model, axis_name="batch", in_axes=(0, None),
           out_axes=(0, None))(jnp.ones((3, 8)), state)
  assert net.seen[-1] == np.dtype(jnp.float32)  # Not the stem's bfloat16.

  class Attend(eqx.Module):
    stem: eqx.nn.Linear
    attn: eqx.nn.MultiheadAttention
    seen: list = eqx.field(static=True)

    def __call__(self, x):
      y = jax.vmap(self.stem)(x)
      a = self.attn(y, y, y)
      self.seen.append(a.dtype)
      return a

  net = Attend(eqx.nn.Linear(8, 8, key=key),
               eqx.nn.MultiheadAttention(2, 8, key=key), [])
  model = jeqx.mixed_precision(net, "p=f32,c=bf16,o=bf16",
                               rules=[("attn", "p=f32,c=bf16,o=f32")])
  model(jnp.ones((5, 8)))
  assert net.seen[-1] == np.dtype(jnp.float32)


def test_report_rows_of_a_nested_policy_and_param_bytes():
  key = jax.random.key(0)

  class Outer(eqx.Module):
    a: eqx.nn.Linear
    b: Callable[..., Any]   # an eqx.Module: the inner policy
    noise_key: jax.Array

    def __call__(self, x):
      return self.b(self.a(x))

  inner = jeqx.mixed_precision(eqx.nn.Linear(4, 4, key=key), "f32")
  outer = jeqx.mixed_precision(Outer(eqx.nn.Linear(4, 4, key=key), inner,
                                     jax.random.key(1)),
                               "p=f32,c=bf16,o=f32")
  report = jeqx.dtype_report(outer, jnp.ones(4))
  rows = {r.path: r for r in report.rows}
  assert rows[""].computed == "-"
  assert rows["a"].computed == "bfloat16"
  assert rows["b"].computed == "float32"
  assert rows["b"].policy == "p=f32,c=f32,o=f32"
  assert not report.mismatches()
  assert rows["b"].param_bytes == rows["a"].param_bytes == 80
  assert report.total_param_bytes == 160  # Not the PRNG key.
  # The nested model still runs under its own policy outside reports.
  assert _dots(outer, jnp.ones(4)) == {(BF16, BF16),
                                       (np.dtype(jnp.float32),) * 2}


def test_a_rules_output_dtype_wins_over_the_cell_check_and_layers_pickle():
  """``film(cond, x)`` is shaped like a cell; its own rule still holds."""
  import pickle
  key = jax.random.key(0)

  class Film(eqx.Module):
    scale: eqx.nn.Linear

    def __call__(self, cond, x):
      return self.scale(cond) * x

  class Net(eqx.Module):
    stem: eqx.nn.Linear
    film: Film
    seq: eqx.nn.Sequential
    seen: list = eqx.field(static=True)

    def __call__(self, cond, x):
      y = self.film(cond, self.stem(x))
      self.seen.append((y.dtype, len(pickle.dumps(self.stem)) > 0))
      return self.seq[0](y) + sum(layer(y) for layer in self.seq)

  net = Net(eqx.nn.Linear(8, 8, key=key), Film(eqx.nn.Linear(3, 8, key=key)),
            eqx.nn.Sequential([eqx.nn.Linear(8, 2, key=key)]), [])
  model = jeqx.mixed_precision(net, "p=f32,c=bf16,o=bf16",
                               rules=[("film", "p=f32,c=f32,o=f32")])
  out = model(jnp.ones(3), jnp.ones(8))
  assert net.seen[-1] == (np.dtype(jnp.float32), True)
  assert_dtype(out, jnp.bfloat16)
