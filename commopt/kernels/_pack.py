"""Bit packing, fused sign + scale + pack, and stochastic quantise + pack.

The layout is :mod:`commopt._src.bits`'s: code ``i`` of a ``b``-bit array
occupies stream bits ``[b·i, b·(i+1))``, little-endian within uint32 words,
and ``n`` codes take ``⌈n·b/32⌉`` words with zero padding bits. The Pallas
kernels handle 1, 2, 4 and 8 bits per code and produce bit-identical words to
the references; each program packs one power-of-two chunk of codes in
registers, so the input is read once and the words written once.
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

_U32 = jnp.uint32
_F32 = jnp.float32
BLOCK = 8192
"""Default codes per Pallas program (a power of two)."""

STYLES = ("qsgd", "terngrad")


# ---------------------------------------------------------------------------
# Shared element-wise pieces: the references and the kernels run the same ops.


def uniform_from_bits(random_bits: jax.Array) -> jax.Array:
  """Uniform float32 in ``[0, 1)`` from uint32 bits, as ``jax.random.uniform`` makes them.

  ``jax.random.uniform(key, shape)`` equals
  ``uniform_from_bits(jax.random.bits(key, shape, jnp.uint32))`` exactly: the
  top 23 bits become the mantissa of a float in ``[1, 2)``, minus one.

  Args:
    random_bits: uint32 array.

  Returns:
    A float32 array of the same shape.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from commopt.kernels import uniform_from_bits
    >>> key = jax.random.key(0)
    >>> u = uniform_from_bits(jax.random.bits(key, (4,), jnp.uint32))
    >>> bool(jnp.all(u == jax.random.uniform(key, (4,))))
    True
  """
  mantissa = (random_bits.astype(_U32) >> 9) | np.uint32(0x3F800000)
  return lax.bitcast_convert_type(mantissa, _F32) - 1.0


def quantize_codes(flat: jax.Array, u: jax.Array, factor: jax.Array, levels: int,
                   style: str) -> jax.Array:
  """Stochastic level codes of float32 ``flat`` given uniforms ``u`` and per-element factors.

  ``"qsgd"``: ``factor = levels/scale`` (0 where the scale is 0), level
  ``l = min(⌊|x|·factor + u⌋, levels)``, code ``levels ± l`` (minus where
  ``x < 0``). ``"terngrad"``: ``factor = scale``, ``p = |x|/scale`` (0 where
  the scale is 0), code 0 unless ``u < p``, then 1 (``x ≥ 0``) or 2 (``x < 0``).
  """
  if style == "terngrad":
    p = jnp.where(factor > 0, jnp.abs(flat) / jnp.where(factor > 0, factor, 1.0), 0.0)
    return jnp.where(u < p, jnp.where(flat < 0, 2, 1), 0).astype(_U32)
  level = jnp.minimum(jnp.floor(jnp.abs(flat) * factor + u), levels)
  return (jnp.where(flat < 0, -level, level) + levels).astype(_U32)


def _pack_rows(codes: jax.Array, bits: int) -> jax.Array:
  """Packs ``codes`` (uint32, length a multiple of ``32 // bits``) into words."""
  per = bitops.WORD_BITS // bits
  shifts = (jnp.arange(per, dtype=_U32) * bits)[None, :]
  # The shifted codes occupy disjoint bits, so a sum is an exact bitwise or.
  return jnp.sum(codes.reshape(-1, per) << shifts, axis=1, dtype=_U32)


def _segment_size(n: int, block_size: Optional[int], block: int) -> int:
  """Elements per partial |x| sum: a power of two dividing ``block`` and each scale block."""
  if block_size is None or block_size >= n:
    return block
  return min(block, block_size & -block_size)


def _block_sums(values: jax.Array, n: int, block_size: Optional[int], per: int) -> jax.Array:
  """Sums of ``values`` in groups of ``per``, one per scale block (zero-padded)."""
  size = base.block_len(n, block_size)
  nb = -(-n // size)
  group = -(-size // per)
  values = jnp.pad(values, (0, nb * group - values.shape[0]))
  return jnp.sum(values.reshape(nb, group), axis=1)


# ---------------------------------------------------------------------------
# The kernels.


def _pack_call(codes_fn, streams, extras, n: int, bits: int, block: int, interpret: bool,
               name: str, segment: Optional[int] = None):
  """One pass: each program maps a chunk of ``streams`` to codes and packs them.

  ``codes_fn(chunks, extra_refs, idx) -> (codes, magnitudes)``. With
  ``segment``, the kernel also writes the sum of ``magnitudes`` over every
  ``segment`` consecutive elements.
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
    dispatch.put(outs[0], first, per_program, _pack_rows(codes, bits),
                 dispatch.lanes(per_program, first) < words)
    if segment is not None:
      sums = jnp.sum(magnitude.reshape(seg_per_program, segment), axis=1)
      first = pid * seg_per_program
      dispatch.put(outs[1], first, seg_per_program, sums,
                   dispatch.lanes(seg_per_program, first) < segments)

  grid = -(-n // block)
  return dispatch.call(kernel, out_shape, grid, interpret, name)(*streams, *extras)


def _unpack_call(words: jax.Array, bits: int, size: int, block: int, interpret: bool):
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


# ---------------------------------------------------------------------------
# Public ops.


def _flat(x: jax.Array, fn: str, name: str = "x") -> jax.Array:
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise ValueError(f"{fn}: `{name}` must be an array, got {type(x).__name__}.")
  return jnp.reshape(x, (-1,))


def _check_float(x, fn: str) -> None:
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{fn}: `x` must be a floating-point array, got dtype {x.dtype}.")


def _check_block_size(block_size, fn: str, name: str = "block_size") -> Optional[int]:
  if block_size is None:
    return None
  if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
    raise ValueError(f"{fn}: `{name}` must be None or a positive integer, got {block_size!r}.")
  return block_size


def pack_bits(codes: jax.Array, bits: int, *, implementation: str = "auto",
              interpret: bool = False, block: int = BLOCK) -> jax.Array:
  """Packs unsigned codes below ``2**bits`` into uint32 words (bit-identical to ``bits.pack``).

  Args:
    codes: an array of non-negative integers (or booleans) below ``2**bits``;
      it is flattened.
    bits: the code width, 1 to 32 (the Pallas kernel handles 1, 2, 4 and 8;
      ``"auto"`` uses the reference for the others).
    implementation: ``"auto"``, ``"xla"`` or ``"pallas"``.
    interpret: run the Pallas kernel through the Pallas interpreter (any backend).
    block: codes per Pallas program, a power of two >= 32.

  Returns:
    ``⌈n·bits/32⌉`` uint32 words; padding bits are zero.

  Example:
    >>> import jax.numpy as jnp
    >>> from commopt.kernels import pack_bits
    >>> pack_bits(jnp.array([1, 0, 3, 2]), 2).tolist()
    [177]
    >>> pack_bits(jnp.array([1, 0, 3, 2]), 2, implementation="pallas", interpret=True).tolist()
    [177]
  """
  flat = _flat(codes, "pack_bits", "codes")
  bits = bitops._check_bits(bits, "pack_bits")
  block = dispatch.check_block(block, "pack_bits")
  if not (jnp.issubdtype(flat.dtype, jnp.integer) or flat.dtype == jnp.bool_):
    raise ValueError(
        f"pack_bits: `codes` must be an integer or boolean array, got dtype {flat.dtype}.")
  if not dispatch.use_pallas(implementation, interpret, "pack_bits",
                             dispatch.check_pallas_bits(bits)) or flat.shape[0] == 0:
    return bitops.pack(flat, bits)
  if flat.dtype == jnp.bool_:
    flat = flat.astype(jnp.uint8)
  return _pack_call(lambda c, e, idx: (c[0].astype(_U32), None), [flat], [],
                    flat.shape[0], bits, block, interpret, "pack_bits")[0]


def unpack_bits(words: jax.Array, bits: int, size: int, *, implementation: str = "auto",
                interpret: bool = False, block: int = BLOCK) -> jax.Array:
  """Inverse of :func:`pack_bits`: the first ``size`` codes, as uint32.

  Args:
    words: 1-D uint32 words from :func:`pack_bits`.
    bits: the code width, 1 to 32 (Pallas: 1, 2, 4 or 8).
    size: number of codes to return (at most ``32·len(words)/bits``).
    implementation: ``"auto"``, ``"xla"`` or ``"pallas"``.
    interpret: run the Pallas kernel through the Pallas interpreter.
    block: codes per Pallas program, a power of two >= 32.

  Returns:
    A uint32 array of ``size`` codes.

  Example:
    >>> import jax.numpy as jnp
    >>> from commopt.kernels import unpack_bits
    >>> unpack_bits(jnp.array([177], jnp.uint32), 2, 4).tolist()
    [1, 0, 3, 2]
  """
  bits = bitops._check_bits(bits, "unpack_bits")
  block = dispatch.check_block(block, "unpack_bits")
  if getattr(words, "ndim", None) != 1 or words.dtype != _U32:
    raise ValueError(
        f"unpack_bits: `words` must be a 1-D uint32 array, got "
        f"{getattr(words, 'dtype', type(words).__name__)} of shape {getattr(words, 'shape', None)}.")
  if (isinstance(size, bool) or not isinstance(size, int) or size < 0
      or size * bits > 32 * words.shape[0]):
    raise ValueError(
        f"unpack_bits: `size` must be an integer in [0, {32 * words.shape[0] // bits}] "
        f"for {words.shape[0]} words of {bits}-bit codes, got {size!r}.")
  if not dispatch.use_pallas(implementation, interpret, "unpack_bits",
                             dispatch.check_pallas_bits(bits)) or size == 0:
    return bitops.unpack(words, size, bits)
  return _unpack_call(words, bits, size, block, interpret)


def sign_bits(x: jax.Array, *, implementation: str = "auto", interpret: bool = False,
              block: int = BLOCK) -> jax.Array:
  """One bit per coordinate, set where ``x < 0``, packed 32 to a word in one pass.

  ``-0.0`` and NaN are not negative: their bit is 0 (they decode as ``+``).

  Args:
    x: a floating-point array; it is flattened.
    implementation: ``"auto"``, ``"xla"`` or ``"pallas"``.
    interpret: run the Pallas kernel through the Pallas interpreter.
    block: coordinates per Pallas program, a power of two >= 32.

  Returns:
    ``⌈d/32⌉`` uint32 words, equal to ``bits.pack(x.ravel() < 0, 1)``.

  Example:
    >>> import jax.numpy as jnp
    >>> from commopt.kernels import sign_bits
    >>> sign_bits(jnp.array([0.5, -3.0, 0.0, -1.0])).tolist()
    [10]
  """
  return sign_pack(x, implementation=implementation, interpret=interpret, block=block,
                   with_scale=False)[1]


def sign_pack(x: jax.Array, block_size: Optional[int] = None, *, implementation: str = "auto",
              interpret: bool = False, block: int = BLOCK, with_scale: bool = True):
  """Fused sign + scale + pack: each block's mean magnitude and the packed signs.

  The reference is ``scaled_sign``'s encoder: ``scale_b = Σ_{i∈b} |x_i| / |b|``
  in float32 and one bit per coordinate set where ``x < 0`` (``-0.0`` and NaN
  give 0). The kernel reads ``x`` once: every program packs its chunk's signs
  and writes partial sums of ``|x|`` (per chunk, or per largest power of two
  dividing ``block_size``), which are added up per block afterwards. The
  words are bit-identical to the reference; the scales agree to float32
  rounding (the sums are added in a different order).

  Args:
    x: a floating-point array; it is flattened and read as float32.
    block_size: coordinates per scale; ``None`` gives one scale.
    implementation: ``"auto"``, ``"xla"`` or ``"pallas"``.
    interpret: run the Pallas kernel through the Pallas interpreter.
    block: coordinates per Pallas program, a power of two >= 32.
    with_scale: compute the scales (``False`` returns ``None`` for them).

  Returns:
    ``(scales, words)``: float32 ``[⌈d/block_size⌉]`` (``[1]`` for ``None``)
    and uint32 ``[⌈d/32⌉]``.

  Example:
    >>> import jax.numpy as jnp
    >>> from commopt.kernels import sign_pack
    >>> scales, words = sign_pack(jnp.array([1.0, -3.0, 2.0]))
    >>> scales.tolist(), words.tolist()
    ([2.0], [2])
  """
  flat = _flat(x, "sign_pack")
  _check_float(flat, "sign_pack")
  block_size = _check_block_size(block_size, "sign_pack")
  block = dispatch.check_block(block, "sign_pack")
  n = flat.shape[0]
  if n == 0:
    raise ValueError("sign_pack: `x` must have at least one element, got size 0.")
  if not dispatch.use_pallas(implementation, interpret, "sign_pack"):
    flat = flat.astype(_F32)
    words = bitops.pack(flat < 0, 1)
    if not with_scale:
      return None, words
    sums = _block_sums(jnp.abs(flat), n, block_size, 1)
    return sums / base.block_counts(n, block_size), words

  def codes_fn(chunks, extra, idx):
    v = chunks[0].astype(_F32)
    return (v < 0).astype(_U32), jnp.abs(v)

  segment = _segment_size(n, block_size, block) if with_scale else None
  out = _pack_call(codes_fn, [flat], [], n, 1, block, interpret, "sign_pack", segment)
  if not with_scale:
    return None, out[0]
  sums = _block_sums(out[1], n, block_size, segment)
  return sums / base.block_counts(n, block_size), out[0]


def quantize_pack(x: jax.Array, random_bits: jax.Array, levels: int, scales: jax.Array, *,
                  block_size: Optional[int] = None, style: str = "qsgd",
                  implementation: str = "auto", interpret: bool = False,
                  block: int = BLOCK) -> jax.Array:
  """Stochastic rounding to levels of per-block scales, packed, in one pass.

  With ``u = uniform_from_bits(random_bits)`` and ``p = |x|/scale`` (0 where
  the block's scale is 0):

  - ``style="qsgd"``: ``l = min(⌊p·levels + u⌋, levels)`` and code
    ``levels + sign(x)·l`` in ``⌈log₂(2·levels+1)⌉`` bits (QSGD, int
    quantisation).
  - ``style="terngrad"`` (``levels=1``): code 1 (``x ≥ 0``) or 2 (``x < 0``)
    where ``u < p``, else 0, in 2 bits (TernGrad).

  The random bits are drawn outside (``jax.random.bits(key, (d,), jnp.uint32)``)
  so both implementations give bit-identical words. NaN inputs (or NaN
  scales) give the code of level 0 (``levels`` for QSGD, 0 for TernGrad).

  Args:
    x: a floating-point array; it is flattened and read as float32.
    random_bits: uint32 array with ``x``'s number of elements.
    levels: positive levels ``s`` (>= 1; 1 for ``"terngrad"``).
    scales: float32 ``[⌈d/block_size⌉]`` (``[1]`` for ``None``): the norm or
      maximum each block is quantised against.
    block_size: coordinates per scale; ``None`` gives one scale.
    style: ``"qsgd"`` or ``"terngrad"``.
    implementation: ``"auto"``, ``"xla"`` or ``"pallas"`` (Pallas packs 1, 2,
      4 or 8-bit codes; ``"auto"`` uses the reference for other widths).
    interpret: run the Pallas kernel through the Pallas interpreter.
    block: coordinates per Pallas program, a power of two >= 32.

  Returns:
    The packed codes, ``⌈d·bits/32⌉`` uint32 words.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from commopt.kernels import quantize_pack, unpack_bits
    >>> x = jnp.array([3.0, -4.0, 0.0])
    >>> r = jax.random.bits(jax.random.key(0), (3,), jnp.uint32)
    >>> words = quantize_pack(x, r, 1, jnp.linalg.norm(x)[None])
    >>> unpack_bits(words, 2, 3).tolist()[2]     # level 0 is code `levels`
    1
  """
  flat = _flat(x, "quantize_pack")
  _check_float(flat, "quantize_pack")
  n = flat.shape[0]
  if style not in STYLES:
    raise ValueError(f"quantize_pack: `style` must be one of {STYLES}, got {style!r}.")
  if (isinstance(levels, bool) or not isinstance(levels, int) or levels < 1
      or (style == "terngrad" and levels != 1)):
    valid = "1 for style='terngrad'" if style == "terngrad" else "an integer >= 1"
    raise ValueError(f"quantize_pack: `levels` must be {valid}, got {levels!r}.")
  block_size = _check_block_size(block_size, "quantize_pack")
  block = dispatch.check_block(block, "quantize_pack")
  rbits = _flat(random_bits, "quantize_pack", "random_bits")
  if rbits.dtype != _U32 or rbits.shape[0] != n:
    raise ValueError(
        f"quantize_pack: `random_bits` must be uint32 with {n} elements (as `x`), got "
        f"{rbits.dtype} with {rbits.shape[0]}.")
  size = base.block_len(n, block_size) if n else 1
  nb = -(-n // size) if n else 0
  scales = jnp.reshape(scales, (-1,)).astype(_F32)
  if scales.shape[0] != nb:
    raise ValueError(
        f"quantize_pack: `scales` must have {nb} entries (one per block of "
        f"{block_size} in {n}), got {scales.shape[0]}.")
  width = 2 if style == "terngrad" else bitops.code_bits(2 * levels + 1)
  if style == "qsgd":   # one multiply per coordinate, as the qsgd compressor does
    scales = jnp.where(scales > 0, levels / jnp.where(scales > 0, scales, 1.0), 0.0)
  if not dispatch.use_pallas(implementation, interpret, "quantize_pack",
                             dispatch.check_pallas_bits(width)) or n == 0:
    per_element = jnp.repeat(scales, size, total_repeat_length=nb * size)[:n]
    codes = quantize_codes(flat.astype(_F32), uniform_from_bits(rbits), per_element, levels,
                           style)
    return bitops.pack(codes, width)

  def codes_fn(chunks, extra, idx):
    which = jnp.minimum(lax.div(idx, size), nb - 1)
    scale = dispatch.plt.load(extra[0].at[which])
    codes = quantize_codes(chunks[0].astype(_F32), uniform_from_bits(chunks[1]), scale,
                           levels, style)
    return codes, None

  return _pack_call(codes_fn, [flat, rbits], [scales], n, width, block, interpret,
                    "quantize_pack")[0]
