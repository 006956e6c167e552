"""Communication plans: which collectives a reduction runs, and their bytes.

One ring model for every byte count in commopt: :mod:`commopt.wire` reads
collectives out of compiled HLO with it, and each reduction strategy predicts
its own collectives with it, so a plan and an audit can be compared entry by
entry.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import jax
import numpy as np

KINDS = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute",
         "collective-broadcast")


def ring_sent_bytes(kind: str, contributed: float, n: int) -> float:
  """Bytes one of ``n`` workers sends for a collective it contributes ``contributed`` bytes to.

  The ring model: an all-reduce sends ``2(n-1)/n`` of its input, an
  all-gather ``n-1`` copies of its contribution, an all-to-all and a
  reduce-scatter ``(n-1)/n`` of their input.
  """
  if kind not in KINDS:
    raise ValueError(f"ring_sent_bytes: `kind` must be one of {KINDS}, got {kind!r}.")
  if kind == "collective-permute":
    return float(contributed)
  if n <= 1:
    return 0.0
  if kind == "all-reduce":
    return 2 * (n - 1) * contributed / n
  if kind == "all-gather":
    return (n - 1) * contributed
  return (n - 1) * contributed / n


class Planned(NamedTuple):
  """One collective a reduction will run for one leaf.

  Attributes:
    leaf: the leaf's path (``jax.tree_util.keystr``).
    kind: ``"all-reduce"``, ``"all-gather"``, ``"all-to-all"`` or ``"reduce-scatter"``.
    axis: the mesh axis it runs over.
    group_size: workers on that axis.
    contributed_bytes: bytes one worker puts in.
    sent_bytes: bytes one worker sends, by :func:`ring_sent_bytes`.
    packed: whether the bytes are a compressed payload (else dense floats).
  """
  leaf: str
  kind: str
  axis: str
  group_size: int
  contributed_bytes: int
  sent_bytes: float
  packed: bool


def planned(leaf: str, kind: str, axis: str, n: int, contributed: int, packed: bool) -> Planned:
  return Planned(leaf=leaf, kind=kind, axis=axis, group_size=n,
                 contributed_bytes=int(contributed),
                 sent_bytes=ring_sent_bytes(kind, contributed, n), packed=packed)


# ---------------------------------------------------------------------------
# Planners: each reducing transform registers how to predict its collectives.

_PLANNERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


_STEP_PLANNERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def with_planner(tx, planner, step_planner=None):
  """Registers ``planner(params, workers) -> [Planned]`` for transform ``tx``; returns ``tx``.

  ``workers`` counts the workers on the transform's axis (an int), or on each
  of its axes (a tuple, see :func:`axis_sizes`). :func:`commopt.wire.comm_plan`
  looks the planner up by ``tx.init``.

  A transform that does not exchange the same thing every step (the
  synchronisation modes) also registers ``step_planner(params, workers, step)
  -> [Planned]``: what runs at its 0-based ``step`` (nothing on a step without
  an exchange). Without one, every step runs ``planner``'s collectives.
  """
  _PLANNERS[tx.init] = planner
  if step_planner is not None:
    _STEP_PLANNERS[tx.init] = step_planner
  return tx


def _lookup(table, tx):
  init = getattr(tx, "init", None)
  try:
    return table.get(init)
  except TypeError:
    return None


def planner_of(tx):
  """The planner registered for ``tx`` (see :func:`with_planner`), or None."""
  return _lookup(_PLANNERS, tx)


def step_planner_of(tx):
  """The per-step planner registered for ``tx`` (see :func:`with_planner`), else one that
  plans ``planner_of(tx)``'s collectives on every step; None for an unregistered ``tx``."""
  planner = planner_of(tx)
  if planner is None:
    return None
  return _lookup(_STEP_PLANNERS, tx) or (lambda params, workers, step: planner(params, workers))


def axis_sizes(axis_name, workers) -> dict:
  """``{axis: workers}`` for ``axis_name`` (a name or tuple) and ``workers`` (an int or tuple)."""
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  counts = workers if isinstance(workers, tuple) else (workers,)
  if len(names) != len(counts) or any(
      isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
    raise ValueError(
        f"comm_plan: `workers` must give one count >= 1 per axis of {axis_name!r} (an int "
        f"for one axis, a tuple for several), got {workers!r}.")
  return dict(zip(names, counts))


def total_workers(sizes: dict) -> int:
  out = 1
  for n in sizes.values():
    out *= n
  return out


def leaf_plans(params, sizes: dict, axis_name, compressed_plan, dense_plan=None) -> list:
  """One entry per collective: ``compressed_plan(where, leaf)`` for leaves it takes, else dense.

  ``compressed_plan`` returns a list of :class:`Planned` for a leaf it
  compresses, or None for a leaf sent dense: ``dense_plan(where, nbytes,
  axis_name, sizes)`` then gives its collectives (default: one all-reduce of
  the leaf over every axis).
  """
  entries = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    where = jax.tree_util.keystr(path)
    got = compressed_plan(where, leaf)
    if got is None:
      nbytes = int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
      got = (dense_plan(where, nbytes, axis_name, sizes) if dense_plan is not None else
             [planned(where, "all-reduce", axis_name, total_workers(sizes), nbytes, packed=False)])
    entries += got
  return entries


def gather_plan(leaf: str, axis_name, sizes: dict, nbytes: int, packed: bool) -> list:
  """An all-gather of ``nbytes`` per worker over ``axis_name``, as :func:`all_gather` runs it.

  Over a tuple of axes the gather runs one axis at a time, the last first,
  each contributing what the previous one gathered.
  """
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  entries = []
  for name in reversed(names):
    entries.append(planned(leaf, "all-gather", name, sizes[name], nbytes, packed))
    nbytes *= sizes[name]
  return entries
