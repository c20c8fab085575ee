"""What jmp_lite assumes of Flax beyond its public API: the one place.

The linen and nnx adapters use Flax's public API everywhere else
(``nn.intercept_methods``, ``Module.clone``, ``nn.map_variables``,
``nn.share_scope``, public fields; ``nnx.split``/``merge``/``update``). Each
function here says which Flax internal or undocumented behaviour it relies
on and why no public route does the job; ``tests/test_linen_compat.py`` and
``tests/test_nnx_compat.py`` fail when one of them changes or disappears.

linen, three internals:

* :func:`wrap_method`: Flax's ``wrap_method_once``, for the policy's own
  call;
* :func:`interceptors_active`: Flax's interceptor stack, to skip the trace
  cache while a user's interceptor is open;
* :func:`fields_overridden`: a field override on Flax's per-call bound copy
  of a layer (a bound clone makes Flax record the layer twice).

nnx, two facts about how it stores and dispatches objects:

* an nnx object's attributes, submodules included, are its instance
  ``__dict__``: the state Flax's own pickling saves and restores, and what
  its graph functions read, so one built with ``__new__`` and
  ``__setstate__`` is a working object (:func:`instance_with`) and an
  attribute rewritten in ``__dict__`` is seen by them (:func:`set_child`);
* nnx picks how to handle a graph node by ``type(node)``, not by
  ``node.__class__``, so a stand-in may report its module's class to
  ``isinstance`` and still be split and merged as itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import flax.linen as nn
from flax.linen import module as _flax_module

from jmp_lite import struct

__all__ = ["attributes", "fields_overridden", "instance_with",
           "interceptors_active", "set_child", "wrap_method"]

# Flax is here now: its checkpoints can take the jmp_lite states made so
# far (later ones register themselves).
struct.register_flax_serialization()

# ------------------------------------------------------------------ linen



def wrap_method(fun: Callable[..., Any]) -> Callable[..., Any]:
  """``fun(module, ...)`` run as a Flax method of ``module``, not an attribute.

  Flax wraps the methods a ``Module`` class defines: a wrapped call runs the
  module's ``setup`` first and is seen by method interceptors. The policy's
  call needs both (its ``setup`` shares the wrapped model's scope), but must
  not be an attribute of the wrapper: ``tabulate`` lists the first call at
  each path whose method the module has, and there the wrapped model's own
  call (the same path, a shared scope) is the one to show. Flax wraps a free
  function only through ``flax.linen.module.wrap_method_once``.

  Args:
    fun: a function taking the module first; its ``__name__`` is the method
      name interceptors see.

  Returns:
    The wrapped function.

  Example:
    >>> import flax.linen as nn
    >>> from jmp_lite import _flax_compat as compat
    >>> def twice(module, x):
    ...   return 2 * x
    >>> wrapped = compat.wrap_method(twice)
    >>> nn.Module.apply(nn.Dense(2), {}, 3, method=wrapped)
    6
  """
  return _flax_module.wrap_method_once(fun)


def interceptors_active() -> bool:
  """Whether a ``nn.intercept_methods`` context is open (unknown: ``True``).

  A trace reused from a cache would run no interceptor, so the policy's
  trace cache is skipped while one is open. Flax offers no public query; the
  stack is ``flax.linen.module._global_interceptor_stack``.

  Returns:
    ``True`` inside ``nn.intercept_methods`` (or if Flax renamed the stack).

  Example:
    >>> import flax.linen as nn
    >>> from jmp_lite import _flax_compat as compat
    >>> spy = lambda next_fun, args, kwargs, context: next_fun(*args, **kwargs)
    >>> with nn.intercept_methods(spy):
    ...   inside = compat.interceptors_active()
    >>> inside, compat.interceptors_active()
    (True, False)
  """
  stack = getattr(_flax_module, "_global_interceptor_stack", None)
  return stack is None or len(stack) > 0


@contextlib.contextmanager
def fields_overridden(module: nn.Module,
                      values: Mapping[str, Any]) -> Iterator[None]:
  """Gives the module an interceptor is running other field values, briefly.

  For ``nn.intercept_methods`` interceptors only: ``module`` is the
  ``context.module`` of the call being intercepted, the copy of a module
  that Flax made when it bound it for this ``init``/``apply`` (Flax clones
  every module it binds; the user's objects are never bound), and the
  values hold while the call runs. The public route, a ``Module.clone``
  with the new values bound to the same scope, is a second module call:
  Flax would record it too (``capture_intermediates`` stores each layer's
  output twice, interceptors see each layer twice, JAX's name stack names it
  twice), so the policy would change what Flax's tools see.

  Args:
    module: the bound module of the call being intercepted.
    values: dataclass field name -> value; names the class lacks are skipped.

  Yields:
    Nothing; run the call inside.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> from jmp_lite import _flax_compat as compat
    >>> def in_bf16(next_fun, args, kwargs, context):
    ...   with compat.fields_overridden(context.module,
    ...                                 {"dtype": jnp.bfloat16}):
    ...     return next_fun(*args, **kwargs)
    >>> layer = nn.Dense(2, dtype=jnp.float32)
    >>> v = layer.init(jax.random.key(0), jnp.ones((1, 3)))
    >>> with nn.intercept_methods(in_bf16):
    ...   y = layer.apply(v, jnp.ones((1, 3)))
    >>> y.dtype, layer.dtype
    (dtype(bfloat16), <class 'jax.numpy.float32'>)
  """
  fields = getattr(type(module), "__dataclass_fields__", {})
  old = {k: getattr(module, k) for k in values if k in fields}
  for k in old:
    # Flax modules are frozen dataclasses; Flax sets its own bookkeeping on
    # bound copies the same way.
    object.__setattr__(module, k, values[k])
  try:
    yield
  finally:
    for k, v in old.items():
      object.__setattr__(module, k, v)


# -------------------------------------------------------------------- nnx
def instance_with(cls: type, attrs: Mapping[str, Any]) -> Any:
  """An instance of the nnx class ``cls`` holding ``attrs`` (not copies),
  built as unpickling builds one: ``cls.__init__`` does not run.

  Example:
    >>> from flax import nnx
    >>> from jmp_lite._flax_compat import instance_with
    >>> layer = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> twin = instance_with(nnx.Linear, vars(layer))
    >>> type(twin).__name__, twin.kernel is layer.kernel
    ('Linear', True)
  """
  obj = object.__new__(cls)
  obj.__setstate__(dict(attrs))
  return obj


def attributes(node: Any) -> Iterator[tuple[str, Any]]:
  """The attributes of an nnx object, submodules and variables included.

  Example:
    >>> from flax import nnx
    >>> from jmp_lite._flax_compat import attributes
    >>> "kernel" in dict(attributes(nnx.Linear(2, 3, rngs=nnx.Rngs(0))))
    True
  """
  yield from list(vars(node).items())


def set_child(node: Any, name: str, value: Any) -> None:
  """Puts ``value`` at attribute ``name`` of the nnx object ``node`` as it
  is (no nnx bookkeeping: ``name`` keeps its data or static kind).

  Example:
    >>> from flax import nnx
    >>> from jmp_lite._flax_compat import set_child
    >>> seq = nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    >>> set_child(seq, "layers", nnx.List([]))
    >>> len(seq.layers)
    0
  """
  object.__setattr__(node, name, value)
