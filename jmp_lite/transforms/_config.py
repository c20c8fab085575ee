"""A guard's static configuration, and the checks of its arguments."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jmp_lite._checks import check_axis_name, check_bool

_SKIP_WITH = ("auto", "cond", "select")


@dataclasses.dataclass(frozen=True)
class GuardConfig:
  """A guard's static configuration, kept in its state's tree structure.

  :func:`jmp_lite.update_and_apply` reads it to decide a step itself.

  Attributes:
    axis_name: the mapped axis every device agrees over, or ``None``.
    skip_with: ``"auto"``, ``"cond"`` or ``"select"``, as requested.
    check_updates: whether non-finite *updates* skip the step too.
    may_amplify: whether the loss scale may drop below 1, so that unscaling
      can overflow gradients that were finite.
  """

  axis_name: Any = None
  skip_with: str = "auto"
  check_updates: bool = False
  may_amplify: bool = False

  def __post_init__(self) -> None:
    # Built by the guards from checked arguments; checked again for a
    # config built by hand (a truthy "no" would switch check_updates on).
    check_axis_name(self.axis_name)
    check_skip_with(self.skip_with)
    for name in ("check_updates", "may_amplify"):
      object.__setattr__(self, name, check_bool(getattr(self, name), name))

  def formulation(self) -> tuple[str, str]:
    """Returns ``("cond" | "select", why)`` for the current backend.

    Returns:
      The formulation a step with this guard compiles to, and the reason.

    Example:
      >>> from jmp_lite.transforms import GuardConfig
      >>> GuardConfig(check_updates=True).formulation()[0]
      'select'
    """
    if self.check_updates:
      return "select", ("check_updates=True: the decision needs the updates,"
                        " which exist only after the inner update ran")
    if self.may_amplify:
      return "select", ("the loss scale may drop below 1: unscaling can"
                        " overflow, so the unscaled gradients are checked too")
    if self.skip_with == "select":
      return "select", "skip_with='select'"
    if self.skip_with == "cond":
      return "cond", "skip_with='cond'"
    backend = jax.default_backend()
    if backend == "cpu":
      return "cond", "skip_with='auto' on the CPU (measured cheaper there)"
    if backend == "gpu":
      return "select", ("skip_with='auto' on gpu (fused into the optimizer's"
                        " kernels; XLA:GPU compiled a cond to the same"
                        " selects for Adam, measured on an H100)")
    return "select", (f"skip_with='auto' on {backend} (fuses into the"
                      " optimizer's kernels; unmeasured there: see"
                      " benchmarks/gpu_step.py)")


def check_skip_with(skip_with: Any) -> str:
  """``skip_with`` if it is a known formulation, else a ``ValueError``.

  Example:
    >>> from jmp_lite.transforms._config import check_skip_with
    >>> check_skip_with("cond")
    'cond'
  """
  if skip_with not in _SKIP_WITH:
    raise ValueError(
        f"skip_with must be one of {_SKIP_WITH}, got {skip_with!r}")
  return skip_with




# The class names jmp_lite.transforms as its module (see __init__), where
# doctest would not find its methods' examples; they run with this module.
__test__ = {"GuardConfig": GuardConfig}
