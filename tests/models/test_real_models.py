"""Models shaped like users' code, in every framework, under every setting.

Each model is written the way the public examples of its framework write
them (``tests/models/*_models.py``), or shipped by a package
(``eqx.nn.MLP``, ``hk.nets.ResNet18``), and put under a policy *unedited*.
:func:`tests.models.harness.check` asserts the dtypes of every matmul and
convolution in the loss and its gradient, of params, gradients, optimizer
state and outputs, and trains with a donated jitted step; the losses must
track float32's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite.linen as jl
from tests.conftest import full_codegen
from tests.models import harness
from tests.models.harness import Case, cross_entropy, island_paths, SETTINGS

# The model zoo: each case trains a real model (5-60 s); CI's slow set.
pytestmark = pytest.mark.slow

SETTING_NAMES = list(SETTINGS)


def _images(shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape),
                     jnp.float32)


def _labels(n, classes, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, classes, n))


# -- Flax linen -------------------------------------------------------------

def linen_resnet(setting):
  from tests.models.linen_models import ResNet
  model = jl.mixed_precision(ResNet(), setting.policy)
  # Two "devices" of 4 images each: BatchNorm's axis_name="batch" is bound
  # by vmap, as pmap binds it in Flax's ImageNet example.
  x = _images((2, 4, 8, 8, 3))
  y = _labels(8, 10).reshape(2, 4)
  variables = jax.jit(model.init)(jax.random.key(0), x[0])
  per_device = lambda v, x: model.apply(v, x, mutable=["batch_stats"])

  def loss(params, state, batch, rng):
    del rng
    x, y = batch
    logits, new = jax.vmap(per_device, in_axes=(None, 0), axis_name="batch")(
        {"params": params, **state}, x)
    new = jax.tree.map(lambda s: s[0], new)  # pmean'd: equal on devices.
    return cross_entropy(logits.reshape(-1, 10), y.reshape(-1)), (logits, new)

  return Case(variables["params"], {"batch_stats": variables["batch_stats"]},
              loss, (x, y), island_paths(r"(^|/)(bn_init|BatchNorm_\d+|"
                                         r"proj_norm)/"))


def linen_decoder(setting):
  from tests.models.linen_models import Decoder
  model = jl.mixed_precision(Decoder(), setting.policy)
  tokens = _labels(4 * 8, 32).reshape(4, 8)
  variables = jax.jit(model.init)({"params": jax.random.key(0),
                                   "dropout": jax.random.key(1)}, tokens)

  def loss(params, state, batch, rng):
    logits = model.apply({"params": params}, batch[:, :-1],
                         rngs={"dropout": rng})
    return cross_entropy(logits, batch[:, 1:]), (logits, state)

  return Case(variables["params"], {}, loss, tokens,
              island_paths(r"LayerNorm_\d+/", r"final_norm/"), lr=1e-2)


def linen_tagger(setting):
  from tests.models.linen_models import Tagger
  model = jl.mixed_precision(Tagger(), setting.policy)
  tokens = _labels(4 * 6, 32).reshape(4, 6)
  tags = tokens % 5
  params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]

  def loss(params, state, batch, rng):
    del rng
    logits = model.apply({"params": params}, batch[0])
    return cross_entropy(logits, batch[1]), (logits, state)

  return Case(params, {}, loss, (tokens, tags), lambda p: False, lr=1e-2)


# -- Flax nnx ---------------------------------------------------------------

def _nnx_case(module, setting, batch, call, island, float32_cotangents=()):
  from flax import nnx

  import jmp_lite.nnx as jnnx
  model = jnnx.mixed_precision(module, setting.policy)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params, state, batch, rng):
    m = nnx.merge(graphdef, params, state)
    out = call(m, batch, rng)
    return cross_entropy(out, batch[1]), (out, nnx.split(m, nnx.Param, ...)[2])

  return Case(params, rest, loss, batch, island,
              float32_cotangents=float32_cotangents)


def nnx_cnn(setting):
  from flax import nnx

  from tests.models.nnx_models import CNN

  def call(m, batch, rng):
    return m(batch[0], rngs=nnx.Rngs(dropout=rng))  # Rngs at call time.

  return _nnx_case(CNN(rngs=nnx.Rngs(0)), setting,
                   (_images((4, 12, 12, 1)), _labels(4, 10)), call,
                   lambda p: False)


def nnx_tied_lm(setting):
  from flax import nnx

  from tests.models.nnx_models import TiedLM
  tokens = _labels(4 * 8, 32).reshape(4, 8)
  # nnx attention without dropout calls jax.nn.dot_product_attention, whose
  # backward multiplies the float32 softmax cotangent by the half keys.
  return _nnx_case(TiedLM(rngs=nnx.Rngs(0)), setting,
                   (tokens[:, :-1], tokens[:, 1:]),
                   lambda m, batch, rng: m(batch[0]),
                   island_paths(r"norm"),
                   float32_cotangents=("BTNH,BSNH->BNTS",))


# -- Equinox ----------------------------------------------------------------

def _eqx_case(module, setting, batch, island):
  eqx = pytest.importorskip("equinox")
  import jmp_lite.equinox as jeqx
  model = jeqx.mixed_precision(module, setting.policy)
  params, static = eqx.partition(model, eqx.is_array)

  def loss(params, state, batch, rng):
    del rng
    m = eqx.combine(params, static)
    out = jax.vmap(m)(batch[0])
    return cross_entropy(out, batch[1]), (out, state)

  return Case(params, {}, loss, batch, island,
              apply_updates=eqx.apply_updates)


def eqx_cnn(setting):
  pytest.importorskip("equinox")
  from tests.models.eqx_models import CNN
  return _eqx_case(CNN(jax.random.key(0)), setting,
                   (_images((8, 1, 12, 12)), _labels(8, 10)),
                   island_paths(r"layers/6/"))


def eqx_mlp(setting):
  eqx = pytest.importorskip("equinox")
  return _eqx_case(eqx.nn.MLP(6, 10, 32, 2, key=jax.random.key(0)), setting,
                   (_images((8, 6)), _labels(8, 10)), lambda p: False)


# -- Haiku (jmp drop-in) ----------------------------------------------------

@pytest.fixture
def haiku_policies():
  hk = pytest.importorskip("haiku")
  yield hk
  hk.mixed_precision.clear_policy(hk.nets.ResNet18)
  hk.mixed_precision.clear_policy(hk.BatchNorm)


def haiku_resnet18(setting, hk):
  policy = jmp_lite.get_policy(setting.policy)
  hk.mixed_precision.set_policy(hk.nets.ResNet18, policy)
  # Haiku's own recipe: batch norm in float32, handing back compute dtype.
  hk.mixed_precision.set_policy(
      hk.BatchNorm, policy.with_param_dtype("f32").with_compute_dtype(
          "f32").with_output_dtype(policy.compute_dtype))
  net = hk.transform_with_state(
      lambda x, train: hk.nets.ResNet18(10)(x, is_training=train))
  # 32x32 and 8 images: the last stage is 1x1, so its BatchNorm normalises
  # over the batch alone; fewer images make its backward pass explode.
  x, y = _images((8, 32, 32, 3)), _labels(8, 10)
  # Jitted, as for the other models: eager, each of its ops compiles alone.
  params, state = jax.jit(net.init, static_argnums=2)(jax.random.key(0), x,
                                                      True)

  def loss(params, state, batch, rng):
    logits, new_state = net.apply(params, state, rng, batch[0], True)
    return cross_entropy(logits, batch[1]), (logits, new_state)

  return Case(params, state, loss, (x, y), island_paths(r"batchnorm"),
              lr=1e-3)


import jmp_lite  # noqa: E402  (after the case builders, used above lazily)

CASES = {
    "linen_resnet": (linen_resnet, 2),
    "linen_decoder": (linen_decoder, 2),
    "linen_tagger": (linen_tagger, 2),
    "nnx_cnn": (nnx_cnn, 2),
    "nnx_tied_lm": (nnx_tied_lm, 2),
    "eqx_cnn": (eqx_cnn, 2),
    "eqx_mlp": (eqx_mlp, 2),
}


@functools.cache
def _float32_losses(name: str) -> np.ndarray:
  build, matmuls = CASES[name]
  return harness.check(build(SETTINGS["f32"]), SETTINGS["f32"],
                       matmuls=matmuls)


@pytest.mark.parametrize("setting", SETTING_NAMES)
@pytest.mark.parametrize("name", list(CASES))
def test_model_under_policy(name, setting):
  if (name == "nnx_tied_lm" and setting == "f16"
      and jax.default_backend() == "cpu"):
    pytest.skip("XLA:CPU cannot compile nnx attention's float16 x float16 ->"
                " float32 dot_general, with or without jmp_lite")
  build, matmuls = CASES[name]
  reference = _float32_losses(name)
  if setting == "f32":
    losses = reference
  else:
    losses = harness.check(build(SETTINGS[setting]), SETTINGS[setting],
                           matmuls=matmuls)
  harness.assert_trains_like_float32(losses, reference)


@pytest.mark.parametrize("setting", ["bf16", "f16"])
def test_haiku_resnet18_through_set_policy(setting, haiku_policies):
  hk = haiku_policies
  case = haiku_resnet18(SETTINGS[setting], hk)
  with full_codegen():  # Its half-precision convolutions run 4x faster.
    losses = harness.check(case, SETTINGS[setting], matmuls=10)
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
