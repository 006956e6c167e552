"""Coding-theory accounting for QSGD: Elias-omega code lengths of its payloads."""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp

from commopt import kernels
from commopt._src import base
from commopt._src import bits as bitops
from commopt.compressors._qcommon import _check_levels


def qsgd_elias_bits(shape, levels: int, bucket_size: Optional[int] = 512) -> float:
  """QSGD's bound on the expected size of its Elias-coded payload, in bits.

  Theorem 3.4 of Alistarh et al.: a bucket of ``n`` coordinates with ``s``
  levels, coded as its float32 norm followed by (Elias(gap), sign,
  Elias(level)) for each non-zero, costs at most
  ``(3 + 1.5·log₂(2(s²+n)/(s(s+√n)))) · s(s+√n) + 32`` bits in expectation
  (the lower-order ``o(1)`` term dropped). :func:`qsgd` sends the fixed-width
  packing instead, which a collective can move without a variable-length
  decoder; this is what entropy coding would have saved.

  Args:
    shape: the leaf's shape.
    levels: ``s``.
    bucket_size: as given to :func:`qsgd`.

  Returns:
    The bound for the whole leaf, summed over buckets.

  Examples:
    >>> from commopt.compressors import qsgd_elias_bits
    >>> round(qsgd_elias_bits((1 << 20,), levels=1, bucket_size=None))   # vs 2 Mbit packed
    20017
  """
  levels = _check_levels(levels, "qsgd_elias_bits")
  n = base.leaf_size(shape)
  total = 0.0
  for count in base.block_counts(n, base.check_block_size(bucket_size, "qsgd_elias_bits", "bucket_size")):
    count = float(count)
    nonzeros = levels * (levels + math.sqrt(count))
    total += (3 + 1.5 * math.log2(2 * (levels ** 2 + count) / nonzeros)) * nonzeros + 32
  return total


def _elias_omega_bits(k: jax.Array) -> jax.Array:
  """Length of the Elias omega code of each positive integer in ``k``."""
  k = k.astype(jnp.uint32)
  total = jnp.ones(k.shape, jnp.int32)
  for _ in range(6):  # 2**32 -> 32 -> 5 -> 2 -> 1: five rounds suffice.
    active = k > 1
    length = 32 - jax.lax.clz(k).astype(jnp.int32)
    total = total + jnp.where(active, length, 0)
    k = jnp.where(active, (length - 1).astype(jnp.uint32), k)
  return total


def qsgd_coded_bits(payload, shape, levels: int, bucket_size: Optional[int] = 512) -> jax.Array:
  """Measured size of one :func:`qsgd` payload under the paper's Elias coding.

  Per bucket: 32 bits of norm, then per non-zero level the Elias omega code
  of its gap from the previous non-zero, a sign bit and the Elias omega code
  of ``|l|``. Compare with :func:`qsgd_elias_bits` (the bound) and with
  ``payload_bits`` (the fixed width actually sent).

  Args:
    payload: from ``qsgd(levels, bucket_size).encode``.
    shape: the leaf's shape.
    levels: as given to :func:`qsgd`.
    bucket_size: as given to :func:`qsgd`.

  Returns:
    An int32 scalar.
  """
  levels = _check_levels(levels, "qsgd_coded_bits")
  n = base.leaf_size(shape)
  level = kernels.unpack_bits(payload["codes"], bitops.code_bits(2 * levels + 1), n)
  level = base.blocks(level.astype(jnp.int32) - levels, bucket_size)
  nb, size = level.shape
  valid = (jnp.arange(nb * size) < n).reshape(nb, size)
  nonzero = (level != 0) & valid
  pos = jnp.broadcast_to(jnp.arange(size), (nb, size))
  last = jax.lax.cummax(jnp.where(nonzero, pos, -1), axis=1)
  previous = jnp.pad(last[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
  per = _elias_omega_bits(pos - previous) + 1 + _elias_omega_bits(jnp.abs(level))
  return 32 * nb + jnp.sum(jnp.where(nonzero, per, 0))
