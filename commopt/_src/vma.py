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


def spec_axes(entries) -> tuple[str, ...]:
  """Every mesh axis a ``PartitionSpec`` (or a list of its entries) names, in order."""
  return tuple(a for e in entries if e is not None
               for a in (e if isinstance(e, tuple) else (e,)))


SHARD_AWARE_SCOPE = "commopt_shard_aware"
"""The ``jax.named_scope`` of commopt's code that reduces a model-sharded leaf on purpose.

Inside a ``shard_map`` manual over every mesh axis (the shard-local step of
:func:`~commopt.data_parallel`), a reduction over a leaf sharded over a
model axis sees only this device's shard. commopt's own reductions of that
kind (a compressor's per-shard scale, the agreed non-finite check, a trust
ratio's norm, which add the model-axis sum they need) run inside this
scope; the step refuses, or works around, any other (a user's
``optax.clip_by_global_norm``), which would silently see a shard.
"""


def shard_aware():
  """The context of :data:`SHARD_AWARE_SCOPE`: code traced inside is commopt's own and
  handles model-sharded leaves correctly."""
  return jax.named_scope(SHARD_AWARE_SCOPE)
