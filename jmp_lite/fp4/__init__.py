"""FP4 training: NVIDIA's NVFP4 recipe and OCP's MXFP4, functional.

* :class:`NVFP4` (16-element blocks, E4M3 block scales, a float32 scale per
  tensor, 16x16 weight tiles, a random Hadamard transform on the weight
  gradient's inputs, stochastically rounded gradients), :class:`MXFP4`
  (32-element blocks, power-of-two scales) and :class:`PerDirection` (a
  format per GEMM): frozen, hashable recipes.
* :func:`dot_general`: a ``jax.lax.dot_general`` replacement running the
  forward and both gradient GEMMs on FP4 operands; plugs into Flax's
  ``dot_general=`` arguments, Equinox modules, policy rules and autocast.
* :func:`quantize_dequantize`: the FP4 values a GEMM sees of a tensor.
* :func:`quantization_health`: per-leaf FP4 error, to choose the layers
  that stay in bfloat16.
* :func:`all_gather`: an FSDP weight gather moving 4-bit codes and 8-bit
  scales (0.25x-0.28x a bfloat16 gather's bytes).
* :mod:`jmp_lite.fp4.linen` and :mod:`jmp_lite.fp4.nnx` (import them
  explicitly; they import Flax): layers that draw a fresh key per call.

Example:
  >>> import jax, jax.numpy as jnp, jmp_lite
  >>> recipe = jmp_lite.fp4.NVFP4()
  >>> def loss(w, x, key):
  ...   dot = jmp_lite.fp4.dot_general(recipe, key)
  ...   return dot(x, w, (((1,), (0,)), ((), ()))).sum()
  >>> g = jax.jit(jax.grad(loss))(jnp.ones((16, 2)), jnp.ones((4, 16)),
  ...                             jax.random.key(0))
  >>> g.shape, float(g[0, 0])
  ((16, 2), 4.0)
"""

from jmp_lite.fp4._dot import dot_general as dot_general
from jmp_lite.fp4._gather import all_gather as all_gather
from jmp_lite.fp4._health import FP4Health as FP4Health
from jmp_lite.fp4._health import quantization_health as quantization_health
from jmp_lite.fp4._quantize import quantize_dequantize as quantize_dequantize
from jmp_lite.fp4._recipes import E2M1 as E2M1
from jmp_lite.fp4._recipes import MXFP4 as MXFP4
from jmp_lite.fp4._recipes import NVFP4 as NVFP4
from jmp_lite.fp4._recipes import PerDirection as PerDirection
from jmp_lite.fp4._recipes import ROLES as ROLES

__all__ = (
    "E2M1",
    "FP4Health",
    "MXFP4",
    "NVFP4",
    "PerDirection",
    "ROLES",
    "all_gather",
    "dot_general",
    "quantization_health",
    "quantize_dequantize",
)
