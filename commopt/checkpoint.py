"""Orbax checkpoints of a data-parallel run, restorable onto another number of workers.

A checkpoint holds the parameters, the full optimizer state (every worker's
error-feedback residuals included), optionally the model's mutable state and
the step number. :func:`restore` puts it back on the devices a
:class:`~commopt.DataParallel` step uses:

- saved with as many workers as the step has: restored straight onto
  :meth:`~commopt.DataParallel.abstract_state` (each process reads only the
  shards its devices hold), and the run continues bit for bit;
- saved with another number: the optimizer state is read whole and resized
  by :meth:`~commopt.DataParallel.resize_state`, whose rule keeps the
  workers' mean residual (what error feedback owes the model) exactly.

Every process of a multi-process run calls :func:`save` and :func:`restore`
with the same arguments; orbax writes each shard once.

Example::

    from commopt import checkpoint
    checkpoint.save("/ckpt/step_100", params, opt_state, step=100)
    ...
    restored = checkpoint.restore("/ckpt/step_100", dp, params)   # params: arrays or shapes
    params, opt_state, step = restored.params, restored.opt_state, restored.step

Needs ``orbax-checkpoint`` (``pip install orbax-checkpoint``, or commopt's
``checkpoint`` extra).
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple, Optional

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from commopt.parallel._data_parallel import DataParallel
from commopt.parallel._resize import path_key


class Restored(NamedTuple):
  """What :func:`restore` returns.

  Attributes:
    params: the parameters, placed as the step places them.
    opt_state: the optimizer state for this step's workers.
    model_state: the model's mutable state, or None if none was saved.
    step: the saved step number, or None.
    saved_workers: the number of workers the checkpoint was saved with, read
      from its per-worker leaves; None when it has none (every leaf dense or
      replicated), and then the number of workers does not matter.
  """
  params: Any
  opt_state: Any
  model_state: Any
  step: Optional[int]
  saved_workers: Optional[int]


def _orbax():
  try:
    import orbax.checkpoint as ocp
  except ImportError as e:
    raise ImportError("commopt.checkpoint needs orbax-checkpoint (`pip install "
                      "orbax-checkpoint`, or `pip install commopt[checkpoint]`).") from e
  return ocp


def save(directory, params, opt_state, *, model_state=None, step: Optional[int] = None,
         force: bool = False) -> str:
  """Writes a checkpoint of a data-parallel run to ``directory`` and waits until it is on disk.

  Args:
    directory: a path that does not exist yet (or ``force=True`` to replace it).
    params: the parameters.
    opt_state: the optimizer state from the step (per-worker leaves stacked).
    model_state: the model's mutable state (batch statistics), if any.
    step: the step number to store with it.
    force: replace an existing checkpoint.

  Returns:
    The absolute path written.
  """
  ocp = _orbax()
  path = os.path.abspath(os.fspath(directory))
  if step is not None and (isinstance(step, bool) or not isinstance(step, (int, np.integer))):
    raise ValueError(f"checkpoint.save: `step` must be an int or None, got {step!r}.")
  item = {"params": params, "opt_state": opt_state}
  if model_state is not None:
    item["model_state"] = model_state
  if step is not None:
    item["step"] = np.asarray(step, np.int64)
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(path, item, force=force)
    ckpt.wait_until_finished()
  return path


def _saved_tree(ckpt, path):
  md = ckpt.metadata(path)
  md = getattr(md, "item_metadata", md)
  return getattr(md, "tree", md)


def restore(directory, dp: DataParallel, params, *, model_state=None) -> Restored:
  """Reads a checkpoint written by :func:`save` onto ``dp``'s devices.

  Args:
    directory: the checkpoint's path.
    dp: the step that continues the run (its mesh may have another number of
      workers than the run that saved it).
    params: this run's parameters, as arrays or ``jax.ShapeDtypeStruct``\\ s:
      they give the structure, shapes and dtypes (not the values).
    model_state: likewise for the model's mutable state, when one was saved.

  Returns:
    A :class:`Restored`.
  """
  ocp = _orbax()
  path = os.path.abspath(os.fspath(directory))
  if not os.path.isdir(path):
    raise ValueError(f"checkpoint.restore: `directory` {path!r} does not exist.")
  if not isinstance(dp, DataParallel):
    raise ValueError(f"checkpoint.restore: `dp` must be a commopt.DataParallel (from "
                     f"commopt.data_parallel, or an nnx trainer's .dp), got {dp!r}.")
  params_t, state_t = dp.abstract_state(params)
  replicated = NamedSharding(dp.mesh, P())
  with ocp.StandardCheckpointer() as ckpt:
    saved = _saved_tree(ckpt, path)
    if model_state is None and "model_state" in saved:
      raise ValueError("checkpoint.restore: the checkpoint holds a model state; pass "
                       "`model_state` (its structure) to restore it.")
    if model_state is not None and "model_state" not in saved:
      raise ValueError("checkpoint.restore: `model_state` was given but the checkpoint "
                       "holds none.")
    shapes = {path_key(p): tuple(m.shape)
              for p, m in jax.tree_util.tree_flatten_with_path(saved["opt_state"])[0]}
    same = all(shapes.get(path_key(p)) == tuple(t.shape)
               for p, t in jax.tree_util.tree_flatten_with_path(state_t)[0])
    as_saved = lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=replicated)
    params_same = all(tuple(m.shape) == tuple(t.shape) for m, t in zip(
        jax.tree.leaves(saved["params"]), jax.tree.leaves(params_t)))
    target = {"params": params_t if params_same else jax.tree.map(as_saved, saved["params"]),
              "opt_state": state_t if same else jax.tree.map(as_saved, saved["opt_state"])}
    if model_state is not None:
      target["model_state"] = jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=replicated),
          model_state)
    if "step" in saved:
      target["step"] = as_saved(saved["step"])
    got = ckpt.restore(path, target)
  opt_state = got["opt_state"] if same else dp.resize_state(got["opt_state"], params)
  if not params_same:
    if not dp.local_params:
      raise ValueError("checkpoint.restore: the saved parameters' shapes differ from `params`' "
                       "(a checkpoint of per-worker parameters, local_params=True, restores "
                       "onto a data_parallel(..., local_params=True) step).")
    got["params"] = dp.resize_params(got["params"], params)
  flags = jax.tree.leaves(dp.per_worker(params))
  leads = {shapes[path_key(p)][0] for (p, _), f in
           zip(jax.tree_util.tree_flatten_with_path(state_t)[0], flags)
           if f and shapes.get(path_key(p))}
  saved_workers = leads.pop() if leads else None
  step = got.get("step")
  if step is not None:
    step = int(np.asarray(step.addressable_data(0) if isinstance(step, jax.Array) else step))
  return Restored(got["params"], opt_state, got.get("model_state"), step, saved_workers)
