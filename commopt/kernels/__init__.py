"""Pallas kernels for the compressors' hot loops, each beside its pure-jnp reference.

Every op takes ``implementation="auto" | "xla" | "pallas"`` (``"auto"``: the
Pallas kernel on a GPU, the reference elsewhere) and ``interpret`` (run the
Pallas kernel through the Pallas interpreter, on any backend, for tests).
Left out (``None``), both come from the innermost :func:`implementation`
scope, which is how a whole compressor is run on one implementation:

    with commopt.kernels.implementation("pallas", interpret=True):
      payload, state = compressor.encode(x, state, key)

A reference and its kernel run the same element-wise code and add in the same
order, so an op gives the same bits on every implementation and a payload
does not depend on which one encoded it. On GPU the kernels lower through
Triton.

One folder per op family, each with a ``reference.py`` (pure jnp), a
``pallas.py`` (the kernels) and an ``api.py`` (argument checks and dispatch);
the public names are re-exported here:

- :func:`pack_bits` / :func:`unpack_bits`: codes of 1, 2, 4 or 8 bits in uint32
  words (``pack/``).
- :func:`sign_pack` / :func:`sign_bits`: fused sign + scale + pack in one pass
  (``pack/``).
- :func:`sign_feedback`: error feedback fused with ``scaled_sign``'s encoding:
  ``u + e``, its payload and the new residual, one read of ``u`` and ``e`` where
  each scale block fits one program (``pack/``).
- :func:`quantize_pack`: stochastic rounding + pack (QSGD, TernGrad) from
  random bits drawn outside (``pack/``).
- :func:`select_top_k`: magnitude top-k, in index order: on a GPU a sampled
  bound, one pass to count and one to compact, with a radix select behind it
  (``select/``).
- :func:`first_true`: the first ``capacity`` true entries of a mask, the
  compaction behind the threshold and random sparsifiers (``select/``).
- :func:`implementation`: the scope that picks the implementation of the ops
  called without one (``_dispatch.py``, shared by all).
- :func:`info`: which implementation ``"auto"`` runs on this machine, and why.
"""

from commopt.kernels._dispatch import (
    IMPLEMENTATIONS,
    PALLAS_BITS,
    Choice,
    current,
    implementation,
    info,
    use_pallas,
)
from commopt.kernels.pack import (
    pack_bits,
    pairwise_sum,
    quantize_codes,
    quantize_pack,
    sign_bits,
    sign_feedback,
    sign_pack,
    uniform_from_bits,
    unpack_bits,
)
from commopt.kernels.select import first_true, magnitude_key, select_top_k

__all__ = [
    "Choice",
    "IMPLEMENTATIONS",
    "PALLAS_BITS",
    "current",
    "first_true",
    "implementation",
    "info",
    "magnitude_key",
    "pack_bits",
    "pairwise_sum",
    "quantize_codes",
    "quantize_pack",
    "select_top_k",
    "sign_bits",
    "sign_feedback",
    "sign_pack",
    "uniform_from_bits",
    "unpack_bits",
    "use_pallas",
]
