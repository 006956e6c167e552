"""Elastic averaging SGD: workers tied to a centre variable by a spring."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from commopt._src import base
from commopt.comm import _collectives as coll
from commopt.transforms._compressed_mean import DEFAULT_MIN_SIZE
from commopt.transforms._control import _check_inner
from commopt.transforms._sync._common import (
    _Mode, _advance, _planned, _reducer, _require_params, _unless_vetoed, _wide, _zero_count,
    is_sync_step, _take_verdict)


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
  mode = _EASGD(fn=fn, axis_name=axis_name, inner=inner, reducer=reducer, alpha=alpha,
                beta=beta, period=base.check_positive_int("period", period, fn=fn))
  return _planned(mode.init, mode.update, reducer, mode.synced, axis_name=axis_name, fn=fn)


@dataclasses.dataclass(frozen=True, eq=False)
class _EASGD(_Mode):
  """:func:`easgd`'s checked options, and its ``init`` and ``update``."""
  reducer: optax.GradientTransformationExtraArgs
  alpha: float
  beta: Optional[float]
  period: int

  def synced(self, count):
    """Whether inner step ``count`` ends with an elastic exchange (traced or not)."""
    return is_sync_step(count, self.period, 0)

  def init(self, params) -> EASGDState:
    centre = jax.tree.map(_wide, params)
    return EASGDState(count=_zero_count(), syncs=_zero_count(), centre=centre,
                      inner_state=self.inner.init(params),
                      reducer_state=self.reducer.init(centre))

  def update(self, updates, state: EASGDState, params=None, **extra_args):
    """The inner step on every worker, plus the elastic pull on an exchange step."""
    _require_params(self.fn, params)
    # data_parallel's agreed skip: false where every worker skips
    go, extra_args = _take_verdict(extra_args, self.axis_name)
    coll.check_input(self.fn, updates, self.axis_name)
    local, inner_state = self.inner.update(updates, state.inner_state, params, **extra_args)
    beta = self.alpha * coll.axis_size(self.axis_name) if self.beta is None else self.beta
    synced = _unless_vetoed(self.synced(state.count), go)
    pull, centre, reducer_state = coll.cond(
        synced, lambda ops: self._exchange(params, beta, *ops),
        lambda ops: self._no_exchange(params, *ops), (state.centre, state.reducer_state))
    out = jax.tree.map(lambda u, e, p: (_wide(u) + e).astype(p.dtype), local, pull, params)
    count, inner_state = _advance(go, state.count, inner_state, state.inner_state,
                                  self.axis_name)
    return out, EASGDState(count=count, syncs=state.syncs + synced.astype(jnp.int32),
                           centre=centre, inner_state=inner_state, reducer_state=reducer_state)

  def _exchange(self, params, beta, centre, reducer_state):
    """Each worker's pull ``−α (xᵢ − x̃)``, and the centre moved by ``β`` of their mean."""
    diff = jax.tree.map(lambda p, c: _wide(p) - c, params, centre)
    mean, reducer_state = self.reducer.update(diff, reducer_state)
    pull = jax.tree.map(lambda d: -self.alpha * d, diff)
    centre = jax.tree.map(lambda c, m: c + beta * m, centre, mean)
    return pull, centre, reducer_state

  @staticmethod
  def _no_exchange(params, centre, reducer_state):
    """No pull between exchanges; the centre and the exchange's state stay."""
    return jax.tree.map(lambda p: jnp.zeros(p.shape, _wide(p).dtype), params), centre, \
        reducer_state
