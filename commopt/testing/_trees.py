"""Bit-for-bit comparison of pytrees, for checks that a step changed nothing."""

from __future__ import annotations

import jax
import numpy as np


def host_copy(tree):
  """A NumPy copy of every leaf of ``tree`` (a donated input is gone after the step)."""
  return jax.tree.map(np.array, jax.device_get(tree))


def assert_same_bits(a, b) -> None:
  """``a`` and ``b`` have the same structure, shapes, dtypes and bytes in every leaf.

  Stricter than ``==``: ``-0.0`` differs from ``0.0``, and NaNs compare by
  their bits.

  Examples:
    >>> import jax.numpy as jnp, commopt
    >>> commopt.testing.assert_same_bits({"w": jnp.zeros(2)}, {"w": jnp.zeros(2)})
  """
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  assert ta == tb, f"structures differ: {ta} and {tb}"
  for x, y in zip(la, lb):
    x, y = np.asarray(x), np.asarray(y)
    assert x.shape == y.shape and x.dtype == y.dtype, (
        f"{x.shape} {x.dtype} against {y.shape} {y.dtype}")
    assert x.tobytes() == y.tobytes()
