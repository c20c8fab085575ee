"""jmp_lite.linen's contracts with the user and with Flax (issue 28).

Nothing the user hands over is modified, nothing is planted on Flax's
objects, no state lives at module level, and Flax's private names appear
only in ``jmp_lite/_flax_compat.py``.
"""

from __future__ import annotations

import copy
import pathlib
import pickle
import re
import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from jmp_lite import linen as jl

ROOT = pathlib.Path(__file__).resolve().parents[1]


class Block(nn.Module):
  """A setup submodule held as a field, a compact one, a norm."""

  head: nn.Module

  @nn.compact
  def __call__(self, x):
    x = nn.LayerNorm()(nn.Dense(4, dtype=jnp.float32)(x))
    return self.head(x)


def _snapshot(module):
  """Every field of the module and of the modules in its fields, by value."""
  out = {}
  for name, value in vars(module).items():
    if isinstance(value, nn.Module):
      out[name] = (type(value), _snapshot(value))
    else:
      out[name] = value
  return out


def test_the_users_modules_are_not_modified():
  head = nn.Dense(3, dtype=jnp.float32, name="head")
  model = Block(head)
  before = _snapshot(model)
  head_before = _snapshot(head)
  wrapped = jl.mixed_precision(model, "p=f32,c=bf16,o=f32",
                               rules=[(nn.Dense, "c=f16")])
  x = jnp.ones((2, 3))
  variables = wrapped.init(jax.random.key(0), x)
  wrapped.apply(variables, x)
  jax.jit(wrapped.apply)(variables, x)
  jl.dtype_report(wrapped, variables, x)
  wrapped.policy_for(variables, x)
  assert wrapped.module is model
  assert _snapshot(model) == before and _snapshot(head) == head_before
  assert model.scope is None and head.scope is None
  assert head.dtype == jnp.float32


def test_nothing_is_planted_on_flax_objects():
  x = jnp.ones((2, 3))
  model = Block(nn.Dense(3))
  wrapped = jl.mixed_precision(model, "c=bf16")
  variables = wrapped.init(jax.random.key(0), x)
  wrapped.apply(variables, x)
  for obj in (model, model.head, wrapped, nn.Dense, nn.LayerNorm, nn.Module,
              jl.MixedPrecision):
    names = set(vars(obj))
    assert not {n for n in names if "jmp_lite" in n.lower()}, obj


def test_no_module_level_mutable_state():
  """No thread-local globals: what a call needs travels with it."""
  import jmp_lite._flax_compat as compat
  import jmp_lite.linen._attention as attention
  import jmp_lite.linen._cache as cache
  import jmp_lite.linen._intercept as intercept
  import jmp_lite.linen._report as report

  for module in (jl, cache, intercept, attention, compat, report):
    for name, value in vars(module).items():
      assert not isinstance(value, threading.local), (module, name)
      # A package's __path__ is a list the import system owns.
      assert not isinstance(value, (list, set, dict)) or name in {
          "__all__", "__builtins__", "__annotations__",
          *(("__path__",) if module is jl else ())}, (module, name)


def test_the_memo_takes_no_part_in_equality():
  """It compared equal to everything, so that wrappers hashed alike; now
  it is excluded from the wrapper's equality instead."""
  model = nn.Dense(2)
  a = jl.mixed_precision(model, "c=bf16")
  b = jl.mixed_precision(model, "c=bf16")
  assert a.memo is not b.memo
  assert a.memo != b.memo and a.memo != object()
  assert a == b and hash(a) == hash(b)
  assert a != jl.mixed_precision(model, "c=f16")
  x = jnp.ones((1, 3))
  variables = a.init(jax.random.key(0), x)
  a.apply(variables, x)
  assert a.memo.classes and not b.memo.classes
  # Flax's clones share it: the same cache.
  assert a.clone().memo is a.memo
  # A cache: an unpickled wrapper starts with an empty one.
  restored = pickle.loads(pickle.dumps(a.memo))
  assert isinstance(restored, type(a.memo)) and not restored.classes
  assert copy.deepcopy(a) == a


def test_policies_in_threads_do_not_see_each_other():
  """State is per call: two policies traced at once in two threads."""
  x = jnp.ones((2, 3))
  models = {c: jl.mixed_precision(Block(nn.Dense(3)), f"c={c}")
            for c in ("bf16", "f16")}
  variables = models["bf16"].init(jax.random.key(0), x)
  out, errors = {}, []

  def run(c):
    try:
      for _ in range(3):
        out[c] = jl.dtype_report(models[c], variables, x)
    except Exception as e:  # noqa: BLE001 (reported below)
      errors.append(e)

  threads = [threading.Thread(target=run, args=(c,)) for c in models]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors
  for c, want in (("bf16", "bfloat16"), ("f16", "float16")):
    rows = {r.path: r for r in out[c].rows}
    assert rows["Dense_0"].computed == want


# jmp_lite.linen's own private modules (jmp_lite.linen._cache) are not Flax's.
_PRIVATE_FLAX = re.compile(
    r"(?<!jmp_lite\.)\b(?:nn|linen|flax\.linen)\.(?:\w+\.)*_[A-Za-z]\w*"
    r"|from flax\.linen(?:\.\w+)* import _"
    r"|wrap_method_once|_global_interceptor_stack")


@pytest.mark.parametrize("path", sorted(
    p.relative_to(ROOT).as_posix() for p in (ROOT / "jmp_lite").rglob("*.py")
    if p.relative_to(ROOT).as_posix() != "jmp_lite/_flax_compat.py"))
def test_flax_private_names_only_in_the_compat_module(path):
  text = (ROOT / path).read_text()
  assert not _PRIVATE_FLAX.findall(text), path


def test_fields_are_overridden_only_in_the_compat_module():
  paths = sorted((ROOT / "jmp_lite" / "linen").glob("*.py"))
  assert ROOT / "jmp_lite" / "linen" / "__init__.py" in paths
  for path in paths:
    if path.name != "_flax_compat.py":
      assert "object.__setattr__" not in path.read_text(), path
