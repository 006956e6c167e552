"""The pure-jnp references of the packing ops, and the element-wise pieces the kernels share.

The layout is :mod:`commopt._src.bits`'s: code ``i`` of a ``b``-bit array
occupies stream bits ``[b·i, b·(i+1))``, little-endian within uint32 words,
and ``n`` codes take ``⌈n·b/32⌉`` words with zero padding bits. The
references are exact for every width from 1 to 32 and run on any backend.

:func:`uniform_from_bits`, :func:`quantize_codes`, :func:`pairwise_sum` and
:func:`pack_rows` are run unchanged inside the Pallas kernels too, which is
what makes the kernels' outputs bit-identical to the references'.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from commopt._src import base
from commopt._src import bits as bitops

_U32 = jnp.uint32
_F32 = jnp.float32

STYLES = ("qsgd", "terngrad")
"""The stochastic roundings of :func:`quantize_pack`."""


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

  Examples:
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

  Args:
    flat: float32 coordinates.
    u: float32 uniforms in ``[0, 1)``, shaped like ``flat``.
    factor: float32 per-coordinate factors (see above), broadcastable to ``flat``.
    levels: the positive levels ``s`` (1 for ``"terngrad"``).
    style: ``"qsgd"`` or ``"terngrad"``.

  Returns:
    uint32 codes shaped like ``flat``.
  """
  if style == "terngrad":
    p = jnp.where(factor > 0, jnp.abs(flat) / jnp.where(factor > 0, factor, 1.0), 0.0)
    return jnp.where(u < p, jnp.where(flat < 0, 2, 1), 0).astype(_U32)
  level = jnp.minimum(jnp.floor(jnp.abs(flat) * factor + u), levels)
  return (jnp.where(flat < 0, -level, level) + levels).astype(_U32)


def pairwise_sum(values: jax.Array) -> jax.Array:
  """Sums over the last axis in one fixed order: the aligned pairwise (binary) tree.

  The last axis is zero-padded to a power of two ``2**m``; level ``l`` adds
  neighbours ``2j`` and ``2j+1`` of level ``l-1``. Every add is a float add of
  two numbers, so the result does not depend on how a backend would order a
  reduction. For non-negative values the zero padding changes nothing, so the
  sum of an aligned power-of-two group is a subtree of the sum of any larger
  group that contains it: summing segments first and the segment sums after
  gives the same bits.

  Args:
    values: a float array (in a kernel, its last axis is a power of two).

  Returns:
    ``values`` without its last axis.

  Examples:
    >>> import jax.numpy as jnp
    >>> from commopt.kernels import pairwise_sum
    >>> pairwise_sum(jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])).tolist()   # (1+2)+(3+0)
    [6.0, 15.0]
  """
  m = values.shape[-1]
  width = 1 << max(m - 1, 0).bit_length()
  if width != m:
    values = jnp.pad(values, [(0, 0)] * (values.ndim - 1) + [(0, width - m)])
  while width > 1:
    width //= 2
    # Element-wise adds of the two halves of each pair (not a reduction, which
    # a compiler may merge with the next level and reorder).
    even, odd = jnp.unstack(values.reshape(values.shape[:-1] + (width, 2)), axis=-1)
    values = even + odd
  return values.reshape(values.shape[:-1])


def pack_rows(codes: jax.Array, bits: int) -> jax.Array:
  """Packs ``codes`` (uint32, length a multiple of ``32 // bits``) into words."""
  per = bitops.WORD_BITS // bits
  shifts = (jnp.arange(per, dtype=_U32) * bits)[None, :]
  # The shifted codes occupy disjoint bits, so a sum is an exact bitwise or.
  return jnp.sum(codes.reshape(-1, per) << shifts, axis=1, dtype=_U32)


SEGMENT: Optional[int] = None
"""The longest partial |x| sum a sign kernel writes (a power of two; None: a whole program's
chunk). Any power of two gives the same scales (see :func:`pairwise_sum`); shorter segments
trade a deeper in-kernel tree for more partial sums written."""


def segment_size(n: int, block_size: Optional[int], block: int) -> int:
  """Elements per partial |x| sum: a power of two dividing ``block`` and each scale block."""
  cap = block if SEGMENT is None else min(block, SEGMENT)
  if block_size is None or block_size >= n:
    return cap
  return min(cap, block_size & -block_size)


def block_sums(values: jax.Array, n: int, block_size: Optional[int], per: int) -> jax.Array:
  """Pairwise sums of ``values`` (each the sum of ``per`` coordinates), one per scale block."""
  size = base.block_len(n, block_size)
  nb = -(-n // size)
  group = -(-size // per)
  values = jnp.pad(values, (0, nb * group - values.shape[0]))
  return pairwise_sum(values.reshape(nb, group))


def block_means(sums: jax.Array, n: int, block_size: Optional[int]) -> jax.Array:
  """Each block's sum times the float32 reciprocal of its count.

  A multiply by constants, not a division: XLA rewrites a division by a constant
  as such a multiply inside a compiled program but not outside one, so a division
  would give other bits eagerly than under ``jit``, and other bits than a kernel.
  """
  return sums * (np.float32(1.0) / base.block_counts(n, block_size))


def segment_sums(values: jax.Array, segment: int) -> jax.Array:
  """Pairwise sums of consecutive ``segment`` values (the last zero-padded)."""
  n = values.shape[0]
  values = jnp.pad(values, (0, -(-n // segment) * segment - n))
  return pairwise_sum(values.reshape(-1, segment))


# ---------------------------------------------------------------------------
# The references (arguments already checked by the api).


def pack_bits(flat: jax.Array, bits: int) -> jax.Array:
  """``⌈n·bits/32⌉`` words of the flat codes (any width from 1 to 32)."""
  return bitops.pack(flat, bits)


def unpack_bits(words: jax.Array, bits: int, size: int) -> jax.Array:
  """The first ``size`` codes of ``words``, as uint32."""
  return bitops.unpack(words, size, bits)


def sign_pack(flat: jax.Array, block_size: Optional[int], segment: Optional[int]):
  """``(scales or None, words)``: mean |x| per block (pairwise sums) and the packed signs.

  ``segment`` is the kernel's partial-sum length; the scales do not depend
  on it (see :func:`pairwise_sum`), and ``None`` leaves them out.
  """
  n = flat.shape[0]
  flat = flat.astype(_F32)
  words = bitops.pack(flat < 0, 1)
  if segment is None:
    return None, words
  sums = block_sums(segment_sums(jnp.abs(flat), segment), n, block_size, segment)
  return block_means(sums, n, block_size), words


def sign_residual(p: jax.Array, scales: jax.Array, block_size: Optional[int]) -> jax.Array:
  """``p − decode(scales, signs of p)``: what ``scaled_sign``'s reconstruction of ``p`` misses.

  ``p`` float32, flat; each coordinate loses ``+scale`` of its block, or ``−scale``
  where ``p < 0`` (the decode's ``scale · ±1``, exactly).
  """
  scale = base.per_element(scales, p.shape[0], block_size)
  return p - jnp.where(p < 0, -scale, scale)


def sign_feedback(u: jax.Array, e: jax.Array, block_size: Optional[int], segment: int):
  """``(scales, words, e′)`` of ``p = u + e`` (float32): ``sign_pack(p)`` and ``p − decode``."""
  p = u + e
  scales, words = sign_pack(p, block_size, segment)
  return scales, words, sign_residual(p, scales, block_size)


def quantize_pack(flat: jax.Array, random_bits: jax.Array, levels: int, factors: jax.Array,
                  block_size: Optional[int], style: str, width: int) -> jax.Array:
  """Packed stochastic codes, with one factor per block (see :func:`quantize_codes`)."""
  per_element = base.per_element(factors, flat.shape[0], block_size)
  codes = quantize_codes(flat.astype(_F32), uniform_from_bits(random_bits), per_element,
                         levels, style)
  return bitops.pack(codes, width)
