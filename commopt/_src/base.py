"""The compressor protocol and the helpers every compressor shares."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

Payload = Any
"""A pytree of arrays with static shapes: exactly what crosses the wire."""


class EmptyState(NamedTuple):
  """Per-leaf compressor state of a stateless compressor."""


class Reduced(NamedTuple):
  """What a reduction returns for one leaf.

  Attributes:
    mean: the mean over the axis of every worker's reconstruction.
    local: this worker's own reconstruction (what error feedback subtracts).
    state: the new per-leaf compressor state.
  """
  mean: jax.Array
  local: jax.Array
  state: Any


@dataclasses.dataclass(frozen=True)
class Compressor:
  """A pure compressor: it encodes and decodes, and never communicates.

  Attributes:
    name: a short name used in reports and error messages.
    init: ``init(leaf) -> state``, the per-leaf state (``EmptyState()`` if none).
    encode: ``encode(x, state, key) -> (payload, state)``. ``payload`` is a
      pytree of arrays with static shapes; signs and low-bit levels are packed
      into unsigned integers.
    decode: ``decode(payload, state, like) -> x_hat`` with ``like``'s shape and
      dtype (``like`` is an array or a ``jax.ShapeDtypeStruct``).
    payload_bits: ``payload_bits(shape, dtype) -> int``, the analytic size of
      one payload in bits.
    linear: whether payloads may be summed before decoding, so that a psum of
      payloads decodes to the sum of the reconstructions.
    shared_randomness: whether every worker must draw the same random bits
      (shared-seed methods); then the key does not depend on the worker.
    accepts: ``accepts(shape, dtype) -> bool``; leaves it rejects are sent
      dense (e.g. vectors for PowerSGD).
    reduce: optional ``reduce(x, state, key, axis_name) -> Reduced`` for
      multi-round protocols that replace the generic reduction (PowerSGD).
      ``axis_name=None`` must run the same protocol on one worker.
  """
  name: str
  init: Callable[[Any], Any]
  encode: Callable[..., tuple[Payload, Any]]
  decode: Callable[..., jax.Array]
  payload_bits: Callable[[tuple[int, ...], Any], int]
  linear: bool = False
  shared_randomness: bool = False
  accepts: Callable[[tuple[int, ...], Any], bool] = lambda shape, dtype: True
  reduce: Optional[Callable[..., Reduced]] = None

  def __repr__(self) -> str:
    return f"Compressor({self.name})"


def stateless_init(leaf) -> EmptyState:
  del leaf
  return EmptyState()


def dtype_bits(dtype) -> int:
  return int(np.dtype(dtype).itemsize * 8)


def leaf_size(shape) -> int:
  return int(math.prod(shape))


def check_positive_int(name: str, value, *, fn: str) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
    raise ValueError(
        f"{fn}: `{name}` must be a positive integer, got {value!r}.")
  return int(value)


def check_ratio(name: str, value, *, fn: str) -> float:
  try:
    v = float(value)
  except (TypeError, ValueError):
    v = float("nan")
  if not 0.0 < v <= 1.0:
    raise ValueError(
        f"{fn}: `{name}` must be a fraction in (0, 1], got {value!r}.")
  return v


def is_float_dtype(dtype) -> bool:
  return jnp.issubdtype(dtype, jnp.floating)
