"""Every script in examples/ runs as a user runs it, and checks itself.

Each script is started in its own interpreter with a small ``--steps``; it
asserts what it demonstrates (dtypes, a skipped step, bytes per parameter,
FP8 matmuls in the program, a resumed run equal to an uninterrupted one)
and prints ``ok`` last, so a script whose claim stops holding fails here.
examples/README.md lists every script.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

EXAMPLES = ROOT / "examples"
# Steps for the test run, and whether a run takes well over 10 s on a
# 2-core machine (mostly compilation: FP8 quantisation, orbax, 8 devices).
RUNS = {
    "linen_bf16_loss_scaling.py": (20, False),
    "nnx_float16_dynamic_scaling.py": (20, False),
    "equinox_mlp.py": (20, False),
    # 8-bit states' layout and bytes are checked by default in
    # tests/test_quantized_states.py; the script's run goes to the slow set.
    "pure_bf16_8bit_states.py": (20, True),
    "fp8_transformer.py": (8, True),
    "data_parallel_shard_map.py": (10, True),
    "checkpoint_resume_orbax.py": (10, True),
}


def test_every_example_is_run_here_and_listed():
  scripts = {p.name for p in EXAMPLES.glob("*.py")}
  assert scripts == set(RUNS), scripts ^ set(RUNS)
  listing = (EXAMPLES / "README.md").read_text()
  linked = set(re.findall(r"\]\(([\w.]+\.py)\)", listing))
  assert linked == scripts, linked ^ scripts
  for name in scripts:
    tree = ast.parse((EXAMPLES / name).read_text())
    doc = ast.get_docstring(tree)
    assert doc and f"examples/{name} --steps" in doc, name
    assert "--steps" in (EXAMPLES / name).read_text(), name


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=[pytest.mark.slow] if slow else [], id=name[:-3])
    for name, (_, slow) in RUNS.items()])
def test_example_runs_and_checks_what_it_shows(name):
  steps, _ = RUNS[name]
  proc = subprocess.run(
      [sys.executable, str(EXAMPLES / name), "--steps", str(steps)],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
  assert proc.stdout.splitlines()[-1] == "ok", proc.stdout
