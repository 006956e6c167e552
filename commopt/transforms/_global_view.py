"""The global view: a reducing transform called in a user's own ``jax.jit`` on global arrays.

Under ``jax.set_mesh`` with explicit axes, a program holds global arrays whose
types carry their sharding, and a gradient taken with respect to parameters
cast ``reduced={'data'}`` is *unreduced* over ``'data'``
(``float32[8,4]{U:data}``): each device holds its partial sum and nothing has
crossed the wire. A reducing transform of commopt (:func:`~commopt.compressed_mean`,
the synchronisation modes, the robust rules, ...) called there runs its own
exchange: :func:`accepting` wraps each one, and its ``init`` and ``update``
take the global view when :func:`global_mesh` finds the transform's axes on
the mesh, explicit and not inside a map over them. Everywhere else (inside
``jax.shard_map`` or ``jax.vmap`` over the axes, ``axis_name=None``) the
transform runs as it always does.

In the global view, per worker:

- **Unreduced values** (``replicated`` or model-sharded parameters): each
  device's partial sum ``gᵢ``, scaled by the number of workers ``N``, is worker
  ``i``'s input, so the mean the exchange computes is the sum the unreduced
  value stands for (for a loss that is a mean over the batch, ``N·gᵢ`` is worker
  ``i``'s gradient of the mean over its own rows, as
  :func:`~commopt.data_parallel` computes it).
- **Per-worker values** (transforms that keep each worker's own parameters:
  ``local_sgd``, ``diloco``): parameters and gradients with a leading dimension
  of size ``N`` sharded over the data axes, one row per worker.

The state's layout is the one :func:`~commopt.data_parallel` finds (the same
:class:`~commopt.transforms._layout.LayoutSolver`), and the transform runs on
each device's blocks in a ``shard_map`` manual over every mesh axis
(:func:`~commopt.transforms._layout.update_on_blocks`, which
``data_parallel``'s shard-local step runs too): per-worker state leaves are
global arrays ``[N, ...]`` sharded over the data axes, created by ``init`` under
the mesh (which it reads from ``jax.sharding.get_abstract_mesh()``, the mesh
``jax.set_mesh`` sets), with the concrete mesh's shardings, so
``jax.eval_shape(tx.init, params)`` is an orbax restore target.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from commopt._src import base
from commopt.comm import _collectives as coll
from commopt.transforms import _layout as lay


def global_mesh(axis_name):
  """The mesh on which a transform over ``axis_name`` takes the global view, or None.

  That is the mesh ``jax.set_mesh`` set, when it has every axis of ``axis_name``,
  each explicit, none manual here (inside ``jax.shard_map`` over it) and none bound
  by ``jax.vmap``. The concrete mesh where one is set (its shardings are what orbax
  restores onto), else the abstract one.
  """
  if axis_name is None:
    return None
  axes = base.axis_names(axis_name)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or any(a not in mesh.axis_names for a in axes):
    return None
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  if any(a in mesh.manual_axes or types[a] != jax.sharding.AxisType.Explicit for a in axes):
    return None
  if any(coll.bound_axis_size(a) is not None for a in axes):
    return None
  try:
    concrete = jax.sharding.get_mesh()
  except ValueError:   # inside jax.jit, where only the abstract mesh is known
    return mesh
  if (not concrete.empty and concrete.axis_names == mesh.axis_names
      and dict(concrete.shape) == dict(mesh.shape)):
    return concrete
  return mesh


def _spec(x) -> P:
  """The partition spec of ``x``'s type, without its reduced and unreduced axes."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  spec = getattr(sharding, "spec", None)
  parts = tuple(spec.partitions) if spec is not None else ()
  return lay.full_spec(P(*parts), jnp.ndim(x))


def _unreduced(x) -> frozenset:
  spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
  return frozenset(getattr(spec, "unreduced", ()) or ())


def _reduced(x) -> frozenset:
  spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
  return frozenset(getattr(spec, "reduced", ()) or ())


@dataclasses.dataclass(frozen=True, eq=False)
class View:
  """One reducing transform's global view on one mesh: what the
  :class:`~commopt.transforms._layout.LayoutSolver` reads (the options
  :class:`~commopt.DataParallel` gives it too).

  Attributes:
    fn: the transform's name, for errors.
    mesh: the mesh (:func:`global_mesh`).
    axis_name: the data axis or axes.
    tx: the transform (with optax's extra-arguments support).
    local_params: whether each worker keeps its own parameters (per-worker form).
  """
  fn: str
  mesh: Any
  axis_name: Any
  tx: optax.GradientTransformationExtraArgs
  local_params: bool
  shard_local: str = "auto"

  @property
  def axes(self) -> tuple[str, ...]:
    return base.axis_names(self.axis_name)

  @property
  def optimizer(self) -> optax.GradientTransformationExtraArgs:
    return self.tx

  @property
  def _other_axes(self) -> tuple[str, ...]:
    return lay.model_axes(self.mesh, self.axes)

  def param_specs_of(self, params) -> Any:
    """The parameters' specs from their types; a data axis inside a spec is refused."""
    def spec_of(path, x):
      spec = _spec(x)
      named = [a for a in lay.spec_axes(spec) if a in self.axes]
      if named:
        raise ValueError(
            f"{self.fn}: {lay.keystr(path)} (type {jax.typeof(x)}) is sharded over the data "
            f"axis {named[0]!r} itself (FSDP), so its gradient is already reduced over it "
            "when it arrives and there is nothing left to compress. Keep parameters "
            f"replicated over {self.axes} (cast them reduced={{{named[0]!r}}} to "
            "differentiate), or train FSDP-sharded parameters with "
            "commopt.zero_data_parallel, which compresses what crosses the data axis.")
      return spec
    return jax.tree_util.tree_map_with_path(spec_of, params)

  def abstract(self, tree, stacked: bool) -> Any:
    """``tree``'s leaves as the solver wants parameters: shapes and specs (each worker's
    own, without the leading worker dimension, when ``stacked``)."""
    def one(x):
      spec, shape = _spec(x), tuple(jnp.shape(x))
      if stacked:
        spec, shape = P(*tuple(spec)[1:]), shape[1:]
      return jax.ShapeDtypeStruct(shape, jnp.result_type(x),
                                  sharding=jax.sharding.NamedSharding(self.mesh, spec))
    return jax.tree.map(one, tree)

  @functools.cached_property
  def solver(self) -> lay.LayoutSolver:
    return lay.LayoutSolver(self)

  def layout(self, abstract) -> lay.Layout:
    layout = self.solver.find(abstract)
    specs = jax.tree.leaves(layout.param_specs, is_leaf=lay.is_spec)
    if (self._other_axes and not layout.shard_local
        and any(a in self._other_axes for s in specs for a in lay.spec_axes(s))):
      raise ValueError(
          f"{self.fn}: in the global view a transform runs on each device's shards of the "
          f"parameters sharded over {self._other_axes}, and this one needs whole leaves "
          "(see the warning above). Train it with commopt.data_parallel, which gathers them.")
    return layout

  def check_replicated(self, tree) -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      if coll.per_worker(leaf, self.axes):
        raise ValueError(
            f"{self.fn}: its output {lay.keystr(path)} differs between workers on axis "
            f"{self.axis_name!r}; in the global view a reducing transform must return the "
            "same update on every worker (transforms that keep parameters per worker take "
            "them stacked [workers, ...], sharded over the data axes).")


def _stacked_form(params, axes, n: int) -> bool:
  """Whether ``params`` are per worker: every array leaf leads with a dimension of ``n``
  sharded over exactly the data ``axes``."""
  leaves = [x for x in jax.tree.leaves(params) if jnp.ndim(x)]
  want = lay.data_spec(axes)
  return bool(leaves) and all(
      x.shape[0] == n and tuple(_spec(x))[0] == want for x in leaves)


def _no_input_error(fn: str, axis_name, path, x) -> base.AxisNameError:
  return base.AxisNameError(
      f"{fn}: in the global view (jax.set_mesh with axis {axis_name!r} explicit, outside "
      f"any shard_map over it), input {lay.keystr(path)} has type {jax.typeof(x)}, which is "
      f"neither unreduced over {axis_name!r} (each device's partial sum, which the "
      "transform reduces) nor one row per worker. Differentiate with respect to "
      f"parameters cast reduced: jax.reshard(params, P(..., reduced={{{axis_name!r}}})) "
      "(the gradient is then unreduced, and nothing has crossed the wire), or call the "
      "transform inside jax.shard_map over the axis (commopt.data_parallel does).")


def _workers(mesh, axes) -> int:
  n = 1
  for a in axes:
    n *= mesh.shape[a]
  return n


def _per_worker_inputs(fn: str, axes, axis_name, mesh, updates) -> Any:
  """Unreduced ``updates`` as per-worker rows ``[N, ...]`` sharded over the data axes: row
  ``i`` is ``N`` times device ``i``'s partial sum (no communication)."""
  n = _workers(mesh, axes)
  want = frozenset(axes)

  def one(path, x):
    if not want <= _unreduced(x):
      raise _no_input_error(fn, axis_name, path, x)
    spec = _spec(x)
    scale = jnp.asarray(n, x.dtype)
    return jax.shard_map(lambda v: v[None] * scale, mesh=mesh,
                         in_specs=P(*spec, unreduced=set(_unreduced(x))),
                         out_specs=lay.stacked_spec(spec, axes), check_vma=False)(x)

  return jax.tree_util.tree_map_with_path(one, updates)


def accepting(tx: optax.GradientTransformation, axis_name,
              fn: str) -> optax.GradientTransformationExtraArgs:
  """``tx`` (a transform that reduces over ``axis_name``) taking the global view where
  :func:`global_mesh` finds one, and running as it is everywhere else.

  Args:
    tx: the reducing transform.
    axis_name: its data axis or axes (None: never the global view).
    fn: its name, for errors.

  Which form the values take is read from their types: inputs unreduced over the
  axes are partial sums; otherwise parameters whose every leaf leads with a
  dimension of ``N`` sharded over the data axes are each worker's own (the
  synchronisation modes keep them so), with inputs alike.
  """
  tx = optax.with_extra_args_support(tx)
  if axis_name is None:
    return tx
  axes = base.axis_names(axis_name)
  views: dict = {}

  def view_of(mesh, stacked: bool) -> View:
    if (mesh, stacked) not in views:
      views[mesh, stacked] = View(fn=fn, mesh=mesh, axis_name=axis_name, tx=tx,
                                  local_params=stacked)
    return views[mesh, stacked]

  def init_fn(params):
    mesh = global_mesh(axis_name)
    if mesh is None:
      return tx.init(params)
    stacked = _stacked_form(params, axes, _workers(mesh, axes))
    view = view_of(mesh, stacked)
    if stacked:   # the first worker's parameters: the workers start alike
      params = jax.tree.map(lambda x: x.at[0].get(out_sharding=P(*tuple(_spec(x))[1:])),
                            params)
    layout = view.layout(view.abstract(params, False))
    params = jax.tree.map(lambda x: jax.reshard(x, _spec(x)) if _reduced(x) else x, params)
    return lay.init_on_blocks(tx, layout, mesh, axes, view._other_axes, params)

  def update_fn(updates, state, params=None, **extra_args):
    mesh = global_mesh(axis_name)
    if mesh is None:
      return tx.update(updates, state, params, **extra_args)
    n = _workers(mesh, axes)
    stacked = (params is not None and _stacked_form(params, axes, n)
               and not any(_unreduced(x) for x in jax.tree.leaves(updates)))
    view = view_of(mesh, stacked)
    if stacked:
      grads, abstract = updates, view.abstract(params, True)
      for path, g in jax.tree_util.tree_flatten_with_path(updates)[0]:
        if jnp.ndim(g) == 0 or g.shape[0] != n or tuple(_spec(g))[0] != lay.data_spec(axes):
          raise _no_input_error(fn, axis_name, path, g)
    else:
      grads = _per_worker_inputs(fn, axes, axis_name, mesh, updates)
      abstract = view.abstract(updates, False)
    layout = view.layout(abstract)
    plain = None if params is None else jax.tree.map(
        lambda x: jax.reshard(x, _spec(x)) if _reduced(x) else x, params)
    out, new_state = lay.update_on_blocks(
        tx, layout, mesh, axes, view._other_axes, stacked, grads, state, plain,
        extra_args, view.check_replicated)
    if params is not None and not stacked:
      # Parameters the user keeps reduced get updates typed alike (``p - u`` needs it).
      out = jax.tree.map(
          lambda u, p: jax.reshard(u, P(*_spec(p), reduced=set(_reduced(p))))
          if _reduced(p) else u, out, params)
    return out, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)

