"""PowerSGD: the matrix view, exactness at full rank, and warm-start convergence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import commopt
from commopt import wire


def run(tx, m, steps):
  state = tx.init({"w": m})
  update = jax.jit(tx.update)
  for _ in range(steps):
    out, state = update({"w": m}, state)
  return out["w"], state


@pytest.mark.parametrize("shape", [(6, 9), (9, 6), (3, 4, 5)])
def test_exact_when_rank_covers_the_matrix(shape):
  m = jnp.asarray(np.random.default_rng(0).normal(size=shape), jnp.float32)
  n_, m_ = int(np.prod(shape[:-1])), shape[-1]
  tx = commopt.compressed_mean(commopt.power_sgd(rank=min(n_, m_), min_compression_rate=0),
                               error_feedback=False, min_size=0)
  out, _ = run(tx, m, 1)
  np.testing.assert_allclose(out, m, atol=1e-4)


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_warm_start_approaches_best_rank_r(rank):
  rng = np.random.default_rng(1)
  u, _ = np.linalg.qr(rng.normal(size=(60, 60)))
  v, _ = np.linalg.qr(rng.normal(size=(40, 40)))
  s = np.geomspace(10.0, 0.1, 40)
  m = (u[:, :40] * s) @ v.T
  best = (u[:, :rank] * s[:rank]) @ v[:, :rank].T
  tx = commopt.compressed_mean(commopt.power_sgd(rank=rank), error_feedback=False, min_size=0)
  first, _ = run(tx, jnp.asarray(m, jnp.float32), 1)
  late, _ = run(tx, jnp.asarray(m, jnp.float32), 60)
  err_best = np.linalg.norm(m - best)
  assert np.linalg.norm(m - np.asarray(late)) <= 1.01 * err_best
  assert np.linalg.norm(np.asarray(late) - best) < np.linalg.norm(np.asarray(first) - best)


def test_matrix_view_keeps_output_features_on_one_side():
  conv = jnp.zeros((3, 3, 16, 32))  # HWIO
  c = commopt.power_sgd(rank=4)
  assert c.payload_bits(conv.shape, conv.dtype) == (3 * 3 * 16 + 32) * 4 * 32
  assert c.init(conv).q.shape == (32, 4)
  first = commopt.power_sgd(rank=4, view="first")
  assert first.init(conv).q.shape == (3 * 16 * 32, 3)   # rank clipped to n = 3
  custom = commopt.power_sgd(rank=4, view=lambda s: (s[0] * s[1], s[2] * s[3]))
  assert custom.init(conv).q.shape == (16 * 32, 4)


def test_small_and_vector_leaves_go_dense():
  c = commopt.power_sgd(rank=2, min_compression_rate=2.0)
  assert not c.accepts((128,), jnp.float32)
  assert not c.accepts((4, 4), jnp.float32)     # 16 / (8 * 2) = 1 < 2
  assert c.accepts((64, 64), jnp.float32)
  report = wire.payload_bytes(c, {"v": jnp.zeros(128), "small": jnp.zeros((4, 4)),
                                  "m": jnp.zeros((64, 64))}, min_size=0)
  assert report.compressed == {"v": False, "small": False, "m": True}
  assert report.per_leaf["m"] == (64 + 64) * 2 * 4


def test_q_is_the_same_on_every_worker_and_warm_started():
  mesh = jax.make_mesh((8,), ("data",))
  tx = commopt.compressed_mean(commopt.power_sgd(rank=2), "data", min_size=0)
  sm = commopt.testing.shard_map_workers(tx, mesh, "data")
  rng = np.random.default_rng(2)
  state = sm.init({"w": jnp.zeros((32, 24))})
  q0 = np.asarray(state.compressor_state["w"].q)
  u = {"w": jnp.asarray(rng.normal(size=(8, 32, 24)), jnp.float32)}
  _, state = sm.update(u, state)
  q1 = np.asarray(state.compressor_state["w"].q)
  assert not np.allclose(q0, q1)
  np.testing.assert_allclose(q1, np.broadcast_to(q1[0], q1.shape), rtol=1e-6)


def test_zero_step_keeps_the_warm_start():
  m = jnp.outer(jnp.arange(1.0, 9.0), jnp.arange(1.0, 7.0))
  tx = commopt.compressed_mean(commopt.power_sgd(rank=1), error_feedback=False, min_size=0)
  state = tx.init({"w": m})
  _, state = tx.update({"w": m}, state)
  _, state = tx.update({"w": jnp.zeros_like(m)}, state)
  out, _ = tx.update({"w": m}, state)
  np.testing.assert_allclose(out["w"], m, rtol=1e-4)
