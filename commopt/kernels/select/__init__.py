"""Magnitude top-k, in ascending index order.

- :mod:`~commopt.kernels.select.reference`: the sort key and ``lax.top_k``.
- :mod:`~commopt.kernels.select.histogram`: the same selection in XLA by
  histograms and bit-packed words (the CPU's, for large ``k``).
- :mod:`~commopt.kernels.select.pallas`: the radix-select Pallas kernel.
- :mod:`~commopt.kernels.select.api`: :func:`select_top_k`, which checks its
  arguments and dispatches between them.
"""

from commopt.kernels.select.api import BLOCK, RADIX_BITS, select_top_k
from commopt.kernels.select.reference import magnitude_key

__all__ = ["BLOCK", "RADIX_BITS", "magnitude_key", "select_top_k"]
