"""Collectives over a named axis that work under shard_map, vmap and locally.

``axis_name=None`` means one local worker: every collective is the identity.
Inside ``jax.shard_map`` with ``check_vma=True`` the gathered payloads are
typed invariant, so a reduced value can leave the map replicated.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp


def varying_axes(x) -> frozenset:
  """The mesh axes over which ``x`` is typed varying (empty outside shard_map)."""
  aval = jax.typeof(x)
  vma = getattr(aval, "vma", None)
  if vma is None:
    mat = getattr(aval, "mat", None)
    vma = getattr(mat, "varying", frozenset())
  return frozenset(vma)


def vary_like(x: jax.Array, like: jax.Array) -> jax.Array:
  """``x`` typed varying over the axes ``like`` varies over (e.g. a scan's initial carry)."""
  missing = tuple(sorted(varying_axes(like) - varying_axes(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def axis_size(axis_name: Optional[str]) -> int:
  """Number of workers on ``axis_name`` (1 when it is None)."""
  if axis_name is None:
    return 1
  return int(jax.lax.psum(1, axis_name))


def axis_index(axis_name: Optional[str]):
  if axis_name is None:
    return jnp.int32(0)
  return jax.lax.axis_index(axis_name)


def psum(tree: Any, axis_name: Optional[str]) -> Any:
  """All-reduce sum of every leaf (identity locally)."""
  if axis_name is None:
    return tree
  return jax.lax.psum(tree, axis_name)


def pmean(x: jax.Array, axis_name: Optional[str]) -> jax.Array:
  """All-reduce mean in ``x``'s dtype (identity locally)."""
  if axis_name is None:
    return x
  return (jax.lax.psum(x, axis_name) / axis_size(axis_name)).astype(x.dtype)


def all_gather(tree: Any, axis_name: Optional[str]) -> Any:
  """Stacks every worker's leaves on a new leading axis.

  Locally the leading axis has size 1. Under ``shard_map`` the result is typed
  invariant when the input varies over the axis, so a value computed from it
  may be returned replicated.
  """
  if axis_name is None:
    return jax.tree.map(lambda x: x[None], tree)

  def gather(x):
    if axis_name in varying_axes(x):
      return _all_gather_invariant(x, axis_name)
    return jax.lax.all_gather(x, axis_name)

  return jax.tree.map(gather, tree)


def _all_gather_invariant(x, axis_name):
  # Spelled `all_gather(..., to="invarying")` in JAX 0.10; older and newer
  # releases expose `all_gather_invariant`.
  try:
    return jax.lax.all_gather(x, axis_name, to="invarying")
  except TypeError:
    return jax.lax.all_gather_invariant(x, axis_name)
