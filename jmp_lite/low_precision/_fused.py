"""``quantized_adam``: Adam with 8/4-bit moments, one fused pass per tensor.

The state is :func:`quantized_states` ``(optax.adam(...))``'s, leaf for leaf
(checkpoints move between the two). On a GPU the step runs one Pallas
(Triton) kernel per param: per block it decodes ``mu`` and ``nu``, applies
Adam's moment update in float32, takes each new moment's outlier and scale
from the new values, draws the stochastic codes' bits and writes the codes,
in one pass over the state with nothing materialised in between. On the CPU
a C++ kernel (``_cpu_kernel``) does the same per block. Where neither runs
it takes :func:`quantized_states`' XLA path. All write the same codes,
scales and outliers: the Pallas kernel (in Pallas' interpreter) bit for bit,
except where a block's largest elements tie to within 2**-20 (it keeps the
first of them as the outlier, the XLA path the largest as XLA computed it,
which may differ by an ulp between equal inputs); the C++ kernel's codes
equal them at XLA's default flags (0 of 4.2M apart in the tests, JAX 0.10
to 0.12), under flags that make XLA contract multiply-adds otherwise to
within one code in a few elements per million (a value a hair from a
rounding threshold), and its scales, outliers and updates to an ulp (more,
a step later, in a block where a code differed).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jmp_lite import contract
from jmp_lite._checks import check_own_state
from jmp_lite._jaxpr import align_varying, type_sharding
from jmp_lite._nnx_paths import rewrap_like, unwrap_variables
from jmp_lite.low_precision import _cpu_kernel
from jmp_lite.low_precision._block_stats import outlier_and_scale_max
from jmp_lite.low_precision._blockwise import (
  _blocks,
  _unblock,
  check_form,
  decode_blocks,
  encode_blocks,
  form_of,
  grid,
  layout,
  QuantizedArray,
  SIGNED_MAP,
  where_dtype,
)
from jmp_lite.low_precision._common import (
  check_made_by,
  check_updates_fit,
  F32,
)
from jmp_lite.low_precision._quantized import (
  quantized_states,
  QuantizedStatesState,
)
from jmp_lite.low_precision._rounding import (
  half_noise,
  NOISE_SCALE,
  pair_bits,
  step_key,
  stream_key,
)
from jmp_lite.low_precision._streams import code_streams, paired_stream

_KERNELS = ("auto", "pallas", "cpu", "interpret", "xla")
# Blocks per kernel program: 8 rows of a block each (a (8, 256) tile). With
# 4 warps ptxas gave each thread 191 registers (16 elements each): 8 warps
# per multiprocessor; with 8 warps, 78 registers: 24 warps per
# multiprocessor (compiled for sm_90a off the GPU; speed unmeasured).
_TILE = 8
_WARPS = 8
# Elements per program at most (ptxas for sm_90a, 8 warps): eight blocks of
# 256 or 1024, or two of 4096, compile without spilling registers; eight of
# 4096 spilled (1,927 local-memory loads in the code), eight of 16384
# 47,133. Wider blocks than _WIDEST take the XLA path.
_ELEMENTS = 8192
_WIDEST = 8192


def _tile(wide: int) -> int:
  """Blocks per program for blocks padded to ``wide`` elements."""
  return max(1, min(_TILE, _ELEMENTS // wide))


def _kernel(meta_ref, g_ref, mc_ref, ms_ref, mo_ref, mw_ref, nc_ref, ns_ref,
            no_ref, nw_ref, u_out, mc_out, ms_out, mo_out, mw_out, nc_out,
            ns_out, no_out, nw_out, *, adam: optax.GradientTransformation,
            bits: int, powers: tuple[float, float], scale_dtype: Any,
            stochastic: bool, dims: tuple[int, int, int, int, int, int]
            ) -> None:
  """One tile of blocks (:func:`_tile`): decode, Adam in float32, encode."""
  rows, n, r, c, col_blocks, block_len = dims
  # Scalars read one by one (Triton has no slice of a loaded vector).
  meta = [meta_ref[i] for i in range(_META)]
  # The gradient in its own dtype: cast here, not in a pass before.
  g = g_ref[...].astype(F32)
  tile = g.shape[0]
  # Each element's place in the leaf: padding is zeroed, as the XLA path
  # pads the new moments with zeros, and the random bits hash the flat index.
  block = (pl.program_id(0) * tile
           + jax.lax.broadcasted_iota(jnp.int32, g.shape, 0))
  e = jax.lax.broadcasted_iota(jnp.int32, g.shape, 1)
  row = (block // col_blocks) * r + e // c
  col = (block % col_blocks) * c + e % c
  # Elements past ``block_len`` pad a block to a power of two (Triton's
  # tiles); read as code 0, they would decode to -scale.
  valid = (row < rows) & (col < n) & (e < block_len)
  flat = row.astype(jnp.uint32) * np.uint32(n % 2**32) + col.astype(
      jnp.uint32)

  def read(c_ref, s_ref, o_ref, w_ref, signed, power, form_signed, ok):
    return decode_blocks(
        c_ref[...].astype(F32), s_ref[...].astype(F32), bits=bits,
        signed=signed, power=power, form_signed=form_signed,
        outliers=jnp.squeeze(o_ref[...], 1),
        where=jnp.squeeze(w_ref[...], 1), ok=ok)

  ok = meta[4].astype(jnp.int32)
  mu = read(mc_ref, ms_ref, mo_ref, mw_ref, True, powers[0],
            meta[2] == SIGNED_MAP, (ok & 1) == 1)
  nu = read(nc_ref, ns_ref, no_ref, nw_ref, False, powers[1],
            meta[3] == SIGNED_MAP, (ok & 2) == 2)
  count = meta[0].astype(jnp.int32)
  updates, chained = adam.update(
      g, (optax.ScaleByAdamState(count=count, mu=mu, nu=nu),
          optax.EmptyState()))
  adam_state: Any = chained[0]  # type: ignore[index]

  # One hash per element for both moments' codes: mu the high half.
  hashed = pair_bits(meta[1], flat) if stochastic else None

  def write(new, half, signed, power, c_out, s_out, o_out, w_out):
    noise = None if hashed is None else half_noise(hashed, half)
    k, scales, outliers, where = encode_blocks(
        jnp.where(valid, new, 0.0), noise, bits=bits, signed=signed,
        power=power, scale_dtype=scale_dtype, stats=outlier_and_scale_max,
        noise_scale=NOISE_SCALE)
    c_out[...] = k.astype(jnp.uint8)
    s_out[...] = scales[:, None]
    o_out[...] = outliers[:, None]
    w_out[...] = where[:, None]

  u_out[...] = updates
  write(adam_state.mu, 0, True, powers[0], mc_out, ms_out, mo_out, mw_out)
  write(adam_state.nu, 1, False, powers[1], nc_out, ns_out, no_out, nw_out)


def _codes_blocks(q: QuantizedArray, shape: tuple[int, ...]) -> jax.Array:
  codes = q.codes
  if q.bits == 4:
    codes = jnp.stack([codes & 0xF, codes >> 4], axis=-1).reshape(
        *codes.shape[:-1], -1)[..., :shape[-1]]
  return _blocks(codes, q.block_size)


# The kernels' per-param scalars (_meta).
_META = 5


def _meta(mu: QuantizedArray, nu: QuantizedArray, count: jax.Array,
          key: jax.Array, stream: int) -> jax.Array:
  """What both kernels read per param (uint32[5]): the count, the param's
  random stream key (mu's codes take its high half, nu's the low), the map
  each was written with, the forms' check bits."""
  oks = [check_form(q) for q in (mu, nu)]
  ok = sum(jnp.asarray(True if o is None else o).astype(jnp.uint32) << i
           for i, o in enumerate(oks))
  return jnp.stack([
      jnp.asarray(count).astype(jnp.uint32), stream_key(key, stream),
      mu.form[2].astype(jnp.uint32), nu.form[2].astype(jnp.uint32), ok])


def _fused_leaf(g: jax.Array, mu: QuantizedArray, nu: QuantizedArray,
                count: jax.Array, key: jax.Array, stream: int, *,
                adam: optax.GradientTransformation, stochastic: bool,
                interpret: bool) -> tuple[jax.Array, QuantizedArray,
                                          QuantizedArray]:
  """One param's Adam step through the kernel."""
  shape = (*mu.codes.shape[:-1], mu.shape[-1])
  bs = mu.block_size
  rows, r, c = layout(shape, bs)
  groups, col_blocks = grid(shape, bs)
  size, nb = r * c, groups * col_blocks
  # Triton's tiles are powers of two: a block of 40 is read as 64.
  wide = 1 << (size - 1).bit_length()
  tile = _tile(wide)
  padded = -(-nb // tile) * tile

  def flat_blocks(x: jax.Array) -> jax.Array:
    x = x.reshape(nb, -1)
    extra = wide - size if x.shape[1] == size else 0
    return jnp.pad(x, [(0, padded - nb), (0, extra)])

  def side(q: QuantizedArray) -> list[jax.Array]:
    return [flat_blocks(_codes_blocks(q, shape)), flat_blocks(q.scales),
            flat_blocks(q.outliers.astype(F32)),
            flat_blocks(q.where.astype(jnp.int32))]

  meta = _meta(mu, nu, count, key, stream)
  tile_spec = pl.BlockSpec((tile, wide), lambda i: (i, 0))
  one_spec = pl.BlockSpec((tile, 1), lambda i: (i, 0))
  meta_spec = pl.BlockSpec((_META,), lambda i: (0,))
  quad = [tile_spec, one_spec, one_spec, one_spec]

  def quad_shapes(q: QuantizedArray) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct((padded, wide), jnp.uint8, **varying),
            jax.ShapeDtypeStruct((padded, 1), q.scales.dtype, **varying),
            jax.ShapeDtypeStruct((padded, 1), F32, **varying),
            jax.ShapeDtypeStruct((padded, 1), jnp.int32, **varying)]

  # Under shard_map (check_vma) the operands and outputs carry the mesh
  # axes any of them varies over (a replicated step: none).
  operands, varying = align_varying(
      [meta, flat_blocks(_blocks(g, bs)), *side(mu), *side(nu)])
  kernel = functools.partial(
      _kernel, adam=adam, bits=mu.bits, powers=(mu.power, nu.power),
      scale_dtype=mu.scales.dtype, stochastic=stochastic,
      dims=(rows, shape[-1], r, c, col_blocks, size))
  out = pl.pallas_call(
      kernel, grid=(padded // tile,),
      in_specs=[meta_spec, tile_spec, *quad, *quad],
      out_specs=[tile_spec, *quad, *quad],
      out_shape=[jax.ShapeDtypeStruct((padded, wide), F32, **varying),
                 *quad_shapes(mu), *quad_shapes(nu)],
      # The new codes, scales, outliers and indices overwrite the old ones
      # in place (each program reads its tile before it writes it): with
      # the state donated, no copy into the donated buffers after.
      input_output_aliases={i: i - 1 for i in range(2, 10)},
      interpret=interpret,
      # Triton named (JAX 0.10 would otherwise pick Mosaic GPU), whatever
      # the host's default backend: a step exported for CUDA from a CPU
      # host gets the same kernel.
      compiler_params=None if interpret else pltriton.CompilerParams(
          num_warps=_WARPS, num_stages=1),
  )(*operands)

  def unflat(x: jax.Array) -> jax.Array:
    return x[:nb, :size].reshape(groups, col_blocks, -1)

  def back(q: QuantizedArray, parts: list[jax.Array], signed: bool
           ) -> QuantizedArray:
    codes = _unblock(unflat(parts[0]), shape, bs)
    if q.bits == 4:
      if shape[-1] % 2:
        codes = jnp.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, 1)])
      codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return QuantizedArray(
        codes=codes, scales=unflat(parts[1])[..., 0],
        outliers=unflat(parts[2])[..., 0],
        where=unflat(parts[3])[..., 0].astype(where_dtype(bs)),
        form=jnp.asarray(form_of(q.bits, bs, signed)), shape=q.shape,
        dtype=q.dtype, bits=q.bits, block_size=bs, signed=signed,
        power=q.power)

  updates = _unblock(unflat(out[0]), shape, bs)
  return updates, back(mu, out[1:5], True), back(nu, out[5:9], False)


def _kernels_take(updates: Any, state: QuantizedStatesState) -> str:
  """Why the kernels cannot take this step ("" when they can): they read
  float32 and half gradients (and write float32 updates, as the XLA path
  does for them) and the maps' integer powers, and run on whole arrays on
  one device (or on the shards ``shard_map`` hands them), which leaves
  sharded in their type (explicit mesh axes) are not."""
  leaves = jax.tree.leaves(state.inner_state,
                           is_leaf=lambda x: isinstance(x, QuantizedArray))
  for g in jax.tree.leaves(updates):
    if np.dtype(g.dtype) not in _cpu_kernel.GRAD_DTYPES:
      return f"gradients of dtype {np.dtype(g.dtype).name}"
  for q in leaves:
    if isinstance(q, QuantizedArray) and q.power != 2.0:
      return f"a map of power {q.power}"
  # The XLA path keeps such shardings; a kernel call would need the arrays
  # gathered (Pallas refuses them outright).
  for x in (*jax.tree.leaves(updates), *jax.tree.leaves(leaves)):
    if (sharding := type_sharding(x)) is not None:
      return (f"an array of shape {tuple(x.shape)} sharded in its type"
              f" ({sharding.spec}, explicit mesh axes); under jax.shard_map"
              " each shard runs the kernel")
  return ""


@functools.cache
def _warn_no_cpu_kernel(why: str) -> None:
  # Once per process and reason: every trace would repeat it.
  warnings.warn(
      f"quantized_adam: the CPU kernel cannot be built here ({why}); the step"
      " takes the XLA path, several times slower on the CPU. Install a C++"
      " compiler, or pass kernel='xla' to choose that path", stacklevel=3)


def quantized_adam(
    learning_rate: float,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    bits: int = 8,
    block_size: int = 256,
    scale_dtype: Any = "float32",
    rounding: str = "stochastic",
    seed: int = 0,
    kernel: str = "auto",
) -> optax.GradientTransformationExtraArgs:
  """Adam with block-quantized moments, as one fused kernel per param.

  The same optimizer as ``quantized_states(optax.adam(learning_rate, b1, b2,
  eps), bits, block_size, ...)``, with the same state (a checkpoint moves
  between them), whose step is one kernel per param: each block's moments
  are decoded, updated in float32 and re-encoded, the block's outlier and
  scale taken from the new values, in one pass.

  ``kernel`` picks the path:

  * ``"auto"``: where the step is lowered for a CUDA GPU, the Pallas kernel
    (blocks of at most 8192 elements); where it is lowered for the CPU on a
    CPU host, the C++ kernel, built on first use with the machine's C++
    compiler (if it cannot be built: a warning, and the XLA path); elsewhere
    (a CPU computation on a GPU host included) the XLA path of
    :func:`quantized_states`.
  * ``"pallas"``: the Pallas (Triton) kernel, for CUDA GPUs.
  * ``"cpu"``: the C++ kernel (raises here if it cannot be built).
  * ``"interpret"``: the Pallas kernel in Pallas' interpreter, any backend
    (for tests).
  * ``"xla"``: the XLA path. A step exported with ``jax.export`` for the
    CPU needs it, or the C++ kernel's custom call allowed
    (``DisabledSafetyCheck.custom_call("jmp_lite_quantized_adam_cpu")``).

  All paths write the same codes, scales and outliers (the C++ kernel the
  same codes at XLA's default flags, scales and outliers to an ulp; under
  other compile flags, codes to within one in a few elements per million,
  where XLA's contractions round a value near a threshold the other way).
  The kernels hash
  each element's index in the whole array for its random bits; under
  ``jax.shard_map`` use :func:`quantized_states` with ``specs=``.

  Put :func:`stochastic_rounding` or :func:`kahan_summation` outside for
  half params, and a :func:`~jmp_lite.loss_scaled` guard outside too (a
  skipped step leaves the state bit-identical).

  Args:
    learning_rate: a float (schedules: use :func:`quantized_states`).
    b1: Adam's first moment decay.
    b2: Adam's second moment decay.
    eps: Adam's epsilon.
    bits: 8 or 4.
    block_size: elements per block.
    scale_dtype: ``"float32"`` or ``"bfloat16"``.
    rounding: ``"stochastic"`` or ``"nearest"``.
    seed: the stochastic codes' seed.
    kernel: ``"auto"``, ``"pallas"``, ``"cpu"``, ``"interpret"`` or
      ``"xla"``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`QuantizedStatesState`.

  Raises:
    TypeError: for a ``learning_rate`` that is not a number.
    ValueError: for an unknown ``kernel``, ``kernel="pallas"`` with blocks
      wider than 8192 elements, and whatever
      :func:`quantized_states` refuses.
    RuntimeError: for ``kernel="cpu"`` where the C++ kernel cannot be
      built (no compiler), with the reason.

  Example:
    >>> import jax, jax.numpy as jnp, jmp_lite
    >>> from jmp_lite.low_precision import quantized_adam
    >>> opt = quantized_adam(1e-3, kernel="interpret")
    >>> params = {"w": jnp.ones((8, 256))}
    >>> state = opt.init(params)
    >>> updates, state = jax.jit(opt.update)(params, state, params)
    >>> state.inner_state[0].mu["w"].codes.dtype
    dtype('uint8')
  """
  if isinstance(learning_rate, bool) or not isinstance(
      learning_rate, (int, float, np.floating, np.integer)):
    raise TypeError(
        "quantized_adam: learning_rate must be a float (for a schedule use"
        " quantized_states(optax.adam(schedule))), got"
        f" {type(learning_rate).__name__}: {learning_rate!r}")
  if kernel not in _KERNELS:
    raise ValueError(
        f"quantized_adam: kernel must be one of {_KERNELS}, got {kernel!r}")
  for name, value, low, high in (("learning_rate", learning_rate, 0.0, None),
                                 ("b1", b1, 0.0, 1.0), ("b2", b2, 0.0, 1.0),
                                 ("eps", eps, 0.0, None)):
    if isinstance(value, bool) or not isinstance(
        value, (int, float, np.floating, np.integer)):
      raise TypeError(f"quantized_adam: {name} must be a float, got"
                      f" {type(value).__name__}: {value!r}")
    if not (np.isfinite(value) and value >= low
            and (high is None or value < high)):
      span = f"in [{low}, {high})" if high is not None else f">= {low}"
      raise ValueError(
          f"quantized_adam: {name} must be finite and {span}, got {value!r}")
  adam = optax.adam(float(learning_rate), b1, b2, eps)
  base = quantized_states(adam, bits, block_size, scale_dtype=scale_dtype,
                          rounding=rounding, seed=seed)
  declared = contract.contract_of(base)
  assert isinstance(declared, contract.Forwarding)
  # Wider blocks would not fit one program's registers: the XLA path.
  fits = 1 << (block_size - 1).bit_length() <= _WIDEST
  if kernel == "pallas" and not fits:
    raise ValueError(
        f"quantized_adam: the kernel takes blocks of at most {_WIDEST}"
        f" elements, got block_size={block_size}; use kernel='auto' (the"
        " XLA path for such blocks) or a smaller block_size")
  if kernel == "cpu" and _cpu_kernel.unavailable():
    raise RuntimeError(
        "quantized_adam: kernel='cpu' needs the C++ kernel, which cannot be"
        f" built here ({_cpu_kernel.unavailable()}); use kernel='auto' or"
        " 'xla' (the XLA path)")
  hyper = (float(learning_rate), float(b1), float(b2), float(eps))

  def fused(updates: Any, state: QuantizedStatesState, params: Any = None,
            *, path: str, **extra: Any) -> tuple[Any, QuantizedStatesState]:
    given = updates
    # As quantized_states reads them.
    updates, params = unwrap_variables((updates, params))
    check_own_state(state, QuantizedStatesState, "quantized_adam")
    check_updates_fit(updates, params, "quantized_adam(...).update")
    # The configuration base's states record (no params needed for it).
    check_made_by(state.config, jax.eval_shape(base.init, {}).config,
                  "quantized_adam")
    if path != "interpret" and (why := _kernels_take(updates, state)):
      raise ValueError(
          f"quantized_adam: kernel={path!r} cannot take this step ({why});"
          " use kernel='auto' or 'xla'")
    adam_state, rest = state.inner_state
    flat = jax.tree.leaves(state.inner_state,
                           is_leaf=lambda x: isinstance(x, QuantizedArray))
    # Each param's random stream, as the XLA path draws it: Adam's mu and
    # nu mirror the params, so mu takes its high half and nu its low.
    streams = {id(x): s for x, s in zip(flat, code_streams(
        state.inner_state, updates if params is None else params),
        strict=True) if s is not None}
    g_leaves, treedef = jax.tree.flatten(updates)
    mus = treedef.flatten_up_to(adam_state.mu)
    nus = treedef.flatten_up_to(adam_state.nu)
    count = optax.safe_increment(adam_state.count)
    key = step_key(state.seed, state.count)
    out_u, out_mu, out_nu = [], [], []
    for g, mu, nu in zip(g_leaves, mus, nus, strict=True):
      if path == "cpu" and isinstance(mu, QuantizedArray) and isinstance(
          nu, QuantizedArray):
        u, mu, nu = _cpu_kernel.leaf_step(
            g, mu, nu, _meta(mu, nu, adam_state.count, key,
                             paired_stream(streams, mu, nu)),
            adam_state.count, hyper=hyper,
            stochastic=rounding == "stochastic")
      elif isinstance(mu, QuantizedArray) and isinstance(nu, QuantizedArray):
        u, mu, nu = _fused_leaf(
            g, mu, nu, adam_state.count, key, paired_stream(streams, mu, nu),
            adam=adam, stochastic=rounding == "stochastic",
            interpret=path == "interpret")
      else:   # Kept as inner made it (a scalar param): plain Adam.
        u, chained = adam.update(
            g.astype(F32), (optax.ScaleByAdamState(
                count=adam_state.count, mu=mu, nu=nu),  # type: ignore[arg-type]
            optax.EmptyState()))
        s: Any = chained[0]  # type: ignore[index]
        mu, nu = s.mu, s.nu
      out_u.append(u)
      out_mu.append(mu)
      out_nu.append(nu)
    new_adam = optax.ScaleByAdamState(
        count=count, mu=treedef.unflatten(out_mu),
        nu=treedef.unflatten(out_nu))
    return rewrap_like(given, treedef.unflatten(out_u)), QuantizedStatesState(
        seed=state.seed, count=state.count + jnp.uint32(1),
        inner_state=(new_adam, rest), config=state.config)

  def auto(updates: Any, state: QuantizedStatesState, params: Any = None,
           **extra: Any) -> tuple[Any, QuantizedStatesState]:
    # Per lowering platform, not by the process's default backend: a CPU
    # computation on a GPU host takes the XLA path (a Triton kernel cannot
    # lower for the CPU, and the C++ kernel is built only on CPU hosts).
    # All write the same state.
    xla = declared.rebind(adam.update)
    branches = {}
    if not _kernels_take(unwrap_variables(updates), state):
      if fits:
        branches["cuda"] = lambda u, s: fused(u, s, params, path="pallas",
                                              **extra)
      if jax.default_backend() == "cpu":
        if why := _cpu_kernel.unavailable():
          _warn_no_cpu_kernel(why)
        else:
          branches["cpu"] = lambda u, s: fused(u, s, params, path="cpu",
                                               **extra)
    if not branches:
      return xla(updates, state, params, **extra)
    return jax.lax.platform_dependent(
        updates, state, **branches,
        default=lambda u, s: xla(u, s, params, **extra))

  def rebind(inner_update: contract.UpdateFn) -> contract.UpdateFn:
    # Adam's own update runs fused; another (a guard's rebinding) the XLA
    # path with it.
    if inner_update is not adam.update or kernel == "xla":
      return declared.rebind(inner_update)
    if kernel == "auto":
      return auto
    return functools.partial(fused, path=kernel)

  return optax.GradientTransformationExtraArgs(
      base.init, contract.declare(rebind(adam.update), contract.Forwarding(
          inner=adam, rebind=rebind, inner_state=declared.inner_state,
          half_by_design=declared.half_by_design)))


__all__ = ["quantized_adam"]
