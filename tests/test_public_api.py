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


# jmp 0.0.4's public names: `import jmp_lite as jmp` must run jmp code.
JMP_NAMES = {"DynamicLossScale", "LossScale", "NoOpLossScale", "Policy",
             "StaticLossScale", "all_finite", "cast_to_full", "cast_to_half",
             "get_policy", "half_dtype", "select_tree"}

# Names that left the top level (issue 28's curated surface) and where they
# live: the state classes of the optimizer wrappers.
MOVED = {
    "AccumulateState": "jmp_lite.accumulation",
    "KahanState": "jmp_lite.low_precision",
    "MasterWeightsState": "jmp_lite.master",
    "SkipNonfiniteState": "jmp_lite.transforms",
    "StateDtypesState": "jmp_lite.low_precision",
    "StochasticRoundingState": "jmp_lite.low_precision",
}


def test_the_top_level_is_curated():
  names = set(jmp_lite.__all__)
  assert JMP_NAMES <= names
  assert len(names) <= 42, sorted(names)
  assert not [n for n in names if inspect.ismodule(getattr(jmp_lite, n))]
  for name, modname in MOVED.items():
    assert name not in names and not hasattr(jmp_lite, name), name
    assert name in importlib.import_module(modname).__all__


def test_every_module_path_the_docs_show_still_imports():
  """Users have code: the paths the README, docs and notebooks show."""
  for modname in ("dtypes", "struct", "step", "transforms", "master",
                  "accumulation", "low_precision", "contract", "diagnostics",
                  "fp8", "fp4", "path_rules", "policy", "loss_scale", "finite",
                  "autocasting", "examples"):
    assert inspect.ismodule(getattr(jmp_lite, modname, None)) or (
        importlib.import_module(f"jmp_lite.{modname}")), modname
  from jmp_lite.diagnostics import tree_bytes  # noqa: F401
  assert callable(jmp_lite.step.formulation)
  assert callable(jmp_lite.struct.find_nodes)


def test_one_meaning_per_name():
  """A name exported by several public modules is the same object in each
  (autocast's FLOAT32 primitive list and the rules' FLOAT32 policy were two
  meanings of one name)."""
  meanings: dict[str, dict[int, list[str]]] = {}
  for modname in ["jmp_lite", *_public_modules()]:
    module = importlib.import_module(modname)
    for name in getattr(module, "__all__", ()):
      obj = getattr(module, name)
      if inspect.ismodule(obj):
        continue
      meanings.setdefault(name, {}).setdefault(id(obj), []).append(modname)
  # The framework adapters offer one API per framework by design
  # (jmp_lite.linen.mixed_precision, jmp_lite.nnx.mixed_precision, ...;
  # jmp_lite.fp8.nnx.commit is jmp_lite.fp8.commit for nnx modules): the
  # same meaning, for another framework.
  # jmp_lite.fp4 mirrors jmp_lite.fp8's API (dot_general) for 4-bit formats.
  adapters = {"jmp_lite.linen", "jmp_lite.nnx", "jmp_lite.equinox",
              "jmp_lite.fp8.linen", "jmp_lite.fp8.nnx", "jmp_lite.fp4",
              "jmp_lite.fp4.linen", "jmp_lite.fp4.nnx"}
  clashes = {name: list(by_id.values()) for name, by_id in meanings.items()
             if len(by_id) > 1 and len(
                 {m for mods in by_id.values() for m in mods} - adapters) > 1}
  assert not clashes, clashes
