"""ATOMO: its probabilities, unbiasedness and variance by Monte Carlo, and its bytes.

Monte-Carlo tolerances. With ``N`` independent decodes ``D_k`` of ``M`` and
total variance ``V = E‖D − M‖²_F``, ``N‖mean − M‖²/V`` is (by the CLT) a
weighted sum of χ²₁ variables whose weights sum to 1, and such a sum exceeds
``c² = 16`` no more often than a single χ²₁ does (Székely and Bakirov, 2003):
``P ≈ 6e-5``. So unbiasedness is asserted as ``‖mean − M‖_F ≤ 4 sqrt(V/N)``.
Variances are asserted within 4 standard errors of the mean squared error.
Every draw comes from fixed keys, so each test is deterministic.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import commopt
from commopt import wire
from commopt.compressors._atomo import atomo_probabilities

N = 4000
C_SIGMA = 4.0
# The paper's bound holds with equality here: 2·3/12.5 < 1, nothing is capped.
FLAT = np.array([3.0, 2.5, 2.0, 1.5, 1.2, 1.0, 0.8, 0.5])
# At s = 3 the two largest are capped at p = 1.
STEEP = np.array([10.0, 4.0, 1.0, 1.0, 0.5, 0.5, 0.2, 0.1])


def matrix(sigma, n=12, seed=0):
  """``U diag(σ) Vᵀ`` for random orthonormal ``U`` [n, r] and ``V`` [r, r]."""
  rng = np.random.default_rng(seed)
  r = sigma.size
  u, _ = np.linalg.qr(rng.normal(size=(n, r)))
  v, _ = np.linalg.qr(rng.normal(size=(r, r)))
  return (u * sigma) @ v.T


def paper_probabilities(sigma, s):
  """The paper's Algorithm 2: ``p ∝ σ`` summing to ``s``, re-normalised until nothing caps."""
  p = np.zeros_like(sigma)
  active, left = sigma > 0, float(s)
  while active.any() and left > 0:
    q = left * sigma / sigma[active].sum()
    over = active & (q >= 1.0)
    if not over.any():
      p[active] = q[active]
      break
    p[over] = 1.0
    active &= ~over
    left -= over.sum()
  return p


def exact_variance(sigma, p):
  """``E‖D − M‖²_F = Σ σ²/p − Σ σ²`` for draws with marginals ``p`` of orthonormal atoms."""
  return float(np.sum(sigma**2 / p) - np.sum(sigma**2))


def decodes(compressor, m, seed=1):
  """``N`` decodes of ``m`` under independent keys, float64 [N, n, m]."""
  x = jnp.asarray(m, jnp.float32)
  keys = jax.random.split(jax.random.key(seed), N)
  run = jax.jit(jax.vmap(lambda k: compressor.decode(compressor.encode(x, None, k)[0], None, x)))
  return np.asarray(run(keys), np.float64)


def test_probabilities_sum_to_the_budget_in_0_1_and_match_the_papers_algorithm():
  rng = np.random.default_rng(0)
  probabilities = jax.jit(atomo_probabilities)
  cases = [(FLAT, 2.0), (STEEP, 3.0), (STEEP, 1.0), (np.ones(6), 2.5),
           (np.array([5.0, 5.0, 1.0, 0.0, 0.0]), 2.0), (np.array([3.0, 0.0, 0.0]), 2.0)]
  cases += [(np.sort(rng.exponential(size=20))[::-1] ** 3, s) for s in (1.0, 3.5, 7.0, 19.0)]
  for sigma, s in cases:
    p = np.asarray(probabilities(jnp.asarray(sigma, jnp.float32), s), np.float64)
    nonzero = sigma > 0
    np.testing.assert_allclose(p, paper_probabilities(sigma, s), rtol=1e-5, atol=1e-7)
    assert np.all((p[nonzero] > 0) & (p[nonzero] <= 1)) and np.all(p[~nonzero] == 0)
    np.testing.assert_allclose(p.sum(), min(s, nonzero.sum()), rtol=1e-5)
    # Optimal: no feasible move (towards uniform, or any random feasible p) lowers Σσ²/p.
    best = exact_variance(sigma[nonzero], p[nonzero])
    k = int(nonzero.sum())
    for _ in range(20):
      q = rng.dirichlet(np.ones(k)) * min(s, k)
      if np.all(q <= 1):
        for t in (0.05, 0.5, 1.0):
          assert exact_variance(sigma[nonzero], (1 - t) * p[nonzero] + t * q) >= best * (1 - 1e-6)


@pytest.mark.parametrize("sampling,capacity,sigma,s", [
    ("systematic", 2.0, FLAT, 2.0),
    ("systematic", 2.0, STEEP, 3.0),
    ("systematic", 2.0, FLAT, 1.5),
    ("independent", 4.0, FLAT, 2.0),     # 8 slots = r: no overflow
    ("independent", 3.0, STEEP, 3.0),    # 8 slots = r
])
def test_unbiased_with_the_exact_variance(sampling, capacity, sigma, s):
  m = matrix(sigma)
  c = commopt.compressors.atomo(s, sampling=sampling, capacity=capacity)
  d = decodes(c, m)
  p = paper_probabilities(sigma, s)
  variance = exact_variance(sigma, p)
  # Unbiased: the mean of N decodes is within 4 sqrt(V/N) of M ...
  tol = C_SIGMA * np.sqrt(variance / N)
  assert np.linalg.norm(d.mean(0) - m) <= tol
  # ... a tolerance that would catch sending σ_i instead of σ_i/p_i, by far.
  assert np.sqrt(np.sum(sigma**2 * (1 - p) ** 2)) > 5 * tol
  # The variance is Σσ²/p − ‖M‖², within 4 standard errors of the Monte-Carlo mean.
  err = np.sum((d - m) ** 2, axis=(1, 2))
  assert abs(err.mean() - variance) <= C_SIGMA * err.std() / np.sqrt(N)
  # The paper's bound (Σσ)²/s − ‖M‖²_F, an equality when nothing is capped.
  paper = sigma.sum() ** 2 / s - np.sum(sigma**2)
  if np.all(p < 1):
    np.testing.assert_allclose(variance, paper, rtol=1e-12)
  else:
    assert variance >= paper and variance < exact_variance(sigma, np.full(8, s / 8))


def test_systematic_sends_floor_or_ceil_of_the_budget_and_capped_triples_always():
  sigma = STEEP
  m = matrix(sigma)
  x = jnp.asarray(m, jnp.float32)
  for s, counts in ((3.0, {3}), (2.5, {2, 3})):
    c = commopt.compressors.atomo(s)
    keys = jax.random.split(jax.random.key(2), 500)
    v = np.asarray(jax.jit(jax.vmap(lambda k: c.encode(x, None, k)[0]["v"]))(keys))
    assert v.shape == (500, 8, 3)
    sent = np.any(v != 0, axis=1).sum(1)
    assert set(sent.tolist()) == counts
    # The triples with p = 1 (σ₁, σ₂ at s = 3; σ₁ alone at s = 2.5) are in every payload.
    capped = paper_probabilities(sigma, s) == 1.0
    assert capped.sum() == {3.0: 2, 2.5: 1}[s]
    _, _, vt = np.linalg.svd(m)
    for top in vt[capped]:
      assert np.all(np.abs(np.einsum("kmc,m->kc", v, top)).max(1) > 0.999)


def test_independent_overflow_is_rescaled_and_stays_unbiased():
  # capacity 1 gives C = 2 slots for s = 2 of 8 uncapped triples: K > 2 a third of the time.
  m = matrix(FLAT)
  d = decodes(commopt.compressors.atomo(2.0, sampling="independent", capacity=1.0), m, seed=3)
  err = np.sum((d - m) ** 2, axis=(1, 2))
  variance = err.mean()
  assert np.linalg.norm(d.mean(0) - m) <= C_SIGMA * np.sqrt(variance / N)
  # Overflow adds variance on top of independent sampling's Σσ²/p − ‖M‖².
  no_overflow = exact_variance(FLAT, paper_probabilities(FLAT, 2.0))
  assert variance - C_SIGMA * err.std() / np.sqrt(N) > no_overflow


def test_exact_when_the_budget_covers_the_rank():
  m = matrix(STEEP)
  for sampling in ("systematic", "independent"):
    c = commopt.compressors.atomo(20, sampling=sampling)
    x = jnp.asarray(m, jnp.float32)
    payload, _ = jax.jit(c.encode)(x, None, jax.random.key(0))
    assert payload["u"].shape == (12, 8)   # s and C are clipped to r = 8
    np.testing.assert_allclose(c.decode(payload, None, x), m, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_payload_is_slots_times_n_plus_m_values(dtype):
  bits = np.dtype(dtype).itemsize * 8
  conv = (3, 3, 16, 32)   # "last": [144, 32]; "first": [3, 1536]
  for c, n, m, slots in ((commopt.compressors.atomo(2), 144, 32, 2),
                         (commopt.compressors.atomo(2.5), 144, 32, 3),
                         (commopt.compressors.atomo(2.5, sampling="independent"), 144, 32, 5),
                         (commopt.compressors.atomo(2, sampling="independent", capacity=1.5),
                          144, 32, 3),
                         (commopt.compressors.atomo(4, view="first"), 3, 1536, 3)):
    assert c.payload_bits(conv, dtype) == slots * (n + m) * bits
    x = jax.ShapeDtypeStruct(conv, dtype)
    payload, _ = jax.eval_shape(c.encode, x, None, jax.random.key(0))
    assert payload["u"].shape == (n, slots) and payload["v"].shape == (m, slots)
    assert all(a.dtype == dtype for a in payload.values())
    assert sum(a.size * a.dtype.itemsize * 8 for a in payload.values()) == c.payload_bits(
        conv, dtype)


def test_vectors_and_incompressible_matrices_go_dense():
  c = commopt.compressors.atomo(2)
  assert not c.accepts((512,), jnp.float32)
  assert not c.accepts((4, 4), jnp.float32)     # 16 < 2 · 2 · 8
  assert c.accepts((64, 48), jnp.float32)
  assert commopt.compressors.atomo(2, min_compression_rate=0).accepts((4, 4), jnp.float32)


def test_compiled_compressed_mean_moves_the_payload_not_the_leaf(mesh):
  c = commopt.compressors.atomo(2)
  params = {"w": jnp.zeros((64, 48))}
  sm = commopt.testing.shard_map_workers(commopt.compressed_mean(c, axis_name="data", min_size=0),
                                         mesh, "data")
  u = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(8, 64, 48)), jnp.float32)}
  collectives = wire.hlo_collectives(sm.update, u, sm.init(params))
  payload = 2 * (64 + 48) * 4
  assert c.payload_bits((64, 48), jnp.float32) == 8 * payload
  assert wire.total_bytes(collectives) == payload == wire.payload_bytes(
      c, params, min_size=0).total
  # Each worker's u [64, 2] and v [48, 2] are gathered from the 8 workers; the
  # dense leaf (64·48 floats per worker) crosses in no collective.
  gathered = sorted(shape for col in collectives for shape in col.shapes)
  assert gathered == [(8, 48, 2), (8, 64, 2)]
  assert {col.kind for col in collectives} == {"all-gather"}


@pytest.mark.parametrize("kwargs,name", [
    ({"budget": 0}, "budget"), ({"budget": -1.0}, "budget"), ({"budget": "two"}, "budget"),
    ({"budget": float("inf")}, "budget"), ({"budget": 2, "sampling": "poisson"}, "sampling"),
    ({"budget": 2, "capacity": 0.5}, "capacity"), ({"budget": 2, "view": "middle"}, "view"),
    ({"budget": 2, "min_compression_rate": -1}, "min_compression_rate"),
])
def test_bad_arguments_name_the_argument(kwargs, name):
  with pytest.raises(ValueError, match=f"atomo: `{name}`"):
    commopt.compressors.atomo(**kwargs)


def test_a_view_that_loses_elements_is_refused_by_name():
  c = commopt.compressors.atomo(2, view=lambda shape: (shape[0], shape[1] - 1))
  with pytest.raises(ValueError, match="atomo: `view`"):
    c.payload_bits((8, 8), jnp.float32)
