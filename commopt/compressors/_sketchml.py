"""SketchML: top-k keys in delta-binary code, values as quantile-bucket indices.

Each leaf sends its ``k`` largest-magnitude coordinates (the top-k selection
of :func:`~commopt.top_k`), in three parts:

- **keys**, the ``k`` indices, ascending, as deltas ``δ_0 = i_0`` and
  ``δ_j = i_j − i_{j−1}``, each in 1, 2, 3 or 4 little-endian bytes with a
  2-bit length flag (:func:`delta_encode`). The byte stream has a static
  capacity (:func:`key_bytes_bound`) so that it compiles.
- **values**, quantised to equal-count quantile buckets of their
  magnitudes, one set of buckets for the positive values and one for the
  negative (:func:`quantile_buckets`): each value becomes a sign bit and the
  index of its bucket, and the buckets' splits (their smallest magnitudes)
  are sent as float32.
- the bucket indices one per key, or in a **MinMaxSketch**
  (:func:`minmax_sketch`, the paper's scheme: ``rows × cols`` cells, each
  the minimum of the indices hashed to it, read back as the maximum over rows).

A value decodes to its sign times the split of its (decoded) bucket: never
larger in magnitude than the value itself, and never of the other sign.

Static sizes: ``k`` keys of a leaf of ``d`` coordinates take at most
:func:`key_bytes_bound` bytes. The deltas add up to ``i_{k−1} ≤ d − 1``, and a
delta of ``m + 1`` bytes is at least ``2^{8m}``, so at most
``⌊(d − 1)/2^{8m}⌋`` deltas (and at most ``k``) need more than ``m`` bytes::

  bytes ≤ k + Σ_{m=1..3} min(k, ⌊(d − 1)/2^{8m}⌋)
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from commopt import kernels
from commopt._src import base
from commopt._src import bits as bitops
from commopt.compressors._registry import register
from commopt.compressors._sketch import sketch_hashes
from commopt.compressors._sparse import (
    _budget,
    _budget_name,
    _magnitude_selector,
    _scatter,
    _scatter_add,
)

_U32 = jnp.uint32
_F32 = jnp.float32
_FLAG_BITS = 2
"""A delta's length flag: its bytes less one."""
_MAX_BUCKETS = 2**16
_MAX_SIZE = 2**31 - 1
"""Keys are int32 flat indices."""


def key_bytes_bound(k: int, size: int) -> int:
  """The most bytes :func:`delta_encode` writes for ``k`` ascending keys of ``[0, size)``.

  ``k`` one-byte slots, plus one byte for each delta that needs more than
  ``m`` bytes, ``m = 1, 2, 3``: each such delta is at least ``2^{8m}`` and
  the deltas sum to at most ``size − 1``.

  Examples:
    >>> from commopt.compressors._sketchml import key_bytes_bound
    >>> key_bytes_bound(31, 3072)          # 31 + ⌊3071/256⌋
    42
  """
  return k + sum(min(k, (size - 1) >> (8 * m)) for m in (1, 2, 3))


def delta_encode(keys: jax.Array, size: int):
  """Delta-binary code of ``k`` ascending keys in ``[0, size)``.

  Args:
    keys: ``[k]`` integer keys, strictly ascending.
    size: the key range (the leaf size).

  Returns:
    ``(flags, words)``: uint32 ``[k]`` length flags (bytes less one) and the
    byte stream, :func:`key_bytes_bound` bytes (zeros past the last delta),
    packed four to a uint32 word.
  """
  k = keys.shape[0]
  capacity = key_bytes_bound(k, size)
  u = keys.astype(_U32)
  deltas = u - jnp.concatenate([jnp.zeros((1,), _U32), u[:-1]])
  length = 1 + sum((deltas >= _U32(1 << (8 * m))).astype(_U32) for m in (1, 2, 3))
  start = jnp.cumsum(length, dtype=_U32) - length
  t = jnp.arange(4, dtype=_U32)
  pos = jnp.where(t[None, :] < length[:, None], start[:, None] + t, _U32(capacity))
  byte = (deltas[:, None] >> (8 * t)) & _U32(0xFF)
  stream = jnp.zeros((capacity,), _U32).at[pos.reshape(-1)].set(byte.reshape(-1), mode="drop")
  return length - 1, kernels.pack_bits(stream, 8)


def delta_decode(flags: jax.Array, words: jax.Array, size: int) -> jax.Array:
  """Inverse of :func:`delta_encode`: the ``k`` keys (int32, ascending)."""
  k = flags.shape[0]
  stream = kernels.unpack_bits(words, 8, key_bytes_bound(k, size))
  length = flags.astype(_U32) + 1
  start = jnp.cumsum(length, dtype=_U32) - length
  t = jnp.arange(4, dtype=_U32)
  byte = stream.at[start[:, None] + t].get(mode="fill", fill_value=0)
  byte = jnp.where(t[None, :] < length[:, None], byte, _U32(0))
  deltas = jnp.sum(byte << (8 * t), axis=1, dtype=_U32)   # disjoint bytes: the sum is an or
  return jnp.cumsum(deltas, dtype=_U32).astype(jnp.int32)


def _groups(n_neg: jax.Array, k: int, per_sign: int):
  """``(counts, offsets, run, used)`` of the positive and the negative group, int32 ``[2]`` each.

  ``counts`` values per group, ``offsets`` where each starts in magnitude
  order, ``run`` values per bucket, ``used`` non-empty buckets (their splits
  are sent, the positive group's first).
  """
  counts = jnp.stack([k - n_neg, n_neg]).astype(jnp.int32)
  offsets = jnp.stack([jnp.int32(0), counts[0]])
  run = jnp.maximum((counts + per_sign - 1) // per_sign, 1)
  used = (counts + run - 1) // run
  return counts, offsets, run, used


def split_slots(k: int, per_sign: int) -> int:
  """How many splits :func:`quantile_buckets` sends: one per non-empty bucket, at most."""
  return min(k, 2 * per_sign)


def quantile_buckets(values: jax.Array, per_sign: int):
  """Equal-count quantile buckets of the magnitudes, per sign.

  The positive values (``+0.0`` and ``-0.0`` among them) and the negative
  ones are bucketed apart: a group of ``n`` values, sorted by magnitude, is
  cut into runs of ``s = ⌈n/per_sign⌉`` (the last may be shorter), so the
  value of rank ``r`` falls in bucket ``⌊r/s⌋`` of its group. A bucket's
  split is its smallest magnitude. The splits of the non-empty buckets are
  sent, the positive group's then the negative group's (at most
  :func:`split_slots` of them; the rest of the slots are zero): value ``i``
  decodes to ``±splits[slot(negative_i, codes_i)]`` (:func:`split_index`).

  Args:
    values: ``[k]`` float32 values.
    per_sign: buckets per sign.

  Returns:
    ``(codes, splits)``: uint32 ``[k]`` bucket indices in ``[0, per_sign)``
    and float32 ``[split_slots(k, per_sign)]`` splits.
  """
  k = values.shape[0]
  negative = values < 0
  magnitude = jnp.abs(values)
  order = jnp.lexsort((magnitude, negative))
  counts, offsets, run, used = _groups(jnp.sum(negative, dtype=jnp.int32), k, per_sign)
  position = jnp.arange(k, dtype=jnp.int32)
  group = (position >= offsets[1]).astype(jnp.int32)
  bucket = (position - offsets[group]) // run[group]
  codes = jnp.zeros((k,), _U32).at[order].set(bucket.astype(_U32))
  # The first value of each non-empty bucket, in magnitude order, goes to its slot.
  first = (position - offsets[group]) % run[group] == 0
  slot = jnp.where(first, group * used[0] + bucket, k)
  splits = jnp.zeros((split_slots(k, per_sign),), _F32)
  return codes, splits.at[slot].set(magnitude[order], mode="drop")


def split_index(negative: jax.Array, codes: jax.Array, per_sign: int) -> jax.Array:
  """The split slot of each value (:func:`quantile_buckets`) from its sign bit and bucket index."""
  k = negative.shape[0]
  _, _, _, used = _groups(jnp.sum(negative, dtype=jnp.int32), k, per_sign)
  return negative.astype(jnp.int32) * used[0] + codes.astype(jnp.int32)


def _slots(keys: jax.Array, seeds: jax.Array, cols: int) -> jax.Array:
  """Each key's cell in every row of the flat ``rows·cols`` table: int32 ``[rows, k]``."""
  buckets, _ = sketch_hashes(seeds, keys, cols)
  return buckets + cols * jnp.arange(seeds.shape[0], dtype=jnp.int32)[:, None]


def minmax_sketch(keys: jax.Array, codes: jax.Array, seeds: jax.Array, cols: int,
                  empty: int) -> jax.Array:
  """The MinMaxSketch of ``key → code``: uint32 ``[rows·cols]``, each cell the least code in it.

  Args:
    keys: ``[k]`` keys.
    codes: ``[k]`` codes, at most ``empty``.
    seeds: uint32 ``[rows, 2]`` hash seeds (for
      :func:`commopt.compressors._sketch.sketch_hashes`).
    cols: cells per row.
    empty: the value of a cell no key hashes to (the largest code).
  """
  slots = _slots(keys, seeds, cols)
  table = jnp.full((seeds.shape[0] * cols,), empty, _U32)
  return table.at[slots.reshape(-1)].min(jnp.broadcast_to(codes, slots.shape).reshape(-1))


def minmax_query(table: jax.Array, keys: jax.Array, seeds: jax.Array, cols: int) -> jax.Array:
  """Each key's code read from :func:`minmax_sketch`: the largest of its cells over the rows.

  Every cell a key hashes to holds at most its code, so the answer is never
  above it, and equals it when one row holds no smaller code.
  """
  return jnp.max(table[_slots(keys, seeds, cols)], axis=0)


def _hash_seeds(rows: int, seed: int) -> np.ndarray:
  """Fixed MinMaxSketch hash seeds, uint32 ``[rows, 2]``: the same for every step and worker."""
  words = np.random.default_rng(seed).integers(0, 2**32, (rows, 2), dtype=np.uint64)
  return words.astype(np.uint32)


_SELECT = _magnitude_selector(False, "exact", 0.01, 0.95)
"""The top-k selection of :func:`~commopt.top_k`'s defaults: the ``k`` largest magnitudes."""


class _Options(NamedTuple):
  """:func:`sketchml`'s options, checked (:func:`_options`)."""
  leaf_k: Callable[[tuple[int, ...]], int]
  buckets: int
  sketch_ratio: Optional[float]
  rows: int
  seed: int
  seeds: np.ndarray       # the MinMaxSketch's hash seeds, from rows and seed (_hash_seeds)


def _options(ratio, k, buckets, sketch_ratio, rows, seed) -> _Options:
  """:func:`sketchml`'s arguments, each checked (its errors name ``sketchml``)."""
  fn = "sketchml"
  leaf_k = _budget(fn, ratio, k)
  buckets = base.check_integer(
      "buckets", buckets, fn=fn,
      rule=f"an even integer in [2, {_MAX_BUCKETS}] (half for each sign)",
      ok=lambda b: 2 <= b <= _MAX_BUCKETS and b % 2 == 0)
  if sketch_ratio is not None:
    sketch_ratio = base.check_number("sketch_ratio", sketch_ratio, fn=fn, low=0.0,
                                     what="None or a positive number")
  rows = base.check_positive_int("rows", rows, fn=fn)
  seed = base.check_int("seed", seed, fn=fn, minimum=0)
  return _Options(leaf_k, buckets, sketch_ratio, rows, seed, _hash_seeds(rows, seed))


def _name(ratio, k, opts: _Options) -> str:
  """``sketchml(ratio=…)`` or ``sketchml(k=…)``, then the options that are not the defaults."""
  options = {}
  if opts.buckets != 256:
    options["buckets"] = opts.buckets
  if opts.sketch_ratio is not None:
    options.update(sketch_ratio=opts.sketch_ratio, rows=opts.rows, seed=opts.seed)
  return _budget_name("sketchml", ratio, k, **options)


def _layout(opts: _Options, shape):
  """``(k, buckets per sign, index bits, cells per row or None)`` of a leaf."""
  size = base.leaf_size(shape)
  if size > _MAX_SIZE:
    raise ValueError(f"sketchml: a leaf of {size} elements is too large for int32 keys (at "
                     f"most {_MAX_SIZE}); split it.")
  n = opts.leaf_k(shape)
  q = min(opts.buckets // 2, n)
  cols = (None if opts.sketch_ratio is None
          else max(1, math.ceil(round(opts.sketch_ratio * n, 6) / opts.rows)))
  return n, q, bitops.code_bits(q), cols


def _field_bits(b, cols) -> int:
  """Bits of a key's field: its length flag, its sign and (without the sketch) its index."""
  return _FLAG_BITS + 1 + (b if cols is None else 0)


def _encode_flat(opts: _Options, flat, shape, choice):
  """The payload of a leaf of ``shape``, flattened to ``flat``.

  ``choice`` (:func:`commopt.kernels.current`) only keys the trace.
  """
  del choice
  n, q, b, cols = _layout(opts, shape)
  keys = _SELECT(flat, n, None).astype(jnp.int32)
  values = flat[keys].astype(_F32)
  codes, splits = quantile_buckets(values, q)
  flags, words = delta_encode(keys, flat.shape[0])
  field = flags | ((values < 0).astype(_U32) << _FLAG_BITS)
  payload = {"keys": words, "splits": splits}
  if cols is None:
    field = field | (codes << (_FLAG_BITS + 1))
  else:
    table = minmax_sketch(keys, codes, jnp.asarray(opts.seeds), cols, q - 1)
    payload["sketch"] = kernels.pack_bits(table, b)
  payload["fields"] = kernels.pack_bits(field, _field_bits(b, cols))
  return payload


def _pairs(opts: _Options, payload, shape, choice):
  """``(keys, values)`` of a payload for a leaf of ``shape`` (``choice``: as for
  :func:`_encode_flat`)."""
  del choice
  n, q, b, cols = _layout(opts, shape)
  field = kernels.unpack_bits(payload["fields"], _field_bits(b, cols), n)
  keys = delta_decode(field & _U32(3), payload["keys"], base.leaf_size(shape))
  negative = (field >> _FLAG_BITS) & _U32(1)
  if cols is None:
    codes = field >> (_FLAG_BITS + 1)
  else:
    table = kernels.unpack_bits(payload["sketch"], b, opts.rows * cols)
    codes = minmax_query(table, keys, jnp.asarray(opts.seeds), cols)
  magnitude = payload["splits"][split_index(negative, codes, q)]
  return keys, jnp.where(negative == 1, -magnitude, magnitude)


def _payload_bits(opts: _Options, shape, dtype) -> int:
  """Keys, fields, the sketch (if any), each packed into uint32 words, and the splits."""
  del dtype
  n, q, b, cols = _layout(opts, shape)
  words = bitops.packed_words(key_bytes_bound(n, base.leaf_size(shape)), 8)
  words += bitops.packed_words(n, _field_bits(b, cols))
  if cols is not None:
    words += bitops.packed_words(opts.rows * cols, b)
  return 32 * words + 32 * split_slots(n, q)


def sketchml(ratio: Optional[float] = None, *, k: Optional[int] = None, buckets: int = 256,
             sketch_ratio: Optional[float] = None, rows: int = 2,
             seed: int = 0) -> base.Compressor:
  """SketchML: the top-k coordinates with delta-binary keys and quantile-bucket values.

  Exactly one of ``ratio`` and ``k`` is given (as for :func:`~commopt.top_k`):
  each leaf of ``d`` coordinates sends its ``k`` (``⌈ratio·d⌉``) coordinates
  of largest magnitude, encoded as in the module docstring of
  :mod:`commopt.compressors._sketchml`:

  - keys: delta-binary, at most ``key_bytes_bound(k, d) = k + Σ_m min(k,
    ⌊(d−1)/2^{8m}⌋)`` bytes (about ``1 + 1/(256·k/d)`` bytes a key), plus a
    2-bit length flag each;
  - values: a sign bit each, and the index of its equal-count quantile
    bucket of magnitudes among the values of its sign, ``q =
    min(buckets/2, k)`` buckets per sign, ``b = ⌈log2 q⌉`` bits; the
    splits of the non-empty buckets (each one's smallest magnitude, at most
    ``min(k, 2q)``) as float32;
  - the indices one per key (``sketch_ratio=None``, the default), or in a
    MinMaxSketch of ``rows × ⌈sketch_ratio·k/rows⌉`` cells of ``b`` bits
    with fixed hashes (``seed``), each cell the least index hashed to it,
    read back as the largest of a key's cells over the rows.

  The paper keeps the signs apart with a key list and a sketch per sign;
  here each key carries a sign bit and one sketch holds both groups'
  indices (a collision across the signs, too, can only lower an index).

  Every field is bit-packed into uint32 words; with ``B =
  key_bytes_bound(k, d)`` and ``S = min(k, 2q)`` split slots, the payload is::

    32·⌈B/4⌉ + 32·⌈k·(3 + b)/32⌉ + 32·S                      indices per key
    32·⌈B/4⌉ + 32·⌈3k/32⌉ + 32·⌈rows·cols·b/32⌉ + 32·S       with the sketch

  bits, against ``k·(value bits + 32)`` for :func:`~commopt.top_k`. With
  ``k/d = 1%`` and ``buckets=256`` that is about ``1 + 100/256`` bytes of key,
  3 bits of flag and sign and 7 of index, and ``1024/k`` bytes of splits:
  ``2.64 + 1024/k`` bytes per coordinate sent, where top-k sends 8 (f32).

  A value decodes to its sign times its bucket's split: its error is at most
  the width of its bucket (its largest magnitude less its smallest), its
  magnitude never grows and its sign never flips. A sketch's collisions can
  only lower an index (the paper's MinMaxSketch property: no magnitude is
  over-estimated), but a key whose cells all hold smaller indices loses
  its own. Since the keys are sent anyway, a sketch of fewer than ``k``
  cells cannot keep every index and one of more costs more than the indices
  themselves: at ``d = 10^5``, ``k/d = 1%``, the selected values' relative
  error is 0.11 at 3.2 bytes per coordinate with ``sketch_ratio=0.5`` (2
  rows), and 0.046 at 2.2 bytes with indices per key and ``buckets=16``.
  So indices per key are the default, and the sketch is an option.
  Non-linear: :func:`~commopt.compressed_mean` gathers the payloads, and
  with error feedback the residual keeps the unsent coordinates and the
  quantisation error.

  Args:
    ratio: fraction of each leaf to send, in (0, 1].
    k: number of coordinates to send per leaf, in [1, leaf size].
    buckets: quantile buckets, half for each sign: an even integer in
      ``[2, 65536]``.
    sketch_ratio: MinMaxSketch cells as a fraction of ``k`` (a positive
      number), or ``None`` to send each key's bucket index.
    rows: MinMaxSketch hash rows, >= 1 (with ``sketch_ratio``).
    seed: the seed of the MinMaxSketch's hashes, fixed for every step and
      worker (with ``sketch_ratio``).

  Returns:
    A non-linear, stateless :class:`~commopt.Compressor`.

  Examples:
    >>> import jax.numpy as jnp, commopt
    >>> c = commopt.compressors.sketchml(k=3)
    >>> x = jnp.array([0.1, -3.0, 2.0, 0.0, 0.5, -0.2])
    >>> payload, _ = c.encode(x, c.init(x), None)
    >>> c.decode(payload, None, x).tolist()
    [0.0, -3.0, 2.0, 0.0, 0.5, 0.0]
    >>> c.payload_bits(x.shape, x.dtype)   # a word of keys, one of flags, signs, indices; 3 splits
    160

  References:
    Jiang et al., SketchML: Accelerating Distributed Machine Learning with
    Data Sketches, SIGMOD 2018.
  """
  opts = _options(ratio, k, buckets, sketch_ratio, rows, seed)
  # Encoding and decoding are traced once per leaf layout (and kernel choice,
  # which they read when traced): called outside jit, as under vmap, they run
  # as one program rather than op by op.
  encode_flat = jax.jit(functools.partial(_encode_flat, opts), static_argnums=(1, 2))
  pairs = jax.jit(functools.partial(_pairs, opts), static_argnums=(1, 2))

  def encode(x, state, key):
    del key
    _layout(opts, x.shape)   # argument errors surface here, not inside the jitted trace
    return encode_flat(x.reshape(-1), tuple(x.shape), kernels.current()), state

  def decode(payload, state, like):
    del state
    return _scatter(*pairs(payload, tuple(like.shape), kernels.current()), like)

  def accumulate(acc, payload, state, like):
    del state
    return _scatter_add(acc, *pairs(payload, tuple(like.shape), kernels.current()), like)

  return base.Compressor(name=_name(ratio, k, opts), init=base.stateless_init,
                         encode=encode, decode=decode,
                         payload_bits=functools.partial(_payload_bits, opts),
                         accumulate=accumulate)


register("sketchml", sketchml, {"ratio": 0.01}, exclusive=("ratio", "k"),
         variants=({"k": 5, "buckets": 4, "sketch_ratio": 2.0, "rows": 3},))
