"""data_parallel: a pure shard_map training step whose only reduction is the optimizer's.

:class:`DataParallel` holds the options and the public methods, and the few
objects that do the work:

- its :class:`~commopt.transforms._layout.LayoutSolver` (:mod:`commopt.transforms._layout`): the step's
  :class:`Layout`, found by tracing ``tx`` (which state leaves are per-worker,
  their specs, whether ``tx`` reads ``value``), and the check of ``tx``'s axis
  names when the step is built;
- its :class:`~._placement.Placer` (:mod:`._placement`): placing parameters,
  state, model state and batches on the mesh, checking what the user placed,
  resizing saved state;
- a step body per parameter layout (:mod:`._steps`), each with ``init`` and
  ``step``: :class:`~._steps.ReplicatedStep` (parameters replicated, or per
  worker with ``local_params``), :class:`~._steps.ShardLocalStep` (parameters
  sharded over other mesh axes, each device updating its shards) and
  :class:`~._steps.WholeLeafStep` (the same parameters, ``tx`` on whole
  leaves). :meth:`DataParallel._body` picks one; a new parameter layout is a
  new class there. The loss's contract and the skip's handling of model state
  are :class:`~._steps.LossContract`'s, a mixin ``ZeroDataParallel`` shares.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from commopt._src import base
from commopt.comm import _plan
from commopt.transforms import _layout as lay
from commopt.transforms._layout import Layout, LayoutSolver, explicit
from commopt.parallel._placement import (Placer, check_batch, layouts_of,
                                         local_workers, placed_on_trace)
from commopt.parallel._steps import (LossContract, ReplicatedStep, ShardLocalStep, StepBody,
                                     WholeLeafStep)
from commopt.transforms._control import apply_if_finite

MODEL_STATE_SYNC = ("mean", "none")
SKIP_MODES = ("zero",)   # skip_nonfinite besides True and False


@dataclasses.dataclass(frozen=True, eq=False)
class DataParallel(LossContract):
  """A data-parallel training step over mesh axes (see :func:`data_parallel`).

  Immutable: every method is a pure function of its arguments, so ``init`` and
  ``step`` may be called inside your own ``jax.jit``, ``lax.scan``,
  ``lax.fori_loop`` and ``jax.eval_shape``, and one ``DataParallel`` serves
  any number of independent runs.

  Attributes:
    loss_fn: as given to :func:`data_parallel`.
    tx: as given to :func:`data_parallel`.
    mesh: as given to :func:`data_parallel`.
    axis_name: as given to :func:`data_parallel`.
    has_aux: as given to :func:`data_parallel`.
    has_state: as given to :func:`data_parallel`.
    model_state_sync: as given to :func:`data_parallel`.
    skip_nonfinite: as given to :func:`data_parallel`.
    donate: as given to :func:`data_parallel`.
    local_params: as given to :func:`data_parallel`.
    shard_local: as given to :func:`data_parallel`.
  """
  loss_fn: Callable
  tx: optax.GradientTransformation
  mesh: jax.sharding.Mesh
  axis_name: str | tuple[str, ...] = "data"
  has_aux: bool = False
  has_state: bool = False
  model_state_sync: str = "mean"
  skip_nonfinite: bool | str = True
  donate: bool = True
  local_params: bool = False
  shard_local: bool | str = "auto"

  def __post_init__(self):
    fn = "data_parallel"
    if not callable(self.loss_fn):
      raise base.OptionTypeError(f"{fn}: `loss_fn` must be callable, got {self.loss_fn!r}.")
    if not (hasattr(self.tx, "init") and hasattr(self.tx, "update")):
      raise base.OptionTypeError(
          f"{fn}: `tx` must be an optax GradientTransformation, got {self.tx!r}.")
    if not isinstance(self.mesh, jax.sharding.Mesh):
      raise base.OptionTypeError(
          f"{fn}: `mesh` must be a jax.sharding.Mesh (e.g. jax.make_mesh((8,), ('data',))), "
          f"got {self.mesh!r}.")
    if isinstance(self.axis_name, list):
      object.__setattr__(self, "axis_name", tuple(self.axis_name))
    axes = base.axis_names(self.axis_name)
    missing = [a for a in axes if a not in self.mesh.axis_names]
    if not axes or missing or len(set(axes)) != len(axes):
      raise ValueError(
          f"{fn}: `axis_name` {self.axis_name!r} must name distinct axes of the mesh, "
          f"whose axes are {tuple(self.mesh.axis_names)}"
          + (f"; {missing} {'is' if len(missing) == 1 else 'are'} not among them." if missing
             else "."))
    base.check_choice("model_state_sync", self.model_state_sync, MODEL_STATE_SYNC, fn)
    if not (self.shard_local is True or self.shard_local is False
            or (isinstance(self.shard_local, str) and self.shard_local == "auto")):
      raise ValueError(f"{fn}: `shard_local` must be 'auto', True or False, got "
                       f"{self.shard_local!r}.")
    if isinstance(self.skip_nonfinite, str) and self.skip_nonfinite == "fast":
      raise ValueError(
          f"{fn}: skip_nonfinite='fast' was removed: use True (the default: every state "
          "kept on any skip) or 'zero' (the cheapest: the optimizer takes a zero gradient).")
    if not (self.skip_nonfinite is True or self.skip_nonfinite is False
            or (isinstance(self.skip_nonfinite, str) and self.skip_nonfinite in SKIP_MODES)):
      raise base.OptionTypeError(f"{fn}: `skip_nonfinite` must be True, False or 'zero', got "
                                 f"{self.skip_nonfinite!r}.")
    for name in ("has_aux", "has_state", "donate", "local_params"):
      object.__setattr__(self, name, base.check_bool(name, getattr(self, name), fn=fn))
    self._solver.check_tx_axes()

  # -- basic facts ---------------------------------------------------------------

  @functools.cached_property
  def axes(self) -> tuple[str, ...]:
    """The data axes as a tuple."""
    return base.axis_names(self.axis_name)

  @functools.cached_property
  def num_workers(self) -> int:
    """The number of workers (the product of the data axes' sizes)."""
    return int(math.prod(self.mesh.shape[a] for a in self.axes))

  @functools.cached_property
  def optimizer(self) -> optax.GradientTransformation:
    """The transformation the step runs: ``tx``, wrapped in an agreed non-finite skip.

    The skip (``skip_nonfinite``: True, False or ``"zero"``) is
    :func:`~commopt.transforms.apply_if_finite`'s. With ``local_params`` and no model
    state, nothing else makes the workers meet on every step: then, for a ``tx`` that
    registers when it exchanges (the synchronisation modes), the workers agree only on
    those steps, and in between each skips its own (``apply_if_finite``'s
    ``agree_when``): no collective runs between exchanges.
    """
    if self.skip_nonfinite is False:
      return optax.with_extra_args_support(self.tx)
    zero = self.skip_nonfinite == "zero"
    local = self.local_params and not self.has_state
    exchanges = _plan.exchanges_of(self.tx) if local and not zero else None
    return apply_if_finite(self.tx, axis_name=self.axis_name, agree_when=exchanges,
                           on_skip="zero" if zero else "keep")

  @functools.cached_property
  def _solver(self) -> LayoutSolver:
    """Finds the step's :class:`Layout` by tracing ``tx``, and keeps what it found."""
    return LayoutSolver(self)

  @functools.cached_property
  def _placer(self) -> Placer:
    """Places the step's values on the mesh, and keeps the argument signatures it checked."""
    return Placer(self)

  @functools.cached_property
  def _other_axes(self) -> tuple[str, ...]:
    """The mesh's other axes (of size above one): tensor-parallel parameters' axes."""
    return lay.model_axes(self.mesh, self.axes)

  # -- layout --------------------------------------------------------------------

  def param_specs_of(self, params) -> Any:
    """The parameters' partition specs over the mesh (checked: none names the data axes)."""
    return self._placer.specs_of(params, "parameter")

  def layout(self, params) -> Layout:
    """The step's :class:`Layout` for ``params`` (arrays, tracers or ``ShapeDtypeStruct``\\ s).

    Which optimizer-state leaves are per-worker is found by tracing ``tx.init``
    and ``tx.update`` inside ``shard_map`` with local gradients, to a fixed
    point: a leaf is per-worker when its new value varies over the data axes.
    Nothing is computed; the result is cached per parameter shapes and specs.
    """
    return self._solver.find(params)

  def state_specs(self, params) -> Any:
    """The optimizer state's ``PartitionSpec``\\ s, a pytree like the state."""
    return self.layout(params).state_specs

  def state_shardings(self, params) -> Any:
    """The optimizer state's ``NamedSharding``\\ s on the mesh (for orbax restores)."""
    return lay.to_shardings(self.mesh, self.state_specs(params))

  def abstract_state(self, params) -> tuple[Any, Any]:
    """``(params, opt_state)`` as ``jax.ShapeDtypeStruct``\\ s placed on the mesh: a restore target.

    The state is ``jax.eval_shape(self.init, params)`` (nothing is computed),
    the parameters as the step places them (stacked per worker with
    ``local_params``), each with the step's sharding, so orbax restores a saved
    ``{"params": ..., "opt_state": ...}`` straight onto the devices the step
    uses, per-worker residuals on their workers::

        target = dict(zip(("params", "opt_state"), dp.abstract_state(params)))
        restored = orbax.checkpoint.StandardCheckpointer().restore(path, target)
    """
    layout = self.layout(params)
    put = lambda a, sharding: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
    state = jax.tree.map(put, jax.eval_shape(self.init, params),
                         lay.to_shardings(self.mesh, layout.state_specs))
    params = jax.tree.map(put, jax.eval_shape(self._placer.stack_params, params),
                          lay.to_shardings(self.mesh, self._placer.param_specs(layout)))
    return params, state

  def per_worker(self, params) -> Any:
    """A pytree like the optimizer state: True where a leaf is per-worker (stacked)."""
    return self.layout(params).per_worker

  def resize_state(self, saved_state, params, *, saved_shardings=None) -> Any:
    """An optimizer state saved by a run with another number of workers, placed for this one.

    The rule (:mod:`commopt.parallel._resize`): per-worker float state such as
    error-feedback residuals is averaged onto the new workers by the overlap of
    their rank intervals, which keeps the workers' mean residual, the update
    error feedback still owes the model, exactly; two-phase server memories
    are re-split into the new chunks; replicated state is copied. With several
    data axes only the first may change size. With as many workers as saved,
    the state comes back unchanged.

    Args:
      saved_state: the saved optimizer state: this state's structure, or the
        plain dicts and lists orbax restores without a target; leaves are host
        or device arrays (multi-process arrays are gathered, so every process
        must call this).
      params: the parameters (arrays or ``ShapeDtypeStruct``\\ s) of this run.
      saved_shardings: how the saved leaves were split over the mesh they were
        saved on: a pytree like ``saved_state`` of ``NamedSharding``\\ s (or of
        arrays or ``ShapeDtypeStruct``\\ s carrying one), e.g. from orbax's
        metadata. Needed only for a state read whole whose two-phase server
        memories hold each device's block of a model-sharded parameter; a
        state of live arrays tells its own.

    Returns:
      The state with this run's shapes, placed on the mesh like :meth:`init`'s.
    """
    _, target = self.abstract_state(params)
    layouts = None if saved_shardings is None else layouts_of(saved_shardings)
    return self._placer.resized(saved_state, target, self.per_worker(params), "resize_state",
                                saved_layouts=layouts)

  def resize_params(self, saved_params, params) -> Any:
    """With ``local_params=True``: per-worker parameters saved by another number of workers.

    The same rule as :meth:`resize_state` for per-worker float state: each new
    worker's parameters are the overlap-weighted average of the old workers'
    (halving the workers averages pairs), so their mean over workers, the model
    a synchronisation would produce, is kept.
    """
    if not self.local_params:
      raise ValueError("data_parallel.resize_params: parameters are per worker only with "
                       "local_params=True; replicated parameters need no resizing.")
    target, _ = self.abstract_state(params)
    return self._placer.resized(saved_params, target, jax.tree.map(lambda _: True, target),
                                "resize_params")

  # -- placement -----------------------------------------------------------------

  def place_params(self, params):
    """Places ``params`` replicated over the data axes, keeping their other sharding.

    With ``local_params=True``: one copy per worker, stacked ``[num_workers, ...]``
    and sharded over the data axes, what :meth:`step` takes and returns.
    """
    placer = self._placer
    return placer.put(placer.stack_params(params), placer.param_specs(self.layout(params)))

  def place_model_state(self, model_state):
    """Places model state (batch statistics, RNG state) replicated over the data axes."""
    return self._placer.put_model_state(model_state)

  def place_batch(self, batch):
    """Shards every batch leaf on its leading axis over the data axes.

    The leaves must share their leading size (rows), at least one and
    divisible by the number of workers (:meth:`_check_batch`).
    """
    self._check_batch(batch)
    return self._placer.put_batch(batch)

  def _check_batch(self, batch, fn: str = "data_parallel", workers: int | None = None,
                   where: str | None = None) -> None:
    """:func:`._placement.check_batch` (default: over the step's workers on its data axes)."""
    if workers is None:
      workers, where = self.num_workers, f"on axis {self.axis_name!r}"
    check_batch(batch, fn, workers, where)

  def local_batch(self, batch):
    """The global batch from this process's rows of it (multi-process runs).

    Each process passes only its own rows, ``[local_rows, ...]`` per leaf, and
    the result is one global array per leaf, sharded over the data axes, that
    :meth:`step` takes as it is (``jax.make_array_from_process_local_data``;
    process ``p``'s rows land on the workers it hosts, in process order). In
    one process it is :meth:`place_batch`. Every process must call it, with
    the same leaf shapes.
    """
    data = P(lay.data_spec(self.axes))
    self._check_batch(batch, "data_parallel.local_batch",
                      local_workers(self.mesh, self.num_workers), "this process hosts")

    def make(path, x):
      x = np.asarray(x)
      sharding = NamedSharding(self.mesh, lay.full_spec(data, x.ndim))
      return jax.make_array_from_process_local_data(sharding, x)

    return jax.tree_util.tree_map_with_path(make, batch)

  # -- init ----------------------------------------------------------------------

  @functools.cached_property
  def init(self) -> Callable[[Any], Any]:
    """``init(params)``: the optimizer state, per-worker leaves stacked ``[num_workers, ...]``,
    the rest replicated.

    ``tx.init`` runs inside the step's ``shard_map``, so a transform can size
    per-worker chunks by the number of workers. Pure, and jitted on a mesh whose
    axes are all explicit (``jax.make_mesh``'s default): ``jax.eval_shape(dp.init,
    params)`` then gives the state's shapes, dtypes and shardings on the mesh's
    devices (:meth:`state_shardings`), the restore target orbax takes::

        target = jax.eval_shape(dp.init, params)
        opt_state = orbax.checkpoint.StandardCheckpointer().restore(path, target)

    On a mesh with other axis types it runs eagerly, checking how the parameters
    were placed, and :meth:`abstract_state` gives the target.
    """
    if not explicit(self.mesh):   # eager: the placement checks read the arrays' shardings
      return self._init
    return placed_on_trace(self._init, self.state_shardings)

  def _init(self, params) -> Any:
    """:attr:`init`'s work: the parameters placed, ``tx.init`` in the step body, the state
    placed by the layout."""
    layout, placer = self.layout(params), self._placer
    params = placer.put(params, layout.param_specs)
    state = self._body(layout).init(params)
    return placer.put(state, layout.state_specs)

  # -- the step ------------------------------------------------------------------

  def step_fn(self, params, opt_state, batch, model_state=None, key=None, **extra_args):
    """The pure, un-jitted training step (what :meth:`step` jits with donation).

    Jit it with your own options, or call it inside your own jitted function.

    Args:
      params: parameters, replicated over the data axes (and sharded over other
        axes as you placed them).
      opt_state: the state from :meth:`init` or a previous step.
      batch: a pytree whose leaves share a leading batch axis, divisible by
        the number of workers; each worker gets its contiguous slice.
      model_state: with ``has_state=True``, the model's mutable state (e.g.
        batch statistics), replicated over the data axes.
      key: an optional PRNG key for this step; ``loss_fn`` receives
        ``key=fold_in(key, worker_index)``. Fold the step number in yourself.
      **extra_args: extra keyword arguments for ``tx.update`` (optax's
        extra-args protocol), the same on every worker: arrays or pytrees of
        arrays, replicated. A ``tx`` that reads ``value`` (e.g.
        ``optax.contrib.reduce_on_plateau``) receives the workers' mean loss
        unless ``value`` is given here (say, a validation loss); the mean
        costs one scalar all-reduce per step, spent only when ``tx`` reads it.

    Returns:
      ``(params, opt_state, metrics)``, or ``(params, opt_state, model_state,
      metrics)`` with ``has_state=True``. ``metrics`` is each worker's loss,
      shape ``[num_workers]``, or ``(losses, aux)`` with ``has_aux=True``,
      where every aux leaf gains a leading ``[num_workers]`` axis. No
      collective is spent on metrics.
    """
    self._check_model_state(model_state)
    placer = self._placer
    layout = placer.checked_layout(params, opt_state)
    param_specs = placer.param_specs(layout)
    params = placer.put(params, param_specs)
    opt_state = placer.put(opt_state, layout.state_specs)
    batch = self.place_batch(batch)
    ms_specs = None
    if self.has_state:
      ms_specs = placer.specs_of(model_state, "model state leaf")
      model_state = placer.put(model_state, ms_specs)
    if key is not None:
      key = jax.device_put(key, NamedSharding(self.mesh, P()))
    extra_args = placer.put_replicated(extra_args)
    new_params, new_state, metrics, new_ms = self._body(layout).step(
        params, opt_state, batch, model_state, key, extra_args)
    new_params = placer.put(new_params, param_specs)
    new_state = placer.put(new_state, layout.state_specs)
    if self.has_state:
      return new_params, new_state, placer.put(new_ms, ms_specs), metrics
    return new_params, new_state, metrics

  def _body(self, layout: Layout) -> StepBody:
    """The step body for ``layout``'s parameters (a :class:`~._steps.StepBody` with ``init``
    and ``step``). A new parameter layout is a new class, picked here."""
    if layout.shard_local:
      return ShardLocalStep(self, layout)
    if WholeLeafStep.applies(self, layout):
      return WholeLeafStep(self, layout)
    return ReplicatedStep(self, layout)

  @functools.cached_property
  def _jitted_step(self):
    names = ("params", "opt_state", "model_state") if self.donate else ()
    return jax.jit(self.step_fn, donate_argnames=names)

  def step(self, params, opt_state, batch, model_state=None, key=None, **extra_args):
    """One jitted training step: :meth:`step_fn` with params, state and model state donated.

    Callable inside your own ``jax.jit``, ``lax.scan`` and ``fori_loop`` (there
    donation is up to the outer jit). With ``donate=True`` (the default) the
    arrays passed as ``params``, ``opt_state`` and ``model_state`` are consumed:
    use the returned ones. ``extra_args`` reach ``tx.update`` (see :meth:`step_fn`).
    """
    *args, extra_args = self._placer.placed(params, opt_state, batch, model_state, key,
                                            extra_args)
    return self._jitted_step(*args, **extra_args)

  def lower(self, params, opt_state, batch, model_state=None, key=None, **extra_args):
    """``jax.jit(...).lower`` of the step, for HLO audits (see :mod:`commopt.wire`)."""
    *args, extra_args = self._placer.placed(params, opt_state, batch, model_state, key,
                                            extra_args)
    return self._jitted_step.lower(*args, **extra_args)


def data_parallel(loss_fn: Callable, tx: optax.GradientTransformation,
                  mesh: jax.sharding.Mesh, axis_name: str | tuple[str, ...] = "data", *,
                  has_aux: bool = False, has_state: bool = False,
                  model_state_sync: str = "mean", skip_nonfinite: bool | str = True,
                  donate: bool = True, local_params: bool = False,
                  shard_local: bool | str = "auto") -> DataParallel:
  """A data-parallel training step over ``mesh``'s ``axis_name``.

  Parameters are replicated over the data axes (a sharding over the mesh's other
  axes is kept) and the batch is split on its leading axis. Each worker
  differentiates ``loss_fn`` on its shard with its gradients kept local
  (:func:`~commopt.parallel.local_value_and_grad`), and ``tx``, which must reduce
  over ``axis_name`` (e.g. :func:`~commopt.compressed_mean`), does the only
  communication. Per-worker optimizer state is stacked on a leading axis sharded
  over ``axis_name`` (:meth:`DataParallel.state_specs`). By default a step with a
  non-finite gradient on any worker is skipped on every worker together.

  See the guide's "Data parallel training" and "Sharded models" pages.

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss`` on one worker's shard; ``-> (loss,
      aux)`` with ``has_aux``; with ``has_state``, ``loss_fn(params, model_state,
      batch) -> (loss, new_model_state)`` (or ``(loss, (new_model_state, aux))``).
      Given a step ``key``, it also receives ``key=`` (this worker's key).
    tx: an optax transformation that reduces over ``axis_name``.
    mesh: a ``jax.sharding.Mesh`` with the axes named by ``axis_name``.
    axis_name: the data axis, or a tuple of axes that together hold the workers,
      e.g. ``("node", "local")`` with ``strategy="hierarchical"``.
    has_aux: ``loss_fn`` returns ``(loss, aux)``; aux comes back per worker.
    has_state: ``loss_fn`` takes and returns model state (e.g. batch statistics).
    model_state_sync: ``"mean"`` (default: floating-point model state that differs
      between workers is averaged, one dense all-reduce) or ``"none"`` (refused).
    skip_nonfinite: ``True`` (default: skip a step with a non-finite gradient or
      reduced update, every state kept), ``False``, or ``"zero"`` (cheaper: the
      optimizer takes a zero gradient).
    donate: donate params, optimizer state and model state to the jitted step.
    local_params: keep one copy of the parameters per worker, stacked over the
      data axes, for :func:`~commopt.local_sgd`, :func:`~commopt.diloco`, ...;
      :meth:`~DataParallel.place_params` stacks them for the first step.
    shard_local: on a mesh with model axes, where ``tx`` runs: ``"auto"``
      (default) on each device's shards, or on whole leaves with a warning where
      ``tx`` needs them; ``True``: shards or a ValueError; ``False``: whole leaves.

  Returns:
    A :class:`DataParallel`: ``init(params) -> opt_state``,
    ``step(params, opt_state, batch) -> (params, opt_state, losses)``, the
    pure ``step_fn`` and the state's ``state_specs(params)``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, commopt
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> tx = optax.chain(commopt.compressed_mean(commopt.scaled_sign(), axis_name="data"),
    ...                  optax.sgd(0.1))
    >>> loss = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
    >>> dp = commopt.data_parallel(loss, tx, mesh)
    >>> params = {"w": jnp.zeros((4, 1))}
    >>> state = dp.init(params)
    >>> batch = {"x": jnp.ones((8, 4)), "y": jnp.ones((8, 1))}
    >>> params, state, losses = dp.step(params, state, batch)
    >>> losses.shape, int(state.total_notfinite)
    ((1,), 0)
  """
  return DataParallel(loss_fn, tx, mesh, axis_name, has_aux=has_aux, has_state=has_state,
                      model_state_sync=model_state_sync, skip_nonfinite=skip_nonfinite,
                      donate=donate, local_params=local_params, shard_local=shard_local)
