"""Recording the collectives a program runs, device by device (:func:`commopt.wire.recording`).

Each collective of :mod:`commopt.comm._collectives` calls :func:`_record` while it is
traced; where a :func:`recording` is active, the compiled program reports each run of it
through a host callback.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from commopt._src import compat


class Event(NamedTuple):
  """One collective one device ran (see :class:`Recorder`).

  Attributes:
    kind: ``"all-reduce"``, ``"all-gather"``, ...
    nbytes: bytes the device put in.
    index: the device's position in the map: its linear index over every
      bound axis (the worker index on a 1-D mesh or under one ``vmap``).
    axis: the axis (or tuple of axes) the collective ran over.
  """
  kind: str
  nbytes: int
  index: int
  axis: Any


class Recorder:
  """Collectives that ran, one :class:`Event` per device per collective.

  Filled at run time by the programs traced while :func:`recording` is
  active: a collective inside a branch that does not run records nothing.
  Each device records its own events with its index over every bound axis,
  so on a 2-D mesh (``("data", "model")``, the optimizer manual over both)
  a device's events are its own, once each, and ``axis`` tells the
  data-axis exchange from the gathers inside a model group.
  """

  def __init__(self):
    self.events: list[Event] = []

  def add(self, kind: str, nbytes: int, axis, index) -> None:
    for i in np.ravel(np.asarray(index)):
      self.events.append(Event(kind, nbytes, int(i), axis))

  def of_worker(self, index: int = 0, axis=None) -> list[tuple[str, int]]:
    """The ``(kind, bytes)`` of every collective device ``index`` ran, in order
    (over ``axis`` only, if given)."""
    return [(e.kind, e.nbytes) for e in self.events
            if e.index == index and (axis is None or e.axis == axis)]

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
  bound = compat.bound_axis_names()
  device = jax.lax.axis_index(bound if bound else axis_name)
  jax.debug.callback(functools.partial(_RECORDERS[-1].add, kind, nbytes, axis_name), device)
