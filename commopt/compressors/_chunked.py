"""Chunked top-k: the ``k`` largest entries of every tile of a leaf, optionally in a DCT basis.

The family behind DeMo and SparseLoCo. A leaf is read as a matrix (a vector
as one row; a tensor of higher rank as ``prod(shape[:-1])`` rows of its last
dimension) and cut into tiles of ``a × b`` entries, ``a`` and ``b`` at most
``chunk``. Each tile keeps its own ``k`` largest magnitudes, so an index
names a position inside its tile: ``⌈log2(a·b)⌉`` bits instead of a flat
32-bit index, and the budget is spread over the whole leaf. With ``dct=True``
the tile is first taken to its 2-D DCT-II coefficients (an orthonormal
matrix product on each side, as DeMo does); decoding scatters the kept
coefficients into zeros and applies the inverse.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from commopt import kernels
from commopt._src import base
from commopt._src import bits as bitops
from commopt.compressors._registry import register
from commopt.compressors._sparse import _check_value_dtype

TABLE_DTYPE = jnp.bfloat16
"""Wire dtype of the per-tile magnitude table of a quantised payload (``bits``)."""


class Tiling(NamedTuple):
  """How :func:`chunk_top_k` cuts a leaf: a ``rows × cols`` matrix, zero-padded to
  ``padded``, in tiles of ``tile = (a, b)``; ``k`` entries kept per tile."""
  rows: int
  cols: int
  padded: tuple
  tile: tuple
  k: int

  @property
  def tiles(self) -> int:
    return (self.padded[0] // self.tile[0]) * (self.padded[1] // self.tile[1])

  @property
  def tile_size(self) -> int:
    return self.tile[0] * self.tile[1]

  @property
  def index_bits(self) -> int:
    """Bits of one in-tile index; 0 when every entry of a tile is kept (no index is sent)."""
    return 0 if self.k == self.tile_size else bitops.code_bits(self.tile_size)


def tile_side(n: int, chunk: int) -> int:
  """The tile's side along a dimension of ``n``: ``n`` itself up to ``chunk``; above, the
  largest divisor of ``n`` in ``[⌈chunk/2⌉, chunk]`` (no padding, as DeMo's rule keeps
  tiles whole), else ``⌈n/m⌉`` for the fewest tiles ``m = ⌈n/chunk⌉``, the dimension
  zero-padded to ``m`` of them (fewer than ``m`` zeros)."""
  if n <= chunk:
    return max(n, 1)
  for side in range(chunk, -(-chunk // 2) - 1, -1):
    if n % side == 0:
      return side
  return -(-n // -(-n // chunk))


@functools.lru_cache(maxsize=256)
def tiling(shape: tuple, chunk: int, k: int) -> Tiling:
  """The :class:`Tiling` of a leaf of ``shape`` (static; cached per shape)."""
  shape = tuple(int(d) for d in shape)
  rows, cols = (1, base.leaf_size(shape)) if len(shape) <= 1 else (
      base.leaf_size(shape[:-1]), shape[-1])
  a, b = tile_side(rows, chunk), tile_side(cols, chunk)
  padded = (-(-rows // a) * a, -(-cols // b) * b)
  return Tiling(rows=rows, cols=cols, padded=padded, tile=(a, b), k=min(k, a * b))


@functools.lru_cache(maxsize=64)
def dct_matrix(n: int) -> np.ndarray:
  """The orthonormal DCT-II matrix ``D`` of size ``n`` (float32): ``D @ x`` are the
  coefficients of ``x`` and ``D.T`` is the inverse."""
  j = np.arange(n)
  d = np.cos(np.pi * (2 * j[None, :] + 1) * j[:, None] / (2 * n)) * np.sqrt(2.0 / n)
  d[0] /= np.sqrt(2.0)
  return d.astype(np.float32)


def to_tiles(x: jax.Array, t: Tiling, dct: bool) -> jax.Array:
  """``[tiles, a·b]`` float32: the leaf's tiles, row-major, in the DCT basis with ``dct``."""
  m = x.astype(jnp.float32).reshape(t.rows, t.cols)
  m = jnp.pad(m, ((0, t.padded[0] - t.rows), (0, t.padded[1] - t.cols)))
  (a, b), (pr, pc) = t.tile, t.padded
  tiles = m.reshape(pr // a, a, pc // b, b).transpose(0, 2, 1, 3).reshape(-1, a, b)
  if dct:
    tiles = jnp.einsum("ij,njk,lk->nil", dct_matrix(a), tiles, dct_matrix(b),
                       precision=jax.lax.Precision.HIGHEST)
  return tiles.reshape(-1, a * b)


def from_tiles(tiles: jax.Array, t: Tiling, dct: bool, like) -> jax.Array:
  """Inverse of :func:`to_tiles`: a leaf shaped and typed like ``like``."""
  (a, b), (pr, pc) = t.tile, t.padded
  tiles = tiles.reshape(-1, a, b)
  if dct:
    tiles = jnp.einsum("ji,njk,kl->nil", dct_matrix(a), tiles, dct_matrix(b),
                       precision=jax.lax.Precision.HIGHEST)
  m = tiles.reshape(pr // a, pc // b, a, b).transpose(0, 2, 1, 3).reshape(pr, pc)
  return m[:t.rows, :t.cols].reshape(like.shape).astype(like.dtype)


def _select(tiles: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """Each tile's ``k`` largest magnitudes: ``(indices [tiles, k], values [tiles, k])``, the
  indices ascending inside each tile (ties go to the lower index)."""
  _, idx = jax.lax.top_k(jnp.abs(tiles), k)
  idx = jnp.sort(idx, axis=1)
  return idx, jnp.take_along_axis(tiles, idx, axis=1)


def _quantise(values: jax.Array, bits: int) -> tuple[jax.Array, jax.Array]:
  """Sign and magnitude bin of each kept value: ``(codes, table)``.

  A tile's magnitudes ``[lo, hi]`` are cut into ``L = 2^(bits−1)`` equal bins;
  each bin is reconstructed at the mean magnitude of its members (the
  midpoint when empty), which the table carries in bfloat16. Codes are
  ``bin << 1 | negative``.
  """
  levels = 2 ** (bits - 1)
  mag = jnp.abs(values)
  lo, hi = jnp.min(mag, axis=1, keepdims=True), jnp.max(mag, axis=1, keepdims=True)
  width = jnp.where(hi > lo, hi - lo, 1.0)
  bin_ = jnp.clip(jnp.floor((mag - lo) / width * levels), 0, levels - 1).astype(jnp.int32)
  member = bin_[:, :, None] == jnp.arange(levels)[None, None, :]
  count = jnp.sum(member, axis=1)
  total = jnp.sum(jnp.where(member, mag[:, :, None], 0.0), axis=1)
  mid = lo + (jnp.arange(levels)[None, :] + 0.5) * (hi - lo) / levels
  table = jnp.where(count > 0, total / jnp.maximum(count, 1), mid).astype(TABLE_DTYPE)
  codes = (bin_.astype(jnp.uint32) << 1) | (values < 0).astype(jnp.uint32)
  return codes, table


def _dequantise(codes: jax.Array, table: jax.Array) -> jax.Array:
  mag = jnp.take_along_axis(table.astype(jnp.float32), (codes >> 1).astype(jnp.int32), axis=1)
  return jnp.where((codes & 1) == 1, -mag, mag)


def _kept(payload, t: Tiling, bits: Optional[int]) -> tuple[jax.Array, jax.Array]:
  """``(indices, values)`` of a :func:`chunk_top_k` payload, ``[tiles, k]`` each (float32)."""
  n = t.tiles * t.k
  if t.index_bits:
    idx = kernels.unpack_bits(payload["indices"], t.index_bits, n).astype(jnp.int32)
    idx = idx.reshape(t.tiles, t.k)
  else:
    idx = jnp.broadcast_to(jnp.arange(t.k, dtype=jnp.int32), (t.tiles, t.k))
  if bits is None:
    return idx, payload["values"].astype(jnp.float32)
  codes = kernels.unpack_bits(payload["codes"], bits, n).reshape(t.tiles, t.k)
  return idx, _dequantise(codes, payload["table"])


def _scattered(idx: jax.Array, values: jax.Array, t: Tiling) -> jax.Array:
  """``[tiles, a·b]`` float32: ``values`` at ``idx`` in each tile, zeros elsewhere."""
  return jnp.zeros((t.tiles, t.tile_size), jnp.float32).at[
      jnp.arange(t.tiles)[:, None], idx].set(values)


COMBINES = ("mean", "senders")
"""How :func:`chunk_top_k`'s gathered payloads combine (its ``combine``)."""


def chunk_top_k(k: int = 32, *, chunk: int = 64, dct: bool = False, bits: Optional[int] = None,
                value_dtype=None, combine: str = "mean") -> base.Compressor:
  """The ``k`` largest entries of every ``chunk × chunk`` tile, with in-tile indices.

  The leaf is read as a matrix (a vector as one row, a tensor of higher rank
  as rows of its last dimension) and cut into tiles of at most ``chunk``
  entries a side (a side that ``chunk`` does not divide takes its largest
  divisor down to ``chunk/2``, else is zero-padded). Every tile sends its
  ``min(k, tile size)`` largest magnitudes: values, and indices inside the
  tile in ``⌈log2(tile size)⌉`` bits, packed (none when the whole tile is
  sent). A 64 × 64 tile with ``k = 32`` keeps 0.78% of the entries at
  ``32 + 12`` bits each, 93× fewer bits than float32.

  ``dct=True`` selects among the tile's 2-D DCT-II coefficients instead of
  its entries (DeMo's transform: an orthonormal matrix on each side of the
  tile, so the energy sent is the energy kept); decoding applies the inverse.

  ``bits`` (1 to 4) quantises the kept values, as SparseLoCo sends its
  2-bit pseudo-gradients: a sign, and ``bits − 1`` bits naming one of
  ``2^(bits−1)`` equal bins of the tile's range of kept magnitudes, decoded
  as the mean magnitude of that bin's members; the tile sends that table
  in bfloat16 (``2^(bits−1) · 16`` bits).

  ``combine="senders"`` averages each entry (or coefficient) over the
  workers that sent it rather than over all of them, as DeMo's reference
  implementation does: a protocol of its own (``reduce``) that all-gathers
  the same payloads and sums the values and the senders of every entry
  before the inverse transform; ``two_phase`` and ``hierarchical`` refuse it.
  What it applies is then not the mean of what the workers sent, so error
  feedback no longer conserves the sum of the inputs (an entry two workers
  sent counts once, one only one sent counts fully).

  Without ``bits`` it is a contraction, ``‖x − C(x)‖² ≤ (1 − k/(a·b))‖x‖²``
  (the DCT is orthonormal, padding only adds zeros); with ``bits`` it is
  biased. Use it with error feedback.

  Args:
    k: entries (or coefficients) kept per tile, at least 1.
    chunk: the tile's largest side, at least 2 (DeMo: 64).
    dct: select DCT-II coefficients of each tile instead of its entries.
    bits: ``None`` (values in ``value_dtype``) or 1 to 4 (sign and magnitude bins).
    value_dtype: wire dtype of the values without ``bits``: ``None`` (the
      input dtype), ``"float16"``, ``"bfloat16"`` or ``"float32"``.
    combine: ``"mean"`` (over all workers) or ``"senders"`` (each entry over
      the workers that sent it).

  Returns:
    A stateless, non-linear :class:`~commopt.Compressor`.

  Examples:
    >>> import jax.numpy as jnp, commopt
    >>> c = commopt.compressors.chunk_top_k(1, chunk=2)
    >>> x = jnp.array([0.1, -3.0, 2.0, 0.5])            # tiles [0.1, -3.0] and [2.0, 0.5]
    >>> c.decode(c.encode(x, None, None)[0], None, x).tolist()
    [0.0, -3.0, 2.0, 0.0]

  References:
    Peng, Quesnelle and Kingma, DeMo: Decoupled Momentum Optimization, 2024,
    arXiv:2411.19870 (tiles of 64, DCT, top-32 per tile).
    Sarfi et al., Communication Efficient LLM Pre-training with SparseLoCo,
    2025, arXiv:2508.15706 (chunked top-k and 2-bit values).
  """
  fn = "chunk_top_k"
  k = base.check_positive_int("k", k, fn=fn)
  chunk = base.check_integer("chunk", chunk, fn=fn, rule="an integer >= 2", ok=lambda c: c >= 2)
  dct = base.check_bool("dct", dct, fn=fn)
  if bits is not None:
    bits = base.check_integer("bits", bits, fn=fn, rule="None or an integer from 1 to 4",
                              ok=lambda b: 1 <= b <= 4)
  value_dtype = _check_value_dtype(value_dtype, fn)
  base.check_choice("combine", combine, COMBINES, fn)
  if bits is not None and value_dtype is not None:
    raise ValueError(f"{fn}: `value_dtype` ({value_dtype.name}) applies to unquantised values; "
                     f"with bits={bits} the values travel as codes and a bfloat16 table.")

  def encode(x, state, key):
    del key
    t = tiling(tuple(x.shape), chunk, k)
    idx, values = _select(to_tiles(x, t, dct), t.k)
    payload = {}
    if t.index_bits:
      payload["indices"] = kernels.pack_bits(idx.reshape(-1).astype(jnp.uint32), t.index_bits)
    if bits is None:
      payload["values"] = values.astype(value_dtype or x.dtype)
    else:
      codes, table = _quantise(values, bits)
      payload["codes"] = kernels.pack_bits(codes.reshape(-1), bits)
      payload["table"] = table
    return payload, state

  def decode(payload, state, like):
    del state
    t = tiling(tuple(like.shape), chunk, k)
    return from_tiles(_scattered(*_kept(payload, t, bits), t), t, dct, like)

  def reduce(x, state, key, channel):
    """All-gather the payloads; each entry's sum over the sum of its senders."""
    t = tiling(tuple(x.shape), chunk, k)
    payload, state = encode(x, state, key)

    def tiles_and_senders(pl):
      idx, values = _kept(pl, t, bits)
      return {"tiles": _scattered(idx, values, t),
              "senders": _scattered(idx, jnp.ones_like(values), t)}

    mean, local = channel.exchange(payload, tiles_and_senders, linear=False)
    per_sender = jnp.where(mean["senders"] > 0,
                           mean["tiles"] / jnp.maximum(mean["senders"], 1e-30), 0.0)
    return base.Reduced(mean=from_tiles(per_sender, t, dct, x),
                        local=from_tiles(local["tiles"], t, dct, x), state=state)

  def payload_bits(shape, dtype):
    t = tiling(tuple(shape), chunk, k)
    n = t.tiles * t.k
    index = bitops.WORD_BITS * bitops.packed_words(n, t.index_bits) if t.index_bits else 0
    if bits is None:
      return index + n * base.dtype_bits(value_dtype or dtype)
    return (index + bitops.WORD_BITS * bitops.packed_words(n, bits)
            + t.tiles * 2 ** (bits - 1) * base.dtype_bits(TABLE_DTYPE))

  def accepts(shape, dtype):
    del dtype
    return base.leaf_size(shape) > 0

  if bits is None:
    declared = dict(error_kind="contractive",
                    error_bound=lambda shape: tiling(tuple(shape), chunk, k).k
                    / tiling(tuple(shape), chunk, k).tile_size)
  else:
    declared = dict(error_kind="biased")
  options = [f"k={k}", f"chunk={chunk}"]
  if dct:
    options.append("dct=True")
  if bits is not None:
    options.append(f"bits={bits}")
  if value_dtype is not None:
    options.append(f"value_dtype={value_dtype.name!r}")
  if combine != "mean":
    options.append(f"combine={combine!r}")
    declared["reduce"], declared["reduce_collective"] = reduce, "all-gather"
  return base.Compressor(name=f"{fn}({', '.join(options)})", init=base.stateless_init,
                         encode=encode, decode=decode, payload_bits=payload_bits,
                         accepts=accepts, **declared)


register("chunk_top_k", chunk_top_k, {"k": 32, "chunk": 64},
         variants=({"k": 4, "chunk": 8, "dct": True}, {"k": 8, "chunk": 16, "bits": 2}))
