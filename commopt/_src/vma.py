"""Varying-axis types inside ``jax.shard_map`` (no communication).

Under ``check_vma=True`` every value carries the set of mesh axes it varies
over; these helpers read that set and cast values to varying where two
branches or a loop carry must agree.
"""

from __future__ import annotations

import jax

from commopt._src import compat


def varying_axes(x) -> frozenset:
  """The mesh axes over which ``x`` is typed varying (empty outside shard_map).

  ``x`` may be an array, a tracer or a ``jax.ShapeDtypeStruct`` from
  ``jax.eval_shape`` inside ``shard_map``.
  """
  if isinstance(x, jax.ShapeDtypeStruct):
    return compat.varying_axes_of_struct(x)
  return compat.varying_axes_of_type(jax.typeof(x))


def vary_like(x: jax.Array, like: jax.Array) -> jax.Array:
  """``x`` typed varying over the axes ``like`` varies over (e.g. a scan's initial carry)."""
  missing = tuple(sorted(varying_axes(like) - varying_axes(x)))
  return compat.pcast_varying(x, missing) if missing else x


def vary(x, axes):
  """``x`` typed varying over ``axes`` (a name or tuple of names), casting only what is missing."""
  axes = axes if isinstance(axes, (tuple, list)) else (axes,)
  missing = tuple(a for a in axes if a not in varying_axes(x))
  return compat.pcast_varying(x, missing) if missing else x
