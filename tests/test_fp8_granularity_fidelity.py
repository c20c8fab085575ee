"""Row, block and MXFP8 training against bfloat16 (issue 32's fidelity).

The same two tasks as ``tests/test_fp8.py``'s fidelity test (the digits MLP
and the one-block char-level Transformer of ``jmp_lite.examples``, bfloat16
compute, float32 params, Adam 3e-4 for 300 steps), with every FP8 matmul of
the per-tensor runs now scaled per row, in DeepSeek-V3's 1x128 / 128x128
blocks (partial edge tiles at the char-LM's 64-wide layers) or in MX blocks.
Required: the held-out loss within 2% of bfloat16's and the accuracy within
2 points.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from jmp_lite import fp8
from tests.conftest import FIDELITY_SETTINGS
from tests.test_fp8 import FIDELITY_TASKS

RECIPES = {
    "row": fp8.CurrentScaling(granularity="row"),
    "block": fp8.CurrentScaling(granularity="block", block_size=128),
    "mx": fp8.MXFP8(),
}


@pytest.fixture(scope="module", params=list(FIDELITY_TASKS))
def task_and_reference(request, optimized_codegen):
  if request.param == "digits":
    pytest.importorskip("sklearn")
  task = functools.partial(FIDELITY_TASKS[request.param], **FIDELITY_SETTINGS)
  return request.param, task, task(None)


@pytest.mark.slow   # 300-step trainings, as tests/test_fp8.py's fidelity
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_granularity_training_matches_bfloat16(task_and_reference, recipe):
  name, task, (ref_loss, ref_acc) = task_and_reference
  loss, acc = task(RECIPES[recipe])
  print(f"\nfp8 {recipe} fidelity {name}: eval loss {float(loss):.4f}"
        f" (bf16 {float(ref_loss):.4f}), accuracy {float(acc):.4f}"
        f" (bf16 {float(ref_acc):.4f})")
  assert np.isfinite(float(loss))
  assert float(loss) <= 1.02 * float(ref_loss), (name, recipe, loss, ref_loss)
  assert float(acc) >= float(ref_acc) - 0.02
