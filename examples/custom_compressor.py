"""A compressor of your own: int8 with one scale per leaf, in one file.

Encode sends ``round(x / s)`` as int8 with ``s = max|x| / 127``; decode
multiplies back. ``compressed_mean`` adds error feedback, the reduction
strategies and the wire audit; ``commopt.testing.checks.run_all`` holds it
to the bar every built-in compressor passes.
"""

import math

import jax.numpy as jnp

import commopt


def int8_scaled() -> commopt.Compressor:
  """int8 levels with one float32 scale per leaf (8 bits per element + 32)."""

  def encode(x, state, key):
    del key
    scale = jnp.max(jnp.abs(x)).astype(jnp.float32) / 127
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(x.astype(jnp.float32) / safe), -127, 127).astype(jnp.int8)
    return {"q": q, "scale": scale}, state

  def decode(payload, state, like):
    del state
    return (payload["q"].astype(jnp.float32) * payload["scale"]).astype(like.dtype)

  return commopt.Compressor(
      name="int8_scaled", init=lambda leaf: commopt.compressors.EmptyState(),
      encode=encode, decode=decode,
      payload_bits=lambda shape, dtype: 8 * math.prod(shape) + 32)


commopt.compressors.register("int8_scaled", int8_scaled, replace=True)
