"""Low-rank compression by sparsifying the singular value decomposition: ATOMO."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from commopt import kernels
from commopt._src import base
from commopt.compressors._lowrank import View, _check_view, _far_scales, _matrix_shape
from commopt.compressors._qcommon import _uniform
from commopt.compressors._registry import register

SAMPLINGS = ("systematic", "independent")
"""How :func:`atomo` draws the singular triples it sends."""

_F32 = jnp.float32


def atomo_probabilities(sigma: jax.Array, budget) -> jax.Array:
  """ATOMO's keep probabilities: ``p_i = min(1, λ σ_i)`` with ``Σ p_i = budget``.

  They minimise the variance ``Σ σ_i² / p_i`` of the unbiased estimate
  ``Σ_{i kept} (σ_i / p_i) u_i v_iᵀ`` over ``0 < p_i ≤ 1``, ``Σ p_i = s``.
  The largest ``k`` singular values are capped at 1 and the rest share
  ``s − k`` in proportion to ``σ_i``: ``λ = (s − k) / Σ_{i ≥ k} σ_i``. The
  paper finds ``k`` by re-normalising until nothing new caps (Algorithm 2);
  here ``k`` is computed at once, as the first index ``j`` with
  ``(s − j) σ_j ≤ Σ_{i ≥ j} σ_i``, which gives the same probabilities.
  Zero singular values get ``p = 0`` (they are never sent and carry nothing),
  so the sum falls short of ``s`` only when fewer than ``s`` are non-zero
  (then every non-zero one has ``p = 1``).

  Args:
    sigma: singular values ``[r]``, non-negative and non-increasing (as
      ``jnp.linalg.svd`` returns them).
    budget: ``s``, the expected number of triples kept, in ``(0, r]``.

  Returns:
    ``p`` ``[r]``, float32.

  Examples:
    >>> import jax.numpy as jnp
    >>> from commopt.compressors._atomo import atomo_probabilities
    >>> atomo_probabilities(jnp.array([4.0, 2.0, 1.0, 1.0]), 2.0).tolist()
    [1.0, 0.5, 0.25, 0.25]
  """
  sigma = sigma.astype(_F32)
  r = sigma.shape[0]
  tail = jnp.cumsum(sigma[::-1])[::-1]                      # Σ_{i ≥ j} σ_i
  j = jnp.arange(r)
  fits = (tail <= 0) | ((budget - j.astype(_F32)) * sigma <= tail)
  capped = jnp.argmax(jnp.append(fits, True))              # k: how many get p = 1
  rest = jnp.append(tail, 0.0)[capped]
  lam = jnp.where(rest > 0, (budget - capped.astype(_F32)) / jnp.where(rest > 0, rest, 1.0), 0.0)
  return jnp.where(j < capped, 1.0, jnp.minimum(1.0, lam * sigma))


def _systematic(p: jax.Array, key, slots: int) -> jax.Array:
  """Indices of a systematic sample with inclusion probabilities ``p`` (``Σ p ≤ slots``).

  One uniform ``U ∈ (0, 1]`` places the points ``U, U + 1, U + 2, …`` on the
  line cut into consecutive intervals of lengths ``p_i``; triple ``i`` is
  drawn when a point falls into its interval, so with probability exactly
  ``p_i``, and ``⌊Σp⌋`` or ``⌈Σp⌉`` are drawn in all. Empty slots hold ``r``.
  """
  c = jnp.cumsum(p)
  prev = jnp.concatenate([jnp.zeros((1,), _F32), c[:-1]])
  u = 1.0 - _uniform(key, 1, "atomo")[0]
  # Float rounding of the cumulative sum could add one draw past ⌈Σp⌉ with
  # probability ~1e-7; the slot count then truncates it.
  return kernels.first_true(jnp.floor(c - u) > jnp.floor(prev - u), slots)


def _independent(p: jax.Array, key, slots: int) -> tuple[jax.Array, jax.Array]:
  """Indices of independent Bernoulli(``p_i``) draws, at most ``slots``, and their rescaling.

  When ``K > slots`` triples are drawn, a uniformly random ``slots`` of them
  are sent, each scaled by ``K / slots``: given the draws the subsample is
  unbiased, so the whole estimate stays unbiased (with more variance).
  """
  r = p.shape[0]
  draws = _uniform(key, 2 * r, "atomo")
  kept = draws[:r] < p
  count = jnp.sum(kept).astype(_F32)
  # Drawn triples first, in a random order; the first `slots` are sent.
  order = jnp.argsort(jnp.where(kept, draws[r:], 2.0))[:slots]
  indices = jnp.where(kept[order], order, r).astype(jnp.int32)
  return indices, jnp.maximum(1.0, count / slots)


class _Options(NamedTuple):
  """:func:`atomo`'s options, checked (:func:`_options`)."""
  budget: float
  sampling: str
  capacity: float
  view: View
  min_compression_rate: float


def _options(budget, sampling, capacity, view, min_compression_rate) -> _Options:
  """:func:`atomo`'s arguments, each checked (its errors name ``atomo``)."""
  budget = base.check_number("budget", budget, fn="atomo", low=0.0,
                             what="a finite number > 0")
  base.check_choice("sampling", sampling, SAMPLINGS, "atomo")
  capacity = base.check_number("capacity", capacity, fn="atomo", low=1.0, low_open=False,
                               what="a finite number >= 1")
  view = _check_view(view, "atomo")
  min_compression_rate = base.check_number(
      "min_compression_rate", min_compression_rate, fn="atomo", low=0.0, low_open=False,
      what="a finite number >= 0")
  return _Options(budget, sampling, capacity, view, min_compression_rate)


def _dims(opts: _Options, shape) -> tuple[int, int, float, int]:
  """``(n, m, s, C)``: the matrix view, the leaf's budget and its slots."""
  if len(shape) < 2:   # chunked strategies hand over 1-D pieces: one row
    n, m = 1, base.leaf_size(shape)
  else:
    n, m = _matrix_shape(shape, opts.view, "atomo")
  r = min(n, m)
  s = min(opts.budget, float(r))
  per = 1.0 if opts.sampling == "systematic" else opts.capacity
  return n, m, s, min(r, math.ceil(round(per * s, 6)))


def _accepts(opts: _Options, shape, dtype) -> bool:
  """Whether a leaf is compressed: a matrix compressing at least ``min_compression_rate``."""
  if len(shape) < 2:
    return False
  n, m, _, slots = _dims(opts, shape)
  return n * m >= opts.min_compression_rate * slots * (n + m)


def _error_bound(opts: _Options, shape) -> float:
  """ω: ``Σσ_i²/p_i − ‖M‖² ≤ (Σσ_i)²/s − ‖M‖² ≤ (r/s − 1)‖M‖²``."""
  n, m, s, _ = _dims(opts, shape)
  return min(n, m) / s - 1.0


def _encode(opts: _Options, x, state, key):
  """The drawn triples as ``{"u": [n, C], "v": [m, C]}`` in ``x``'s dtype (``σ_i / p_i``
  folded into ``u``), and the state as it was."""
  key = base.need_key(key, "atomo")
  n, m, s, slots = _dims(opts, x.shape)
  mat = x.reshape(n, m).astype(_F32)
  # A matrix of extreme magnitude is decomposed scaled by a power of two
  # (exact), so the SVD squares nothing out of range; the probabilities
  # do not depend on the scale, and σ is scaled back into the payload.
  down, up = _far_scales(jnp.max(jnp.abs(mat)))
  u, sigma, vt = jnp.linalg.svd(mat * down, full_matrices=False)
  p = atomo_probabilities(sigma, s)
  if opts.sampling == "systematic":
    indices, factor = _systematic(p, key, slots), 1.0
  else:
    indices, factor = _independent(p, key, slots)
  sent = indices < sigma.shape[0]
  safe = jnp.where(sent, indices, 0)
  p_sent = p[safe]
  scale = jnp.where(sent & (p_sent > 0), sigma[safe] / jnp.where(p_sent > 0, p_sent, 1.0), 0.0)
  payload = {"u": (u[:, safe] * (scale * factor) * up).astype(x.dtype),
             "v": jnp.where(sent, vt[safe, :].T, 0.0).astype(x.dtype)}
  return payload, state


def _decode(payload, state, like) -> jax.Array:
  """``u vᵀ`` with ``like``'s shape and dtype."""
  mat = payload["u"].astype(_F32) @ payload["v"].astype(_F32).T
  return mat.reshape(like.shape).astype(like.dtype)


def _payload_bits(opts: _Options, shape, dtype) -> int:
  """``C (n + m)`` values of the leaf's dtype."""
  n, m, _, slots = _dims(opts, shape)
  return slots * (n + m) * base.dtype_bits(dtype)


def atomo(budget: float, *, sampling: str = "systematic", capacity: float = 2.0,
          view: View = "last", min_compression_rate: float = 2.0) -> base.Compressor:
  """ATOMO: an unbiased random sparsification of each leaf's singular value decomposition.

  A leaf is viewed as a matrix ``M`` [n, m] (``view`` as in
  :func:`~commopt.power_sgd`: ``"last"`` gives ``[prod(shape[:-1]),
  shape[-1]]``) and decomposed, ``M = Σ_i σ_i u_i v_iᵀ`` (float32
  ``jnp.linalg.svd``, ``r = min(n, m)`` triples). Triple ``i`` is sent with
  probability ``p_i`` (:func:`atomo_probabilities`: ``p_i = min(1, λσ_i)``,
  ``Σ p_i = s``, the ``s = budget`` that minimises the variance) as
  ``(σ_i / p_i) u_i`` and ``v_i``, so ``E[decode] = M``. The atoms
  ``u_i v_iᵀ`` are orthonormal, so the variance is exactly::

    E‖decode − M‖²_F = Σ_i σ_i² / p_i − ‖M‖²_F

  which is ``(Σ σ_i)² / s − ‖M‖²_F`` when no ``p_i`` is capped at 1.
  It depends only on the ``p_i``, not on how the draws are correlated,
  which ``sampling`` chooses:

  - ``"systematic"`` (default): one uniform offset picks the triples
    (systematic sampling, :func:`_systematic`), exactly ``⌊s⌋`` or ``⌈s⌉`` of
    them with the same ``p_i``. The payload has ``C = ⌈s⌉`` slots and never
    overflows: unbiased and fixed-size, at the variance above.
  - ``"independent"``: each triple is drawn on its own (the paper's
    Algorithm 1); ``K`` triples, ``E[K] = s``. The payload has
    ``C = ⌈capacity · s⌉`` slots. If ``K > C`` a random ``C`` of them are sent
    scaled by ``K / C``, which keeps it unbiased but adds variance. ``K`` is
    a sum of independent Bernoullis of mean ``s``; for ``s ≥ 1`` and
    ``C ≥ s + 1``, ``P(K > C) ≤ P(Binomial(r, s/r) > C) ≤ P(Poisson(s) > C)``
    (Hoeffding, 1956; Anderson and Samuels, 1967): at ``capacity = 2``, at
    most 8.0% for ``s = 1``, 5.3% for ``s = 2``, 2.1% for ``s = 4``.

  Empty slots are zeros. The payload is ``{"u": [n, C], "v": [m, C]}`` in the
  leaf's dtype, the scale ``σ_i / p_i`` folded into ``u``:
  ``C · (n + m)`` values. ``C`` is at most ``r``; ``s`` is clipped to ``r``
  (then every triple is sent and the leaf arrives exactly). The compressor
  is stateless and non-linear (payloads are gathered).

  Cost: one thin SVD per leaf and step, ``O(n m min(n, m))`` flops and far
  slower per flop than a matrix product (LAPACK on CPU, an iterative solver
  on GPU): the dominant cost for large leaves, where PowerSGD's two matrix
  products are much cheaper. Choose ``view`` so that ``min(n, m)`` is small
  (e.g. a conv kernel's output features), or leave large leaves to another
  compressor.

  Leaves with at most one dimension, or whose compression rate
  ``n m / (C (n + m))`` is below ``min_compression_rate``, are sent dense.

  Args:
    budget: ``s > 0``, the expected number of singular triples sent per leaf.
    sampling: ``"systematic"`` or ``"independent"``, as above.
    capacity: slots per expected triple under ``"independent"`` (≥ 1).
    view: ``"last"``, ``"first"`` or a callable ``shape -> (n, m)``.
    min_compression_rate: leaves compressing less than this go dense (≥ 0).

  Returns:
    A stateless, non-linear, unbiased :class:`~commopt.Compressor`.

  Examples:
    >>> import jax, jax.numpy as jnp, commopt
    >>> c = commopt.compressors.atomo(budget=2)
    >>> m = jnp.outer(jnp.arange(1.0, 5.0), jnp.ones(3))   # rank 1: p = (1, 0, 0)
    >>> payload, _ = c.encode(m, c.init(m), jax.random.key(0))
    >>> {k: v.shape for k, v in payload.items()}            # C = 2 slots
    {'u': (4, 2), 'v': (3, 2)}
    >>> bool(jnp.allclose(c.decode(payload, None, m), m, atol=1e-5))
    True

  References:
    Wang, Sievert, Charles, Liu, Wright and Papailiopoulos, ATOMO:
    Communication-efficient Learning via Atomic Sparsification, NeurIPS 2018.
    Hoeffding, On the Distribution of the Number of Successes in Independent
    Trials, Annals of Mathematical Statistics, 1956.
  """
  opts = _options(budget, sampling, capacity, view, min_compression_rate)
  extra = ("" if opts.sampling == "systematic"
           else f", sampling=independent, capacity={opts.capacity:g}")
  return base.Compressor(
      name=f"atomo(budget={opts.budget:g}{extra})",
      error_kind="unbiased",
      error_bound=functools.partial(_error_bound, opts),
      init=base.stateless_init,
      encode=functools.partial(_encode, opts),
      decode=_decode,
      payload_bits=functools.partial(_payload_bits, opts),
      linear=False,
      accepts=functools.partial(_accepts, opts),
      # Its payload follows the leaf's matrix shape: a flat chunk costs more than dense.
      flat_chunks=False,
  )


register("atomo", atomo, {"budget": 2},
         variants=({"budget": 1.5, "sampling": "independent"},))
