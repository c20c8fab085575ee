"""Tests for jmp_lite._jaxpr: the one package that reads and rewrites jaxprs."""

from __future__ import annotations

import pathlib
import re

import jax
import jax.core
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from jmp_lite import _jaxpr

_PACKAGE = pathlib.Path(_jaxpr.__file__).parent.parent


def _normal(within):
  # The nested-jit primitive is "pjit" in older JAX versions.
  return tuple("jit" if p == "pjit" else p for p in within)


@jax.custom_vjp
def _sin_custom_vjp(x):
  with jax.named_scope("vjp_body"):
    return jnp.sin(x)


_sin_custom_vjp.defvjp(lambda x: (_sin_custom_vjp(x), x),
                       lambda x, g: (g * jnp.cos(x),))


def _nested(x):
  """One equation of a known primitive inside each kind of sub-jaxpr."""
  with jax.named_scope("outer"):
    def in_jit(y):
      with jax.named_scope("in_jit"):
        return jnp.exp(y)

    def body(c, _):
      with jax.named_scope("in_scan"):
        return jnp.tanh(c), None

    def branch(a):
      with jax.named_scope("in_cond"):
        return jnp.log1p(a)

    def rematted(a):
      with jax.named_scope("in_remat"):
        return jnp.cos(a)

    y = jax.jit(in_jit)(x)
    y = jax.lax.scan(body, y, None, length=2)[0]
    y = jax.lax.cond(x > 0, branch, lambda a: a, y)
    y = jax.nn.relu(y)   # A custom_jvp function.
    y = _sin_custom_vjp(y)
    return jax.checkpoint(rematted)(y)


def test_walk_visits_every_kind_of_sub_jaxpr_with_full_scopes():
  sites = {s.primitive: s for s in _jaxpr.walk(jax.make_jaxpr(_nested)(1.0))}
  expected = {
      "exp": ("outer/in_jit", ("jit",)),
      "tanh": ("outer/in_scan", ("scan",)),
      "log1p": ("outer/in_cond", ("cond",)),
      "max": ("outer", ("custom_jvp_call", "jit")),   # jax.nn.relu's body.
      "sin": ("outer/vjp_body", ("custom_vjp_call",)),
      "cos": ("outer/in_remat", ("remat2",)),
  }
  for name, (scope, within) in expected.items():
    assert name in sites, (name, sorted(sites))
    assert (sites[name].scope, _normal(sites[name].within)) == (
        scope, within), name
  # The equations holding sub-jaxprs come first, at the outer scope.
  order = [s.primitive for s in _jaxpr.walk(jax.make_jaxpr(_nested)(1.0))]
  assert order.index("scan") < order.index("tanh")
  assert sites["scan"].scope == "outer" and sites["scan"].within == ()


def test_walk_takes_open_and_closed_jaxprs_and_names_backward_scopes():
  closed = jax.make_jaxpr(jax.grad(_nested))(1.0)
  from_closed = [(s.primitive, s.scope) for s in _jaxpr.walk(closed)]
  assert from_closed == [(s.primitive, s.scope)
                         for s in _jaxpr.walk(closed.jaxpr)]
  # A backward pass names its scopes transpose(jvp(...)); scope_names
  # unwraps them.
  backward = [s.scope for s in _jaxpr.walk(closed)
              if "transpose(jvp(outer))" in s.scope]
  assert backward
  assert "outer" in _jaxpr.scope_names(backward[0])


def test_scope_helpers():
  assert _jaxpr.join_scopes("", "") == ""
  assert _jaxpr.join_scopes("a/b", "") == "a/b"
  assert _jaxpr.join_scopes("", "c") == "c"
  assert _jaxpr.scope_names("transpose(jvp(vmap(blk)))/x") == {"blk", "x"}


@pytest.mark.parametrize("spec,lhs,rhs,dims", [
    ("ij,jk->ik", (3, 7), (7, 9), {"M": 3, "N": 9, "K": 7}),
    ("bij,bjk->bik", (5, 3, 7), (5, 7, 9), {"M": 3, "N": 9, "K": 7}),
    # Two batch dimensions, two contracted, free dimensions on both sides.
    ("abij,abjkl->abikl", (2, 5, 3, 7), (2, 5, 7, 4, 6),
     {"M": 3, "N": 24, "K": 7}),
    ("bhqd,bhkd->bhqk", (2, 4, 8, 16), (2, 4, 10, 16),
     {"M": 8, "N": 10, "K": 16}),
])
def test_dot_dims_and_flops_of_batched_dot_generals(spec, lhs, rhs, dims):
  closed = jax.make_jaxpr(lambda a, b: jnp.einsum(spec, a, b))(
      jnp.ones(lhs), jnp.ones(rhs))
  dots = [s.eqn for s in _jaxpr.walk(closed) if _jaxpr.is_matmul(s.eqn)]
  assert len(dots) == 1
  assert _jaxpr.matmul_dims(dots[0]) == dims
  out = np.einsum(spec, np.ones(lhs), np.ones(rhs))
  # Each output element is a K-long dot product: 2 * K FLOPs.
  assert _jaxpr.matmul_flops(dots[0]) == 2.0 * out.size * dims["K"]
  assert _jaxpr.operand_dtype_names(dots[0]) == ("float32", "float32")


def test_conv_dims_and_flops():
  def conv(x, k):
    return jax.lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                        feature_group_count=2)
  closed = jax.make_jaxpr(conv)(jnp.ones((1, 4, 6, 6)),
                                jnp.ones((8, 2, 3, 3)))
  (eqn,) = [s.eqn for s in _jaxpr.walk(closed)]
  assert _jaxpr.matmul_dims(eqn) == {"out_channels": 8, "in_channels": 4}
  # 1 * 8 * 6 * 6 outputs, each 2 * 3 * 3 multiply-adds.
  assert _jaxpr.matmul_flops(eqn) == 2.0 * (8 * 36) * (2 * 9)
  assert _jaxpr.matmul_flops(next(_jaxpr.walk(
      jax.make_jaxpr(jnp.sin)(1.0))).eqn) == 0.0


def test_interpret_enters_calls_and_shows_scopes():
  seen = []
  closed = jax.make_jaxpr(_nested)(1.0)
  outs = _jaxpr.interpret(closed, [np.float32(0.5)],
                          lambda s, i, o: seen.append(
                              (s.primitive, s.scope, s.within)))
  np.testing.assert_allclose(outs[0], _nested(0.5), rtol=1e-6)
  seen = [(_normal((p,))[0], s, _normal(w)) for p, s, w in seen]
  assert ("exp", "outer/in_jit", ("jit",)) in seen
  # A call is observed too, after its body.
  assert seen.index(("jit", "outer", ())) == seen.index(
      ("exp", "outer/in_jit", ("jit",))) + 1
  assert ("sin", "outer/vjp_body", ("custom_vjp_call",)) in seen
  # Control flow runs as one primitive.
  assert ("scan", "outer", ()) in seen and "tanh" not in {p for p, *_ in seen}


class _HalfExp(_jaxpr.Rewriter):
  """Runs exp in float16 and logs each run."""

  def plan(self, ops, mode):
    if ops.primitive == "exp":
      return _jaxpr.Plan("half", np.dtype(np.float16))
    return _jaxpr.Plan("as-written")

  def ran(self, ops, plan, category, inputs, outputs):
    assert self.log is not None
    self.log.append((ops.primitive, category, str(inputs[0])))

  def repeated(self, entries, loop, length):
    return [(*e, loop, length) for e in entries]


def test_rewriter_retypes_logs_and_keeps_signatures():
  def f(x):
    y = jax.lax.scan(lambda c, _: (jnp.exp(c), None), x, None, length=3)[0]
    return jnp.exp(y) + 1
  closed = jax.make_jaxpr(f)(jnp.ones(2))
  body, consts = _jaxpr.jaxpr_and_consts(closed)
  log = []
  new = _HalfExp(log).rewrite(body, "auto")
  assert log == [("exp", "half", "float16", "scan", 3),
                 ("exp", "half", "float16"), ("add", "as-written", "float32")]
  exps = [s for s in _jaxpr.walk(new) if s.primitive == "exp"]
  assert [str(s.eqn.outvars[0].aval.dtype) for s in exps] == ["float16"] * 2
  # Same signature: the scan carry and the output stay float32.
  assert [str(v.aval.dtype) for v in new.outvars] == ["float32"]
  out = _jaxpr.evaluate(_jaxpr.consts_as_args(new), [*consts, jnp.ones(2)])
  assert out[0].dtype == jnp.float32
  np.testing.assert_allclose(out[0], f(jnp.ones(2)), rtol=1e-2)


def test_supported_jax_version_and_internals():
  """JAX lies in the supported range and has what ``_jaxpr`` relies on."""
  version = tuple(int(p) for p in jax.__version__.split(".")[:3])
  assert (0, 10, 2) <= version < (0, 13), jax.__version__
  # The internals, each used in one place in jmp_lite/_jaxpr.
  from jax._src import config, core, source_info_util
  assert callable(core.extend_axis_env_nd) and callable(config._check_vma)
  assert callable(source_info_util.summarize)
  # The extension API the jaxpr rewriting is built on.
  jex = jax.extend.core
  for name in ("Var", "DropVar", "Literal", "new_jaxpr_eqn", "jaxpr_as_fun",
               "ClosedJaxpr", "Jaxpr", "no_effects"):
    assert hasattr(jex, name), name
  assert jex.primitives.jit_p.name == "jit"
  assert callable(jax.core.Tracer)
  closed = jax.make_jaxpr(lambda x: x * 2)(1.0)
  assert callable(closed.jaxpr.replace)
  assert callable(closed.jaxpr.debug_info.with_unknown_names)


# What only jmp_lite/_jaxpr may name: JAX's core and extension modules, its
# internals, and equations' name stacks, source information and bodies.
_JAX_INTERNALS = re.compile(
    r"jax\.core|jax\.extend|from jax import core|jax\._src|source_info"
    r"|name_stack|\.eqns\b|ShapedArray|SymbolicZero|ClosedJaxpr")
# TODO(issue 28): modules other engineers own that still name jax.core
# (jax.core.Tracer; _jaxpr.is_tracer is the replacement). Remove each entry
# when its module is fixed.
_PENDING: set[str] = set()


def test_no_module_outside_the_jaxpr_package_touches_jax_internals():
  offenders = {}
  for path in sorted(_PACKAGE.rglob("*.py")):
    rel = path.relative_to(_PACKAGE).as_posix()
    if rel.startswith("_jaxpr/") or rel in _PENDING:
      continue
    hits = [f"{n}: {line.strip()}"
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if _JAX_INTERNALS.search(line)]
    if hits:
      offenders[rel] = hits
  assert not offenders, offenders


def test_varying_axes_reads_what_shard_map_tracks():
  """jmp_lite refuses a forgotten axis_name by reading which mesh axes a
  value varies over; this fails if JAX renames where it keeps that."""
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  seen = {}

  def local(x):
    finite = jnp.isfinite(x).all()
    seen["local"] = _jaxpr.varying_axes(finite)
    seen["agreed"] = _jaxpr.varying_axes(
        jax.lax.pmin(finite.astype(jnp.int32), "d"))
    return x

  jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("d"),
                        out_specs=P("d")))(jnp.ones(4))
  assert seen == {"local": frozenset({"d"}), "agreed": frozenset()}
  assert _jaxpr.varying_axes(jnp.ones(2)) == frozenset()
  assert _jaxpr.varying_axes(3) == frozenset()


def test_align_varying_gives_kernel_operands_one_type():
  """A pallas_call under shard_map (check_vma) needs operands that vary
  over the same axes and an out_shape that says so."""
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  seen = {}

  def local(x, w):
    (x2, w2), kwargs = _jaxpr.align_varying([x, w])
    seen["before"] = (_jaxpr.varying_axes(x), _jaxpr.varying_axes(w))
    seen["after"] = (_jaxpr.varying_axes(x2), _jaxpr.varying_axes(w2))
    out = jax.ShapeDtypeStruct(x.shape, x.dtype, **kwargs)
    seen["out"] = _jaxpr.varying_axes(out)
    return x2 + w2.sum()

  jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("d"), P()),
                        out_specs=P("d")))(jnp.ones(4), jnp.ones(3))
  d = frozenset({"d"})
  assert seen == {"before": (d, frozenset()), "after": (d, d), "out": d}
  xs, kwargs = _jaxpr.align_varying([jnp.ones(2)])
  assert xs[0].shape == (2,)
