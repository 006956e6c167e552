"""Magnitude top-k: the coordinates of largest ``|x|``, in ascending index order.

:func:`select_top_k` checks its arguments, then runs
:mod:`commopt.kernels.select.reference` (``lax.top_k`` on the key, then a
sort of the ``k`` indices), :mod:`commopt.kernels.select.histogram` (the
same selection in XLA by histograms and bit-packed words, what the CPU runs
for large ``k``) or :mod:`commopt.kernels.select.pallas` (a radix select that
never sorts). All rank by :func:`~commopt.kernels.magnitude_key` (NaN above
``inf``, ``-0.0`` tied with ``0.0``), break ties to the lower index, and
return the same coordinates in the same order.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from commopt._src import base
from commopt.kernels import _dispatch as dispatch
from commopt.kernels.select import histogram
from commopt.kernels.select import pallas as kernel
from commopt.kernels.select import reference

BLOCK = 1024
"""Default coordinates per Pallas program."""
RADIX_BITS = 4
"""Default digit width of the radix select (16-bin histograms)."""


def select_top_k(x: jax.Array, k: int, *, implementation: Optional[str] = None,
                 interpret: Optional[bool] = None, block: int = BLOCK,
                 radix_bits: int = RADIX_BITS, approx: bool = False,
                 recall_target: float = 0.95):
  """The ``k`` coordinates of largest magnitude, as values and indices in index order.

  Ranking: by :func:`magnitude_key` (``|x|``; NaN counts as the largest
  magnitude, above ``inf``), ties to the lower index. The reference
  (``"xla"``) is ``lax.top_k`` on the key followed by a sort of the ``k``
  indices; on the CPU, for ``k`` of at least
  :data:`~commopt.kernels.select.histogram.MIN_K`, it runs the same
  selection by histograms and bit-packed words instead (XLA:CPU's
  ``lax.top_k`` slows with ``k``). The Pallas kernel is a radix select (see
  the module docstring). All return the same coordinates in the same order.

  With ``approx=True`` the reference selects with ``lax.approx_max_k`` on a
  TPU (at least ``recall_target`` of the true top ``k`` in expectation);
  elsewhere ``approx_max_k`` is exact, and the selection is the exact one
  above. The indices are sorted in every case.

  Args:
    x: a floating-point array; it is flattened.
    k: how many coordinates, in ``[1, x.size]``.
    implementation: ``"auto"``, ``"xla"``, ``"pallas"``, or ``None`` for the
      innermost :func:`~commopt.kernels.implementation` scope's (``"auto"``
      outside any).
    interpret: run the Pallas kernel through the Pallas interpreter; ``None``
      takes the scope's (``False`` outside any).
    block: coordinates per Pallas program, a power of two >= 32.
    radix_bits: digit width of the select, 1 to 8 (``⌈31/radix_bits⌉``
      histogram passes of ``2**radix_bits`` bins).
    approx: allow ``lax.approx_max_k`` on a TPU (the Pallas kernel is exact).
    recall_target: ``approx_max_k``'s recall target, in (0, 1].

  Returns:
    ``(values, indices)``: ``[k]`` in ``x``'s dtype and ``[k]`` int32 flat
    indices, ascending.

  Examples:
    >>> import jax.numpy as jnp
    >>> from commopt.kernels import select_top_k
    >>> x = jnp.array([0.1, -3.0, 2.0, 0.5, -2.0])
    >>> values, indices = select_top_k(x, 3)
    >>> values.tolist(), indices.tolist()
    ([-3.0, 2.0, -2.0], [1, 2, 4])
    >>> select_top_k(x, 3, implementation="pallas", interpret=True)[1].tolist()
    [1, 2, 4]
  """
  if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(
        f"select_top_k: `x` must be a floating-point array, got "
        f"{getattr(x, 'dtype', type(x).__name__)}.")
  flat = jnp.reshape(x, (-1,))
  n = flat.shape[0]
  if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
    raise ValueError(f"select_top_k: `k` must be an integer in [1, {n}] (x.size), got {k!r}.")
  if n >= 2**31:
    raise ValueError(f"select_top_k: `x` must have fewer than 2**31 elements, got {n}.")
  block = dispatch.check_block(block, "select_top_k")
  if isinstance(radix_bits, bool) or not isinstance(radix_bits, int) or not 1 <= radix_bits <= 8:
    raise ValueError(
        f"select_top_k: `radix_bits` must be an integer in [1, 8], got {radix_bits!r}.")
  if not isinstance(approx, bool):
    raise ValueError(f"select_top_k: `approx` must be True or False, got {approx!r}.")
  if (isinstance(recall_target, bool) or not isinstance(recall_target, (int, float))
      or not 0.0 < recall_target <= 1.0):
    raise ValueError(
        f"select_top_k: `recall_target` must be a number in (0, 1], got {recall_target!r}.")
  pallas, interpret = dispatch.resolve(implementation, interpret, "select_top_k")
  if pallas:
    if kernel.suits_sampled(n, k):
      return kernel.select_top_k_sampled(flat, k, radix_bits, block, interpret)
    return kernel.select_top_k(flat, k, radix_bits, block, interpret)
  if histogram.suits(n, k):
    return histogram.select_top_k(flat, k)
  return reference.select_top_k(flat, k, approx, recall_target)


def first_true(mask: jax.Array, capacity: int, *, implementation: Optional[str] = None,
               interpret: Optional[bool] = None, block: int = BLOCK) -> jax.Array:
  """The flat indices of the first ``capacity`` true entries of ``mask``, ascending.

  The compaction behind every data-dependent sparsifier (``threshold``,
  ``gradient_dropping``, the sampled ``top_k``, ``random_k``'s Bernoulli
  draws, ATOMO): slots past the number of true entries hold ``mask.size``
  (out of range, dropped by a scatter with ``mode="drop"``). The reference
  packs the mask 32 entries to a word, scans the words' counts and searches them
  per slot (``commopt._src.bits.first_true``); the Pallas kernel
  counts each program's true entries in one pass and writes their indices
  in a second. Both return the same indices.

  Args:
    mask: a boolean array; it is flattened.
    capacity: how many slots, a non-negative integer.
    implementation: ``"auto"``, ``"xla"``, ``"pallas"``, or ``None`` for the
      innermost :func:`~commopt.kernels.implementation` scope's.
    interpret: run the Pallas kernel through the Pallas interpreter.
    block: mask entries per Pallas program, a power of two >= 32.

  Returns:
    ``[capacity]`` int32 indices.

  Examples:
    >>> import jax.numpy as jnp
    >>> from commopt.kernels import first_true
    >>> mask = jnp.array([False, True, True, False, True])
    >>> first_true(mask, 2).tolist(), first_true(mask, 4).tolist()
    ([1, 2], [1, 2, 4, 5])
    >>> first_true(mask, 4, implementation="pallas", interpret=True).tolist()
    [1, 2, 4, 5]
  """
  if not hasattr(mask, "dtype") or mask.dtype != jnp.bool_:
    raise ValueError(
        f"first_true: `mask` must be a boolean array, got "
        f"{getattr(mask, 'dtype', type(mask).__name__)}.")
  flat = jnp.reshape(mask, (-1,))
  n = flat.shape[0]
  if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 0:
    raise ValueError(f"first_true: `capacity` must be a non-negative integer, got {capacity!r}.")
  if n >= 2**31:
    raise ValueError(f"first_true: `mask` must have fewer than 2**31 elements, got {n}.")
  block = dispatch.check_block(block, "first_true")
  capacity = int(capacity)
  pallas, interpret = dispatch.resolve(implementation, interpret, "first_true")
  if pallas and n and capacity:
    return kernel.first_true(flat, capacity, block, interpret)
  return base.first_true(flat, capacity)
