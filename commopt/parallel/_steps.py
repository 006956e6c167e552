"""The step bodies, one class per parameter layout, and the loss contract they share.

A step body runs the data-parallel step for one kind of parameter layout. It is
built from the ``DataParallel`` and the step's :class:`~commopt.transforms._layout.Layout`, and has
``init(params)`` and ``step(params, opt_state, batch, model_state, key,
extra_args)``; both get the parameters and the state already placed by the
layout (``DataParallel.init`` and ``step_fn`` place them, and place what they
return). ``DataParallel._body(layout)`` picks one:

- :class:`ReplicatedStep`: parameters replicated over the mesh (or per worker,
  with ``local_params``): one ``shard_map`` over the data axes.
- :class:`ShardLocalStep`: parameters sharded over the mesh's other axes, each
  device updating its own shards.
- :class:`WholeLeafStep`: the same parameters, ``tx`` on whole leaves
  all-gathered over the model axes (a ``tx`` that needs them, or
  ``shard_local=False``).

:class:`StepBody`, their base, holds what every body shares: the check that an
update stays the same on every worker and model state made so. The two bodies
for sharded parameters share :class:`ShardedStep` (per-worker gradients by
``jax.vmap``, the optimizer in a ``shard_map`` manual over every mesh axis).
A new parameter layout is a new subclass and one branch in ``DataParallel._body``.

:class:`LossContract` is the mixin of ``DataParallel`` and ``ZeroDataParallel``: the
loss's output checked against ``has_aux`` / ``has_state`` and split, model state
averaged over the workers, and the agreed non-finite skip's handling of model
state (a worker whose new model state is not finite poisons its gradients, so
the skip covers it; a skipped step keeps the old model state).
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from commopt._src.finite import all_finite
from commopt.comm import _collectives as coll
from commopt.transforms import _layout as lay
from commopt.transforms._layout import Layout, keystr, local_value_and_grad


class LossContract:
  """What a data-parallel step does with the user's loss and model state, and the agreed
  non-finite skip's part in it: a mixin of ``DataParallel`` and ``ZeroDataParallel``.

  It reads the fields ``loss_fn``, ``has_aux``, ``has_state``, ``model_state_sync``
  and ``skip_nonfinite`` of the class it is mixed into; ``_CALLER`` names that
  class's factory in errors.
  """
  _CALLER: ClassVar[str] = "data_parallel"

  def _check_model_state(self, model_state) -> None:
    """A ValueError unless ``model_state`` is given exactly when ``has_state`` (a PRNG key
    given in its place is named as one: the key goes by name)."""
    fn = self._CALLER
    if self.has_state and model_state is None:
      raise ValueError(f"{fn}: has_state=True needs `model_state` in every step.")
    if not self.has_state and model_state is not None:
      hint = ""
      if any(jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)
             for x in jax.tree.leaves(model_state)):
        hint = (" It is a PRNG key: the step's fourth argument is the model state, so pass "
                "the key by name, step(params, state, batch, key=key).")
      raise ValueError(
          f"{fn}: `model_state` was given but has_state=False; pass has_state=True and a "
          "loss_fn(params, model_state, batch) -> (loss, new_model_state)." + hint)

  def _checked_loss(self, *args, **kwargs):
    """``loss_fn``, with its output checked against ``has_aux`` / ``has_state``.

    The model state (``has_state``: the second argument) is rebuilt here, inside the
    gradient's trace, where a Flax nnx model merged from it may update its variables
    (batch statistics, RNG counts): nnx refuses to mutate a variable made at another."""
    if self.has_state:
      args = (args[0], jax.tree.map(lambda x: x, args[1]), *args[2:])
    out = self.loss_fn(*args, **kwargs)
    fn = self._CALLER
    pair = isinstance(out, (tuple, list)) and len(out) == 2
    if (self.has_aux or self.has_state) and not pair:
      flags = " and ".join(f for f in ("has_aux=True", "has_state=True")
                           if getattr(self, f[:-5]))
      want = ("(loss, (new_model_state, aux))" if self.has_aux and self.has_state
              else "(loss, new_model_state)" if self.has_state else "(loss, aux)")
      raise ValueError(f"{fn}: with {flags}, `loss_fn` must return {want}; it "
                       f"returned {type(out).__name__}.")
    if self.has_state and self.has_aux and not (isinstance(out[1], (tuple, list))
                                                and len(out[1]) == 2):
      raise ValueError(f"{fn}: with has_aux=True and has_state=True, `loss_fn` must "
                       "return (loss, (new_model_state, aux)).")
    return out

  def _split_out(self, value):
    """``(loss, aux, new_model_state)`` from what the loss returned."""
    loss, out = value if (self.has_aux or self.has_state) else (value, None)
    aux = new_ms = None
    if self.has_state:
      new_ms, aux = out if self.has_aux else (out, None)
    elif self.has_aux:
      aux = out
    return loss, aux, new_ms

  def _mean_model_state(self, new, axes, workers: int):
    """Inside ``shard_map`` over ``axes``: each floating-point leaf of ``new`` that differs
    between the ``workers`` averaged over them (one all-reduce each, in float32), the rest
    as it is; with ``model_state_sync="none"`` (or an integer leaf) a leaf that differs is
    refused."""
    sync = self.model_state_sync
    leaves, treedef = jax.tree_util.tree_flatten_with_path(new)
    out = []
    for path, x in leaves:
      if not coll.per_worker(x, axes):
        out.append(x)
        continue
      if sync == "none" or not jnp.issubdtype(x.dtype, jnp.inexact):
        raise ValueError(
            f"{self._CALLER}: model state leaf {keystr(path)} ({x.dtype}) differs between "
            f"workers after the loss, and model_state_sync={sync!r} "
            + ("keeps model state replicated without communicating; use "
               "model_state_sync='mean' to average it." if sync == "none"
               else "can only average floating-point state."))
      out.append((coll.psum(x.astype(jnp.float32), axes) / workers).astype(x.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)

  def _poison_if_nonfinite(self, grads, new_model_state):
    """A worker whose new model state is not finite sends NaN gradients, so the agreed
    skip (``skip_nonfinite``) also covers state that the gradients do not reach."""
    if not (self.skip_nonfinite and self.has_state):
      return grads
    # Floating-point leaves only: model state may hold PRNG keys, which have no isfinite.
    floats = [x for x in jax.tree.leaves(new_model_state)
              if jnp.issubdtype(x.dtype, jnp.inexact)]
    if not floats:
      return grads
    ok = all_finite(floats)
    return jax.tree.map(lambda g: jnp.where(ok, g, jnp.nan).astype(g.dtype), grads)

  def _keep_on_skip(self, new_model_state, model_state, new_opt_state):
    """The old model state where the agreed non-finite skip dropped the step."""
    if not self.skip_nonfinite:
      return new_model_state
    ok = new_opt_state.last_finite
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_model_state, model_state)


class StepBody:
  """What every step body shares; a subclass runs the step for one parameter layout.

  Args:
    dp: the :class:`~commopt.DataParallel` (its options, its optimizer, its
      :class:`LossContract`).
    layout: the step's :class:`~commopt.transforms._layout.Layout` for these parameters.
  """

  def __init__(self, dp, layout: Layout):
    self.dp, self.layout = dp, layout
    self.axes, self.opt = dp.axes, dp.optimizer

  def init(self, params) -> Any:
    """The optimizer state for ``params``: per-worker leaves stacked ``[num_workers, ...]``."""
    raise NotImplementedError

  def step(self, params, opt_state, batch, model_state, key,
           extra_args) -> tuple[Any, Any, Any, Any]:
    """``(params, opt_state, metrics, model_state)`` after one step (``model_state`` is
    None without ``has_state``); the arguments are as :meth:`DataParallel.step_fn`'s."""
    raise NotImplementedError

  def check_replicated(self, tree, what="the update of parameter"):
    """A ValueError if a leaf of ``tree`` differs between workers (inside ``shard_map``)."""
    name = self.dp.axis_name
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      if coll.per_worker(leaf, self.axes):
        raise ValueError(
            f"data_parallel: {what} {keystr(path)} differs between "
            f"workers on axis {name!r}, so the replicas would drift apart. "
            "`tx` must reduce over that axis after anything per-worker, e.g. "
            f"optax.chain(commopt.compressed_mean(c, axis_name={name!r}), optax.sgd(lr)); "
            "transforms that keep parameters per worker between synchronisations "
            "(commopt.local_sgd, commopt.diloco) need data_parallel(..., local_params=True).")

  def sync_model_state(self, new):
    """Inside ``shard_map``: averages model state that differs between workers
    (``model_state_sync='mean'``)."""
    return self.dp._mean_model_state(new, self.axes, self.dp.num_workers)


class ReplicatedStep(StepBody):
  """The step body for parameters replicated over the mesh: one ``shard_map`` over the data
  axes.

  Each worker differentiates the loss on its rows with its gradients kept local
  (:func:`~commopt.parallel.local_value_and_grad`) and runs the optimizer, whose
  reduction is the step's only communication. With ``local_params=True`` each
  worker keeps its own parameters, stacked ``[num_workers, ...]`` over the data
  axes, for transforms that synchronise them now and then (``local_sgd``,
  ``diloco``).
  """

  def init(self, params) -> Any:
    """``tx.init`` inside the step's ``shard_map``, so it can size per-worker chunks."""
    axes, opt, state_specs = self.axes, self.opt, self.layout.state_specs

    def body(p):
      return lay.stack_workers(opt.init(p), state_specs, axes)

    # Jitted: run eagerly, a shard_map compiles each of its operations on its own.
    manual = lay.manual_specs(state_specs, axes)
    return jax.jit(jax.shard_map(body, mesh=self.dp.mesh, in_specs=(P(),), out_specs=manual,
                                 axis_names=set(axes)))(params)

  def step(self, params, opt_state, batch, model_state, key, extra_args):
    """One ``shard_map`` over the data axes: local gradients, then the optimizer."""
    dp, layout, axes, opt = self.dp, self.layout, self.axes, self.opt
    manual = lay.manual_specs(layout.state_specs, axes)
    grad_fn = local_value_and_grad(dp._checked_loss, axes, has_aux=dp.has_aux or dp.has_state)

    def body(params, state, batch, model_state, key, extra_args):
      if dp.local_params:
        params = jax.tree.map(lambda x: x[0], params)
      state = lay.unstack_workers(state, layout.state_specs, axes)
      kwargs = {} if key is None else {"key": jax.random.fold_in(key, coll.axis_index(axes))}
      args = (model_state, batch) if dp.has_state else (batch,)
      value, grads = grad_fn(params, *args, **kwargs)
      loss, aux, new_ms = dp._split_out(value)
      grads = dp._poison_if_nonfinite(grads, new_ms)
      if layout.reads_value and "value" not in extra_args:
        extra_args = dict(extra_args, value=coll.pmean(loss, axes))
        grads = coll.after(grads, extra_args["value"])     # the exchange after that mean
      updates, new_state = opt.update(grads, state, params, **extra_args)
      new_params = optax.apply_updates(params, updates)
      if dp.local_params:
        new_params = jax.tree.map(lambda x: x[None], new_params)
      else:
        self.check_replicated(new_params)
      if dp.has_state:
        new_ms = dp._keep_on_skip(self.sync_model_state(coll.after(new_ms, updates)),
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


class ShardedStep(StepBody):
  """The step around the optimizer for parameters sharded over the mesh's other axes, with
  no dense value crossing the data axes (a subclass runs the optimizer: :meth:`update`).

  The gradients come from ``jax.vmap`` over the workers (``spmd_axis_name``
  shards the worker axis over the data axes; the model's own sharding over the
  other axes is the compiler's, as in any sharded JAX program, so a gradient
  reduced over an FSDP axis is reduced there, densely, by the compiler), so each
  worker's gradient stays on its data rank. The optimizer then runs in a
  ``shard_map`` manual over every mesh axis. (A ``shard_map`` manual over the data
  axes alone would gather its model-sharded inputs at its boundary, over all
  devices.)
  """
  SHARD_LOCAL: ClassVar[bool] = False
  """Whether the optimizer runs on each device's shards (else on whole leaves)."""

  def update(self, grads, opt_state, params, extra_args):
    """``(updates, new_state)``: the optimizer in a ``shard_map`` manual over every mesh
    axis, on the per-worker ``grads`` stacked ``[num_workers, ...]``."""
    raise NotImplementedError

  def step(self, params, opt_state, batch, model_state, key, extra_args):
    """Per-worker gradients by ``vmap`` before :meth:`update`, parameters and model state
    after."""
    dp, layout = self.dp, self.layout
    self.refuse_options()
    value, grads = self.worker_grads(params, batch, model_state, key)
    loss, aux, new_ms = dp._split_out(value)
    grads = jax.vmap(dp._poison_if_nonfinite, spmd_axis_name=self._spmd_axes())(grads, new_ms)
    if layout.reads_value and "value" not in extra_args:
      extra_args = dict(extra_args, value=jnp.mean(loss))
    updates, new_state = self.update(grads, opt_state, params, extra_args)
    new_params = optax.apply_updates(params, updates)
    metrics = loss if not dp.has_aux else (loss, aux)
    if dp.has_state:
      new_ms = dp._keep_on_skip(self.mean_over_workers(new_ms), model_state, new_state)
    return new_params, new_state, metrics, new_ms

  def refuse_options(self) -> None:
    """A ValueError for the options this body does not support."""
    dp = self.dp
    if dp.local_params and not self.SHARD_LOCAL:
      raise ValueError(
          "data_parallel: local_params=True with parameters sharded over other mesh axes "
          "needs the shard-local step, which this `tx` cannot take (see the warning or "
          "error that data_parallel gave when it traced `tx`).")
    if len(dp.axes) != 1 and not self.SHARD_LOCAL:
      raise ValueError(
          f"data_parallel: on a mesh with other axes ({dp._other_axes}) the data axis must "
          f"be one mesh axis; got axis_name={dp.axis_name!r}.")
    if dp.has_state and dp.model_state_sync != "mean":
      raise ValueError(
          "data_parallel: with tensor-parallel parameters, model state is averaged across "
          f"workers (model_state_sync='mean'); got {dp.model_state_sync!r}.")

  def _spmd_axes(self):
    """The data axes as ``jax.vmap``'s ``spmd_axis_name`` (a name, or a tuple of them)."""
    return self.axes[0] if len(self.axes) == 1 else tuple(self.axes)

  def worker_grads(self, params, batch, model_state, key):
    """``(value, grads)`` of every worker on its rows, stacked ``[num_workers, ...]``
    (with ``local_params``, each worker's own parameters, stacked so too)."""
    dp = self.dp
    axis, n = lay.data_spec(self.axes), dp.num_workers

    def split_workers(x):
      shape = (n, x.shape[0] // n) + tuple(x.shape[1:])
      return jax.lax.reshape(x, shape, out_sharding=NamedSharding(
          dp.mesh, P(axis, *[None] * (len(shape) - 1))))

    local_batch = jax.tree.map(split_workers, batch)
    keys = None
    if key is not None:
      keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(n))
      keys = jax.device_put(keys, NamedSharding(dp.mesh, P(axis)))
    grad_fn = jax.value_and_grad(dp._checked_loss, has_aux=dp.has_aux or dp.has_state)

    def worker_of(b, k, p):
      args = (model_state, b) if dp.has_state else (b,)
      return grad_fn(p, *args, **({} if k is None else {"key": k}))

    # The mesh as the abstract context, so a model's own sharding annotations
    # (PartitionSpecs) resolve; it is not a device context (none is entered).
    with jax.sharding.use_abstract_mesh(dp.mesh.abstract_mesh):
      return jax.vmap(worker_of, in_axes=(0, None if keys is None else 0,
                                          0 if dp.local_params else None),
                      axis_name=axis if isinstance(axis, str) else None,
                      spmd_axis_name=self._spmd_axes())(local_batch, keys, params)

  def mean_over_workers(self, stacked):
    """Outside ``shard_map``: model state stacked ``[num_workers, ...]`` made one.

    Floating-point state is averaged over the workers; the rest (counters)
    advances the same way on every worker, so the first worker's is kept.
    """
    replicated = lambda x: jax.device_put(x, NamedSharding(self.dp.mesh, P()))
    return jax.tree.map(
        lambda x: jnp.mean(x.astype(jnp.float32), 0).astype(x.dtype)
        if jnp.issubdtype(x.dtype, jnp.inexact) else replicated(x)[0], stacked)


class WholeLeafStep(ShardedStep):
  """The whole-leaf step body for parameters sharded over the mesh's other axes (tensor
  parallel plus data parallel): for a ``tx`` that needs whole leaves, or
  ``shard_local=False`` (:class:`ShardLocalStep` is the default).

  The optimizer runs in a ``shard_map`` manual over every mesh axis: each leaf
  is all-gathered over the non-data axes its spec names, the optimizer (and its
  compressed exchange over the data axis) runs on whole leaves, and each rank
  keeps its slice.
  """

  @staticmethod
  def applies(dp, layout: Layout) -> bool:
    """Whether some parameter is sharded over a mesh axis other than the data axes."""
    specs = jax.tree.leaves(layout.param_specs, is_leaf=lay.is_spec)
    return bool(dp._other_axes) and any(e is not None for s in specs for e in s)

  def init(self, params) -> Any:
    """Manual over every axis: whole leaves gathered over the non-data axes, each rank
    keeping its slice of the state."""
    axes, opt, layout = self.axes, self.opt, self.layout
    state_specs = lay.unstacked_specs(layout.state_specs, axes)

    def body(p):
      state = lay.slice_tree(opt.init(lay.gather_tree(p, layout.param_specs)), state_specs)
      return lay.stack_workers(state, layout.state_specs, axes)

    # Jitted: run eagerly, a shard_map compiles each of its operations on its own.
    return jax.jit(jax.shard_map(body, mesh=self.dp.mesh, in_specs=(layout.param_specs,),
                                 out_specs=layout.state_specs))(params)

  def update(self, grads, opt_state, params, extra_args):
    """``(updates, new_state)``: the optimizer on whole leaves, each rank keeping its
    slice."""
    axes, opt, layout = self.axes, self.opt, self.layout
    state_specs = lay.unstacked_specs(layout.state_specs, axes)

    def update(g, st, p, extra):
      g = jax.tree.map(lambda x: x[0], g)
      st = lay.unstack_workers(st, layout.state_specs, axes)
      u, new = opt.update(lay.gather_tree(g, layout.param_specs),
                          lay.gather_tree(st, state_specs),
                          lay.gather_tree(p, layout.param_specs), **extra)
      self.check_replicated(u)
      new = lay.stack_workers(lay.slice_tree(new, state_specs), layout.state_specs, axes)
      return lay.slice_tree(u, layout.param_specs), new

    grad_specs = jax.tree.map(lambda s: lay.stacked_spec(s, axes), layout.param_specs,
                              is_leaf=lay.is_spec)
    return jax.shard_map(
        update, mesh=self.dp.mesh,
        in_specs=(grad_specs, layout.state_specs, layout.param_specs, P()),
        out_specs=(layout.param_specs, layout.state_specs))(grads, opt_state, params,
                                                            extra_args)


class ShardLocalStep(ShardedStep):
  """The step body for parameters sharded over the mesh's other axes, each device updating
  its own shard: tensor parallel, FSDP or both inside each replica (HSDP), with the
  compressed exchange over the data (replica) axes only.

  The optimizer runs on each device's block of every leaf: a compressor encodes
  this device's shard, the error-feedback residual and every other state leaf
  are sharded like their parameter (plus the worker axis), and nothing
  parameter-sized crosses a model axis. Methods that need a whole leaf's
  quantity (PowerSGD's factors, a trust ratio's norm, the agreed non-finite
  check) add the small model-axis collective they need. With
  ``local_params=True`` each worker's parameters (local SGD, DiLoCo) are stacked
  over the data axes and keep their model sharding.

  It runs when tracing finds ``tx`` safe on shards
  (:class:`~commopt.transforms._layout.LayoutSolver`);
  a ``tx`` that reduces a sharded leaf by itself (``optax.clip_by_global_norm``)
  runs on whole leaves (:class:`WholeLeafStep`).
  """
  SHARD_LOCAL: ClassVar[bool] = True

  def init(self, params) -> Any:
    """``tx.init`` on each device's shards; per-worker leaves stacked, sharded leaves kept so."""
    return lay.init_on_blocks(self.opt, self.layout, self.dp.mesh, self.axes,
                              self.dp._other_axes, params)

  def update(self, grads, opt_state, params, extra_args):
    """``(updates, new_state)``: the optimizer on each device's shards (updates stacked
    over the workers with ``local_params``)."""
    dp = self.dp
    return lay.update_on_blocks(self.opt, self.layout, dp.mesh, self.axes, dp._other_axes,
                                dp.local_params, grads, opt_state, params, extra_args,
                                self.check_replicated)
