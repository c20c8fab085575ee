"""``dot_product_attention_fp32``: Flax's attention with a float32 softmax.

Re-exported by :mod:`jmp_lite.linen`; it takes Flax's attention parameters
by name and serves linen's and nnx's attention layers alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jmp_lite.autocasting import float32_region

__all__ = ["dot_product_attention_fp32"]


def dot_product_attention_fp32(
    query: jax.Array, key: jax.Array, value: jax.Array, bias: Any = None,
    mask: Any = None, broadcast_dropout: bool = True, dropout_rng: Any = None,
    dropout_rate: float = 0.0, deterministic: bool = False, dtype: Any = None,
    precision: Any = None, module: Any = None,
    force_fp32_for_softmax: bool = False, is_causal: bool = False,
) -> jax.Array:
  """``nn.dot_product_attention`` with logits and softmax in float32.

  Pass it as ``attention_fn=`` to ``nn.MultiHeadDotProductAttention`` or
  ``nnx.MultiHeadAttention`` (or use it in your own attention) to keep the
  numerically sensitive part of attention in float32 while the projections
  run in half precision. The weighted sum of values runs in the values'
  dtype. The float32 part runs in a :func:`jmp_lite.float32_region`, so
  :func:`dtype_report` shows its float32 matmul without flagging it.

  The parameters are Flax's own, by name: linen's attention passes only the
  keyword arguments its ``attention_fn`` names, so attention dropout works
  as with ``nn.dot_product_attention``.

  Args:
    query: ``[..., q, heads, depth]``.
    key: ``[..., k, heads, depth]``.
    value: ``[..., k, heads, depth_v]``.
    bias: optional additive logits bias.
    mask: optional boolean mask.
    broadcast_dropout: one dropout mask for all batch dimensions.
    dropout_rng: the dropout key (``None``: no dropout).
    dropout_rate: the attention weights' dropout rate.
    deterministic: no dropout when true.
    dtype: ignored (the weights are float32; the output has ``value``'s
      dtype).
    precision: ignored (float32 logits need no precision flag).
    module: given by both attention layers when called with
      ``sow_weights=True``: the float32 attention weights are sown as Flax's
      own function sows them, before dropout, into ``"intermediates"`` for a
      linen module or ``nnx.Intermediate`` for an nnx one, named
      ``attention_weights``.
    force_fp32_for_softmax: ignored (always float32 here).
    is_causal: mask keys after each query position (query ``i`` sees keys
      ``0..i``), combined with ``mask``; ``nnx.MultiHeadAttention`` passes it.

  Returns:
    ``[..., q, heads, depth_v]`` in ``value``'s dtype.

  Raises:
    TypeError: for a ``module`` that is not a Flax linen or nnx module.

  Example:
    >>> import jax.numpy as jnp, jmp_lite.linen
    >>> q = jnp.ones((1, 4, 2, 8), jnp.bfloat16)
    >>> jmp_lite.linen.dot_product_attention_fp32(q, q, q).dtype
    dtype(bfloat16)
  """
  del dtype, precision, force_fp32_for_softmax  # float32 by construction.
  if is_causal:
    q_len, k_len = query.shape[-3], key.shape[-3]
    causal = jnp.tril(jnp.ones((q_len, k_len), jnp.bool_))
    mask = causal if mask is None else jnp.logical_and(mask, causal)
  # Flax's own weights function for the module's kind: it sows where that
  # kind reads intermediates, before dropout, as Flax's attention does.
  weights_fn = (nn.dot_product_attention_weights if module is None
                else _weights_fn_for(module))
  # A named float32 region: `dtype_report` reads it as deliberate (no
  # mismatch) and `jmp_lite.autocast` leaves it as written.
  with float32_region():
    weights = weights_fn(
        query.astype(jnp.float32), key.astype(jnp.float32), bias=bias,
        mask=mask, broadcast_dropout=broadcast_dropout,
        dropout_rng=dropout_rng, dropout_rate=dropout_rate,
        deterministic=deterministic, dtype=jnp.float32, module=module)
  return jnp.einsum("...hqk,...khd->...qhd", weights.astype(value.dtype), value)


def _weights_fn_for(module: Any) -> Callable[..., jax.Array]:
  """Flax's attention-weights function that sows into ``module``'s kind."""
  if isinstance(module, nn.Module):
    return nn.dot_product_attention_weights
  from flax import nnx  # Imported here: linen users need not load nnx.
  if not isinstance(module, nnx.Module):
    raise TypeError("dot_product_attention_fp32: module= must be a flax"
                    " linen or nnx Module (it sows the attention weights),"
                    f" got {type(module).__name__}: {module!r}")
  from flax.nnx.nn.attention import dot_product_attention_weights
  return dot_product_attention_weights
