"""Tests for jmp_lite.nnx: policies on flax.nnx models."""

from __future__ import annotations

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_lite
import jmp_lite.nnx as jnnx
from tests.conftest import assert_dtype
from tests.models.nnx_models import StatefulBlock


class Net(nnx.Module):
  def __init__(self, rngs):
    self.conv = nnx.Conv(3, 8, (3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(8, rngs=rngs)
    self.drop = nnx.Dropout(0.1, rngs=rngs)
    self.mlp = nnx.Sequential(nnx.Linear(8, 16, rngs=rngs), nnx.gelu,
                              nnx.Linear(16, 8, rngs=rngs))
    self.ln = nnx.LayerNorm(8, rngs=rngs)
    self.head = nnx.Linear(8, 10, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.bn(self.conv(x)))
    x = self.drop(x.mean(axis=(1, 2)))
    x = self.ln(x + self.mlp(x))
    return self.head(x)


def _x():
  return jnp.asarray(np.random.default_rng(0).standard_normal((4, 6, 6, 3)),
                     jnp.float32)


def _value(var):
  return var.get_value()


def test_params_stored_per_rule_and_original_untouched():
  model = Net(nnx.Rngs(0))
  half = jnnx.mixed_precision(model, "p=bf16,c=bf16,o=f32")
  assert_dtype(_value(half.conv.kernel), jnp.bfloat16)
  assert_dtype(_value(half.mlp.layers[0].kernel), jnp.bfloat16)
  assert_dtype(_value(half.bn.scale), jnp.float32)      # Norm islands.
  assert_dtype(_value(half.ln.scale), jnp.float32)
  assert_dtype(_value(half.bn.mean), jnp.float32)       # Batch stats.
  assert_dtype(_value(model.conv.kernel), jnp.float32)  # Original untouched.
  assert type(model.conv) is nnx.Conv


def test_hlo_dtypes_batch_stats_and_grads():
  half = jnnx.mixed_precision(Net(nnx.Rngs(0)), "p=f32,c=bf16,o=f32")
  x = _x()
  out = half(x)
  assert_dtype(out, jnp.float32)
  assert_dtype(_value(half.bn.mean), jnp.float32)  # Updated, still float32.
  graphdef, state = nnx.split(half)

  def f(state, x):
    return nnx.merge(graphdef, state)(x)

  text = jax.jit(f).lower(state, x).as_text()
  lines = text.splitlines()
  convs = [line for line in lines if "stablehlo.convolution" in line]
  dots = [line for line in lines if "stablehlo.dot_general" in line]
  assert len(convs) == 1 and len(dots) == 3
  for op in convs + dots:
    assert re.search(r"\(tensor<[^>]*bf16>, tensor<[^>]*bf16>\)", op), op

  half.eval()

  def loss(model, x):
    return model(x).sum()

  grads = nnx.grad(loss)(half, x)
  for g in jax.tree.leaves(nnx.state(grads, nnx.Param)):
    assert_dtype(g, jnp.float32)
  # A jitted nnx step works too, and keeps the stored dtypes.
  step = nnx.jit(lambda m, x: m(x))
  assert_dtype(step(half, x), jnp.float32)
  assert_dtype(_value(half.conv.kernel), jnp.float32)


def test_rules_enabled_and_strict():
  model = Net(nnx.Rngs(0))
  ruled = jnnx.mixed_precision(model, "p=bf16,c=bf16,o=f32",
                               rules=[("head", "f32"),
                                      (nnx.Sequential, "p=f16,c=f16")])
  assert_dtype(_value(ruled.head.kernel), jnp.float32)
  assert_dtype(_value(ruled.mlp.layers[2].kernel), jnp.float16)  # Inherited.
  assert_dtype(ruled(_x()), jnp.float32)
  off = jnnx.mixed_precision(model, "bf16", enabled=False)
  for leaf in jax.tree.leaves(nnx.state(off)):
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      assert_dtype(leaf, jnp.float32)
  with pytest.raises(ValueError,
                     match=r"matched no module: \[\"path 'decoder'"):
    jnnx.mixed_precision(model, "bf16", rules=[("decoder", "f32")], strict=True)
  with pytest.raises(TypeError, match="expects a flax.nnx.Module"):
    jnnx.mixed_precision(lambda x: x, "bf16")
  twice = jnnx.mixed_precision(ruled, "p=bf16,c=bf16,o=f32")
  assert_dtype(twice(_x()), jnp.float32)


def test_trains_with_master_weights_and_loss_scaling():
  model = jnnx.mixed_precision(Net(nnx.Rngs(0)), "p=bf16,c=bf16,o=f32")
  model.eval()
  x = _x()
  y = jnp.arange(4) % 10
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  opt = jmp_lite.master_weights(jmp_lite.loss_scaled(
      optax.adam(1e-2), jmp_lite.DynamicLossScale(2.0**10)))
  opt_state = opt.init(params)

  @jax.jit
  def step(params, opt_state):
    scale = jmp_lite.current_loss_scale(opt_state)

    def loss_fn(p):
      logits = nnx.merge(graphdef, p, rest)(x)
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
      return scale.scale(loss), loss

    grads, loss = jax.grad(loss_fn, has_aux=True)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  for _ in range(20):
    params, opt_state, loss = step(params, opt_state)
    losses.append(float(loss))
  assert losses[-1] < 0.5 * losses[0], losses
  assert_dtype(params["conv"]["kernel"][...], jnp.bfloat16)


# -- Issue 9: nnx models as users write them ---------------------------------

def _dot_conv_dtypes(fn, *args):
  from tests.models.harness import matmul_dtypes
  return {d for _, d, _ in matmul_dtypes(jax.make_jaxpr(fn)(*args))}


class DropoutAtCall(nnx.Module):
  """The nnx MNIST tutorial's way: Rngs handed to each call."""

  def __init__(self, rngs):
    self.lin = nnx.Linear(6, 6, dtype=jnp.float32, rngs=rngs)
    self.drop = nnx.Dropout(0.5)

  def __call__(self, x, rngs: nnx.Rngs):
    return self.drop(self.lin(x), rngs=rngs)


@pytest.mark.parametrize("enabled", [True, False])
def test_rngs_at_call_time_are_the_callers_own(enabled):
  """Points 3 and 4: typed keys pass, the caller's Rngs advances."""
  model = jnnx.mixed_precision(DropoutAtCall(nnx.Rngs(0)),
                               "p=f32,c=bf16,o=f32", enabled=enabled)
  rngs = nnx.Rngs(dropout=1)
  x = jnp.ones((4, 6))
  first, second = model(x, rngs), model(x, rngs)
  assert int(rngs.dropout.count[...]) == 2
  assert bool((first != second).any())  # Fresh masks, not repeated ones.
  assert_dtype(first, jnp.float32)
  key = jax.random.key(0)
  assert jmp_lite.get_policy("bf16").cast_to_compute(key) is key
  assert jmp_lite.cast_by_path({"k": key}, "bf16")["k"] is key
  assert bool(jmp_lite.all_finite({"k": key, "x": x}))


class Tied(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(20, 8, dtype=jnp.float32, rngs=rngs)
    self.norm = nnx.LayerNorm(8, rngs=rngs)
    self.proj = nnx.Linear(8, 8, rngs=rngs)

  def encode(self, tokens):
    x = self.embed(tokens)
    return x + self.proj(self.norm(x))

  def __call__(self, tokens):
    return self.embed.attend(self.encode(tokens))


def test_every_method_runs_under_the_policy():
  """Point 5: Embed.attend and the model's own encode, not only __call__."""
  model = jnnx.mixed_precision(Tied(nnx.Rngs(0)), "p=f32,c=bf16,o=f32")
  tokens = jnp.arange(6).reshape(2, 3)
  bf16 = (np.dtype(jnp.bfloat16),) * 2
  assert _dot_conv_dtypes(lambda t: model(t), tokens) == {bf16}
  assert _dot_conv_dtypes(lambda t: model.encode(t), tokens) == {bf16}
  assert_dtype(model.encode(tokens), jnp.float32)  # The root's output dtype.
  assert_dtype(model(tokens), jnp.float32)
  report = jnnx.dtype_report(model, tokens)
  rows = {r.path: r for r in report.rows}
  assert rows["embed"].computed == "bfloat16"  # attend, in bf16.
  assert rows["norm"].inputs == "float32" and rows["norm"].outputs == "bfloat16"
  assert not report.mismatches()
  with pytest.raises(AttributeError, match="has no attribute 'decode'"):
    model.decode(tokens)


def test_plain_jax_transforms_pickle_and_report():
  """Point 6: plain jit/make_jaxpr/eval_shape closures, pickling, the report."""
  import pickle
  model = jnnx.mixed_precision(Tied(nnx.Rngs(0)), "p=bf16,c=bf16,o=f32")
  tokens = jnp.arange(6).reshape(2, 3)
  expected = model(tokens)
  chex.assert_trees_all_close(jax.jit(lambda t: model(t))(tokens), expected,
                              atol=1e-2)
  assert jax.eval_shape(lambda t: model(t), tokens).dtype == jnp.float32
  jax.make_jaxpr(lambda t: model.encode(t))(tokens)
  restored = pickle.loads(pickle.dumps(model))
  chex.assert_trees_all_equal(restored(tokens), expected)
  assert restored.wrapped_class is Tied and not isinstance(restored, Tied)
  # Applying the policy mutated nothing: every stored dtype as it was.
  assert_dtype(_value(model.proj.kernel), jnp.bfloat16)
  assert_dtype(_value(model.norm.scale), jnp.float32)
  # State layout is the bare model's.
  bare = nnx.state(Tied(nnx.Rngs(0)), nnx.Param)
  assert (jax.tree.structure(nnx.state(model, nnx.Param))
          == jax.tree.structure(bare))


def test_batch_stats_written_back_in_their_dtype():
  model = jnnx.mixed_precision(Net(nnx.Rngs(0)), "p=bf16,c=bf16,o=f32",
                               float32_norms=False)
  before = _value(model.bn.mean)
  model(_x())
  after = _value(model.bn.mean)
  assert_dtype(after, jnp.float32)  # Stored float32, though bn ran in bf16.
  assert not np.allclose(before, after)
  # Nothing changed, nothing written: the same array object.
  model.eval()
  kernel = _value(model.conv.kernel)
  model(_x())
  assert _value(model.conv.kernel) is kernel


def test_nested_policy_and_bad_inputs():
  inner = jnnx.mixed_precision(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), "f16")

  class Outer(nnx.Module):
    def __init__(self):
      self.inner = inner
      self.head = nnx.Linear(4, 2, rngs=nnx.Rngs(1))

    def __call__(self, x):
      return self.head(self.inner(x))

  outer = jnnx.mixed_precision(Outer(), "p=f32,c=bf16,o=f32")
  x = jnp.ones((1, 4))
  f16, bf16 = (np.dtype(jnp.float16),) * 2, (np.dtype(jnp.bfloat16),) * 2
  assert _dot_conv_dtypes(lambda x: outer(x), x) == {f16, bf16}
  assert_dtype(_value(outer.inner.kernel), jnp.float16)
  with pytest.raises(TypeError, match=r"expects a flax.nnx.Module instance"):
    jnnx.mixed_precision(nnx.Linear, "bf16")
  with pytest.raises(TypeError, match=r"rule matcher Dense is not a subclass"
                     r" of flax.nnx"):
    import flax.linen as nn
    jnnx.mixed_precision(Net(nnx.Rngs(0)), "bf16", rules=[(nn.Dense, "f32")])
  with pytest.raises(ValueError, match=r"Unknown dtype 'half16'"):
    jnnx.mixed_precision(Net(nnx.Rngs(0)), "c=half16")
  with pytest.raises(TypeError, match=r"dtype_report expects"):
    jnnx.dtype_report(Net(nnx.Rngs(0)), _x())


class Encoder(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(3, 4, dtype=jnp.float32, rngs=rngs)
    self.bn = nnx.BatchNorm(4, rngs=rngs)

  def __call__(self, x):
    return self.bn(self.lin(x))

  def project(self, x):
    return self.lin(x)


class EncoderHead(nnx.Module):
  def __init__(self, rngs):
    self.encoder = Encoder(rngs)
    self.head = nnx.Linear(4, 2, dtype=jnp.float32, rngs=rngs)

  def __call__(self, x):
    return self.head(self.encoder(x))


def test_nested_policy_reports_its_own_modules():
  """The report flagged a nested policy's float16 matmuls as the outer
  root's own code, and listed none of its modules."""

  class Outer(nnx.Module):
    def __init__(self, rngs):
      self.backbone = jnnx.mixed_precision(Encoder(rngs), "f16")
      self.head = nnx.Linear(4, 2, dtype=jnp.float32, rngs=rngs)

    def __call__(self, x):
      return self.head(self.backbone(x))

  model = jnnx.mixed_precision(Outer(nnx.Rngs(0)), "p=f32,c=bf16,o=f32")
  report = jnnx.dtype_report(model, jnp.ones((2, 3)))
  rows = {r.path: r for r in report.rows}
  assert set(rows) == {"", "backbone", "backbone/lin", "backbone/bn", "head"}
  assert rows["backbone/lin"].computed == "float16"
  assert rows["backbone/lin"].stored == "float16"
  assert rows["backbone/bn"].stored == "float32"  # Its float32 island.
  assert rows["head"].computed == "bfloat16" and rows[""].computed == "-"
  assert not report.mismatches()


def test_views_and_configuring_methods_act_on_the_wrapped_submodules():
  """nnx.view / set_view switch a wrapped model to eval mode, as unwrapped."""
  model = jnnx.mixed_precision(StatefulBlock(4, 4, rngs=nnx.Rngs(0)),
                               "p=f32,c=bf16,o=f32")
  x = jax.random.normal(jax.random.key(1), (8, 4))
  model(x)  # Training mode: batch statistics move.
  evaluating = nnx.view(model, deterministic=True, use_running_average=True)
  assert evaluating.drop.deterministic and evaluating.bn.use_running_average
  mean = evaluating.bn.mean[...]
  chex.assert_trees_all_equal(evaluating(x), evaluating(x))
  chex.assert_trees_all_equal(evaluating.bn.mean[...], mean)
  model.drop.set_view(deterministic=True)
  assert model.drop.deterministic


class Autoencoder(nnx.Module):
  """Flax-example style: every layer says dtype=float32; parts called alone."""

  def __init__(self, rngs):
    self.encoder = Encoder(rngs)
    self.blocks = nnx.List([nnx.Linear(4, 4, dtype=jnp.float32, rngs=rngs)
                            for _ in range(2)])
    self.decoder = nnx.Linear(4, 3, dtype=jnp.float32, rngs=rngs)

  def __call__(self, x):
    h = self.encoder(x)
    for block in self.blocks:
      h = nnx.relu(block(h))
    return self.decoder(h)


def _traced_dtypes(call, module, *args):
  """Matmul operand dtypes of ``call(module, *args)``, traced as nnx.jit does
  (module merged inside the trace, so batch statistics may move)."""
  graphdef, state = nnx.split(module)
  return _dot_conv_dtypes(
      lambda s, *a: call(nnx.merge(graphdef, s), *a), state, *args)


def test_submodules_called_directly_run_under_the_policy():
  """`wrapped.encoder(x)` ran the bare module: float32 matmuls, silently."""
  model = jnnx.mixed_precision(Autoencoder(nnx.Rngs(0)), "p=f32,c=bf16,o=f32",
                               rules=[("blocks/1", "c=f32")])
  x = jax.random.normal(jax.random.key(1), (8, 3))
  h = jnp.ones((8, 4))
  bf16, f32 = (np.dtype(jnp.bfloat16),) * 2, (np.dtype(jnp.float32),) * 2
  assert _traced_dtypes(lambda m, x: m.encoder(x), model, x) == {bf16}
  assert _traced_dtypes(lambda m, h: m.blocks[0](h), model, h) == {bf16}
  assert _traced_dtypes(lambda m, h: m.decoder(h), model, h) == {bf16}
  # Rules resolve on the full path (blocks/1) and are inherited (encoder/lin).
  assert _traced_dtypes(lambda m, h: m.blocks[1](h), model, h) == {f32}
  ruled = jnnx.mixed_precision(Autoencoder(nnx.Rngs(0)), "p=f32,c=bf16",
                               rules=[(Encoder, "c=f32,o=f32")])
  assert _traced_dtypes(lambda m, x: m.encoder.lin(x), ruled, x) == {f32}
  # The policy's output dtype, as from the wrapper; params stay stored f32.
  assert_dtype(model.decoder(h), jnp.float32)
  assert_dtype(_value(model.decoder.kernel), jnp.float32)
  # What the call changed is written back, in the stored dtype.
  mean = _value(model.encoder.bn.mean)
  model.encoder(x)
  assert_dtype(_value(model.encoder.bn.mean), jnp.float32)
  assert not np.allclose(_value(model.encoder.bn.mean), mean)
  # A view of the stored module, which is exactly the model's own class (no
  # subclass stands in for it); the user's model keeps its classes too.
  stored = dict(nnx.iter_graph(model))
  assert type(stored[("encoder",)]) is Encoder
  assert model.encoder.lin.kernel is stored[("encoder", "lin", "kernel")]
  assert not isinstance(model.encoder, nnx.Module)
  bare = Autoencoder(nnx.Rngs(0))
  jnnx.mixed_precision(bare, "c=bf16")
  assert type(bare.encoder) is Encoder and type(bare.decoder) is nnx.Linear


def test_direct_submodule_calls_in_a_donated_nnx_jit_step():
  model = jnnx.mixed_precision(Autoencoder(nnx.Rngs(0)),
                               "p=f32,c=bf16,o=bf16")
  opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  x = jax.random.normal(jax.random.key(1), (8, 3))
  traces = []

  @nnx.jit(donate_argnums=(0, 1))
  def step(model, opt, x):
    def loss(model):  # Encoder and decoder called directly, no blocks.
      encoded = model.encoder(x)
      traces.append(encoded.dtype)
      y = model.decoder(encoded).astype(jnp.float32)
      return jnp.mean((y - x) ** 2)

    value, grads = nnx.value_and_grad(loss)(model)
    opt.update(model, grads)
    return value, grads

  losses = [float(step(model, opt, x)[0]) for _ in range(4)]
  value, grads = step(model, opt, x)
  losses.append(float(value))
  assert traces == [jnp.bfloat16]   # One trace; the policy's output dtype.
  assert losses[-1] < losses[0]
  assert_dtype(_value(grads["decoder"]["kernel"]), jnp.float32)
  assert_dtype(_value(model.encoder.lin.kernel), jnp.float32)


def test_guarded_submodules_pickle_and_unwrap():
  import pickle
  model = jnnx.mixed_precision(Autoencoder(nnx.Rngs(0)), "p=f32,c=bf16,o=f32")
  h = jnp.ones((2, 4))
  graphdef = nnx.graphdef(model)
  assert pickle.loads(pickle.dumps(graphdef)) == graphdef
  restored = pickle.loads(pickle.dumps(model))
  bf16 = (np.dtype(jnp.bfloat16),) * 2
  assert _traced_dtypes(lambda m, h: m.decoder(h), restored, h) == {bf16}
  chex.assert_trees_all_equal(restored.decoder(h), model.decoder(h))
  # Unwrapping (a float32 policy re-wraps the model itself) and wrapping a
  # guarded submodule on its own: each runs only its own policy.
  f32 = (np.dtype(jnp.float32),) * 2
  plain = jnnx.mixed_precision(model, "f32")
  assert _traced_dtypes(lambda m, h: m.decoder(h), plain, h) == {f32}
  alone = jnnx.mixed_precision(model.decoder, "c=f16")
  assert alone.wrapped_class is nnx.Linear
  assert _traced_dtypes(lambda m, h: m(h), alone, h) == {
      (np.dtype(jnp.float16),) * 2}
  assert _traced_dtypes(lambda m, h: m.decoder(h), model, h) == {bf16}


def test_float32_attention_as_an_nnx_attention_fn_with_is_causal():
  """nnx.MultiHeadAttention passes is_causal=: a TypeError before."""
  from jmp_lite.linen import dot_product_attention_fp32

  def attention(fn):
    return nnx.MultiHeadAttention(2, 8, qkv_features=8, decode=False,
                                  attention_fn=fn, rngs=nnx.Rngs(0))

  x = jax.random.normal(jax.random.key(1), (2, 5, 8))
  reference = attention(nnx.dot_product_attention)(x, is_causal=True,
                                                   deterministic=True)
  bare = attention(dot_product_attention_fp32)(x, is_causal=True,
                                                deterministic=True)
  chex.assert_trees_all_close(bare, reference, atol=1e-6)
  model = jnnx.mixed_precision(attention(dot_product_attention_fp32),
                               "p=f32,c=bf16,o=f32")
  y = model(x, is_causal=True, deterministic=True)
  assert_dtype(y, jnp.float32)
  chex.assert_trees_all_close(y, reference, atol=3e-2)
  # Later positions do not reach earlier ones.
  later = model(x.at[:, 3:].set(0.0), is_causal=True, deterministic=True)
  chex.assert_trees_all_equal(later[:, :3], y[:, :3])
  # Projections in bf16, logits and softmax in float32.
  assert _dot_conv_dtypes(
      lambda x: model(x, is_causal=True, deterministic=True), x) == {
          (np.dtype(jnp.bfloat16),) * 2, (np.dtype(jnp.float32),) * 2}


def test_float32_attention_sows_its_weights_into_nnx_intermediates():
  """With sow_weights=True nnx attention passes module=: it was dropped."""
  from jmp_lite.linen import dot_product_attention_fp32

  def attention(fn):
    return nnx.MultiHeadAttention(2, 8, qkv_features=8, decode=False,
                                  attention_fn=fn, rngs=nnx.Rngs(0))

  def sown(model, **kwargs):   # nnx.capture: how nnx reads sown values.
    _, state = nnx.capture(model, nnx.Intermediate)(
        x, deterministic=True, **kwargs)
    return state

  x = jax.random.normal(jax.random.key(1), (2, 5, 8))
  expected = sown(attention(nnx.dot_product_attention),
                  sow_weights=True)["attention_weights"][0]
  for policy, atol in ((None, 1e-6), ("p=f32,c=bf16,o=f32", 1e-2)):
    model = attention(dot_product_attention_fp32)
    if policy is not None:
      model = jnnx.mixed_precision(model, policy)
    weights = sown(model, sow_weights=True)["attention_weights"][0]
    assert_dtype(weights, jnp.float32)   # What ran: softmax in float32.
    chex.assert_trees_all_close(weights, expected, atol=atol)
    assert not sown(model)   # Without sow_weights nothing is sown.


def test_float32_attention_sows_before_nnx_dropout():
  """It sowed the weights after dropout (zeros, rows scaled by 2): Flax
  sows the softmax (found by a review)."""
  from jmp_lite.linen import dot_product_attention_fp32

  def run(fn):
    model = nnx.MultiHeadAttention(2, 8, qkv_features=8, decode=False,
                                   dropout_rate=0.5, attention_fn=fn,
                                   rngs=nnx.Rngs(0, dropout=5))
    return nnx.capture(model, nnx.Intermediate)(
        x, deterministic=False, sow_weights=True)

  x = jax.random.normal(jax.random.key(1), (2, 5, 8))
  (y, sown), (ref, ref_sown) = run(dot_product_attention_fp32), run(
      nnx.dot_product_attention)
  chex.assert_trees_all_close(y, ref, atol=1e-5)   # Same dropout mask.
  weights = sown["attention_weights"][0]
  chex.assert_trees_all_close(weights.sum(-1), jnp.ones(weights.shape[:-1]),
                              atol=1e-5)
  chex.assert_trees_all_close(weights, ref_sown["attention_weights"][0],
                              atol=1e-6)


class CachedDecoder(nnx.Module):
  """A decoder as Flax's examples write one: the cache made by a method."""

  def __init__(self):
    self.attn = nnx.MultiHeadAttention(2, 16, decode=True, rngs=nnx.Rngs(0))
    self.out = nnx.Linear(16, 5, rngs=nnx.Rngs(1))

  def init_cache(self, shape, dtype):
    self.attn.init_cache(shape, dtype=dtype)

  def __call__(self, x):
    return self.out(self.attn(x))


@pytest.mark.parametrize("jit_init", [False, True])
def test_init_cache_through_the_wrapper_then_decode(jit_init):
  """A method that makes variables where the model declared nnx.data(None)
  (attention's cache) raised 'Expected a subgraph for cache_index'."""
  x = jax.random.normal(jax.random.key(0), (1, 4, 16))
  bare = CachedDecoder()
  bare.init_cache((1, 4, 16), jnp.float32)
  want = [bare(x[:, i:i + 1]) for i in range(4)]
  model = jnnx.mixed_precision(CachedDecoder(), "p=f32,c=bf16,o=f32")
  make = lambda m: m.init_cache((1, 4, 16), jnp.bfloat16)
  nnx.jit(make)(model) if jit_init else make(model)
  assert_dtype(model.attn.cached_key[...], jnp.bfloat16)
  step = nnx.jit(lambda m, t: m(t))
  for i in range(4):
    got = step(model, x[:, i:i + 1])
    assert_dtype(got, jnp.float32)
    chex.assert_trees_all_close(got, want[i], atol=5e-2)
  assert int(model.attn.cache_index[...]) == 4
  # The wrapped attention layer's own init_cache too.
  alone = jnnx.mixed_precision(
      nnx.MultiHeadAttention(2, 16, decode=True, rngs=nnx.Rngs(0)),
      "p=f32,c=bf16,o=f32")
  alone.init_cache((1, 4, 16), dtype=jnp.bfloat16)
  assert_dtype(alone(x[:, :1]), jnp.float32)


# -- Issue 29, item 7: a returned cache keeps the dtype its method made ---

def _cache_dtypes(cache):
  return {jax.tree_util.keystr(p): np.dtype(x.dtype)
          for p, x in jax.tree_util.tree_leaves_with_path(cache)}


def _greedy(model, prompt, steps, cache_dtype):
  """Prefill, then ``steps`` single-token steps handing the cache back."""
  call = nnx.jit(lambda m, t, c: m(t, c))
  cache = model.init_cache(prompt.shape[0], 16, cache_dtype)
  logits, cache = call(model, prompt, cache)
  tokens, all_logits, caches = [], [logits], [cache]
  for _ in range(steps):
    tokens.append(jnp.argmax(logits[:, -1], axis=-1)[:, None])
    logits, cache = call(model, tokens[-1], cache)
    all_logits.append(logits)
    caches.append(cache)
  return jnp.concatenate(tokens, axis=1), all_logits, caches


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("setting,cache_dtype,logits_dtype", [
    ("p=f32,c=bf16,o=f32", jnp.bfloat16, jnp.float32),
    ("p=f32,c=f32,o=bf16", jnp.float32, jnp.bfloat16),
    ("p=f32,c=f32,o=f32", jnp.bfloat16, jnp.float32),
])
def test_a_returned_cache_keeps_the_dtype_its_method_made_it_in(
    jit, setting, cache_dtype, logits_dtype):
  """init_cache(..., dtype=...) returns its cache in that dtype, and a call
  handed the cache returns it in the dtype it was given (it came back in the
  output dtype, float32, twice the bare model's size); the logits take the
  output dtype."""
  from tests.models.nnx_models import CachedLM
  model = jnnx.mixed_precision(CachedLM(rngs=nnx.Rngs(0)), setting)
  make = lambda m: m.init_cache(2, 16, cache_dtype)
  cache = nnx.jit(make)(model) if jit else make(model)
  assert _cache_dtypes(cache) == _cache_dtypes(
      CachedLM(rngs=nnx.Rngs(0)).init_cache(2, 16, cache_dtype))
  assert_dtype(cache["layers"][0]["k"], cache_dtype)
  assert_dtype(cache["index"], jnp.int32)
  call = (lambda m, t, c: m(t, c))
  call = nnx.jit(call) if jit else call
  tokens = jnp.arange(6).reshape(2, 3)
  for _ in range(2):
    logits, new = call(model, tokens, cache)
    assert_dtype(logits, logits_dtype)
    assert _cache_dtypes(new) == _cache_dtypes(cache)
    assert int(new["index"]) == int(cache["index"]) + 3
    cache = new
  # Plain activations still take the output dtype (no cache: none back).
  logits, none = model(tokens)
  assert_dtype(logits, logits_dtype)
  assert none is None


def test_greedy_decode_keeps_a_bfloat16_cache_and_matches_the_bare_model():
  """A jitted greedy decode through the wrapper under p=f32,c=bf16,o=f32:
  every step gets a bfloat16 cache back and float32 logits, the tokens and
  logits are the bare model's with its params in bfloat16, and the step's
  jaxpr converts nothing of the cache's size."""
  from jmp_lite._jaxpr import walk
  from tests.models.nnx_models import CachedLM
  bare = CachedLM(rngs=nnx.Rngs(0))
  # float32_norms=False: the policy is then bfloat16 everywhere, as in the
  # bare model with bfloat16 params, so the two decodes are the same.
  model = jnnx.mixed_precision(bare, "p=f32,c=bf16,o=f32",
                               float32_norms=False)
  # The bare model computing in bfloat16 (Embed fixed its dtype, float32,
  # when it was made).
  half = nnx.clone(bare)
  params = nnx.state(half, nnx.Param)
  nnx.update(half, jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))
  for _, layer in nnx.iter_graph(half):
    if isinstance(layer, (nnx.Embed, nnx.Linear, nnx.RMSNorm)):
      layer.dtype = jnp.bfloat16
  prompt = jnp.array([[3, 1, 4, 1], [5, 9, 2, 6]])
  tokens, logits, caches = _greedy(model, prompt, 6, jnp.bfloat16)
  want_tokens, want_logits, want_caches = _greedy(half, prompt, 6,
                                                  jnp.bfloat16)
  np.testing.assert_array_equal(tokens, want_tokens)
  for got, want in zip(logits, want_logits, strict=True):
    assert_dtype(got, jnp.float32)
    assert_dtype(want, jnp.bfloat16)
    chex.assert_trees_all_close(got, want.astype(jnp.float32), atol=1e-2)
  for got, want in zip(caches, want_caches, strict=True):
    assert set(_cache_dtypes(got).values()) == {np.dtype(jnp.bfloat16),
                                                np.dtype(jnp.int32)}
    chex.assert_trees_all_close(got, want, atol=1e-2)
  # One decode step converts no array of the cache's shape (it converted
  # every K and V to float32 and back each step).
  cache = caches[-1]
  shape = cache["layers"][0]["k"].shape
  jaxpr = jax.make_jaxpr(lambda t, c: model(t, c))(tokens[:, -1:], cache)
  converts = [s.eqn for s in walk(jaxpr)
              if s.primitive == "convert_element_type"]
  assert converts   # The logits' cast to float32 is there.
  assert not [e for e in converts if e.invars[0].aval.shape == shape]


class _AttributeCache(nnx.Module):
  """Makes its cache in a dtype it holds, naming none in the call."""

  def __init__(self):
    self.lin = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    self.cache_dtype = jnp.bfloat16

  def init_cache(self, batch):
    return {"k": jnp.zeros((batch, 8, 4), self.cache_dtype)}

  def __call__(self, x):
    return self.lin(x)


def test_state_methods_hand_back_what_the_rule_does_not_recognise():
  """A cache made in a dtype no argument names is cast like an activation
  unless its method is named in state_methods; bad names are refused."""
  setting = "p=f32,c=bf16,o=f32"
  plain = jnnx.mixed_precision(_AttributeCache(), setting)
  assert_dtype(plain.init_cache(2)["k"], jnp.float32)
  kept = jnnx.mixed_precision(_AttributeCache(), setting,
                              state_methods=("init_cache",))
  assert_dtype(kept.init_cache(2)["k"], jnp.bfloat16)
  assert_dtype(nnx.jit(lambda m: m.init_cache(2))(kept)["k"], jnp.bfloat16)
  assert_dtype(kept(jnp.ones((1, 4))), jnp.float32)   # Others are cast.
  with pytest.raises(TypeError, match="sequence of method names"):
    jnnx.mixed_precision(_AttributeCache(), setting,
                         state_methods="init_cache")
  with pytest.raises(ValueError, match=r"\['init_kache'\].*init_cache"):
    jnnx.mixed_precision(_AttributeCache(), setting,
                         state_methods=["init_kache"])


class Slotted(nnx.Module):
  def __init__(self):
    self.lin = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    self.slot = nnx.data(None)

  def fill(self, x):
    self.slot = nnx.Cache(jnp.full(3, 2.0))
    return self.lin(x)


class SlottedDict(nnx.Module):
  def __init__(self):
    self.layers = nnx.data({"a": Slotted(), "b": Slotted()})

  def fill(self, x):
    return self.layers["b"].fill(self.layers["a"].fill(x))


def test_variables_created_under_plain_dict_containers_land():
  """A plain dict container's keys were read as attributes (AttributeError:
  'dict' object has no attribute 'a')."""
  model = jnnx.mixed_precision(SlottedDict(), "p=f32,c=bf16,o=f32")
  assert_dtype(model.fill(jnp.ones((2, 4))), jnp.float32)
  for key in ("a", "b"):
    chex.assert_trees_all_equal(model.layers[key].slot[...], jnp.full(3, 2.0))


def test_tabulate_lists_the_wrapped_models_modules_every_time():
  """nnx.tabulate listed the submodules once, then raised KeyError."""
  model = jnnx.mixed_precision(Autoencoder(nnx.Rngs(0)), "p=f32,c=bf16,o=f32")
  x = jnp.ones((2, 3))
  for _ in range(2):
    table = nnx.tabulate(model, x, depth=2,
                         console_kwargs={"width": 250, "no_color": True})
    for path in ("encoder/lin", "encoder/bn", "blocks/0", "decoder"):
      assert path in table, path


def test_a_shared_submodule_called_directly_keeps_its_rule():
  """A tied module resolves at the path the model's own call sees it."""

  class Head(nnx.Module):
    def __init__(self, embed):
      self.embed = embed

    def __call__(self, h):
      return self.embed.attend(h)

  class TiedLM(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(16, 8, rngs=rngs)
      self.proj = nnx.Linear(8, 8, rngs=rngs)
      self.head = Head(self.embed)

    def __call__(self, tokens):
      return self.head(self.proj(self.embed(tokens)))

  model = jnnx.mixed_precision(TiedLM(nnx.Rngs(0)), "f32",
                               rules=[("embed", "p=f32,c=bf16,o=f32")])
  h = jnp.ones((2, 8))
  bf16 = (np.dtype(jnp.bfloat16),) * 2
  # Reached as head/embed, ruled as embed (the model's call runs it so).
  assert _traced_dtypes(lambda m, h: m.head(h), model, h) == {bf16}
  assert bf16 in _traced_dtypes(lambda m, t: m(t), model,
                                jnp.arange(4).reshape(2, 2))


def test_models_defined_in_a_script_pickle(monkeypatch):
  """Classes of ``__main__`` (scripts, notebooks) pickle by name too."""
  import pickle
  import sys

  class MainBlock(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(3, 3, rngs=rngs)

    def __call__(self, x):
      return self.lin(x)

  MainBlock.__module__, MainBlock.__qualname__ = "__main__", "MainBlock"
  monkeypatch.setattr(sys.modules["__main__"], "MainBlock", MainBlock,
                      raising=False)
  model = jnnx.mixed_precision(Encoder(nnx.Rngs(0)), "c=bf16")
  model.lin = MainBlock(nnx.Rngs(1))   # Model surgery, then wrapped again.
  model = jnnx.mixed_precision(model, "c=bf16")
  restored = pickle.loads(pickle.dumps(model))
  assert type(vars(restored)["lin"]) is MainBlock
  chex.assert_trees_all_equal(restored.lin(jnp.ones((1, 3))),
                              model.lin(jnp.ones((1, 3))))


# -- Issue 28: nothing the user hands over is modified ------------------------

def _module_classes():
  """Every subclass of nnx.Module that exists now."""
  found, todo = set(), [nnx.Module]
  while todo:
    for sub in todo.pop().__subclasses__():
      if sub not in found:
        found.add(sub)
        todo.append(sub)
  return found


def _snapshot(model):
  """Each module of ``model``: its class, attribute names and arrays."""
  return {path: (type(m), sorted(vars(m)),
                 [v.get_value() for v in vars(m).values()
                  if isinstance(v, nnx.Variable)])
          for path, m in nnx.iter_graph(model) if isinstance(m, nnx.Module)}


def _assert_unchanged(model, snapshot):
  now = _snapshot(model)
  assert set(now) == set(snapshot)
  for path, (cls, names, arrays) in snapshot.items():
    got_cls, got_names, got_arrays = now[path]
    assert got_cls is cls, path
    assert got_names == names, path
    assert len(got_arrays) == len(arrays)
    assert all(a is b for a, b in zip(got_arrays, arrays, strict=True)), path


def _assert_own_classes(model):
  """Every module below the root is an instance of a class its module
  defines under its name (no class made at run time), none of jmp_lite's."""
  import importlib
  for path, m in nnx.iter_graph(model):
    if not path or not isinstance(m, nnx.Module):
      continue
    cls = type(m)
    assert not cls.__module__.startswith("jmp_lite"), (path, cls)
    if "<locals>" not in cls.__qualname__:
      found = importlib.import_module(cls.__module__)
      for part in cls.__qualname__.split("."):
        found = getattr(found, part)
      assert found is cls, (path, cls)


def test_wrapping_and_calling_change_no_module_and_make_no_class():
  """Issue 28: the adapter set __class__ on the stored submodules (to
  generated <Name>UnderPolicy subclasses) and on per-call copies."""
  user = Autoencoder(nnx.Rngs(0))
  before = _snapshot(user)
  classes = _module_classes()
  model = jnnx.mixed_precision(user, "p=bf16,c=bf16,o=f32",
                               rules=[("blocks/1", "c=f32")])
  stored = _snapshot(model)
  x = jax.random.normal(jax.random.key(1), (8, 3))
  h = jnp.ones((8, 4))
  model(x)                                      # Eager.
  model.encoder(x)                              # A submodule, directly.
  model.blocks[1](h)
  nnx.jit(lambda m, x: m(x))(model, x)          # Under nnx.jit.
  nnx.jit(lambda m, h: m.decoder(h))(model, h)
  evaluating = nnx.view(model, use_running_average=True)
  jax.jit(lambda x: evaluating(x))(x)           # Closed over by jax.jit.
  grads = nnx.grad(lambda m: m(x).sum())(model)  # Gradients.
  jnnx.dtype_report(model, x)
  nnx.tabulate(model, x, console_kwargs={"no_color": True})
  _assert_unchanged(user, before)
  _assert_own_classes(user)
  _assert_own_classes(model)
  for path, (cls, names, _) in stored.items():  # The wrapper's own modules.
    now = _snapshot(model)[path]
    assert now[0] is cls and now[1] == names, path
  assert _module_classes() == classes   # No class was made.
  params = jax.tree.leaves(nnx.state(model, nnx.Param))
  for g, p in zip(jax.tree.leaves(nnx.state(grads, nnx.Param)), params,
                  strict=True):
    assert_dtype(g, p.dtype)   # Gradients in the stored param dtypes.
  assert {p.dtype for p in params} == {np.dtype(jnp.bfloat16),
                                       np.dtype(jnp.float32)}


def test_stateful_models_keep_their_modules_after_training_steps():
  """The user's model is left as built after a jitted, donated training
  loop on the wrapper (batch statistics and RNG counts move there only)."""
  user = StatefulBlock(4, 4, rngs=nnx.Rngs(0))
  before = _snapshot(user)
  model = jnnx.mixed_precision(user, "p=f32,c=bf16,o=f32")
  opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  x = jax.random.normal(jax.random.key(1), (8, 4))

  @nnx.jit
  def step(model, opt):
    grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
    opt.update(model, grads)

  for _ in range(2):
    step(model, opt)
  _assert_unchanged(user, before)
  assert int(model.drop.rngs.count[...]) == 2   # The wrapper's stream moved.
  _assert_own_classes(model)


def test_pickles_name_only_the_models_own_classes():
  """No pickle shim: a pickled wrapper names the model's classes, Flax's
  and jmp_lite's public ones, and restores the same classes."""
  import pickle
  import pickletools
  model = jnnx.mixed_precision(Autoencoder(nnx.Rngs(0)), "p=bf16,c=bf16,o=f32")
  h = jnp.ones((2, 4))
  data = pickle.dumps(model)
  strings = [arg for _, arg, _ in pickletools.genops(data)
             if isinstance(arg, str)]
  assert not [s for s in strings if "UnderPolicy" in s or "_guarded" in s]
  restored = pickle.loads(data)
  assert type(restored) is jnnx.MixedPrecision
  assert restored.wrapped_class is Autoencoder
  _assert_own_classes(restored)
  assert type(vars(restored)["encoder"]) is Encoder
  chex.assert_trees_all_equal(restored.decoder(h), model.decoder(h))
  chex.assert_trees_all_equal(restored(jnp.ones((2, 3))),
                              model(jnp.ones((2, 3))))


def test_direct_calls_follow_model_surgery():
  """A submodule put into the wrapper after wrapping runs under the policy
  of its place (it ran bare, or under its old place's policy, before)."""
  model = jnnx.mixed_precision(Autoencoder(nnx.Rngs(0)), "p=f32,c=bf16,o=f32",
                               rules=[("blocks/1", "c=f16")])
  h = jnp.ones((2, 4))
  model.decoder = nnx.Linear(4, 3, rngs=nnx.Rngs(2))
  model.blocks[1] = nnx.Linear(4, 4, rngs=nnx.Rngs(3))
  bf16, f16 = (np.dtype(jnp.bfloat16),) * 2, (np.dtype(jnp.float16),) * 2
  assert _traced_dtypes(lambda m, h: m.decoder(h), model, h) == {bf16}
  assert _traced_dtypes(lambda m, h: m.blocks[1](h), model, h) == {f16}
  assert type(vars(model)["decoder"]) is nnx.Linear
  assert_dtype(model.decoder(h), jnp.float32)


def test_views_index_iterate_and_forward_like_the_stored_modules():
  model = jnnx.mixed_precision(Autoencoder(nnx.Rngs(0)), "p=f32,c=bf16,o=f32")
  h = jnp.ones((2, 4))
  blocks = model.blocks
  assert len(blocks) == 2 and bool(blocks)
  bf16 = (np.dtype(jnp.bfloat16),) * 2
  for i, block in enumerate(blocks):   # Iterating gives callable views.
    assert_dtype(block(h), jnp.float32)
    assert block.kernel is vars(model)["blocks"][i].kernel
  assert _traced_dtypes(lambda m, h: m.blocks[-1](h), model, h) == {bf16}
  assert [b.in_features for b in model.blocks[:1]] == [4]
  model.encoder.lin.marker = "set"     # Attributes land on the stored module.
  assert vars(model)["encoder"].lin.marker == "set"
  assert "Linear at 'blocks/0'" in repr(model.blocks[0])
  import pickle
  block = pickle.loads(pickle.dumps(model.blocks[1]))   # With its wrapper.
  chex.assert_trees_all_equal(block(h), model.blocks[1](h))
  # A wrapper inside another keeps its own calls: no view around it.
  outer = jnnx.mixed_precision(
      nnx.Sequential(jnnx.mixed_precision(nnx.Linear(4, 4, rngs=nnx.Rngs(0)),
                                          "f16")), "bf16")
  assert type(outer.layers[0]) is jnnx.MixedPrecision
  assert_dtype(outer.layers[0](h), jnp.float16)


class Branching(nnx.Module):
  """Model code that branches on its layers' classes."""

  def __init__(self, rngs):
    self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs),
                            nnx.Dropout(0.5, rngs=rngs)])

  def __call__(self, x):
    for layer in self.layers:
      if isinstance(layer, nnx.Dropout):
        x = layer(x, deterministic=True)
      else:
        x = layer(x)
    return x


def test_model_code_sees_its_layers_classes():
  """isinstance(layer, nnx.Dropout) in the model's code holds under the
  policy as without it (dropout ran in training mode otherwise)."""
  bare = Branching(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (3, 4))
  model = jnnx.mixed_precision(bare, "f32")
  chex.assert_trees_all_equal(model(x), bare(x))
  half = jnnx.mixed_precision(bare, "p=f32,c=bf16,o=f32")
  chex.assert_trees_all_close(half(x), bare(x), atol=5e-2)


class ScannedStack(nnx.Module):
  """Layers made with nnx.vmap and run with nnx.scan (Flax's recipe)."""

  def __init__(self, rngs):
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return nnx.Linear(4, 4, rngs=rngs)

    self.blocks = make(rngs)
    self.norm = nnx.LayerNorm(4, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def body(block, x):
      return x + block(self.norm(x))

    return body(self.blocks, x)


def test_layers_scanned_inside_the_model_run_under_the_policy():
  """nnx.scan over stacked layers splits and merges the call's copy: each
  step's layer still computes in the compute dtype."""
  bare = ScannedStack(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 4))
  model = jnnx.mixed_precision(bare, "p=f32,c=bf16,o=f32")
  assert_dtype(model(x), jnp.float32)
  chex.assert_trees_all_close(model(x), bare(x), atol=5e-2)
  bf16 = (np.dtype(jnp.bfloat16),) * 2
  assert _dot_conv_dtypes(lambda x: model(x), x) == {bf16}
  rows = {r.path: r for r in jnnx.dtype_report(model, x).rows}
  assert rows["blocks"].computed == "bfloat16"
  assert rows["norm"].computed == "-" and rows["norm"].read == "float32"


class _NormBetween(nnx.Module):
  """Linear -> LayerNorm -> Linear, the norm's input shaped (4, 16) alone."""

  def __init__(self, rngs, hand=False):
    # hand: the policy's layout written out with dtype= and nnx.remat.
    dtype = jnp.bfloat16 if hand else None
    self.hand = hand
    self.a = nnx.Linear(8, 16, dtype=dtype, rngs=rngs)
    self.ln = nnx.LayerNorm(16, dtype=jnp.float32 if hand else None,
                            rngs=rngs)
    self.b = nnx.Linear(16, 12, dtype=dtype, rngs=rngs)

  def __call__(self, x):
    if not self.hand:
      return self.b(self.ln(self.a(x)))
    h = self.a(x.astype(jnp.bfloat16))
    h = nnx.remat(lambda m, h: m(h))(self.ln, h).astype(jnp.bfloat16)
    return self.b(h).astype(jnp.float32)


def test_remat_norms_saves_the_norms_bfloat16_input():
  """remat_norms saved the norm's input after its cast to float32: the
  cast now runs inside the recomputed region, so the backward pass keeps
  the bfloat16 input, what a hand-written nnx.remat keeps."""
  x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8)),
                  jnp.float32)

  def residuals(model):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    _, vjp_fn = jax.vjp(
        lambda p: nnx.merge(graphdef, p, rest)(x), params)
    given = {id(p) for p in jax.tree.leaves(params)}
    return [r for r in jax.tree.leaves(vjp_fn)
            if hasattr(r, "dtype") and id(r) not in given
            and r.dtype != jax.dtypes.float0]

  saved = {remat: residuals(jnnx.mixed_precision(
      _NormBetween(nnx.Rngs(0)), "p=f32,c=bf16,o=f32", remat_norms=remat))
           for remat in (False, True)}
  hand_saved = residuals(_NormBetween(nnx.Rngs(0), hand=True))

  def norm_inputs(rs):
    return sorted(str(r.dtype) for r in rs if r.shape == (4, 16))

  # Without remat the norm keeps float32 intermediates of its input's shape.
  assert "float32" in norm_inputs(saved[False])
  # With it: the norm's input and the next Linear's, both bfloat16.
  assert norm_inputs(saved[True]) == ["bfloat16", "bfloat16"]
  assert sorted((r.shape, str(r.dtype)) for r in saved[True]) == sorted(
      (r.shape, str(r.dtype)) for r in hand_saved)
  nbytes = lambda rs: sum(r.size * r.dtype.itemsize for r in rs)
  assert nbytes(saved[True]) < nbytes(saved[False])
