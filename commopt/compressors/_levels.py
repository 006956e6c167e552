"""Multi-level quantisers: TernGrad, QSGD, natural compression, int8/int4 and adaptive levels.

Codes of ``b`` bits are packed into uint32 words through :mod:`commopt.kernels`
(Pallas where it handles the width, the reference elsewhere, the same bits on
every implementation); scales and norms travel as float32. The stochastic
quantisers draw their random bits from the key ``compressed_mean`` passes in.
"""

from __future__ import annotations

from typing import Optional

import math

import jax
import jax.numpy as jnp

from commopt import kernels
from commopt._src import base
from commopt._src import bits as bitops
from commopt._src import vma
from commopt.compressors._registry import register
from commopt.compressors._qcommon import (
    _F32,
    _block_norms,
    _check_levels,
    _flat32,
    _inverse,
    _out,
    _random_bits,
    _signed_levels,
    _stochastic_round,
    _uniform,
    _words_bits,
)


def terngrad(clip: Optional[float] = 2.5) -> base.Compressor:
  """TernGrad: stochastic ternary levels ``{-1, 0, +1} · s`` with ``s = max|x|``.

  Coordinate ``x_i`` becomes ``s · sign(x_i)`` with probability ``|x_i|/s``
  and 0 otherwise, which is unbiased. With ``clip`` the input is first
  clipped to ``±clip·σ`` (``σ`` its standard deviation), as in the paper;
  this shrinks ``s`` and the variance, and biases the largest coordinates.
  The payload is one float32 ``s`` and 2 bits per coordinate (0, +, -).

  Args:
    clip: the clipping factor ``c`` (> 0), or ``None`` for no clipping
      (unbiased).

  Returns:
    A non-linear, stochastic :class:`~commopt.Compressor`.

  Examples:
    >>> import jax, jax.numpy as jnp, commopt
    >>> c = commopt.compressors.terngrad(clip=None)
    >>> x = jnp.array([0.5, -1.0, 0.0, 0.25])
    >>> y = c.decode(c.encode(x, None, jax.random.key(0))[0], None, x)
    >>> bool(jnp.all((y == 0) | (jnp.abs(y) == 1.0)))
    True

  References:
    Wen et al., TernGrad: Ternary Gradients to Reduce Communication in
    Distributed Deep Learning, NeurIPS 2017.
  """
  if clip is not None:
    clip = base.check_number("clip", clip, fn="terngrad", low=0.0, what="a finite number > 0")

  def encode(x, state, key):
    flat = _flat32(x)
    if clip is not None:
      # σ of the input scaled near 1 (by a power of two), so its squares never overflow.
      down, up = base.pow2_scales(jnp.max(jnp.abs(flat)))
      bound = clip * (up * jnp.std(flat * down))
      flat = jnp.where(bound > 0, jnp.clip(flat, -bound, bound), flat)
    s = jnp.max(jnp.abs(flat))
    bits = _random_bits(key, flat.shape[0], "terngrad")
    codes = kernels.quantize_pack(flat, bits, 1, s.reshape(1), style="terngrad")
    return {"scale": s.reshape(1), "codes": codes}, state

  def decode(payload, state, like):
    codes = kernels.unpack_bits(payload["codes"], 2, base.leaf_size(like.shape))
    level = jnp.where(codes == 2, -1.0, codes.astype(_F32))
    return _out(payload["scale"][0] * level, like)

  return base.Compressor(
      name=f"terngrad(clip={clip})", init=base.stateless_init, encode=encode, decode=decode,
      payload_bits=lambda shape, dtype: 32 + _words_bits(base.leaf_size(shape), 2),
      # Unbiased for the (clipped) input; Σ|x_i|(s − |x_i|) ≤ s‖x‖₁ ≤ √n‖x‖².
      error_kind="unbiased", error_bound=lambda shape: math.sqrt(base.leaf_size(shape)))


def qsgd(levels: int = 7, bucket_size: Optional[int] = 512) -> base.Compressor:
  """QSGD: stochastic rounding to ``s`` uniform levels of each bucket's norm.

  Each bucket of ``bucket_size`` coordinates is sent as its float32 norm
  ``‖v‖₂`` and, per coordinate, a signed level ``l ∈ {-s, …, s}``:
  ``|v_i|/‖v‖₂ · s`` is rounded down or up at random so that the result
  ``‖v‖₂ · l / s`` is unbiased. Its variance is at most
  ``min(n/s², √n/s) · ‖v‖₂²`` for a bucket of ``n``. The levels are packed
  at a fixed width of ``⌈log₂(2s+1)⌉`` bits; :func:`qsgd_elias_bits` gives
  what the paper's Elias coding would cost instead.

  Args:
    levels: ``s``, the number of positive levels (≥ 1).
    bucket_size: coordinates per norm; ``None`` gives one norm per leaf.

  Returns:
    A non-linear, stochastic :class:`~commopt.Compressor`.

  Examples:
    >>> import jax, jax.numpy as jnp, commopt
    >>> c = commopt.qsgd(levels=1, bucket_size=None)   # ternary, 2 bits each
    >>> c.payload_bits((64,), jnp.float32)
    160
    >>> x = jnp.array([3.0, -4.0])
    >>> y = c.decode(c.encode(x, None, jax.random.key(0))[0], None, x)
    >>> set(jnp.abs(y).tolist()) <= {0.0, 5.0}
    True

  References:
    Alistarh et al., QSGD: Communication-Efficient SGD via Gradient
    Quantization and Encoding, NeurIPS 2017.
  """
  levels = _check_levels(levels, "qsgd")
  bucket_size = base.check_block_size(bucket_size, "qsgd", "bucket_size")
  width = bitops.code_bits(2 * levels + 1)

  def encode(x, state, key):
    flat = _flat32(x)
    n = flat.shape[0]
    norms = _block_norms(base.blocks(flat, bucket_size))
    codes = kernels.quantize_pack(flat, _random_bits(key, n, "qsgd"), levels, norms,
                                  block_size=bucket_size)
    return {"norms": norms, "codes": codes}, state

  decode, payload_bits = _signed_levels(bucket_size, width, levels, "norms")

  def omega(shape) -> float:
    # Alistarh et al., Lemma 3.1, for buckets of n coordinates.
    n = base.block_len(base.leaf_size(shape), bucket_size)
    return min(n / levels ** 2, math.sqrt(n) / levels)

  return base.Compressor(
      name=f"qsgd(levels={levels}, bucket_size={bucket_size})", init=base.stateless_init,
      encode=encode, decode=decode, payload_bits=payload_bits,
      error_kind="unbiased", error_bound=omega)


def natural() -> base.Compressor:
  """Natural compression: unbiased random rounding to a signed power of two.

  ``|x| ∈ [2^e, 2^(e+1))`` rounds up to ``2^(e+1)`` with probability
  ``(|x| − 2^e)/2^e`` and down to ``2^e`` otherwise, so ``E[C(x)] = x`` and
  ``E‖C(x) − x‖² ≤ ‖x‖²/8``. Only the sign and the float32 exponent remain:
  9 bits per coordinate, packed as two planes (the signs 32 to a word, the
  exponents 4 to a word) that decode without codes straddling words, so a
  gathered sum stays one cheap pass. Values below the smallest normal float32
  round between 0 and ``2^-126``; infinities and NaNs are sent as infinities.

  Returns:
    A non-linear, stochastic :class:`~commopt.Compressor`.

  Examples:
    >>> import jax, jax.numpy as jnp, commopt
    >>> c = commopt.compressors.natural()
    >>> x = jnp.array([1.0, -0.75, 3.0, 0.0])
    >>> y = c.decode(c.encode(x, None, jax.random.key(1))[0], None, x)
    >>> y[0].item(), y[3].item(), y[1].item() in (-0.5, -1.0), y[2].item() in (2.0, 4.0)
    (1.0, 0.0, True, True)

  References:
    Horváth et al., Natural Compression for Distributed Deep Learning, 2019.
  """

  def power(exponent_field):
    return jax.lax.bitcast_convert_type(exponent_field << 23, _F32)

  def encode(x, state, key):
    flat = _flat32(x)
    raw = jax.lax.bitcast_convert_type(flat, jnp.uint32)
    field = (raw >> 23) & 0xFF
    magnitude = jnp.abs(flat)
    low = power(field)
    high = power(jnp.minimum(field + 1, 255))
    finite = field < 255
    p = jnp.where(finite & (high > low), (magnitude - low) / (high - low), 0.0)
    up = (_uniform(key, flat.shape[0], "natural") < p).astype(jnp.uint32)
    field = jnp.where(finite, field + up, field)
    return {"signs": kernels.pack_bits(raw >> 31, 1),
            "exponents": kernels.pack_bits(field, 8)}, state

  def decode(payload, state, like):
    n = base.leaf_size(like.shape)
    signs = kernels.unpack_bits(payload["signs"], 1, n)
    field = kernels.unpack_bits(payload["exponents"], 8, n)
    raw = (signs << 31) | (field << 23)
    return _out(jax.lax.bitcast_convert_type(raw, _F32), like)

  return base.Compressor(
      name="natural", init=base.stateless_init, encode=encode, decode=decode,
      payload_bits=lambda shape, dtype: (_words_bits(base.leaf_size(shape), 1)
                                         + _words_bits(base.leaf_size(shape), 8)),
      error_kind="unbiased", error_bound=lambda shape: 1.0 / 8.0)


def _lookup(table: jax.Array, codes: jax.Array) -> jax.Array:
  """``table[codes]`` for a small table, as one select per entry.

  Elementwise, so XLA fuses it (into a gathered sum too), where a gather of
  one table entry per coordinate is a slow op of its own on a CPU.
  """
  out = jnp.broadcast_to(table[0], codes.shape)
  for j in range(1, table.shape[0]):
    out = jnp.where(codes == j, table[j], out)
  return out


ROUNDINGS = ("stochastic", "nearest")


def int_quant(bits: int = 8, block_size: Optional[int] = 256,
              rounding: str = "stochastic") -> base.Compressor:
  """Blockwise absmax integer quantisation to 8 or 4 bits.

  Each block is scaled by its largest magnitude ``m`` onto the integers
  ``{-q, …, q}`` with ``q = 2^(bits-1) − 1`` (127 or 7), rounded
  stochastically (unbiased) or to the nearest level (biased, a
  contraction), and sent as ``bits``-bit codes plus one float32 ``m`` per block.

  Args:
    bits: 8 or 4.
    block_size: coordinates per scale; ``None`` gives one scale per leaf.
    rounding: ``"stochastic"`` or ``"nearest"``.

  Returns:
    A non-linear :class:`~commopt.Compressor` (stochastic with stochastic rounding).

  Examples:
    >>> import jax.numpy as jnp, commopt
    >>> c = commopt.int_quant(bits=4, block_size=None, rounding="nearest")
    >>> x = jnp.array([7.0, -3.5, 1.2, 0.0])
    >>> y = c.decode(c.encode(x, None, None)[0], None, x)
    >>> [round(v, 5) for v in y.tolist()]      # levels of 7/7 = 1: 7, -4, 1, 0
    [7.0, -4.0, 1.0, 0.0]

  References:
    Dettmers, 8-Bit Approximations for Parallelism in Deep Learning, ICLR 2016.
    Dettmers et al., 8-bit Optimizers via Block-wise Quantization, ICLR 2022.
  """
  bits = base.check_integer("bits", bits, fn="int_quant", rule="4 or 8", ok=lambda b: b in (4, 8))
  block_size = base.check_block_size(block_size, "int_quant")
  base.check_choice("rounding", rounding, ROUNDINGS, "int_quant")
  q = 2 ** (bits - 1) - 1

  def encode(x, state, key):
    flat = _flat32(x)
    n = flat.shape[0]
    scales = jnp.max(jnp.abs(base.blocks(flat, block_size)), axis=1)
    y = flat * base.per_element(_inverse(scales, q), n, block_size)
    if rounding == "stochastic":
      level = _stochastic_round(y, _uniform(key, n, "int_quant"))
    else:
      level = jnp.round(y)
    codes = (jnp.clip(level, -q, q) + q).astype(jnp.uint32)
    return {"scales": scales, "codes": kernels.pack_bits(codes, bits)}, state

  decode, payload_bits = _signed_levels(block_size, bits, q, "scales")

  def spread(shape) -> float:
    # A block of n moves by at most a step m/q per coordinate, m ≤ its norm:
    # stochastic rounding's variance ≤ n (m/q)²/4, nearest's error likewise.
    return base.block_len(base.leaf_size(shape), block_size) / (4.0 * q * q)

  if rounding == "stochastic":
    declared = dict(error_kind="unbiased", error_bound=spread)
  else:
    declared = dict(error_kind="contractive",
                    error_bound=lambda shape: max(1.0 - spread(shape), 0.0) or 1.0 / q)

  return base.Compressor(
      name=f"int_quant(bits={bits}, block_size={block_size}, rounding={rounding})",
      init=base.stateless_init, encode=encode, decode=decode, payload_bits=payload_bits,
      **declared)


def adaptive_levels(levels: int = 16, bins: int = 128) -> base.Compressor:
  """Variance-optimal quantisation points from the data, with stochastic rounding.

  The points are chosen per leaf and per step, as ZipML does: the range
  ``[min x, max x]`` is cut into ``bins`` equal bins (counts, sums and sums
  of squares in one pass), and dynamic programming over the bin edges picks
  the ``levels`` points (both ends included) that minimise the variance of
  stochastic rounding, ``Σ (b − x)(x − a)`` for each ``x`` between
  neighbouring points ``a ≤ x ≤ b``. Each coordinate is then rounded to one
  of its two neighbours without bias. The payload is the points as float32
  and ``⌈log₂ levels⌉`` bits per coordinate.

  Args:
    levels: number of quantisation points (≥ 2).
    bins: histogram bins whose edges are the candidate points (raised to at
      least ``levels``); more bins fit the distribution more finely at
      ``O(levels · bins²)`` extra work per leaf.

  Returns:
    A non-linear, stochastic :class:`~commopt.Compressor`.

  Examples:
    >>> import jax, jax.numpy as jnp, commopt
    >>> c = commopt.compressors.adaptive_levels(levels=4)
    >>> x = jnp.concatenate([jnp.zeros(60), jnp.array([1.0, 2.0, 3.0, 10.0])])
    >>> payload, _ = c.encode(x, None, jax.random.key(0))
    >>> payload["levels"][0].item(), payload["levels"][-1].item()
    (0.0, 10.0)

  References:
    Zhang et al., ZipML: Training Linear Models with End-to-End Low
    Precision, and a Little Bit of Deep Learning, ICML 2017.
  """
  levels = _check_levels(levels, "adaptive_levels", minimum=2)
  bins = max(base.check_positive_int("bins", bins, fn="adaptive_levels"), levels)
  width = bitops.code_bits(levels)

  def points(flat):
    lo, hi = jnp.min(flat), jnp.max(flat)
    span = hi - lo
    safe = jnp.where(span > 0, span, 1.0)
    idx = jnp.clip(jnp.floor((flat - lo) / safe * bins), 0, bins - 1).astype(jnp.int32)
    # Moments about lo keep the sums well conditioned; in units of the span
    # scaled by a power of two near 1, so the squares never overflow. The
    # costs are then those of the unscaled points times a power of two: the
    # same choice of points.
    down, _ = base.pow2_scales(span)
    z = (flat - lo) * down
    moments = jnp.zeros((3, bins), _F32).at[:, idx].add(jnp.stack([jnp.ones_like(z), z, z * z]))
    prefix = jnp.pad(jnp.cumsum(moments, axis=1), ((0, 0), (1, 0)))
    edges = span * jnp.arange(bins + 1, dtype=_F32) / bins
    s0, s1, s2 = (p[None, :] - p[:, None] for p in prefix)   # [i, j]: bins i..j-1
    a, b = edges[:, None] * down, edges[None, :] * down
    cost = -s2 + (a + b) * s1 - a * b * s0
    cost = jnp.where(jnp.arange(bins + 1)[:, None] < jnp.arange(bins + 1)[None, :],
                     jnp.maximum(cost, 0.0), jnp.inf)

    def extend(best, _):
      total = best[:, None] + cost
      return jnp.min(total, axis=0), jnp.argmin(total, axis=0).astype(jnp.int32)

    _, choices = jax.lax.scan(extend, cost[0], None, length=levels - 2)

    def back(j, choice):
      return choice[j], choice[j]

    last = vma.vary_like(jnp.int32(bins), choices)
    _, chosen = jax.lax.scan(back, last, choices, reverse=True)
    ends = jnp.array([0, bins], jnp.int32)
    index = jnp.concatenate([ends[:1], chosen, ends[1:]])
    # The ends are exactly the extremes, so every coordinate has two neighbours.
    return (lo + edges[index]).at[0].set(lo).at[-1].set(hi)

  def encode(x, state, key):
    flat = _flat32(x)
    pts = points(flat)
    k = jnp.clip(jnp.searchsorted(pts, flat, side="right") - 1, 0, levels - 2)
    a, b = pts[k], pts[k + 1]
    p = jnp.where(b > a, (flat - a) / jnp.where(b > a, b - a, 1.0), 0.0)
    up = _uniform(key, flat.shape[0], "adaptive_levels") < jnp.clip(p, 0.0, 1.0)
    codes = (k + up).astype(jnp.uint32)
    return {"levels": pts, "codes": kernels.pack_bits(codes, width)}, state

  def decode(payload, state, like):
    codes = kernels.unpack_bits(payload["codes"], width, base.leaf_size(like.shape))
    return _out(_lookup(payload["levels"], codes), like)

  def payload_bits(shape, dtype):
    return 32 * levels + _words_bits(base.leaf_size(shape), width)

  return base.Compressor(
      name=f"adaptive_levels(levels={levels})", init=base.stateless_init, encode=encode,
      decode=decode, payload_bits=payload_bits,
      # No worse than points every ⌈bins/(levels−1)⌉ bins over a range ≤ 2·max|x|.
      error_kind="unbiased",
      error_bound=lambda shape: base.leaf_size(shape) * (
          math.ceil(bins / (levels - 1)) / bins) ** 2)


register("terngrad", terngrad, {"clip": 2.5}, variants=({"clip": None},))
register("qsgd", qsgd, {"levels": 7, "bucket_size": 512}, variants=({"levels": 1},))
register("natural", natural)
register("int_quant", int_quant, {"bits": 8, "block_size": 256, "rounding": "stochastic"},
         variants=({"bits": 4, "rounding": "nearest"},))
register("adaptive_levels", adaptive_levels, {"levels": 16})
