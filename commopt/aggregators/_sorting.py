"""Sorting the workers' values coordinate by coordinate (the median family's core).

For the small worker counts of data parallelism a sorting network (Batcher's
odd-even merge sort) of elementwise minima and maxima over whole rows is much
faster than XLA's sort along the worker axis, and a median keeps only the
comparators that reach the middle rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

SORT_NETWORK_MAX_N = 32
"""Up to this many workers, :func:`sort_workers` runs a sorting network."""


@functools.lru_cache(maxsize=None)
def sorting_network(n: int) -> tuple[tuple[int, int], ...]:
  """Batcher's odd-even merge sort comparators ``(i, j)``, ``i < j``, for ``n`` inputs.

  Built for the next power of two; comparators that touch an index ``>= n``
  are dropped, which is exact because such an input would be a ``+inf`` pad
  that no comparator moves.

  Args:
    n: the number of inputs (an integer >= 1).

  Returns:
    The comparators in the order they apply: after each, row ``i`` holds the
    minimum and row ``j`` the maximum of the two.

  Examples:
    >>> from commopt.aggregators._sorting import sorting_network
    >>> len(sorting_network(8)), sorting_network(2)
    (19, ((0, 1),))

  References:
    Batcher, Sorting Networks and their Applications, AFIPS 1968.
  """
  p = 1
  while p < n:
    p *= 2
  pairs = []
  run = 1
  while run < p:
    k = run
    while k >= 1:
      for j in range(k % run, p - k, 2 * k):
        for i in range(min(k, p - j - k)):
          if (i + j) // (2 * run) == (i + j + k) // (2 * run) and i + j + k < n:
            pairs.append((i + j, i + j + k))
      k //= 2
    run *= 2
  return tuple(pairs)


def sort_workers(x: jax.Array) -> jax.Array:
  """``jnp.sort(x, axis=0)`` for the ``[n, ...]`` values of ``n`` workers.

  For ``n <= SORT_NETWORK_MAX_N`` a sorting network of elementwise min/max
  over whole rows, one fused pass, where XLA's sort orders each coordinate's
  ``n`` values on its own; a median keeps only the comparators that reach the
  middle rows, which XLA prunes (``benchmarks/bench_robust.py --problems speed``
  times both against ``jnp.sort`` and ``jnp.median``); beyond, ``jnp.sort``.
  Inputs must not hold NaN (the robust transforms zero non-finite workers
  before any rule sees them).

  Args:
    x: ``[n, ...]``, one row per worker.

  Returns:
    ``x`` sorted along axis 0, coordinate by coordinate.

  Examples:
    >>> import jax.numpy as jnp
    >>> from commopt.aggregators._sorting import sort_workers
    >>> sort_workers(jnp.array([[3.0, 0.0], [1.0, 2.0], [2.0, 1.0]]))[:, 0].tolist()
    [1.0, 2.0, 3.0]
  """
  n = x.shape[0]
  if n > SORT_NETWORK_MAX_N:
    return jnp.sort(x, axis=0)
  rows = list(x)
  for i, j in sorting_network(n):
    rows[i], rows[j] = jnp.minimum(rows[i], rows[j]), jnp.maximum(rows[i], rows[j])
  return jnp.stack(rows)


def median_workers(x: jax.Array) -> jax.Array:
  """The coordinate-wise median over axis 0 (the mean of the middle two for even ``n``).

  Args:
    x: ``[n, ...]``, one row per worker, without NaN.

  Returns:
    ``[...]``: the median of each coordinate over the ``n`` rows, as ``np.median``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from commopt.aggregators._sorting import median_workers
    >>> median_workers(jnp.array([[4.0], [1.0], [2.0], [9.0]])).tolist()
    [3.0]
  """
  n = x.shape[0]
  s = sort_workers(x)
  return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


__all__ = ["SORT_NETWORK_MAX_N", "median_workers", "sort_workers", "sorting_network"]
