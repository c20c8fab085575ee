"""Every docs page runs on its own, as a reader runs it.

Each page of ``docs/`` with ```python blocks is run top to bottom in a fresh
interpreter (one subprocess per page): its blocks in one namespace, with
nothing imported for it, so a page that uses a name another page imported
fails here. A warning other than jmp_lite's ``PrecisionWarning`` (which the
CPU shows on purpose) fails the page, and so does a check below of what the
page's examples must leave behind. The README runs in tests/test_readme.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import ROOT

DOCS = sorted((ROOT / "docs").glob("*.md"))

# Runs argv[1]'s blocks in one namespace, then asserts argv[2:] there.
RUNNER = r"""
import re, sys, textwrap, warnings
from pathlib import Path
page = Path(sys.argv[1])
blocks = [textwrap.dedent(b) for b in re.findall(
    r"^[ \t]*```python\n(.*?)^[ \t]*```", page.read_text(), re.S | re.M)]
namespace = {"__name__": "__main__"}
with warnings.catch_warnings(record=True) as caught:
  warnings.simplefilter("always")
  for i, block in enumerate(blocks):
    exec(compile(block, f"{page.name}[python block {i}]", "exec"), namespace)
import jmp_lite
others = [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})"
          for w in caught
          if not issubclass(w.category, jmp_lite.PrecisionWarning)]
assert not others, others
for check in sys.argv[2:]:
  assert eval(check, namespace), check
print(f"ok {len(blocks)} blocks")
"""

# What some pages' examples must leave behind, beyond running: (the fewest
# python blocks the page has, expressions that hold in its namespace).
PAGE_CHECKS: dict[str, tuple[int, tuple[str, ...]]] = {
    "quickstart": (5, ("len(losses) == 20 and losses[-1] < 0.5 * losses[0]",)),
    "train_step": (6, ("int(jmp_lite.loss_scaled_state(opt_state).total_skips)"
                       " == 1",)),
    # The page asks for 8 host devices itself; the overflowing shard was
    # skipped, and the state restored and resumed.
    "distributed": (9, (
        "jax.device_count() == 8",
        "int(jmp_lite.loss_scaled_state(opt_state).total_skips) == 1",
        "e_loss.dtype == jnp.float32")),
    "low_precision": (3, ()),
}
# Pages whose run takes over 10 s on a 2-core machine (the others take 1-7 s
# each, measured alone); what their examples do is tested by default in the
# modules' own tests (test_step.py, test_linen.py and test_nnx.py,
# test_low_precision.py, test_fp8*.py, test_fp4*.py).
SLOW_PAGES = {"fp8", "fp4", "flax", "train_step", "low_precision"}


def _python_blocks(path: Path) -> list[str]:
  # Dedented, so that a block indented under a list item runs too.
  return [textwrap.dedent(block) for block in re.findall(
      r"^[ \t]*```python\n(.*?)^[ \t]*```", path.read_text(), re.S | re.M)]


def _pages():
  for page in DOCS:
    if _python_blocks(page):
      marks = [pytest.mark.slow] if page.stem in SLOW_PAGES else []
      yield pytest.param(page, id=page.stem, marks=marks)


def _reader_env() -> dict[str, str]:
  # As a reader starts Python: no device count from outside (a page that
  # wants several devices asks for them); the suite's compile flags stay.
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  return dict(os.environ, XLA_FLAGS=" ".join(flags))


@pytest.mark.parametrize("page", list(_pages()))
def test_page_runs_on_its_own(page):
  least, checks = PAGE_CHECKS.get(page.stem, (1, ()))
  assert len(_python_blocks(page)) >= least
  proc = subprocess.run(
      [sys.executable, "-c", RUNNER, str(page), *checks], cwd=ROOT,
      capture_output=True, text=True, timeout=600, env=_reader_env())
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
  assert proc.stdout.splitlines()[-1].startswith("ok "), proc.stdout


def test_runner_fails_on_a_name_from_another_page(tmp_path):
  # The guard this file exists for: a block that uses jnp without importing
  # it fails in a fresh interpreter, and a check that does not hold fails.
  page = tmp_path / "page.md"
  page.write_text("# t\n\n```python\nx = 1\n```\n\n* item\n\n  ```python\n"
                  "  y = x + 1\n  ```\n\n```sh\necho not python\n```\n")
  ok = subprocess.run([sys.executable, "-c", RUNNER, str(page), "y == 2"],
                      cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert ok.returncode == 0, ok.stderr
  assert ok.stdout.splitlines()[-1] == "ok 2 blocks"
  wrong = subprocess.run([sys.executable, "-c", RUNNER, str(page), "y == 3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert wrong.returncode != 0 and "y == 3" in wrong.stderr
  page.write_text("```python\nz = jnp.ones(2)\n```\n")
  missing = subprocess.run([sys.executable, "-c", RUNNER, str(page)],
                           cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
  assert missing.returncode != 0
  assert "NameError: name 'jnp' is not defined" in missing.stderr
