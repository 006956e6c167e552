"""Stale-synchronous and asynchronous training, simulated: gradients at parameters read late."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from commopt._src import base, finite
from commopt.transforms import _global_view
from commopt.comm import _collectives as coll
from commopt.comm import _plan
from commopt.transforms._compressed_mean import DEFAULT_MIN_SIZE
from commopt.transforms._control import _check_axes, _check_inner
from commopt.transforms._sync._common import (
    _Mode, _exchange_options, _reducer, _require_params, _update_to, _wide, _zero_count)

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
    reducer_for, seed = _budget_reducer(fn, axis_name, byte_budget, compressor, error_feedback,
                                        strategy, min_size, seed)
  s, mean_staleness = _staleness(fn, max_staleness, distribution, mean_staleness)
  mode = _Stale(fn=fn, axis_name=axis_name, inner=inner, reducer_for=reducer_for,
                max_staleness=s, distribution=distribution, mean_staleness=mean_staleness,
                seed=seed)
  return _plan.with_planner(_global_view.accepting(
                                optax.GradientTransformationExtraArgs(mode.init, mode.update),
                                axis_name, fn),
                            mode.planner)


def _budget_reducer(fn, axis_name, byte_budget, compressor, error_feedback, strategy, min_size,
                    seed):
  """``byte_budget`` checked: the reducer of a tree (a top-k sized for it) and the seed."""
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
  return (lambda tree: _reducer(fn, axis_name, budget_top_k(byte_budget, tree, fn), True,
                                strategy, 0, seed)), seed


def _staleness(fn, max_staleness, distribution, mean_staleness) -> tuple[int, Optional[float]]:
  """The delays' options checked: the bound ``s`` and the geometric mean (None if uniform)."""
  s = base.check_int("max_staleness", max_staleness, fn=fn, minimum=0)
  base.check_choice("distribution", distribution, STALENESS, fn)
  if mean_staleness is not None:
    base.check_number("mean_staleness", mean_staleness, fn=fn, low=0)
  if distribution == "geometric":
    mean_staleness = base.check_number("mean_staleness", mean_staleness, fn=fn, low=0)
  elif mean_staleness is not None:
    raise ValueError(f"{fn}: `mean_staleness` is for distribution='geometric'; got "
                     f"{mean_staleness!r} with distribution={distribution!r}.")
  return s, mean_staleness


@dataclasses.dataclass(frozen=True, eq=False)
class _Stale(_Mode):
  """:func:`stale`'s checked options, and its ``init``, ``update`` and planner.

  ``reducer_for(tree)`` is the :func:`~commopt.compressed_mean` of the
  gradients (a byte budget's top-k depends on the tree's leaves).
  """
  reducer_for: Callable[[Any], optax.GradientTransformationExtraArgs]
  max_staleness: int
  distribution: str
  mean_staleness: Optional[float]
  seed: Any

  @property
  def slots(self) -> int:
    """The parameters kept: ``max_staleness + 1``."""
    return self.max_staleness + 1

  def init(self, params) -> StaleState:
    wide = jax.tree.map(_wide, params)
    return StaleState(count=_zero_count(), params=wide,
                      history=jax.tree.map(lambda x: jnp.broadcast_to(x, (self.slots,) + x.shape),
                                           wide),
                      key=jax.random.key_data(jax.random.key(self.seed)),
                      inner_state=self.inner.init(wide),
                      reducer_state=self.reducer_for(wide).init(wide))

  def update(self, updates, state: StaleState, params=None, **extra_args):
    """The server's step on the mean gradient; each worker then reads a stale copy."""
    _require_params(self.fn, params, "each worker's own, stale, copy")
    coll.check_input(self.fn, updates, self.axis_name)
    mean, reducer_state = self.reducer_for(updates).update(updates, state.reducer_state)
    # The inner step runs on the mean, not on this call's input: the skip's flag stays here.
    step, inner_state = self.inner.update(mean, state.inner_state, state.params,
                                          **finite.without(extra_args))
    new = optax.apply_updates(state.params, step)
    count = optax.safe_int32_increment(state.count)
    history = jax.tree.map(lambda h, x: h.at[count % self.slots].set(x), state.history, new)
    read = (count - self.delay(state.key, count)) % self.slots
    view = jax.tree.map(lambda h: h[read], history)
    return _update_to(view, params), StaleState(
        count=count, params=new, history=history, key=state.key, inner_state=inner_state,
        reducer_state=reducer_state)

  def delay(self, key_data, count):
    """This worker's delay for the parameters it reads after step ``count``."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(key_data), count),
                             coll.axis_index(self.axis_name))
    if self.distribution == "uniform":
      d = jax.random.randint(key, (), 0, self.slots)
    else:
      p = 1.0 / (1.0 + self.mean_staleness)     # failures before a success: mean (1-p)/p
      d = jax.random.geometric(key, p) - 1
    return jnp.minimum(jnp.minimum(d, self.max_staleness), count).astype(jnp.int32)

  def planner(self, params, workers):
    """The collectives of one step's exchange of gradients."""
    return _plan.planner_of(self.reducer_for(params))(params, workers)
