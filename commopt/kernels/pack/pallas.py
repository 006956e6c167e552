"""The Pallas kernels of the packing ops (1, 2, 4 or 8 bits per code).

Each program packs one power-of-two chunk of codes in registers, so the input
is read once and the words written once; a masked load and store handle the
last, partial chunk. The codes, uniforms and partial sums are computed by the
element-wise pieces of :mod:`commopt.kernels.pack.reference`, so the outputs
are bit-identical to the references'. Arguments are checked by the api.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from commopt._src import base
from commopt._src import bits as bitops
from commopt.kernels import _dispatch as dispatch
from commopt.kernels.pack import reference

_U32 = jnp.uint32
_F32 = jnp.float32


def _pack_call(codes_fn, streams, extras, n: int, bits: int, block: int, interpret: bool,
               name: str, segment: Optional[int] = None):
  """One pass: each program maps a chunk of ``streams`` to codes and packs them.

  ``codes_fn(chunks, extra_refs, idx) -> (codes, magnitudes)``. With
  ``segment``, the kernel also writes the pairwise sum of ``magnitudes`` over
  every ``segment`` consecutive elements.
  """
  words = bitops.packed_words(n, bits)
  per_program = block * bits // bitops.WORD_BITS
  out_shape = [jax.ShapeDtypeStruct((words,), _U32)]
  if segment is not None:
    segments, seg_per_program = -(-n // segment), block // segment
    out_shape.append(jax.ShapeDtypeStruct((segments,), _F32))

  def kernel(*refs):
    ins, extra = refs[:len(streams)], refs[len(streams):len(streams) + len(extras)]
    outs = refs[len(streams) + len(extras):]
    pid = pl.program_id(0)
    idx = dispatch.lanes(block, pid * block)
    valid = idx < n
    chunks = [dispatch.chunk(r, pid * block, block, valid) for r in ins]
    codes, magnitude = codes_fn(chunks, extra, idx)
    codes = jnp.where(valid, codes, np.uint32(0))
    first = pid * per_program
    dispatch.put(outs[0], first, per_program, reference.pack_rows(codes, bits),
                 dispatch.lanes(per_program, first) < words)
    if segment is not None:
      sums = reference.pairwise_sum(magnitude.reshape(seg_per_program, segment))
      first = pid * seg_per_program
      dispatch.put(outs[1], first, seg_per_program, sums,
                   dispatch.lanes(seg_per_program, first) < segments)

  grid = -(-n // block)
  return dispatch.call(kernel, out_shape, grid, interpret, name)(*streams, *extras)


def pack_bits(flat: jax.Array, bits: int, block: int, interpret: bool) -> jax.Array:
  """The words of the integer or boolean codes ``flat`` (non-empty)."""
  if flat.dtype == jnp.bool_:
    flat = flat.astype(jnp.uint8)
  return _pack_call(lambda c, e, idx: (c[0].astype(_U32), None), [flat], [],
                    flat.shape[0], bits, block, interpret, "pack_bits")[0]


def unpack_bits(words: jax.Array, bits: int, size: int, block: int,
                interpret: bool) -> jax.Array:
  """The first ``size`` (> 0) codes of ``words``, as uint32."""
  per = bitops.WORD_BITS // bits
  per_program = block // per
  nwords = words.shape[0]
  mask = np.uint32((1 << bits) - 1)

  def kernel(w_ref, out_ref):
    pid = pl.program_id(0)
    first = pid * per_program
    w = dispatch.chunk(w_ref, first, per_program, dispatch.lanes(per_program, first) < nwords)
    shifts = (jnp.arange(per, dtype=_U32) * bits)[None, :]
    codes = ((w[:, None] >> shifts) & mask).reshape(block)
    dispatch.put(out_ref, pid * block, block, codes,
                 dispatch.lanes(block, pid * block) < size)

  return dispatch.call(kernel, jax.ShapeDtypeStruct((size,), _U32), -(-size // block),
                       interpret, "unpack_bits")(words)


def sign_pack(flat: jax.Array, block_size: Optional[int], segment: Optional[int], block: int,
              interpret: bool, plus: Optional[jax.Array] = None):
  """``(scales or None, words)`` in one read of ``flat`` (as :func:`reference.sign_pack`);
  of ``flat + plus`` (both float32, added in the kernel) when ``plus`` is given."""
  n = flat.shape[0]
  streams = [flat] if plus is None else [flat, plus]

  def codes_fn(chunks, extra, idx):
    v = chunks[0].astype(_F32) if plus is None else chunks[0] + chunks[1]
    return (v < 0).astype(_U32), jnp.abs(v)

  out = _pack_call(codes_fn, streams, [], n, 1, block, interpret, "sign_pack", segment)
  if segment is None:
    return None, out[0]
  sums = reference.block_sums(out[1], n, block_size, segment)
  return reference.block_means(sums, n, block_size), out[0]


def one_pass_feedback(n: int, block_size: Optional[int], block: int) -> bool:
  """Whether :func:`sign_feedback` runs in one pass: every scale block inside one program."""
  return block_size is not None and block_size & (block_size - 1) == 0 and 32 <= block_size <= block \
      and block_size < n


def sign_feedback(u: jax.Array, e: jax.Array, block_size: Optional[int], block: int,
                  interpret: bool):
  """``(scales, words, e′)`` of ``p = u + e`` (as :func:`reference.sign_feedback`).

  When each scale block lies inside one program's chunk (:func:`one_pass_feedback`), one
  kernel reads ``u`` and ``e`` once and writes the words, the scales and ``e′``. Otherwise
  the scales need every program's partial sums first: one kernel writes the words and the
  partial sums, and one fused XLA pass reads ``u`` and ``e`` again for ``e′``.
  """
  n = u.shape[0]
  if not one_pass_feedback(n, block_size, block):
    scales, words = sign_pack(u, block_size, reference.segment_size(n, block_size, block),
                              block, interpret, plus=e)
    return scales, words, reference.sign_residual(u + e, scales, block_size)
  per_program, rows = block // 32, block // block_size
  nwords, nscales = -(-n // 32), -(-n // block_size)
  full = np.float32(1.0) / np.float32(block_size)
  last = np.float32(1.0) / np.float32(n - block_size * (nscales - 1))
  out_shape = [jax.ShapeDtypeStruct((nwords,), _U32), jax.ShapeDtypeStruct((nscales,), _F32),
               jax.ShapeDtypeStruct((n,), _F32)]

  def kernel(u_ref, e_ref, words_ref, scales_ref, e_out):
    pid = pl.program_id(0)
    idx = dispatch.lanes(block, pid * block)
    valid = idx < n
    p = dispatch.chunk(u_ref, pid * block, block, valid) + dispatch.chunk(
        e_ref, pid * block, block, valid)
    words = reference.pack_rows(jnp.where(valid, p < 0, False).astype(_U32), 1)
    first = pid * per_program
    dispatch.put(words_ref, first, per_program, words, dispatch.lanes(per_program, first) < nwords)
    sums = reference.pairwise_sum(jnp.abs(p).reshape(rows, block_size))
    which = dispatch.lanes(rows, pid * rows)
    # The reference's reciprocals (reference.block_means): every block is whole but the last.
    scale = sums * jnp.where(which == nscales - 1, last, full)
    dispatch.put(scales_ref, pid * rows, rows, scale, which < nscales)
    p2 = p.reshape(rows, block_size)
    dispatch.put(e_out, pid * block, block,
                 (p2 - jnp.where(p2 < 0, -scale[:, None], scale[:, None])).reshape(block), valid)

  words, scales, new_e = dispatch.call(kernel, out_shape, -(-n // block), interpret,
                                       "sign_feedback")(u, e)
  return scales, words, new_e


def quantize_pack(flat: jax.Array, random_bits: jax.Array, levels: int, factors: jax.Array,
                  block_size: Optional[int], style: str, width: int, block: int,
                  interpret: bool) -> jax.Array:
  """Packed stochastic codes in one read (as ``reference.quantize_pack``; ``flat`` non-empty)."""
  n = flat.shape[0]
  size = base.block_len(n, block_size)
  nb = factors.shape[0]

  def codes_fn(chunks, extra, idx):
    which = jnp.minimum(lax.div(idx, size), nb - 1)
    factor = dispatch.plt.load(extra[0].at[which])
    codes = reference.quantize_codes(chunks[0].astype(_F32),
                                     reference.uniform_from_bits(chunks[1]), factor, levels,
                                     style)
    return codes, None

  return _pack_call(codes_fn, [flat, random_bits], [factors], n, width, block, interpret,
                    "quantize_pack")[0]
