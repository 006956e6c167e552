"""Random sparsification: random-k (shared seed) and Wangni et al.'s variance-balanced keep."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from commopt._src import base, rng
from commopt.compressors._registry import register
from commopt.compressors._qcommon import _uniform
from commopt.compressors._sparse import (
    _VALUES_CODEC,
    _budget,
    _budget_name,
    _pairs_codec,
    _sparse_compressor,
    _take,
    first_true,
)


class RandomKState(NamedTuple):
  """Per-leaf state of shared-seed :func:`random_k`: the indices of the last step.

  Every worker draws the same indices from the shared step key, so they never
  cross the wire; ``decode`` reads them from here.
  """
  indices: jax.Array


def random_k(ratio: float | None = None, *, k: int | None = None, shared_seed: bool = True,
             scale: bool = False) -> base.Compressor:
  """Sends ``k`` coordinates chosen uniformly at random.

  Exactly one of ``ratio`` and ``k`` is given. Each leaf sends a uniformly
  random set of ``k`` distinct coordinates, drawn in O(k) work as the first
  ``k`` in range of a keyed pseudo-random permutation
  (:func:`commopt._src.rng.distinct_indices`), sent in ascending order.

  With ``shared_seed=True`` (the default) every worker draws the same
  coordinates from the shared step key, so the indices never cross the wire:
  the payload is the ``k`` values alone (``k · value bits``), it is linear,
  and :func:`~commopt.compressed_mean` all-reduces it. The indices are kept in
  the per-leaf :class:`RandomKState` for ``decode``. With
  ``shared_seed=False`` each worker draws its own coordinates and sends
  values and int32 indices, which are all-gathered.

  ``scale=True`` multiplies the values by ``d/k``, which makes the compressor
  unbiased (``E[C(x)] = x``, variance ``(d/k − 1)‖x‖²``); unscaled it is a
  biased contraction in expectation, ``E‖x − C(x)‖² = (1 − k/d)‖x‖²``, meant
  for error feedback.

  Args:
    ratio: fraction of each leaf to send, in (0, 1].
    k: number of coordinates to send per leaf, in [1, leaf size].
    shared_seed: draw the same coordinates on every worker (values only on
      the wire, linear).
    scale: multiply by ``d/k`` (unbiased).

  Returns:
    A :class:`~commopt.Compressor`, linear with shared randomness when
    ``shared_seed``.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from commopt.compressors import random_k
    >>> c = random_k(k=3)
    >>> x = jnp.arange(1.0, 9.0)
    >>> payload, state = c.encode(x, c.init(x), jax.random.PRNGKey(0))
    >>> list(payload), int(jnp.count_nonzero(c.decode(payload, state, x)))
    (['values'], 3)

  References:
    Stich et al., Sparsified SGD with Memory, NeurIPS 2018.
    Wangni et al., Gradient Sparsification for Communication-Efficient
    Distributed Optimization, NeurIPS 2018.
  """
  leaf_k = _budget("random_k", ratio, k)
  shared_seed = base.check_bool("shared_seed", shared_seed, fn="random_k")
  scale = base.check_bool("scale", scale, fn="random_k")

  def draw(key, shape):
    return rng.distinct_indices(base.need_key(key, "random_k"), base.leaf_size(shape),
                                leaf_k(shape))

  def factor(shape):
    return base.leaf_size(shape) / leaf_k(shape) if scale else 1.0

  def values(x, indices):
    return _take(x.reshape(-1), indices) * jnp.asarray(factor(x.shape), x.dtype)

  if shared_seed:
    def init(leaf):
      return RandomKState(indices=jnp.zeros((leaf_k(leaf.shape),), jnp.int32))

    def encode(x, state, key):
      indices = draw(key, x.shape)
      return {"values": values(x, indices)}, RandomKState(indices=indices)

    decode, accumulate = _pairs_codec(lambda payload, state: (state.indices, payload["values"]))

    def payload_bits(shape, dtype):
      return leaf_k(shape) * base.dtype_bits(dtype)
  else:
    init = base.stateless_init

    def encode(x, state, key):
      indices = draw(key, x.shape)
      return {"values": values(x, indices), "indices": indices}, state

    decode, accumulate = _VALUES_CODEC

    def payload_bits(shape, dtype):
      return leaf_k(shape) * (base.dtype_bits(dtype) + 32)

  return base.Compressor(
      name=_budget_name("random_k", ratio, k, shared_seed=shared_seed, scale=scale),
      init=init, stateful=shared_seed, encode=encode, decode=decode, payload_bits=payload_bits,
      sparse_values=decode is _VALUES_CODEC[0],
      accumulate=accumulate,
      linear=shared_seed, shared_randomness=shared_seed,
      **(dict(error_kind="unbiased",
              error_bound=lambda shape: base.leaf_size(shape) / leaf_k(shape) - 1.0) if scale
         else dict(error_kind="expected_contractive",
                   error_bound=lambda shape: leaf_k(shape) / base.leaf_size(shape))))


def keep_probabilities(magnitude: jax.Array, k: float, iterations: int) -> jax.Array:
  """Wangni et al.'s keep probabilities ``p_i = min(1, λ|x_i|)`` with ``Σ p ≈ k``.

  The greedy algorithm: start from ``p ∝ |x|`` summing to ``k``, then rescale
  the unsaturated probabilities so that the total is ``k`` again, a fixed
  number of times. Coordinates that are zero are never kept.
  """
  total = jnp.sum(magnitude)
  p = jnp.minimum(1.0, k * magnitude / jnp.where(total > 0, total, 1.0))
  for _ in range(iterations):
    active = p < 1.0
    saturated = jnp.sum(~active)
    mass = jnp.sum(jnp.where(active, p, 0.0))
    c = jnp.where(mass > 0, (k - saturated) / jnp.where(mass > 0, mass, 1.0), 1.0)
    p = jnp.where(active, jnp.minimum(1.0, p * jnp.maximum(c, 1.0)), 1.0)
  return p


def variance_balanced(ratio: float | None = None, *, k: int | None = None,
                      iterations: int = 2, capacity: float = 2.0) -> base.Compressor:
  """Unbiased sparsification with variance-minimising keep probabilities (Wangni et al. 2018).

  Coordinate ``i`` is kept with probability ``p_i = min(1, λ|x_i|)``, with
  ``λ`` set (by the paper's greedy iterations) so that about ``k`` are kept in
  expectation, and sent as ``x_i / p_i``: ``E[C(x)] = x``. These
  probabilities minimise the variance for the expected density. The payload
  has ``⌈capacity · k⌉`` slots of values and int32 indices; kept coordinates
  fill them in index order. Should more than that be kept (rare for
  ``capacity ≥ 2``), the excess is not sent and the step is biased; under
  error feedback it stays in the residual.

  Args:
    ratio: expected fraction of each leaf kept, in (0, 1].
    k: expected number kept per leaf, in [1, leaf size].
    iterations: rescaling iterations of the greedy algorithm (≥ 1).
    capacity: slots per expected kept coordinate, ≥ 1 (capped at the leaf size).

  Returns:
    A non-linear, unbiased :class:`~commopt.Compressor`.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from commopt.compressors import variance_balanced
    >>> c = variance_balanced(k=2)
    >>> x = jnp.array([0.0, -3.0, 2.0, 0.0])      # both kept with p = 1
    >>> payload, _ = c.encode(x, c.init(x), jax.random.PRNGKey(0))
    >>> c.decode(payload, None, x).tolist()
    [0.0, -3.0, 2.0, 0.0]

  References:
    Wangni et al., Gradient Sparsification for Communication-Efficient
    Distributed Optimization, NeurIPS 2018.
  """
  leaf_k = _budget("variance_balanced", ratio, k)
  iterations = base.check_positive_int("iterations", iterations, fn="variance_balanced")
  capacity = base.check_number("capacity", capacity, fn="variance_balanced", low=1.0,
                               low_open=False, what="a number >= 1")

  def slots(shape) -> int:
    return min(base.leaf_size(shape), math.ceil(capacity * leaf_k(shape)))

  def pick(flat, n_slots, key):
    magnitude = jnp.abs(flat).astype(jnp.float32)
    p = keep_probabilities(magnitude, leaf_k(flat.shape), iterations)
    u = _uniform(key, flat.shape[0], "variance_balanced")
    indices = first_true(u < p, n_slots)
    kept = _take(p, indices)
    return indices, _take(flat.astype(jnp.float32), indices) / jnp.where(kept > 0, kept, 1.0)

  # Σ x_i²(1/p_i − 1) ≤ ‖x‖₁/λ ≤ ‖x‖₁²/k ≤ (n/k)‖x‖² (λ ≥ k/‖x‖₁).
  return _sparse_compressor(_budget_name("variance_balanced", ratio, k), slots, pick, None,
                            error_kind="unbiased",
                            error_bound=lambda shape: base.leaf_size(shape) / leaf_k(shape))


register("random_k", random_k, {"ratio": 0.01}, exclusive=("ratio", "k"),
         variants=({"ratio": 0.05, "shared_seed": False},))
register("variance_balanced", variance_balanced, {"ratio": 0.01}, exclusive=("ratio", "k"))
