"""The README's and the docs' Python snippets run; CI runs what they promise.

Every ```python block of README.md runs, in order, in one namespace; so does
every block of each docs/*.md page (one namespace per page, starting from the
README's imports). CI's test command is the README's, and the minimum
versions CI pins are the lower bounds pyproject.toml declares.
"""

from __future__ import annotations

import re
import textwrap
import tomllib
import warnings
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "README.md")
# The imports every README and docs example assumes.
IMPORTS = """\
import jax
import jax.numpy as jnp
import numpy as np
import optax
import jmp_lite
"""


def _python_blocks(path: Path) -> list[str]:
  # Dedented, so that a block indented under a list item runs too.
  return [textwrap.dedent(block) for block in re.findall(
      r"^[ \t]*```python\n(.*?)^[ \t]*```", path.read_text(), re.S | re.M)]


def _run_blocks(path: Path, blocks: list[str], namespace: dict) -> list:
  """Runs the blocks in order; returns the warnings they emitted."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for i, block in enumerate(blocks):
      exec(compile(block, f"{path.name}[python block {i}]", "exec"),
           namespace)
  return caught


def _only_precision_warnings(caught: list) -> None:
  # check_hardware's PrecisionWarning on the CPU is shown on purpose; any
  # other warning (a deprecation, say) is a defect of the example.
  import jmp_lite
  others = [w for w in caught
            if not issubclass(w.category, jmp_lite.PrecisionWarning)]
  assert not others, [f"{w.category.__name__}: {w.message}" for w in others]


def test_readme_python_snippets_run():
  blocks = _python_blocks(README)
  assert len(blocks) >= 5
  namespace: dict = {}
  caught = _run_blocks(README, blocks, namespace)
  # The diagnostics snippet demonstrates check_hardware's warning on CPU
  # (on a GPU with bfloat16 tensor cores there is nothing to warn about).
  import jax

  import jmp_lite
  warned = any(issubclass(w.category, jmp_lite.PrecisionWarning)
               for w in caught)
  assert warned == bool(jmp_lite.check_hardware("bf16", warn=False))
  if jax.default_backend() == "cpu":
    assert warned
  _only_precision_warnings(caught)
  # The snippets left a bfloat16 model trained with master weights and a
  # Flax model under the O2 preset.
  assert namespace["half_params"]["w"].dtype == namespace["jnp"].bfloat16
  assert namespace["o2"].name == "O2"
  text = "".join(blocks)
  for name in ("loss_scaled", "master_weights", "accumulate_gradients",
               "mixed_precision", "dtype_report", "preset("):
    assert name in text


def test_docs_has_guide_pages():
  names = {p.stem for p in DOCS}
  assert {"index", "install", "policies", "loss_scaling", "optax", "flax",
          "autocast", "diagnostics", "migration", "benchmarks",
          "notebooks"} <= names, sorted(names)


@pytest.mark.parametrize(
    "page", [p for p in DOCS if _python_blocks(p)], ids=lambda p: p.stem)
def test_docs_python_snippets_run(page):
  blocks = _python_blocks(page)
  namespace: dict = {}
  exec(compile(IMPORTS, "imports", "exec"), namespace)
  _only_precision_warnings(_run_blocks(page, blocks, namespace))


def test_python_block_extraction():
  # Guards the regex the two snippet tests rely on: fenced, indented, and
  # non-Python blocks.
  import tempfile
  text = ("# t\n\n```python\nx = 1\n```\n\n* item\n\n  ```python\n  y = x + 1\n"
          "  ```\n\n```sh\necho not python\n```\n")
  with tempfile.TemporaryDirectory() as tmp:
    path = Path(tmp) / "page.md"
    path.write_text(text)
    assert _python_blocks(path) == ["x = 1\n", "y = x + 1\n"]


def test_readme_test_command_is_the_ci_command():
  ci = (ROOT / ".ci" / "run").read_text()
  command = 'pip install -e ".[test]" && python -m pytest -q'
  assert command in README.read_text()
  assert command in ci


def _declared_requirements() -> list[Requirement]:
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  lines = list(project["dependencies"])
  for extra in project["optional-dependencies"].values():
    lines += extra
  return [Requirement(line) for line in lines]


def _lower_bound(req: Requirement) -> Version | None:
  bounds = [Version(s.version) for s in req.specifier
            if s.operator in (">=", "==")]
  return max(bounds) if bounds else None


def test_minimum_pins_are_the_declared_lower_bounds():
  pins = {}
  for line in (ROOT / ".ci" / "minimum.txt").read_text().splitlines():
    line = line.split("#")[0].strip()
    if line:
      req = Requirement(line)
      (spec,) = req.specifier
      assert spec.operator == "==", line
      pins[req.name.lower()] = Version(spec.version)
  declared: dict[str, Version] = {}
  for req in _declared_requirements():
    bound = _lower_bound(req)
    name = req.name.lower()
    if bound is not None:
      declared[name] = max(bound, declared.get(name, bound))
  # Every runtime dependency is pinned at its lower bound.
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  for line in project["dependencies"]:
    assert Requirement(line).name.lower() in pins, line
  for name, pin in pins.items():
    if name == "jaxlib":  # not declared: jax requires the matching jaxlib
      assert pin == pins["jax"], (pin, pins["jax"])
      continue
    assert name in declared, f"{name} is pinned but not declared"
    assert pin == declared[name], (name, pin, declared[name])


def test_core_and_optax_layers_import_without_flax():
  import subprocess
  import sys
  code = ("import sys, jmp_lite; assert 'flax' not in sys.modules, "
          "sorted(m for m in sys.modules if m.startswith('flax'))")
  subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
