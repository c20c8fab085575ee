"""jmp_lite: functional mixed-precision training for JAX, Flax and optax.

A drop-in superset of DeepMind's ``jmp``: ``import jmp_lite as jmp`` runs code
written for ``jmp`` 0.0.4.

The top level holds ``jmp``'s names, the optax layer, autocast and the
diagnostics. The rest lives in named public submodules, loaded with the
package: :mod:`jmp_lite.transforms`, :mod:`jmp_lite.master`,
:mod:`jmp_lite.accumulation` and :mod:`jmp_lite.low_precision` (the
optimizers' state classes), :mod:`jmp_lite.step`, :mod:`jmp_lite.contract`,
:mod:`jmp_lite.dtypes`, :mod:`jmp_lite.struct`, :mod:`jmp_lite.fp8`,
:mod:`jmp_lite.diagnostics`, :mod:`jmp_lite.distributed`,
:mod:`jmp_lite.path_rules`; and, each importing
its framework, :mod:`jmp_lite.linen`, :mod:`jmp_lite.nnx`,
:mod:`jmp_lite.equinox` and :mod:`jmp_lite.presets`.
"""

from jmp_lite import accumulation as accumulation
from jmp_lite import autocasting as autocasting
from jmp_lite import contract as contract
from jmp_lite import diagnostics as diagnostics
from jmp_lite import distributed as distributed
from jmp_lite import dtypes as dtypes
from jmp_lite import finite as finite
from jmp_lite import fp4 as fp4
from jmp_lite import fp8 as fp8
from jmp_lite import loss_scale as loss_scale
from jmp_lite import low_precision as low_precision
from jmp_lite import master as master
from jmp_lite import path_rules as path_rules
from jmp_lite import policy as policy
from jmp_lite import step as step
from jmp_lite import struct as struct
from jmp_lite import transforms as transforms
from jmp_lite._version import __version__ as __version__
from jmp_lite.accumulation import accumulate_gradients as accumulate_gradients
from jmp_lite.autocasting import autocast as autocast
from jmp_lite.autocasting import autocast_audit as autocast_audit
from jmp_lite.autocasting import autocast_fp8_state as autocast_fp8_state
from jmp_lite.autocasting import float32_region as float32_region
from jmp_lite.autocasting import half_region as half_region
from jmp_lite.diagnostics import check_alignment as check_alignment
from jmp_lite.diagnostics import check_hardware as check_hardware
from jmp_lite.diagnostics import find_nonfinite as find_nonfinite
from jmp_lite.diagnostics import gradient_health as gradient_health
from jmp_lite.diagnostics import nonfinite_counts as nonfinite_counts
from jmp_lite.diagnostics import nonfinite_paths as nonfinite_paths
from jmp_lite.diagnostics import PrecisionWarning as PrecisionWarning
from jmp_lite.dtypes import half_dtype as half_dtype
from jmp_lite.finite import all_finite as all_finite
from jmp_lite.finite import select_tree as select_tree
from jmp_lite.loss_scale import DynamicLossScale as DynamicLossScale
from jmp_lite.loss_scale import LossScale as LossScale
from jmp_lite.loss_scale import NoOpLossScale as NoOpLossScale
from jmp_lite.loss_scale import StaticLossScale as StaticLossScale
from jmp_lite.low_precision import kahan_summation as kahan_summation
from jmp_lite.low_precision import quantized_states as quantized_states
from jmp_lite.low_precision import state_dtypes as state_dtypes
from jmp_lite.low_precision import stochastic_rounding as stochastic_rounding
from jmp_lite.master import master_params as master_params
from jmp_lite.master import master_weights as master_weights
from jmp_lite.path_rules import cast_by_path as cast_by_path
from jmp_lite.policy import cast_to_full as cast_to_full
from jmp_lite.policy import cast_to_half as cast_to_half
from jmp_lite.policy import get_policy as get_policy
from jmp_lite.policy import Policy as Policy
from jmp_lite.step import apply_gradients as apply_gradients
from jmp_lite.step import scaled_value_and_grad as scaled_value_and_grad
from jmp_lite.step import update_and_apply as update_and_apply
from jmp_lite.transforms import current_loss_scale as current_loss_scale
from jmp_lite.transforms import default_loss_scale as default_loss_scale
from jmp_lite.transforms import loss_scaled as loss_scaled
from jmp_lite.transforms import loss_scaled_state as loss_scaled_state
from jmp_lite.transforms import LossScaledState as LossScaledState
from jmp_lite.transforms import NonFiniteHaltError as NonFiniteHaltError
from jmp_lite.transforms import raise_if_halted as raise_if_halted
from jmp_lite.transforms import skip_nonfinite as skip_nonfinite

__all__ = (
    "DynamicLossScale",
    "LossScale",
    "LossScaledState",
    "NoOpLossScale",
    "NonFiniteHaltError",
    "Policy",
    "PrecisionWarning",
    "StaticLossScale",
    "accumulate_gradients",
    "all_finite",
    "apply_gradients",
    "autocast",
    "autocast_audit",
    "autocast_fp8_state",
    "cast_by_path",
    "cast_to_full",
    "cast_to_half",
    "check_alignment",
    "check_hardware",
    "current_loss_scale",
    "default_loss_scale",
    "find_nonfinite",
    "float32_region",
    "get_policy",
    "gradient_health",
    "half_dtype",
    "half_region",
    "kahan_summation",
    "loss_scaled",
    "loss_scaled_state",
    "master_params",
    "master_weights",
    "nonfinite_counts",
    "nonfinite_paths",
    "quantized_states",
    "raise_if_halted",
    "scaled_value_and_grad",
    "select_tree",
    "skip_nonfinite",
    "state_dtypes",
    "stochastic_rounding",
    "update_and_apply",
)
