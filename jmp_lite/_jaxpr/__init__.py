"""The one place jmp_lite touches JAX's jaxpr machinery.

Autocast, the dtype report and the diagnostics read and rewrite jaxprs only
through this package; no other module names ``jax.core``, ``jax.extend``,
equations' name stacks or their source information. It goes through
``jax.extend.core`` (JAX's API for extensions), each primitive's
``abstract_eval`` and the ``get_bind_params``/``bind`` protocol; the few
internals still needed are imported inside the function that needs them.
Differences between JAX versions are detected by what objects are and have,
never by version number. Tested on jax 0.10.2 and 0.12.0.1.

Modules, one concept each:

* ``args`` — which argument leaves are traced (:func:`split_array_args`),
  :func:`is_tracer`, shardings in types (:func:`type_sharding`);
* ``depends`` — which outputs are computed from the inputs' values
  (:func:`depends_on_inputs`);
* ``names`` — name stacks, scope names, source locations;
* ``walk`` — :func:`walk`, the one walker over equations and sub-jaxprs,
  and :func:`interpret`, the observing evaluator;
* ``dots`` — matmul and convolution dimensions and FLOPs;
* ``trace`` — tracing to jaxprs and calling them back;
* ``retype`` — building blocks for rewriting equations;
* ``rewriter`` — :class:`Rewriter`, the re-typing engine autocast's rules
  plug into.
"""

from jmp_lite._jaxpr.args import (
  align_varying,
  is_tracer,
  split_array_args,
  type_sharding,
  varying_axes,
)
from jmp_lite._jaxpr.depends import depends_on_inputs
from jmp_lite._jaxpr.dots import (
    is_matmul,
    matmul_dims,
    matmul_flops,
    MATMULS,
    operand_dtype_names,
)
from jmp_lite._jaxpr.names import (
    join_scopes,
    name_stack_of,
    scope_names,
    source_location,
)
from jmp_lite._jaxpr.retype import (
    abstract_eval,
    bind,
    consts_as_args,
    convert,
    has_subjaxprs,
    inline_jaxpr,
    is_jaxpr,
    is_literal,
    jaxpr_and_consts,
    Literal,
    new_eqn,
    new_var,
    primitives_by_name,
    rebuilt,
    rewrite,
    sub_context,
    with_operands,
)
from jmp_lite._jaxpr.rewriter import CASTABLE, Operands, Plan, Rewriter
from jmp_lite._jaxpr.trace import (
    call,
    differentiable_call,
    evaluate,
    trace,
    trace_flat,
    traced_call,
)
from jmp_lite._jaxpr.walk import interpret, Site, walk

__all__ = [
    "CASTABLE", "Literal", "MATMULS", "Operands", "Plan", "Rewriter", "Site",
    "abstract_eval", "align_varying", "bind", "call", "consts_as_args",
    "convert",
    "depends_on_inputs",
    "differentiable_call", "evaluate", "has_subjaxprs", "inline_jaxpr",
    "interpret", "is_jaxpr", "is_literal", "is_matmul", "is_tracer",
    "jaxpr_and_consts", "join_scopes", "matmul_dims", "matmul_flops",
    "name_stack_of", "new_eqn", "new_var", "operand_dtype_names",
    "primitives_by_name", "rebuilt", "rewrite", "scope_names",
    "source_location", "split_array_args", "sub_context", "trace",
    "trace_flat", "traced_call", "type_sharding", "varying_axes", "walk",
    "with_operands",
]
