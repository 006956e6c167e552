"""The step body for parameters replicated over the mesh: one ``shard_map`` over the data axes.

Each worker differentiates the loss on its rows with its gradients kept local
(:func:`~commopt.parallel.local_value_and_grad`) and runs the optimizer, whose
reduction is the step's only communication. With ``local_params=True`` each
worker keeps its own parameters, stacked ``[num_workers, ...]`` over the data
axes, for transforms that synchronise them now and then (``local_sgd``,
``diloco``). A :class:`~._step_common.StepBody`.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from commopt.comm import _collectives as coll
from commopt.parallel import _faults as faults
from commopt.parallel import _layout as lay
from commopt.parallel import _step_common as common
from commopt.parallel._layout import local_value_and_grad

if TYPE_CHECKING:
  from commopt.parallel._layout_probe import Layout


def manual_specs(layout: Layout, axes) -> Any:
  """The state specs a ``shard_map`` manual over the data axes alone sees: those axes only."""
  return jax.tree.map(lambda s: P(lay.data_spec(axes)) if lay.is_stacked(s, axes) else P(),
                      layout.state_specs, is_leaf=lay.is_spec)


def init(dp, layout: Layout, params) -> Any:
  """``tx.init`` inside the step's ``shard_map``, so it can size per-worker chunks."""
  axes, opt = dp.axes, dp.optimizer

  def body(p):
    return lay.stack_workers(opt.init(p), layout.state_specs, axes)

  # Jitted: run eagerly, a shard_map compiles each of its operations on its own.
  return jax.jit(jax.shard_map(body, mesh=dp.mesh, in_specs=(P(),),
                               out_specs=manual_specs(layout, axes), axis_names=set(axes)))(params)


def step(dp, layout: Layout, params, opt_state, batch, model_state, key, extra_args):
  """One ``shard_map`` over the data axes: local gradients, then the optimizer."""
  axes, opt = dp.axes, dp.optimizer
  manual = manual_specs(layout, axes)
  grad_fn = local_value_and_grad(functools.partial(common.checked_loss, dp), axes,
                                 has_aux=dp.has_aux or dp.has_state)

  def body(params, state, batch, model_state, key, extra_args):
    if dp.local_params:
      params = jax.tree.map(lambda x: x[0], params)
    state = lay.unstack_workers(state, layout.state_specs, axes)
    kwargs = {} if key is None else {"key": jax.random.fold_in(key, coll.axis_index(axes))}
    args = (model_state, batch) if dp.has_state else (batch,)
    value, grads = grad_fn(params, *args, **kwargs)
    loss, aux, new_ms = common.split_out(dp, value)
    grads = faults.poison_if_nonfinite(dp, grads, new_ms)
    if layout.reads_value and "value" not in extra_args:
      extra_args = dict(extra_args, value=coll.pmean(loss, axes))
      grads = coll.after(grads, extra_args["value"])     # the exchange after that mean
    updates, new_state = opt.update(grads, state, params, **extra_args)
    new_params = optax.apply_updates(params, updates)
    if dp.local_params:
      new_params = jax.tree.map(lambda x: x[None], new_params)
    else:
      common.check_replicated(dp, new_params)
    if dp.has_state:
      new_ms = faults.keep_on_skip(dp, common.sync_model_state(dp, coll.after(new_ms, updates)),
                                   model_state, new_state)
    metrics = loss[None] if not dp.has_aux else (
        loss[None], jax.tree.map(lambda x: jnp.asarray(x)[None], aux))
    return (new_params, lay.stack_workers(new_state, layout.state_specs, axes), metrics,
            new_ms)

  data = P(lay.data_spec(axes))
  pspec = data if dp.local_params else P()
  fn = jax.shard_map(
      body, mesh=dp.mesh,
      in_specs=(pspec, manual, data, P(), P(), P()),
      out_specs=(pspec, manual, data, P()),
      axis_names=set(axes))
  return fn(params, opt_state, batch, model_state, key, extra_args)
