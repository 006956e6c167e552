"""Orbax checkpoints of a data-parallel run, verified, restorable onto another number of workers.

A checkpoint holds the parameters, the full optimizer state (every worker's
error-feedback residuals included), optionally the model's mutable state and
the step number. :func:`restore` puts it back on the devices a
:class:`~commopt.DataParallel` step uses:

- saved with as many workers as the step has: restored straight onto
  :meth:`~commopt.DataParallel.abstract_state` (each process reads only the
  shards its devices hold), and the run continues bit for bit;
- saved with another number: the optimizer state is read whole and resized
  by :meth:`~commopt.DataParallel.resize_state`, whose rule keeps the
  workers' mean residual (what error feedback owes the model) exactly;
- parameters sharded over other mesh axes (the shard-local step, its state
  sharded like them): every leaf is a global array, placed onto the step's
  sharding whatever the saved mesh's shape; a two-phase server memory (each
  device's block of its parameter) is re-laid out by the layout orbax
  recorded when it was saved.

Every process of a multi-process run calls :func:`save` and :func:`restore`
with the same arguments; orbax writes each shard once.

**Verification.** :func:`save` also writes ``commopt_checksums.json`` (the
name is :data:`CHECKSUMS`) into the checkpoint: for every leaf its key path,
shape, dtype, and a BLAKE2b hash of the bytes of each distinct shard of the
global array, keyed by the shard's global index (a replicated leaf is one
shard). Each process hashes the shards its devices hold (replica 0 only), the
hashes are gathered, and the primary process writes the file inside orbax's
temporary directory, before the rename that commits the checkpoint: a
checkpoint exists complete with its checksums or not at all, and a save killed
midway leaves the previous checkpoint as it was. Orbax's own
``_CHECKPOINT_METADATA`` records that the file exists and its hash.
:func:`restore` checks orbax's metadata files and the checksum file, then
hashes what it read (each process the shards it holds, the verdict agreed by
all, so every process raises together) and raises
:class:`CorruptCheckpointError` naming the checkpoint and the damaged file or
leaf; restore an earlier checkpoint then. Rules:

- a checkpoint whose ``_CHECKPOINT_METADATA`` records checksums but whose
  checksum file is missing or altered is corrupt;
- a checkpoint written before checksums existed (neither the record nor the
  file) restores as before, **unverified**;
- a missing, truncated or garbled ``_METADATA`` or ``_CHECKPOINT_METADATA``
  (orbax's files) is corrupt, and so is array data orbax reports as lost.

Example::

    from commopt import checkpoint
    checkpoint.save("/ckpt/step_100", params, opt_state, step=100)
    ...
    restored = checkpoint.restore("/ckpt/step_100", dp, params)   # params: arrays or shapes
    params, opt_state, step = restored.params, restored.opt_state, restored.step

**A directory of steps.** :class:`CheckpointManager` is orbax's
``CheckpointManager`` with the same content, checksums, verification and
resize: each step is a directory ``ROOT/<step>`` that holds orbax's
``_CHECKPOINT_METADATA`` (with the checksum record) and the item
``state/``, laid out as a :func:`save` checkpoint (the arrays, orbax's
``_METADATA`` and ``commopt_checksums.json``), and ``metrics/`` when the
manager ranks steps by a metric. On top it keeps the last ``max_to_keep``
steps, or the best ``max_to_keep`` by ``best_fn`` of the metrics saved with
each, saves every ``save_interval_steps`` steps, and with ``async_save=True``
writes in the background. The checksum file is written by the item's orbax
handler when orbax finalizes it, inside the step's temporary directory and
before the rename that commits the step, under an asynchronous save too (the
hashes are taken from the arrays when :meth:`CheckpointManager.save` is
called): a step exists complete with its checksums or not at all. ::

    with checkpoint.CheckpointManager("/ckpt", max_to_keep=3, async_save=True) as mgr:
      for step in range(first, steps):
        params, opt_state, losses = dp.step(params, opt_state, batch)
        mgr.save(step, params, opt_state)          # every process; returns whether it saved
    ...
    restored = checkpoint.CheckpointManager("/ckpt").restore(dp, params)   # the latest step

Needs ``orbax-checkpoint`` (``pip install orbax-checkpoint``, or commopt's
``checkpoint`` extra).
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

# The package, one concept a module:
#   _files      the files' names, CorruptCheckpointError, reading orbax's JSON metadata;
#   _checksums  hashing the shards, the checksum file, verifying what was read;
#   _handler    orbax's handler that writes the checksum file as it commits a save;
#   _restore    the restore path save's checkpoints and a manager's steps share (and resize);
#   _manager    CheckpointManager, a directory of steps.
# save and restore are here.
from commopt.checkpoint import _files, _handler, _restore
from commopt.checkpoint._files import CHECKSUMS, ITEM, CorruptCheckpointError
from commopt.checkpoint._restore import Restored  # (before the manager, as the docs list them)
from commopt.checkpoint._manager import CheckpointManager
from commopt.parallel._data_parallel import DataParallel

__all__ = ["CHECKSUMS", "ITEM", "CorruptCheckpointError", "Restored", "save", "restore",
           "CheckpointManager"]


def save(directory, params, opt_state, *, model_state=None, step: Optional[int] = None,
         force: bool = False) -> str:
  """Writes a checkpoint of a data-parallel run to ``directory`` and waits until it is on disk.

  The write is atomic (orbax writes a temporary directory and renames it), and
  the checkpoint carries the checksums :func:`restore` verifies (see the
  module's description). For a directory of steps with retention, best-k and
  asynchronous saves, see :class:`CheckpointManager`.

  Args:
    directory: a path that does not exist yet (or ``force=True`` to replace it).
    params: the parameters.
    opt_state: the optimizer state from the step (per-worker leaves stacked).
    model_state: the model's mutable state (batch statistics), if any.
    step: the step number to store with it.
    force: replace an existing checkpoint.

  Returns:
    The absolute path written.

  Examples:
    >>> import tempfile, jax.numpy as jnp
    >>> from commopt import checkpoint
    >>> path = checkpoint.save(tempfile.mkdtemp() + "/step_1", {"w": jnp.ones(3)},
    ...                        {"count": jnp.zeros((), jnp.int32)}, step=1)
    >>> import os; os.path.isfile(os.path.join(path, checkpoint.CHECKSUMS))
    True
  """
  ocp = _files.orbax()
  path = os.path.abspath(os.fspath(directory))
  if step is not None and (isinstance(step, bool) or not isinstance(step, (int, np.integer))):
    raise ValueError(f"checkpoint.save: `step` must be an int or None, got {step!r}.")
  args, record = _handler.save_args("checkpoint.save", params, opt_state, model_state, step)
  handler, _, _ = _handler.handler_types()
  with ocp.AsyncCheckpointer(handler()) as ckpt:
    ckpt.save(path, args=args, force=force, custom_metadata=record)
    ckpt.wait_until_finished()
  return path


def restore(directory, dp: DataParallel, params, *, model_state=None) -> Restored:
  """Reads a checkpoint written by :func:`save` onto ``dp``'s devices, and verifies it.

  Every leaf read is hashed against the checksums saved with it. A checkpoint
  written before :func:`save` wrote checksums restores unverified.

  Args:
    directory: the checkpoint's path.
    dp: the step that continues the run (its mesh may have another number of
      workers than the run that saved it).
    params: this run's parameters, as arrays or ``jax.ShapeDtypeStruct``\\ s:
      they give the structure, shapes and dtypes (not the values).
    model_state: likewise for the model's mutable state, when one was saved.

  Returns:
    A :class:`Restored`.

  Raises:
    CorruptCheckpointError: a metadata or checksum file is missing or damaged,
      or a leaf's data differs from its checksum (restore an earlier
      checkpoint).
    ValueError: the arguments do not fit the checkpoint.
  """
  ocp = _files.orbax()
  path = os.path.abspath(os.fspath(directory))
  if not os.path.isdir(path):
    raise ValueError(f"checkpoint.restore: `directory` {path!r} does not exist.")

  def read(target):
    with ocp.StandardCheckpointer() as ckpt:
      return ckpt.restore(path, target)

  where = _files.Where("checkpoint.restore", path, "", f"the checkpoint {path!r}",
                       _files.EARLIER, read)
  return _restore.restore_at(where, dp, params, model_state)
