"""The compressor protocol and the helpers every compressor shares."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple, Optional, Union

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
    reduce: optional ``reduce(x, state, key, channel) -> Reduced`` for
      multi-round protocols that replace the generic reduction (PowerSGD).
      ``channel`` (a :class:`commopt.comm.Channel`) does the collectives:
      ``channel.mean(x)`` all-reduces, ``channel.exchange(payload, decode,
      linear)`` sends a payload, ``channel.size`` counts the workers; the
      compressor itself never communicates.
    reduce_collective: the collective ``reduce`` runs (``"all-reduce"`` or
      ``"all-gather"``), for communication plans (:func:`commopt.wire.comm_plan`).
    stateful: whether ``init`` returns per-leaf state that ``encode`` updates
      (PowerSGD's ``q``, random-k's counter); the shared suite checks the
      declaration against ``init``.
    encode_tree: optional ``encode_tree(xs, key) -> payload`` for a
      selection that spans every compressed leaf at once (``top_k(scope=
      "global")``): :func:`~commopt.compressed_mean` hands it the list of
      compressed leaves and exchanges one payload for all of them. ``encode``
      and ``decode`` on one leaf then behave as the same selection over that
      leaf alone, and ``payload_bits`` gives each leaf's share of the budget.
    decode_tree: ``decode_tree(payload, likes) -> list`` of reconstructions
      with the shapes and dtypes of ``likes`` (with ``encode_tree``).
    accumulate: optional ``accumulate(acc, payload, state, like) -> acc +
      decode(payload, state, like)`` (``acc`` float32, ``like``'s shape),
      computed without building the decoded tensor: a sparse payload adds its
      values in place. It must equal the default, bit for bit, for any
      ``acc`` that sums decoded payloads from zeros (:meth:`add_decoded`).
    reduce_tree: optional ``reduce_tree(xs, states, keys, channel) -> [Reduced]``,
      a protocol over every compressed leaf at once (one ``Reduced`` per
      leaf of ``xs``, with its state and key), which
      :func:`~commopt.compressed_mean` runs instead of ``reduce`` per leaf
      (PowerSGD's ``batched=True``: one exchange per group of same-shaped leaves).
    dense_steps: the first ``dense_steps`` reductions send each leaf dense (an
      all-reduce of the leaf in its dtype) before the compressed exchange
      starts (PowerSGD's ``start_iter``); communication plans for a given
      step follow it.

  What a compressor can do is declared, not probed: :attr:`capabilities`
  reads these fields, and the strategies and robust rules check it.
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
  reduce_collective: str = "all-reduce"
  stateful: bool = False
  encode_tree: Optional[Callable[[list, Any], Any]] = None
  decode_tree: Optional[Callable[[Any, list], list]] = None
  accumulate: Optional[Callable[..., jax.Array]] = None
  reduce_tree: Optional[Callable[..., list]] = None
  dense_steps: int = 0

  def add_decoded(self, acc: jax.Array, payload: Payload, state: Any, like) -> jax.Array:
    """``acc + decode(payload, state, like)`` in ``acc``'s dtype (float32).

    A gathered reduction calls it once per worker, in worker order, on one
    accumulator: XLA fuses the decoding into the sum, and a compressor with
    ``accumulate`` (the sparse family's scatter-add) never builds the dense
    reconstruction at all.
    """
    if self.accumulate is not None:
      return self.accumulate(acc, payload, state, like)
    return acc + self.decode(payload, state, like).astype(acc.dtype)

  def __repr__(self) -> str:
    return f"Compressor({self.name})"

  @property
  def capabilities(self) -> frozenset:
    """The declared capabilities, a subset of :data:`CAPABILITIES`.

    - ``"linear"``: payloads may be summed before decoding (``strategy="psum"``).
    - ``"shared_randomness"``: every worker draws the same bits.
    - ``"stateful"``: per-leaf state carried from step to step.
    - ``"protocol"``: its own multi-round reduction (``reduce``).
    - ``"tree_wide"``: one selection over every compressed leaf (``encode_tree``).
    - ``"per_leaf"``: none of the last three, so each payload decodes on its
      own: what ``two_phase``, ``hierarchical`` and the robust rules need.

    Examples:
      >>> import commopt
      >>> sorted(commopt.scaled_sign().capabilities)
      ['per_leaf']
      >>> sorted(commopt.power_sgd().capabilities)
      ['protocol', 'stateful']
    """
    caps = {name for name, on in (("linear", self.linear),
                                  ("shared_randomness", self.shared_randomness),
                                  ("stateful", self.stateful),
                                  ("protocol", self.reduce is not None),
                                  ("tree_wide", self.encode_tree is not None)) if on}
    if not caps & {"stateful", "protocol", "tree_wide"}:
      caps.add("per_leaf")
    return frozenset(caps)


CAPABILITIES = ("linear", "shared_randomness", "stateful", "protocol", "tree_wide", "per_leaf")
"""Everything :attr:`Compressor.capabilities` may hold."""


def is_stateless_per_leaf(compressor: Compressor) -> bool:
  """Whether each payload decodes on its own (the ``"per_leaf"`` capability).

  Chunked reductions and robust rules encode pieces or decode each worker's
  payload independently, which only such compressors allow.
  """
  return "per_leaf" in compressor.capabilities


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


def first_true(mask: jax.Array, capacity: int) -> jax.Array:
  """The flat indices of the first ``capacity`` true entries of ``mask``.

  Slots past the number of true entries hold ``mask.size`` (out of range).
  One inclusive scan and a binary search per slot: O(size + capacity log size),
  with no sort over the leaf.
  """
  counts = jax.lax.associative_scan(jnp.add, mask.reshape(-1).astype(jnp.int32))
  wanted = jnp.arange(1, capacity + 1, dtype=jnp.int32)
  return jnp.searchsorted(counts, wanted, side="left").astype(jnp.int32)


def block_len(n: int, block_size: Optional[int]) -> int:
  """Coordinates per block when ``n`` are cut into blocks of ``block_size`` (None: one block)."""
  return n if block_size is None else min(block_size, n)


def block_counts(n: int, block_size: Optional[int]) -> np.ndarray:
  """Coordinates in each block (float32; the last block may be shorter)."""
  size = block_len(n, block_size)
  counts = np.full(-(-n // size), size, np.float32)
  counts[-1] = n - size * (counts.size - 1)
  return counts


def blocks(flat: jax.Array, block_size: Optional[int]) -> jax.Array:
  """``flat`` (1-D) zero-padded to whole blocks, shaped ``[blocks, block length]``.

  Args:
    flat: a 1-D array of ``n`` coordinates.
    block_size: coordinates per block; ``None`` gives one block.

  Returns:
    ``[⌈n/size⌉, size]`` with ``size = block_len(n, block_size)``.
  """
  n = flat.shape[0]
  size = block_len(n, block_size)
  nb = -(-n // size)
  return jnp.pad(flat, (0, nb * size - n)).reshape(nb, size)


def per_element(per_block: jax.Array, n: int, block_size: Optional[int]) -> jax.Array:
  """Broadcasts one value per block back to the ``n`` coordinates.

  A broadcast and a reshape, which XLA compiles in constant time whatever
  ``n`` (``jnp.repeat`` with ``total_repeat_length`` builds an index cumsum
  that XLA constant-folds, which took seconds for large leaves).

  Args:
    per_block: ``[⌈n/size⌉]`` values, one per block.
    n: the number of coordinates.
    block_size: coordinates per block; ``None`` gives one block.

  Returns:
    ``[n]``: coordinate ``i`` holds ``per_block[i // size]``.
  """
  size = block_len(n, block_size)
  return jnp.broadcast_to(per_block[:, None], (per_block.shape[0], size)).reshape(-1)[:n]


def check_choice(name: str, value, valid: tuple, fn: str):
  """``value``, or a ValueError naming ``name`` unless it is one of ``valid``."""
  if value not in valid:
    raise ValueError(f"{fn}: `{name}` must be one of {valid}, got {value!r}.")
  return value


def check_block_size(block_size, fn: str, name: str = "block_size") -> Optional[int]:
  """``None`` (one block) or a positive int, else a ValueError naming ``name``."""
  if block_size is None:
    return None
  if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or \
      block_size <= 0:
    raise ValueError(f"{fn}: `{name}` must be None or a positive integer, got {block_size!r}.")
  return int(block_size)


def check_int(name: str, value, *, fn: str, minimum: int) -> int:
  """``value`` as an int, or a ValueError unless it is an integer >= ``minimum``."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ValueError(f"{fn}: `{name}` must be an integer >= {minimum}, got {value!r}.")
  return int(value)


def check_number(name: str, value, *, fn: str, low: float, high: float = math.inf,
                 low_open: bool = True, high_open: bool = True,
                 what: Optional[str] = None) -> float:
  """``value`` as a float, or a ValueError unless it lies in the interval from ``low`` to ``high``.

  The ends are open unless ``low_open``/``high_open`` say otherwise; NaN and
  booleans are refused. ``what`` replaces the default description
  ("a number in (low, high)") in the message.
  """
  try:
    v = float(value)
  except (TypeError, ValueError):
    v = float("nan")
  ok = ((v > low) if low_open else (v >= low)) and ((v < high) if high_open else (v <= high))
  if isinstance(value, bool) or not ok:
    if what is None:
      lo, hi = "(" if low_open else "[", ")" if high_open else "]"
      what = f"a number in {lo}{low}, {high}{hi}"
    raise ValueError(f"{fn}: `{name}` must be {what}, got {value!r}.")
  return v


def need_key(key, fn: str):
  """``key``, or a ValueError when a stochastic encode was given none."""
  if key is None:
    raise ValueError(
        f"{fn}: `encode` needs a PRNG key (this compressor is stochastic), got key=None. "
        "compressed_mean passes one; when calling encode yourself pass jax.random.key(0) "
        "or similar.")
  return key


AxisName = Optional[Union[str, tuple[str, ...]]]
"""``None`` (one local worker), a mesh axis name, or a tuple of distinct axis names."""


def check_axis_name(axis_name, fn: str) -> AxisName:
  """``axis_name``, or a ValueError unless it is None, a name or a tuple of distinct names.

  Examples:
    >>> from commopt._src.base import check_axis_name
    >>> check_axis_name(("node", "local"), "krum")
    ('node', 'local')
  """
  if axis_name is None or isinstance(axis_name, str):
    return axis_name
  if (isinstance(axis_name, tuple) and axis_name and all(isinstance(a, str) for a in axis_name)
      and len(set(axis_name)) == len(axis_name)):
    return axis_name
  raise ValueError(
      f"{fn}: `axis_name` must be None, a mesh axis name (str) or a non-empty tuple of "
      f"distinct axis names such as ('node', 'local'), got {axis_name!r}.")


def check_float_leaf(fn: str, path, leaf, *, verb: str, what: str = "an update") -> None:
  """A ValueError unless ``leaf`` is a floating-point array (None-like leaves pass)."""
  dtype = getattr(leaf, "dtype", None)
  if dtype is None or not is_float_dtype(dtype):
    raise ValueError(
        f"{fn}: {what} leaf {jax.tree_util.keystr(path) or '<root>'} has dtype {dtype}, but "
        f"only floating-point leaves can be {verb}. Pass None for leaves that carry no "
        "gradient, or wrap the transform in optax.masked so that it skips them.")


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
