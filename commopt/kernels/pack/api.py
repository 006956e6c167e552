"""The packing ops: bit packing, fused sign + scale + pack, stochastic quantise + pack.

Each op checks its arguments, then runs :mod:`commopt.kernels.pack.reference`
or :mod:`commopt.kernels.pack.pallas` as ``implementation`` (or the innermost
:func:`commopt.kernels.implementation` scope) says. The Pallas kernels handle
1, 2, 4 and 8 bits per code and give bit-identical outputs to the
references, the per-block sums of :func:`sign_pack` included: both add each
block's magnitudes in the order of :func:`~commopt.kernels.pairwise_sum`.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from commopt._src import base
from commopt._src import bits as bitops
from commopt.kernels import _dispatch as dispatch
from commopt.kernels.pack import pallas as kernel
from commopt.kernels.pack import reference

_U32 = jnp.uint32
_F32 = jnp.float32
BLOCK = 8192
"""Default codes per Pallas program (a power of two)."""


def _flat(x: jax.Array, fn: str, name: str = "x") -> jax.Array:
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise ValueError(f"{fn}: `{name}` must be an array, got {type(x).__name__}.")
  return jnp.reshape(x, (-1,))


def _check_float(x, fn: str) -> None:
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{fn}: `x` must be a floating-point array, got dtype {x.dtype}.")


def pack_bits(codes: jax.Array, bits: int, *, implementation: Optional[str] = None,
              interpret: Optional[bool] = None, block: int = BLOCK) -> jax.Array:
  """Packs unsigned codes below ``2**bits`` into uint32 words (bit-identical to ``bits.pack``).

  Args:
    codes: an array of non-negative integers (or booleans) below ``2**bits``;
      it is flattened.
    bits: the code width, 1 to 32 (the Pallas kernel handles 1, 2, 4 and 8;
      ``"auto"`` uses the reference for the others).
    implementation: ``"auto"``, ``"xla"``, ``"pallas"``, or ``None`` for the
      innermost :func:`~commopt.kernels.implementation` scope's (``"auto"``
      outside any).
    interpret: run the Pallas kernel through the Pallas interpreter (any
      backend); ``None`` takes the scope's (``False`` outside any).
    block: codes per Pallas program, a power of two >= 32.

  Returns:
    ``⌈n·bits/32⌉`` uint32 words; padding bits are zero.

  Examples:
    >>> import jax.numpy as jnp
    >>> from commopt.kernels import pack_bits
    >>> pack_bits(jnp.array([1, 0, 3, 2]), 2).tolist()
    [177]
    >>> pack_bits(jnp.array([1, 0, 3, 2]), 2, implementation="pallas", interpret=True).tolist()
    [177]
  """
  flat = _flat(codes, "pack_bits", "codes")
  bits = bitops._check_bits(bits, "pack_bits")
  block = dispatch.check_block(block, "pack_bits")
  if not (jnp.issubdtype(flat.dtype, jnp.integer) or flat.dtype == jnp.bool_):
    raise ValueError(
        f"pack_bits: `codes` must be an integer or boolean array, got dtype {flat.dtype}.")
  pallas, interpret = dispatch.resolve(implementation, interpret, "pack_bits",
                                       dispatch.check_pallas_bits(bits))
  if not pallas or flat.shape[0] == 0:
    return reference.pack_bits(flat, bits)
  return kernel.pack_bits(flat, bits, block, interpret)


def unpack_bits(words: jax.Array, bits: int, size: int, *,
                implementation: Optional[str] = None, interpret: Optional[bool] = None,
                block: int = BLOCK) -> jax.Array:
  """Inverse of :func:`pack_bits`: the first ``size`` codes, as uint32.

  Args:
    words: 1-D uint32 words from :func:`pack_bits`.
    bits: the code width, 1 to 32 (Pallas: 1, 2, 4 or 8).
    size: number of codes to return (at most ``32·len(words)/bits``).
    implementation: ``"auto"``, ``"xla"``, ``"pallas"``, or ``None`` for the
      innermost :func:`~commopt.kernels.implementation` scope's (``"auto"``
      outside any).
    interpret: run the Pallas kernel through the Pallas interpreter; ``None``
      takes the scope's (``False`` outside any).
    block: codes per Pallas program, a power of two >= 32.

  Returns:
    A uint32 array of ``size`` codes.

  Examples:
    >>> import jax.numpy as jnp
    >>> from commopt.kernels import unpack_bits
    >>> unpack_bits(jnp.array([177], jnp.uint32), 2, 4).tolist()
    [1, 0, 3, 2]
  """
  bits = bitops._check_bits(bits, "unpack_bits")
  block = dispatch.check_block(block, "unpack_bits")
  if getattr(words, "ndim", None) != 1 or words.dtype != _U32:
    raise ValueError(
        f"unpack_bits: `words` must be a 1-D uint32 array, got "
        f"{getattr(words, 'dtype', type(words).__name__)} of shape {getattr(words, 'shape', None)}.")
  if (isinstance(size, bool) or not isinstance(size, int) or size < 0
      or size * bits > 32 * words.shape[0]):
    raise ValueError(
        f"unpack_bits: `size` must be an integer in [0, {32 * words.shape[0] // bits}] "
        f"for {words.shape[0]} words of {bits}-bit codes, got {size!r}.")
  pallas, interpret = dispatch.resolve(implementation, interpret, "unpack_bits",
                                       dispatch.check_pallas_bits(bits))
  if not pallas or size == 0:
    return reference.unpack_bits(words, bits, size)
  return kernel.unpack_bits(words, bits, size, block, interpret)


def sign_bits(x: jax.Array, *, implementation: Optional[str] = None,
              interpret: Optional[bool] = None, block: int = BLOCK) -> jax.Array:
  """One bit per coordinate, set where ``x < 0``, packed 32 to a word in one pass.

  ``-0.0`` and NaN are not negative: their bit is 0 (they decode as ``+``).

  Args:
    x: a floating-point array; it is flattened.
    implementation: ``"auto"``, ``"xla"``, ``"pallas"``, or ``None`` for the
      innermost :func:`~commopt.kernels.implementation` scope's (``"auto"``
      outside any).
    interpret: run the Pallas kernel through the Pallas interpreter; ``None``
      takes the scope's (``False`` outside any).
    block: coordinates per Pallas program, a power of two >= 32.

  Returns:
    ``⌈d/32⌉`` uint32 words, equal to ``bits.pack(x.ravel() < 0, 1)``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from commopt.kernels import sign_bits
    >>> sign_bits(jnp.array([0.5, -3.0, 0.0, -1.0])).tolist()
    [10]
  """
  return sign_pack(x, implementation=implementation, interpret=interpret, block=block,
                   with_scale=False)[1]


def sign_pack(x: jax.Array, block_size: Optional[int] = None, *,
              implementation: Optional[str] = None, interpret: Optional[bool] = None,
              block: int = BLOCK, with_scale: bool = True):
  """Fused sign + scale + pack: each block's mean magnitude and the packed signs.

  The reference is ``scaled_sign``'s encoder: ``scale_b = Σ_{i∈b} |x_i| / |b|``
  in float32 and one bit per coordinate set where ``x < 0`` (``-0.0`` and NaN
  give 0). The kernel reads ``x`` once: every program packs its chunk's signs
  and writes partial sums of ``|x|`` (per chunk, or per largest power of two
  dividing ``block_size``), which are added up per block afterwards. Both
  add each block's magnitudes in the order of :func:`pairwise_sum` over the
  block, so the words and the scales are bit-identical to the reference's,
  whatever ``block``.

  Args:
    x: a floating-point array; it is flattened and read as float32.
    block_size: coordinates per scale; ``None`` gives one scale.
    implementation: ``"auto"``, ``"xla"``, ``"pallas"``, or ``None`` for the
      innermost :func:`~commopt.kernels.implementation` scope's (``"auto"``
      outside any).
    interpret: run the Pallas kernel through the Pallas interpreter; ``None``
      takes the scope's (``False`` outside any).
    block: coordinates per Pallas program, a power of two >= 32.
    with_scale: compute the scales (``False`` returns ``None`` for them).

  Returns:
    ``(scales, words)``: float32 ``[⌈d/block_size⌉]`` (``[1]`` for ``None``)
    and uint32 ``[⌈d/32⌉]``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from commopt.kernels import sign_pack
    >>> scales, words = sign_pack(jnp.array([1.0, -3.0, 2.0]))
    >>> scales.tolist(), words.tolist()
    ([2.0], [2])
  """
  flat = _flat(x, "sign_pack")
  _check_float(flat, "sign_pack")
  block_size = base.check_block_size(block_size, "sign_pack")
  block = dispatch.check_block(block, "sign_pack")
  n = flat.shape[0]
  if n == 0:
    raise ValueError("sign_pack: `x` must have at least one element, got size 0.")
  pallas, interpret = dispatch.resolve(implementation, interpret, "sign_pack")
  segment = reference.segment_size(n, block_size, block) if with_scale else None
  if not pallas:
    return reference.sign_pack(flat, block_size, segment)
  return kernel.sign_pack(flat, block_size, segment, block, interpret)


def sign_feedback(u: jax.Array, e: jax.Array, block_size: Optional[int] = None, *,
                  implementation: Optional[str] = None, interpret: Optional[bool] = None,
                  block: int = BLOCK):
  """Error feedback fused with ``scaled_sign``'s encoding: ``p = u + e``, its payload, ``p − decode``.

  The reference runs the separate steps (``p = u + e``; :func:`sign_pack` of
  ``p``; ``e′ = p − scale·(±1)``). The kernel reads ``u`` and ``e`` once and
  writes the words, the scales and ``e′`` when every scale block lies inside one
  program's chunk (``block_size`` a power of two from 32 to ``block``, and
  smaller than the leaf); otherwise (one scale, or other block sizes) one kernel
  writes the words and partial sums and one fused pass writes ``e′``. Both give
  the reference's bits.

  Args:
    u: the float32 update; it is flattened.
    e: the float32 error-feedback residual, with ``u``'s number of elements.
    block_size: coordinates per scale; ``None`` gives one scale.
    implementation: ``"auto"``, ``"xla"``, ``"pallas"``, or ``None`` for the
      innermost :func:`~commopt.kernels.implementation` scope's (``"auto"``
      outside any).
    interpret: run the Pallas kernel through the Pallas interpreter; ``None``
      takes the scope's (``False`` outside any).
    block: coordinates per Pallas program, a power of two >= 32.

  Returns:
    ``(scales, words, e′)``: float32 ``[⌈d/block_size⌉]`` (``[1]`` for
    ``None``), uint32 ``[⌈d/32⌉]`` and float32 ``[d]``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from commopt.kernels import sign_feedback
    >>> scales, words, e = sign_feedback(jnp.array([1.0, -3.0, 2.0]), jnp.array([0.5, 0.0, -0.5]))
    >>> scales.tolist(), words.tolist(), e.tolist()
    ([2.0], [2], [-0.5, -1.0, -0.5])
  """
  fn = "sign_feedback"
  flat, res = _flat(u, fn, "u"), _flat(e, fn, "e")
  for name, v in (("u", flat), ("e", res)):
    if v.dtype != _F32:
      raise ValueError(f"{fn}: `{name}` must be float32, got dtype {v.dtype}.")
  if flat.shape != res.shape or flat.shape[0] == 0:
    raise ValueError(f"{fn}: `u` and `e` must have the same, non-zero number of elements, got "
                     f"{flat.shape[0]} and {res.shape[0]}.")
  block_size = base.check_block_size(block_size, fn)
  block = dispatch.check_block(block, fn)
  n = flat.shape[0]
  pallas, interpret = dispatch.resolve(implementation, interpret, fn)
  if not pallas:
    return reference.sign_feedback(flat, res, block_size,
                                   reference.segment_size(n, block_size, block))
  return kernel.sign_feedback(flat, res, block_size, block, interpret)


def quantize_pack(x: jax.Array, random_bits: jax.Array, levels: int, scales: jax.Array, *,
                  block_size: Optional[int] = None, style: str = "qsgd",
                  implementation: Optional[str] = None, interpret: Optional[bool] = None,
                  block: int = BLOCK) -> jax.Array:
  """Stochastic rounding to levels of per-block scales, packed, in one pass.

  With ``u = uniform_from_bits(random_bits)`` and ``p = |x|/scale`` (0 where
  the block's scale is 0):

  - ``style="qsgd"``: ``l = min(⌊p·levels + u⌋, levels)`` and code
    ``levels + sign(x)·l`` in ``⌈log₂(2·levels+1)⌉`` bits (QSGD, int
    quantisation).
  - ``style="terngrad"`` (``levels=1``): code 1 (``x ≥ 0``) or 2 (``x < 0``)
    where ``u < p``, else 0, in 2 bits (TernGrad).

  The random bits are drawn outside (``jax.random.bits(key, (d,), jnp.uint32)``)
  so both implementations give bit-identical words. NaN inputs (or NaN
  scales) give the code of level 0 (``levels`` for QSGD, 0 for TernGrad).

  Args:
    x: a floating-point array; it is flattened and read as float32.
    random_bits: uint32 array with ``x``'s number of elements.
    levels: positive levels ``s`` (>= 1; 1 for ``"terngrad"``).
    scales: float32 ``[⌈d/block_size⌉]`` (``[1]`` for ``None``): the norm or
      maximum each block is quantised against.
    block_size: coordinates per scale; ``None`` gives one scale.
    style: ``"qsgd"`` or ``"terngrad"``.
    implementation: ``"auto"``, ``"xla"``, ``"pallas"``, or ``None`` for the
      innermost :func:`~commopt.kernels.implementation` scope's (Pallas packs
      1, 2, 4 or 8-bit codes; ``"auto"`` uses the reference for other widths).
    interpret: run the Pallas kernel through the Pallas interpreter; ``None``
      takes the scope's (``False`` outside any).
    block: coordinates per Pallas program, a power of two >= 32.

  Returns:
    The packed codes, ``⌈d·bits/32⌉`` uint32 words.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from commopt.kernels import quantize_pack, unpack_bits
    >>> x = jnp.array([3.0, -4.0, 0.0])
    >>> r = jax.random.bits(jax.random.key(0), (3,), jnp.uint32)
    >>> words = quantize_pack(x, r, 1, jnp.linalg.norm(x)[None])
    >>> unpack_bits(words, 2, 3).tolist()[2]     # level 0 is code `levels`
    1
  """
  flat = _flat(x, "quantize_pack")
  _check_float(flat, "quantize_pack")
  n = flat.shape[0]
  if style not in reference.STYLES:
    raise ValueError(
        f"quantize_pack: `style` must be one of {reference.STYLES}, got {style!r}.")
  if (isinstance(levels, bool) or not isinstance(levels, int) or levels < 1
      or (style == "terngrad" and levels != 1)):
    valid = "1 for style='terngrad'" if style == "terngrad" else "an integer >= 1"
    raise ValueError(f"quantize_pack: `levels` must be {valid}, got {levels!r}.")
  block_size = base.check_block_size(block_size, "quantize_pack")
  block = dispatch.check_block(block, "quantize_pack")
  rbits = _flat(random_bits, "quantize_pack", "random_bits")
  if rbits.dtype != _U32 or rbits.shape[0] != n:
    raise ValueError(
        f"quantize_pack: `random_bits` must be uint32 with {n} elements (as `x`), got "
        f"{rbits.dtype} with {rbits.shape[0]}.")
  size = base.block_len(n, block_size) if n else 1
  nb = -(-n // size) if n else 0
  scales = jnp.reshape(scales, (-1,)).astype(_F32)
  if scales.shape[0] != nb:
    raise ValueError(
        f"quantize_pack: `scales` must have {nb} entries (one per block of "
        f"{block_size} in {n}), got {scales.shape[0]}.")
  width = 2 if style == "terngrad" else bitops.code_bits(2 * levels + 1)
  if style == "qsgd":   # one multiply per coordinate, as the qsgd compressor does
    scales = jnp.where(scales > 0, levels / jnp.where(scales > 0, scales, 1.0), 0.0)
  pallas, interpret = dispatch.resolve(implementation, interpret, "quantize_pack",
                                       dispatch.check_pallas_bits(width))
  if not pallas or n == 0:
    return reference.quantize_pack(flat, rbits, levels, scales, block_size, style, width)
  return kernel.quantize_pack(flat, rbits, levels, scales, block_size, style, width, block,
                              interpret)
