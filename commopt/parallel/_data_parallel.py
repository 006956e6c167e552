"""data_parallel: a pure shard_map training step whose only reduction is the optimizer's."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from commopt._src import base, compat
from commopt.comm import _collectives as coll
from commopt.parallel import _layout as lay
from commopt.parallel._layout import keystr, local_value_and_grad

MODEL_STATE_SYNC = ("mean", "none")


class Layout(NamedTuple):
  """Where the step's values live, for one parameter layout (see :meth:`DataParallel.layout`).

  Attributes:
    param_specs: a pytree like the parameters of their ``PartitionSpec``\\ s
      (over the mesh's non-data axes; replicated over the data axes).
    state_specs: a pytree like the optimizer state of ``PartitionSpec``\\ s:
      per-worker leaves lead with the data axes, e.g. ``P('data', None, 'model')``.
    per_worker: a pytree like the optimizer state of bools.
    state_treedef: the optimizer state's tree structure.
    reads_value: whether the optimizer's update reads the ``value`` extra
      argument (optax's extra-args protocol, e.g.
      ``optax.contrib.reduce_on_plateau``): only then does the step average
      the loss over the workers to hand it over.
  """
  param_specs: Any
  state_specs: Any
  per_worker: Any
  state_treedef: Any
  reads_value: bool = False


def _manual_specs(layout: Layout, axes) -> Any:
  """The state specs a ``shard_map`` manual over the data axes alone sees: those axes only."""
  return jax.tree.map(lambda s: P(lay.data_spec(axes)) if lay.is_stacked(s, axes) else P(),
                      layout.state_specs, is_leaf=lay.is_spec)


@dataclasses.dataclass(frozen=True, eq=False)
class DataParallel:
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
  """
  loss_fn: Callable
  tx: optax.GradientTransformation
  mesh: jax.sharding.Mesh
  axis_name: str | tuple[str, ...] = "data"
  has_aux: bool = False
  has_state: bool = False
  model_state_sync: str = "mean"
  skip_nonfinite: bool = True
  donate: bool = True
  local_params: bool = False

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
    axes = lay.axes_tuple(self.axis_name)
    missing = [a for a in axes if a not in self.mesh.axis_names]
    if not axes or missing or len(set(axes)) != len(axes):
      raise ValueError(
          f"{fn}: `axis_name` {self.axis_name!r} must name distinct axes of the mesh, "
          f"whose axes are {tuple(self.mesh.axis_names)}"
          + (f"; {missing} {'is' if len(missing) == 1 else 'are'} not among them." if missing
             else "."))
    base.check_choice("model_state_sync", self.model_state_sync, MODEL_STATE_SYNC, fn)
    for name in ("has_aux", "has_state", "skip_nonfinite", "donate", "local_params"):
      object.__setattr__(self, name, base.check_bool(name, getattr(self, name), fn=fn))
    object.__setattr__(self, "_layouts", {})
    self._check_tx_axes()

  def _axis_error(self, e: Exception) -> Exception:
    return base.AxisNameError(
        f"data_parallel: `tx` reduces over an axis the step does not map over. The step "
        f"maps over axis_name={self.axis_name!r} of a mesh with axes "
        f"{tuple(self.mesh.axis_names)}; give the transforms inside `tx` that axis_name. "
        f"({e})")

  def _check_tx_axes(self) -> None:
    """An :class:`~commopt.AxisNameError` now if ``tx`` reduces over an axis the step does
    not map over, found by tracing ``tx`` on one scalar parameter (nothing is computed).

    A ``tx`` that cannot run on that parameter (a ``multi_transform`` whose labels
    name the real parameters, ...) is checked when :meth:`layout` first traces it.
    """
    tx, axes = optax.with_extra_args_support(self.tx), self.axes

    def probe(p):
      g = jax.tree.map(lambda x: coll.vary(x, axes), p)
      tx.update(g, tx.init(p), p)
      return jnp.zeros(())

    fn = jax.shard_map(probe, mesh=self.mesh, in_specs=(P(),), out_specs=P(),
                       axis_names=set(axes))
    try:
      with coll.inputs_unchecked():
        jax.eval_shape(fn, {"probe": jax.ShapeDtypeStruct((), jnp.float32)})
    except base.AxisNameError as e:
      raise self._axis_error(e) from None
    except Exception:   # noqa: BLE001 - anything else is the layout's to report, with params
      pass

  # -- basic facts ---------------------------------------------------------------

  @property
  def axes(self) -> tuple[str, ...]:
    """The data axes as a tuple."""
    return lay.axes_tuple(self.axis_name)

  @property
  def num_workers(self) -> int:
    """The number of workers (the product of the data axes' sizes)."""
    return int(math.prod(self.mesh.shape[a] for a in self.axes))

  @functools.cached_property
  def optimizer(self) -> optax.GradientTransformation:
    """The transformation the step runs: ``tx``, wrapped in an agreed non-finite skip."""
    if not self.skip_nonfinite:
      return optax.with_extra_args_support(self.tx)
    from commopt.transforms._control import apply_if_finite
    return apply_if_finite(self.tx, self.axis_name)

  # -- layout --------------------------------------------------------------------

  def _spec_of(self, x, what: str, path) -> P:
    """The user's sharding of a parameter or model-state leaf over the non-data axes."""
    sharding = getattr(x, "sharding", None)
    if (isinstance(sharding, NamedSharding) and sharding.mesh is self.mesh
        and not compat.is_tracer(x)):
      # Placed on this mesh already (every step after the first): its spec is the layout.
      spec = lay.full_spec(sharding.spec, len(x.shape))
      if self._explicit or all(e is None for e in spec):
        lay.check_no_data_axes(what, path, spec, self.axes)
        return spec
    spec = lay.leaf_spec(x)
    if not compat.is_tracer(x) and isinstance(sharding, NamedSharding):
      placed = lay.full_spec(sharding.spec, len(jnp.shape(x)))
      if any(e is not None for e in placed) and placed != spec:
        if sharding.mesh.shape_tuple != self.mesh.shape_tuple:
          raise ValueError(
              f"data_parallel: {what} {keystr(path)} is sharded ({placed}) on a mesh of shape "
              f"{dict(sharding.mesh.shape)}, not on the step's mesh {dict(self.mesh.shape)}; "
              "place it on the mesh given to data_parallel.")
        if not self._explicit:
          raise ValueError(
              f"data_parallel: {what} {keystr(path)} is placed with {placed} on a mesh whose "
              f"axes are not all explicit ({dict(zip(self.mesh.axis_names, self.mesh.axis_types))}). "
              "The optimizer state can only follow a tensor-parallel layout whose sharding "
              "is part of the array type: build the mesh with jax.make_mesh(shape, names) "
              "(explicit axes by default) and place the parameters on it.")
        spec = placed
    lay.check_no_data_axes(what, path, spec, self.axes)
    return spec

  @functools.cached_property
  def _explicit(self) -> bool:
    return all(t == AxisType.Explicit for t in self.mesh.axis_types)

  def _specs_of(self, tree, what: str):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return jax.tree_util.tree_unflatten(treedef, [self._spec_of(x, what, p) for p, x in leaves])

  def layout(self, params) -> Layout:
    """The step's :class:`Layout` for ``params`` (arrays, tracers or ``ShapeDtypeStruct``\\ s).

    Which optimizer-state leaves are per-worker is found by tracing ``tx.init``
    and ``tx.update`` inside ``shard_map`` with local gradients, to a fixed
    point: a leaf is per-worker when its new value varies over the data axes.
    Nothing is computed; the result is cached per parameter shapes and specs.
    """
    param_specs = self._specs_of(params, "parameter")
    flat_specs = jax.tree.leaves(param_specs, is_leaf=lay.is_spec)
    key = (jax.tree.structure(params),
           tuple((tuple(jnp.shape(x)), str(getattr(x, "dtype", None) or jnp.result_type(x)), s)
                 for x, s in zip(jax.tree.leaves(params), flat_specs)))
    cached = self._layouts.get(key)
    if cached is not None:
      return cached
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x),
                                          sharding=NamedSharding(self.mesh, s)),
        params, param_specs)
    found = {}
    axes, opt = self.axes, self.optimizer

    def probe(p):
      p = self._whole(p)
      state = opt.init(p)
      leaves, treedef = jax.tree_util.tree_flatten(state)
      grads = jax.tree.map(lambda x: coll.vary(x, axes), p)
      if self.local_params:
        p = grads
      reads_value = _reads_value(opt, grads, state, p)
      extra = {} if reads_value is None else {"value": jnp.zeros((), jnp.float32)}
      mask = [False] * len(leaves)
      new = leaves
      for _ in range(len(leaves) + 1):
        s = jax.tree_util.tree_unflatten(
            treedef, [coll.vary(l, axes) if m else l for l, m in zip(leaves, mask)])
        new = jax.tree.leaves(jax.eval_shape(lambda g, s: opt.update(g, s, p, **extra)[1],
                                             grads, s))
        seen = [m or lay.per_worker(x, axes) for x, m in zip(new, mask)]
        if seen == mask:
          break
        mask = seen
      found.update(treedef=treedef, mask=mask, shapes=[jnp.shape(x) for x in leaves],
                   reads_value=bool(reads_value))
      return jnp.zeros(())

    fn = jax.shard_map(probe, mesh=self.mesh, in_specs=(P(),), out_specs=P(),
                       axis_names=set(axes))
    try:
      with coll.inputs_unchecked():
        jax.eval_shape(fn, abstract)
    except base.AxisNameError as e:
      raise self._axis_error(e) from None
    except (TypeError, ValueError) as e:
      if isinstance(e, TypeError) and "required keyword-only argument" in str(e):
        raise TypeError(
            f"data_parallel: `tx.update` needs an extra argument the step cannot supply when "
            f"it traces `tx` to find the state's layout (init): {e}. The step passes `value` "
            "(the workers' mean loss) itself; give any other extra argument a default, and "
            "pass its value to dp.step(..., name=value).") from e
      if "cond branches must have equal output types" in str(e):
        raise ValueError(
            "data_parallel: `tx` runs a lax.cond whose branches return per-worker state in "
            "one branch and replicated state in the other, which shard_map rejects (as "
            "optax.MultiSteps and optax.apply_if_finite do). Use commopt.transforms."
            "multi_steps / commopt.transforms.apply_if_finite (data_parallel already skips "
            "non-finite steps by agreement, skip_nonfinite=True).") from e
      raise
    by_shape = lay.specs_by_shape(params, param_specs)
    state_specs = [lay.stacked_spec(by_shape.get(tuple(shape), P(*[None] * len(shape))), axes)
                   if m else by_shape.get(tuple(shape), P(*[None] * len(shape)))
                   for shape, m in zip(found["shapes"], found["mask"])]
    result = Layout(
        param_specs=param_specs,
        state_specs=jax.tree_util.tree_unflatten(found["treedef"], state_specs),
        per_worker=jax.tree_util.tree_unflatten(found["treedef"], found["mask"]),
        state_treedef=found["treedef"],
        reads_value=found["reads_value"])
    self._layouts[key] = result
    return result

  def state_specs(self, params) -> Any:
    """The optimizer state's ``PartitionSpec``\\ s, a pytree like the state."""
    return self.layout(params).state_specs

  def state_shardings(self, params) -> Any:
    """The optimizer state's ``NamedSharding``\\ s on the mesh (for orbax restores)."""
    return lay.to_shardings(self.mesh, self.state_specs(params))

  def abstract_state(self, params) -> tuple[Any, Any]:
    """``(params, opt_state)`` as ``jax.ShapeDtypeStruct``\\ s placed on the mesh: a restore target.

    Shapes and dtypes come from ``jax.eval_shape(self.init, params)`` (nothing
    is computed), shardings from the step's layout, so orbax restores a saved
    ``{"params": ..., "opt_state": ...}`` straight onto the devices the step
    uses, per-worker residuals on their workers::

        target = dict(zip(("params", "opt_state"), dp.abstract_state(params)))
        restored = orbax.checkpoint.StandardCheckpointer().restore(path, target)
    """
    layout = self.layout(params)
    place = lambda a, sharding: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
    state = jax.tree.map(place, jax.eval_shape(self.init, params),
                         lay.to_shardings(self.mesh, layout.state_specs))
    params = jax.tree.map(place, jax.eval_shape(self._stack_params, params),
                          lay.to_shardings(self.mesh, self._param_specs(layout)))
    return params, state

  def per_worker(self, params) -> Any:
    """A pytree like the optimizer state: True where a leaf is per-worker (stacked)."""
    return self.layout(params).per_worker

  def resize_state(self, saved_state, params) -> Any:
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

    Returns:
      The state with this run's shapes, placed on the mesh like :meth:`init`'s.
    """
    _, target = self.abstract_state(params)
    return self._resized(saved_state, target, self.per_worker(params), "resize_state")

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
    return self._resized(saved_params, target, jax.tree.map(lambda _: True, target), "resize_params")

  def _resized(self, saved, target, per_worker, name: str):
    from jax.experimental import multihost_utils

    from commopt.parallel import _resize

    def host(x):
      if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = multihost_utils.process_allgather(x, tiled=True)
      if jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
        x = jax.random.key_data(x)
      return np.asarray(x)

    saved = {_resize.path_key(p): host(x) for p, x in jax.tree_util.tree_flatten_with_path(saved)[0]}
    leaves = _resize.resize(saved, target, per_worker,
                            data_sizes=tuple(self.mesh.shape[a] for a in self.axes),
                            fn=f"data_parallel.{name}")
    flat, treedef = jax.tree_util.tree_flatten(target)
    placed = [jax.make_array_from_callback(t.shape, t.sharding, lambda idx, v=v: v[idx])
              for t, v in zip(flat, leaves)]
    return jax.tree_util.tree_unflatten(treedef, placed)

  # -- placement -----------------------------------------------------------------

  def _put(self, tree, specs):
    """``tree`` placed by ``specs``; arrays already placed so pass through untouched."""
    def put(x, spec):
      target = NamedSharding(self.mesh, spec)
      if isinstance(x, jax.Array) and not compat.is_tracer(x):
        if x.sharding == target:
          return x
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
          # device_put refuses typed keys on a mesh that spans processes: place
          # their data (a trailing key axis, replicated) and wrap it again.
          data = put(jax.random.key_data(x), P(*lay.full_spec(spec, x.ndim), None))
          return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        # A copy, never an alias: the step donates what it is given, and the
        # caller's own arrays (e.g. one device's parameters) must survive that.
        # (device_put(..., may_alias=False) still aliases onto a mesh in JAX 0.10.)
        if x.is_fully_addressable:
          x = jnp.copy(x)
      return jax.device_put(x, target)

    return lay.map_specs(put, tree, specs)

  def place_params(self, params):
    """Places ``params`` replicated over the data axes, keeping their other sharding.

    With ``local_params=True``: one copy per worker, stacked ``[num_workers, ...]``
    and sharded over the data axes, what :meth:`step` takes and returns.
    """
    layout = self.layout(params)
    return self._put(self._stack_params(params), self._param_specs(layout))

  def _stack_params(self, params):
    if not self.local_params:
      return params
    n = self.num_workers
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + tuple(jnp.shape(x))), params)

  def _param_specs(self, layout: Layout):
    """How the step's parameters are placed: the layout's, stacked with ``local_params``."""
    if not self.local_params:
      return layout.param_specs
    return jax.tree.map(lambda s: lay.stacked_spec(s, self.axes), layout.param_specs,
                        is_leaf=lay.is_spec)

  def _unstacked(self, params):
    """With ``local_params``: per-worker parameters checked and seen as one worker's shapes."""
    if not self.local_params:
      return params
    n = self.num_workers
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
      if not jnp.shape(x) or jnp.shape(x)[0] != n:
        raise ValueError(
            f"data_parallel: with local_params=True the parameters are per worker, stacked "
            f"[{n}, ...]; parameter {keystr(path)} has shape {tuple(jnp.shape(x))}. Pass "
            "dp.place_params(params) to the first step.")
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(jnp.shape(x))[1:], x.dtype), params)

  def place_model_state(self, model_state):
    """Places model state (batch statistics, RNG state) replicated over the data axes."""
    return self._put(model_state, self._specs_of(model_state, "model state leaf"))

  def place_batch(self, batch):
    """Shards every batch leaf on its leading axis over the data axes.

    The leaves must share their leading size (rows), at least one and
    divisible by the number of workers (:meth:`_check_batch`).
    """
    self._check_batch(batch)
    return self._put_batch(batch)

  def _put_batch(self, batch):
    data = P(lay.data_spec(self.axes))
    return self._put(batch, jax.tree.map(lambda x: lay.full_spec(data, jnp.ndim(x)), batch))

  def _check_batch(self, batch, fn: str = "data_parallel", workers: int | None = None,
                   where: str | None = None) -> None:
    """A ValueError naming the leaves and their shapes unless every batch leaf has a
    leading axis, all of the same non-zero size, divisible by ``workers``.

    Each worker takes the same contiguous rows of every leaf, so leaves of
    different lengths would pair row ``i`` of one with another row of the
    next; a batch of no rows has no loss (a mean over nothing is NaN). Python
    on static shapes: inside the step it runs when the step is traced (once
    per batch shape, under the user's ``jit`` or ``scan`` too), not per call.

    Args:
      batch: a pytree of arrays (or tracers, or ``ShapeDtypeStruct``\\ s).
      fn: the caller, for messages.
      workers: what the rows must divide into (default: the step's workers).
      where: those workers, for messages (default: the data axis).
    """
    if workers is None:
      workers, where = self.num_workers, f"on axis {self.axis_name!r}"
    shapes = [(keystr(path), tuple(jnp.shape(x)))
              for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]]
    listed = ", ".join(f"{k}: {s}" for k, s in shapes)
    for k, s in shapes:
      if not s:
        raise ValueError(
            f"{fn}: batch leaf {k} has shape (), with no leading axis to split over the "
            f"{workers} workers {where}; give every batch leaf a leading (batch) axis "
            f"(batch: {listed}).")
    if len({s[0] for _, s in shapes}) > 1:
      raise ValueError(
          f"{fn}: batch leaves must share their leading size, so that each worker gets the "
          f"same rows of every leaf; got {listed}. Give every leaf the same number of rows.")
    if shapes and shapes[0][1][0] == 0:
      raise ValueError(
          f"{fn}: the batch is empty, with 0 rows ({listed}): a step on no data has no loss "
          f"(a mean over nothing is NaN). Skip the step, or give a multiple of the "
          f"{workers} workers' rows.")
    if shapes and shapes[0][1][0] % workers:
      k, s = shapes[0]
      raise ValueError(
          f"{fn}: batch leaf {k} has shape {s}; its leading axis must be divisible by the "
          f"{workers} workers {where}.")

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
    local_workers = max(1, len(self.mesh.local_devices) * self.num_workers // self.mesh.size)
    self._check_batch(batch, "data_parallel.local_batch", local_workers, "this process hosts")

    def make(path, x):
      x = np.asarray(x)
      sharding = NamedSharding(self.mesh, lay.full_spec(data, x.ndim))
      return jax.make_array_from_process_local_data(sharding, x)

    return jax.tree_util.tree_map_with_path(make, batch)

  # -- init ----------------------------------------------------------------------

  def init(self, params) -> Any:
    """The optimizer state: per-worker leaves stacked ``[num_workers, ...]``, the rest replicated.

    ``tx.init`` runs inside the step's ``shard_map``, so a transform can size
    per-worker chunks by the number of workers. Pure: ``jax.eval_shape(dp.init,
    params)`` gives the state's shapes and dtypes, and its shardings on the
    mesh's *abstract* mesh (JAX gives device shardings only for a jitted
    function with ``out_shardings``), which orbax cannot restore onto: for a
    restore target use :meth:`abstract_state`.
    """
    layout = self.layout(params)
    params = self._put(params, layout.param_specs)
    axes, opt = self.axes, self.optimizer
    if not self._tensor_parallel(layout):
      def body(p):
        return lay.stack_workers(opt.init(p), layout.state_specs, axes)

      state = jax.shard_map(body, mesh=self.mesh, in_specs=(P(),),
                            out_specs=_manual_specs(layout, axes), axis_names=set(axes))(params)
      return self._put(state, layout.state_specs)

    # Tensor parallel: manual over every axis, whole leaves gathered over the
    # non-data axes, each rank keeping its slice of the state.
    state_specs = lay.unstacked_specs(layout.state_specs, axes)

    def body_tp(p):
      state = lay.slice_tree(opt.init(lay.gather_tree(p, layout.param_specs)), state_specs)
      return lay.stack_workers(state, layout.state_specs, axes)

    state = jax.shard_map(body_tp, mesh=self.mesh, in_specs=(layout.param_specs,),
                          out_specs=layout.state_specs)(params)
    return self._put(state, layout.state_specs)

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
    if self.has_state and model_state is None:
      raise ValueError("data_parallel: has_state=True needs `model_state` in every step.")
    if not self.has_state and model_state is not None:
      raise ValueError(
          "data_parallel: `model_state` was given but has_state=False; pass has_state=True "
          "and a loss_fn(params, model_state, batch) -> (loss, new_model_state).")
    layout = self._checked_layout(params, opt_state)
    params = self._put(params, self._param_specs(layout))
    opt_state = self._put(opt_state, layout.state_specs)
    batch = self.place_batch(batch)
    ms_specs = None
    if self.has_state:
      ms_specs = self._specs_of(model_state, "model state leaf")
      model_state = self._put(model_state, ms_specs)
    if key is not None:
      key = jax.device_put(key, NamedSharding(self.mesh, P()))
    extra_args = self._put(extra_args, jax.tree.map(lambda _: P(), extra_args))
    if self._tensor_parallel(layout):
      if self.local_params:
        raise ValueError("data_parallel: local_params=True keeps whole parameters per worker; "
                         "it does not combine with parameters sharded over other mesh axes.")
      new_params, new_state, metrics, new_ms = self._tensor_parallel_step(
          layout, params, opt_state, batch, model_state, key, extra_args)
    else:
      new_params, new_state, metrics, new_ms = self._data_parallel_step(
          layout, params, opt_state, batch, model_state, key, extra_args)
    new_params = self._put(new_params, self._param_specs(layout))
    new_state = self._put(new_state, layout.state_specs)
    if self.has_state:
      return new_params, new_state, self._put(new_ms, ms_specs), metrics
    return new_params, new_state, metrics

  def _loss(self, *args, **kwargs):
    """``loss_fn``, with its output checked against ``has_aux`` / ``has_state``."""
    out = self.loss_fn(*args, **kwargs)
    pair = isinstance(out, (tuple, list)) and len(out) == 2
    if (self.has_aux or self.has_state) and not pair:
      flags = " and ".join(f for f in ("has_aux=True", "has_state=True") if getattr(self, f[:-5]))
      want = ("(loss, (new_model_state, aux))" if self.has_aux and self.has_state
              else "(loss, new_model_state)" if self.has_state else "(loss, aux)")
      raise ValueError(f"data_parallel: with {flags}, `loss_fn` must return {want}; it "
                       f"returned {type(out).__name__}.")
    if self.has_state and self.has_aux and not (isinstance(out[1], (tuple, list))
                                                and len(out[1]) == 2):
      raise ValueError("data_parallel: with has_aux=True and has_state=True, `loss_fn` must "
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

  def _poison_if_nonfinite(self, grads, new_model_state):
    """A worker whose new model state is not finite sends NaN gradients, so the agreed
    skip (``skip_nonfinite``) also covers state that the gradients do not reach."""
    if not (self.skip_nonfinite and self.has_state):
      return grads
    from commopt.transforms._control import all_finite
    # Floating-point leaves only: model state may hold PRNG keys, which have no isfinite.
    floats = [x for x in jax.tree.leaves(new_model_state) if jnp.issubdtype(x.dtype, jnp.inexact)]
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

  def _check_replicated(self, tree, what="the update of parameter"):
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      if lay.per_worker(leaf, self.axes):
        raise ValueError(
            f"data_parallel: {what} {keystr(path)} differs between "
            f"workers on axis {self.axis_name!r}, so the replicas would drift apart. "
            "`tx` must reduce over that axis after anything per-worker, e.g. "
            f"optax.chain(commopt.compressed_mean(c, {self.axis_name!r}), optax.sgd(lr)); "
            "transforms that keep parameters per worker between synchronisations "
            "(commopt.local_sgd, commopt.diloco) need data_parallel(..., local_params=True).")

  def _data_parallel_step(self, layout, params, opt_state, batch, model_state, key, extra_args):
    """One ``shard_map`` over the data axes: local gradients, then the optimizer."""
    axes, opt = self.axes, self.optimizer
    manual = _manual_specs(layout, axes)
    grad_fn = local_value_and_grad(self._loss, axes, has_aux=self.has_aux or self.has_state)

    def body(params, state, batch, model_state, key, extra_args):
      if self.local_params:
        params = jax.tree.map(lambda x: x[0], params)
      state = lay.unstack_workers(state, layout.state_specs, axes)
      kwargs = {} if key is None else {"key": jax.random.fold_in(key, coll.axis_index(axes))}
      args = (model_state, batch) if self.has_state else (batch,)
      value, grads = grad_fn(params, *args, **kwargs)
      loss, aux, new_ms = self._split_out(value)
      grads = self._poison_if_nonfinite(grads, new_ms)
      if layout.reads_value and "value" not in extra_args:
        extra_args = dict(extra_args, value=coll.pmean(loss, axes))
      updates, new_state = opt.update(grads, state, params, **extra_args)
      new_params = optax.apply_updates(params, updates)
      if self.local_params:
        new_params = jax.tree.map(lambda x: x[None], new_params)
      else:
        self._check_replicated(new_params)
      if self.has_state:
        new_ms = self._keep_on_skip(self._sync_model_state(new_ms), model_state, new_state)
      metrics = loss[None] if not self.has_aux else (
          loss[None], jax.tree.map(lambda x: jnp.asarray(x)[None], aux))
      return (new_params, lay.stack_workers(new_state, layout.state_specs, axes), metrics,
              new_ms)

    data = P(lay.data_spec(axes))
    pspec = data if self.local_params else P()
    fn = jax.shard_map(
        body, mesh=self.mesh,
        in_specs=(pspec, manual, data, P(), P(), P()),
        out_specs=(pspec, manual, data, P()),
        axis_names=set(axes))
    return fn(params, opt_state, batch, model_state, key, extra_args)

  def _tensor_parallel_step(self, layout, params, opt_state, batch, model_state, key,
                            extra_args):
    """Tensor parallel plus data parallel, with no dense value crossing the data axis.

    The gradients come from ``jax.vmap`` over the workers (``spmd_axis_name``
    shards the worker axis over the data axis, and the model's own sharding
    over the other axes is left to the compiler), so each worker's gradient
    stays on its data rank. The optimizer then runs in a ``shard_map`` manual
    over every mesh axis: each leaf is all-gathered over the non-data axes its
    spec names, the optimizer (and its compressed exchange over the data axis)
    runs on whole leaves, and each rank keeps its slice. (A ``shard_map``
    manual over the data axes alone would gather its model-sharded inputs at
    its boundary, over all devices.)
    """
    axes, n = self.axes, self.num_workers
    if len(axes) != 1:
      raise ValueError(
          f"data_parallel: on a mesh with other axes ({self._other_axes}) the data axis must "
          f"be one mesh axis; got axis_name={self.axis_name!r}.")
    if self.has_state and self.model_state_sync != "mean":
      raise ValueError(
          "data_parallel: with tensor-parallel parameters, model state is averaged across "
          f"workers (model_state_sync='mean'); got {self.model_state_sync!r}.")
    (axis,) = axes

    def split_workers(x):
      shape = (n, x.shape[0] // n) + tuple(x.shape[1:])
      return jax.lax.reshape(x, shape, out_sharding=NamedSharding(
          self.mesh, P(axis, *[None] * (len(shape) - 1))))

    local_batch = jax.tree.map(split_workers, batch)
    keys = None
    if key is not None:
      keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(n))
      keys = jax.device_put(keys, NamedSharding(self.mesh, P(axis)))
    grad_fn = jax.value_and_grad(self._loss, has_aux=self.has_aux or self.has_state)

    def worker(b, k):
      args = (model_state, b) if self.has_state else (b,)
      return grad_fn(params, *args, **({} if k is None else {"key": k}))

    # The mesh as the abstract context, so a model's own sharding annotations
    # (PartitionSpecs) resolve; it is not a device context (none is entered).
    with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
      value, grads = jax.vmap(worker, in_axes=(0, None if keys is None else 0),
                              axis_name=axis, spmd_axis_name=axis)(local_batch, keys)
    loss, aux, new_ms = self._split_out(value)
    grads = jax.vmap(self._poison_if_nonfinite, spmd_axis_name=axis)(grads, new_ms)

    opt = self.optimizer
    state_specs = lay.unstacked_specs(layout.state_specs, axes)
    if layout.reads_value and "value" not in extra_args:
      extra_args = dict(extra_args, value=jnp.mean(loss))

    def update(g, st, p, extra):
      g = jax.tree.map(lambda x: x[0], g)
      st = lay.unstack_workers(st, layout.state_specs, axes)
      u, new = opt.update(lay.gather_tree(g, layout.param_specs), lay.gather_tree(st, state_specs),
                          lay.gather_tree(p, layout.param_specs), **extra)
      self._check_replicated(u)
      new = lay.stack_workers(lay.slice_tree(new, state_specs), layout.state_specs, axes)
      return lay.slice_tree(u, layout.param_specs), new

    grad_specs = jax.tree.map(lambda s: lay.stacked_spec(s, axes), layout.param_specs,
                              is_leaf=lay.is_spec)
    updates, new_state = jax.shard_map(
        update, mesh=self.mesh,
        in_specs=(grad_specs, layout.state_specs, layout.param_specs, P()),
        out_specs=(layout.param_specs, layout.state_specs))(grads, opt_state, params, extra_args)
    new_params = optax.apply_updates(params, updates)
    metrics = loss if not self.has_aux else (loss, aux)
    if self.has_state:
      # Floating-point state is averaged over the workers; the rest (counters)
      # advances the same way on every worker.
      replicated = lambda x: jax.device_put(x, NamedSharding(self.mesh, P()))
      new_ms = jax.tree.map(
          lambda x: jnp.mean(x.astype(jnp.float32), 0).astype(x.dtype)
          if jnp.issubdtype(x.dtype, jnp.inexact) else replicated(x)[0], new_ms)
      new_ms = self._keep_on_skip(new_ms, model_state, new_state)
    return new_params, new_state, metrics, new_ms

  def _tensor_parallel(self, layout: Layout) -> bool:
    """Whether some parameter is sharded over a mesh axis other than the data axes."""
    specs = jax.tree.leaves(layout.param_specs, is_leaf=lay.is_spec)
    return bool(self._other_axes) and any(e is not None for s in specs for e in s)

  @property
  def _other_axes(self) -> tuple[str, ...]:
    return tuple(a for a in self.mesh.axis_names if a not in self.axes and self.mesh.shape[a] > 1)

  def _whole(self, tree):
    """Inside the step: ``tree`` replicated over the non-data axes (the optimizer sees whole leaves)."""
    if not self._other_axes:
      return tree
    return jax.tree.map(lambda x: jax.sharding.reshard(x, P(*[None] * jnp.ndim(x))), tree)

  def _checked_layout(self, params, opt_state) -> Layout:
    layout = self.layout(self._unstacked(params))
    treedef = jax.tree.structure(opt_state)
    if treedef != layout.state_treedef:
      raise ValueError(
          "data_parallel: `opt_state` does not have the structure that `init` returns "
          f"({layout.state_treedef}); got {treedef}.")
    leaves = jax.tree_util.tree_flatten_with_path(opt_state)[0]
    for (path, x), stacked in zip(leaves, jax.tree.leaves(layout.per_worker)):
      if stacked and (not jnp.shape(x) or jnp.shape(x)[0] != self.num_workers):
        raise ValueError(
            f"data_parallel: optimizer-state leaf {keystr(path)} is per-worker and must lead "
            f"with the {self.num_workers} workers of axis {self.axis_name!r}, but has shape "
            f"{tuple(jnp.shape(x))}: a state made for another number of workers cannot be "
            "used as it is (its error residuals would be dropped or duplicated).")
    return layout

  def _sync_model_state(self, new):
    """Averages model state that differs between workers (``model_state_sync='mean'``)."""
    axes = self.axes
    leaves, treedef = jax.tree_util.tree_flatten_with_path(new)
    out = []
    for path, x in leaves:
      if not lay.per_worker(x, axes):
        out.append(x)
        continue
      if self.model_state_sync == "none" or not jnp.issubdtype(x.dtype, jnp.inexact):
        raise ValueError(
            f"data_parallel: model state leaf {keystr(path)} ({x.dtype}) differs between "
            f"workers after the loss, and model_state_sync={self.model_state_sync!r} "
            + ("keeps model state replicated without communicating; use "
               "model_state_sync='mean' to average it." if self.model_state_sync == "none"
               else "can only average floating-point state."))
      out.append((coll.psum(x.astype(jnp.float32), axes) / self.num_workers).astype(x.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)

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
    *args, extra_args = self._placed(params, opt_state, batch, model_state, key, extra_args)
    return self._jitted_step(*args, **extra_args)

  def _placed(self, params, opt_state, batch, model_state, key, extra_args=None):
    """Outside tracing, the arguments placed as the step expects them.

    XLA:CPU can deadlock when a multi-device program is launched while the
    previous one is still running: in the native stacks of a stuck process,
    seven devices wait in the step's first all-reduce while the eighth
    device's launch waits for that device's in-flight-computation semaphore,
    until the rendezvous times out and aborts the process ("only 7 of 8
    arrived"). Seen in 6 of 20 runs of 300 small steps under CPU contention. So on CPU meshes the step waits until its inputs (the
    previous step's outputs, the batch's copies) are ready: 0 of 48 runs
    failed after. On other platforms only arguments that had to be copied
    are waited for. Arrays already placed pass through untouched (donation
    still aliases them).
    """
    extra_args = {} if extra_args is None else extra_args
    before = jax.tree.leaves((params, opt_state, batch, model_state, key, extra_args))
    if any(compat.is_tracer(x) for x in before):
      return params, opt_state, batch, model_state, key, extra_args
    layout = self._checked_layout(params, opt_state)
    params = self._put(params, self._param_specs(layout))
    opt_state = self._put(opt_state, layout.state_specs)
    if model_state is not None:
      model_state = self.place_model_state(model_state)
    if key is not None:
      key = jax.device_put(key, NamedSharding(self.mesh, P()))
    extra_args = self._put(extra_args, jax.tree.map(lambda _: P(), extra_args))
    try:
      # Not checked here, per call: the step checks the batch's shapes when it is traced.
      placed = self._put_batch(batch)
    except (TypeError, ValueError):
      self._check_batch(batch)   # a placement that fails on shapes, with the shapes named
      raise
    args = (params, opt_state, placed, model_state, key, extra_args)
    if self._on_cpu:
      jax.block_until_ready(args)
    else:
      copied = [y for x, y in zip(before, jax.tree.leaves(args)) if y is not x]
      if copied:
        jax.block_until_ready(copied)
    return args

  @functools.cached_property
  def _on_cpu(self) -> bool:
    return self.mesh.devices.size > 1 and self.mesh.devices.flat[0].platform == "cpu"

  def lower(self, params, opt_state, batch, model_state=None, key=None, **extra_args):
    """``jax.jit(...).lower`` of the step, for HLO audits (see :mod:`commopt.wire`)."""
    *args, extra_args = self._placed(params, opt_state, batch, model_state, key, extra_args)
    return self._jitted_step.lower(*args, **extra_args)


def _reads_value(opt, grads, state, params) -> bool | None:
  """Whether ``opt.update`` reads the ``value`` extra argument (traced, nothing computed).

  The update is traced with ``value`` as an input of its own; it is read when
  some equation of the trace (or the output) uses that input. None when the
  update does not take it (a transform of the user's that accepts no
  ``value`` keyword).
  """
  try:
    closed = jax.make_jaxpr(lambda g, s, v: opt.update(g, s, params, value=v))(
        grads, state, jnp.zeros((), jnp.float32))
  except TypeError as e:
    if "unexpected keyword argument 'value'" in str(e):
      return None
    raise
  var = closed.jaxpr.invars[-1]
  return (any(var is x for eqn in closed.jaxpr.eqns for x in eqn.invars)
          or any(var is x for x in closed.jaxpr.outvars))


def data_parallel(loss_fn: Callable, tx: optax.GradientTransformation,
                  mesh: jax.sharding.Mesh, axis_name: str | tuple[str, ...] = "data", *,
                  has_aux: bool = False, has_state: bool = False,
                  model_state_sync: str = "mean", skip_nonfinite: bool = True,
                  donate: bool = True, local_params: bool = False) -> DataParallel:
  """A data-parallel training step over ``mesh``'s ``axis_name``.

  Parameters are replicated over the data axes (a sharding over the mesh's
  other axes, e.g. ``P(None, 'model')``, is kept: tensor parallelism plus
  compressed data parallelism); the batch is split on its leading axis; each
  worker differentiates ``loss_fn`` on its shard with its gradients kept local
  (:func:`~commopt.parallel.local_value_and_grad`), and ``tx`` (which must
  contain a reduction such as :func:`~commopt.compressed_mean` over
  ``axis_name``) does the only communication. Per-worker optimizer state is
  stacked on a leading axis sharded over ``axis_name``; the rest stays
  replicated (:meth:`DataParallel.state_specs`).

  Faults: with ``skip_nonfinite=True`` the optimizer runs inside
  :func:`commopt.transforms.apply_if_finite`: a non-finite value in any
  worker's gradient makes all workers agree, with one int32 all-reduce, to
  skip the step; so does a non-finite reduced update (finite gradients that
  overflow in the exchange or the optimizer), which every worker sees the
  same and judges alike with no collective. Parameters, optimizer state
  (error residuals included) and model state stay as they were, and
  ``opt_state.total_notfinite`` counts the skips. The compressed exchange
  still runs on a skipped step (its result is discarded), so no worker ever
  waits in a collective another one skipped.

  Model state (``has_state=True``), e.g. batch-norm statistics: ``loss_fn``
  returns the new state beside the loss. With ``model_state_sync='mean'``
  (the default, the usual JAX recipe) floating-point leaves that differ
  between workers are averaged over the data axes each step with one dense
  all-reduce (model state is small); ``'none'`` refuses model state that
  differs between workers instead of communicating.

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss`` on one worker's shard;
      ``-> (loss, aux)`` with ``has_aux``; ``loss_fn(params, model_state,
      batch) -> (loss, new_model_state)`` (or ``(loss, (new_model_state,
      aux))``) with ``has_state``. If the step is given a ``key``, ``loss_fn``
      also receives ``key=`` (this worker's key).
    tx: an optax transformation.
    mesh: a ``jax.sharding.Mesh`` with the axes named by ``axis_name``.
    axis_name: the data axis, or a tuple of axes that together hold the
      workers, e.g. ``("node", "local")`` with
      ``compressed_mean(c, ("node", "local"), strategy="hierarchical")``.
    has_aux: ``loss_fn`` returns ``(loss, aux)``; aux comes back per worker.
    has_state: ``loss_fn`` takes and returns model state.
    model_state_sync: ``"mean"`` or ``"none"``.
    skip_nonfinite: skip steps with a non-finite gradient on any worker or a
      non-finite reduced update.
    donate: donate params, optimizer state and model state to the jitted step.
    local_params: keep one copy of the parameters per worker, stacked
      ``[num_workers, ...]`` and sharded over the data axes, for transforms
      whose updates differ between workers between synchronisations
      (:func:`~commopt.local_sgd`, :func:`~commopt.diloco`). ``init`` takes the
      parameters as usual; :meth:`~DataParallel.place_params` stacks them for
      the first step, which returns them stacked.

  Returns:
    A :class:`DataParallel`: ``init(params) -> opt_state``,
    ``step(params, opt_state, batch) -> (params, opt_state, losses)``, the
    pure ``step_fn`` and the state's ``state_specs(params)``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, commopt
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> tx = optax.chain(commopt.compressed_mean(commopt.scaled_sign(), "data"),
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
                      donate=donate, local_params=local_params)
