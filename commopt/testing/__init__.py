"""Testing helpers for commopt and for code built on it.

- Simulated workers: :func:`vmap_workers` (N workers on one device) and
  :func:`shard_map_workers` (one worker per device of a mesh) run a transform
  on per-worker inputs stacked on a leading axis, so the two can be compared.
- The shared compressor checks (:mod:`commopt.testing.checks`): the suite
  every registered compressor passes, reusable on your own compressor.
- Whether a compressor trains (:mod:`commopt.testing.convergence`): its
  error-feedback residual over many steps against its declared bound, and
  SGD with it on a noisy strongly convex problem against plain SGD.
"""

from commopt.testing import checks, convergence
from commopt.testing._workers import Workers, shard_map_workers, vmap_workers

__all__ = ["Workers", "checks", "convergence", "shard_map_workers", "vmap_workers"]
