"""Frozen dataclasses that are pytrees, registered from their own field list.

Every state class in jmp_lite is declared with :func:`dataclass` and
:func:`field`. The pytree registration is derived from ``dataclasses.fields``,
so a field can never be forgotten by a hand-written flatten (the bug that makes
``jmp.DynamicLossScale`` drop ``min_loss_scale``). Unflattening bypasses
``__init__``/``__post_init__``: JAX rebuilds pytrees with tracers,
``ShapeDtypeStruct`` placeholders or ``object()`` sentinels as leaves
(``jit``, ``lower``, ``eval_shape``, ``vmap``), and validation must never run on
those. Validation belongs in ``__post_init__``, which only user construction
reaches.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, dataclass_transform, TypeVar

import jax

_T = TypeVar("_T", bound=type)

_STATIC = "jmp_lite.static"


def field(
    *,
    static: bool = False,
    default: Any = dataclasses.MISSING,
    default_factory: Any = dataclasses.MISSING,
    init: bool = True,
    repr: bool = True,
    hash: bool | None = None,
    compare: bool = True,
    metadata: Any = None,
    kw_only: Any = dataclasses.MISSING,
) -> Any:
  """Declares a dataclass field as a pytree leaf (default) or static metadata.

  Args:
    static: ``True`` for configuration (Python numbers, strings, dtypes) that is
      part of the pytree structure: it is hashed into ``jax.jit``'s cache key,
      so changing it recompiles. ``False`` for arrays, which become leaves.
    default: the field's default value.
    default_factory: a zero-argument callable making the default.
    init: whether ``__init__`` takes the field.
    repr: whether ``__repr__`` shows the field.
    hash: whether ``__hash__`` uses the field (``None``: as ``compare``).
    compare: whether ``__eq__`` compares the field.
    metadata: a mapping stored on the field (``static`` is added to it).
    kw_only: whether ``__init__`` takes the field by keyword only.

  Returns:
    A :class:`dataclasses.Field` descriptor.

  Example:
    >>> import jmp_lite
    >>> @jmp_lite.struct.dataclass
    ... class Counter:
    ...   count: int
    ...   period: int = jmp_lite.struct.field(static=True, default=10)
    >>> import jax
    >>> jax.tree.leaves(Counter(3))
    [3]
  """
  metadata = dict(metadata or {})
  metadata[_STATIC] = static
  # The parameters are spelt out (rather than **kwargs) so that type checkers,
  # told by ``dataclass_transform`` that this is a field specifier, see which
  # fields have defaults.
  return dataclasses.field(
      default=default, default_factory=default_factory, init=init, repr=repr,
      hash=hash, compare=compare, metadata=metadata, kw_only=kw_only)


# Every class :func:`dataclass` made, with its Flax serializers: the
# registry Flax's own is filled from, once Flax is imported (jmp_lite's core
# and optax layers do not import Flax). Appended to at class creation only,
# like JAX's pytree registry.
_FLAX_SERIALIZERS: list[tuple[type, Any, Any]] = []


def register_flax_serialization() -> None:
  """Puts every :func:`dataclass` class in Flax's serialization registry,
  so ``flax.serialization.to_bytes`` / ``from_bytes`` save and restore
  jmp_lite states.

  Done for you when Flax was imported before jmp_lite, and when
  ``jmp_lite.linen``, ``jmp_lite.nnx`` or ``jmp_lite.presets`` is imported;
  call it yourself when you import Flax after jmp_lite's optax layers only.
  Idempotent.

  Example:
    >>> import flax.serialization, optax, jmp_lite
    >>> jmp_lite.struct.register_flax_serialization()
    >>> opt = jmp_lite.loss_scaled(optax.sgd(0.1), jmp_lite.NoOpLossScale())
    >>> state = opt.init({"w": 1.0})
    >>> back = flax.serialization.from_bytes(
    ...     state, flax.serialization.to_bytes(state))
    >>> type(back).__name__
    'LossScaledState'
  """
  from flax import serialization
  for cls, to_state_dict, from_state_dict in _FLAX_SERIALIZERS:
    serialization.register_serialization_state(
        cls, to_state_dict, from_state_dict, override=True)


# Tells type checkers (PEP 681) that decorated classes are frozen dataclasses
# whose fields may be declared with :func:`field`.
@dataclass_transform(frozen_default=True, field_specifiers=(field,))
def dataclass(cls: _T) -> _T:
  """Makes ``cls`` a frozen dataclass registered as a pytree with key paths.

  Leaves are the fields not declared ``static=True``; static fields form the
  treedef's auxiliary data. Key paths name the fields
  (``jax.tree_util.GetAttrKey``), so ``jax.tree_util.tree_flatten_with_path``,
  orbax and the diagnostics print ``.loss_scale`` rather than an index.

  Args:
    cls: the class to decorate.

  Returns:
    The same class, now a frozen dataclass and a registered pytree node.

  Example:
    >>> import jax, jmp_lite
    >>> @jmp_lite.struct.dataclass
    ... class Pair:
    ...   a: float
    ...   b: float
    >>> jax.tree.map(lambda x: 2 * x, Pair(1.0, 2.0))
    Pair(a=2.0, b=4.0)
  """
  cls = dataclasses.dataclass(frozen=True)(cls)
  fields = dataclasses.fields(cls)
  data_names = tuple(f.name for f in fields if not f.metadata.get(_STATIC))
  meta_names = tuple(f.name for f in fields if f.metadata.get(_STATIC))
  keys = tuple(jax.tree_util.GetAttrKey(n) for n in data_names)

  def flatten_with_keys(obj):
    children = tuple((k, getattr(obj, n))
                     for k, n in zip(keys, data_names, strict=True))
    return children, tuple(getattr(obj, n) for n in meta_names)

  def flatten(obj):
    children = tuple(getattr(obj, n) for n in data_names)
    return children, tuple(getattr(obj, n) for n in meta_names)

  def unflatten(meta, children):
    # Deliberately skips __init__/__post_init__: see the module docstring.
    obj = object.__new__(cls)
    for name, value in zip(data_names, children, strict=True):
      object.__setattr__(obj, name, value)
    for name, value in zip(meta_names, meta, strict=True):
      object.__setattr__(obj, name, value)
    return obj

  jax.tree_util.register_pytree_with_keys(
      cls, flatten_with_keys, unflatten, flatten
  )

  # Flax checkpoints (``flax.serialization.to_bytes``, ``to_state_dict``)
  # walk their own registry, not JAX's: the fields that are leaves, by
  # name; static fields come from the target on restore.
  def to_state_dict(obj: Any) -> dict[str, Any]:
    from flax import serialization
    return {n: serialization.to_state_dict(getattr(obj, n))
            for n in data_names}

  def from_state_dict(target: Any, state: dict[str, Any]) -> Any:
    from flax import serialization
    missing = [n for n in data_names if n not in state]
    if missing:
      raise ValueError(
          f"{cls.__name__}: the restored state has no {missing} (it has"
          f" {sorted(state)}); it was saved from another class or version")
    return unflatten(
        tuple(getattr(target, n) for n in meta_names),
        tuple(serialization.from_state_dict(getattr(target, n), state[n],
                                            name=n)
              for n in data_names))

  _FLAX_SERIALIZERS.append((cls, to_state_dict, from_state_dict))
  if "flax.serialization" in sys.modules:
    register_flax_serialization()
  return cls


def replace(obj: Any, **changes: Any) -> Any:
  """Returns a copy of the dataclass ``obj`` with ``changes`` applied.

  Unlike :func:`dataclasses.replace` this does not re-run ``__post_init__``
  validation, so it is safe on states whose leaves are tracers.

  Args:
    obj: an instance of a :func:`dataclass`-decorated class.
    **changes: field names and their new values.

  Returns:
    A new instance; ``obj`` is unchanged.

  Raises:
    TypeError: if a name in ``changes`` is not a field of ``obj``.

  Example:
    >>> import jmp_lite
    >>> s = jmp_lite.DynamicLossScale(2.0 ** 15)
    >>> float(jmp_lite.struct.replace(s, loss_scale=2.0 ** 10).loss_scale)
    1024.0
  """
  names = {f.name for f in dataclasses.fields(obj)}
  unknown = sorted(set(changes) - names)
  if unknown:
    raise TypeError(
        f"{type(obj).__name__} has no field(s) {unknown}; fields are"
        f" {sorted(names)}"
    )
  new = object.__new__(type(obj))
  for name in names:
    object.__setattr__(new, name, changes.get(name, getattr(obj, name)))
  return new


def find_nodes(tree: Any, kind: type | tuple[type, ...]) -> list[Any]:
  """Every node of type ``kind`` in ``tree``, in flattening order.

  Finds states inside ``optax.chain``, ``MultiSteps``, ``inject_hyperparams``
  and any other pytree of states; the nodes themselves are not descended into.

  Args:
    tree: any pytree (an optimizer state, say).
    kind: the node class (or a tuple of classes) to look for.

  Returns:
    The matching nodes.

  Example:
    >>> import jmp_lite
    >>> state = ({"a": jmp_lite.NoOpLossScale()},
    ...          [jmp_lite.StaticLossScale(2.0)])
    >>> [type(n).__name__ for n in jmp_lite.struct.find_nodes(
    ...     state, jmp_lite.StaticLossScale)]
    ['StaticLossScale']
  """
  return [node for node in jax.tree.leaves(
      tree, is_leaf=lambda x: isinstance(x, kind)) if isinstance(node, kind)]


__all__ = ["dataclass", "field", "find_nodes", "register_flax_serialization",
           "replace"]
