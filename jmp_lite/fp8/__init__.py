"""FP8 training: scaled FP8 matmuls for plain JAX, Flax and autocast.

* :class:`CurrentScaling` (per tensor, row or block), :class:`DelayedScaling`
  and :class:`MXFP8` (32-element blocks, power-of-two scales): the recipes
  (frozen values).
* :func:`dot_general`: a ``jax.lax.dot_general`` replacement that runs a
  recipe (E4M3 operands forward, an E5M2 cotangent backward, float32
  accumulation) and plugs into Flax's ``dot_general=`` arguments.
* :class:`ScalingState` and :func:`commit`: delayed scaling's state, threaded
  as a value, advanced once per applied optimizer step.
* :func:`all_gather`: an FSDP weight gather under ``shard_map`` that moves
  FP8 payloads and reduce-scatters its gradient in float32.
* :func:`quantize`, :func:`quantization_health`, :func:`history_amax`:
  building blocks and diagnostics.
* :mod:`jmp_lite.fp8.linen` and :mod:`jmp_lite.fp8.nnx` (import them
  explicitly; they import Flax): modules for ``dot_general_cls=`` and nnx
  ``dot_general=``.

Example:
  >>> import jax, jax.numpy as jnp, jmp_lite
  >>> recipe = jmp_lite.fp8.CurrentScaling()
  >>> def loss(w, x):
  ...   dot = jmp_lite.fp8.dot_general(recipe)
  ...   return dot(x, w, (((1,), (0,)), ((), ()))).sum()
  >>> jnp.round(jax.grad(loss)(jnp.ones((3, 2)), jnp.ones((4, 3))), 4).tolist()
  [[4.0, 4.0], [4.0, 4.0], [4.0, 4.0]]
"""

from jmp_lite.fp8._commit import commit as commit
from jmp_lite.fp8._commit import history_amax as history_amax
from jmp_lite.fp8._commit import step_outcome as step_outcome
from jmp_lite.fp8._dot import dot_general as dot_general
from jmp_lite.fp8._gather import all_gather as all_gather
from jmp_lite.fp8._health import quantization_health as quantization_health
from jmp_lite.fp8._health import QuantizationHealth as QuantizationHealth
from jmp_lite.fp8._quantize import quantize as quantize
from jmp_lite.fp8._recipes import AMAX_COMPUTE as AMAX_COMPUTE
from jmp_lite.fp8._recipes import CurrentScaling as CurrentScaling
from jmp_lite.fp8._recipes import DelayedScaling as DelayedScaling
from jmp_lite.fp8._recipes import FP8_DTYPES as FP8_DTYPES
from jmp_lite.fp8._recipes import GRANULARITIES as GRANULARITIES
from jmp_lite.fp8._recipes import MXFP8 as MXFP8
from jmp_lite.fp8._recipes import ScalingState as ScalingState

__all__ = (
    "AMAX_COMPUTE",
    "CurrentScaling",
    "DelayedScaling",
    "FP8_DTYPES",
    "GRANULARITIES",
    "MXFP8",
    "QuantizationHealth",
    "ScalingState",
    "all_gather",
    "commit",
    "dot_general",
    "history_amax",
    "quantization_health",
    "quantize",
    "step_outcome",
)
