"""DynamicLossScale's two hysteresis rules against plain-Python models of the
systems they come from (PaddlePaddle; Colossal-AI and Megatron-LM)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite


def paddle_schedule(finite_steps, scale, period, hysteresis, factor=2.0):
  """PaddlePaddle's update_loss_scaling: a good step clears the bad-step
  count, a bad one the good-step count; decr_every_n_nan_or_inf bad steps
  in a row back off once and clear the count."""
  good = bad = 0
  out = []
  for finite in finite_steps:
    if finite:
      good, bad = good + 1, 0
      if good == period:
        scale, good = scale * factor, 0
    else:
      good, bad = 0, bad + 1
      if bad == hysteresis:
        scale, bad = scale / factor, 0
    out.append(scale)
  return out


def colossal_schedule(finite_steps, scale, period, hysteresis, factor=2.0):
  """Colossal-AI's DynamicGradScaler (and Megatron-LM's): overflows count
  up and are never cleared by a good step or a back-off, only by a growth;
  from the hysteresis-th one on, every overflow backs off."""
  growth_step = hysteresis_step = 0
  out = []
  for finite in finite_steps:
    if not finite:
      hysteresis_step += 1
      growth_step = 0
      if hysteresis_step >= hysteresis:
        scale = scale / factor
    else:
      growth_step += 1
      if growth_step == period:
        growth_step = hysteresis_step = 0
        scale = scale * factor
    out.append(scale)
  return out


def _run(rule, finite_steps, scale, period, hysteresis):
  ls = jmp_lite.DynamicLossScale(scale, period=period, hysteresis=hysteresis,
                                 hysteresis_reset=rule, min_loss_scale=2**-60,
                                 max_loss_scale=2.0**100)
  adjust = jax.jit(lambda s, f: s.adjust(f))
  out = []
  for finite in finite_steps:
    ls = adjust(ls, jnp.asarray(finite))
    out.append(float(ls.loss_scale))
  return out


@pytest.mark.parametrize("rule,model", [("finite", paddle_schedule),
                                        ("growth", colossal_schedule)])
@pytest.mark.parametrize("seed", range(4))
def test_each_rule_follows_its_reference(rule, model, seed):
  rng = np.random.default_rng(seed)
  period, hysteresis = int(rng.integers(1, 5)), int(rng.integers(1, 4))
  steps = [bool(b) for b in rng.random(60) > rng.uniform(0.1, 0.6)]
  assert _run(rule, steps, 2.0**10, period, hysteresis) == model(
      steps, 2.0**10, period, hysteresis)


def test_an_overflow_every_other_step():
  """The issue's case: hysteresis 2, overflow every other step. Colossal-AI
  falls from 65536 to 128 in 20 steps; Paddle's rule never backs off."""
  steps = [i % 2 == 1 for i in range(20)]
  assert _run("growth", steps, 65536.0, 1000, 2)[-1] == 128.0
  assert _run("finite", steps, 65536.0, 1000, 2)[-1] == 65536.0


def test_the_rule_is_static_and_checked():
  ls = jmp_lite.DynamicLossScale(8.0, hysteresis=2, hysteresis_reset="growth")
  leaves, treedef = jax.tree.flatten(ls)
  assert jax.tree.unflatten(treedef, leaves).hysteresis_reset == "growth"
  assert "growth" not in [str(x) for x in leaves]
  with pytest.raises(ValueError, match="hysteresis_reset must be one of"):
    jmp_lite.DynamicLossScale(8.0, hysteresis_reset="consecutive")
