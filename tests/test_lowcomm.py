"""The newest low-communication methods: chunked top-k (and DeMo's DCT), decaying error
feedback, DeMo, SparseLoCo and Muon inside DiLoCo: each one's defining property."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.fft
from jax.sharding import NamedSharding, PartitionSpec as P

import commopt
from commopt import wire
from commopt.compressors import _chunked

N = 4


def _tiles_np(x, a, b):
  """A (rows, cols) matrix cut into row-major (a, b) tiles: [tiles, a, b] (no padding)."""
  r, c = x.shape
  return x.reshape(r // a, a, c // b, b).transpose(0, 2, 1, 3).reshape(-1, a, b)


def _top_k_np(tiles, k):
  """Each tile's k largest magnitudes kept, the rest zero (ties to the lower index)."""
  flat = tiles.reshape(len(tiles), -1)
  out = np.zeros_like(flat)
  for t, row in enumerate(flat):
    keep = np.argsort(-np.abs(row), kind="stable")[:k]
    out[t, keep] = row[keep]
  return out.reshape(tiles.shape)


@pytest.mark.parametrize("dct", [False, True])
def test_chunk_top_k_keeps_each_tiles_k_largest_entries_or_dct_coefficients(dct):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(128, 192)).astype(np.float32)
  c = commopt.compressors.chunk_top_k(8, chunk=64, dct=dct)
  payload, _ = c.encode(jnp.asarray(x), None, None)
  got = np.asarray(c.decode(payload, None, jnp.asarray(x)), np.float64)
  tiles = _tiles_np(x.astype(np.float64), 64, 64)
  if dct:   # scipy's orthonormal 2-D DCT-II of every tile, then the same selection
    coef = scipy.fft.dctn(tiles, axes=(1, 2), norm="ortho")
    kept = scipy.fft.idctn(_top_k_np(coef, 8), axes=(1, 2), norm="ortho")
  else:
    kept = _top_k_np(tiles, 8)
  want = kept.reshape(2, 3, 64, 64).transpose(0, 2, 1, 3).reshape(128, 192)
  np.testing.assert_allclose(got, want, atol=1e-5)
  # 8 of each 4096-entry tile: 12-bit packed indices and float32 values, nothing else.
  assert set(payload) == {"indices", "values"}
  assert payload["values"].shape == (6, 8) and payload["indices"].dtype == jnp.uint32
  assert c.payload_bits(x.shape, x.dtype) == 6 * 8 * 32 + 32 * -(-6 * 8 * 12 // 32)


@pytest.mark.slow
def test_chunk_top_k_tiles_odd_shapes_and_sends_whole_tiles_without_indices():
  assert _chunked.tiling((130,), 64, 8).tile == (1, 44)            # 3 tiles, 2 zeros of padding
  assert _chunked.tiling((100, 4096), 64, 8).tile == (50, 64)      # divisors: no padding
  assert _chunked.tiling((3, 3, 8, 16), 64, 8).padded == (72, 16)  # rows of the last dimension
  rng = np.random.default_rng(1)
  for shape in [(130,), (3, 3, 8, 16), (5,), (67, 3)]:
    x = jnp.asarray(rng.normal(size=shape).astype(np.float32))
    c = commopt.compressors.chunk_top_k(4096, chunk=64, dct=True)  # k ≥ every tile: lossless
    payload, _ = c.encode(x, None, None)
    assert "indices" not in payload
    np.testing.assert_allclose(np.asarray(c.decode(payload, None, x)), np.asarray(x), atol=1e-5)


@pytest.mark.slow
def test_chunk_top_k_bits_send_a_sign_and_a_bin_mean_per_value():
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.normal(size=(64, 64)).astype(np.float32))
  c = commopt.compressors.chunk_top_k(64, chunk=64, bits=2)
  payload, _ = c.encode(x, None, None)
  y = np.asarray(c.decode(payload, None, x))
  kept = np.flatnonzero(y)
  assert kept.size == 64
  exact = np.asarray(commopt.compressors.chunk_top_k(64, chunk=64).decode(
      commopt.compressors.chunk_top_k(64, chunk=64).encode(x, None, None)[0], None, x))
  np.testing.assert_array_equal(kept, np.flatnonzero(exact))       # the same coordinates
  assert np.all(np.sign(y.ravel()[kept]) == np.sign(exact.ravel()[kept]))
  mags = np.abs(exact.ravel()[kept])
  lo, hi = mags.min(), mags.max()
  upper = mags >= (lo + hi) / 2
  table = np.asarray(payload["table"], np.float32)[0]
  np.testing.assert_allclose(table, [mags[~upper].mean(), mags[upper].mean()], rtol=1e-2)
  np.testing.assert_array_equal(np.abs(y.ravel()[kept]), np.where(upper, table[1], table[0]))
  assert c.payload_bits(x.shape, x.dtype) == 64 * 12 + 64 * 2 + 2 * 16


@pytest.mark.parametrize("decay", [1.0, 0.9])
def test_residual_decay_keeps_exactly_what_was_not_sent(decay):
  """e′ + sent = u + β·e on every worker, step after step."""
  tx = commopt.compressed_mean(commopt.top_k(0.05), axis_name="w", min_size=0,
                               residual_decay=decay)
  rng = np.random.default_rng(3)
  state = jax.vmap(tx.init, in_axes=None, axis_size=N, axis_name="w")({"w": jnp.zeros((32, 16))})
  reconstruct = commopt.top_k(0.05)
  for _ in range(4):
    u = rng.normal(size=(N, 32, 16)).astype(np.float32)
    e = np.asarray(state.residual["w"])
    mean, state = jax.vmap(tx.update, axis_name="w")({"w": jnp.asarray(u)}, state)
    p = u + decay * e
    sent = np.stack([np.asarray(reconstruct.decode(
        reconstruct.encode(jnp.asarray(q), None, None)[0], None, jnp.asarray(q))) for q in p])
    np.testing.assert_allclose(np.asarray(state.residual["w"]), p - sent, atol=1e-5)
    np.testing.assert_allclose(np.asarray(mean["w"][0]), sent.mean(0), atol=1e-5)


def test_residual_decay_is_checked():
  with pytest.raises(ValueError, match=r"residual_decay.*\[0, 1\].*1.5"):
    commopt.compressed_mean(commopt.top_k(0.1), residual_decay=1.5)
  with pytest.raises(ValueError, match="keeps none here"):
    commopt.compressed_mean(commopt.qsgd(), residual_decay=0.9)


def _demo_reference(g, m, lr, k, decay):
  """One DeMo step in numpy for every worker (one 64 x 64 tile each): the sent coefficients,
  their reconstructions, the new momenta, and the coefficients' mean over their senders."""
  p = decay * m + lr * g
  coef = np.stack([_top_k_np(scipy.fft.dctn(q[None], axes=(1, 2), norm="ortho"), k)[0]
                   for q in p])
  sent = np.stack([scipy.fft.idctn(c, norm="ortho") for c in coef])
  senders = (coef != 0).sum(0)
  per_sender = np.where(senders > 0, coef.sum(0) / np.maximum(senders, 1), 0.0)
  return sent, p - sent, scipy.fft.idctn(per_sender, norm="ortho")


@pytest.mark.slow
def test_demo_sends_the_top_k_dct_coefficients_and_its_momentum_loses_exactly_them():
  lr, k, decay = 0.01, 16, 0.9
  tx = commopt.demo(lr, axis_name="w", k=k, decay=decay, weight_decay=0.1, min_size=0,
                    value_dtype="float32")
  rng = np.random.default_rng(4)
  params = {"w": jnp.asarray(rng.normal(size=(64, 64)).astype(np.float32))}
  state = jax.vmap(tx.init, in_axes=None, axis_size=N, axis_name="w")(params)
  stacked = jax.tree.map(lambda x: jnp.broadcast_to(x, (N,) + x.shape), params)
  m = np.zeros((N, 64, 64))
  for _ in range(3):
    g = rng.normal(size=(N, 64, 64))
    u, state = jax.vmap(tx.update, axis_name="w")({"w": jnp.asarray(g, jnp.float32)}, state,
                                                  stacked)
    sent, m, combined = _demo_reference(g, m, lr, k, decay)
    np.testing.assert_allclose(np.asarray(state["exchange"].residual["w"]), m, atol=1e-5)
    # The default combine="senders": each coefficient averaged over its senders, as DeMo's
    # reference does ("mean", over all workers, is sent.mean(0)).
    want = -lr * (np.sign(combined) + 0.1 * np.asarray(params["w"]))
    np.testing.assert_allclose(np.asarray(u["w"][1]), want, atol=1e-6)
  # The momentum is each worker's own.
  assert np.ptp(np.asarray(state["exchange"].residual["w"]), axis=0).max() > 1e-3


def _mlp(seed=0):
  rng = np.random.default_rng(seed)
  params = {"w1": (rng.normal(size=(64, 128)) * 0.1).astype(np.float32),
            "w2": (rng.normal(size=(128, 8)) * 0.1).astype(np.float32),
            "b": np.zeros(8, np.float32)}
  x = rng.normal(size=(256, 64)).astype(np.float32)
  y = np.tanh(x[:, :8] * 2).astype(np.float32)
  return params, x, y


def _mlp_loss(p, b):
  return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] + p["b"] - b["y"]) ** 2)


@pytest.mark.slow
def test_demo_trains_under_data_parallel_and_gathers_only_its_packed_payload(mesh):
  params, x, y = _mlp()
  tx = commopt.demo(3e-3, axis_name="data", k=32, min_size=0)
  dp = commopt.data_parallel(_mlp_loss, tx, mesh)
  state, p = dp.init(params), params
  audit = wire.hlo_collectives(dp, p, state, {"x": x[:64], "y": y[:64]})
  gathers = [c for c in audit if c.kind == "all-gather"]
  dtypes = {d for c in gathers for d in c.dtypes}
  assert dtypes == {"u32", "u16"}, audit      # 12-bit indices packed, bf16 values' 16 bits
  plan = wire.comm_plan(tx, params, 8)
  assert wire.total_bytes(gathers) == plan.contributed_bytes
  dense = sum(v.size * 4 for v in params.values())
  assert plan.contributed_bytes * 20 < dense
  losses = []
  rng = np.random.default_rng(0)
  for _ in range(60):
    idx = rng.choice(len(x), 64, replace=False)
    p, state, loss = dp.step(p, state, {"x": x[idx], "y": y[idx]})
    losses.append(float(np.mean(loss)))
  assert np.mean(losses[-10:]) < 0.6 * np.mean(losses[:5]), losses


def test_demo_runs_shard_local_on_a_tensor_parallel_mesh():
  """("data", "model"): each device takes the DCT of its own shard's tiles; the
  momentum keeps the model sharding and nothing parameter-sized crosses the model axis."""
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  params, x, y = _mlp()
  specs = {"w1": P(None, "model"), "w2": P("model", None), "b": P()}
  placed = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
  tx = commopt.demo(3e-3, axis_name="data", k=8, min_size=0)

  def loss_fn(p, b):
    h = jnp.tanh(b["x"] @ p["w1"])
    out = jnp.einsum("bh,ho->bo", h, p["w2"], out_sharding=P(None, None))
    return jnp.mean((out + p["b"] - b["y"]) ** 2)

  dp = commopt.data_parallel(loss_fn, tx, mesh)
  assert dp.layout(placed).shard_local
  state, p = dp.init(placed), placed
  losses = []
  for step in range(20):
    b = {"x": x[step * 8:(step + 1) * 8], "y": y[step * 8:(step + 1) * 8]}
    p, state, loss = dp.step(p, state, b)
    losses.append(float(np.mean(np.asarray(loss))))
  assert np.mean(losses[-5:]) < np.mean(losses[:5])
  momentum = state.inner_state["exchange"].residual["w1"]
  assert "model" in momentum.sharding.spec
  assert momentum.addressable_shards[0].data.shape[-1] == 128 // 4


@pytest.mark.slow
def test_sparseloco_error_feedback_conserves_the_decayed_pseudo_gradient():
  """Per worker and sync: e′ = β·e + Δ − s, and the anchor moves by −mean s (outer sgd(1))."""
  lr, period, decay = 0.1, 2, 0.8
  rng = np.random.default_rng(5)
  params0 = {"w": rng.normal(size=(64, 64)).astype(np.float32)}
  tx = commopt.transforms.sparseloco(optax.sgd(lr), axis_name="w", period=period, k=64, decay=decay,
                          min_size=0)
  state = jax.vmap(tx.init, in_axes=None, axis_size=N, axis_name="w")(params0)
  update = jax.jit(jax.vmap(tx.update, axis_name="w"))
  p = {"w": np.broadcast_to(params0["w"], (N, 64, 64)).copy()}
  e = np.zeros((N, 64, 64))
  for step in range(6):
    g = rng.normal(size=(N, 64, 64)).astype(np.float32)
    anchor = np.asarray(state.anchor["w"][0], np.float64)
    moved = np.asarray(p["w"], np.float64) - lr * g
    u, state = update({"w": jnp.asarray(g)}, state, p)
    p = {"w": np.asarray(p["w"] + u["w"])}
    if (step + 1) % period:
      continue
    new_e = np.asarray(state.reducer_state.residual["w"], np.float64)
    sent = decay * e + (anchor[None] - moved) - new_e
    # What was sent is 64 two-bit values of each 4096-entry tile: 64 nonzeros per worker.
    assert all(np.count_nonzero(np.abs(s) > 1e-4) <= 64 for s in sent)
    np.testing.assert_allclose(np.asarray(state.anchor["w"][0]), anchor - sent.mean(0),
                               atol=2e-5)
    e = new_e


def test_sparseloco_sends_over_97_times_fewer_bytes_than_dense_diloco():
  params = {"w1": jnp.zeros((512, 1024)), "w2": jnp.zeros((1024, 512)), "b": jnp.zeros(512)}
  dense = wire.comm_plan(commopt.diloco(optax.adamw(1e-3), axis_name="data", period=30),
                         params, 4)
  sparse = wire.comm_plan(commopt.transforms.sparseloco(optax.adamw(1e-3), axis_name="data",
                                                        period=30),
                          params, 4)
  ratio = dense.contributed_bytes / sparse.contributed_bytes
  assert ratio >= 97, ratio


@pytest.mark.slow
def test_muon_inside_diloco_with_h_1_is_muon_data_parallel(mesh):
  """With every worker on the same rows, H = 1 and outer sgd(1), DiLoCo's anchor is Muon's
  data-parallel step (with different rows the two differ: Muon's orthogonalisation is not
  linear, so the mean of the workers' steps is not the step of the mean gradient)."""
  params, x, y = _mlp()
  muon = lambda: optax.contrib.muon(0.02)
  rows = np.tile(np.arange(8), 8)             # each of the 8 workers gets rows 0..7
  batch = {"x": x[rows], "y": y[rows]}
  bsp = commopt.data_parallel(_mlp_loss, optax.chain(
      commopt.compressed_mean(commopt.compressors.make("identity"), axis_name="data"), muon()),
      mesh)
  local = commopt.data_parallel(_mlp_loss, commopt.diloco(muon(), optax.sgd(1.0),
                                                          axis_name="data", period=1), mesh,
                                local_params=True)
  p1, s1 = params, bsp.init(params)
  p2, s2 = local.place_params(params), local.init(params)
  for _ in range(4):
    p1, s1, _ = bsp.step(p1, s1, batch)
    p2, s2, _ = local.step(p2, s2, batch)
  for k in params:
    np.testing.assert_allclose(np.asarray(s2.inner_state.anchor[k]), np.asarray(p1[k]),
                               rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.slow
def test_bench_lowcomm_runs_and_states_the_byte_ratios(tmp_path):
  import json
  import pathlib
  import subprocess
  import sys
  root = pathlib.Path(__file__).resolve().parents[1]
  proc = subprocess.run(
      [sys.executable, "benchmarks/bench_lowcomm.py", "--problems", "lm", "--steps", "30",
       "--methods", "AdamW DP,DeMo,DiLoCo,SparseLoCo", "--out", str(tmp_path)],
      cwd=root, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = json.loads((tmp_path / "lowcomm.json").read_text())["problems"]["lm"]["results"]
  assert got["DeMo"]["baseline"] == "AdamW DP" and got["DeMo"]["bytes_ratio"] > 85
  assert got["SparseLoCo"]["baseline"] == "DiLoCo" and got["SparseLoCo"]["bytes_ratio"] > 97
  # Two exchanges in 30 steps at H = 15; DeMo and AdamW DP exchange every step.
  per_sync = got["DiLoCo"]["contributed"][14]
  assert per_sync > 0 and set(got["DiLoCo"]["contributed"]) == {0, per_sync, 2 * per_sync}
  assert (tmp_path / "lowcomm.png").stat().st_size > 0


def test_bench_lowcomm_passes_demos_knobs_through(monkeypatch):
  import pathlib
  import sys
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
  import bench_lowcomm
  seen = []
  monkeypatch.setattr(commopt, "demo", lambda lr, **kw: seen.append(kw) or optax.identity())
  setting = bench_lowcomm.SETTINGS["lm"]
  for argv in ([], ["--demo-k", "48", "--demo-chunk", "32", "--demo-min-size", "0"]):
    bench_lowcomm.make("DeMo", bench_lowcomm.parse_args(argv), setting, {})
  assert (seen[0]["k"], seen[0]["chunk"], "min_size" in seen[0]) == (32, 64, False)
  assert (seen[1]["k"], seen[1]["chunk"], seen[1]["min_size"]) == (48, 32, 0)


@pytest.mark.parametrize("delay,mixing,compressed", [
    (0, 0.0, False), (1, 0.5, False), pytest.param(3, 0.5, True, marks=pytest.mark.slow)])
def test_overlapped_diloco_is_streaming_diloco_run_as_two_programs(delay, mixing, compressed,
                                                                   mesh):
  """The exchange on a thread of its own, merged `delay` steps later, gives streaming DiLoCo's
  parameters (one fragment) step for step (with delay 0 and mixing 0 that is DiLoCo, which
  tests/test_sync.py checks)."""
  params, x, y = _mlp()
  inner, period = optax.adam(3e-3), 4
  kw = dict(compressor=commopt.compressors.chunk_top_k(16, chunk=32, bits=2),
            min_size=0) if compressed else {}
  want = commopt.data_parallel(_mlp_loss, commopt.streaming_diloco(
      inner, axis_name="data", period=period, fragments=1, delay=delay, mixing=mixing, **kw),
      mesh, local_params=True)
  run = commopt.parallel.overlapped_diloco(_mlp_loss, inner, mesh, period=period, delay=delay,
                                  mixing=mixing, **kw)
  p1, s1 = want.place_params(params), want.init(params)
  p2, s2 = run.place_params(params), run.init(params)
  rng = np.random.default_rng(0)
  for step in range(12):
    idx = rng.choice(len(x), 64, replace=False)
    b = {"x": x[idx], "y": y[idx]}
    p1, s1, l1 = want.step(p1, s1, b)
    p2, s2, l2 = run.step(p2, s2, b)
    np.testing.assert_allclose(np.asarray(l2), np.asarray(l1), rtol=2e-5, atol=1e-6)
    for k in params:
      np.testing.assert_allclose(np.asarray(p2[k]), np.asarray(p1[k]), rtol=2e-5, atol=2e-6,
                                 err_msg=f"step {step} {k}")
  p2, s2 = run.finish(p2, s2)
  run.close()
  np.testing.assert_allclose(np.asarray(run.global_params(s2)["w1"]),
                             np.asarray(s1.inner_state.anchor["w1"]), rtol=2e-5, atol=2e-6)


def test_overlapped_diloco_checks_its_arguments(mesh):
  with pytest.raises(ValueError, match=r"overlapped_diloco: `delay` must be below `period` \(4\)"):
    commopt.parallel.overlapped_diloco(_mlp_loss, optax.sgd(0.1), mesh, period=4, delay=4)


@pytest.mark.slow
def test_chunk_top_k_senders_averages_each_coefficient_over_the_workers_that_sent_it():
  c = commopt.compressors.chunk_top_k(8, chunk=64, dct=True, combine="senders")
  tx = commopt.compressed_mean(c, axis_name="w", min_size=0, error_feedback=False)
  rng = np.random.default_rng(6)
  strong = np.zeros((64, 64))
  strong[[0, 1, 5, 9], [0, 3, 2, 7]] = 40.0            # every worker's 4 largest coefficients
  u = np.stack([scipy.fft.idctn(strong, norm="ortho") for _ in range(N)])
  u = u + rng.normal(size=(N, 64, 64))
  state = jax.vmap(tx.init, in_axes=None, axis_size=N, axis_name="w")({"w": jnp.zeros((64, 64))})
  mean, _ = jax.vmap(tx.update, axis_name="w")({"w": jnp.asarray(u, jnp.float32)}, state)
  coef = np.stack([_top_k_np(scipy.fft.dctn(q[None], axes=(1, 2), norm="ortho"), 8)[0]
                   for q in u])
  senders = (coef != 0).sum(0)
  per_sender = np.where(senders > 0, coef.sum(0) / np.maximum(senders, 1), 0.0)
  want = scipy.fft.idctn(per_sender, norm="ortho")
  np.testing.assert_allclose(np.asarray(mean["w"][0]), want, atol=1e-5)
  # Coefficients more than one worker sent: the plain mean would be smaller there.
  assert (senders > 1).any() and (senders == 1).any()
  plain = commopt.compressed_mean(commopt.compressors.chunk_top_k(8, chunk=64, dct=True),
                                  axis_name="w", min_size=0, error_feedback=False)
  m2, _ = jax.vmap(plain.update, axis_name="w")({"w": jnp.asarray(u, jnp.float32)},
                                                jax.vmap(plain.init, in_axes=None, axis_size=N,
                                                         axis_name="w")({"w": jnp.zeros((64, 64))}))
  np.testing.assert_allclose(np.asarray(m2["w"][0]),
                             scipy.fft.idctn(coef.mean(0), norm="ortho"), atol=1e-5)
