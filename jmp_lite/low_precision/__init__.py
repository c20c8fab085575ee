"""Low-precision update rules: pure half-precision params that still learn.

A bfloat16 param of 1.0 ignores every update smaller than 2**-9: plain
``optax.apply_updates`` rounds ``p + u`` to the nearest bfloat16, and small
updates round away step after step. Float32 master weights fix that at 14
bytes per parameter. These transformations fix it at 6-8:

* :func:`kahan_summation` keeps each half-precision param's rounding error in
  a compensation buffer of the param's dtype and adds it back on the next
  step (Kahan's compensated summation).
* :func:`stochastic_rounding` rounds ``p + u`` up or down at random, with the
  probabilities that make the expected result exact.
* :func:`state_dtypes` stores an optimizer's state (Adam's moments) in narrow
  dtypes while the optimizer computes in float32; optax alone cannot choose
  the dtype of ``nu`` (optax issue 1552).
* :func:`quantized_states` stores it in 8 or 4 bits per element, one scale
  per block: with stochastic rounding, bfloat16 params and Adam's state
  together take about 4 bytes per parameter. :func:`quantized_adam` is
  Adam with that state, one fused kernel per param (Pallas on GPUs, C++ on
  CPUs).

Together (``kahan_summation(state_dtypes(adam, "bf16"))``) they are the
``O3`` preset's default recipe; see ``docs/low_precision.md``.

The random bits of stochastic rounding come from a counter-based hash of
(seed, step counter, leaf, element index) computed inside the fused update
kernel: no random array is materialised and no key is passed per call.
"""

from __future__ import annotations

from jmp_lite.low_precision._fused import quantized_adam
from jmp_lite.low_precision._kahan import kahan_summation, KahanState
from jmp_lite.low_precision._quantized import (
  quantized_states,
  QuantizedArray,
  QuantizedConfig,
  QuantizedStatesState,
)
from jmp_lite.low_precision._state_dtypes import (
  state_dtypes,
  StateDtypesState,
)
from jmp_lite.low_precision._stochastic_rounding import (
  stochastic_rounding,
  StochasticRoundingState,
)

__all__ = ["KahanState", "QuantizedArray", "QuantizedConfig",
           "QuantizedStatesState",
           "StateDtypesState", "StochasticRoundingState", "kahan_summation",
           "quantized_adam", "quantized_states", "state_dtypes",
           "stochastic_rounding"]

# Everything public names this package as its home: reprs, the API docs and
# pickles (which find a class by module and name, as pickles made before the
# split did) never see the private modules.
for _name in __all__:
  globals()[_name].__module__ = __name__
