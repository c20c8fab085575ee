"""Named presets O0–O3, mapped to what Apex, Paddle and PyTorch users know.

.. list-table::
   :header-rows: 1

   * - preset
     - params
     - compute
     - optimizer
     - Apex
     - Paddle
     - PyTorch
   * - ``O0``
     - float32
     - float32
     - plain
     - O0
     - (AMP off)
     - no autocast
   * - ``O1``
     - float32
     - half for Dense/Conv/Einsum layers (attention layers' projections
       included; the score and value products run in the attention layer's
       own dtype, float32 here); their outputs stay half, so code between
       layers runs in half after them (per-op float32 for exp/log/softmax:
       ``jmp_lite.autocast``)
     - loss scaling if float16
     - O1
     - O1
     - ``autocast`` (per layer; per op is ``jmp_lite.autocast``)
   * - ``O2``
     - half (norms float32)
     - half (norms float32)
     - float32 master weights + loss scaling if float16
     - O2
     - O2
     - ``model.half()`` + master weights
   * - ``O3``
     - half
     - half
     - half params + Kahan compensation, bfloat16 moments computed in float32
     - O3
     - pure fp16
     - ``model.half()``

:meth:`Preset.wrap` takes a ``flax.linen`` or a ``flax.nnx`` model
(:func:`jmp_lite.linen.mixed_precision` or :func:`jmp_lite.nnx.mixed_precision`
under the preset's policy and rules); :meth:`Preset.optimizer` is plain optax,
for either (``nnx.Optimizer(model, preset.optimizer(tx), wrt=nnx.Param)``).
Equinox and Haiku models take ``preset.policy`` and their own rules.

Bytes per parameter of params + optimizer state with Adam: ``O0``/``O1`` 12
(4 + 8), ``O2`` 14 (2 + 4 master + 8), ``O3`` 8 (2 + 2 compensation + 2 + 2
moments), ``O3`` with ``compensation="stochastic"`` 6, and the old pure half
``O3`` (``compensation=None``) 6 but it stops learning once updates fall
below half an ulp.

``O3`` stores the optimizer's moments in bfloat16 whatever the half dtype of
the params: float16 cannot hold Adam's second moment (``0.001 * g**2``
rounds to zero for gradients below about 5e-3, and the update divides by its
square root), and with float16 moments models that train in float32 blow up
within a few steps. bfloat16 has float32's exponent range; only storage is
bfloat16, the arithmetic is float32, so this needs no bfloat16 hardware.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jmp_lite import dtypes as _dtypes
from jmp_lite import nnx as _nnx
from jmp_lite.linen import mixed_precision, MixedPrecision, Rule
from jmp_lite.loss_scale import DynamicLossScale, LossScale, NoOpLossScale
from jmp_lite.low_precision import (
  kahan_summation,
  quantized_states,
  state_dtypes,
  stochastic_rounding,
)
from jmp_lite.master import master_weights
from jmp_lite.policy import Policy
from jmp_lite.transforms import loss_scaled

__all__ = ["MATMUL_LAYERS", "NNX_MATMUL_LAYERS", "O3_STATE_DTYPE", "Preset",
           "preset"]

MATMUL_LAYERS: tuple[type, ...] = (
    nn.Dense, nn.DenseGeneral, nn.Conv, nn.ConvTranspose, nn.ConvLocal,
    nn.Einsum)
"""The matmul/convolution-heavy linen layers ``O1`` runs in half precision."""

NNX_MATMUL_LAYERS: tuple[type, ...] = (
    nnx.Linear, nnx.LinearGeneral, nnx.Conv, nnx.ConvTranspose, nnx.Einsum)
"""The same for ``flax.nnx`` models."""

O3_STATE_DTYPE: np.dtype = np.dtype(jnp.bfloat16)
"""The dtype ``O3``'s compensated recipes store optimizer state in.

bfloat16 for float16 params too: float16 cannot hold Adam's second moment.
"""

_LEVELS = ("O0", "O1", "O2", "O3")
_CODES_SEED = 0x5EED_C0DE


def _codes_seed(seed: Any) -> Any:
  """The quantized states' seed, apart from the params' ``seed`` (a bad
  ``seed`` is passed on for ``quantized_states`` to refuse by name)."""
  if isinstance(seed, (int, np.integer)) and not isinstance(
      seed, (bool, np.bool_)) and 0 <= int(seed) < 2**32:
    return int(seed) ^ _CODES_SEED
  return seed
_COMPENSATIONS = ("kahan", "stochastic", None)


@dataclasses.dataclass(frozen=True)
class Preset:
  """A named mixed-precision recipe: a policy with rules, and an optimizer.

  Attributes:
    name: ``"O0"`` … ``"O3"``.
    policy: the default policy.
    rules: linen rules applied before the float32 normalisation islands.
    float32_norms: whether normalisation layers stay float32.
    master: whether the optimizer keeps float32 master weights.
    half: the half dtype used.
    compensation: ``O3`` only: how half-precision params take their
      updates, ``"kahan"`` (:func:`~jmp_lite.kahan_summation`),
      ``"stochastic"`` (:func:`~jmp_lite.stochastic_rounding`) or ``None``
      (plain rounding to nearest, with moments computed in half precision).
    nnx_rules: ``rules`` for ``flax.nnx`` models (nnx layer classes).
    state_bits: ``O3`` only: 8 or 4 to store the optimizer's state
      block-quantized (:func:`~jmp_lite.quantized_states`) instead of in
      bfloat16; ``None``: bfloat16.
  """

  name: str
  policy: Policy
  rules: tuple[Rule, ...]
  float32_norms: bool
  master: bool
  half: np.dtype
  compensation: str | None = None
  nnx_rules: tuple[Rule, ...] = ()
  state_bits: int | None = None

  def wrap(self, module: nn.Module | nnx.Module, *, rules: Sequence[Any] = (),
           strict: bool = False, enabled: bool = True
           ) -> MixedPrecision | _nnx.MixedPrecision:
    """Puts a linen or nnx model under this preset (your ``rules`` first).

    Args:
      module: a ``flax.linen`` module, or a ``flax.nnx`` module (not
        modified: the wrapper holds a copy, see :mod:`jmp_lite.nnx`).
      rules: extra rules, matched before the preset's own; with classes of
        the model's framework.
      strict: as for :func:`jmp_lite.linen.mixed_precision`.
      enabled: ``False`` runs everything in float32.

    Returns:
      A :class:`jmp_lite.linen.MixedPrecision` or
      :class:`jmp_lite.nnx.MixedPrecision`.

    Raises:
      TypeError: for anything else (an Equinox or Haiku model takes
        ``preset.policy`` with its own adapter).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import jmp_lite.nnx, jmp_lite.presets
      >>> o1 = jmp_lite.presets.preset("O1", half="bf16")
      >>> model = o1.wrap(nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)),
      ...                                nnx.LayerNorm(4, rngs=nnx.Rngs(0))))
      >>> rows = jmp_lite.nnx.dtype_report(model, jnp.ones((1, 3))).rows
      >>> {r.path: (r.stored, r.computed) for r in rows if r.stored != "-"}
      {'layers/0': ('float32', 'bfloat16'), 'layers/1': ('float32', '-')}
    """
    options: dict[str, Any] = dict(float32_norms=self.float32_norms,
                                   strict=strict,
                                   enabled=enabled)
    if isinstance(module, nnx.Module):
      return _nnx.mixed_precision(
          module, self.policy, rules=tuple(rules) + self.nnx_rules, **options)
    # linen's own TypeError names anything that is not a linen model.
    return mixed_precision(module, self.policy,
                           rules=tuple(rules) + self.rules, **options)

  def loss_scale(self) -> LossScale:
    """Dynamic scaling (from 2**15) when the half dtype is float16, else none.

    Returns:
      A fresh loss-scale state.
    """
    if self.name != "O0" and self.half == np.dtype(jnp.float16):
      return DynamicLossScale(2.0**15)
    return NoOpLossScale()

  def autocast(self, fn: Any, **options: Any) -> Any:
    """Op-level autocast in this preset's half dtype (``O1``: float32 params).

    Use it for functions of float32 params instead of :meth:`wrap` to get
    PyTorch-autocast-style per-operation precision.

    Args:
      fn: the function to transform.
      **options: :func:`jmp_lite.autocast` options.

    Returns:
      The autocast function (identity re-typing for ``O0``).
    """
    from jmp_lite.autocasting import autocast
    dtype = np.dtype(jnp.float32) if self.name == "O0" else self.half
    return autocast(fn, dtype, **options)

  def optimizer(self, inner: optax.GradientTransformation, *, seed: int = 0,
                axis_name: Any = None, specs: Any = None
                ) -> optax.GradientTransformation:
    """Wraps ``inner`` as this preset needs.

    ``O0``/``O1``: ``loss_scaled(inner)``; ``O2``:
    ``master_weights(loss_scaled(inner))``. ``O3`` (default
    ``compensation="kahan"``)::

        kahan_summation(state_dtypes(loss_scaled(inner), "bf16"))

    ``inner`` computes in float32 (unscaling float32 gradients), its state
    arrays are stored in bfloat16 (also when the params are float16, which
    lacks the range for Adam's second moment: see :data:`O3_STATE_DTYPE`),
    and the params take their updates with Kahan compensation: 8 bytes per
    parameter with Adam (2 param, 2 compensation, 2 + 2 moments).
    ``compensation="stochastic"`` puts ``stochastic_rounding(..., seed=seed)``
    in place of Kahan: 6 bytes per parameter. ``state_bits=8`` (or 4) puts
    ``quantized_states(..., bits=state_bits, specs=specs)`` in place of
    ``state_dtypes`` (its stochastic codes seeded from ``seed``, apart from
    the params' bits): with stochastic rounding about 4 (or 3) bytes per
    parameter, params and
    state together (``preset`` picks it, with a warning, unless you pass a
    compensation). ``compensation=None`` is the
    old pure half recipe, ``loss_scaled(inner, allow_half_state=True)`` with
    moments computed and stored in the half dtype (6 bytes; small updates
    round away), and with float16 every constant of ``inner`` must survive
    float16: Adam's ``eps=1e-8`` rounds to 0, so pass ``eps=1e-4`` or so.

    Under ``shard_map`` (per-device gradients), pass ``axis_name`` as to
    :func:`~jmp_lite.loss_scaled`, so that every device takes the same skip
    and scale decision, and with stochastic rounding of sharded params
    ``specs`` as to :func:`~jmp_lite.stochastic_rounding` (and to the
    quantized states of ``state_bits``), so that shards draw their own
    random bits.

    Args:
      inner: the optimizer.
      seed: the random bits' seed (``compensation="stochastic"`` or
        ``state_bits``); refused where nothing is random.
      axis_name: the mapped axis (or axes) the loss scale agrees over;
        ``None`` outside ``shard_map``/``pmap``.
      specs: ``compensation="stochastic"`` or ``state_bits`` only: the
        params' ``PartitionSpec`` tree inside ``shard_map``.

    Returns:
      The wrapped optimizer.

    Raises:
      ValueError: ``specs`` or a ``seed`` with a preset that draws no
        random bits.
    """
    o3 = self.name == "O3" and self.compensation is not None
    # Random bits: stochastic rounding of the params, and the stochastic
    # codes of quantized states (with either compensation).
    random = o3 and (self.compensation == "stochastic"
                     or self.state_bits is not None)
    if specs is not None and not random:
      raise ValueError(
          "specs= is for stochastic rounding (preset('O3', ...,"
          " compensation='stochastic') or state_bits=...); preset"
          f" {self.name} with compensation={self.compensation!r} draws no"
          " random bits")
    if seed != 0 and not random:
      raise ValueError(
          f"seed={seed!r} would be ignored: preset {self.name} with"
          f" compensation={self.compensation!r} draws no random bits")
    scaled = loss_scaled(inner, self.loss_scale(), axis_name=axis_name,
                         allow_half_state=self.name == "O3"
                         and self.compensation is None)
    if o3:
      # The codes' stream is seeded apart from the params' (the same seed
      # would give a param and its first moment the same bits each step).
      stored = (state_dtypes(scaled, O3_STATE_DTYPE) if self.state_bits is None
                else quantized_states(scaled, bits=self.state_bits,
                                      seed=_codes_seed(seed), specs=specs))
      if self.compensation == "kahan":
        return kahan_summation(stored)
      return stochastic_rounding(stored, seed=seed, specs=specs)
    wrapped = scaled
    return master_weights(wrapped) if self.master else wrapped


def preset(level: str, half: Any = None, *,
           compensation: str | None = "auto",
           state_bits: int | None = None) -> Preset:
  """Returns the named preset.

  :meth:`Preset.wrap` puts a Flax model (linen or nnx) under it;
  :meth:`Preset.optimizer` is plain optax. An Equinox or Haiku model takes
  ``preset.policy`` with its own adapter and rules.

  ``O3`` keeps params in the half dtype and, by default, trains them with
  Kahan compensation and bfloat16 Adam moments computed in float32
  (see :meth:`Preset.optimizer`): 8 bytes per parameter against ``O2``'s
  14, at float32's accuracy on the fidelity tasks (``docs/low_precision.md``).

  Args:
    level: ``"O0"``, ``"O1"``, ``"O2"`` or ``"O3"`` (case-insensitive).
    half: the half dtype; defaults to :func:`~jmp_lite.half_dtype` (bfloat16
      on TPUs and recent GPUs, float16 elsewhere).
    compensation: ``O3`` only: ``"kahan"`` (8 bytes per parameter with
      Adam), ``"stochastic"`` (6 bytes) or ``None`` (plain pure half, 6
      bytes, loses small updates). ``"auto"``: ``"kahan"`` for ``O3``,
      ``None`` for the others; with ``state_bits``, ``"stochastic"`` and a
      warning saying so (pass the compensation to choose it yourself).
    state_bits: ``O3`` only: 8 or 4 stores the optimizer's state in that
      many bits per element (:func:`~jmp_lite.quantized_states`): with
      stochastic rounding, Adam at about 4 (or 3) bytes per parameter,
      params and optimizer state together; Kahan's compensation buffer
      adds 2 bytes per bfloat16 parameter to that.

  Returns:
    A :class:`Preset`.

  Raises:
    ValueError: for an unknown level or compensation, a compensation or
      ``state_bits`` with a level other than ``O3``, ``state_bits`` other
      than 8 or 4, or ``state_bits`` with ``compensation=None``.
    TypeError: for a ``half`` that is not float16 or bfloat16.

  Warns:
    UserWarning: for ``state_bits`` with ``compensation="auto"``, which
      picks ``"stochastic"`` where ``O3`` alone picks ``"kahan"``.

  Example:
    >>> import jmp_lite.presets
    >>> p = jmp_lite.presets.preset("O2", half="bf16")
    >>> str(p.policy), p.master
    ('p=bf16,c=bf16,o=f32', True)
    >>> jmp_lite.presets.preset("O3", half="bf16").compensation
    'kahan'
  """
  name = str(level).strip().upper()
  if name not in _LEVELS:
    raise ValueError(f"Unknown preset {level!r}; expected one of {_LEVELS}")
  if state_bits is not None:
    if isinstance(state_bits, bool) or state_bits not in (8, 4):
      raise ValueError(f"state_bits must be 8, 4 or None, got {state_bits!r}")
    if name != "O3":
      raise ValueError(
          f"state_bits={state_bits} applies to preset 'O3', not {name!r}")
    if compensation is None:
      raise ValueError(
          "state_bits needs a compensation ('stochastic' or 'kahan'):"
          " compensation=None computes the moments in the half dtype")
  if compensation == "auto" and state_bits is not None:
    # Not silently: O3 alone means Kahan, and a user who read that should
    # see the switch (the compensation buffer would cost what 8 bits save).
    warnings.warn(
        f"preset('O3', state_bits={state_bits}) trains with"
        " compensation='stochastic', not O3's default 'kahan' (Kahan's"
        " compensation buffer adds 2 bytes per parameter to the"
        f" {4 if state_bits == 8 else 3} of params and state); pass"
        " compensation='stochastic' or 'kahan' to choose", UserWarning,
        stacklevel=2)
    compensation = "stochastic"
  if compensation == "auto":
    compensation = "kahan" if name == "O3" else None
  if compensation not in _COMPENSATIONS:
    raise ValueError(
        f"Unknown compensation {compensation!r}; expected one of"
        f" {_COMPENSATIONS} or 'auto'")
  if compensation is not None and name != "O3":
    raise ValueError(
        f"compensation={compensation!r} applies to half-precision params"
        f" without master weights, i.e. preset 'O3', not {name!r}")
  half = _dtypes.half_dtype() if half is None else _dtypes.to_floating_dtype(
      half, "half")
  if half not in (np.dtype(jnp.float16), np.dtype(jnp.bfloat16)):
    raise TypeError(f"half must be float16 or bfloat16, got {half.name}")
  f32 = np.dtype(jnp.float32)
  if name == "O0":
    return Preset(name, Policy(f32, f32, f32), (), True, False, half)
  if name == "O1":
    matmuls = Policy(f32, half, half)
    return Preset(name, Policy(f32, f32, f32),
                  (Rule(MATMUL_LAYERS, matmuls),), True, False, half,
                  nnx_rules=(Rule(NNX_MATMUL_LAYERS, matmuls),))
  if name == "O2":
    return Preset(name, Policy(half, half, f32), (), True, True, half)
  return Preset(name, Policy(half, half, half), (), False, False, half,
                compensation, state_bits=state_bits)
