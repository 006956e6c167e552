"""Dense leaves reduced together: one all-reduce per bucket, and scalars that ride along.

A tree of leaves averaged leaf by leaf is one all-reduce per leaf in the
program. How that runs depends on the platform, measured with
``benchmarks/bench_base.py``:

- in one process (XLA:CPU or XLA:GPU), the compiler's all-reduce combiner
  merges them into one tuple all-reduce, and concatenating the leaves into a
  flat buffer first only adds two copies (the plain JAX step took 1.26-1.36x
  as long with one flat buffer on 4 CPU devices);
- across processes, XLA:CPU runs a tuple all-reduce as one gloo collective
  per operand (8 leaves: 48.6 ms against 12.6 ms for one flat buffer of the
  same bytes), so there one flat buffer per dtype is the faster layout, as
  PyTorch DDP's buckets are.

:func:`mean` does both: ``bucket_bytes`` picks flat buffers of at most that
many bytes (``"auto"``: :func:`flat_by_default`), else one all-reduce over the
tuple of leaves. Leaves are grouped by dtype and by the mesh axes they vary
over, so a bucket never mixes values typed differently.

**Riders.** A scalar that must be summed over the same axes, such as the
agreed non-finite flag of :func:`commopt.transforms.apply_if_finite`, can
ride inside the first floating-point bucket as one more element instead of
costing a collective (and on one process a rendezvous of every device) of its
own: :func:`ride` offers it while the wrapped update is traced, :func:`mean`
takes it, and the offerer reads the reduced value afterwards
(:attr:`Rider.result`, None when nothing took it). A rider is taken only at
the trace it was offered in (never inside a ``lax.cond`` branch or a
``scan`` body of the wrapped update) and only by a reduction over exactly its
axes.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from commopt._src import base, compat
from commopt.comm import _collectives as coll

DEFAULT_BUCKET_BYTES = 25 * 2**20
"""The largest flat buffer :func:`mean` builds by default (PyTorch DDP's bucket size)."""


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


# -- riders -------------------------------------------------------------------------------

@dataclasses.dataclass
class Rider:
  """A scalar offered to the next dense reduction over ``axes`` (see the module).

  Attributes:
    value: the scalar (float32) each worker contributes; a mean over the axes
      is what comes back, so only what survives averaging is meaningful
      (e.g. 0 or NaN: the mean is NaN iff some worker's is).
    axes: the mesh axes it must be reduced over, as a frozenset.
    trace: the trace it was offered in.
    result: the reduced value once a reduction took it, else None.
  """
  value: jax.Array
  axes: frozenset
  trace: Any
  result: Optional[jax.Array] = None


_RIDERS: contextvars.ContextVar = contextvars.ContextVar("commopt_riders", default=())


@contextlib.contextmanager
def ride(value, axis_name):
  """Offers ``value`` to the dense reductions traced inside; yields the :class:`Rider`."""
  rider = Rider(jnp.asarray(value, jnp.float32), frozenset(_names(axis_name)),
                compat.trace_state())
  token = _RIDERS.set(_RIDERS.get() + (rider,))
  try:
    yield rider
  finally:
    _RIDERS.reset(token)


def _names(axis_name) -> tuple:
  if axis_name is None:
    return ()
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _take(axis_name) -> Optional[Rider]:
  """The innermost rider over exactly ``axis_name``'s axes offered at this trace, if any."""
  riders = _RIDERS.get()
  if not riders:
    return None
  rider = riders[-1]
  if (rider.result is not None or rider.axes != frozenset(_names(axis_name))
      or rider.trace != compat.trace_state()):
    return None
  return rider


# -- the reduction ------------------------------------------------------------------------

def _groups(xs: list) -> list[list[int]]:
  """Indices of ``xs`` grouped by dtype and varying axes, in order of first appearance."""
  groups: dict = {}
  for i, x in enumerate(xs):
    groups.setdefault((jnp.dtype(x.dtype), coll.varying_axes(x)), []).append(i)
  return list(groups.values())


def _chunks(xs: list, idx: list[int], cap: int) -> list[list[int]]:
  """``idx`` cut, in order, into runs of at most ``cap`` bytes (a larger leaf alone)."""
  out, run, size = [], [], 0
  for i in idx:
    nbytes = math.prod(xs[i].shape) * jnp.dtype(xs[i].dtype).itemsize
    if run and size + nbytes > cap:
      out.append(run)
      run, size = [], 0
    run.append(i)
    size += nbytes
  if run:
    out.append(run)
  return out


def mean(xs: list, axis_name, dense_mean: Callable[[Any, Any], Any],
         bucket_bytes: Optional[int]) -> list:
  """The mean of each of ``xs`` over ``axis_name``, by ``dense_mean(tree, axis_name)``
  (a strategy's dense reduction, which takes a list of arrays).

  ``bucket_bytes``: the cap of one flat buffer, or None to reduce each group's
  leaves as one tuple all-reduce. A rider over ``axis_name`` (:func:`ride`) is
  taken by the first floating-point group whose leaves vary over no other
  axis.
  """
  out: list = [None] * len(xs)
  rider = _take(axis_name)
  for idx in _groups(xs):
    dtype = jnp.dtype(xs[idx[0]].dtype)
    carry = None
    if (rider is not None and rider.result is None and base.is_float_dtype(dtype)
        and coll.varying_axes(xs[idx[0]]) <= rider.axes):
      carry = coll.vary_like(rider.value.astype(dtype), xs[idx[0]])
    if bucket_bytes is None:
      sent = [xs[i] for i in idx] + ([carry] if carry is not None else [])
      got = dense_mean(sent, axis_name)
      for i, y in zip(idx, got):
        out[i] = y
      if carry is not None:
        rider.result = got[-1].astype(jnp.float32)
      continue
    for c, run in enumerate(_chunks(xs, idx, bucket_bytes)):
      parts = [jnp.ravel(xs[i]) for i in run]
      if carry is not None and c == 0:
        parts.append(carry[None])
      flat = dense_mean(jnp.concatenate(parts) if len(parts) > 1 else parts[0], axis_name)
      at = 0
      for i in run:
        n = math.prod(xs[i].shape)
        out[i] = flat[at:at + n].reshape(xs[i].shape)
        at += n
      if carry is not None and c == 0:
        rider.result = flat[at].astype(jnp.float32)
  return out
