"""Orbax's handler for a checkpoint's item, which writes the checksum file as orbax finalizes
the item: inside the temporary directory, before the rename that commits the checkpoint.

Both :func:`save` and :class:`CheckpointManager` save through it; orbax is
optional, so the handler and its arguments are defined (and registered with
orbax) on first use, by :func:`handler_types`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import numpy as np

from commopt.checkpoint import _checksums
from commopt.checkpoint._files import CHECKSUMS, RECORD, orbax

# The handler's name, which orbax records in every checkpoint's _CHECKPOINT_METADATA
# ("item_handlers"): the module's name before it became a package. Never change it.
_TYPESTR = "commopt.checkpoint.ChecksummedHandler"


@functools.cache
def handler_types():
  """``(handler, save args, restore args)``: orbax's standard pytree handler, which also
  writes the checksum file when orbax finalizes the item, and its arguments (defined and
  registered with orbax on first use: orbax is optional)."""
  ocp = orbax()

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
      return _TYPESTR   # recorded in orbax's step metadata

    async def async_save(self, directory, *rest, args=None, **kwargs):
      self._checksums = args.checksums if isinstance(args, ChecksummedSave) else None
      return await super().async_save(directory, *rest, args=args, **kwargs)

    def finalize(self, directory) -> None:
      super().finalize(directory)
      data, self._checksums = self._checksums, None
      if data is None:
        raise RuntimeError(f"commopt.checkpoint: finalizing {directory} without checksums "
                           f"(saved without ChecksummedSave)")
      _checksums.write(directory, data)

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


def save_args(fn: str, params, opt_state, model_state, step):
  """``(orbax's save args, the step metadata's record)`` for one checkpoint: the tree, and
  its checksums (every process calls it; one gather of the hashes)."""
  item = {"params": params, "opt_state": opt_state}
  if model_state is not None:
    item["model_state"] = model_state
  if step is not None:
    item["step"] = np.asarray(step, np.int64)
  data = _checksums.dumps(_checksums.compute(item, fn))
  _, save, _ = handler_types()
  record = {RECORD: {"file": CHECKSUMS, "blake2b": _checksums.digest(data)}}
  return save(item, checksums=data), record
