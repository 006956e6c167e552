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
  workers' mean residual (what error feedback owes the model) exactly.

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

import dataclasses
import functools
import hashlib
import json
import os
from typing import Any, Callable, NamedTuple, Optional

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from commopt._src import base
from commopt.parallel._data_parallel import DataParallel
from commopt.parallel._resize import path_key

CHECKSUMS = "commopt_checksums.json"
"""The name of the checksum file :func:`save` writes into each checkpoint."""

ITEM = "state"
"""The item (subdirectory) of a :class:`CheckpointManager` step that holds the checkpoint."""

_RECORD = "commopt_checksums"  # the key of its record in orbax's custom metadata
_FORMAT = "commopt.checkpoint.checksums"
_VERSION = 1
_HASH = "blake2b-128"
_TREE_FILE = "_METADATA"  # orbax: the saved tree, its leaves' types and shapes
_STEP_FILE = "_CHECKPOINT_METADATA"  # orbax: the commit, and our record of the checksums
_EARLIER = "restore an earlier checkpoint (an earlier step) instead"


class CorruptCheckpointError(ValueError):
  """A checkpoint whose files are damaged: missing, truncated, garbled, or changed since saving.

  Raised by :func:`restore` and :meth:`CheckpointManager.restore`; the message
  names the checkpoint (the step), the file or the leaf's key path, and what
  is wrong. Such a checkpoint cannot be trusted: restore an earlier one.
  """


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


# --- checksums ----------------------------------------------------------------------


def _digest(data) -> str:
  return hashlib.blake2b(data, digest_size=16).hexdigest()


def _is_key(dtype) -> bool:
  return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _host(x) -> np.ndarray:
  """An array (a whole leaf or one shard's data) on the host, C-contiguous; typed PRNG keys
  as their key data."""
  if not hasattr(x, "dtype"):
    x = np.asarray(x)
  if _is_key(x.dtype):
    x = jax.random.key_data(x)
  return np.ascontiguousarray(np.asarray(x))


def _hash(a: np.ndarray) -> str:
  return _digest(a.reshape(-1).view(np.uint8))


def _aval(x):
  """The (shape, dtype) that is hashed: a typed PRNG key's key data, else the leaf's own."""
  if _is_key(x.dtype):
    x = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(np.shape(x), x.dtype))
  return tuple(int(n) for n in np.shape(x)), np.dtype(x.dtype)


def _index(index, shape) -> tuple:
  """A shard's global index as ((start, stop), ...) over ``shape`` (trailing dims whole)."""
  out = [tuple(int(v) for v in sl.indices(n)[:2]) for sl, n in zip(index, shape)]
  return tuple(out) + tuple((0, n) for n in shape[len(out):])


def _contains(outer, inner) -> bool:
  return all(a <= c and d <= b for (a, b), (c, d) in zip(outer, inner))


def _part(a: np.ndarray, outer, inner) -> np.ndarray:
  """The block ``inner`` of ``a``, which holds the block ``outer`` of the global array."""
  return a[tuple(slice(c - a0, d - a0) for (a0, _), (c, d) in zip(outer, inner))]


def _from_every_process(local: np.ndarray) -> np.ndarray:
  """Each process's ``local``, stacked ``[processes, ...]`` on every process (one collective)."""
  if jax.process_count() == 1:
    return local[None]
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(local))


def _checksums(item, fn: str) -> dict:
  """The checksum record of ``item``: per leaf, the hash of each distinct shard.

  Every process calls it; each hashes the shards its devices hold (replica 0),
  and one gather gives every process the whole record.
  """
  leaves, rows, local = [], 0, {}
  for path, x in jax.tree_util.tree_flatten_with_path(item)[0]:
    shape, dtype = _aval(x if hasattr(x, "dtype") else np.asarray(x))
    entry = {"keypath": jax.tree_util.keystr(path), "path": list(path_key(path)),
             "shape": list(shape), "dtype": dtype.name, "shards": []}
    if isinstance(x, jax.Array):
      indices = sorted({_index(i, shape) for i in x.sharding.devices_indices_map(x.shape).values()})
      row = {i: rows + n for n, i in enumerate(indices)}
      for s in x.addressable_shards:
        if s.replica_id == 0:
          local[row[_index(s.index, shape)]] = _hash(_host(s.data))
      entry["shards"] = [{"index": [list(r) for r in i], "row": row[i]} for i in indices]
      rows += len(indices)
    else:                                   # the same host value in every process
      entry["shards"] = [{"index": [[0, n] for n in shape], "hash": _hash(_host(x))}]
    leaves.append(entry)
  table = np.zeros((rows, 17), np.uint8)    # 16 bytes of hash, then 1 where filled
  for r, h in local.items():
    table[r, :16] = np.frombuffer(bytes.fromhex(h), np.uint8)
    table[r, 16] = 1
  if rows:
    stacked = _from_every_process(table)
    if not (stacked[..., 16].sum(axis=0) == 1).all():
      raise RuntimeError(f"{fn}: a shard was hashed by no process or by several; the processes "
                         "must call save with the same tree of global arrays.")
    table = np.bitwise_or.reduce(stacked, axis=0)
  for entry in leaves:
    for shard in entry["shards"]:
      if "row" in shard:
        shard["hash"] = table[shard.pop("row"), :16].tobytes().hex()
  return {"format": _FORMAT, "version": _VERSION, "hash": _HASH, "leaves": leaves}


def _dumps(sums: dict) -> bytes:
  """The checksum file's text: JSON, one leaf a line."""
  head = json.dumps({k: v for k, v in sums.items() if k != "leaves"})[:-1]
  leaves = ",\n  ".join(json.dumps(leaf) for leaf in sums["leaves"])
  return f'{head}, "leaves": [\n  {leaves}\n]}}\n'.encode("utf-8")


def _write_checksums(directory, data: bytes) -> None:
  """Writes the checksum file into ``directory`` (orbax's temporary directory) and syncs it."""
  with open(os.path.join(os.fspath(directory), CHECKSUMS), "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())


# --- reading and verifying a checkpoint ---------------------------------------------


class _Where(NamedTuple):
  """A checkpoint as :func:`_restore` reads it: where its files are, what messages call it,
  and how orbax reads its arrays (a :func:`save` checkpoint, or a manager's step)."""
  fn: str                          # the function reading it, in messages
  path: str                        # its directory, which holds orbax's _CHECKPOINT_METADATA
  item: str                        # the subdirectory with the arrays and CHECKSUMS ("": path)
  name: str                        # the checkpoint, in messages
  remedy: str                      # what to do when it is corrupt
  read: Callable[[Any], Any]       # a target tree -> the tree orbax reads

  def file(self, name: str) -> str:
    """A file of the item, relative to :attr:`path` (as messages name it)."""
    return os.path.join(self.item, name) if self.item else name


def _corrupt(where: _Where, what: str) -> CorruptCheckpointError:
  return CorruptCheckpointError(f"{where.fn}: {where.name} is corrupt: {what}; {where.remedy}.")


def _read_json(where: _Where, name: str, what: str, raw: Optional[bytes] = None):
  """The JSON object in the file ``name`` (relative to the checkpoint's directory)."""
  file = os.path.join(where.path, name)
  if raw is None:
    if not os.path.isfile(file):
      raise _corrupt(where, f"{what} {name} is missing (every checkpoint commopt writes has "
                            f"one)")
    with open(file, "rb") as f:
      raw = f.read()
  try:
    value = json.loads(raw.decode("utf-8"))
  except (UnicodeDecodeError, ValueError) as e:
    size = "empty" if not raw else f"truncated or garbled ({len(raw)} bytes, not valid JSON: {e})"
    raise _corrupt(where, f"{what} {name} is {size}") from None
  if not isinstance(value, dict):
    raise _corrupt(where, f"{what} {name} holds a JSON {type(value).__name__}, not an object")
  return value


def _check_json_files(where: _Where) -> None:
  """Orbax's JSON files parse: ``_METADATA`` (required), ``_sharding`` and
  ``array_metadatas/*`` (where present); orbax itself fails obscurely on a damaged one."""
  tree_file = where.file(_TREE_FILE)
  tree = _read_json(where, tree_file, "orbax's tree metadata").get("tree_metadata")
  if not isinstance(tree, dict) or not tree:
    raise _corrupt(where, f"orbax's tree metadata {tree_file} has no 'tree_metadata' entries "
                          f"(got {type(tree).__name__})")
  item = os.path.join(where.path, where.item)
  names = [where.file("_sharding")] if os.path.isfile(os.path.join(item, "_sharding")) else []
  if os.path.isdir(os.path.join(item, "array_metadatas")):
    names += sorted(where.file(os.path.join("array_metadatas", f))
                    for f in os.listdir(os.path.join(item, "array_metadatas")))
  for name in names:
    _read_json(where, name, "orbax's array metadata")


def _brief(e: Exception) -> str:
  """An orbax or tensorstore error in a line (without tensorstore's spec)."""
  return f"{type(e).__name__}: {str(e).split(' [tensorstore_spec')[0][:400]}"


def _expected(where: _Where) -> Optional[dict]:
  """The checksums recorded with the checkpoint, by leaf path; None when it has none.

  Raises:
    CorruptCheckpointError: a metadata file is missing or damaged, or the
      checksum file is missing or altered though the checkpoint records one.
  """
  custom = _read_json(where, _STEP_FILE, "orbax's checkpoint metadata").get("custom_metadata")
  custom = {} if custom is None else custom
  if not isinstance(custom, dict):
    raise _corrupt(where, f"orbax's checkpoint metadata {_STEP_FILE} has a 'custom_metadata' "
                          f"that is a {type(custom).__name__}, not an object")
  name = where.file(CHECKSUMS)
  record, file = custom.get(_RECORD), os.path.join(where.path, name)
  if record is None and not os.path.exists(file):
    return None                             # written before checksums: not verified
  if record is not None:
    if not (isinstance(record, dict) and isinstance(record.get("blake2b"), str)):
      raise _corrupt(where, f"the checksum record in {_STEP_FILE} is garbled: {record!r}")
    if not os.path.isfile(file):
      raise _corrupt(where, f"{_STEP_FILE} records a checksum file {name}, but it is missing")
  with open(file, "rb") as f:
    raw = f.read()
  if record is not None and _digest(raw) != record["blake2b"]:
    raise _corrupt(where, f"the checksum file {name} has changed since it was written (its "
                          f"hash differs from the one {_STEP_FILE} records)")
  sums = _read_json(where, name, "the checksum file", raw)
  if sums.get("format") != _FORMAT or sums.get("version") != _VERSION or sums.get("hash") != _HASH:
    raise _corrupt(where, f"the checksum file {name} is not format {_FORMAT!r} version "
                          f"{_VERSION} with hash {_HASH!r}")
  out = {}
  try:
    for leaf in sums["leaves"]:
      shards = [(tuple(tuple(int(v) for v in i) for i in s["index"]), str(s["hash"]))
                for s in leaf["shards"]]
      out[tuple(str(k) for k in leaf["path"])] = (
          str(leaf["keypath"]), tuple(int(n) for n in leaf["shape"]), np.dtype(leaf["dtype"]),
          shards)
  except (KeyError, TypeError, ValueError) as e:
    raise _corrupt(where, f"the checksum file {name} has a malformed leaf entry "
                          f"({type(e).__name__}: {e})") from None
  return out


def _verify(where: _Where, got, expected: dict) -> None:
  """Hashes what was read against ``expected``; every process reaches the same verdict."""
  name = where.file(CHECKSUMS)
  leaves = jax.tree_util.tree_flatten_with_path(got)[0]
  for p, _ in leaves:
    if path_key(p) not in expected:
      raise _corrupt(where, f"the checksum file {name} has no entry for the leaf "
                            f"{jax.tree_util.keystr(p)} the checkpoint holds")
  bad = np.zeros(len(leaves), np.uint8)
  for n, (p, x) in enumerate(leaves):
    _, shape, dtype, shards = expected[path_key(p)]
    if _aval(x)[0] != shape:
      raise _corrupt(where, f"the leaf {jax.tree_util.keystr(p)} reads with shape "
                            f"{_aval(x)[0]}, but {name} records {shape}")
    # (Block of the global array, its host data): each distinct shard this process holds,
    # or the whole array where the saved shards are not blocks of the restored ones.
    if isinstance(x, jax.Array):
      held = {_index(i, shape) for i in x.sharding.devices_indices_map(x.shape).values()}
      if all(any(_contains(h, i) for h in held) for i, _ in shards):
        blocks = {}
        for s in x.addressable_shards:
          i = _index(s.index, shape)
          if i not in blocks:
            blocks[i] = _host(s.data)
      else:
        from jax.experimental import multihost_utils
        y = jax.random.key_data(x) if _is_key(x.dtype) else x
        whole = (np.asarray(y) if y.is_fully_addressable
                 else np.asarray(multihost_utils.process_allgather(y, tiled=True)))
        blocks = {tuple((0, m) for m in shape): np.ascontiguousarray(whole)}
    else:
      blocks = {tuple((0, m) for m in shape): _host(x)}
    for i, want in shards:
      for outer, a in blocks.items():
        if _contains(outer, i):
          a = np.ascontiguousarray(_part(a, outer, i))
          if a.dtype != dtype:              # e.g. int64 saved, read as int32 without jax_enable_x64
            a = a.astype(dtype)
          bad[n] |= _hash(a) != want
          break
  bad = _from_every_process(bad).any(axis=0)   # one verdict, the same in every process
  if bad.any():
    names = [expected[path_key(p)][0] for (p, _), b in zip(leaves, bad) if b]
    also = f" (and {len(names) - 1} more leaves)" if len(names) > 1 else ""
    raise _corrupt(where, f"the data read for the leaf {names[0]}{also} "
                          f"differs from the checksum recorded when it was saved ({name}): "
                          f"its array files were damaged after saving")


def _saved_tree(ocp, where: _Where):
  """The saved tree's metadata (shapes and dtypes), every file it comes from checked."""
  from etils import epath
  _check_json_files(where)
  handler = ocp.StandardCheckpointHandler()
  try:
    md = handler.metadata(epath.Path(os.path.join(where.path, where.item)))
  except Exception as e:  # noqa: BLE001 - reading metadata only reads files
    raise _corrupt(where, f"orbax cannot read the metadata of its arrays ({_brief(e)})") from e
  finally:
    handler.close()
  md = getattr(md, "item_metadata", md)
  tree = getattr(md, "tree", md)
  if not (isinstance(tree, dict) and "params" in tree and "opt_state" in tree):
    keys = sorted(tree) if isinstance(tree, dict) else type(tree).__name__
    raise _corrupt(where, f"orbax's tree metadata {where.file(_TREE_FILE)} does not hold "
                          f"'params' and 'opt_state' (it holds {keys})")
  return tree


def _cast(x, t):
  """``x``, read in its saved dtype, in the dtype ``t`` asks for (on the same devices)."""
  if _is_key(x.dtype) or _is_key(t.dtype) or x.dtype == jax.dtypes.canonicalize_dtype(t.dtype):
    return x
  return jax.jit(lambda v: v.astype(t.dtype), out_shardings=x.sharding)(x)


def _read(where: _Where, target):
  try:
    return where.read(target)
  except Exception as e:  # noqa: BLE001
    if not (isinstance(e, json.JSONDecodeError) or "DATA_LOSS" in str(e)):
      raise
    raise _corrupt(where, f"orbax cannot read its arrays ({_brief(e)})") from e


def _restore(where: _Where, dp: DataParallel, params, model_state) -> Restored:
  """Reads and verifies the checkpoint ``where`` onto ``dp``'s devices: :func:`restore` and
  :meth:`CheckpointManager.restore` (see :func:`restore`)."""
  ocp = _orbax()
  fn = where.fn
  if not isinstance(dp, DataParallel):
    raise ValueError(f"{fn}: `dp` must be a commopt.DataParallel (from "
                     f"commopt.data_parallel, or an nnx trainer's .dp), got {dp!r}.")
  expected = _expected(where)
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
  # Read each leaf in the dtype it was saved in (so it can be verified), then cast.
  saved_dtypes = {path_key(p): getattr(m, "dtype", None)
                  for p, m in jax.tree_util.tree_flatten_with_path(saved)[0]}

  def as_stored(p, t):
    d = saved_dtypes.get(path_key(p))
    if d is None or _is_key(d) or _is_key(t.dtype):
      return t
    d = jax.dtypes.canonicalize_dtype(d)
    return t if d == t.dtype else jax.ShapeDtypeStruct(t.shape, d, sharding=t.sharding)

  got = _read(where, jax.tree_util.tree_map_with_path(as_stored, target))
  if expected is not None:
    _verify(where, got, expected)
  got = jax.tree.map(_cast, got, target)
  opt_state = got["opt_state"] if same else dp.resize_state(got["opt_state"], params)
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


# --- writing a checkpoint -----------------------------------------------------------


@functools.cache
def _handler_types():
  """``(handler, save args, restore args)``: orbax's standard pytree handler, which also
  writes the checksum file when orbax finalizes the item, and its arguments (defined and
  registered with orbax on first use: orbax is optional)."""
  ocp = _orbax()

  class ChecksummedHandler(ocp.StandardCheckpointHandler):
    """Orbax's ``StandardCheckpointHandler`` that writes :data:`CHECKSUMS` as it finalizes.

    Orbax calls ``finalize`` on the primary process once every process has
    written its shards, on the item's temporary directory, before the renames
    that commit it (the item's, then under a manager the step's), from the
    background thread of an asynchronous save too. One save at a time: orbax
    waits for the previous one before it starts the next.
    """

    def __init__(self):
      super().__init__()
      self._checksums: Optional[bytes] = None

    @classmethod
    def typestr(cls) -> str:
      return f"{__name__}.ChecksummedHandler"   # recorded in orbax's step metadata

    async def async_save(self, directory, *rest, args=None, **kwargs):
      self._checksums = args.checksums if isinstance(args, ChecksummedSave) else None
      return await super().async_save(directory, *rest, args=args, **kwargs)

    def finalize(self, directory) -> None:
      super().finalize(directory)
      data, self._checksums = self._checksums, None
      if data is None:
        raise RuntimeError(f"commopt.checkpoint: finalizing {directory} without checksums "
                           f"(saved without ChecksummedSave)")
      _write_checksums(directory, data)

  @ocp.args.register_with_handler(ChecksummedHandler, for_save=True)
  @dataclasses.dataclass
  class ChecksummedSave(ocp.args.StandardSave):
    """``StandardSave`` with the bytes of the checksum file the item's finalize writes."""
    checksums: bytes = b""

  @ocp.args.register_with_handler(ChecksummedHandler, for_restore=True)
  @dataclasses.dataclass
  class ChecksummedRestore(ocp.args.StandardRestore):
    """``StandardRestore``, for the handler above (the files are a standard pytree's)."""

  return ChecksummedHandler, ChecksummedSave, ChecksummedRestore


def _save_args(fn: str, params, opt_state, model_state, step):
  """``(orbax's save args, the step metadata's record)`` for one checkpoint: the tree, and
  its checksums (every process calls it; one gather of the hashes)."""
  item = {"params": params, "opt_state": opt_state}
  if model_state is not None:
    item["model_state"] = model_state
  if step is not None:
    item["step"] = np.asarray(step, np.int64)
  data = _dumps(_checksums(item, fn))
  _, save_args, _ = _handler_types()
  return save_args(item, checksums=data), {_RECORD: {"file": CHECKSUMS, "blake2b": _digest(data)}}


# --- save and restore ---------------------------------------------------------------


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
  ocp = _orbax()
  path = os.path.abspath(os.fspath(directory))
  if step is not None and (isinstance(step, bool) or not isinstance(step, (int, np.integer))):
    raise ValueError(f"checkpoint.save: `step` must be an int or None, got {step!r}.")
  args, record = _save_args("checkpoint.save", params, opt_state, model_state, step)
  handler, _, _ = _handler_types()
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
  ocp = _orbax()
  path = os.path.abspath(os.fspath(directory))
  if not os.path.isdir(path):
    raise ValueError(f"checkpoint.restore: `directory` {path!r} does not exist.")

  def read(target):
    with ocp.StandardCheckpointer() as ckpt:
      return ckpt.restore(path, target)

  where = _Where("checkpoint.restore", path, "", f"the checkpoint {path!r}", _EARLIER, read)
  return _restore(where, dp, params, model_state)


# --- a directory of steps -----------------------------------------------------------


class CheckpointManager:
  """Orbax's ``CheckpointManager`` over a directory of steps, with commopt's checksums,
  verification and resize: :func:`save` and :func:`restore` with retention, best-k and
  asynchronous saves.

  Each step is the directory ``ROOT/<step>``: orbax's ``_CHECKPOINT_METADATA``
  (which records the checksum file and its hash, as :func:`save` does), the
  item ``state/`` holding what :func:`save` writes (the parameters, the whole
  optimizer state, the model state if any, the step) with its
  ``commopt_checksums.json``, and ``metrics/`` when steps are ranked by a
  metric. :meth:`restore` verifies a step as :func:`restore` verifies a
  checkpoint, with the same code, and resizes the optimizer state onto another
  number of workers by the same rule (:meth:`~commopt.DataParallel.resize_state`).

  **Atomic steps.** The checksum file is written by the item's orbax handler
  when orbax finalizes the item: on the primary process, once every process
  has written its shards, inside the step's temporary directory, before the
  renames that commit the item and then the step. A step is on disk complete
  with its checksums, or not at all.

  **Asynchronous saves** (``async_save=True``, orbax's async checkpointing):
  :meth:`save` hashes the arrays (every process its shards, one gather) and
  returns once orbax has copied them off the devices, so the training step may
  go on (and donate them); a background thread writes the files, the checksum
  file and commits the step. The next :meth:`save` and :meth:`restore` first
  wait for it, as do :meth:`wait_until_finished` and :meth:`close`, which
  raise the background write's error if it failed. A process killed (or a
  write failed) before the commit leaves only orbax's temporary directory
  ``ROOT/<step>.orbax-checkpoint-tmp...``: it is never listed as a step, the
  next ``CheckpointManager`` opened on ``ROOT`` deletes it (in the background,
  before its first save), and the steps before it stay as they were (old steps
  are deleted only after a new one is committed). With ``async_save=False``
  :meth:`save` returns once the step is committed.

  **Retention.** ``max_to_keep=None`` keeps every step. Without ``best_fn``,
  ``max_to_keep=k`` keeps the last ``k`` steps. With ``best_fn``, it keeps the
  best ``k`` of the steps saved with ``metrics`` (the lowest
  ``best_fn(metrics)`` with ``best_mode="min"``, the highest with ``"max"``;
  orbax's default is ``"max"``), so the latest step is deleted at once when it
  is not among them. Steps saved without ``metrics`` follow orbax's
  ``keep_checkpoints_without_metrics``: when True (the default) they are
  never deleted, not ranked and not counted among the ``k``; when False they
  are not kept, deleted as soon as more than ``k`` steps exist.
  :meth:`best_step` is the best kept step (the latest without ``best_fn``).

  **Damaged steps.** :meth:`restore` of a step whose files were damaged raises
  :class:`CorruptCheckpointError` naming the step and the file or leaf; the
  remedy is an earlier step, e.g. ``mgr.restore(dp, params,
  step=mgr.all_steps()[-2])`` (the message names the step before it).

  Every process of a multi-process run creates the manager and calls
  :meth:`save` and :meth:`restore` with the same arguments (``metrics``
  included), as with :func:`save`.

  Args:
    directory: the root directory of the steps (created if missing).
    max_to_keep: how many steps to keep: the last ones, or the best ones with
      ``best_fn``; None keeps every step.
    best_fn: None, or a function of a step's ``metrics`` dict returning a
      number that ranks the steps for ``max_to_keep``.
    best_mode: ``"min"`` (the default: the lowest ``best_fn`` is best, as for a
      loss) or ``"max"``.
    keep_checkpoints_without_metrics: with ``best_fn``, whether steps saved
      without ``metrics`` are kept (orbax's option, default True).
    save_interval_steps: :meth:`save` writes only steps that are multiples of
      it, as orbax decides: also the first step saved into a directory with
      none, and a step at a preemption orbax was told of; ``force=True``
      writes any step.
    async_save: save in the background (see above).

  Examples:
    >>> import tempfile, jax.numpy as jnp
    >>> from commopt import checkpoint
    >>> with checkpoint.CheckpointManager(tempfile.mkdtemp(), max_to_keep=2) as mgr:
    ...   for step in range(4):
    ...     _ = mgr.save(step, {"w": jnp.ones(3) * step}, {"count": jnp.zeros((), jnp.int32)})
    ...   mgr.all_steps()
    [2, 3]
  """

  def __init__(self, directory, *, max_to_keep: Optional[int] = None,
               best_fn: Optional[Callable[[dict], float]] = None, best_mode: str = "min",
               keep_checkpoints_without_metrics: bool = True, save_interval_steps: int = 1,
               async_save: bool = False):
    fn = "CheckpointManager"
    if isinstance(directory, bytes) or not isinstance(directory, (str, os.PathLike)):
      raise base.OptionTypeError(
          f"{fn}: `directory` must be a path (a str or an os.PathLike), got {directory!r} "
          f"({type(directory).__name__}).")
    if max_to_keep is not None:
      max_to_keep = base.check_integer("max_to_keep", max_to_keep, fn=fn,
                                       rule="None (keep every step) or a positive integer",
                                       ok=lambda v: v > 0)
    if best_fn is not None and not callable(best_fn):
      raise base.OptionTypeError(
          f"{fn}: `best_fn` must be None or a function of a step's metrics dict that returns "
          f"a number, got {best_fn!r} ({type(best_fn).__name__}).")
    best_mode = base.check_choice("best_mode", best_mode, ("min", "max"), fn)
    keep = base.check_bool("keep_checkpoints_without_metrics", keep_checkpoints_without_metrics,
                           fn=fn)
    interval = base.check_positive_int("save_interval_steps", save_interval_steps, fn=fn)
    async_save = base.check_bool("async_save", async_save, fn=fn)
    ocp = _orbax()
    handler_type, save_args, self._restore_args = _handler_types()
    handler = handler_type()
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add(ITEM, save_args, handler)
    registry.add(ITEM, self._restore_args, handler)
    self._name_format = ocp.step.standard_name_format()
    self._root = os.path.abspath(os.fspath(directory))
    self._best_fn = best_fn
    self._settings = dict(max_to_keep=max_to_keep, best_fn=best_fn, best_mode=best_mode,
                          keep_checkpoints_without_metrics=keep,
                          save_interval_steps=interval, async_save=async_save)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, best_fn=best_fn, best_mode=best_mode,
        keep_checkpoints_without_metrics=keep, save_interval_steps=interval,
        enable_async_checkpointing=async_save, step_name_format=self._name_format,
        cleanup_tmp_directories=True, create=True)
    self._mgr = ocp.CheckpointManager(self._root, options=options, handler_registry=registry)

  def __repr__(self) -> str:
    settings = ", ".join(f"{k}={v!r}" for k, v in self._settings.items())
    return f"CheckpointManager({self._root!r}, {settings})"

  @property
  def directory(self) -> str:
    """The root directory (absolute)."""
    return self._root

  @property
  def orbax(self):
    """Orbax's ``CheckpointManager`` underneath, for what this class does not wrap
    (``delete``, ``reload``, ``metadata``); save and restore through this class, which adds
    and checks the checksums."""
    return self._mgr

  def _metrics(self, metrics) -> Optional[dict]:
    """``metrics`` checked: a dict of names to numbers (as Python numbers, which orbax writes
    as JSON), ranked by ``best_fn`` to a finite number."""
    fn = "CheckpointManager.save"
    if metrics is None:
      return None
    if not (isinstance(metrics, dict) and all(isinstance(k, str) for k in metrics)):
      raise base.OptionTypeError(
          f"{fn}: `metrics` must be None or a dict of metric names (str) to numbers, got "
          f"{metrics!r} ({type(metrics).__name__}).")
    out = {}
    for k, v in metrics.items():
      if not base.is_real_number(v):
        raise base.OptionTypeError(
            f"{fn}: `metrics[{k!r}]` must be a number (an int or a float, or a 0-d array of "
            f"one), got {v!r} ({type(v).__name__}).")
      out[k] = int(v) if isinstance(v, (int, np.integer)) else float(v)
    if self._best_fn is not None:
      score = self._best_fn(out)
      if not (base.is_real_number(score) and np.isfinite(float(score))):
        raise ValueError(f"{fn}: `best_fn` must return a finite number for the metrics "
                         f"{out!r}, got {score!r}; the steps are ranked by it.")
    return out

  def should_save(self, step: int) -> bool:
    """Whether :meth:`save` would write ``step``: after the latest step, and on the
    save interval."""
    return self._mgr.should_save(base.check_int("step", step, fn="CheckpointManager.should_save",
                                                minimum=0))

  def save(self, step: int, params, opt_state, *, model_state=None,
           metrics: Optional[dict] = None, force: bool = False) -> bool:
    """Writes ``step`` (atomically, with its checksums) if the save interval asks for it.

    What is written is what :func:`save` writes, into the step's item
    ``state/``; the checksums are taken from the arrays now (under
    ``async_save`` too). Once the step is committed, the steps that
    ``max_to_keep`` (and ``best_fn``) no longer keep are deleted.

    Args:
      step: the step number, an int >= 0; a step at or before the latest one
        is not saved (False is returned).
      params: the parameters.
      opt_state: the optimizer state from the step (per-worker leaves stacked).
      model_state: the model's mutable state (batch statistics), if any.
      metrics: a dict of metric names to numbers, which ``best_fn`` ranks
        (kept with the step only when the manager has a ``best_fn``).
      force: save even off the save interval (orbax's ``force``); it does not
        replace a step already saved.

    Returns:
      Whether the step was saved (with ``async_save``: started).
    """
    fn = "CheckpointManager.save"
    step = base.check_int("step", step, fn=fn, minimum=0)
    force = base.check_bool("force", force, fn=fn)
    metrics = self._metrics(metrics)
    if not force and not self._mgr.should_save(step):
      return False
    if step in self._mgr.all_steps():
      raise ValueError(f"{fn}: step {step} is already saved in {self._root!r}; `force=True` "
                       f"saves off the save interval but replaces no step (delete it first "
                       f"with mgr.orbax.delete({step})).")
    ocp = _orbax()
    args, record = _save_args(fn, params, opt_state, model_state, step)
    return bool(self._finished(self._mgr.save, step, args=ocp.args.Composite(**{ITEM: args}),
                               metrics=metrics, force=force, custom_metadata=record))

  def restore(self, dp: DataParallel, params, *, step: Optional[int] = None,
              model_state=None) -> Restored:
    """Reads a step onto ``dp``'s devices and verifies it, as :func:`restore` does.

    Waits for an asynchronous save in flight first. Saved with another number
    of workers, the optimizer state is resized
    (:meth:`~commopt.DataParallel.resize_state`).

    Args:
      dp: the step that continues the run.
      params: this run's parameters, as arrays or ``jax.ShapeDtypeStruct``\\ s.
      step: the step to restore; None (the default) restores the latest.
      model_state: the model's mutable state's structure, when one was saved.

    Returns:
      A :class:`Restored`.

    Raises:
      CorruptCheckpointError: the step's files are damaged (the message names
        the step and the file or leaf). Restore an earlier step instead:
        ``mgr.restore(dp, params, step=mgr.all_steps()[-2])`` after the latest.
      ValueError: no such step is kept, or the arguments do not fit it.
    """
    fn = "CheckpointManager.restore"
    self.wait_until_finished()
    steps = self.all_steps()
    if step is None:
      if not steps:
        raise ValueError(f"{fn}: no step is saved in {self._root!r}.")
      step = steps[-1]
    else:
      step = base.check_int("step", step, fn=fn, minimum=0)
      if step not in steps:
        raise ValueError(f"{fn}: step {step} is not saved in {self._root!r}; the steps kept "
                         f"are {steps}.")
    path = os.fspath(self._name_format.find_step(self._mgr.directory, step).path)
    earlier = [s for s in steps if s < step]
    remedy = (f"{_EARLIER}: restore(dp, params, step={earlier[-1]}), the one before it of the "
              f"steps kept, {steps}" if earlier else
              f"no earlier step is kept (the steps kept are {steps})")
    ocp = _orbax()

    def read(target):
      args = ocp.args.Composite(**{ITEM: self._restore_args(target)})
      return self._mgr.restore(step, args=args)[ITEM]

    where = _Where(fn, path, ITEM, f"step {step} ({path!r})", remedy, read)
    return _restore(where, dp, params, model_state)

  def latest_step(self) -> Optional[int]:
    """The latest step kept, or None."""
    return self._mgr.latest_step()

  def all_steps(self) -> list[int]:
    """The steps kept, in increasing order (a step being saved asynchronously included)."""
    return sorted(self._mgr.all_steps())

  def best_step(self) -> Optional[int]:
    """The best step kept by ``best_fn`` of its metrics (without ``best_fn``: the latest),
    or None."""
    return self._mgr.best_step()

  def _finished(self, call, *args, **kwargs):
    """Orbax's ``call``, which raises the error of an asynchronous save that failed; the steps
    are then read again from disk (orbax had listed the failed step already, and unlisted the
    ones it was to replace)."""
    try:
      return call(*args, **kwargs)
    except Exception:
      self._mgr.reload()
      raise

  def wait_until_finished(self) -> None:
    """Blocks until an asynchronous save is committed; raises its error if it failed (the
    step was then not committed, and :meth:`all_steps` no longer lists it)."""
    self._finished(self._mgr.wait_until_finished)

  def close(self) -> None:
    """Waits for an asynchronous save (raising its error) and releases orbax's resources."""
    try:
      self.wait_until_finished()
    finally:
      self._mgr.close()

  def __enter__(self) -> "CheckpointManager":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
