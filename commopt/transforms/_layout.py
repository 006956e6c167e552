"""Where a data-parallel step's values live, and the solver that finds it by tracing ``tx``.

An optimizer state leaf is **per-worker** when its new value varies over the
data axes after one update traced inside ``shard_map`` with local gradients
(an error-feedback residual, momentum before the reduction, a two-phase
server chunk). Per-worker leaves are stacked on a leading axis of size
``num_workers`` sharded over the data axes; every other leaf is replicated
over them. Over the mesh's other axes (tensor parallelism) a leaf keeps the
sharding its type carries, which on a mesh with explicit axes follows the
parameters.

- :class:`Layout` holds what the step needs of that for one parameter layout,
  beside the spec helpers the step bodies and the placer use (stacking workers,
  gathering and slicing shards, :func:`reads_value`).
- :class:`LayoutSolver` finds it (``DataParallel.layout``): it traces ``tx.init``
  and ``tx.update`` to a fixed point of the state's varying axes, over the data
  axes or, for parameters sharded over model axes, on each device's shards
  (where it also lists what ``tx`` computes over a whole leaf, which a shard
  would get wrong: :func:`shard_hazards`), asks whether ``tx`` reads the ``value``
  extra argument, and checks ``tx``'s axis names when the step is built. Its cache
  of layouts per parameter signature is its own.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from commopt._src import base, vma
from commopt._src.vma import spec_axes
from commopt.comm import _collectives as coll
from commopt.comm import _plan


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
    shard_local: whether ``tx`` runs on each device's shards of parameters
      sharded over model axes (:class:`._steps.ShardLocalStep`); False where they
      are whole, or where ``tx`` needs whole leaves.
  """
  param_specs: Any
  state_specs: Any
  per_worker: Any
  state_treedef: Any
  reads_value: bool = False
  shard_local: bool = False


def explicit(mesh) -> bool:
  """Whether every axis of ``mesh`` is explicit (shardings are part of the array types)."""
  return all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)


def model_axes(mesh, data_axes) -> tuple[str, ...]:
  """The mesh's axes besides ``data_axes`` of size above one: those parameters are sharded
  over (tensor parallel, FSDP inside a replica)."""
  data = set(base.axis_names(data_axes))
  return tuple(a for a in mesh.axis_names if a not in data and mesh.shape[a] > 1)


def runs_shard_local(mesh, data_axes, specs) -> bool:
  """Whether ``tx`` runs on each device's blocks of parameters of these ``specs`` (a flat
  list of ``PartitionSpec``\\ s): some spec cuts a model axis, or the mesh has model axes
  and is explicit (replicated parameters too: each device's block is the whole leaf).
  Then the optimizer runs in a ``shard_map`` manual over every axis, whose dense buckets
  the model ranks split (``comm._exchange``) and whose 16-bit all-reduces XLA:CPU
  compiles (manual over the data axes alone, it aborts on them)."""
  other = model_axes(mesh, data_axes)
  return any(a in other for s in specs for a in spec_axes(s)) or bool(other and explicit(mesh))


def keystr(path) -> str:
  return jax.tree_util.keystr(path) or "<root>"


def data_spec(axes: Sequence[str]):
  """The spec entry of a dimension sharded over the data axes."""
  return axes[0] if len(axes) == 1 else tuple(axes)


def local_value_and_grad(loss_fn: Callable, axis_name, *, has_aux: bool = False) -> Callable:
  """``jax.value_and_grad`` whose gradients stay on this worker.

  Inside ``jax.shard_map`` (with ``check_vma=True``), differentiating
  replicated parameters makes JAX all-reduce the gradient densely (the
  transpose of the implicit broadcast), which would undo any compression. This
  casts the parameters to varying over ``axis_name`` first, so each worker
  gets the gradient of its own shard and the optimizer's reduction (e.g.
  :func:`~commopt.compressed_mean`) is the only communication.

  Args:
    loss_fn: ``loss_fn(params, *args, **kwargs)`` returning a scalar, or
      ``(scalar, aux)`` with ``has_aux=True``.
    axis_name: the data axis, or a tuple of axes.
    has_aux: as in ``jax.value_and_grad``.

  Returns:
    ``f(params, *args, **kwargs) -> (value, grads)`` like ``jax.value_and_grad``.
  """
  grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux)
  axes = base.axis_names(axis_name)

  def f(params, *args, **kwargs):
    return grad_fn(jax.tree.map(lambda x: coll.vary(x, axes), params), *args, **kwargs)

  return f


def full_spec(spec, ndim: int) -> P:
  """``spec`` with one entry per dimension (missing trailing entries are None)."""
  entries = list(spec)[:ndim]
  return P(*(entries + [None] * (ndim - len(entries))))


def stacked_spec(spec: P, axes) -> P:
  """``spec`` with a leading worker dimension sharded over the data axes."""
  return P(data_spec(axes), *spec)


def stack_workers(tree, specs, axis_name) -> Any:
  """Inside ``shard_map``: gives each per-worker leaf its leading worker axis (size 1 here).

  ``specs`` are the state's specs (:meth:`~commopt.DataParallel.state_specs`);
  ``axis_name`` is the data axis or tuple of axes.
  """
  axes = base.axis_names(axis_name)
  return jax.tree.map(lambda x, s: x[None] if is_stacked(s, axes) else x, tree, specs)


def unstack_workers(tree, specs, axis_name) -> Any:
  """Inside ``shard_map``: drops each per-worker leaf's leading worker axis."""
  axes = base.axis_names(axis_name)
  return jax.tree.map(lambda x, s: x[0] if is_stacked(s, axes) else x, tree, specs)


def is_spec(x) -> bool:
  """``is_leaf`` for pytrees of partition specs (a spec is a tuple, not a pytree node)."""
  return isinstance(x, P)


def map_specs(fn, tree, specs) -> Any:
  """``jax.tree.map(fn, tree, specs)`` with each spec taken whole."""
  return jax.tree.map(fn, tree, specs, is_leaf=is_spec)


def is_stacked(spec: P, axes) -> bool:
  return len(spec) > 0 and spec[0] == data_spec(axes)


def to_shardings(mesh, specs) -> Any:
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=is_spec)


def unstacked_specs(specs, axes) -> Any:
  """``specs`` with the leading worker dimension of per-worker leaves removed."""
  return jax.tree.map(lambda s: P(*s[1:]) if is_stacked(s, axes) else s, specs,
                      is_leaf=is_spec)


def manual_specs(specs, axes) -> Any:
  """The state ``specs`` as a ``shard_map`` manual over the data ``axes`` alone sees them:
  those axes only (a per-worker leaf's leading dimension), the rest replicated."""
  data = P(data_spec(axes))
  return jax.tree.map(lambda s: data if is_stacked(s, axes) else P(), specs, is_leaf=is_spec)


def specs_by_shape(params, param_specs) -> dict:
  """Shape -> spec for the parameters' shapes that only one spec uses.

  An optimizer-state leaf takes the spec of the parameters of its shape
  (momentum, residuals and Adam moments mirror their parameter); shapes that
  parameters with different specs share, and shapes no parameter has, are
  replicated.
  """
  seen: dict = {}
  flat_specs = jax.tree.leaves(param_specs, is_leaf=is_spec)
  for x, spec in zip(jax.tree.leaves(params), flat_specs):
    shape = tuple(jnp.shape(x))
    spec = P(*(list(spec) + [None] * (len(shape) - len(spec))))
    seen.setdefault(shape, set()).add(spec)
  return {shape: next(iter(specs)) for shape, specs in seen.items() if len(specs) == 1}


def gather_spec(x, spec: P):
  """Inside ``shard_map`` over ``spec``'s axes: the whole array from this rank's shard.

  Gathered with the invariant all-gather, so values computed from it may be
  returned replicated.
  """
  for dim, entry in enumerate(spec):
    x = coll.all_gather_tiled(x, spec_axes((entry,)), dim)
  return x


def slice_spec(x, spec: P):
  """Inside ``shard_map`` over ``spec``'s axes: this rank's shard of the whole array ``x``."""
  for dim, entry in enumerate(spec):
    for name in spec_axes((entry,)):
      size = x.shape[dim] // coll.axis_size(name)
      x = jax.lax.dynamic_slice_in_dim(x, coll.axis_index(name) * size, size, axis=dim)
  return x


def gather_tree(tree, specs) -> Any:
  """:func:`gather_spec` of every leaf: whole arrays from this rank's shards."""
  return map_specs(gather_spec, tree, specs)


def slice_tree(tree, specs) -> Any:
  """:func:`slice_spec` of every leaf: this rank's shards of whole arrays."""
  return map_specs(slice_spec, tree, specs)


def vary_to_specs(tree, specs) -> Any:
  """Inside the all-manual ``shard_map``: each leaf typed varying over every axis its spec
  names (a state leaf the same on every shard at ``init`` that the step keeps per shard)."""
  return map_specs(lambda x, s: coll.vary(x, spec_axes(s)) if spec_axes(s) else x,
                   tree, specs)


# -- the ``value`` extra argument ----------------------------------------------------------

def update_with_value(tx, updates, state, params, value) -> tuple[Any, bool]:
  """``(tx.update(..., value=value), True)``, or ``(tx.update(...), False)`` for a ``tx``
  that takes no ``value`` keyword (a transform of the user's without extra arguments)."""
  try:
    return tx.update(updates, state, params, value=value), True
  except TypeError as e:
    if "unexpected keyword argument 'value'" not in str(e):
      raise
    return tx.update(updates, state, params), False


def reads_value(opt, grads, state, params) -> bool | None:
  """Whether ``opt.update`` reads the ``value`` extra argument (traced, nothing computed).

  The update is traced with ``value`` as an input of its own; it is read when
  some equation of the trace (or the output) uses that input. None when the
  update does not take it (see :func:`update_with_value`).
  """
  took = []

  def update(g, s, v):
    out, taken = update_with_value(opt, g, s, params, v)
    took.append(taken)
    return out

  closed = jax.make_jaxpr(update)(grads, state, jnp.zeros((), jnp.float32))
  if not took[-1]:
    return None
  var = closed.jaxpr.invars[-1]
  return (any(var is x for eqn in closed.jaxpr.eqns for x in eqn.invars)
          or any(var is x for x in closed.jaxpr.outvars))


# -- the solver: the layout found by tracing ``tx`` --------------------------------------

REDUCING = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
    "reduce_xor", "reduce", "argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin",
    "cumlogsumexp", "sort", "top_k", "dot_general", "conv_general_dilated",
    "reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window",
    "select_and_scatter_add", "fft", "eigh", "svd", "qr", "cholesky", "triangular_solve",
    "lu", "householder_product"})
"""Primitives whose result mixes the elements of an operand: on a shard they see part of it."""

RANDOM = frozenset({"random_bits", "threefry2x32"})
"""Primitives that draw random bits: an array drawn from a key the shards share is the same
on every shard (noise that should differ between a leaf's blocks does not)."""


class Hazard(NamedTuple):
  """A computation of ``tx`` that a shard would get wrong."""
  primitive: str
  where: str

  def __str__(self) -> str:
    what = self.primitive + (" (an array drawn alike on every shard)"
                             if self.primitive in RANDOM else "")
    return f"{what} at {self.where}" if self.where else what


def _contracts(eqn) -> bool:
  if eqn.primitive.name != "dot_general":
    return True
  (lhs_contract, _), _ = eqn.params["dimension_numbers"]
  return bool(lhs_contract)


def shard_hazards(jaxpr, model_axes) -> list[Hazard]:
  """The reductions of a model-sharded value in ``jaxpr`` (sub-jaxprs included), and the
  random draws of arrays from keys every shard shares, outside commopt's shard-aware code
  (:data:`commopt._src.vma.SHARD_AWARE_SCOPE`)."""
  model_axes = frozenset(model_axes)
  found: list[Hazard] = []
  todo = [(jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr, False)]
  seen = set()
  while todo:
    j, inside = todo.pop()
    if (id(j), inside) in seen:
      continue
    seen.add((id(j), inside))
    for eqn in j.eqns:
      here = inside or vma.SHARD_AWARE_SCOPE in str(
          getattr(getattr(eqn, "source_info", None), "name_stack", ""))
      reduces = (eqn.primitive.name in REDUCING and _contracts(eqn)
                 and any(vma.varying_axes_of_type(getattr(v, "aval", None)) & model_axes
                         for v in eqn.invars))
      draws = (eqn.primitive.name in RANDOM
               and any(len(getattr(getattr(v, "aval", None), "shape", ())) > 1
                       or max(getattr(getattr(v, "aval", None), "shape", (0,)) or (0,)) > 2
                       for v in eqn.outvars)
               and not any(vma.varying_axes_of_type(getattr(v, "aval", None)) & model_axes
                           for v in eqn.invars))
      if not here and (reduces or draws):
        hazard = Hazard(eqn.primitive.name, vma.where_traced(eqn))
        if hazard not in found:
          found.append(hazard)
      for v in eqn.params.values():
        todo.extend((sub, here) for sub in _plan.subjaxprs(v))
  return found


def _unbound_axis(e: NameError) -> bool:
  """Whether ``e`` is commopt's :class:`~commopt.AxisNameError` or JAX's unbound-axis error
  (a collective of ``tx`` outside commopt's reductions, e.g. a ``jax.lax.psum`` of its own)."""
  return isinstance(e, base.AxisNameError) or "unbound axis name" in str(e)


class LayoutSolver:
  """The :class:`Layout` of a ``DataParallel``'s step, found by tracing its ``tx`` (nothing
  is computed) and kept per parameter signature.

  Over the data axes (:meth:`_trace_state`): a state leaf is per worker when its
  new value varies over them. On the shards of parameters sharded over model axes
  (:meth:`_trace_shards`, for the shard-local step, inside a ``shard_map`` manual
  over every mesh axis): a leaf's model axes too, and so its partition spec
  (:meth:`_state_spec`), and whether ``tx`` computes something over a whole leaf
  that a shard would get wrong (:func:`shard_hazards`): a reduction (sum, max,
  sort, a matrix product's contraction, ...) of a model-sharded value outside
  commopt's own shard-aware code, e.g. ``optax.clip_by_global_norm``'s norm or
  Muon's Newton-Schulz products. Such a ``tx`` runs on whole leaves instead
  (:class:`._steps.WholeLeafStep`), or is refused with ``shard_local=True``.

  Args:
    dp: what is solved for: a :class:`~commopt.DataParallel`, or the global view of a
      reducing transform (:class:`commopt.transforms._global_view.View`); the solver reads
      its ``mesh``, ``axes``, ``axis_name``, ``tx``, ``optimizer``, ``local_params``,
      ``shard_local``, ``_other_axes`` and ``param_specs_of(params)``.
  """

  def __init__(self, dp):
    self.dp = dp
    self._layouts: dict = {}

  def axis_error(self, e: Exception) -> Exception:
    """The :class:`~commopt.AxisNameError` for a ``tx`` that reduces over an axis not mapped."""
    dp = self.dp
    return base.AxisNameError(
        f"data_parallel: `tx` reduces over an axis the step does not map over. The step "
        f"maps over axis_name={dp.axis_name!r} of a mesh with axes "
        f"{tuple(dp.mesh.axis_names)}; give the transforms inside `tx` that axis_name. "
        f"({e})")

  def _over_data_axes(self, probe: Callable) -> Callable:
    """``probe`` in a ``shard_map`` manual over the data axes, replicated in and out."""
    return jax.shard_map(probe, mesh=self.dp.mesh, in_specs=(P(),), out_specs=P(),
                         axis_names=set(self.dp.axes))

  def check_tx_axes(self) -> None:
    """An :class:`~commopt.AxisNameError` now if ``tx`` reduces over an axis the step does
    not map over, found by tracing ``tx`` on one scalar parameter (nothing is computed).

    A ``tx`` that cannot run on that parameter (a ``multi_transform`` whose labels
    name the real parameters, ...) is checked when :meth:`find` first traces it.
    """
    tx, axes = optax.with_extra_args_support(self.dp.tx), self.dp.axes

    def probe(p):
      g = jax.tree.map(lambda x: coll.vary(x, axes), p)
      tx.update(g, tx.init(p), p)
      return jnp.zeros(())

    fn = self._over_data_axes(probe)
    try:
      with coll.inputs_unchecked():
        jax.eval_shape(fn, {"probe": jax.ShapeDtypeStruct((), jnp.float32)})
    except NameError as e:
      if not _unbound_axis(e):
        raise
      raise self.axis_error(e) from None
    except Exception:   # noqa: BLE001 - anything else is the layout's to report, with params
      pass

  def find(self, params) -> Layout:
    """``DataParallel.layout``: traced once per parameter shapes and specs, then cached."""
    dp = self.dp
    param_specs = dp.param_specs_of(params)
    flat_specs = jax.tree.leaves(param_specs, is_leaf=is_spec)
    key = (jax.tree.structure(params),
           tuple((tuple(jnp.shape(x)), str(getattr(x, "dtype", None) or jnp.result_type(x)), s)
                 for x, s in zip(jax.tree.leaves(params), flat_specs)))
    cached = self._layouts.get(key)
    if cached is not None:
      return cached
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x),
                                          sharding=NamedSharding(dp.mesh, s)),
        params, param_specs)
    if dp.shard_local is not False and runs_shard_local(dp.mesh, dp.axes, flat_specs):
      result = self._shard_local(params, abstract, param_specs)
      if result is not None:
        self._layouts[key] = result
        return result
    found = self._trace_state(abstract)
    by_shape = specs_by_shape(params, param_specs)
    state_specs = [stacked_spec(by_shape.get(tuple(shape), P(*[None] * len(shape))), dp.axes)
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

  def _shard_local(self, params, abstract, param_specs) -> Layout | None:
    """The shard-local step's layout, or None (with a warning) where ``tx`` reduces a
    sharded leaf by itself, draws an array alike on every shard or fails on shards, and
    ``shard_local="auto"`` lets it run on whole leaves."""
    dp = self.dp
    try:
      found = self._trace_shards(abstract, param_specs)
      fields = self._shard_fields(params, param_specs, found)
    except NameError as e:
      if not _unbound_axis(e):
        raise
      raise self.axis_error(e) from None
    except (ValueError, TypeError) as e:
      if dp.shard_local is True:
        raise
      # A tx that cannot run on shards (a mask shaped like whole leaves, a callable
      # PowerSGD view) runs on whole leaves, as before there was a shard-local step.
      warnings.warn(
          f"data_parallel: `tx` does not run on the shards of parameters sharded over the "
          f"model axes ({e}); it runs on whole leaves instead, all-gathered over those axes. "
          "Pass shard_local=False to choose that quietly.", stacklevel=4)
      return None
    hazards = found["hazards"]
    if hazards:
      listed = "; ".join(str(h) for h in hazards[:4]) + (" ..." if len(hazards) > 4 else "")
      what = (f"`tx` computes over whole leaves ({listed}), which on a shard-local step would "
              "see only each device's shard of a parameter sharded over the model axes "
              f"{sorted(set(dp.mesh.axis_names) - set(dp.axes))}")
      if dp.shard_local is True:
        raise ValueError(
            f"data_parallel: shard_local=True, but {what}. Use transforms that work per "
            "element (optax.adam, sgd, lion, ...) and commopt's reductions, or "
            "shard_local='auto' to run such a `tx` on whole leaves (all-gathered over the "
            "model axes, at the whole model's memory and bytes).")
      warnings.warn(
          f"data_parallel: {what}; it runs on whole leaves instead, all-gathered over the "
          "model axes, so each model rank compresses and sends the whole leaf. Pass "
          "shard_local=False to choose that quietly.", stacklevel=4)
      return None
    return Layout(**fields, shard_local=True)

  def _whole(self, tree):
    """Inside the step: ``tree`` replicated over the non-data axes (the optimizer sees whole
    leaves)."""
    if not self.dp._other_axes:
      return tree
    return jax.tree.map(lambda x: jax.sharding.reshard(x, P(*[None] * jnp.ndim(x))), tree)

  def _trace_state(self, abstract) -> dict:
    """``tx.init`` and ``tx.update`` traced with local gradients to a fixed point: a state
    leaf is per-worker when its new value varies over the data axes.

    Returns ``{"treedef", "mask", "shapes", "reads_value"}`` of the state's leaves.
    """
    found = {}
    dp = self.dp
    axes, opt = dp.axes, dp.optimizer

    def probe(p):
      p = self._whole(p)
      state = opt.init(p)
      leaves, treedef = jax.tree_util.tree_flatten(state)
      grads = jax.tree.map(lambda x: coll.vary(x, axes), p)
      if dp.local_params:
        p = grads
      read = reads_value(opt, grads, state, p)
      extra = {} if read is None else {"value": jnp.zeros((), jnp.float32)}
      mask = [False] * len(leaves)
      new = leaves
      for _ in range(len(leaves) + 1):
        s = jax.tree_util.tree_unflatten(
            treedef, [coll.vary(l, axes) if m else l for l, m in zip(leaves, mask)])
        new = jax.tree.leaves(jax.eval_shape(lambda g, s: opt.update(g, s, p, **extra)[1],
                                             grads, s))
        seen = [m or coll.per_worker(x, axes) for x, m in zip(new, mask)]
        if seen == mask:
          break
        mask = seen
      found.update(treedef=treedef, mask=mask, shapes=[jnp.shape(x) for x in leaves],
                   reads_value=bool(read))
      return jnp.zeros(())

    fn = self._over_data_axes(probe)
    try:
      with coll.inputs_unchecked():
        jax.eval_shape(fn, abstract)
    except NameError as e:
      if not _unbound_axis(e):
        raise
      raise self.axis_error(e) from None
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
    return found

  def _trace_shards(self, abstract, param_specs) -> dict:
    """``tx.init`` and ``tx.update`` traced on the shards, to a fixed point of the state's
    varying axes (see the class). Returns ``{"treedef", "paths", "shapes", "axes",
    "stacked", "reads_value", "hazards"}``; ``axes`` are each state leaf's model axes."""
    found: dict = {}
    dp = self.dp
    axes, opt = dp.axes, dp.optimizer
    model = frozenset(a for a in dp.mesh.axis_names if a not in axes)
    sizes = dict(dp.mesh.shape)

    def body(p):
      with coll.model_sharding(param_specs, abstract, sizes):
        state = opt.init(p)
        flat, treedef = jax.tree_util.tree_flatten_with_path(state)
        leaves = [x for _, x in flat]
        grads = jax.tree.map(lambda x: coll.vary(x, axes), p)
        params = grads if dp.local_params else p
        read = reads_value(opt, grads, state, params)
        extra = {} if read is None else {"value": jnp.zeros((), jnp.float32)}
        update = lambda g, s: opt.update(g, s, params, **extra)
        varying = [coll.varying_axes(x) for x in leaves]
        for _ in range(len(leaves) + 1):
          s = jax.tree_util.tree_unflatten(
              treedef, [coll.vary(x, tuple(sorted(v))) if v else x
                        for x, v in zip(leaves, varying)])
          new = jax.tree.leaves(jax.eval_shape(lambda g, s: update(g, s)[1], grads, s))
          seen = [v | coll.varying_axes(x) for x, v in zip(new, varying)]
          if seen == varying:
            break
          varying = seen
        jaxpr = jax.make_jaxpr(update)(grads, s)
      found.update(treedef=treedef, paths=[keystr(p) for p, _ in flat],
                   shapes=[tuple(jnp.shape(x)) for x in leaves],
                   axes=[frozenset(v) & model for v in varying],
                   stacked=[bool(set(v) & set(axes)) for v in varying],
                   reads_value=bool(read), hazards=shard_hazards(jaxpr, model))
      return jnp.zeros(())

    fn = jax.shard_map(body, mesh=dp.mesh, in_specs=(param_specs,), out_specs=P())
    with coll.inputs_unchecked():
      jax.eval_shape(fn, abstract)
    return found

  def _shard_fields(self, params, param_specs, found) -> dict:
    """The :class:`Layout` fields of a shard-local trace."""
    sizes = dict(self.dp.mesh.shape)
    described = [(keystr(path), coll.local_shape(jnp.shape(x), spec, sizes), spec)
                 for (path, x), spec in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                            jax.tree.leaves(param_specs, is_leaf=is_spec))]
    specs = [self._state_spec(path, shape, axes, stacked, described)
             for path, shape, axes, stacked in zip(found["paths"], found["shapes"],
                                                   found["axes"], found["stacked"])]
    unflat = lambda xs: jax.tree_util.tree_unflatten(found["treedef"], xs)
    return dict(param_specs=param_specs, state_specs=unflat(specs),
                per_worker=unflat(found["stacked"]), state_treedef=found["treedef"],
                reads_value=found["reads_value"])

  def _state_spec(self, path: str, shape, axes: frozenset, stacked: bool, params: list):
    """The partition spec of a state leaf whose block here has ``shape`` and varies over
    the model ``axes`` (and over the data axes when ``stacked``).

    A leaf that mirrors a parameter (its path ends with the parameter's, or it
    is the only parameter with that block shape and those axes) takes the
    parameter's spec, so the saved state has the parameter's global shape.
    Any other leaf sharded over model axes is tiled on its first dimension.
    """
    spec = P(*[None] * len(shape))
    if axes:
      matches = [s for p, local, s in params
                 if local == tuple(shape) and frozenset(spec_axes(s)) == axes]
      by_path = [s for p, local, s in sorted(params, key=lambda t: -len(t[0]))
                 if p and path.endswith(p) and local == tuple(shape)
                 and frozenset(spec_axes(s)) == axes]
      if by_path:
        spec = by_path[0]
      elif len(set(matches)) == 1:
        spec = matches[0]
      elif not shape:
        raise ValueError(
            f"data_parallel: optimizer-state leaf {path} is a scalar that differs between the "
            f"shards of model axes {sorted(axes)}; a shard-local step can only keep state "
            "with a dimension to shard. Pass shard_local=False to run `tx` on whole leaves.")
      else:
        order = [a for a in self.dp.mesh.axis_names if a in axes]
        spec = P(order[0] if len(order) == 1 else tuple(order), *[None] * (len(shape) - 1))
      spec = full_spec(spec, len(shape))
    return stacked_spec(spec, self.dp.axes) if stacked else spec


# -- the optimizer on each device's blocks: the shard-local step and the global view ----

def init_on_blocks(opt, layout: Layout, mesh, axes, other_axes, params) -> Any:
  """``opt.init`` on each device's blocks of ``params`` (global arrays of
  ``layout.param_specs``), in a ``shard_map`` manual over every mesh axis: per-worker leaves
  stacked over the data ``axes``, leaves sharded over model axes kept so.

  The step of parameters sharded over model axes (``ShardLocalStep.init``) and the global
  view of a reducing transform (:mod:`commopt.transforms._global_view`) both call it.
  """
  state_specs = unstacked_specs(layout.state_specs, axes)
  shapes = jax.tree.map(lambda x: tuple(jnp.shape(x)), params)

  def body(p):
    with coll.model_sharding(layout.param_specs, shapes, mesh, other_axes):
      state = vary_to_specs(opt.init(p), state_specs)
    return stack_workers(state, layout.state_specs, axes)

  # Jitted: run eagerly, a shard_map compiles each of its operations on its own.
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(layout.param_specs,),
                               out_specs=layout.state_specs))(params)


def update_on_blocks(opt, layout: Layout, mesh, axes, other_axes, local_params: bool,
                     grads, opt_state, params, extra_args, check: Callable) -> tuple[Any, Any]:
  """``(updates, new_state)``: ``opt.update`` on each device's blocks, in a ``shard_map``
  manual over every mesh axis, of the per-worker ``grads`` stacked ``[num_workers, ...]``
  over the data ``axes`` (updates stacked so too with ``local_params``, else replicated
  over the data axes, which ``check`` verifies inside the map).

  The step of parameters sharded over model axes (``ShardLocalStep.update``) and the
  global view of a reducing transform both call it.
  """
  state_specs = unstacked_specs(layout.state_specs, axes)
  stacked = lambda specs: jax.tree.map(lambda s: stacked_spec(s, axes), specs,
                                       is_leaf=is_spec)
  param_specs = stacked(layout.param_specs) if local_params else layout.param_specs
  if params is None:   # a transform that takes no parameters (compressed_mean)
    param_specs = P()
  unstack = lambda t: jax.tree.map(lambda x: x[0], t)
  shapes = jax.tree.map(lambda x: tuple(jnp.shape(x))[1:] if local_params or params is None
                        else tuple(jnp.shape(x)), grads if params is None else params)

  def update(g, st, p, extra):
    g = unstack(g)
    p = unstack(p) if local_params else p
    st = unstack_workers(st, layout.state_specs, axes)
    with coll.model_sharding(layout.param_specs, shapes, mesh, other_axes):
      u, new = opt.update(g, st, p, **extra)
    if local_params:
      u = jax.tree.map(lambda x: x[None], u)
    else:
      check(u)
    new = vary_to_specs(new, state_specs)
    return u, stack_workers(new, layout.state_specs, axes)

  return jax.shard_map(
      update, mesh=mesh,
      in_specs=(stacked(layout.param_specs), layout.state_specs, param_specs, P()),
      out_specs=(param_specs, layout.state_specs))(grads, opt_state, params, extra_args)
