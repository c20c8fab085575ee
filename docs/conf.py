"""Sphinx configuration for the jmp_lite documentation site.

Build: ``pip install -e ".[docs]" && python -m sphinx -W -b html docs
docs/_build/html`` (CI runs exactly this, warnings as errors).

Why Sphinx + myst-nb (not mkdocs-material + mkdocstrings): it is what JAX,
Flax, optax and chex use, so readers get the layout and cross-reference style
they know; autodoc with napoleon reads the Google-style docstrings the code
already has; myst-nb renders the stored outputs of the notebooks without
executing them; and nitpicky mode under ``-W`` turns every broken reference
to a jmp_lite name into a build error.

Three things are generated here at build time, into ``docs/_generated/``
(gitignored), so that new modules, names, pages and notebooks appear without
editing a list by hand:

* the API reference: one page for everything in ``jmp_lite.__all__``, and one
  page per module named in ``API_MODULES`` that exists;
* the guide's table of contents on the index page, from ``GUIDE`` (pages
  that do not exist yet are left out; pages not in ``GUIDE`` are appended);
* copies of ``notebooks/*.ipynb``, rendered with their stored outputs.
"""

from __future__ import annotations

import collections
import functools
import importlib
import importlib.util
import inspect
import pkgutil
import re
import shutil
import sys
import types
from pathlib import Path
from typing import TypeVar

from sphinx.pycode import ModuleAnalyzer
from sphinx.util import logging

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
GENERATED = DOCS / "_generated"
sys.path.insert(0, str(ROOT))

import jmp_lite  # noqa: E402 (after the sys.path line above)

logger = logging.getLogger("jmp_lite_docs")

project = "jmp_lite"
author = "jmp_lite contributors"
copyright = "jmp_lite contributors"
release = jmp_lite.__version__
version = release

extensions = [
    "myst_nb",  # Markdown pages (MyST) and notebooks
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",  # Google-style Args/Returns/Raises sections
    "sphinx.ext.viewcode",
]
exclude_patterns = ["_build", "README.md", "**.ipynb_checkpoints"]
html_theme = "sphinx_book_theme"
html_title = "jmp_lite"
html_theme_options = {"show_toc_level": 2}

# Pages.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "deflist"]
nb_execution_mode = "off"  # notebooks show the outputs they were saved with
nb_merge_streams = True

# API reference.
autodoc_typehints = "description"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": False}
autosummary_generate = False  # the pages are written below
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # dataclass fields as fields, not duplicate objects
napoleon_use_rtype = False
# A method without a docstring of its own shows none (not its base class's:
# Flax's ``Module.setup`` text under an adapter's ``setup`` misleads).
autodoc_inherit_docstrings = False

# Every reference to a jmp_lite name must resolve. References to other
# libraries cannot be checked: their inventories (intersphinx) would have to
# be fetched from their sites, which CI cannot reach.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(jax|jaxlib|jnp|np|numpy|optax|flax|nn|nnx|linen|chex|orbax"
               r"|ocp|eqx|equinox|haiku|hk|jmp|ml_dtypes|dataclasses|typing"
               r"|collections|types|enum|functools|contextlib|warnings"
               r"|numbers|re|builtins|abc|os|pathlib|argparse)(\..*)?"),
    # Private names and type variables in signatures: internal by definition.
    (r"py:.*", r"jmp_lite(\.\w+)*\._\w+(\.\w+)*"),
    (r"py:.*", r"(jmp_lite(\.\w+)*\.)?_?[A-Z]"),
    # Builtins and typing names that annotations render bare.
    (r"py:.*", r"(Any|Callable|Sequence|Mapping|Iterable|Iterator|Hashable"
               r"|TypeVar|Union|Optional|Literal|NamedTuple|ArrayLike"
               r"|DTypeLike|Array|PyTree|ArrayTree|Self|T|_T|.*\._T.*"
               r"|object|type|str|int|float|bool|complex|bytes|tuple|list"
               r"|dict|set|frozenset|None|NoneType|ellipsis|callable"
               r"|Exception|ValueError|TypeError|RuntimeError|Warning"
               r"|UserWarning)"),
]

# ---------------------------------------------------------------------------
# The guide: page names (docs/<name>.md) in reading order. A name whose page
# does not exist yet is skipped; a page that exists but is not listed here is
# appended at the end, so no page is ever left out of the navigation.
GUIDE = [
    "quickstart",
    "install",
    "policies",
    "loss_scaling",
    "optax",
    "train_step",
    "flax",
    "equinox_haiku",
    "autocast",
    "low_precision",
    "fp8",
    "fp4",
    "distributed",
    "diagnostics",
    "migration",
    "benchmarks",
    "notebooks",
]
# Pages linked from elsewhere (the Reference toctree), not from the guide.
NOT_GUIDE = {"index", "development"}


def guide_pages() -> list[str]:
  existing = {p.stem for p in DOCS.glob("*.md")} - NOT_GUIDE - {"README"}
  listed = [name for name in GUIDE if name in existing]
  return listed + sorted(existing - set(GUIDE))


# ---------------------------------------------------------------------------
# The API reference.
#
# * The "jmp_lite" page documents every name in jmp_lite.__all__ (as
#   ``jmp_lite.<name>``), in sections by the module that defines it. The other
#   public names of the modules in TOP_LEVEL_MODULES are documented in their
#   section too (as ``jmp_lite.<module>.<name>``).
# * Each module in API_MODULES that exists gets a page (a listed module that
#   does not exist yet is skipped). A class or function is documented once:
#   on the top-level page if jmp_lite exports it, else on the page of the
#   module that defines it, else on the first page that exports it; other
#   pages link to it.
# * A public module in neither list fails the build, so that a new module is
#   never silently left out: add it to API_MODULES, or to NOT_API_MODULES.
API_MODULES = [
    "jmp_lite.linen",
    "jmp_lite.nnx",
    "jmp_lite.equinox",
    "jmp_lite.rules",
    "jmp_lite.report",
    "jmp_lite.presets",
    "jmp_lite.transforms",
    "jmp_lite.accumulation",
    "jmp_lite.low_precision",
    "jmp_lite.contract",
    "jmp_lite.fp8",
    "jmp_lite.fp8.linen",
    "jmp_lite.fp8.nnx",
    "jmp_lite.fp4",
    "jmp_lite.fp4.linen",
    "jmp_lite.fp4.nnx",
    "jmp_lite.diagnostics",
    "jmp_lite.step",
    "jmp_lite.master",
    "jmp_lite.dtypes",
    "jmp_lite.path_rules",
    "jmp_lite.struct",
    "jmp_lite.distributed",
]
# Modules documented on the top-level page, section titles in this order. A
# module that defines a top-level name but is not named here gets its
# docstring's first line as the title, at the end.
TOP_LEVEL_MODULES = {
    "jmp_lite.policy": "Policies",
    "jmp_lite.dtypes": "Dtypes",
    "jmp_lite.loss_scale": "Loss-scale states",
    "jmp_lite.finite": "Finiteness",
    "jmp_lite.transforms": "optax: skipping and loss scaling",
    "jmp_lite.master": "optax: master weights",
    "jmp_lite.accumulation": "optax: gradient accumulation",
    "jmp_lite.low_precision": "optax: low-precision updates",
    "jmp_lite.step": "Train steps",
    "jmp_lite.path_rules": "Per-path rules",
    "jmp_lite.autocasting": "Autocast",
    "jmp_lite.diagnostics": "Diagnostics",
}
# Public modules that are not an API: the demo and the notebooks' tasks.
NOT_API_MODULES = {"jmp_lite.demo", "jmp_lite.examples", "jmp_lite.__main__"}


def _public_modules() -> list[str]:
  names = []
  for info in pkgutil.walk_packages(jmp_lite.__path__, "jmp_lite."):
    if not any(part.startswith("_") for part in info.name.split(".")[1:]):
      names.append(info.name)
  return names + ["jmp_lite.__main__"]


def _is_data(obj: object) -> bool:
  return not (inspect.isclass(obj) or inspect.isroutine(obj)
              or isinstance(obj, functools.partial))


def _directive(qualname: str, obj: object) -> str:
  if inspect.isclass(obj):
    kind = "autoexception" if issubclass(obj, BaseException) else "autoclass"
  elif _is_data(obj):
    kind = "autodata"
  else:
    kind = "autofunction"
  return f".. {kind}:: {qualname}\n\n"


def _title(text: str, char: str = "=") -> str:
  return f"{text}\n{char * len(text)}\n\n"


def _public_names(module: types.ModuleType) -> list[str]:
  """The module's ``__all__``; without one, the public names it defines."""
  if hasattr(module, "__all__"):
    names = list(module.__all__)
  else:
    # Classes and functions defined here, and constants documented here.
    documented = {name for (scope, name) in _attr_docs(module.__name__)
                  if not scope}
    names = [name for name, obj in vars(module).items()
             if not name.startswith("_") and not isinstance(obj, TypeVar)
             and (getattr(obj, "__module__", None) == module.__name__
                  or (_is_data(obj) and name in documented))]
  return [n for n in names if not inspect.ismodule(getattr(module, n))]


@functools.cache
def _attr_docs(modname: str) -> dict[tuple[str, str], list[str]]:
  """Docstrings written under module-level names (and class attributes)."""
  try:
    return dict(ModuleAnalyzer.for_module(modname).find_attr_docs())
  except Exception:  # no source to read: no docstrings
    return {}


def _defining_module(obj: object, name: str) -> str:
  mod = getattr(obj, "__module__", None)
  if not _is_data(obj) and isinstance(mod, str) and mod.startswith("jmp_lite"):
    return mod
  # Data (a type alias, a constant): the first submodule that binds it.
  for modname in sorted(m for m in sys.modules if m.startswith("jmp_lite.")):
    if getattr(sys.modules[modname], name, None) is obj:
      return modname
  return "jmp_lite"


def _summary(module: types.ModuleType) -> str:
  doc = inspect.getdoc(module) or module.__name__
  return doc.splitlines()[0].rstrip(".")


def _entries(names: list[str], prefix: str, module: object) -> list[str]:
  out = [".. autosummary::\n   :nosignatures:\n\n"]
  out += [f"   {name}\n" for name in names]
  out.append("\n")
  for name in names:
    out.append(_directive(f"{prefix}{name}", getattr(module, name)))
  return out


def _plan(pages: list[str]):
  """Who documents what: the top-level sections and each page's entries."""
  owner: dict[int, str] = {}  # id(class or function) -> documented name
  sections: dict[str, list[tuple[str, str]]] = collections.defaultdict(list)
  for name in jmp_lite.__all__:
    obj = getattr(jmp_lite, name)
    if inspect.ismodule(obj):
      continue
    sections[_defining_module(obj, name)].append(("jmp_lite.", name))
    if not _is_data(obj):
      owner[id(obj)] = f"jmp_lite.{name}"
  for modname in TOP_LEVEL_MODULES:
    if modname in pages or modname not in sys.modules:
      continue  # documented on its own page
    module = sys.modules[modname]
    for name in _public_names(module):
      obj = getattr(module, name)
      if id(obj) not in owner and not (
          _is_data(obj) and name in jmp_lite.__all__):
        sections[modname].append((f"{modname}.", name))
        if not _is_data(obj):
          owner[id(obj)] = f"{modname}.{name}"
  # Each page first claims what its module defines, then what is left.
  for modname in pages:
    module = sys.modules[modname]
    for name in _public_names(module):
      obj = getattr(module, name)
      if not _is_data(obj) and id(obj) not in owner and (
          getattr(obj, "__module__", None) == modname):
        owner[id(obj)] = f"{modname}.{name}"
  entries: dict[str, tuple[list[str], list[str]]] = {}
  for modname in pages:
    module = sys.modules[modname]
    own, links = [], []
    for name in _public_names(module):
      obj = getattr(module, name)
      if _is_data(obj):
        own.append(name)
        continue
      owner.setdefault(id(obj), f"{modname}.{name}")
      if owner[id(obj)] == f"{modname}.{name}":
        own.append(name)
      else:
        links.append(owner[id(obj)])
    entries[modname] = (own, links)
  return sections, entries


def _top_level_page(sections) -> str:
  order = [m for m in TOP_LEVEL_MODULES if m in sections]
  order += sorted(set(sections) - set(order))
  out = [_title("jmp_lite"), ".. automodule:: jmp_lite\n   :no-members:\n\n",
         ".. currentmodule:: jmp_lite\n\n"]
  for modname in order:
    title = (TOP_LEVEL_MODULES.get(modname)
             or _summary(sys.modules[modname]))
    out.append(_title(title, "-"))
    out.append(".. autosummary::\n   :nosignatures:\n\n")
    # Relative to the current module, jmp_lite: "Policy", "autocasting.Audit".
    out += [f"   {prefix.removeprefix('jmp_lite.')}{name}\n"
            for prefix, name in sections[modname]]
    out.append("\n")
    for prefix, name in sections[modname]:
      module = jmp_lite if prefix == "jmp_lite." else sys.modules[modname]
      out.append(_directive(f"{prefix}{name}", getattr(module, name)))
  submodules = [n for n in jmp_lite.__all__
                if inspect.ismodule(getattr(jmp_lite, n))]
  if submodules:
    out.append(_title("Submodules", "-"))
    out += [f"* :mod:`jmp_lite.{name}`\n" for name in submodules]
  return "".join(out)


def _module_page(modname: str, own: list[str], links: list[str]) -> str:
  module = sys.modules[modname]
  out = [_title(modname), f".. automodule:: {modname}\n   :no-members:\n\n",
         f".. currentmodule:: {modname}\n\n"]
  if own:
    out += _entries(own, f"{modname}.", module)
  if links:
    out.append(_title(f"Also in {modname}", "-"))
    out.append("Documented with the module that defines them:\n\n")
    out += [f"* :obj:`{target}`\n" for target in links]
  return "".join(out)


def write_api_pages() -> None:
  target = GENERATED / "api"
  shutil.rmtree(target, ignore_errors=True)
  target.mkdir(parents=True)
  pages = []
  for modname in API_MODULES:
    if importlib.util.find_spec(modname) is None:
      continue  # not written yet
    importlib.import_module(modname)  # an import error fails the build
    pages.append(modname)
  for modname in TOP_LEVEL_MODULES:
    if importlib.util.find_spec(modname) is not None:
      importlib.import_module(modname)
  sections, entries = _plan(pages)
  for modname in pages:
    (target / f"{modname}.rst").write_text(_module_page(modname,
                                                        *entries[modname]))
  (target / "jmp_lite.rst").write_text(_top_level_page(sections))
  (target / "index.rst").write_text(
      _title("API reference") + ".. toctree::\n   :maxdepth: 1\n\n"
      + "".join(f"   {m}\n" for m in ["jmp_lite", *pages]))
  undecided = sorted(set(_public_modules()) - set(API_MODULES)
                     - set(TOP_LEVEL_MODULES) - NOT_API_MODULES)
  if undecided:
    # Reported once Sphinx's logging is set up (config-inited, below).
    _PENDING_WARNINGS.append(
        f"public module(s) {undecided} are not in the API reference: add"
        " them to API_MODULES (or, if they are not an API, NOT_API_MODULES)"
        " in docs/conf.py")


def copy_notebooks() -> None:
  target = GENERATED / "notebooks"
  shutil.rmtree(target, ignore_errors=True)
  target.mkdir(parents=True)
  for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
    shutil.copy2(path, target / path.name)


_PENDING_WARNINGS: list[str] = []
write_api_pages()
copy_notebooks()


# ---------------------------------------------------------------------------
# Hooks.
def _fill_guide(app, docname: str, source: list[str]) -> None:
  if docname == "index":
    source[0] = source[0].replace("GUIDE_PAGES", "\n".join(guide_pages()))


def _attribute_doc(name: str) -> list[str]:
  """The docstring written under a module-level name where it is bound.

  autodoc looks for the docstring of ``jmp_lite.LossScale`` (a type alias)
  in jmp_lite/__init__.py, but it is written next to the definition; and for
  a constant without one it would show its type's docstring instead.
  """
  modname, short = name.rsplit(".", 1)
  obj = getattr(sys.modules.get(modname), short, None)
  binders = [m for m in sorted(sys.modules) if m.startswith("jmp_lite.")
             and getattr(sys.modules[m], short, None) is obj]
  for candidate in [modname, *binders]:
    docs = _attr_docs(candidate)
    if ("", short) in docs:
      return list(docs[("", short)])
  return []


def _require_docstrings(app, what, name, obj, options, lines) -> None:
  if what == "data":
    lines[:] = _attribute_doc(name)
  if what == "attribute":
    return  # dataclass fields are described by their class's docstring
  if not any(line.strip() for line in lines):
    logger.warning(f"{name} ({what}) has no docstring", type="jmp_lite",
                   subtype="docstring")


def _overrides(cls: type, name: str) -> bool:
  return any(name in vars(base) for base in cls.__mro__[1:])


def _show_undocumented_methods(app, what, name, obj, skip, options):
  # autodoc drops undocumented members silently: keep a public method or
  # property that a class adds (not a framework hook it overrides, such as
  # Flax's ``setup``) so that _require_docstrings reports it.
  if not (what in ("class", "exception") and skip
          and not name.startswith("_") and not obj.__doc__):
    return None
  if inspect.isfunction(obj) or isinstance(obj, property):
    qual = getattr(obj, "__qualname__", "") or getattr(
        obj.fget, "__qualname__", "")
    owner = inspect.getmodule(obj.fget if isinstance(obj, property) else obj)
    cls = getattr(owner, qual.split(".")[0], None) if "." in qual else None
    if isinstance(cls, type) and _overrides(cls, name):
      return None
    return False
  return None


def _resolve_within_jmp_lite(app, env, node, contnode):
  """Resolves a short reference to the one jmp_lite object of that name.

  A docstring written in ``jmp_lite.diagnostics`` says :func:`find_nonfinite`;
  documented as ``jmp_lite.find_nonfinite`` on the top-level page, Sphinx
  looks for ``jmp_lite.find_nonfinite``'s neighbours only. This tries, in
  order: the name in the module the reference is made from, in the module
  its docstring was written in (and that module's parents), at the top
  level, and anywhere in jmp_lite if exactly one object has that name. A
  reference that still matches nothing (or several objects) stays broken and
  fails the build.
  """
  if node.get("refdomain") != "py":
    return None
  target = node["reftarget"].lstrip(".~")
  domain = env.get_domain("py")
  # Another library's name matches nothing here: see nitpick_ignore_regex.
  names = [n for n in domain.objects
           if n.startswith("jmp_lite") and (n == target
                                            or n.endswith("." + target))]
  # Where the text was written: "...:docstring of jmp_lite.autocasting.x".
  home = re.search(r"docstring of ([\w.]+)", node.source or "")
  parts = home.group(1).split(".") if home else []
  scopes = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
  scopes.insert(0, node.get("py:module") or "")
  preferred = [f"{scope}.{target}" for scope in scopes if scope]
  preferred += [f"jmp_lite.{target}", target]
  chosen = next((n for n in preferred if n in names), None)
  if chosen is None and len(set(names)) == 1:
    chosen = names[0]
  if chosen is None:
    return None
  return domain.resolve_xref(env, node["refdoc"], app.builder,
                             node["reftype"], chosen, node, contnode)


def _report_pending(app, config) -> None:
  for message in _PENDING_WARNINGS:
    logger.warning(message, type="jmp_lite", subtype="api")


def setup(app):
  app.connect("config-inited", _report_pending)
  app.connect("source-read", _fill_guide)
  app.connect("autodoc-process-docstring", _require_docstrings)
  app.connect("autodoc-skip-member", _show_undocumented_methods)
  app.connect("missing-reference", _resolve_within_jmp_lite)
  return {"parallel_read_safe": True}
