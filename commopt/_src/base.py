"""The compressor protocol and the helpers every compressor shares."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from commopt._src import bits, vma
from commopt._src.errors import AxisNameError, OptionTypeError  # noqa: F401  (re-exported)

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
    init_shard: optional ``init_shard(leaf, spec, channel) -> state``: the state of
      this device's block of a leaf sharded by ``spec`` over model axes, called
      inside a ``shard_map`` manual over them (:meth:`init_block`); ``channel``
      gives the block's place (``channel.model_index(axes)``,
      ``channel.model_size(axes)``). Where the state
      depends on the leaf's whole shape (PowerSGD's seeded ``Q``), it is the block
      of the whole leaf's ``init`` state that the shard's reductions use, so that
      the sharded run equals the unsharded one; without it each shard gets
      ``init(shard)``.
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
    error_kind: what the compressor's error is, which decides what error
      feedback does with it (one of :data:`ERROR_KINDS`; see
      :func:`feedback_compressor`): ``"lossless"``; ``"rounding"`` (each
      value moved by a tiny fraction of itself, ``|C(x)ᵢ − xᵢ| ≤ u|xᵢ|``, as a
      cast to bfloat16 rounds it; ``δ = 1 − u²``); ``"contractive"`` (for
      every ``x``, ``‖C(x) − x‖² ≤ (1 − δ)‖x‖²``, the largest entries sent
      first); ``"expected_contractive"`` (the same bound in expectation, the
      kept part drawn at random whatever the magnitudes); ``"unbiased"``
      (``E C(x) = x``, ``E‖C(x) − x‖² ≤ ω‖x‖²``); ``"direction"`` (the output's
      magnitude does not follow the input's, as ``sign``); ``"biased"`` (none
      of these declared; the default for a compressor you write).
    error_bound: ``error_bound(shape) -> float``: δ for ``"rounding"`` and the
      two contractive kinds, ω for ``"unbiased"``, for a leaf of that shape;
      ``None`` for the other kinds.
    encode_feedback: optional ``encode_feedback(u, e, state, key) -> (payload,
      e′, state)``: ``encode(u + e)`` and ``e′ = u + e − decode(payload)``,
      bit for bit, in fewer passes over the leaf (``scaled_sign``'s fused
      kernel). :func:`~commopt.compressed_mean` calls it for float32 leaves
      with float32 residuals under ``strategy="gather"``.
    flat_chunks: whether a flat chunk of a leaf (the 1-D pieces
      ``two_phase`` and ``hierarchical`` cut each leaf into) compresses as the
      leaf does. ``False`` for a compressor whose payload depends on the
      leaf's matrix shape and saves nothing on a vector (ATOMO): those
      strategies refuse it.
    sparse_values: whether the payload is ``{"values", "indices"}``, decoded by
      placing the values at the flat indices of a zero leaf (top-k, threshold,
      random-k): a gathered reduction then sends 32-bit values and their indices
      in one all-gather and writes the residual by subtracting the values sent,
      with no dense reconstruction (``strategy="gather"``).

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
  error_kind: str = "biased"
  error_bound: Optional[Callable[[tuple[int, ...]], float]] = None
  flat_chunks: bool = True
  encode_feedback: Optional[Callable[..., tuple]] = None
  sparse_values: bool = False
  init_shard: Optional[Callable[[Any, Any, Any], Any]] = None

  def __post_init__(self):
    if self.error_kind not in ERROR_KINDS:
      raise ValueError(f"Compressor {self.name!r}: `error_kind` must be one of {ERROR_KINDS}, "
                       f"got {self.error_kind!r}.")
    bounded = self.error_kind in ("rounding", "contractive", "expected_contractive", "unbiased")
    if bounded != (self.error_bound is not None):
      raise ValueError(
          f"Compressor {self.name!r}: error_kind={self.error_kind!r} "
          + ("needs `error_bound(shape)` (δ for the contractive kinds, ω for unbiased)."
             if bounded else "takes no `error_bound`."))

  def delta(self, shape) -> Optional[float]:
    """The contraction ``δ`` this compressor guarantees on a leaf of ``shape``.

    1 for ``"lossless"``; the declared bound for ``"rounding"`` and the contractive kinds;
    ``1/(1+ω)`` for ``"unbiased"`` (the contraction of ``C/(1+ω)``, which
    error feedback uses); ``None`` when nothing is declared.

    Examples:
      >>> import commopt
      >>> commopt.top_k(0.01).delta((100, 100))
      0.01
      >>> round(commopt.qsgd(levels=7, bucket_size=512).delta((4096,)), 3)
      0.236
    """
    if self.error_kind == "lossless":
      return 1.0
    if self.error_kind in ("rounding", "contractive", "expected_contractive"):
      return float(self.error_bound(tuple(shape)))
    if self.error_kind == "unbiased":
      return 1.0 / (1.0 + float(self.error_bound(tuple(shape))))
    return None

  def init_block(self, leaf, spec, channel) -> Any:
    """The state of ``leaf``, this device's block of a leaf sharded by ``spec`` over
    model axes (``init_shard``), or ``init(leaf)`` where ``spec`` names no axis or is
    unknown (None)."""
    if self.init_shard is None or spec is None or not vma.spec_axes(spec):
      return self.init(leaf)
    return self.init_shard(leaf, spec, channel)

  def omega(self, shape) -> Optional[float]:
    """The variance factor ``ω`` of an unbiased compressor on a leaf of ``shape`` (else None)."""
    return float(self.error_bound(tuple(shape))) if self.error_kind == "unbiased" else None

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
    - ``"flat_chunks"``: ``per_leaf``, and a flat chunk (the 1-D pieces
      ``two_phase`` and ``hierarchical`` cut each leaf into) compresses as
      the leaf does (the :attr:`flat_chunks` field). ATOMO's payload depends
      on the leaf's matrix shape and saves nothing on a vector, so it is
      ``per_leaf`` but not ``flat_chunks``.
    - ``"fused_feedback"``: error feedback and encoding in one fused op
      (:attr:`encode_feedback`).
    - ``"sparse_values"``: a values-and-indices payload (:attr:`sparse_values`).
    - the error kind (:attr:`error_kind`): ``"lossless"``, ``"rounding"``,
      ``"contractive"``, ``"expected_contractive"``, ``"unbiased"``,
      ``"direction"`` or ``"biased"``.

    Examples:
      >>> import commopt
      >>> sorted(commopt.scaled_sign().capabilities)
      ['contractive', 'flat_chunks', 'fused_feedback', 'per_leaf']
      >>> sorted(commopt.qsgd().capabilities)
      ['flat_chunks', 'per_leaf', 'unbiased']
    """
    caps = {name for name, on in (("linear", self.linear),
                                  ("shared_randomness", self.shared_randomness),
                                  ("stateful", self.stateful),
                                  ("protocol", self.reduce is not None),
                                  ("tree_wide", self.encode_tree is not None),
                                  ("fused_feedback", self.encode_feedback is not None),
                                  ("sparse_values", self.sparse_values)) if on}
    if not caps & {"stateful", "protocol", "tree_wide"}:
      caps.add("per_leaf")
      if self.flat_chunks:
        caps.add("flat_chunks")
    caps.add(self.error_kind)
    return frozenset(caps)


ERROR_KINDS = ("lossless", "rounding", "contractive", "expected_contractive", "unbiased",
               "direction", "biased")
"""What a compressor's error may be declared as (:attr:`Compressor.error_kind`)."""

CAPABILITIES = ("linear", "shared_randomness", "stateful", "protocol", "tree_wide",
                "per_leaf", "flat_chunks", "fused_feedback", "sparse_values") + ERROR_KINDS
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


def axis_names(axis_name) -> tuple:
  """``axis_name`` as a tuple of axis names: a tuple as it is, one name (or None) as a 1-tuple."""
  return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def leaf_size(shape) -> int:
  return int(math.prod(shape))


def _received(value) -> str:
  """The value received, as messages show it: its repr and its type."""
  return f"{value!r} ({type(value).__name__})"


def _is_bool(value) -> bool:
  return isinstance(value, (bool, np.bool_))


def _is_int(value) -> bool:
  """A Python or NumPy integer; a bool is not one."""
  return isinstance(value, (int, np.integer)) and not _is_bool(value)


def is_real_number(value) -> bool:
  """Whether ``value`` is a real number: a Python or NumPy int or float, or a
  concrete 0-d array of one (``jnp.float32(0.1)``); bools, strings and tracers
  are not."""
  if _is_bool(value):
    return False
  if isinstance(value, numbers.Real):
    return True
  if isinstance(value, (np.ndarray, jax.Array)) and not vma.is_tracer(value):
    return (np.ndim(value) == 0 and (jnp.issubdtype(value.dtype, jnp.integer)
                                     or jnp.issubdtype(value.dtype, jnp.floating)))
  return False


def _int_fix(value) -> str:
  """What to pass instead of ``value`` where an integer belongs."""
  if not _is_bool(value) and isinstance(value, (str, float, np.floating)):
    try:
      whole = float(value)
    except ValueError:
      whole = math.nan
    if math.isfinite(whole) and whole.is_integer():
      return f"pass {int(whole)} (an int)"
  return "pass an int"


def _real_fix(value) -> str:
  """What to pass instead of ``value`` where a real number belongs."""
  if isinstance(value, str):
    try:
      return f"pass {float(value)!r} (a number, not a string)"
    except ValueError:
      pass
  if _is_bool(value):
    return "pass an int or a float (True and False are not numbers here)"
  return "pass an int or a float"


def check_bool(name: str, value, *, fn: str) -> bool:
  """``value`` as a bool, or an :class:`OptionTypeError` unless it is ``True`` or ``False``.

  Nothing else is read as a bool: ``"no"`` is truthy, and a ``0`` or ``1`` is
  more often an argument in the wrong place than a flag.

  Examples:
    >>> from commopt._src.base import check_bool
    >>> check_bool("approx", False, fn="top_k")
    False
  """
  if not _is_bool(value):
    raise OptionTypeError(
        f"{fn}: `{name}` must be True or False, got {_received(value)}; pass True or False "
        "(a bool).")
  return bool(value)


def check_integer(name: str, value, *, fn: str, rule: str,
                  ok: Callable[[int], bool] = lambda v: True) -> int:
  """``value`` as an int: an :class:`OptionTypeError` unless it is an integer (a
  bool or an integral float is not), a ValueError unless ``ok(value)``; both
  messages state ``rule`` (``"an even integer in [2, 256]"``)."""
  if not _is_int(value):
    raise OptionTypeError(
        f"{fn}: `{name}` must be {rule}, got {_received(value)}; {_int_fix(value)}.")
  if not ok(int(value)):
    raise ValueError(f"{fn}: `{name}` must be {rule}, got {value!r}.")
  return int(value)


def check_positive_int(name: str, value, *, fn: str) -> int:
  """``value`` as an int: an :class:`OptionTypeError` unless it is an integer (a
  bool or an integral float is not), a ValueError unless it is positive."""
  return check_integer(name, value, fn=fn, rule="a positive integer", ok=lambda v: v > 0)


def first_true(mask: jax.Array, capacity: int) -> jax.Array:
  """The flat indices of the first ``capacity`` true entries of ``mask``.

  Slots past the number of true entries hold ``mask.size`` (out of range).
  A scan over the mask's 32-entry words and a search per slot
  (:func:`commopt._src.bits.first_true`), with no sort over the leaf.
  """
  return bits.first_true(mask, capacity)


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
  that XLA constant-folds, in time growing with ``n``).

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
  """``value`` if it is one of ``valid``, of the same type (``True`` is not ``1``).

  Otherwise an :class:`OptionTypeError` when no choice has ``value``'s type
  (``1`` among strings), else a ValueError; both name ``name``.
  """
  def same_kind(v) -> bool:   # bools apart from ints, NumPy's ints and strs with Python's
    if _is_bool(v) or _is_bool(value):
      return _is_bool(v) and _is_bool(value)
    return _is_int(value) if _is_int(v) else isinstance(value, type(v))

  kin = [v for v in valid if same_kind(v)]
  if any(v == value for v in kin):
    return value
  if not kin:
    alike = [v for v in valid if (is_real_number(value) and is_real_number(v) and v == value)
             or (isinstance(value, str) and str(v) == value)]
    fix = f"pass {alike[0]!r}" if alike else "pass one of them"
    raise OptionTypeError(
        f"{fn}: `{name}` must be one of {valid}, got {_received(value)}; {fix}.")
  raise ValueError(f"{fn}: `{name}` must be one of {valid}, got {value!r}.")


def check_block_size(block_size, fn: str, name: str = "block_size") -> Optional[int]:
  """``None`` (one block) or a positive int, else an :class:`OptionTypeError`
  (not an integer) or a ValueError (not positive) naming ``name``."""
  if block_size is None:
    return None
  return check_integer(name, block_size, fn=fn, rule="None or a positive integer",
                       ok=lambda v: v > 0)


def check_int(name: str, value, *, fn: str, minimum: Optional[int] = None) -> int:
  """``value`` as an int: an :class:`OptionTypeError` unless it is an integer (a
  bool or an integral float is not), a ValueError unless it is >= ``minimum``
  (any integer when ``minimum`` is None, e.g. a seed)."""
  if minimum is None:
    return check_integer(name, value, fn=fn, rule="an integer")
  return check_integer(name, value, fn=fn, rule=f"an integer >= {minimum}",
                       ok=lambda v: v >= minimum)


def check_number(name: str, value, *, fn: str, low: float, high: float = math.inf,
                 low_open: bool = True, high_open: bool = True,
                 what: Optional[str] = None) -> float:
  """``value`` as a float if it is a real number in the interval from ``low`` to ``high``.

  The ends are open unless ``low_open``/``high_open`` say otherwise. A value
  that is not a real number (a string such as ``"0.1"``, a bool, None) raises
  an :class:`OptionTypeError`; one outside the interval, or NaN, a
  ValueError. ``what`` replaces the default description ("a number in
  (low, high)") in the message.
  """
  if what is None:
    lo, hi = "(" if low_open else "[", ")" if high_open else "]"
    what = f"a number in {lo}{low}, {high}{hi}"
  if not is_real_number(value):
    raise OptionTypeError(
        f"{fn}: `{name}` must be {what}, got {_received(value)}; {_real_fix(value)}.")
  v = float(value)
  ok = ((v > low) if low_open else (v >= low)) and ((v < high) if high_open else (v <= high))
  if not ok:
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
  """``axis_name`` if it is None, a name or a tuple of distinct names: an
  :class:`OptionTypeError` for another type, a ValueError for an empty tuple
  or a repeated name.

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
  rule = ("None, a mesh axis name (str) or a non-empty tuple of distinct axis names such as "
          "('node', 'local')")
  if not isinstance(axis_name, tuple) or not all(isinstance(a, str) for a in axis_name):
    raise OptionTypeError(f"{fn}: `axis_name` must be {rule}, got {_received(axis_name)}.")
  raise ValueError(f"{fn}: `axis_name` must be {rule}, got {axis_name!r}.")


def check_float_leaf(fn: str, path, leaf, *, verb: str, what: str = "an update") -> None:
  """A ValueError unless ``leaf`` is a floating-point array (None-like leaves pass)."""
  dtype = getattr(leaf, "dtype", None)
  if dtype is None or not is_float_dtype(dtype):
    raise ValueError(
        f"{fn}: {what} leaf {jax.tree_util.keystr(path) or '<root>'} has dtype {dtype}, but "
        f"only floating-point leaves can be {verb}. Pass None for leaves that carry no "
        "gradient, or wrap the transform in optax.masked so that it skips them.")


def check_ratio(name: str, value, *, fn: str) -> float:
  """``value`` as a float if it is a real number in (0, 1]: an
  :class:`OptionTypeError` for a string (``"0.1"``) or a bool, a ValueError
  outside the interval."""
  return check_number(name, value, fn=fn, low=0.0, high=1.0, high_open=False,
                      what="a fraction in (0, 1]")


def power_of_two(e: jax.Array, dtype) -> jax.Array:
  """``2**e`` in ``dtype``, exactly, for integer ``e`` between the dtype's normal exponents."""
  info = jnp.finfo(dtype)
  uint = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[info.bits // 8]
  biased = (e + (info.maxexp - 1)).astype(uint)
  return jax.lax.bitcast_convert_type(biased << info.nmant, dtype)


def pow2_scales(m: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(down, up)``: powers of two, ``up = 1/down``, with ``m · down`` in ``[1, 2)``.

  Multiplying by ``down`` before squaring, summing squares or a
  factorisation, and by ``up`` after, keeps every intermediate of a
  magnitude about 1, so an input whose norm is representable never
  overflows (nor underflows) on the way to it. Both are exact powers of
  two: scaling commutes with every rounding, so the result is the same bit
  for bit as the unscaled computation wherever that one neither overflows
  nor underflows.

  Args:
    m: non-negative magnitudes (e.g. a max-abs per bucket), any float dtype.

  Returns:
    ``(down, up)`` shaped like ``m``. Both stay normal numbers: ``m`` below
    the smallest normal is scaled up as far as that allows, and ``m`` in the
    top binade (``m ≥ 2^127`` in float32) lands in ``[2, 4)``. Where ``m`` is
    not finite both are 1, so a NaN or an infinity still propagates.
  """
  info = jnp.finfo(m.dtype)
  uint = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[info.bits // 8]
  bias = info.maxexp - 1
  field = (jax.lax.bitcast_convert_type(jnp.abs(m), uint) >> info.nmant).astype(jnp.int32)
  e = jnp.where(field > 2 * bias, 0, jnp.clip(field - bias, 1 - bias, bias - 1))
  return power_of_two(-e, m.dtype), power_of_two(e, m.dtype)


def safe_norm(arrays) -> jax.Array:
  """The Euclidean norm of ``arrays`` taken together (in float32 or wider), without overflow.

  Every array is scaled by one power of two (:func:`pow2_scales` of the
  largest magnitude) before it is squared, and the norm scaled back: the
  same bits as ``sqrt(Σ x²)`` wherever that neither overflows nor
  underflows, and finite wherever the norm itself is representable. A NaN or
  inf still propagates.
  """
  xs = [jnp.asarray(a) for a in arrays]
  dtype = jnp.result_type(jnp.float32, *(x.dtype for x in xs))
  xs = [x.astype(dtype) for x in xs]
  down, up = pow2_scales(jnp.max(jnp.stack([jnp.max(jnp.abs(x), initial=0.0) for x in xs])))
  return up * jnp.sqrt(sum(jnp.sum(jnp.square(x * down)) for x in xs))


def is_float_dtype(dtype) -> bool:
  return jnp.issubdtype(dtype, jnp.floating)
