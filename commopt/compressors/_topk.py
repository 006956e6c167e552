"""Top-k sparsification: the largest magnitudes, per leaf or over the whole tree."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from commopt._src import base
from commopt.compressors._registry import register
from commopt.compressors._sparse import (
    _VALUES_CODEC,
    METHODS,
    SCOPES,
    _budget,
    _budget_name,
    _check_value_dtype,
    _fraction_count,
    _globalise,
    _magnitude_selector,
    _sparse_compressor,
    _take,
    _with_values,
    first_true,
)

SHARD_THRESHOLDS = ("shard", "leaf")
"""How :func:`top_k` selects on a leaf sharded over model axes (its ``shard_threshold``)."""


def top_k(ratio: float | None = None, *, k: int | None = None, approx: bool = False,
          method: str = "exact", scope: str = "leaf", value_dtype=None,
          sample_ratio: float = 0.01, recall_target: float = 0.95,
          shard_threshold: str = "shard", capacity: float = 1.0) -> base.Compressor:
  """Sends the ``k`` coordinates of largest magnitude, as values and indices.

  Exactly one of ``ratio`` and ``k`` is given. With ``ratio`` each leaf keeps
  ``⌈ratio · size⌉`` coordinates. The payload is the values (in the input
  dtype, or ``value_dtype``) and their int32 flat indices, sent in ascending
  order: ``k · (value bits + 32)`` bits. Top-k is a contraction:
  ``‖x − C(x)‖² ≤ (1 − k/d)‖x‖²``; use it with error feedback.

  See the guide's "Compressors and aggregators" page (Top-k) for the selection
  methods, ``scope="global"`` and sharded leaves.

  Args:
    ratio: fraction of each leaf to send, in (0, 1].
    k: number of coordinates to send per leaf, in [1, leaf size].
    approx: select with ``jax.lax.approx_max_k``, exact except on TPU
      (``method="exact"`` only).
    method: ``"exact"`` (:func:`commopt.kernels.select_top_k`) or ``"sample"``
      (a threshold estimated from a sample, as DGC).
    scope: ``"leaf"`` (per leaf) or ``"global"`` (one budget over the whole
      model, with ``ratio``).
    value_dtype: wire dtype of the values: ``None`` (the input dtype),
      ``"float16"``, ``"bfloat16"`` or ``"float32"``. The rounding stays in
      the error residual.
    sample_ratio: fraction of the leaf sampled by ``method="sample"`` (at
      least 1024 coordinates), in (0, 1].
    recall_target: ``approx_max_k``'s recall target, in (0, 1].
    shard_threshold: ``"shard"`` (default: each shard of a model-sharded leaf
      keeps its own top ``ratio``) or ``"leaf"`` (the whole leaf's threshold).
    capacity: with ``shard_threshold="leaf"``, a shard's slots as a multiple of
      ``ratio · shard size`` (>= 1; more slots, more bytes).

  Returns:
    A non-linear :class:`~commopt.Compressor` (a :class:`~commopt.Compressor` with ``encode_tree``
    for ``scope="global"``).

  Examples:
    >>> import jax.numpy as jnp, commopt
    >>> c = commopt.top_k(k=2)
    >>> x = jnp.array([0.1, -3.0, 2.0, 0.5])
    >>> payload, _ = c.encode(x, c.init(x), None)
    >>> c.decode(payload, None, x).tolist()
    [0.0, -3.0, 2.0, 0.0]

  References:
    Stich et al., Sparsified SGD with Memory, NeurIPS 2018.
    Alistarh et al., The Convergence of Sparsified Gradient Methods, NeurIPS 2018.
    Lin et al., Deep Gradient Compression, ICLR 2018 (sampled threshold).
    Chern et al., TPU-KNN: K Nearest Neighbor Search at Peak FLOP/s, NeurIPS
    2022 (``approx_max_k``).
  """
  leaf_k = _budget("top_k", ratio, k)
  base.check_choice("method", method, METHODS, "top_k")
  base.check_choice("scope", scope, SCOPES, "top_k")
  approx = base.check_bool("approx", approx, fn="top_k")
  if approx and method != "exact":
    raise ValueError(
        f"top_k: `approx=True` selects with approx_max_k and needs method='exact', "
        f"got method={method!r}.")
  if scope == "global" and ratio is None:
    raise ValueError(
        f"top_k: scope='global' shares one budget over all leaves and needs "
        f"`ratio`, got k={k!r}.")
  base.check_choice("shard_threshold", shard_threshold, SHARD_THRESHOLDS, "top_k")
  capacity = base.check_number("capacity", capacity, fn="top_k", low=1.0, high=float("inf"),
                               low_open=False, what="a number >= 1")
  if shard_threshold == "leaf" and (ratio is None or scope != "leaf" or method != "exact"):
    raise ValueError(
        "top_k: shard_threshold='leaf' finds one threshold per leaf from `ratio` with "
        f"method='exact' and scope='leaf'; got ratio={ratio!r}, method={method!r}, "
        f"scope={scope!r}.")
  value_dtype = _check_value_dtype(value_dtype, "top_k")
  sample_ratio = base.check_ratio("sample_ratio", sample_ratio, fn="top_k")
  recall_target = base.check_ratio("recall_target", recall_target, fn="top_k")

  options = {}
  if approx:
    options["approx"] = True
  if method != "exact":
    options["method"] = method
  if scope != "leaf":
    options["scope"] = scope
  if value_dtype is not None:
    options["value_dtype"] = value_dtype.name
  if shard_threshold != "shard":
    options["shard_threshold"] = shard_threshold
    if capacity != 1.0:
      options["capacity"] = capacity
  pick = _with_values(_magnitude_selector(approx, method, sample_ratio, recall_target))
  # The exact selection keeps the k largest: ‖x − C(x)‖² ≤ (1 − k/n)‖x‖².
  declared = (dict(error_kind="contractive",
                   error_bound=lambda shape: leaf_k(shape) / base.leaf_size(shape))
              if not approx and method == "exact" else {})
  compressor = _sparse_compressor(_budget_name("top_k", ratio, k, **options), leaf_k,
                                  pick, value_dtype, **declared)
  if scope == "global":
    return _globalise(compressor, leaf_k, pick, value_dtype)
  if shard_threshold == "leaf":
    return dataclasses.replace(
        compressor, reduce=_leaf_threshold_reduce(compressor, ratio, capacity, value_dtype),
        reduce_collective="all-gather")
  return compressor


def _leaf_threshold_reduce(compressor: base.Compressor, ratio: float, capacity: float,
                           value_dtype):
  """``reduce`` for ``shard_threshold="leaf"``: the leaf's threshold from the shards'
  candidates, then each shard's coordinates above it exchanged as a sparse payload."""
  decode, _ = _VALUES_CODEC

  def reduce(x, state, key, channel):
    axes = channel.shard_axes(x)
    if not axes:   # whole on this device: the plain top-k
      payload, state = compressor.encode(x, state, key)
    else:
      flat = x.reshape(-1)
      magnitude = jnp.abs(flat)
      shards = channel.model_size(axes)
      k = _fraction_count(ratio, flat.size * shards)
      candidates = jax.lax.top_k(magnitude, min(k, flat.size))[0]
      threshold = jax.lax.top_k(channel.model_gather(candidates, axes, 0), k)[0][-1]
      slots = min(flat.size, math.ceil(capacity * _fraction_count(ratio, flat.size)))
      indices = first_true((magnitude >= threshold) & (magnitude > 0), slots)
      indices = indices.astype(jnp.int32)
      payload = {"values": _take(flat, indices).astype(value_dtype or x.dtype),
                 "indices": indices}
    mean, local = channel.exchange(payload, lambda pl: decode(pl, state, x), linear=False)
    return base.Reduced(mean=mean.astype(x.dtype), local=local, state=state)

  return reduce


register("top_k", top_k, {"ratio": 0.01}, exclusive=("ratio", "k"),
         variants=({"k": 5}, {"ratio": 0.05, "scope": "global"}))
