"""The Flax internals jmp_lite.linen relies on, one test each.

``jmp_lite/_flax_compat.py`` is the only place that reaches past
Flax's public API; these tests fail when one of those internals changes or
disappears, before the adapter breaks in a confusing way.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from jmp_lite import _flax_compat as compat


def _pass_through(next_fun, args, kwargs, context):
  return next_fun(*args, **kwargs)


def test_wrap_method_once_is_where_it_was():
  from flax.linen import module as flax_module
  assert callable(flax_module.wrap_method_once)


def test_a_wrapped_function_is_a_method_call_but_no_attribute():
  """Setup first, seen by interceptors by its name, not an attribute."""
  order = []

  class WithSetup(nn.Module):
    def setup(self):
      order.append("setup")
      self.dense = nn.Dense(2)

  def policy_like(module, x):
    order.append("fun")
    return module.dense(x)

  wrapped = compat.wrap_method(policy_like)
  seen = []

  def spy(next_fun, args, kwargs, context):
    seen.append((type(context.module).__name__, context.method_name))
    return next_fun(*args, **kwargs)

  x = jnp.ones((1, 3))
  with nn.intercept_methods(spy):
    variables = WithSetup().init(jax.random.key(0), x, method=wrapped)
  assert order[:2] == ["setup", "fun"]
  assert ("WithSetup", "policy_like") in seen
  assert not hasattr(WithSetup(), "policy_like")
  assert set(variables["params"]) == {"dense"}


def test_the_interceptor_stack_is_where_it_was():
  from flax.linen import module as flax_module
  stack = flax_module._global_interceptor_stack  # noqa: SLF001
  before = len(stack)
  with nn.intercept_methods(_pass_through):
    assert len(stack) == before + 1
  assert len(stack) == before


def test_interceptors_active_inside_and_only_inside():
  assert not compat.interceptors_active()
  with nn.intercept_methods(_pass_through):
    assert compat.interceptors_active()
    with nn.intercept_methods(_pass_through):
      assert compat.interceptors_active()
  assert not compat.interceptors_active()


def test_interceptors_see_flaxs_bound_copy_not_the_users_module():
  """fields_overridden acts on context.module: Flax's copy for this apply."""
  layer = nn.Dense(2, dtype=jnp.float32)
  modules = []

  def override(next_fun, args, kwargs, context):
    modules.append(context.module)
    with compat.fields_overridden(context.module, {"dtype": jnp.bfloat16,
                                                   "not_a_field": 1}):
      assert context.module.dtype == jnp.bfloat16
      return next_fun(*args, **kwargs)

  x = jnp.ones((1, 3))
  variables = layer.init(jax.random.key(0), x)
  with nn.intercept_methods(override):
    y = layer.apply(variables, x)
  assert y.dtype == jnp.bfloat16           # The override took effect,
  assert modules and all(m is not layer for m in modules)  # on a copy,
  assert all(m.dtype == jnp.float32 for m in modules)      # restored after,
  assert layer.dtype == jnp.float32 and layer.scope is None  # user's intact.
  assert not hasattr(modules[0], "not_a_field")


def test_flax_refuses_plain_field_assignment_on_bound_modules():
  """Why the override goes through object.__setattr__ (and only there)."""
  errors = []

  def assign(next_fun, args, kwargs, context):
    try:
      context.module.dtype = jnp.bfloat16
    except Exception as e:  # noqa: BLE001 (inspected below)
      errors.append(e)
    return next_fun(*args, **kwargs)

  layer = nn.Dense(2)
  x = jnp.ones((1, 3))
  variables = layer.init(jax.random.key(0), x)
  with nn.intercept_methods(assign):
    layer.apply(variables, x)
  assert dataclasses.is_dataclass(layer)
  assert errors and "frozen" in str(errors[0]).lower()


def test_the_public_clone_route_records_each_layer_twice():
  """Why fields_overridden does not bind a Module.clone to the same scope
  and call it: Flax records that as a second call (two captured outputs).
  If this fails, Flax stopped doing so and the clone route is open."""
  twins = set()

  def via_clone(next_fun, args, kwargs, context):
    module = context.module
    if id(module) in twins or not isinstance(module, nn.Dense):
      return next_fun(*args, **kwargs)
    twin = module.clone(parent=module.scope, dtype=jnp.bfloat16)
    twins.add(id(twin))
    return getattr(twin, context.method_name)(*args, **kwargs)

  layer = nn.Dense(2, dtype=jnp.float32)
  x = jnp.ones((1, 3))
  variables = layer.init(jax.random.key(0), x)
  with nn.intercept_methods(via_clone):
    _, state = layer.apply(variables, x, capture_intermediates=True)
  assert len(state["intermediates"]["__call__"]) == 2
