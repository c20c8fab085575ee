"""The public surface: every name exported, documented, and importable."""

from __future__ import annotations

import inspect

import jmp_lite


def test_all_matches_the_module():
  public = {n for n in dir(jmp_lite) if not n.startswith("_")}
  assert set(jmp_lite.__all__) <= public
  assert list(jmp_lite.__all__) == sorted(
      jmp_lite.__all__, key=lambda n: (n[0].islower(), n))


def test_every_public_name_has_a_docstring_with_an_example():
  missing, no_example = [], []
  for name in jmp_lite.__all__:
    obj = getattr(jmp_lite, name)
    if inspect.ismodule(obj) or name == "LossScale":
      continue
    doc = inspect.getdoc(obj) or ""
    if not doc.strip():
      missing.append(name)
    elif inspect.isfunction(obj) and ">>>" not in doc and "Example" not in doc:
      no_example.append(name)
  assert not missing, missing
  assert not no_example, no_example
