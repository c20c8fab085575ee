"""Tests for jmp_lite._flax_compat: what the nnx adapter assumes of Flax.

Each test fails when a Flax release changes one of the facts the module
docstring lists.
"""

from __future__ import annotations

import pickle

import jax
import jax.numpy as jnp
from flax import nnx

from jmp_lite import _flax_compat as compat


class Block(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(3, 3, rngs=rngs)
    self.layers = nnx.List([nnx.Linear(3, 3, rngs=rngs)])
    self.width = 3

  def __call__(self, x):
    return self.layers[0](self.lin(x))


def test_an_instance_built_from_attributes_is_a_working_module():
  block = Block(nnx.Rngs(0))
  twin = compat.instance_with(Block, vars(block))
  assert type(twin) is Block and twin.lin is block.lin
  # nnx reads it as the original: same graphdef, same variables.
  graphdef, state = nnx.split(twin)
  assert graphdef == nnx.graphdef(block)
  assert jax.tree.structure(state) == jax.tree.structure(nnx.state(block))
  x = jnp.ones((1, 3))
  assert bool((twin(x) == block(x)).all())
  assert type(pickle.loads(pickle.dumps(twin))) is Block
  # Flax's attribute checks (trace level) work on it.
  twin.width = 4
  assert twin.width == 4 and block.width == 3


def test_attributes_are_what_nnx_reads_and_a_set_child_is_seen():
  block = Block(nnx.Rngs(0))
  names = dict(compat.attributes(block))
  graph_children = {key for key, _ in nnx.iter_children(block)}
  assert graph_children <= set(names)
  other = nnx.Linear(3, 3, rngs=nnx.Rngs(1))
  compat.set_child(block, "lin", other)
  found = dict(nnx.iter_graph(block))
  assert found[("lin",)] is other
  assert nnx.split(block)[1]["lin"]["kernel"].get_value() is \
      other.kernel.get_value()


class Standing(nnx.Module):
  """A stand-in reporting another class to isinstance, as the adapter's
  per-call Boundary does."""

  def __init__(self, module):
    self.module = module

  def _reported(self):
    return type(vars(self)["module"])

  __class__ = property(_reported)  # type: ignore[assignment]


def test_nnx_dispatches_on_the_type_not_the_reported_class():
  inner = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
  stand = Standing(inner)
  assert isinstance(stand, nnx.Linear) and type(stand) is Standing
  graphdef, state = nnx.split(stand)
  merged = nnx.merge(graphdef, state)
  assert type(merged) is Standing and type(vars(merged)["module"]) is \
      nnx.Linear
  assert set(state) == {"module"}   # Its own attributes, not a Linear's.
  # And through a transform that splits and merges it.
  out = nnx.jit(lambda s, x: vars(s)["module"](x))(stand, jnp.ones((1, 3)))
  assert out.shape == (1, 3)
