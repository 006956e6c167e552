"""Bit packing: booleans and small unsigned codes into uint32 words.

These are the pure-jnp references; they are exact for every width and run
unchanged on CPU and GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

WORD_BITS = 32


def packed_words(n: int, bits: int = 1) -> int:
  """Number of uint32 words that hold ``n`` codes of ``bits`` bits."""
  per_word = WORD_BITS // bits
  return -(-n // per_word)


def pack(codes: jax.Array, bits: int = 1) -> jax.Array:
  """Packs a flat array of unsigned codes (< 2**bits) into uint32 words.

  ``bits`` must divide 32. Code ``i`` lands in word ``i // (32 // bits)`` at
  bit offset ``bits * (i % (32 // bits))``. Padding codes are zero.
  """
  if WORD_BITS % bits:
    raise ValueError(f"pack: `bits` must divide 32, got {bits!r}.")
  per_word = WORD_BITS // bits
  n = codes.shape[0]
  words = packed_words(n, bits)
  codes = jnp.pad(codes.astype(jnp.uint32), (0, words * per_word - n))
  codes = codes.reshape(words, per_word)
  shifts = (jnp.arange(per_word, dtype=jnp.uint32) * bits)
  # The shifted codes occupy disjoint bits, so a sum is an exact bitwise or.
  return jnp.sum(codes << shifts, axis=1, dtype=jnp.uint32)


def unpack(words: jax.Array, n: int, bits: int = 1) -> jax.Array:
  """Inverse of :func:`pack`: the first ``n`` codes as uint32."""
  if WORD_BITS % bits:
    raise ValueError(f"unpack: `bits` must divide 32, got {bits!r}.")
  per_word = WORD_BITS // bits
  shifts = (jnp.arange(per_word, dtype=jnp.uint32) * bits)
  mask = jnp.uint32((1 << bits) - 1)
  codes = (words[:, None] >> shifts) & mask
  return codes.reshape(-1)[:n]
