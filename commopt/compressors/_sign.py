"""The sign family: ``sign`` (signSGD), ``scaled_sign`` (EF-signSGD) and ``onebit`` (1-bit SGD).

One bit per coordinate, packed 32 to a uint32 word (:mod:`commopt._src.bits`);
``scaled_sign`` and ``onebit`` add float32 scales.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from commopt import kernels
from commopt._src import base
from commopt.compressors._registry import register
from commopt.compressors._qcommon import (
    _flat32,
    _num_blocks,
    _out,
    _sign_words,
    _signs_from_words,
    _words_bits,
)


def sign() -> base.Compressor:
  """signSGD's compressor: ``sign(x)``, one bit per coordinate, no scale.

  The payload is ``⌈d/32⌉`` uint32 words; zeros are sent as ``+1``. The output
  has the magnitude 1 whatever the input's, so use it where only directions
  matter: :func:`~commopt.majority_vote` (signSGD with majority vote), or
  followed by a learning rate. It is neither unbiased nor a contraction.

  Returns:
    A non-linear :class:`~commopt.Compressor`.

  Examples:
    >>> import jax.numpy as jnp, commopt
    >>> c = commopt.sign()
    >>> x = jnp.array([0.5, -3.0, 0.0])
    >>> payload, _ = c.encode(x, c.init(x), None)
    >>> payload["signs"].tolist(), c.decode(payload, None, x).tolist()
    ([2], [1.0, -1.0, 1.0])

  References:
    Bernstein et al., signSGD: Compressed Optimisation for Non-Convex
    Problems, ICML 2018.
  """

  def encode(x, state, key):
    return {"signs": _sign_words(x.reshape(-1))}, state

  def decode(payload, state, like):
    return _out(_signs_from_words(payload["signs"], base.leaf_size(like.shape)), like)

  return base.Compressor(
      name="sign", init=base.stateless_init, encode=encode, decode=decode,
      payload_bits=lambda shape, dtype: _words_bits(base.leaf_size(shape), 1),
      error_kind="direction")


def scaled_sign(block_size: Optional[int] = None) -> base.Compressor:
  """EF-signSGD's compressor: ``‖x‖₁/d · sign(x)``, signs packed 32 to a word.

  The payload is one float32 scale per block (the block's mean magnitude)
  and ``⌈d/32⌉`` uint32 words of signs. Zeros are sent as ``+scale``. The
  compressor is biased, a contraction with ``δ = ‖x‖₁²/(d‖x‖₂²)`` per block,
  so use it with error feedback. Smaller blocks cost more scales and track
  the magnitudes of different regions of a tensor better.

  What error feedback keeps is bounded by ``√(1−δ)/(1−√(1−δ)) ≤ 2/δ`` times
  the input's norm, and ``δ`` can be as small as ``1/d`` (``1/block_size``):
  on a steady gradient the residual keeps growing slowly, about as ``√t``
  (13 then 18 times the gradient's norm after 250 and 500 steps on a
  4,096-element leaf), until
  ``δ`` of the compensated input stops shrinking. Blocks cap the bound at
  ``2 · block_size``.

  Args:
    block_size: coordinates per scale; ``None`` gives one scale per leaf.

  Returns:
    A non-linear :class:`~commopt.Compressor` (reduced by gather-decode-mean).

  Examples:
    >>> import jax.numpy as jnp, commopt
    >>> c = commopt.scaled_sign()
    >>> x = jnp.array([1.0, -3.0, 2.0])
    >>> payload, _ = c.encode(x, c.init(x), None)
    >>> c.decode(payload, None, x).tolist()
    [2.0, -2.0, 2.0]
    >>> c = commopt.scaled_sign(block_size=2)
    >>> c.decode(c.encode(x, None, None)[0], None, x).tolist()
    [2.0, -2.0, 2.0]

  References:
    Karimireddy et al., Error Feedback Fixes SignSGD and other Gradient
    Compression Schemes, ICML 2019.
    Zheng et al., Communication-Efficient Distributed Blockwise Momentum SGD
    with Error-Feedback, NeurIPS 2019.
  """
  block_size = base.check_block_size(block_size, "scaled_sign")

  def encode(x, state, key):
    scale, signs = kernels.sign_pack(_flat32(x), block_size)
    return {"scale": scale, "signs": signs}, state

  def decode(payload, state, like):
    n = base.leaf_size(like.shape)
    scale = base.per_element(payload["scale"], n, block_size)
    return _out(scale * _signs_from_words(payload["signs"], n), like)

  def encode_feedback(u, e, state, key):
    scale, signs, new_e = kernels.sign_feedback(u.reshape(-1), e.reshape(-1), block_size)
    return {"scale": scale, "signs": signs}, new_e.reshape(e.shape), state

  def payload_bits(shape, dtype):
    n = base.leaf_size(shape)
    return 32 * _num_blocks(n, block_size) + _words_bits(n, 1)

  name = "scaled_sign" if block_size is None else f"scaled_sign(block_size={block_size})"
  return base.Compressor(name=name, init=base.stateless_init, encode=encode,
                         decode=decode, payload_bits=payload_bits, error_kind="contractive",
                         encode_feedback=encode_feedback,
                         error_bound=lambda shape: 1.0 / base.block_len(
                             base.leaf_size(shape), block_size))


def onebit() -> base.Compressor:
  """1-bit SGD's quantiser: each sign is reconstructed to its group's mean.

  Coordinates ``≥ 0`` decode to the mean of the non-negative coordinates and
  negative ones to the mean of the negative coordinates: the least-squares
  reconstruction from one bit per coordinate, so its error is never larger
  than :func:`scaled_sign`'s. The payload is two float32 means and
  ``⌈d/32⌉`` words. Biased; use it with error feedback, as Seide et al. did.

  Returns:
    A non-linear :class:`~commopt.Compressor`.

  Examples:
    >>> import jax.numpy as jnp, commopt
    >>> c = commopt.compressors.onebit()
    >>> x = jnp.array([1.0, -3.0, 2.0, -1.0])
    >>> c.decode(c.encode(x, None, None)[0], None, x).tolist()
    [1.5, -2.0, 1.5, -2.0]

  References:
    Seide et al., 1-Bit Stochastic Gradient Descent and its Application to
    Data-Parallel Distributed Training of Speech DNNs, Interspeech 2014.
  """

  def encode(x, state, key):
    flat = _flat32(x)
    neg = flat < 0
    zero = jnp.zeros((), jnp.float32)
    # One pass over the leaf for the count and the two sums (a variadic reduce), not three.
    n_neg, sum_neg, sum_pos = jax.lax.reduce(
        (neg.astype(jnp.int32), jnp.where(neg, flat, zero), jnp.where(neg, zero, flat)),
        (jnp.zeros((), jnp.int32), zero, zero),
        lambda a, b: tuple(x + y for x, y in zip(a, b)), (0,))
    n_pos = flat.shape[0] - n_neg
    mean_pos = sum_pos / jnp.maximum(n_pos, 1)
    mean_neg = sum_neg / jnp.maximum(n_neg, 1)
    return {"means": jnp.stack([mean_pos, mean_neg]), "signs": _sign_words(flat)}, state

  def decode(payload, state, like):
    n = base.leaf_size(like.shape)
    neg = kernels.unpack_bits(payload["signs"], 1, n).astype(jnp.float32)
    # Each mean times a 0/1 weight, summed: the same values as a select between the two
    # for finite normal means (x·1 + y·0 = x; XLA:CPU flushes subnormal ones to zero, and
    # -0 comes out +0). XLA:CPU fuses this arithmetic into the sum of the gathered
    # payloads far more cheaply than a select (bench_step.py's onebit row under
    # two_phase times the step that decodes this way).
    # A non-finite mean makes every coordinate non-finite (inf·0 is NaN).
    means = payload["means"]
    return _out(means[0] * (1.0 - neg) + means[1] * neg, like)

  return base.Compressor(
      name="onebit", init=base.stateless_init, encode=encode, decode=decode,
      payload_bits=lambda shape, dtype: 64 + _words_bits(base.leaf_size(shape), 1),
      # Never worse than scaled_sign over the whole leaf.
      error_kind="contractive", error_bound=lambda shape: 1.0 / base.leaf_size(shape))


register("sign", sign)
register("scaled_sign", scaled_sign, variants=({"block_size": 256},))
register("onebit", onebit)
