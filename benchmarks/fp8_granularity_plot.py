"""Plots what each FP8 granularity does to the rows an outlier ruins.

One activation (64 x 256) with one outlier row (x 1e5) times one weight
(256 x 64) with one outlier 32 x 32 block, through ``jmp_lite.fp8.dot_general``
with per-tensor, per-row, block (128) and MXFP8 scaling: the relative error of
each output row against the float32 product. Per-tensor scaling flushes the
other rows' small values to zero; the finer scales keep them. Writes
``docs/fp8_granularity.png`` (or ``--out``) and prints the medians.

Run: ``python benchmarks/fp8_granularity_plot.py``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax.numpy as jnp
import numpy as np

import jmp_lite

RECIPES = {
    "per tensor": jmp_lite.fp8.CurrentScaling(),
    "per row": jmp_lite.fp8.CurrentScaling(granularity="row"),
    "block 128": jmp_lite.fp8.CurrentScaling(granularity="block"),
    "MXFP8 (32)": jmp_lite.fp8.MXFP8(),
}
OUTLIER_ROW = 3


def operands(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((64, 256)).astype(np.float32)
  w = rng.standard_normal((256, 64)).astype(np.float32)
  x[OUTLIER_ROW] *= 1e5
  w[:32, :32] *= 1e5
  return x, w


def row_errors() -> dict[str, np.ndarray]:
  """Relative error of each output row (outlier row left out), per recipe."""
  x, w = operands()
  want = x.astype(np.float64) @ w.astype(np.float64)
  keep = np.arange(x.shape[0]) != OUTLIER_ROW
  out = {}
  for name, recipe in RECIPES.items():
    dot = jmp_lite.fp8.dot_general(recipe)
    got = np.asarray(dot(jnp.asarray(x), jnp.asarray(w),
                         (((1,), (0,)), ((), ()))), np.float64)
    err = (np.linalg.norm(got - want, axis=1)
           / np.linalg.norm(want, axis=1))
    out[name] = err[keep]
  return out


def main(argv: list[str] | None = None) -> dict[str, float]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=Path, default=Path(__file__).resolve(
      ).parents[1] / "docs" / "fp8_granularity.png")
  args = parser.parse_args(argv)
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  errors = row_errors()
  fig, ax = plt.subplots(figsize=(6.4, 3.6))
  for name, err in errors.items():
    ax.plot(np.sort(err), marker=".", linestyle="-", label=name)
  ax.set_yscale("log")
  ax.set_xlabel("output rows other than the outlier's (sorted)")
  ax.set_ylabel("relative error vs float32")
  ax.set_title("FP8 dot with an outlier row and block")
  ax.legend()
  fig.tight_layout()
  fig.savefig(args.out, dpi=110)
  medians = {name: float(np.median(err)) for name, err in errors.items()}
  for name, value in medians.items():
    print(f"{name:12s} median relative row error {value:.3g}")
  print(f"wrote {args.out}")
  return medians


if __name__ == "__main__":
  main()
