"""The quantisation family: statistics, bit widths on the wire, majority vote, EF."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

import commopt
from commopt import wire
from commopt._src import base, bits
from commopt.aggregators import vote_words
from commopt.compressors import qsgd_coded_bits, qsgd_elias_bits

N = 8


def samples(c, x, m, seed=0):
  """``m`` independent reconstructions ``C(x)``, shaped ``[m, d]``."""
  keys = jax.random.split(jax.random.key(seed), m)
  fn = jax.jit(jax.vmap(lambda k: c.decode(c.encode(x, c.init(x), k)[0], None, x)))
  return np.asarray(fn(keys), np.float64)


def hoeffding(width, m, d, delta=1e-6):
  """Half-width of a two-sided bound holding for all d coordinates w.p. 1 - delta.

  Each coordinate's samples lie in an interval of length ``width``, so
  P(|mean - E| >= t) <= 2 exp(-2 m t² / width²) (Hoeffding), union-bounded.
  """
  return np.asarray(width) * math.sqrt(math.log(2 * d / delta) / (2 * m))


def rng_x(seed, d=64, scale=1.0):
  return jnp.asarray(np.random.default_rng(seed).normal(size=d) * scale, jnp.float32)


# --- Unbiasedness, by Monte Carlo --------------------------------------------

M = 3000


def assert_unbiased(c, x, width):
  y = samples(c, x, M)
  bias = np.abs(y.mean(0) - np.asarray(x, np.float64))
  tol = hoeffding(width, M, x.size) + 1e-6 * np.abs(np.asarray(x))
  assert np.all(bias <= tol), (np.max(bias / tol), c)
  return y


@pytest.mark.slow
@given(seed=st.integers(0, 2**31), levels=st.sampled_from([1, 2, 5, 15]))
@settings(max_examples=6, deadline=None)
def test_qsgd_unbiased(seed, levels):
  x = rng_x(seed)
  c = commopt.qsgd(levels=levels, bucket_size=16)
  norms = np.linalg.norm(np.asarray(x).reshape(4, 16), axis=1).repeat(16)
  assert_unbiased(c, x, norms / levels)


@given(seed=st.integers(0, 2**31))
@settings(max_examples=4, deadline=None)
def test_terngrad_without_clipping_unbiased(seed):
  x = rng_x(seed)
  assert_unbiased(commopt.compressors.terngrad(clip=None), x, np.max(np.abs(np.asarray(x))))


def test_terngrad_clipping_is_biased_on_the_largest():
  x = rng_x(1).at[0].set(10.0)
  y = samples(commopt.compressors.terngrad(clip=2.5), x, M)
  assert y.mean(0)[0] < 5.0        # clipped to 2.5σ: far below 10 on average
  assert np.all(np.abs(y) <= 2.5 * float(jnp.std(x)) + 1e-5)


@given(seed=st.integers(0, 2**31), scale=st.sampled_from([1e-3, 1.0, 1e3]))
@settings(max_examples=6, deadline=None)
def test_natural_unbiased_with_variance_at_most_an_eighth(seed, scale):
  x = rng_x(seed, scale=scale)
  width = 2.0 ** np.floor(np.log2(np.abs(np.asarray(x, np.float64))))
  y = assert_unbiased(commopt.compressors.natural(), x, width)
  # Only powers of two (with the input's sign) come out.
  mant, _ = np.frexp(np.abs(y))
  assert np.all((mant == 0.5) | (y == 0))
  assert np.all(np.sign(y) == np.sign(np.asarray(x))[None])
  var = np.mean(np.sum((y - np.asarray(x)) ** 2, axis=1))
  assert var <= np.sum(np.asarray(x, np.float64) ** 2) / 8 * 1.05


@pytest.mark.parametrize("nbits", [4, 8])
def test_int_quant_stochastic_unbiased_and_nearest_is_not(nbits):
  x = rng_x(3)
  q = 2 ** (nbits - 1) - 1
  m = np.abs(np.asarray(x)).reshape(4, 16).max(1).repeat(16)
  assert_unbiased(commopt.int_quant(bits=nbits, block_size=16), x, m / q)
  # The same test catches a biased rounding.
  y = samples(commopt.int_quant(bits=nbits, block_size=16, rounding="nearest"), x, M)
  bias = np.abs(y.mean(0) - np.asarray(x))
  assert np.any(bias > hoeffding(m / q, M, x.size))


@pytest.mark.slow
def test_adaptive_levels_unbiased():
  x = jnp.asarray(np.random.default_rng(4).standard_t(3, size=64), jnp.float32)
  c = commopt.compressors.adaptive_levels(levels=8, bins=64)
  pts = np.asarray(c.encode(x, None, jax.random.key(0))[0]["levels"])
  assert_unbiased(c, x, np.max(np.diff(pts)))


# --- Variance and contraction bounds ------------------------------------------


@given(seed=st.integers(0, 2**31), levels=st.integers(1, 20),
       bucket=st.sampled_from([None, 8, 64, 100]))
@settings(max_examples=10, deadline=None)
@pytest.mark.slow
def test_qsgd_variance_within_bound(seed, levels, bucket):
  x = rng_x(seed, d=200)
  y = samples(commopt.qsgd(levels=levels, bucket_size=bucket), x, 400)
  xs = np.asarray(x, np.float64)
  var = np.mean(np.sum((y - xs) ** 2, axis=1))
  # Per bucket of n: Var <= min(n/s², √n/s)·‖x_b‖²; summed, with the largest n.
  n = 200 if bucket is None else min(bucket, 200)
  bound = min(n / levels**2, math.sqrt(n) / levels) * np.sum(xs**2)
  assert var <= bound * 1.05 + 1e-9


def reconstruct(c, x, key=None):
  return c.decode(c.encode(x, c.init(x), key)[0], None, x)


@given(seed=st.integers(0, 2**31), block=st.sampled_from([None, 1, 7, 32, 1000]),
       d=st.sampled_from([1, 33, 300]))
@pytest.mark.slow
def test_scaled_sign_contraction_per_block(seed, block, d):
  x = rng_x(seed, d=d)
  err = float(jnp.sum((x - reconstruct(commopt.scaled_sign(block_size=block), x)) ** 2))
  xs = np.asarray(x, np.float64)
  size = d if block is None else min(block, d)
  blocks = [xs[i:i + size] for i in range(0, d, size)]
  exact = sum(np.sum(b**2) - np.sum(np.abs(b)) ** 2 / b.size for b in blocks)
  np.testing.assert_allclose(err, exact, rtol=1e-4, atol=1e-4)
  assert err <= (1 - 1 / size) * np.sum(xs**2) + 1e-4


@pytest.mark.slow
@given(seed=st.integers(0, 2**31), d=st.sampled_from([1, 2, 33, 300]))
def test_onebit_never_worse_than_scaled_sign(seed, d):
  x = rng_x(seed, d=d) + 0.3   # unbalanced signs: where the two means differ
  e1 = float(jnp.sum((x - reconstruct(commopt.compressors.onebit(), x)) ** 2))
  e2 = float(jnp.sum((x - reconstruct(commopt.scaled_sign(), x)) ** 2))
  assert e1 <= e2 * (1 + 1e-5) + 1e-6


@pytest.mark.slow
@given(seed=st.integers(0, 2**31), d=st.sampled_from([1, 33, 300]),
       scale=st.sampled_from([1e-30, 1.0, 1e30]))
def test_onebit_decodes_each_sign_to_its_groups_mean_exactly(seed, d, scale):
  """Each coordinate decodes to the mean of its sign group, bit for bit, alone and summed
  over gathered payloads (its decode weighs the two means by the sign bit)."""
  c = commopt.compressors.onebit()
  x = rng_x(seed, d=d) * scale
  payload, _ = c.encode(x, None, None)
  means = np.asarray(payload["means"])
  xs = np.asarray(x)
  expect = np.where(xs < 0, means[1], means[0]).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(jax.jit(lambda pl: c.decode(pl, None, x))(payload)),
                                expect)
  assert np.all(expect[xs >= 0] == means[0]) and np.all(expect[xs < 0] == means[1])
  acc = jax.jit(lambda pl: c.add_decoded(c.add_decoded(jnp.zeros(d), pl, None, x), pl, None, x))(
      payload)
  np.testing.assert_array_equal(np.asarray(acc), expect + expect)


@pytest.mark.slow
@given(seed=st.integers(0, 2**31), nbits=st.sampled_from([4, 8]),
       block=st.sampled_from([4, 64, 256]))
def test_int_quant_nearest_contraction(seed, nbits, block):
  x = rng_x(seed, d=256)
  q = 2 ** (nbits - 1) - 1
  err = (np.asarray(x) - np.asarray(reconstruct(
      commopt.int_quant(bits=nbits, block_size=block, rounding="nearest"), x))) ** 2
  for e, xb in zip(err.reshape(-1, block), np.asarray(x).reshape(-1, block)):
    m = np.max(np.abs(xb))
    # Each coordinate is off by at most half a level, and never more than itself.
    assert np.all(e <= (m / (2 * q)) ** 2 * (1 + 1e-4) + 1e-12)
    assert e.sum() <= min(1.0, block / (4 * q * q)) * np.sum(xb**2) * (1 + 1e-4) + 1e-12


def uniform_grid_variance(x, pts):
  k = np.clip(np.searchsorted(pts, x, side="right") - 1, 0, len(pts) - 2)
  return np.sum((pts[k + 1] - x) * (x - pts[k]))


@pytest.mark.slow
@given(seed=st.integers(0, 2**31))
@settings(max_examples=10, deadline=None)
def test_adaptive_levels_beat_uniform_levels(seed):
  x = np.random.default_rng(seed).standard_t(2, size=500).astype(np.float32)
  c = commopt.compressors.adaptive_levels(levels=5, bins=128)   # the uniform grid is a candidate
  pts = np.asarray(c.encode(jnp.asarray(x), None, jax.random.key(0))[0]["levels"], np.float64)
  assert pts[0] == x.min() and pts[-1] == x.max() and np.all(np.diff(pts) > 0)
  uniform = np.linspace(x.min(), x.max(), 5)
  xs = x.astype(np.float64)
  assert uniform_grid_variance(xs, pts) <= uniform_grid_variance(xs, uniform) * (1 + 1e-4) + 1e-6


@pytest.mark.slow
def test_adaptive_levels_constant_input_is_exact():
  x = jnp.full((40,), 3.5)
  np.testing.assert_array_equal(
      reconstruct(commopt.compressors.adaptive_levels(), x, jax.random.key(0)), x)


# --- Bit packing ---------------------------------------------------------------


@settings(max_examples=10)
@given(width=st.integers(1, 32), n=st.integers(1, 200), seed=st.integers(0, 2**31))
@pytest.mark.slow
def test_bit_pack_round_trip_every_width(width, n, seed):
  codes = np.random.default_rng(seed).integers(0, 2**width, size=n, dtype=np.uint64)
  codes = codes.astype(np.uint32)
  words = bits.pack(jnp.asarray(codes), width)
  assert words.shape == (-(-n * width // 32),)
  np.testing.assert_array_equal(np.asarray(bits.unpack(words, n, width)), codes)


def test_three_bit_codes_straddle_words():
  # Code 10 occupies stream bits 30..32: two bits in word 0, one in word 1.
  codes = np.zeros(11, np.uint32)
  codes[10] = 0b111
  assert np.asarray(bits.pack(jnp.asarray(codes), 3)).tolist() == [0b11 << 30, 0b1]


# --- Bits per element on the wire ---------------------------------------------

SHAPE = (64, 96)   # 6144 coordinates: whole words, blocks and buckets
D = 6144
TABLE = [
    # (compressor, bits per coordinate, float32 scalars per leaf)
    (commopt.sign(), 1, 0),
    (commopt.scaled_sign(), 1, 1),
    (commopt.scaled_sign(block_size=256), 1, D // 256),
    (commopt.compressors.onebit(), 1, 2),
    (commopt.compressors.terngrad(), 2, 1),
    (commopt.qsgd(levels=1), 2, D // 512),
    (commopt.qsgd(levels=3), 3, D // 512),
    (commopt.qsgd(levels=7, bucket_size=None), 4, 1),
    (commopt.qsgd(levels=127), 8, D // 512),
    (commopt.compressors.natural(), 9, 0),
    (commopt.int_quant(bits=8), 8, D // 256),
    (commopt.int_quant(bits=4, block_size=512), 4, D // 512),
    (commopt.compressors.adaptive_levels(levels=16), 4, 16),
    (commopt.compressors.adaptive_levels(levels=5), 3, 5),
]


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((N,), ("data",))


# Widths another row also covers (2 bits: terngrad; one scale a block: qsgd and int_quant;
# adaptive levels: levels=5) compile in the slow tier.
SLOW_ROWS = {"scaled_sign(block_size=256)", "qsgd(levels=1, bucket_size=512)",
             "adaptive_levels(levels=16)"}


@pytest.mark.parametrize("c,per_element,scalars", [
    pytest.param(*row, id=row[0].name, marks=pytest.mark.slow if row[0].name in SLOW_ROWS else ())
    for row in TABLE])
def test_bits_per_element_in_payload_and_hlo(c, per_element, scalars, mesh):
  assert c.payload_bits(SHAPE, jnp.float32) == per_element * D + 32 * scalars
  x = rng_x(5, d=D).reshape(SHAPE)
  payload, _ = c.encode(x, c.init(x), jax.random.key(0))
  assert sum(l.size * l.dtype.itemsize * 8 for l in jax.tree.leaves(payload)) == \
      c.payload_bits(SHAPE, jnp.float32)
  # The compiled step moves exactly that, packed: no float array of D elements.
  tx = commopt.compressed_mean(c, axis_name="data", min_size=0)
  sm = commopt.testing.shard_map_workers(tx, mesh, "data")
  params = {"w": jnp.zeros(SHAPE)}
  u = {"w": jnp.asarray(np.random.default_rng(6).normal(size=(N,) + SHAPE), jnp.float32)}
  collectives = wire.hlo_collectives(sm.update, u, sm.init(params))
  assert wire.total_bytes(collectives) * 8 == per_element * D + 32 * scalars
  for coll in collectives:
    for dtype, shape in zip(coll.dtypes, coll.shapes):
      assert dtype == "u32" or math.prod(shape) <= N * max(scalars, 1), coll.line


@pytest.mark.parametrize("n, block_size", [(1, None), (100, None), (100, 7), (257, 48),
                                           (64, 64), (10, 1000)])
def test_per_element_repeats_each_block_value(n, block_size):
  size = n if block_size is None else min(block_size, n)
  per_block = jnp.arange(1.0, -(-n // size) + 1.0)
  got = base.per_element(per_block, n, block_size)
  np.testing.assert_array_equal(got, np.repeat(np.asarray(per_block), size)[:n])
  np.testing.assert_array_equal(base.blocks(jnp.arange(n), block_size).reshape(-1)[:n],
                                np.arange(n))


@pytest.mark.parametrize("c", [commopt.compressors.terngrad(), commopt.qsgd(), commopt.int_quant(),
                               commopt.scaled_sign(block_size=256)], ids=lambda c: c.name)
def test_per_block_broadcasts_build_no_index_scan(c):
  """Block values reach the coordinates by a broadcast: no repeat-style index cumsum,
  which XLA constant-folds for seconds on large leaves (TernGrad's encode took
  over 10 s to compile for 512k coordinates)."""
  x = jax.ShapeDtypeStruct((512 * 1024,), jnp.float32)
  jaxpr = str(jax.make_jaxpr(lambda v, k: c.decode(c.encode(v, None, k)[0], None, v))(
      x, jax.random.key(0)))
  assert "cumsum" not in jaxpr and "scatter" not in jaxpr


# --- Elias coding of QSGD ------------------------------------------------------


@pytest.mark.parametrize("levels,bucket", [(1, None), (1, 512), (4, 512)])
@pytest.mark.slow
def test_qsgd_elias_cost_measured_below_bound(levels, bucket):
  d = 4096
  c = commopt.qsgd(levels=levels, bucket_size=bucket)
  x = rng_x(7, d=d)
  keys = jax.random.split(jax.random.key(1), 20)
  measured = jax.vmap(lambda k: qsgd_coded_bits(c.encode(x, None, k)[0], (d,), levels,
                                                bucket))(keys)
  bound = qsgd_elias_bits((d,), levels, bucket)
  assert float(jnp.mean(measured)) <= bound
  if levels == 1 and bucket is None:   # sparse levels: coding beats the fixed 2 bits
    assert bound < c.payload_bits((d,), jnp.float32)


@pytest.mark.slow
def test_qsgd_coded_bits_counts_by_hand():
  # Levels [0, 2, 0, 0, -1] (s=2): norm 32 + (omega(2)=3, sign, omega(2)=3)
  # + (omega(3)=3, sign, omega(1)=1)
  c = commopt.qsgd(levels=2, bucket_size=None)
  codes = jnp.array([0, 2, 0, 0, -1]) + 2
  payload = {"norms": jnp.ones(1), "codes": bits.pack(codes, 3)}
  assert int(qsgd_coded_bits(payload, (5,), 2, None)) == 32 + 7 + 5
  assert c.decode(payload, None, jnp.zeros(5)).tolist() == [0.0, 1.0, 0.0, 0.0, -0.5]


# --- Majority vote -------------------------------------------------------------


def reference_vote(u):
  """sign(Σ_w s_w) with s = -1 for negatives, +1 otherwise, and sign(0) = 0."""
  return np.sign(np.sum(np.where(np.asarray(u) < 0, -1, 1), axis=0)).astype(np.float32)


@pytest.mark.slow
@given(n=st.integers(1, 17), d=st.integers(1, 100), seed=st.integers(0, 2**31))
def test_vote_words_equal_sign_of_sum_including_ties(n, d, seed):
  rng = np.random.default_rng(seed)
  u = rng.choice([-1.0, 0.0, 1.0], size=(n, d))
  words = jnp.stack([bits.pack(jnp.asarray(row < 0), 1) for row in u])
  negative, tie = vote_words(words)
  neg = np.asarray(bits.unpack(negative, d, 1)).astype(np.int64)
  zero = np.asarray(bits.unpack(tie, d, 1)).astype(np.int64)
  np.testing.assert_array_equal((1 - 2 * neg) * (1 - zero), reference_vote(u))


def test_majority_vote_under_shard_map_ties_and_audit(mesh):
  rng = np.random.default_rng(8)
  u = rng.normal(size=(N, 40, 33)).astype(np.float32)
  u[:4, 0, :] = -1.0   # exactly half negative: ties
  u[4:, 0, :] = 2.0
  tx = commopt.majority_vote(axis_name="data")
  sm = commopt.testing.shard_map_workers(tx, mesh, "data")
  tree = {"w": jnp.asarray(u), "skip": None}
  state = sm.init({"w": jnp.zeros((40, 33)), "skip": None})
  out, _ = sm.update(tree, state)
  assert out["skip"] is None
  got = np.asarray(out["w"])
  np.testing.assert_array_equal(got, np.broadcast_to(reference_vote(u), got.shape))
  assert np.all(got[:, 0, :] == 0)
  # Only packed sign words cross the axis: one all-gather of ⌈1320/32⌉ uint32 per worker.
  collectives = wire.hlo_collectives(sm.update, tree, state)
  assert [(c.kind, c.dtypes) for c in collectives] == [("all-gather", ("u32",))]
  assert wire.total_bytes(collectives) == 4 * math.ceil(40 * 33 / 32)


def test_signum_is_majority_vote_of_worker_momentum():
  beta, lr, n = 0.9, 0.1, 5
  tx = optax.chain(optax.trace(decay=beta), commopt.majority_vote(axis_name="w"), optax.scale(-lr))
  workers = commopt.testing.vmap_workers(tx, n, "w")
  state = workers.init({"x": jnp.zeros(30)})
  rng = np.random.default_rng(9)
  momentum = np.zeros((n, 30))
  for _ in range(4):
    g = rng.normal(size=(n, 30))
    momentum = beta * momentum + g
    out, state = workers.update({"x": jnp.asarray(g, jnp.float32)}, state)
    np.testing.assert_allclose(np.asarray(out["x"]),
                               np.broadcast_to(-lr * reference_vote(momentum), (n, 30)))


def test_signum_trains_under_data_parallel(mesh):
  # Least squares; every worker holds its own momentum, only signs travel.
  w_true = np.random.default_rng(10).normal(size=(32,)).astype(np.float32)
  x = np.random.default_rng(11).normal(size=(256, 32)).astype(np.float32)
  batch = {"x": jnp.asarray(x), "y": jnp.asarray(x @ w_true)}
  loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
  tx = optax.chain(optax.trace(decay=0.9), commopt.majority_vote(axis_name="data"),
                   optax.scale_by_schedule(optax.exponential_decay(-0.05, 50, 0.5)))
  dp = commopt.data_parallel(loss_fn, tx, mesh)
  params = {"w": jnp.zeros(32)}
  state = dp.init(params)
  first = float(loss_fn(params, batch))
  for _ in range(300):
    params, state, loss = dp.step(params, state, batch)
  assert float(np.mean(np.asarray(loss))) < 0.01 * first


# --- Error feedback's reason to exist ------------------------------------------

A = np.array([[1.0, -0.5], [-0.5, 1.0]], np.float32)   # rows a1, a2


def run_counterexample(compressor, error_feedback, steps=3000, lr=0.01):
  """min ½Σ(a_iᵀx)², x0 = (1, 1); one a_i per step, so sign(g) = ±[1, -1]."""
  tx = optax.chain(commopt.compressed_mean(compressor, error_feedback=error_feedback,
                                           min_size=0), optax.scale(-lr))
  x = jnp.ones(2)
  idx = jnp.asarray(np.random.default_rng(12).integers(0, 2, size=steps))

  def step(carry, i):
    x, s = carry
    a = jnp.asarray(A)[i]
    g = a * jnp.dot(a, x)
    u, s = tx.update(g, s)
    return (x + u, s), None

  (x, _), _ = jax.lax.scan(step, (x, tx.init(x)), idx)
  return np.asarray(x)


@pytest.mark.parametrize("compressor", [commopt.sign(), commopt.scaled_sign()],
                         ids=["sign", "scaled_sign"])
def test_error_feedback_fixes_sign_on_counterexample(compressor):
  f = lambda x: 0.5 * float(np.sum((A @ x) ** 2))
  stuck = run_counterexample(compressor, error_feedback=False)
  # Every update is ±lr·[1, -1] (times a scale): x1 + x2 never moves, and on
  # that line f is at least ½((1/2)² + (1/2)²) = 0.25, while min f = 0.
  np.testing.assert_allclose(stuck.sum(), 2.0, atol=1e-4)
  assert f(stuck) >= 0.25 - 1e-6
  if compressor.error_kind == "direction":
    # sign's residual p − sign(p) grows with every step: error feedback is refused,
    # and the message points to the scaled sign that it fixes.
    with pytest.raises(ValueError, match="scaled_sign"):
      run_counterexample(compressor, error_feedback=True)
    compressor = commopt.scaled_sign()
  fixed = run_counterexample(compressor, error_feedback=True)
  assert f(fixed) < 1e-3 and np.linalg.norm(fixed) < 0.05


# --- Bad input -----------------------------------------------------------------


@pytest.mark.parametrize("make,match", [
    (lambda: commopt.qsgd(levels=0), "`levels` must be an integer >= 1, got 0"),
    (lambda: commopt.qsgd(levels=2.5), "`levels`"),
    (lambda: commopt.qsgd(bucket_size=0),
     "`bucket_size` must be None or a positive integer, got 0"),
    (lambda: commopt.compressors.adaptive_levels(levels=1),
     "`levels` must be an integer >= 2, got 1"),
    (lambda: commopt.compressors.adaptive_levels(bins=-3), "`bins`"),
    (lambda: commopt.int_quant(bits=6), "`bits` must be 4 or 8, got 6"),
    (lambda: commopt.int_quant(bits=True), "`bits` must be 4 or 8"),
    (lambda: commopt.int_quant(block_size=-1),
     "`block_size` must be None or a positive integer, got -1"),
    (lambda: commopt.int_quant(rounding="floor"), "`rounding` must be one of"),
    (lambda: commopt.scaled_sign(block_size=0), "scaled_sign: `block_size`"),
    (lambda: commopt.compressors.terngrad(clip=0), "`clip` must be a finite number > 0, got 0"),
    (lambda: commopt.compressors.terngrad(clip=-1.5), "got -1.5"),
    (lambda: commopt.compressors.terngrad(clip="big"), "`clip`"),
    (lambda: commopt.majority_vote(axis_name=3), "`axis_name`"),
])
def test_bad_arguments_raise_value_error(make, match):
  with pytest.raises(ValueError, match=match):
    make()


@pytest.mark.parametrize("c", [commopt.qsgd(), commopt.compressors.terngrad(),
                               commopt.compressors.natural(), commopt.int_quant(),
                               commopt.compressors.adaptive_levels()], ids=lambda c: c.name)
def test_stochastic_compressors_need_a_key(c):
  with pytest.raises(ValueError, match="needs a PRNG key"):
    c.encode(jnp.ones(8), None, None)


def test_majority_vote_rejects_integer_leaves():
  tx = commopt.majority_vote()
  with pytest.raises(ValueError, match=r"\['step'\] has dtype int32"):
    tx.update({"step": jnp.zeros(3, jnp.int32)}, tx.init(None))
