"""The compressed-momentum exchange that 1-bit Adam, 0/1 Adam and 1-bit LAMB share.

All three follow DeepSpeed's implementations: the momentum (or the gradient,
or the accumulated move) crosses the data axis 1-bit with a scale through
:func:`~commopt.compressed_mean`'s two-phase reduction with worker and server
error memories, and the second moment stops changing after a warm-up. The
step count that drives every schedule is the transform's own (0-based
``count``, the same on every worker); a phase with an exchange sits in a
``lax.cond`` on it, so a step without one moves no bytes.

This module holds what they share: their common options (checked by
:func:`momentum_options`, which builds the exchange), the momentum mask
(DeepSpeed's ``exp_avg_mask``), Adam's dense moments and step, and the wire
plan of a transform whose steps exchange densely, compressed or not at all.
Each optimizer has its own module: ``_onebit_adam``, ``_zero_one_adam``,
``_onebit_lamb``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from commopt._src import base, vma
from commopt.comm import _collectives as coll
from commopt.comm import _plan
from commopt.transforms._compressed_mean import compressed_mean
from commopt.transforms._control import _check_axes
from commopt.transforms._sync import _wide
from commopt.transforms import _global_view


class MomentumOptions(NamedTuple):
  """The checked options every compressed-momentum optimizer takes.

  Attributes:
    fn: the optimizer's name, for messages.
    learning_rate: a float or an optax schedule of the step.
    axis_name: the data axis.
    b1: Adam's first-moment decay.
    b2: Adam's second-moment decay.
    eps: Adam's epsilon.
    weight_decay: the decoupled weight decay added to the update.
    reducer: the :func:`~commopt.compressed_mean` of the 1-bit exchanges.
    exp_avg_mask: None, or the momentum mask (see :func:`check_exp_avg_mask`).
  """
  fn: str
  learning_rate: Any
  axis_name: str
  b1: float
  b2: float
  eps: float
  weight_decay: float
  reducer: Any
  exp_avg_mask: Any


def momentum_options(fn: str, learning_rate, axis_name, *, b1, b2, eps, weight_decay,
                     compressor, strategy, min_size, seed, exp_avg_mask) -> MomentumOptions:
  """The shared options checked (a ValueError naming ``fn`` and the option), with the
  compressed_mean of the 1-bit exchanges built from ``compressor`` (default
  ``scaled_sign()``), ``strategy``, ``min_size`` and ``seed``."""
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
  exp_avg_mask = check_exp_avg_mask(fn, exp_avg_mask)
  if compressor is None:
    from commopt.compressors import scaled_sign
    compressor = scaled_sign()
  reducer = compressed_mean(compressor, axis_name=axis_name, error_feedback=True, strategy=strategy,
                            min_size=min_size, seed=seed)
  return MomentumOptions(fn, learning_rate, axis_name, b1, b2, eps, weight_decay, reducer,
                         exp_avg_mask)


# ---------------------------------------------------------------------------
# The momentum mask (DeepSpeed's exp_avg_mask).


def _unmasked(leaf) -> bool:
  return leaf is None


def check_exp_avg_mask(fn: str, mask):
  """``mask`` if it is None or a pytree of 0/1 arrays (bools, ints or floats) and Nones.

  A leaf that is not an array raises an :class:`~commopt.OptionTypeError`, a
  concrete leaf holding anything but 0s and 1s a ValueError; both name the
  leaf. The structure and shapes are checked against the parameters by
  :func:`check_mask_fits` (at ``init``).
  """
  if mask is None:
    return None
  for path, leaf in jax.tree_util.tree_flatten_with_path(mask, is_leaf=_unmasked)[0]:
    where = jax.tree_util.keystr(path) or "<root>"
    if leaf is None:
      continue
    dtype = getattr(leaf, "dtype", None)
    if (not hasattr(leaf, "shape") or dtype is None
        or not (jnp.issubdtype(dtype, jnp.bool_) or jnp.issubdtype(dtype, jnp.number))):
      raise base.OptionTypeError(
          f"{fn}: `exp_avg_mask` leaf {where} must be an array of 0s and 1s (or bools) of "
          f"the parameter's shape, or None to leave the parameter unmasked, got "
          f"{type(leaf).__name__}{f' of dtype {dtype}' if dtype is not None else ''}.")
    if vma.is_tracer(leaf):
      continue
    values = np.asarray(leaf)
    bad = values[(values != 0) & (values != 1)]
    if bad.size:
      raise ValueError(
          f"{fn}: `exp_avg_mask` leaf {where} must hold only 0s and 1s (1 keeps the "
          f"momentum, 0 zeroes it), got {bad.reshape(-1)[0].item()!r} among its values.")
  return mask


def check_mask_fits(o: MomentumOptions, params) -> None:
  """A ValueError unless ``o.exp_avg_mask`` (if any) has the structure of ``params`` and each
  mask array the shape of its parameter."""
  if o.exp_avg_mask is None:
    return
  what = ("a pytree with the parameters' structure whose leaves are 0/1 arrays of the "
          "parameter's shape, or None for a parameter left unmasked")
  treedef = jax.tree.structure(params)
  try:
    masks = treedef.flatten_up_to(o.exp_avg_mask)
  except (ValueError, TypeError) as e:
    raise ValueError(
        f"{o.fn}: `exp_avg_mask` must be {what}; its structure does not match the "
        f"parameters' {treedef}: {e}") from None
  for (path, p), m in zip(jax.tree_util.tree_flatten_with_path(params)[0], masks):
    where, shape = jax.tree_util.keystr(path) or "<root>", tuple(jnp.shape(p))
    if m is not None and not hasattr(m, "shape"):
      raise ValueError(
          f"{o.fn}: `exp_avg_mask` must be {what}; at {where} it has a "
          f"{type(m).__name__} where the parameters have an array of shape {shape}.")
    if m is not None and tuple(jnp.shape(m)) != shape:
      raise ValueError(
          f"{o.fn}: `exp_avg_mask` leaf {where} has shape {tuple(jnp.shape(m))}, but its "
          f"parameter has shape {shape}; pass a 0/1 array of shape {shape}, or None to leave "
          "it unmasked.")


def masked(o: MomentumOptions, tree):
  """``tree`` (the parameters' structure) times ``o.exp_avg_mask`` where it has a mask."""
  if o.exp_avg_mask is None:
    return tree
  return jax.tree.map(lambda m, x: x if m is None else x * jnp.asarray(m, x.dtype),
                      o.exp_avg_mask, tree, is_leaf=_unmasked)


# ---------------------------------------------------------------------------
# Adam's pieces.


def widen(tree):
  """Each leaf in float32, or its own dtype where that is wider."""
  return jax.tree.map(_wide, tree)


def wide_zeros(params):
  return jax.tree.map(
      lambda p: jnp.zeros(jnp.shape(p), jnp.promote_types(p.dtype, jnp.float32)), params)


def lr_at(learning_rate, count):
  return learning_rate(count) if callable(learning_rate) else learning_rate


def ema(beta):
  return lambda m, x: beta * m + (1 - beta) * x


def check_params(fn, params, weight_decay):
  if weight_decay and params is None:
    raise ValueError(f"{fn}: `weight_decay` needs `params` in `update`.")


def dense_moments(grads, mu, nu, b1, b2, axis_name):
  """Adam's moments on the mean gradient (one dense all-reduce)."""
  g = jax.tree.map(lambda x: coll.pmean(x, axis_name), grads)
  mu = jax.tree.map(ema(b1), mu, g)
  nu = jax.tree.map(lambda v, x: b2 * v + (1 - b2) * x * x, nu, g)
  return mu, nu


def dense_branch(b1, b2, axis_name):
  """A cond branch ``(grads, mu, nu, reducer_state) -> (mu, nu, reducer_state)``: Adam's
  moments on the mean gradient, the reducer's state untouched."""
  def dense(ops):
    grads, mu, nu, red = ops
    mu, nu = dense_moments(grads, mu, nu, b1, b2, axis_name)
    return mu, nu, red
  return dense


def denominator(nu, eps):
  return jax.tree.map(lambda v: jnp.sqrt(v) + eps, nu)


def adam_step(mu, nu, eps, weight_decay, params):
  """``m / (√v + ε) + weight_decay · θ``."""
  step = jax.tree.map(lambda m, d: m / d, mu, denominator(nu, eps))
  if weight_decay:
    step = jax.tree.map(lambda s, p: s + weight_decay * _wide(p), step, params)
  return step


# ---------------------------------------------------------------------------
# The wire plan.


def _widened(params):
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.promote_types(x.dtype, jnp.float32)),
      params)


def planned(init_fn, update_fn, reducer, axis_name,
            exchange_at: Callable[[int], Optional[str]], fn: str):
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

  tx = _global_view.accepting(optax.GradientTransformationExtraArgs(init_fn, update_fn),
                              axis_name, fn)
  return _plan.with_planner(tx, planner, step_planner)
