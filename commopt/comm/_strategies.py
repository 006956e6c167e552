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

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from commopt._src import base
from commopt.comm import _collectives as coll


# ---------------------------------------------------------------------------
# One uint32 buffer per payload, so each phase is a single collective.


def to_words(payload: Any, batch_dims: int = 0) -> tuple[jax.Array, Callable[[jax.Array], Any]]:
  """Lays every array of ``payload`` end to end in one uint32 buffer.

  Args:
    payload: a pytree of arrays sharing ``batch_dims`` leading dimensions.
    batch_dims: 0 or 1.

  Returns:
    ``(words, unpack)``: ``words`` is ``[*batch, W]`` uint32, the payload's
    bytes padded to whole words; ``unpack(words)`` restores the pytree (for
    any leading batch shape ``words`` has by then).
  """
  leaves, treedef = jax.tree.flatten(payload)
  lead = leaves[0].shape[:batch_dims]
  parts, metas = [], []
  for leaf in leaves:
    inner = leaf.shape[batch_dims:]
    raw = jax.lax.bitcast_convert_type(leaf, jnp.uint8) if leaf.dtype != jnp.uint8 else leaf
    raw = raw.reshape(lead + (-1,))
    parts.append(raw)
    metas.append((inner, leaf.dtype, raw.shape[-1]))
  raw = jnp.concatenate(parts, axis=-1)
  total = raw.shape[-1]
  pad = -total % 4
  raw = jnp.pad(raw, [(0, 0)] * batch_dims + [(0, pad)])
  words = jax.lax.bitcast_convert_type(raw.reshape(lead + (-1, 4)), jnp.uint32)

  def unpack(w):
    batch = w.shape[:-1]
    raw = jax.lax.bitcast_convert_type(w, jnp.uint8).reshape(batch + (-1,))
    out, offset = [], 0
    for inner, dtype, nbytes in metas:
      chunk = raw[..., offset:offset + nbytes]
      offset += nbytes
      itemsize = np.dtype(dtype).itemsize
      if itemsize > 1:
        chunk = chunk.reshape(batch + tuple(inner) + (itemsize,))
        out.append(jax.lax.bitcast_convert_type(chunk, dtype))
      else:
        out.append(jax.lax.bitcast_convert_type(chunk.reshape(batch + tuple(inner)), dtype))
    return jax.tree.unflatten(treedef, out)

  return words, unpack


def payload_words(compressor: base.Compressor, n: int, dtype) -> int:
  """uint32 words of one packed payload of ``n`` coordinates (see :func:`to_words`)."""
  return -(-compressor.payload_bits((n,), dtype) // 32)


def check_stateless(compressor: base.Compressor, fn: str, strategy: str):
  """Two-phase and hierarchical re-encode chunks; they need a stateless compressor."""
  if not base.is_stateless_per_leaf(compressor):
    raise ValueError(
        f"{fn}: strategy={strategy!r} splits each leaf into chunks and encodes them "
        f"independently, so it needs a stateless per-leaf compressor; {compressor.name} "
        "keeps per-leaf state, runs its own protocol or selects over the whole tree. "
        "Use strategy='auto' for it.")


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
  """Compressed all-reduce in two phases (all-to-all, then all-gather).

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

  Returns:
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
  received = coll.all_to_all(words, axis_name)
  me = coll.axis_index(axis_name)
  start = me * c
  valid = (start + jnp.arange(c)) < (n if size is None else size)
  chunk_mean = jnp.where(valid, jnp.mean(jax.vmap(decode)(unpack(received)), axis=0), 0.0)

  q = chunk_mean
  if memory is not None:
    q = q + own_part(memory, n, workers, me).astype(jnp.float32)
  payload, _ = compressor.encode(q.astype(p.dtype), empty, jax.random.fold_in(key, workers))
  new_memory = None
  if memory is not None:
    kept = jnp.where(valid, q - decode(payload), 0.0)
    new_memory = store_part(kept, memory, n, workers, me)

  words2, unpack2 = to_words(payload)
  gathered = coll.all_gather(words2, axis_name)
  mean = jax.vmap(decode)(unpack2(gathered)).reshape(-1)[:n]
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
    slow, fast: the axis names.

  Returns:
    ``(mean [n], new residual or None, new memory or None)``, the memories in
    the layouts they were given.
  """
  n = u.shape[0]
  ranks = coll.axis_size(fast)
  c = chunk_size(n, ranks)
  rank = coll.axis_index(fast)

  padded = jnp.pad(u.astype(jnp.float32), (0, ranks * c - n))
  dense = coll.psum_scatter(padded, fast) / ranks
  p = dense
  if residual is not None:
    p = p + own_part(residual, n, ranks, rank).astype(jnp.float32)
  # A whole memory is cut to this shard; a part is already the inner reduction's own.
  whole = memory is not None and not is_own(memory, n)
  mean, local, new_memory = p_reduce(
      p.astype(u.dtype), own_part(memory, n, ranks, rank) if whole else memory,
      jnp.clip(n - rank * c, 0, c))
  full = coll.all_gather(mean.astype(jnp.float32), fast).reshape(-1)[:n]
  new_residual = None
  if residual is not None:
    new_residual = store_part(p - local.astype(jnp.float32), residual, n, ranks, rank)
  if whole:
    new_memory = store_part(new_memory, memory, n, ranks, rank)
  return full, new_residual, new_memory
