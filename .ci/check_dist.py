"""Checks what the built wheel and sdist contain.

  python .ci/check_dist.py dist/jmp_lite-X-py3-none-any.whl \
      dist/jmp_lite-X.tar.gz

Every module under jmp_lite/ in the checkout, the C++ kernel sources it
compiles on first use, and the ``py.typed`` marker must be in both; the
wheel holds the package only (no tests, benchmarks or notebooks); the
wheel's metadata declares the extras and the supported Python versions.
Exits non-zero naming what is wrong.
"""

from __future__ import annotations

import email.parser
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = {"cuda", "cuda13", "equinox", "test", "docs", "lint"}


def _package_files() -> set[str]:
  files = {p.relative_to(ROOT).as_posix()
           for pattern in ("*.py", "*.cc")
           for p in (ROOT / "jmp_lite").rglob(pattern)
           if "__pycache__" not in p.parts}
  return files | {"jmp_lite/py.typed"}


def main(wheel: Path, sdist: Path) -> list[str]:
  problems = []
  expected = _package_files()
  with zipfile.ZipFile(wheel) as zf:
    names = set(zf.namelist())
    meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
    meta = email.parser.Parser().parsestr(zf.read(meta_name).decode())
  missing = sorted(expected - names)
  if missing:
    problems.append(f"wheel lacks {missing}")
  strays = sorted(n for n in names if not (
      n.startswith("jmp_lite/") or ".dist-info/" in n))
  if strays:
    problems.append(f"wheel holds files outside the package: {strays}")
  extras = set(meta.get_all("Provides-Extra") or [])
  if not EXTRAS <= extras:
    problems.append(f"wheel metadata lacks extras {sorted(EXTRAS - extras)}")
  if meta["Requires-Python"] != ">=3.11":
    problems.append(f"Requires-Python is {meta['Requires-Python']!r}")
  if not meta.get("License-Expression"):
    problems.append("wheel metadata has no License-Expression")

  with tarfile.open(sdist) as tf:
    # Strip the leading "jmp_lite-X/" directory.
    members = {m.name.split("/", 1)[1] for m in tf.getmembers()
               if "/" in m.name}
  missing = sorted((expected | {"pyproject.toml", "README.md"}) - members)
  if missing:
    problems.append(f"sdist lacks {missing}")
  return problems


if __name__ == "__main__":
  found = main(Path(sys.argv[1]), Path(sys.argv[2]))
  for problem in found:
    print(f"check_dist: {problem}", file=sys.stderr)
  if not found:
    print(f"check_dist: wheel and sdist hold all {len(_package_files())}"
          " package files, py.typed and the extras")
  sys.exit(1 if found else 0)
