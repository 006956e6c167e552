"""Magnitude top-k, in ascending index order.

- :mod:`~commopt.kernels.select.reference`: the sort key and ``lax.top_k``.
- :mod:`~commopt.kernels.select.histogram`: the same selection in XLA by
  histograms and bit-packed words (the CPU's, for large ``k``).
- :mod:`~commopt.kernels.select.pallas`: the Pallas kernels: the sampled
  two-pass select, the radix select it falls back to, and the two-pass
  compaction of a mask (:func:`first_true`).
- :mod:`~commopt.kernels.select.api`: :func:`select_top_k` and
  :func:`first_true`, which check their arguments and dispatch.
"""

from commopt.kernels.select.api import BLOCK, RADIX_BITS, first_true, select_top_k
from commopt.kernels.select.reference import magnitude_key

__all__ = ["BLOCK", "RADIX_BITS", "first_true", "magnitude_key", "select_top_k"]
