"""What the nnx adapter assumes of ``flax.nnx`` beyond its documented API.

Three facts about how nnx stores and dispatches objects, each checked by
``tests/test_nnx_compat.py`` so that a Flax release changing one fails
there, not deep inside a wrapped call:

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

from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["attributes", "instance_with", "set_child"]


def instance_with(cls: type, attrs: Mapping[str, Any]) -> Any:
  """An instance of the nnx class ``cls`` holding ``attrs`` (not copies),
  built as unpickling builds one: ``cls.__init__`` does not run.

  Example:
    >>> from flax import nnx
    >>> from jmp_lite.nnx._flax_compat import instance_with
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
    >>> from jmp_lite.nnx._flax_compat import attributes
    >>> "kernel" in dict(attributes(nnx.Linear(2, 3, rngs=nnx.Rngs(0))))
    True
  """
  yield from list(vars(node).items())


def set_child(node: Any, name: str, value: Any) -> None:
  """Puts ``value`` at attribute ``name`` of the nnx object ``node`` as it
  is (no nnx bookkeeping: ``name`` keeps its data or static kind).

  Example:
    >>> from flax import nnx
    >>> from jmp_lite.nnx._flax_compat import set_child
    >>> seq = nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    >>> set_child(seq, "layers", nnx.List([]))
    >>> len(seq.layers)
    0
  """
  object.__setattr__(node, name, value)
