"""DiLoCo: ``period`` inner steps per worker, then an outer step on the mean pseudo-gradient."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from commopt._src import base, finite
from commopt.comm import _collectives as coll
from commopt.transforms._compressed_mean import DEFAULT_MIN_SIZE
from commopt.transforms._control import _check_inner
from commopt.transforms._sync._common import (
    _Mode, _advance, _inner_step, _moved, _outer, _outer_step, _planned, _reducer,
    _require_params, _to_target_or_local, _unless_vetoed, _update_to, _wide, _zero_count,
    is_sync_step, _take_verdict)


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


def diloco(inner: optax.GradientTransformation,
           outer: Optional[optax.GradientTransformation] = None,
           *, axis_name, period: int, compressor: Optional[base.Compressor] = None,
           error_feedback: bool | str = "auto", strategy: str = "auto", warmup_steps: int = 0,
           min_size: int = DEFAULT_MIN_SIZE, seed: int = 0,
           residual_decay: float = 1.0) -> optax.GradientTransformationExtraArgs:
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
      worker's own gradients; its state is per worker. With ``period > 1`` a
      synchronising step (every step of the warm-up) runs its ``update`` twice
      on the same inputs, so that between synchronisations its update fuses
      into the parameters': it must be a function of its inputs (optax's are),
      and its collectives, if any (a global norm over model axes), run twice.
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
    residual_decay: β of the error-feedback residual, ``e ← β·e + Δ`` before
      each exchange (:func:`~commopt.compressed_mean`'s option); SparseLoCo
      uses 0.95 (see :func:`~commopt.transforms.sparseloco`).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` needs
    ``params`` (each worker's own); state :class:`PeriodicState`.

  References:
    Douillard et al., DiLoCo: Distributed Low-Communication Training of
    Language Models, 2023.
  """
  fn = "diloco"
  mode = _DiLoCo(fn=fn, axis_name=axis_name, inner=_check_inner(inner, fn),
                 outer=_outer(outer, fn, compressor, error_feedback),
                 reducer=_reducer(fn, axis_name, compressor, error_feedback, strategy, min_size,
                                  seed, residual_decay),
                 period=base.check_positive_int("period", period, fn=fn),
                 warmup_steps=base.check_int("warmup_steps", warmup_steps, fn=fn, minimum=0))
  return _planned(mode.init, mode.update, mode.reducer, mode.synced)


@dataclasses.dataclass(frozen=True, eq=False)
class _DiLoCo(_Mode):
  """:func:`diloco`'s checked options, and its ``init`` and ``update``."""
  outer: optax.GradientTransformation
  reducer: optax.GradientTransformationExtraArgs
  period: int
  warmup_steps: int

  def synced(self, count):
    """Whether inner step ``count`` ends with a synchronisation (traced or not)."""
    return is_sync_step(count, self.period, self.warmup_steps)

  def init(self, params) -> PeriodicState:
    anchor = jax.tree.map(_wide, params)
    return PeriodicState(count=_zero_count(), syncs=_zero_count(), anchor=anchor,
                         inner_state=self.inner.init(params),
                         reducer_state=self.reducer.init(anchor),
                         outer_state=self.outer.init(anchor))

  def update(self, updates, state: PeriodicState, params=None, **extra_args):
    """The inner step on every worker; on a synchronisation step, every worker takes the anchor
    after the outer step."""
    _require_params(self.fn, params)
    # Inside data_parallel's non-finite skip: the workers' agreed verdict, false only on a
    # step that would exchange and that every worker skips (then nothing is exchanged and
    # the state the workers share stays; see _common._take_verdict). None elsewhere.
    go, extra_args = _take_verdict(extra_args, self.axis_name)
    coll.check_input(self.fn, updates, self.axis_name)
    local, inner_state = self.inner.update(updates, state.inner_state, params, **extra_args)
    synced = _unless_vetoed(self.synced(state.count), go)
    count, inner_state = _advance(go, state.count, inner_state, state.inner_state,
                                  self.axis_name)
    if self.period == 1:
      # Every step synchronises: no conditional, and the inner step taken once.
      anchor, reducer_state, outer_state = _outer_step(
          self.reducer, self.outer, _moved(params, local), state.anchor, state.reducer_state,
          state.outer_state)
      if go is not None:
        # A step every worker skips: the state the workers share stays.
        anchor, reducer_state, outer_state = finite.hold_unless(
            go, (anchor, reducer_state, outer_state),
            (state.anchor, state.reducer_state, state.outer_state))
      update = _update_to(anchor, params)
    else:
      # Only the anchor and the exchange's state pass through the conditional: every operand
      # of it is a buffer that exists anyway, so between synchronisations the inner step's
      # update is not written out for it and fuses into the parameters' update. The branch
      # that synchronises takes the inner step again, after the first (its collectives, if
      # any, in order across processes).
      operands = coll.after(
          (updates, state.inner_state, state.anchor, state.reducer_state, state.outer_state),
          local)
      anchor, reducer_state, outer_state = coll.cond(
          synced, functools.partial(self._sync, params, extra_args), self._no_sync, operands)
      update = _to_target_or_local(synced, anchor, params, local)
    return update, PeriodicState(
        count=count, syncs=state.syncs + synced.astype(jnp.int32), anchor=anchor,
        inner_state=inner_state,
        reducer_state=reducer_state, outer_state=outer_state)

  def _sync(self, params, extra_args, operands):
    """The outer step on the mean pseudo-gradient: the new anchor, reducer and outer state.
    The inner step is taken again here, from its operands: on a synchronisation, and so on
    every step of the warm-up, the inner optimizer runs twice (its update written out once
    per synchronisation, where it was on every step)."""
    updates, inner_state, anchor, reducer_state, outer_state = operands
    moved, _ = _inner_step(self.inner, updates, inner_state, params, extra_args)
    return _outer_step(self.reducer, self.outer, moved, anchor, reducer_state,
                       outer_state)

  @staticmethod
  def _no_sync(operands):
    """No exchange: the anchor and the exchange's state stay."""
    return operands[2:]
