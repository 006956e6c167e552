"""The sparsification family: top-k variants, random-k, threshold, gradient dropping,
AdaComp, variance-balanced sparsification and DGC."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

import commopt
from commopt import wire
from commopt.compressors import (
    adacomp,
    gradient_dropping,
    random_k,
    threshold,
    top_k,
    variance_balanced,
)
from commopt.compressors._random import keep_probabilities
from commopt.transforms._dgc import (
    DGC_WARMUP_DENSITIES,
    DGCLeafState,
    dgc,
    scheduled_top_k,
    warmup_density,
)

N = 8


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((N,), ("data",))


def distinct(shape, seed):
  """Distinct non-zero magnitudes with mixed signs, so top-k has one answer."""
  rng = np.random.default_rng(seed)
  size = int(np.prod(shape))
  x = (rng.permutation(size) + 1.0) * rng.choice([-1.0, 1.0], size)
  return jnp.asarray(x.reshape(shape), jnp.float32)


def roundtrip(c, x, key=jax.random.PRNGKey(0)):
  payload, state = c.encode(x, c.init(x), key)
  return payload, c.decode(payload, state, x)


def hoeffding_check(samples, x, ranges, delta=1e-6):
  """Every coordinate's sample mean is within Hoeffding's bound of ``x``.

  Each sample of coordinate i lies in an interval of length ``ranges[i]``;
  with a union bound over the coordinates the check fails with probability
  below ``delta`` for an unbiased estimator.
  """
  n, d = samples.shape
  tol = ranges * math.sqrt(math.log(2 * d / delta) / (2 * n))
  err = np.abs(samples.mean(0) - x)
  assert np.all(err <= tol + 1e-6), (err - tol).max()


def audit(mesh, c, params, min_size=256, stage="auto"):
  tx = commopt.compressed_mean(c, axis_name="data", min_size=min_size)
  sm = commopt.testing.shard_map_workers(tx, mesh, "data")
  rng = np.random.default_rng(0)
  u = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=(N,) + p.shape), p.dtype), params)
  collectives = wire.hlo_collectives(sm.update, u, sm.init(params), stage=stage)
  return collectives, wire.payload_bytes(c, params, min_size=min_size)


# --- top_k -------------------------------------------------------------------------


@given(shape=st.sampled_from([(7,), (40, 3), (5, 6, 7)]), k=st.integers(1, 7),
       seed=st.integers(0, 2**31), variant=st.sampled_from(["approx", "sample", "bf16", "global"]))
@pytest.mark.slow
def test_top_k_variants_select_exactly_top_k(shape, k, seed, variant):
  """Small leaves: approx (exact off TPU), sampled threshold (the sample is the whole
  leaf) and global scope on one leaf all pick lax.top_k's k coordinates."""
  x = distinct(shape, seed)
  options = {"approx": {"approx": True}, "sample": {"method": "sample"},
             "bf16": {"value_dtype": "bfloat16"}, "global": {}}[variant]
  c = top_k(k=k, **options)
  payload, y = roundtrip(c, x)
  assert payload["values"].shape == (k,) and payload["indices"].dtype == jnp.int32
  assert int(jnp.count_nonzero(y)) == k
  _, expected = jax.lax.top_k(jnp.abs(x.reshape(-1)), k)
  assert set(np.asarray(payload["indices"]).tolist()) == set(np.asarray(expected).tolist())
  wanted = x.reshape(-1)[expected]
  if variant == "bf16":
    assert payload["values"].dtype == jnp.bfloat16
    wanted = wanted.astype(jnp.bfloat16).astype(jnp.float32)
  np.testing.assert_array_equal(np.sort(np.asarray(y.reshape(-1)[expected])), np.sort(wanted))
  assert float(jnp.sum((x - y) ** 2)) <= (1 - k / x.size) * float(jnp.sum(x**2)) * (1 + 1e-2)


@pytest.mark.parametrize("options", [{}, {"approx": True}, {"value_dtype": "bfloat16"},
                                     {"method": "sample"}], ids=str)
@pytest.mark.slow
def test_top_k_sends_its_indices_in_ascending_order(options):
  """One canonical order, whichever kernel selected: ascending indices, empty slots last."""
  x = jnp.asarray(np.random.default_rng(3).normal(size=(64, 48)), jnp.float32)
  c = top_k(0.02, **options)
  payload, _ = c.encode(x, c.init(x), jax.random.PRNGKey(1))
  idx = np.asarray(payload["indices"])
  assert np.all(np.diff(idx) >= 0) and np.all(np.diff(idx[idx < x.size]) > 0)
  if "method" not in options:
    want = np.argsort(-np.abs(np.asarray(x)).reshape(-1), kind="stable")[:idx.size]
    np.testing.assert_array_equal(idx, np.sort(want))
    np.testing.assert_array_equal(
        np.asarray(payload["values"], np.float32),
        np.asarray(x.reshape(-1)[idx].astype(payload["values"].dtype), np.float32))


def test_top_k_ranks_nan_above_inf_and_ties_to_the_lower_index():
  x = jnp.array([1.0, jnp.nan, -jnp.inf, 3.0, -3.0, 0.0])
  payload, _ = top_k(k=4).encode(x, None, None)
  assert payload["indices"].tolist() == [1, 2, 3, 4]
  payload, _ = top_k(k=3).encode(x, None, None)
  assert payload["indices"].tolist() == [1, 2, 3]


@settings(max_examples=4)
@given(seed=st.integers(0, 2**31), ratio=st.floats(0.005, 1.0),
       options=st.sampled_from([{}, {"method": "sample"}, {"value_dtype": "bfloat16"}]))
@pytest.mark.slow
def test_top_k_global_scope_on_one_leaf_equals_leaf_scope(seed, ratio, options):
  x = {"w": jnp.asarray(np.random.default_rng(seed).normal(size=(33, 17)), jnp.float32)}
  outs = []
  for scope in ("leaf", "global"):
    tx = commopt.compressed_mean(top_k(ratio, scope=scope, **options), min_size=0)
    state = tx.init(x)
    for _ in range(2):
      out, state = tx.update(x, state)
    outs.append((out["w"], state.residual["w"]))
  for a, b in zip(*outs):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_top_k_global_scope_spends_the_budget_where_the_mass_is():
  rng = np.random.default_rng(0)
  big = jnp.asarray(rng.normal(size=(30, 20)) * 100, jnp.float32)
  small = jnp.asarray(rng.normal(size=(400,)), jnp.float32)
  params = {"big": big, "small": small}
  tx = commopt.compressed_mean(top_k(0.05, scope="global"), min_size=0)
  out, state = tx.update(params, tx.init(params))
  budget = math.ceil(0.05 * 600) + math.ceil(0.05 * 400)
  assert int(jnp.count_nonzero(out["big"])) == budget and not bool(jnp.any(out["small"]))
  flat = jnp.concatenate([big.reshape(-1), small])
  _, expected = jax.lax.top_k(jnp.abs(flat), budget)
  mask = np.zeros(1000, bool)
  mask[np.asarray(expected)] = True
  np.testing.assert_array_equal(np.asarray(out["big"]).reshape(-1) != 0, mask[:600])
  # Error feedback per leaf: the residual holds exactly what was not sent.
  np.testing.assert_array_equal(np.asarray(state.residual["small"]), np.asarray(small))


def test_top_k_sample_fills_a_fixed_capacity():
  x = jnp.asarray(np.random.default_rng(1).normal(size=(200, 100)), jnp.float32)
  c = top_k(0.01, method="sample", sample_ratio=0.05)
  k = 200
  counts = []
  run = jax.jit(lambda key: roundtrip(c, x, key))
  for seed in range(5):
    payload, y = run(jax.random.PRNGKey(seed))
    assert payload["values"].shape == (k,)
    sent = np.asarray(y).reshape(-1) != 0
    counts.append(sent.sum())
    # Whatever is sent lies above whatever is not, as a threshold selects.
    mag = np.abs(np.asarray(x)).reshape(-1)
    if sent.sum() < k:
      assert mag[sent].min() >= mag[~sent].max()
    # Empty slots point past the leaf.
    idx = np.asarray(payload["indices"])
    assert np.all((idx < x.size) == (np.arange(k) < sent.sum()))
  # A 1000-coordinate sample estimates a 1% quantile to within a factor of two.
  assert k / 2 <= np.mean(counts) <= k


@pytest.mark.parametrize("options", [{"approx": True}, {"method": "sample"}, {"scope": "global"}])
def test_top_k_variants_audited_bytes(mesh, options):
  params = {"w": jnp.zeros((64, 48)), "v": jnp.zeros((300,)), "b": jnp.zeros((16,))}
  collectives, report = audit(mesh, top_k(0.02, **options), params)
  assert wire.total_bytes(collectives) == report.total
  gathered = [c for c in collectives if c.kind == "all-gather"]
  # Per leaf its values and indices in one uint32 buffer; global: one payload, in two.
  assert len(gathered) == 2
  if options.get("scope") != "global":
    assert all(c.dtypes == ("u32",) for c in gathered)


def test_top_k_bf16_values_on_the_wire(mesh):
  """The bfloat16 values cross the compiled gather as their 16 bits (as u16: XLA:CPU would
  widen a bf16 all-gather to f32)."""
  params = {"w": jnp.zeros((64, 48))}
  c = top_k(0.01, value_dtype="bfloat16")
  collectives, report = audit(mesh, c, params)
  assert ("u16",) in [c_.dtypes for c_ in collectives]
  assert wire.total_bytes(collectives) == report.total == 31 * (2 + 4)


# --- random_k ------------------------------------------------------------------------


def test_random_k_shared_seed_all_reduces_only_values(mesh):
  params = {"w": jnp.zeros((64, 48)), "b": jnp.zeros((16,))}
  c = random_k(0.01)
  assert c.linear and c.shared_randomness
  collectives, report = audit(mesh, c, params)
  k = math.ceil(0.01 * 64 * 48)
  # The dense bias and the k values: all-reduced, nothing else, and no integers.
  assert {c_.kind for c_ in collectives} == {"all-reduce"}
  shapes = [s for c_ in collectives for s in c_.shapes]
  assert sorted(shapes) == sorted([(16,), (k,)])
  assert all(d.startswith("f") for c_ in collectives for d in c_.dtypes)
  assert wire.total_bytes(collectives) == report.total == 16 * 4 + k * 4


def test_random_k_shared_seed_workers_agree(mesh):
  tx = commopt.compressed_mean(random_k(k=40), axis_name="data", min_size=0, error_feedback=False)
  sm = commopt.testing.shard_map_workers(tx, mesh, "data")
  u = {"w": jnp.asarray(np.random.default_rng(2).normal(size=(N, 500)), jnp.float32)}
  state = sm.init({"w": jnp.zeros(500)})
  for _ in range(2):
    out, state = sm.update(u, state)
    indices = np.asarray(state.compressor_state["w"].indices)
    assert np.all(indices == indices[0]) and len(set(indices[0].tolist())) == 40
    expected = np.zeros(500)
    expected[indices[0]] = np.asarray(u["w"]).mean(0)[indices[0]]
    np.testing.assert_allclose(np.asarray(out["w"])[0], expected, rtol=1e-5, atol=1e-6)
  # A new step draws new coordinates.
  state2 = sm.update(u, state)[1]
  assert set(np.asarray(state2.compressor_state["w"].indices)[0]) != set(indices[0])


def test_random_k_per_worker_seed_gathers_values_and_indices(mesh):
  c = random_k(0.01, shared_seed=False)
  assert not c.linear
  collectives, report = audit(mesh, c, {"w": jnp.zeros((64, 48))})
  assert {c_.kind for c_ in collectives} == {"all-gather"}
  # The float32 values and int32 indices in one uint32 buffer.
  assert [c_.dtypes for c_ in collectives] == [("u32",)]
  assert wire.total_bytes(collectives) == report.total


@pytest.mark.parametrize("shared_seed", [True, False])
@pytest.mark.slow
def test_random_k_scaled_is_unbiased(shared_seed):
  d, k, n = 16, 4, 4000
  x = jnp.asarray(np.random.default_rng(3).normal(size=d), jnp.float32)
  c = random_k(k=k, scale=True, shared_seed=shared_seed)
  samples = jax.vmap(lambda key: roundtrip(c, x, key)[1])(
      jax.random.split(jax.random.PRNGKey(4), n))
  assert np.all(np.count_nonzero(np.asarray(samples), axis=1) == k)
  hoeffding_check(np.asarray(samples), np.asarray(x), d / k * np.abs(np.asarray(x)))


# --- variance_balanced -----------------------------------------------------------------


@pytest.mark.slow
def test_variance_balanced_is_unbiased():
  d, k, n = 24, 6, 4000
  x = jnp.asarray(np.random.default_rng(5).standard_cauchy(d), jnp.float32)
  c = variance_balanced(k=k, capacity=d / k)   # room for every coordinate: no overflow
  samples = np.asarray(jax.vmap(lambda key: roundtrip(c, x, key)[1])(
      jax.random.split(jax.random.PRNGKey(6), n)))
  p = np.asarray(keep_probabilities(jnp.abs(x), k, 2))
  hoeffding_check(samples, np.asarray(x), np.abs(np.asarray(x)) / p)
  # About k coordinates are kept per draw.
  assert abs(np.count_nonzero(samples, axis=1).mean() - p.sum()) < 4 * math.sqrt(k / n) + 0.05


@given(seed=st.integers(0, 2**31), k=st.integers(1, 60), heavy=st.booleans())
@pytest.mark.slow
def test_keep_probabilities_meet_the_density(seed, k, heavy):
  rng = np.random.default_rng(seed)
  x = rng.standard_cauchy(200) if heavy else rng.normal(size=200)
  p = np.asarray(keep_probabilities(jnp.abs(jnp.asarray(x, jnp.float32)), k, 3))
  assert np.all((p >= 0) & (p <= 1))
  assert abs(p.sum() - k) <= 0.02 * k + 1e-3
  # Larger magnitudes are never kept with a smaller probability.
  order = np.argsort(np.abs(x))
  assert np.all(np.diff(p[order]) >= -1e-6)


# --- threshold, gradient dropping, AdaComp ---------------------------------------------


@given(seed=st.integers(0, 2**31), tau=st.floats(0.1, 2.0))
@pytest.mark.slow
def test_threshold_sends_signed_tau_above_the_threshold(seed, tau):
  x = jnp.asarray(np.random.default_rng(seed).normal(size=300), jnp.float32)
  c = threshold(tau, capacity=1.0)
  payload, y = roundtrip(c, x)
  assert payload["codes"].dtype == jnp.uint32 and payload["codes"].shape == (300,)
  assert c.payload_bits((300,), jnp.float32) == 32 * 300
  above = np.abs(np.asarray(x)) > tau
  np.testing.assert_allclose(np.asarray(y), np.where(above, np.sign(x) * np.float32(tau), 0.0),
                             rtol=1e-6)


@pytest.mark.slow
def test_threshold_capacity_keeps_the_first_in_index_order():
  x = jnp.asarray([5.0, 0.1, -4.0, 3.0, -2.0, 0.0, 9.0, 0.2])
  payload, y = roundtrip(threshold(1.0, capacity=0.25), x)   # 2 slots for 5 candidates
  assert y.tolist() == [1.0, 0.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
  payload, y = roundtrip(threshold(10.0), x)                 # none: empty slot
  assert payload["codes"].tolist() == [0xFFFFFFFF] and not bool(jnp.any(y))


@pytest.mark.slow
def test_gradient_dropping_keeps_the_largest():
  x = distinct((30, 20), 7)
  payload, y = roundtrip(gradient_dropping(0.9), x)          # 600 < 1024: exact quantile
  _, expected = jax.lax.top_k(jnp.abs(x.reshape(-1)), 60)
  assert set(np.asarray(payload["indices"]).tolist()) == set(np.asarray(expected).tolist())
  _, y = roundtrip(gradient_dropping(0.0), x)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


def adacomp_reference(g, residual_prev, bin_size, per_bin):
  """AdaComp in numpy, one leaf: (reconstruction, new residual)."""
  d = g.size
  h = 2 * g - residual_prev
  out = np.zeros(d)
  chosen = []
  for start in range(0, d, bin_size):
    gb, hb = np.abs(g[start:start + bin_size]), np.abs(h[start:start + bin_size])
    ok = np.flatnonzero((hb >= gb.max()) & (gb > 0))
    ok = ok[np.argsort(-hb[ok], kind="stable")][:per_bin]
    chosen += (start + ok).tolist()
  if chosen:
    scale = np.abs(g[chosen]).mean()
    out[chosen] = np.sign(g[chosen]) * scale
  return out, g - out


@settings(max_examples=10)
@given(seed=st.integers(0, 2**31), bin_size=st.integers(1, 40), per_bin=st.integers(1, 3))
@pytest.mark.slow
def test_adacomp_matches_reference(seed, bin_size, per_bin):
  per_bin = min(per_bin, bin_size)
  rng = np.random.default_rng(seed)
  c = adacomp(bin_size, per_bin=per_bin)
  tx = commopt.compressed_mean(c, min_size=0)
  state = tx.init({"w": jnp.zeros(97)})
  update = jax.jit(tx.update)
  residual = np.zeros(97)
  for _ in range(3):
    g = rng.normal(size=97).astype(np.float32)
    out, state = update({"w": jnp.asarray(g)}, state)
    expected, residual = adacomp_reference(g + residual, residual, bin_size, per_bin)
    np.testing.assert_allclose(np.asarray(out["w"]), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(state.residual["w"]), residual, rtol=1e-5, atol=1e-5)
  assert c.payload_bits((97,), jnp.float32) == 32 * (-(-97 // bin_size) * per_bin + 1)


@pytest.mark.parametrize("c", [threshold(0.5, capacity=0.05), adacomp(50),
                               variance_balanced(0.02), gradient_dropping(0.95)],
                         ids=["threshold", "adacomp", "variance_balanced", "gradient_dropping"])
def test_audited_bytes_equal_payload_bytes(mesh, c):
  collectives, report = audit(mesh, c, {"w": jnp.zeros((64, 48)), "b": jnp.zeros((16,))})
  assert wire.total_bytes(collectives) == report.total
  assert report.ratio > 5


# --- conservation under overflow ----------------------------------------------------------


BURST = {
    "threshold": (threshold(1.0, capacity=0.25), 1.0),
    "top_k": (top_k(0.05), 1e-4),
    "top_k_sample": (top_k(0.05, method="sample"), 1e-4),
    "top_k_global": (top_k(0.05, scope="global"), 1e-4),
    "gradient_dropping": (gradient_dropping(0.95), 1e-4),
    "random_k": (random_k(0.05), 1e-4),
    "adacomp": (adacomp(16), 0.05),
}


@pytest.mark.parametrize("name", sorted(BURST))
def test_conservation_under_overflow(name):
  """A burst of large inputs overflows the fixed capacities; then zeros drain it.

  At every step outputs plus residual equal inputs; after the zeros the sum of
  the outputs has caught up with the sum of the inputs (to within tau for the
  threshold, whose residual keeps what is below it)."""
  c, tol = BURST[name]
  tx = commopt.compressed_mean(c, min_size=0, error_feedback=True)
  params = {"w": jnp.zeros((16, 16)), "v": jnp.zeros(64)}
  rng = np.random.default_rng(8)
  burst = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape) * 10, jnp.float32), params)
           for _ in range(3)]
  zeros = jax.tree.map(jnp.zeros_like, params)
  inputs = jax.tree.map(lambda *xs: jnp.stack(xs), *burst, *[zeros] * 400)

  @jax.jit
  def run(inputs):
    def step(state, u):
      out, state = tx.update(u, state)
      return state, out
    state, outs = jax.lax.scan(step, tx.init(params), inputs)
    return state, outs

  state, outs = run(inputs)
  for key in params:
    sum_in = np.cumsum(np.asarray(inputs[key], np.float64), axis=0)
    sum_out = np.cumsum(np.asarray(outs[key], np.float64), axis=0)
    burst_size = np.abs(sum_in[2]).max()
    # Mid-burst, the payload could not carry it all.
    assert np.abs(sum_in[2] - sum_out[2]).max() > 0.1 * burst_size
    np.testing.assert_allclose(sum_out[-1] + np.asarray(state.residual[key]), sum_in[-1],
                               atol=1e-3)
    bound = tol if name == "threshold" else tol * burst_size
    assert np.abs(sum_in[-1] - sum_out[-1]).max() <= bound + 1e-4


# --- DGC ---------------------------------------------------------------------------------


def test_dgc_warmup_gives_the_configured_densities():
  boundaries = (2, 4, 6, 8)
  tx = dgc(densities=DGC_WARMUP_DENSITIES, boundaries=boundaries, min_size=0, momentum=0.0)
  params = {"w": jnp.zeros(4096)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  for step in range(10):
    density = warmup_density(step, DGC_WARMUP_DENSITIES, boundaries)
    assert density == DGC_WARMUP_DENSITIES[min(step // 2, 4)]
    out, state = update({"w": distinct((4096,), step)}, state)
    expected = math.ceil(density * 4096)
    assert int(jnp.count_nonzero(out["w"])) == expected
    assert int(state.inner.compressor_state["w"].sent.sum()) == expected


def test_dgc_momentum_factor_masking():
  m = 0.9
  tx = dgc(densities=0.05, min_size=100, momentum=m)
  params = {"w": jnp.zeros((20, 30)), "b": jnp.zeros(3)}
  state = tx.init(params)
  rng = np.random.default_rng(9)
  velocity = {"w": np.zeros((20, 30)), "b": np.zeros(3)}
  for _ in range(4):
    g = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in velocity.items()}
    out, state = tx.update(jax.tree.map(jnp.asarray, g), state)
    sent = np.asarray(state.inner.compressor_state["w"].sent)
    np.testing.assert_array_equal(sent, np.asarray(out["w"]) != 0)
    assert sent.sum() == 30
    u = m * velocity["w"] + g["w"]
    # Zero exactly where sent, the momentum-corrected velocity elsewhere.
    np.testing.assert_array_equal(np.asarray(state.velocity["w"])[sent], 0.0)
    np.testing.assert_allclose(np.asarray(state.velocity["w"])[~sent], u[~sent], rtol=1e-5,
                               atol=1e-6)
    velocity["w"] = np.where(sent, 0.0, u)
    # The dense bias keeps ordinary momentum.
    velocity["b"] = m * velocity["b"] + g["b"]
    np.testing.assert_allclose(np.asarray(out["b"]), velocity["b"], rtol=1e-6)
    assert isinstance(state.inner.compressor_state["w"], DGCLeafState)


def dgc_reference(grads, density, m, clip_norm, nesterov):
  """DGC in numpy over workers' gradient sequences [T, W, d]: the outputs [T, d]."""
  steps, workers, d = grads.shape
  k = math.ceil(density * d)
  u = np.zeros((workers, d))
  v = np.zeros((workers, d))
  outs = []
  for t in range(steps):
    total = np.zeros(d)
    for w in range(workers):
      g = grads[t, w]
      norm = np.linalg.norm(g)
      g = g * min(1.0, clip_norm / math.sqrt(workers) / norm)
      u[w] = m * u[w] + g
      v[w] += g + m * u[w] if nesterov else u[w]
      sent = np.argsort(-np.abs(v[w]))[:k]
      total[sent] += v[w][sent]
      v[w][sent] = 0
      u[w][sent] = 0
    outs.append(total / workers)
  return np.stack(outs)


@pytest.mark.parametrize("nesterov", [False, True])
def test_dgc_matches_reference_on_simulated_workers(nesterov):
  workers, d, steps = 4, 300, 4
  grads = np.random.default_rng(10).normal(size=(steps, workers, d)).astype(np.float32)
  tx = dgc(axis_name="workers", densities=0.02, momentum=0.8, clip_norm=20.0, nesterov=nesterov,
           min_size=0)
  sim = commopt.testing.vmap_workers(tx, workers, "workers")
  state = sim.init({"w": jnp.zeros(d)})
  expected = dgc_reference(grads.astype(np.float64), 0.02, 0.8, 20.0, nesterov)
  for t in range(steps):
    out, state = sim.update({"w": jnp.asarray(grads[t])}, state)
    np.testing.assert_allclose(np.asarray(out["w"])[0], expected[t], rtol=1e-4, atol=1e-5)


def test_dgc_stages_each_send_their_own_k(mesh):
  """Inside data_parallel-style shard_map: one all-gather pair per warm-up stage."""
  tx = dgc(axis_name="data", densities=(0.25, 0.01), boundaries=(3,), min_size=256)
  sm = commopt.testing.shard_map_workers(tx, mesh, "data")
  params = {"w": jnp.zeros((64, 48)), "b": jnp.zeros(16)}
  u = {"w": jnp.ones((N, 64, 48)), "b": jnp.ones((N, 16))}
  collectives = wire.hlo_collectives(sm.update, u, sm.init(params))
  gathered = sorted((c.dtypes[0], c.shapes[0]) for c in collectives if c.kind == "all-gather")
  assert gathered == [("f32", (N, 31)), ("f32", (N, 768)), ("s32", (N, 31)), ("s32", (N, 768))]
  assert [c.shapes for c in collectives if c.kind == "all-reduce"] == [((16,),)]
  # Steady state: the last stage's payload.
  assert wire.payload_bytes(scheduled_top_k((0.25, 0.01), (3,)), params,
                            min_size=256).total == 31 * 8 + 16 * 4
  # Four steps: all workers receive the same mean, three dense-ish then one sparse.
  state = sm.init(params)
  rng = np.random.default_rng(11)
  for step in range(4):
    out, state = sm.update({"w": jnp.asarray(rng.normal(size=(N, 64, 48)), jnp.float32),
                            "b": jnp.ones((N, 16))}, state)
    w = np.asarray(out["w"])
    np.testing.assert_allclose(w, np.broadcast_to(w[0], w.shape))
    assert np.count_nonzero(w[0]) <= N * (768 if step < 3 else 31)


# --- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize("make, match", [
    (lambda: threshold(0.0), r"threshold: `tau` must be a finite number > 0, got 0.0"),
    (lambda: threshold(-1.0), r"`tau` must be a finite number > 0, got -1.0"),
    (lambda: threshold(1.0, capacity=0), r"`capacity` must be a fraction in \(0, 1\], got 0"),
    (lambda: gradient_dropping(1.0), r"`drop_ratio` must be a fraction in \[0, 1\), got 1.0"),
    (lambda: gradient_dropping(-0.1), r"`drop_ratio` must be a fraction in \[0, 1\), got -0.1"),
    (lambda: adacomp(0), r"adacomp: `bin_size` must be a positive integer, got 0"),
    (lambda: adacomp(-5), r"`bin_size` must be a positive integer, got -5"),
    (lambda: adacomp(4, per_bin=5), r"`per_bin` must be at most bin_size=4, got 5"),
    (lambda: random_k(), r"random_k: give exactly one of `ratio` and `k`"),
    (lambda: random_k(1.5), r"random_k: `ratio` must be a fraction in \(0, 1\], got 1.5"),
    (lambda: random_k(0.1, shared_seed=1), r"`shared_seed` must be True or False, got 1"),
    (lambda: variance_balanced(0.1, capacity=0.5), r"`capacity` must be a number >= 1, got 0.5"),
    (lambda: variance_balanced(k=0), r"`k` must be a positive integer, got 0"),
    (lambda: top_k(0.1, method="median"), r"`method` must be one of \('exact', 'sample'\), got 'median'"),
    (lambda: top_k(0.1, scope="layer"), r"`scope` must be one of \('leaf', 'global'\), got 'layer'"),
    (lambda: top_k(k=3, scope="global"), r"scope='global' .* needs `ratio`, got k=3"),
    (lambda: top_k(0.1, approx=True, method="sample"), r"`approx=True` .* needs method='exact'"),
    (lambda: top_k(0.1, value_dtype="int8"), r"`value_dtype` must be None .* got 'int8'"),
    (lambda: top_k(0.1, sample_ratio=2), r"`sample_ratio` must be a fraction in \(0, 1\], got 2"),
    (lambda: dgc(densities=(0.25, 0.0)), r"dgc: `densities` must be a fraction in \(0, 1\] .*0.0 is not"),
    (lambda: dgc(densities=1.5), r"`densities` must be a fraction in \(0, 1\].*1.5 is not"),
    (lambda: dgc(densities=(0.25, 0.1), boundaries=()), r"`boundaries` must hold one step per change"),
    (lambda: dgc(densities=(0.5, 0.25, 0.1), boundaries=(5, 5)), r"`boundaries` must increase strictly"),
    (lambda: dgc(densities=(0.5, 0.1), boundaries=(0,)), r"`boundaries` must be a positive integer, got 0"),
    (lambda: dgc(momentum=1.0), r"dgc: `momentum` must be a number in \[0, 1\), got 1.0"),
    (lambda: dgc(clip_norm=0), r"`clip_norm` must be None or a finite number > 0, got 0"),
])
def test_bad_arguments(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_encode_without_a_key_is_rejected():
  x = jnp.ones(8)
  for c in (random_k(k=2), variance_balanced(k=2), top_k(k=2, method="sample"),
            gradient_dropping(0.5)):
    with pytest.raises(ValueError, match=r"`encode` needs a PRNG key"):
      c.encode(x, c.init(x), None)


def test_dgc_chains_with_an_optimizer_and_trains():
  """DGC with warm-up on a quadratic: the step shrinks the loss like momentum SGD."""
  tx = optax.chain(dgc(densities=(0.5, 0.1), boundaries=(5,), min_size=0, clip_norm=100.0),
                   optax.sgd(0.05))
  target = jnp.asarray(np.random.default_rng(12).normal(size=200), jnp.float32)
  params = {"w": jnp.zeros(200)}
  state = tx.init(params)
  loss = lambda p: 0.5 * jnp.sum((p["w"] - target) ** 2)
  step = jax.jit(lambda p, s: tx.update(jax.grad(loss)(p), s, p))
  start = float(loss(params))
  for _ in range(150):
    updates, state = step(params, state)
    params = optax.apply_updates(params, updates)
  assert float(loss(params)) < 0.01 * start


@pytest.mark.slow
@pytest.mark.parametrize("name", ["random_k", "variance_balanced"])
def test_unbiased_sparse_compressors_under_error_feedback_keep_the_scaled_residual(mesh, name):
  """Under error_feedback=True an unbiased compressor runs as C/(1+ω): its payload no longer
  decodes to the values it carries, so the gather's sparse fast path must not write the
  residual from them. Worker 0's residual equals the one a single worker computes."""
  options = {"shared_seed": False, "scale": True} if name == "random_k" else {}
  compressor = commopt.compressors.make(name, **options)
  tx = commopt.compressed_mean(compressor, axis_name="data", min_size=0, error_feedback=True,
                               strategy="gather")
  local = commopt.compressed_mean(compressor, min_size=0, error_feedback=True)
  params = {"w": jnp.zeros((64, 32))}
  grads = np.asarray(jax.random.normal(jax.random.key(3), (mesh.size, 64, 32)))
  workers = commopt.testing.shard_map_workers(tx, mesh, "data")
  _, state = workers.update({"w": grads}, workers.init(params))
  _, alone = local.update({"w": jnp.asarray(grads[0])}, local.init(params))
  np.testing.assert_allclose(np.asarray(state.residual["w"])[0], np.asarray(alone.residual["w"]),
                             rtol=1e-6, atol=1e-6)
  assert "sparse_values" not in commopt._src.feedback.feedback_compressor(
      compressor, True, "test")[0].capabilities
