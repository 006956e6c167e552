"""Top-k's selection by histograms (the CPU's for large ``k``) and its gathered exchange:
the same coordinates, values and means as the references, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import commopt
from commopt.comm import _strategies
from commopt.kernels.select import histogram, reference
from commopt.kernels.select.reference import magnitude_key

N = 8


def same_selection(x, k):
  want_values, want_indices = reference.select_top_k(x, k, False, 0.95)
  values, indices = histogram.select_top_k(x, k)
  np.testing.assert_array_equal(indices, want_indices)
  np.testing.assert_array_equal(values, want_values)      # NaN == NaN here
  assert values.dtype == x.dtype and indices.dtype == jnp.int32


def leaves(n, seed=0):
  """Leaves of ``n`` coordinates: plain, heavy-tailed by row and by column (a matrix of
  1000 columns), mostly zero, few distinct values, with NaN and ±inf, all equal."""
  rng = np.random.default_rng(seed)
  rows = -(-n // 1000)
  scale_rows = rng.exponential(size=(rows, 1)) ** 3
  scale_cols = rng.exponential(size=(1, 1000)) ** 3
  special = rng.normal(size=n)
  special[rng.random(n) < 0.002] = np.nan
  special[rng.random(n) < 0.002] = np.inf
  special[rng.random(n) < 0.002] = -np.inf
  out = {
      "normal": rng.normal(size=n),
      "rows": (rng.normal(size=(rows, 1000)) * scale_rows).reshape(-1)[:n],
      "columns": (rng.normal(size=(rows, 1000)) * scale_cols).reshape(-1)[:n],
      "sparse": np.where(rng.random(n) < 0.01, rng.normal(size=n), 0.0),
      "ties": np.round(rng.normal(size=n) * 2) / 2 * np.where(rng.random(n) < 0.5, -1, 1),
      "specials": special,
      "equal": -np.ones(n),
  }
  return {name: jnp.asarray(v, jnp.float32) for name, v in out.items()}


@pytest.mark.slow
def test_the_sampled_band_selects_as_the_reference():
  """One leaf past SAMPLE_FROM in the default tier: the sampled band's path (its
  compaction of the band's words included) against the reference."""
  x = leaves(2**17 + 7)["normal"]
  same_selection(x, 2049)


@pytest.mark.slow
@pytest.mark.parametrize("n", [40_000, 2**17 + 7, 300_000])
def test_histogram_selection_equals_the_reference(n):
  """Below SAMPLE_FROM the radix select, above it the sampled band (and its fallback)."""
  for name, x in leaves(n, n).items():
    for k in (2048, 2049, n // 50, n // 3, n):
      same_selection(x, k)


@pytest.mark.slow
def test_the_sampled_band_brackets_gradients_and_falls_back_on_ties():
  """Which way a selection goes: the band on spread-out magnitudes (where its work is
  small), the radix select where a tie at the k-th key fills the band."""
  def bracketed(x, k):
    n, key = x.size, magnitude_key(x)
    low, high = histogram._band_edges(key, n, k)
    above, band = histogram._words(key, n, lambda v: v >= high,
                                   lambda v: (v >= low) & (v < high))
    count_above, count_band = int(jnp.sum(histogram._count(above))), int(
        jnp.sum(histogram._count(band)))
    return (count_above < k <= count_above + count_band
            and count_band <= histogram.band_capacity(n, k))

  x = leaves(2**20)
  rng = np.random.default_rng(1)
  tenth = jnp.asarray(np.where(rng.random(2**20) < 0.1, rng.normal(size=2**20), 0), jnp.float32)
  for k in (2048, 10486, 52429):
    assert bracketed(x["normal"], k) and bracketed(x["rows"], k) and bracketed(tenth, k)
  assert not bracketed(x["equal"], 10486) and not bracketed(x["sparse"], 20000)
  for name in ("columns", "equal"):
    same_selection(x[name], 10486)


@pytest.mark.slow
def test_the_api_runs_the_histograms_on_the_cpu_for_large_k():
  x = leaves(50_000, 3)["specials"]
  for k in (histogram.MIN_K - 1, histogram.MIN_K, 20_000):
    jaxpr = str(jax.make_jaxpr(lambda v: commopt.kernels.select_top_k(v, k))(x))
    assert (" top_k[" in jaxpr) == (k < histogram.MIN_K or jax.default_backend() != "cpu")
    values, indices = commopt.kernels.select_top_k(x, k, implementation="xla")
    want_values, want_indices = reference.select_top_k(x, k, False, 0.95)
    np.testing.assert_array_equal(indices, want_indices)
    np.testing.assert_array_equal(values, want_values)
  assert not histogram.suits(2**24 + 1, 4096)


# --- the gathered exchange of values and indices ------------------------------------------


def generic(monkeypatch):
  """Gather.reduce as every strategy runs it: dense reconstructions, per-worker adds."""
  monkeypatch.setattr(_strategies.Gather, "reduce", _strategies.Strategy.reduce)


def run(compressor, updates, mesh, steps=3, **options):
  tx = commopt.compressed_mean(compressor, axis_name="data", strategy="gather", **options)
  sm = commopt.testing.shard_map_workers(tx, mesh, "data")
  state = sm.init(jax.tree.map(lambda u: u[0], updates))
  outs = []
  for t in range(steps):
    out, state = sm.update(jax.tree.map(lambda u: u * (1 + t), updates), state)
    outs.append(out)
  return jax.tree.leaves((outs, state))


@pytest.mark.parametrize("make, options", [
    (lambda: commopt.top_k(0.05), {}),
    pytest.param(lambda: commopt.top_k(k=3), {}, marks=pytest.mark.slow),
    (lambda: commopt.top_k(0.05, value_dtype="bfloat16"), {}),
    pytest.param(lambda: commopt.top_k(0.05), {"error_feedback": False},
                 marks=pytest.mark.slow),
    pytest.param(lambda: commopt.top_k(0.05), {"residual_dtype": "bfloat16"},
                 marks=pytest.mark.slow),
    pytest.param(lambda: commopt.random_k(0.05, shared_seed=False), {}, marks=pytest.mark.slow),
    pytest.param(lambda: commopt.compressors.make("variance_balanced", ratio=0.05), {},
                 marks=pytest.mark.slow),
], ids=["top_k", "k", "bf16_values", "no_feedback", "bf16_residual", "random_k",
        "variance_balanced"])
def test_gathered_values_and_indices_equal_the_generic_exchange_bit_for_bit(
    mesh, monkeypatch, make, options):
  """Packed in one all-gather, summed in one scatter-add, the residual subtracted in place:
  the same bits as dense reconstructions added worker by worker. The workers share many
  coordinates (a common part in every input), so the order of the adds shows."""
  rng = np.random.default_rng(7)
  common = rng.normal(size=(1, 40, 30)) * 3
  updates = {"w": jnp.asarray(common + rng.normal(size=(N, 40, 30)), jnp.float32),
             "v": jnp.asarray(rng.normal(size=(N, 1000)) * 1e-3, jnp.float32),
             "h": jnp.asarray(rng.normal(size=(N, 30, 40)), jnp.bfloat16)}
  got = run(make(), updates, mesh, min_size=100, **options)
  generic(monkeypatch)
  want = run(make(), updates, mesh, min_size=100, **options)
  assert len(got) == len(want)
  for a, b in zip(got, want):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
