"""Loss-scale states: no-op, static and dynamic, as immutable pytrees.

The schedule of :class:`DynamicLossScale` (pinned, and tested against a
plain-Python model of it):

* A step is *finite* when ``grads_finite`` is true.
* ``counter`` counts consecutive finite steps. On the ``period``-th one the
  scale grows to ``min(loss_scale * factor, max_loss_scale)`` and the counter
  restarts at 0 (the same step as PyTorch's ``GradScaler`` and ``jmp``; Flax's
  ``DynamicScale`` grows one step later).
* Any non-finite step resets ``counter`` to 0 and adds one to
  ``nonfinite_counter``. When that reaches ``hysteresis`` the scale backs off
  to ``max(loss_scale * backoff_factor, min_loss_scale)`` and
  ``nonfinite_counter`` restarts at 0. With ``hysteresis_reset="finite"``
  (the default) a finite step resets ``nonfinite_counter`` to 0, so only
  *consecutive* non-finite steps count (PaddlePaddle's
  ``decr_every_n_nan_or_inf``). With ``hysteresis_reset="growth"``
  (Colossal-AI's and Megatron-LM's rule) only a growth of the scale resets
  it: non-finite steps count across finite ones, and once ``hysteresis`` of
  them have been seen every further one backs off, until the scale grows.
* The scale is a float32 scalar, never non-finite, never above
  ``max_loss_scale`` and never below ``min_loss_scale``.
* Every scale and bound lies in ``[2**-126, 2**126]``, where it and its
  reciprocal (which unscales) are normal float32 numbers (XLA flushes
  subnormals to zero), and ``factor`` and ``backoff_factor`` must differ
  from 1 in float32 (``1.00000001`` is 1.0 there, and would never move the
  scale).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _jaxpr, struct
from jmp_lite import dtypes as _dtypes
from jmp_lite._checks import (
  check_float32_factor,
  check_numeric_leaf,
  check_scalar_bool,
  check_scale_range,
)

__all__ = ["DynamicLossScale", "LossScale", "NoOpLossScale", "StaticLossScale"]

T = TypeVar("T")

_F32 = np.dtype(np.float32)
_I32 = np.dtype(np.int32)
_I32_MAX = int(np.iinfo(np.int32).max)


def _as_scalar(value: Any, dtype: np.dtype, what: str) -> Any:
  """Converts ``value`` to a scalar of ``dtype`` without breaking tracing.

  JAX arrays (tracers included) stay JAX arrays; Python and numpy values
  become numpy arrays, so constructing a state puts nothing on a device.
  Bools and complex numbers are refused rather than cast: ``True`` is no
  scale, and the cast would drop an imaginary part without a word.
  """
  if isinstance(value, jax.Array):
    # The dtype is known for tracers too: checking it never needs a value.
    if not jnp.issubdtype(value.dtype, jnp.number) or jnp.issubdtype(
        value.dtype, jnp.complexfloating):
      raise TypeError(
          f"{what} must be a real number, got an array of dtype"
          f" {value.dtype}: {value!r}")
    if value.dtype != dtype or getattr(value, "weak_type", False):
      # Strong-typed: a weak-typed leaf would retrace once the first adjust()
      # returns a strong-typed one.
      value = jax.lax.convert_element_type(value, dtype)
  elif isinstance(value, (numbers.Number, np.ndarray, np.generic)):
    if isinstance(value, (bool, np.bool_)) or (
        isinstance(value, np.ndarray) and value.dtype == np.bool_):
      raise TypeError(f"{what} must be a number, got bool {value!r}")
    real = (np.issubdtype(value.dtype, np.integer)
            or np.issubdtype(value.dtype, np.floating)
            if isinstance(value, np.ndarray)
            else isinstance(value, numbers.Real))
    if not real:
      raise TypeError(
          f"{what} must be a real number, got {type(value).__name__}:"
          f" {value!r}")
    with np.errstate(over="ignore"):  # Out of range: inf, refused below.
      try:
        value = np.asarray(value, dtype)
      except OverflowError:  # A Python int beyond even float64.
        raise ValueError(
            f"{what} is out of range for {dtype.name}, got {value!r}"
        ) from None
  else:
    raise TypeError(
        f"{what} must be a scalar number or array, got"
        f" {type(value).__name__}: {value!r}"
    )
  if value.shape != ():
    raise ValueError(f"{what} must be a scalar, got shape {value.shape}")
  return value


def _as_count(value: Any, what: str, bound: str, limit: int) -> Any:
  """Converts a counter to an int32 scalar in ``[0, limit)``.

  Only integers are counts: ``2.5`` would be truncated, and ``2**40`` would
  overflow int32 (numpy raises, a JAX cast wraps). Checked before the cast,
  and, for tracers, by dtype only.

  Args:
    value: a Python or numpy integer, or an integer array scalar.
    what: the argument's name, for error messages.
    bound: how ``limit`` is named in the message (``"period=2000"``).
    limit: the exclusive upper bound, at most ``2**31 - 1``.

  Returns:
    An int32 scalar (numpy, or JAX for JAX input).
  """
  dtype: Any = getattr(value, "dtype", None)
  if isinstance(value, (bool, np.bool_)) or not (
      isinstance(value, numbers.Integral)
      or (isinstance(value, (jax.Array, np.ndarray, np.generic))
          and jnp.issubdtype(dtype, jnp.integer))):
    raise TypeError(
        f"{what} must be an integer, got {type(value).__name__}"
        + (f" of dtype {dtype}" if dtype is not None else "")
        + f": {value!r}")
  if not _jaxpr.is_tracer(value):
    checked: Any = value  # An integer or integer array, as checked above.
    if np.ndim(checked) != 0:
      raise ValueError(
          f"{what} must be a scalar, got shape {np.shape(checked)}")
    v = int(checked)
    if not 0 <= v < limit:
      raise ValueError(f"{what} must be in [0, {bound}), got {v}")
  return _as_scalar(value, _I32, what)


def _concrete(value: Any) -> float | None:
  """The Python value of a concrete scalar, or None for a tracer."""
  if _jaxpr.is_tracer(value):
    return None
  return float(value)


def _check_positive_finite(value: Any, what: str,
                           given: Any = None) -> None:
  check_scale_range(_concrete(value), what, given)


def _check_static_int(value: Any, what: str, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(
        f"{what} must be a Python int (static configuration), got"
        f" {type(value).__name__}: {value!r}"
    )
  value = int(value)
  if value < minimum:
    raise ValueError(f"{what} must be >= {minimum}, got {value}")
  if value > _I32_MAX:
    # The int32 counters compare against it (and count up to it).
    raise ValueError(
        f"{what} must be at most 2**31 - 1 = {_I32_MAX} (it bounds an int32"
        f" counter), got {value}")
  return int(value)


def _check_static_real(value: Any, what: str) -> float | int:
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(
        f"{what} must be a Python number (static configuration), got"
        f" {type(value).__name__}: {value!r}"
    )
  if not math.isfinite(value):
    raise ValueError(f"{what} must be finite, got {value}")
  return value if isinstance(value, int) else float(value)


def _check_grads_finite(grads_finite: Any) -> jax.Array:
  return check_scalar_bool(grads_finite, "adjust's grads_finite")


def _multiply(tree: T, factor: jax.Array) -> T:
  """Multiplies inexact leaves by a float32 scalar, keeping each leaf's dtype.

  Half-precision leaves are multiplied in float32 and cast back: a float16
  scale cannot even hold 2**16, while ``small_loss * 2**16`` often fits.
  Python floats are floating values too: they come back as float32 arrays
  (as jmp's ``x * loss_scale`` gives), not unscaled.
  """

  def mul(x: Any) -> Any:
    if not _dtypes.is_inexact_array(x):
      # A Python float (np.float64 is one too, but an array above: it keeps
      # its dtype); bool and int are not floating.
      if isinstance(x, float):
        return jnp.asarray(x, jnp.float32) * jnp.asarray(factor, jnp.float32)
      if isinstance(x, complex):
        return jnp.asarray(x, jnp.complex64) * jnp.asarray(factor,
                                                           jnp.float32)
      return x
    wide = _dtypes.at_least_float32(x.dtype)
    real = jnp.finfo(wide).dtype
    return (x.astype(wide) * jnp.asarray(factor, real)).astype(x.dtype)

  _check_numeric_leaves(tree)
  return jax.tree.map(mul, tree)


def _check_numeric_leaves(tree: Any) -> None:
  """Raises for a leaf that is no number or array (a string, say): scaling
  passed it through, so a tree of names given by mistake went unnoticed."""
  for x in jax.tree.leaves(tree):
    if not (isinstance(x, (numbers.Number, np.ndarray, np.generic, jax.Array))
            or _jaxpr.is_tracer(x)):
      raise TypeError(
          "A loss scale scales numbers and arrays, got a"
          f" {type(x).__name__} leaf: {x!r:.200}")
    check_numeric_leaf(x, "A loss scale")


class _MultiplyingScale:
  """``scale``/``unscale`` shared by the states that hold a ``loss_scale``."""

  loss_scale: Any

  def scale(self, tree: T) -> T:
    """Multiplies the inexact leaves of ``tree`` by the scale.

    Args:
      tree: a loss or any pytree; each array leaf keeps its dtype
        (half-precision leaves are multiplied in float32, then cast back),
        a Python float becomes a float32 array, non-floating leaves pass.

    Returns:
      The scaled tree.
    """
    return _multiply(tree, self.loss_scale)

  def unscale(self, tree: T) -> T:
    """Multiplies the inexact leaves of ``tree`` by ``1 / loss_scale``.

    Args:
      tree: gradients or any pytree; each array leaf keeps its dtype, a
        Python float becomes a float32 array, non-floating leaves pass.

    Returns:
      The unscaled tree.
    """
    return _multiply(tree, 1.0 / jnp.asarray(self.loss_scale, jnp.float32))


@struct.dataclass
class NoOpLossScale:
  """A loss scale that does nothing: for float32 or bfloat16 training.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> ls = jmp_lite.NoOpLossScale()
    >>> float(ls.scale(jnp.float32(3.0))), float(ls.loss_scale)
    (3.0, 1.0)
  """

  @property
  def loss_scale(self) -> np.ndarray:
    """The scale, always 1 (a float32 scalar, like the other states)."""
    return np.ones((), _F32)

  def scale(self, tree: T) -> T:
    """Returns ``tree`` unchanged.

    Args:
      tree: a loss or any pytree.

    Returns:
      ``tree`` itself.

    Raises:
      TypeError: for a leaf that is no number or array.
    """
    _check_numeric_leaves(tree)
    return tree

  def unscale(self, tree: T) -> T:
    """Returns ``tree`` unchanged.

    Args:
      tree: gradients or any pytree.

    Returns:
      ``tree`` itself.

    Raises:
      TypeError: for a leaf that is no number or array.
    """
    _check_numeric_leaves(tree)
    return tree

  def adjust(self, grads_finite: Any) -> NoOpLossScale:
    """Returns ``self``: a no-op scale never changes.

    Args:
      grads_finite: a scalar bool (checked, then ignored).

    Returns:
      ``self``.
    """
    _check_grads_finite(grads_finite)
    return self


@struct.dataclass
class StaticLossScale(_MultiplyingScale):
  """Scales the loss up and the gradients down by a fixed float32 constant.

  The constant is a pytree leaf, so jitted steps taking states with different
  scales share one compilation.

  Attributes:
    loss_scale: a positive, finite scalar (stored as float32).

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> ls = jmp_lite.StaticLossScale(128.0)
    >>> ls.scale(jnp.bfloat16(0.5))
    Array(64, dtype=bfloat16)
    >>> float(ls.unscale(jnp.float32(64.0)))
    0.5
  """

  loss_scale: Any

  def __post_init__(self) -> None:
    scale = _as_scalar(self.loss_scale, _F32, "loss_scale")
    _check_positive_finite(scale, "loss_scale", self.loss_scale)
    object.__setattr__(self, "loss_scale", scale)

  def adjust(self, grads_finite: Any) -> StaticLossScale:
    """Returns ``self``: a static scale never changes.

    Args:
      grads_finite: a scalar bool (checked, then ignored).

    Returns:
      ``self``.
    """
    _check_grads_finite(grads_finite)
    return self


@struct.dataclass
class DynamicLossScale(_MultiplyingScale):
  """A loss scale that grows while gradients stay finite and backs off when not.

  Positional arguments and defaults are ``jmp``'s; the keyword-only ones add
  what PyTorch, Apex, Colossal-AI and PaddlePaddle users expect. See the module
  docstring for the exact schedule.

  Attributes:
    loss_scale: the current scale (float32 scalar leaf).
    counter: consecutive finite steps since the last change (int32 leaf).
    period: consecutive finite steps needed to grow (static).
    factor: growth factor, > 1 (static).
    min_loss_scale: lower bound of the scale, may be below 1 (float32 leaf).
    backoff_factor: multiplier on back-off, in (0, 1); ``None`` means
      ``1 / factor`` (static).
    max_loss_scale: upper bound of the scale; 2**24 as in Apex (float32 leaf).
    hysteresis: non-finite steps that trigger a back-off (static).
    nonfinite_counter: non-finite steps counted towards ``hysteresis``
      (int32 leaf, at most ``hysteresis``).
    hysteresis_reset: what resets ``nonfinite_counter`` (static):
      ``"finite"`` (default): every finite step and every back-off, so
      only consecutive non-finite steps back off (PaddlePaddle);
      ``"growth"``: only a growth of the scale, so that after
      ``hysteresis`` non-finite steps every further one backs off
      (Colossal-AI, Megatron-LM).

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> ls = jmp_lite.DynamicLossScale(2.0 ** 15, period=2)
    >>> ls = ls.adjust(jnp.array(True)).adjust(jnp.array(True))
    >>> float(ls.loss_scale)
    65536.0
    >>> float(ls.adjust(jnp.array(False)).loss_scale)
    32768.0
  """

  loss_scale: Any
  counter: Any = struct.field(default=0)
  period: int = struct.field(static=True, default=2000)
  factor: float = struct.field(static=True, default=2)
  min_loss_scale: Any = struct.field(default=1.0)
  backoff_factor: float | None = struct.field(
      static=True, default=None, kw_only=True
  )
  max_loss_scale: Any = struct.field(default=2.0**24, kw_only=True)
  hysteresis: int = struct.field(static=True, default=1, kw_only=True)
  nonfinite_counter: Any = struct.field(default=0, kw_only=True)
  hysteresis_reset: str = struct.field(static=True, default="finite",
                                       kw_only=True)

  def __post_init__(self) -> None:
    if self.hysteresis_reset not in _HYSTERESIS_RESETS:
      raise ValueError(
          f"hysteresis_reset must be one of {_HYSTERESIS_RESETS} ('finite':"
          " PaddlePaddle's rule; 'growth': Colossal-AI's and Megatron-LM's),"
          f" got {self.hysteresis_reset!r}")
    period = _check_static_int(self.period, "period", 1)
    hysteresis = _check_static_int(self.hysteresis, "hysteresis", 1)
    factor = _check_static_real(self.factor, "factor")
    if factor <= 1:
      raise ValueError(f"factor must be > 1, got {factor}")
    check_float32_factor(factor, "factor", 1.0, math.inf)
    backoff = self.backoff_factor
    if backoff is None:
      backoff = 1.0 / factor
    backoff = _check_static_real(backoff, "backoff_factor")
    if not 0 < backoff < 1:
      raise ValueError(f"backoff_factor must be in (0, 1), got {backoff}")
    check_float32_factor(backoff, "backoff_factor", 0.0, 1.0)

    scale = _as_scalar(self.loss_scale, _F32, "loss_scale")
    lo = _as_scalar(self.min_loss_scale, _F32, "min_loss_scale")
    hi = _as_scalar(self.max_loss_scale, _F32, "max_loss_scale")
    counter = _as_count(self.counter, "counter", f"period={period}", period)
    nonfinite = _as_count(self.nonfinite_counter, "nonfinite_counter",
                          f"hysteresis={hysteresis}", hysteresis)
    for value, what, given in (
        (scale, "loss_scale", self.loss_scale),
        (lo, "min_loss_scale", self.min_loss_scale),
        (hi, "max_loss_scale", self.max_loss_scale)):
      _check_positive_finite(value, what, given)
    s, low, high = _concrete(scale), _concrete(lo), _concrete(hi)
    if low is not None and high is not None and low > high:
      raise ValueError(
          f"min_loss_scale ({low}) must not exceed max_loss_scale ({high})"
      )
    if s is not None and low is not None and s < low:
      raise ValueError(
          f"loss_scale ({s}) is below min_loss_scale ({low})"
      )
    if s is not None and high is not None and s > high:
      raise ValueError(
          f"loss_scale ({s}) is above max_loss_scale ({high}); pass a larger"
          " max_loss_scale= to start there"
      )
    for name, value in (("period", period), ("hysteresis", hysteresis),
                        ("factor", factor), ("backoff_factor", backoff),
                        ("loss_scale", scale), ("min_loss_scale", lo),
                        ("max_loss_scale", hi), ("counter", counter),
                        ("nonfinite_counter", nonfinite)):
      object.__setattr__(self, name, value)

  def adjust(self, grads_finite: Any) -> DynamicLossScale:
    """Returns the next state, given whether this step's gradients were finite.

    Branch-free, so it fuses and never syncs with the host.

    Args:
      grads_finite: a scalar bool, typically ``jmp_lite.all_finite(grads)``.

    Returns:
      A new :class:`DynamicLossScale`; all static fields are kept.

    Raises:
      TypeError: if ``grads_finite`` is not bool.
      ValueError: if ``grads_finite`` is not a scalar.
    """
    finite = _check_grads_finite(grads_finite)
    scale = jnp.asarray(self.loss_scale, jnp.float32)
    counter = jnp.asarray(self.counter, jnp.int32) + 1
    nonfinite = jnp.asarray(self.nonfinite_counter, jnp.int32) + 1
    grow = finite & (counter >= self.period)
    back_off = ~finite & (nonfinite >= self.hysteresis)
    # The bounds are finite, so min()/max() keep the scale finite even when
    # scale * factor overflows float32.
    grown = jnp.minimum(scale * self.factor, self.max_loss_scale)
    # __post_init__ stores the resolved factor; None (1 / factor) is handled
    # here too so that the type is a float either way.
    backoff = (1.0 / self.factor if self.backoff_factor is None
               else self.backoff_factor)
    shrunk = jnp.maximum(scale * backoff, self.min_loss_scale)
    new_scale = jnp.where(grow, grown, jnp.where(back_off, shrunk, scale))
    new_counter = jnp.where(finite & ~grow, counter, 0)
    if self.hysteresis_reset == "finite":
      new_nonfinite = jnp.where(finite | back_off, 0, nonfinite)
    else:
      # Kept across finite steps and back-offs (capped: reaching hysteresis
      # once is what counts), cleared when the scale grows.
      kept = jnp.minimum(jnp.where(finite, nonfinite - 1, nonfinite),
                         self.hysteresis)
      new_nonfinite = jnp.where(grow, 0, kept)
    return struct.replace(
        self,
        loss_scale=new_scale.astype(jnp.float32),
        counter=new_counter.astype(jnp.int32),
        nonfinite_counter=new_nonfinite.astype(jnp.int32),
    )


_HYSTERESIS_RESETS = ("finite", "growth")

LossScale = NoOpLossScale | StaticLossScale | DynamicLossScale
"""Any of the three loss-scale states (the name ``jmp`` users import)."""
