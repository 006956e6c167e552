"""The restore path that :func:`restore` and :meth:`CheckpointManager.restore` share.

:func:`restore_at` checks orbax's metadata files and reads the checksum
record, reads the saved tree onto the step's layout when it was saved with as
many workers (else as saved, replicated), each leaf in its saved dtype,
verifies it against the checksums, casts it to the dtypes asked for, and
resizes the optimizer state (and per-worker parameters) onto the step's
number of workers. Over the model axes every leaf is a global array that is
read straight onto the step's sharding, whatever the saved mesh; the
exception, a two-phase server memory of a model-sharded parameter (each
device's block, flattened), is re-laid out by the layout orbax recorded when
it was saved (:mod:`commopt.parallel._resize`).
"""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple, Optional

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from commopt.checkpoint import _checksums
from commopt.checkpoint._checksums import is_key
from commopt.checkpoint._files import TREE_FILE, Where, brief, check_json_files, corrupt, orbax
from commopt.parallel import _resize
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


def _saved_tree(ocp, where: Where):
  """The saved tree's metadata (shapes and dtypes), every file it comes from checked."""
  from etils import epath
  check_json_files(where)
  handler = ocp.StandardCheckpointHandler()
  try:
    md = handler.metadata(epath.Path(os.path.join(where.path, where.item)))
  except Exception as e:  # noqa: BLE001 - reading metadata only reads files
    raise corrupt(where, f"orbax cannot read the metadata of its arrays ({brief(e)})") from e
  finally:
    handler.close()
  md = getattr(md, "item_metadata", md)
  tree = getattr(md, "tree", md)
  if not (isinstance(tree, dict) and "params" in tree and "opt_state" in tree):
    keys = sorted(tree) if isinstance(tree, dict) else type(tree).__name__
    raise corrupt(where, f"orbax's tree metadata {where.file(TREE_FILE)} does not hold "
                         f"'params' and 'opt_state' (it holds {keys})")
  return tree


def _cast(x, t):
  """``x``, read in its saved dtype, in the dtype ``t`` asks for (on the same devices)."""
  if is_key(x.dtype) or is_key(t.dtype) or x.dtype == jax.dtypes.canonicalize_dtype(t.dtype):
    return x
  return jax.jit(lambda v: v.astype(t.dtype), out_shardings=x.sharding)(x)


_UNREADABLE = ("DATA_LOSS", "decompress", "Error reading")
"""Words of tensorstore's errors for stored bytes it cannot decode (a damaged chunk: which
one a flipped bit reaches, and whether its checksum or its decompression notices first,
depends on how the chunks were laid out)."""


def _read(where: Where, target):
  try:
    return where.read(target)
  except Exception as e:  # noqa: BLE001
    if not (isinstance(e, json.JSONDecodeError) or any(w in str(e) for w in _UNREADABLE)):
      raise
    raise corrupt(where, f"orbax cannot read its arrays ({brief(e)})") from e


def _saved_layouts(tree) -> dict:
  """``path_key -> (spec, axis sizes)``: how each leaf of the saved metadata ``tree`` was split
  over the mesh it was saved on, from orbax's sharding metadata; None where orbax recorded no
  ``NamedSharding`` (a host array, or a checkpoint without the ``_sharding`` file)."""
  out = {}
  for p, m in jax.tree_util.tree_flatten_with_path(tree)[0]:
    sharding = getattr(m, "sharding", None)
    names = getattr(sharding, "axis_names", None)
    sizes = getattr(sharding, "shape", None)
    spec = getattr(sharding, "partition_spec", None)
    layout = None
    if names is not None and sizes is not None and spec is not None:
      layout = (tuple(spec), dict(zip(names, (int(n) for n in np.asarray(sizes).reshape(-1)))))
    out[path_key(p)] = layout
  return out


def restore_at(where: Where, dp: DataParallel, params, model_state) -> Restored:
  """Reads and verifies the checkpoint ``where`` onto ``dp``'s devices: :func:`restore` and
  :meth:`CheckpointManager.restore` (see :func:`restore`)."""
  ocp = orbax()
  fn = where.fn
  if not isinstance(dp, DataParallel):
    raise ValueError(f"{fn}: `dp` must be a commopt.DataParallel (from "
                     f"commopt.data_parallel, or an nnx trainer's .dp), got {dp!r}.")
  expected = _checksums.expected(where)
  params_t, state_t = dp.abstract_state(params)
  replicated = NamedSharding(dp.mesh, P())
  saved = _saved_tree(ocp, where)
  if model_state is None and "model_state" in saved:
    raise ValueError(f"{fn}: the checkpoint holds a model state; pass `model_state` (its "
                     f"structure) to restore it.")
  if model_state is not None and "model_state" not in saved:
    raise ValueError(f"{fn}: `model_state` was given but the checkpoint holds none.")
  shapes = {path_key(p): tuple(m.shape)
            for p, m in jax.tree_util.tree_flatten_with_path(saved["opt_state"])[0]}
  # Onto the step's layout as it is only when every leaf keeps its shape and no two-phase
  # server memory was split over the model axes otherwise (its blocks would be read into
  # other devices' coordinates: it is re-laid out instead, by resize; with several data
  # axes any per-worker leaf split otherwise goes there too, to be refused).
  layouts = _saved_layouts(saved["opt_state"])
  data_sizes = tuple(dp.mesh.shape[a] for a in dp.axes)
  same = (not _resize.relaid_out(layouts, state_t, dp.per_worker(params), data_sizes)
          and all(shapes.get(path_key(p)) == tuple(t.shape)
                  for p, t in jax.tree_util.tree_flatten_with_path(state_t)[0]))
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
  # Read each leaf in the dtype it was saved in (so it can be verified), then cast.
  saved_dtypes = {path_key(p): getattr(m, "dtype", None)
                  for p, m in jax.tree_util.tree_flatten_with_path(saved)[0]}

  def as_stored(p, t):
    d = saved_dtypes.get(path_key(p))
    if d is None or is_key(d) or is_key(t.dtype):
      return t
    d = jax.dtypes.canonicalize_dtype(d)
    return t if d == t.dtype else jax.ShapeDtypeStruct(t.shape, d, sharding=t.sharding)

  got = _read(where, jax.tree_util.tree_map_with_path(as_stored, target))
  if expected is not None:
    _checksums.verify(where, got, expected)
  got = jax.tree.map(_cast, got, target)
  # DataParallel.resize_state's rule, told the saved layout (the state was read whole).
  opt_state = got["opt_state"] if same else dp._placer.resized(
      got["opt_state"], state_t, dp.per_worker(params), "resize_state",
      saved_layouts=layouts)
  if not params_same:
    if not dp.local_params:
      raise ValueError(f"{fn}: the saved parameters' shapes differ from `params`' (a "
                       f"checkpoint of per-worker parameters, local_params=True, restores "
                       f"onto a data_parallel(..., local_params=True) step).")
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
