"""SketchML: delta-binary keys, quantile-bucket values, the MinMaxSketch, and the bytes.

Bytes per coordinate sent, the paper's accounting with this payload's
static capacities (``d`` coordinates, ``k`` sent, ``q = min(buckets/2, k)``
buckets per sign, ``b = ⌈log2 q⌉``)::

  keys    key_bytes_bound(k, d) / k = 1 + Σ_m min(k, ⌊(d−1)/256^m⌋)/k   (≈ 1 + d/(256k) bytes)
  fields  (2 flag + 1 sign + b index) bits,  or 3 bits + rows·cols·b/k with the sketch
  splits  32·min(k, 2q)/k bits

each field rounded up to whole uint32 words.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import commopt
from commopt import wire
from commopt.kernels import unpack_bits
from commopt.compressors._sketchml import (
    _slots,
    delta_decode,
    delta_encode,
    key_bytes_bound,
    minmax_query,
    minmax_sketch,
    quantile_buckets,
)
from commopt.testing import checks


def words(bits):
  return 32 * math.ceil(bits / 32)


def paper_bits(k, d, buckets=256, cells=None):
  """The payload's bits from the accounting in the module docstring (``cells``: the sketch's)."""
  q = min(buckets // 2, k)
  b = max(1, math.ceil(math.log2(q)))
  key_bytes = k + sum(min(k, (d - 1) // 256**m) for m in (1, 2, 3))
  fields = words(k * 3) + words(cells * b) if cells else words(k * (3 + b))
  return words(8 * key_bytes) + fields + 32 * min(k, 2 * q)


def roundtrip(c, x):
  return jax.jit(lambda x: c.decode(c.encode(x, c.init(x), None)[0], None, x))(x)


def encode_keys(keys, d):
  flags, stream = jax.jit(delta_encode, static_argnums=1)(jnp.asarray(keys, jnp.int32), d)
  return flags, stream, np.asarray(jax.jit(delta_decode, static_argnums=2)(flags, stream, d))


# --- bytes ---------------------------------------------------------------------------


@pytest.mark.parametrize("d,k,buckets,sketch_ratio,rows", [
    (10**6, 10**4, 256, None, 2), (10**6, 10**4, 256, 0.5, 2), (3072, 31, 256, None, 2),
    (3072, 154, 16, 2.0, 3), (2**25, 1000, 64, None, 2), (7, 7, 2, None, 2),
])
def test_payload_bits_follow_the_papers_accounting(d, k, buckets, sketch_ratio, rows):
  c = commopt.compressors.sketchml(k=k, buckets=buckets, sketch_ratio=sketch_ratio, rows=rows)
  cells = rows * math.ceil(sketch_ratio * k / rows) if sketch_ratio else None
  bits = c.payload_bits((d,), jnp.float32)
  assert bits == paper_bits(k, d, buckets, cells)
  # Delta keys take about 1 + d/(256k) bytes each, never more than top-k's 4-byte indices.
  assert key_bytes_bound(k, d) <= k + (d - 1) / 256 + (d - 1) / 65536 + (d - 1) / 2**24
  assert key_bytes_bound(k, d) <= 4 * k
  assert bits < commopt.top_k(k=k).payload_bits((d,), jnp.float32)


@pytest.mark.slow
def test_bytes_per_coordinate_at_one_percent():
  """At k/d = 1% and 256 buckets: 1 + 100/256 bytes of key, 10 bits of fields, 1024/k of splits."""
  d, k = 10**6, 10**4
  c = commopt.compressors.sketchml(k=k)
  per_coordinate = c.payload_bits((d,), jnp.float32) / 8 / k
  key_bytes = 1 + ((d - 1) // 256 + (d - 1) // 65536) / k
  assert per_coordinate == pytest.approx(key_bytes + 10 / 8 + 1024 / k, abs=1e-3)
  assert per_coordinate < 2.75 < 8 == commopt.top_k(k=k).payload_bits((d,), jnp.float32) / 8 / k
  # What is encoded is what payload_bits counts, and random keys use well under the bound.
  x = jnp.asarray(np.random.default_rng(0).standard_normal(d), jnp.float32)
  payload, _ = jax.jit(lambda x: c.encode(x, (), None))(x)
  assert sum(l.size * 32 for l in jax.tree.leaves(payload)) == c.payload_bits((d,), jnp.float32)
  flags = np.asarray(unpack_bits(payload["fields"], 10, k)) & 3
  used = int(np.sum(flags + 1))
  # Deltas average 100, so about e^{-256/100} of them take a second byte.
  assert k < used < 1.1 * k < key_bytes_bound(k, d)


@pytest.mark.parametrize("opts", [{}, {"sketch_ratio": 1.0, "rows": 2}],
                         ids=["per-key", "sketch"])
def test_compiled_mean_moves_exactly_payload_bits(mesh, opts):
  shape, n = (96, 80), mesh.devices.size
  c = commopt.compressors.sketchml(0.02, **opts)
  sm = commopt.testing.shard_map_workers(commopt.compressed_mean(c, axis_name="data", min_size=0),
                                         mesh, "data")
  params = {"w": jnp.zeros(shape)}
  u = {"w": jnp.asarray(np.random.default_rng(1).normal(size=(n,) + shape), jnp.float32)}
  collectives = wire.hlo_collectives(sm.update, u, sm.init(params))
  assert 8 * wire.total_bytes(collectives) == c.payload_bits(shape, jnp.float32)
  assert {col.kind for col in collectives} == {"all-gather"}
  # Only packed words and the splits cross: nothing of the leaf's size.
  for col in collectives:
    for dtype, s in zip(col.dtypes, col.shapes):
      assert dtype in ("u32", "f32") and math.prod(s) < n * 0.1 * math.prod(shape), col.line


# --- keys ----------------------------------------------------------------------------


@pytest.mark.parametrize("d", [1, 97, 3072, 10**6, 2**31 - 1])
def test_delta_keys_round_trip_within_the_bound(d):
  """Random key sets, their gaps drawn on every scale from 1 to d/k (every byte length)."""
  k = min(d, 64)
  encode = jax.jit(lambda keys: delta_encode(keys, d))
  decode = jax.jit(lambda flags, stream: delta_decode(flags, stream, d))
  rng = np.random.default_rng(d)
  for trial in range(12):
    gaps = np.maximum(1, (rng.random(k) * (d / k) ** (trial / 11)).astype(np.int64))
    gaps[0] = rng.integers(0, max(1, d - gaps[1:].sum()))
    keys = np.cumsum(gaps)
    assert keys[-1] < d
    flags, stream = encode(jnp.asarray(keys, jnp.int32))
    np.testing.assert_array_equal(np.asarray(decode(flags, stream)), keys)
    assert int(np.sum(np.asarray(flags) + 1)) <= key_bytes_bound(k, d)


@pytest.mark.parametrize("name,d,keys", [
    ("all deltas 1", 1000, np.arange(100, 600)),
    ("every key", 300, np.arange(300)),
    ("0 and d-1", 2**31 - 1, np.array([0, 2**31 - 2])),
    ("d-1 alone", 2**31 - 1, np.array([2**31 - 2])),
    ("0 alone", 5, np.array([0])),
    ("byte edges", 2**31 - 1, np.cumsum([255, 1, 255, 256, 65535, 65536, 2**24 - 1, 2**24, 2**30])),
    ("all deltas large", 2**31 - 1, np.arange(1, 9) * (2**28 - 1)),
])
def test_delta_keys_round_trip_on_adversarial_sets(name, d, keys):
  flags, _, back = encode_keys(keys, d)
  np.testing.assert_array_equal(back, keys, err_msg=name)
  deltas = np.diff(keys, prepend=0)
  lengths = 1 + sum((deltas >= 256**m).astype(int) for m in (1, 2, 3))
  np.testing.assert_array_equal(np.asarray(flags) + 1, lengths, err_msg=name)
  assert lengths.sum() <= key_bytes_bound(keys.size, d)


@pytest.mark.parametrize("step,level", [(256, 1), (65536, 2), (2**24, 3)])
def test_the_key_bound_is_reached(step, level):
  """Keys ``step, 2·step, …, m·step = d − 1``: every delta takes ``level`` extra bytes."""
  m = 40
  d = m * step + 1
  keys = np.arange(1, m + 1) * step
  flags, _, back = encode_keys(keys, d)
  np.testing.assert_array_equal(back, keys)
  assert int(np.sum(np.asarray(flags) + 1)) == m * (1 + level) == key_bytes_bound(m, d)


# --- values --------------------------------------------------------------------------


def reference_buckets(v, per_sign):
  """numpy: each value's split (its bucket's smallest magnitude) and its bucket's width."""
  split, width = np.zeros(v.size, np.float32), np.zeros(v.size, np.float32)
  for negative in (False, True):
    members = np.flatnonzero((v < 0) == negative)
    if members.size == 0:
      continue
    order = members[np.argsort(np.abs(v[members]), kind="stable")]
    run = -(-members.size // per_sign)
    for start in range(0, members.size, run):
      bucket = order[start:start + run]
      mags = np.abs(v[bucket])
      split[bucket], width[bucket] = mags.min(), mags.max() - mags.min()
  return split, width


def inputs(seed, d):
  """Gaussian values at a random scale, with ties, zeros of both signs and a few outliers."""
  rng = np.random.default_rng(seed)
  x = np.asarray(checks.hard_floats(d, seed, specials=False)) * 10.0 ** rng.uniform(-3, 3)
  x[rng.choice(d, 3, replace=False)] = [0.0, -0.0, 0.0]
  x[rng.choice(d, 2, replace=False)] *= 1e3
  return x.astype(np.float32)


@pytest.mark.parametrize("d,k,buckets", [(2000, 700, 256), (1500, 300, 16), (800, 400, 2),
                                         (300, 5, 256)])
def test_each_value_errs_by_at_most_its_buckets_width(d, k, buckets):
  run = jax.jit(lambda x: roundtrip(commopt.compressors.sketchml(k=k, buckets=buckets), x))
  for seed in range(5):
    x = inputs(seed, d)
    y = np.asarray(run(jnp.asarray(x)))
    keys = checks.top_k_indices(x, k)
    assert not np.any(np.delete(y, keys))
    split, width = reference_buckets(x[keys], min(buckets // 2, k))
    np.testing.assert_array_equal(y[keys], np.where(x[keys] < 0, -split, split))
    assert np.all(np.abs(x[keys] - y[keys]) <= width)
    assert np.all(np.abs(y) <= np.abs(x)) and np.all(y * x >= 0)


@pytest.mark.parametrize("n_neg,per_sign", [(0, 4), (9, 4), (17, 4), (3, 100), (12, 5)])
def test_quantile_buckets_hold_equal_counts(n_neg, per_sign):
  k = 17
  rng = np.random.default_rng(n_neg)
  v = rng.uniform(0.1, 5.0, k).astype(np.float32)
  v[:n_neg] *= -1
  codes, splits = jax.jit(quantile_buckets, static_argnums=1)(jnp.asarray(v), per_sign)
  codes = np.asarray(codes)
  for negative, n in ((False, k - n_neg), (True, n_neg)):
    if n == 0:
      continue
    sizes = np.bincount(codes[(v < 0) == negative], minlength=per_sign)
    run = -(-n // per_sign)
    used = -(-n // run)
    np.testing.assert_array_equal(sizes[:used - 1], run)
    assert 1 <= sizes[used - 1] <= run and not sizes[used:].any()
  assert splits.shape == (min(k, 2 * per_sign),)


# --- the MinMaxSketch ----------------------------------------------------------------


@pytest.mark.parametrize("cells,rows", [(0.25, 1), (1.0, 3), (4.0, 2)])
def test_the_sketch_never_over_estimates(cells, rows):
  per_key = jax.jit(lambda x: roundtrip(commopt.compressors.sketchml(k=300, buckets=64), x))
  sketched = jax.jit(lambda x: roundtrip(
      commopt.compressors.sketchml(k=300, buckets=64, sketch_ratio=cells, rows=rows, seed=rows), x))
  for seed in range(4):
    x = inputs(seed, 1500)
    q, y = np.asarray(per_key(jnp.asarray(x))), np.asarray(sketched(jnp.asarray(x)))
    # Never a larger magnitude than the quantisation alone gives, nor than the value itself.
    assert np.all(np.abs(y) <= np.abs(q)) and np.all(np.abs(y) <= np.abs(x))
    assert np.all(y * x >= 0) and not np.any(y[q == 0])
    if cells <= 1:   # fewer cells than keys: some index must be lost
      assert np.any(np.abs(y) < np.abs(q))


def test_a_key_reads_its_own_code_unless_every_row_holds_a_smaller_one():
  rng = np.random.default_rng(3)
  keys = jnp.asarray(np.sort(rng.choice(10**5, 500, replace=False)), jnp.int32)
  codes = jnp.asarray(rng.integers(0, 64, 500), jnp.uint32)
  seeds = jnp.asarray(rng.integers(0, 2**32, (3, 2), dtype=np.uint64).astype(np.uint32))
  table = minmax_sketch(keys, codes, seeds, 700, 63)
  got = np.asarray(minmax_query(table, keys, seeds, 700))
  cells = np.asarray(table)[np.asarray(_slots(keys, seeds, 700))]    # [rows, k]
  codes = np.asarray(codes)
  assert np.all(cells <= codes) and np.all(got <= codes)
  # Exact where some row's cell holds no smaller code: here most keys, not all.
  np.testing.assert_array_equal(got == codes, np.any(cells == codes, axis=0))
  assert 0.8 < np.mean(got == codes) < 1.0


@pytest.mark.slow
def test_indices_per_key_beat_the_sketch_at_fewer_bits():
  """The measurement behind the default: a sketch of k/2 cells errs more, and costs more,
  than indices per key with 16 buckets."""
  d = 10_000
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal(d), jnp.float32)
  kept = np.asarray(roundtrip(commopt.top_k(0.01), x))
  error = {}
  for name, c in (("sketch", commopt.compressors.sketchml(0.01, sketch_ratio=0.5, rows=2)),
                  ("per-key", commopt.compressors.sketchml(0.01, buckets=16))):
    y = np.asarray(roundtrip(c, x))
    error[name] = (np.linalg.norm(kept - y) / np.linalg.norm(kept),
                   c.payload_bits((d,), jnp.float32))
  assert error["per-key"][0] < error["sketch"][0] / 2
  assert error["per-key"][1] < error["sketch"][1]


# --- error feedback ------------------------------------------------------------------


@pytest.mark.parametrize("opts", [{}, {"sketch_ratio": 0.5}], ids=["per-key", "sketch"])
def test_error_feedback_keeps_what_was_not_sent(opts):
  """Locally: the input plus the old residual is the output plus the new residual."""
  tx = commopt.compressed_mean(commopt.compressors.sketchml(0.05, buckets=8, **opts), min_size=0)
  params = {"w": jnp.zeros((40, 30))}
  state = tx.init(params)
  update = jax.jit(tx.update)
  rng = np.random.default_rng(2)
  for _ in range(4):
    u = {"w": jnp.asarray(rng.normal(size=(40, 30)), jnp.float32)}
    before = np.asarray(state.residual["w"])
    out, state = update(u, state)
    np.testing.assert_allclose(np.asarray(out["w"]) + np.asarray(state.residual["w"]),
                               np.asarray(u["w"]) + before, rtol=0, atol=1e-6)
    assert np.count_nonzero(np.asarray(out["w"])) <= 60


# --- arguments -----------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,name", [
    ({"ratio": 0.1, "buckets": 3}, "buckets"), ({"ratio": 0.1, "buckets": 0}, "buckets"),
    ({"ratio": 0.1, "buckets": 2**17}, "buckets"),
    ({"ratio": 0.1, "sketch_ratio": 0.0}, "sketch_ratio"),
    ({"ratio": 0.1, "sketch_ratio": 0.5, "rows": 0}, "rows"), ({"ratio": 0.1, "seed": -1}, "seed"),
    ({"ratio": 0.1, "k": 3}, "ratio"), ({"ratio": 1.5}, "ratio"), ({"k": 0}, "k"),
])
def test_bad_arguments_name_the_argument(kwargs, name):
  with pytest.raises(ValueError, match=f"`{name}`"):
    commopt.compressors.sketchml(**kwargs)
