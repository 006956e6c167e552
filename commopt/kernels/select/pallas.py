"""Magnitude top-k by a radix select over the key's bits, then compaction, in Pallas.

The ranking is :mod:`commopt.kernels.select.reference`'s (the key of
:func:`~commopt.kernels.magnitude_key`, ties to the lower index), and so is
the order of the result: ascending indices. The kernel never sorts. Pass ``p``
of the select reads the input once and builds, per program, a histogram of
one ``radix_bits``-wide digit of the key over the coordinates whose higher
digits equal the prefix found so far; the per-program histograms are added
up to pick the digit that holds the k-th key and the count above it. After
``⌈31/radix_bits⌉`` passes the k-th key ``T`` is known, and so is how many
coordinates above ``T`` each program holds; a last pass writes every
coordinate with key ``> T`` and the first (by index) coordinates with key
``== T`` to their slots, found by prefix sums. Arguments are checked by the api.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from commopt.kernels import _dispatch as dispatch
from commopt.kernels.select import reference

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
  """Writes the selected coordinates (key > T, and the first ``ties`` per program at T)."""
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
    slot = jnp.where(take, slot, k)          # masked lanes point past the end
    dispatch.plt.store(val_ref.at[slot], values, mask=take)
    dispatch.plt.store(idx_ref.at[slot], idx, mask=take)

  out = (jax.ShapeDtypeStruct((k,), flat.dtype), jax.ShapeDtypeStruct((k,), _I32))
  return dispatch.call(kernel, out, -(-n // block), interpret, "select_top_k_compact")(
      flat, threshold.reshape(1), offsets, ties)


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
