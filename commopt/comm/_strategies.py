"""Reduction strategies that keep compression at scale: two-phase and hierarchical.

Both work on one flat, error-compensated leaf of ``n`` coordinates and return
``(mean, local, memory)``: the mean over the axis of the reconstructions, this
worker's own reconstruction (what worker-side error feedback subtracts), and
the new second (server) error memory.

What each worker keeps (``N`` workers on the axis; ``L`` local ranks and ``S``
nodes for hierarchical):

- ``two_phase``: the server memory of its own chunk only, ``[⌈n/N⌉]``
  (worker ``j`` owns coordinates ``j·c`` to ``(j+1)·c``, the last chunk
  zero-padded past ``n``). Its worker-side residual covers the whole leaf,
  since it encodes all of it.
- ``hierarchical``: the worker-side residual of its own shard only,
  ``[⌈n/L⌉]`` (local rank ``l`` owns shard ``l``), and with an inner
  ``two_phase`` the server memory of its own chunk of that shard,
  ``[⌈⌈n/L⌉/S⌉]``.

A memory may also be kept whole, in the leaf's flat coordinates ``[n]``, with
each worker using only its own part and holding zeros elsewhere: that is what
a state made where the number of workers is unknown (``init`` outside any
mapped axis) holds. Every function here takes either layout, tells them apart
by the stored length, and returns the new memory in the layout it was given;
the two give the same results.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from commopt._src import base, errors, tree
from commopt.comm import _collectives as coll
from commopt.comm import _plan
from commopt.comm._channel import Channel
from commopt.comm._exchange import exchange, sum_decoded
from commopt.comm._words import Send, payload_words, run_together, to_words


def check_chunks(compressor: base.Compressor, fn: str, strategy: str):
  """Two-phase and hierarchical encode flat chunks of each leaf independently: they need a
  stateless per-leaf compressor that compresses a flat chunk (``"flat_chunks"``)."""
  if not base.is_stateless_per_leaf(compressor):
    raise ValueError(
        f"{fn}: strategy={strategy!r} splits each leaf into chunks and encodes them "
        f"independently, so it needs a stateless per-leaf compressor; {compressor.name} "
        "keeps per-leaf state, runs its own protocol or selects over the whole tree. "
        "Use strategy='auto' for it.")
  if "flat_chunks" not in compressor.capabilities:
    raise ValueError(
        f"{fn}: strategy={strategy!r} encodes flat chunks of each leaf, and {compressor.name} "
        "declares flat_chunks=False: it compresses a leaf by its matrix shape, which the "
        "chunks do not have, so a chunk's payload is no smaller than the chunk and this "
        "strategy would save nothing. Use strategy='gather' (or 'auto') for it.")


# ---------------------------------------------------------------------------
# Two-phase.


def chunk_size(n: int, workers: int) -> int:
  return -(-n // workers)


def is_own(memory: jax.Array, n: int) -> bool:
  """Whether a flat memory of a leaf of ``n`` coordinates holds only this worker's part.

  Whole memories have length ``n``; a worker's part is shorter whenever there
  is more than one worker (when it is not, the two layouts coincide).
  """
  return memory.shape[0] != n


def own_part(memory: jax.Array, n: int, workers: int, index) -> jax.Array:
  """Worker ``index``'s ``⌈n/workers⌉`` coordinates of ``memory``, in its dtype.

  ``memory`` is the whole flat memory ``[n]`` or already the part (see
  :func:`is_own`).
  """
  c = chunk_size(n, workers)
  if memory.shape[0] not in (n, c):
    raise ValueError(
        f"the memory of a leaf of {n} coordinates must hold {n} (whole) or {c} (one of "
        f"{workers} workers' part) values, got {memory.shape[0]}; it was made for another "
        "number of workers. Call init where the axis has this many workers, or outside it.")
  if is_own(memory, n):
    return memory
  return jax.lax.dynamic_slice(jnp.pad(memory, (0, workers * c - n)), (index * c,), (c,))


def store_part(part: jax.Array, memory: jax.Array, n: int, workers: int, index) -> jax.Array:
  """``part`` (worker ``index``'s coordinates) kept in ``memory``'s layout and dtype.

  A whole memory gets zeros outside the part; either way nothing is kept past
  the leaf's ``n`` coordinates.
  """
  c = part.shape[0]
  if is_own(memory, n):
    return jnp.where(index * c + jnp.arange(c) < n, part, 0).astype(memory.dtype)
  full = jax.lax.dynamic_update_slice(jnp.zeros((workers * c,), part.dtype), part, (index * c,))
  return full[:n].astype(memory.dtype)


def two_phase(compressor: base.Compressor, p: jax.Array, memory: Optional[jax.Array], key,
              axis_name, size=None) -> tuple[jax.Array, jax.Array, Optional[jax.Array]]:
  """Compressed all-reduce of one leaf in two phases: :func:`two_phase_rounds` run alone."""
  return run_together([two_phase_rounds(compressor, p, memory, key, axis_name, size)],
                      axis_name)[0]


def two_phase_rounds(compressor: base.Compressor, p: jax.Array, memory: Optional[jax.Array],
                     key, axis_name, size=None):
  """Compressed all-reduce in two phases (all-to-all, then all-gather), as the two rounds
  of an exchange :func:`run_together` packs with other leaves' (a generator).

  Worker ``w`` splits its flat input ``p`` (``n`` coordinates, zero-padded to
  ``N·c``) into ``N`` chunks of ``c``, encodes each, and an all-to-all sends
  chunk ``j`` to worker ``j``. Worker ``j`` decodes the ``N`` payloads of its
  chunk, averages them, adds its server memory, re-encodes, and keeps what
  the second encoding missed. An all-gather returns every worker's encoded
  chunk mean. Each worker sends about two payloads, whatever ``N``.

  Args:
    compressor: a stateless compressor.
    p: the error-compensated flat input, ``[n]``.
    memory: this worker's server memory, ``[⌈n/N⌉]`` (its own chunk) or
      ``[n]`` (in ``p``'s coordinates, only the own chunk used), or None for none.
    key: this worker's key for the leaf.
    axis_name: the axis.
    size: how many leading coordinates of ``p`` hold data (default all ``n``;
      may be traced): the chunk mean and the memory are zero past it.

  Returns (as the generator's value):
    ``(mean [n] float32, local [n], new memory or None)``, the memory in the
    layout it was given.
  """
  n = p.shape[0]
  workers = coll.axis_size(axis_name)
  c = chunk_size(n, workers)
  like = jax.ShapeDtypeStruct((c,), p.dtype)
  empty = compressor.init(like)
  chunks = jnp.pad(p, (0, workers * c - n)).reshape(workers, c)
  keys = jax.vmap(lambda j: jax.random.fold_in(key, j))(jnp.arange(workers))
  payloads = jax.vmap(lambda x, k: compressor.encode(x, empty, k)[0])(chunks, keys)
  decode = lambda pl: compressor.decode(pl, empty, like).astype(jnp.float32)
  local = jax.vmap(decode)(payloads).reshape(-1)[:n].astype(p.dtype)

  words, unpack = to_words(payloads, batch_dims=1)
  received = yield Send("all-to-all", words)
  me = coll.axis_index(axis_name)
  start = me * c
  valid = (start + jnp.arange(c)) < (n if size is None else size)
  chunk_sum = sum_decoded(unpack(received),
                          lambda acc, pl: compressor.add_decoded(acc, pl, empty, like),
                          jnp.zeros((c,), jnp.float32))
  chunk_mean = jnp.where(valid, chunk_sum / workers, 0.0)

  q = chunk_mean
  if memory is not None:
    q = q + own_part(memory, n, workers, me).astype(jnp.float32)
  payload, _ = compressor.encode(q.astype(p.dtype), empty, jax.random.fold_in(key, workers))
  new_memory = None
  if memory is not None:
    kept = jnp.where(valid, q - decode(payload), 0.0)
    new_memory = store_part(kept, memory, n, workers, me)

  words2, unpack2 = to_words(payload)
  means = yield Send("all-gather", words2)
  mean = jax.vmap(decode)(unpack2(means)).reshape(-1)[:n]
  return mean, local, new_memory


# ---------------------------------------------------------------------------
# Hierarchical.


def hierarchical(p_reduce: Callable, u: jax.Array, residual: Optional[jax.Array],
                 memory: Optional[jax.Array], slow: str, fast: str):
  """Dense inside ``fast``, compressed across ``slow``, gathered back inside ``fast``.

  A reduce-scatter over ``fast`` leaves local rank ``l`` with the dense mean
  of shard ``l`` (``c = ⌈n/L⌉`` coordinates). Only that shard is compressed
  and exchanged across ``slow`` (by ``p_reduce``), with its error memory;
  an all-gather over ``fast`` reassembles the leaf. So compressed bytes
  cross only the slow axis and each local rank sends ``1/L`` of the leaf.

  Args:
    p_reduce: ``p_reduce(p_shard, memory, size) -> (mean, local, memory)``,
      the compressed reduction across ``slow`` (it gets and returns ``memory``
      in the shard's layout: whole shard or its own part; ``size`` is how many
      leading coordinates of the shard lie inside the leaf).
    u: this worker's flat update, ``[n]``.
    residual: this local rank's error memory, ``[⌈n/L⌉]`` (its shard) or
      ``[n]`` (leaf coordinates, only the shard used), or None without error
      feedback.
    memory: a second (server) memory, ``[n]`` in leaf coordinates or already
      this rank's part of its shard (as ``p_reduce`` keeps it), or None.
    slow: the slow axis's name.
    fast: the fast axis's name.

  Returns:
    ``(mean [n], new residual or None, new memory or None)``, the memories in
    the layouts they were given.
  """
  n = u.shape[0]
  ranks = coll.axis_size(fast)
  c = chunk_size(n, ranks)
  rank = coll.axis_index(fast)

  padded = jnp.pad(u.astype(jnp.float32), (0, ranks * c - n))
  pre, post = coll.mean_factors(ranks)
  dense = coll.psum_scatter(padded * jnp.float32(pre), fast) / jnp.float32(post)
  # Error feedback on this rank's shard, by the one implementation (compensate /
  # remember), in float32 whatever the memory's dtype.
  p = compensate(dense, None if residual is None
                 else own_part(residual, n, ranks, rank).astype(jnp.float32))
  # A whole memory is cut to this shard; a part is already the inner reduction's own.
  whole = memory is not None and not is_own(memory, n)
  mean, local, new_memory = p_reduce(
      p.astype(u.dtype), own_part(memory, n, ranks, rank) if whole else memory,
      jnp.clip(n - rank * c, 0, c))
  full = coll.all_gather(mean.astype(jnp.float32), fast).reshape(-1)[:n]
  new_residual = None
  if residual is not None:
    new_residual = store_part(remember(p, local), residual, n, ranks, rank)
  if whole:
    new_memory = store_part(new_memory, memory, n, ranks, rank)
  return full, new_residual, new_memory


# ---------------------------------------------------------------------------
# Error feedback: the one implementation every reduction uses.


def compensate(u: jax.Array, residual: Optional[jax.Array]) -> jax.Array:
  """``p = u + e``: the update with the error memory added (in the memory's dtype)."""
  return u if residual is None else u.astype(residual.dtype) + residual


def remember(p: jax.Array, local: jax.Array) -> jax.Array:
  """``e' = p - decode(payload)``: what this worker's reconstruction missed."""
  return p - local.astype(p.dtype)


# ---------------------------------------------------------------------------
# Strategies as objects: what each keeps, how it reduces, what it sends.


class LeafResult(NamedTuple):
  """One compressed leaf after a strategy's reduction.

  Attributes:
    out: the mean over the workers, in the update's shape and dtype.
    residual: the new worker-side error memory (None without error feedback).
    memory: the new server memory (None where the strategy keeps none).
    state: the new per-leaf compressor state.
  """
  out: jax.Array
  residual: Optional[jax.Array]
  memory: Optional[jax.Array]
  state: Any


class Batch(NamedTuple):
  """The compressed leaves of one update, in the update's order, as
  :func:`~commopt.compressed_mean` hands them to :meth:`Strategy.reduce_all`.

  Attributes:
    updates: each leaf's input.
    residuals: each leaf's error-feedback residual (None: no error feedback).
    memories: each leaf's server memory (None where the strategy keeps none).
    states: each leaf's compressor state.
    keys: each leaf's key (the worker key folded with the leaf's index, and the
      shard's where the leaf is cut over model axes).
    specs: each leaf's ``PartitionSpec`` over the model axes (``P()``: whole).
    paths: each leaf's path, for error messages.
  """
  updates: list
  residuals: list
  memories: list
  states: list
  keys: list
  specs: list
  paths: list


@contextlib.contextmanager
def naming(path: str, spec):
  """A ValueError raised inside names the leaf ``path`` and its sharding ``spec``."""
  try:
    yield
  except ValueError as e:
    where = f"leaf {path}" + (f" (sharded {spec})" if spec not in (None, P()) else "")
    raise ValueError(f"compressed_mean: {where}: {e}") from e


def _reduce_tree_wide(strategy: "Strategy", compressor: base.Compressor, batch: Batch, key,
                      axis_name) -> list[LeafResult]:
  """One selection (or one protocol) over every compressed leaf, per sharding: leaves whole
  on this device apart from leaves cut over model axes, whose values differ between the
  model ranks (the replicated ones' output must not)."""
  groups: dict = {}
  for i, u in enumerate(batch.updates):
    groups.setdefault(coll.shard_axes(u, axis_name), []).append(i)
  results: list = [None] * len(batch.updates)
  for g, (_, idx) in enumerate(sorted(groups.items())):
    group_key = key if len(groups) == 1 else jax.random.fold_in(key, g)
    ps = [compensate(batch.updates[i], batch.residuals[i]) for i in idx]
    xs = [p.astype(batch.updates[i].dtype) for p, i in zip(ps, idx)]
    states = [batch.states[i] for i in idx]
    if compressor.reduce_tree is not None:
      reduced = compressor.reduce_tree(xs, states, [batch.keys[i] for i in idx],
                                       Channel(axis_name, tuple(batch.specs[i] for i in idx)))
      means, locals_, states = ([r.mean for r in reduced], [r.local for r in reduced],
                                [r.state for r in reduced])
    else:
      means, locals_ = exchange(compressor.encode_tree(xs, group_key),
                                lambda pl: compressor.decode_tree(pl, xs), strategy.name,
                                axis_name)
    for i, p, mean, local, s in zip(idx, ps, means, locals_, states):
      u = batch.updates[i]
      results[i] = LeafResult(
          out=mean.astype(u.dtype),
          residual=None if batch.residuals[i] is None else remember(p, local),
          memory=batch.memories[i], state=s)
  return results


def _payload_bytes(compressor: base.Compressor, shape, dtype) -> int:
  return -(-compressor.payload_bits(tuple(shape), dtype) // 8)


class Strategy:
  """How a compressed leaf crosses the axis (see :data:`STRATEGIES`).

  Each strategy states what it keeps (:meth:`memory_shapes`), reduces one
  error-compensated leaf (:meth:`reduce`) and predicts its collectives
  (:meth:`plan`).
  """
  name: str = ""
  keeps_server_memory: bool = False

  def __repr__(self) -> str:
    return f"{type(self).__name__}()"

  def __eq__(self, other) -> bool:
    return type(self) is type(other) and vars(self) == vars(other)

  def __hash__(self) -> int:
    return hash((type(self), tuple(sorted(vars(self).items()))))

  def check(self, compressor: base.Compressor, fn: str) -> None:
    """Refuses a compressor this strategy cannot carry."""

  def memory_shapes(self, shape, axis_name, workers) -> tuple[tuple, tuple]:
    """``(residual shape, server memory shape)`` of a leaf of ``shape``.

    ``workers(axis)`` is the number of workers on ``axis``, or None where it
    is unknown: then a per-worker memory is kept whole.
    """
    return tuple(shape), (base.leaf_size(shape),)

  def exchange(self, compressor, x, memory, cstate, key, axis_name, spec=None):
    """``(mean, local, memory, state)`` of the error-compensated ``x``; ``spec``: the
    leaf's ``PartitionSpec`` over the model axes, for a compressor's own protocol
    (:class:`~commopt.comm._channel.Channel`)."""
    raise NotImplementedError

  def reduce(self, compressor: base.Compressor, u: jax.Array, residual, memory, cstate, key,
             axis_name, spec=None) -> LeafResult:
    """The mean of every worker's compressed ``u``, with error feedback when ``residual`` is
    given; ``spec`` as for :meth:`exchange`."""
    p = compensate(u, residual)
    mean, local, memory, cstate = self.exchange(compressor, p.astype(u.dtype), memory, cstate,
                                                key, axis_name, spec=spec)
    return LeafResult(out=mean.astype(u.dtype),
                      residual=None if residual is None else remember(p, local),
                      memory=memory, state=cstate)

  def reduce_all(self, compressor: base.Compressor, batch: Batch, key, axis_name,
                 wait_for=()) -> list[LeafResult]:
    """Every compressed leaf of one update, reduced: each leaf's mean, residual, memory and
    state, in ``batch``'s order. A tree-wide compressor (``encode_tree``, ``reduce_tree``)
    selects over every leaf at once, keyed by ``key`` (the worker key); every other one
    goes leaf by leaf through :meth:`reduce`. ``wait_for``: the values whose collectives
    ran before (the dense leaves' all-reduces), for a strategy that orders its own
    after them. An error in a leaf's own step names the leaf."""
    if compressor.encode_tree is not None or compressor.reduce_tree is not None:
      return _reduce_tree_wide(self, compressor, batch, key, axis_name)
    results = []
    for i, u in enumerate(batch.updates):
      with naming(batch.paths[i], batch.specs[i]):
        results.append(self.reduce(compressor, u, batch.residuals[i], batch.memories[i],
                                   batch.states[i], batch.keys[i], axis_name,
                                   spec=batch.specs[i]))
    return results

  def plan(self, compressor, leaf: str, shape, dtype, axis_name, sizes) -> list[_plan.Planned]:
    """The collectives one worker runs for a compressed leaf; ``sizes[axis]`` counts workers."""
    raise NotImplementedError

  def dense_mean(self, u: jax.Array, axis_name) -> jax.Array:
    """The mean of a leaf sent dense (below ``min_size``, or not compressible): one all-reduce."""
    return coll.pmean(u, axis_name)

  def dense_plan(self, leaf: str, nbytes: int, axis_name, sizes) -> list[_plan.Planned]:
    """The collectives of :meth:`dense_mean` for a leaf of ``nbytes``."""
    return [_plan.planned(leaf, "all-reduce", axis_name, _plan.total_workers(sizes), nbytes,
                          packed=False)]


def _send(compressor, payload, cstate, like, axis_name, linear: bool):
  """``(mean, local)`` of ``payload`` over the axis (:func:`exchange`), decoded as ``like``."""
  if linear and axis_name is not None and coll.crosses_processes() and any(
      base.is_float_dtype(t.dtype) and t.dtype.itemsize == 2 for t in jax.tree.leaves(payload)):
    warnings.warn(
        f"compressed_mean: {compressor.name}'s 16-bit payload is all-reduced (strategy="
        f"'psum') over {axis_name!r} in a job of several CPU processes: XLA:CPU widens a "
        "16-bit all-reduce to float32 when it compiles, so where this axis crosses processes "
        "it sends as many bytes as the dense mean. strategy='two_phase' (inner_strategy="
        "'two_phase' under 'hierarchical') sends 16 bits.", errors.WireSizeWarning,
        stacklevel=2)
  return exchange(payload, lambda pl: compressor.decode(pl, cstate, like),
                  "psum" if linear else "gather", axis_name,
                  lambda acc, pl: compressor.add_decoded(acc, pl, cstate, like))


def _protocol_or_exchange(compressor, x, cstate, key, axis_name, linear: bool, spec=None):
  if compressor.reduce is not None:
    reduced = compressor.reduce(x, cstate, key,
                                Channel(axis_name, () if spec is None else (spec,)))
    return reduced.mean, reduced.local, None, reduced.state
  payload, cstate = compressor.encode(x, cstate, key)
  mean, local = _send(compressor, payload, cstate, x, axis_name, linear)
  return mean, local, None, cstate


def _sparse_reduce(compressor, u, residual, memory, cstate, key, axis_name) -> LeafResult:
  """:meth:`Strategy.reduce` of a ``sparse_values`` payload, bit for bit, in fewer passes
  over the leaf: 32-bit values travel with their indices in one all-gather; where the
  platform applies a scatter's updates in order (:func:`coll.scatters_in_order`) the
  workers' payloads are added in one scatter-add (worker after worker, as
  :func:`sum_decoded`); the residual
  ``p − decode(payload)`` is a scatter-subtract of the values sent from ``p`` (``p``, the
  output of an add, is ``p − 0`` bit for bit), no dense reconstruction."""
  p = compensate(u, residual)
  x = p.astype(u.dtype)
  payload, cstate = compressor.encode(x, cstate, key)
  values, indices = payload["values"], payload["indices"]
  gathered = coll.all_gather(payload if values.dtype.itemsize != 4 else jnp.concatenate(
      [jax.lax.bitcast_convert_type(values, jnp.uint32), indices.astype(jnp.uint32)]), axis_name)
  if values.dtype.itemsize == 4:
    k = values.shape[0]
    gathered = {"values": jax.lax.bitcast_convert_type(gathered[:, :k], values.dtype),
                "indices": gathered[:, k:].astype(jnp.int32)}
  add = lambda acc, pl: compressor.add_decoded(acc, pl, cstate, x)
  zeros = jnp.zeros(x.shape, jnp.float32)
  total = (add(zeros, jax.tree.map(lambda t: t.reshape(-1), gathered))
           if coll.scatters_in_order() else sum_decoded(gathered, add, zeros))
  new = None
  if residual is not None:   # in the leaf's own shape: a flat view would be copied back
    where = jnp.unravel_index(indices, p.shape) if p.ndim > 1 else indices
    new = p.at[where].subtract(values.astype(x.dtype).astype(p.dtype), mode="drop")
  return LeafResult(out=(total / coll.axis_size(axis_name)).astype(u.dtype), residual=new,
                    memory=memory, state=cstate)


def _single_plan(kind, compressor, leaf, shape, dtype, axis_name, sizes):
  return [_plan.planned(leaf, kind, axis_name, sizes[axis_name],
                        _payload_bytes(compressor, shape, dtype), packed=True)]


class Psum(Strategy):
  """All-reduce of the payloads, decoded once: linear compressors (casts, shared-seed random-k)."""
  name = "psum"

  def check(self, compressor, fn):
    if not compressor.linear:
      raise ValueError(
          f"{fn}: strategy='psum' needs a linear compressor, and {compressor.name} is not "
          "(its payloads cannot be summed before decoding). Use strategy='gather' or 'auto'.")

  def exchange(self, compressor, x, memory, cstate, key, axis_name, spec=None):
    return _protocol_or_exchange(compressor, x, cstate, key, axis_name, linear=True,
                                 spec=spec)

  def plan(self, compressor, leaf, shape, dtype, axis_name, sizes):
    return _single_plan("all-reduce", compressor, leaf, shape, dtype, axis_name, sizes)


class Gather(Strategy):
  """All-gather of the payloads, each decoded: any compressor; traffic grows with the workers.

  A compressor with its own protocol (``compressor.reduce``: PowerSGD's two
  all-reduces, a staged top-k's gathers) runs that instead.
  """
  name = "gather"

  def exchange(self, compressor, x, memory, cstate, key, axis_name, spec=None):
    return _protocol_or_exchange(compressor, x, cstate, key, axis_name, linear=False,
                                 spec=spec)

  def reduce(self, compressor, u, residual, memory, cstate, key, axis_name, spec=None):
    """As :meth:`Strategy.reduce`, with a values-and-indices payload (:func:`_sparse_reduce`)
    or a fused encoding (``encode_feedback``, float32 only) exchanged and its residual
    written by fewer passes over the leaf."""
    if (compressor.encode_feedback is not None and compressor.reduce is None
        and residual is not None and u.dtype == residual.dtype == jnp.float32):
      payload, new_residual, cstate = compressor.encode_feedback(u, residual, cstate, key)
      mean, _ = _send(compressor, payload, cstate, u, axis_name, linear=False)
      return LeafResult(out=mean.astype(u.dtype), residual=new_residual, memory=memory,
                        state=cstate)
    if axis_name is None or compressor.reduce is not None or not compressor.sparse_values:
      return super().reduce(compressor, u, residual, memory, cstate, key, axis_name, spec)
    return _sparse_reduce(compressor, u, residual, memory, cstate, key, axis_name)

  def plan(self, compressor, leaf, shape, dtype, axis_name, sizes):
    kind = compressor.reduce_collective if compressor.reduce is not None else "all-gather"
    return _single_plan(kind, compressor, leaf, shape, dtype, axis_name, sizes)


class TwoPhase(Strategy):
  """All-to-all of compressed chunks, re-compression with a server memory, all-gather.

  Its exchange of a leaf is a generator of rounds (:meth:`reduce_rounds`), so
  ``compressed_mean`` runs every leaf's together (:func:`run_together`). Gather has none:
  its payloads packed as bytes (one all-gather for every leaf), when tried, slowed the
  in-process step (``bench_step.py``) and gained nothing across processes
  (``bench_network.py``).
  """
  name = "two_phase"
  keeps_server_memory = True

  def check(self, compressor, fn):
    check_chunks(compressor, fn, self.name)

  def memory_shapes(self, shape, axis_name, workers):
    n, count = base.leaf_size(shape), workers(axis_name)
    return tuple(shape), (n if count is None else chunk_size(n, count),)

  def exchange(self, compressor, x, memory, cstate, key, axis_name, spec=None, size=None):
    mean, local, memory = two_phase(compressor, x.reshape(-1), memory, key, axis_name, size)
    return mean.reshape(x.shape), local.reshape(x.shape), memory, cstate

  def reduce(self, compressor, u, residual, memory, cstate, key, axis_name, spec=None):
    return run_together([self.reduce_rounds(compressor, u, residual, memory, cstate, key,
                                            axis_name)], axis_name)[0]

  def reduce_all(self, compressor, batch: Batch, key, axis_name, wait_for=()):
    """Every leaf's rounds together, one collective a round (:func:`run_together`), after
    the dense leaves' all-reduces (``wait_for``)."""
    rounds = [self.reduce_rounds(compressor, u, r, m, s, k, axis_name)
              for u, r, m, s, k in zip(batch.updates, batch.residuals, batch.memories,
                                       batch.states, batch.keys)]
    return run_together(rounds, axis_name, lambda j: naming(batch.paths[j], batch.specs[j]),
                        wait_for)

  def reduce_rounds(self, compressor, u, residual, memory, cstate, key, axis_name):
    """:meth:`reduce` as an exchange whose rounds :func:`run_together` packs with the other
    leaves' (a generator; ``compressed_mean`` runs every leaf's together)."""
    p = compensate(u, residual)
    mean, local, memory = yield from two_phase_rounds(
        compressor, p.astype(u.dtype).reshape(-1), memory, key, axis_name)
    return LeafResult(out=mean.reshape(u.shape).astype(u.dtype),
                      residual=None if residual is None else remember(p, local.reshape(u.shape)),
                      memory=memory, state=cstate)

  def plan(self, compressor, leaf, shape, dtype, axis_name, sizes):
    n, workers = base.leaf_size(shape), sizes[axis_name]
    word_bytes = 4 * payload_words(compressor, chunk_size(n, workers), dtype)
    return [_plan.planned(leaf, "all-to-all", axis_name, workers, workers * word_bytes, True),
            _plan.planned(leaf, "all-gather", axis_name, workers, word_bytes, True)]


class Hierarchical(Strategy):
  """Dense reduce-scatter inside the fast axis, ``inner`` across the slow one, dense all-gather."""
  name = "hierarchical"

  def __init__(self, inner: Strategy):
    if isinstance(inner, Hierarchical):
      raise ValueError("Hierarchical: `inner` cannot itself be hierarchical.")
    self.inner = inner

  def __repr__(self) -> str:
    return f"Hierarchical({self.inner!r})"

  @property
  def keeps_server_memory(self) -> bool:
    return self.inner.keeps_server_memory

  def check(self, compressor, fn):
    check_chunks(compressor, fn, self.name)
    self.inner.check(compressor, fn)

  def memory_shapes(self, shape, axis_name, workers):
    n = base.leaf_size(shape)
    nodes, ranks = (workers(a) for a in axis_name)
    if ranks is None:
      return tuple(shape), (n,)
    shard = chunk_size(n, ranks)
    return (shard,), (n if nodes is None else chunk_size(shard, nodes),)

  def reduce(self, compressor, u, residual, memory, cstate, key, axis_name, spec=None):
    slow, fast = axis_name
    inner = self.inner

    def slow_reduce(p, memory, size):
      if isinstance(inner, TwoPhase):
        mean, local, memory, _ = inner.exchange(compressor, p, memory, None, key, slow, size=size)
        return mean, local, memory
      mean, local, _, _ = inner.exchange(compressor, p, None, compressor.init(p), key, slow)
      return mean.astype(p.dtype), local, None

    mean, new_residual, memory = hierarchical(
        slow_reduce, u.reshape(-1), None if residual is None else residual.reshape(-1),
        memory, slow, fast)
    return LeafResult(out=mean.reshape(u.shape).astype(u.dtype),
                      residual=None if residual is None else new_residual.reshape(residual.shape),
                      memory=memory, state=cstate)

  def dense_mean(self, u, axis_name):
    """Inside each node first, then between the same local rank of each node.

    So a dense leaf crosses the slow axis only between ``(node, r)`` pairs of
    equal rank ``r``, as the compressed shards do, never in one all-reduce
    over every device.
    """
    slow, fast = axis_name
    return coll.pmean(coll.pmean(u, fast), slow)

  def dense_plan(self, leaf, nbytes, axis_name, sizes):
    slow, fast = axis_name
    return [_plan.planned(leaf, "all-reduce", fast, sizes[fast], nbytes, packed=False),
            _plan.planned(leaf, "all-reduce", slow, sizes[slow], nbytes, packed=False)]

  def plan(self, compressor, leaf, shape, dtype, axis_name, sizes):
    slow, fast = axis_name
    ranks = sizes[fast]
    shard = chunk_size(base.leaf_size(shape), ranks)
    return ([_plan.planned(leaf, "reduce-scatter", fast, ranks, ranks * shard * 4, False)]
            + self.inner.plan(compressor, leaf, (shard,), dtype, slow, sizes)
            + [_plan.planned(leaf, "all-gather", fast, ranks, shard * 4, False)])


STRATEGIES = {s.name: s for s in (Psum, Gather, TwoPhase, Hierarchical)}
"""The strategy classes by name."""


def resolve(name: str, compressor: base.Compressor, fn: str,
            inner: str = "auto") -> Strategy:
  """The strategy object for ``name`` (``"auto"``: psum for linear compressors, else gather)."""
  if name == "auto":
    return Psum() if compressor.linear else Gather()
  if name == "hierarchical":
    strategy = Hierarchical(resolve(inner, compressor, fn))
  else:
    strategy = STRATEGIES[name]()
  strategy.check(compressor, fn)
  return strategy


def plan_reduction(compressor: base.Compressor, reduction: Strategy, params, sizes: dict,
                   axis_name, min_size: int, step=None) -> list:
  """The collectives ``compressed_mean`` runs for ``params`` (see :mod:`commopt.comm._plan`).

  With ``step`` (0-based), what runs at that step: every leaf dense before
  ``compressor.dense_steps``.
  """
  warm_up = step is not None and step < compressor.dense_steps

  def compressed(where, leaf):
    if warm_up or not tree.compresses(compressor, leaf.shape, leaf.dtype, min_size,
                                      getattr(leaf, "whole_size", None)):
      return None
    return reduction.plan(compressor, where, leaf.shape, leaf.dtype, axis_name, sizes)

  return _plan.leaf_plans(params, sizes, axis_name, compressed, reduction.dense_plan)
