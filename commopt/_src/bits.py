"""Bit packing: booleans and small unsigned codes into uint32 words.

The layout is one little-endian bit stream: code ``i`` of a ``bits``-wide
array occupies stream bits ``[bits·i, bits·(i+1))``, and stream bit ``j`` is
bit ``j % 32`` of word ``j // 32``. Widths that divide 32 never straddle a
word; other widths (3, 5, 9, ...) may, and every 32 codes fill exactly
``bits`` words. ``n`` codes take ``⌈n·bits/32⌉`` words.

These are the pure-jnp references; they are exact for every width from 1 to
32 and run unchanged on CPU and GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

WORD_BITS = 32


def _check_bits(bits, fn: str) -> int:
  if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 32:
    raise ValueError(f"{fn}: `bits` must be an integer in [1, 32], got {bits!r}.")
  return int(bits)


def packed_words(n: int, bits: int = 1) -> int:
  """Number of uint32 words that hold ``n`` codes of ``bits`` bits."""
  return -(-n * bits // WORD_BITS)


def code_bits(num_codes: int) -> int:
  """Bits of a fixed-width code for ``num_codes`` distinct values (≥ 1 bit)."""
  return max(1, int(num_codes - 1).bit_length())


def _straddle_plan(bits: int):
  """Static offsets for a group of 32 codes spread over ``bits`` words."""
  offset = np.arange(WORD_BITS) * bits
  word, shift = offset // WORD_BITS, offset % WORD_BITS
  spill = shift + bits > WORD_BITS          # the code's high part is in word + 1
  return word, shift.astype(np.uint32), spill


def pack(codes: jax.Array, bits: int = 1) -> jax.Array:
  """Packs a flat array of unsigned codes (< 2**bits) into uint32 words.

  Args:
    codes: a 1-D array of non-negative integers (or booleans) below ``2**bits``.
    bits: the code width, 1 to 32.

  Returns:
    ``⌈n·bits/32⌉`` uint32 words; padding bits are zero.
  """
  bits = _check_bits(bits, "pack")
  n = codes.shape[0]
  words = packed_words(n, bits)
  codes = codes.astype(jnp.uint32)
  if WORD_BITS % bits == 0:
    per_word = WORD_BITS // bits
    codes = jnp.pad(codes, (0, words * per_word - n)).reshape(words, per_word)
    shifts = jnp.arange(per_word, dtype=jnp.uint32) * bits
    # The shifted codes occupy disjoint bits, so a sum is an exact bitwise or.
    return jnp.sum(codes << shifts, axis=1, dtype=jnp.uint32)
  groups = -(-n // WORD_BITS)
  codes = jnp.pad(codes, (0, groups * WORD_BITS - n)).reshape(groups, WORD_BITS)
  word, shift, spill = _straddle_plan(bits)
  out = []
  for w in range(bits):
    low = np.flatnonzero(word == w)
    high = np.flatnonzero((word == w - 1) & spill)
    part = jnp.sum(codes[:, low] << shift[low], axis=1, dtype=jnp.uint32)
    if high.size:
      part = part + jnp.sum(codes[:, high] >> (WORD_BITS - shift[high]), axis=1,
                            dtype=jnp.uint32)
    out.append(part)
  return jnp.stack(out, axis=1).reshape(-1)[:words]


def unpack(words: jax.Array, n: int, bits: int = 1) -> jax.Array:
  """Inverse of :func:`pack`: the first ``n`` codes, as uint32."""
  bits = _check_bits(bits, "unpack")
  mask = jnp.uint32((1 << bits) - 1) if bits < WORD_BITS else jnp.uint32(0xFFFFFFFF)
  if WORD_BITS % bits == 0:
    per_word = WORD_BITS // bits
    shifts = jnp.arange(per_word, dtype=jnp.uint32) * bits
    codes = (words[:, None] >> shifts) & mask
    return codes.reshape(-1)[:n]
  groups = -(-n // WORD_BITS)
  words = jnp.pad(words, (0, groups * bits - words.shape[0])).reshape(groups, bits)
  word, shift, spill = _straddle_plan(bits)
  codes = words[:, word] >> shift
  high_word = np.minimum(word + 1, bits - 1)
  high_shift = np.where(spill, WORD_BITS - shift.astype(np.int64), 0).astype(np.uint32)
  high = jnp.where(spill, words[:, high_word] << high_shift, jnp.uint32(0))
  return ((codes | high) & mask).reshape(-1)[:n]


def low_mask(bits: jax.Array) -> jax.Array:
  """uint32 words with the ``bits`` (0 to 31) lowest bits set."""
  return (jnp.uint32(1) << bits.astype(jnp.uint32)) - np.uint32(1)


def nth_set_bit(word: jax.Array, rank: jax.Array) -> jax.Array:
  """The position of the set bit of rank ``rank`` (0-based, below ``popcount(word)``) of
  each uint32 ``word``: the largest ``p`` with ``popcount(word & low_mask(p)) <= rank``."""
  position = jnp.zeros(word.shape, jnp.uint32)
  for step in (16, 8, 4, 2, 1):
    trial = position + np.uint32(step)
    below = jax.lax.population_count(word & low_mask(trial)).astype(jnp.int32)
    position = jnp.where(below <= rank, trial, position)
  return position.astype(jnp.int32)


def set_bit_slots(words: jax.Array, size: int):
  """``(word, bit)`` of the first ``size`` set bits of ``words`` in stream order (past the
  last set bit: ``word`` is the number of words). One scan over the words' counts and a
  binary search per slot."""
  counts = jax.lax.population_count(words).astype(jnp.int32)
  ends = jnp.cumsum(counts)
  slots = jnp.arange(size, dtype=jnp.int32)
  word = jnp.searchsorted(ends, slots, side="right").astype(jnp.int32)
  found = words.at[word].get(mode="fill", fill_value=0)
  rank = slots - (ends.at[word].get(mode="fill", fill_value=0)
                  - jax.lax.population_count(found).astype(jnp.int32))
  return word, nth_set_bit(found, rank)


def first_true(mask: jax.Array, capacity: int) -> jax.Array:
  """The flat indices of the first ``capacity`` true entries of boolean ``mask``, ascending;
  slots past the number of true entries hold ``mask.size``.

  The mask packed 32 entries to a word (:func:`pack`), then :func:`set_bit_slots`: the
  one scan runs over the ``⌈n/32⌉`` words' counts, not the ``n`` entries. XLA:CPU scans an
  array several times slower than it reads one, so one read that packs the mask and a
  scan over 32 times fewer values cost less than a scan and a search over the entries.
  """
  flat = mask.reshape(-1) != 0          # a bool mask as it is; anything else, its nonzeros
  n = flat.shape[0]
  if not capacity or not n:
    return jnp.full((capacity,), n, jnp.int32)
  words = pack(flat, 1)
  word, bit = set_bit_slots(words, capacity)
  return jnp.where(word < words.shape[0], word * WORD_BITS + bit, n).astype(jnp.int32)
