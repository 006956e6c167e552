"""Count sketches: the linear sketch itself and SketchSGD's heavy hitters.

A count sketch of ``x ∈ Rⁿ`` is a table ``T`` of ``rows × cols`` buckets.
Row ``r`` hashes coordinate ``i`` to a bucket ``h_r(i)`` with a sign
``s_r(i) = ±1`` and adds ``s_r(i)·x_i`` there::

  T[r, b] = Σ_{i : h_r(i) = b} s_r(i) x_i

Row ``r`` estimates ``x_i`` by ``s_r(i)·T[r, h_r(i)]``: unbiased, with
variance ``Σ_{j≠i} x_j² / cols`` from the coordinates sharing the bucket.
The sketch is linear, so the sum of the workers' tables is the table of the
sum of their vectors: tables are all-reduced, whatever the number of workers.

Hashes: word ``fmix32(fmix32(i + a_r) ^ b_r)`` (:func:`commopt._src.rng.fmix32`)
per coordinate and row, ``(a_r, b_r)`` two words per row drawn from a key
(:func:`sketch_seeds`); its low 31 bits modulo ``cols`` give the bucket and
its top bit the sign, so the two are independent. Under
:func:`~commopt.compressed_mean` the key is the step key, the same on every
worker (shared randomness), so every worker hashes alike, and the hashes
change from step to step.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from commopt import kernels
from commopt._src import base, rng
from commopt.compressors._registry import register
from commopt.compressors._sparse import _budget, _scatter


class CountSketchState(NamedTuple):
  """Per-leaf state of :func:`count_sketch` and :func:`sketch_sgd`: the hash seeds of the last step.

  Every worker draws them from the shared step key, so they never cross the
  wire; ``decode`` reads them from here.

  Attributes:
    seeds: uint32 ``[rows, 2]``, two words per row (see :func:`sketch_seeds`).
  """
  seeds: jax.Array


def sketch_seeds(key, rows: int) -> jax.Array:
  """The hash seeds of a sketch with ``rows`` rows: uint32 ``[rows, 2]`` drawn from ``key``."""
  return jax.random.bits(key, (rows, 2), jnp.uint32)


def sketch_hashes(seeds: jax.Array, indices: jax.Array, cols: int):
  """Buckets and signs of coordinates ``indices`` in every row.

  Args:
    seeds: uint32 ``[rows, 2]`` (:func:`sketch_seeds`).
    indices: ``[m]`` non-negative integer coordinates.
    cols: buckets per row.

  Returns:
    ``(buckets, signs)``: int32 ``[rows, m]`` in ``[0, cols)`` and float32
    ``[rows, m]`` of ±1.
  """
  i = indices.astype(jnp.uint32)[None, :]
  words = rng.fmix32(rng.fmix32(i + seeds[:, :1]) ^ seeds[:, 1:])
  buckets = ((words & jnp.uint32(0x7FFFFFFF)) % jnp.uint32(cols)).astype(jnp.int32)
  signs = jnp.where(words >> 31 == 0, jnp.float32(1), jnp.float32(-1))
  return buckets, signs


def sketch(values: jax.Array, seeds: jax.Array, cols: int,
           indices: Optional[jax.Array] = None) -> jax.Array:
  """The count sketch (float32 ``[rows, cols]``) of a vector.

  Args:
    values: ``[m]`` coordinate values (summed in float32).
    seeds: uint32 ``[rows, 2]``.
    cols: buckets per row.
    indices: the coordinates ``values`` hold (default ``0 … m−1``: a dense
      vector); a sparse vector is sketched in O(m) work this way.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from commopt.compressors._sketch import sketch, sketch_seeds
    >>> seeds = sketch_seeds(jax.random.key(0), 3)
    >>> x, y = jnp.arange(10.0), jnp.ones(10)
    >>> bool(jnp.allclose(sketch(x, seeds, 4) + sketch(y, seeds, 4), sketch(x + y, seeds, 4)))
    True
  """
  values = values.astype(jnp.float32)
  if indices is None:
    indices = jnp.arange(values.shape[0], dtype=jnp.uint32)
  rows = seeds.shape[0]
  buckets, signs = sketch_hashes(seeds, indices, cols)
  slots = buckets + cols * jnp.arange(rows, dtype=jnp.int32)[:, None]
  table = jnp.zeros((rows * cols,), jnp.float32).at[slots.reshape(-1)].add(
      (signs * values[None, :]).reshape(-1))
  return table.reshape(rows, cols)


def row_estimates(table: jax.Array, seeds: jax.Array, indices: jax.Array) -> jax.Array:
  """Each row's estimate ``s_r(i)·T[r, h_r(i)]`` of coordinates ``indices``.

  Returns:
    float32 ``[rows, m]``.
  """
  table = table.astype(jnp.float32)
  buckets, signs = sketch_hashes(seeds, indices, table.shape[1])
  return signs * jnp.take_along_axis(table, buckets, axis=1)


_NETWORK_ROWS = 16
"""Up to this many rows the median is taken by a sorting network (elementwise min and max)."""


def median_of_rows(values: jax.Array) -> jax.Array:
  """The median over the leading axis (the mean of the two middle values for an even count).

  Up to :data:`_NETWORK_ROWS` rows it runs an odd-even transposition network
  of elementwise minima and maxima, which XLA fuses into one pass over whole
  rows, where a sort along a short leading axis orders each coordinate's few
  values on its own; more rows go through ``jnp.median``.
  """
  rows = values.shape[0]
  if rows > _NETWORK_ROWS:
    return jnp.median(values, axis=0)
  order = [values[r] for r in range(rows)]
  for phase in range(rows):
    for i in range(phase % 2, rows - 1, 2):
      order[i], order[i + 1] = (jnp.minimum(order[i], order[i + 1]),
                                jnp.maximum(order[i], order[i + 1]))
  if rows % 2:
    return order[rows // 2]
  return (order[rows // 2 - 1] + order[rows // 2]) / 2


def median_estimate(table: jax.Array, seeds: jax.Array, indices: jax.Array) -> jax.Array:
  """The median over rows of :func:`row_estimates` (Charikar et al.'s estimate): float32 ``[m]``.

  Each row is off by more than ``t`` with probability at most
  ``Σ_{j≠i} x_j² / (cols·t²)`` (Chebyshev), and the median only when at least
  half the rows are, so the failure probability falls exponentially in ``rows``.
  """
  return median_of_rows(row_estimates(table, seeds, indices))


def heavy_hitters(table: jax.Array, seeds: jax.Array, n: int, k: int):
  """The ``k`` coordinates of ``[0, n)`` with the largest median estimates in magnitude.

  Returns:
    ``(estimates, indices)``: float32 ``[k]`` and int32 ``[k]``, ascending
    (:func:`commopt.kernels.select_top_k` on the estimates of every coordinate).
  """
  estimates = median_estimate(table, seeds, jnp.arange(n, dtype=jnp.uint32))
  return kernels.select_top_k(estimates, k)


def _check_size(fn: str, rows, cols, ratio):
  """``(rows, cols)`` checked, ``cols`` None when ``ratio`` sizes each leaf's table instead."""
  rows = base.check_positive_int("rows", rows, fn=fn)
  if (cols is None) == (ratio is None):
    raise ValueError(
        f"{fn}: give exactly one of `cols` and `ratio`, got cols={cols!r}, ratio={ratio!r}.")
  if cols is not None:
    cols = base.check_positive_int("cols", cols, fn=fn)
  return rows, cols


def _row_sum(rows_of: jax.Array) -> jax.Array:
  """``rows_of[0] + rows_of[1] + …`` in that order: a fixed order, so a fused sum is bit-exact."""
  out = rows_of[0]
  for r in range(1, rows_of.shape[0]):
    out = out + rows_of[r]
  return out


def count_sketch(rows: int = 5, cols: Optional[int] = None, *, ratio: Optional[float] = None,
                 unbiased: bool = False) -> base.Compressor:
  """A count sketch of each leaf: ``rows × cols`` buckets, all-reduced and decoded densely.

  Exactly one of ``cols`` and ``ratio`` is given: ``cols`` buckets per row
  for every leaf, or ``⌈ratio·n/rows⌉`` for a leaf of ``n`` coordinates (a
  table of about ``ratio`` of the leaf). Each leaf (flattened) is sketched
  with hashes drawn from the shared step key (see the module docstring):
  every worker hashes alike, so the payload, the table in the leaf's dtype
  (``rows·cols`` values), is linear and :func:`~commopt.compressed_mean`
  all-reduces it (``strategy="psum"``); the bytes do not grow with the
  workers. The seeds are kept in :class:`CountSketchState` for ``decode``,
  and change every step.

  Decoding gives a dense estimate of every coordinate, the mean over rows of
  the row estimates, which is linear in the table (a psum of tables decodes to
  the sum of the decoded tables, as ``linear`` promises and error feedback
  needs). Charikar et al.'s median of rows is not linear; it is what picks
  heavy hitters in :func:`sketch_sgd` and :func:`~commopt.transforms.fetch_sgd`. With
  ``m = rows·cols`` and fresh hashes the mean is unbiased with
  ``E‖x̂ − x‖² = ω‖x‖²``, ``ω = (n−1)/m``: more noise than signal once the
  table is smaller than the leaf, which error feedback would accumulate.
  So by default (``unbiased=False``) the estimate is scaled by ``1/(1+ω)``,
  the scale that minimises the expected error, which makes it a contraction
  in expectation, ``E‖x − C(x)‖² = (1 − m/(m+n−1))‖x‖²`` (like unscaled
  random-k with ``k = m``), fit for error feedback. ``unbiased=True`` sends
  the unbiased estimate, for use without error feedback.

  Leaves whose table would not be smaller than the leaf (``rows·cols ≥ n``)
  are sent dense.

  Args:
    rows: hash rows (independent estimates of each coordinate), >= 1.
    cols: buckets per row, >= 1, the same for every leaf.
    ratio: table size as a fraction of each leaf, in (0, 1].
    unbiased: decode to the unbiased mean of rows (else scaled by ``1/(1+ω)``).

  Returns:
    A linear :class:`~commopt.Compressor` with shared randomness and per-leaf
    state (the seeds).

  Examples:
    >>> import jax, jax.numpy as jnp, commopt
    >>> c = commopt.compressors.count_sketch(rows=3, cols=4, unbiased=True)
    >>> x = jnp.zeros(64).at[5].set(10.0)        # one coordinate: every row finds it
    >>> payload, state = c.encode(x, c.init(x), jax.random.key(0))
    >>> payload["table"].shape, float(c.decode(payload, state, x)[5])
    ((3, 4), 10.0)

  References:
    Charikar, Chen and Farach-Colton, Finding Frequent Items in Data Streams,
    ICALP 2002.
  """
  fn = "count_sketch"
  rows, cols = _check_size(fn, rows, cols, ratio)
  if ratio is not None:
    ratio = base.check_ratio("ratio", ratio, fn=fn)
  unbiased = base.check_bool("unbiased", unbiased, fn=fn)

  def width(shape) -> int:
    if cols is not None:
      return cols
    return max(1, math.ceil(round(ratio * base.leaf_size(shape), 6) / rows))

  def accepts(shape, dtype):
    return rows * width(shape) < base.leaf_size(shape)

  def init(leaf):
    del leaf
    return CountSketchState(seeds=jnp.zeros((rows, 2), jnp.uint32))

  def encode(x, state, key):
    seeds = sketch_seeds(base.need_key(key, fn), rows)
    table = sketch(x.reshape(-1), seeds, width(x.shape))
    return {"table": table.astype(x.dtype)}, CountSketchState(seeds=seeds)

  def decode(payload, state, like):
    n = base.leaf_size(like.shape)
    m = rows * width(like.shape)
    scale = 1.0 / rows if unbiased else 1.0 / (rows * (1.0 + (n - 1) / m))
    # The scale goes on the small table; the rows are then added in a fixed order.
    table = payload["table"].astype(jnp.float32) * jnp.float32(scale)
    est = _row_sum(row_estimates(table, state.seeds, jnp.arange(n, dtype=jnp.uint32)))
    return est.reshape(like.shape).astype(like.dtype)

  def payload_bits(shape, dtype):
    return rows * width(shape) * base.dtype_bits(dtype)

  def omega(shape) -> float:
    return (base.leaf_size(shape) - 1) / (rows * width(shape))

  size = f"cols={cols}" if cols is not None else f"ratio={ratio}"
  return base.Compressor(
      name=f"{fn}(rows={rows}, {size}{', unbiased=True' if unbiased else ''})",
      init=init, stateful=True, encode=encode, decode=decode, payload_bits=payload_bits,
      **(dict(error_kind="unbiased", error_bound=omega) if unbiased else
         dict(error_kind="expected_contractive",
              error_bound=lambda shape: 1.0 / (1.0 + omega(shape)))),
      linear=True, shared_randomness=True, accepts=accepts)


def sketch_sgd(ratio: Optional[float] = None, *, k: Optional[int] = None, rows: int = 5,
               cols: Optional[int] = None, second_round: bool = True) -> base.Compressor:
  """SketchSGD: all-reduce count sketches, recover the top-k heavy hitters, fetch their values.

  Exactly one of ``ratio`` and ``k`` is given (as for
  :func:`~commopt.top_k`): each leaf of ``n`` coordinates sends its
  ``k`` (``⌈ratio·n⌉``) heavy hitters. Per leaf, over the workers' inputs
  ``x_w`` (error-compensated by :func:`~commopt.compressed_mean`)::

    round 1:  S = mean_w sketch(x_w)                       all-reduce of [rows, cols]
              I = top-k of |median-of-rows estimate of S|   the same on every worker
    round 2:  v = mean_w x_w[I]                            all-reduce of [k]
    out = v at I, zeros elsewhere

  Hashes come from the shared step key, as in :func:`count_sketch`. With
  ``second_round=True`` (the paper's two-round protocol) the values are
  exact: each worker's own reconstruction is its ``x_w`` at ``I``, so error
  feedback zeroes exactly the coordinates that were applied and keeps the
  rest. With ``second_round=False`` only the table crosses the wire and the
  values are the sketch's median estimates; every worker then counts the
  applied step as its own reconstruction (its residual keeps ``x_w − out``),
  so the residuals still sum to what the step missed: the workers' mean
  residual is FetchSGD's error sketch, kept unsketched. The estimates' error
  (about ``‖x‖/√cols`` per coordinate) then enters the residuals, so one
  round needs ``cols`` well above ``k``: with ``cols = 2k`` error feedback
  diverged on a least-squares problem where two rounds trained.

  Both rounds are all-reduces: a worker sends ``rows·cols (+ k)`` values
  whatever the number of workers, where :func:`~commopt.top_k`'s
  all-gather sends ``(N−1)·k`` values and indices.

  Args:
    ratio: fraction of each leaf sent as heavy hitters, in (0, 1].
    k: heavy hitters per leaf, >= 1.
    rows: hash rows, >= 1 (an odd number gives a proper median).
    cols: buckets per row, the same for every leaf; default ``2k`` for a
      leaf with ``k`` heavy hitters.
    second_round: fetch the exact values of the heavy hitters (a second
      all-reduce of ``k`` values).

  Returns:
    A :class:`~commopt.Compressor` whose ``reduce`` runs the protocol. Leaves
    whose payload would not be smaller than the leaf are sent dense.

  Examples:
    >>> import jax.numpy as jnp, commopt
    >>> tx = commopt.compressed_mean(commopt.compressors.sketch_sgd(k=2, cols=16), min_size=0)
    >>> x = jnp.zeros(200).at[7].set(5.0).at[90].set(-3.0)
    >>> out, _ = tx.update({"w": x}, tx.init({"w": x}))
    >>> jnp.flatnonzero(out["w"]).tolist(), out["w"][90].tolist()
    ([7, 90], -3.0)

  References:
    Ivkin, Rothchild, Ullah, Braverman, Stoica and Arora, Communication-efficient
    Distributed SGD with Sketching, NeurIPS 2019.
    Charikar, Chen and Farach-Colton, Finding Frequent Items in Data Streams,
    ICALP 2002.
  """
  fn = "sketch_sgd"
  rows = base.check_positive_int("rows", rows, fn=fn)
  if cols is not None:
    cols = base.check_positive_int("cols", cols, fn=fn)
  second_round = base.check_bool("second_round", second_round, fn=fn)
  budget = _budget(fn, ratio, k)

  def leaf_k(shape) -> int:
    # A fixed k above the leaf's size makes the leaf go dense (see accepts).
    return min(k, base.leaf_size(shape)) if k is not None else budget(shape)

  def width(shape) -> int:
    return cols if cols is not None else 2 * leaf_k(shape)

  def payload_size(shape) -> int:
    return rows * width(shape) + (leaf_k(shape) if second_round else 0)

  def accepts(shape, dtype):
    n = base.leaf_size(shape)
    return leaf_k(shape) < n and payload_size(shape) < n

  def init(leaf):
    del leaf
    return CountSketchState(seeds=jnp.zeros((rows, 2), jnp.uint32))

  def encode(x, state, key):
    # One worker's protocol as a payload: its table, and its heavy hitters' values.
    seeds = sketch_seeds(base.need_key(key, fn), rows)
    table = sketch(x.reshape(-1), seeds, width(x.shape)).astype(x.dtype)
    payload = {"table": table}
    if second_round:
      _, indices = heavy_hitters(table, seeds, x.size, leaf_k(x.shape))
      payload["values"] = x.reshape(-1)[indices]
    return payload, CountSketchState(seeds=seeds)

  def decode(payload, state, like):
    estimates, indices = heavy_hitters(payload["table"], state.seeds,
                                       base.leaf_size(like.shape), leaf_k(like.shape))
    return _scatter(indices, payload["values"] if second_round else estimates, like)

  def reduce(x, state, key, channel):
    seeds = sketch_seeds(base.need_key(key, fn), rows)
    flat = x.reshape(-1)
    table = channel.mean(sketch(flat, seeds, width(x.shape)).astype(x.dtype))
    estimates, indices = heavy_hitters(table, seeds, flat.shape[0], leaf_k(x.shape))
    if second_round:
      sent = flat[indices]
      mean = _scatter(indices, channel.mean(sent), x)
      local = _scatter(indices, sent, x)
    else:
      mean = local = _scatter(indices, estimates, x)
    return base.Reduced(mean=mean, local=local, state=CountSketchState(seeds=seeds))

  def payload_bits(shape, dtype):
    return payload_size(shape) * base.dtype_bits(dtype)

  budget_name = f"ratio={float(ratio)}" if ratio is not None else f"k={k}"
  extra = "".join([f", rows={rows}" if rows != 5 else "",
                   f", cols={cols}" if cols is not None else "",
                   "" if second_round else ", second_round=False"])
  return base.Compressor(
      name=f"{fn}({budget_name}{extra})", init=init, stateful=True, encode=encode,
      decode=decode, payload_bits=payload_bits, shared_randomness=True, accepts=accepts,
      reduce=reduce, reduce_collective="all-reduce",
      # The k sent are the sketch's heavy hitters, drawn through random hashes: where the
      # input has no heavy hitters (a spread-out residual) they are as good as random,
      # and a residual would wait about n/k steps per coordinate.
      error_kind="expected_contractive",
      error_bound=lambda shape: leaf_k(shape) / base.leaf_size(shape))


register("count_sketch", count_sketch, {"rows": 5, "ratio": 0.1}, exclusive=("cols", "ratio"),
         variants=({"rows": 3, "cols": 64},))
register("sketch_sgd", sketch_sgd, {"ratio": 0.01}, exclusive=("ratio", "k"),
         variants=({"k": 20, "rows": 3, "second_round": False},))
