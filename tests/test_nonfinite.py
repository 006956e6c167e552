"""Nothing non-finite reaches the parameters: finite inputs that overflow inside the exchange."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import commopt
from commopt.testing import assert_same_bits, host_copy
from commopt import wire
from commopt.comm import _collectives as coll
from commopt.transforms import apply_if_finite

N = 8
BIG = 2.0 ** 64   # ≈ 1.8e19: its squares overflow float32


def _roundtrip(compressor, x, seed=0):
  @jax.jit
  def run(x):
    payload, _ = compressor.encode(x, compressor.init(x), jax.random.key(seed))
    return compressor.decode(payload, None, x)
  return run(x)


# -- norms and scales ----------------------------------------------------------------


def test_qsgd_at_1e19_sends_finite_norms():
  c = commopt.qsgd(levels=7, bucket_size=512)
  x = jnp.full((1024,), 1e19, jnp.float32)
  payload, _ = jax.jit(c.encode)(x, None, jax.random.key(0))
  np.testing.assert_allclose(payload["norms"], 1e19 * np.sqrt(512), rtol=1e-6)
  y = jax.jit(c.decode)(payload, None, x)
  assert np.all(np.isfinite(y)) and np.all(np.asarray(y) >= 0)
  # Every level is a multiple of the bucket's norm / 7.
  np.testing.assert_allclose(np.unique(np.asarray(y)), [0.0, 1e19 * np.sqrt(512) / 7], rtol=1e-6)


@pytest.mark.parametrize("name,compressor", [
    ("qsgd", commopt.qsgd(levels=7, bucket_size=64)),
    ("terngrad", commopt.compressors.terngrad(clip=2.5)),
    ("adaptive_levels", commopt.compressors.adaptive_levels(levels=8, bins=32)),
])
def test_quantisers_scale_by_powers_of_two_exactly(name, compressor):
  # Scaling an input by 2^64 scales the reconstruction by 2^64, bit for bit:
  # norms, standard deviations and moments are taken without overflow.
  x = jax.random.normal(jax.random.key(1), (512,))
  small = np.asarray(_roundtrip(compressor, x))
  big = np.asarray(_roundtrip(compressor, x * BIG))
  assert np.all(np.isfinite(big)), name
  np.testing.assert_array_equal(big, small * BIG)


def test_qsgd_norms_of_ordinary_inputs_are_unchanged():
  from commopt._src import base
  from commopt.compressors._qcommon import _block_norms
  for scale in (1e-6, 1.0, 3e5):
    blocks = base.blocks(scale * jax.random.normal(jax.random.key(2), (1000,)), 64)
    np.testing.assert_array_equal(_block_norms(blocks), jnp.linalg.norm(blocks, axis=1))


def _rank_two_workers(scale):
  """Every worker's matrix a multiple of one rank-2 matrix: so is the mean."""
  a = jax.random.normal(jax.random.key(3), (16, 2))
  b = jax.random.normal(jax.random.key(4), (2, 12))
  c = 1.0 + jnp.arange(N, dtype=jnp.float32)[:, None, None] / N
  return {"w": scale * c * (a @ b)}


@pytest.mark.parametrize("options", [
    {},
    {"orthogonalization_epsilon": 1e-8},
    {"batched": True, "residual": "local"},
])
def test_power_sgd_after_inputs_of_1e30(options):
  tx = commopt.compressed_mean(
      commopt.power_sgd(rank=2, min_compression_rate=0, **options), axis_name="workers", min_size=0)
  workers = commopt.testing.vmap_workers(tx, N)
  u = _rank_two_workers(1e30)
  want = np.asarray(u["w"]).mean(0)
  state = workers.init({"w": u["w"][0]})
  for _ in range(3):   # Q carries the inputs' magnitude from one step to the next
    out, state = workers.update(u, state)
    assert np.all(np.isfinite(out["w"]))
    np.testing.assert_allclose(out["w"][0], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    # Rank 2 holds the mean: what error feedback keeps stays finite too.
    assert np.all(np.isfinite(state.residual["w"]))


def test_atomo_at_1e30_is_finite():
  c = commopt.compressors.atomo(budget=2)
  m = 1e30 * _rank_two_workers(1.0)["w"][0]
  y = _roundtrip(c, m)
  np.testing.assert_allclose(y, m, rtol=1e-4, atol=1e-4 * float(jnp.abs(m).max()))


# -- 16-bit sums across workers ------------------------------------------------------


def _mean_over_mesh(tx, u, mesh):
  workers = commopt.testing.shard_map_workers(tx, mesh, "data")
  state = workers.init(jax.tree.map(lambda x: x[0], u))
  out, _ = workers.update(u, state)
  return workers, state, out


@pytest.mark.parametrize("dtype,value", [(jnp.float16, 6e4), (jnp.bfloat16, 3e38)])
def test_dense_16_bit_mean_of_8_workers_does_not_overflow(mesh, dtype, value):
  # Below min_size the leaf is sent dense: one all-reduce of 16-bit values.
  tx = commopt.compressed_mean(commopt.scaled_sign(), axis_name="data", min_size=10 ** 6)
  u = {"w": jnp.full((N, 64), value, dtype)}
  workers, state, out = _mean_over_mesh(tx, u, mesh)
  assert out["w"].dtype == dtype and np.all(np.isfinite(np.asarray(out["w"], np.float32)))
  # The all-reduce adds in 16 bits: each partial sum rounds.
  np.testing.assert_allclose(np.asarray(out["w"], np.float32), np.asarray(u["w"], np.float32),
                             rtol=N * float(jnp.finfo(dtype).eps))
  # Still 16 bits on the wire: nothing is widened before the all-reduce.
  reduces = [c for c in wire.hlo_collectives(workers.update, u, state)
             if c.kind == "all-reduce" and (64,) in c.shapes]
  narrow = jnp.dtype(dtype).name.replace("float", "f")   # f16, bf16
  assert reduces and all(c.dtypes == (narrow,) and c.contributed_bytes == 128 for c in reduces)


def test_cast_float16_payload_of_8_workers_does_not_overflow(mesh):
  tx = commopt.compressed_mean(commopt.cast("float16"), axis_name="data", min_size=0)
  u = {"w": jnp.full((N, 256), 6e4, jnp.float32)}
  workers, state, out = _mean_over_mesh(tx, u, mesh)
  assert np.all(np.isfinite(out["w"]))
  np.testing.assert_allclose(out["w"], 6e4, rtol=N * float(jnp.finfo(jnp.float16).eps))
  reduces = [c for c in wire.hlo_collectives(workers.update, u, state) if c.kind == "all-reduce"
             and (256,) in c.shapes]
  assert reduces and all(c.dtypes == ("f16",) and c.contributed_bytes == 512 for c in reduces)


def test_pmean_matches_psum_over_n_bit_for_bit():
  # Pre-scaling by a power of two is exact: ordinary values give the old bits,
  # for any number of workers.
  for n in (3, 6, 8):
    x = jax.random.normal(jax.random.key(n), (n, 333))
    for dtype in (jnp.float32, jnp.bfloat16):
      v = x.astype(dtype)
      old = jax.jit(jax.vmap(lambda t: (jax.lax.psum(t, "i") / n).astype(t.dtype),
                             axis_name="i"))(v)
      new = jax.jit(jax.vmap(lambda t: coll.pmean(t, "i"), axis_name="i"))(v)
      assert_same_bits(new, old)


def test_float32_dense_mean_is_lax_pmean_and_its_overflow_is_skipped(mesh):
  # Float32 leaves are summed as they are (no pre-scaling pass): the mean is lax.pmean's
  # bit for bit, near 3.4e38 too, where 8 workers' sum overflows; data_parallel's skip
  # then drops the step, so nothing non-finite reaches the parameters.
  x = jnp.full((N, 5), 1e38, jnp.float32).at[:, 0].set(jax.random.normal(jax.random.key(0), (N,)))
  ours = jax.jit(jax.vmap(lambda t: coll.pmean(t, "i"), axis_name="i"))(x)
  theirs = jax.jit(jax.vmap(lambda t: jax.lax.pmean(t, "i"), axis_name="i"))(x)
  assert_same_bits(ours, theirs)
  assert np.all(np.isinf(np.asarray(ours)[:, 1:]))
  tx = optax.chain(commopt.compressed_mean(commopt.compressors.identity(), axis_name="data"),
                   optax.sgd(1.0))
  dp = commopt.data_parallel(lambda p, b: jnp.mean(b["x"] @ p["w"]), tx, mesh)
  params = {"w": jnp.zeros(4)}
  state = dp.init(params)
  params, state, _ = dp.step(params, state, {"x": jnp.full((N, 4), 3e38)})
  assert_same_bits(host_copy(params), {"w": np.zeros(4, np.float32)})
  assert int(state.total_notfinite) == 1


# -- the skip covers the reduced update ----------------------------------------------


def test_apply_if_finite_skips_an_update_that_overflows():
  tx = apply_if_finite(optax.sgd(1e30))
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  out, state = tx.update({"w": jnp.full(3, 1e10)}, state, params)   # finite in, inf out
  assert_same_bits(optax.apply_updates(params, out), params)
  assert not bool(state.last_finite) and int(state.total_notfinite) == 1
  out, state = tx.update({"w": jnp.ones(3)}, state, params)
  assert bool(state.last_finite) and int(state.total_notfinite) == 1
  assert int(state.notfinite_count) == 0 and np.all(np.asarray(out["w"]) == -1e30)


def test_apply_if_finite_reads_only_replicated_updates(mesh):
  # Per-worker (varying) updates never decide the skip: one worker's overflow
  # alone skips nothing, and the counters stay replicated.
  tx = apply_if_finite(optax.scale(1e30), axis_name="data")
  u = {"w": jnp.ones((N, 4)).at[3].set(1e10)}
  workers = commopt.testing.shard_map_workers(tx, mesh, "data")
  out, state = workers.update(u, workers.init({"w": jnp.ones(4)}))
  assert np.all(np.asarray(state.last_finite)) and np.all(np.asarray(state.total_notfinite) == 0)
  w = np.asarray(out["w"])
  assert np.isinf(w[3]).all() and np.isfinite(np.delete(w, 3, 0)).all()


def _loss(p, b):
  return jnp.mean(b["x"] @ p["w"])


def test_data_parallel_skips_a_reduced_update_that_overflows(mesh):
  # The gradients are finite on every worker (about 1e18); the step size makes
  # the reduced update overflow. The step is skipped on every worker.
  tx = optax.chain(commopt.compressed_mean(commopt.scaled_sign(), axis_name="data"),
                   optax.sgd(1e30))
  dp = commopt.data_parallel(_loss, tx, mesh)
  params = {"w": 0.1 * jax.random.normal(jax.random.key(5), (32, 64))}
  state = dp.init(params)
  batch = lambda scale: {"x": scale * jax.random.normal(jax.random.key(6), (N * 2, 32))}
  params, state, losses = dp.step(params, state, batch(1e-25))
  params_before, state_before = host_copy(params), host_copy(state)
  assert bool(state.last_finite)
  residual = state_before.inner_state[0].residual["w"]
  assert residual.shape == (N, 32, 64) and np.any(residual != 0)

  params, state, losses = dp.step(params, state, batch(1e20))
  assert np.all(np.isfinite(losses))
  assert_same_bits(host_copy(params), params_before)
  assert not bool(state.last_finite)
  assert int(state.total_notfinite) == 1 and int(state.notfinite_count) == 1
  assert_same_bits(host_copy(state.inner_state), state_before.inner_state)

  params, state, losses = dp.step(params, state, batch(1e-25))
  assert np.all(np.isfinite(params["w"]))
  assert bool(state.last_finite) and int(state.total_notfinite) == 1
  assert int(state.inner_state[0].count) == 2


def test_reduced_update_check_adds_no_collective(mesh):
  tx = optax.chain(commopt.compressed_mean(commopt.scaled_sign(), axis_name="data"), optax.sgd(0.1))
  params = {"w": jnp.zeros((32, 64))}
  batch = {"x": jnp.ones((N * 2, 32))}
  audits = {}
  for skip in (False, True):
    dp = commopt.data_parallel(_loss, tx, mesh, skip_nonfinite=skip)
    audits[skip] = wire.hlo_collectives(dp, params, dp.init(params), batch)
  key = lambda c: (c.kind, c.dtypes, c.shapes, c.group_size, c.contributed_bytes)
  extra = [key(c) for c in audits[True]]
  for c in audits[False]:
    extra.remove(key(c))
  # The input flag's int32 all-reduce is the only collective the skip adds.
  assert len(extra) == 1 and extra[0][:2] == ("all-reduce", ("s32",))


def test_safe_norm_is_the_plain_norm_and_finite_at_1e30():
  """The norms of LAMB's trust ratio and DGC's clipping: same bits, no overflow."""
  from commopt._src import base
  x = jnp.asarray(np.random.default_rng(0).normal(size=1000), jnp.float32)
  assert base.safe_norm([x]) == jnp.sqrt(jnp.sum(x * x))
  big = base.safe_norm([x * 1e30, x[:10] * 1e30])
  assert np.isfinite(big)
  np.testing.assert_allclose(big / 1e30,
                             np.sqrt(np.sum(np.square(np.asarray(x, np.float64)))
                                     + np.sum(np.square(np.asarray(x[:10], np.float64)))),
                             rtol=1e-5)
  assert float(base.safe_norm([jnp.zeros(3)])) == 0.0
  assert np.isnan(base.safe_norm([jnp.array([1.0, np.nan])]))
