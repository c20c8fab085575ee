"""Skipping and loss scaling agree across devices (8 forced host devices).

The checks run in a subprocess because the device count is fixed when JAX
starts: ``XLA_FLAGS=--xla_force_host_platform_device_count=8``.
"""

from __future__ import annotations

from tests.conftest import run_multidevice


def test_every_device_skips_and_backs_off_together():
  proc = run_multidevice("multidevice/sharded_skip.py", 8)
  lines = proc.stdout.splitlines()
  assert lines == [
      "ok data-parallel jit",
      "ok data x model mesh jit",
      "ok shard_map without axis_name diverges",
      "ok shard_map with axis_name",
      "ok pmap skip_nonfinite with axis_name",
      "ok update_and_apply data-parallel donated jit",
      "ok update_and_apply model-sharded master weights",
      "ok update_and_apply shard_map with axis_name",
      "ok shard_map check_vma: forgotten axis_name raises, given agrees",
      "ok accumulate_gradients axis_name under shard_map",
      "ok explicit axes skip keeps shardings",
  ], proc.stdout + proc.stderr


def test_fp8_and_fp4_under_explicit_mesh_axes():
  """Under ``jax.set_mesh`` with explicit axes (``jax.make_mesh``'s
  default): per-tensor, row, block and MX FP8 and both FP4 matmuls, with a
  data-parallel batch and a column-split weight and with a weight split
  along its contraction, give the unsharded values and gradients, sharded as
  the plain matmul's result and the operands are; so do autocast's FP8/FP4
  gradients, ``fp4.quantize_dequantize`` and both health reports. Inside a
  ``shard_map`` over one axis of two, they run as written."""
  proc = run_multidevice("multidevice/lowbit_explicit.py", 8)
  assert proc.stdout.splitlines() == [
      "ok fp8 and fp4 matmuls under explicit axes",
      "ok autocast fp8 grads under explicit axes",
      "ok fp8 and fp4 quantizers and health under explicit axes",
      "ok fp8 and fp4 inside a partial shard_map",
  ], proc.stdout + proc.stderr
