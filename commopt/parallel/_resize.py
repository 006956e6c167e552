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
  units of the mean) is carried over element for element.
- **Per-worker state that is not a float** (counters, flags) must be equal on
  every old worker; it is copied. Otherwise resizing raises, except for
  records of the last step that no later step reads before rewriting them
  (DGC's mask of the coordinates it sent, ``sent``), which start again from
  their initial value, zeros.
- **Replicated state** (step counts, keys, the optimizer's moments after the
  reduction) is copied unchanged.
"""

from __future__ import annotations

import math
import jax
import numpy as np

from commopt._src import base

SERVER_FIELD = "server_residual"
RESIDUAL_FIELD = "residual"
LAST_STEP_FIELDS = ("sent",)
"""Fields that record the last step only (rewritten before they are read): reset on resize."""


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


def _rechunk(x: np.ndarray, length: int, old: int, new: int, chunk: int) -> np.ndarray:
  """Chunks ``[old, c]`` of a flat memory of ``length`` values, re-split into ``[new, chunk]``."""
  flat = x.reshape(-1)[:length]
  return np.pad(flat, (0, new * chunk - length)).reshape(new, chunk)


def resize(saved: dict, target, per_worker, *, data_sizes: tuple[int, ...], fn: str) -> list[np.ndarray]:
  """The new state's leaves (host arrays), in ``target``'s flattened order.

  Args:
    saved: ``path_key -> host array`` of the saved state.
    target: the new state, abstract (shapes and dtypes).
    per_worker: a pytree like ``target`` of bools.
    data_sizes: this run's data axis sizes.
    fn: the caller's name, for errors.
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
  out = []
  for (path, want), key, flag in zip(leaves, keys, flags):
    x = np.asarray(saved[key])
    name = jax.tree_util.keystr(path)
    if not flag or old_total == new_total:
      if x.shape != tuple(want.shape):
        raise ValueError(f"{fn}: saved leaf {name} has shape {x.shape}, this run's has "
                         f"{tuple(want.shape)}.")
      out.append(x.astype(want.dtype))
      continue
    if SERVER_FIELD in key:
      out.append(_server(x, key, saved, want, old, new, rest, name, fn))
    elif x.shape[1:] != tuple(want.shape[1:]):
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


def _server(x, key, saved, want, old, new, rest, name, fn) -> np.ndarray:
  """A two-phase server memory re-split into this run's chunks."""
  i = len(key) - 1 - key[::-1].index(SERVER_FIELD)
  sibling = key[:i] + (RESIDUAL_FIELD,) + key[i + 1:]
  if sibling not in saved:
    raise ValueError(f"{fn}: server memory {name} has no worker residual beside it to size it.")
  length = math.prod(saved[sibling].shape[1:])
  chunk_old, chunk_new = x.shape[-1], want.shape[-1]
  # Chunks over the first data axis alone (hierarchical's slow axis) or over all workers.
  over_first = chunk_old == -(-length // old) and chunk_new == -(-length // new)
  over_all = chunk_old == -(-length // (old * rest)) and chunk_new == -(-length // (new * rest))
  if rest > 1 and over_first and over_all:
    raise ValueError(f"{fn}: cannot tell how server memory {name} is chunked over the data "
                     "axes; resize a run with one data axis.")
  if over_first:
    blocks = x.reshape(old, rest, chunk_old)
    parts = [_rechunk(blocks[:, r], length, old, new, chunk_new) for r in range(rest)]
    return np.stack(parts, axis=1).reshape(want.shape).astype(want.dtype)
  if over_all:
    return _rechunk(x, length, old * rest, new * rest, chunk_new).astype(want.dtype)
  raise ValueError(f"{fn}: server memory {name} has chunks of {chunk_old} values for "
                   f"{old * rest} workers, which does not match a memory of {length} values.")
