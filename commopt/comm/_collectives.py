"""Collectives over a named axis that work under shard_map, vmap and locally.

The only module of commopt that calls JAX's collectives (``jax.lax.psum``,
``all_gather``, ``all_to_all``, ...); everything else goes through these
wrappers (``tests/test_layering.py`` checks it).

``axis_name=None`` means one local worker: every collective is the identity.
Inside ``jax.shard_map`` with ``check_vma=True`` the gathered payloads are
typed invariant, so a reduced value can leave the map replicated.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from commopt._src import compat
from commopt._src.vma import vary, vary_like, varying_axes  # noqa: F401  (re-exported)


class Recorder:
  """Collectives that ran, as ``(kind, bytes one worker puts in, worker index)`` events.

  Filled at run time by the programs traced while :func:`recording` is
  active: a collective inside a branch that does not run records nothing.
  """

  def __init__(self):
    self.events: list[tuple[str, int, int]] = []

  def add(self, kind: str, nbytes: int, index) -> None:
    for i in np.ravel(np.asarray(index)):
      self.events.append((kind, nbytes, int(i)))

  def of_worker(self, index: int = 0) -> list[tuple[str, int]]:
    """The ``(kind, bytes)`` of every collective worker ``index`` ran, in order."""
    return [(k, b) for k, b, i in self.events if i == index]

  def clear(self) -> None:
    self.events.clear()


_RECORDERS: list[Recorder] = []


@contextlib.contextmanager
def recording():
  """Programs traced inside record each collective of this module when it runs."""
  rec = Recorder()
  _RECORDERS.append(rec)
  try:
    yield rec
  finally:
    _RECORDERS.remove(rec)


def _record(kind: str, tree, axis_name) -> None:
  if not _RECORDERS or axis_name is None:
    return
  nbytes = sum(int(np.prod(jnp.shape(x))) * jnp.result_type(x).itemsize
               for x in jax.tree.leaves(tree))
  jax.debug.callback(functools.partial(_RECORDERS[-1].add, kind, nbytes),
                     jax.lax.axis_index(axis_name))


def bound_axis_size(axis_name) -> Optional[int]:
  """Workers on ``axis_name`` (a name or tuple of names) if it is bound here, else None.

  Bound means: inside ``jax.shard_map`` over that axis or ``jax.vmap(...,
  axis_name=...)``. A transform's ``init`` uses it to size per-worker chunks
  when it is called inside the mapped context (as :func:`~commopt.data_parallel`
  and :mod:`commopt.testing` do) and to fall back to whole-leaf sizes otherwise.
  """
  if axis_name is None:
    return None
  try:
    return int(jax.lax.psum(1, axis_name))
  except NameError:
    return None


def cond(pred, true_fn, false_fn, *operands):
  """``lax.cond`` whose branch outputs are typed varying over the same axes.

  Inside ``shard_map`` a branch that passes state through unchanged and one
  that updates it (per-worker residuals, accumulated gradients) return
  different varying-axis types, which ``lax.cond`` rejects. Each output leaf
  is cast to the union of the two branches' varying axes. ``pred`` must be
  the same on every worker whenever a branch communicates (a counter, or a
  flag that was itself reduced over the axis), else workers deadlock.
  """
  t = jax.eval_shape(true_fn, *operands)
  f = jax.eval_shape(false_fn, *operands)
  if jax.tree.structure(t) != jax.tree.structure(f):
    raise ValueError(
        f"cond: the branches return different structures: {jax.tree.structure(t)} and "
        f"{jax.tree.structure(f)}.")
  axes = jax.tree.map(lambda a, b: tuple(sorted(varying_axes(a) | varying_axes(b))), t, f)

  def joined(fn):
    def branch(*ops):
      return jax.tree.map(lambda x, ax: vary(x, ax), fn(*ops), axes)
    return branch

  return jax.lax.cond(pred, joined(true_fn), joined(false_fn), *operands)


def axis_size(axis_name: Optional[str]) -> int:
  """Number of workers on ``axis_name`` (1 when it is None)."""
  if axis_name is None:
    return 1
  return int(jax.lax.psum(1, axis_name))


def axis_index(axis_name: Optional[str]):
  if axis_name is None:
    return jnp.int32(0)
  return jax.lax.axis_index(axis_name)


def psum(tree: Any, axis_name: Optional[str]) -> Any:
  """All-reduce sum of every leaf (identity locally)."""
  if axis_name is None:
    return tree
  _record("all-reduce", tree, axis_name)
  return jax.lax.psum(tree, axis_name)


def mean_factors(n: int) -> tuple[float, float]:
  """``(pre, post)`` for a mean over ``n`` workers that cannot overflow: ``psum(x · pre) / post``.

  ``pre = 2^-k`` with ``2^k`` the least power of two ``>= n``, and
  ``post = n · pre`` in ``(1/2, 1]``. Every partial sum of ``x · pre`` is at
  most ``n · pre ≤ 1`` times the largest ``|x|``, so a sum that runs in the
  values' own dtype (a 16-bit all-reduce on a GPU) or is rounded back to it
  (XLA:CPU widens it to float32) stays finite whenever the values are, and
  the mean is finite whenever it is representable. Both factors are exact,
  so the collective's result is bit for bit ``psum(x) / n`` wherever that is
  finite and ``x · pre`` is normal; the compiler may fuse the scaling into
  the computation of ``x`` and round that differently (a training run then
  differs from the unscaled one in its last bits). The wire carries ``x``'s
  dtype, at its size.
  """
  k = max(int(n) - 1, 0).bit_length()
  return 2.0 ** -k, n / 2.0 ** k


def _is_float(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def pmean(x: jax.Array, axis_name: Optional[str]) -> jax.Array:
  """All-reduce mean in ``x``'s dtype (identity locally).

  Floating-point ``x`` is summed pre-scaled (:func:`mean_factors`), so a
  mean of finite values that is representable comes out finite, also in
  16 bits, with nothing widened on the wire.
  """
  if axis_name is None:
    return x
  _record("all-reduce", x, axis_name)
  n = axis_size(axis_name)
  if not _is_float(x) or n == 1:
    return (jax.lax.psum(x, axis_name) / n).astype(x.dtype)
  pre, post = mean_factors(n)
  dtype = jnp.result_type(x)
  total = jax.lax.psum(x * jnp.asarray(pre, dtype), axis_name)
  return (total / jnp.asarray(post, dtype)).astype(dtype)


def all_to_all(x: jax.Array, axis_name: Optional[str]) -> jax.Array:
  """Row ``j`` of ``x`` (``[N, ...]``) goes to worker ``j``; row ``w`` of the result came from worker ``w``.

  Locally (``axis_name=None``) ``x`` must have one row and is returned as it is.
  """
  if axis_name is None:
    return x
  _record("all-to-all", x, axis_name)
  return jax.lax.all_to_all(x, axis_name, 0, 0, tiled=False)


def psum_scatter(x: jax.Array, axis_name: Optional[str]) -> jax.Array:
  """Sum over the axis of ``x`` (``[N·c]``), worker ``j`` keeping coordinates ``j·c`` to ``(j+1)·c``.

  Locally it is ``x`` itself.
  """
  if axis_name is None:
    return x
  _record("reduce-scatter", x, axis_name)
  return jax.lax.psum_scatter(x, axis_name, scatter_dimension=0, tiled=True)


def all_gather(tree: Any, axis_name) -> Any:
  """Stacks every worker's leaves on a new leading axis.

  Locally the leading axis has size 1. Under ``shard_map`` the result is typed
  invariant when the input varies over the axis, so a value computed from it
  may be returned replicated. Over a tuple of axes (every device of a 2-D
  mesh) the leaves are gathered one axis at a time, the last first, and the
  leading axes merged: worker ``i`` of the result is the one whose
  ``jax.lax.axis_index(axis_name)`` is ``i``, and the result is invariant over
  all of them (one gather over the tuple would leave it varying).

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from commopt.comm import all_gather
    >>> x = jnp.arange(6.0).reshape(2, 3)
    >>> g = jax.vmap(jax.vmap(lambda v: all_gather(v, ("a", "b")), axis_name="b"),
    ...              axis_name="a")(x)
    >>> g[1, 2].tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
  """
  if axis_name is None:
    return jax.tree.map(lambda x: x[None], tree)
  if isinstance(axis_name, (tuple, list)):
    for name in reversed(axis_name):
      tree = all_gather(tree, name)
    k = len(axis_name)
    return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[k:]), tree)

  def gather(x):
    _record("all-gather", x, axis_name)
    if axis_name in varying_axes(x):
      return compat.all_gather_invariant(x, axis_name)
    return jax.lax.all_gather(x, axis_name)

  return jax.tree.map(gather, tree)


def all_gather_tiled(x, axis_name, axis: int):
  """Concatenates every worker's ``x`` along ``axis``; typed invariant when ``x`` varies."""
  if axis_name is None:
    return x
  _record("all-gather", x, axis_name)
  if axis_name in varying_axes(x):
    return compat.all_gather_invariant(x, axis_name, axis=axis, tiled=True)
  return jax.lax.all_gather(x, axis_name, axis=axis, tiled=True)
