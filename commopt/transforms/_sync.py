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
(learning rate 0.7, momentum 0.9).

The transforms output per-worker updates, so the parameters differ between
workers between synchronisations: run them under
``commopt.data_parallel(..., local_params=True)``, under ``jax.vmap`` over the
workers, or in your own ``shard_map`` with per-worker parameters.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from commopt._src import base
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


def _reducer(fn: str, axis_name, compressor, error_feedback, strategy, min_size, seed):
  """The compressed_mean that averages what the workers exchange (dense without a compressor)."""
  _check_axes(axis_name, fn)
  if axis_name is None:
    raise ValueError(f"{fn}: `axis_name` must name the data axis, got None.")
  from commopt.compressors import make
  return compressed_mean(make("identity") if compressor is None else compressor, axis_name,
                         error_feedback=error_feedback and compressor is not None,
                         strategy=strategy, min_size=min_size, seed=seed)


def _outer(outer, fn: str):
  """The outer optimizer: DiLoCo's Nesterov SGD (learning rate 0.7, momentum 0.9) by default."""
  return _check_inner(optax.sgd(0.7, momentum=0.9, nesterov=True) if outer is None else outer, fn)


def diloco(inner: optax.GradientTransformation, outer: Optional[optax.GradientTransformation] = None,
           *, axis_name, period: int, compressor: Optional[base.Compressor] = None,
           error_feedback: bool = True, strategy: str = "auto", warmup_steps: int = 0,
           min_size: int = DEFAULT_MIN_SIZE, seed: int = 0) -> optax.GradientTransformationExtraArgs:
  """DiLoCo: ``period`` inner steps per worker, then an outer step on the mean pseudo-gradient.

  Per worker, with local parameters ``θᵢ`` and the anchor ``θ`` (the
  parameters at the last synchronisation)::

    θᵢ ← θᵢ + inner(gᵢ)                          every step, no communication
    every period steps:
      Δ = mean_i C(θ − θᵢ)                       compressed_mean, with error feedback
      θ ← θ + outer(Δ);  θᵢ ← θ                  the same on every worker

  Before ``warmup_steps`` every step synchronises (post-local SGD's warm-up).

  Args:
    inner: the workers' optimizer (e.g. ``optax.adamw(...)``), stepped on each
      worker's own gradients; its state is per worker.
    outer: the optimizer of the anchor, fed the mean pseudo-gradient; default
      ``optax.sgd(0.7, momentum=0.9, nesterov=True)``.
    axis_name: the data axis (or tuple of axes).
    period: inner steps between synchronisations (H), at least 1.
    compressor: compresses the pseudo-gradients (e.g. ``commopt.top_k(0.01)``
      as SparseLoCo, ``commopt.int_quant(bits=4)`` as Streaming DiLoCo's
      outer gradients); None sends them dense.
    error_feedback: keep what the compressor did not send (per worker).
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
  inner, outer = _check_inner(inner, fn), _outer(outer, fn)
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

  return _planned(init_fn, update_fn, reducer)


def _planned(init_fn, update_fn, reducer):
  """The transform, with :func:`commopt.wire.comm_plan` giving its exchange's collectives
  (what one synchronisation step sends; other steps send nothing)."""
  return _plan.with_planner(optax.GradientTransformationExtraArgs(init_fn, update_fn),
                            _plan.planner_of(reducer))


def local_sgd(inner: optax.GradientTransformation, *, axis_name, period: int,
              warmup_steps: int = 0, compressor: Optional[base.Compressor] = None,
              error_feedback: bool = True, strategy: str = "auto",
              min_size: int = DEFAULT_MIN_SIZE, seed: int = 0
              ) -> optax.GradientTransformationExtraArgs:
  """Local SGD / post-local SGD: workers step alone and average parameters every ``period`` steps.

  Synchronous for the first ``warmup_steps`` steps (post-local SGD), then
  each worker takes ``period`` steps of ``inner`` on its own gradients and the
  workers average their parameters, optionally through a compressor with
  error feedback (what is averaged is each worker's move since the last
  average). This is :func:`diloco` with the outer optimizer ``sgd(1.0)``.

  With ``period=1`` and a linear inner optimizer (SGD, momentum SGD), it is
  synchronous data-parallel training: the mean of the workers' steps is the
  step on the mean gradient.

  Args:
    inner: the workers' optimizer.
    axis_name: the data axis (or tuple of axes).
    period: steps between averages, at least 1.
    warmup_steps: steps at the start that average every step.
    compressor, error_feedback, strategy, min_size, seed: as in :func:`diloco`.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; state :class:`PeriodicState`.

  References:
    Stich, Local SGD Converges Fast and Communicates Little, ICLR 2019.
    Lin et al., Don't Use Large Mini-Batches, Use Local SGD, ICLR 2020.
  """
  return diloco(inner, optax.sgd(1.0), axis_name=axis_name, period=period,
                compressor=compressor, error_feedback=error_feedback, strategy=strategy,
                warmup_steps=warmup_steps, min_size=min_size, seed=seed)


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
          error_feedback: bool = True, strategy: str = "auto",
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
    compressor, error_feedback, strategy, min_size, seed: how ``xᵢ − x̃`` is
      averaged, as in :func:`diloco`.

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

  return _planned(init_fn, update_fn, reducer)


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


def stale(inner: optax.GradientTransformation, *, axis_name, max_staleness: int,
          distribution: str = "uniform", mean_staleness: Optional[float] = None,
          compressor: Optional[base.Compressor] = None, error_feedback: bool = True,
          strategy: str = "auto", min_size: int = DEFAULT_MIN_SIZE, seed: int = 0
          ) -> optax.GradientTransformationExtraArgs:
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
    compressor, error_feedback, strategy, min_size: how gradients are
      averaged, as in :func:`diloco`.
    seed: seeds the delays and the compressor.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; state :class:`StaleState`.

  References:
    Ho et al., More Effective Distributed ML via a Stale Synchronous Parallel
    Parameter Server, NeurIPS 2013.
    Dean et al., Large Scale Distributed Deep Networks, NeurIPS 2012 (ASP).
  """
  fn = "stale"
  inner = _check_inner(inner, fn)
  reducer = _reducer(fn, axis_name, compressor, error_feedback, strategy, min_size, seed)
  s = base.check_int("max_staleness", max_staleness, fn=fn, minimum=0)
  base.check_choice("distribution", distribution, STALENESS, fn)
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
                      inner_state=inner.init(wide), reducer_state=reducer.init(wide))

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
    mean, reducer_state = reducer.update(updates, state.reducer_state)
    step, inner_state = inner.update(mean, state.inner_state, state.params, **extra_args)
    new = optax.apply_updates(state.params, step)
    count = optax.safe_int32_increment(state.count)
    history = jax.tree.map(lambda h, x: h.at[count % slots].set(x), state.history, new)
    read = (count - delay(state.key, count)) % slots
    view = jax.tree.map(lambda h: h[read], history)
    out = jax.tree.map(lambda v, p: (v - _wide(p)).astype(p.dtype), view, params)
    return out, StaleState(count=count, params=new, history=history, key=state.key,
                           inner_state=inner_state, reducer_state=reducer_state)

  return _planned(init_fn, update_fn, reducer)


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
                     compressor: Optional[base.Compressor] = None, error_feedback: bool = True,
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

  Args:
    inner, outer, axis_name, period, compressor, error_feedback, strategy,
    min_size, seed: as in :func:`diloco`.
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
  inner, outer = _check_inner(inner, fn), _outer(outer, fn)
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

  return _planned(init_fn, update_fn, reducer)
