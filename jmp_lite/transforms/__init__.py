"""optax transformations: skip non-finite updates and keep a loss scale.

:func:`skip_nonfinite` and :func:`loss_scaled` ("guards") check the incoming
gradients once, run the inner optimizer, and on a non-finite step hand on
``-0.0`` updates and the inner state bit for bit unchanged. How the skip is
compiled is the guard's ``skip_with`` option:

* ``"cond"``: one ``lax.cond`` around "unscale, inner update"; nothing of the
  inner optimizer runs on a skipped step, and its state never passes through
  a select. On XLA:CPU this is what lets a donated train step update the
  optimizer's moments in place (a select there forces copies of every
  moment). :func:`jmp_lite.update_and_apply` goes further and puts the
  parameter update inside the same branch.
* ``"select"``: the inner optimizer always runs and ``lax.select`` keeps the
  previous state when the step is skipped: branch-free, no predicate for the
  host to read. Used whenever the decision is not known before the inner
  update runs (``check_updates``, a loss scale that may drop below 1).
* ``"auto"`` (default): ``"cond"`` on the CPU, where it is measured cheaper
  (``benchmarks/loss_scaling_overhead.py``); ``"select"`` on GPU and TPU.
  Measured on an H100 (``benchmarks/gpu_step.py``, Adam on an MLP), the two
  are the same program there: XLA:GPU turns the ``lax.cond`` into selects
  fused into the optimizer's kernels (no conditional, no predicate read by
  the host), with equal bytes and time. Other optimizers are unmeasured, and
  so is TPU: run ``benchmarks/gpu_step.py`` there and pass ``skip_with=``
  the faster one.

Skipped steps are bit-identical either way; applied steps agree up to float
rounding (XLA fuses the same arithmetic differently in the two programs).
"""

from __future__ import annotations

from jmp_lite.transforms._config import GuardConfig
from jmp_lite.transforms._lookup import (
  current_loss_scale,
  loss_scaled_state,
  NonFiniteHaltError,
  raise_if_halted,
)
from jmp_lite.transforms._loss_scaled import (
  default_loss_scale,
  loss_scaled,
  LossScaledState,
)
from jmp_lite.transforms._skip_nonfinite import (
  skip_nonfinite,
  SkipNonfiniteState,
)

__all__ = ["GuardConfig", "LossScaledState", "NonFiniteHaltError",
           "SkipNonfiniteState", "current_loss_scale", "default_loss_scale",
           "loss_scaled", "loss_scaled_state", "raise_if_halted",
           "skip_nonfinite"]

# Everything public names this package as its home: reprs, the API docs and
# pickles (which find a class by module and name, as pickles made before the
# split did) never see the private modules.
for _name in __all__:
  globals()[_name].__module__ = __name__
