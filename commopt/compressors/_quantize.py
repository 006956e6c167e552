"""Quantisation compressors: every coordinate in a few bits."""

from __future__ import annotations

import jax.numpy as jnp

from commopt._src import base
from commopt._src import bits as bitops


def scaled_sign() -> base.Compressor:
  """EF-signSGD's compressor: ``‖x‖₁/d · sign(x)``, signs packed 32 to a word.

  The payload is one float32 scale and ``⌈d/32⌉`` uint32 words. Zeros are
  sent as ``+scale``. The compressor is biased (a contraction with
  ``δ = ‖x‖₁²/(d‖x‖₂²)``), so use it with error feedback.

  Returns:
    A non-linear :class:`~commopt.Compressor` (reduced by gather-decode-mean).

  Example:
    >>> import jax.numpy as jnp, commopt
    >>> c = commopt.scaled_sign()
    >>> x = jnp.array([1.0, -3.0, 2.0])
    >>> payload, _ = c.encode(x, c.init(x), None)
    >>> c.decode(payload, None, x).tolist()
    [2.0, -2.0, 2.0]

  References:
    Karimireddy et al., Error Feedback Fixes SignSGD and other Gradient
    Compression Schemes, ICML 2019.
  """

  def encode(x, state, key):
    flat = x.reshape(-1)
    scale = jnp.mean(jnp.abs(flat.astype(jnp.float32)))
    signs = bitops.pack(flat < 0, bits=1)
    return {"scale": scale, "signs": signs}, state

  def decode(payload, state, like):
    n = base.leaf_size(like.shape)
    negative = bitops.unpack(payload["signs"], n, bits=1)
    values = payload["scale"] * (1.0 - 2.0 * negative.astype(jnp.float32))
    return values.reshape(like.shape).astype(like.dtype)

  def payload_bits(shape, dtype):
    return 32 + 32 * bitops.packed_words(base.leaf_size(shape), 1)

  return base.Compressor(
      name="scaled_sign",
      init=base.stateless_init,
      encode=encode,
      decode=decode,
      payload_bits=payload_bits,
  )
