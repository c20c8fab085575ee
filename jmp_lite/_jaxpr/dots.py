"""Matmuls and convolutions in a jaxpr: their dimensions and FLOPs.

``dot_general`` is read through its dimension numbers: ``M`` (the left
operand's free dimensions), ``N`` (the right's), ``K`` (contracted) and the
batch dimensions; a convolution through its kernel's layout.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

MATMULS = ("dot_general", "conv_general_dilated")
"""The primitives counted as matmuls (the tensor-core work)."""


def is_matmul(eqn: Any) -> bool:
  """Whether ``eqn`` is a ``dot_general`` or ``conv_general_dilated``.

  Args:
    eqn: a jaxpr equation.

  Returns:
    ``True`` for a matmul or convolution.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jmp_lite._jaxpr import is_matmul, walk
    >>> closed = jax.make_jaxpr(lambda a: jnp.tanh(a @ a))(jnp.ones((2, 2)))
    >>> [is_matmul(s.eqn) for s in walk(closed)]
    [True, False]
  """
  return eqn.primitive.name in MATMULS


def _dot_sizes(eqn: Any) -> tuple[int, int, int, int]:
  """``(batch, M, N, K)`` of a ``dot_general`` equation."""
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  lhs = eqn.invars[0].aval.shape
  rhs = eqn.invars[1].aval.shape
  batch = math.prod(lhs[i] for i in lb)
  m = math.prod(d for i, d in enumerate(lhs) if i not in lc and i not in lb)
  n = math.prod(d for i, d in enumerate(rhs) if i not in rc and i not in rb)
  k = math.prod(lhs[i] for i in lc)
  return batch, m, n, k


def matmul_dims(eqn: Any) -> dict[str, int]:
  """The dimensions tensor cores see in a matmul or convolution.

  Args:
    eqn: a ``dot_general`` or ``conv_general_dilated`` equation.

  Returns:
    ``{"M": ..., "N": ..., "K": ...}`` for ``dot_general`` (batch dimensions
    excluded), ``{"out_channels": ..., "in_channels": ...}`` for a
    convolution (all groups' input channels).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jmp_lite._jaxpr import matmul_dims, walk
    >>> closed = jax.make_jaxpr(lambda a, b: jnp.einsum("bij,bjk->bik", a, b))(
    ...     jnp.ones((5, 3, 7)), jnp.ones((5, 7, 9)))
    >>> [matmul_dims(s.eqn) for s in walk(closed)]
    [{'M': 3, 'N': 9, 'K': 7}]
  """
  if eqn.primitive.name == "dot_general":
    _, m, n, k = _dot_sizes(eqn)
    return {"M": m, "N": n, "K": k}
  dn = eqn.params["dimension_numbers"]
  rhs = eqn.invars[1].aval.shape
  groups = eqn.params.get("feature_group_count", 1)
  return {"out_channels": rhs[dn.rhs_spec[0]],
          "in_channels": rhs[dn.rhs_spec[1]] * groups}


def matmul_flops(eqn: Any) -> float:
  """Floating-point operations of one run of a matmul or convolution.

  Args:
    eqn: a jaxpr equation.

  Returns:
    ``2 * batch * M * N * K`` for ``dot_general``; for a convolution, 2 per
    multiply-add (output elements times the kernel's size per output
    feature); ``0.0`` for any other primitive.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jmp_lite._jaxpr import matmul_flops, walk
    >>> closed = jax.make_jaxpr(lambda a, b: jnp.einsum("bij,bjk->bik", a, b))(
    ...     jnp.ones((5, 3, 7)), jnp.ones((5, 7, 9)))
    >>> [matmul_flops(s.eqn) for s in walk(closed)]  # 2 * 5 * 3 * 9 * 7
    [1890.0]
  """
  name = eqn.primitive.name
  if name == "dot_general":
    batch, m, n, k = _dot_sizes(eqn)
    # The output holds batch * M * N elements, each a K-long dot product.
    return 2.0 * (batch * m * n) * k
  if name == "conv_general_dilated":
    rhs = eqn.invars[1].aval.shape
    out = eqn.outvars[0].aval.shape
    dn = eqn.params["dimension_numbers"]
    out_features = rhs[dn.rhs_spec[0]]
    # MACs per output element = product of the kernel's other dimensions.
    per_output = math.prod(rhs) / out_features
    return 2.0 * math.prod(out) * per_output
  return 0.0


def operand_dtype_names(eqn: Any) -> tuple[str, str]:
  """The dtype names of a matmul's two operands.

  Args:
    eqn: a ``dot_general`` or ``conv_general_dilated`` equation.

  Returns:
    E.g. ``("bfloat16", "bfloat16")``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jmp_lite._jaxpr import operand_dtype_names, walk
    >>> closed = jax.make_jaxpr(lambda a, b: a @ b.astype(jnp.bfloat16))(
    ...     jnp.ones((2, 2), jnp.bfloat16), jnp.ones((2, 2)))
    >>> [operand_dtype_names(s.eqn) for s in walk(closed) if s.primitive
    ...  == "dot_general"]
    [('bfloat16', 'bfloat16')]
  """
  lhs, rhs = eqn.invars[:2]
  return np.dtype(lhs.aval.dtype).name, np.dtype(rhs.aval.dtype).name
