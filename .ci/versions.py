"""Prints the versions CI tested, and checks that "newest" means newest.

Run inside a CI virtual environment after jmp-lite is installed:

  python .ci/versions.py                 # print the versions
  python .ci/versions.py --check-newest  # and compare them with the index

For each package named below, ``--check-newest`` asks pip for the newest
release on the index (for this interpreter) and compares it with what pip
installed:

* the newest release is inside the range jmp-lite declares, but an older one
  was installed: something held it back (a conflict, a stale pin). That fails,
  because a user installing next to the newest JAX/Flax would be downgraded.
* the newest release is outside the declared range (a new JAX minor came
  out): a notice says so. Run the suite on it and raise the upper bound in
  pyproject.toml (see docs/install.md); CI stays green until then.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import subprocess
import sys

from packaging.requirements import Requirement
from packaging.version import Version

# Compared with the index by --check-newest.
CHECKED = ("jax", "jaxlib", "flax", "optax", "chex", "orbax-checkpoint")
# Printed only: other packages may cap numpy, and that is not ours to fix.
PRINTED = ("numpy",)


def _declared() -> dict[str, Requirement]:
  """jmp-lite's requirements (every extra included), by normalised name."""
  out = {}
  for line in md.requires("jmp-lite") or []:
    req = Requirement(line)
    name = req.name.lower().replace("_", "-")
    if name in out:  # several extras name it: keep the tightest (any works)
      req.specifier &= out[name].specifier
    out[name] = req
  return out


def _newest_on_index(name: str) -> Version | None:
  proc = subprocess.run(
      [sys.executable, "-m", "pip", "index", "versions", name],
      capture_output=True, text=True, check=False)
  match = re.search(rf"^{re.escape(name)} \(([^)]+)\)", proc.stdout,
                    re.M | re.I)
  return Version(match.group(1)) if match else None


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check-newest", action="store_true")
  args = parser.parse_args()
  declared = _declared()
  failures = []
  print(f"python {sys.version.split()[0]}")
  for name in CHECKED + PRINTED:
    installed = Version(md.version(name))
    spec = declared[name].specifier if name in declared else None
    line = f"  {name:18} {installed}"
    if args.check_newest and name in CHECKED:
      newest = _newest_on_index(name)
      if newest is None:
        line += "   (newest on the index: could not tell)"
      elif newest == installed:
        line += "   (the newest release)"
      elif spec is not None and not spec.contains(newest):
        line += (f"   NOTICE: {newest} is out, outside the tested range"
                 f" '{spec}': run the suite on it and bump pyproject.toml")
      else:
        line += f"   FAIL: {newest} is allowed but {installed} was installed"
        failures.append(name)
    print(line)
  if failures:
    print(f"versions: pip held back {', '.join(failures)}: run"
          " `pip install -e .[test]` after installing the newest releases to"
          " see the conflict", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
