"""The README's Python snippets run; CI runs what the README promises.

Every ```python block of README.md runs, in order, in one fresh namespace
(the docs pages run, each in its own interpreter, in
tests/test_docs_pages.py). The README stays a short entry point whose links
resolve and that names every capability. CI's test command is the README's,
CI runs the slow tests the default command leaves out, and the minimum
versions CI pins are the lower bounds pyproject.toml declares.
"""

from __future__ import annotations

import ast
import re
import textwrap
import tomllib
import warnings
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "README.md")


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
  assert len(blocks) >= 1
  namespace: dict = {}
  _only_precision_warnings(_run_blocks(README, blocks, namespace))
  # The train step trained the float16 CNN with a dynamic loss scale: five
  # applied steps, a finite loss, the head kept in float32.
  import jmp_lite
  state = jmp_lite.loss_scaled_state(namespace["opt_state"])
  assert isinstance(state.loss_scale, jmp_lite.DynamicLossScale)
  assert int(state.total_skips) == 0
  assert bool(namespace["jnp"].isfinite(namespace["loss"]))
  assert namespace["computed"]["head"] == "float32"
  text = "".join(blocks)
  for name in ("loss_scaled(", "scaled_value_and_grad(", "update_and_apply(",
               "mixed_precision(", "dtype_report(", "donate_argnums"):
    assert name in text


def _slug(heading: str) -> str:
  # The anchors MyST makes (myst_heading_anchors in docs/conf.py) and
  # GitHub shows: lower case, punctuation dropped, spaces to hyphens.
  text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
  return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
  # Headings outside fenced blocks (a "# comment" in code is none).
  text = re.sub(r"^[ \t]*```.*?^[ \t]*```", "", page.read_text(),
                flags=re.S | re.M)
  return {_slug(m) for m in re.findall(r"^#+ (.*)$", text, re.M)}


def test_readme_is_one_short_entry_point_whose_links_resolve():
  text = README.read_text()
  assert len(text.splitlines()) <= 150
  # The two set-up commands, as CI runs them.
  assert "pip install . && python -m jmp_lite" in text
  assert 'pip install -e ".[test]" && python -m pytest -q' in text
  links = re.findall(r"\]\(([^)#\s]+\.md)(?:#([^)\s]+))?\)", text)
  assert {"docs/quickstart.md", "docs/install.md"} <= {p for p, _ in links}
  for path, anchor in links:
    target = ROOT / path
    assert target.is_file(), path
    if anchor:
      assert anchor in _anchors(target), f"{path}#{anchor}"


# Every capability, by the name a user would look for: the README names it
# (one line each, with a link) and the docs' index maps a need to it.
CAPABILITIES = ("get_policy", "DynamicLossScale", "loss_scaled",
                "scaled_value_and_grad", "update_and_apply", "master_weights",
                "accumulate_gradients", "skip_nonfinite", "jmp_lite.linen",
                "jmp_lite.nnx", "jmp_lite.equinox", "autocast",
                "kahan_summation", "stochastic_rounding", "state_dtypes",
                "quantized_states", "CurrentScaling", "DelayedScaling",
                "granularity=", "MXFP8", "fp8.all_gather", "init_sharded",
                "shard_map", "find_nonfinite", "gradient_health",
                "quantization_health", "benchmarks.md", "examples/")


def _lines_naming(text: str, prefix: str) -> dict[str, list[str]]:
  lines = [line for line in text.splitlines() if line.startswith(prefix)]
  return {name: [line for line in lines if name in line]
          for name in CAPABILITIES}


def test_readme_names_every_capability_with_a_link():
  # In its list (lines starting "* ") or its text, one line with a link.
  text = README.read_text()
  for name, lines in _lines_naming(text, "").items():
    assert any(re.search(r"\]\([^)]+\)", line) for line in lines), (
        f"the README names {name} on no line with a link")
  listed = _lines_naming(text, "* ")
  assert sum(bool(lines) for lines in listed.values()) >= len(
      CAPABILITIES) - 2, {n for n, lines in listed.items() if not lines}


def test_docs_index_maps_every_capability_to_a_page():
  index = (ROOT / "docs" / "index.md").read_text()
  for name, lines in _lines_naming(index, "| ").items():
    if name == "examples/":
      continue  # the examples live outside the docs site
    assert any(re.search(r"\]\(\w+\.md", line) for line in lines), (
        f"docs/index.md's table maps no need to {name} with a page")


def test_readme_says_which_extras_its_imports_need():
  text = README.read_text()
  extras = tomllib.loads((ROOT / "pyproject.toml").read_text())[
      "project"]["optional-dependencies"]
  for module, extra in (("haiku", "haiku"), ("equinox", "equinox")):
    if re.search(rf"^import {module}\b", text, re.M):
      assert extra in extras, extra
      # The install command names the extra ("[equinox,haiku]", say).
      assert re.search(rf'pip install [^`]*\[[a-z,]*\b{extra}\b', text), extra


def test_docs_has_guide_pages_and_opens_on_the_quickstart():
  names = {p.stem for p in DOCS}
  assert {"index", "quickstart", "install", "policies", "loss_scaling",
          "optax", "flax", "autocast", "diagnostics", "migration",
          "benchmarks", "notebooks"} <= names, sorted(names)
  # docs/conf.py fills the index's table of contents from GUIDE, in order.
  conf = ast.parse((ROOT / "docs" / "conf.py").read_text())
  (guide,) = [ast.literal_eval(node.value) for node in conf.body
              if isinstance(node, ast.Assign)
              and any(getattr(t, "id", None) == "GUIDE" for t in node.targets)]
  assert guide[0] == "quickstart", guide
  index = (ROOT / "docs" / "index.md").read_text()
  assert index.index("(quickstart.md)") < index.index("```{toctree}")


def test_python_block_extraction():
  # Guards the regex the README's snippet test relies on: fenced, indented, and
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


def test_default_run_leaves_out_slow_tests_and_ci_runs_them():
  pytest_config = tomllib.loads((ROOT / "pyproject.toml").read_text())[
      "tool"]["pytest"]["ini_options"]
  assert "-m 'not slow'" in pytest_config["addopts"]
  assert "--strict-markers" in pytest_config["addopts"]
  assert any(m.startswith("slow:") for m in pytest_config["markers"])
  # CI's slow part runs exactly the tests the README's command leaves out.
  ci = (ROOT / ".ci" / "run").read_text()
  assert "python -m pytest -q -m slow" in ci
  (default_parts,) = re.findall(r"then PARTS=\(([^)]*)\); fi", ci)
  assert "slow" in default_parts.split(), default_parts


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
