"""Periodic synchronisation: local SGD and DiLoCo, with compressed exchanges.

Each worker keeps its own parameters and steps them with the inner optimizer
on its own gradients; every ``period`` steps the workers exchange what they
moved since the last synchronisation (``anchor − local``, the pseudo-gradient),
reduce it through :func:`~commopt.compressed_mean` (any compressor, with error
feedback), and an outer optimizer applies the mean to the anchor, which every
worker then takes as its parameters. Between synchronisations nothing crosses
the axis: the exchange sits in a ``lax.cond`` on the step counter, which is
the same on every worker.

Local SGD is the outer optimizer ``sgd(1.0)``: the new anchor is the mean of
the workers' parameters. DiLoCo's default outer optimizer is Nesterov SGD
(learning rate 0.7, momentum 0.9) for dense exchanges, and ``sgd(1.0)``
where the exchange keeps an error-feedback residual, whose memory then
stands in for the outer momentum (SparseLoCo); :func:`diloco` says which
pairings of inner and outer optimizer are stable, and why.

The transforms output per-worker updates, so the parameters differ between
workers between synchronisations: run them under
``commopt.data_parallel(..., local_params=True)``, under ``jax.vmap`` over the
workers, or in your own ``shard_map`` with per-worker parameters.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

from commopt._src import base, feedback
from commopt.comm import _collectives as coll
from commopt.comm import _plan
from commopt.transforms._compressed_mean import DEFAULT_MIN_SIZE, compressed_mean
from commopt.transforms._control import _check_axes, _check_inner


class PeriodicState(NamedTuple):
  """State of :func:`diloco` and :func:`local_sgd`.

  Attributes:
    count: inner steps so far (int32), the same on every worker.
    syncs: synchronisations so far (int32).
    anchor: the parameters at the last synchronisation (replicated), float32
      or wider.
    inner_state: the inner optimizer's state (per worker).
    reducer_state: the state of the :func:`~commopt.compressed_mean` that
      averages the pseudo-gradients (its error-feedback residuals per worker).
    outer_state: the outer optimizer's state (replicated).
  """
  count: jax.Array
  syncs: jax.Array
  anchor: Any
  inner_state: Any
  reducer_state: Any
  outer_state: Any


def _wide(x):
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def is_sync_step(count, period: int, warmup_steps: int):
  """Whether inner step ``count`` (0-based) ends with a synchronisation."""
  after = count - warmup_steps
  return (count < warmup_steps) | ((after + 1) % period == 0)


def _exchange_options(fn: str, error_feedback, min_size, seed) -> tuple[bool | str, int, int]:
  """The options every mode hands to its exchange, checked: 'auto' or a bool, two integers."""
  return (feedback.check_error_feedback(error_feedback, fn),
          base.check_int("min_size", min_size, fn=fn, minimum=0),
          base.check_int("seed", seed, fn=fn))


def _reducer(fn: str, axis_name, compressor, error_feedback, strategy, min_size, seed):
  """The compressed_mean that averages what the workers exchange (dense without a compressor)."""
  _check_axes(axis_name, fn)
  error_feedback, min_size, seed = _exchange_options(fn, error_feedback, min_size, seed)
  if axis_name is None:
    raise ValueError(f"{fn}: `axis_name` must name the data axis, got None.")
  from commopt.compressors import make
  inner_strategy = "auto"
  if isinstance(axis_name, tuple) and len(axis_name) == 2 and strategy != "hierarchical":
    # (slow, fast): dense inside the fast axis, `strategy` across the slow one.
    if compressor is not None and not base.is_stateless_per_leaf(compressor):
      raise ValueError(
          f"{fn}: over a pair of axes {axis_name!r} the exchange is reduced hierarchically "
          f"(dense inside the fast axis, compressed across the slow one), which encodes "
          f"chunks of each leaf on their own; {compressor.name} keeps per-leaf state, runs its "
          "own protocol or selects over the whole tree. Use a per-leaf compressor (e.g. "
          "commopt.scaled_sign(), commopt.top_k(0.01)) or one data axis.")
    strategy, inner_strategy = "hierarchical", strategy
  return compressed_mean(make("identity") if compressor is None else compressor, axis_name,
                         error_feedback=error_feedback if compressor is not None else False,
                         strategy=strategy, inner_strategy=inner_strategy, min_size=min_size,
                         seed=seed)


def _keeps_residual(compressor, error_feedback, fn: str) -> bool:
  """Whether the exchange keeps an error-feedback residual: a lossy compressor whose error
  :func:`~commopt.compressed_mean` feeds back (what is not a compressor is left to it)."""
  if not isinstance(compressor, base.Compressor):
    return False
  return feedback.feedback_compressor(compressor, error_feedback, fn)[1]


def _outer(outer, fn: str, compressor=None, error_feedback=False):
  """The outer optimizer. By default DiLoCo's Nesterov SGD (learning rate 0.7, momentum 0.9),
  and plain ``sgd(1.0)`` where the exchange keeps an error-feedback residual (SparseLoCo's
  outer step: the residual accumulates pseudo-gradients as the outer momentum would)."""
  if outer is None:
    outer = (optax.sgd(1.0) if _keeps_residual(compressor, error_feedback, fn)
             else optax.sgd(0.7, momentum=0.9, nesterov=True))
  return _check_inner(outer, fn)


def diloco(inner: optax.GradientTransformation, outer: Optional[optax.GradientTransformation] = None,
           *, axis_name, period: int, compressor: Optional[base.Compressor] = None,
           error_feedback: bool | str = "auto", strategy: str = "auto", warmup_steps: int = 0,
           min_size: int = DEFAULT_MIN_SIZE, seed: int = 0) -> optax.GradientTransformationExtraArgs:
  """DiLoCo: ``period`` inner steps per worker, then an outer step on the mean pseudo-gradient.

  Per worker, with local parameters ``θᵢ`` and the anchor ``θ`` (the
  parameters at the last synchronisation)::

    θᵢ ← θᵢ + inner(gᵢ)                          every step, no communication
    every period steps:
      Δ = mean_i C(θ − θᵢ)                       compressed_mean, with error feedback
      θ ← θ + outer(Δ);  θᵢ ← θ                  the same on every worker

  Before ``warmup_steps`` every step synchronises (post-local SGD's warm-up).

  The default outer optimizer depends on what is exchanged. Dense (no
  compressor, a lossless one, or no residual kept): DiLoCo's Nesterov SGD,
  learning rate 0.7, momentum 0.9, which moves the anchor by up to
  ``0.7/(1 − 0.9) = 7`` times a pseudo-gradient that keeps its direction.
  With an error-feedback residual (e.g. ``top_k`` under the default
  ``error_feedback="auto"``): ``optax.sgd(1.0)``, as SparseLoCo (Sarfi et
  al., 2025, arXiv:2508.15706). The residual holds what was not sent, about
  ``1/ratio`` synchronisations' worth for ``top_k(ratio)``, and releases it
  late and in bursts: it already accumulates past pseudo-gradients as an
  outer momentum would, and a Nesterov step on top amplifies the late bursts.

  Which pairings are stable:

  - ``outer=optax.sgd(1.0)`` (local SGD) with any inner optimizer, dense or
    compressed: the anchor moves by the workers' mean move, and on a
    quadratic the whole is stable for exactly the curvatures the inner
    optimizer is stable for; a residual is applied once, unamplified.
  - Nesterov 0.7/0.9 over AdamW, as in DiLoCo: Adam moves each coordinate
    by about its learning rate per step, so a period's move stays small.
    Over a compressor with error feedback (passed explicitly) it trained
    too, and faster than ``sgd(1.0)`` in the guide's measurements.
  - Not Nesterov 0.7/0.9 over momentum SGD: the inner momentum, carried
    across synchronisations, compounds with the outer one. On a quadratic,
    over ``sgd(0.05, momentum=0.9)`` with ``period=8`` the inner optimizer
    is stable for curvatures below 76 and the whole only below 59; over
    ``sgd(0.01, momentum=0.95)`` curvatures from 0.1 to 5 already diverge.
    On an MLP with fresh minibatches the first diverged, dense and
    compressed alike. Pass ``optax.sgd(1.0)`` there, or a smaller outer
    momentum (``optax.sgd(0.7, momentum=0.5, nesterov=True)``).

  The guide's "Synchronising less often" page has the measurements.

  Args:
    inner: the workers' optimizer (e.g. ``optax.adamw(...)``), stepped on each
      worker's own gradients; its state is per worker.
    outer: the optimizer of the anchor, fed the mean pseudo-gradient; None
      for ``optax.sgd(1.0)`` where the exchange keeps an error-feedback
      residual, else ``optax.sgd(0.7, momentum=0.9, nesterov=True)``.
    axis_name: the data axis (or tuple of axes).
    period: inner steps between synchronisations (H), at least 1.
    compressor: compresses the pseudo-gradients (e.g. ``commopt.top_k(0.01)``
      as SparseLoCo, ``commopt.int_quant(bits=4)`` as Streaming DiLoCo's
      outer gradients); None sends them dense.
    error_feedback: keep what the compressor did not send (per worker):
      ``"auto"`` (the default), ``True`` or ``False``, as in
      :func:`~commopt.compressed_mean` (a residual for contractive
      compressors such as top-k, none for unbiased ones such as QSGD).
    strategy: :func:`~commopt.compressed_mean`'s reduction.
    warmup_steps: steps at the start that synchronise every step.
    min_size: leaves with fewer elements are exchanged dense.
    seed: the compressor's base key.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` needs
    ``params`` (each worker's own); state :class:`PeriodicState`.

  References:
    Douillard et al., DiLoCo: Distributed Low-Communication Training of
    Language Models, 2023.
  """
  fn = "diloco"
  inner, outer = _check_inner(inner, fn), _outer(outer, fn, compressor, error_feedback)
  reducer = _reducer(fn, axis_name, compressor, error_feedback, strategy, min_size, seed)
  period = base.check_positive_int("period", period, fn=fn)
  warmup_steps = base.check_int("warmup_steps", warmup_steps, fn=fn, minimum=0)

  def init_fn(params):
    anchor = jax.tree.map(_wide, params)
    return PeriodicState(count=jnp.zeros([], jnp.int32), syncs=jnp.zeros([], jnp.int32),
                         anchor=anchor, inner_state=inner.init(params),
                         reducer_state=reducer.init(anchor), outer_state=outer.init(anchor))

  def update_fn(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError(f"{fn}: `update` needs `params` (each worker's own parameters).")
    coll.check_input(fn, updates, axis_name)
    local, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
    moved = jax.tree.map(lambda p, u: _wide(p) + _wide(u), params, local)

    def sync(operands):
      moved, anchor, reducer_state, outer_state = operands
      delta = jax.tree.map(lambda a, m: a - m, anchor, moved)
      mean, reducer_state = reducer.update(delta, reducer_state)
      step, outer_state = outer.update(mean, outer_state, anchor)
      anchor = optax.apply_updates(anchor, step)
      return anchor, anchor, reducer_state, outer_state

    def no_sync(operands):
      moved, anchor, reducer_state, outer_state = operands
      return moved, anchor, reducer_state, outer_state

    target, anchor, reducer_state, outer_state = coll.cond(
        is_sync_step(state.count, period, warmup_steps), sync, no_sync,
        (moved, state.anchor, state.reducer_state, state.outer_state))
    out = jax.tree.map(lambda t, p: (t - _wide(p)).astype(p.dtype), target, params)
    synced = is_sync_step(state.count, period, warmup_steps)
    return out, PeriodicState(count=optax.safe_int32_increment(state.count),
                              syncs=state.syncs + synced.astype(jnp.int32), anchor=anchor,
                              inner_state=inner_state, reducer_state=reducer_state,
                              outer_state=outer_state)

  return _planned(init_fn, update_fn, reducer,
                  lambda step: bool(is_sync_step(step, period, warmup_steps)))


def _planned(init_fn, update_fn, reducer, synced=None):
  """The transform, with :func:`commopt.wire.comm_plan` giving its exchange's collectives:
  what one synchronisation sends, and with ``step``, what runs at that step
  (everything when ``synced(step)``, else nothing; every step without ``synced``)."""
  planner = _plan.planner_of(reducer)
  step_planner = None if synced is None else (
      lambda params, workers, step: planner(params, workers) if synced(step) else [])
  return _plan.with_planner(optax.GradientTransformationExtraArgs(init_fn, update_fn),
                            planner, step_planner)


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
    inner: the workers' optimizer.
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
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
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

  reducers = [level_reducer(i, axes) for i, (axes, _) in enumerate(levels)]
  top = len(levels) - 1

  def level_at(count):
    """The widest level that averages after inner step ``count`` (-1: none); traced or not."""
    out = -1
    for i, (_, p) in enumerate(levels):    # during the warm-up every level is due: the widest
      d = is_sync_step(count, p, warmup_steps)
      out = jnp.where(d, i, out) if isinstance(d, jax.Array) else (i if d else out)
    return out

  def init_fn(params):
    anchor = jax.tree.map(_wide, params)
    return HierarchicalLocalSGDState(
        count=jnp.zeros([], jnp.int32), syncs=jnp.zeros([], jnp.int32),
        level_syncs=jnp.zeros([len(levels)], jnp.int32), anchors=(anchor,) * len(levels),
        inner_state=inner.init(params), reducer_states=tuple(r.init(anchor) for r in reducers))

  def update_fn(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError(f"{fn}: `update` needs `params` (each worker's own parameters).")
    coll.check_input(fn, updates, axis_name)
    local, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
    moved = jax.tree.map(lambda p, u: _wide(p) + _wide(u), params, local)
    level = level_at(state.count)

    def average(i, operands):
      """Level i averages: its anchor and every narrower one become the level's mean."""
      moved, anchors, reducer_states = operands
      delta = jax.tree.map(lambda a, m: a - m, anchors[i], moved)
      mean, red = reducers[i].update(delta, reducer_states[i])
      new = jax.tree.map(lambda a, d: a - d, anchors[i], mean)
      return (new, tuple(new if j <= i else a for j, a in enumerate(anchors)),
              tuple(red if j == i else r for j, r in enumerate(reducer_states)))

    def from_level(i, operands):
      """Average at the widest level from ``i`` down that is due; none: keep the moves."""
      if i < 0:
        moved, anchors, reducer_states = operands
        return moved, anchors, reducer_states
      return coll.cond(level == i, lambda ops: average(i, ops),
                       lambda ops: from_level(i - 1, ops), operands)

    target, anchors, reducer_states = from_level(
        top, (moved, state.anchors, state.reducer_states))
    out = jax.tree.map(lambda t, p: (t - _wide(p)).astype(p.dtype), target, params)
    hit = (jnp.arange(len(levels)) == level).astype(jnp.int32)
    return out, HierarchicalLocalSGDState(
        count=optax.safe_int32_increment(state.count),
        syncs=state.syncs + (level >= 0).astype(jnp.int32),
        level_syncs=state.level_syncs + hit, anchors=anchors, inner_state=inner_state,
        reducer_states=reducer_states)

  planners = [_plan.planner_of(r) for r in reducers]

  def sizes_of(axes, workers):
    """The worker counts of ``axes`` from the counts of ``axis_name``'s axes."""
    counts = _plan.axis_sizes(axis_name, workers)
    got = tuple(counts[a] for a in axes)
    return got if len(got) > 1 else got[0]

  def step_planner(params, workers, step):
    i = level_at(step)
    return [] if i < 0 else planners[i](params, sizes_of(levels[i][0], workers))

  return _plan.with_planner(
      optax.GradientTransformationExtraArgs(init_fn, update_fn),
      lambda params, workers: planners[top](params, sizes_of(levels[top][0], workers)),
      step_planner)


class EASGDState(NamedTuple):
  """State of :func:`easgd`.

  Attributes:
    count: inner steps so far (int32), the same on every worker.
    syncs: elastic exchanges so far (int32).
    centre: the centre variable ``x̃`` (replicated), float32 or wider.
    inner_state: the inner optimizer's state (per worker).
    reducer_state: the :func:`~commopt.compressed_mean` state of the exchange.
  """
  count: jax.Array
  syncs: jax.Array
  centre: Any
  inner_state: Any
  reducer_state: Any


def easgd(inner: optax.GradientTransformation, *, axis_name, alpha: float, period: int = 1,
          beta: Optional[float] = None, compressor: Optional[base.Compressor] = None,
          error_feedback: bool | str = "auto", strategy: str = "auto",
          min_size: int = DEFAULT_MIN_SIZE, seed: int = 0
          ) -> optax.GradientTransformationExtraArgs:
  """Elastic averaging SGD, synchronous all-reduce form: workers tied to a centre by a spring.

  Per worker with parameters ``xᵢ``, the centre ``x̃`` and ``N`` workers, every
  ``period`` (τ) steps::

    xᵢ ← xᵢ + inner(gᵢ) − α (xᵢ − x̃)
    x̃ ← x̃ + β · mean_i C(xᵢ − x̃)             compressed_mean, with error feedback

  with ``gᵢ`` the gradient at the ``xᵢ`` before the step (the paper's equations
  5 and 6; between exchanges, ``xᵢ ← xᵢ + inner(gᵢ)`` alone). ``α = ηρ``
  for a step size η and elasticity ρ; the paper's symmetric choice is
  ``β = N·α`` (the default), for which ``β`` about 0.9 works well.

  Args:
    inner: the workers' optimizer (the paper's: ``optax.sgd(η)``).
    axis_name: the data axis (or tuple of axes).
    alpha: the workers' moving rate α = ηρ towards the centre, in (0, 1].
    period: steps between exchanges (τ), at least 1.
    beta: the centre's moving rate; None for ``N·α``; 0 fixes the centre.
    compressor: how ``xᵢ − x̃`` is averaged, as in :func:`diloco`.
    error_feedback: as in :func:`diloco`.
    strategy: as in :func:`diloco`.
    min_size: as in :func:`diloco`.
    seed: as in :func:`diloco`.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` needs
    ``params``; state :class:`EASGDState`. Run it under
    ``data_parallel(..., local_params=True)``.

  References:
    Zhang, Choromanska and LeCun, Deep Learning with Elastic Averaging SGD,
    NeurIPS 2015.
  """
  fn = "easgd"
  inner = _check_inner(inner, fn)
  reducer = _reducer(fn, axis_name, compressor, error_feedback, strategy, min_size, seed)
  alpha = base.check_number("alpha", alpha, fn=fn, low=0, high=1, high_open=False)
  if beta is not None:
    beta = base.check_number("beta", beta, fn=fn, low=0, low_open=False,
                             what="a number >= 0 (or None)")
  period = base.check_positive_int("period", period, fn=fn)

  def init_fn(params):
    centre = jax.tree.map(_wide, params)
    return EASGDState(count=jnp.zeros([], jnp.int32), syncs=jnp.zeros([], jnp.int32),
                      centre=centre, inner_state=inner.init(params),
                      reducer_state=reducer.init(centre))

  def update_fn(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError(f"{fn}: `update` needs `params` (each worker's own parameters).")
    coll.check_input(fn, updates, axis_name)
    local, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
    b = alpha * coll.axis_size(axis_name) if beta is None else beta

    def sync(operands):
      centre, reducer_state = operands
      diff = jax.tree.map(lambda p, c: _wide(p) - c, params, centre)
      mean, reducer_state = reducer.update(diff, reducer_state)
      pull = jax.tree.map(lambda d: -alpha * d, diff)
      centre = jax.tree.map(lambda c, m: c + b * m, centre, mean)
      return pull, centre, reducer_state

    def no_sync(operands):
      centre, reducer_state = operands
      return jax.tree.map(lambda p: jnp.zeros(p.shape, _wide(p).dtype), params), centre, \
          reducer_state

    synced = is_sync_step(state.count, period, 0)
    pull, centre, reducer_state = coll.cond(synced, sync, no_sync,
                                            (state.centre, state.reducer_state))
    out = jax.tree.map(lambda u, e, p: (_wide(u) + e).astype(p.dtype), local, pull, params)
    return out, EASGDState(count=optax.safe_int32_increment(state.count),
                           syncs=state.syncs + synced.astype(jnp.int32), centre=centre,
                           inner_state=inner_state, reducer_state=reducer_state)

  return _planned(init_fn, update_fn, reducer, lambda step: bool(is_sync_step(step, period, 0)))


STALENESS = ("uniform", "geometric")


class StaleState(NamedTuple):
  """State of :func:`stale`.

  Attributes:
    count: steps so far (int32).
    params: the current parameters ``θₜ`` (replicated: the parameter server's).
    history: the last ``max_staleness + 1`` parameters, a ring buffer with a
      leading axis (``θₜ`` at ``count % (max_staleness + 1)``).
    key: the base key of the staleness draws (raw uint32[2]).
    inner_state: the optimizer's state (replicated: it steps on the mean).
    reducer_state: the :func:`~commopt.compressed_mean` state of the gradients.
  """
  count: jax.Array
  params: Any
  history: Any
  key: jax.Array
  inner_state: Any
  reducer_state: Any


BUDGET_BYTES_PER_VALUE = 8
"""What :func:`stale`'s byte budget pays per coordinate sent: a float32 value and an int32 index."""


def budget_top_k(byte_budget: int, tree, fn: str = "stale") -> base.Compressor:
  """Top-k over the whole of ``tree`` whose payload fits ``byte_budget`` bytes.

  The largest-magnitude coordinates across every leaf, as float32 values and
  int32 indices (8 bytes each), at most ``byte_budget // 8`` of them: the
  ratio is chosen so that the leaves' rounded-up shares add up to no more.
  """
  from commopt.compressors import top_k
  sizes = [base.leaf_size(jnp.shape(x)) for x in jax.tree.leaves(tree)]
  k = byte_budget // BUDGET_BYTES_PER_VALUE
  if k <= len(sizes):
    raise ValueError(
        f"{fn}: `byte_budget` ({byte_budget} bytes) must exceed {BUDGET_BYTES_PER_VALUE} bytes "
        f"(a float32 value and an int32 index) per parameter leaf: the model has "
        f"{len(sizes)} leaves, so at least {BUDGET_BYTES_PER_VALUE * (len(sizes) + 1)} bytes.")
  # Σ ⌈r·sᵢ⌉ < r·Σsᵢ + leaves = k.
  ratio = min(1.0, (k - len(sizes)) / sum(sizes))
  return top_k(ratio, scope="global", value_dtype="float32")


def stale(inner: optax.GradientTransformation, *, axis_name, max_staleness: int,
          distribution: str = "uniform", mean_staleness: Optional[float] = None,
          compressor: Optional[base.Compressor] = None, error_feedback: bool | str = "auto",
          strategy: str = "auto", min_size: int = DEFAULT_MIN_SIZE, seed: int = 0,
          byte_budget: Optional[int] = None) -> optax.GradientTransformationExtraArgs:
  """Stale-synchronous (SSP) and asynchronous (ASP) training, simulated in one SPMD program.

  A parameter server holds ``θₜ``; worker ``i`` computes its gradient at the
  parameters it last read, ``θ_{t−dᵢ}``, with a delay ``dᵢ ≤ s`` drawn per
  worker and step. Each step the server averages the workers' gradients
  (through ``compressor``, with error feedback) and steps ``inner`` on the
  mean: ``θₜ₊₁ = θₜ + inner(mean_i gᵢ(θ_{t−dᵢ}))``. Each worker's parameters
  (under ``data_parallel(..., local_params=True)``) are the stale copy it
  computes its next gradient at; the server's are ``state.params``.

  ``max_staleness=0`` is BSP. A bounded ``s`` is SSP (Ho et al.). ASP has no
  bound; it is simulated with ``distribution="geometric"`` (delays with the
  given ``mean_staleness``) truncated at a large ``max_staleness``, the
  length of the buffer of past parameters kept (``s + 1`` copies).

  With ``byte_budget`` each worker sends at most that many bytes per step,
  the largest entries of its update first (Bösen's bandwidth-managed
  communication): the top coordinates of gradient plus what it held back,
  over the whole model, as float32 values with int32 indices; the rest stays
  in its error-feedback residual and goes out on later steps.

  What this captures: how stale gradients change convergence per step, for
  any optimizer and compressor. What it does not: wall-clock time, a real
  server's queueing or workers of different speeds (delays are drawn, not
  caused), nor the server's own bandwidth.

  Args:
    inner: the server's optimizer, stepped on the mean gradient.
    axis_name: the data axis (or tuple of axes).
    max_staleness: the bound ``s`` on the delay, >= 0.
    distribution: ``"uniform"`` (``dᵢ`` uniform on ``0..s``) or
      ``"geometric"`` (mean ``mean_staleness``, truncated at ``s``).
    mean_staleness: the geometric distribution's mean (> 0).
    compressor: how gradients are averaged, as in :func:`diloco`.
    error_feedback: as in :func:`diloco`.
    strategy: as in :func:`diloco`.
    min_size: as in :func:`diloco`.
    seed: seeds the delays and the compressor.
    byte_budget: bytes each worker may put on the wire per step (its payload,
      before the collective multiplies it), spent on the largest entries of
      its update; the rest is kept (error feedback). At least 8 bytes per
      parameter leaf plus 8. Not with ``compressor``.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; state :class:`StaleState`.

  References:
    Ho et al., More Effective Distributed ML via a Stale Synchronous Parallel
    Parameter Server, NeurIPS 2013.
    Dean et al., Large Scale Distributed Deep Networks, NeurIPS 2012 (ASP).
    Wei et al., Managed Communication and Consistency for Fast Data-Parallel
    Iterative Analytics, SoCC 2015 (Bösen).
  """
  fn = "stale"
  inner = _check_inner(inner, fn)
  if byte_budget is None:
    fixed = _reducer(fn, axis_name, compressor, error_feedback, strategy, min_size, seed)
    reducer_for = lambda tree: fixed
  else:
    byte_budget = base.check_positive_int("byte_budget", byte_budget, fn=fn)
    error_feedback, min_size, seed = _exchange_options(fn, error_feedback, min_size, seed)
    if compressor is not None:
      raise ValueError(f"{fn}: give `byte_budget` or `compressor`, not both: the budget sends "
                       f"the largest entries (a top-k over the model), got compressor "
                       f"{compressor.name!r}.")
    if error_feedback is False:
      raise ValueError(f"{fn}: `byte_budget` keeps what it does not send for later steps and "
                       "needs error_feedback=True (or 'auto').")
    _check_axes(axis_name, fn)
    if not isinstance(axis_name, str):
      raise ValueError(f"{fn}: `byte_budget` selects over the whole model on one data axis; "
                       f"`axis_name` must be one axis name, got {axis_name!r}.")
    reducer_for = lambda tree: _reducer(fn, axis_name, budget_top_k(byte_budget, tree, fn), True,
                                        strategy, 0, seed)
  s = base.check_int("max_staleness", max_staleness, fn=fn, minimum=0)
  base.check_choice("distribution", distribution, STALENESS, fn)
  if mean_staleness is not None:
    base.check_number("mean_staleness", mean_staleness, fn=fn, low=0)
  if distribution == "geometric":
    mean_staleness = base.check_number("mean_staleness", mean_staleness, fn=fn, low=0)
  elif mean_staleness is not None:
    raise ValueError(f"{fn}: `mean_staleness` is for distribution='geometric'; got "
                     f"{mean_staleness!r} with distribution={distribution!r}.")
  slots = s + 1

  def init_fn(params):
    wide = jax.tree.map(_wide, params)
    return StaleState(count=jnp.zeros([], jnp.int32), params=wide,
                      history=jax.tree.map(lambda x: jnp.broadcast_to(x, (slots,) + x.shape),
                                           wide),
                      key=jax.random.key_data(jax.random.key(seed)),
                      inner_state=inner.init(wide), reducer_state=reducer_for(wide).init(wide))

  def delay(key_data, count):
    """This worker's delay for the parameters it reads after step ``count``."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(key_data), count),
                             coll.axis_index(axis_name))
    if distribution == "uniform":
      d = jax.random.randint(key, (), 0, slots)
    else:
      p = 1.0 / (1.0 + mean_staleness)          # failures before a success: mean (1-p)/p
      d = jax.random.geometric(key, p) - 1
    return jnp.minimum(jnp.minimum(d, s), count).astype(jnp.int32)

  def update_fn(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError(f"{fn}: `update` needs `params` (each worker's own, stale, copy).")
    coll.check_input(fn, updates, axis_name)
    mean, reducer_state = reducer_for(updates).update(updates, state.reducer_state)
    step, inner_state = inner.update(mean, state.inner_state, state.params, **extra_args)
    new = optax.apply_updates(state.params, step)
    count = optax.safe_int32_increment(state.count)
    history = jax.tree.map(lambda h, x: h.at[count % slots].set(x), state.history, new)
    read = (count - delay(state.key, count)) % slots
    view = jax.tree.map(lambda h: h[read], history)
    out = jax.tree.map(lambda v, p: (v - _wide(p)).astype(p.dtype), view, params)
    return out, StaleState(count=count, params=new, history=history, key=state.key,
                           inner_state=inner_state, reducer_state=reducer_state)

  tx = optax.GradientTransformationExtraArgs(init_fn, update_fn)
  return _plan.with_planner(
      tx, lambda params, workers: _plan.planner_of(reducer_for(params))(params, workers))


class StreamingDiLoCoState(NamedTuple):
  """State of :func:`streaming_diloco`.

  Attributes:
    count: inner steps so far (int32).
    syncs: fragment synchronisations so far (int32).
    anchor: the global parameters (replicated), float32 or wider.
    inner_state: the inner optimizer's state (per worker).
    reducer_states: one :func:`~commopt.compressed_mean` state per fragment.
    outer_states: one outer-optimizer state per fragment (replicated).
  """
  count: jax.Array
  syncs: jax.Array
  anchor: Any
  inner_state: Any
  reducer_states: tuple
  outer_states: tuple


def fragment_of(num_leaves: int, fragments: int) -> list[int]:
  """Leaf ``i``'s fragment: ``fragments`` consecutive blocks of leaves, as even as they come."""
  return [i * fragments // num_leaves for i in range(num_leaves)]


def streaming_diloco(inner: optax.GradientTransformation,
                     outer: Optional[optax.GradientTransformation] = None, *, axis_name,
                     period: int, fragments: int = 2, delay: int = 0, mixing: float = 0.5,
                     compressor: Optional[base.Compressor] = None, error_feedback: bool | str = "auto",
                     strategy: str = "auto", min_size: int = DEFAULT_MIN_SIZE, seed: int = 0
                     ) -> optax.GradientTransformationExtraArgs:
  """Streaming DiLoCo: fragments synchronised on a staggered schedule, applied ``delay`` steps late.

  The parameter leaves are split into ``fragments`` consecutive blocks
  (:func:`fragment_of`). Fragment ``p`` synchronises every ``period`` steps,
  ``p·period/fragments`` steps after fragment 0, so each exchange carries
  about ``1/fragments`` of the model and the peak bandwidth drops by that
  factor. At its step the fragment's pseudo-gradient ``anchor − local`` is
  averaged (through ``compressor``, e.g. ``int_quant(bits=4)``, with error
  feedback) and the outer optimizer updates the fragment's anchor, as in
  :func:`diloco`. The result is merged ``delay`` steps later (τ: the
  exchange overlaps that many inner steps), as
  ``local ← mixing·local + (1 − mixing)·anchor``.

  With ``fragments=1, delay=0, mixing=0`` it is :func:`diloco`.

  The default outer optimizer follows :func:`diloco`'s rule: Nesterov SGD
  (0.7, 0.9) for dense exchanges, ``sgd(1.0)`` where each fragment's
  exchange keeps an error-feedback residual (e.g. ``top_k``); and, as
  there, pass ``optax.sgd(1.0)`` over momentum SGD. The merge keeps
  ``mixing`` of the local parameters, which damps the outer step: with
  mixing 0.5 and one step of delay, Nesterov over momentum SGD did not
  diverge where :func:`diloco`'s did, though dense it ended eight times
  above ``sgd(1.0)``.

  Args:
    inner: as in :func:`diloco`.
    outer: as in :func:`diloco` (the default depends on the exchange).
    axis_name: as in :func:`diloco`.
    period: as in :func:`diloco`.
    compressor: as in :func:`diloco`.
    error_feedback: as in :func:`diloco`.
    strategy: as in :func:`diloco`.
    min_size: as in :func:`diloco`.
    seed: as in :func:`diloco`.
    fragments: number of fragments (P), from 1 to the number of leaves.
    delay: inner steps between a fragment's exchange and its merge (τ),
      ``0 <= delay < period``.
    mixing: the weight α of the local parameters in the merge, in [0, 1).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` needs
    ``params``; state :class:`StreamingDiLoCoState`.

  References:
    Douillard et al., Streaming DiLoCo with overlapping communication:
    Towards a Distributed Free Lunch, 2025.
  """
  fn = "streaming_diloco"
  inner, outer = _check_inner(inner, fn), _outer(outer, fn, compressor, error_feedback)
  reducer = _reducer(fn, axis_name, compressor, error_feedback, strategy, min_size, seed)
  period = base.check_positive_int("period", period, fn=fn)
  fragments = base.check_positive_int("fragments", fragments, fn=fn)
  delay = base.check_int("delay", delay, fn=fn, minimum=0)
  if delay >= period:
    raise ValueError(f"{fn}: `delay` must be below `period` ({period}), got {delay}: a "
                     "fragment's merge must come before its next exchange.")
  mixing = base.check_number("mixing", mixing, fn=fn, low=0, high=1, low_open=False)

  def split(tree):
    """The leaves of ``tree`` grouped by fragment, and how to put them back."""
    leaves, treedef = jax.tree.flatten(tree)
    if len(leaves) < fragments:
      raise ValueError(f"{fn}: `fragments` ({fragments}) must not exceed the number of "
                       f"parameter leaves ({len(leaves)}).")
    owner = fragment_of(len(leaves), fragments)
    groups = tuple([x for x, o in zip(leaves, owner) if o == p] for p in range(fragments))

    def join(parts):
      it = [iter(g) for g in parts]
      return jax.tree.unflatten(treedef, [next(it[o]) for o in owner])
    return groups, join

  def offset(p):
    return p * period // fragments

  def init_fn(params):
    anchor = jax.tree.map(_wide, params)
    groups, _ = split(anchor)
    return StreamingDiLoCoState(
        count=jnp.zeros([], jnp.int32), syncs=jnp.zeros([], jnp.int32), anchor=anchor,
        inner_state=inner.init(params),
        reducer_states=tuple(reducer.init(g) for g in groups),
        outer_states=tuple(outer.init(g) for g in groups))

  def update_fn(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError(f"{fn}: `update` needs `params` (each worker's own parameters).")
    coll.check_input(fn, updates, axis_name)
    local, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
    moved = jax.tree.map(lambda p, u: _wide(p) + _wide(u), params, local)
    moved_groups, join = split(moved)
    anchor_groups, _ = split(state.anchor)
    t = state.count
    new_anchor, reducer_states, outer_states, targets, synced = [], [], [], [], 0
    for p in range(fragments):
      send = (t + 1 + offset(p)) % period == 0

      def sync(ops, p=p):
        moved_p, anchor_p, red, out_s = ops
        delta = [a - m for a, m in zip(anchor_p, moved_p)]
        mean, red = reducer.update(delta, red)
        step, out_s = outer.update(mean, out_s, anchor_p)
        return optax.apply_updates(anchor_p, step), red, out_s

      def keep(ops):
        _, anchor_p, red, out_s = ops
        return anchor_p, red, out_s

      anchor_p, red, out_s = coll.cond(
          send, sync, keep,
          (moved_groups[p], anchor_groups[p], state.reducer_states[p], state.outer_states[p]))
      # The merge, `delay` steps after the exchange (the anchor does not move in between).
      merge = ((t + 1 + offset(p) - delay) % period == 0) & (t >= delay)
      w = jnp.where(merge, mixing, 1.0)
      targets.append([w * m + (1 - w) * a for m, a in zip(moved_groups[p], anchor_p)])
      new_anchor.append(anchor_p)
      reducer_states.append(red)
      outer_states.append(out_s)
      synced = synced + send.astype(jnp.int32)
    target = join(targets)
    out = jax.tree.map(lambda x, p: (x - _wide(p)).astype(p.dtype), target, params)
    return out, StreamingDiLoCoState(
        count=optax.safe_int32_increment(t), syncs=state.syncs + synced,
        anchor=join(new_anchor), inner_state=inner_state,
        reducer_states=tuple(reducer_states), outer_states=tuple(outer_states))

  planner = _plan.planner_of(reducer)

  def step_planner(params, workers, step):
    """The collectives of the fragments that exchange at ``step``."""
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    owner = dict(zip(paths, fragment_of(len(paths), fragments)))
    return [c for c in planner(params, workers)
            if (step + 1 + offset(owner[c.leaf])) % period == 0]

  return _plan.with_planner(optax.GradientTransformationExtraArgs(init_fn, update_fn), planner,
                            step_planner)


def global_params(opt_state):
  """The global model a synchronisation mode holds in ``opt_state``.

  Between synchronisations the workers' parameters differ; the model to
  evaluate or ship is the mode's own: the anchor of :func:`diloco`,
  :func:`local_sgd` and :func:`streaming_diloco` (the all-worker anchor of a
  hierarchical ``local_sgd``), the centre of :func:`easgd`, the server's
  parameters of :func:`stale`. ``opt_state`` may be the whole state of a
  chain (or of :func:`~commopt.data_parallel`) holding one of these.

  Raises:
    ValueError: when ``opt_state`` holds no synchronisation mode's state.

  Examples:
    >>> import jax.numpy as jnp, optax, commopt
    >>> tx = commopt.local_sgd(optax.sgd(0.1), axis_name="data", period=4)
    >>> state = tx.init({"w": jnp.ones(3)})
    >>> commopt.transforms.global_params(state)["w"].tolist()
    [1.0, 1.0, 1.0]
  """
  fields = {PeriodicState: lambda s: s.anchor, StreamingDiLoCoState: lambda s: s.anchor,
            EASGDState: lambda s: s.centre, StaleState: lambda s: s.params,
            HierarchicalLocalSGDState: lambda s: s.anchors[-1]}
  kinds = tuple(fields)
  for node in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, kinds)):
    if isinstance(node, kinds):
      return fields[type(node)](node)
  raise ValueError("global_params: `opt_state` holds no synchronisation mode's state "
                   "(local_sgd, diloco, streaming_diloco, easgd or stale); with every-step "
                   "synchronisation the parameters themselves are the global model.")
