"""A checkpoint's files: their names, which checkpoint a restore reads, and orbax's JSON files.

What the other modules of :mod:`commopt.checkpoint` share: the names of the
files and the item (:data:`CHECKSUMS`, :data:`ITEM`, orbax's ``_METADATA`` and
``_CHECKPOINT_METADATA``), :class:`CorruptCheckpointError` and the message that
names the damaged checkpoint (:func:`corrupt`), and reading orbax's JSON
metadata files, which orbax itself reads with obscure errors when damaged.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, NamedTuple, Optional

CHECKSUMS = "commopt_checksums.json"
"""The name of the checksum file :func:`save` writes into each checkpoint."""

ITEM = "state"
"""The item (subdirectory) of a :class:`CheckpointManager` step that holds the checkpoint."""

RECORD = "commopt_checksums"  # the key of its record in orbax's custom metadata
TREE_FILE = "_METADATA"  # orbax: the saved tree, its leaves' types and shapes
STEP_FILE = "_CHECKPOINT_METADATA"  # orbax: the commit, and our record of the checksums
EARLIER = "restore an earlier checkpoint (an earlier step) instead"


class CorruptCheckpointError(ValueError):
  """A checkpoint whose files are damaged: missing, truncated, garbled, or changed since saving.

  Raised by :func:`restore` and :meth:`CheckpointManager.restore`; the message
  names the checkpoint (the step), the file or the leaf's key path, and what
  is wrong. Such a checkpoint cannot be trusted: restore an earlier one.
  """


def orbax():
  """``orbax.checkpoint``, imported on first use (commopt's ``checkpoint`` extra)."""
  try:
    import orbax.checkpoint as ocp
  except ImportError as e:
    raise ImportError("commopt.checkpoint needs orbax-checkpoint (`pip install "
                      "orbax-checkpoint`, or `pip install commopt[checkpoint]`).") from e
  return ocp


class Where(NamedTuple):
  """A checkpoint as a restore reads it: where its files are, what messages call it, and how
  orbax reads its arrays (a :func:`save` checkpoint, or a manager's step)."""
  fn: str                          # the function reading it, in messages
  path: str                        # its directory, which holds orbax's _CHECKPOINT_METADATA
  item: str                        # the subdirectory with the arrays and CHECKSUMS ("": path)
  name: str                        # the checkpoint, in messages
  remedy: str                      # what to do when it is corrupt
  read: Callable[[Any], Any]       # a target tree -> the tree orbax reads

  def file(self, name: str) -> str:
    """A file of the item, relative to :attr:`path` (as messages name it)."""
    return os.path.join(self.item, name) if self.item else name


def corrupt(where: Where, what: str) -> CorruptCheckpointError:
  return CorruptCheckpointError(f"{where.fn}: {where.name} is corrupt: {what}; {where.remedy}.")


def read_json(where: Where, name: str, what: str, raw: Optional[bytes] = None):
  """The JSON object in the file ``name`` (relative to the checkpoint's directory)."""
  file = os.path.join(where.path, name)
  if raw is None:
    if not os.path.isfile(file):
      raise corrupt(where, f"{what} {name} is missing (every checkpoint commopt writes has "
                           f"one)")
    with open(file, "rb") as f:
      raw = f.read()
  try:
    value = json.loads(raw.decode("utf-8"))
  except (UnicodeDecodeError, ValueError) as e:
    size = "empty" if not raw else f"truncated or garbled ({len(raw)} bytes, not valid JSON: {e})"
    raise corrupt(where, f"{what} {name} is {size}") from None
  if not isinstance(value, dict):
    raise corrupt(where, f"{what} {name} holds a JSON {type(value).__name__}, not an object")
  return value


def check_json_files(where: Where) -> None:
  """Orbax's JSON files parse: ``_METADATA`` (required), ``_sharding`` and
  ``array_metadatas/*`` (where present); orbax itself fails obscurely on a damaged one."""
  tree_file = where.file(TREE_FILE)
  tree = read_json(where, tree_file, "orbax's tree metadata").get("tree_metadata")
  if not isinstance(tree, dict) or not tree:
    raise corrupt(where, f"orbax's tree metadata {tree_file} has no 'tree_metadata' entries "
                         f"(got {type(tree).__name__})")
  item = os.path.join(where.path, where.item)
  names = [where.file("_sharding")] if os.path.isfile(os.path.join(item, "_sharding")) else []
  if os.path.isdir(os.path.join(item, "array_metadatas")):
    names += sorted(where.file(os.path.join("array_metadatas", f))
                    for f in os.listdir(os.path.join(item, "array_metadatas")))
  for name in names:
    read_json(where, name, "orbax's array metadata")


def brief(e: Exception) -> str:
  """An orbax or tensorstore error in a line (without tensorstore's spec)."""
  return f"{type(e).__name__}: {str(e).split(' [tensorstore_spec')[0][:400]}"
