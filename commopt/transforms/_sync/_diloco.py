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
  Over momentum SGD inside, pass ``outer=optax.sgd(1.0)``: the default Nesterov
  outer step compounds with the inner momentum and can diverge.

  See the guide's "Synchronising less often" page (which outer optimizer, and
  the measurements).

  Args:
    inner: the workers' optimizer (e.g. ``optax.adamw(...)``), per worker; a
      function of its inputs (optax's are): a synchronising step runs it twice.
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
      :func:`~commopt.compressed_mean`.
    strategy: :func:`~commopt.compressed_mean`'s reduction.
    warmup_steps: steps at the start that synchronise every step.
    min_size: leaves with fewer elements are exchanged dense.
    seed: the compressor's base key.
    residual_decay: β of the error-feedback residual, ``e ← β·e + Δ`` before
      each exchange; SparseLoCo uses 0.95 (see :func:`~commopt.transforms.sparseloco`).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` needs
    ``params`` (each worker's own); state :class:`PeriodicState`.

  Examples:
    >>> import jax.numpy as jnp, optax, commopt
    >>> tx = commopt.diloco(optax.adamw(1e-3), axis_name="data", period=8,
    ...                     compressor=commopt.top_k(0.01))
    >>> state = tx.init({"w": jnp.ones(3)})
    >>> commopt.transforms.global_params(state)["w"].tolist()
    [1.0, 1.0, 1.0]

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
  return _planned(mode.init, mode.update, mode.reducer, mode.synced, axis_name=axis_name,
                  fn=fn)


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
