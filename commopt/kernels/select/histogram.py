"""Magnitude top-k in XLA without ``lax.top_k``: a sampled band, histograms, bit-packed words.

The ranking and the result are :mod:`commopt.kernels.select.reference`'s (the
key of :func:`~commopt.kernels.magnitude_key`, ties to the lower index,
indices ascending); only the way there differs. XLA:CPU's ``lax.top_k``
keeps a heap of the ``k`` best, whose upkeep dominates once ``k`` is in the
thousands (``benchmarks/bench_sparsify.py`` times ``lax.top_k`` on a CPU by
density, ``benchmarks/kernels.py``'s CPU section this selection); this reads
the leaf about once whatever ``k``.

The leaf is cut into words of 32 coordinates, and a word's selected
coordinates are the set bits of a uint32 mask. The masks are found in one of
two ways, both exact:

- **Sampled band** (leaves of at least :data:`SAMPLE_FROM` coordinates). The
  histogram of the keys' high 16 bits in a sample of :data:`SAMPLE`
  coordinates (:data:`RUNS` runs of 16 spread over the leaf) brackets the
  k-th key between two bin edges, with a margin. One pass over the leaf
  packs, per word, the keys above the band and the keys inside it. When the
  counts confirm the bracket (fewer than ``k`` above, at least ``k`` above
  or inside) and the band holds at most :func:`band_capacity` coordinates,
  the band's coordinates are gathered in index order and the k-th key ``T``
  found among them (two histograms, as below); the band's keys above ``T``,
  and its first keys equal to ``T`` by index, join the words above the band.
- **Radix select** (smaller leaves, and a bracket the counts refute): a
  histogram (a scatter-add of ones) of the high 16 bits of every key picks
  the bin that holds the k-th key, a histogram of the low 15 bits of the keys
  in that bin finishes ``T``; one pass packs the keys above ``T`` and the keys
  equal to it, and a word's ties are taken lowest bits first, as many as the
  words before it leave.

Then the compaction, without a scan over the leaf: output slot ``s`` lies in
the word where the running count of selected coordinates passes ``s`` (a
binary search over the words' prefix sums), at the bit of that word's mask
whose rank is what is left (a binary search with ``population_count``).
Arguments are checked by the api.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from commopt._src import bits
from commopt.kernels.select import reference

_U32 = jnp.uint32
_I32 = jnp.int32
HIGH_BITS = 16
"""Width of the first digit: the key's bits 30 to 15 (65,536 bins)."""
LOW_BITS = 15
"""Width of the second digit: the key's bits 14 to 0 (32,768 bins)."""
WORD = 32
"""Coordinates per word (the bits of a uint32)."""
CHUNK = 2**18
"""Coordinates per scatter of a histogram (XLA:CPU's scatter slows several-fold once its
indices outgrow the cache)."""
SAMPLE = 2**16
"""Coordinates of the sample that brackets the k-th key: :data:`RUNS` runs of 16."""
RUNS = SAMPLE // 16
"""Runs of 16 consecutive coordinates in the sample, one in each of as many equal spans of
the leaf, at offsets that vary from span to span (so no column of a matrix is favoured)."""
SAMPLE_FROM = 2**17
"""The smallest leaf whose k-th key is bracketed from a sample."""
MIN_K = 2048
"""The smallest ``k`` :func:`suits` sends here: below it ``lax.top_k``'s heap is cheap."""
MAX_SIZE = 2**24
"""The largest leaf :func:`suits` sends here (its histograms are unrolled by chunk)."""


def suits(n: int, k: int) -> bool:
  """Whether :func:`select_top_k` is the faster exact selection of ``k`` of ``n``: on the
  CPU backend, for ``k >= MIN_K`` (there ``lax.top_k`` costs several reads of the leaf)."""
  return jax.default_backend() == "cpu" and MIN_K <= k and n <= MAX_SIZE


MARGIN = (4.0, 16.0)
"""``(a, b)``: the band reaches ``a·√r + b`` sample keys either side of the sample's
expected rank ``r`` of the k-th key (``a`` standard deviations of an independent sample,
and room for runs of neighbours that resemble each other)."""


def _margin(n: int, k: int) -> float:
  """Half the band, in sample keys, around the sample's expected rank of the k-th key."""
  return MARGIN[0] * math.sqrt(k * SAMPLE / n) + MARGIN[1]


def band_capacity(n: int, k: int) -> int:
  """The most coordinates a band may hold for its keys to be ranked among themselves:
  twice the band's expected size (a power of two, at least 1024)."""
  expected = (2 * _margin(n, k) + 2) * n / SAMPLE
  return min(n, max(1024, 1 << math.ceil(math.log2(2 * expected))))


# ---------------------------------------------------------------------------
# Histograms.


def _histogram(values: jax.Array, bins: int) -> jax.Array:
  """int32 counts of ``values`` (int32, 1-D; ``bins`` and above are dropped), by one
  scatter-add of ones per :data:`CHUNK` of them."""
  n = values.shape[0]
  ones = jnp.ones((min(n, CHUNK),), _I32)
  hist = jnp.zeros((bins,), _I32)
  for start in range(0, n, CHUNK):
    part = values[start:start + CHUNK]
    hist = hist.at[part].add(ones[:part.shape[0]], mode="drop")
  return hist


def _digit(hist: jax.Array, rank):
  """``(bin, rank')``: the bin holding the ``rank``-th largest value (1-based) counted by
  ``hist``, and that value's rank among the bin's own (``rank`` less the values in higher
  bins). By blocks of 256 bins, so no prefix sum runs over the whole histogram."""
  blocks = hist.reshape(-1, 256)
  totals = jnp.sum(blocks, axis=1)
  at_least = jnp.cumsum(totals[::-1])[::-1]            # in this block or a higher one
  block = jnp.sum(at_least >= rank).astype(_I32) - 1
  rank = rank - (at_least[block] - totals[block])
  inner = blocks[block]
  at_least = jnp.cumsum(inner[::-1])[::-1]
  digit = jnp.sum(at_least >= rank).astype(_I32) - 1
  return block * 256 + digit, rank - (at_least[digit] - inner[digit])


def kth_key(key: jax.Array, k, valid=None):
  """``(T, ties)``: the ``k``-th largest of ``key`` (uint32, 1-D; only where ``valid``)
  and how many of the keys equal to it are among the ``k`` largest."""
  high = (key >> LOW_BITS).astype(_I32)
  if valid is not None:
    high = jnp.where(valid, high, 1 << HIGH_BITS)
  top, rank = _digit(_histogram(high, 1 << HIGH_BITS), k)
  low = jnp.where(high == top, (key & np.uint32((1 << LOW_BITS) - 1)).astype(_I32),
                  1 << LOW_BITS)
  bottom, ties = _digit(_histogram(low, 1 << LOW_BITS), rank)
  return (top.astype(_U32) << LOW_BITS) | bottom.astype(_U32), ties


# ---------------------------------------------------------------------------
# Words of 32 coordinates.


def _count(words: jax.Array) -> jax.Array:
  return lax.population_count(words).astype(_I32)


def _words(key: jax.Array, n: int, *tests):
  """Per test, the ``[words]`` uint32 masks of the coordinates whose key passes it, from
  one read of ``key``."""
  words = -(-n // WORD)
  padded = jnp.pad(key, (0, words * WORD - n)).reshape(words, WORD)
  passed = jnp.stack([test(padded) for test in tests], axis=-1)      # [words, WORD, tests]
  if n % WORD:
    passed &= (jnp.arange(words * WORD, dtype=_I32) < n).reshape(words, WORD, 1)
  weights = (jnp.uint32(1) << jnp.arange(WORD, dtype=_U32))[:, None]
  masks = jnp.sum(jnp.where(passed, weights, np.uint32(0)), axis=1, dtype=_U32)
  return [masks[:, i] for i in range(len(tests))]


def _radix_words(flat: jax.Array, k: int) -> jax.Array:
  """The selection's words by the radix select over every key."""
  n, key = flat.shape[0], reference.magnitude_key(flat)
  threshold, need = kth_key(key, jnp.asarray(k, _I32))
  above, tied = _words(key, n, lambda v: v > threshold, lambda v: v == threshold)
  tied_count = _count(tied)
  taken = jnp.clip(need - (jnp.cumsum(tied_count) - tied_count), 0, tied_count)
  # Every word takes all of its ties or none, but one may take only its lowest `taken`:
  # those below its tie of rank `taken`.
  kept = jnp.where(taken >= tied_count, tied, np.uint32(0))
  split = jnp.argmax((taken > 0) & (taken < tied_count))
  cut = bits.nth_set_bit(tied[split], taken[split])
  kept = kept.at[split].set(jnp.where(taken[split] < tied_count[split],
                                      tied[split] & bits.low_mask(cut), kept[split]))
  return above | kept


def sample_keys(key: jax.Array, n: int) -> jax.Array:
  """:data:`SAMPLE` of the ``n`` (at least :data:`SAMPLE_FROM`) keys: :data:`RUNS` runs of
  16 consecutive keys, each in its own span of the leaf, at an offset scrambled by Knuth's
  multiplicative hash (so no column of a matrix is favoured)."""
  blocks = n // 16
  span = blocks // RUNS
  scrambled = np.arange(RUNS, dtype=np.uint64) * 2654435761 % 2**32
  starts = np.arange(RUNS) * span + scrambled % span
  return key[:blocks * 16].reshape(blocks, 16)[starts.astype(np.int32)].reshape(-1)


def sample_rank_bounds(n: int, k: int) -> tuple[int, int]:
  """``(low, high)``: the sample ranks (1-based, may fall outside ``[1, SAMPLE]``) that
  bracket the k-th largest key of the leaf with the margin :data:`MARGIN`."""
  rank, margin = k * SAMPLE / n, _margin(n, k)
  return math.floor(rank - margin), math.ceil(rank + margin)


def _band_edges(key: jax.Array, n: int, k: int):
  """``(low, high)``: bin edges of the keys the sample ranks around the k-th largest."""
  sample = sample_keys(key, n)
  hist = _histogram((sample >> LOW_BITS).astype(_I32), 1 << HIGH_BITS)
  edges = []
  for r, past in zip(sample_rank_bounds(n, k), (1, 0)):
    if r < 1:                     # above everything
      edges.append(jnp.asarray(1 << 31, _U32))
    elif r > SAMPLE:              # below everything
      edges.append(jnp.asarray(0, _U32))
    else:
      b, _ = _digit(hist, jnp.asarray(r, _I32))
      edges.append((b + past).astype(_U32) << LOW_BITS)
  high, low = edges
  return low, high


def _band_words(flat: jax.Array, k: int, above, band, capacity: int):
  """The selection's words from the words ``above`` the band and the band's, the k-th key
  being inside the band and the band at most ``capacity`` coordinates."""
  word, bit = bits.set_bit_slots(band, capacity)
  valid = word < band.shape[0]
  index = word * WORD + bit
  band_key = reference.magnitude_key(flat.at[index].get(mode="fill", fill_value=0))
  need = k - jnp.sum(_count(above))
  threshold, ties = kth_key(band_key, need, valid)
  tie = valid & (band_key == threshold)
  taken = valid & ((band_key > threshold) | (tie & (jnp.cumsum(tie.astype(_I32)) <= ties)))
  set_bits = jnp.where(taken, jnp.uint32(1) << bit.astype(_U32), np.uint32(0))
  return above + jnp.zeros_like(above).at[jnp.where(taken, word, band.shape[0])].add(
      set_bits, mode="drop")


@functools.partial(jax.jit, static_argnums=(1,))
def select_top_k(flat: jax.Array, k: int):
  """``(values, indices)`` of the ``k`` largest keys of ``flat``, indices ascending."""
  n = flat.shape[0]
  key = reference.magnitude_key(flat)
  if n < SAMPLE_FROM:
    chosen = _radix_words(flat, k)
  else:
    low, high = _band_edges(key, n, k)
    above, band = _words(key, n, lambda v: v >= high, lambda v: (v >= low) & (v < high))
    count_above, count_band = jnp.sum(_count(above)), jnp.sum(_count(band))
    capacity = band_capacity(n, k)
    bracketed = (count_above < k) & (k <= count_above + count_band) & (count_band <= capacity)
    # The branches recompute the keys from `flat`: an operand of the cond is written out.
    chosen = lax.cond(bracketed, lambda: _band_words(flat, k, above, band, capacity),
                      lambda: _radix_words(flat, k))
  word, bit = bits.set_bit_slots(chosen, k)
  indices = word * WORD + bit
  return flat[indices], indices
