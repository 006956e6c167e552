"""Payloads as bytes or uint32 words, and the leaves' exchanges run together, one
collective a round.

:func:`to_bytes` lays a payload's arrays end to end in one uint8 buffer,
:func:`to_words` in uint32 words (what two-phase moves), so one payload crosses in one
collective. :func:`run_together` goes further: the exchanges of many leaves (generators
that yield each round's buffer, :class:`Send`) run in lockstep, and each round's buffers
of every leaf are packed into one that crosses in one collective. Across processes on
CPUs every collective is a gloo operation of its own, whose fixed cost does not depend on
its size: a model of 5 compressed leaves exchanged two-phase runs 2 collectives a step,
not 10.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Generator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from commopt._src import base, tree
from commopt.comm import _collectives as coll


def to_bytes(payload: Any, batch_dims: int = 0) -> tuple[jax.Array, Callable[[jax.Array], Any]]:
  """Lays every array of ``payload`` end to end in one uint8 buffer, bit for bit.

  Args:
    payload: a pytree of arrays sharing ``batch_dims`` leading dimensions.
    batch_dims: 0 or 1.

  Returns:
    ``(raw, unpack)``: ``raw`` is ``[*batch, B]`` uint8, the payload's bytes;
    ``unpack(raw)`` restores the pytree (for any leading batch shape ``raw`` has by
    then, and ignoring bytes past the payload's).
  """
  leaves, treedef = jax.tree.flatten(payload)
  lead = leaves[0].shape[:batch_dims]
  parts, metas = [], []
  for leaf in leaves:
    inner = leaf.shape[batch_dims:]
    if leaf.dtype == jnp.bool_:
      raw = leaf.astype(jnp.uint8)
    elif leaf.dtype != jnp.uint8:
      raw = jax.lax.bitcast_convert_type(leaf, jnp.uint8)
    else:
      raw = leaf
    raw = raw.reshape(lead + (-1,))
    parts.append(raw)
    metas.append((inner, leaf.dtype, raw.shape[-1]))

  def unpack(raw):
    batch = raw.shape[:-1]
    out, offset = [], 0
    for inner, dtype, nbytes in metas:
      chunk = raw[..., offset:offset + nbytes]
      offset += nbytes
      itemsize = np.dtype(dtype).itemsize
      if dtype == jnp.bool_:
        out.append(chunk.reshape(batch + tuple(inner)) != 0)
      elif itemsize > 1:
        chunk = chunk.reshape(batch + tuple(inner) + (itemsize,))
        out.append(jax.lax.bitcast_convert_type(chunk, dtype))
      else:
        out.append(jax.lax.bitcast_convert_type(chunk.reshape(batch + tuple(inner)), dtype))
    return jax.tree.unflatten(treedef, out)

  return tree.concat_flat(parts), unpack


def to_words(payload: Any, batch_dims: int = 0) -> tuple[jax.Array, Callable[[jax.Array], Any]]:
  """Lays every array of ``payload`` end to end in one uint32 buffer (:func:`to_bytes`,
  padded to whole words).

  Args:
    payload: a pytree of arrays sharing ``batch_dims`` leading dimensions.
    batch_dims: 0 or 1.

  Returns:
    ``(words, unpack)``: ``words`` is ``[*batch, W]`` uint32, the payload's
    bytes padded to whole words; ``unpack(words)`` restores the pytree (for
    any leading batch shape ``words`` has by then).
  """
  raw, unpack_bytes = to_bytes(payload, batch_dims)
  lead = raw.shape[:-1]
  raw = jnp.pad(raw, [(0, 0)] * batch_dims + [(0, -raw.shape[-1] % 4)])
  words = jax.lax.bitcast_convert_type(raw.reshape(lead + (-1, 4)), jnp.uint32)

  def unpack(w):
    return unpack_bytes(jax.lax.bitcast_convert_type(w, jnp.uint8).reshape(w.shape[:-1] + (-1,)))

  return words, unpack


def payload_words(compressor: base.Compressor, n: int, dtype) -> int:
  """uint32 words of one packed payload of ``n`` coordinates (see :func:`to_words`)."""
  return -(-compressor.payload_bits((n,), dtype) // 32)


class Send(NamedTuple):
  """One round of a leaf's exchange: ``words`` (uint8 or uint32) to cross the axis by ``kind``.

  ``"all-to-all"``: ``words`` is ``[N, W]``, row ``j`` for worker ``j``; the leaf gets
  back ``[N, W]``, row ``w`` from worker ``w``. ``"all-gather"``: ``words`` is ``[W]``;
  the leaf gets back every worker's, ``[N, W]``.
  """
  kind: str
  words: jax.Array


_COLLECTIVES = {"all-to-all": coll.all_to_all, "all-gather": coll.all_gather}


Exchange = Generator[Send, jax.Array, Any]
"""A leaf's exchange: yields each round's :class:`Send`, is sent back what arrived, and
returns its result."""


def run_together(exchanges: list[Exchange], axis_name, around=None, wait_for=()) -> list:
  """The results of ``exchanges``, run in lockstep: each round, the words of every leaf
  that sends by the same collective (and varies over the same mesh axes: a leaf sharded
  over model axes is not packed with replicated ones) are laid end to end in one buffer
  (in place, :func:`tree.concat_flat`) and cross in one collective; each leaf is sent
  back its own columns. ``around(i)``, if given, is a context manager each step of
  exchange ``i`` runs inside. Each collective waits for the one before it, the first for
  ``wait_for`` (:func:`coll.after`: gloo would mix two that ran beside each other).
  """
  results: list = [None] * len(exchanges)
  pending: dict = {}

  def advance(i, value):
    with around(i) if around is not None else contextlib.nullcontext():
      try:
        pending[i] = exchanges[i].send(value)
      except StopIteration as stop:
        pending.pop(i, None)
        results[i] = stop.value

  for i in range(len(exchanges)):
    advance(i, None)
  while pending:
    sends, groups = dict(pending), {}
    for i, send in sends.items():
      if send.kind not in _COLLECTIVES:
        raise ValueError(f"run_together: unknown collective {send.kind!r}; "
                         f"valid: {sorted(_COLLECTIVES)}")
      key = (send.kind, send.words.dtype, send.words.shape[:-1],
             coll.varying_axes(send.words))
      groups.setdefault(key, []).append(i)
    for (kind, *_), idx in groups.items():
      parts = [sends[i].words for i in idx]
      arrived = _COLLECTIVES[kind](coll.after(tree.concat_flat(parts), wait_for), axis_name)
      wait_for = arrived
      at = 0
      for i, part in zip(idx, parts):
        width = part.shape[-1]
        advance(i, arrived[..., at:at + width])
        at += width
  return results
