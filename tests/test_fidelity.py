"""Numerical fidelity on small real data (numbers recorded in the README).

bfloat16 and float16 + dynamic loss scaling must reach float32's final
evaluation loss within 2% (no more than 2% worse); pure float16 without loss
scaling or master weights must visibly fail.
"""

from __future__ import annotations

import numpy as np
import pytest

import jmp_lite
from jmp_lite import examples

pytest.importorskip("sklearn")

MIXED = {
    "bf16": ("p=f32,c=bf16,o=f32", None, False),
    "f16-dynamic": ("p=f32,c=f16,o=f32", None, False),
    "o2-f16-master": ("p=f16,c=f16,o=f32", "dynamic", True),
}


def _scale(kind):
  return jmp_lite.DynamicLossScale(2.0**15) if kind == "dynamic" else None


@pytest.fixture(scope="module", params=["digits", "char_lm"])
def task(request):
  train = {"digits": examples.train_digits,
           "char_lm": examples.train_char_lm}[request.param]
  return request.param, train, train("f32")


@pytest.mark.parametrize("name", list(MIXED))
def test_mixed_precision_matches_float32(task, name):
  task_name, train, ref = task
  policy, scale, master = MIXED[name]
  result = train(policy, _scale(scale), master=master)
  assert result.skipped <= 3, result.skipped
  assert np.isfinite(result.eval_loss)
  assert result.eval_loss <= 1.02 * ref.eval_loss, (
      task_name, name, result.eval_loss, ref.eval_loss)
  assert result.accuracy >= ref.accuracy - 0.02


def test_pure_float16_without_loss_scaling_fails(task):
  _, train, ref = task
  result = train("f16", jmp_lite.NoOpLossScale())
  failed = (not np.isfinite(result.eval_loss)
            or result.eval_loss > 1.5 * ref.eval_loss)
  assert failed, (result.eval_loss, ref.eval_loss)
  assert result.skipped > 0 or not np.isfinite(result.losses).all()
