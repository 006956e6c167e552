"""JAX's types inside a trace: varying-axis types, and the calls whose spelling differs
between the JAX releases commopt supports.

Varying-axis types: under ``jax.shard_map`` with ``check_vma=True`` every value carries
the set of mesh axes it varies over; :func:`varying_axes` reads that set and
:func:`vary` / :func:`vary_like` cast values to varying where two branches or a loop
carry must agree (no communication).

Spellings: tested with JAX 0.10.2 (Python 3.11), 0.11.2 (Python 3.12, on GPU) and
0.12.0.1 (Python 3.13). Every version-specific call in commopt goes through this module,
except the spellings of collectives (``all_gather(..., to="invarying")``), which live in
:mod:`commopt.comm._collectives`, the one module that calls ``jax.lax``'s collectives
(``tests/test_layering.py`` checks every other module, this one included). Each function
says which releases need which spelling.
"""

from __future__ import annotations

import jax


Tracer = jax.core.Tracer
"""The type of a tracer (an abstract value inside ``jit``/``vmap``/``grad``): ``jax.core.Tracer``
in 0.10–0.12; JAX has been moving names out of ``jax.core``, so the spelling lives here."""


def is_tracer(x) -> bool:
  """Whether ``x`` is a tracer (abstract, inside ``jit``/``vmap``/``grad``), not a concrete
  array (``isinstance(x, Tracer)``)."""
  return isinstance(x, Tracer)


def varying_axes_of_type(aval) -> frozenset:
  """The mesh axes a value's type (``jax.typeof(x)``) varies over.

  0.10–0.12 keep them in ``aval.mat.varying`` (a ``ManualAxisType``); the
  ``aval.vma`` of earlier releases is gone.
  """
  return frozenset(getattr(getattr(aval, "mat", None), "varying", None) or ())


def bound_axis_names() -> tuple:
  """The named axes bound where this runs (``jax.shard_map`` manual axes, ``jax.vmap`` names).

  0.10–0.12 keep them in the trace's axis environment
  (``jax._src.core.get_axis_env().axis_names()``), which has no public
  spelling; where that is missing, the current abstract mesh's manual axes.
  Used to word error messages and, by ``wire.record_collectives``, to give
  each device its index over every bound axis.
  """
  try:
    from jax._src import core as _core
    return tuple(_core.get_axis_env().axis_names())
  except (ImportError, AttributeError):
    return tuple(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()) or ())


def varying_axes_of_struct(s: jax.ShapeDtypeStruct) -> frozenset:
  """The same for a ``jax.ShapeDtypeStruct`` from ``jax.eval_shape`` inside shard_map.

  0.10–0.12: ``s.manual_axis_type.varying``.
  """
  return frozenset(getattr(getattr(s, "manual_axis_type", None), "varying", None) or ())


def varying_struct(shape, dtype, axes) -> jax.ShapeDtypeStruct:
  """A ``ShapeDtypeStruct`` typed varying over ``axes`` (e.g. a Pallas kernel's output in shard_map).

  0.10–0.12: ``manual_axis_type=jax.sharding.ManualAxisType(varying=...)``;
  ``pallas_call`` inside a ``shard_map`` with ``check_vma=True`` refuses an
  output shape without it, even an invariant one (``axes`` empty).
  """
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.sharding.ManualAxisType(
      varying=frozenset(axes)))


def pcast_varying(x: jax.Array, axes: tuple) -> jax.Array:
  """``x`` cast to varying over ``axes`` (no communication): ``jax.lax.pcast(..., to="varying")``."""
  return jax.lax.pcast(x, axes, to="varying")


# The Pallas kernels (``commopt.kernels``) target the Triton lowering
# (``jax.experimental.pallas.triton.CompilerParams``). From 0.11 JAX warns, when
# such a kernel is compiled for a GPU, that this backend is deprecated in favour
# of Mosaic GPU; pyproject's pytest settings name that one warning.


def where_traced(eqn) -> str:
  """Where the equation ``eqn`` of a jaxpr was traced, as ``file:line (function)``, for
  messages ('' where unknown).

  0.10–0.12: ``jax._src.source_info_util.summarize(eqn.source_info)``, which
  has no public spelling.
  """
  try:
    from jax._src import source_info_util
    return source_info_util.summarize(eqn.source_info)
  except Exception:   # noqa: BLE001 - a message detail only
    return ""

def varying_axes(x) -> frozenset:
  """The mesh axes over which ``x`` is typed varying (empty outside shard_map).

  ``x`` may be an array, a tracer or a ``jax.ShapeDtypeStruct`` from
  ``jax.eval_shape`` inside ``shard_map``.
  """
  if isinstance(x, jax.ShapeDtypeStruct):
    return varying_axes_of_struct(x)
  return varying_axes_of_type(jax.typeof(x))


def vary_like(x: jax.Array, like: jax.Array) -> jax.Array:
  """``x`` typed varying over the axes ``like`` varies over (e.g. a scan's initial carry)."""
  missing = tuple(sorted(varying_axes(like) - varying_axes(x)))
  return pcast_varying(x, missing) if missing else x


def vary(x, axes):
  """``x`` typed varying over ``axes`` (a name or tuple of names), casting only what is missing."""
  axes = axes if isinstance(axes, (tuple, list)) else (axes,)
  missing = tuple(a for a in axes if a not in varying_axes(x))
  return pcast_varying(x, missing) if missing else x


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
