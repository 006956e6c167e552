"""Magnitude top-k, in ascending index order.

- :mod:`~commopt.kernels.select.reference`: the sort key and ``lax.top_k``.
- :mod:`~commopt.kernels.select.pallas`: the radix-select Pallas kernel.
- :mod:`~commopt.kernels.select.api`: :func:`select_top_k`, which checks its
  arguments and dispatches between the two.
"""

from commopt.kernels.select.api import BLOCK, RADIX_BITS, select_top_k
from commopt.kernels.select.reference import magnitude_key

__all__ = ["BLOCK", "RADIX_BITS", "magnitude_key", "select_top_k"]
