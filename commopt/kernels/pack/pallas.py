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
              interpret: bool):
  """``(scales or None, words)`` in one read of ``flat`` (as :func:`reference.sign_pack`)."""
  n = flat.shape[0]

  def codes_fn(chunks, extra, idx):
    v = chunks[0].astype(_F32)
    return (v < 0).astype(_U32), jnp.abs(v)

  out = _pack_call(codes_fn, [flat], [], n, 1, block, interpret, "sign_pack", segment)
  if segment is None:
    return None, out[0]
  sums = reference.block_sums(out[1], n, block_size, segment)
  return sums / base.block_counts(n, block_size), out[0]


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
