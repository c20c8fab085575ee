"""Autocast's parts, one concept per module (the public face is
:mod:`jmp_lite.autocasting`).

* ``options`` — the primitive lists, region scope names, and the checked
  options (:class:`~jmp_lite._autocast.options.Config`);
* ``retyper`` — the autocast rules, plugged into
  :class:`jmp_lite._jaxpr.Rewriter`;
* ``fp8`` — the FP8 swap: a matmul as one :func:`jmp_lite.fp8.dot_general`
  call, and the delayed-scaling state's arrays;
* ``audit`` — :class:`~jmp_lite._autocast.audit.Audit` and its records;
* ``writeback`` — Flax nnx arguments: run as a pure function, changed
  variables written back;
* ``run`` — one autocast call: trace, rewrite, call.
"""
