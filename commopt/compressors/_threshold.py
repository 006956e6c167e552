"""Threshold sparsification: Strom's threshold, gradient dropping and AdaComp."""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from commopt._src import base
from commopt.compressors._registry import register
from commopt.compressors._sparse import (
    _check_coded_size,
    _check_value_dtype,
    _fraction_count,
    _magnitude_selector,
    _pairs_codec,
    _sign_index_codes,
    _sign_index_values,
    _sparse_compressor,
    _take,
    _with_values,
    first_true,
)


class AdaCompState(NamedTuple):
  """Per-leaf state of :func:`adacomp`: what the last step left unsent.

  AdaComp's selection needs the fresh gradient ``dW`` beside the accumulated
  residue ``G = residue + dW``; with error feedback the input is ``G``, so
  ``dW = G - residue`` is recovered from this copy of the residue.
  """
  residual: jax.Array


RELATIVE_TAU = 0.75
"""`threshold`'s ``tau`` when none is given: this fraction of each leaf's largest magnitude."""


def threshold(tau: Optional[float] = None, *, capacity: float = 0.01) -> base.Compressor:
  """Sends ``±tau`` for each coordinate with ``|x| > tau`` (Strom 2015).

  Each sent coordinate is one uint32 word: its flat index (31 bits) and its
  sign (the low bit). A leaf has ``⌈capacity · size⌉`` words; coordinates over
  the threshold fill them in index order and the rest of them wait. The
  quantisation error ``x − (±tau)`` and every coordinate not sent stay in the
  error residual, where they accumulate until they cross the threshold.
  Use it with error feedback (the default).

  ``tau=None`` (the default) sets each leaf's threshold at every step to
  three quarters of its largest magnitude, sent as one float32 beside the
  words. The largest coordinate always crosses it, so
  every payload sends at least one coordinate, and each one sent removes at
  least ``tau²`` of the squared norm: a contraction with
  ``δ ≥ (3/4)² / size``, whose residual stays bounded whatever the input's
  scale (at a 1% capacity under a constant normal gradient it levels off
  near 50× the gradient's norm, as :func:`~commopt.top_k`'s does).

  An absolute ``tau`` (Strom's) must suit the input's scale: one payload
  moves at most ``capacity · size · tau`` of mass, so with error feedback the
  residual stays bounded only while the mean magnitude of the input stays
  below ``capacity · tau`` (``1e-5`` for ``tau = 1e-3`` and a 1% capacity);
  above that it grows with every step (linearly under a constant input), and
  the step sizes of the model are ``±tau`` whatever the gradient. A
  threshold relative to the input's spread (its mean or root-mean-square
  magnitude) does not help: the residual then grows in proportion to the
  input, keeps its shape, and the coordinates that never crossed never do;
  only one relative to the largest magnitude is sure to be crossed.

  Args:
    tau: the threshold, > 0, in the units of the compressed input; ``None``
      (the default): three quarters of the leaf's largest magnitude, at
      every step.
    capacity: fraction of each leaf that one payload can carry, in (0, 1].

  Returns:
    A non-linear :class:`~commopt.Compressor` with ``32 · ⌈capacity · size⌉``
    payload bits per leaf (32 more with ``tau=None``); declared contractive
    with ``tau=None``, biased with no bound otherwise.

  Examples:
    >>> import jax.numpy as jnp
    >>> from commopt.compressors import threshold
    >>> c = threshold(1.0, capacity=0.5)
    >>> x = jnp.array([0.5, -3.0, 2.0, 0.1])
    >>> payload, _ = c.encode(x, c.init(x), None)
    >>> c.decode(payload, None, x).tolist()
    [0.0, -1.0, 1.0, 0.0]
    >>> c = threshold(capacity=0.5)             # tau = 0.75 · 4
    >>> x = jnp.array([0.5, -4.0, 3.5, 2.0])
    >>> payload, _ = c.encode(x, c.init(x), None)
    >>> c.decode(payload, None, x).tolist()
    [0.0, -3.0, 3.0, 0.0]

  References:
    Strom, Scalable Distributed DNN Training Using Commodity GPU Cloud
    Computing, Interspeech 2015.
  """
  relative = tau is None
  if not relative:
    tau = base.check_number("tau", tau, fn="threshold", low=0.0, what="a finite number > 0")
  capacity = base.check_ratio("capacity", capacity, fn="threshold")

  def slots(shape) -> int:
    size = base.leaf_size(shape)
    _check_coded_size(size, "threshold")
    return _fraction_count(capacity, size)

  def encode(x, state, key):
    flat = x.reshape(-1)
    if not relative:
      indices = first_true(jnp.abs(flat) > tau, slots(x.shape))
      return {"codes": _sign_index_codes(flat, indices)}, state
    magnitude = jnp.abs(flat.astype(jnp.float32))
    level = RELATIVE_TAU * jnp.max(magnitude)
    indices = first_true(magnitude > level, slots(x.shape))
    return {"codes": _sign_index_codes(flat, indices), "tau": level.reshape(1)}, state

  decode, accumulate = _pairs_codec(
      lambda payload, state: _sign_index_values(
          payload["codes"], payload["tau"][0] if relative else jnp.float32(tau)))

  if relative:
    return base.Compressor(
        name=f"threshold(tau={RELATIVE_TAU}·max, capacity={capacity})",
        init=base.stateless_init, encode=encode, decode=decode, accumulate=accumulate,
        payload_bits=lambda shape, dtype: 32 * slots(shape) + 32, error_kind="contractive",
        error_bound=lambda shape: RELATIVE_TAU ** 2 / base.leaf_size(shape))
  return base.Compressor(
      name=f"threshold(tau={tau}, capacity={capacity})", init=base.stateless_init,
      encode=encode, decode=decode, payload_bits=lambda shape, dtype: 32 * slots(shape),
      accumulate=accumulate)


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

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from commopt.compressors import gradient_dropping
    >>> c = gradient_dropping(0.5)
    >>> x = jnp.array([0.1, -3.0, 2.0, 0.5])
    >>> payload, _ = c.encode(x, c.init(x), jax.random.PRNGKey(0))
    >>> c.decode(payload, None, x).tolist()
    [0.0, -3.0, 2.0, 0.0]

  References:
    Aji & Heafield, Sparse Communication for Distributed Gradient Descent,
    EMNLP 2017.
  """
  drop = base.check_number("drop_ratio", drop_ratio, fn="gradient_dropping", low=0.0, high=1.0,
                           low_open=False, what="a fraction in [0, 1)")
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

  Why it keeps a residue of its own beside the transform's error feedback:
  a compressor sees only ``G = residue + dW`` (the compressor protocol hands
  ``encode`` the error-compensated input), and AdaComp's selection also needs
  the fresh ``dW = G - residue``. Its state keeps the residue it left, which
  equals :func:`~commopt.compressed_mean`'s residual for the leaf (both are
  ``G - decode(payload)``); so the residue is stored twice, one leaf-sized
  buffer more than other compressors, and under ``error_feedback=False``
  the selection still uses it while nothing is carried over.

  Args:
    bin_size: coordinates per bin, a positive integer (the paper uses 50
      for convolutions and 500 for dense layers).
    per_bin: slots per bin, a positive integer at most ``bin_size``.

  Returns:
    A non-linear :class:`~commopt.Compressor` with per-leaf state.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from commopt.compressors import adacomp
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
    residual = x - decode(payload, None, x)
    return payload, AdaCompState(residual=residual)

  decode, accumulate = _pairs_codec(
      lambda payload, state: _sign_index_values(payload["codes"], payload["scale"][0]))

  return base.Compressor(
      name=f"adacomp(bin_size={bin_size}, per_bin={per_bin})", init=init, stateful=True,
      encode=encode, decode=decode, accumulate=accumulate,
      payload_bits=lambda shape, dtype: 32 * (bins(shape) * per_bin + 1))


register("threshold", threshold, {"capacity": 0.01}, variants=({"tau": 0.5},))
register("gradient_dropping", gradient_dropping, {"drop_ratio": 0.99})
register("adacomp", adacomp, {"bin_size": 50})
