"""Magnitude top-k and mask compaction in Pallas, without sorting.

The ranking is :mod:`commopt.kernels.select.reference`'s (the key of
:func:`~commopt.kernels.magnitude_key`, ties to the lower index), and so is
the order of the result: ascending indices.

- :func:`select_top_k_sampled` (leaves of at least
  :data:`~commopt.kernels.select.histogram.SAMPLE_FROM` coordinates, when
  :func:`suits_sampled`): a sample of the keys gives a lower bound ``L`` of the
  k-th key; one pass (XLA) counts each program's keys ``>= L``, the compaction
  kernel writes them, in index order, to a few times ``k`` slots; the k-th
  key and its ties are found among those candidates by two histograms. When
  the counts refute the bound, the radix select runs instead.
- :func:`select_top_k` (the radix select): pass ``p`` reads the input once
  and builds, per program, a histogram of one ``radix_bits``-wide digit of the
  key over the coordinates whose higher digits equal the prefix found so far;
  the per-program histograms are added up to pick the digit that holds the
  k-th key and the count above it. After ``⌈31/radix_bits⌉`` passes the k-th
  key ``T`` is known, and so is how many coordinates above ``T`` each program
  holds; a last pass writes every coordinate with key ``> T`` and the first
  (by index) coordinates with key ``== T`` to their slots, found by prefix
  sums.
- :func:`first_true`: the same compaction for a boolean mask (one counting
  pass, one writing pass).

Arguments are checked by the api.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from commopt.kernels import _dispatch as dispatch
from commopt.kernels.select import histogram, reference

_U32 = jnp.uint32
_I32 = jnp.int32
KEY_BITS = 31


def _digits(radix_bits: int):
  """``(low bit, width)`` of each digit of the 31-bit key, most significant first."""
  plan, high = [], KEY_BITS
  while high > 0:
    width = min(radix_bits, high)
    plan.append((high - width, width))
    high -= width
  return plan


def _histogram_pass(flat, prefix, low: int, width: int, radix_bits: int, block: int,
                    interpret: bool):
  """Per-program histograms ``[programs, 2**radix_bits]`` of one digit under ``prefix``."""
  n = flat.shape[0]
  bins = 1 << radix_bits
  programs = -(-n // block)

  def kernel(x_ref, prefix_ref, hist_ref):
    pid = pl.program_id(0)
    valid = dispatch.lanes(block, pid * block) < n
    key = reference.magnitude_key(dispatch.chunk(x_ref, pid * block, block, valid))
    match = valid & ((key >> (low + width)) == prefix_ref[0])
    digit = (key >> low) & np.uint32((1 << width) - 1)
    onehot = (digit[:, None] == jnp.arange(bins, dtype=_U32)[None, :]) & match[:, None]
    counts = jnp.sum(onehot.astype(_I32), axis=0)
    dispatch.put(hist_ref, pid * bins, bins, counts, dispatch.lanes(bins) < bins)

  out = jax.ShapeDtypeStruct((programs * bins,), _I32)
  hist = dispatch.call(kernel, out, programs, interpret, "select_top_k_histogram")(
      flat, prefix.reshape(1))
  return hist.reshape(programs, bins)


def _compact_pass(flat, threshold, offsets, ties, k: int, block: int, interpret: bool):
  """Writes the selected coordinates (key > T, and the first ``ties`` per program at T) to
  ``k`` slots; a coordinate whose slot would fall past the end is dropped."""
  n = flat.shape[0]

  def kernel(x_ref, t_ref, off_ref, ties_ref, val_ref, idx_ref):
    pid = pl.program_id(0)
    idx = dispatch.lanes(block, pid * block)
    valid = idx < n
    values = dispatch.chunk(x_ref, pid * block, block, valid)
    key = reference.magnitude_key(values)
    t = t_ref[0]
    tie = valid & (key == t)
    take = (valid & (key > t)) | (tie & (jnp.cumsum(tie.astype(_I32)) <= ties_ref[pid]))
    slot = off_ref[pid] + jnp.cumsum(take.astype(_I32)) - 1
    take = take & (slot < k)
    slot = jnp.where(take, slot, k)          # masked lanes point past the end
    dispatch.plt.store(val_ref.at[slot], values, mask=take)
    dispatch.plt.store(idx_ref.at[slot], idx, mask=take)

  out = (jax.ShapeDtypeStruct((k,), flat.dtype), jax.ShapeDtypeStruct((k,), _I32))
  return dispatch.call(kernel, out, -(-n // block), interpret, "select_top_k_compact")(
      flat, threshold.reshape(1), offsets, ties)


def _block_counts(hits, block: int):
  """``[programs]`` int32: how many of each program's ``block`` entries of ``hits`` are true.

  In XLA, one read fused with whatever computes ``hits`` (the counts are the offsets of
  the compaction kernel's programs)."""
  n = hits.shape[0]
  programs = -(-n // block)
  padded = jnp.pad(hits, (0, programs * block - n)).reshape(programs, block)
  return jnp.sum(padded, axis=1, dtype=_I32)


def _mask_passes(mask, capacity: int, block: int, interpret: bool):
  """``[capacity]`` int32: the indices of the first ``capacity`` true entries of the uint8
  ``mask``, in order; slots past the count hold ``mask.size``. One pass counts each
  program's true entries (:func:`_block_counts`), the kernel writes each one's index to
  its slot."""
  n = mask.shape[0]
  programs = -(-n // block)
  counts = _block_counts(mask != 0, block)
  offsets = _exclusive_cumsum(counts).astype(_I32)

  def compact_kernel(m_ref, off_ref, idx_ref):
    pid = pl.program_id(0)
    idx = dispatch.lanes(block, pid * block)
    valid = idx < n
    take = valid & (dispatch.chunk(m_ref, pid * block, block, valid) != 0)
    slot = off_ref[pid] + jnp.cumsum(take.astype(_I32)) - 1
    take = take & (slot < capacity)
    dispatch.plt.store(idx_ref.at[jnp.where(take, slot, capacity)], idx, mask=take)

  indices = dispatch.call(compact_kernel, jax.ShapeDtypeStruct((capacity,), _I32), programs,
                          interpret, "first_true_compact")(mask, offsets)
  return jnp.where(jnp.arange(capacity, dtype=_I32) < jnp.sum(counts), indices, n)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def first_true(mask, capacity: int, block: int, interpret: bool):
  """The indices of the first ``capacity`` true entries of the 1-D ``mask``, ascending;
  slots past the count hold ``mask.size`` (as ``commopt._src.base.first_true``)."""
  return _mask_passes(mask.astype(jnp.uint8), capacity, block, interpret)


def sampled_capacity(n: int, k: int) -> int:
  """The most candidates the sampled select ranks among themselves: a power of two at
  least twice the expected count of keys at or above the sample's lower bound."""
  high_rank = histogram.sample_rank_bounds(n, k)[1]
  expected = max(high_rank, 1) * n / histogram.SAMPLE
  return 1 << math.ceil(math.log2(2 * expected + 1024))


def suits_sampled(n: int, k: int) -> bool:
  """Whether :func:`select_top_k_sampled` applies: a leaf large enough to sample whose
  candidates are fewer than its coordinates."""
  return n >= histogram.SAMPLE_FROM and sampled_capacity(n, k) < n


def _candidates_finish(values, indices, count, k: int):
  """The ``k`` largest keys among the first ``count`` candidates (in index order), kept in
  index order: the k-th key and its ties by two histograms, then one compaction."""
  size = values.shape[0]
  valid = jnp.arange(size, dtype=_I32) < count
  key = reference.magnitude_key(values)
  threshold, ties = histogram.kth_key(key, jnp.asarray(k, _I32), valid)
  tie = valid & (key == threshold)
  taken = valid & ((key > threshold) | (tie & (jnp.cumsum(tie.astype(_I32)) <= ties)))
  slot = jnp.where(taken, jnp.cumsum(taken.astype(_I32)) - 1, k)
  out_values = jnp.zeros((k,), values.dtype).at[slot].set(values, mode="drop")
  out_indices = jnp.zeros((k,), _I32).at[slot].set(indices, mode="drop")
  return out_values, out_indices


def sampled_bound(flat, k: int, block: int):
  """``(L, counts, total, bracketed)``: the sample's lower bound ``L`` of the k-th key, the
  per-program counts of keys ``>= L`` and their total, and whether the candidates hold the
  k largest keys and fit :func:`sampled_capacity`."""
  n = flat.shape[0]
  key = reference.magnitude_key(flat)
  sample = histogram.sample_keys(key, n)
  rank = min(histogram.sample_rank_bounds(n, k)[1], histogram.SAMPLE)
  if rank < 1:
    low = jnp.asarray(1 << 31, _U32)
  else:    # the rank-th largest sample key (sign-cleared keys order as float32 bit patterns)
    kth = lax.top_k(lax.bitcast_convert_type(sample, jnp.float32), rank)[0][rank - 1]
    low = lax.bitcast_convert_type(kth, _U32)
  counts = _block_counts(key >= low, block)
  total = jnp.sum(counts)
  bracketed = (total >= k) & (total <= sampled_capacity(n, k)) & (low > 0)
  return low, counts, total, bracketed


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def select_top_k_sampled(flat, k: int, radix_bits: int, block: int, interpret: bool):
  """``(values, indices)`` of the ``k`` largest keys of ``flat`` (indices ascending) in
  two reads of ``flat``: a sample's key of rank :func:`histogram.sample_rank_bounds`'s
  upper bound is a lower bound ``L`` of the k-th key; one pass counts each program's keys
  ``>= L``, a second writes them, in index order, to :func:`sampled_capacity` slots; the
  k-th key and its ties are found among those candidates. When the counts refute the
  bound (fewer than ``k`` keys ``>= L``, or more than the slots), the radix select runs
  instead (:func:`select_top_k`). Same result as the reference either way."""
  capacity = sampled_capacity(flat.shape[0], k)
  low, counts, total, bracketed = sampled_bound(flat, k, block)
  offsets = _exclusive_cumsum(counts).astype(_I32)

  def from_candidates():
    # keys > low - 1, i.e. >= low (low > 0 here); no ties taken at the threshold
    values, indices = _compact_pass(flat, low - np.uint32(1), offsets,
                                    jnp.zeros_like(counts), capacity, block, interpret)
    return _candidates_finish(values, indices, total, k)

  return lax.cond(bracketed, from_candidates,
                  lambda: select_top_k(flat, k, radix_bits, block, interpret))


def _exclusive_cumsum(v):
  return jnp.cumsum(v) - v


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def select_top_k(flat, k: int, radix_bits: int, block: int, interpret: bool):
  """``(values, indices)`` of the ``k`` largest keys of ``flat``, indices ascending."""
  prefix = jnp.zeros((), _U32)
  need = jnp.asarray(k, _I32)                 # how many of the matching keys to take
  above = None                                # per program: keys known to exceed T
  for low, width in _digits(radix_bits):
    hist = _histogram_pass(flat, prefix, low, width, radix_bits, block, interpret)
    total = jnp.sum(hist, axis=0)
    at_least = jnp.cumsum(total[::-1])[::-1]  # keys with this digit or a larger one
    digit = jnp.sum(at_least >= need).astype(_I32) - 1
    larger = jnp.arange(hist.shape[1]) > digit
    more = jnp.sum(jnp.where(larger, hist, 0), axis=1)
    above = more if above is None else above + more
    need = need - (at_least[digit] - total[digit])
    prefix = (prefix << width) | digit.astype(_U32)
  ties = hist[:, digit]
  ties_taken = jnp.clip(need - _exclusive_cumsum(ties), 0, ties)
  offsets = _exclusive_cumsum(above + ties_taken)
  return _compact_pass(flat, prefix, offsets.astype(_I32), ties_taken.astype(_I32), k, block,
                       interpret)
