"""Sparsifying compressors: send a few coordinates as values and indices."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from commopt._src import base


def top_k(ratio: float | None = None, *, k: int | None = None) -> base.Compressor:
  """Sends the ``k`` coordinates of largest magnitude, as values and indices.

  Exactly one of ``ratio`` and ``k`` is given. With ``ratio`` each leaf keeps
  ``⌈ratio · size⌉`` coordinates. The payload is the values in the input dtype
  and their int32 flat indices. Top-k is a contraction:
  ``‖x − C(x)‖² ≤ (1 − k/d)‖x‖²``; use it with error feedback.

  Args:
    ratio: fraction of each leaf to send, in (0, 1].
    k: number of coordinates to send per leaf, in [1, leaf size].

  Returns:
    A non-linear :class:`~commopt.Compressor`.

  Example:
    >>> import jax.numpy as jnp, commopt
    >>> c = commopt.top_k(k=2)
    >>> x = jnp.array([0.1, -3.0, 2.0, 0.5])
    >>> payload, _ = c.encode(x, c.init(x), None)
    >>> c.decode(payload, None, x).tolist()
    [0.0, -3.0, 2.0, 0.0]

  References:
    Stich et al., Sparsified SGD with Memory, NeurIPS 2018.
    Alistarh et al., The Convergence of Sparsified Gradient Methods, NeurIPS 2018.
  """
  if (ratio is None) == (k is None):
    raise ValueError(
        f"top_k: give exactly one of `ratio` and `k`, got ratio={ratio!r}, k={k!r}.")
  if ratio is not None:
    ratio = base.check_ratio("ratio", ratio, fn="top_k")
  else:
    k = base.check_positive_int("k", k, fn="top_k")

  def leaf_k(shape) -> int:
    size = base.leaf_size(shape)
    if ratio is not None:
      # Rounded first so that e.g. 0.07 * 100 keeps 7, not 8.
      return max(1, min(size, math.ceil(round(ratio * size, 6))))
    if k > size:
      raise ValueError(
          f"top_k: `k` must be at most the leaf size, got k={k} for a leaf of "
          f"shape {tuple(shape)} (size {size}). Use `ratio=` or a smaller k.")
    return k

  def encode(x, state, key):
    flat = x.reshape(-1)
    _, indices = jax.lax.top_k(jnp.abs(flat), leaf_k(x.shape))
    indices = indices.astype(jnp.int32)
    return {"values": flat[indices], "indices": indices}, state

  def decode(payload, state, like):
    flat = jnp.zeros((base.leaf_size(like.shape),), like.dtype)
    flat = flat.at[payload["indices"]].set(payload["values"].astype(like.dtype))
    return flat.reshape(like.shape)

  def payload_bits(shape, dtype):
    return leaf_k(shape) * (base.dtype_bits(dtype) + 32)

  name = f"top_k(ratio={ratio})" if ratio is not None else f"top_k(k={k})"
  return base.Compressor(
      name=name,
      init=base.stateless_init,
      encode=encode,
      decode=decode,
      payload_bits=payload_bits,
  )
