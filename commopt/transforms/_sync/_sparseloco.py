"""SparseLoCo: DiLoCo whose pseudo-gradients travel as chunked top-k in 2 bits, with decaying
error feedback in place of the outer momentum."""

from __future__ import annotations

from typing import Optional

import optax

from commopt.compressors import chunk_top_k
from commopt.transforms._compressed_mean import DEFAULT_MIN_SIZE
from commopt.transforms._sync._diloco import diloco


def sparseloco(inner: optax.GradientTransformation,
               outer: Optional[optax.GradientTransformation] = None, *, axis_name, period: int,
               k: int = 64, chunk: int = 64, bits: Optional[int] = 2, decay: float = 0.95,
               strategy: str = "auto", warmup_steps: int = 0, min_size: int = DEFAULT_MIN_SIZE,
               seed: int = 0) -> optax.GradientTransformationExtraArgs:
  """SparseLoCo: ``period`` inner steps, then a sparse, 2-bit, error-fed outer exchange.

  :func:`diloco` with the exchange SparseLoCo sends (Sarfi et al., 2025).
  Per worker, with ``Δᵢ = θ − θᵢ`` its pseudo-gradient::

    eᵢ ← β·eᵢ + Δᵢ                  decaying error feedback (β = ``decay``)
    sᵢ = Q(TopK(eᵢ));  eᵢ ← eᵢ − sᵢ   k per chunk × chunk tile, ``bits``-bit values
    θ ← θ + outer(mean_i sᵢ)         ``optax.sgd(1.0)`` by default: θ ← θ − mean sᵢ

  The decaying residual takes the place of DiLoCo's outer momentum, so the
  default outer step is plain SGD at learning rate 1; pass
  ``outer=optax.sgd(0.7, momentum=0.9, nesterov=True)`` for the outer
  Nesterov step of DiLoCo on top of it. With the defaults (``k = 64`` of
  every 64 × 64 tile, 1.6% of the entries, each sent as a 2-bit code and a
  12-bit index, and a bfloat16 table of two magnitudes per tile) a worker
  puts about 140× fewer bytes into each exchange than a float32
  pseudo-gradient (:func:`commopt.wire.comm_plan` states it for a model).
  The payloads are all-gathered (``strategy="auto"``): every worker selects
  its own coordinates, as in the paper, so they do not sum before decoding;
  ``strategy="two_phase"`` keeps the bytes per worker flat in the number of
  workers at the price of a second error memory.

  Args:
    inner: the workers' optimizer (AdamW in the paper; ``optax.contrib.muon``
      gives MuLoCo's configuration, see the guide).
    outer: the anchor's optimizer; None for ``optax.sgd(1.0)``.
    axis_name: the data axis.
    period: inner steps between exchanges (H; the paper sweeps 15 to 250).
    k: entries kept per tile (the paper's density 1–3%: 41 to 123 of 4096).
    chunk: the tile's side (64: tiles of 4096 entries).
    bits: bits per kept value (sign and magnitude bin, see
      :func:`~commopt.compressors.chunk_top_k`), or None for float values.
    decay: β of the error feedback, in [0, 1].
    strategy: :func:`~commopt.compressed_mean`'s reduction.
    warmup_steps: as in :func:`diloco`.
    min_size: leaves with fewer elements are exchanged dense.
    seed: the exchange's base key.

  Returns:
    :func:`diloco`'s transform (state :class:`~commopt.transforms.PeriodicState`).

  Examples:
    >>> import optax, commopt
    >>> tx = commopt.transforms.sparseloco(optax.adamw(1e-3), axis_name="data", period=30)

  References:
    Sarfi et al., Communication Efficient LLM Pre-training with SparseLoCo,
    2025, arXiv:2508.15706.
    Douillard et al., DiLoCo: Distributed Low-Communication Training of
    Language Models, 2023.
  """
  return diloco(inner, optax.sgd(1.0) if outer is None else outer, axis_name=axis_name,
                period=period, compressor=chunk_top_k(k, chunk=chunk, bits=bits),
                error_feedback=True, strategy=strategy, warmup_steps=warmup_steps,
                min_size=min_size, seed=seed, residual_decay=decay)
