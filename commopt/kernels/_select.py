"""Magnitude top-k by a radix select over the float bit pattern, then compaction.

Ordering rule (both implementations): coordinates are ranked by the key
``bits(float32(x)) & 0x7FFFFFFF``, the bit pattern of ``|x|``, which orders
every finite magnitude and ``inf`` as the floats do, ranks every NaN above
``inf`` (NaNs among themselves by payload), and makes ``-0.0`` tie with
``0.0``. Ties are broken by index: the lower index wins. The ``k`` selected
coordinates are returned in ascending index order.

The Pallas path never sorts. Pass ``p`` of the select reads the input once and
builds, per program, a histogram of one ``radix_bits``-wide digit of the key
over the coordinates whose higher digits equal the prefix found so far; the
per-program histograms are added up to pick the digit that holds the k-th key
and the count above it. After ``⌈31/radix_bits⌉`` passes the k-th key ``T``
is known, and so is how many coordinates above ``T`` each program holds; a
last pass writes every coordinate with key ``> T`` and the first (by index)
coordinates with key ``== T`` to their slots, found by prefix sums.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from commopt.kernels import _dispatch as dispatch

_U32 = jnp.uint32
_I32 = jnp.int32
KEY_BITS = 31
BLOCK = 1024
"""Default coordinates per Pallas program."""
RADIX_BITS = 4
"""Default digit width of the radix select (16-bin histograms)."""


def magnitude_key(x: jax.Array) -> jax.Array:
  """The uint32 sort key of ``|x|``: its float32 bit pattern with the sign bit cleared.

  Args:
    x: a floating-point array.

  Returns:
    A uint32 array of the same shape; larger key means larger magnitude,
    NaN above ``inf``.

  Example:
    >>> import jax.numpy as jnp
    >>> from commopt.kernels import magnitude_key
    >>> [hex(v) for v in magnitude_key(jnp.array([-1.0, jnp.inf, jnp.nan])).tolist()]
    ['0x3f800000', '0x7f800000', '0x7fc00000']
  """
  bits = lax.bitcast_convert_type(x.astype(jnp.float32), _U32)
  return bits & np.uint32(0x7FFFFFFF)


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
    key = magnitude_key(dispatch.chunk(x_ref, pid * block, block, valid))
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
    key = magnitude_key(values)
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
def _radix_select(flat, k: int, radix_bits: int, block: int, interpret: bool):
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


def select_top_k(x: jax.Array, k: int, *, implementation: str = "auto",
                 interpret: bool = False, block: int = BLOCK,
                 radix_bits: int = RADIX_BITS):
  """The ``k`` coordinates of largest magnitude, as values and indices in index order.

  Ranking: by :func:`magnitude_key` (``|x|``; NaN counts as the largest
  magnitude, above ``inf``), ties to the lower index. The reference
  (``"xla"``) is ``lax.top_k`` on the key followed by a sort of the ``k``
  indices; the Pallas kernel is a radix select (see the module docstring)
  and returns the same coordinates in the same order.

  Args:
    x: a floating-point array; it is flattened.
    k: how many coordinates, in ``[1, x.size]``.
    implementation: ``"auto"``, ``"xla"`` or ``"pallas"``.
    interpret: run the Pallas kernel through the Pallas interpreter.
    block: coordinates per Pallas program, a power of two >= 32.
    radix_bits: digit width of the select, 1 to 8 (``⌈31/radix_bits⌉``
      histogram passes of ``2**radix_bits`` bins).

  Returns:
    ``(values, indices)``: ``[k]`` in ``x``'s dtype and ``[k]`` int32 flat
    indices, ascending.

  Example:
    >>> import jax.numpy as jnp
    >>> from commopt.kernels import select_top_k
    >>> x = jnp.array([0.1, -3.0, 2.0, 0.5, -2.0])
    >>> values, indices = select_top_k(x, 3)
    >>> values.tolist(), indices.tolist()
    ([-3.0, 2.0, -2.0], [1, 2, 4])
    >>> select_top_k(x, 3, implementation="pallas", interpret=True)[1].tolist()
    [1, 2, 4]
  """
  if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(
        f"select_top_k: `x` must be a floating-point array, got "
        f"{getattr(x, 'dtype', type(x).__name__)}.")
  flat = jnp.reshape(x, (-1,))
  n = flat.shape[0]
  if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
    raise ValueError(f"select_top_k: `k` must be an integer in [1, {n}] (x.size), got {k!r}.")
  if n >= 2**31:
    raise ValueError(f"select_top_k: `x` must have fewer than 2**31 elements, got {n}.")
  block = dispatch.check_block(block, "select_top_k")
  if isinstance(radix_bits, bool) or not isinstance(radix_bits, int) or not 1 <= radix_bits <= 8:
    raise ValueError(
        f"select_top_k: `radix_bits` must be an integer in [1, 8], got {radix_bits!r}.")
  if not dispatch.use_pallas(implementation, interpret, "select_top_k"):
    indices = jnp.sort(lax.top_k(magnitude_key(flat).astype(_I32), k)[1])
    return flat[indices], indices
  return _radix_select(flat, k, radix_bits, block, interpret)
