"""Local SGD: workers step alone and average their parameters, on one level or per axis."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

from commopt._src import base
from commopt.comm import _collectives as coll
from commopt.comm import _plan
from commopt.transforms._compressed_mean import DEFAULT_MIN_SIZE
from commopt.transforms._control import _check_axes, _check_inner
from commopt.transforms._sync._common import (
    _Mode, _advance, _exchange_options, _inner_step, _moved, _reducer, _require_params,
    _to_target_or_local, _wide, _zero_count, is_sync_step, _take_verdict)
from commopt.transforms._sync._diloco import diloco
from commopt.transforms import _global_view


def local_sgd(inner: optax.GradientTransformation, *, axis_name,
              period: Union[int, Mapping[str, int]], warmup_steps: int = 0,
              compressor: Optional[base.Compressor] = None, error_feedback: bool | str = "auto",
              strategy: str = "auto", min_size: int = DEFAULT_MIN_SIZE, seed: int = 0
              ) -> optax.GradientTransformationExtraArgs:
  """Local SGD / post-local SGD: workers step alone and average parameters every ``period`` steps.

  Synchronous for the first ``warmup_steps`` steps (post-local SGD), then
  each worker takes ``period`` steps of ``inner`` on its own gradients and the
  workers average their parameters, optionally through a compressor with
  error feedback (what is averaged is each worker's move since the last
  average). This is :func:`diloco` with the outer optimizer ``sgd(1.0)``,
  the pairing that is stable with any inner optimizer and any compressor
  (:func:`diloco` says why): on a quadratic it converges wherever ``inner``
  does, and an error-feedback residual is applied once, unamplified.

  With ``period=1`` and a linear inner optimizer (SGD, momentum SGD), it is
  synchronous data-parallel training: the mean of the workers' steps is the
  step on the mean gradient.

  **Hierarchical local SGD** on a mesh of several data axes: ``period`` maps
  each axis of ``axis_name`` to its own period, e.g. ``axis_name=("node",
  "local"), period={"local": 4, "node": 16}``. Every 4 steps the workers of
  a node average among themselves, dense (over ``local``, the fast links);
  every 16 all workers average (over ``node`` and every axis with a shorter
  period). The longer period must be a multiple of the shorter, so a wide
  average always falls on a narrow one's step and takes its place. The wide
  average runs as ``compressed_mean``'s ``"hierarchical"`` strategy: dense
  inside the node, ``compressor`` (with ``strategy``) across nodes, so it
  needs a per-leaf compressor. Each level has its own anchor (and the wide
  one its error-feedback residuals); the state is
  :class:`HierarchicalLocalSGDState`.

  Args:
    inner: the workers' optimizer. Unless a period is 1, an averaging step
      (every step of the warm-up) runs its ``update`` twice on the same
      inputs, so that between averages its update fuses into the
      parameters': it must be a function of its inputs (optax's are), and its
      collectives, if any, run twice.
    axis_name: the data axis (or tuple of axes).
    period: steps between averages, at least 1; or ``{axis: period}`` for
      every axis of ``axis_name`` (hierarchical).
    warmup_steps: steps at the start that average every step (over all axes).
    compressor: as in :func:`diloco`.
    error_feedback: as in :func:`diloco`.
    strategy: as in :func:`diloco`.
    min_size: as in :func:`diloco`.
    seed: as in :func:`diloco`.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; state :class:`PeriodicState`
    (:class:`HierarchicalLocalSGDState` with a period per axis).

  References:
    Stich, Local SGD Converges Fast and Communicates Little, ICLR 2019.
    Lin et al., Don't Use Large Mini-Batches, Use Local SGD, ICLR 2020
    (post-local SGD, hierarchical local SGD).
  """
  if isinstance(period, Mapping):
    return _hierarchical_local_sgd(inner, axis_name, period, warmup_steps, compressor,
                                   error_feedback, strategy, min_size, seed)
  return diloco(inner, optax.sgd(1.0), axis_name=axis_name, period=period,
                compressor=compressor, error_feedback=error_feedback, strategy=strategy,
                warmup_steps=warmup_steps, min_size=min_size, seed=seed)


class HierarchicalLocalSGDState(NamedTuple):
  """State of :func:`local_sgd` with a period per axis.

  Attributes:
    count: inner steps so far (int32), the same on every worker.
    syncs: averages so far, at any level (int32).
    level_syncs: averages so far per level, narrowest first (int32 ``[levels]``).
    anchors: per level, narrowest first, the parameters at that level's last
      average (float32 or wider); the last, all workers' average, is the
      global model.
    inner_state: the inner optimizer's state (per worker).
    reducer_states: per level, the :func:`~commopt.compressed_mean` state of
      its average (the wide level's error-feedback residuals per worker; the
      node level averages dense).
  """
  count: jax.Array
  syncs: jax.Array
  level_syncs: jax.Array
  anchors: tuple
  inner_state: Any
  reducer_states: tuple


def sync_levels(axis_name, period: Mapping, fn: str = "local_sgd"
                ) -> list[tuple[tuple[str, ...], int]]:
  """``[(axes, period), ...]`` narrowest first: each level averages over its axis and every
  axis with a shorter period, the axes ordered ``(slow, fast)`` (longer period first; equal
  periods in ``axis_name``'s order)."""
  _check_axes(axis_name, fn)
  names = base.axis_names(axis_name)
  if axis_name is None or len(names) > 2 or set(period) != set(names):
    raise ValueError(f"{fn}: a `period` per axis needs `axis_name` to be one axis or a pair "
                     f"such as ('node', 'local') and one entry per axis, got axis_name="
                     f"{axis_name!r} and keys {sorted(period, key=str)!r}.")
  periods = {a: base.check_positive_int(f"period[{a!r}]", period[a], fn=fn) for a in names}
  if max(periods.values()) % min(periods.values()):
    raise ValueError(f"{fn}: the longer period must be a multiple of the shorter, so a wide "
                     f"average falls on a narrow one's step and takes its place; got "
                     f"{periods!r}.")
  order = sorted(names, key=lambda a: -periods[a])          # stable: equal periods keep order
  return [(tuple(a for a in order if periods[a] <= p), p)
          for p in sorted(set(periods.values()))]


def _hierarchical_local_sgd(inner, axis_name, period, warmup_steps, compressor, error_feedback,
                            strategy, min_size, seed):
  """:func:`local_sgd` with ``period`` a mapping: the options checked, one reducer per level."""
  fn = "local_sgd"
  inner = _check_inner(inner, fn)
  levels = sync_levels(axis_name, period, fn)
  warmup_steps = base.check_int("warmup_steps", warmup_steps, fn=fn, minimum=0)
  error_feedback, min_size, seed = _exchange_options(fn, error_feedback, min_size, seed)

  def level_reducer(i, axes):
    if len(axes) > 1:          # hierarchical: dense inside the fast axis, compressed across
      return _reducer(fn, axes, compressor, error_feedback, strategy, min_size, seed + i)
    if len(levels) > 1:        # inside a node, over its fast links: dense
      return _reducer(fn, axes[0], None, False, "auto", min_size, seed + i)
    return _reducer(fn, axes[0], compressor, error_feedback, strategy, min_size, seed + i)

  mode = _HierarchicalLocalSGD(
      fn=fn, axis_name=axis_name, inner=inner, levels=tuple(levels), warmup_steps=warmup_steps,
      reducers=tuple(level_reducer(i, axes) for i, (axes, _) in enumerate(levels)))
  return _plan.with_planner(_global_view.accepting(
                                optax.GradientTransformationExtraArgs(mode.init, mode.update),
                                axis_name, fn),
                            mode.planner, mode.step_planner,
                            lambda state: mode.level_at(state.count) >= 0)


@dataclasses.dataclass(frozen=True, eq=False)
class _HierarchicalLocalSGD(_Mode):
  """Hierarchical :func:`local_sgd`'s checked options, its ``init``, ``update`` and planners.

  ``levels`` are :func:`sync_levels`' ``(axes, period)``, narrowest first,
  and ``reducers`` their averages' :func:`~commopt.compressed_mean`.
  """
  levels: tuple
  reducers: tuple
  warmup_steps: int

  @property
  def averages_every_step(self) -> bool:
    """Whether some level averages after every step (a period of 1)."""
    return any(p == 1 for _, p in self.levels)

  @property
  def top(self) -> int:
    """The widest level: all workers'."""
    return len(self.levels) - 1

  def level_at(self, count):
    """The widest level that averages after inner step ``count`` (-1: none); traced or not."""
    out = -1
    for i, (_, p) in enumerate(self.levels):  # during the warm-up every level is due: the widest
      d = is_sync_step(count, p, self.warmup_steps)
      out = jnp.where(d, i, out) if isinstance(d, jax.Array) else (i if d else out)
    return out

  def init(self, params) -> HierarchicalLocalSGDState:
    anchor = jax.tree.map(_wide, params)
    return HierarchicalLocalSGDState(
        count=_zero_count(), syncs=_zero_count(),
        level_syncs=jnp.zeros([len(self.levels)], jnp.int32),
        anchors=(anchor,) * len(self.levels), inner_state=self.inner.init(params),
        reducer_states=tuple(r.init(anchor) for r in self.reducers))

  def update(self, updates, state: HierarchicalLocalSGDState, params=None, **extra_args):
    """The inner step on every worker, then the average of the widest level that is due."""
    _require_params(self.fn, params)
    # data_parallel's agreed skip: false where every worker skips
    go, extra_args = _take_verdict(extra_args, self.axis_name)
    coll.check_input(self.fn, updates, self.axis_name)
    local, inner_state = self.inner.update(updates, state.inner_state, params, **extra_args)
    level = self.level_at(state.count) if go is None else jnp.where(
        go, self.level_at(state.count), -1)
    if self.averages_every_step:
      # The move passes the conditionals: the inner step is taken once.
      source = _moved(params, local)
    else:
      # As diloco's: only the anchors and the exchanges' state pass the conditionals, so
      # between averages the inner step's update fuses into the parameters' update; an
      # average takes the inner step again, after the first.
      source = coll.after((updates, state.inner_state), local)
    anchors, reducer_states = self._from_level(
        level, self.top, params, extra_args, (source, state.anchors, state.reducer_states))
    # After an average every anchor up to its level is the mean: anchors[0] is the target.
    update = _to_target_or_local(level >= 0, anchors[0], params, local)
    hit = (jnp.arange(len(self.levels)) == level).astype(jnp.int32)
    count, inner_state = _advance(go, state.count, inner_state, state.inner_state,
                                  self.axis_name)
    return update, HierarchicalLocalSGDState(
        count=count,
        syncs=state.syncs + (level >= 0).astype(jnp.int32),
        level_syncs=state.level_syncs + hit, anchors=anchors, inner_state=inner_state,
        reducer_states=reducer_states)

  def _from_level(self, level, i, params, extra_args, operands):
    """Average at the widest level from ``i`` down that is ``level``; none: the anchors and
    the exchanges' state as they are."""
    if i < 0:
      _, anchors, reducer_states = operands
      return anchors, reducer_states
    return coll.cond(level == i, functools.partial(self._average, i, params, extra_args),
                     functools.partial(self._from_level, level, i - 1, params, extra_args),
                     operands)

  def _average(self, i, params, extra_args, operands):
    """Level i averages: its anchor and every narrower one become the level's mean. Unless
    some level averages every step, the inner step is taken again here, from its operands
    (so the inner optimizer runs twice on an average, and on every step of the warm-up)."""
    source, anchors, reducer_states = operands
    if self.averages_every_step:
      moved = source
    else:
      updates, inner_state = source
      moved, _ = _inner_step(self.inner, updates, inner_state, params, extra_args)
    delta = jax.tree.map(lambda a, m: a - m, anchors[i], moved)
    mean, red = self.reducers[i].update(delta, reducer_states[i])
    new = jax.tree.map(lambda a, d: a - d, anchors[i], mean)
    return (tuple(new if j <= i else a for j, a in enumerate(anchors)),
            tuple(red if j == i else r for j, r in enumerate(reducer_states)))

  def _plan_level(self, i, params, workers):
    """Level ``i``'s collectives, from the worker counts of ``axis_name``'s axes."""
    counts = _plan.axis_sizes(self.axis_name, workers)
    sizes = tuple(counts[a] for a in self.levels[i][0])
    return _plan.planner_of(self.reducers[i])(params, sizes if len(sizes) > 1 else sizes[0])

  def planner(self, params, workers):
    """What the widest average sends."""
    return self._plan_level(self.top, params, workers)

  def step_planner(self, params, workers, step):
    """What the average due at ``step`` sends (nothing between averages)."""
    i = self.level_at(step)
    return [] if i < 0 else self._plan_level(i, params, workers)
