"""ZeRO-3 on a mesh with model axes beside the data axes (tensor parallel, or HSDP's inner
sharding): each parameter keeps its own sharding over the model axes, and each model
rank's block of it is sharded flat over the data axes by ZeRO, so every device gathers,
compresses and reduce-scatters only its own block.

A parameter of ``shape`` with the model-axes spec ``tp`` (a ``PartitionSpec`` naming no
data axis) is cut into ``T`` blocks of its local shape (``shape`` divided by each
dimension's split), in the device order of the model axes the spec names, dimension by
dimension. Each block is flattened and zero-padded to ``N·c`` as ZeRO's ``[N, c]`` rows,
and the blocks sit side by side: ``rows`` is ``[N, T·c]``, sharded ``P(data, tp_axes)``, so
device ``(j, t)`` holds owner ``j``'s ``c`` coordinates of block ``t``.

In the step the loss runs in a ``shard_map`` manual over the data axes only, the model
axes left to the compiler (the user's loss is the global-view tensor-parallel one). A
gather runs a second ``shard_map``, manual over the leaf's model axes, around
:func:`commopt.comm._zero.gather` on the device's own block; its result is the leaf
sharded by ``tp``. Two limits of nested maps in JAX 0.10 shape the code: a value that
partial evaluation moves from inside a nested map to outside (a residual of autodiff, or
a loop-invariant value a ``scan`` hoists) gets a spec the lowering rejects. So the gather
and its backward pass are one ``custom_vjp`` around two maps (autodiff keeps only the
rows), and the forward map's body is one trip of a ``while_loop`` whose carries all come
from its inputs (partial evaluation neither splits nor hoists it; XLA inlines the trip).
With explicit model axes the data-manual map runs inside ``jax.sharding.auto_axes`` over
them: a map manual over only some axes of an explicit mesh gathers its inputs over the
others at its boundary (both directions, a full copy of every leaf).
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, PartitionSpec as P

from commopt.comm import _zero as zero_comm


def _entry_axes(entry) -> tuple:
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def axes_of(tp: Optional[P]) -> tuple:
  """The mesh axes ``tp`` names, dimension by dimension (the block order)."""
  if tp is None:
    return ()
  return tuple(a for entry in tp for a in _entry_axes(entry))


def splits(tp: Optional[P], ndim: int, mesh) -> tuple:
  """How many blocks each of ``ndim`` dimensions is cut into by ``tp``."""
  entries = tuple(tp or ()) + (None,) * (ndim - len(tuple(tp or ())))
  return tuple(math.prod(mesh.shape[a] for a in _entry_axes(e)) for e in entries)


def local_shape(shape, tp: Optional[P], mesh) -> tuple:
  """One model rank's block of a leaf of ``shape``."""
  return tuple(n // s for n, s in zip(shape, splits(tp, len(shape), mesh)))


def check(tp, shape, mesh, data_axes, where: str) -> Optional[P]:
  """``tp`` as a spec over the model axes (None when it shards nothing), or a ValueError
  naming the leaf ``where``."""
  fn = "zero_data_parallel.shard"
  if tp is None:
    return None
  if not isinstance(tp, P):
    raise ValueError(f"{fn}: the spec of {where} must be a PartitionSpec or None, got {tp!r}.")
  if len(tp) > len(shape):
    raise ValueError(f"{fn}: the spec {tp} of {where} has more entries than its shape "
                     f"{tuple(shape)} has dimensions.")
  named = axes_of(tp)
  bad = [a for a in named if a not in mesh.axis_names or a in data_axes]
  if bad or len(set(named)) != len(named):
    raise ValueError(
        f"{fn}: the spec {tp} of {where} may name only the mesh's model axes, each once "
        f"(not the data axes {tuple(data_axes)}, which ZeRO shards over itself); the model "
        f"axes are {tuple(a for a in mesh.axis_names if a not in data_axes)}.")
  for n, s in zip(shape, splits(tp, len(shape), mesh)):
    if n % s:
      raise ValueError(f"{fn}: the spec {tp} of {where} splits a dimension of {n} into {s} "
                       f"blocks; every split dimension must be a multiple of its blocks "
                       f"(shape {tuple(shape)}).")
  return tp if named else None


def spec_of(value, mesh, data_axes) -> Optional[P]:
  """The model-axes spec of a placed parameter (a ``jax.Array`` on ``mesh``), else None."""
  sharding = getattr(value, "sharding", None)
  if not isinstance(sharding, jax.sharding.NamedSharding) or sharding.mesh.axis_names != \
      mesh.axis_names:
    return None
  return sharding.spec


def cut(value: np.ndarray, tp: Optional[P], mesh, workers: int) -> np.ndarray:
  """``[N, T·c]``: ``value``'s ``T`` blocks (see the module), each as ZeRO's ``[N, c]``."""
  parts = splits(tp, value.ndim, mesh)
  local = local_shape(value.shape, tp, mesh)
  inter = [d for pair in zip(parts, local) for d in pair]
  order = list(range(0, 2 * value.ndim, 2)) + list(range(1, 2 * value.ndim, 2))
  blocks = value.reshape(inter).transpose(order).reshape((-1,) + local)
  rows = np.stack([zero_comm.shard_flat(b, workers) for b in blocks])      # [T, N, c]
  return rows.transpose(1, 0, 2).reshape(workers, -1)


def join(rows: jax.Array, shape, tp: Optional[P], mesh, dtype=None) -> jax.Array:
  """The leaf of ``shape`` from its ``[N, T·c]`` rows (traceable; :func:`cut`'s inverse)."""
  parts = splits(tp, len(shape), mesh)
  local = local_shape(shape, tp, mesh)
  workers, blocks = rows.shape[0], math.prod(parts)
  by_block = rows.reshape(workers, blocks, -1).transpose(1, 0, 2)            # [T, N, c]
  value = jax.vmap(lambda r: zero_comm.unshard_flat(r, local, dtype))(by_block)
  order = [i for d in range(len(shape)) for i in (d, len(shape) + d)]
  return value.reshape(parts + local).transpose(order).reshape(shape)


def gather(rows: jax.Array, shape, tp: P, mesh, axis_name, key=None, residual=None,
           **options) -> jax.Array:
  """The leaf of ``shape``, sharded by ``tp`` over the model axes, from this worker's rows
  ``[T·c]`` (inside a ``shard_map`` manual over the data axes ``axis_name``): each model
  rank gathers its own block (:func:`commopt.comm._zero.gather` with ``options``), and the
  backward pass reduce-scatters each block's gradient the same way. With ``residual``
  (this worker's error memory, ``[N, T·c]``) the gradient is sent with it, and its
  cotangent is the new memory, as :func:`commopt.comm._zero.gather`'s."""
  local = local_shape(shape, tp, mesh)
  model = axes_of(tp)
  row_spec = P(model if len(model) > 1 else model[0])

  def one(r, k, e=None):
    return zero_comm.gather(r, local, axis_name, key=None if key is None else k, residual=e,
                            **options)

  def opaque(r, k):
    # One trip of a while loop (XLA inlines it): partial evaluation neither hoists nor
    # splits what is inside, so no residual leaves this map (see the module).
    first = jax.lax.slice(r, (0,), (1,)).reshape(())
    out = jnp.broadcast_to(first - first, local)     # no constant: nothing known here
    def body(carry):
      i, r, _ = carry
      return i + 1, r, one(r, k)
    return jax.lax.while_loop(lambda c: c[0] < 1, body, (0, r, out))[2]

  def forward(r, k):
    return jax.shard_map(opaque, in_specs=(row_spec, P()), out_specs=tp,
                         axis_names=set(model))(r, k)

  def backward(r, e, k, ct):
    """``(the rows' cotangent, the new memory or None)``: each block's reduce-scatter."""
    memory_spec = P(None, *row_spec)

    def local_vjp(r, e, k, ct):
      return jax.vjp(lambda s, m: one(s, k, m), r, e)[1](ct)
    return jax.shard_map(local_vjp, in_specs=(row_spec, memory_spec, P(), tp),
                         out_specs=(row_spec, memory_spec), axis_names=set(model))(r, e, k, ct)

  @jax.custom_vjp
  def run(r, e, k):
    return forward(r, k)
  run.defvjp(lambda r, e, k: (forward(r, k), (r, e, k)),
             lambda res, ct: (*backward(*res, ct), None))
  return run(rows, residual, jnp.zeros((), jnp.uint32) if key is None else key)


def explicit_model_axes(mesh, data_axes) -> tuple:
  """The mesh's explicit axes that are not data axes (see the module)."""
  return tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types)
               if a not in data_axes and t == AxisType.Explicit)
