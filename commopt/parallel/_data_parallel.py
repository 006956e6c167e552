"""data_parallel: a jitted shard_map training step whose only reduction is the transform's."""

from __future__ import annotations

from typing import Any, Callable

import math

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from commopt.parallel import _collectives as coll


def _keystr(path) -> str:
  return jax.tree_util.keystr(path) or "<root>"


class DataParallel:
  """A data-parallel trainer over mesh axes (see :func:`data_parallel`).

  Attributes:
    mesh: the device mesh.
    axis_name: the data axis, or a tuple of axes (e.g. ``("node", "local")``).
    num_workers: the number of workers (the product of the axes' sizes).
    varying: after :meth:`init`, one bool per optimizer-state leaf: True where
      the leaf is per-worker (stacked on a leading axis sharded over the data
      axis), False where it is replicated.
  """

  def __init__(self, loss_fn: Callable, tx: optax.GradientTransformation,
               mesh: jax.sharding.Mesh, axis_name: str | tuple[str, ...] = "data"):
    if not callable(loss_fn):
      raise ValueError(f"data_parallel: `loss_fn` must be callable, got {loss_fn!r}.")
    if not (hasattr(tx, "init") and hasattr(tx, "update")):
      raise ValueError(
          f"data_parallel: `tx` must be an optax GradientTransformation, got {tx!r}.")
    if not isinstance(mesh, jax.sharding.Mesh):
      raise ValueError(
          f"data_parallel: `mesh` must be a jax.sharding.Mesh (e.g. "
          f"jax.make_mesh((8,), ('data',))), got {mesh!r}.")
    axes = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    missing = [a for a in axes if a not in mesh.axis_names]
    if not axes or missing or len(set(axes)) != len(axes):
      raise ValueError(
          f"data_parallel: `axis_name` {axis_name!r} must name distinct axes of the mesh, "
          f"whose axes are {tuple(mesh.axis_names)}"
          + (f"; {missing} {'is' if len(missing) == 1 else 'are'} not among them." if missing
             else "."))
    self._axes = axes
    self.loss_fn = loss_fn
    self.tx = tx
    self.mesh = mesh
    self.axis_name = axis_name
    self.num_workers = int(math.prod(mesh.shape[a] for a in axes))
    self.varying = None
    self._treedef = None
    self._jitted = None

  # -- placement ---------------------------------------------------------------

  def _replicated(self):
    return NamedSharding(self.mesh, P())

  def _sharded(self):
    return NamedSharding(self.mesh, P(self.axis_name))

  def place_params(self, params):
    """Replicates ``params`` over the mesh (a no-op when they already are)."""
    return jax.device_put(params, self._replicated())

  def place_batch(self, batch):
    """Shards every batch leaf on its leading axis over the data axis."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
      shape = getattr(leaf, "shape", ())
      if not shape or shape[0] % self.num_workers:
        raise ValueError(
            f"data_parallel: batch leaf {_keystr(path)} has shape {tuple(shape)}; "
            f"its leading axis must be divisible by the {self.num_workers} "
            f"workers on axis {self.axis_name!r}.")
    return jax.device_put(batch, self._sharded())

  # -- state layout ------------------------------------------------------------

  def _spec(self, varying: bool):
    return P(self.axis_name) if varying else P()

  def _unstack(self, leaves, mask):
    return [l[0] if m else l for l, m in zip(leaves, mask)]

  def _stack(self, leaves, mask):
    return [l[None] if m else l for l, m in zip(leaves, mask)]

  def _varies(self, leaf) -> bool:
    return bool(coll.varying_axes(leaf) & set(self._axes))

  def _updated_state_varying(self, params, state_leaves, mask) -> list[bool]:
    """Traces one update and reports which new state leaves vary per worker."""
    seen = []
    axis = self.axis_name

    def body(params, leaves):
      state = jax.tree_util.tree_unflatten(self._treedef, self._unstack(leaves, mask))
      grads = jax.lax.pcast(params, axis, to="varying")
      _, new_state = self.tx.update(grads, state, params)
      new_leaves = jax.tree_util.tree_leaves(new_state)
      seen[:] = [self._varies(l) for l in new_leaves]
      return [l[None] for l in new_leaves]

    abstract = [
        jax.ShapeDtypeStruct(((self.num_workers,) + l.shape) if m else l.shape, l.dtype,
                             sharding=NamedSharding(self.mesh, self._spec(m)))
        for l, m in zip(state_leaves, mask)]
    fn = jax.shard_map(
        body, mesh=self.mesh,
        in_specs=(P(), [self._spec(m) for m in mask]),
        out_specs=[P(axis)] * len(state_leaves))
    jax.eval_shape(fn, params, abstract)
    return seen

  def init(self, params) -> Any:
    """Builds the optimizer state: per-worker leaves stacked, the rest replicated.

    Which leaves are per-worker is found by tracing the update inside
    ``shard_map``: a leaf is per-worker when its new value varies over the data
    axis (an error-feedback residual, or momentum before the reduction).
    """
    with jax.set_mesh(self.mesh):
      params = self.place_params(params)
      state = jax.jit(self.tx.init)(params)
      leaves, self._treedef = jax.tree_util.tree_flatten(state)
      mask = [False] * len(leaves)
      for _ in range(len(leaves) + 1):
        seen = self._updated_state_varying(params, leaves, mask)
        new_mask = [a or b for a, b in zip(mask, seen)]
        if new_mask == mask:
          break
        mask = new_mask
      self.varying = tuple(mask)
      self._jitted = self._build_step()
      placed = [
          jax.device_put(jnp.broadcast_to(l, (self.num_workers,) + l.shape), self._sharded())
          if m else jax.device_put(l, self._replicated())
          for l, m in zip(leaves, mask)]
    return jax.tree_util.tree_unflatten(self._treedef, placed)

  # -- the step ----------------------------------------------------------------

  def _build_step(self):
    axis, mask = self.axis_name, self.varying

    def body(params, leaves, batch):
      state = jax.tree_util.tree_unflatten(self._treedef, self._unstack(leaves, mask))
      # Differentiate a varying copy: gradients stay local, so no dense
      # all-reduce is inserted; the transform does the only reduction.
      local_params = jax.lax.pcast(params, axis, to="varying")
      loss, grads = jax.value_and_grad(self.loss_fn)(local_params, batch)
      updates, new_state = self.tx.update(grads, state, params)
      new_params = optax.apply_updates(params, updates)
      for path, leaf in jax.tree_util.tree_flatten_with_path(new_params)[0]:
        if self._varies(leaf):
          raise ValueError(
              f"data_parallel: the update of parameter {_keystr(path)} differs "
              f"between workers on axis {axis!r}, so the replicas would drift "
              "apart. `tx` must reduce over that axis after anything per-worker, "
              f"e.g. optax.chain(commopt.compressed_mean(c, {axis!r}), "
              "optax.sgd(lr)).")
      new_leaves = jax.tree_util.tree_leaves(new_state)
      return new_params, self._stack(new_leaves, mask), loss[None]

    specs = [self._spec(m) for m in mask]
    fn = jax.shard_map(
        body, mesh=self.mesh,
        in_specs=(P(), specs, P(axis)),
        out_specs=(P(), specs, P(axis)))
    return jax.jit(fn)

  def _args(self, params, opt_state, batch):
    if self._jitted is None:
      raise ValueError("data_parallel: call `init(params)` before `step`.")
    leaves, treedef = jax.tree_util.tree_flatten(opt_state)
    if treedef != self._treedef:
      raise ValueError(
          "data_parallel: `opt_state` does not have the structure that "
          f"`init` returned ({self._treedef}); got {treedef}.")
    return self.place_params(params), leaves, self.place_batch(batch)

  def step(self, params, opt_state, batch):
    """One training step.

    Args:
      params: replicated parameters (placed for you if they are not).
      opt_state: the state from :meth:`init` or a previous step.
      batch: a pytree whose leaves share a leading batch axis, divisible by
        the number of workers; it is sharded over the data axis.

    Returns:
      ``(params, opt_state, losses)`` where ``losses`` holds each worker's
      loss, shape ``[num_workers]`` (no collective is spent on it).
    """
    with jax.set_mesh(self.mesh):
      params, leaves, batch = self._args(params, opt_state, batch)
      new_params, new_leaves, losses = self._jitted(params, leaves, batch)
    return new_params, jax.tree_util.tree_unflatten(self._treedef, new_leaves), losses

  def lower(self, params, opt_state, batch):
    """``jax.jit(...).lower`` of the step, for HLO audits (see :mod:`commopt.wire`)."""
    with jax.set_mesh(self.mesh):
      return self._jitted.lower(*self._args(params, opt_state, batch))


def data_parallel(loss_fn: Callable, tx: optax.GradientTransformation,
                  mesh: jax.sharding.Mesh,
                  axis_name: str | tuple[str, ...] = "data") -> DataParallel:
  """Packages a data-parallel training step over ``mesh``'s ``axis_name``.

  Parameters are replicated; the batch is sharded on its leading axis; each
  worker differentiates ``loss_fn`` on its shard with its gradients kept
  local, and ``tx`` (which must contain a reduction such as
  :func:`~commopt.compressed_mean` over ``axis_name``) does the only
  communication. Per-worker optimizer state is stacked on a leading axis
  sharded over ``axis_name``; the rest stays replicated.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar`` on one worker's shard.
    tx: an optax transformation.
    mesh: a ``jax.sharding.Mesh`` with the axes named by ``axis_name``.
    axis_name: the data axis, or a tuple of axes that together hold the
      workers, e.g. ``("node", "local")`` on a 2-D mesh with
      ``compressed_mean(c, ("node", "local"), strategy="hierarchical")``.

  Returns:
    A :class:`DataParallel` with ``init(params) -> opt_state`` and
    ``step(params, opt_state, batch) -> (params, opt_state, losses)``.

  Example:
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
    >>> losses.shape
    (1,)
  """
  return DataParallel(loss_fn, tx, mesh, axis_name)
