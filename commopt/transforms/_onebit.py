"""Compressed adaptive optimizers: 1-bit Adam, 0/1 Adam and 1-bit LAMB.

All three follow DeepSpeed's implementations: the momentum (or the gradient,
or the accumulated move) crosses the data axis 1-bit with a scale through
:func:`~commopt.compressed_mean`'s two-phase reduction with worker and server
error memories, and the second moment stops changing after a warm-up. The
step count that drives every schedule is the transform's own (0-based
``count``, the same on every worker); a phase with an exchange sits in a
``lax.cond`` on it, so a step without one moves no bytes.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from commopt._src import base
from commopt.comm import _collectives as coll
from commopt.comm import _plan
from commopt.transforms._compressed_mean import DEFAULT_MIN_SIZE, compressed_mean
from commopt.transforms._control import _check_axes
from commopt.transforms._sync import _wide


class OneBitAdamState(NamedTuple):
  """State of :func:`onebit_adam`.

  Attributes:
    count: steps so far (int32), the same on every worker.
    mu: the momentum, the same on every worker (float32 or wider).
    nu: the second moment, frozen after ``freeze_step`` (float32 or wider).
    reducer_state: the :func:`~commopt.compressed_mean` state of the
      momentum's exchange: each worker's error memory and its chunk's server
      memory.
  """
  count: jax.Array
  mu: Any
  nu: Any
  reducer_state: Any


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


class OneBitLambState(NamedTuple):
  """State of :func:`onebit_lamb`.

  Attributes:
    count: steps so far (int32), the same on every worker.
    mu: the momentum, the same on every worker (float32 or wider).
    nu: the second moment, frozen after ``freeze_step``.
    fresh_nu: the second moment of the gradients reconstructed from the
      momentum after the freeze (DeepSpeed's ``exp_avg_sq_fresh``); equal to
      ``nu`` during the warm-up.
    frozen_ratio: per leaf, the running average of the warm-up trust ratios
      (DeepSpeed's ``lamb_coeff_freeze``), float32 scalars.
    last_factor: per leaf, the factor that rescaled ``frozen_ratio`` at the
      last compressed step (1 before the first).
    scaling: per leaf, the factor the momentum is multiplied by before
      compression (DeepSpeed's ``scaling_coeff``), set at the first compressed
      step (1 before).
    trust_ratio: per leaf, the coefficient the last update was scaled by
      (DeepSpeed's ``get_lamb_coeffs()``).
    reducer_state: the :func:`~commopt.compressed_mean` state of the
      momentum's exchange.
  """
  count: jax.Array
  mu: Any
  nu: Any
  fresh_nu: Any
  frozen_ratio: Any
  last_factor: Any
  scaling: Any
  trust_ratio: Any
  reducer_state: Any


# ---------------------------------------------------------------------------
# Shared pieces.


def _momentum_reducer(fn, learning_rate, axis_name, b1, b2, eps, weight_decay, compressor,
                      strategy, min_size, seed):
  """The checked (b1, b2, eps, weight_decay) and the compressed_mean of the 1-bit exchanges."""
  _check_axes(axis_name, fn)
  if not isinstance(axis_name, str):
    raise ValueError(f"{fn}: `axis_name` must name the data axis (a str), got {axis_name!r}.")
  b1 = base.check_number("b1", b1, fn=fn, low=0, high=1, low_open=False)
  b2 = base.check_number("b2", b2, fn=fn, low=0, high=1, low_open=False)
  eps = base.check_number("eps", eps, fn=fn, low=0, low_open=False)
  weight_decay = base.check_number("weight_decay", weight_decay, fn=fn, low=0, low_open=False)
  if not callable(learning_rate):
    base.check_number("learning_rate", learning_rate, fn=fn, low=0, low_open=False)
  base.check_choice("strategy", strategy, ("two_phase", "gather"), fn)
  min_size = base.check_int("min_size", min_size, fn=fn, minimum=0)
  seed = base.check_int("seed", seed, fn=fn)
  if compressor is None:
    from commopt.compressors import scaled_sign
    compressor = scaled_sign()
  reducer = compressed_mean(compressor, axis_name, error_feedback=True, strategy=strategy,
                            min_size=min_size, seed=seed)
  return b1, b2, eps, weight_decay, reducer


def _wide_zeros(params):
  return jax.tree.map(
      lambda p: jnp.zeros(jnp.shape(p), jnp.promote_types(p.dtype, jnp.float32)), params)


def _per_leaf(params, value: float):
  """One float32 scalar per leaf."""
  return jax.tree.map(lambda _: jnp.full([], value, jnp.float32), params)


def _lr_at(learning_rate, count):
  return learning_rate(count) if callable(learning_rate) else learning_rate


def _ema(beta):
  return lambda m, x: beta * m + (1 - beta) * x


def _dense_moments(grads, mu, nu, b1, b2, axis_name):
  """Adam's moments on the mean gradient (one dense all-reduce)."""
  g = jax.tree.map(lambda x: coll.pmean(x, axis_name), grads)
  mu = jax.tree.map(_ema(b1), mu, g)
  nu = jax.tree.map(lambda v, x: b2 * v + (1 - b2) * x * x, nu, g)
  return mu, nu


def _dense_branch(b1, b2, axis_name):
  """A cond branch ``(grads, mu, nu, reducer_state) -> (mu, nu, reducer_state)``: Adam's
  moments on the mean gradient, the reducer's state untouched."""
  def dense(ops):
    grads, mu, nu, red = ops
    mu, nu = _dense_moments(grads, mu, nu, b1, b2, axis_name)
    return mu, nu, red
  return dense


def _denominator(nu, eps):
  return jax.tree.map(lambda v: jnp.sqrt(v) + eps, nu)


def _adam_step(mu, nu, eps, weight_decay, params):
  """``m / (√v + ε) + weight_decay · θ``."""
  step = jax.tree.map(lambda m, d: m / d, mu, _denominator(nu, eps))
  if weight_decay:
    step = jax.tree.map(lambda s, p: s + weight_decay * _wide(p), step, params)
  return step


def _check_params(fn, params, weight_decay):
  if weight_decay and params is None:
    raise ValueError(f"{fn}: `weight_decay` needs `params` in `update`.")


def _norm(x):
  return base.safe_norm([x])


def _widened(params):
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.promote_types(x.dtype, jnp.float32)),
      params)


def _planned(init_fn, update_fn, reducer, axis_name, exchange_at):
  """The transform with its wire plans: a compressed step's exchange, and per step
  ``exchange_at(step)``'s: ``"dense"`` (one float all-reduce per leaf), ``"compressed"``
  (the reducer's) or None (nothing). Every exchange carries the widened values."""
  reducer_plan = _plan.planner_of(reducer)
  planner = lambda params, workers: reducer_plan(_widened(params), workers)

  def step_planner(params, workers, step):
    kind = exchange_at(step)
    if kind == "compressed":
      return planner(params, workers)
    if kind is None:
      return []
    return [_plan.planned(jax.tree_util.keystr(path), "all-reduce", axis_name, workers,
                          base.leaf_size(x.shape) * jnp.dtype(x.dtype).itemsize, packed=False)
            for path, x in jax.tree_util.tree_flatten_with_path(_widened(params))[0]]

  return _plan.with_planner(optax.GradientTransformationExtraArgs(init_fn, update_fn), planner,
                            step_planner)


# ---------------------------------------------------------------------------
# 1-bit Adam.


def onebit_adam(learning_rate: Union[float, optax.Schedule], freeze_step: int, *, axis_name,
                b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                weight_decay: float = 0.0, compressor: Optional[base.Compressor] = None,
                strategy: str = "two_phase", min_size: int = DEFAULT_MIN_SIZE, seed: int = 0
                ) -> optax.GradientTransformationExtraArgs:
  """1-bit Adam: Adam for ``freeze_step`` steps, then 1-bit momentum with the variance frozen.

  Per worker ``i`` with gradient ``gᵢ``, at step ``t``::

    t < freeze_step (warm-up, dense):
      g = mean_i gᵢ                                   one dense all-reduce
      m ← β₁m + (1−β₁)g;   v ← β₂v + (1−β₂)g²
    t ≥ freeze_step (compression):
      m ← mean_i C(β₁m + (1−β₁)gᵢ)                    v frozen
    update = −lr · (m / (√v + ε) + weight_decay · θ)

  ``C`` is the two-phase compressed all-reduce of DeepSpeed's 1-bit Adam:
  each worker adds its error memory to its momentum and sends it 1-bit with a
  scale (``compressor``, default :func:`~commopt.scaled_sign`), chunk ``j``
  to worker ``j``; worker ``j`` averages its chunk, adds its server memory,
  compresses again and all-gathers; both memories keep what compression
  missed (``compressed_mean(..., strategy="two_phase")``). After the freeze
  each worker sends about two 1-bit payloads of the model per step, 1/32 of
  a float32 all-reduce's volume. As in DeepSpeed, neither moment is
  bias-corrected and weight decay is added to the update. commopt's sign
  scale is the chunk's mean magnitude (the scale that minimises the
  squared error of ``s·sign(x)``); DeepSpeed uses ``‖x‖₂/√d``.

  Args:
    learning_rate: a float or an optax schedule of the step.
    freeze_step: dense Adam steps before the variance freezes, >= 0.
    axis_name: the data axis.
    b1: Adam's first-moment decay.
    b2: Adam's second-moment decay.
    eps: Adam's epsilon. After the freeze each 1-bit value carries its
      chunk's mean magnitude, so a coordinate whose frozen variance is tiny
      steps by about ``lr·|value|/eps``: with small models and few warm-up
      steps, ``1e-8`` can diverge where ``1e-4`` trains (the demo's default).
    weight_decay: added to the update times the parameters (needs ``params``).
    compressor: the momentum's compressor (stateless); default
      ``scaled_sign()``.
    strategy: its reduction, ``"two_phase"`` (as published) or ``"gather"``.
    min_size: leaves with fewer elements are all-reduced dense.
    seed: the compressor's base key.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; state :class:`OneBitAdamState`.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, commopt
    >>> tx = commopt.onebit_adam(1e-3, freeze_step=100, axis_name="data")
    >>> dp = commopt.data_parallel(lambda p, b: jnp.mean((b @ p["w"]) ** 2), tx,
    ...                            jax.make_mesh((1,), ("data",)))
    >>> params = {"w": jnp.ones((4, 2))}
    >>> params, state, losses = dp.step(params, dp.init(params), jnp.ones((8, 4)))
    >>> int(state.inner_state.count)       # data_parallel's state wraps the transform's
    1

  References:
    Tang et al., 1-bit Adam: Communication Efficient Large-Scale Training
    with Adam's Convergence Speed, ICML 2021.
  """
  fn = "onebit_adam"
  b1, b2, eps, weight_decay, reducer = _momentum_reducer(
      fn, learning_rate, axis_name, b1, b2, eps, weight_decay, compressor, strategy, min_size,
      seed)
  freeze_step = base.check_int("freeze_step", freeze_step, fn=fn, minimum=0)

  def init_fn(params):
    zeros = _wide_zeros(params)
    return OneBitAdamState(count=jnp.zeros([], jnp.int32), mu=zeros, nu=zeros,
                           reducer_state=reducer.init(zeros))

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    _check_params(fn, params, weight_decay)
    coll.check_input(fn, updates, axis_name)
    grads = jax.tree.map(_wide, updates)

    def frozen(ops):
      grads, mu, nu, red = ops
      mu, red = reducer.update(jax.tree.map(_ema(b1), mu, grads), red)
      return mu, nu, red

    mu, nu, red = coll.cond(state.count < freeze_step, _dense_branch(b1, b2, axis_name), frozen,
                            (grads, state.mu, state.nu, state.reducer_state))
    lr = _lr_at(learning_rate, state.count)
    step = _adam_step(mu, nu, eps, weight_decay, params)
    out = jax.tree.map(lambda s, u: (-lr * s).astype(jnp.result_type(u)), step, updates)
    return out, OneBitAdamState(count=optax.safe_int32_increment(state.count), mu=mu, nu=nu,
                                reducer_state=red)

  return _planned(init_fn, update_fn, reducer, axis_name,
                  lambda step: "dense" if step < freeze_step else "compressed")


# ---------------------------------------------------------------------------
# 0/1 Adam.


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
                  strategy: str = "two_phase", min_size: int = DEFAULT_MIN_SIZE, seed: int = 0
                  ) -> optax.GradientTransformationExtraArgs:
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
  about ``lr·|C|/ε``: DeepSpeed masks such coordinates (``exp_avg_mask``,
  not offered here); a larger ``eps`` bounds the step.

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

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` takes each
    worker's own ``params`` (needed with ``weight_decay``); state
    :class:`ZeroOneAdamState`.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, commopt
    >>> tx = commopt.zero_one_adam(1e-3, axis_name="data", var_freeze_step=2,
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
  fn = "zero_one_adam"
  b1, b2, eps, weight_decay, reducer = _momentum_reducer(
      fn, learning_rate, axis_name, b1, b2, eps, weight_decay, compressor, strategy, min_size,
      seed)
  var_freeze_step = base.check_int("var_freeze_step", var_freeze_step, fn=fn, minimum=0)
  var_update_scaler = base.check_positive_int("var_update_scaler", var_update_scaler, fn=fn)
  local_step_scaler = base.check_positive_int("local_step_scaler", local_step_scaler, fn=fn)
  local_step_clipper = base.check_positive_int("local_step_clipper", local_step_clipper, fn=fn)
  ends = _variance_phase_ends(var_update_scaler, var_freeze_step)
  schedule = lambda count: _zero_one_schedule(count, var_freeze_step, ends, local_step_scaler,
                                              local_step_clipper)

  def init_fn(params):
    zeros = _wide_zeros(params)
    return ZeroOneAdamState(count=jnp.zeros([], jnp.int32), mu=zeros, nu=zeros, moved=zeros,
                            lr_sum=jnp.zeros([], jnp.float32), reducer_state=reducer.init(zeros))

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    _check_params(fn, params, weight_decay)
    coll.check_input(fn, updates, axis_name)
    grads = jax.tree.map(_wide, updates)
    lr = _lr_at(learning_rate, state.count)
    variance_step, sync_step, frozen = schedule(state.count)

    def onebit(ops):
      grads, mu, nu, red = ops
      g, red = reducer.update(grads, red)
      return jax.tree.map(_ema(b1), mu, g), nu, red

    def variance_phase(ops):
      grads, mu, nu, moved, lr_sum, red = ops
      mu, nu, red = coll.cond(variance_step, _dense_branch(b1, b2, axis_name), onebit,
                              (grads, mu, nu, red))
      out = jax.tree.map(lambda s: -lr * s, _adam_step(mu, nu, eps, weight_decay, params))
      return out, mu, nu, moved, lr_sum, red

    def frozen_phase(ops):
      grads, mu, nu, moved, lr_sum, red = ops
      mu = jax.tree.map(_ema(b1), mu, grads)
      step = jax.tree.map(lambda s: -lr * s, _adam_step(mu, nu, eps, weight_decay, params))
      now = jax.tree.map(lambda u, s: u + s, moved, step)
      lr_sum = lr_sum + lr

      def synchronise(ops):
        mu, red = ops
        # The variance phase's errors were the gradients'; these are the moves'.
        first = state.count == var_freeze_step
        forget = lambda e: jnp.where(first, jnp.zeros_like(e), e)
        red = red._replace(residual=jax.tree.map(forget, red.residual),
                           server_residual=jax.tree.map(forget, red.server_residual))
        denom = _denominator(nu, eps)
        mean, red = reducer.update(jax.tree.map(lambda u, d: u * d, now, denom), red)
        mu = jax.tree.map(lambda a, m: jnp.where(lr_sum > 0, -a / lr_sum, m), mean, mu)
        out = jax.tree.map(lambda a, d, u: a / d - u, mean, denom, moved)
        return out, mu, jax.tree.map(jnp.zeros_like, now), jnp.zeros_like(lr_sum), red

      def local(ops):
        mu, red = ops
        return step, mu, now, lr_sum, red

      out, mu, moved, lr_sum, red = coll.cond(sync_step, synchronise, local, (mu, red))
      return out, mu, nu, moved, lr_sum, red

    out, mu, nu, moved, lr_sum, red = coll.cond(
        frozen, frozen_phase, variance_phase,
        (grads, state.mu, state.nu, state.moved, state.lr_sum, state.reducer_state))
    out = jax.tree.map(lambda s, u: s.astype(jnp.result_type(u)), out, updates)
    return out, ZeroOneAdamState(count=optax.safe_int32_increment(state.count), mu=mu, nu=nu,
                                 moved=moved, lr_sum=lr_sum.astype(jnp.float32),
                                 reducer_state=red)

  def exchange_at(step):
    variance_step, sync_step, frozen = schedule(step)
    if not frozen:
      return "dense" if variance_step else "compressed"
    return "compressed" if sync_step else None

  return _planned(init_fn, update_fn, reducer, axis_name, exchange_at)


# ---------------------------------------------------------------------------
# 1-bit LAMB.


def onebit_lamb(learning_rate: Union[float, optax.Schedule], freeze_step: int, *, axis_name,
                max_coeff: float = 10.0, min_coeff: float = 0.01, coeff_beta: float = 0.9,
                factor_max: float = 4.0, factor_min: float = 0.5, factor_threshold: float = 0.1,
                b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                weight_decay: float = 0.0, compressor: Optional[base.Compressor] = None,
                strategy: str = "two_phase", min_size: int = DEFAULT_MIN_SIZE, seed: int = 0
                ) -> optax.GradientTransformationExtraArgs:
  """1-bit LAMB: LAMB, then 1-bit momentum with the variance frozen and the trust ratio rescaled.

  Per leaf (a layer: DeepSpeed's parameter tensor) with parameters ``θ``, at
  step ``t``, with ``r̄ = 0``, ``f_last = 1`` and ``s = 1`` at the start::

    t < freeze_step (warm-up, dense LAMB):
      g = mean_i gᵢ;   m ← β₁m + (1−β₁)g;   v ← β₂v + (1−β₂)g²;   v_fresh ← v
      u = m/(√v+ε) + wd·θ
      r = clip(‖θ‖/‖u‖, min_coeff, max_coeff)      (1 where ‖θ‖ or ‖u‖ is 0)
      r̄ ← coeff_beta·r̄ + (1−coeff_beta)·r          (where r ≠ 1, as DeepSpeed)
    t ≥ freeze_step (compression; v frozen):
      at t = freeze_step:  s = mean_leaves(‖m‖/√n) / (‖m‖/√n)     (n: the leaf's size)
      m' = mean_i C(s·(β₁m + (1−β₁)gᵢ)) / s
      ĝ = (m' − β₁m)/(1−β₁);   v_fresh ← β₂v_fresh + (1−β₂)ĝ²;   m ← m'
      u = m/(√v+ε) + wd·θ
      f = max over the leaf's elements of (√v+ε)/(√v_fresh+ε)
      with wd > 0:  ρ = min(1, ‖m/(√v+ε)‖/‖u‖);   f ← ρf + 1 − ρ
      f ← clip(f, factor_min, factor_max)
      f ← clip(f, f_last·(1 − factor_threshold), f_last·(1 + factor_threshold));   f_last ← f
      r = r̄·f
    update = −lr · r · u

  The warm-up is LAMB without bias correction, its per-layer trust ratio
  averaged into ``r̄``; after the freeze ``r̄`` is frozen and rescaled by
  ``f``, which tracks how far the variance of the gradients reconstructed
  from the (compressed) momentum has moved from the frozen one. ``C`` is the
  two-phase 1-bit all-reduce with worker and server error memories of
  :func:`onebit_adam`; the momentum is multiplied by ``s`` before it, which
  brings every leaf to the same magnitude (DeepSpeed compresses all leaves as
  one buffer with one scale). With commopt's per-leaf compressors each
  leaf's chunks have their own scales, so ``s`` cancels (the 1-bit
  compressors are homogeneous); it matters for a tree-wide compressor
  (``strategy="gather"``).

  DeepSpeed's parameters, as ``OnebitLamb`` uses them:

  - ``max_coeff``, ``min_coeff``: bounds of the warm-up trust ratio
    ``‖θ‖/‖u‖`` (its "lamb coefficient"); not applied after the freeze.
  - ``coeff_beta``: the running average's rate for ``r̄``; DeepSpeed advises
    ``1/(1 − coeff_beta) ≤ freeze_step``.
  - ``factor_max``, ``factor_min``: bounds of the factor ``f`` that rescales
    the frozen ``r̄`` after the freeze.
  - ``factor_threshold``: the most ``f`` may change relative to the last
    step's.

  DeepSpeed's first ``step()`` call only allocates buffers but counts, so
  its ``freeze_step`` gives ``freeze_step − 1`` dense updates; here (as in
  :func:`onebit_adam`) ``freeze_step`` is the number of dense updates.

  Args:
    learning_rate: a float or an optax schedule of the step.
    freeze_step: dense LAMB steps before the variance freezes, >= 0.
    axis_name: the data axis.
    max_coeff: the warm-up trust ratio's upper bound, ``>= min_coeff``.
    min_coeff: the warm-up trust ratio's lower bound, ``>= 0``.
    coeff_beta: the rate of the trust ratio's running average, in [0, 1).
    factor_max: the rescaling factor's upper bound, ``>= factor_min``.
    factor_min: the rescaling factor's lower bound, ``>= 0``.
    factor_threshold: the factor's largest relative change per step, >= 0.
    b1: as in :func:`onebit_adam`.
    b2: as in :func:`onebit_adam`.
    eps: as in :func:`onebit_adam` (which says why ``1e-4`` may be needed).
    weight_decay: as in :func:`onebit_adam`.
    compressor: as in :func:`onebit_adam`.
    strategy: as in :func:`onebit_adam`.
    min_size: as in :func:`onebit_adam`.
    seed: as in :func:`onebit_adam`.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` needs
    ``params`` (for the trust ratio); state :class:`OneBitLambState`.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, commopt
    >>> tx = commopt.onebit_lamb(1e-3, freeze_step=100, axis_name="data")
    >>> dp = commopt.data_parallel(lambda p, b: jnp.mean((b @ p["w"]) ** 2), tx,
    ...                            jax.make_mesh((1,), ("data",)))
    >>> params = {"w": jnp.ones((4, 2))}
    >>> params, state, losses = dp.step(params, dp.init(params), jnp.ones((8, 4)))
    >>> round(float(state.inner_state.trust_ratio["w"]), 3)     # ‖θ‖/‖u‖ of the first step
    0.316

  References:
    Li et al., 1-bit LAMB: Communication Efficient Large-Scale Large-Batch
    Training with LAMB's Convergence Speed, HiPC 2022.
    You et al., Large Batch Optimization for Deep Learning: Training BERT in
    76 minutes, ICLR 2020 (LAMB).
  """
  fn = "onebit_lamb"
  b1, b2, eps, weight_decay, reducer = _momentum_reducer(
      fn, learning_rate, axis_name, b1, b2, eps, weight_decay, compressor, strategy, min_size,
      seed)
  freeze_step = base.check_int("freeze_step", freeze_step, fn=fn, minimum=0)
  min_coeff = base.check_number("min_coeff", min_coeff, fn=fn, low=0, low_open=False)
  max_coeff = base.check_number("max_coeff", max_coeff, fn=fn, low=min_coeff, low_open=False,
                                what=f"a number >= min_coeff ({min_coeff})")
  coeff_beta = base.check_number("coeff_beta", coeff_beta, fn=fn, low=0, high=1,
                                 low_open=False)
  factor_min = base.check_number("factor_min", factor_min, fn=fn, low=0, low_open=False)
  factor_max = base.check_number("factor_max", factor_max, fn=fn, low=factor_min,
                                 low_open=False, what=f"a number >= factor_min ({factor_min})")
  factor_threshold = base.check_number("factor_threshold", factor_threshold, fn=fn, low=0,
                                       low_open=False)

  def init_fn(params):
    zeros = _wide_zeros(params)
    return OneBitLambState(
        count=jnp.zeros([], jnp.int32), mu=zeros, nu=zeros, fresh_nu=zeros,
        frozen_ratio=_per_leaf(params, 0.0), last_factor=_per_leaf(params, 1.0),
        scaling=_per_leaf(params, 1.0), trust_ratio=_per_leaf(params, 1.0),
        reducer_state=reducer.init(zeros))

  def trust(p, u):
    """The warm-up trust ratio ‖θ‖/‖u‖, clipped; 1 where either norm is 0."""
    w, n = _norm(_wide(p)), _norm(u)
    return jnp.where((w != 0) & (n != 0), jnp.clip(w / n, min_coeff, max_coeff), 1.0)

  def momentum_scaling(mu):
    """Per leaf, the mean over all leaves of ‖m‖/√n divided by the leaf's own (1 where 0)."""
    scales = jax.tree.map(lambda m: _norm(m) / np.sqrt(max(m.size, 1)), mu)
    united = sum(jax.tree.leaves(scales)) / len(jax.tree.leaves(scales))
    return jax.tree.map(lambda s: jnp.where(s > 0, united / s, 1.0).astype(jnp.float32),
                        scales)

  def factor_of(prelim, u, nu, fresh_nu, last):
    """The factor rescaling the frozen trust ratio, clipped, from the last one."""
    f = jnp.max((jnp.sqrt(nu) + eps) / (jnp.sqrt(fresh_nu) + eps))
    if weight_decay:
      n = _norm(u)
      rho = jnp.where(n > 0, jnp.minimum(1.0, _norm(prelim) / n), 1.0)
      f = f * rho + (1.0 - rho)
    f = jnp.clip(f, factor_min, factor_max)
    return jnp.clip(f, last * (1.0 - factor_threshold), last * (1.0 + factor_threshold))

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    if params is None:
      raise ValueError(f"{fn}: `update` needs `params` (the trust ratio is ‖θ‖/‖u‖ per leaf).")
    coll.check_input(fn, updates, axis_name)
    grads = jax.tree.map(_wide, updates)

    def warm(ops):
      grads, mu, nu, fresh_nu, frozen_ratio, last, scaling, red = ops
      mu, nu = _dense_moments(grads, mu, nu, b1, b2, axis_name)
      u = _adam_step(mu, nu, eps, weight_decay, params)
      r = jax.tree.map(trust, params, u)
      frozen_ratio = jax.tree.map(
          lambda c, r: jnp.where(r != 1.0, coeff_beta * c + (1 - coeff_beta) * r, c),
          frozen_ratio, r)
      return u, r, mu, nu, nu, frozen_ratio, last, scaling, red

    def compressed(ops):
      grads, mu, nu, fresh_nu, frozen_ratio, last, scaling, red = ops
      scaling = coll.cond(state.count == freeze_step, lambda ops: momentum_scaling(ops[0]),
                          lambda ops: ops[1], (mu, scaling))
      local = jax.tree.map(lambda m, g, s: _ema(b1)(m, g) * s, mu, grads, scaling)
      mean, red = reducer.update(local, red)
      new_mu = jax.tree.map(lambda a, s: a / s, mean, scaling)
      fresh_nu = jax.tree.map(
          lambda f, m, old: _ema(b2)(f, ((m - old * b1) / (1 - b1)) ** 2), fresh_nu, new_mu, mu)
      prelim = _adam_step(new_mu, nu, eps, 0.0, None)
      u = _adam_step(new_mu, nu, eps, weight_decay, params)
      last = jax.tree.map(factor_of, prelim, u, nu, fresh_nu, last)
      r = jax.tree.map(lambda c, f: c * f, frozen_ratio, last)
      return u, r, new_mu, nu, fresh_nu, frozen_ratio, last, scaling, red

    u, r, mu, nu, fresh_nu, frozen_ratio, last, scaling, red = coll.cond(
        state.count < freeze_step, warm, compressed,
        (grads, state.mu, state.nu, state.fresh_nu, state.frozen_ratio, state.last_factor,
         state.scaling, state.reducer_state))
    lr = _lr_at(learning_rate, state.count)
    out = jax.tree.map(lambda u, r, x: ((-lr * r) * u).astype(jnp.result_type(x)), u, r,
                       updates)
    f32 = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)
    return out, OneBitLambState(
        count=optax.safe_int32_increment(state.count), mu=mu, nu=nu, fresh_nu=fresh_nu,
        frozen_ratio=f32(frozen_ratio), last_factor=f32(last), scaling=f32(scaling),
        trust_ratio=f32(r), reducer_state=red)

  return _planned(init_fn, update_fn, reducer, axis_name,
                  lambda step: "dense" if step < freeze_step else "compressed")
