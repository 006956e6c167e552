"""Dense leaves share all-reduces: flat buffers of at most bucket_bytes, or one tuple."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import commopt
from commopt import wire
from commopt.comm import _exchange
from commopt.testing import assert_same_bits, host_copy
from commopt.transforms import apply_if_finite

N = 8


def _params():
  k = jax.random.split(jax.random.key(0), 3)
  return {"w1": jax.random.normal(k[0], (32, 64)) / 8, "b1": jnp.zeros(64),
          "w2": jax.random.normal(k[1], (64, 10)) / 8, "b2": jnp.zeros(10),
          "s": jnp.ones((), jnp.bfloat16)}


def _loss(p, b):
  h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
  return jnp.mean((h @ p["w2"] + p["b2"] - b["y"]) ** 2) * p["s"].astype(jnp.float32)


def _batch(scale=1.0, seed=1):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {"x": scale * jax.random.normal(k1, (N * 4, 32)), "y": jax.random.normal(k2, (N * 4, 10))}


def _dp(mesh, bucket_bytes, compressor=None, skip=True, lr=0.05):
  c = compressor if compressor is not None else commopt.compressors.identity()
  tx = optax.chain(commopt.compressed_mean(c, axis_name="data", bucket_bytes=bucket_bytes),
                   optax.adam(lr))
  return commopt.data_parallel(_loss, tx, mesh, skip_nonfinite=skip)


def _train(dp, steps=3, params=None):
  params = _params() if params is None else params
  state = dp.init(params)
  losses = []
  for i in range(steps):
    params, state, loss = dp.step(params, state, _batch(seed=i))
    losses.append(loss)
  return host_copy(params), host_copy(state), np.asarray(losses)


def _mean_in_shard_map(mesh, bucket_bytes, grads):
  from jax.sharding import PartitionSpec as P
  tx = commopt.compressed_mean(commopt.compressors.identity(), axis_name="data",
                               bucket_bytes=bucket_bytes)

  @jax.jit
  def run(grads):
    def body(g):
      g = jax.tree.map(lambda x: x[0], g)
      u, _ = tx.update(g, tx.init(g))
      return u
    return jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P())(grads)
  return host_copy(run(jax.device_put(grads, jax.sharding.NamedSharding(mesh, P("data")))))


@pytest.mark.slow
@pytest.mark.parametrize("bucket_bytes", [pytest.param(4, marks=pytest.mark.slow), 1024, 10**9])
def test_flat_buckets_equal_the_tuple_all_reduce_bit_for_bit(mesh, bucket_bytes):
  # The same pre-scaled sum and division on every element, however the leaves are
  # packed: buffers of one leaf each (4 bytes: every leaf alone), of a few leaves, of all.
  grads = jax.tree.map(lambda x: jax.random.normal(jax.random.key(x.size), (N,) + x.shape,
                                                   x.dtype) * 1e3, _params())
  assert_same_bits(_mean_in_shard_map(mesh, bucket_bytes, grads),
                   _mean_in_shard_map(mesh, None, grads))


@pytest.mark.slow
def test_flat_buckets_train_like_the_tuple_all_reduce(mesh):
  # In a step the compiler lays out the gradients' producers differently when they feed
  # a concatenation, so the two agree to float rounding, not bit for bit.
  ref, got = _train(_dp(mesh, None)), _train(_dp(mesh, 1024))
  for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=1e-4, atol=1e-6)


def _all_reduces(dp):
  params = _params()
  return [c for c in wire.hlo_collectives(dp, params, dp.init(params), _batch())
          if c.kind == "all-reduce"]


def test_one_flat_buffer_per_dtype(mesh):
  # w1 (2048) + b1 (64) + w2 (640) + b2 (10) float32 values: one buffer; the bfloat16
  # scalar: a second. The skip's flag rides in the float32 buffer, one element more.
  reduces = _all_reduces(_dp(mesh, 10**9, skip=False))
  shapes = sorted(s for c in reduces for s in c.shapes)
  assert shapes == [(1,), (2048 + 64 + 640 + 10,)], shapes
  assert all(c.group_size == N for c in reduces)
  with_skip = _all_reduces(_dp(mesh, 10**9))
  assert sorted(s for c in with_skip for s in c.shapes) == [(1,), (2048 + 64 + 640 + 10 + 1,)]
  assert not any("s32" in c.dtypes for c in with_skip)


def test_capped_buckets_and_tuple_mode(mesh):
  # 8 KB cap, leaves in the tree's order (b1, b2, s, w1, w2): b1 + b2, then w1 (8192
  # bytes) alone, then w2; the bfloat16 scalar in its own buffer.
  capped = _all_reduces(_dp(mesh, 8192, skip=False))
  assert sorted(s for c in capped for s in c.shapes) == [(1,), (64 + 10,), (640,), (2048,)]
  # No flat buffers: the leaves as they are, in one tuple all-reduce per dtype.
  plain = _all_reduces(_dp(mesh, None, skip=False))
  shapes = [s for c in plain for s in c.shapes]
  assert sorted(shapes, key=str) == sorted([(32, 64), (64,), (64, 10), (10,), ()], key=str)


def test_auto_keeps_leaves_whole_in_one_process(mesh):
  assert not _exchange.flat_by_default()
  assert _exchange.resolve("auto") is None and _exchange.resolve(4096) == 4096


@pytest.mark.parametrize("bucket_bytes", [None, 1024])
def test_nonfinite_gradient_on_one_worker_is_skipped_by_every_worker(mesh, bucket_bytes):
  dp = _dp(mesh, bucket_bytes)
  params = _params()
  state = dp.init(params)
  params, state, _ = dp.step(params, state, _batch())
  before_p, before_s = host_copy(params), host_copy(state)
  bad = _batch(seed=2)
  bad["x"] = bad["x"].at[5, 0].set(jnp.nan)   # one row of worker 1
  params, state, _ = dp.step(params, state, bad)
  assert_same_bits(host_copy(params), before_p)
  assert_same_bits(host_copy(state.inner_state), before_s.inner_state)
  assert int(state.total_notfinite) == 1 and not bool(state.last_finite)
  params, state, _ = dp.step(params, state, _batch(seed=3))
  assert bool(state.last_finite) and int(state.total_notfinite) == 1


def test_overflow_after_the_exchange_is_still_skipped(mesh):
  # Finite gradients (10 everywhere), an update that overflows (1e39): the output
  # check, not the rider, skips it.
  tx = optax.chain(commopt.compressed_mean(commopt.compressors.identity(), axis_name="data"),
                   optax.sgd(1e38))
  dp = commopt.data_parallel(lambda p, b: jnp.mean(b["x"] @ p["w"]), tx, mesh)
  params = {"w": jnp.zeros(4)}
  state = dp.init(params)
  params, state, _ = dp.step(params, state, {"x": jnp.full((N, 4), 10.0)})
  assert_same_bits(host_copy(params), {"w": np.zeros(4, np.float32)})
  assert not bool(state.last_finite) and int(state.total_notfinite) == 1


def test_skip_in_a_users_shard_map(mesh):
  # apply_if_finite in the user's own shard_map: one worker's NaN skips every worker.
  from jax.sharding import PartitionSpec as P
  tx = apply_if_finite(optax.chain(
      commopt.compressed_mean(commopt.compressors.identity(), axis_name="data"),
      optax.sgd(0.1)), axis_name="data")
  x = jnp.arange(N * 3, dtype=jnp.float32).reshape(N, 3)

  @jax.jit
  def run(x):
    def body(g):
      g = g[0]
      state = tx.init(jnp.zeros(3))
      u, s = tx.update(g, state, jnp.zeros(3))
      return u[None], s.last_finite[None]
    return jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"))(x)

  put = lambda v: jax.device_put(v, jax.sharding.NamedSharding(mesh, P("data")))
  u, ok = run(put(x))
  np.testing.assert_allclose(np.asarray(u)[0], -0.1 * np.asarray(x).mean(0), rtol=1e-6)
  assert np.all(np.asarray(ok))
  u, ok = run(put(x.at[3, 1].set(jnp.nan)))
  assert not np.any(np.asarray(ok)) and np.all(np.asarray(u) == 0)


def test_bucket_bytes_is_checked():
  with pytest.raises(ValueError, match="bucket_bytes"):
    commopt.compressed_mean(commopt.compressors.identity(), axis_name="data", bucket_bytes=0)
  with pytest.raises(TypeError, match="bucket_bytes"):
    commopt.compressed_mean(commopt.compressors.identity(), axis_name="data", bucket_bytes="big")
