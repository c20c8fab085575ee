"""fp8.all_gather under shard_map on 4 forced host devices (a subprocess).

The device count is fixed when JAX starts, so the checks live in
tests/multidevice/fp8_gather.py: 8-bit all-gathers in the lowered StableHLO,
a float32 reduce-scatter for the gradient, and values equal to
quantise-dequantise of the global tensor, for every granularity.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jmp_lite import fp8
from tests.conftest import run_multidevice


def test_all_gather_moves_fp8_and_reduce_scatters_in_float32():
  proc = run_multidevice("multidevice/fp8_gather.py", 4)
  assert proc.stdout.splitlines() == [
      "ok tensor", "ok row", "ok block", "ok mx",
      "ok bfloat16 params, float32 reduce-scatter",
      "ok block along the last axis"], proc.stdout + proc.stderr


@pytest.mark.parametrize("args, error, match", [
    ((jnp.ones((4, 8)), "i", "e4m3"), TypeError, "recipe"),
    ((jnp.ones((4, 8), jnp.int32), "i", fp8.MXFP8()), TypeError, "floating"),
    ((jnp.ones((4, 8)), "i", fp8.MXFP8(), 2), ValueError, "out of range"),
    ((jnp.ones((4, 8)), "i", fp8.CurrentScaling(granularity="row"), 1),
     ValueError, "last axis"),
    ((jnp.ones((4, 8)), "i", fp8.MXFP8(), 1), ValueError, "multiple"),
    ((jnp.ones((4, 32)), "i", fp8.CurrentScaling(granularity="block",
                                                 block_size=8)),
     ValueError, "multiple"),
])
def test_bad_arguments(args, error, match):
  with pytest.raises(error, match=match):
    fp8.all_gather(*args)
