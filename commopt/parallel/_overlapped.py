"""Streaming DiLoCo's outer exchange overlapped with the next inner steps: two programs, the
exchange on a thread of its own."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from commopt._src import base
from commopt.parallel._data_parallel import data_parallel
from commopt.transforms._layout import local_value_and_grad
from commopt.transforms._compressed_mean import DEFAULT_MIN_SIZE
from commopt.transforms._control import apply_if_finite
from commopt.transforms._sync._diloco import diloco


@dataclasses.dataclass
class OverlappedState:
  """What :class:`OverlappedDiLoCo` carries between steps (host-level: not a pytree).

  Attributes:
    inner: the inner optimizer's state (per worker), as ``data_parallel`` keeps it (inside
      each worker's :class:`~commopt.transforms.ApplyIfFiniteState` with ``skip_nonfinite``).
    exchange: the exchange's state (a :func:`~commopt.diloco` state: the anchor,
      the error-feedback residuals, the outer optimizer's state).
    count: inner steps so far.
    pending: the exchange in flight (a future of its result), or None.
    merge_at: the count after which ``pending`` is merged.
  """
  inner: Any
  exchange: Any
  count: int = 0
  pending: Optional[concurrent.futures.Future] = None
  merge_at: Optional[int] = None

  @property
  def anchor(self):
    """The global model at the last merged exchange."""
    return self.exchange.inner_state.anchor


def _probe_loss(params, batch):
  """Zero, with a gradient that is NaN wherever a parameter is not finite: the exchange's
  agreed skip then keeps a worker's non-finite parameters out of the anchor."""
  del batch
  return sum(jnp.sum(jnp.square(p)) for p in jax.tree.leaves(params)) * 0.0


def _worker_skip(inner, skip_nonfinite, fn: str):
  """``inner`` wrapped so that each worker skips its own non-finite inner step (a verdict
  of its own: no collective across workers), or ``inner`` itself (``skip_nonfinite=False``)."""
  return apply_if_finite(inner) if base.check_bool("skip_nonfinite", skip_nonfinite,
                                                   fn=fn) else inner


class OverlappedDiLoCo:
  """Streaming DiLoCo (one fragment) whose outer exchange runs beside the next inner steps.

  The same update as ``data_parallel(loss_fn, streaming_diloco(inner, outer,
  fragments=1, delay=delay, mixing=mixing, ...), local_params=True)``, run as
  two programs: the inner steps (no collective at all), and the exchange
  (the pseudo-gradient's compressed mean and the outer step), which
  :meth:`step` dispatches on a thread of its own after every ``period``-th
  inner step and merges ``delay`` steps later::

    step t (t % period == 0):  exchange(anchor − θᵢ)   -> anchor′      (in flight)
    steps t+1 … t+delay:       θᵢ ← θᵢ + inner(gᵢ)                   (meanwhile)
    after step t+delay:        θᵢ ← mixing·θᵢ + (1 − mixing)·anchor′

  With ``delay=0`` the exchange is waited for at once: ``mixing=0`` is then
  :func:`~commopt.diloco`. Where ``delay`` inner steps take longer than an
  exchange, its time is hidden: on XLA:CPU over gloo two programs
  dispatched from two threads run at once (two dispatched from one thread
  run one after the other).

  The driver is host-level: :meth:`step` is not a pure function and does not
  go inside ``jit`` or ``scan`` (it is two programs and a thread by design).
  Every process of a multi-process job calls it in the same order; the inner
  program has no collective, so the exchange's are the only ones in flight.
  **Run no collective of your own while an exchange is in flight** (between
  the ``period``-th step and its merge ``delay`` steps later): over gloo, a
  ``multihost_utils.process_allgather`` of the losses then interleaves with
  the exchange differently on different processes, and the job aborts
  ("collective mismatch"). Log each process's own losses, or call
  :meth:`finish` first.
  With ``skip_nonfinite`` (the default) each worker skips its own inner step
  whose gradients hold a NaN or an infinity (its parameters and inner
  optimizer state kept, counted in its ``ApplyIfFiniteState``): a verdict of
  its own, with no collective across workers (a worker whose leaves are
  sharded over model axes agrees over those axes only), so nothing crosses
  the data axis beside the exchange. The
  exchange skips by agreement (``data_parallel``'s skip, on a probe whose
  gradient is NaN where a parameter is), so a worker whose parameters went
  non-finite never reaches the anchor. Checkpoint between a merge and the
  next exchange (:meth:`finish` merges what is in flight).

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``, as for ``data_parallel``.
    inner: the workers' optimizer.
    mesh: the device mesh.
    outer: the anchor's optimizer, as :func:`~commopt.diloco` picks it.
    axis_name: the data axis.
    period: inner steps between exchanges (H).
    delay: inner steps an exchange overlaps (τ), ``0 <= delay < period``.
    mixing: the weight of the local parameters in the merge, in [0, 1).
    compressor: compresses the pseudo-gradients, as in :func:`~commopt.diloco`.
    error_feedback: as in :func:`~commopt.diloco`.
    residual_decay: as in :func:`~commopt.diloco`.
    strategy: as in :func:`~commopt.diloco`.
    min_size: as in :func:`~commopt.diloco`.
    seed: as in :func:`~commopt.diloco`.
    skip_nonfinite: each worker skips its own non-finite inner steps (True, the
      default; no collective across workers) or runs them as they come (False).

  References:
    Douillard et al., Streaming DiLoCo with overlapping communication:
    Towards a Distributed Free Lunch, 2025.
  """

  def __init__(self, loss_fn: Callable, inner: optax.GradientTransformation, mesh,
               outer: Optional[optax.GradientTransformation] = None, *, axis_name="data",
               period: int, delay: int = 1, mixing: float = 0.5,
               compressor: Optional[base.Compressor] = None, error_feedback="auto",
               residual_decay: float = 1.0, strategy: str = "auto",
               min_size: int = DEFAULT_MIN_SIZE, seed: int = 0, skip_nonfinite: bool = True):
    fn = "overlapped_diloco"
    self.period = base.check_positive_int("period", period, fn=fn)
    self.delay = base.check_int("delay", delay, fn=fn, minimum=0)
    if self.delay >= self.period:
      raise ValueError(f"{fn}: `delay` must be below `period` ({period}), got {delay}: an "
                       "exchange is merged before the next one starts.")
    self.mixing = base.check_number("mixing", mixing, fn=fn, low=0, high=1, low_open=False)
    self.exchange_tx = diloco(optax.set_to_zero(), outer, axis_name=axis_name, period=1,
                              compressor=compressor, error_feedback=error_feedback,
                              residual_decay=residual_decay, strategy=strategy,
                              min_size=min_size, seed=seed)
    self.inner_dp = data_parallel(loss_fn, _worker_skip(inner, skip_nonfinite, fn), mesh,
                                  axis_name, local_params=True, skip_nonfinite=False,
                                  donate=False)
    self.exchange_dp = data_parallel(_probe_loss, self.exchange_tx, mesh, axis_name,
                                     local_params=True, donate=False)
    self.mesh = mesh
    self._probe = {"rows": jnp.zeros((self.exchange_dp.num_workers,), jnp.float32)}   # unread
    self._thread = concurrent.futures.ThreadPoolExecutor(1, "commopt-overlapped-exchange")
    mix = self.mixing
    self._merge = jax.jit(lambda local, anchor: jax.tree.map(
        lambda l, a: (mix * l.astype(a.dtype) + (1 - mix) * a).astype(l.dtype), local, anchor))

  def place_params(self, params):
    """Every worker's copy of ``params`` (stacked over the data axis), as ``data_parallel``'s."""
    return self.inner_dp.place_params(params)

  def local_batch(self, batch):
    """The global batch from this process's rows of it (multi-process runs), as
    ``data_parallel``'s :meth:`~commopt.DataParallel.local_batch`."""
    return self.inner_dp.local_batch(batch)

  def init(self, params) -> OverlappedState:
    """The state at the start: the inner optimizer's per worker, the anchor = ``params``."""
    return OverlappedState(inner=self.inner_dp.init(params),
                           exchange=self.exchange_dp.init(params))

  def _exchange(self, local, exchange_state):
    """One exchange (run on the thread): every worker's new parameters (the anchor′) and the
    exchange's state."""
    anchor, exchange_state, _ = self.exchange_dp.step(local, exchange_state, self._probe)
    return jax.block_until_ready((anchor, exchange_state))

  def _merged(self, params, state: OverlappedState):
    anchor, state.exchange = state.pending.result()
    state.pending, state.merge_at = None, None
    return self._merge(params, anchor)

  def step(self, params, state: OverlappedState, batch):
    """One inner step on every worker; the exchange started or merged where it is due.

    Returns ``(params, state, losses)`` as ``data_parallel``'s step does (``state``
    is updated in place and returned).
    """
    params, state.inner, losses = self.inner_dp.step(params, state.inner, batch)
    state.count += 1
    if state.pending is not None and state.count >= state.merge_at:
      params = self._merged(params, state)
    if state.count % self.period == 0:
      state.pending = self._thread.submit(self._exchange, params, state.exchange)
      state.merge_at = state.count + self.delay
      if self.delay == 0:
        params = self._merged(params, state)
    return params, state, losses

  def finish(self, params, state: OverlappedState):
    """Merges the exchange in flight, if any (before a checkpoint or an evaluation)."""
    if state.pending is not None:
      params = self._merged(params, state)
    return params, state

  def global_params(self, state: OverlappedState):
    """The anchor: the global model of the last merged exchange."""
    return state.anchor

  def close(self) -> None:
    """Waits for the exchange thread and stops it."""
    self._thread.shutdown(wait=True)


def overlapped_diloco(loss_fn: Callable, inner: optax.GradientTransformation, mesh,
                      outer: Optional[optax.GradientTransformation] = None, **kwargs
                      ) -> OverlappedDiLoCo:
  """Streaming DiLoCo whose outer exchange overlaps the next ``delay`` inner steps.

  See :class:`OverlappedDiLoCo` (the same arguments).

  Examples:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, commopt
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> loss = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
    >>> run = commopt.parallel.overlapped_diloco(loss, optax.adam(1e-2), mesh, period=4, delay=2)
    >>> params = {"w": jnp.zeros((16, 2))}
    >>> p, s = run.place_params(params), run.init(params)
    >>> x = np.ones((32, 16), np.float32)
    >>> for _ in range(8):
    ...   p, s, losses = run.step(p, s, {"x": x, "y": x[:, :2]})
    >>> p, s = run.finish(p, s)
    >>> run.close()
    >>> s.count, s.pending is None
    (8, True)
  """
  return OverlappedDiLoCo(loss_fn, inner, mesh, outer, **kwargs)


@dataclasses.dataclass
class OverlappedDataParallelState:
  """What :class:`OverlappedDataParallel` carries between steps (host-level: not a pytree).

  Attributes:
    opt: ``tx``'s state, as ``data_parallel`` keeps it.
    kept: every worker's gradient of the last step (stacked ``[num_workers, ...]``), which
      the next step exchanges; None before the first step and after
      :meth:`~OverlappedDataParallel.finish`.
    count: steps so far.
  """
  opt: Any
  kept: Any = None
  count: int = 0


def _kept_loss(params, batch):
  """A loss whose gradient is this worker's kept gradient ``batch["g"][0]``, exactly: a step
  on it is the exchange and ``tx``'s update of the kept gradient, with no compute."""
  return sum(jnp.vdot(p, g[0]) for p, g in zip(jax.tree.leaves(params),
                                               jax.tree.leaves(batch["g"])))


class OverlappedDataParallel:
  """A one-step-delayed data-parallel step whose exchange runs beside the next backward pass.

  The update of ``data_parallel(loss_fn, pipelined(apply_if_finite(tx, axis_name)),
  mesh, skip_nonfinite=False)`` (``θₜ₊₁ = θₜ + tx(gₜ₋₁)``, Pipe-SGD), run as two
  programs per step: the forward and backward pass at ``θₜ`` (no collective at all), and
  the exchange of the gradient kept from the step before with ``tx``'s update
  (``data_parallel``'s step on a loss whose gradient is the kept one, with its agreed skip
  of non-finite gradients), which :meth:`step` dispatches on a thread of its own. On
  XLA:CPU over gloo two programs dispatched from two threads run at once, where one
  program, or two from one thread, run their collectives and compute one after the other
  (the Overlap page), so a step costs about ``max(compute, exchange)``.

  The first step only computes and keeps its gradient (the parameters stay, as
  ``pipelined``'s first step applies zeros); :meth:`finish` exchanges and applies the
  gradient still kept (before a checkpoint or an evaluation). The same stability bounds
  as ``pipelined`` apply: one step of delay halves the stable step size of SGD and divides
  that of momentum SGD by about ``(1 + β)/(1 − β)``.

  The driver is host-level: :meth:`step` is not a pure function and does not go inside
  ``jit`` or ``scan``. Every process of a multi-process job calls it in the same order;
  the backward program has no collective, so the exchange's are the only ones in flight.
  **Run no collective of your own during a step** (over gloo it would interleave with the
  exchange differently on different processes and abort the job). ``loss_fn(params,
  batch) -> scalar`` on a 1-D data mesh; no auxiliary outputs or model state.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar`` (the mean over this worker's rows).
    tx: the optimizer, with the exchange (e.g. ``chain(compressed_mean(...), sgd(lr))``).
    mesh: the device mesh (one data axis).
    axis_name: the data axis.

  References:
    Li et al., Pipe-SGD: A Decentralized Pipelined SGD Framework for Distributed Deep
    Net Training, NeurIPS 2018.
  """

  def __init__(self, loss_fn: Callable, tx: optax.GradientTransformation, mesh, *,
               axis_name="data"):
    self.exchange_dp = data_parallel(_kept_loss, tx, mesh, axis_name, donate=False)
    if len(self.exchange_dp.axes) != 1 or len(mesh.axis_names) != 1:
      raise ValueError(f"overlapped_data_parallel: `mesh` must have one axis, the data axis "
                       f"{axis_name!r}; got axes {mesh.axis_names}.")
    self.mesh = mesh
    grad = local_value_and_grad(loss_fn, axis_name)

    def backward(params, batch):
      loss, grads = grad(params, batch)
      return loss[None], jax.tree.map(lambda g: g[None], grads)

    self._backward = jax.jit(jax.shard_map(backward, mesh=mesh, in_specs=(P(), P(axis_name)),
                                           out_specs=P(axis_name)))
    self._thread = concurrent.futures.ThreadPoolExecutor(1, "commopt-overlapped-exchange")

  def place_params(self, params):
    """``params`` replicated over the data axis, as ``data_parallel``'s."""
    return self.exchange_dp.place_params(params)

  def init(self, params) -> OverlappedDataParallelState:
    """``tx``'s state; nothing kept yet."""
    return OverlappedDataParallelState(opt=self.exchange_dp.init(params))

  def local_batch(self, batch):
    """The global batch from this process's rows (multi-process runs), as ``data_parallel``'s."""
    return self.exchange_dp.local_batch(batch)

  def _exchange(self, params, state: OverlappedDataParallelState):
    new_params, opt, _ = self.exchange_dp.step(params, state.opt, {"g": state.kept})
    return jax.block_until_ready((new_params, opt))

  def step(self, params, state: OverlappedDataParallelState, batch):
    """The backward pass at ``params`` beside the exchange of the kept gradient.

    Returns ``(params, state, losses)`` as ``data_parallel``'s step does (``state`` is
    updated in place and returned); ``losses`` are each worker's at the ``params`` given.
    """
    pending = None
    if state.kept is not None:
      pending = self._thread.submit(self._exchange, params, state)
    if not all(isinstance(x, jax.Array) for x in jax.tree.leaves(batch)):
      batch = self.exchange_dp.place_batch(batch)      # host rows (one process)
    with jax.set_mesh(self.mesh):
      losses, grads = self._backward(params, batch)
    if pending is not None:
      params, state.opt = pending.result()
    state.kept, state.count = grads, state.count + 1
    return params, state, losses

  def finish(self, params, state: OverlappedDataParallelState):
    """Exchanges and applies the kept gradient, if any: nothing computed is left unapplied."""
    if state.kept is not None:
      params, state.opt = self._exchange(params, state)
      state.kept = None
    return params, state

  def close(self) -> None:
    """Waits for the exchange thread and stops it."""
    self._thread.shutdown(wait=True)


def overlapped_data_parallel(loss_fn: Callable, tx: optax.GradientTransformation, mesh, *,
                             axis_name="data") -> OverlappedDataParallel:
  """A one-step-delayed data-parallel step whose exchange overlaps the next backward pass.

  See :class:`OverlappedDataParallel` (the same arguments).

  Examples:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, commopt
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> loss = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
    >>> tx = optax.chain(commopt.compressed_mean(commopt.scaled_sign(), axis_name="data"),
    ...                  optax.sgd(0.1))
    >>> run = commopt.parallel.overlapped_data_parallel(loss, tx, mesh)
    >>> params = {"w": jnp.zeros((16, 2))}
    >>> p, s = run.place_params(params), run.init(params)
    >>> x = np.ones((32, 16), np.float32)
    >>> for _ in range(5):
    ...   p, s, losses = run.step(p, s, {"x": x, "y": x[:, :2]})
    >>> p, s = run.finish(p, s)
    >>> run.close()
    >>> s.count, s.kept is None
    (5, True)
  """
  return OverlappedDataParallel(loss_fn, tx, mesh, axis_name=axis_name)
