"""eager_diloco: DiLoCo whose outer exchange overlaps the whole next inner phase, the outer
step taken at once on the eager estimate w·Δ + mean(Δ⁻) − w·Δ⁻ (w = 1/M by default)."""

import sys
import pathlib

import jax
import numpy as np
import optax
import pytest

import commopt

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from test_lowcomm import _mlp, _mlp_loss  # noqa: E402


def _batches(x, y, steps, rows, seed=0):
  rng = np.random.default_rng(seed)
  for _ in range(steps):
    idx = rng.choice(len(x), rows, replace=False)
    yield {"x": x[idx], "y": y[idx]}


def test_one_worker_is_diloco():
  """With one worker the exchange's mean is its own last pseudo-gradient, so the eager
  estimate is the current one: DiLoCo's parameters step for step."""
  mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
  params, x, y = _mlp()
  inner, period = optax.adam(3e-3), 4
  outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
  want = commopt.data_parallel(_mlp_loss, commopt.diloco(inner, outer, axis_name="data",
                                                         period=period), mesh, local_params=True)
  run = commopt.parallel.eager_diloco(_mlp_loss, inner, mesh, outer, period=period)
  runs = [(want, want.place_params(params), want.init(params)),
          (run, run.place_params(params), run.init(params))]
  trajectories = [[], []]
  for b in _batches(x, y, 12, 32):
    for i, (r, p, s) in enumerate(runs):
      p, s, losses = r.step(p, s, b)
      runs[i] = (r, p, s)
      trajectories[i].append((np.asarray(losses), jax.tree.map(np.asarray, p)))
  run.close()
  for (l1, p1), (l2, p2) in zip(*trajectories):      # step by step
    np.testing.assert_allclose(l2, l1, rtol=2e-5, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6), p2, p1)


@pytest.mark.parametrize("own_weight", [None, 1.0])
def test_finish_makes_the_workers_agree_under_a_linear_outer_step(mesh, own_weight):
  """Each worker's anchor differs by its own current term until the last exchange's mean
  is in: after finish, with outer sgd, every worker holds the same anchor (the sum of every
  exchange's mean), and training goes on from it."""
  params, x, y = _mlp()
  run = commopt.parallel.eager_diloco(_mlp_loss, optax.adam(3e-3), mesh, optax.sgd(0.8), period=3,
                             own_weight=own_weight)
  p, s = run.place_params(params), run.init(params)
  batches = _batches(x, y, 12, 64)
  for b in batches:
    p, s, _ = run.step(p, s, b)
  anchors = np.asarray(s.anchors["w1"])
  assert np.abs(anchors - anchors[:1]).max() > 1e-4        # apart before finish
  p, s = run.finish(p, s)
  anchors = np.asarray(s.anchors["w1"])
  np.testing.assert_allclose(anchors, np.broadcast_to(anchors[:1], anchors.shape), rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_allclose(np.asarray(run.global_params(s)["w1"]), anchors[0], rtol=1e-5,
                             atol=1e-6)
  assert s.pending is None and not np.asarray(s.previous["w1"]).any()
  for b in _batches(x, y, 6, 64, seed=1):
    p, s, losses = run.step(p, s, b)
  assert np.isfinite(np.asarray(losses)).all()
  run.close()


@pytest.mark.parametrize("compressed,own_weight", [
    (False, None), pytest.param(True, None, marks=pytest.mark.slow), (False, 1.0)],
    ids=["dense", "chunk_top_k", "dense-own_weight=1"])
def test_eager_trains_close_to_blocking_diloco(mesh, compressed, own_weight):
  """8 workers on their own batches, H = 4, the outer step sgd(1.0) (eager's default): the
  eager run's loss falls and stays within 1.3x of DiLoCo's (whose every exchange is waited
  for), dense and with a sparse 2-bit exchange whose error feedback replaces the outer
  momentum, and with the worker's own term standing for the whole mean."""
  params, x, y = _mlp()
  inner, period = optax.adam(3e-3), 4
  kw = dict(compressor=commopt.compressors.chunk_top_k(16, chunk=32, bits=2),
            min_size=0) if compressed else {}
  want = commopt.data_parallel(_mlp_loss, commopt.diloco(inner, optax.sgd(1.0), axis_name="data",
                                                         period=period, **kw),
                               mesh, local_params=True)
  run = commopt.parallel.eager_diloco(_mlp_loss, inner, mesh, period=period, own_weight=own_weight,
                                      **kw)
  p1, s1 = want.place_params(params), want.init(params)
  p2, s2 = run.place_params(params), run.init(params)
  l1s, l2s = [], []
  for b in _batches(x, y, 60, 256):
    p1, s1, l1 = want.step(p1, s1, b)
    p2, s2, l2 = run.step(p2, s2, b)
    l1s.append(float(np.mean(l1)))
    l2s.append(float(np.mean(l2)))
  run.close()
  assert np.mean(l2s[-8:]) < 0.5 * np.mean(l2s[:4])
  assert np.mean(l2s[-8:]) < 1.3 * np.mean(l1s[-8:]), (l1s[-8:], l2s[-8:])


@pytest.mark.parametrize("own_weight", [None, 1.0, 0.0])
def test_the_mean_anchor_takes_w_of_this_exchange_and_the_rest_of_the_last(mesh, own_weight):
  """With outer sgd(1.0) and a dense exchange, each outer step moves the workers' mean anchor
  by w·mean(Δ) + (1 − w)·mean(Δ⁻): w = 1 moves it by this exchange's whole mean at once, as
  blocking DiLoCo moves its anchor; w = 1/M by a share of it; w = 0 by the last one only."""
  params, x, y = _mlp()
  run = commopt.parallel.eager_diloco(_mlp_loss, optax.sgd(0.05, momentum=0.9), mesh, period=2,
                             own_weight=own_weight)
  w = 1 / mesh.size if own_weight is None else own_weight
  assert run.own_weight == w
  p, s = run.place_params(params), run.init(params)
  mean = lambda tree: {k: np.asarray(v, np.float64).mean(0) for k, v in tree.items()}
  anchor, last = mean(s.anchors), mean(s.previous)
  outer_steps = 0
  for k, b in enumerate(_batches(x, y, 8, 64)):
    p, s, _ = run.step(p, s, b)
    if (k + 1) % 2:
      continue
    outer_steps += 1
    now, delta = mean(s.anchors), mean(s.previous)
    for leaf in now:
      np.testing.assert_allclose(now[leaf], anchor[leaf] - w * delta[leaf]
                                 - (1 - w) * last[leaf], rtol=1e-4, atol=1e-6)
    assert np.abs(delta["w1"]).max() > 1e-3
    anchor, last = now, delta
  assert outer_steps == 4
  run.close()


def test_eager_diloco_checks_its_arguments(mesh):
  with pytest.raises(ValueError, match="eager_diloco: `period`"):
    commopt.parallel.eager_diloco(_mlp_loss, optax.sgd(0.1), mesh, period=0)
  with pytest.raises(ValueError, match="eager_diloco"):
    commopt.parallel.eager_diloco(_mlp_loss, optax.sgd(0.1), mesh, period=2, axis_name=None)
  for bad in (1.5, -0.1, float("nan")):
    with pytest.raises(ValueError, match=r"eager_diloco: `own_weight` must be a number in "
                                         r"\[0.0, 1.0\], got"):
      commopt.parallel.eager_diloco(_mlp_loss, optax.sgd(0.1), mesh, period=2, own_weight=bad)
  for bad in ("1", True):
    with pytest.raises(TypeError, match="eager_diloco: `own_weight`"):
      commopt.parallel.eager_diloco(_mlp_loss, optax.sgd(0.1), mesh, period=2, own_weight=bad)


@pytest.mark.parametrize("driver", ["eager", "overlapped"])
def test_local_batch_is_data_parallels(mesh, driver):
  """The host-level DiLoCo drivers take a multi-process global batch as data_parallel does:
  in one process local_batch is the batch placed over the data axis, and a step on it
  equals a step on the host batch."""
  params, x, y = _mlp()
  make = {"eager": lambda: commopt.parallel.eager_diloco(_mlp_loss, optax.sgd(0.1), mesh, period=2),
          "overlapped": lambda: commopt.parallel.overlapped_diloco(_mlp_loss, optax.sgd(0.1), mesh,
                                                          period=2, delay=1)}[driver]
  batch = next(_batches(x, y, 1, 64))
  runs = [make(), make()]
  placed = runs[0].local_batch(batch)
  assert placed["x"].sharding.spec[0] == "data" and placed["x"].shape == batch["x"].shape
  out = []
  for run, b in zip(runs, (placed, batch)):
    p, s = run.place_params(params), run.init(params)
    p, s, losses = run.step(p, s, b)
    out.append((np.asarray(losses), np.asarray(p["w1"])))
    run.close()
  np.testing.assert_array_equal(out[0][0], out[1][0])
  np.testing.assert_array_equal(out[0][1], out[1][1])


@pytest.mark.parametrize("driver", ["eager", "overlapped"])
def test_each_worker_skips_its_own_nonfinite_inner_step(mesh, driver):
  """A NaN in one worker's rows: that worker keeps its parameters and its inner state (its
  skip counted), the others step; the inner program runs no collective, so nothing runs
  beside an exchange in flight. With skip_nonfinite=False the NaN reaches the parameters."""
  params, x, y = _mlp()
  make = {"eager": lambda **kw: commopt.parallel.eager_diloco(
              _mlp_loss, optax.sgd(0.1, momentum=0.9), mesh, period=4, **kw),
          "overlapped": lambda **kw: commopt.parallel.overlapped_diloco(
              _mlp_loss, optax.sgd(0.1, momentum=0.9), mesh, period=4, delay=1, **kw)}[driver]
  good, bad = list(_batches(x, y, 2, 64))
  rows = 64 // mesh.size
  bad["x"] = bad["x"].copy()
  bad["x"][3 * rows + 1, 5] = np.nan                          # worker 3's rows only
  run = make()
  p, s = run.place_params(params), run.init(params)
  p, s, _ = run.step(p, s, good)
  before, trace_before = np.asarray(p["w1"]), np.asarray(s.inner.inner_state[0].trace["w1"])
  p, s, losses = run.step(p, s, bad)
  after, trace_after = np.asarray(p["w1"]), np.asarray(s.inner.inner_state[0].trace["w1"])
  assert np.isnan(np.asarray(losses)[3]) and np.isfinite(np.delete(np.asarray(losses), 3)).all()
  np.testing.assert_array_equal(after[3], before[3])
  np.testing.assert_array_equal(trace_after[3], trace_before[3])
  assert all(np.abs(after[w] - before[w]).max() > 0 for w in range(mesh.size) if w != 3)
  assert np.asarray(s.inner.notfinite_count).tolist() == [int(w == 3) for w in range(mesh.size)]
  text = run.inner_dp.lower(p, s.inner, run.inner_dp.place_batch(good)).compile().as_text()
  assert not any(op in text for op in ("all-reduce(", "all-gather(", "collective-permute("))
  run.close()
  unguarded = make(skip_nonfinite=False)
  p, s = unguarded.place_params(params), unguarded.init(params)
  p, s, _ = unguarded.step(p, s, good)
  p, s, _ = unguarded.step(p, s, bad)
  assert np.isnan(np.asarray(p["w1"])[3]).any()
  unguarded.close()
  with pytest.raises(TypeError, match="skip_nonfinite"):
    make(skip_nonfinite="yes")
