"""Flax nnx models under :func:`~commopt.data_parallel`: pass a model, not split/merge code."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from commopt._src import base
from commopt.comm import _collectives as coll
from commopt.transforms import _layout as lay
from commopt.parallel._data_parallel import DataParallel
from commopt.transforms._layout import explicit
from commopt.parallel._placement import placed_on_trace


class NnxTrainState(NamedTuple):
  """What :class:`NnxDataParallel` carries from step to step.

  Attributes:
    params: the model's trainable variables (``nnx.State`` of ``wrt``).
    model_state: every other variable: batch statistics, RNG keys and counts.
    opt_state: the optimizer state (per-worker leaves stacked).
  """
  params: Any
  model_state: Any
  opt_state: Any


@dataclasses.dataclass(frozen=True, eq=False)
class NnxDataParallel:
  """:func:`~commopt.data_parallel` for a Flax nnx model (see :func:`nnx_data_parallel`).

  Attributes:
    graphdef: the model's structure (static).
    dp: the underlying :class:`~commopt.DataParallel` (``has_state=True``).
  """
  graphdef: Any
  dp: DataParallel
  wrt: Any = nnx.Param

  def split(self, model: nnx.Module) -> tuple[Any, Any]:
    """``(params, model_state)`` of ``model``."""
    _, params, state = nnx.split(model, self.wrt, ...)
    return params, state

  @functools.cached_property
  def init(self) -> Callable[[nnx.Module], NnxTrainState]:
    """``init(model)``: the train state for ``model``'s current variables (the model is not
    modified).

    Pure, and jitted on a mesh whose axes are all explicit (``jax.make_mesh``'s
    default): ``jax.eval_shape(trainer.init, model)`` then gives the train state's
    shapes, dtypes and shardings on the mesh's devices (:meth:`state_shardings`), the
    restore target orbax takes::

        target = jax.eval_shape(trainer.init, model)
        state = orbax.checkpoint.StandardCheckpointer().restore(path, target)

    On a mesh with other axis types it runs eagerly, checking how the variables were
    placed (as :attr:`commopt.DataParallel.init` does).
    """
    if not explicit(self.dp.mesh):
      return self._init
    return placed_on_trace(self._init, self.state_shardings)

  def state_shardings(self, model: nnx.Module) -> NnxTrainState:
    """The train state's ``NamedSharding``\\ s on the mesh for ``model`` (its variables as
    arrays or ``jax.ShapeDtypeStruct``\\ s): the parameters and model state as the step
    places them, the optimizer state by the step's layout."""
    dp = self.dp
    params, model_state = self.split(model)
    layout, placer = dp.layout(params), dp._placer
    return NnxTrainState(lay.to_shardings(dp.mesh, placer.param_specs(layout)),
                         lay.to_shardings(dp.mesh, placer.specs_of(model_state,
                                                                   "model state leaf")),
                         dp.state_shardings(params))

  def _init(self, model: nnx.Module) -> NnxTrainState:
    """:attr:`init`'s work."""
    # Copies: the step donates the train state, and placing an array can share
    # its buffer, which donation would then take from the model.
    params, state = jax.tree.map(jnp.copy, self.split(model))
    opt_state = self.dp.init(params)            # from one worker's parameters
    return NnxTrainState(self.dp.place_params(params), self.dp.place_model_state(state),
                         opt_state)

  def merge(self, state: NnxTrainState) -> nnx.Module:
    """A model holding copies of the train state's variables (e.g. to evaluate it after
    ``.eval()``); copies, so the next (donating) step leaves the model intact."""
    params, model_state = jax.tree.map(jnp.copy, (state.params, state.model_state))
    return nnx.merge(self.graphdef, params, model_state)

  def update_model(self, model: nnx.Module, state: NnxTrainState) -> None:
    """Writes copies of the train state's variables into ``model`` in place."""
    nnx.update(model, *jax.tree.map(jnp.copy, (state.params, state.model_state)))

  def step_fn(self, state: NnxTrainState, batch, key=None, **extra_args):
    """The pure, un-jitted step: ``(state, batch) -> (state, metrics)``.

    ``extra_args`` reach ``tx.update`` (optax's extra-args protocol; see
    :meth:`commopt.DataParallel.step_fn`)."""
    params, opt_state, model_state, metrics = self.dp.step_fn(
        state.params, state.opt_state, batch, state.model_state, key, **extra_args)
    return NnxTrainState(params, model_state, opt_state), metrics

  def step(self, state: NnxTrainState, batch, key=None, **extra_args):
    """One jitted step (the train state is donated unless ``donate=False``).

    ``extra_args`` reach ``tx.update``; a ``tx`` that reads ``value`` (e.g.
    ``optax.contrib.reduce_on_plateau``) gets the workers' mean loss unless
    one is given.

    Returns:
      ``(state, metrics)``: ``metrics`` is each worker's loss ``[num_workers]``,
      or ``(losses, aux)`` with ``has_aux=True``.
    """
    params, opt_state, model_state, metrics = self.dp.step(
        state.params, state.opt_state, batch, state.model_state, key, **extra_args)
    return NnxTrainState(params, model_state, opt_state), metrics

  def lower(self, state: NnxTrainState, batch, key=None, **extra_args):
    """The lowered step, for :func:`commopt.wire.hlo_collectives`."""
    return self.dp.lower(state.params, state.opt_state, batch, state.model_state, key,
                         **extra_args)


def nnx_data_parallel(model: nnx.Module, loss_fn: Callable, tx: optax.GradientTransformation,
                      mesh: jax.sharding.Mesh, axis_name: str | tuple[str, ...] = "data", *,
                      has_aux: bool = False, wrt=nnx.Param, **options) -> NnxDataParallel:
  """Data-parallel training of a Flax nnx model with mutable state.

  ``loss_fn(model, batch)`` is written as for one device. On every worker the
  step merges the model from the train state, runs ``loss_fn`` on the worker's
  shard, and splits the model again, so mutable variables are carried:

  - **Batch statistics** (``nnx.BatchNorm``) are computed on each worker's
    shard and **averaged across workers after every step** (one small dense
    all-reduce, the usual JAX recipe): the replicas keep identical running
    statistics. Pass ``model_state_sync="none"`` to refuse model state that
    differs between workers instead.
  - **Randomness** (``nnx.Dropout`` and any ``nnx.Rngs`` stream) differs per
    worker and per step: each worker's RNG keys are ``fold_in(key,
    worker_index)`` for the step, and the streams' counts advance every step as
    on one device. The stored keys stay replicated.

  Put the model in training mode (``model.train()``) before calling this.

  Args:
    model: the nnx model; its structure is captured, its variables are read
      by :meth:`NnxDataParallel.init`.
    loss_fn: ``loss_fn(model, batch) -> loss``, or ``(loss, aux)`` with ``has_aux``.
    tx: the optax transformation (with a reduction over ``axis_name``).
    mesh: as for :func:`~commopt.data_parallel`.
    axis_name: as for :func:`~commopt.data_parallel`.
    has_aux: ``loss_fn`` returns ``(loss, aux)``; aux comes back per worker.
    wrt: the variables to train (an nnx filter, default ``nnx.Param``).
    **options: ``model_state_sync``, ``skip_nonfinite``, ``donate`` as for
      :func:`~commopt.data_parallel`.

  Returns:
    An :class:`NnxDataParallel` with ``init(model) -> state`` and
    ``step(state, batch) -> (state, metrics)``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, commopt
    >>> from flax import nnx
    >>> class Net(nnx.Module):
    ...   def __init__(self, rngs):
    ...     self.lin = nnx.Linear(4, 2, rngs=rngs)
    ...     self.bn = nnx.BatchNorm(2, rngs=rngs)
    ...     self.drop = nnx.Dropout(0.5, rngs=rngs)
    ...   def __call__(self, x):
    ...     return self.drop(self.bn(self.lin(x)))
    >>> model = Net(nnx.Rngs(0))
    >>> loss_fn = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
    >>> tx = optax.chain(commopt.compressed_mean(commopt.compressors.identity(), axis_name="data"), optax.sgd(0.1))
    >>> trainer = commopt.nnx_data_parallel(model, loss_fn, tx, jax.make_mesh((1,), ("data",)))
    >>> state = trainer.init(model)
    >>> state, losses = trainer.step(state, {"x": jnp.ones((8, 4)), "y": jnp.zeros((8, 2))})
    >>> losses.shape
    (1,)
  """
  if not isinstance(model, nnx.Module):
    raise base.OptionTypeError(
        f"nnx_data_parallel: `model` must be a flax nnx.Module, got {model!r}.")
  has_aux = base.check_bool("has_aux", has_aux, fn="nnx_data_parallel")
  graphdef, _, _ = nnx.split(model, wrt, ...)
  axes = base.axis_names(axis_name)

  def state_loss(params, model_state, batch):
    keys, rest = nnx.split_state(model_state, nnx.RngKey, ...)
    worker = coll.axis_index(axes)
    local_keys = jax.tree.map(lambda k: jax.random.fold_in(k, worker), keys)
    # Rebuilding the variables here ties them to this trace level (inside the
    # gradient), where nnx lets the model update them (RNG counts, statistics).
    fresh = lambda tree: jax.tree.map(lambda x: x, tree)
    m = nnx.merge(graphdef, fresh(params), fresh(nnx.merge_state(local_keys, rest)))
    out = loss_fn(m, batch)
    loss, aux = out if has_aux else (out, None)
    _, _, new_state = nnx.split(m, wrt, ...)
    _, new_rest = nnx.split_state(new_state, nnx.RngKey, ...)
    new_state = nnx.merge_state(keys, new_rest)
    return loss, ((new_state, aux) if has_aux else new_state)

  dp = DataParallel(state_loss, tx, mesh, axis_name, has_aux=has_aux, has_state=True, **options)
  return NnxDataParallel(graphdef, dp, wrt)
