"""The step body for parameters sharded over the mesh's other axes, each device updating
its own shard: tensor parallel, FSDP or both inside each replica (HSDP), with the
compressed exchange over the data (replica) axes only.

The gradients come from ``jax.vmap`` over the workers (``spmd_axis_name``
shards the worker axis over the data axes; the model's own sharding over the
other axes is the compiler's, as in any sharded JAX program, so a gradient
reduced over an FSDP axis is reduced there, densely, by the compiler). The
optimizer then runs in a ``shard_map`` manual over every mesh axis on each
device's block of every leaf: a compressor encodes this device's shard, the
error-feedback residual and every other state leaf are sharded like their
parameter (plus the worker axis), and nothing parameter-sized crosses a model
axis. Methods that need a whole leaf's quantity (PowerSGD's factors, a trust
ratio's norm, the agreed non-finite check) add the small model-axis
collective they need. With ``local_params=True`` each worker's parameters
(local SGD, DiLoCo) are stacked over the data axes and keep their model
sharding.

It runs when tracing finds ``tx`` safe on shards (:mod:`._shard_probe`);
a ``tx`` that reduces a sharded leaf by itself (``optax.clip_by_global_norm``)
runs on whole leaves (:mod:`._tensor_parallel_step`). A
:class:`~._step_common.StepBody`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from commopt.comm import _shards
from commopt.parallel import _layout as lay
from commopt.parallel import _shard_probe as shard_probe
from commopt.parallel import _step_common as common
from commopt.parallel import _tensor_parallel_step as tp

if TYPE_CHECKING:
  from commopt.parallel._layout_probe import Layout


def _sharding(dp, layout: Layout, shapes):
  """The context telling the reductions inside how each parameter (of global ``shapes``)
  is sharded over the model axes."""
  return _shards.model_sharding(layout.param_specs, shapes, dp.mesh)


def init(dp, layout: Layout, params) -> Any:
  """``tx.init`` on each device's shards; per-worker leaves stacked, sharded leaves kept so."""
  axes, opt = dp.axes, dp.optimizer
  state_specs = lay.unstacked_specs(layout.state_specs, axes)

  def body(p):
    with _sharding(dp, layout, jax.tree.map(lambda x: tuple(jnp.shape(x)), params)):
      state = shard_probe.vary_to_specs(opt.init(p), state_specs)
    return lay.stack_workers(state, layout.state_specs, axes)

  # Jitted: run eagerly, a shard_map compiles each of its operations on its own.
  return jax.jit(jax.shard_map(body, mesh=dp.mesh, in_specs=(layout.param_specs,),
                               out_specs=layout.state_specs))(params)


def step(dp, layout: Layout, params, opt_state, batch, model_state, key, extra_args):
  """Per-worker gradients by ``vmap``, then the optimizer on each device's shards."""
  tp.refuse_options(dp, shard_local=True)
  return tp.run_step(dp, layout, _update, params, opt_state, batch, model_state, key,
                     extra_args)


def _update(dp, layout: Layout, grads, opt_state, params, extra_args):
  """``(updates, new_state)``: the optimizer on each device's shards, in a ``shard_map``
  manual over every mesh axis (updates stacked over the workers with ``local_params``)."""
  axes, opt = dp.axes, dp.optimizer
  state_specs = lay.unstacked_specs(layout.state_specs, axes)
  stacked = lambda specs: jax.tree.map(lambda s: lay.stacked_spec(s, axes), specs,
                                       is_leaf=lay.is_spec)
  param_specs = stacked(layout.param_specs) if dp.local_params else layout.param_specs
  unstack = lambda t: jax.tree.map(lambda x: x[0], t)
  shapes = jax.tree.map(lambda x: tuple(jnp.shape(x))[1:] if dp.local_params
                        else tuple(jnp.shape(x)), params)

  def update(g, st, p, extra):
    g = unstack(g)
    p = unstack(p) if dp.local_params else p
    st = lay.unstack_workers(st, layout.state_specs, axes)
    with _sharding(dp, layout, shapes):
      u, new = opt.update(g, st, p, **extra)
    if dp.local_params:
      u = jax.tree.map(lambda x: x[None], u)
    else:
      common.check_replicated(dp, u)
    new = shard_probe.vary_to_specs(new, state_specs)
    return u, lay.stack_workers(new, layout.state_specs, axes)

  return jax.shard_map(
      update, mesh=dp.mesh,
      in_specs=(stacked(layout.param_specs), layout.state_specs, param_specs, P()),
      out_specs=(param_specs, layout.state_specs))(grads, opt_state, params, extra_args)
