"""Simulated workers: run a transform over N workers with vmap or shard_map.

Both take and return per-worker values stacked on a leading axis, so the same
inputs can be pushed through either and the results compared.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

class Workers(NamedTuple):
  """``init(params) -> stacked state`` and jitted ``update(stacked updates, stacked state)``."""
  init: Callable[[Any], Any]
  update: Callable[[Any, Any], tuple[Any, Any]]


def vmap_workers(tx: optax.GradientTransformation, num_workers: int,
                 axis_name: str = "workers") -> Workers:
  """``num_workers`` simulated workers on one device, via ``jax.vmap(axis_name=...)``.

  ``init`` runs ``tx.init`` inside the vmap over the axis, so a transform can
  size per-worker state for ``num_workers`` workers; each worker's state is
  stacked on a leading axis.

  Examples:
    >>> import jax.numpy as jnp, commopt
    >>> w = commopt.testing.vmap_workers(commopt.compressed_mean(commopt.compressors.identity(), axis_name="workers"), 4)
    >>> state = w.init({"x": jnp.zeros(2)})
    >>> out, state = w.update({"x": jnp.arange(8.0).reshape(4, 2)}, state)
    >>> out["x"][0].tolist()
    [3.0, 4.0]
  """
  init = jax.vmap(tx.init, in_axes=None, axis_size=num_workers, axis_name=axis_name)
  update = jax.jit(jax.vmap(lambda u, s: tx.update(u, s), axis_name=axis_name))
  return Workers(init, update)


def shard_map_workers(tx: optax.GradientTransformation, mesh: jax.sharding.Mesh,
                      axis_name: str | tuple[str, ...]) -> Workers:
  """One worker per device of ``mesh``'s ``axis_name``, via ``jax.shard_map``.

  Inputs are stacked ``[N, ...]`` and placed sharded over the axis for you. A
  tuple of axes (e.g. ``("node", "local")``) stacks the workers of all of
  them, in the mesh's row-major order. ``init`` runs ``tx.init`` inside the
  ``shard_map``, on replicated parameters, so a transform can size
  per-worker state for the mesh; each worker's state is stacked likewise.
  """
  sharded = NamedSharding(mesh, P(axis_name))
  squeeze = lambda t: jax.tree.map(lambda x: x[0], t)
  expand = lambda t: jax.tree.map(lambda x: x[None], t)

  def body(u, s):
    out, new = tx.update(squeeze(u), squeeze(s))
    return expand(out), expand(new)

  mapped = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(axis_name), P(axis_name)),
                                 out_specs=(P(axis_name), P(axis_name))))
  mapped_init = jax.jit(jax.shard_map(lambda p: expand(tx.init(p)), mesh=mesh,
                                      in_specs=P(), out_specs=P(axis_name)))

  def place(tree):
    return jax.device_put(tree, sharded)

  def init(params):
    with jax.set_mesh(mesh):
      return mapped_init(jax.device_put(params, NamedSharding(mesh, P())))

  def update(u, s):
    with jax.set_mesh(mesh):
      # Copies finish before the collectives start (XLA:CPU can otherwise abort
      # on a rendezvous whose last device is still copying its input).
      u, s = jax.block_until_ready((place(u), place(s)))
      return mapped(u, s)

  update.lower = lambda u, s: _lower(mesh, mapped, place(u), place(s))
  return Workers(init, update)


def _lower(mesh, fn, *args):
  with jax.set_mesh(mesh):
    return fn.lower(*args)
