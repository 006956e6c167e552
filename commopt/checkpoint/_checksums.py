"""The checksums: each leaf's shards hashed as it is saved, the checksum file, and verifying
what a restore read against it.

:func:`compute` hashes, for every leaf, each distinct shard of the global array
(BLAKE2b, 16 bytes), keyed by the shard's global index: each process the shards
its devices hold (replica 0 only), then one gather gives every process the
whole record. :func:`dumps` is the file's text, :func:`write` writes it (from
the orbax handler, inside the temporary directory). On restore,
:func:`expected` reads the record back, checked against the hash
``_CHECKPOINT_METADATA`` keeps of it, and :func:`verify` hashes what was read,
every process the shards it holds, one verdict agreed by all.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

import jax
import numpy as np

from commopt.checkpoint._files import CHECKSUMS, RECORD, STEP_FILE, Where, corrupt, read_json
from commopt.parallel._resize import path_key

_FORMAT = "commopt.checkpoint.checksums"
_VERSION = 1
_HASH = "blake2b-128"


def digest(data) -> str:
  return hashlib.blake2b(data, digest_size=16).hexdigest()


def is_key(dtype) -> bool:
  return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _host(x) -> np.ndarray:
  """An array (a whole leaf or one shard's data) on the host, C-contiguous; typed PRNG keys
  as their key data."""
  if not hasattr(x, "dtype"):
    x = np.asarray(x)
  if is_key(x.dtype):
    x = jax.random.key_data(x)
  return np.ascontiguousarray(np.asarray(x))


def _hash(a: np.ndarray) -> str:
  return digest(a.reshape(-1).view(np.uint8))


def _aval(x):
  """The (shape, dtype) that is hashed: a typed PRNG key's key data, else the leaf's own."""
  if is_key(x.dtype):
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


# --- saving -------------------------------------------------------------------------


def compute(item, fn: str) -> dict:
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


def dumps(sums: dict) -> bytes:
  """The checksum file's text: JSON, one leaf a line."""
  head = json.dumps({k: v for k, v in sums.items() if k != "leaves"})[:-1]
  leaves = ",\n  ".join(json.dumps(leaf) for leaf in sums["leaves"])
  return f'{head}, "leaves": [\n  {leaves}\n]}}\n'.encode("utf-8")


def write(directory, data: bytes) -> None:
  """Writes the checksum file into ``directory`` (orbax's temporary directory) and syncs it."""
  with open(os.path.join(os.fspath(directory), CHECKSUMS), "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())


# --- verifying ----------------------------------------------------------------------


def expected(where: Where) -> Optional[dict]:
  """The checksums recorded with the checkpoint, by leaf path; None when it has none.

  Raises:
    CorruptCheckpointError: a metadata file is missing or damaged, or the
      checksum file is missing or altered though the checkpoint records one.
  """
  custom = read_json(where, STEP_FILE, "orbax's checkpoint metadata").get("custom_metadata")
  custom = {} if custom is None else custom
  if not isinstance(custom, dict):
    raise corrupt(where, f"orbax's checkpoint metadata {STEP_FILE} has a 'custom_metadata' "
                         f"that is a {type(custom).__name__}, not an object")
  name = where.file(CHECKSUMS)
  record, file = custom.get(RECORD), os.path.join(where.path, name)
  if record is None and not os.path.exists(file):
    return None                             # written before checksums: not verified
  if record is not None:
    if not (isinstance(record, dict) and isinstance(record.get("blake2b"), str)):
      raise corrupt(where, f"the checksum record in {STEP_FILE} is garbled: {record!r}")
    if not os.path.isfile(file):
      raise corrupt(where, f"{STEP_FILE} records a checksum file {name}, but it is missing")
  with open(file, "rb") as f:
    raw = f.read()
  if record is not None and digest(raw) != record["blake2b"]:
    raise corrupt(where, f"the checksum file {name} has changed since it was written (its "
                         f"hash differs from the one {STEP_FILE} records)")
  sums = read_json(where, name, "the checksum file", raw)
  if sums.get("format") != _FORMAT or sums.get("version") != _VERSION or sums.get("hash") != _HASH:
    raise corrupt(where, f"the checksum file {name} is not format {_FORMAT!r} version "
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
    raise corrupt(where, f"the checksum file {name} has a malformed leaf entry "
                         f"({type(e).__name__}: {e})") from None
  return out


def verify(where: Where, got, expected: dict) -> None:
  """Hashes what was read against ``expected``; every process reaches the same verdict."""
  name = where.file(CHECKSUMS)
  leaves = jax.tree_util.tree_flatten_with_path(got)[0]
  for p, _ in leaves:
    if path_key(p) not in expected:
      raise corrupt(where, f"the checksum file {name} has no entry for the leaf "
                           f"{jax.tree_util.keystr(p)} the checkpoint holds")
  bad = np.zeros(len(leaves), np.uint8)
  for n, (p, x) in enumerate(leaves):
    _, shape, dtype, shards = expected[path_key(p)]
    if _aval(x)[0] != shape:
      raise corrupt(where, f"the leaf {jax.tree_util.keystr(p)} reads with shape "
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
        y = jax.random.key_data(x) if is_key(x.dtype) else x
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
    raise corrupt(where, f"the data read for the leaf {names[0]}{also} "
                         f"differs from the checksum recorded when it was saved ({name}): "
                         f"its array files were damaged after saving")
