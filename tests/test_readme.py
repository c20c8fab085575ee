"""Every Python snippet in the README runs, in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_snippets_run():
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
  assert len(blocks) >= 5
  namespace: dict = {}
  import warnings
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for i, block in enumerate(blocks):
      exec(compile(block, f"README.md[python block {i}]", "exec"), namespace)
  # The diagnostics snippet demonstrates check_hardware's warning on CPU.
  import jmp_lite
  assert any(issubclass(w.category, jmp_lite.PrecisionWarning) for w in caught)
  assert not [w for w in caught
              if not issubclass(w.category, jmp_lite.PrecisionWarning)]
  # The snippets left a bfloat16 model trained with master weights and a
  # Flax model under the O2 preset.
  assert namespace["half_params"]["w"].dtype == namespace["jnp"].bfloat16
  assert namespace["o2"].name == "O2"
  text = "".join(blocks)
  for name in ("loss_scaled", "master_weights", "accumulate_gradients",
               "mixed_precision", "dtype_report", "preset("):
    assert name in text


def test_readme_test_command_is_the_ci_command():
  ci = (README.parent / ".ci" / "run").read_text()
  command = 'pip install -e ".[test]" && python -m pytest -q'
  assert command in README.read_text()
  assert command in ci


def test_core_and_optax_layers_import_without_flax():
  import subprocess
  import sys
  code = ("import sys, jmp_lite; assert 'flax' not in sys.modules, "
          "sorted(m for m in sys.modules if m.startswith('flax'))")
  subprocess.run([sys.executable, "-c", code], check=True,
                 cwd=README.parent)
