"""PowerSGD: the matrix view, exactness at full rank, warm-start convergence, and the
options of PyTorch's hook (dense warm-up, Gram-Schmidt epsilon, float64, residual, batching)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

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
  tx = commopt.compressed_mean(commopt.power_sgd(rank=2), axis_name="data", min_size=0)
  sm = commopt.testing.shard_map_workers(tx, mesh, "data")
  rng = np.random.default_rng(2)
  state = sm.init({"w": jnp.zeros((32, 24))})
  q0 = np.asarray(state.compressor_state["w"].q)
  u = {"w": jnp.asarray(rng.normal(size=(8, 32, 24)), jnp.float32)}
  _, state = sm.update(u, state)
  q1 = np.asarray(state.compressor_state["w"].q)
  assert not np.allclose(q0, q1)
  np.testing.assert_allclose(q1, np.broadcast_to(q1[0], q1.shape), rtol=1e-6)


@pytest.mark.slow
def test_zero_step_keeps_the_warm_start():
  m = jnp.outer(jnp.arange(1.0, 9.0), jnp.arange(1.0, 7.0))
  tx = commopt.compressed_mean(commopt.power_sgd(rank=1), error_feedback=False, min_size=0)
  state = tx.init({"w": m})
  _, state = tx.update({"w": m}, state)
  _, state = tx.update({"w": jnp.zeros_like(m)}, state)
  out, _ = tx.update({"w": m}, state)
  np.testing.assert_allclose(out["w"], m, rtol=1e-4)


# ---------------------------------------------------------------------------
# The options of PyTorch's PowerSGD hook: start_iter, orthogonalization_epsilon,
# float64 leaves, residual, batched.

N = 8
EPS32 = float(np.finfo(np.float32).eps)


def worker_inputs(seed, shape, n=N, dtype=np.float32):
  return np.random.default_rng(seed).normal(size=(n,) + shape).astype(dtype)


def scanned(tx, mesh, us, state):
  """``tx.update`` over the steps of ``us`` (``[T, N, ...]``) in one ``lax.scan`` in ``jit``,
  one worker per device: ``(outputs [T, N, ...], state)``."""
  first = lambda t: jax.tree.map(lambda x: x[0], t)

  def body(us, s):
    def step(s, u):
      out, s = tx.update(u, s)
      return s, out
    s, outs = jax.lax.scan(step, first(s), jax.tree.map(lambda x: x[:, 0], us))
    return jax.tree.map(lambda x: x[:, None], outs), jax.tree.map(lambda x: x[None], s)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "data"), P("data")),
                            out_specs=(P(None, "data"), P("data"))))
  with jax.set_mesh(mesh):
    return f(jax.device_put(us, NamedSharding(mesh, P(None, "data"))),
             jax.device_put(state, NamedSharding(mesh, P("data"))))


def test_start_iter_sends_exact_means_then_rank_r(mesh):
  shape, start, steps = (32, 24), 3, 6
  params = {"w": jnp.zeros(shape)}
  tx = commopt.compressed_mean(commopt.power_sgd(rank=2, start_iter=start), axis_name="data", min_size=0)
  us = np.stack([worker_inputs(10 + t, shape) for t in range(steps)])
  with wire.record_collectives() as rec:
    sm = commopt.testing.shard_map_workers(tx, mesh, "data")
    state = init = sm.init(params)
    outs = []
    for t in range(steps):
      out, state = sm.update({"w": us[t]}, state)
      out, res = np.asarray(out["w"]), np.asarray(state.residual["w"])
      outs.append(out)
      count = np.asarray(state.compressor_state["w"].count)
      assert np.all(count == t + 1)                      # the same on every worker
      # What ran is what the plan for this step says: the leaf, then the factors.
      plan = wire.comm_plan(tx, params, N, step=t)
      assert sum(nbytes for _, nbytes in rec.of_worker(0)) == plan.contributed_bytes
      assert rec.of_worker(0) == ([("all-reduce", 32 * 24 * 4)] if t < start else
                                  [("all-reduce", 32 * 2 * 4), ("all-reduce", 24 * 2 * 4)])
      rec.clear()
      mean = us[t].astype(np.float64).mean(0)
      if t < start:
        # The exact mean (up to the float32 rounding of a sum of 8), nothing owed.
        np.testing.assert_allclose(out, np.broadcast_to(mean, out.shape), rtol=0,
                                   atol=N * EPS32 * np.abs(us[t]).max())
        assert not res.any()
      else:
        assert np.linalg.matrix_rank(out[0], tol=1e-4) == 2
        assert np.abs(out[0] - mean).max() > 0.1 and np.abs(res).max() > 0.1
      np.testing.assert_array_equal(out, np.broadcast_to(out[0], out.shape))
  # The plan without a step is the compressed one.
  assert wire.comm_plan(tx, params, N).contributed_bytes == (32 + 24) * 2 * 4
  # The same steps in one lax.scan inside jit.
  scan_outs, scan_state = scanned(tx, mesh, {"w": us}, init)
  np.testing.assert_allclose(np.asarray(scan_outs["w"]), np.stack(outs), rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(scan_state.compressor_state["w"].count) == steps)


def test_start_iter_plans_the_leaf_dense_for_a_compressor():
  params = {"w": jnp.zeros((64, 48)), "b": jnp.zeros(48)}
  c = commopt.power_sgd(rank=2, start_iter=5)
  assert c.dense_steps == 5
  warm, late = (wire.comm_plan(c, params, N, step=t) for t in (4, 5))
  assert warm.contributed_bytes == (64 * 48 + 48) * 4
  assert not any(e.packed for e in warm.collectives)
  assert late.contributed_bytes == (64 + 48) * 2 * 4 + 48 * 4


@pytest.mark.slow
def test_float64_leaves_stay_float64_and_match_numpy():
  shape, rank, steps = (40, 30), 3, 3
  us = [worker_inputs(20 + t, shape, dtype=np.float64) for t in range(steps)]

  def run(dtype):
    tx = commopt.compressed_mean(commopt.power_sgd(rank=rank), axis_name="data", min_size=0)
    w = commopt.testing.vmap_workers(tx, N, "data")
    state = w.init({"w": jnp.zeros(shape, dtype)})
    q0 = np.asarray(state.compressor_state["w"].q[0], np.float64)
    outs = []
    for u in us:
      out, state = w.update({"w": jnp.asarray(u, dtype)}, state)
      outs.append(np.asarray(out["w"][0]))
    return q0, outs, state, out["w"].dtype

  with jax.enable_x64(True):
    q0, outs64, state, dtype = run(jnp.float64)
    assert dtype == jnp.float64
    assert state.compressor_state["w"].q.dtype == jnp.float64
    assert state.residual["w"].dtype == jnp.float64
  assert not jax.config.jax_enable_x64 and jnp.zeros(1).dtype == jnp.float32   # not leaked
  _, outs32, _, dtype32 = run(jnp.float32)
  assert dtype32 == jnp.float32

  # The protocol in NumPy float64 (aggregate residual), from the same Q.
  q, e = q0, np.zeros((N,) + shape)
  for t, u in enumerate(us):
    m = u + e
    p_hat, _ = np.linalg.qr(np.mean(m @ q, axis=0))
    q = np.mean(np.swapaxes(m, 1, 2) @ p_hat, axis=0)
    want = p_hat @ q.T
    e = m - want
    scale = np.abs(want).max()
    assert np.abs(outs64[t] - want).max() < 1e-12 * scale
    assert np.abs(outs32[t] - want).max() > 1e-8 * scale           # what float32 can do


def test_residual_aggregate_and_local_owe_the_same_sum(mesh):
  shape, steps = (32, 24), 5
  params = {"w": jnp.zeros(shape)}
  runs = {}
  for residual in ("aggregate", "local"):
    tx = commopt.compressed_mean(commopt.power_sgd(rank=2, residual=residual), axis_name="data",
                                 min_size=0)
    sm = commopt.testing.shard_map_workers(tx, mesh, "data")
    state, outs, sums, res = sm.init(params), [], [], []
    for t in range(steps):
      before = np.asarray(state.residual["w"])
      u = worker_inputs(30 + t, shape)
      out, state = sm.update({"w": u}, state)
      after = np.asarray(state.residual["w"])
      outs.append(np.asarray(out["w"])[0])
      sums.append(after.sum(0))
      res.append(after)
      if residual == "aggregate":
        # Every worker keeps its compensated input less the common output.
        np.testing.assert_allclose(after, u + before - outs[-1], atol=1e-5)
    runs[residual] = outs, sums, res
  for t in range(steps):
    np.testing.assert_allclose(runs["aggregate"][0][t], runs["local"][0][t], rtol=1e-5,
                               atol=1e-5, err_msg=f"outputs differ at step {t}")
    np.testing.assert_allclose(runs["aggregate"][1][t], runs["local"][1][t], rtol=1e-5,
                               atol=1e-4, err_msg=f"summed residuals differ at step {t}")
    # ... though the workers hold different shares of it.
    assert np.abs(runs["aggregate"][2][t] - runs["local"][2][t]).max() > 0.1


def gram_schmidt_reference(p, eps):
  """PyTorch's hook's Gram-Schmidt, in NumPy float64."""
  p = np.array(p, np.float64)
  with np.errstate(invalid="ignore", divide="ignore"):
    for i in range(p.shape[1]):
      p[:, i:i + 1] /= np.linalg.norm(p[:, i:i + 1]) + eps
      p[:, i + 1:] -= np.sum(p[:, i:i + 1] * p[:, i + 1:], axis=0, keepdims=True) * p[:, i:i + 1]
  return p


def test_orthogonalization_epsilon_keeps_a_zero_column_finite():
  from commopt.compressors._lowrank import _orthogonalize
  rng = np.random.default_rng(4)
  p = rng.normal(size=(20, 3)).astype(np.float32)
  p[:, 1] = 0.0
  eps = 1e-6
  got = np.asarray(_orthogonalize(jnp.asarray(p), eps))
  assert np.isfinite(got).all() and not got[:, 1].any()
  np.testing.assert_allclose(got, gram_schmidt_reference(p, eps), atol=1e-5)
  np.testing.assert_allclose(got[:, [0, 2]].T @ got[:, [0, 2]], np.eye(2), atol=1e-5)
  assert np.isnan(gram_schmidt_reference(p, 0.0)).any()      # what the epsilon prevents
  # Through the protocol: a zero update, and a rank-1 one at rank 2.
  tx = commopt.compressed_mean(commopt.power_sgd(rank=2, orthogonalization_epsilon=eps),
                               min_size=0)
  m = jnp.outer(jnp.arange(1.0, 9.0), jnp.arange(1.0, 7.0))
  state = tx.init({"w": m})
  for u in (jnp.zeros_like(m), m):
    out, state = jax.jit(tx.update)({"w": u}, state)
    assert bool(jnp.all(jnp.isfinite(out["w"])))
  np.testing.assert_allclose(out["w"], m, rtol=1e-4)


@pytest.mark.slow
def test_batched_equals_per_leaf_and_every_factor_crosses_in_one_all_reduce(mesh):
  # Three leaves view as [32, 24] (one as [4, 8, 24]), one as [16, 40]; a dense bias.
  params = {"a": jnp.zeros((32, 24)), "b": jnp.zeros((32, 24)), "c": jnp.zeros((4, 8, 24)),
            "d": jnp.zeros((16, 40)), "bias": jnp.zeros(24)}
  rng = np.random.default_rng(5)
  results, audits, qrs = {}, {}, {}
  for batched in (False, True):
    tx = commopt.compressed_mean(commopt.power_sgd(rank=2, batched=batched), axis_name="data",
                                 min_size=100)
    sm = commopt.testing.shard_map_workers(tx, mesh, "data")
    state = sm.init(params)
    us = [jax.tree.map(lambda x: rng.normal(size=(N,) + x.shape).astype(np.float32), params)
          for _ in range(3)] if not results else us
    outs = []
    for u in us:
      out, state = sm.update(u, state)
      outs.append(out)
    results[batched] = outs, state
    audits[batched] = {stage: wire.hlo_collectives(sm.update, us[0], state, stage=stage)
                       for stage in ("lowered", "compiled")}
    qrs[batched] = sm.update.lower(us[0], state).compile().as_text().count('"lapack_sgeqrf')
  for a, b in zip(jax.tree.leaves(results[False]), jax.tree.leaves(results[True])):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=1e-5, atol=1e-5)
  ars = {k: {s: [c for c in v if c.kind == "all-reduce"] for s, v in a.items()}
         for k, a in audits.items()}
  # Either way, as PyTorch's hook: every P in one all-reduce, every Q in one, and the bias.
  for batched in (False, True):
    assert len(ars[batched]["lowered"]) == 2 + 1
    factors = sorted(int(np.prod(s)) for c in ars[batched]["lowered"] for s in c.shapes)
    assert factors == [24, (3 * 32 + 16) * 2, (3 * 24 + 40) * 2]
  assert wire.total_bytes(ars[True]["compiled"]) == wire.total_bytes(ars[False]["compiled"])
  assert wire.total_bytes(ars[True]["compiled"]) == wire.payload_bytes(
      commopt.power_sgd(rank=2, batched=True), params, min_size=100).total
  # Batched: one QR per group of same-shaped matrices, not one per leaf.
  assert qrs == {False: 4, True: 2} or jax.default_backend() != "cpu"


@pytest.mark.parametrize("rank", [1, 2, 4, 6])
def test_the_products_with_the_matrix_are_the_matmuls_up_to_rounding(rank):
  """Up to SMALL_RANK, Mᵀ P and P Qᵀ are written as reductions and broadcast products (one
  read of M, fused into what reads P Qᵀ); above it they are the matmuls themselves."""
  from commopt.compressors._lowrank import SMALL_RANK, _left_product, _outer
  rng = np.random.default_rng(rank)
  for lead in ((), (3,)):
    m = rng.normal(size=lead + (300, 70)).astype(np.float32)
    p = rng.normal(size=lead + (300, rank)).astype(np.float32)
    q = rng.normal(size=lead + (70, rank)).astype(np.float32)
    left = np.asarray(jax.jit(_left_product)(m, p))
    outer = np.asarray(jax.jit(_outer)(p, q))
    want_left = np.swapaxes(m.astype(np.float64), -1, -2) @ p
    want_outer = p.astype(np.float64) @ np.swapaxes(q, -1, -2)
    assert left.shape == want_left.shape and outer.shape == want_outer.shape
    np.testing.assert_allclose(left, want_left, rtol=0, atol=300 * EPS32 * np.abs(want_left).max())
    np.testing.assert_allclose(outer, want_outer, rtol=0, atol=4 * EPS32 * np.abs(want_outer).max())
    matmul = "dot_general" in str(jax.make_jaxpr(_outer)(p, q))
    assert matmul == (rank > SMALL_RANK)


def test_option_errors_name_the_option():
  for kwargs, match in (({"start_iter": -1}, "`start_iter` must be an integer >= 0, got -1"),
                        ({"orthogonalization_epsilon": -1e-3},
                         "`orthogonalization_epsilon` must be a number >= 0"),
                        ({"residual": "mean"}, r"`residual` must be one of \('aggregate', "
                                               r"'local'\), got 'mean'"),
                        ({"batched": 1}, "`batched` must be True or False, got 1")):
    with pytest.raises(ValueError, match="power_sgd: " + match):
      commopt.power_sgd(**kwargs)
