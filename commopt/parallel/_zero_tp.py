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
rows; with hpZ, two such gathers, and the secondary partition between them), and the
forward map's body is one trip of a ``while_loop`` whose carries all come from its inputs
(partial evaluation neither splits nor hoists it; XLA inlines the trip).
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
from jax.ad_checkpoint import checkpoint_name
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


def _blockwise(f, x, e, k, in_spec, out_spec, out_shape, model):
  """``f(x, k, e)`` on this device's block (inside a ``shard_map`` manual over the model
  axes ``model``), differentiable in ``x`` and ``e``: one ``custom_vjp`` around a forward
  and a backward map (see the module), so autodiff keeps only ``x``, ``e`` and ``k``. ``x``
  is flat, ``in_spec`` over the model axes; ``e`` (None, or ``[N, ·]`` sharded like ``x``
  on its second dimension) gets its cotangent from ``f``'s own backward pass."""
  def opaque(x, k):
    # One trip of a while loop (XLA inlines it): partial evaluation neither hoists nor
    # splits what is inside, so no residual leaves this map (see the module).
    first = jax.lax.slice(x, (0,), (1,)).reshape(())
    out = jnp.broadcast_to(first - first, out_shape)     # no constant: nothing known here
    def body(carry):
      i, x, _ = carry
      return i + 1, x, f(x, k, None)
    return jax.lax.while_loop(lambda c: c[0] < 1, body, (0, x, out))[2]

  def forward(x, k):
    return jax.shard_map(opaque, in_specs=(in_spec, P()), out_specs=out_spec,
                         axis_names=set(model))(x, k)

  def backward(x, e, k, ct):
    """``(x's cotangent, e's cotangent or None)``: each block's backward pass."""
    memory_spec = P(None, *in_spec)

    def local_vjp(x, e, k, ct):
      return jax.vjp(lambda s, m: f(s, k, m), x, e)[1](ct)
    return jax.shard_map(local_vjp, in_specs=(in_spec, memory_spec, P(), out_spec),
                         out_specs=(in_spec, memory_spec), axis_names=set(model))(x, e, k, ct)

  @jax.custom_vjp
  def run(x, e, k):
    return forward(x, k)
  run.defvjp(lambda x, e, k: (forward(x, k), (x, e, k)),
             lambda res, ct: (*backward(*res, ct), None))
  return run(x, e, k)


def gather(rows: jax.Array, shape, tp: P, mesh, axis_name, key=None, residual=None,
           **options) -> jax.Array:
  """The leaf of ``shape``, sharded by ``tp`` over the model axes, from this worker's rows
  ``[T·c]`` (inside a ``shard_map`` manual over the data axes ``axis_name``): each model
  rank gathers its own block (:func:`commopt.comm._zero.gather` with ``options``), and the
  backward pass reduce-scatters each block's gradient the same way. With ``residual``
  (this worker's error memory, ``[N, T·c]``) the gradient is sent with it, and its
  cotangent is the new memory, as :func:`commopt.comm._zero.gather`'s. With ``hpz`` the
  two stages are two maps, and the secondary partition between them (``[T·nodes·c]``,
  sharded like the rows) is named :data:`commopt.comm._zero.HPZ_NAME` outside them, so a
  body rematerialised under :data:`~commopt.comm._zero.HPZ_POLICY` keeps it."""
  local = local_shape(shape, tp, mesh)
  model = axes_of(tp)
  row_spec = P(model if len(model) > 1 else model[0])
  k_in = jnp.zeros((), jnp.uint32) if key is None else key
  k_of = lambda k: None if key is None else k
  if options.pop("hpz", False):
    weights, grads = options.get("weights"), options.get("grads")
    n = math.prod(local)
    nodes = math.prod(mesh.shape[a] for a in _entry_axes(axis_name[0]))
    c = rows.shape[0] // math.prod(splits(tp, len(shape), mesh))

    def first(r, k, e):
      r = zero_comm.mask_padding(r, n, axis_name)
      secondary = zero_comm.hpz_secondary(r, axis_name, weights, grads, k_of(k))
      return secondary.reshape(-1).astype(r.dtype)

    def second(s, k, e):
      flat = zero_comm.hpz_whole(s.reshape(nodes, c), axis_name, grads, k_of(k))
      return zero_comm.unshard_flat(flat, local, rows.dtype)

    secondary = _blockwise(first, rows, None, k_in, row_spec, row_spec, (nodes * c,), model)
    secondary = checkpoint_name(secondary, zero_comm.HPZ_NAME)
    return _blockwise(second, secondary, None, k_in, row_spec, tp, local, model)

  def one(r, k, e):
    return zero_comm.gather(r, local, axis_name, key=k_of(k), residual=e, **options)
  return _blockwise(one, rows, residual, k_in, row_spec, tp, local, model)


def explicit_model_axes(mesh, data_axes) -> tuple:
  """The mesh's explicit axes that are not data axes (see the module)."""
  return tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types)
               if a not in data_axes and t == AxisType.Explicit)
