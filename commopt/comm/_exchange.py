"""A payload across the axis, and the workers' reconstructions summed: the one exchange.

:func:`exchange` sends one payload (all-reduced where it is linear, else all-gathered)
and returns the workers' mean reconstruction and this worker's own; gathered payloads
are decoded and summed in one pass by :func:`sum_decoded`. Every strategy and every
compressor's protocol (through its :class:`~commopt.comm._channel.Channel`) sends
through it. :func:`worker_key` is each worker's key for a step.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from commopt.comm import _collectives as coll


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
