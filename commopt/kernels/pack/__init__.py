"""Packing ops: codes of 1 to 32 bits in uint32 words, fused sign + scale + pack,
stochastic quantise + pack, error feedback fused with the sign encoding.

- :mod:`~commopt.kernels.pack.reference`: the pure-jnp references and the
  element-wise pieces the kernels share.
- :mod:`~commopt.kernels.pack.pallas`: the Pallas kernels (1, 2, 4, 8 bits).
- :mod:`~commopt.kernels.pack.api`: the public ops, which check their
  arguments and dispatch between the two.
"""

from commopt.kernels.pack.api import (
    BLOCK,
    pack_bits,
    quantize_pack,
    sign_bits,
    sign_feedback,
    sign_pack,
    unpack_bits,
)
from commopt.kernels.pack.reference import (
    STYLES,
    pairwise_sum,
    quantize_codes,
    uniform_from_bits,
)

__all__ = ["BLOCK", "STYLES", "pack_bits", "pairwise_sum", "quantize_codes", "quantize_pack",
           "sign_bits", "sign_feedback", "sign_pack", "uniform_from_bits", "unpack_bits"]
