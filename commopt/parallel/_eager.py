"""DiLoCo with eager outer updates: each outer exchange overlaps the whole next inner phase,
and the outer step does not wait for it (Kale, Douillard and Donchev, 2025).

At an outer step each worker ``m`` has its pseudo-gradient ``Δₘ = anchorₘ − θₘ``. It starts
the exchange of ``Δₘ`` (a compressed mean over the workers, on a thread of its own) and at
once takes the outer step on the eager estimate of the mean

    Δ̃ₘ = w·Δₘ + mean(Δ⁻) − w·Δₘ⁻

its own current pseudo-gradient standing in, with weight ``w``, for what has not arrived,
and the previous exchange's mean (``Δ⁻``, which has arrived by now: it overlapped the inner
phase that just ended) replacing what stood in for it one outer step before. With
``w = 1/M`` (the default, the paper's) the own term stands for the worker's share of the
mean; with ``w = 1`` for the whole mean (with ``optax.sgd(1.0)`` the workers' mean anchor
then moves by the mean pseudo-gradient at each outer step, as blocking DiLoCo's does);
``w = 0`` is the plain one-period delay. The workers' anchors differ by their own current
terms; summed over outer steps, each worker has applied every exchange's mean once, plus
``w`` times its own last term.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax

from commopt._src import base
from commopt.parallel._data_parallel import data_parallel
from commopt.parallel._overlapped import _probe_loss, _worker_skip
from commopt.transforms._compressed_mean import DEFAULT_MIN_SIZE
from commopt.transforms._sync._common import _outer, _reducer


@dataclasses.dataclass
class EagerState:
  """What :class:`EagerDiLoCo` carries between steps (host-level: not a pytree).

  Attributes:
    inner: the inner optimizer's state (per worker), as ``data_parallel`` keeps it (inside
      each worker's :class:`~commopt.transforms.ApplyIfFiniteState` with ``skip_nonfinite``).
    anchors: each worker's anchor (float32, stacked over the workers).
    outer: each worker's outer optimizer state (stacked).
    previous: each worker's pseudo-gradient of the last outer step (stacked; zero before
      the first and after :meth:`EagerDiLoCo.finish`).
    exchange: the exchange's state (its error-feedback residuals, per worker).
    count: inner steps so far.
    pending: the exchange in flight (a future of the mean ``Δ⁻``), or None.
  """
  inner: Any
  anchors: Any
  outer: Any
  previous: Any
  exchange: Any
  count: int = 0
  pending: Optional[concurrent.futures.Future] = None


def _mean_of_params(reducer) -> optax.GradientTransformationExtraArgs:
  """``reducer``'s mean of each worker's ``params`` (the pseudo-gradients), as the update
  that takes each worker's ``params`` to that mean (the probe's gradients are ignored)."""
  def init(params):
    return reducer.init(params)

  def update(updates, state, params=None, **extra):
    del updates
    mean, state = reducer.update(params, state, params, **extra)
    return jax.tree.map(lambda m, p: (m - p).astype(p.dtype), mean, params), state
  return optax.GradientTransformationExtraArgs(init, update)


class EagerDiLoCo:
  """DiLoCo whose outer exchange overlaps the whole next inner phase, with eager updates.

  Every ``period`` inner steps each worker takes the outer step at once on
  ``w·Δₘ + mean(Δ⁻) − w·Δₘ⁻`` (``w = own_weight``, ``1/M`` by default; see
  :mod:`commopt.parallel._eager`) and starts the exchange of its ``Δₘ`` on a thread, which
  the next outer step collects: a link slower than one outer step costs nothing while it is
  faster than ``period`` inner steps. With one worker, a dense exchange and ``own_weight``
  None or 1 it is :func:`~commopt.diloco` exactly.

  The driver is host-level, as :class:`~commopt.parallel.OverlappedDiLoCo` (two programs
  and a thread; every process calls it in the same order; run no collective of your own
  while an exchange is in flight; call :meth:`finish` before a checkpoint or an
  evaluation). :meth:`finish` collects the exchange in flight and applies its other
  workers' part, so that with a linear outer step (``optax.sgd(lr)``) every worker then
  holds the same anchor; :meth:`global_params` is the workers' mean anchor.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``, as for ``data_parallel``.
    inner: the workers' optimizer.
    mesh: the device mesh.
    outer: each worker's outer optimizer; None: ``optax.sgd(1.0)``. The eager estimate
      carries the previous exchange's mean, one outer step old: DiLoCo's Nesterov step
      (0.7, momentum 0.9) on top of it made the tests' MLP diverge where ``sgd(1.0)``
      trained within 1.3x of blocking DiLoCo's loss.
    axis_name: the data axis.
    period: inner steps between outer steps (H); each exchange has that long to arrive.
    compressor: the pseudo-gradients' compressor (None: dense), :func:`~commopt.diloco`'s.
    error_feedback: the exchange's error feedback, :func:`~commopt.diloco`'s option.
    residual_decay: the residual's decay, :func:`~commopt.diloco`'s option.
    strategy: the exchange's reduction, :func:`~commopt.diloco`'s option.
    min_size: leaves smaller than this go dense, :func:`~commopt.diloco`'s option.
    seed: the compressor's base key, :func:`~commopt.diloco`'s option.
    own_weight: ``w``, the weight of a worker's own current pseudo-gradient in its eager
      estimate, in [0, 1]; None: ``1/M`` (the paper's: its share of the mean). ``1.0``
      lets it stand for the whole mean until the exchange arrives: on the network
      benchmark's MLP under momentum SGD 0.9 it never needed more steps to the target
      than ``1/M`` and did not oscillate, where ``1/M`` did with short periods (the
      Overlapping page); ``0.0`` is the plain delay, which the paper found converges
      worse than its eager estimate.
    skip_nonfinite: each worker skips its own inner step whose gradients hold a NaN or an
      infinity, its parameters and inner optimizer state kept (True, the default: a
      verdict of its own, no collective across workers beside the exchange in flight;
      leaves sharded over model axes agree over those axes), or runs it as it
      comes (False). The exchange skips by agreement, as ``data_parallel`` does.

  References:
    Kale, Douillard and Donchev, Eager Updates For Overlapped Communication and
    Computation in DiLoCo, arXiv 2502.12996, 2025.
  """

  def __init__(self, loss_fn: Callable, inner: optax.GradientTransformation, mesh,
               outer: Optional[optax.GradientTransformation] = None, *, axis_name="data",
               period: int, compressor: Optional[base.Compressor] = None,
               error_feedback="auto", residual_decay: float = 1.0, strategy: str = "auto",
               min_size: int = DEFAULT_MIN_SIZE, seed: int = 0,
               own_weight: Optional[float] = None, skip_nonfinite: bool = True):
    fn = "eager_diloco"
    self.period = base.check_positive_int("period", period, fn=fn)
    self.outer = _outer(optax.sgd(1.0) if outer is None else outer, fn)
    reducer = _reducer(fn, axis_name, compressor, error_feedback, strategy, min_size, seed,
                       residual_decay)
    self.inner_dp = data_parallel(loss_fn, _worker_skip(inner, skip_nonfinite, fn), mesh,
                                  axis_name, local_params=True, skip_nonfinite=False,
                                  donate=False)
    self.exchange_dp = data_parallel(_probe_loss, _mean_of_params(reducer), mesh, axis_name,
                                     local_params=True, donate=False)
    self.mesh = mesh
    self.workers = self.inner_dp.num_workers
    self.own_weight = (1.0 / self.workers if own_weight is None else base.check_number(
        "own_weight", own_weight, fn=fn, low=0.0, high=1.0, low_open=False, high_open=False))
    self._probe = {"rows": jnp.zeros((self.workers,), jnp.float32)}   # unread
    self._thread = concurrent.futures.ThreadPoolExecutor(1, "commopt-eager-exchange")
    self._outer_step = jax.jit(self._outer_fn, static_argnums=5)
    self._mean = jax.jit(lambda tree: jax.tree.map(lambda x: jnp.mean(x, axis=0), tree))
    self._zeros = jax.jit(lambda tree: jax.tree.map(jnp.zeros_like, tree))

  def _outer_fn(self, params, anchors, previous, mean, outer_state, own: bool):
    """Every worker's outer step (no collective): ``(params, anchors, outer state, Δ)`` after
    it. With ``own`` (an outer step) on ``w·Δ + mean − w·Δ⁻``, the parameters restarting
    from the new anchor; without (:meth:`finish`) on ``mean − w·Δ⁻``, the parameters moved
    as their anchor moved."""
    w = self.own_weight

    def one(p, a, prev, avg, state):
      delta = jax.tree.map(lambda a_, p_: a_ - p_.astype(a_.dtype), a, p)
      eager = jax.tree.map(lambda d, g, e: (d * w if own else 0) + g - e * w, delta, avg, prev)
      step, state = self.outer.update(eager, state, a)
      moved = optax.apply_updates(a, step)
      if own:
        new = jax.tree.map(lambda p_, b_: b_.astype(p_.dtype), p, moved)
      else:
        new = jax.tree.map(lambda p_, a_, b_: (p_.astype(a_.dtype) + b_ - a_).astype(p_.dtype),
                           p, a, moved)
      return new, moved, state, delta
    return jax.vmap(one)(params, anchors, previous, mean, outer_state)

  def place_params(self, params):
    """Every worker's copy of ``params`` (stacked over the data axis), as ``data_parallel``'s."""
    return self.inner_dp.place_params(params)

  def local_batch(self, batch):
    """The global batch from this process's rows of it (multi-process runs), as
    ``data_parallel``'s :meth:`~commopt.DataParallel.local_batch`."""
    return self.inner_dp.local_batch(batch)

  def init(self, params) -> EagerState:
    """The state at the start: every worker's anchor = ``params``, no exchange yet."""
    stacked = self.place_params(jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params))
    with jax.set_mesh(self.mesh):
      zeros, outer = self._zeros(stacked), jax.jit(jax.vmap(self.outer.init))(stacked)
    return EagerState(inner=self.inner_dp.init(params), anchors=stacked, outer=outer,
                      previous=zeros, exchange=self.exchange_dp.init(params))

  def _exchange(self, deltas, exchange_state):
    """One exchange (run on the thread): the mean pseudo-gradient, on every worker."""
    mean, exchange_state, _ = self.exchange_dp.step(deltas, exchange_state, self._probe)
    return jax.block_until_ready((mean, exchange_state))

  def _collect(self, state: EagerState):
    """The mean of the exchange in flight (zeros when none), and its state taken in."""
    if state.pending is None:
      return state.previous          # zeros: before the first exchange, or after finish()
    mean, state.exchange = state.pending.result()
    state.pending = None
    return mean

  def step(self, params, state: EagerState, batch):
    """One inner step on every worker; every ``period``-th also the eager outer step and
    the start of its exchange. Returns ``(params, state, losses)`` (``state`` updated in
    place)."""
    params, state.inner, losses = self.inner_dp.step(params, state.inner, batch)
    state.count += 1
    if state.count % self.period == 0:
      mean = self._collect(state)
      with jax.set_mesh(self.mesh):
        params, state.anchors, state.outer, deltas = self._outer_step(
            params, state.anchors, state.previous, mean, state.outer, True)
      state.previous = deltas
      state.pending = self._thread.submit(self._exchange, deltas, state.exchange)
    return params, state, losses

  def finish(self, params, state: EagerState):
    """Collects the exchange in flight and applies the other workers' part of it (each
    worker's own part is already in), so the workers agree again (exactly for a linear
    outer step). Training may go on afterwards."""
    if state.pending is not None:
      mean = self._collect(state)
      with jax.set_mesh(self.mesh):
        params, state.anchors, state.outer, _ = self._outer_step(
            params, state.anchors, state.previous, mean, state.outer, False)
        state.previous = self._zeros(state.previous)
    return params, state

  def global_params(self, state: EagerState):
    """The workers' mean anchor (after :meth:`finish`, each worker's own with sgd)."""
    with jax.set_mesh(self.mesh):
      return self._mean(state.anchors)

  def close(self) -> None:
    """Waits for the exchange thread and stops it."""
    self._thread.shutdown(wait=True)


def eager_diloco(loss_fn: Callable, inner: optax.GradientTransformation, mesh,
                 outer: Optional[optax.GradientTransformation] = None, **kwargs) -> EagerDiLoCo:
  """DiLoCo with eager outer updates, each exchange overlapping the whole next inner phase.

  See :class:`EagerDiLoCo` (the same arguments).

  Examples:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, commopt
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> x = np.random.default_rng(0).normal(size=(32, 2)).astype(np.float32)
    >>> batch = {"x": x, "y": x @ np.array([[2.0], [-1.0]], np.float32)}
    >>> run = commopt.parallel.eager_diloco(lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2),
    ...                            optax.sgd(0.5), mesh, period=5)
    >>> local = run.place_params({"w": jnp.zeros((2, 1))})
    >>> state = run.init({"w": jnp.zeros((2, 1))})
    >>> for _ in range(200):
    ...   local, state, losses = run.step(local, state, batch)
    >>> local, state = run.finish(local, state)      # the exchange in flight taken in
    >>> run.close()
    >>> np.round(np.asarray(run.global_params(state)["w"]).ravel(), 2)
    array([ 2., -1.], dtype=float32)
  """
  return EagerDiLoCo(loss_fn, inner, mesh, outer, **kwargs)
