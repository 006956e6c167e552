"""Sparsifying compressors: send a few coordinates as values and indices.

Every payload here has a static capacity fixed by the leaf's shape. A method
whose selection is data dependent (a threshold, a sampled quantile, bin-local
maxima, random keep decisions) fills its slots with the selected coordinates
in index order; empty slots carry the out-of-range index ``size`` (or the
all-ones code word) and decode to nothing, and selected coordinates beyond
the capacity are not sent. ``decode`` rebuilds exactly what was sent, so under
:func:`~commopt.compressed_mean` with error feedback whatever did not fit stays
in the residual and is sent later: nothing is dropped silently.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from commopt import kernels
from commopt._src import base

VALUE_DTYPES = ("float16", "bfloat16", "float32")
METHODS = ("exact", "sample")
SCOPES = ("leaf", "global")

_MIN_SAMPLE = 1024
"""The smallest sample a sampled threshold is estimated from (or the whole leaf)."""

_EMPTY_CODE = 0xFFFFFFFF
"""A sign-and-index code word that marks an empty slot."""

_MAX_CODED_SIZE = 2**31 - 1
"""Sign-and-index codes hold a 31-bit index."""


@dataclasses.dataclass(frozen=True)
class GlobalCompressor(base.Compressor):
  """A compressor whose selection spans every compressed leaf at once.

  :func:`~commopt.compressed_mean` hands it the list of compressed leaves
  and exchanges a single payload for all of them. ``encode``/``decode`` on
  one leaf behave as the same selection over that leaf alone, and
  ``payload_bits`` gives each leaf's share of the budget, so the per-leaf
  accounting of :func:`commopt.wire.payload_bytes` sums to the whole payload.

  Attributes:
    encode_tree: ``encode_tree(xs, key) -> payload`` for a list of leaves.
    decode_tree: ``decode_tree(payload, likes) -> list`` of reconstructions
      with the shapes and dtypes of ``likes``.
  """
  encode_tree: Optional[Callable[[list, Any], Any]] = None
  decode_tree: Optional[Callable[[Any, list], list]] = None

  def __repr__(self) -> str:
    return f"Compressor({self.name})"


class RandomKState(NamedTuple):
  """Per-leaf state of shared-seed :func:`random_k`: the indices of the last step.

  Every worker draws the same indices from the shared step key, so they never
  cross the wire; ``decode`` reads them from here.
  """
  indices: jax.Array


class AdaCompState(NamedTuple):
  """Per-leaf state of :func:`adacomp`: what the last step left unsent.

  AdaComp's selection needs the fresh gradient ``dW`` beside the accumulated
  residue ``G = residue + dW``; with error feedback the input is ``G``, so
  ``dW = G - residue`` is recovered from this copy of the residue.
  """
  residual: jax.Array


# ---------------------------------------------------------------------------
# Argument checks and budgets.


def _fraction_count(fraction: float, size: int) -> int:
  # Rounded first so that e.g. 0.07 * 100 keeps 7, not 8.
  return max(1, min(size, math.ceil(round(fraction * size, 6))))


def _budget(fn: str, ratio, k) -> Callable[[tuple[int, ...]], int]:
  """``shape -> k`` from exactly one of ``ratio`` and ``k``."""
  if (ratio is None) == (k is None):
    raise ValueError(
        f"{fn}: give exactly one of `ratio` and `k`, got ratio={ratio!r}, k={k!r}.")
  if ratio is not None:
    ratio = base.check_ratio("ratio", ratio, fn=fn)
    return lambda shape: _fraction_count(ratio, base.leaf_size(shape))
  k = base.check_positive_int("k", k, fn=fn)

  def leaf_k(shape) -> int:
    size = base.leaf_size(shape)
    if k > size:
      raise ValueError(
          f"{fn}: `k` must be at most the leaf size, got k={k} for a leaf of "
          f"shape {tuple(shape)} (size {size}). Use `ratio=` or a smaller k.")
    return k

  return leaf_k


def _budget_name(fn: str, ratio, k, **extra) -> str:
  args = [f"ratio={float(ratio)}" if ratio is not None else f"k={k}"]
  args += [f"{key}={value!r}" for key, value in extra.items()]
  return f"{fn}({', '.join(args)})"


def _check_value_dtype(value_dtype, fn: str):
  if value_dtype is None:
    return None
  try:
    dtype = jnp.dtype(value_dtype)
  except TypeError:
    dtype = None
  if dtype is None or dtype.name not in VALUE_DTYPES:
    raise ValueError(
        f"{fn}: `value_dtype` must be None (the input dtype) or one of "
        f"{VALUE_DTYPES}, got {value_dtype!r}.")
  return dtype


def _check_choice(name: str, value, valid: tuple, fn: str):
  if value not in valid:
    raise ValueError(f"{fn}: `{name}` must be one of {valid}, got {value!r}.")
  return value


def _check_coded_size(size: int, fn: str):
  if size > _MAX_CODED_SIZE:
    raise ValueError(
        f"{fn}: a leaf of {size} elements is too large for 31-bit indices (at "
        f"most {_MAX_CODED_SIZE}); split it.")


# ---------------------------------------------------------------------------
# Selection and sparse payloads.


def first_true(mask: jax.Array, capacity: int) -> jax.Array:
  """The flat indices of the first ``capacity`` true entries of ``mask``.

  Slots past the number of true entries hold ``mask.size`` (out of range).
  One inclusive scan and a binary search per slot: O(size + capacity log size),
  with no sort over the leaf.
  """
  counts = jax.lax.associative_scan(jnp.add, mask.reshape(-1).astype(jnp.int32))
  wanted = jnp.arange(1, capacity + 1, dtype=jnp.int32)
  return jnp.searchsorted(counts, wanted, side="left").astype(jnp.int32)


def sampled_threshold(magnitude: jax.Array, density: float, key,
                      sample_ratio: float) -> jax.Array:
  """The magnitude above which a ``density`` fraction of ``magnitude`` lies, from a sample.

  As in DGC: draw ``max(sample_ratio * size, 1024)`` coordinates (with
  replacement; the whole leaf when it is smaller) and take the
  ``⌈density · sample⌉``-th largest of their magnitudes.
  """
  size = magnitude.size
  flat = magnitude.reshape(-1)
  samples = min(size, max(math.ceil(sample_ratio * size), _MIN_SAMPLE))
  if samples < size:
    flat = flat[jax.random.randint(key, (samples,), 0, size)]
  kept = _fraction_count(density, samples)
  return jax.lax.top_k(flat, kept)[0][-1]


def _take(flat: jax.Array, indices: jax.Array) -> jax.Array:
  return flat.at[indices].get(mode="fill", fill_value=0)


def _scatter(indices: jax.Array, values: jax.Array, like) -> jax.Array:
  flat = jnp.zeros((base.leaf_size(like.shape),), like.dtype)
  flat = flat.at[indices].set(values.astype(like.dtype), mode="drop")
  return flat.reshape(like.shape)


def support(indices: jax.Array, like) -> jax.Array:
  """A boolean mask shaped like ``like``: true where ``indices`` send a coordinate."""
  flat = jnp.zeros((base.leaf_size(like.shape),), bool)
  return flat.at[indices].set(True, mode="drop").reshape(like.shape)


def _sign_index_codes(flat: jax.Array, indices: jax.Array) -> jax.Array:
  """uint32 words ``index << 1 | (value < 0)``; empty slots are all ones."""
  negative = (_take(flat, indices) < 0).astype(jnp.uint32)
  codes = (indices.astype(jnp.uint32) << 1) | negative
  return jnp.where(indices < flat.size, codes, jnp.uint32(_EMPTY_CODE))


def _decode_sign_index(codes: jax.Array, magnitude, like) -> jax.Array:
  indices = (codes >> 1).astype(jnp.int32)  # empty slots: 2**31 - 1, dropped
  signs = jnp.where((codes & 1) == 1, -1.0, 1.0).astype(jnp.float32)
  return _scatter(indices, signs * magnitude, like)


def _sparse_compressor(name: str, slots, pick, value_dtype) -> base.Compressor:
  """A stateless values-and-indices compressor.

  ``pick(flat, slots, key) -> (indices, values)`` fills the ``slots`` of a
  leaf; empty slots carry the index ``size``.
  """

  def encode(x, state, key):
    indices, values = pick(x.reshape(-1), slots(x.shape), key)
    return {"values": values.astype(value_dtype or x.dtype),
            "indices": indices.astype(jnp.int32)}, state

  def decode(payload, state, like):
    return _scatter(payload["indices"], payload["values"], like)

  def payload_bits(shape, dtype):
    return slots(shape) * (base.dtype_bits(value_dtype or dtype) + 32)

  return base.Compressor(name=name, init=base.stateless_init, encode=encode,
                         decode=decode, payload_bits=payload_bits)


def _with_values(select):
  """``pick`` that sends the selected coordinates' own values."""
  def pick(flat, slots, key):
    indices = select(flat, slots, key).astype(jnp.int32)
    return indices, _take(flat, indices)
  return pick


def _magnitude_selector(approx: bool, method: str, sample_ratio: float,
                        recall_target: float):
  """``select(flat, k, key) -> indices`` of (about) the k largest magnitudes, ascending.

  Every selection hands back its indices in ascending order (empty slots,
  which hold ``size``, last), so the payload is the same whichever kernel
  implementation selected: ``method="exact"`` is
  :func:`commopt.kernels.select_top_k`, whose every implementation returns the
  same coordinates in index order; ``method="sample"`` fills its slots in
  index order.
  """
  def select(flat, k, key):
    if method == "sample":
      magnitude = jnp.abs(flat)
      threshold = sampled_threshold(magnitude, k / flat.size, base.need_key(key, "top_k"),
                                    sample_ratio)
      return first_true((magnitude >= threshold) & (magnitude > 0), k)
    return kernels.select_top_k(flat, k, approx=approx, recall_target=recall_target)[1]
  return select


def _globalise(compressor: base.Compressor, leaf_k, pick, value_dtype) -> GlobalCompressor:
  """Adds tree-wide selection: one budget ``sum(leaf_k)`` over the concatenated leaves."""

  def encode_tree(xs, key):
    dtype = jnp.result_type(*[x.dtype for x in xs])
    flat = jnp.concatenate([x.reshape(-1).astype(dtype) for x in xs])
    indices, values = pick(flat, sum(leaf_k(x.shape) for x in xs), key)
    return {"values": values.astype(value_dtype or dtype), "indices": indices}

  def decode_tree(payload, likes):
    dtype = jnp.result_type(*[like.dtype for like in likes])
    sizes = [base.leaf_size(like.shape) for like in likes]
    flat = _scatter(payload["indices"], payload["values"],
                    jax.ShapeDtypeStruct((sum(sizes),), dtype))
    parts = jnp.split(flat, np.cumsum(sizes)[:-1].tolist())
    return [p.reshape(like.shape).astype(like.dtype) for p, like in zip(parts, likes)]

  fields = {f.name: getattr(compressor, f.name) for f in dataclasses.fields(base.Compressor)}
  return GlobalCompressor(**fields, encode_tree=encode_tree, decode_tree=decode_tree)


# ---------------------------------------------------------------------------
# Compressors.


def top_k(ratio: float | None = None, *, k: int | None = None, approx: bool = False,
          method: str = "exact", scope: str = "leaf", value_dtype=None,
          sample_ratio: float = 0.01, recall_target: float = 0.95) -> base.Compressor:
  """Sends the ``k`` coordinates of largest magnitude, as values and indices.

  Exactly one of ``ratio`` and ``k`` is given. With ``ratio`` each leaf keeps
  ``⌈ratio · size⌉`` coordinates. The payload is the values (in the input
  dtype, or ``value_dtype``) and their int32 flat indices:
  ``k · (value bits + 32)`` bits. Top-k is a contraction:
  ``‖x − C(x)‖² ≤ (1 − k/d)‖x‖²``; use it with error feedback.

  Selection: ``method="exact"`` uses :func:`commopt.kernels.select_top_k`
  (a radix-select Pallas kernel on GPUs, ``jax.lax.top_k`` elsewhere; ties go
  to the lower index, NaN ranks above ``inf``); ``approx=True`` lets it use
  ``jax.lax.approx_max_k``, which on TPU trades recall for speed and on other
  backends is exact. The indices are sent in ascending order, whatever the
  backend. ``method="sample"`` estimates the threshold as DGC does,
  from the top of a random sample of ``sample_ratio`` of the leaf, and sends
  the coordinates above it in index order into the ``k`` slots: an
  underestimate leaves slots empty, an overestimate leaves the excess in the
  error residual.

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

  Returns:
    A non-linear :class:`~commopt.Compressor` (a :class:`GlobalCompressor`
    for ``scope="global"``).

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
    Lin et al., Deep Gradient Compression, ICLR 2018 (sampled threshold).
    Chern et al., TPU-KNN: K Nearest Neighbor Search at Peak FLOP/s, NeurIPS
    2022 (``approx_max_k``).
  """
  leaf_k = _budget("top_k", ratio, k)
  _check_choice("method", method, METHODS, "top_k")
  _check_choice("scope", scope, SCOPES, "top_k")
  if not isinstance(approx, bool):
    raise ValueError(f"top_k: `approx` must be True or False, got {approx!r}.")
  if approx and method != "exact":
    raise ValueError(
        f"top_k: `approx=True` selects with approx_max_k and needs method='exact', "
        f"got method={method!r}.")
  if scope == "global" and ratio is None:
    raise ValueError(
        f"top_k: scope='global' shares one budget over all leaves and needs "
        f"`ratio`, got k={k!r}.")
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
  pick = _with_values(_magnitude_selector(approx, method, sample_ratio, recall_target))
  compressor = _sparse_compressor(_budget_name("top_k", ratio, k, **options), leaf_k,
                                  pick, value_dtype)
  if scope == "global":
    return _globalise(compressor, leaf_k, pick, value_dtype)
  return compressor


def random_k(ratio: float | None = None, *, k: int | None = None, shared_seed: bool = True,
             scale: bool = False) -> base.Compressor:
  """Sends ``k`` coordinates chosen uniformly at random.

  Exactly one of ``ratio`` and ``k`` is given. Each leaf sends a uniformly
  random set of ``k`` distinct coordinates (the ``k`` largest of ``size``
  uniform keys).

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

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from commopt.compressors._sparsify import random_k
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
  for name, value in (("shared_seed", shared_seed), ("scale", scale)):
    if not isinstance(value, bool):
      raise ValueError(f"random_k: `{name}` must be True or False, got {value!r}.")

  def draw(key, shape):
    size = base.leaf_size(shape)
    uniform = jax.random.uniform(base.need_key(key, "random_k"), (size,))
    return jax.lax.top_k(uniform, leaf_k(shape))[1].astype(jnp.int32)

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

    def decode(payload, state, like):
      return _scatter(state.indices, payload["values"], like)

    def payload_bits(shape, dtype):
      return leaf_k(shape) * base.dtype_bits(dtype)
  else:
    init = base.stateless_init

    def encode(x, state, key):
      indices = draw(key, x.shape)
      return {"values": values(x, indices), "indices": indices}, state

    def decode(payload, state, like):
      return _scatter(payload["indices"], payload["values"], like)

    def payload_bits(shape, dtype):
      return leaf_k(shape) * (base.dtype_bits(dtype) + 32)

  return base.Compressor(
      name=_budget_name("random_k", ratio, k, shared_seed=shared_seed, scale=scale),
      init=init, encode=encode, decode=decode, payload_bits=payload_bits,
      linear=shared_seed, shared_randomness=shared_seed)


def threshold(tau: float, *, capacity: float = 0.01) -> base.Compressor:
  """Sends ``±tau`` for each coordinate with ``|x| > tau`` (Strom 2015).

  Each sent coordinate is one uint32 word: its flat index (31 bits) and its
  sign (the low bit). A leaf has ``⌈capacity · size⌉`` words; coordinates over
  the threshold fill them in index order and the rest of them wait. The
  quantisation error ``x − (±tau)`` and every coordinate not sent stay in the
  error residual, where they accumulate until they cross the threshold.
  Biased; use it with error feedback.

  Args:
    tau: the threshold, > 0, in the units of the compressed input.
    capacity: fraction of each leaf that one payload can carry, in (0, 1].

  Returns:
    A non-linear :class:`~commopt.Compressor` with ``32 · ⌈capacity · size⌉``
    payload bits per leaf.

  Example:
    >>> import jax.numpy as jnp
    >>> from commopt.compressors._sparsify import threshold
    >>> c = threshold(1.0, capacity=0.5)
    >>> x = jnp.array([0.5, -3.0, 2.0, 0.1])
    >>> payload, _ = c.encode(x, c.init(x), None)
    >>> c.decode(payload, None, x).tolist()
    [0.0, -1.0, 1.0, 0.0]

  References:
    Strom, Scalable Distributed DNN Training Using Commodity GPU Cloud
    Computing, Interspeech 2015.
  """
  tau = base.check_number("tau", tau, fn="threshold", low=0.0, what="a finite number > 0")
  capacity = base.check_ratio("capacity", capacity, fn="threshold")

  def slots(shape) -> int:
    size = base.leaf_size(shape)
    _check_coded_size(size, "threshold")
    return _fraction_count(capacity, size)

  def encode(x, state, key):
    flat = x.reshape(-1)
    indices = first_true(jnp.abs(flat) > tau, slots(x.shape))
    return {"codes": _sign_index_codes(flat, indices)}, state

  def decode(payload, state, like):
    return _decode_sign_index(payload["codes"], jnp.float32(tau), like)

  return base.Compressor(
      name=f"threshold(tau={tau}, capacity={capacity})", init=base.stateless_init,
      encode=encode, decode=decode, payload_bits=lambda shape, dtype: 32 * slots(shape))


def gradient_dropping(drop_ratio: float = 0.99, *, sample_ratio: float = 0.001,
                      value_dtype=None) -> base.Compressor:
  """Drops the ``drop_ratio`` smallest-magnitude coordinates (Aji & Heafield 2017).

  The threshold is the ``drop_ratio`` quantile of ``|x|``, estimated from a
  random sample of ``sample_ratio`` of the leaf (at least 1024 coordinates);
  the coordinates above it are sent as values and int32 indices, in index
  order, into ``⌈(1 − drop_ratio) · size⌉`` slots. Selected coordinates that
  do not fit, and those dropped, stay in the error residual. Biased; use it
  with error feedback.

  Args:
    drop_ratio: fraction of each leaf dropped, in [0, 1).
    sample_ratio: fraction of the leaf sampled for the quantile, in (0, 1].
    value_dtype: wire dtype of the values (``None``: the input dtype;
      ``"float16"``, ``"bfloat16"``, ``"float32"``).

  Returns:
    A non-linear :class:`~commopt.Compressor`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from commopt.compressors._sparsify import gradient_dropping
    >>> c = gradient_dropping(0.5)
    >>> x = jnp.array([0.1, -3.0, 2.0, 0.5])
    >>> payload, _ = c.encode(x, c.init(x), jax.random.PRNGKey(0))
    >>> c.decode(payload, None, x).tolist()
    [0.0, -3.0, 2.0, 0.0]

  References:
    Aji & Heafield, Sparse Communication for Distributed Gradient Descent,
    EMNLP 2017.
  """
  try:
    drop = float(drop_ratio)
  except (TypeError, ValueError):
    drop = float("nan")
  if isinstance(drop_ratio, bool) or not 0.0 <= drop < 1.0:
    raise ValueError(
        f"gradient_dropping: `drop_ratio` must be a fraction in [0, 1), got {drop_ratio!r}.")
  sample_ratio = base.check_ratio("sample_ratio", sample_ratio, fn="gradient_dropping")
  value_dtype = _check_value_dtype(value_dtype, "gradient_dropping")
  keep = 1.0 - drop
  select = _magnitude_selector(False, "sample", sample_ratio, 1.0)
  return _sparse_compressor(
      f"gradient_dropping(drop_ratio={drop})",
      lambda shape: _fraction_count(keep, base.leaf_size(shape)),
      _with_values(lambda flat, k, key: select(flat, k, base.need_key(key, "gradient_dropping"))),
      value_dtype)


def adacomp(bin_size: int = 50, *, per_bin: int = 2) -> base.Compressor:
  """AdaComp: bin-local maxima decide which residues are sent (Chen et al. 2018).

  The input is the accumulated residue ``G = residue + dW`` (error feedback
  on); ``dW`` is recovered from the residue kept in :class:`AdaCompState`.
  Each leaf is cut into bins of ``bin_size`` coordinates; a coordinate is
  selected when the soft-thresholded ``|H| = |G + dW|`` reaches the bin's
  largest ``|G|``, so the number sent follows local activity. At most
  ``per_bin`` selected coordinates per bin are sent (those with the largest
  ``|H|``); the sent residues are ternarised to ``±s``, with ``s`` the mean
  ``|G|`` of this leaf's sent residues. A slot is one uint32 word (31-bit flat
  index, sign bit), empty slots are all ones, and ``s`` is one float32: the
  payload has ``32 · (⌈size / bin_size⌉ · per_bin + 1)`` bits. Everything not
  sent stays in the residue. Biased; use it under
  :func:`~commopt.compressed_mean` with error feedback (the default).

  Args:
    bin_size: coordinates per bin, a positive integer (the paper uses 50
      for convolutions and 500 for dense layers).
    per_bin: slots per bin, a positive integer at most ``bin_size``.

  Returns:
    A non-linear :class:`~commopt.Compressor` with per-leaf state.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from commopt.compressors._sparsify import adacomp
    >>> c = adacomp(bin_size=4, per_bin=1)
    >>> x = jnp.array([0.1, -3.0, 2.0, 0.5, 1.0, 0.0, 0.0, 0.0])
    >>> payload, state = c.encode(x, c.init(x), None)
    >>> c.decode(payload, state, x).tolist()   # one per bin, ±mean(3, 1)
    [0.0, -2.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0]

  References:
    Chen et al., AdaComp: Adaptive Residual Gradient Compression for
    Data-Parallel Distributed Training, AAAI 2018.
  """
  bin_size = base.check_positive_int("bin_size", bin_size, fn="adacomp")
  per_bin = base.check_positive_int("per_bin", per_bin, fn="adacomp")
  if per_bin > bin_size:
    raise ValueError(
        f"adacomp: `per_bin` must be at most bin_size={bin_size}, got {per_bin}.")

  def bins(shape) -> int:
    size = base.leaf_size(shape)
    _check_coded_size(size, "adacomp")
    return -(-size // bin_size)

  def init(leaf):
    return AdaCompState(residual=jnp.zeros(leaf.shape, leaf.dtype))

  def encode(x, state, key):
    del key
    size, n_bins = base.leaf_size(x.shape), bins(x.shape)
    g = x.reshape(-1).astype(jnp.float32)
    h = 2.0 * g - state.residual.reshape(-1).astype(jnp.float32)   # G + dW
    pad = n_bins * bin_size - size
    g_bins = jnp.pad(jnp.abs(g), (0, pad)).reshape(n_bins, bin_size)
    h_bins = jnp.pad(jnp.abs(h), (0, pad)).reshape(n_bins, bin_size)
    g_max = jnp.max(g_bins, axis=1, keepdims=True)
    selected = (h_bins >= g_max) & (g_bins > 0)
    score, col = jax.lax.top_k(jnp.where(selected, h_bins, -1.0), per_bin)
    indices = jnp.arange(n_bins, dtype=jnp.int32)[:, None] * bin_size + col
    indices = jnp.where(score >= 0, indices, size).reshape(-1)
    sent = _take(jnp.abs(g), indices)
    count = jnp.sum(indices < size)
    scale = jnp.where(count > 0, jnp.sum(sent) / jnp.maximum(count, 1), 0.0)
    payload = {"codes": _sign_index_codes(g, indices), "scale": scale.reshape(1)}
    residual = x - _decode_sign_index(payload["codes"], scale, x)
    return payload, AdaCompState(residual=residual)

  def decode(payload, state, like):
    return _decode_sign_index(payload["codes"], payload["scale"][0], like)

  return base.Compressor(
      name=f"adacomp(bin_size={bin_size}, per_bin={per_bin})", init=init, encode=encode,
      decode=decode, payload_bits=lambda shape, dtype: 32 * (bins(shape) * per_bin + 1))


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

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from commopt.compressors._sparsify import variance_balanced
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
    u = jax.random.uniform(base.need_key(key, "variance_balanced"), flat.shape)
    indices = first_true(u < p, n_slots)
    kept = _take(p, indices)
    return indices, _take(flat.astype(jnp.float32), indices) / jnp.where(kept > 0, kept, 1.0)

  return _sparse_compressor(_budget_name("variance_balanced", ratio, k), slots, pick, None)
