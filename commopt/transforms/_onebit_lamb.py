"""1-bit LAMB: LAMB for a warm-up, then the momentum exchanged 1-bit with the variance frozen
and the warm-up's trust ratio rescaled (see :mod:`commopt.transforms._compressed_momentum`
for the shared exchange).

The factory checks the options (:func:`_checked_options`); its update runs the warm-up
(:func:`_warm_branch`, dense LAMB) or the compressed steps (:func:`_compressed_branch`,
with the trust ratio's factor from :func:`_factor`), a ``lax.cond`` on the step.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from commopt._src import base, vma
from commopt.comm import _collectives as coll
from commopt.transforms._compressed_mean import DEFAULT_MIN_SIZE
from commopt.transforms._compressed_momentum import (
    MomentumOptions, adam_step, check_mask_fits, dense_moments, ema, lr_at, masked,
    momentum_options, planned, wide_zeros, widen)


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

def onebit_lamb(learning_rate: Union[float, optax.Schedule], freeze_step: int, *, axis_name,
                max_coeff: float = 10.0, min_coeff: float = 0.01, coeff_beta: float = 0.9,
                factor_max: float = 4.0, factor_min: float = 0.5, factor_threshold: float = 0.1,
                b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                weight_decay: float = 0.0, compressor: Optional[base.Compressor] = None,
                strategy: str = "two_phase", min_size: int = DEFAULT_MIN_SIZE, seed: int = 0,
                exp_avg_mask: Any = None) -> optax.GradientTransformationExtraArgs:
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
    exp_avg_mask: as in :func:`onebit_adam`; after the freeze it multiplies
      the exchanged momentum ``m'`` (after the division by ``s``), before
      ``ĝ`` and the update are computed from it.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` needs
    ``params`` (for the trust ratio); state :class:`OneBitLambState`.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, commopt
    >>> tx = commopt.transforms.onebit_lamb(1e-3, freeze_step=100, axis_name="data")
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
  o = _checked_options(
      momentum_options("onebit_lamb", learning_rate, axis_name, b1=b1, b2=b2, eps=eps,
                       weight_decay=weight_decay, compressor=compressor, strategy=strategy,
                       min_size=min_size, seed=seed, exp_avg_mask=exp_avg_mask),
      freeze_step, min_coeff=min_coeff, max_coeff=max_coeff, coeff_beta=coeff_beta,
      factor_min=factor_min, factor_max=factor_max, factor_threshold=factor_threshold)
  return planned(_init_fn(o.common), _update_fn(o), o.common.reducer, o.common.axis_name,
                 lambda step: "dense" if step < o.freeze_step else "compressed", o.common.fn)


class _LambOptions(NamedTuple):
  """:func:`onebit_lamb`'s checked options: the shared ones and the trust ratio's."""
  common: MomentumOptions
  freeze_step: int
  min_coeff: float
  max_coeff: float
  coeff_beta: float
  factor_min: float
  factor_max: float
  factor_threshold: float


def _checked_options(common: MomentumOptions, freeze_step, *, min_coeff, max_coeff, coeff_beta,
                     factor_min, factor_max, factor_threshold) -> _LambOptions:
  """The freeze step and the trust ratio's options checked (a ValueError naming the
  option)."""
  fn = common.fn
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
  return _LambOptions(common, freeze_step, min_coeff, max_coeff, coeff_beta, factor_min,
                      factor_max, factor_threshold)


def _per_leaf(params, value: float):
  """One float32 scalar per leaf."""
  return jax.tree.map(lambda _: jnp.full([], value, jnp.float32), params)


def _init_fn(c: MomentumOptions):
  def init_fn(params):
    check_mask_fits(c, params)
    zeros = wide_zeros(params)
    return OneBitLambState(
        count=jnp.zeros([], jnp.int32), mu=zeros, nu=zeros, fresh_nu=zeros,
        frozen_ratio=_per_leaf(params, 0.0), last_factor=_per_leaf(params, 1.0),
        scaling=_per_leaf(params, 1.0), trust_ratio=_per_leaf(params, 1.0),
        reducer_state=c.reducer.init(zeros))
  return init_fn


def _update_fn(o: _LambOptions):
  """The update: the warm-up or a compressed step (a cond on the step), each leaf's ``u``
  scaled by ``−lr·r`` and cast to the updates' dtypes."""
  c = o.common

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    if params is None:
      raise ValueError(f"{c.fn}: `update` needs `params` (the trust ratio is ‖θ‖/‖u‖ per "
                       "leaf).")
    with vma.shard_aware():   # its norms and maxima are of whole leaves (see _norm)
      return _update(updates, state, params)

  def _update(updates, state, params):
    coll.check_input(c.fn, updates, c.axis_name)
    u, r, mu, nu, fresh_nu, frozen_ratio, last, scaling, red = coll.cond(
        state.count < o.freeze_step, _warm_branch(o, params),
        _compressed_branch(o, state.count, params),
        (widen(updates), state.mu, state.nu, state.fresh_nu, state.frozen_ratio,
         state.last_factor, state.scaling, state.reducer_state))
    lr = lr_at(c.learning_rate, state.count)
    out = jax.tree.map(lambda u, r, x: ((-lr * r) * u).astype(jnp.result_type(x)), u, r,
                       updates)
    f32 = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)
    return out, OneBitLambState(
        count=optax.safe_int32_increment(state.count), mu=mu, nu=nu, fresh_nu=fresh_nu,
        frozen_ratio=f32(frozen_ratio), last_factor=f32(last), scaling=f32(scaling),
        trust_ratio=f32(r), reducer_state=red)
  return update_fn


def _norm(x, axis_name):
  """The norm of the whole leaf ``x`` (:func:`commopt._src.base.safe_norm`'s bits), summed
  over the model axes when ``x`` is one device's shard of it."""
  x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  top = coll.leaf_max(jnp.max(jnp.abs(x), initial=0.0), x, axis_name)
  down, up = base.pow2_scales(top)
  return up * jnp.sqrt(coll.leaf_sum(jnp.sum(jnp.square(x * down)), x, axis_name))


def _sqrt_size(x, axis_name):
  """√(the element count of the whole leaf ``x``, all its shards), at least √1."""
  if not coll.shard_axes(x, axis_name):
    return np.sqrt(max(x.size, 1))
  return jnp.sqrt(coll.leaf_sum(jnp.float32(max(x.size, 1)), x, axis_name))


def _trust(o: _LambOptions, p, u):
  """The warm-up trust ratio ‖θ‖/‖u‖ of a leaf (``p`` widened), clipped; 1 where either
  norm is 0."""
  w, n = _norm(p, o.common.axis_name), _norm(u, o.common.axis_name)
  return jnp.where((w != 0) & (n != 0), jnp.clip(w / n, o.min_coeff, o.max_coeff), 1.0)


def _warm_branch(o: _LambOptions, params):
  """The cond branch before the freeze, ``(grads, mu, nu, fresh_nu, frozen_ratio, last_factor,
  scaling, reducer_state) -> (u, r) + the same``: LAMB on the dense mean gradient, its
  trust ratio ``r`` averaged into ``frozen_ratio`` (where it is not 1)."""
  c, beta = o.common, o.coeff_beta

  def warm(ops):
    grads, mu, nu, fresh_nu, frozen_ratio, last, scaling, red = ops
    mu, nu = dense_moments(grads, mu, nu, c.b1, c.b2, c.axis_name)
    u = adam_step(mu, nu, c.eps, c.weight_decay, params)
    r = jax.tree.map(functools.partial(_trust, o), widen(params), u)
    frozen_ratio = jax.tree.map(
        lambda f, r: jnp.where(r != 1.0, beta * f + (1 - beta) * r, f), frozen_ratio, r)
    return u, r, mu, nu, nu, frozen_ratio, last, scaling, red
  return warm


def _momentum_scaling(mu, axis_name):
  """Per leaf, the mean over all leaves of ‖m‖/√n divided by the leaf's own (1 where 0)."""
  scales = jax.tree.map(
      lambda m: _norm(m, axis_name) / _sqrt_size(m, axis_name), mu)
  united = sum(jax.tree.leaves(scales)) / len(jax.tree.leaves(scales))
  return jax.tree.map(lambda s: jnp.where(s > 0, united / s, 1.0).astype(jnp.float32),
                      scales)


def _compressed_branch(o: _LambOptions, count, params):
  """The cond branch from the freeze on, with :func:`_warm_branch`'s operands and results:
  the 1-bit mean of the workers' momenta scaled by ``s`` (set at the first compressed
  step), masked; ``v_fresh`` from the reconstructed gradient; ``r = r̄·f``."""
  c = o.common

  def compressed(ops):
    grads, mu, nu, fresh_nu, frozen_ratio, last, scaling, red = ops
    scaling = coll.cond(count == o.freeze_step, lambda ops: _momentum_scaling(ops[0], c.axis_name),
                        lambda ops: ops[1], (mu, scaling))
    local = jax.tree.map(lambda m, g, s: ema(c.b1)(m, g) * s, mu, grads, scaling)
    mean, red = c.reducer.update(local, red)
    new_mu = masked(c, jax.tree.map(lambda a, s: a / s, mean, scaling))
    fresh_nu = jax.tree.map(
        lambda f, m, old: ema(c.b2)(f, ((m - old * c.b1) / (1 - c.b1)) ** 2), fresh_nu, new_mu,
        mu)
    prelim = adam_step(new_mu, nu, c.eps, 0.0, None)
    u = adam_step(new_mu, nu, c.eps, c.weight_decay, params)
    last = jax.tree.map(functools.partial(_factor, o), prelim, u, nu, fresh_nu, last)
    r = jax.tree.map(lambda f, l: f * l, frozen_ratio, last)
    return u, r, new_mu, nu, fresh_nu, frozen_ratio, last, scaling, red
  return compressed


def _factor(o: _LambOptions, prelim, u, nu, fresh_nu, last):
  """The factor that rescales a leaf's frozen trust ratio, clipped, from the last one."""
  eps = o.common.eps
  axis = o.common.axis_name
  f = coll.leaf_max(jnp.max((jnp.sqrt(nu) + eps) / (jnp.sqrt(fresh_nu) + eps)), u, axis)
  if o.common.weight_decay:
    n = _norm(u, axis)
    rho = jnp.where(n > 0, jnp.minimum(1.0, _norm(prelim, axis) / n), 1.0)
    f = f * rho + (1.0 - rho)
  f = jnp.clip(f, o.factor_min, o.factor_max)
  return jnp.clip(f, last * (1.0 - o.factor_threshold), last * (1.0 + o.factor_threshold))
