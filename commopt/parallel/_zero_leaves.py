"""The leaves of ZeRO-3's sharded state: parameters (:class:`ShardedLeaf`) and the
workers' error memories (:class:`ResidualLeaf`).

With ``zero_data_parallel(..., error_feedback=True)`` every worker keeps, per parameter,
what its encoded gradient chunks have not carried yet: the whole flat leaf, ``[N, c]``
(one row per owner), in ``residual_dtype``. That is a full gradient per device, the
memory ZeRO exists to save, so it is off by default. A :class:`ResidualLeaf` holds every
worker's memory as one global array, ``[W·N, c]`` (``[L, W·N, c]`` for a stack of ``L``
layers) sharded over the data axis: device ``w`` holds its own ``[N, c]``.

A checkpoint keeps them whole (``[W, *shape]``, one memory per worker); restored onto
another number of workers they follow the library's resize rule (new worker ``j`` takes
the overlap-weighted average of the old workers' memories, so the mean over workers, the
update error feedback still owes, is conserved; see :mod:`commopt.parallel._resize`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from commopt.parallel import _zero_tp as zero_tp
from commopt.parallel._resize import overlap_weights, path_key


class _Rows:
  """A leaf's ``rows`` (a pytree child) and its one-layer ``shape``, ``dtype``, stack
  ``layers`` and model-axes spec ``tp`` (static; see :mod:`._zero_tp`)."""

  def __init__(self, rows, shape, dtype, layers=None, tp=None):
    self.rows = rows
    self.shape = tuple(shape)
    self.dtype = np.dtype(dtype)
    self.layers = layers
    self.tp = tp

  def tree_flatten(self):
    return (self.rows,), (self.shape, self.dtype.name, self.layers, self.tp)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], *aux)


@jax.tree_util.register_pytree_node_class
class ShardedLeaf(_Rows):
  """One parameter sharded over the data axis: ``rows`` ``[N, c]`` (``[L, N, c]`` for a
  stack of ``L`` layers, each layer sharded by itself), and one layer's ``shape`` and the
  ``dtype`` (static). A parameter sharded over model axes too (``tp``, a spec of one
  layer) has its ``T`` blocks' rows side by side: ``[N, T·c]``."""

  @property
  def full_shape(self) -> tuple:
    """The parameter's shape (with its layer axis first for a stack)."""
    return self.shape if self.layers is None else (self.layers,) + self.shape

  def __repr__(self) -> str:
    rows = getattr(self.rows, "shape", self.rows)
    tp = "" if self.tp is None else f", tp={self.tp}"
    return (f"ShardedLeaf(shape={self.full_shape}, dtype={self.dtype.name}, rows={rows}{tp})")


@jax.tree_util.register_pytree_node_class
class FedLeaf(ShardedLeaf):
  """Inside the step with error feedback: a :class:`ShardedLeaf` carrying this worker's
  error memory (``residual``, ``[N, c]`` or ``[L, N, c]``) and its index among the
  parameters (``slot``, static)."""

  def __init__(self, rows, residual, shape, dtype, layers, slot, tp=None):
    super().__init__(rows, shape, dtype, layers, tp)
    self.residual = residual
    self.slot = slot

  def tree_flatten(self):
    return (self.rows, self.residual), (self.shape, self.dtype.name, self.layers, self.slot,
                                        self.tp)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], children[1], *aux)


@jax.tree_util.register_pytree_node_class
class ResidualLeaf(_Rows):
  """Every worker's error memory of one parameter: ``rows`` ``[W·N, c]`` (``[L, W·N, c]``
  for a stack), sharded over the data axis; the parameter's one-layer ``shape``, the
  memory's ``dtype`` and the stack's ``layers`` (static)."""

  def __repr__(self) -> str:
    rows = getattr(self.rows, "shape", self.rows)
    return f"ResidualLeaf(shape={self.shape}, dtype={self.dtype.name}, rows={rows})"


class ZeroFeedbackState(NamedTuple):
  """``zero_data_parallel``'s optimizer state with error feedback: ``tx``'s state and a
  tree of :class:`ResidualLeaf` shaped as the parameters."""
  opt_state: Any
  residuals: Any


def is_residual(x) -> bool:
  return isinstance(x, ResidualLeaf)


def is_sharded(x) -> bool:
  return isinstance(x, ShardedLeaf)


def is_state_leaf(x) -> bool:
  return isinstance(x, ShardedLeaf) or is_residual(x)


def merge(sharded, residuals):
  """``sharded`` with each leaf carrying its error memory (a tree of :class:`FedLeaf`)."""
  leaves, treedef = jax.tree.flatten(sharded, is_leaf=is_sharded)
  memories = jax.tree.leaves(residuals, is_leaf=is_residual)
  return treedef.unflatten([FedLeaf(leaf.rows, e.rows, leaf.shape, leaf.dtype, leaf.layers, i,
                                    leaf.tp)
                            for i, (leaf, e) in enumerate(zip(leaves, memories))])


def split(fed_grads, residuals, gathered: set):
  """``(gradients as ShardedLeaf, new error memories)`` from the gradient of a
  :func:`merge`'d tree: a memory's gradient is its new value (see
  :func:`commopt.comm._zero.gather`); a leaf the loss never gathered keeps its memory."""
  fed, treedef = jax.tree.flatten(fed_grads, is_leaf=is_sharded)
  old = jax.tree.leaves(residuals, is_leaf=is_residual)
  grads = [ShardedLeaf(f.rows, f.shape, f.dtype, f.layers, f.tp) for f in fed]
  new = [ResidualLeaf(f.residual if f.slot in gathered else e.rows, e.shape, e.dtype, e.layers,
                      e.tp) for f, e in zip(fed, old)]
  return treedef.unflatten(grads), treedef.unflatten(new)


def spec(axis_name, layers, model_axes=()) -> P:
  """A leaf's rows over the data axis: ``[N, c]``, or ``[L, N, c]`` by layer for a stack;
  their columns over ``model_axes`` (a parameter's blocks side by side, :mod:`._zero_tp`)."""
  cols = () if not model_axes else (model_axes[0] if len(model_axes) == 1 else model_axes,)
  return P(axis_name, *cols) if layers is None else P(None, axis_name, *cols)


def rows_spec(leaf, axis_name) -> P:
  """:func:`spec` of a :class:`ShardedLeaf` or :class:`ResidualLeaf` (its stack and blocks)."""
  return spec(axis_name, leaf.layers, zero_tp.axes_of(leaf.tp))


def _place(rows: np.ndarray, slot, mesh, axis_name) -> ResidualLeaf:
  put = jax.device_put(rows.astype(slot.dtype), NamedSharding(mesh, rows_spec(slot, axis_name)))
  return ResidualLeaf(put, slot.shape, slot.dtype, slot.layers, slot.tp)


def zeros_like(leaf, dtype, mesh, axis_name, workers: int) -> ResidualLeaf:
  """Zero memories for the :class:`ShardedLeaf` ``leaf`` (rows ``[N, c]`` or ``[L, N, c]``;
  ``[N, T·c]`` beside model axes)."""
  n, c = leaf.rows.shape[-2:]
  lead = () if leaf.layers is None else (leaf.layers,)
  sharding = NamedSharding(mesh, rows_spec(leaf, axis_name))
  rows = jax.jit(lambda: jnp.zeros(lead + (workers * n, c), dtype), out_shardings=sharding)()
  return ResidualLeaf(rows, leaf.shape, dtype, leaf.layers, leaf.tp)


def whole(leaf: ResidualLeaf, mesh, workers: int) -> jax.Array:
  """``[W, *shape]`` (``[W, L, *shape]`` for a stack): each worker's memory as a leaf of the
  parameter's shape, replicated (the padding dropped)."""
  replicated = NamedSharding(mesh, P())
  rows = jax.device_put(leaf.rows, replicated)

  def per_worker(r):            # [W·N, c] -> [W, *shape]
    return jax.vmap(lambda x: zero_tp.join(x, leaf.shape, leaf.tp, mesh))(
        r.reshape(workers, -1, r.shape[-1]))
  fn = per_worker if leaf.layers is None else (
      lambda r: jnp.swapaxes(jax.vmap(per_worker)(r), 0, 1))
  with jax.set_mesh(mesh):
    return jax.jit(fn, out_shardings=replicated)(rows)


def from_whole(value, slot: ResidualLeaf, mesh, axis_name, workers: int) -> ResidualLeaf:
  """The :class:`ResidualLeaf` of ``slot``'s layout from :func:`whole`'s ``[W_old, ...]``,
  saved by ``W_old`` workers: averaged onto ``workers`` by the resize rule (the mean over
  workers conserved), then cut into each worker's rows."""
  value = np.asarray(jax.device_get(value), np.float64)
  old = value.shape[0]
  value = np.tensordot(overlap_weights(old, workers), value, axes=(1, 0))   # [W, ...]
  cut = lambda v: zero_tp.cut(v, slot.tp, mesh, workers)
  if slot.layers is None:
    rows = np.concatenate([cut(v) for v in value])
  else:
    rows = np.stack([np.concatenate([cut(v[layer]) for v in value])
                     for layer in range(slot.layers)])
  return _place(rows, slot, mesh, axis_name)


def _path_name(path) -> str:
  """A tree path as ``a/b/0``, whatever node types spell it (see :func:`_resize.path_key`)."""
  return "/".join(path_key(path))


def restore_state(template, whole_state, shard_value, mesh, axis_name, workers: int):
  """``ZeroDataParallel.reshard_state``: the leaves of ``whole_state`` (a whole state, by
  path) placed as the slots of ``template`` (``tx.init``'s shapes, with residual slots):
  sharded leaves by ``shard_value(value, stacked, tp)``, memories by :func:`from_whole`,
  the rest replicated."""
  slots, treedef = jax.tree_util.tree_flatten_with_path(template, is_leaf=is_state_leaf)
  # By path, not by position: a checkpoint restored without a target turns named tuples
  # into dicts (their keys sorted) and tuples into lists.
  values = {_path_name(path): value
            for path, value in jax.tree_util.tree_flatten_with_path(whole_state)[0]}
  out = []
  for path, slot in slots:
    name = _path_name(path)
    if name not in values:
      raise ValueError(
          f"zero_data_parallel.reshard_state: the state has no leaf {name!r}, which "
          f"tx.init of these parameters has (it has {sorted(values)[:6]}...); it was made "
          "for another optimizer or other parameters.")
    value = values[name]
    if is_residual(slot):
      lead = () if slot.layers is None else (slot.layers,)
      if tuple(np.shape(value))[1:] != lead + slot.shape:
        raise ValueError(
            f"zero_data_parallel.reshard_state: the error memory {name!r} has shape "
            f"{tuple(np.shape(value))} where [workers, *{lead + slot.shape}] is expected.")
      out.append(from_whole(value, slot, mesh, axis_name, workers))
    elif is_sharded(slot):
      if tuple(np.shape(value)) != slot.full_shape:
        raise ValueError(
            f"zero_data_parallel.reshard_state: the leaf {name!r} has shape "
            f"{tuple(np.shape(value))} where its parameter has shape {slot.full_shape}.")
      out.append(shard_value(np.asarray(jax.device_get(value)), slot.layers is not None,
                             slot.tp))
    else:
      # By the host: a new buffer, never one the caller's state (donated later) holds.
      out.append(jax.device_put(np.asarray(jax.device_get(value), slot.dtype),
                                NamedSharding(mesh, P())))
  return jax.tree.unflatten(treedef, out)
