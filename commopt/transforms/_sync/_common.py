"""What the synchronisation modes share: their schedule, their exchange and their outer step.

Every mode keeps float32-or-wider copies of the parameters (:func:`_wide`),
steps an inner optimizer on each worker (:func:`_inner_step`), averages what
the workers exchange through a :func:`~commopt.compressed_mean`
(:func:`_reducer`), at the steps :func:`is_sync_step` names, and hands back
the update that takes each worker's parameters to their target
(:func:`_update_to`). The anchor-based modes step an outer optimizer
(:func:`_outer`) on the mean pseudo-gradient (:func:`_outer_step`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from commopt._src import base, feedback, finite
from commopt.comm import _plan
from commopt.transforms._compressed_mean import compressed_mean
from commopt.transforms._control import _check_axes, _check_inner, _hold_state
from commopt.transforms import _global_view


@dataclasses.dataclass(frozen=True, eq=False)
class _Mode:
  """What every mode is built from: its name in errors, its data axis and the workers'
  optimizer. Each mode's subclass adds its other options, checked, and its ``init`` and
  ``update``, which the mode's factory hands to optax."""
  fn: str
  axis_name: Any
  inner: optax.GradientTransformation


def _wide(x):
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _zero_count() -> jax.Array:
  """A step or synchronisation counter at its start: int32 zero."""
  return jnp.zeros([], jnp.int32)


def is_sync_step(count, period: int, warmup_steps: int):
  """Whether inner step ``count`` (0-based) ends with a synchronisation."""
  after = count - warmup_steps
  return (count < warmup_steps) | ((after + 1) % period == 0)


def _exchange_options(fn: str, error_feedback, min_size, seed) -> tuple[bool | str, int, int]:
  """The options every mode hands to its exchange, checked: 'auto' or a bool, two integers."""
  return (feedback.check_error_feedback(error_feedback, fn),
          base.check_int("min_size", min_size, fn=fn, minimum=0),
          base.check_int("seed", seed, fn=fn))


def _reducer(fn: str, axis_name, compressor, error_feedback, strategy, min_size, seed,
             residual_decay=1.0):
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
  return compressed_mean(make("identity") if compressor is None else compressor, axis_name=axis_name,
                         error_feedback=error_feedback if compressor is not None else False,
                         strategy=strategy, inner_strategy=inner_strategy, min_size=min_size,
                         seed=seed, residual_decay=residual_decay)


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


def _planned(init_fn, update_fn, reducer, synced=None, *, axis_name, fn: str):
  """The transform, with :func:`commopt.wire.comm_plan` giving its exchange's collectives:
  what one synchronisation sends, and with ``step``, what runs at that step
  (everything when ``synced(step)``, else nothing; every step without ``synced``).
  ``synced`` takes a step count, an int or traced, and also tells a non-finite skip
  (:func:`~commopt.transforms.apply_if_finite`'s ``agree_when``) which updates
  exchange: those whose state's ``count`` it names."""
  planner = _plan.planner_of(reducer)
  step_planner = exchanges = None
  if synced is not None:
    step_planner = lambda params, workers, step: (
        planner(params, workers) if bool(synced(step)) else [])
    exchanges = lambda state: synced(state.count)
  tx = _global_view.accepting(optax.GradientTransformationExtraArgs(init_fn, update_fn),
                              axis_name, fn)
  return _plan.with_planner(tx, planner, step_planner, exchanges)


def _require_params(fn: str, params, what: str = "each worker's own parameters") -> None:
  """Refuses an ``update`` called without ``params``: every mode steps the workers' own."""
  if params is None:
    raise ValueError(f"{fn}: `update` needs `params` ({what}).")


def _take_verdict(extra_args: dict, axis_name) -> tuple:
  """``(go, extra_args)``: the non-finite skip's agreed verdict handed to the mode
  (``nonfinite.agreed``, :mod:`commopt._src.finite`: false on a step every worker skips),
  or None where none was; and the extra arguments for the inner step, without
  ``nonfinite`` (the mode answers the skip itself). A verdict agreed over fewer axes than
  the mode exchanges over is refused: the mode could not hold its shared state by it."""
  nf = extra_args.get(finite.EXTRA_ARG)
  go = None
  if isinstance(nf, finite.NonFinite) and nf.agreed is not None:
    if not set(base.axis_names(axis_name)) <= set(nf.axes):
      # The skip would count on this mode to hold the state the workers share.
      raise ValueError(
          f"apply_if_finite: the workers agree over {nf.axes!r}, but the synchronisation "
          f"mode it wraps exchanges over {axis_name!r}: pass apply_if_finite the mode's "
          "axis_name (or a tuple holding every axis of it).")
    go = nf.agreed
  return go, finite.without(extra_args)


def _unless_vetoed(due, go):
  """Whether an exchange that is ``due`` runs: unless the skip's agreed verdict ``go``
  (:func:`_take_verdict`; None outside such a skip) is false."""
  return due if go is None else due & go


def _advance(go, count, inner_state, old_inner, axis_name):
  """The next step count and the inner state. ``go`` is the skip's agreed verdict taken by
  the mode (:func:`_take_verdict`; None outside such a skip):
  where it is false every worker skips, so the count stays (the exchange comes a step
  later) and so do the inner state's leaves the workers share (a step count); the skip
  holds the per-worker leaves."""
  new_count = optax.safe_int32_increment(count)
  if go is None:
    return new_count, inner_state
  return jnp.where(go, new_count, count), _hold_state(inner_state, old_inner, worker=True,
                                                      shared=go, axis_name=axis_name)


def _inner_step(inner, updates, inner_state, params, extra_args):
  """Each worker's own step of ``inner``: where it moves the parameters (wide), and its state."""
  local, inner_state = inner.update(updates, inner_state, params, **extra_args)
  return _moved(params, local), inner_state


def _moved(params, local):
  """Where ``local`` (an inner step's update) moves each worker's ``params`` (wide)."""
  return jax.tree.map(lambda p, u: _wide(p) + _wide(u), params, local)


def _to_target_or_local(synced, target, params, local):
  """The update where ``synced``: to ``target`` (``_update_to``); elsewhere the inner step's
  own ``local``; in the parameters' dtypes. Elementwise, so between synchronisations it
  fuses with the inner step into the parameters' update."""
  return jax.tree.map(
      lambda t, p, u: jnp.where(synced, _leaf_update_to(t, p), u.astype(p.dtype)),
      target, params, local)


def _update_to(target, params):
  """The update that takes each worker's ``params`` to ``target``, in the parameters' dtypes."""
  return jax.tree.map(_leaf_update_to, target, params)


def _leaf_update_to(t, p):
  return (t - _wide(p)).astype(p.dtype)


def _outer_step(reducer, outer, moved, anchor, reducer_state, outer_state):
  """One synchronisation of ``anchor``: the workers' mean pseudo-gradient ``anchor − moved``
  (through ``reducer``) stepped by ``outer``; the new anchor, reducer state and outer state."""
  delta = jax.tree.map(lambda a, m: a - m, anchor, moved)
  mean, reducer_state = reducer.update(delta, reducer_state)
  step, outer_state = outer.update(mean, outer_state, anchor)
  return optax.apply_updates(anchor, step), reducer_state, outer_state
