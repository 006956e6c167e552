"""Compressed adaptive optimizers: 1-bit Adam."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
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
    b1, b2, eps: Adam's.
    weight_decay: added to the update times the parameters (needs ``params``).
    compressor: the momentum's compressor (stateless); default
      ``scaled_sign()``.
    strategy: its reduction, ``"two_phase"`` (as published) or ``"gather"``.
    min_size: leaves with fewer elements are all-reduced dense.
    seed: the compressor's base key.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; state :class:`OneBitAdamState`.

  Example:
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
  _check_axes(axis_name, fn)
  if not isinstance(axis_name, str):
    raise ValueError(f"{fn}: `axis_name` must name the data axis (a str), got {axis_name!r}.")
  freeze_step = base.check_int("freeze_step", freeze_step, fn=fn, minimum=0)
  b1 = base.check_number("b1", b1, fn=fn, low=0, high=1, low_open=False)
  b2 = base.check_number("b2", b2, fn=fn, low=0, high=1, low_open=False)
  eps = base.check_number("eps", eps, fn=fn, low=0, low_open=False)
  weight_decay = base.check_number("weight_decay", weight_decay, fn=fn, low=0, low_open=False)
  if not callable(learning_rate):
    base.check_number("learning_rate", learning_rate, fn=fn, low=0, low_open=False)
  base.check_choice("strategy", strategy, ("two_phase", "gather"), fn)
  if compressor is None:
    from commopt.compressors import scaled_sign
    compressor = scaled_sign()
  reducer = compressed_mean(compressor, axis_name, error_feedback=True, strategy=strategy,
                            min_size=min_size, seed=seed)

  def init_fn(params):
    zeros = jax.tree.map(
        lambda p: jnp.zeros(jnp.shape(p), jnp.promote_types(p.dtype, jnp.float32)), params)
    return OneBitAdamState(count=jnp.zeros([], jnp.int32), mu=zeros, nu=zeros,
                           reducer_state=reducer.init(zeros))

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    if weight_decay and params is None:
      raise ValueError(f"{fn}: `weight_decay` needs `params` in `update`.")
    grads = jax.tree.map(_wide, updates)

    def warm(ops):
      grads, mu, nu, red = ops
      g = jax.tree.map(lambda x: coll.pmean(x, axis_name), grads)
      mu = jax.tree.map(lambda m, x: b1 * m + (1 - b1) * x, mu, g)
      nu = jax.tree.map(lambda v, x: b2 * v + (1 - b2) * x * x, nu, g)
      return mu, nu, red

    def frozen(ops):
      grads, mu, nu, red = ops
      local = jax.tree.map(lambda m, x: b1 * m + (1 - b1) * x, mu, grads)
      mu, red = reducer.update(local, red)
      return mu, nu, red

    mu, nu, red = coll.cond(state.count < freeze_step, warm, frozen,
                            (grads, state.mu, state.nu, state.reducer_state))
    lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
    step = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu, nu)
    if weight_decay:
      step = jax.tree.map(lambda s, p: s + weight_decay * _wide(p), step, params)
    out = jax.tree.map(lambda s, u: (-lr * s).astype(jnp.result_type(u)), step, updates)
    return out, OneBitAdamState(count=optax.safe_int32_increment(state.count), mu=mu, nu=nu,
                                reducer_state=red)

  reducer_plan = _plan.planner_of(reducer)
  # Both phases exchange the widened (float32 or wider) gradient or momentum.
  widened = lambda params: jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.promote_types(x.dtype, jnp.float32)),
      params)
  planner = lambda params, workers: reducer_plan(widened(params), workers)

  def step_planner(params, workers, step):
    if step >= freeze_step:
      return planner(params, workers)
    return [_plan.planned(jax.tree_util.keystr(path), "all-reduce", axis_name, workers,
                          base.leaf_size(x.shape) * jnp.dtype(x.dtype).itemsize, packed=False)
            for path, x in jax.tree_util.tree_flatten_with_path(widened(params))[0]]

  return _plan.with_planner(optax.GradientTransformationExtraArgs(init_fn, update_fn), planner,
                            step_planner)
