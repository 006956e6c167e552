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
  """The collectives of one named axis (``None``: one local worker), and of the model
  axes a leaf's shard is cut on.

  Attributes:
    axis_name: the workers' axis.
    specs: per leaf handed to the protocol, its ``PartitionSpec`` over the model
      axes (``P()``: whole on this device; None: sharded, dimensions unknown), as
      :func:`~commopt.compressed_mean` hands it over; empty where nothing is sharded.
  """
  axis_name: Optional[str | tuple[str, ...]]
  specs: tuple = ()

  def spec(self, i: int = 0):
    """Leaf ``i``'s spec over the model axes (``P()`` when none is known to cut it)."""
    from jax.sharding import PartitionSpec as P
    return self.specs[i] if i < len(self.specs) else P()

  def shard_axes(self, x) -> tuple:
    """The model axes ``x`` is sharded over (:func:`~commopt.comm._collectives.shard_axes`)."""
    return coll.shard_axes(x, self.axis_name)

  def model_sum(self, x: jax.Array, axes: tuple) -> jax.Array:
    """Sum of ``x`` over the model ``axes`` (a leaf's partial sums made whole)."""
    return coll.psum(x, axes) if axes else x

  def model_max(self, x: jax.Array, axes: tuple) -> jax.Array:
    """Maximum of ``x`` over the model ``axes``."""
    return coll.pmax(x, axes) if axes else x

  def model_index(self, axes: tuple):
    """This device's linear index over the model ``axes`` (0 without any)."""
    return jax.lax.axis_index(axes) if axes else jnp.int32(0)

  def model_size(self, axes: tuple) -> int:
    return coll.axis_size(axes) if axes else 1

  def model_gather(self, x: jax.Array, axes: tuple, dim: int) -> jax.Array:
    """``x`` from every device of the model ``axes`` concatenated along ``dim``, in
    :meth:`model_index` order."""
    return coll.all_gather_tiled(x, tuple(axes), dim)

  def mean_split(self, x: jax.Array, axes: tuple, dim: int = -2) -> jax.Array:
    """The workers' mean of ``x``, which is the same on every device of the model
    ``axes``: each of them sends only its slice along ``dim`` across the workers' axis,
    then the slices are gathered over ``axes`` (whole ``x`` where ``dim`` does not divide)."""
    k = self.model_size(axes)
    dim = dim % x.ndim
    if k == 1 or x.shape[dim] % k:
      return self.mean(x)
    size = x.shape[dim] // k
    part = jax.lax.dynamic_slice_in_dim(x, self.model_index(axes) * size, size, axis=dim)
    return self.model_gather(self.mean(part), axes, dim)

  @property
  def size(self) -> int:
    """Workers on the axis (1 locally)."""
    return coll.axis_size(self.axis_name)

  def mean(self, x: jax.Array) -> jax.Array:
    """All-reduce mean of ``x`` in its dtype."""
    return coll.pmean(x, self.axis_name)

  def exchange(self, payload: Any, decode: Callable[[Any], Any], linear: bool,
               add: Optional[Callable[[Any, Any], Any]] = None):
    """Sends ``payload``; ``(mean, local)``: the workers' mean reconstruction and this one's.

    ``decode(payload)`` returns an array or a pytree of arrays; ``mean`` is
    float32. Linear payloads are all-reduced and decoded once; the others are
    all-gathered and summed decoded in one pass (``add(acc, payload)``, see
    :func:`exchange`).
    """
    return exchange(payload, decode, "psum" if linear else "gather", self.axis_name, add)


UNROLL = 8
"""Payloads decoded per fused pass of :func:`sum_decoded` (up to twice this, all in one)."""


def _adder(decode):
  return lambda acc, pl: jax.tree.map(lambda a, t: a + t.astype(a.dtype), acc, decode(pl))


def sum_decoded(gathered, add: Callable[[Any, Any], Any], acc):
  """``acc`` plus every worker's decoded payload, added in worker order.

  ``gathered`` stacks the workers' payloads on a leading axis;
  ``add(acc, payload)`` returns ``acc + decode(payload)``. The adds are
  written out one after another, so XLA fuses the unpacking and decoding of
  several payloads into one pass over the accumulator: no ``[N, d]`` decoded
  array exists. Up to ``2·UNROLL`` workers are unrolled; more run in a loop of
  ``UNROLL`` per iteration. The order is fixed (worker 0 first), so the sum
  equals :func:`sum_decoded_reference` bit for bit, unless the compiler
  contracts a decoder's last inexact product with the add into one FMA
  (qsgd's and int_quant's ``scale · l · 1/top``: within one rounding per add).
  """
  n = jax.tree.leaves(gathered)[0].shape[0]
  row = lambda w: jax.tree.map(lambda x: x[w], gathered)
  if n <= 2 * UNROLL:
    for w in range(n):
      acc = add(acc, row(w))
    return acc

  def group(g, acc):
    for j in range(UNROLL):
      w = g * UNROLL + j
      acc = add(acc, jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, w, keepdims=False),
                                  gathered))
    return acc

  groups = n // UNROLL
  acc = jax.lax.fori_loop(0, groups, group, acc)
  for w in range(groups * UNROLL, n):
    acc = add(acc, row(w))
  return acc


def sum_decoded_reference(gathered, decode, acc):
  """:func:`sum_decoded` by the long way: every payload decoded to a dense
  array (``jax.vmap(decode)``), then the rows added to ``acc`` in worker order."""
  decoded = jax.vmap(decode)(gathered)
  n = jax.tree.leaves(gathered)[0].shape[0]
  for w in range(n):
    acc = jax.tree.map(lambda a, t: a + t[w].astype(a.dtype), acc, decoded)
  return acc


def exchange(payload, decode, strategy: str, axis_name, add=None):
  """Sends ``payload`` over ``axis_name``; returns ``(mean, local)`` reconstructions.

  ``decode(payload)`` returns an array or a pytree of arrays; ``mean`` is the
  float32 mean over the workers of their decoded payloads (``local`` itself
  when ``axis_name`` is None). Linear payloads are all-reduced
  (``strategy="psum"``) and decoded once; a payload of floats is summed
  pre-scaled by a power of two (:func:`~commopt.comm.mean_factors`, exact, in
  its own dtype on the wire), so 16-bit payloads whose mean is representable
  do not overflow in the sum. The others are all-gathered and
  summed in worker order by :func:`sum_decoded` with ``add(acc, payload) ->
  acc + decode(payload)`` (default: exactly that; a compressor's
  :meth:`~commopt.Compressor.add_decoded` may do it in place), then divided by
  the number of workers.
  """
  local = decode(payload)
  if axis_name is None:
    return local, local
  n = coll.axis_size(axis_name)
  if strategy == "psum":
    post = n
    if all(jnp.issubdtype(t.dtype, jnp.floating) for t in jax.tree.leaves(payload)):
      # A linear decode is homogeneous: decode(Σ p·pre) = pre · decode(Σ p).
      pre, post = coll.mean_factors(n)
      payload = jax.tree.map(lambda t: t * jnp.asarray(pre, t.dtype), payload)
    mean = jax.tree.map(lambda t: t.astype(jnp.float32) / jnp.float32(post),
                        decode(coll.psum(payload, axis_name)))
  else:
    zeros = jax.tree.map(lambda t: jnp.zeros(t.shape, jnp.float32), local)
    total = sum_decoded(coll.all_gather(payload, axis_name), add or _adder(decode), zeros)
    mean = jax.tree.map(lambda t: t / n, total)
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
