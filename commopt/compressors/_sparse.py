"""Sparse payloads: budgets, static capacities, value/index and sign/index codes.

Every sparse payload has a static capacity fixed by the leaf's shape. A method
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
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from commopt import kernels
from commopt._src import base, tree
from commopt.kernels import first_true  # noqa: F401  (re-exported: the compaction kernel)


VALUE_DTYPES = ("float16", "bfloat16", "float32")


METHODS = ("exact", "sample")


SCOPES = ("leaf", "global")


_MIN_SAMPLE = 1024
"""The smallest sample a sampled threshold is estimated from (or the whole leaf)."""


_EMPTY_CODE = 0xFFFFFFFF
"""A sign-and-index code word that marks an empty slot."""


_MAX_CODED_SIZE = 2**31 - 1
"""Sign-and-index codes hold a 31-bit index."""


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
    raise base.OptionTypeError(
        f"{fn}: `value_dtype` must be None (the input dtype) or one of {VALUE_DTYPES} (a name "
        f"or a dtype), got {value_dtype!r} ({type(value_dtype).__name__}).") from None
  if dtype.name not in VALUE_DTYPES:
    raise ValueError(
        f"{fn}: `value_dtype` must be None (the input dtype) or one of "
        f"{VALUE_DTYPES}, got {value_dtype!r}.")
  return dtype


def _check_coded_size(size: int, fn: str):
  if size > _MAX_CODED_SIZE:
    raise ValueError(
        f"{fn}: a leaf of {size} elements is too large for 31-bit indices (at "
        f"most {_MAX_CODED_SIZE}); split it.")


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


def _scatter_add(acc: jax.Array, indices: jax.Array, values: jax.Array, like) -> jax.Array:
  """``acc + _scatter(indices, values, like)`` in place; indices are distinct (empty slots dropped)."""
  flat = acc.reshape(-1).at[indices].add(values.astype(like.dtype).astype(acc.dtype), mode="drop")
  return flat.reshape(acc.shape)


def support(indices: jax.Array, like) -> jax.Array:
  """A boolean mask shaped like ``like``: true where ``indices`` send a coordinate."""
  flat = jnp.zeros((base.leaf_size(like.shape),), bool)
  return flat.at[indices].set(True, mode="drop").reshape(like.shape)


def _sign_index_codes(flat: jax.Array, indices: jax.Array) -> jax.Array:
  """uint32 words ``index << 1 | (value < 0)``; empty slots are all ones."""
  negative = (_take(flat, indices) < 0).astype(jnp.uint32)
  codes = (indices.astype(jnp.uint32) << 1) | negative
  return jnp.where(indices < flat.size, codes, jnp.uint32(_EMPTY_CODE))


def _sign_index_values(codes: jax.Array, magnitude):
  """``(indices, values)`` of sign-index codes sent with one ``magnitude``."""
  indices = (codes >> 1).astype(jnp.int32)  # empty slots: 2**31 - 1, dropped
  signs = jnp.where((codes & 1) == 1, -1.0, 1.0).astype(jnp.float32)
  return indices, signs * magnitude


def _pairs_codec(pairs):
  """``(decode, accumulate)`` of a payload naming distinct coordinates and their values.

  ``pairs(payload, state) -> (indices, values)`` (out-of-range indices are
  empty slots): ``decode`` scatters them into zeros and ``accumulate`` adds
  them into an accumulator in place, so the two agree by construction.
  """
  def decode(payload, state, like):
    return _scatter(*pairs(payload, state), like)

  def accumulate(acc, payload, state, like):
    return _scatter_add(acc, *pairs(payload, state), like)

  return decode, accumulate


_VALUES_CODEC = _pairs_codec(lambda payload, state: (payload["indices"], payload["values"]))
"""For payloads ``{"indices", "values"}``."""


def _sparse_compressor(name: str, slots, pick, value_dtype, **declared) -> base.Compressor:
  """A stateless values-and-indices compressor.

  ``pick(flat, slots, key) -> (indices, values)`` fills the ``slots`` of a
  leaf; empty slots carry the index ``size``. ``declared`` sets the error
  kind and bound (:attr:`~commopt.Compressor.error_kind`).
  """

  def encode(x, state, key):
    indices, values = pick(x.reshape(-1), slots(x.shape), key)
    return {"values": values.astype(value_dtype or x.dtype),
            "indices": indices.astype(jnp.int32)}, state

  decode, accumulate = _VALUES_CODEC

  def payload_bits(shape, dtype):
    return slots(shape) * (base.dtype_bits(value_dtype or dtype) + 32)

  return base.Compressor(name=name, init=base.stateless_init, encode=encode,
                         decode=decode, payload_bits=payload_bits, accumulate=accumulate,
                         sparse_values=True,
                         **declared)


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


def _globalise(compressor: base.Compressor, leaf_k, pick, value_dtype) -> base.Compressor:
  """Adds tree-wide selection: one budget ``sum(leaf_k)`` over the concatenated leaves."""

  def encode_tree(xs, key):
    dtype = jnp.result_type(*[x.dtype for x in xs])
    flat = tree.concat_flat([x.reshape(-1).astype(dtype) for x in xs])
    indices, values = pick(flat, sum(leaf_k(x.shape) for x in xs), key)
    return {"values": values.astype(value_dtype or dtype), "indices": indices}

  def decode_tree(payload, likes):
    dtype = jnp.result_type(*[like.dtype for like in likes])
    sizes = [base.leaf_size(like.shape) for like in likes]
    flat = _scatter(payload["indices"], payload["values"],
                    jax.ShapeDtypeStruct((sum(sizes),), dtype))
    parts = jnp.split(flat, np.cumsum(sizes)[:-1].tolist())
    return [p.reshape(like.shape).astype(like.dtype) for p, like in zip(parts, likes)]

  return dataclasses.replace(compressor, encode_tree=encode_tree, decode_tree=decode_tree)
