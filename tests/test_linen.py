"""Tests for jmp_lite.linen and jmp_lite.presets on real Flax models."""

from __future__ import annotations

import re
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite
from jmp_lite import linen as jl
from jmp_lite.presets import preset
from tests.conftest import assert_dtype
from tests.models.harness import matmul_dtypes


class ResBlock(nn.Module):
  channels: int

  @nn.compact
  def __call__(self, x, train: bool):
    y = nn.Conv(self.channels, (3, 3))(x)
    y = nn.BatchNorm(use_running_average=not train)(y)
    y = nn.relu(y)
    y = nn.Conv(self.channels, (3, 3))(y)
    y = nn.BatchNorm(use_running_average=not train)(y)
    return nn.relu(x + y)


class ResNet(nn.Module):

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(8, (3, 3))(x)
    x = ResBlock(8)(x, train)
    x = ResBlock(8)(x, train)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(10)(x)


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, deterministic: bool = True):
    h = nn.LayerNorm()(x)
    h = nn.MultiHeadDotProductAttention(
        num_heads=2, attention_fn=jl.dot_product_attention_fp32)(
            h, h, deterministic=deterministic)
    x = x + nn.Dropout(0.1)(h, deterministic=deterministic)
    h = nn.LayerNorm()(x)
    h = nn.Dense(32)(h)
    h = nn.gelu(h)
    return x + nn.Dense(16)(h)


class Transformer(nn.Module):
  vocab: int = 20

  @nn.compact
  def __call__(self, tokens, deterministic: bool = True):
    x = nn.Embed(self.vocab, 16)(tokens)
    x = Block()(x, deterministic)
    x = nn.LayerNorm(name="final_norm")(x)
    return nn.Dense(self.vocab, name="logits")(x)


def _images():
  return jnp.asarray(np.random.default_rng(0).standard_normal((4, 8, 8, 3)),
                     jnp.float32)


def _tokens():
  return jnp.asarray(np.random.default_rng(0).integers(0, 20, (2, 6)))


def _rows(report):
  return {r.path: r for r in report.rows}


def test_resnet_dtypes_seen_by_each_module():
  model = jl.mixed_precision(ResNet(), "p=f32,c=bf16,o=f32")
  x = _images()
  variables = model.init(jax.random.key(0), x)
  report = jl.dtype_report(model, variables, x)
  rows = _rows(report)
  assert rows[""].outputs == "float32"  # Root output dtype.
  for path, row in rows.items():
    if row.cls == "Conv" or row.cls == "Dense":
      assert (row.stored, row.read, row.inputs) == (
          "float32", "bfloat16", "bfloat16"), path
    if row.cls == "BatchNorm":
      assert (row.stored, row.read, row.inputs, row.outputs) == (
          "float32", "float32", "float32", "bfloat16"), path
  assert "BatchNorm" in str(report) and "<table>" in report._repr_html_()
  # Batch statistics stay float32 through a training step.
  out, updated = model.apply(variables, x, mutable=["batch_stats"])
  assert_dtype(out, jnp.float32)
  for leaf in jax.tree.leaves(updated["batch_stats"]):
    assert_dtype(leaf, jnp.float32)
  changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)),
                         updated["batch_stats"], variables["batch_stats"])
  assert any(jax.tree.leaves(changed))


def _hlo_ops(lowered_text, op):
  return [line for line in lowered_text.splitlines()
          if f"stablehlo.{op}" in line]


def test_resnet_hlo_runs_convs_in_bf16_and_batchnorm_in_f32():
  x = _images()
  for norms in (True, False):
    model = jl.mixed_precision(ResNet(), "p=f32,c=bf16,o=f32",
                               float32_norms=norms)
    variables = model.init(jax.random.key(0), x)
    text = jax.jit(lambda v, x, model=model: model.apply(
        v, x, mutable=["batch_stats"])).lower(variables, x).as_text()
    convs = _hlo_ops(text, "convolution")
    assert len(convs) == 5
    assert all(re.search(r"\(tensor<[^>]*bf16>, tensor<[^>]*bf16>\)", c)
               for c in convs)
    dots = _hlo_ops(text, "dot_general")
    assert dots and all("bf16>, tensor" in d for d in dots)
    # BatchNorm's statistics are reduced in float32 either way (Flax forces
    # float32 reductions); the island decides the dtype its params are read
    # in and its inputs are cast to.
    reduces = [line for line in _hlo_ops(text, "reduce")
               if "tensor<4x8x8x8x" in line]
    assert reduces and all("bf16" not in r for r in reduces)
    row = _rows(jl.dtype_report(model, variables, x))["ResBlock_0/BatchNorm_0"]
    expected = "float32" if norms else "bfloat16"
    assert (row.read, row.inputs) == (expected, expected)


def test_transformer_islands_attention_and_grads():
  model = jl.mixed_precision(Transformer(), "p=f32,c=bf16,o=f32")
  tokens = _tokens()
  variables = model.init(jax.random.key(0), tokens)
  rows = _rows(jl.dtype_report(model, variables, tokens))
  assert rows["Embed_0"].read == "bfloat16"
  assert rows["Block_0/LayerNorm_0"].read == "float32"
  assert rows["Block_0/LayerNorm_0"].inputs == "float32"
  assert rows["final_norm"].outputs == "bfloat16"
  assert rows["logits"].read == "bfloat16"
  qproj = rows["Block_0/MultiHeadDotProductAttention_0/query"]
  assert (qproj.cls, qproj.read) == ("DenseGeneral", "bfloat16")
  text = jax.jit(model.apply).lower(variables, tokens).as_text()
  # Attention logits and softmax (the exp) run in float32.
  exps = _hlo_ops(text, "exponential")
  assert exps and all("bf16" not in e for e in exps)

  def loss(params):
    logits = model.apply({"params": params}, tokens)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, tokens).mean()

  grads = jax.grad(loss)(variables["params"])
  for g in jax.tree.leaves(grads):
    assert_dtype(g, jnp.float32)  # Gradients come back in the param dtype.


def test_rngs_dropout_and_method():
  model = jl.mixed_precision(Transformer(), "c=bf16,o=f32")
  tokens = _tokens()
  variables = model.init(jax.random.key(0), tokens)
  a = model.apply(variables, tokens, False, rngs={"dropout": jax.random.key(1)})
  b = model.apply(variables, tokens, False, rngs={"dropout": jax.random.key(2)})
  assert_dtype(a, jnp.float32)
  assert bool(jnp.any(a != b))

  class TwoHeads(nn.Module):
    def setup(self):
      self.body = nn.Dense(4)
      self.norm = nn.LayerNorm()

    def __call__(self, x):
      return self.body(x)

    def normed(self, x):
      return self.norm(self.body(x))

  m = jl.mixed_precision(TwoHeads(), "c=bf16,o=f32")
  x = jnp.ones((2, 3))
  v = m.init(jax.random.key(0), x, method=TwoHeads.normed)
  assert set(v["params"]) == {"body", "norm"}
  assert_dtype(m.apply(v, x, method=TwoHeads.normed), jnp.float32)
  rows = _rows(jl.dtype_report(m, v, x, method=TwoHeads.normed))
  assert rows["norm"].read == "float32" and rows["body"].read == "bfloat16"


class Lifted(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.remat(nn.Dense)(8, name="remat_dense")(x)
    x = nn.jit(nn.LayerNorm)(name="jit_norm")(x)

    class Cell(nn.Module):
      @nn.compact
      def __call__(self, carry, _):
        return nn.Dense(8)(carry), None

    scan = nn.scan(Cell, variable_broadcast=False, variable_axes={"params": 0},
                   split_rngs={"params": True}, length=3)
    x, _ = scan(name="scanned")(x, None)
    return x


def test_lifted_submodules_follow_rules():
  model = jl.mixed_precision(Lifted(), "p=bf16,c=bf16,o=f32")
  x = jnp.ones((2, 8))
  variables = model.init(jax.random.key(0), x)
  params = variables["params"]
  assert_dtype(params["remat_dense"]["kernel"], jnp.bfloat16)
  assert_dtype(params["jit_norm"]["scale"], jnp.float32)  # Class rule, lifted.
  assert params["scanned"]["Dense_0"]["kernel"].shape == (3, 8, 8)
  assert_dtype(params["scanned"]["Dense_0"]["kernel"], jnp.bfloat16)
  out = jax.jit(model.apply)(variables, x)
  assert_dtype(out, jnp.float32)
  grads = jax.grad(lambda p: model.apply({"params": p}, x).sum())(params)
  assert_dtype(grads["remat_dense"]["kernel"], jnp.bfloat16)
  assert_dtype(grads["jit_norm"]["scale"], jnp.float32)


def test_path_and_class_rules_first_match_and_inheritance():
  model = jl.mixed_precision(
      Transformer(), "p=f32,c=bf16,o=f32",
      rules=[("logits", "f32"),            # A path rule.
             (nn.MultiHeadDotProductAttention, "c=f16"),  # Children inherit.
             ("Block_0/Dense_.*", "c=f16"),
             (nn.Dense, "f32")])           # Never reached for Block_0/Dense_*.
  tokens = _tokens()
  variables = model.init(jax.random.key(0), tokens)
  pol = model.policy_for(variables, tokens)
  assert pol["logits"] == "p=f32,c=f32,o=f32"
  attention_key = "Block_0/MultiHeadDotProductAttention_0/key"
  assert pol[attention_key] == "p=f32,c=f16,o=f16"
  assert pol["Block_0/Dense_0"] == "p=f32,c=f16,o=f16"
  assert pol["Block_0"] == "p=f32,c=bf16,o=f32"
  rows = _rows(jl.dtype_report(model, variables, tokens))
  assert rows["Block_0/MultiHeadDotProductAttention_0/key"].read == "float16"
  assert rows["logits"].outputs == "float32"


def test_enabled_false_is_float32_everywhere():
  model = jl.mixed_precision(ResNet(), "bf16", enabled=False)
  x = _images()
  variables = model.init(jax.random.key(0), x)
  for leaf in jax.tree.leaves(variables):
    assert_dtype(leaf, jnp.float32)
  out, _ = model.apply(variables, x, mutable=["batch_stats"])
  assert_dtype(out, jnp.float32)
  text = jax.jit(lambda v, x: model.apply(v, x, mutable=["batch_stats"])
                 ).lower(variables, x).as_text()
  assert "bf16" not in text


def test_bad_rules_give_clear_errors():
  with pytest.raises(TypeError, match=r"rule matcher int is not a subclass of"
                     r" flax.linen.module.Module"):
    jl.mixed_precision(ResNet(), "bf16", rules=[(int, "f32")])
  with pytest.raises(TypeError, match="path pattern"):
    jl.mixed_precision(ResNet(), "bf16", rules=[(3, "f32")])
  with pytest.raises(ValueError, match="Bad module path pattern"):
    jl.mixed_precision(ResNet(), "bf16", rules=[("(", "f32")])
  with pytest.raises(TypeError, match="compute_dtype must be a floating"):
    jl.mixed_precision(ResNet(), "bf16", rules=[(nn.Dense, jmp_lite.Policy(
        jnp.float32, jnp.int32, jnp.float32))])
  with pytest.raises(ValueError, match="Unknown dtype 'int8'"):
    jl.mixed_precision(ResNet(), "bf16", rules=[(nn.Dense, "c=int8")])
  with pytest.raises(TypeError, match="matcher, policy"):
    jl.mixed_precision(ResNet(), "bf16", rules=["Dense"])
  with pytest.raises(TypeError, match="expects a flax.linen.Module"):
    jl.mixed_precision(lambda x: x, "bf16")
  strict = jl.mixed_precision(ResNet(), "bf16", strict=True,
                              rules=[("decoder/logits", "f32"),
                                     (nn.Conv, "f32")])
  with pytest.raises(ValueError, match=r"matched no module: \[\"path "
                     r"'decoder/logits'.*modules seen: .*ResBlock_0/Conv_0"):
    strict.init(jax.random.key(0), _images())


def test_gradients_in_param_dtype_for_half_params():
  model = jl.mixed_precision(ResNet(), "p=bf16,c=bf16,o=f32")
  x = _images()
  variables = model.init(jax.random.key(0), x)
  assert_dtype(variables["params"]["Conv_0"]["kernel"], jnp.bfloat16)
  assert_dtype(variables["params"]["ResBlock_0"]["BatchNorm_0"]["scale"],
               jnp.float32)
  grads = jax.grad(lambda p: model.apply(
      {"params": p, "batch_stats": variables["batch_stats"]}, x,
      mutable=["batch_stats"])[0].sum())(variables["params"])
  chex.assert_trees_all_equal_dtypes(grads, variables["params"])


# O0 is float32 throughout whatever the half dtype: its float16 case repeats
# the bfloat16 one and runs in the slow set only.
@pytest.mark.parametrize("level,half", [
    pytest.param(level, half, id=f"{half}-{level}",
                 marks=[pytest.mark.slow] if (level, half) == ("O0", "f16")
                 else [])
    for half in ("bf16", "f16") for level in ("O0", "O1", "O2", "O3")])
def test_presets_train_and_lower_the_loss(level, half):
  p = preset(level, half=half)
  model = p.wrap(Transformer())
  tokens = _tokens()
  variables = model.init(jax.random.key(0), tokens)
  params = variables["params"]
  # Pure float16 (O3) needs an eps float16 can hold (1e-8 rounds to 0).
  eps = 1e-4 if (level, half) == ("O3", "f16") else 1e-8
  opt = p.optimizer(optax.adam(3e-3, eps=eps))
  state = opt.init(params)
  half_dtype = jmp_lite.dtypes.parse_dtype(half)
  kernel = params["logits"]["kernel"]
  expected_param = jnp.float32 if level in ("O0", "O1") else half_dtype
  assert_dtype(kernel, expected_param)
  assert_dtype(params["final_norm"]["scale"],
               half_dtype if level == "O3" else jnp.float32)

  @jax.jit
  def step(params, state):
    scale = jmp_lite.current_loss_scale(state)

    def loss_fn(p):
      logits = model.apply({"params": p}, tokens).astype(jnp.float32)
      loss = optax.softmax_cross_entropy_with_integer_labels(
          logits, tokens).mean()
      return scale.scale(loss), loss

    grads, loss = jax.grad(loss_fn, has_aux=True)(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  for _ in range(25):
    params, state, loss = step(params, state)
    losses.append(float(loss))
  assert losses[-1] < 0.7 * losses[0], losses
  chex.assert_trees_all_equal_dtypes(params, variables["params"])


def test_o1_runs_only_matmul_layers_in_half():
  model = preset("O1", half="bf16").wrap(Transformer())
  tokens = _tokens()
  variables = model.init(jax.random.key(0), tokens)
  rows = _rows(jl.dtype_report(model, variables, tokens))
  assert rows["logits"].read == "bfloat16"
  assert rows["Block_0/Dense_0"].read == "bfloat16"
  assert rows["Embed_0"].read == "float32"
  assert rows["final_norm"].read == "float32"
  assert rows[""].outputs == "float32"


def test_preset_errors():
  with pytest.raises(ValueError, match="Unknown preset 'O4'"):
    preset("O4")
  with pytest.raises(TypeError, match="half must be float16 or bfloat16"):
    preset("O2", half="f32")


def test_cast_by_path_for_plain_pytrees():
  params = {"encoder": [{"w": jnp.ones(2), "ln_scale": jnp.ones(2)}],
            "head": {"w": np.ones(2, np.float32), "steps": jnp.array(1)}}
  out = jmp_lite.cast_by_path(params, "p=bf16,c=bf16",
                              [(r"ln_", "f32"), (r"^head/", "p=f16")],
                              to="param")
  assert_dtype(out["encoder"][0]["w"], jnp.bfloat16)
  assert_dtype(out["encoder"][0]["ln_scale"], jnp.float32)
  assert_dtype(out["head"]["w"], jnp.float16)
  assert isinstance(out["head"]["w"], np.ndarray)
  assert out["head"]["steps"] is params["head"]["steps"]
  with pytest.raises(ValueError, match=r"matched no leaf: \['decoder'\]"):
    jmp_lite.cast_by_path(params, "bf16", [("decoder", "f32")], strict=True)
  with pytest.raises(ValueError, match="to must be one of"):
    jmp_lite.cast_by_path(params, "bf16", to="input")


# -- Issue 9: models as users write them -------------------------------------

def _dot_conv_dtypes(fn, *args):
  return {d for _, d, _ in matmul_dtypes(jax.make_jaxpr(fn)(*args))}


class Float32Fields(nn.Module):
  """Layers built as Flax's examples build them: dtype=float32 everywhere."""

  dtype: object = jnp.float32

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(4, (3, 3), dtype=self.dtype, param_dtype=jnp.bfloat16)(x)
    x = nn.LayerNorm(dtype=self.dtype)(x)
    return nn.Dense(3, dtype=self.dtype, name="head")(x.mean(axis=(1, 2)))


@pytest.mark.parametrize("compute", [jnp.bfloat16, jnp.float16])
def test_policy_overrides_layers_dtype_fields(compute):
  """Point 1: dtype=float32 on a Flax layer no longer wins over the policy."""
  name = np.dtype(compute).name
  model = jl.mixed_precision(Float32Fields(), f"p=f32,c={name},o=f32")
  x = _images()
  variables = model.init(jax.random.key(0), x)
  # The policy governs storage too: the Conv asked for bf16 params.
  for leaf in jax.tree.leaves(variables["params"]):
    assert_dtype(leaf, jnp.float32)
  fwd = lambda v: model.apply(v, x)
  assert _dot_conv_dtypes(fwd, variables) == {(np.dtype(compute),) * 2}
  grad = jax.grad(lambda v: fwd(v).sum())
  assert _dot_conv_dtypes(grad, variables) == {(np.dtype(compute),) * 2}
  assert_dtype(fwd(variables), jnp.float32)
  # A rule is how a module stays in float32.
  kept = jl.mixed_precision(Float32Fields(), f"p=f32,c={name},o=f32",
                            rules=[("head", "f32")])
  ops = _dot_conv_dtypes(lambda v: kept.apply(v, x), variables)
  assert ops == {(np.dtype(compute),) * 2, (np.dtype(jnp.float32),) * 2}


class CastsItself(nn.Module):
  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.ones, (x.shape[-1], 2))
    return x.astype(jnp.float32) @ w.astype(jnp.float32)


class SharedAndScanned(nn.Module):
  @nn.compact
  def __call__(self, x):
    shared = nn.Dense(x.shape[-1], name="shared")
    x = shared(shared(x))  # One module, called twice.
    body = nn.scan(nn.Dense, variable_axes={"params": 0},
                   split_rngs={"params": True}, length=3)
    x = body(x.shape[-1], name="scanned")(x)
    return CastsItself(name="own_cast")(x)


class SelfAttending(nn.MultiHeadDotProductAttention):
  """Flax's SelfAttention pattern: a subclass calling super().__call__."""

  def __call__(self, x):
    return super().__call__(x, x, deterministic=True)


@pytest.mark.parametrize("frozen", [False, True])
def test_dtype_report_reads_the_computation(frozen):
  """Point 2: dtypes from the jaxpr, mismatches flagged, no double count."""
  from flax.core import freeze

  class ScanBody(nn.Module):
    @nn.compact
    def __call__(self, c, _):
      return nn.Dense(c.shape[-1])(c), None

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      shared = nn.Dense(x.shape[-1], name="shared")
      x = shared(shared(x))
      x, _ = nn.scan(ScanBody, variable_axes={"params": 0},
                     split_rngs={"params": True}, length=3)(name="scan")(
                         x, None)
      x = SelfAttending(num_heads=2, name="sa")(x[:, None, :])[:, 0]
      x = Float32Fields(name="flax_example")(x[:, None, None, :])
      return CastsItself(name="own_cast")(x)

  model = jl.mixed_precision(Model(), "p=f32,c=bf16,o=f32")
  x = jnp.ones((2, 4))
  variables = model.init(jax.random.key(0), x)
  if frozen:
    variables = freeze(variables)
  report = jl.dtype_report(model, variables, x)
  rows = _rows(report)
  assert rows["shared"].calls == 2
  # A layer's call of its superclass's __call__ is one call (it was
  # 2), and the scan body, traced once in the computation, one (it was 2,
  # for length 3 or 7 alike: lifted scan traces the body twice).
  assert rows["sa"].calls == 1 and rows["sa/query"].calls == 1
  assert rows["scan"].calls == 1 and rows["scan/Dense_0"].calls == 1
  assert rows["shared"].computed == "bfloat16"
  assert rows["flax_example/Conv_0"].computed == "bfloat16"  # Not float32.
  assert rows["flax_example/Conv_0"].read == "bfloat16"
  assert rows["flax_example/Conv_0"].stored == "float32"
  assert rows["own_cast"].computed == "float32"
  assert [r.path for r in report.mismatches()] == ["own_cast"]
  assert "own code" in rows["own_cast"].note and "(!) own_cast" in str(report)
  # Every param byte once: the shared layer and the scanned stack included.
  nbytes = sum(x.size * x.dtype.itemsize
               for x in jax.tree.leaves(variables["params"]))
  assert report.total_param_bytes == nbytes
  assert "<table>" in report._repr_html_()


class KeyTaker(nn.Module):
  @nn.compact
  def __call__(self, x, key):
    noise = jax.random.normal(key, x.shape, x.dtype)
    return nn.Dense(2)(x + noise), key


def test_typed_keys_pass_through_modules():
  """Point 3: a typed key argument reaches the module and comes back as is."""
  model = jl.mixed_precision(KeyTaker(), "p=f32,c=bf16,o=f32")
  key = jax.random.key(3)
  variables = model.init(jax.random.key(0), jnp.ones((1, 3)), key)
  out, key_out = model.apply(variables, jnp.ones((1, 3)), key)
  assert_dtype(out, jnp.float32)
  assert jax.dtypes.issubdtype(key_out.dtype, jax.dtypes.prng_key)
  assert (jax.random.key_data(key_out) == jax.random.key_data(key)).all()


@pytest.mark.parametrize("compute", ["bf16", "f16"])
def test_rnn_and_scan_carries_keep_their_dtype(compute):
  """Point 7: nn.RNN(LSTMCell) and a user's nn.scan with a float32 carry."""

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      y = nn.RNN(nn.LSTMCell(8))(x)
      carry = jnp.zeros((x.shape[0], 8), jnp.float32)  # Made inside.

      class Step(nn.Module):
        @nn.compact
        def __call__(self, c, xs):
          c = nn.tanh(nn.Dense(8)(c) + xs)
          return c, c

      carry, ys = nn.scan(Step, variable_broadcast="params",
                          split_rngs={"params": False}, in_axes=1,
                          out_axes=1)()(carry, y)
      return ys, carry

  model = jl.mixed_precision(Model(), f"p=f32,c={compute},o=f32")
  x = jnp.ones((2, 5, 3))
  variables = model.init(jax.random.key(0), x)
  ys, carry = model.apply(variables, x)
  assert_dtype(ys, jnp.float32)
  assert_dtype(carry, jnp.float32)
  dtype = np.dtype(jmp_lite.get_policy(f"c={compute}").compute_dtype)
  assert _dot_conv_dtypes(lambda v: model.apply(v, x), variables) == {
      (dtype, dtype)}


class CNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(4, (3, 3))(x))
    return nn.Dense(5)(x.mean(axis=(1, 2)))


def test_wrapped_model_nests_as_a_submodule():
  """Point 8: a wrapped model inside another model's compact and setup."""

  class Compact(nn.Module):
    @nn.compact
    def __call__(self, x):
      feats = jl.mixed_precision(CNN(), "p=f32,c=bf16,o=bf16")(x)
      return nn.Dense(2, name="head")(feats)  # The outer model is float32.

  class Setup(nn.Module):
    def setup(self):
      self.cnn = jl.mixed_precision(CNN(), "p=f32,c=bf16,o=bf16")
      self.head = nn.Dense(2)

    def __call__(self, x):
      return self.head(self.cnn(x))

  x = _images()
  for outer in (Compact(), Setup()):
    variables = outer.init(jax.random.key(0), x)
    for leaf in jax.tree.leaves(variables):
      assert_dtype(leaf, jnp.float32)
    ops = _dot_conv_dtypes(lambda v, outer=outer: outer.apply(v, x),
                           variables)
    bf16 = np.dtype(jnp.bfloat16)
    assert (bf16, bf16) in ops  # The CNN's conv and dense.
    assert_dtype(outer.apply(variables, x), jnp.float32)
  # The wrapped CNN's params live where the bare CNN's would.
  bare = Compact().init(jax.random.key(0), x)
  assert set(bare["params"]) == {"CNN_0", "head"}
  # Nested under an outer policy: the inner policy wins inside.
  outer = jl.mixed_precision(Compact(), "p=f32,c=f16,o=f32")
  variables = outer.init(jax.random.key(0), x)
  ops = _dot_conv_dtypes(lambda v: outer.apply(v, x), variables)
  assert ops == {(np.dtype(jnp.bfloat16),) * 2, (np.dtype(jnp.float16),) * 2}


def test_method_and_memoised_discovery():
  """``method=`` reaches the model's methods; shapes are discovered once."""

  class Model(nn.Module):
    def setup(self):
      self.enc = nn.Dense(4, dtype=jnp.float32)
      self.dec = nn.Dense(3, dtype=jnp.float32)

    def encode(self, x):
      return self.enc(x)

    def __call__(self, x):
      return self.dec(self.encode(x))

  model = jl.mixed_precision(Model(), "p=f32,c=bf16,o=f32")
  x = jnp.ones((2, 3))
  variables = model.init(jax.random.key(0), x)
  for method in ("encode", Model.encode):
    out = model.apply(variables, x, method=method)
    assert_dtype(out, jnp.float32)
    assert _dot_conv_dtypes(
        lambda v, method=method: model.apply(v, x, method=method),
        variables) == {(np.dtype(jnp.bfloat16),) * 2}
  before = len(model.memo.classes)
  for _ in range(3):
    model.apply(variables, x)
  assert len(model.memo.classes) == before + 1  # One trace per new shape.
  with pytest.raises(TypeError, match="method must be None, a method name"):
    model.apply(variables, x, method=3)


def test_a_new_method_function_is_discovered_afresh():
  """A freed ``method=`` lambda's id goes to the next lambda Python makes;
  the memo must not hand that one the freed lambda's module classes (it
  did: decode's LayerNorm then ran in bfloat16, no float32 island)."""

  class AutoEncoder(nn.Module):
    def setup(self):
      self.enc = nn.Dense(4, dtype=jnp.float32)
      self.ln = nn.LayerNorm(dtype=jnp.float32)
      self.dec = nn.Dense(6, dtype=jnp.float32)

    def __call__(self, x):
      return self.decode(self.encode(x))

    def encode(self, x):
      return self.enc(x)

    def decode(self, z):
      return self.dec(self.ln(z))

  policy = "p=f32,c=bf16,o=f32"
  x = jax.random.normal(jax.random.key(2), (2, 4))
  model = jl.mixed_precision(AutoEncoder(), policy)
  variables = model.init(jax.random.key(0), x)
  encode = lambda m, x: m.encode(x)  # noqa: E731
  model.apply(variables, x, method=encode)
  freed = id(encode)
  del encode
  decode, kept = lambda m, z: m.decode(z), []  # noqa: E731
  while id(decode) != freed and len(kept) < 64:  # CPython reuses it at once.
    kept.append(decode)
    decode = lambda m, z: m.decode(z)  # noqa: E731
  assert id(decode) == freed
  want = jl.mixed_precision(AutoEncoder(), policy).apply(
      variables, x, method=lambda m, z: m.decode(z))
  chex.assert_trees_all_equal(model.apply(variables, x, method=decode), want)
  assert "c=f32" in model.policy_for(variables, x, method=decode)["ln"]


def test_bad_inputs_name_the_value_and_the_fix():
  with pytest.raises(TypeError, match=r"instantiate the class first"):
    jl.mixed_precision(CNN, "bf16")
  with pytest.raises(ValueError, match=r"Unknown dtype 'bf17'"):
    jl.mixed_precision(CNN(), "c=bf17")
  with pytest.raises(TypeError, match=r"policy must be a jmp_lite.Policy or a"
                     r" policy string.*got int: 3"):
    jl.mixed_precision(CNN(), 3)
  with pytest.raises(TypeError, match=r"wrap a single rule in a list"):
    jl.mixed_precision(CNN(), "bf16", rules=(nn.Dense, "f32"))
  with pytest.raises(TypeError, match=r"dtype_report expects a"
                     r" jmp_lite.linen.MixedPrecision"):
    jl.dtype_report(CNN(), {}, _images())


class Counted(nn.Module):
  """Counts how often its Python code runs (once per trace when cached)."""

  calls: Any  # A _Calls.

  @nn.compact
  def __call__(self, x, train: bool = False):
    self.calls.append(x.shape)
    x = nn.Dense(8, dtype=jnp.float32)(x)
    x = nn.Dropout(0.5, deterministic=not train)(x)
    return nn.Dense(3)(nn.LayerNorm()(x))

  def with_count(self, x):
    return self(x), len(self.calls)  # A Python int: never cached.


class _Calls:
  """Shapes seen by :class:`Counted` (Flax would freeze a list field)."""

  def __init__(self):
    self.shapes = []

  def append(self, shape):
    self.shapes.append(shape)

  def clear(self):
    self.shapes.clear()

  def __len__(self):
    return len(self.shapes)

  def __getitem__(self, i):
    return self.shapes[i]


def _counted(cache_traces=True):
  calls = _Calls()
  model = jl.mixed_precision(Counted(calls), "p=f32,c=bf16,o=f32",
                             cache_traces=cache_traces)
  return model, calls


@pytest.mark.parametrize("cache_traces", [True, False])
def test_later_traces_reuse_the_traced_model(cache_traces):
  """A new ``jax.jit`` of the same call runs the model's Python once."""
  model, calls = _counted(cache_traces)
  x = jnp.ones((4, 5))
  variables = jax.jit(model.init)(jax.random.key(0), x)
  loss = lambda v, x: model.apply(v, x).astype(jnp.float32).sum()
  # A new function each time, as a notebook re-jit or an eval step is: JAX's
  # own cache of the outer function cannot help.
  new_step = lambda: jax.jit(lambda v, x: jax.value_and_grad(loss)(v, x))
  first = new_step()(variables, x)
  traced = len(calls)  # Once for the policy's discovery, once to trace.
  later = [new_step()(variables, x) for _ in range(2)]
  assert len(calls) == traced + (0 if cache_traces else 2)
  for r in later:
    chex.assert_trees_all_equal(r, first)
  n = len(calls)
  new_step()(variables, jnp.ones((2, 5)))  # A new shape traces again.
  assert calls[-1] == (2, 5) and len(calls) > n
  # The policy holds in the cached program: bf16 matmuls, fp32 output.
  assert _dot_conv_dtypes(lambda v: model.apply(v, x), variables) == {
      (np.dtype(jnp.bfloat16),) * 2}
  assert_dtype(jax.jit(model.apply)(variables, x), jnp.float32)


def test_traced_model_equals_the_uncached_one():
  """Same loss and gradients, dropout on: first trace, cache hit, uncached."""
  cached, calls = _counted(True)
  plain, _ = _counted(False)
  x = jax.random.normal(jax.random.key(1), (4, 5))
  variables = jax.jit(plain.init)(jax.random.key(0), x)
  rngs = {"dropout": jax.random.key(2)}

  def loss_and_grad(model):  # A new function, so a new outer trace.
    return jax.jit(jax.value_and_grad(lambda v: model.apply(
        v, x, train=True, rngs=rngs).astype(jnp.float32).sum()))(variables)

  want = loss_and_grad(plain)
  first = loss_and_grad(cached)
  n = len(calls)
  again = loss_and_grad(cached)
  assert len(calls) == n  # From the cache.
  for got in (first, again):
    chex.assert_trees_all_equal(got, want)


def test_cache_keys_python_arguments_and_contexts():
  """Python flags, interceptors and axis rules are never served stale."""
  model, calls = _counted()
  x = jnp.ones((4, 5))
  variables = jax.jit(model.init)(jax.random.key(0), x)
  rngs = {"dropout": jax.random.key(0)}
  run = lambda train: jax.jit(
      lambda v: model.apply(v, x, train=train, rngs=rngs))(variables)
  first = run(False)
  n = len(calls)
  assert bool(jnp.all(run(False) == first)) and len(calls) == n
  # `train` is a Python value: a new key, and dropout really runs.
  assert not bool(jnp.all(run(True) == first))
  assert len(calls) == n + 2  # Its discovery, and its trace.
  # An interceptor sees every call: nothing comes from the cache.
  seen = []

  def spy(next_fun, args, kwargs, context):
    seen.append(type(context.module).__name__)
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(spy):
    run(False)
  assert "Dense" in seen and len(calls) == n + 3
  with nn.logical_axis_rules([("batch", None)]):
    run(False)
  assert len(calls) == n + 4
  # Eager calls run op by op every time, as Flax's apply does.
  model.apply(variables, x)
  n = len(calls)
  model.apply(variables, x)
  model.apply(variables, x)
  assert len(calls) == n + 2


def test_uncacheable_calls_run_as_before():
  model, calls = _counted()
  x = jnp.ones((4, 5))
  variables = jax.jit(model.init)(jax.random.key(0), x)

  def count(v):
    out, n = model.apply(v, x, method="with_count")
    assert isinstance(n, int)  # Stays a Python int, not a traced array.
    return out

  jax.jit(count)(variables)
  n = len(calls)
  jax.jit(lambda v: count(v))(variables)
  assert len(calls) == n + 1  # Traced again: it cannot be cached,
  assert len(model.memo.uncacheable) == 1  # which was learnt once.
  # A NumPy argument stays a constant of the trace (not cached).
  xs = np.ones((4, 5), np.float32)
  jax.jit(lambda v: model.apply(v, xs))(variables)
  n = len(calls)
  jax.jit(lambda v: model.apply(v, xs))(variables)
  assert len(calls) == n + 1
  with pytest.raises(TypeError, match=r"cache_traces must be a bool, got 1"):
    jl.mixed_precision(Counted(_Calls()), "bf16", cache_traces=1)


# -- Flax's own tools on the wrapper ------------------------------------------

class MLP(nn.Module):
  """Written as Flax's examples write it: ``dtype=jnp.float32`` on layers."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(4, dtype=jnp.float32)(x))
    return nn.Dense(3, dtype=jnp.float32)(x)


def test_tabulate_shows_the_model_under_the_policy():
  """``model.tabulate`` raised a bare AssertionError (an unbound wrapper)."""
  model = jl.mixed_precision(MLP(), "p=f32,c=bf16,o=f32")
  x = jnp.ones((2, 3))
  table = model.tabulate(jax.random.key(0), x,
                         console_kwargs={"width": 200})
  table = re.sub(r"\x1b\[[0-9;]*m", "", table)  # Rich's colours.
  rows = {line.split("│")[1].strip(): line for line in table.splitlines()
          if line.startswith("│") and line.split("│")[2].strip()}
  # The root row is the model's, as for the bare model: the caller's
  # inputs, the policy's output dtype.
  assert re.search(r"MLP\s*│\s*float32\[2,3\]\s*│\s*float32\[2,3\]", rows[""])
  assert re.search(r"Dense\s*│\s*bfloat16\[2,3\]\s*│\s*bfloat16\[2,4\]",
                   rows["Dense_0"])
  assert "Total Parameters: 31" in table


def test_init_and_apply_inside_intercept_methods():
  """An interceptor saw the wrapper's unbound ``init``/``apply`` (and its
  bookkeeping methods); one reading ``context.module.path`` raised."""
  model = jl.mixed_precision(MLP(), "p=f32,c=bf16,o=f32")
  x = jnp.ones((2, 3))
  seen = []

  def interceptor(next_fun, args, kwargs, context):
    seen.append((type(context.module).__name__, context.method_name,
                 "/".join(context.module.path)))
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(interceptor):
    variables = model.init(jax.random.key(0), x)
    out = jax.jit(model.apply)(variables, x)
  assert_dtype(out, jnp.float32)
  wrapper_calls = {m for n, m, _ in seen if n == "MixedPrecision"}
  assert wrapper_calls == {"setup", "jmp_lite_policy"}
  assert ("MLP", "__call__", "") in seen
  assert ("Dense", "__call__", "Dense_1") in seen
  # The policy still runs inside someone else's interceptor.
  with nn.intercept_methods(interceptor):
    ops = _dot_conv_dtypes(lambda v: model.apply(v, x), variables)
  assert ops == {(np.dtype(jnp.bfloat16),) * 2}


class AutoEncoder(nn.Module):
  """Setup-style, with methods other than ``__call__`` (as Flax's VAE)."""

  def setup(self):
    self.encoder = nn.Dense(4, dtype=jnp.float32)
    self.decoder = nn.Dense(3, dtype=jnp.float32)

  def __call__(self, x):
    return self.decode(self.encode(x))

  def encode(self, x):
    return nn.relu(self.encoder(x))

  def decode(self, z):
    return self.decoder(z)


class BackboneHead(nn.Module):
  """A float32 head on an AutoEncoder backbone under its own policy."""

  backbone_policy: str

  def setup(self):
    self.backbone = jl.mixed_precision(AutoEncoder(), self.backbone_policy)
    self.head = nn.Dense(2, dtype=jnp.float32)

  def __call__(self, x):
    return self.head(self.backbone(x))

  def features(self, x):
    return self.head(self.backbone.encode(x)[:, :3])


def test_wrapped_models_methods_through_the_wrapper_as_a_submodule():
  """``self.backbone.encode(x)`` raised AttributeError: the wrapper only had
  ``__call__``. Now every method of the model runs under its policy."""

  class Compact(nn.Module):
    @nn.compact
    def __call__(self, x):
      backbone = jl.mixed_precision(AutoEncoder(), "p=f32,c=bf16,o=bf16")
      z = backbone.encode(x)
      return nn.Dense(2, dtype=jnp.float32)(backbone.decode(z))

  x = jnp.ones((2, 3))
  bf16, f32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
  setup_style = BackboneHead("p=f32,c=bf16,o=bf16")
  for outer, method, backbone in ((setup_style, "features", "backbone"),
                                  (Compact(), None, "AutoEncoder_0")):
    variables = outer.init(jax.random.key(0), x, method=method)
    assert set(variables["params"][backbone]) >= {"encoder"}
    for leaf in jax.tree.leaves(variables):
      assert_dtype(leaf, jnp.float32)
    fn = lambda v, outer=outer, method=method: outer.apply(  # noqa: E731
        v, x, method=method)
    ops = {stack.rsplit("/", 1)[-1]: d for _, d, stack
           in matmul_dtypes(jax.make_jaxpr(fn)(variables))}
    # The backbone's matmuls ran in bfloat16, the outer model's in float32.
    want = {"encoder": (bf16, bf16), "head": (f32, f32)} if method else {
        "encoder": (bf16, bf16), "decoder": (bf16, bf16),
        "Dense_0": (f32, f32)}
    assert ops == want
    assert_dtype(fn(variables), jnp.float32)
  # Flax's capture_intermediates records the backbone's output once, as for
  # the bare model (the wrapper's own `__call__` was recorded too).
  variables = setup_style.init(jax.random.key(0), x)
  _, state = setup_style.apply(variables, x, capture_intermediates=True,
                           mutable=["intermediates"])
  assert len(state["intermediates"]["backbone"]["__call__"]) == 1
  # At the top, `method=model.encode` is Flax's idiom and means "encode".
  model = jl.mixed_precision(AutoEncoder(), "p=f32,c=bf16,o=f32")
  variables = model.init(jax.random.key(0), x)
  assert _dot_conv_dtypes(
      lambda v: model.apply(v, x, method=model.encode), variables) == {
          (bf16, bf16)}
  assert_dtype(model.apply(variables, x, method=model.encode), jnp.float32)
  with pytest.raises(AttributeError, match="no attribute"):
    model.enocde  # noqa: B018



class SownAttention(nn.Module):
  attention_fn: Any

  @nn.compact
  def __call__(self, x):
    return nn.MultiHeadDotProductAttention(
        num_heads=2, attention_fn=self.attention_fn)(
            x, x, deterministic=True, sow_weights=True)


def test_float32_attention_sows_its_weights_into_intermediates():
  """With sow_weights=True linen attention passes module=: it was dropped."""
  x = jax.random.normal(jax.random.key(1), (2, 5, 16))
  variables = SownAttention(nn.dot_product_attention).init(
      jax.random.key(0), x)
  _, ref = SownAttention(nn.dot_product_attention).apply(
      variables, x, mutable=["intermediates"])
  expected = ref["intermediates"]["MultiHeadDotProductAttention_0"][
      "attention_weights"][0]
  for policy, atol in ((None, 1e-6), ("p=f32,c=bf16,o=f32", 1e-2)):
    model = SownAttention(jl.dot_product_attention_fp32)
    if policy is not None:
      model = jl.mixed_precision(model, policy)
    _, state = model.apply(variables, x, mutable=["intermediates"])
    sown = state["intermediates"]["MultiHeadDotProductAttention_0"][
        "attention_weights"][0]
    assert sown.dtype == jnp.float32
    chex.assert_trees_all_close(sown, expected, atol=atol)


class DropoutAttention(nn.Module):
  attention_fn: Any

  @nn.compact
  def __call__(self, x):
    return nn.MultiHeadDotProductAttention(
        num_heads=2, dropout_rate=0.5, attention_fn=self.attention_fn)(
            x, x, deterministic=False, sow_weights=True)


def test_float32_attention_applies_linens_attention_dropout():
  """Linen passes only the keyword arguments attention_fn names; with
  **kwargs it got no dropout_rng/dropout_rate: attention dropout was off,
  silently (found by a review)."""
  x = jax.random.normal(jax.random.key(1), (2, 5, 16))
  rngs = {"dropout": jax.random.key(7)}
  variables = DropoutAttention(nn.dot_product_attention).init(
      jax.random.key(0), x)
  outs = {}
  for name, fn in (("flax", nn.dot_product_attention),
                   ("fp32", jl.dot_product_attention_fp32)):
    outs[name] = DropoutAttention(fn).apply(
        variables, x, rngs=rngs, mutable=["intermediates"])
  (y, sown), (ref, ref_sown) = outs["fp32"], outs["flax"]
  chex.assert_trees_all_close(y, ref, atol=1e-5)   # The same dropout mask.
  no_dropout = DropoutAttention(nn.dot_product_attention).apply(
      variables, x, rngs={"dropout": jax.random.key(8)},
      mutable=["intermediates"])[0]
  assert not np.allclose(np.asarray(y), np.asarray(no_dropout), atol=1e-3)
  # Sown before dropout, as Flax sows: rows are softmaxes.
  weights = sown["intermediates"]["MultiHeadDotProductAttention_0"][
      "attention_weights"][0]
  chex.assert_trees_all_close(weights.sum(-1), jnp.ones(weights.shape[:-1]),
                              atol=1e-5)
  chex.assert_trees_all_close(sown, ref_sown, atol=1e-6)


def test_float32_attention_names_a_bad_module():
  q = jnp.ones((1, 3, 2, 4))
  with pytest.raises(TypeError, match="module= must be a flax linen or nnx"):
    jl.dot_product_attention_fp32(q, q, q, module="encoder")


def test_report_accepts_the_float32_attention_helper_not_user_casts():
  """``dot_product_attention_fp32`` (float32 on purpose) was flagged as a
  mismatch, like a user's own cast; only the user's cast should be."""

  class SelfAttention(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
      mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
      return nn.MultiHeadDotProductAttention(
          num_heads=2, attention_fn=jl.dot_product_attention_fp32,
          dropout_rate=0.1, deterministic=not train, dtype=jnp.float32)(
              x, x, mask=mask)

  class HandRolled(nn.Module):
    """Calls the helper, and casts to float32 itself for another matmul."""

    @nn.compact
    def __call__(self, x):
      q = x.reshape(x.shape[:2] + (2, -1))
      y = jl.dot_product_attention_fp32(q, q, q).reshape(x.shape)
      w = self.param("w", nn.initializers.ones, (x.shape[-1], x.shape[-1]))
      return x + y.astype(jnp.float32) @ w.astype(jnp.float32)

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
      x = SelfAttention(name="attn")(x, train)
      x = HandRolled(name="hand")(x)
      return CastsItself(name="own_cast")(x)

  model = jl.mixed_precision(Model(), "p=f32,c=bf16,o=f32")
  x = jax.random.normal(jax.random.key(0), (2, 5, 8))
  rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
  variables = model.init(rngs, x)
  report = jl.dtype_report(model, variables, x,
                           rngs={"dropout": jax.random.key(2)})
  rows = _rows(report)
  # The facts are still shown: the helper's logits ran in float32.
  assert rows["attn/MultiHeadDotProductAttention_0"].computed == (
      "bfloat16,float32")
  assert rows["attn/MultiHeadDotProductAttention_0/query"].computed == (
      "bfloat16")
  assert [r.path for r in report.mismatches()] == ["hand", "own_cast"]
  assert "float32_region" in rows["own_cast"].note


def test_nested_policy_in_setup_reports_its_own_modules():
  """A policy nested in a parent under another policy: the outer policy saw
  the inner one's discovery trace as its own modules (``encoder`` at the
  top, inputs cast to bfloat16) and the report flagged the inner float16
  matmuls as the outer root's own code."""

  model = jl.mixed_precision(BackboneHead("f16"), "p=f32,c=bf16,o=f32")
  x = jnp.ones((2, 3))
  variables = model.init(jax.random.key(0), x)
  report = jl.dtype_report(model, variables, x)
  rows = _rows(report)
  assert set(rows) == {"", "backbone", "backbone/encoder", "backbone/decoder",
                       "head"}
  assert rows["backbone/encoder"].computed == "float16"
  assert rows["backbone/encoder"].inputs == "float16"
  assert rows["backbone"].policy == "p=f16,c=f16,o=f16"
  assert rows["head"].computed == "bfloat16" and rows[""].computed == "-"
  assert not report.mismatches()
  assert set(model.policy_for(variables, x)) == {"", "backbone", "head"}


class _NormBetween(nn.Module):
  """Dense -> LayerNorm -> Dense, the norm's input shaped (4, 16) alone."""

  hand: bool = False  # The policy's layout written out with dtype= and remat.

  @nn.compact
  def __call__(self, x):
    dtype = jnp.bfloat16 if self.hand else None
    h = nn.Dense(16, dtype=dtype)(x.astype(dtype) if self.hand else x)
    if self.hand:
      h = nn.remat(nn.LayerNorm)(dtype=jnp.float32)(h).astype(dtype)
    else:
      h = nn.LayerNorm()(h)
    out = nn.Dense(12, dtype=dtype)(h)
    return out.astype(jnp.float32) if self.hand else out


def _residuals(apply, params, x):
  """The arrays the backward pass keeps (the vjp's closure), params aside."""
  _, vjp_fn = jax.vjp(lambda p: apply({"params": p}, x), params)
  given = {id(p) for p in jax.tree.leaves(params)}
  return [r for r in jax.tree.leaves(vjp_fn)
          if hasattr(r, "dtype") and id(r) not in given
          and r.dtype != jax.dtypes.float0]


def test_remat_norms_saves_the_norms_bfloat16_input():
  """remat_norms saved the norm's input after its cast to float32: the
  cast now runs inside the recomputed region, so the backward pass keeps
  the bfloat16 input, byte for byte what a hand-written nn.remat keeps."""
  x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8)),
                  jnp.float32)
  saved = {}
  for remat in (False, True):
    model = jl.mixed_precision(_NormBetween(), "p=f32,c=bf16,o=f32",
                               remat_norms=remat)
    params = model.init(jax.random.key(0), x)["params"]
    saved[remat] = _residuals(model.apply, params, x)
  hand = _NormBetween(hand=True)
  hand_saved = _residuals(hand.apply,
                          hand.init(jax.random.key(0), x)["params"], x)

  def norm_inputs(rs):
    return sorted(str(r.dtype) for r in rs if r.shape == (4, 16))

  # Without remat the norm keeps float32 intermediates of its input's shape.
  assert "float32" in norm_inputs(saved[False])
  # With it: the norm's input and the next Dense's, both bfloat16.
  assert norm_inputs(saved[True]) == ["bfloat16", "bfloat16"]
  assert sorted((r.shape, str(r.dtype)) for r in saved[True]) == sorted(
      (r.shape, str(r.dtype)) for r in hand_saved)
  nbytes = lambda rs: sum(r.size * r.dtype.itemsize for r in rs)
  assert nbytes(saved[True]) == nbytes(hand_saved)
  assert nbytes(saved[True]) < nbytes(saved[False])
