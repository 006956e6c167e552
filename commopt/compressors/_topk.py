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
  dtype, or ``value_dtype``) and their int32 flat indices:
  ``k · (value bits + 32)`` bits. Top-k is a contraction:
  ``‖x − C(x)‖² ≤ (1 − k/d)‖x‖²``; use it with error feedback.

  Selection: ``method="exact"`` uses :func:`commopt.kernels.select_top_k`
  (a radix-select Pallas kernel on GPUs, histograms and bit-packed words on
  the CPU from ``k = 2048``, ``jax.lax.top_k`` elsewhere; the same
  coordinates: ties go to the lower index, NaN ranks above ``inf``);
  ``approx=True`` lets it use ``jax.lax.approx_max_k``, which on TPU trades
  recall for speed and on other backends is exact. The indices are sent in
  ascending order, whatever the backend. ``method="sample"`` estimates the
  threshold as DGC does, from the top of a random sample of ``sample_ratio``
  of the leaf, and sends the coordinates above it in index order into the
  ``k`` slots: an underestimate leaves slots empty, an overestimate leaves
  the excess in the error residual.

  On a leaf sharded over model axes (the shard-local step of
  :func:`~commopt.data_parallel`), each device compresses its own shard.
  ``shard_threshold="shard"`` (default) keeps ``⌈ratio · shard size⌉``
  coordinates per shard: the same ratio, each shard's own largest.
  ``shard_threshold="leaf"`` (with ``ratio``) keeps the whole leaf's: the
  threshold is the ``⌈ratio · leaf size⌉``-th largest magnitude of the
  leaf, found from every shard's candidates gathered over the model axes
  (at most that many magnitudes per shard, on the fast links), and each
  shard sends its coordinates above it, in index order, in
  ``⌈capacity · ratio · shard size⌉`` slots; a shard holding more than that
  leaves the rest in the error residual (coordinates tied at the threshold
  may take more slots than the leaf's budget). On a leaf that is whole on
  every device both options are the plain top-k; ``"leaf"`` is a protocol of
  its own (``reduce``), which ``two_phase`` and ``hierarchical`` refuse.

  ``scope="global"`` selects over every compressed leaf of the model at once
  (with ``ratio``): the budget is the sum of the leaves' ``⌈ratio · size⌉``,
  one payload carries indices into the concatenated leaves, and a leaf with
  larger entries gets more of the budget. Mixed leaf dtypes are selected in
  their promoted dtype; ``commopt.wire.payload_bytes`` is exact when the
  compressed leaves share a dtype or ``value_dtype`` is set.

  Args:
    ratio: fraction of each leaf to send, in (0, 1].
    k: number of coordinates to send per leaf, in [1, leaf size].
    approx: select with ``jax.lax.approx_max_k`` (``method="exact"`` only).
    method: ``"exact"`` or ``"sample"``.
    scope: ``"leaf"`` (per leaf) or ``"global"`` (over the whole model).
    value_dtype: wire dtype of the values: ``None`` (the input dtype),
      ``"float16"``, ``"bfloat16"`` or ``"float32"``. The rounding stays in
      the error residual.
    sample_ratio: fraction of the leaf sampled by ``method="sample"`` (at
      least 1024 coordinates), in (0, 1].
    recall_target: ``approx_max_k``'s recall target, in (0, 1].
    shard_threshold: ``"shard"`` or ``"leaf"``: on a sharded leaf, each shard's
      own top ``ratio``, or the whole leaf's threshold (see above).
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
