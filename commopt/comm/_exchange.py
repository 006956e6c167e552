"""How values cross the axis: dense leaves in buckets, a payload and its decoded sum.

:func:`bucketed_mean` all-reduces the leaves sent dense, together (below). :func:`exchange`
sends one payload (all-reduced where it is linear, else all-gathered) and returns the
workers' mean reconstruction and this worker's own; gathered payloads are decoded and
summed in one pass by :func:`sum_decoded`. Every strategy and every compressor's protocol
(through its :class:`~commopt.comm._channel.Channel`) sends through it.
:func:`worker_key` is each worker's key for a step.

Dense leaves reduced together: one all-reduce per bucket (a flat buffer, or a tuple of
leaves). A tree of leaves averaged leaf by leaf is one all-reduce per leaf in the
program. How that runs depends on the platform (``benchmarks/bench_base.py`` times the
hand-written step leaf by leaf, with one flat buffer and with 1 MB buckets, in one
process and across processes):

- in one process (XLA:CPU or XLA:GPU), the compiler's all-reduce combiner
  merges them into one tuple all-reduce, and concatenating the leaves into a
  flat buffer first only adds two copies (into the buffer and out of it);
- across processes, XLA:CPU runs a tuple all-reduce as one gloo collective
  per operand, each with a cost of its own whatever its size, where a flat
  buffer is one operand, so there one flat buffer per dtype is the faster
  layout, as PyTorch DDP's buckets are.

:func:`bucketed_mean` does both: ``bucket_bytes`` picks flat buffers of at most that
many bytes (``"auto"``: :func:`flat_by_default`), else one all-reduce over the
tuple of leaves. Leaves are grouped by dtype and by the mesh axes they vary
over, so a bucket never mixes values typed differently.

The non-finite skip's flag rides as one more element of a bucket (:func:`bucketed_mean`'s
``flag``), so that agreeing on it costs no collective of its own.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from commopt._src import base, tree
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
  equals decoding every payload to a dense array and adding the rows in worker order
  (``commopt.testing.checks.fused_sum_equals_reference``) bit for bit, unless the compiler
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


# -- dense leaves in buckets ----------------------------------------------------------------

DEFAULT_BUCKET_BYTES = 25 * 2**20
"""The largest flat buffer :func:`bucketed_mean` builds by default: 25 MB, PyTorch DDP's bucket.
The leaves are packed by :func:`commopt._src.tree.concat_flat`, in place, so a large
bucket costs its copies only. Packed by a concatenation, XLA:CPU's loop that picks an
operand per element made a large bucket far dearer than its copies (the reason a 1 MB
cap was the default then). Across gloo processes, where every collective has a cost of
its own whatever its size, fewer and larger buckets cost less
(``bench_base.py --layouts processes`` times the identity step in these buckets beside
the hand-written step with one flat buffer and with 1 MB buckets)."""


def flat_by_default() -> bool:
  """Whether ``bucket_bytes="auto"`` concatenates: on XLA:CPU across processes only.

  In one process XLA combines the leaves' all-reduces by itself, and on GPUs
  its combiner does the same across processes (NCCL groups a tuple
  all-reduce); only XLA:CPU's cross-process collectives (gloo) run each
  operand of a tuple on its own.
  """
  return jax.process_count() > 1 and jax.default_backend() == "cpu"


def check_bucket_bytes(value, fn: str):
  """``value`` if it is ``"auto"``, None or a positive int, else an error naming it."""
  if value is None or (isinstance(value, str) and value == "auto"):
    return value
  return base.check_int("bucket_bytes", value, fn=fn, minimum=1)


def resolve(bucket_bytes) -> Optional[int]:
  """The cap of a flat buffer in bytes, or None for one tuple all-reduce."""
  if isinstance(bucket_bytes, str):
    return DEFAULT_BUCKET_BYTES if flat_by_default() else None
  return bucket_bytes


# -- a flag that rides -------------------------------------------------------------------

def _seat(xs: list, groups: list, flag: Optional[jax.Array]) -> Optional[int]:
  """Appends ``flag`` (a float scalar) to ``xs`` and to the first floating-point group typed
  as it is (same varying axes), cast to that group's dtype: its index in ``xs``, or None
  where no group fits."""
  if flag is None:
    return None
  axes = coll.varying_axes(flag)
  for idx in groups:
    x = xs[idx[0]]
    if base.is_float_dtype(x.dtype) and coll.varying_axes(x) == axes:
      idx.append(len(xs))
      xs.append(jnp.reshape(flag, (1,)).astype(x.dtype))
      return idx[-1]
  return None


# -- the reduction ------------------------------------------------------------------------

def _groups(xs: list) -> list[list[int]]:
  """Indices of ``xs`` grouped by dtype and varying axes, in order of first appearance."""
  groups: dict = {}
  for i, x in enumerate(xs):
    groups.setdefault((jnp.dtype(x.dtype), coll.varying_axes(x)), []).append(i)
  return list(groups.values())


def _chunks(xs: list, idx: list[int], cap: int, seat: Optional[int] = None) -> list[list[int]]:
  """``idx`` cut, in order, into runs of at most ``cap`` bytes (a larger leaf alone); the
  flag's index ``seat`` rides at the end of the first run, whatever its size."""
  out, run, size = [], [], 0
  for i in idx:
    if i == seat:
      continue
    nbytes = math.prod(xs[i].shape) * jnp.dtype(xs[i].dtype).itemsize
    if run and size + nbytes > cap:
      out.append(run)
      run, size = [], 0
    run.append(i)
    size += nbytes
  if run:
    out.append(run)
  if seat in idx:
    out[0].append(seat)
  return out


def _model_split(x: jax.Array) -> tuple[tuple, int]:
  """``(axes, M)``: the declared model axes ``x`` is the same on, and their size."""
  axes = tuple(a for a in sorted(coll.traced().model_axes) if a not in coll.varying_axes(x))
  return axes, math.prod(coll.axis_size(a) for a in axes)


def _split_over_model(reduce: Callable, flat: jax.Array) -> jax.Array:
  """``reduce(flat)`` for a buffer that is the same on every device of the declared model
  axes (leaves replicated over them: biases, norms): each of those devices reduces its
  ``1/M`` of it (padded to a multiple of ``M``) and the parts are all-gathered over the
  model axes, so that each byte crosses the data axis once, not ``M`` times. Elementwise:
  the same means."""
  axes, m = _model_split(flat)
  if m <= 1:
    return reduce(flat)
  size = -(-flat.shape[0] // m)
  padded = jnp.pad(flat, (0, size * m - flat.shape[0]))
  part = jax.lax.dynamic_slice_in_dim(padded, jax.lax.axis_index(axes) * size, size)
  return coll.all_gather_tiled(reduce(part), axes, 0)[:flat.shape[0]]


def bucketed_mean(xs: list, axis_name, dense_mean: Callable[[Any, Any], Any],
                  bucket_bytes: Optional[int], flag: Optional[jax.Array] = None) -> tuple:
  """The mean of each of ``xs`` over ``axis_name``, by ``dense_mean(tree, axis_name)``
  (a strategy's dense reduction, which takes a list of arrays).

  ``bucket_bytes``: the cap of one flat buffer, or None to reduce each group's
  leaves as one tuple all-reduce.

  Each flat buffer's all-reduce waits for the one before it (:func:`coll.after`, where
  collectives cross processes on CPUs): left independent, XLA combines small buffers
  back into one tuple all-reduce (one gloo collective per operand again) and may run
  large ones beside each other, whose messages gloo would mix.

  ``flag``: a float scalar to carry as one more element of the first floating-point
  bucket (the non-finite skip's flag, :mod:`commopt._src.finite`): no collective of its
  own.

  Returns:
    ``(means, flag_mean)``: the means in the order of ``xs``, and the mean of ``flag``
    over the workers, or None where no bucket could carry it (or none was given).
  """
  xs = list(xs)
  groups = _groups(xs)
  seat = _seat(xs, groups, flag)
  out: list = [None] * len(xs)
  prev = ()
  for idx in groups:
    if bucket_bytes is None and _model_split(xs[idx[0]])[1] <= 1:
      for i, y in zip(idx, dense_mean([xs[i] for i in idx], axis_name)):
        out[i] = y
      continue
    # Flat buffers; a group the model ranks split is one buffer even without a cap.
    cap = bucket_bytes if bucket_bytes is not None else math.inf
    for run in _chunks(xs, idx, cap, seat):
      parts = [jnp.ravel(xs[i]) for i in run]
      flat = _split_over_model(lambda x: dense_mean(x, axis_name),
                               coll.after(tree.concat_flat(parts), prev))
      prev = flat
      at = 0
      for i in run:
        n = math.prod(xs[i].shape)
        out[i] = flat[at:at + n].reshape(xs[i].shape)
        at += n
  carried = None if seat is None else out.pop(seat)[0].astype(flag.dtype)
  return out, carried
