"""fp4.all_gather under shard_map on 4 forced host devices (a subprocess).

The device count is fixed when JAX starts, so the checks live in
tests/multidevice/fp4_gather.py: values equal to quantise-dequantise of the
global tensor, FP4 codes and 8-bit scales in the lowered all-gathers at
<= 0.30x a bfloat16 gather's bytes, a float32 reduce-scatter for the
gradient; and fp4.dot_general inside shard_map, its replicated weight's
gradient summed over the shards.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jmp_lite import fp4
from tests.conftest import run_multidevice


def test_all_gather_moves_fp4_and_reduce_scatters_in_float32():
  proc = run_multidevice("multidevice/fp4_gather.py", 4)
  lines = proc.stdout.splitlines()
  assert lines[:6] == [f"ok {n} axis {a}" for n in ("nvfp4", "nvfp4-1d",
                                                   "mxfp4") for a in (0, 1)]
  assert lines[6:] == ["ok nvfp4 bytes 0.2520x bf16",
                       "ok nvfp4-1d bytes 0.2812x bf16",
                       "ok mxfp4 bytes 0.2656x bf16",
                       "ok float32 reduce-scatter",
                       "ok matmul in shard_map"], proc.stdout


@pytest.mark.parametrize("args, error, match", [
    ((jnp.ones((4, 32)), "i", "nvfp4"), TypeError, "recipe"),
    ((jnp.ones((4, 32), jnp.int32), "i", fp4.MXFP4()), TypeError, "floating"),
    ((jnp.ones((4, 32)), "i", fp4.MXFP4(), 2), ValueError, "out of range"),
    ((jnp.ones((4, 24)), "i", fp4.MXFP4(), 1), ValueError, "multiple"),
    ((jnp.ones((8, 32)), "i", fp4.NVFP4(), 0), ValueError, "multiple"),
    ((jnp.ones((4, 32)), "i", fp4.PerDirection(None, fp4.NVFP4(), None)),
     ValueError, "forward is None"),
])
def test_bad_arguments(args, error, match):
  with pytest.raises(error, match=match):
    fp4.all_gather(*args)
