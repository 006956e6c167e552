"""Pallas kernels for the compressors' hot loops, each beside its pure-jnp reference.

Every op takes ``implementation="auto" | "xla" | "pallas"`` (``"auto"``: the
Pallas kernel on a GPU, the reference elsewhere) and ``interpret`` (run the
Pallas kernel through the Pallas interpreter, on any backend, for tests).
On GPU the kernels lower through Triton.

- :func:`pack_bits` / :func:`unpack_bits`: codes of 1, 2, 4 or 8 bits in uint32 words.
- :func:`sign_pack` / :func:`sign_bits`: fused sign + scale + pack in one pass.
- :func:`quantize_pack`: stochastic rounding + pack (QSGD, TernGrad) from
  random bits drawn outside.
- :func:`select_top_k`: magnitude top-k by a radix select, in index order.
"""

from commopt.kernels._dispatch import IMPLEMENTATIONS, PALLAS_BITS, use_pallas
from commopt.kernels._pack import (
    pack_bits,
    quantize_codes,
    quantize_pack,
    sign_bits,
    sign_pack,
    uniform_from_bits,
    unpack_bits,
)
from commopt.kernels._select import magnitude_key, select_top_k

__all__ = [
    "IMPLEMENTATIONS",
    "PALLAS_BITS",
    "magnitude_key",
    "pack_bits",
    "quantize_codes",
    "quantize_pack",
    "select_top_k",
    "sign_bits",
    "sign_pack",
    "uniform_from_bits",
    "unpack_bits",
    "use_pallas",
]
