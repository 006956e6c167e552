"""The whole-leaf step body for parameters sharded over the mesh's other axes (tensor parallel
plus data parallel), with no dense value crossing the data axis: for a ``tx`` that needs
whole leaves, or ``shard_local=False`` (the shard-local body, :mod:`._shard_local_step`,
is the default and shares :func:`run_step` and :func:`worker_grads` with this one).

The gradients come from ``jax.vmap`` over the workers (``spmd_axis_name``
shards the worker axis over the data axis, and the model's own sharding over
the other axes is left to the compiler), so each worker's gradient stays on
its data rank. The optimizer then runs in a ``shard_map`` manual over every
mesh axis: each leaf is all-gathered over the non-data axes its spec names,
the optimizer (and its compressed exchange over the data axis) runs on whole
leaves, and each rank keeps its slice. (A ``shard_map`` manual over the data
axes alone would gather its model-sharded inputs at its boundary, over all
devices.) A :class:`~._step_common.StepBody`.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from commopt.parallel import _faults as faults
from commopt.parallel import _layout as lay
from commopt.parallel import _step_common as common

if TYPE_CHECKING:
  from commopt.parallel._layout_probe import Layout


def applies(dp, layout: Layout) -> bool:
  """Whether some parameter is sharded over a mesh axis other than the data axes."""
  specs = jax.tree.leaves(layout.param_specs, is_leaf=lay.is_spec)
  return bool(dp._other_axes) and any(e is not None for s in specs for e in s)


def init(dp, layout: Layout, params) -> Any:
  """Manual over every axis: whole leaves gathered over the non-data axes, each rank
  keeping its slice of the state."""
  axes, opt = dp.axes, dp.optimizer
  state_specs = lay.unstacked_specs(layout.state_specs, axes)

  def body(p):
    state = lay.slice_tree(opt.init(lay.gather_tree(p, layout.param_specs)), state_specs)
    return lay.stack_workers(state, layout.state_specs, axes)

  # Jitted: run eagerly, a shard_map compiles each of its operations on its own.
  return jax.jit(jax.shard_map(body, mesh=dp.mesh, in_specs=(layout.param_specs,),
                               out_specs=layout.state_specs))(params)


def step(dp, layout: Layout, params, opt_state, batch, model_state, key, extra_args):
  """Per-worker gradients by ``vmap``, then the optimizer on whole leaves (see the module)."""
  refuse_options(dp)
  return run_step(dp, layout, _update, params, opt_state, batch, model_state, key, extra_args)


def run_step(dp, layout: Layout, update, params, opt_state, batch, model_state, key,
             extra_args):
  """The step around ``update(dp, layout, grads, opt_state, params, extra_args) ->
  (updates, new_state)``: per-worker gradients by ``vmap`` before, parameters and model
  state after (this body's and the shard-local one's)."""
  value, grads = worker_grads(dp, params, batch, model_state, key)
  loss, aux, new_ms = common.split_out(dp, value)
  grads = jax.vmap(functools.partial(faults.poison_if_nonfinite, dp),
                   spmd_axis_name=_spmd_axes(dp))(grads, new_ms)
  if layout.reads_value and "value" not in extra_args:
    extra_args = dict(extra_args, value=jnp.mean(loss))
  updates, new_state = update(dp, layout, grads, opt_state, params, extra_args)
  new_params = optax.apply_updates(params, updates)
  metrics = loss if not dp.has_aux else (loss, aux)
  if dp.has_state:
    new_ms = common.mean_over_workers(dp.mesh, new_ms)
    new_ms = faults.keep_on_skip(dp, new_ms, model_state, new_state)
  return new_params, new_state, metrics, new_ms


def refuse_options(dp, shard_local: bool = False) -> None:
  """A ValueError for the options this body (or the shard-local one) does not support."""
  if dp.local_params and not shard_local:
    raise ValueError(
        "data_parallel: local_params=True with parameters sharded over other mesh axes "
        "needs the shard-local step, which this `tx` cannot take (see the warning or "
        "error that data_parallel gave when it traced `tx`).")
  if len(dp.axes) != 1 and not shard_local:
    raise ValueError(
        f"data_parallel: on a mesh with other axes ({dp._other_axes}) the data axis must "
        f"be one mesh axis; got axis_name={dp.axis_name!r}.")
  if dp.has_state and dp.model_state_sync != "mean":
    raise ValueError(
        "data_parallel: with tensor-parallel parameters, model state is averaged across "
        f"workers (model_state_sync='mean'); got {dp.model_state_sync!r}.")


def _spmd_axes(dp):
  """The data axes as ``jax.vmap``'s ``spmd_axis_name`` (a name, or a tuple of them)."""
  return dp.axes[0] if len(dp.axes) == 1 else tuple(dp.axes)


def worker_grads(dp, params, batch, model_state, key):
  """``(value, grads)`` of every worker on its rows, stacked ``[num_workers, ...]``
  (with ``local_params``, each worker's own parameters, stacked so too)."""
  axis, n = lay.data_spec(dp.axes), dp.num_workers

  def split_workers(x):
    shape = (n, x.shape[0] // n) + tuple(x.shape[1:])
    return jax.lax.reshape(x, shape, out_sharding=NamedSharding(
        dp.mesh, P(axis, *[None] * (len(shape) - 1))))

  local_batch = jax.tree.map(split_workers, batch)
  keys = None
  if key is not None:
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(n))
    keys = jax.device_put(keys, NamedSharding(dp.mesh, P(axis)))
  grad_fn = jax.value_and_grad(functools.partial(common.checked_loss, dp),
                               has_aux=dp.has_aux or dp.has_state)

  def worker_of(b, k, p):
    args = (model_state, b) if dp.has_state else (b,)
    return grad_fn(p, *args, **({} if k is None else {"key": k}))

  # The mesh as the abstract context, so a model's own sharding annotations
  # (PartitionSpecs) resolve; it is not a device context (none is entered).
  with jax.sharding.use_abstract_mesh(dp.mesh.abstract_mesh):
    return jax.vmap(worker_of, in_axes=(0, None if keys is None else 0,
                                        0 if dp.local_params else None),
                    axis_name=axis if isinstance(axis, str) else None,
                    spmd_axis_name=_spmd_axes(dp))(local_batch, keys, params)


def _update(dp, layout: Layout, grads, opt_state, params, extra_args):
  """``(updates, new_state)``: the optimizer on whole leaves, in a ``shard_map`` manual
  over every mesh axis, each rank keeping its slice."""
  axes, opt = dp.axes, dp.optimizer
  state_specs = lay.unstacked_specs(layout.state_specs, axes)

  def update(g, st, p, extra):
    g = jax.tree.map(lambda x: x[0], g)
    st = lay.unstack_workers(st, layout.state_specs, axes)
    u, new = opt.update(lay.gather_tree(g, layout.param_specs), lay.gather_tree(st, state_specs),
                        lay.gather_tree(p, layout.param_specs), **extra)
    common.check_replicated(dp, u)
    new = lay.stack_workers(lay.slice_tree(new, state_specs), layout.state_specs, axes)
    return lay.slice_tree(u, layout.param_specs), new

  grad_specs = jax.tree.map(lambda s: lay.stacked_spec(s, axes), layout.param_specs,
                            is_leaf=lay.is_spec)
  return jax.shard_map(
      update, mesh=dp.mesh,
      in_specs=(grad_specs, layout.state_specs, layout.param_specs, P()),
      out_specs=(layout.param_specs, layout.state_specs))(grads, opt_state, params, extra_args)
