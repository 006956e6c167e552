"""Cheap, seeded random bits for stochastic rounding: a counter hash.

``jax.random.bits`` (threefry) costs about 20 rounds of 32-bit arithmetic per
word; stochastic rounding needs one uniform per coordinate on every step, so
on a CPU it was most of what an encoder spent. This hash is two finalisers,
a handful of multiplies, shifts and xors per word, and fuses into the
rounding (``benchmarks/bench_quantize.py`` times the stochastic quantisers
that draw their bits here).

Word ``i`` of a stream is ``fmix(fmix(i + s0) ^ s1)``, ``fmix`` being
MurmurHash3's 32-bit finaliser (an invertible avalanche mix) and ``(s0, s1)``
two words drawn from the key with ``jax.random.bits``. It is deterministic
given the key, elementwise (so XLA fuses it into the rounding and no buffer
of random words exists), and identical on every backend. It is a statistical
generator, not a cryptographic one: what stochastic rounding needs is
uniform, independent-looking bits, which ``tests/test_rng.py`` checks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from commopt._src import base


def fmix32(h: jax.Array) -> jax.Array:
  """MurmurHash3's finaliser on uint32 words."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def counter_bits(key: jax.Array, n: int) -> jax.Array:
  """``n`` pseudo-random uint32 words from ``key`` (a typed or raw PRNG key)."""
  s = jax.random.bits(key, (2,), jnp.uint32)
  i = jnp.arange(n, dtype=jnp.uint32)
  return fmix32(fmix32(i + s[0]) ^ s[1])


def _feistel(j: jax.Array, seeds: jax.Array, half: int) -> jax.Array:
  """A keyed bijection of the ``2·half``-bit integers: four Feistel rounds of :func:`fmix32`."""
  mask = jnp.uint32((1 << half) - 1)
  left, right = j >> half, j & mask
  for r in range(4):
    left, right = right, left ^ (fmix32(right ^ seeds[r]) & mask)
  return (left << half) | right


def distinct_indices(key: jax.Array, size: int, k: int) -> jax.Array:
  """``k`` distinct pseudo-random indices in ``[0, size)``, ascending, in O(k) work.

  The first candidates ``π(0), π(1), ...`` of a keyed permutation ``π`` of
  the ``2^b ≥ size`` integers (a 4-round Feistel network, Luby–Rackoff's
  construction of a pseudo-random permutation) that fall below ``size``,
  the first ``k`` of them: a random ``k``-subset. At least a quarter of the
  candidates fall below ``size``, and ``4k + 32√k + 64`` are drawn, so a
  shortfall (filled with the out-of-range ``size``) is more than 10
  standard deviations away. Where that many candidates cover the whole
  range, every index is enumerated and the subset is exact.
  """
  bits = max(2, (size - 1).bit_length())
  bits += bits % 2
  half = bits // 2
  candidates = min(1 << bits, 4 * k + 32 * int(k ** 0.5) + 64)
  seeds = jax.random.bits(key, (4,), jnp.uint32)
  drawn = _feistel(jnp.arange(candidates, dtype=jnp.uint32), seeds, half)
  # Positions of the first k valid candidates, in candidate order.
  slots = base.first_true(drawn < jnp.uint32(size), k)
  chosen = jnp.where(slots < candidates, drawn[jnp.minimum(slots, candidates - 1)], size)
  return jnp.sort(chosen.astype(jnp.int32))
