"""The counter hash behind stochastic rounding: deterministic, and statistically uniform."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import commopt
from commopt._src import rng

N = 1 << 20


def bits(key, n=N):
  return np.asarray(jax.jit(rng.counter_bits, static_argnums=1)(key, n))


def test_deterministic_given_the_key_and_different_across_keys():
  key = jax.random.key(3)
  np.testing.assert_array_equal(bits(key, 1000), bits(key, 1000))
  a, b = bits(jax.random.fold_in(key, 0), 1000), bits(jax.random.fold_in(key, 1), 1000)
  assert np.mean(a == b) < 0.01
  # A prefix of a longer stream is the shorter stream.
  np.testing.assert_array_equal(bits(key, 1000), bits(key, 5000)[:1000])


def test_bytes_are_uniform_chi_square():
  words = bits(jax.random.key(0))
  for shift in (0, 8, 16, 24):
    counts = np.bincount((words >> shift) & 0xFF, minlength=256)
    expected = N / 256
    chi2 = np.sum((counts - expected) ** 2 / expected)
    # 255 degrees of freedom: mean 255, sd 22.6; 6 sd above the mean.
    assert chi2 < 255 + 6 * 22.6, (shift, chi2)


def test_every_bit_is_fair_and_neighbours_are_uncorrelated():
  words = bits(jax.random.key(1))
  ones = np.array([np.mean((words >> b) & 1) for b in range(32)])
  assert np.all(np.abs(ones - 0.5) < 6 * 0.5 / np.sqrt(N)), ones
  u = words.astype(np.float64) / 2**32
  for lag in (1, 2, 32):
    r = np.corrcoef(u[:-lag], u[lag:])[0, 1]
    assert abs(r) < 6 / np.sqrt(N), (lag, r)
  v = bits(jax.random.fold_in(jax.random.key(1), 7)).astype(np.float64) / 2**32
  assert abs(np.corrcoef(u, v)[0, 1]) < 6 / np.sqrt(N)


def test_stochastic_rounding_with_it_is_unbiased():
  """qsgd's decoded mean over many seeds converges to its input."""
  c = commopt.qsgd(levels=3, bucket_size=64)
  x = jnp.asarray(np.random.default_rng(0).normal(size=64), jnp.float32)
  keys = jax.random.split(jax.random.key(5), 4000)
  out = jax.jit(jax.vmap(lambda k: c.decode(c.encode(x, None, k)[0], None, x)))(keys)
  mean = np.asarray(out).mean(0)
  sd = np.asarray(out).std(0) / np.sqrt(len(keys))
  assert np.all(np.abs(mean - np.asarray(x)) < 6 * sd + 1e-6)


@pytest.mark.slow
def test_distinct_indices_are_a_uniform_k_subset():
  for size, k in [(1, 1), (5, 5), (7, 3), (1000, 10), (1 << 20, 10485), (3_000_017, 30_000)]:
    idx = np.asarray(jax.jit(rng.distinct_indices, static_argnums=(1, 2))(
        jax.random.key(size), size, k))
    assert idx.shape == (k,) and np.all(np.diff(idx) > 0), (size, k)   # distinct, ascending
    assert idx[0] >= 0 and idx[-1] < size
  size, k, draws = 100, 10, 20_000
  f = jax.jit(jax.vmap(lambda key: rng.distinct_indices(key, size, k)))
  subsets = np.asarray(f(jax.random.split(jax.random.key(0), draws)))
  counts = np.bincount(subsets.ravel(), minlength=size)
  expected = draws * k / size
  chi2 = np.sum((counts - expected) ** 2 / expected)   # 99 dof: mean 99, sd 14
  assert chi2 < 99 + 6 * 14, chi2
  # Pairs: coordinates 0 and 1 together as often as in a uniform subset.
  both = np.mean(np.any(subsets == 0, 1) & np.any(subsets == 1, 1))
  want = k * (k - 1) / (size * (size - 1))
  assert abs(both - want) < 6 * np.sqrt(want / draws), (both, want)
