"""Where a data-parallel step's values live: per-worker state and the partition specs.

An optimizer state leaf is **per-worker** when its new value varies over the
data axes after one update traced inside ``shard_map`` with local gradients
(an error-feedback residual, momentum before the reduction, a two-phase
server chunk). Per-worker leaves are stacked on a leading axis of size
``num_workers`` sharded over the data axes; every other leaf is replicated
over them. Over the mesh's other axes (tensor parallelism) a leaf keeps the
sharding its type carries, which on a mesh with explicit axes follows the
parameters.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from commopt._src import base
from commopt._src.vma import spec_axes
from commopt.comm import _collectives as coll


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


def per_worker(leaf, axes) -> bool:
  return bool(coll.varying_axes(leaf) & set(axes))


def full_spec(spec, ndim: int) -> P:
  """``spec`` with one entry per dimension (missing trailing entries are None)."""
  entries = list(spec)[:ndim]
  return P(*(entries + [None] * (ndim - len(entries))))


def leaf_spec(x) -> P:
  """The partition spec ``x``'s type carries over the mesh's explicit axes (P() if none)."""
  sharding = getattr(jax.typeof(x), "sharding", None) if not isinstance(
      x, jax.ShapeDtypeStruct) else x.sharding
  spec = getattr(sharding, "spec", None)
  return full_spec(() if spec is None else spec, len(x.shape))


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


def check_no_data_axes(what: str, path, spec: P, axes, fn: str = "data_parallel"):
  clash = sorted(set(spec_axes(spec)) & set(axes))
  if clash:
    raise ValueError(
        f"{fn}: {what} {keystr(path)} is sharded over the data axis {clash} (spec {spec}); "
        "data parallelism keeps parameters whole on every worker of the data axes. Shard "
        "them over other mesh axes only (tensor parallelism), e.g. P(None, 'model').")


def abstract(x, sharding=None) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x),
                              sharding=sharding if sharding is not None else None)


def to_shardings(mesh, specs) -> Any:
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=is_spec)


def unstacked_specs(specs, axes) -> Any:
  """``specs`` with the leading worker dimension of per-worker leaves removed."""
  return jax.tree.map(lambda s: P(*s[1:]) if is_stacked(s, axes) else s, specs,
                      is_leaf=is_spec)


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
