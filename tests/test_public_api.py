"""The public surface: every name exported, documented, and importable."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

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


def _public_modules() -> list[str]:
  names = []
  for info in pkgutil.walk_packages(jmp_lite.__path__, "jmp_lite."):
    if not any(part.startswith("_") for part in info.name.split(".")[1:]):
      names.append(info.name)
  return names


@pytest.mark.parametrize("modname", _public_modules())
def test_every_public_module_declares_its_surface(modname):
  """``__all__`` lists existing, documented names; a star import gives it."""
  module = importlib.import_module(modname)
  assert isinstance(getattr(module, "__all__", None), (list, tuple)), (
      f"{modname} has no __all__")
  names = list(module.__all__)
  assert len(set(names)) == len(names), names
  assert not [n for n in names if n.startswith("_")]
  missing = [n for n in names if not hasattr(module, n)]
  assert not missing, missing
  undocumented = [
      n for n in names
      if (inspect.isclass(getattr(module, n))
          or inspect.isfunction(getattr(module, n)))
      and not (inspect.getdoc(getattr(module, n)) or "").strip()]
  assert not undocumented, undocumented
  namespace: dict[str, object] = {}
  exec(f"from {modname} import *", namespace)
  assert set(namespace) - {"__builtins__"} == set(names)
