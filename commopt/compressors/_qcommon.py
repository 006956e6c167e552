"""Helpers the quantisers share: block counts, random bits, stochastic rounding, sign words."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from commopt import kernels
from commopt._src import base
from commopt._src import bits as bitops
from commopt._src import rng


_F32 = jnp.float32


def _num_blocks(n: int, block_size: Optional[int]) -> int:
  return 1 if block_size is None else -(-n // block_size)


def _uniform(key, n: int, fn: str) -> jax.Array:
  """``n`` uniforms in [0, 1) made of :func:`_random_bits` (``kernels.uniform_from_bits``)."""
  return kernels.uniform_from_bits(_random_bits(key, n, fn))


def _random_bits(key, n: int, fn: str) -> jax.Array:
  """``n`` random uint32 words for stochastic rounding: a seeded counter hash (:mod:`commopt._src.rng`)."""
  return rng.counter_bits(base.need_key(key, fn), n)


def _inverse(scales: jax.Array, top) -> jax.Array:
  """``top / scale`` per block (0 where the scale is 0).

  One multiply per coordinate, computed the same way by every program that
  contains it, so that stochastic rounding draws identical levels under jit,
  vmap and shard_map.
  """
  return jnp.where(scales > 0, top / jnp.where(scales > 0, scales, 1.0), 0.0)


def _block_norms(blocks: jax.Array) -> jax.Array:
  """``‖row‖₂`` of each row of ``blocks`` (``[B, n]``), computed without overflow.

  Each row is scaled by a power of two (:func:`commopt._src.base.pow2_scales` of its
  max-abs) before it is squared, then its norm scaled back: the same bits as
  ``jnp.linalg.norm(blocks, axis=1)`` wherever that is finite and its
  squares are normal, and finite wherever the norm itself is representable.
  """
  down, up = base.pow2_scales(jnp.max(jnp.abs(blocks), axis=1))
  return up * jnp.linalg.norm(blocks * down[:, None], axis=1)


def _stochastic_round(y: jax.Array, u: jax.Array) -> jax.Array:
  """``⌊y⌋ + 1`` with probability ``y - ⌊y⌋``, else ``⌊y⌋`` (unbiased)."""
  return jnp.floor(y + u)


def _flat32(x: jax.Array) -> jax.Array:
  return x.reshape(-1).astype(_F32)


def _sign_words(flat: jax.Array) -> jax.Array:
  """One bit per coordinate, set where the coordinate is negative."""
  return kernels.sign_bits(flat)


def _signs_from_words(words: jax.Array, n: int) -> jax.Array:
  """±1.0 per coordinate from :func:`_sign_words` (zeros were sent as +1)."""
  return 1.0 - 2.0 * kernels.unpack_bits(words, 1, n).astype(_F32)


def _words_bits(n: int, bits: int) -> int:
  return 32 * bitops.packed_words(n, bits)


def _out(values: jax.Array, like) -> jax.Array:
  return values.reshape(like.shape).astype(like.dtype)


def _check_levels(levels, fn: str, minimum: int = 1) -> int:
  return base.check_int("levels", levels, fn=fn, minimum=minimum)


def _signed_levels(block_size, width: int, top: int, scale_key: str):
  """decode and payload_bits of ``scale_block · l · (1/top)`` with codes ``l + top``.

  The reciprocal is multiplied, not divided by: XLA rewrites a division by a
  constant into that product inside some fusions and not others, so only
  the product decodes to the same bits wherever the decode is compiled (a
  gathered sum fuses it, :func:`commopt.comm.sum_decoded`).
  """
  inverse = np.float32(1.0) / np.float32(top)

  def decode(payload, state, like):
    n = base.leaf_size(like.shape)
    level = kernels.unpack_bits(payload["codes"], width, n).astype(_F32) - top
    return _out(base.per_element(payload[scale_key], n, block_size) * level * inverse, like)

  def payload_bits(shape, dtype):
    n = base.leaf_size(shape)
    return 32 * _num_blocks(n, block_size) + _words_bits(n, width)

  return decode, payload_bits
