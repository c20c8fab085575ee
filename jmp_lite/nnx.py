"""Apply a precision policy to a ``flax.nnx`` model without editing it.

:func:`mixed_precision` returns a *copy* of the model (the original is left
as it is) in which:

* every ``nnx.Param`` is stored in its module's param dtype;
* every module call casts its floating inputs to the module's compute dtype,
  reads its own params in the compute dtype for the duration of the call (the
  cast is traced, so ``nnx.grad`` gives gradients in the param dtype), and
  returns the root's outputs in the policy's output dtype, a module with a
  rule of its own in its rule's output dtype, other modules in their compute
  dtype;
* other variables (``BatchStat``) keep the dtype they were stored in.

Rules are the linen ones (:class:`jmp_lite.linen.Rule`) with ``nnx.Module``
classes or path patterns; by default normalisation layers are float32
islands. This works by giving each module instance a generated subclass whose
``__call__`` does the casting: the model's code is untouched.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

from flax import nnx

from jmp_lite import dtypes as _dtypes
from jmp_lite.linen import FLOAT32, Rule, policy_and_rules
from jmp_lite.policy import Policy

NORM_LAYERS: tuple[type, ...] = (nnx.LayerNorm, nnx.BatchNorm, nnx.RMSNorm,
                                 nnx.GroupNorm)
"""The nnx layers kept in float32 by default."""

_POLICY = "_jmp_lite_policy"
_OUTPUT = "_jmp_lite_output"


def _own_variables(module: nnx.Module) -> list[nnx.Variable]:
  return [v for v in vars(module).values() if isinstance(v, nnx.Variable)]


@functools.cache
def _policy_class(cls: type) -> type:
  """A subclass of ``cls`` whose ``__call__`` applies the module's policy.

  Cached per class: one generated class per original class, not per call.
  """
  base_call = cls.__call__

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    policy: Policy = getattr(self, _POLICY)
    output: Policy | None = getattr(self, _OUTPUT)
    args, kwargs = policy.cast_to_compute((args, kwargs))
    saved = []
    for var in _own_variables(self):
      value = var.get_value()
      if not _dtypes.is_floating_array(value):
        continue
      saved.append((var, value))
      if isinstance(var, nnx.Param) and value.dtype != policy.compute_dtype:
        var.set_value(value.astype(policy.compute_dtype))
    try:
      out = base_call(self, *args, **kwargs)
    finally:
      for var, value in saved:
        if isinstance(var, nnx.Param):
          var.set_value(value)  # Params are read-only during a call.
        else:
          new = var.get_value()  # BatchStat & co: keep their stored dtype.
          if _dtypes.is_floating_array(new) and new.dtype != value.dtype:
            var.set_value(new.astype(value.dtype))
    if output is not None:
      return output.cast_to_output(out)
    return policy.cast_to_compute(out)

  return type(cls.__name__, (cls,), {"__call__": __call__,
                                      "_jmp_lite_wrapped": True,
                                      "__module__": cls.__module__,
                                      "__qualname__": cls.__qualname__})


def mixed_precision(
    model: nnx.Module,
    policy: Policy | str,
    *,
    rules: Sequence[Any] = (),
    float32_norms: bool = True,
    strict: bool = False,
    enabled: bool = True,
) -> nnx.Module:
  """Returns a copy of an ``nnx`` model that runs under a precision policy.

  Args:
    model: any ``flax.nnx.Module``; it is not modified.
    policy: the default :class:`~jmp_lite.Policy` or policy string.
    rules: ``(matcher, policy)`` pairs or :class:`~jmp_lite.linen.Rule`\\ s,
      with ``nnx.Module`` classes or path patterns; first match wins,
      children inherit.
    float32_norms: keep LayerNorm, BatchNorm, RMSNorm and GroupNorm in
      float32 (after your rules), returning the model's compute dtype.
    strict: raise if one of your rules matches no module.
    enabled: ``False`` makes everything float32.

  Returns:
    The policy-applied copy.

  Raises:
    TypeError: for a bad model, rule or policy.
    ValueError: with ``strict``, for a rule matching nothing.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import jmp_lite.nnx
    >>> layer = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    >>> half = jmp_lite.nnx.mixed_precision(layer, "p=bf16,c=bf16,o=f32")
    >>> half.kernel[...].dtype, half(jnp.ones((1, 3))).dtype
    (dtype(bfloat16), dtype('float32'))
    >>> layer.kernel[...].dtype  # The original is untouched.
    dtype('float32')
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(
        f"mixed_precision expects a flax.nnx.Module, got {type(model).__name__}"
    )
  policy, user, all_rules = policy_and_rules(policy, rules, float32_norms,
                                             NORM_LAYERS)
  if not enabled:
    policy, all_rules = FLOAT32, ()

  model = nnx.clone(model)
  modules = {tuple(str(p) for p in path): m
             for path, m in nnx.iter_modules(model)}
  own: dict[tuple[str, ...], Rule | None] = {}
  used: set[int] = set()
  for path, module in modules.items():
    own[path] = None
    for i, rule in enumerate(all_rules):
      if rule.matches(path, type(module)):
        own[path] = rule
        used.add(i)
        break
  if strict and enabled:
    unused = [all_rules[i].describe() for i in range(len(user))
              if i not in used]
    if unused:
      seen = ", ".join(f"{'/'.join(p) or '<root>'} ({type(m).__name__})"
                       for p, m in sorted(modules.items()))
      raise ValueError(f"strict=True: rule(s) matched no module: {unused};"
                       f" modules seen: {seen}")

  def policy_for(path: tuple[str, ...]) -> Policy:
    for n in range(len(path), -1, -1):
      rule = own.get(path[:n])
      if rule is not None:
        return rule.policy
    return policy

  for path, module in modules.items():
    module_policy = policy_for(path)
    for var in _own_variables(module):
      value = var.get_value()
      if (isinstance(var, nnx.Param) and _dtypes.is_floating_array(value)
          and value.dtype != module_policy.param_dtype):
        var.set_value(value.astype(module_policy.param_dtype))
    output = policy if not path else (own[path].policy if own[path] else None)
    # Static (non-array) attributes: nnx keeps them in the graph definition.
    object.__setattr__(module, _POLICY, module_policy)
    object.__setattr__(module, _OUTPUT, output)
    cls = type(module)
    # Already wrapped (a policy applied twice) or nothing to call: keep.
    if callable(getattr(cls, "__call__", None)) and not getattr(
        cls, "_jmp_lite_wrapped", False):
      module.__class__ = _policy_class(cls)
  return model
