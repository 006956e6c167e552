"""A directory of steps: orbax's ``CheckpointManager`` with commopt's checksums, verification
and resize (see :class:`CheckpointManager`)."""

from __future__ import annotations

import os
from typing import Callable, Optional

import numpy as np

from commopt._src import base
from commopt.checkpoint._files import EARLIER, ITEM, Where, orbax
from commopt.checkpoint._handler import handler_types, save_args
from commopt.checkpoint._restore import Restored, restore_at
from commopt.parallel._data_parallel import DataParallel


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
    ocp = orbax()
    handler_type, save_args, self._restore_args = handler_types()
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
    ocp = orbax()
    args, record = save_args(fn, params, opt_state, model_state, step)
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
    remedy = (f"{EARLIER}: restore(dp, params, step={earlier[-1]}), the one before it of the "
              f"steps kept, {steps}" if earlier else
              f"no earlier step is kept (the steps kept are {steps})")
    ocp = orbax()

    def read(target):
      args = ocp.args.Composite(**{ITEM: self._restore_args(target)})
      return self._mgr.restore(step, args=args)[ITEM]

    where = Where(fn, path, ITEM, f"step {step} ({path!r})", remedy, read)
    return restore_at(where, dp, params, model_state)

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
