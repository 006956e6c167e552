"""Data parallelism over device meshes: the pure step, its state layout, and the helpers it uses.

- :func:`data_parallel` / :class:`DataParallel`: ``init``, the jitted ``step``,
  the pure ``step_fn`` and the state's ``state_specs`` for a ``loss_fn`` and an
  optax transform.
- :func:`nnx_data_parallel`: the same for a Flax nnx model with mutable state.
- :func:`zero_data_parallel` / :class:`ZeroDataParallel`: parameters and optimizer
  state sharded over the data axis (ZeRO-3), weights and gradients optionally
  compressed on their way (qwZ, qgZ).
- :func:`overlapped_data_parallel` / :func:`overlapped_diloco` / :func:`eager_diloco`:
  host-level drivers whose exchange runs on a thread of its own, beside the next backward
  pass or inner steps.
- For a hand-written ``shard_map`` step: :func:`local_value_and_grad` (gradients
  that stay on the worker), :meth:`DataParallel.state_specs` (which state
  leaves are per-worker), :func:`stack_workers` / :func:`unstack_workers`.
"""

from commopt.parallel._data_parallel import DataParallel, Layout, data_parallel
from commopt.parallel._eager import EagerDiLoCo, EagerState, eager_diloco
from commopt.transforms._layout import local_value_and_grad, stack_workers, unstack_workers
from commopt.parallel._overlapped import (
    OverlappedDataParallel,
    OverlappedDiLoCo,
    OverlappedState,
    OverlappedDataParallelState,
    overlapped_data_parallel,
    overlapped_diloco,
)
from commopt.parallel._zero import ZeroDataParallel, zero_data_parallel
from commopt.parallel._zero_leaves import ResidualLeaf, ShardedLeaf, ZeroFeedbackState

_NNX = ("NnxDataParallel", "NnxTrainState", "nnx_data_parallel")
_SFB_NNX = ("SFBKernel", "SFBLinear", "sfb_mask")


def __getattr__(name):
  # Flax is needed only for nnx models: it is imported on first use.
  if name in _NNX + _SFB_NNX:
    try:
      from commopt.parallel import _nnx, _sfb_nnx
    except ImportError as e:
      raise ImportError(
          f"commopt.{name} needs flax (`pip install flax`, or commopt's `nnx` extra: "
          f"`pip install commopt[nnx]`): {e}") from e
    return getattr(_nnx if name in _NNX else _sfb_nnx, name)
  raise AttributeError(f"module 'commopt.parallel' has no attribute {name!r}")

__all__ = ["DataParallel", "Layout", "NnxDataParallel", "NnxTrainState", "OverlappedDiLoCo",
           "OverlappedState", "overlapped_diloco", "EagerDiLoCo", "EagerState", "eager_diloco", "OverlappedDataParallel",
           "OverlappedDataParallelState", "overlapped_data_parallel", "SFBKernel", "SFBLinear",
           "ResidualLeaf", "ShardedLeaf", "ZeroDataParallel", "ZeroFeedbackState", "data_parallel", "local_value_and_grad",
           "nnx_data_parallel", "sfb_mask", "stack_workers", "unstack_workers",
           "zero_data_parallel"]
