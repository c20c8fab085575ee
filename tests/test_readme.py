"""Every Python snippet in the README runs, in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_snippets_run():
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
  assert len(blocks) >= 5
  namespace: dict = {}
  for i, block in enumerate(blocks):
    exec(compile(block, f"README.md[python block {i}]", "exec"), namespace)
  # The last snippets left a bfloat16 model trained with master weights.
  assert namespace["half_params"]["w"].dtype == namespace["jnp"].bfloat16
  assert "accumulate_gradients" in blocks[-1]


def test_readme_test_command_is_the_ci_command():
  ci = (README.parent / ".ci" / "run").read_text()
  command = 'pip install -e ".[test]" && python -m pytest -q'
  assert command in README.read_text()
  assert command in ci
