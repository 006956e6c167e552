"""Testing helpers for commopt and for code built on it.

- Simulated workers: :func:`vmap_workers` (N workers on one device) and
  :func:`shard_map_workers` (one worker per device of a mesh) run a transform
  on per-worker inputs stacked on a leading axis, so the two can be compared.
- The shared compressor checks (:mod:`commopt.testing.checks`): the suite
  every registered compressor passes, reusable on your own compressor.
- Whether a compressor trains (:mod:`commopt.testing.convergence`): its
  error-feedback residual over many steps against its declared bound, and
  SGD with it on a noisy strongly convex problem against plain SGD.
- :func:`assert_same_bits` and :func:`host_copy`: that a (skipped) step
  changed nothing, bit for bit.
- Processes a test started (:mod:`commopt.testing.processes`): whether they
  still run, waiting for them to end, ending only one's own.
"""

from commopt.testing import checks, convergence, processes
from commopt.testing._trees import assert_same_bits, host_copy
from commopt.testing._workers import Workers, shard_map_workers, vmap_workers

__all__ = ["Workers", "assert_same_bits", "checks", "convergence", "host_copy", "processes",
           "shard_map_workers", "vmap_workers"]
