"""What a compressor's own protocol may do across the axis, and the worker keys.

A compressor never communicates. One with a multi-round protocol (PowerSGD's
two all-reduces, a staged top-k's gathers) describes the rounds in its
``reduce(x, state, key, channel)`` and the :class:`Channel` it is handed
does the collectives, on one device, under ``jax.vmap`` and in ``shard_map``
alike.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from commopt.comm import _collectives as coll


@dataclasses.dataclass(frozen=True)
class Channel:
  """The collectives of one named axis (``None``: one local worker)."""
  axis_name: Optional[str | tuple[str, ...]]

  @property
  def size(self) -> int:
    """Workers on the axis (1 locally)."""
    return coll.axis_size(self.axis_name)

  def mean(self, x: jax.Array) -> jax.Array:
    """All-reduce mean of ``x`` in its dtype."""
    return coll.pmean(x, self.axis_name)

  def exchange(self, payload: Any, decode: Callable[[Any], Any], linear: bool):
    """Sends ``payload``; ``(mean, local)``: the workers' mean reconstruction and this one's.

    ``decode(payload)`` returns an array or a pytree of arrays; ``mean`` is
    float32. Linear payloads are all-reduced and decoded once; the others are
    all-gathered and decoded one by one.
    """
    return exchange(payload, decode, "psum" if linear else "gather", self.axis_name)


def exchange(payload, decode, strategy: str, axis_name):
  """Sends ``payload`` over ``axis_name``; returns ``(mean, local)`` reconstructions.

  ``decode(payload)`` returns an array or a pytree of arrays; ``mean`` is the
  float32 mean over the workers of their decoded payloads (``local`` itself
  when ``axis_name`` is None). Linear payloads are all-reduced
  (``strategy="psum"``), the others all-gathered and decoded one by one.
  """
  local = decode(payload)
  if axis_name is None:
    return local, local
  n = coll.axis_size(axis_name)
  f32 = lambda t: t.astype(jnp.float32)
  if strategy == "psum":
    mean = jax.tree.map(lambda t: f32(t) / n, decode(coll.psum(payload, axis_name)))
  else:
    decoded = jax.vmap(decode)(coll.all_gather(payload, axis_name))
    mean = jax.tree.map(lambda t: jnp.mean(f32(t), axis=0), decoded)
  return mean, local


def worker_key(key, count, compressor, axis_name):
  """This worker's key for step ``count``: ``fold_in(fold_in(key, count), axis_index)``.

  Compressors with shared randomness (or none, ``compressor=None`` counts as
  not shared) use the step key alone; one local worker (``axis_name=None``)
  draws as worker 0 of a mesh would.
  """
  step_key = jax.random.fold_in(key, count)
  if compressor is not None and compressor.shared_randomness:
    return step_key
  return jax.random.fold_in(step_key, coll.axis_index(axis_name))
