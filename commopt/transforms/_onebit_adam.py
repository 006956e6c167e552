"""1-bit Adam: dense Adam for a warm-up, then the momentum exchanged 1-bit with the variance
frozen (see :mod:`commopt.transforms._compressed_momentum` for the shared exchange)."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

from commopt._src import base
from commopt.comm import _collectives as coll
from commopt.transforms._compressed_mean import DEFAULT_MIN_SIZE
from commopt.transforms._compressed_momentum import (
    adam_step, check_mask_fits, check_params, dense_branch, ema, lr_at, masked, momentum_options,
    planned, wide_zeros, widen)


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



def onebit_adam(learning_rate: Union[float, optax.Schedule], freeze_step: int, *, axis_name,
                b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                weight_decay: float = 0.0, compressor: Optional[base.Compressor] = None,
                strategy: str = "two_phase", min_size: int = DEFAULT_MIN_SIZE, seed: int = 0,
                exp_avg_mask: Any = None) -> optax.GradientTransformationExtraArgs:
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
    exp_avg_mask: None (default), or DeepSpeed's momentum mask: a pytree
      with the parameters' structure whose leaves are arrays of 0s and 1s
      (or bools) of the parameter's shape, or None for a parameter left
      unmasked. After the freeze the momentum that the 1-bit exchange
      returns is multiplied by it, so where the mask is 0 the momentum is
      exactly 0 and, without weight decay, the parameter does not move. A
      1-bit code cannot send an exact zero: a coordinate whose gradient is
      always 0 (a position embedding's rows beyond the sequence length the
      model is trained on, say) would otherwise take momentum from the
      error memories and drift. The warm-up's dense steps are not masked;
      the error memories are not either (the mask multiplies what the
      exchange returns). Checked against the parameters by ``init``.

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
  o = momentum_options("onebit_adam", learning_rate, axis_name, b1=b1, b2=b2, eps=eps,
                       weight_decay=weight_decay, compressor=compressor, strategy=strategy,
                       min_size=min_size, seed=seed, exp_avg_mask=exp_avg_mask)
  freeze_step = base.check_int("freeze_step", freeze_step, fn=o.fn, minimum=0)

  def init_fn(params):
    check_mask_fits(o, params)
    zeros = wide_zeros(params)
    return OneBitAdamState(count=jnp.zeros([], jnp.int32), mu=zeros, nu=zeros,
                           reducer_state=o.reducer.init(zeros))

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    check_params(o.fn, params, o.weight_decay)
    coll.check_input(o.fn, updates, o.axis_name)
    mu, nu, red = coll.cond(state.count < freeze_step, dense_branch(o.b1, o.b2, o.axis_name),
                            _compressed_branch(o),
                            (widen(updates), state.mu, state.nu, state.reducer_state))
    lr = lr_at(o.learning_rate, state.count)
    step = adam_step(mu, nu, o.eps, o.weight_decay, params)
    out = jax.tree.map(lambda s, u: (-lr * s).astype(jnp.result_type(u)), step, updates)
    return out, OneBitAdamState(count=optax.safe_int32_increment(state.count), mu=mu, nu=nu,
                                reducer_state=red)

  return planned(init_fn, update_fn, o.reducer, o.axis_name,
                 lambda step: "dense" if step < freeze_step else "compressed", o.fn)


def _compressed_branch(o):
  """The cond branch after the freeze, ``(grads, mu, nu, reducer_state) -> (mu, nu,
  reducer_state)``: the 1-bit mean of the workers' momenta, masked; ``nu`` frozen."""
  def compressed(ops):
    grads, mu, nu, red = ops
    mu, red = o.reducer.update(jax.tree.map(ema(o.b1), mu, grads), red)
    return masked(o, mu), nu, red
  return compressed
