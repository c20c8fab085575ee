"""The real models of ``tests/models`` trained in pure half precision.

As ``preset("O3")`` trains them: half params with float32 norm islands, no
float32 master copy, Adam's moments stored in bfloat16 and computed in
float32, and the params updated with Kahan summation (``O3``, ``O3-f16``)
or stochastic rounding (``O3-sr``), one :func:`jmp_lite.update_and_apply`
per donated, jitted step. :func:`tests.models.harness.check` asserts every
matmul's operand dtypes in the loss and its gradient, the dtypes of params,
moments and Kahan buffers before and after training, and the losses must
track float32's. Every model runs under ``O3``; the other two recipes run on
one model per framework (``O3-f16`` includes the two that diverged while
the preset stored float16 params' moments in float16). ``nnx_tied_lm`` has
no float16 run: XLA:CPU cannot compile nnx's float16 attention.
"""

from __future__ import annotations

import pytest

from tests.models import harness
from tests.models.harness import O3_SETTINGS
from tests.models.test_real_models import _float32_losses, CASES

# The model zoo: each case trains a real model (5-60 s); CI's slow set.
pytestmark = pytest.mark.slow

PAIRS = ([(name, "O3") for name in CASES]
         + [(name, "O3-sr") for name in ("linen_tagger", "nnx_cnn",
                                         "eqx_mlp")]
         + [(name, "O3-f16") for name in ("linen_tagger", "nnx_cnn",
                                          "eqx_mlp")])


@pytest.mark.parametrize("name,setting", PAIRS)
def test_model_in_pure_half_precision(name, setting):
  build, matmuls = CASES[name]
  reference = _float32_losses(name)
  losses = harness.check(build(O3_SETTINGS[setting]), O3_SETTINGS[setting],
                         matmuls=matmuls)
  harness.assert_trains_like_float32(losses, reference)
