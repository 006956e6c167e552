"""Optimizer state saved with one number of workers, resized for another.

Per-worker leaves are stacked ``[N, ...]`` over the data axes (see
:mod:`commopt.parallel._layout`). Restoring a checkpoint of ``N`` workers onto
``M`` follows one rule, stated on the first data axis (with several data axes
the others must keep their sizes, and only the first changes):

- **Error memories and other per-worker float state** (residuals, DGC's
  momentum and velocity, a robust rule's worker memory): new worker ``j`` takes
  the average of the old workers whose share of the rank interval ``[0, 1)``
  overlaps its own, weighted by the overlap. Halving the workers averages
  pairs; doubling them copies each memory to two workers. Every old worker's
  weights add up to ``M / N``, so the **mean over workers is conserved
  exactly**: ``Σⱼ e'ⱼ / M = Σᵢ eᵢ / N``. That mean is what error feedback owes
  the model, since ``compressed_mean`` averages what the workers send: the
  update it has not delivered yet is ``Σᵢ eᵢ / N``. (Keeping the plain sum
  ``Σᵢ eᵢ`` instead would double the owed update when the workers halve.) In
  sum terms: the new sum is the old one times ``M / N``.
- **Two-phase server memories** (``CompressedMeanState.server_residual``, one
  chunk of the averaged update per worker): the chunks are concatenated and
  re-split into the new number of chunks, so the memory (already in the
  units of the mean) is carried over element for element. For a parameter
  sharded over model axes (the shard-local step), each device chunks the
  flattened block of the parameter it holds, and the memory is tiled over the
  model axes, ``[workers, blocks * chunk]``: it is put back into the
  parameter's coordinates block by block, by the layout it was saved with,
  then cut and chunked by this run's layout, so it survives a change of the
  model axes' sizes too (even one that keeps its shape).
- **Per-worker state that is not a float** (counters, flags) must be equal on
  every old worker; it is copied. Otherwise resizing raises, except for
  records of the last step that no later step reads before rewriting them
  (DGC's mask of the coordinates it sent, ``sent``), which start again from
  their initial value, zeros, and a non-finite skip's per-worker counters
  (``ApplyIfFiniteState``), where every new worker takes the most any old
  worker counted. Such counters saved agreed (one scalar) and restored per
  worker are every worker's, and the other way the most any worker counted.
- **Replicated state** (step counts, keys, the optimizer's moments after the
  reduction) is copied unchanged.

Over the model axes, every other leaf is a global array (residuals, moments
and anchors have their parameter's global shape; PowerSGD's factors are
tiled in the order of the parameter's own sharding), which the caller places
onto this run's sharding as it is. The saved layout of a leaf is
``(spec, axis sizes)`` of the mesh it was saved on (``layouts``): from
orbax's metadata on a restore, from the arrays' own shardings otherwise.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import numpy as np

from commopt._src import base

SERVER_FIELD = "server_residual"
RESIDUAL_FIELD = "residual"
LAST_STEP_FIELDS = ("sent",)
"""Fields that record the last step only (rewritten before they are read): reset on resize."""
SKIP_COUNTER_FIELDS = {"notfinite_count": np.max, "total_notfinite": np.max,
                       "last_finite": np.min}
"""A non-finite skip's per-worker counters (``ApplyIfFiniteState``): on resize every new
worker takes the most any saved worker counted (and ``last_finite`` only if all were)."""


def path_key(path) -> tuple[str, ...]:
  """A key path as plain names: a NamedTuple's fields and a dict's keys read alike.

  orbax restores a NamedTuple state without a target as a dict of its fields
  and tuples as lists, so a checkpoint restored either way matches the state
  leaf for leaf.
  """
  out = []
  for k in path:
    for attr in ("name", "key", "idx"):
      if hasattr(k, attr):
        out.append(str(getattr(k, attr)))
        break
    else:
      out.append(str(k))
  return tuple(out)


def overlap_weights(old: int, new: int) -> np.ndarray:
  """``[new, old]`` weights: new worker ``j``'s share of each old worker's memory.

  ``W[j, i]`` is the length of the overlap of ``[i/old, (i+1)/old)`` and
  ``[j/new, (j+1)/new)``, times ``new``. Rows add up to 1 (an average), columns to
  ``new / old`` (the mean over workers is conserved).
  """
  i = np.arange(old)[None, :]
  j = np.arange(new)[:, None]
  overlap = np.maximum(0, np.minimum((i + 1) * new, (j + 1) * old) - np.maximum(i * new, j * old))
  return overlap.astype(np.float64) / old


def _average(x: np.ndarray, old: int, new: int, rest: int) -> np.ndarray:
  """``x`` ``[old * rest, ...]`` averaged onto ``[new * rest, ...]`` along the first data axis."""
  blocks = x.reshape((old, rest) + x.shape[1:]).astype(np.float64)
  out = np.tensordot(overlap_weights(old, new), blocks, axes=(1, 0))
  return out.reshape((new * rest,) + x.shape[1:]).astype(x.dtype)


def resize(saved: dict, target, per_worker, *, data_sizes: tuple[int, ...], fn: str,
           layouts: Optional[dict] = None) -> list[np.ndarray]:
  """The new state's leaves (host arrays), in ``target``'s flattened order.

  Args:
    saved: ``path_key -> host array`` of the saved state.
    target: the new state, abstract (shapes, dtypes and, for the model axes'
      layout, shardings).
    per_worker: a pytree like ``target`` of bools.
    data_sizes: this run's data axis sizes.
    fn: the caller's name, for errors.
    layouts: ``path_key -> (spec, axis sizes)`` of the saved leaves on the
      mesh they were saved on, or None (or a missing key) where unknown; only
      two-phase server memories of model-sharded parameters read it.
  """
  leaves, _ = jax.tree_util.tree_flatten_with_path(target)
  flags = jax.tree.leaves(per_worker)
  keys = [path_key(p) for p, _ in leaves]
  missing = [jax.tree_util.keystr(p) for (p, _), k in zip(leaves, keys) if k not in saved]
  if missing:
    raise ValueError(
        f"{fn}: the saved state has no leaf for {missing[:5]}{' ...' if len(missing) > 5 else ''}; "
        "it was saved from another optimizer (the saved leaves are "
        f"{['/'.join(k) for k in list(saved)[:8]]}{' ...' if len(saved) > 8 else ''}).")
  new_total = math.prod(data_sizes)
  rest = math.prod(data_sizes[1:])
  leads = {saved[k].shape[0] for k, f in zip(keys, flags) if f and saved[k].ndim}
  if len(leads) > 1:
    raise ValueError(f"{fn}: the saved per-worker leaves disagree on the number of workers "
                     f"({sorted(leads)}); the checkpoint is not one data-parallel state.")
  old_total = leads.pop() if leads else new_total
  if old_total % rest:
    raise ValueError(
        f"{fn}: the saved state has {old_total} workers, which is not a multiple of the "
        f"{rest} workers of this run's other data axes {data_sizes[1:]}; only the first data "
        "axis may change size.")
  old = old_total // rest
  new = data_sizes[0]
  layouts = {} if layouts is None else layouts
  wants = dict(zip(keys, (w for _, w in leaves)))
  moved = moved_leaves(layouts, target, per_worker)
  if rest > 1 and moved:
    raise ValueError(
        f"{fn}: the per-worker leaves {moved[:3]} were saved split over the model axes "
        "differently than this run splits them; with several data axes such state cannot "
        "be re-laid out (keep the model axes' sizes, or resize a run with one data axis).")
  out = []
  for (path, want), key, flag in zip(leaves, keys, flags):
    x = np.asarray(saved[key])
    name = jax.tree_util.keystr(path)
    if flag and SERVER_FIELD in key:
      # Before the shortcut below: a model-sharded memory moves when the model axes change,
      # even with as many workers.
      out.append(_server(x, key, saved, wants, layouts, old, new, rest, name, fn))
      continue
    if key[-1] in SKIP_COUNTER_FIELDS and x.shape != tuple(want.shape):
      # Skip counters saved agreed (a scalar) and restored per worker, the other way, or
      # per worker onto another number of workers: the most any saved worker counted.
      out.append(np.full(want.shape, SKIP_COUNTER_FIELDS[key[-1]](x), want.dtype))
      continue
    if not flag or old_total == new_total:
      if x.shape != tuple(want.shape):
        raise ValueError(f"{fn}: saved leaf {name} has shape {x.shape}, this run's has "
                         f"{tuple(want.shape)}.")
      out.append(x.astype(want.dtype))
      continue
    if x.shape[1:] != tuple(want.shape[1:]):
      raise ValueError(
          f"{fn}: per-worker leaf {name} is {x.shape[1:]} per worker when saved and "
          f"{tuple(want.shape[1:])} here; its layout depends on the number of workers in a "
          "way this rule does not know, so it cannot be resized.")
    elif base.is_float_dtype(x.dtype):
      out.append(_average(x, old, new, rest).astype(want.dtype))
    else:
      blocks = x.reshape((old, rest) + x.shape[1:])
      if not (blocks == blocks[:1]).all():
        if key[-1] in LAST_STEP_FIELDS:
          out.append(np.zeros(want.shape, want.dtype))
          continue
        raise ValueError(
            f"{fn}: per-worker leaf {name} ({x.dtype}) differs between the saved workers; "
            "only float state can be averaged onto another number of workers.")
      out.append(np.broadcast_to(blocks[:1], (new, rest) + x.shape[1:])
                 .reshape(want.shape).astype(want.dtype))
  return out


def _axes(entry) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _tiling(layout, ndim: int):
  """Per dimension of a per-worker leaf after the worker one: the model axes it is split
  over, as ``((name, size), ...)`` (axes of size one left out); None for an unknown layout.

  ``layout`` is ``(spec, axis sizes)``; the worker dimension's entry (the data axes, under
  whatever names the saving run gave them) is skipped.
  """
  if layout is None:
    return None
  spec, sizes = layout
  spec = list(spec)[:ndim] + [None] * (ndim - len(list(spec)[:ndim]))
  return tuple(tuple((a, int(sizes[a])) for a in _axes(e) if int(sizes[a]) > 1)
               for e in spec[1:])


def layout_of(x):
  """``(spec, axis sizes)`` of a ``NamedSharding``, or of an array or ``ShapeDtypeStruct``
  placed with one; a leaf on one device or none is split over no axis: ``((), {})``."""
  sharding = x if isinstance(x, jax.sharding.NamedSharding) else getattr(x, "sharding", None)
  if isinstance(sharding, jax.sharding.NamedSharding):
    return tuple(sharding.spec), dict(sharding.mesh.shape)
  return (), {}


def moved_leaves(layouts: dict, target, per_worker) -> list[str]:
  """The per-worker leaves of ``target`` whose saved split over the model axes (known in
  ``layouts``, ``path_key -> (spec, axis sizes)``) differs from the target's: for a
  two-phase server memory its values must be moved (:func:`resize`), whatever the shapes."""
  out = []
  for (path, want), flag in zip(jax.tree_util.tree_flatten_with_path(target)[0],
                                jax.tree.leaves(per_worker)):
    key = path_key(path)
    if flag and layouts.get(key) is not None:
      ndim = len(want.shape)
      if _tiling(layouts[key], ndim) != _tiling(layout_of(want), ndim):
        out.append(jax.tree_util.keystr(path))
  return out


def relaid_out(layouts: dict, target, per_worker, data_sizes: tuple[int, ...]) -> bool:
  """Whether a state saved with ``layouts`` must go through :func:`resize` even where every
  shape is kept: a two-phase server memory split over the model axes otherwise (its values
  move), or, with several data axes, any per-worker leaf split otherwise (refused there)."""
  moved = moved_leaves(layouts, target, per_worker)
  return any(SERVER_FIELD in m for m in moved) or (len(data_sizes) > 1 and bool(moved))


def _blocks(param_tiling, server_tiling, shape, what: str, fn: str) -> list[tuple]:
  """The blocks (index tuples into the global ``shape``) of a parameter split by
  ``param_tiling``, in the order a server memory split by ``server_tiling`` holds them.

  The step tiles a memory that does not mirror its parameter on its first dimension over
  the parameter's model axes in the mesh's order (:meth:`commopt.transforms._layout.LayoutSolver._state_spec`): the
  block of the device at coordinates ``c`` is ``c`` read row-major over those axes.
  """
  if not any(server_tiling):
    # Split over no model axis: the whole leaf's coordinates, one block (the whole-leaf
    # step's layout, shard_local=False, whatever the parameter's split).
    return [tuple(slice(0, d) for d in shape)]
  order = server_tiling[-1] if server_tiling else ()
  named = {a for entry in param_tiling for a, _ in entry}
  if named != {a for a, _ in order} or any(server_tiling[:-1]):
    raise ValueError(f"{fn}: server memory {what} is split over the model axes "
                     f"{[a for a, _ in order]}, its parameter over {sorted(named)}; this "
                     "layout is not the shard-local step's and cannot be re-laid out.")
  for dim, entry in zip(shape, param_tiling):
    if dim % math.prod(n for _, n in entry):
      raise ValueError(f"{fn}: the parameter of server memory {what}, of shape {shape}, does "
                       f"not split evenly over {entry}.")
  out = []
  for coords in np.ndindex(*[n for _, n in order]):
    at = dict(zip((a for a, _ in order), coords))
    index = []
    for dim, entry in zip(shape, param_tiling):
      j = 0
      for a, n in entry:
        j = j * n + at[a]
      size = dim // math.prod(n for _, n in entry)
      index.append(slice(j * size, (j + 1) * size))
    out.append(tuple(index))
  return out


def _unchunk(x: np.ndarray, length: int, n: int, rest: int, over_first: bool) -> np.ndarray:
  """Chunks ``[n * rest, c]`` of flat memories of ``length`` values: the memories,
  ``[rest, length]`` (one per rank of the other data axes) when chunked over the first data
  axis, else ``[1, length]`` (chunked over all workers)."""
  if over_first:
    blocks = x.reshape(n, rest, -1)
    return np.stack([blocks[:, r].reshape(-1)[:length] for r in range(rest)])
  return x.reshape(-1)[:length][None]


def _chunk(u: np.ndarray, n: int, rest: int, over_first: bool, chunk: int) -> np.ndarray:
  """The inverse of :func:`_unchunk`: memories ``[R, length]`` cut into ``[n * rest, chunk]``
  (zero past ``length``)."""
  length = u.shape[1]
  if over_first:
    parts = [np.pad(u[r], (0, n * chunk - length)).reshape(n, chunk) for r in range(rest)]
    return np.stack(parts, axis=1).reshape(n * rest, chunk)
  return np.pad(u[0], (0, n * rest * chunk - length)).reshape(n * rest, chunk)


def _server(x, key, saved, wants, layouts, old, new, rest, name, fn) -> np.ndarray:
  """A two-phase server memory re-split into this run's chunks (and model blocks).

  Without model sharding it holds the chunks of one flat memory (of as many values as the
  worker residual beside it); with it, the chunks of each device's block of the parameter,
  flattened, one block after another (see the module). The memory is put back into the
  parameter's coordinates by the saved layout, then blocked and chunked by this run's. A
  saved layout that is unknown (host arrays, or arrays read whole) is taken as unsplit,
  what every memory saved before model sharding is; onto a split layout that is refused,
  since the blocks' order could not be told.
  """
  want = wants[key]
  i = len(key) - 1 - key[::-1].index(SERVER_FIELD)
  sibling = key[:i] + (RESIDUAL_FIELD,) + key[i + 1:]
  if sibling not in saved:
    raise ValueError(f"{fn}: server memory {name} has no worker residual beside it to size it.")
  shape = tuple(saved[sibling].shape[1:])   # the residual: the parameter's global shape
  res_ndim = len(shape) + 1
  new_param = _tiling(layout_of(wants[sibling]), res_ndim) if sibling in wants else None
  new_server = _tiling(layout_of(want), 2)
  old_param = _tiling(layouts.get(sibling), res_ndim)
  old_server = _tiling(layouts.get(key), 2)
  new_param = tuple(() for _ in shape) if new_param is None else new_param
  if old_param is None or old_server is None:
    if any(new_param) or any(new_server):
      raise ValueError(
          f"{fn}: server memory {name} is split over the model axes here, but how it was "
          "split when saved is unknown (the saved state holds host arrays, or arrays read "
          "whole); restore with commopt.checkpoint, which reads the saved layout from "
          "orbax's metadata, or pass the saved state as arrays that keep their sharding.")
    old_param, old_server = new_param, new_server
  if (old, x.shape, old_param, old_server) == (new, tuple(want.shape), new_param, new_server):
    return x.astype(want.dtype)             # nothing moves: bit for bit
  old_blocks = _blocks(old_param, old_server, shape, name, fn)
  new_blocks = _blocks(new_param, new_server, shape, name, fn)
  block = lambda index: tuple(s.stop - s.start for s in index)
  length_old, length_new = math.prod(block(old_blocks[0])), math.prod(block(new_blocks[0]))
  if x.shape[-1] % len(old_blocks) or want.shape[-1] % len(new_blocks):
    raise ValueError(f"{fn}: server memory {name} of width {x.shape[-1]} (saved) or "
                     f"{want.shape[-1]} (here) is not tiled over {len(old_blocks)} or "
                     f"{len(new_blocks)} model blocks.")
  chunk_old, chunk_new = x.shape[-1] // len(old_blocks), want.shape[-1] // len(new_blocks)
  # Chunks over the first data axis alone (hierarchical's slow axis) or over all workers.
  over_first = (chunk_old == -(-length_old // old) and chunk_new == -(-length_new // new))
  over_all = (chunk_old == -(-length_old // (old * rest))
              and chunk_new == -(-length_new // (new * rest)))
  if rest > 1 and over_first and over_all:
    raise ValueError(f"{fn}: cannot tell how server memory {name} is chunked over the data "
                     "axes; resize a run with one data axis.")
  if not (over_first or over_all):
    raise ValueError(f"{fn}: server memory {name} has chunks of {chunk_old} values for "
                     f"{old * rest} workers, which does not match a memory of {length_old} "
                     "values.")
  ranks = rest if over_first else 1
  whole = np.zeros((ranks,) + shape, x.dtype)   # the memory in the parameter's coordinates
  for b, index in enumerate(old_blocks):
    part = _unchunk(x[:, b * chunk_old:(b + 1) * chunk_old], length_old, old, rest, over_first)
    whole[(slice(None),) + index] = part.reshape((ranks,) + block(index))
  parts = [_chunk(whole[(slice(None),) + index].reshape(ranks, -1), new, rest, over_first,
                  chunk_new) for index in new_blocks]
  return np.concatenate(parts, axis=1).astype(want.dtype)
