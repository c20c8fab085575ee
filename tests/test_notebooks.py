"""The notebooks run top to bottom with no edits and stay small."""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob(
    "*.ipynb"))


def test_there_are_six_notebooks():
  assert [p.stem for p in NOTEBOOKS] == [
      "01_quickstart", "02_comparison", "03_migration", "04_debugging",
      "05_pure_bf16", "06_fp4"]


@pytest.mark.slow   # a kernel per notebook, 7-35 s each
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes_and_shows_outputs(path):
  assert path.stat().st_size < 100_000, "keep notebooks small"
  shipped = nbformat.read(path, as_version=4)
  code = [c for c in shipped.cells if c.cell_type == "code"]
  assert all(c.outputs for c in code), "shipped notebooks show their outputs"
  nb = nbformat.read(path, as_version=4)
  nbclient.NotebookClient(
      nb, timeout=240, kernel_name="python3",
      resources={"metadata": {"path": str(path.parents[1])}}).execute()
  for cell in nb.cells:
    for out in cell.get("outputs", []):
      assert out.output_type != "error", (out.get("ename"), out.get("evalue"))
  if path.stem in ("01_quickstart", "02_comparison", "04_debugging",
                   "05_pure_bf16", "06_fp4"):
    assert any("image/png" in out.get("data", {})
               for c in nb.cells for out in c.get("outputs", []))
