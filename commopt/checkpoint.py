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

Needs ``orbax-checkpoint`` (``pip install orbax-checkpoint``, or commopt's
``checkpoint`` extra).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, NamedTuple, Optional

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from commopt.parallel._data_parallel import DataParallel
from commopt.parallel._resize import path_key

CHECKSUMS = "commopt_checksums.json"
"""The name of the checksum file :func:`save` writes into each checkpoint."""

_RECORD = "commopt_checksums"  # the key of its record in orbax's custom metadata
_FORMAT = "commopt.checkpoint.checksums"
_VERSION = 1
_HASH = "blake2b-128"
_TREE_FILE = "_METADATA"  # orbax: the saved tree, its leaves' types and shapes
_STEP_FILE = "_CHECKPOINT_METADATA"  # orbax: the commit, and our record of the checksums
_EARLIER = "restore an earlier checkpoint (an earlier step) instead"


class CorruptCheckpointError(ValueError):
  """A checkpoint whose files are damaged: missing, truncated, garbled, or changed since saving.

  Raised by :func:`restore`; the message names the checkpoint, the file or the
  leaf's key path, and what is wrong. Such a checkpoint cannot be trusted:
  restore an earlier one.
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


def _checksums(item) -> dict:
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
      raise RuntimeError("checkpoint.save: a shard was hashed by no process or by several; the "
                         "processes must call save with the same tree of global arrays.")
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


def _corrupt(path, what: str) -> CorruptCheckpointError:
  return CorruptCheckpointError(f"checkpoint.restore: the checkpoint {path!r} is corrupt: {what}; "
                                f"{_EARLIER}.")


def _read_json(path, name: str, what: str, raw: Optional[bytes] = None):
  file = os.path.join(path, name)
  if raw is None:
    if not os.path.isfile(file):
      raise _corrupt(path, f"{what} {name} is missing (every checkpoint written by "
                           f"checkpoint.save has one)")
    with open(file, "rb") as f:
      raw = f.read()
  try:
    value = json.loads(raw.decode("utf-8"))
  except (UnicodeDecodeError, ValueError) as e:
    size = "empty" if not raw else f"truncated or garbled ({len(raw)} bytes, not valid JSON: {e})"
    raise _corrupt(path, f"{what} {name} is {size}") from None
  if not isinstance(value, dict):
    raise _corrupt(path, f"{what} {name} holds a JSON {type(value).__name__}, not an object")
  return value


def _check_json_files(path) -> None:
  """Orbax's JSON files parse: ``_METADATA`` (required), ``_sharding`` and
  ``array_metadatas/*`` (where present); orbax itself fails obscurely on a damaged one."""
  tree = _read_json(path, _TREE_FILE, "orbax's tree metadata").get("tree_metadata")
  if not isinstance(tree, dict) or not tree:
    raise _corrupt(path, f"orbax's tree metadata {_TREE_FILE} has no 'tree_metadata' entries "
                         f"(got {type(tree).__name__})")
  names = ["_sharding"] if os.path.isfile(os.path.join(path, "_sharding")) else []
  if os.path.isdir(os.path.join(path, "array_metadatas")):
    names += sorted(os.path.join("array_metadatas", f)
                    for f in os.listdir(os.path.join(path, "array_metadatas")))
  for name in names:
    _read_json(path, name, "orbax's array metadata")


def _brief(e: Exception) -> str:
  """An orbax or tensorstore error in a line (without tensorstore's spec)."""
  return f"{type(e).__name__}: {str(e).split(' [tensorstore_spec')[0][:400]}"


def _expected(path) -> Optional[dict]:
  """The checksums recorded with the checkpoint at ``path``, by leaf path; None when it has none.

  Raises:
    CorruptCheckpointError: a metadata file is missing or damaged, or the
      checksum file is missing or altered though the checkpoint records one.
  """
  custom = _read_json(path, _STEP_FILE, "orbax's checkpoint metadata").get("custom_metadata")
  custom = {} if custom is None else custom
  if not isinstance(custom, dict):
    raise _corrupt(path, f"orbax's checkpoint metadata {_STEP_FILE} has a 'custom_metadata' "
                         f"that is a {type(custom).__name__}, not an object")
  record, file = custom.get(_RECORD), os.path.join(path, CHECKSUMS)
  if record is None and not os.path.exists(file):
    return None                             # written before checksums: not verified
  if record is not None:
    if not (isinstance(record, dict) and isinstance(record.get("blake2b"), str)):
      raise _corrupt(path, f"the checksum record in {_STEP_FILE} is garbled: {record!r}")
    if not os.path.isfile(file):
      raise _corrupt(path, f"{_STEP_FILE} records a checksum file {CHECKSUMS}, but it is missing")
  with open(file, "rb") as f:
    raw = f.read()
  if record is not None and _digest(raw) != record["blake2b"]:
    raise _corrupt(path, f"the checksum file {CHECKSUMS} has changed since it was written (its "
                         f"hash differs from the one {_STEP_FILE} records)")
  sums = _read_json(path, CHECKSUMS, "the checksum file", raw)
  if sums.get("format") != _FORMAT or sums.get("version") != _VERSION or sums.get("hash") != _HASH:
    raise _corrupt(path, f"the checksum file {CHECKSUMS} is not format {_FORMAT!r} version "
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
    raise _corrupt(path, f"the checksum file {CHECKSUMS} has a malformed leaf entry "
                         f"({type(e).__name__}: {e})") from None
  return out


def _verify(path, got, expected: dict) -> None:
  """Hashes what was read against ``expected``; every process reaches the same verdict."""
  leaves = jax.tree_util.tree_flatten_with_path(got)[0]
  for p, _ in leaves:
    if path_key(p) not in expected:
      raise _corrupt(path, f"the checksum file {CHECKSUMS} has no entry for the leaf "
                           f"{jax.tree_util.keystr(p)} the checkpoint holds")
  bad = np.zeros(len(leaves), np.uint8)
  for n, (p, x) in enumerate(leaves):
    _, shape, dtype, shards = expected[path_key(p)]
    if _aval(x)[0] != shape:
      raise _corrupt(path, f"the leaf {jax.tree_util.keystr(p)} reads with shape "
                           f"{_aval(x)[0]}, but {CHECKSUMS} records {shape}")
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
    raise _corrupt(path, f"the data read for the leaf {names[0]}{also} "
                         f"differs from the checksum recorded when it was saved ({CHECKSUMS}): "
                         f"its array files were damaged after saving")


# --- save and restore ---------------------------------------------------------------


def save(directory, params, opt_state, *, model_state=None, step: Optional[int] = None,
         force: bool = False) -> str:
  """Writes a checkpoint of a data-parallel run to ``directory`` and waits until it is on disk.

  The write is atomic (orbax writes a temporary directory and renames it), and
  the checkpoint carries the checksums :func:`restore` verifies (see the
  module's description).

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
  item = {"params": params, "opt_state": opt_state}
  if model_state is not None:
    item["model_state"] = model_state
  if step is not None:
    item["step"] = np.asarray(step, np.int64)
  data = _dumps(_checksums(item))
  handler = ocp.StandardCheckpointHandler()
  finalize = handler.finalize

  def finalize_with_checksums(tmp_directory):
    # Orbax calls this on the primary process, after every process has written its
    # shards, in the temporary directory, before the rename that commits it.
    finalize(tmp_directory)
    _write_checksums(tmp_directory, data)

  handler.finalize = finalize_with_checksums
  record = {_RECORD: {"file": CHECKSUMS, "blake2b": _digest(data)}}
  with ocp.AsyncCheckpointer(handler) as ckpt:
    ckpt.save(path, args=ocp.args.StandardSave(item), force=force, custom_metadata=record)
    ckpt.wait_until_finished()
  return path


def _saved_tree(ocp, path):
  """The saved tree's metadata (shapes and dtypes), every file it comes from checked."""
  from etils import epath
  _check_json_files(path)
  handler = ocp.StandardCheckpointHandler()
  try:
    md = handler.metadata(epath.Path(path))
  except Exception as e:  # noqa: BLE001 - reading metadata only reads files
    raise _corrupt(path, f"orbax cannot read the metadata of its arrays ({_brief(e)})") from e
  finally:
    handler.close()
  md = getattr(md, "item_metadata", md)
  tree = getattr(md, "tree", md)
  if not (isinstance(tree, dict) and "params" in tree and "opt_state" in tree):
    keys = sorted(tree) if isinstance(tree, dict) else type(tree).__name__
    raise _corrupt(path, f"orbax's tree metadata {_TREE_FILE} does not hold 'params' and "
                         f"'opt_state' (it holds {keys})")
  return tree


def _cast(x, t):
  """``x``, read in its saved dtype, in the dtype ``t`` asks for (on the same devices)."""
  if _is_key(x.dtype) or _is_key(t.dtype) or x.dtype == jax.dtypes.canonicalize_dtype(t.dtype):
    return x
  return jax.jit(lambda v: v.astype(t.dtype), out_shardings=x.sharding)(x)


def _read(ckpt, path, target):
  try:
    return ckpt.restore(path, target)
  except Exception as e:  # noqa: BLE001
    if not (isinstance(e, json.JSONDecodeError) or "DATA_LOSS" in str(e)):
      raise
    raise _corrupt(path, f"orbax cannot read its arrays ({_brief(e)})") from e


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
  if not isinstance(dp, DataParallel):
    raise ValueError(f"checkpoint.restore: `dp` must be a commopt.DataParallel (from "
                     f"commopt.data_parallel, or an nnx trainer's .dp), got {dp!r}.")
  expected = _expected(path)
  params_t, state_t = dp.abstract_state(params)
  replicated = NamedSharding(dp.mesh, P())
  saved = _saved_tree(ocp, path)
  with ocp.StandardCheckpointer() as ckpt:
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
    # Read each leaf in the dtype it was saved in (so it can be verified), then cast.
    saved_dtypes = {path_key(p): getattr(m, "dtype", None)
                    for p, m in jax.tree_util.tree_flatten_with_path(saved)[0]}

    def as_stored(p, t):
      d = saved_dtypes.get(path_key(p))
      if d is None or _is_key(d) or _is_key(t.dtype):
        return t
      d = jax.dtypes.canonicalize_dtype(d)
      return t if d == t.dtype else jax.ShapeDtypeStruct(t.shape, d, sharding=t.sharding)

    got = _read(ckpt, path, jax.tree_util.tree_map_with_path(as_stored, target))
  if expected is not None:
    _verify(path, got, expected)
  got = jax.tree.map(_cast, got, target)
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
