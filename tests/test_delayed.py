"""commopt.transforms.pipelined: the one-step-delayed update whose exchange overlaps the next
step's compute."""

import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import commopt
from commopt import wire
from commopt.testing import assert_same_bits, host_copy, vmap_workers
from commopt.transforms import apply_if_finite, pipelined

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_overlap import batch_dependent_collectives  # noqa: E402

N = 8


def sgd_over(compressor, lr=0.1, axis_name="workers", **options):
  return optax.chain(commopt.compressed_mean(compressor, axis_name=axis_name, min_size=0,
                                             **options), optax.sgd(lr))


def gradients(steps, shape=(N, 6, 5), seed=0):
  key = jax.random.key(seed)
  return [{"w": jax.random.normal(jax.random.fold_in(key, t), shape),
           "b": jax.random.normal(jax.random.fold_in(key, 1000 + t), shape[:1] + shape[2:])}
          for t in range(steps)]


PARAMS = {"w": jnp.zeros((6, 5)), "b": jnp.zeros((5,))}


# -- the delayed stream --------------------------------------------------------------------

@pytest.mark.parametrize("delay", [1, 2])
@pytest.mark.parametrize("compressor", [commopt.scaled_sign(), commopt.qsgd(levels=4)],
                         ids=["scaled_sign", "qsgd"])
def test_update_t_plus_delay_is_the_undelayed_update_t_bit_for_bit(delay, compressor):
  # A fixed stream of per-worker gradients (independent of the parameters): the delayed
  # run returns zeros for `delay` steps, then exactly what the undelayed one returned,
  # residuals (scaled_sign) and random keys (qsgd) included.
  plain = vmap_workers(sgd_over(compressor), N)
  late = vmap_workers(pipelined(sgd_over(compressor), delay=delay), N)
  s1, s2 = plain.init(PARAMS), late.init(PARAMS)
  want, got = [], []
  for g in gradients(6):
    u1, s1 = plain.update(g, s1)
    u2, s2 = late.update(g, s2)
    want.append(host_copy(u1))
    got.append(host_copy(u2))
  for t in range(delay):
    assert_same_bits(got[t], jax.tree.map(lambda x: np.full_like(x, -0.0), got[t]))
  for t in range(len(want) - delay):
    assert_same_bits(got[t + delay], want[t])
  # The inner state lags the undelayed one by `delay` steps: its count too.
  assert int(s2.inner_state[0].count[0]) == int(s1[0].count[0]) - delay
  assert int(s2.count[0]) == 6 and int(s2.dropped[0]) == 0


def test_error_feedback_conserves_the_sum_of_the_gradients():
  # With sgd(lr): the updates applied so far are -lr times the sum of the workers' mean
  # gradients, less what is still owed: their mean residual and mean pending gradient.
  lr = 0.1
  w = vmap_workers(pipelined(sgd_over(commopt.scaled_sign(), lr)), N)
  state = w.init(PARAMS)
  applied = jax.tree.map(jnp.zeros_like, PARAMS)
  sent = jax.tree.map(jnp.zeros_like, PARAMS)
  for g in gradients(25, seed=3):
    updates, state = w.update(g, state)
    applied = jax.tree.map(lambda a, u: a + u[0], applied, updates)
    sent = jax.tree.map(lambda s, x: s + jnp.mean(x, 0), sent, g)
  owed = jax.tree.map(lambda e, p: lr * (jnp.mean(e, 0) + jnp.mean(p, 0)),
                      state.inner_state[0].residual, state.pending[0])
  assert float(jnp.max(jnp.abs(state.inner_state[0].residual["w"]))) > 0.1   # it compresses
  for k in PARAMS:
    np.testing.assert_allclose(applied[k] - owed[k], -lr * sent[k], rtol=1e-5, atol=1e-5)


def test_the_first_steps_keep_the_inner_state_and_the_parameters_bit_for_bit():
  tx = pipelined(optax.adam(0.1), delay=2)
  state = tx.init(PARAMS)
  before = host_copy(state.inner_state)
  for _ in range(2):
    updates, state = tx.update(jax.tree.map(jnp.ones_like, PARAMS), state, PARAMS)
    assert_same_bits(host_copy(optax.apply_updates(PARAMS, updates)), host_copy(PARAMS))
  assert_same_bits(host_copy(state.inner_state), before)     # adam's count did not move
  updates, state = tx.update(jax.tree.map(jnp.ones_like, PARAMS), state, PARAMS)
  np.testing.assert_allclose(updates["w"], -0.1, rtol=1e-5)  # adam's first step, on g_0
  assert int(state.inner_state[0].count) == 1


def test_the_kept_gradient_keeps_the_parameters_dtype_and_goes_out_in_the_gradients():
  params = {"w": jnp.zeros(4, jnp.bfloat16)}
  seen = []
  spy = optax.GradientTransformation(
      lambda p: optax.EmptyState(),
      lambda u, s, p=None: (seen.append(u["w"].dtype) or u, s))
  tx = pipelined(spy)
  state = tx.init(params)
  assert state.pending[0]["w"].dtype == jnp.bfloat16
  _, state = tx.update({"w": jnp.ones(4, jnp.bfloat16)}, state, params)
  assert seen == [jnp.bfloat16] and state.pending[0]["w"].dtype == jnp.bfloat16


# -- stability -----------------------------------------------------------------------------

def _final_distance(tx, steps=3000):
  """|x| after `steps` steps of tx on f(x) = x²/2 (L = 1, so lr is lr·L), from x = 1."""
  x = jnp.ones(())
  state = tx.init(x)

  def body(carry, _):
    x, s = carry
    u, s = tx.update(x, s, x)
    return (x + u, s), None

  (x, _), _ = jax.lax.scan(body, (x, state), None, length=steps)
  return float(jnp.abs(x))


@pytest.mark.parametrize("momentum", [0.0, 0.5, 0.9])
def test_one_step_of_delay_is_stable_below_lr_l_of_one_minus_momentum(momentum):
  # The documented bound: lr·L < 1 − β with one step of delay (< 2(1+β) without).
  bound = 1.0 - momentum
  make = lambda lr: optax.sgd(lr, momentum=momentum or None)
  assert _final_distance(pipelined(make(0.9 * bound))) < 1e-3
  assert _final_distance(pipelined(make(1.1 * bound))) > 1e3
  assert _final_distance(make(1.1 * bound)) < 1e-3   # undelayed: stable there


def test_delay_two_is_stable_below_two_sin_pi_over_ten():
  bound = 2 * np.sin(np.pi / 10)
  assert _final_distance(pipelined(optax.sgd(0.95 * bound), delay=2)) < 1e-3
  assert _final_distance(pipelined(optax.sgd(1.05 * bound), delay=2)) > 1e3


# -- convergence on least squares ----------------------------------------------------------

D, ROWS, POOL = 32, 16, 4096


def _least_squares():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(POOL, D)).astype(np.float32)
  y = (x @ rng.normal(size=(D, 1)) + 0.5 * rng.normal(size=(POOL, 1))).astype(np.float32)
  return x, y


def _ls_loss(p, b):
  return 0.5 * jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)


def _ls_run(step, params, state, steps=300):
  """Minibatch SGD, fresh rows each step; the loss on the whole pool after every step."""
  x, y = _least_squares()
  rng = np.random.default_rng(1)
  trace = []
  for _ in range(steps):
    idx = rng.choice(POOL, N * ROWS, replace=False)
    params, state = step(params, state, {"x": x[idx], "y": y[idx]})
    p = jax.tree.map(np.asarray, params)
    trace.append(float(0.5 * np.mean((x @ p["w"] + p["b"] - y) ** 2)))
  return np.asarray(trace)


LS_PARAMS = {"w": jnp.zeros((D, 1)), "b": jnp.zeros((1,))}
TAIL_FACTOR = 1.06
"""The delayed run's mean loss over the last 60 of 300 steps is within this factor of the
undelayed run's (lr·L ≈ 0.35, a third of the delayed bound; measured 1.002 to 1.023)."""


@pytest.mark.parametrize("name", ["identity", "scaled_sign"])
def test_least_squares_under_data_parallel_on_8_devices(name, mesh):
  c = commopt.compressors.make(name)
  traces = []
  for delayed in (False, True):
    inner = sgd_over(c, 0.3, axis_name="data")
    dp = commopt.data_parallel(_ls_loss, pipelined(inner) if delayed else inner, mesh)

    def step(p, s, b, dp=dp):
      p, s, _ = dp.step(p, s, b)
      return p, s
    traces.append(_ls_run(step, dp.place_params(LS_PARAMS), dp.init(LS_PARAMS)))
  plain, late = traces
  assert late[-60:].mean() < TAIL_FACTOR * plain[-60:].mean(), (plain[-60:].mean(),
                                                                late[-60:].mean())
  assert late[-1] < 0.06 * late[0]                 # 2.3 at the start, 0.12 is the optimum


@pytest.mark.parametrize("name", ["identity", "scaled_sign"])
def test_least_squares_with_simulated_workers(name):
  c = commopt.compressors.make(name)
  traces = []
  for delayed in (False, True):
    inner = sgd_over(c, 0.3)
    w = vmap_workers(pipelined(inner) if delayed else inner, N)
    grad = jax.jit(jax.vmap(jax.grad(_ls_loss), in_axes=(None, 0)))

    def step(p, s, b, w=w):
      b = jax.tree.map(lambda v: v.reshape((N, ROWS) + v.shape[1:]), b)
      u, s = w.update(grad(p, b), s)
      return optax.apply_updates(p, jax.tree.map(lambda v: v[0], u)), s
    traces.append(_ls_run(step, LS_PARAMS, w.init(LS_PARAMS)))
  plain, late = traces
  assert late[-60:].mean() < TAIL_FACTOR * plain[-60:].mean()


# -- data_parallel: layout, the compiled exchange, non-finite steps --------------------------

def _dp(mesh, tx, **options):
  loss = lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)
  return commopt.data_parallel(loss, tx, mesh, **options)


def _batch(seed=0, bad_worker=None):
  rng = np.random.default_rng(seed)
  b = {"x": rng.normal(size=(32, 6)).astype(np.float32),
       "y": rng.normal(size=(32, 5)).astype(np.float32)}
  if bad_worker is not None:
    b["x"][4 * bad_worker] = np.nan
  return b


def test_the_kept_gradient_is_per_worker_state(mesh):
  dp = _dp(mesh, pipelined(sgd_over(commopt.scaled_sign(), axis_name="data")))
  pending = dp.state_specs(PARAMS).inner_state.pending[0]
  assert pending["w"][0] == "data" and pending["b"][0] == "data"
  state = dp.init(PARAMS)
  assert state.inner_state.pending[0]["w"].shape == (N, 6, 5)
  params, state, _ = dp.step(dp.place_params(PARAMS), state, _batch())
  kept = np.asarray(state.inner_state.pending[0]["w"])
  assert not np.allclose(kept[0], kept[1])                # each worker's own gradient


@pytest.mark.slow
def test_no_exchange_of_a_pipelined_step_waits_for_the_backward_pass(mesh):
  # Read from the compiled program: undelayed, every collective waits for the batch; with
  # pipelined and no skip on this step's gradient, none does, with or without the agreed
  # skip on the kept gradient inside. (data_parallel's own skip, skip_nonfinite=True,
  # agrees on this step's gradient first; what waits for that is its to decide.)
  params = {"w": jnp.zeros((64, 5)), "b": jnp.zeros((5,))}
  batch = {"x": np.ones((32, 64), np.float32), "y": np.ones((32, 5), np.float32)}
  inner = lambda: sgd_over(commopt.scaled_sign(), axis_name="data")
  cases = {
      "undelayed": (inner(), True),
      "pipelined": (pipelined(inner()), False),
      "kept": (pipelined(apply_if_finite(inner(), axis_name="data")), False),
  }
  for label, (tx, skip) in cases.items():
    dp = commopt.data_parallel(lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2),
                               tx, mesh, skip_nonfinite=skip)
    text = dp.lower(dp.place_params(params), dp.init(params), batch).compile().as_text()
    found = batch_dependent_collectives(text)
    assert len(found) >= 2, (label, found)
    waiting = [c["shape"] for c in found if c["batch"]]
    assert waiting == ([c["shape"] for c in found] if label == "undelayed" else []), (label,
                                                                                     found)


def test_momentum_after_a_compressed_exchange_stays_replicated(mesh):
  # While data_parallel traces the layout, the kept gradient (a state leaf) is typed
  # replicated until found per worker; what pipelined hands `inner` is typed per worker from
  # the start, so the optimizer's state after the exchange is not mistaken for per worker.
  params = {"k": jnp.zeros((3, 3, 32, 64)), "b": jnp.zeros((64,))}
  inner = optax.chain(commopt.compressed_mean(commopt.scaled_sign(), axis_name="data"),
                      optax.sgd(0.05, momentum=0.9))
  dp = commopt.data_parallel(lambda p, b: jnp.mean((b["x"] @ p["k"].reshape(-1, 64) + p["b"]) ** 2),
                             pipelined(inner), mesh)
  layout = dp.per_worker(params).inner_state
  assert layout.pending[0] == {"k": True, "b": True}
  assert layout.inner_state[1][0].trace == {"k": False, "b": False}
  x = np.random.default_rng(0).normal(size=(64, 288)).astype(np.float32)
  p, s = dp.place_params(params), dp.init(params)
  for _ in range(3):
    p, s, _ = dp.step(p, s, {"x": x})
  assert np.isfinite(np.asarray(p["k"])).all()


def test_the_batch_dependence_reader_follows_chains_and_calls():
  hlo = "\n".join([
      "HloModule m", "",
      "%branch (p: f32[2]) -> f32[2] {",
      "  %p = f32[2]{0} parameter(0)",
      "  ROOT %r3 = f32[2]{0} all-gather(%p), dimensions={0}",
      "}", "",
      "ENTRY %main (a: f32[2], b: f32[2]) -> f32[2] {",
      '  %a = f32[2]{0} parameter(0), metadata={op_name="batch.x"}',
      '  %b = f32[2]{0} parameter(1), metadata={op_name="opt_state.pending"}',
      "  %n = f32[2]{0} negate(%a)",
      "  %r1 = f32[2]{0} all-reduce(%b), to_apply=%add",
      "  %r2 = f32[2]{0} all-reduce(%n), to_apply=%add",
      "  %c = pred[] compare(%r2, %r2), direction=EQ",
      "  %k = f32[2]{0} conditional(%c, %b, %b), branch_computations={%branch, %branch}",
      "  ROOT %s = f32[2]{0} add(%r1, %k)", "}"])
  found = batch_dependent_collectives(hlo)
  assert [(c["name"], c["batch"]) for c in found] == [
      ("r1", False), ("r2", True), ("k/r3", True), ("k/r3", True)]


def test_a_nan_step_is_skipped_with_the_kept_gradient_and_it_goes_out_next(mesh):
  # Default data_parallel (skip_nonfinite=True): the NaN gradient is never kept; the
  # skipped step leaves everything as it was, so the run equals one without that step.
  tx = pipelined(sgd_over(commopt.scaled_sign(), axis_name="data"))
  dp = _dp(mesh, tx, donate=False)
  batches = [_batch(i) for i in range(5)]
  p, s = dp.place_params(PARAMS), dp.init(PARAMS)
  ref_p, ref_s = p, s
  for i, b in enumerate(batches):
    if i == 2:
      before = host_copy((p, s))
      p, s, _ = dp.step(p, s, _batch(99, bad_worker=3))
      assert int(s.total_notfinite) == 1
      kept = host_copy((p, s))
      assert_same_bits(kept[0], before[0])
      assert_same_bits(kept[1].inner_state, before[1].inner_state)   # pending g_1 kept
    p, s, _ = dp.step(p, s, b)
    ref_p, ref_s, _ = dp.step(ref_p, ref_s, b)
  assert_same_bits(host_copy(p), host_copy(ref_p))
  assert_same_bits(host_copy(s.inner_state), host_copy(ref_s.inner_state))


def test_with_the_agreement_on_the_kept_gradient_a_nan_is_dropped_one_step_later(mesh):
  tx = pipelined(apply_if_finite(sgd_over(commopt.scaled_sign(), axis_name="data"),
                                 axis_name="data"))
  dp = _dp(mesh, tx, skip_nonfinite=False, donate=False)
  p, s = dp.place_params(PARAMS), dp.init(PARAMS)
  for i in range(2):
    p, s, _ = dp.step(p, s, _batch(i))
  p, s, _ = dp.step(p, s, _batch(2, bad_worker=3))      # kept: NaN on worker 3
  assert np.isnan(np.asarray(s.pending[0]["w"])[3]).any()
  residual = host_copy(s.inner_state.inner_state[0].residual)
  before = host_copy(p)
  p, s, _ = dp.step(p, s, _batch(3))                     # its exchange is skipped
  assert_same_bits(host_copy(p), before)
  assert_same_bits(host_copy(s.inner_state.inner_state[0].residual), residual)
  assert int(s.inner_state.total_notfinite) == 1
  assert np.isfinite(np.asarray(s.pending[0]["w"])).all()
  p, s, _ = dp.step(p, s, _batch(4))
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(p))
  assert not np.array_equal(np.asarray(p["w"]), before["w"])


def test_an_exchange_that_overflows_is_dropped_and_the_next_gradient_goes_out():
  # Under an outer agreed skip, a kept gradient whose update overflows would be kept by
  # the skip and overflow again at every later step; pipelined drops it instead.
  lr = 1e20
  tx = apply_if_finite(pipelined(sgd_over(commopt.compressors.identity(), lr)),
                       axis_name="workers")
  w = vmap_workers(tx, N)
  state = w.init(PARAMS)
  huge = jax.tree.map(lambda x: jnp.full((N,) + x.shape, 1e20), PARAMS)
  ones = jax.tree.map(lambda x: jnp.ones((N,) + x.shape), PARAMS)
  _, state = w.update(huge, state)                      # kept
  u, state = w.update(ones, state)                      # 1e20 * 1e20 overflows: dropped
  assert all(bool(jnp.all(x == 0)) for x in jax.tree.leaves(u))
  assert int(state.inner_state.dropped[0]) == 1 and int(state.total_notfinite[0]) == 0
  assert int(state.inner_state.inner_state[0].count[0]) == 0      # the exchange is undone
  u, state = w.update(ones, state)                      # the ones go out
  np.testing.assert_allclose(u["w"][0], -lr)


def test_a_checkpointed_run_continues_bit_for_bit(mesh, tmp_path):
  import orbax.checkpoint as ocp
  tx = pipelined(sgd_over(commopt.scaled_sign(), axis_name="data"))
  dp = _dp(mesh, tx, donate=False)
  p, s = dp.place_params(PARAMS), dp.init(PARAMS)
  for i in range(2):
    p, s, _ = dp.step(p, s, _batch(i))
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(tmp_path / "ckpt", {"params": p, "opt_state": s})
  target = dict(zip(("params", "opt_state"), dp.abstract_state(PARAMS)))
  with ocp.StandardCheckpointer() as ckpt:
    restored = ckpt.restore(tmp_path / "ckpt", target)
  assert_same_bits(host_copy(restored["opt_state"].inner_state.pending),
                   host_copy(s.inner_state.pending))
  p2, s2 = restored["params"], restored["opt_state"]
  for i in range(2, 4):
    p, s, _ = dp.step(p, s, _batch(i))
    p2, s2, _ = dp.step(p2, s2, _batch(i))
  assert_same_bits(host_copy(p2), host_copy(p))


def test_resizing_keeps_the_workers_mean_kept_gradient(mesh):
  tx = pipelined(sgd_over(commopt.scaled_sign(), axis_name="data"))
  dp = _dp(mesh, tx)
  p, s = dp.place_params(PARAMS), dp.init(PARAMS)
  p, s, _ = dp.step(p, s, _batch())
  dp4 = _dp(jax.make_mesh((4,), ("data",), devices=jax.devices()[:4]), tx)
  resized = dp4.resize_state(s, PARAMS)
  np.testing.assert_allclose(np.mean(resized.inner_state.pending[0]["w"], 0),
                             np.mean(s.inner_state.pending[0]["w"], 0), rtol=1e-6, atol=1e-7)


def test_the_comm_plan_is_the_inner_one():
  inner = sgd_over(commopt.scaled_sign(), axis_name="data")
  params = {"w": jnp.zeros((64, 32))}
  assert (wire.comm_plan(pipelined(inner), params, 8).sent_bytes
          == wire.comm_plan(inner, params, 8).sent_bytes > 0)


# -- arguments ------------------------------------------------------------------------------

def test_bad_arguments_are_named():
  with pytest.raises(ValueError, match=r"pipelined: `delay` must be an integer >= 1, got 0"):
    pipelined(optax.sgd(0.1), delay=0)
  with pytest.raises(commopt.OptionTypeError, match="`delay`"):
    pipelined(optax.sgd(0.1), delay=1.5)
  with pytest.raises(commopt.OptionTypeError, match="pipelined: `inner` must be an optax"):
    pipelined(0.1)
  tx = pipelined(optax.sgd(0.1))
  state = tx.init(PARAMS)
  with pytest.raises(ValueError, match=r"update \['w'\] has shape \(3,\).*shape \(6, 5\)"):
    tx.update({"w": jnp.zeros(3), "b": jnp.zeros(5)}, state)
  with pytest.raises(ValueError, match="updates' tree"):
    tx.update({"w": jnp.zeros((6, 5))}, state)


def test_the_top_level_and_transforms_export_it():
  assert commopt.transforms.pipelined is commopt.transforms.pipelined
  assert commopt.transforms.PipelinedState is commopt.transforms.PipelinedState



# -- the "Overlapping communication" page ------------------------------------------------

PAGE = ROOT / "docs" / "guide" / "overlap.md"


@pytest.mark.slow
def test_the_overlapping_communication_page_runs_in_order(capsys):
  blocks = re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), flags=re.S | re.M)
  assert blocks
  ns = {}
  for block in blocks:
    exec(compile(block, str(PAGE), "exec"), ns)   # noqa: S102 - the page's own code
  out = capsys.readouterr().out.splitlines()
  start = float(jnp.mean(jnp.square(ns["batch"]["y"]))) / 2      # the loss at zero weights
  assert float(out[0]) < 0.5 * start, (out[0], start)
  assert out[1] == "(8, 32, 4)"
  assert not ns["dp"].skip_nonfinite and int(ns["opt_state"].count) == 40
  # The overlapped data-parallel block: trained from the start, nothing left kept.
  loss, count = out[2].split()
  assert float(loss) < 0.5 * start and int(count) == 40 and ns["state2"].kept is None
  # The overlapped DiLoCo block: trained on from there, nothing left in flight.
  loss, count = out[3].split()
  assert float(loss) < 0.5 * start and int(count) == 40 and ns["state"].pending is None

# -- the digits CNN (slow) ------------------------------------------------------------------

CNN_STEPS, CNN_MARGIN = 150, 0.02
"""Steps of the CNN runs, and how far below the undelayed run's test accuracy the delayed
one may end (measured: 0.978 against 0.978 dense, 0.981 against 0.983 with scaled_sign)."""


def digits_cnn_accuracies(name: str) -> dict:
  """``{"undelayed": accuracy, "delayed": accuracy}`` of
  :func:`test_the_digits_cnn_reaches_the_undelayed_accuracy`'s runs (in a process of its
  own, with 8 CPU devices; ``call_in_process`` puts ``examples/`` on its path)."""
  import digits_cnn
  x_train, y_train, x_test, y_test = digits_cnn.load_digits_split()
  params0, logits_fn, loss_fn = digits_cnn.model_fns(0)
  accuracy = jax.jit(lambda p, x, y: jnp.mean(jnp.argmax(logits_fn(p, x), -1) == y))
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  found = {}
  for delayed in (False, True):
    inner = optax.chain(commopt.compressed_mean(commopt.compressors.make(name), axis_name="data"),
                        optax.sgd(0.1, momentum=0.5))
    dp = commopt.data_parallel(loss_fn, pipelined(inner) if delayed else inner, mesh)
    p, s = dp.place_params(params0), dp.init(params0)
    rng = np.random.default_rng(0)
    for _ in range(CNN_STEPS):
      idx = rng.choice(len(x_train), 128, replace=False)
      p, s, _ = dp.step(p, s, {"x": x_train[idx], "y": y_train[idx]})
    found["delayed" if delayed else "undelayed"] = float(accuracy(p, x_test, y_test))
  return found


@pytest.mark.slow
@pytest.mark.optimized
@pytest.mark.parametrize("name", ["identity", "scaled_sign"])
def test_the_digits_cnn_reaches_the_undelayed_accuracy(name, call_in_process):
  """examples/digits_cnn.py's CNN (1.07M parameters), 8 workers x 16 rows, momentum SGD
  (0.1, 0.5: an effective step of 0.2), 150 steps, delayed against undelayed; in a process
  of its own, which compiles as users do."""
  found = call_in_process("test_delayed", "digits_cnn_accuracies", timeout=900, name=name)
  assert found["undelayed"] > 0.95, found
  assert found["delayed"] >= found["undelayed"] - CNN_MARGIN, found


# --- the exchange on a thread of its own (overlapped_data_parallel) -----------------


def _pipelined_pair(mesh, compressor):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(256, 32)).astype(np.float32)
  y = x @ rng.normal(size=(32, 4)).astype(np.float32)
  params = {"w": jnp.zeros((32, 4)), "b": jnp.zeros((4,))}
  loss = lambda p, b: 0.5 * jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)
  inner = lambda: optax.chain(commopt.compressed_mean(compressor, axis_name="data", min_size=1),
                              optax.sgd(0.1))
  dp = commopt.data_parallel(loss, pipelined(apply_if_finite(inner(), axis_name="data")), mesh,
                             skip_nonfinite=False)
  run = commopt.parallel.overlapped_data_parallel(loss, inner(), mesh)
  batches = [{"x": x[t * 16:][:128], "y": y[t * 16:][:128]} for t in range(7)]
  return dp, run, params, batches


@pytest.mark.parametrize("compressor", [commopt.scaled_sign(), commopt.compressors.identity()],
                         ids=["scaled_sign", "identity"])
def test_overlapped_data_parallel_is_pipelined_bit_for_bit(mesh, compressor):
  """Two programs per step (the backward pass, and the exchange of the kept gradient on a
  thread) give pipelined(apply_if_finite(tx))'s parameters and losses, bit for bit; finish
  applies the gradient still kept, as pipelined's next step does. A NaN in one worker's
  gradient is dropped by the next exchange's agreed skip in both."""
  dp, run, params, batches = _pipelined_pair(mesh, compressor)
  batches[2]["x"] = batches[2]["x"].copy()
  batches[2]["x"][3, 0] = np.nan                 # worker 0's gradient at step 2
  p1, s1 = dp.place_params(params), dp.init(params)
  p2, s2 = run.place_params(params), run.init(params)
  try:
    for b in batches[:6]:
      p1, s1, l1 = dp.step(p1, s1, b)
      p2, s2, l2 = run.step(p2, s2, b)
      assert_same_bits(l2, l1)
      assert_same_bits(p2, p1)
    p1, s1, _ = dp.step(p1, s1, batches[6])
    p2, s2 = run.finish(p2, s2)
    assert_same_bits(p2, p1)
    assert s2.kept is None and s2.count == 6
    assert np.all(np.isfinite(np.asarray(p2["w"])))
  finally:
    run.close()


def test_overlapped_data_parallel_refuses_a_mesh_with_other_axes(mesh2d):
  with pytest.raises(ValueError, match=r"`mesh` must have one axis, the data axis 'local'"):
    commopt.parallel.overlapped_data_parallel(lambda p, b: 0.0, optax.sgd(0.1), mesh2d,
                                              axis_name="local")
