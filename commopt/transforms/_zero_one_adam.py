"""0/1 Adam: the variance updated ever more rarely, then frozen, and 1-bit exchanges ever more
rarely (see :mod:`commopt.transforms._compressed_momentum` for the shared exchange).

The factory checks the options (:func:`_checked_options`), and its update runs one of two
phases, each a ``lax.cond`` branch on the step: the variance phase
(:func:`_variance_phase`: dense Adam moments on ``T_v``, 1-bit gradients between) and the
frozen phase (:func:`_frozen_phase`: local Adam steps, with :func:`_synchronise` on ``T_u``).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from commopt._src import base
from commopt.comm import _collectives as coll
from commopt.transforms._compressed_mean import DEFAULT_MIN_SIZE
from commopt.transforms._compressed_momentum import (
    MomentumOptions, adam_step, check_mask_fits, check_params, dense_branch, denominator, ema,
    lr_at, masked, momentum_options, planned, wide_zeros, widen)


class ZeroOneAdamState(NamedTuple):
  """State of :func:`zero_one_adam`.

  Attributes:
    count: steps so far (int32), the same on every worker.
    mu: the momentum (float32 or wider); per worker between synchronisations
      after ``var_freeze_step``.
    nu: the second moment, the same on every worker, frozen after
      ``var_freeze_step``.
    moved: each worker's parameter change since the last synchronisation
      (DeepSpeed's ``momentum_accumulator``, the paper's ``u``); zero in the
      variance phase.
    lr_sum: the learning rates summed since the last synchronisation
      (DeepSpeed's ``lrs``).
    reducer_state: the :func:`~commopt.compressed_mean` state of the 1-bit
      exchanges (worker and server error memories).
  """
  count: jax.Array
  mu: Any
  nu: Any
  moved: Any
  lr_sum: jax.Array
  reducer_state: Any


def _variance_phase_ends(var_update_scaler: int, var_freeze_step: int) -> list[int]:
  """DeepSpeed's step counter at the last variance update of each interval 1, 2, 4, ...

  The counter reads 1 before the first update (see :func:`zero_one_adam`);
  interval ``2ʲ`` takes the ``var_update_scaler`` smallest multiples of
  ``2ʲ`` after the previous interval's last step, until the variance phase
  ends (counter ``var_freeze_step + 1``).
  """
  ends, last, j = [], 1, 0
  while last <= var_freeze_step and j < 30:
    first = (last // 2 ** j + 1) * 2 ** j
    last = first + (var_update_scaler - 1) * 2 ** j
    ends.append(min(last, np.iinfo(np.int32).max))
    j += 1
  return ends


def _zero_one_schedule(count, var_freeze_step, ends, local_step_scaler, local_step_clipper):
  """``(variance_step, sync_step, frozen)`` at 0-based ``count``, traced (jnp) or not (numpy).

  ``frozen``: after the variance phase. ``variance_step``: a variance-phase step in
  ``T_v``. ``sync_step``: a frozen step in ``T_u`` (it synchronises).
  """
  xp = jnp if isinstance(count, jax.Array) else np
  count = count if xp is jnp else np.int64(count)
  s = count + 2                                            # DeepSpeed's step counter
  frozen = count >= var_freeze_step
  var_interval = xp.left_shift(1, xp.sum(xp.asarray(ends, dtype=np.int32) < s))
  variance_step = ~frozen & (s % var_interval == 0)
  doublings = xp.maximum(count - var_freeze_step, 0) // local_step_scaler
  local_interval = xp.minimum(local_step_clipper, xp.left_shift(1, xp.minimum(doublings, 30)))
  return variance_step, frozen & (s % local_interval == 0), frozen


def zero_one_adam(learning_rate: Union[float, optax.Schedule], *, axis_name,
                  var_freeze_step: int = 100000, var_update_scaler: int = 16,
                  local_step_scaler: int = 32678, local_step_clipper: int = 16,
                  b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                  weight_decay: float = 0.0, compressor: Optional[base.Compressor] = None,
                  strategy: str = "two_phase", min_size: int = DEFAULT_MIN_SIZE, seed: int = 0,
                  exp_avg_mask: Any = None) -> optax.GradientTransformationExtraArgs:
  """0/1 Adam: the variance updated ever more rarely, then frozen; 1-bit exchanges ever more rarely.

  Per worker ``i`` with gradient ``gᵢ`` and parameters ``θᵢ``, at step
  ``count`` (0-based)::

    variance phase, count < var_freeze_step (every step exchanges):
      in T_v:      g = mean_i gᵢ                      one dense all-reduce
                   m ← β₁m + (1−β₁)g;   v ← β₂v + (1−β₂)g²
      not in T_v:  m ← β₁m + (1−β₁)·mean_i C(gᵢ)      1-bit gradients, v kept
      θ ← θ − lr·(m/(√v+ε) + wd·θ)
    frozen phase, count ≥ var_freeze_step (v frozen), each worker on its own:
      mᵢ ← β₁mᵢ + (1−β₁)gᵢ
      sᵢ = lr·(mᵢ/(√v+ε) + wd·θᵢ);   θᵢ ← θᵢ − sᵢ;   uᵢ ← uᵢ − sᵢ;   Λ ← Λ + lr
      in T_u:      ū = mean_i C(uᵢ·(√v+ε))           1-bit accumulated moves
                   θᵢ ← θᵢ − uᵢ + ū/(√v+ε);   m ← −ū/Λ;   uᵢ ← 0;   Λ ← 0
      not in T_u:  nothing crosses the wire

  At a synchronisation ``θᵢ − uᵢ`` is the parameters at the previous one, the
  same on every worker, so all workers leave it with the same parameters
  and momentum (the learning-rate-weighted mean of the local momenta).

  The schedules are DeepSpeed's (``ZeroOneAdam``), on its step counter
  ``s = count + 2``: DeepSpeed's first ``step()`` call only allocates its
  buffers (it applies no update) but counts as step 1, so its first update is
  its step 2. Run on that counter, the rules pick the same updates as
  DeepSpeed's:

  - ``T_v``: a variance interval ``I_v`` starts at 1; step ``s`` is in
    ``T_v`` when ``s mod I_v = 0``, and ``I_v`` doubles after every
    ``var_update_scaler`` (``κ``) steps in ``T_v``: the first ``κ`` updates,
    then ``κ`` updates at even ``s``, then ``κ`` at multiples of 4, ...
  - ``T_u``: a local-step interval ``I_u`` starts at 1 on the first frozen
    step; step ``s`` is in ``T_u`` when ``s mod I_u = 0``, and ``I_u``
    doubles, up to ``local_step_clipper``, after every ``local_step_scaler``
    frozen steps (synchronising or not):
    ``I_u = min(local_step_clipper, 2^⌊(count − var_freeze_step) / local_step_scaler⌋)``.

  ``C`` is :func:`~commopt.compressed_mean`'s two-phase 1-bit all-reduce with
  worker and server error memories (see :func:`onebit_adam`); both memories
  are zeroed at the first frozen step, since the variance phase filled them
  with gradients' errors and the frozen phase compresses accumulated moves.
  :func:`commopt.wire.comm_plan` with ``step`` gives each step's
  collectives: a dense all-reduce on ``T_v``, about two 1-bit payloads of the
  model on the variance phase's other steps and on ``T_u``, nothing on the
  frozen steps outside ``T_u``. As in DeepSpeed neither moment is
  bias-corrected; the 1-bit scale differs as in :func:`onebit_adam`. A 1-bit
  value carries its chunk's mean magnitude, so a coordinate whose ``v`` is
  tiny (few variance updates, a gradient far below its neighbours') moves by
  about ``lr·|C|/ε``: ``exp_avg_mask`` (as DeepSpeed's) zeroes the momentum
  of coordinates known to need none; a larger ``eps`` bounds the step.

  The parameters differ between workers between synchronisations: run it
  under ``commopt.data_parallel(..., local_params=True)``, ``jax.vmap`` over
  the workers, or a ``shard_map`` with per-worker parameters.

  Args:
    learning_rate: a float or an optax schedule of the step.
    axis_name: the data axis.
    var_freeze_step: the variance phase's length in updates, >= 0: the
      first ``var_freeze_step`` updates may update ``v`` (on ``T_v``) and
      exchange every step; then ``v`` is frozen and the local steps begin
      (DeepSpeed freezes once its counter exceeds ``var_freeze_step``, after
      the update at counter ``var_freeze_step + 1``). DeepSpeed documents it
      as the latest step to update the variance, the paper's ``max T_v``,
      usually the end of the learning-rate warm-up. DeepSpeed's default,
      100000.
    var_update_scaler: ``κ`` of the paper: how many variance updates each
      interval of ``T_v`` takes before it doubles, >= 1. Default 16.
    local_step_scaler: frozen steps at each local-step interval before it
      doubles, >= 1 (DeepSpeed: "the interval to scale the local steps
      interval according to the learning rate policy"). DeepSpeed's default,
      32678.
    local_step_clipper: ``H`` of the paper: the largest local-step interval,
      >= 1. Default 16.
    b1: as in :func:`onebit_adam`.
    b2: as in :func:`onebit_adam`.
    eps: as in :func:`onebit_adam` (which says why ``1e-4`` may be needed).
    weight_decay: as in :func:`onebit_adam`.
    compressor: as in :func:`onebit_adam` (it serves every 1-bit exchange).
    strategy: as in :func:`onebit_adam`.
    min_size: as in :func:`onebit_adam`.
    seed: as in :func:`onebit_adam`.
    exp_avg_mask: as in :func:`onebit_adam`; it multiplies what each 1-bit
      exchange returns (the variance phase's mean gradient, a
      synchronisation's ``ū``), so where it is 0 a synchronisation leaves
      ``m = 0`` and the parameters as the previous one (or the freeze) left them.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` takes each
    worker's own ``params`` (needed with ``weight_decay``); state
    :class:`ZeroOneAdamState`.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, commopt
    >>> tx = commopt.transforms.zero_one_adam(1e-3, axis_name="data", var_freeze_step=2,
    ...                            local_step_scaler=1, local_step_clipper=4)
    >>> params = {"w": jnp.ones((64, 32))}
    >>> dp = commopt.data_parallel(lambda p, b: jnp.mean((b @ p["w"]) ** 2), tx,
    ...                            jax.make_mesh((1,), ("data",)), local_params=True)
    >>> p, state = dp.place_params(params), dp.init(params)
    >>> for _ in range(4):
    ...   p, state, losses = dp.step(p, state, jnp.ones((8, 64)))
    >>> # Bytes per worker at steps 0-7 on 8 workers: dense Adam twice, then T_u's 1-bit rounds.
    >>> [commopt.wire.comm_plan(tx, params, 8, step=t).contributed_bytes for t in range(8)]
    [8192, 8192, 324, 0, 0, 0, 324, 0]

  References:
    Lu et al., Maximizing Communication Efficiency for Large-scale Training
    via 0/1 Adam, ICLR 2023.
  """
  o = _checked_options(
      momentum_options("zero_one_adam", learning_rate, axis_name, b1=b1, b2=b2, eps=eps,
                       weight_decay=weight_decay, compressor=compressor, strategy=strategy,
                       min_size=min_size, seed=seed, exp_avg_mask=exp_avg_mask),
      var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper)
  return planned(_init_fn(o.common), _update_fn(o), o.common.reducer, o.common.axis_name,
                 lambda step: _exchange_at(o, step), o.common.fn)


class _ZeroOneOptions(NamedTuple):
  """:func:`zero_one_adam`'s checked options: the shared ones and its schedules'."""
  common: MomentumOptions
  var_freeze_step: int
  variance_ends: list[int]
  local_step_scaler: int
  local_step_clipper: int

  def schedule(self, count):
    """``(variance_step, sync_step, frozen)`` at 0-based ``count`` (see
    :func:`_zero_one_schedule`)."""
    return _zero_one_schedule(count, self.var_freeze_step, self.variance_ends,
                              self.local_step_scaler, self.local_step_clipper)


def _checked_options(common: MomentumOptions, var_freeze_step, var_update_scaler,
                     local_step_scaler, local_step_clipper) -> _ZeroOneOptions:
  """The schedules' options checked (a ValueError naming the option)."""
  fn = common.fn
  var_freeze_step = base.check_int("var_freeze_step", var_freeze_step, fn=fn, minimum=0)
  var_update_scaler = base.check_positive_int("var_update_scaler", var_update_scaler, fn=fn)
  local_step_scaler = base.check_positive_int("local_step_scaler", local_step_scaler, fn=fn)
  local_step_clipper = base.check_positive_int("local_step_clipper", local_step_clipper, fn=fn)
  return _ZeroOneOptions(common, var_freeze_step,
                         _variance_phase_ends(var_update_scaler, var_freeze_step),
                         local_step_scaler, local_step_clipper)


def _exchange_at(o: _ZeroOneOptions, step: int) -> Optional[str]:
  """What crosses the wire at ``step``: ``"dense"``, ``"compressed"`` or None."""
  variance_step, sync_step, frozen = o.schedule(step)
  if not frozen:
    return "dense" if variance_step else "compressed"
  return "compressed" if sync_step else None


def _init_fn(c: MomentumOptions):
  def init_fn(params):
    check_mask_fits(c, params)
    zeros = wide_zeros(params)
    return ZeroOneAdamState(count=jnp.zeros([], jnp.int32), mu=zeros, nu=zeros, moved=zeros,
                            lr_sum=jnp.zeros([], jnp.float32), reducer_state=c.reducer.init(zeros))
  return init_fn


def _update_fn(o: _ZeroOneOptions):
  """The update: the frozen phase or the variance phase (a cond on the step), its
  result cast to the updates' dtypes."""
  c = o.common

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    check_params(c.fn, params, c.weight_decay)
    coll.check_input(c.fn, updates, c.axis_name)
    grads = widen(updates)
    lr = lr_at(c.learning_rate, state.count)
    variance_step, sync_step, frozen = o.schedule(state.count)
    out, mu, nu, moved, lr_sum, red = coll.cond(
        frozen, _frozen_phase(o, state.count, lr, sync_step, params),
        _variance_phase(c, lr, variance_step, params),
        (grads, state.mu, state.nu, state.moved, state.lr_sum, state.reducer_state))
    out = jax.tree.map(lambda s, u: s.astype(jnp.result_type(u)), out, updates)
    return out, ZeroOneAdamState(count=optax.safe_int32_increment(state.count), mu=mu, nu=nu,
                                 moved=moved, lr_sum=lr_sum.astype(jnp.float32),
                                 reducer_state=red)
  return update_fn


def _variance_phase(c: MomentumOptions, lr, variance_step, params):
  """The cond branch before ``var_freeze_step``, ``(grads, mu, nu, moved, lr_sum,
  reducer_state) -> (update, mu, nu, moved, lr_sum, reducer_state)``: Adam's moments on
  the dense mean gradient on ``T_v``, else ``m`` on the 1-bit mean gradient (masked) with
  ``v`` kept; every worker takes the same Adam step."""
  def onebit(ops):
    grads, mu, nu, red = ops
    g, red = c.reducer.update(grads, red)
    return jax.tree.map(ema(c.b1), mu, masked(c, g)), nu, red

  def variance_phase(ops):
    grads, mu, nu, moved, lr_sum, red = ops
    mu, nu, red = coll.cond(variance_step, dense_branch(c.b1, c.b2, c.axis_name), onebit,
                            (grads, mu, nu, red))
    out = jax.tree.map(lambda s: -lr * s, adam_step(mu, nu, c.eps, c.weight_decay, params))
    return out, mu, nu, moved, lr_sum, red
  return variance_phase


def _frozen_phase(o: _ZeroOneOptions, count, lr, sync_step, params):
  """The cond branch from ``var_freeze_step`` on, with the operands of
  :func:`_variance_phase`: each worker's Adam step on its own momentum with ``v`` frozen,
  added to ``moved`` and its learning rate to ``lr_sum``; on ``T_u`` :func:`_synchronise`."""
  c = o.common

  def frozen_phase(ops):
    grads, mu, nu, moved, lr_sum, red = ops
    mu = jax.tree.map(ema(c.b1), mu, grads)
    step = jax.tree.map(lambda s: -lr * s, adam_step(mu, nu, c.eps, c.weight_decay, params))
    now = jax.tree.map(lambda u, s: u + s, moved, step)
    lr_sum = lr_sum + lr
    local = lambda ops: (step, ops[0], now, lr_sum, ops[1])
    out, mu, moved, lr_sum, red = coll.cond(
        sync_step, _synchronise(o, count, nu, now, moved, lr_sum), local, (mu, red))
    return out, mu, nu, moved, lr_sum, red
  return frozen_phase


def _synchronise(o: _ZeroOneOptions, count, nu, now, moved, lr_sum):
  """The cond branch on ``T_u``, ``(mu, reducer_state) -> (update, mu, moved, lr_sum,
  reducer_state)``: ``now`` (the moves since the last synchronisation, this step's
  included) times ``√v+ε`` crosses 1-bit; its mean (masked) sets the update that brings
  every worker to the same parameters, and ``m``; ``moved`` and ``lr_sum`` restart at 0."""
  c = o.common

  def synchronise(ops):
    mu, red = ops
    red = _forget_errors(red, count == o.var_freeze_step)
    denom = denominator(nu, c.eps)
    mean, red = c.reducer.update(jax.tree.map(lambda u, d: u * d, now, denom), red)
    mean = masked(c, mean)
    mu = jax.tree.map(lambda a, m: jnp.where(lr_sum > 0, -a / lr_sum, m), mean, mu)
    out = jax.tree.map(lambda a, d, u: a / d - u, mean, denom, moved)
    return out, mu, jax.tree.map(jnp.zeros_like, now), jnp.zeros_like(lr_sum), red
  return synchronise


def _forget_errors(red, first):
  """The error memories, zeroed at the ``first`` synchronisation: the variance phase's
  errors were the gradients', the frozen phase's are the moves'."""
  forget = lambda e: jnp.where(first, jnp.zeros_like(e), e)
  return red._replace(residual=jax.tree.map(forget, red.residual),
                      server_residual=jax.tree.map(forget, red.server_residual))
