"""apply_if_finite and multi_steps across workers: vmap, shard_map and data_parallel."""

import inspect
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import commopt
from commopt.testing import assert_same_bits, host_copy
from commopt.transforms import (
    ApplyIfFiniteState,
    MultiStepsState,
    apply_if_finite,
    multi_steps,
)

N = 8


def _sign_sgd(axis, error_feedback="auto"):
  return optax.chain(commopt.compressed_mean(commopt.scaled_sign(), axis_name=axis, min_size=0,
                                             error_feedback=error_feedback),
                     optax.sgd(0.1))


def _stack(tree, n=N):
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + jnp.shape(x)), tree)


def _shard_map_update(tx, mesh, axis, check_vma):
  """A hand-written shard_map over ``axis``: inputs and state stacked per worker."""
  def body(u, s):
    squeeze = lambda t: jax.tree.map(lambda x: x[0], t)
    out, new = tx.update(squeeze(u), squeeze(s))
    expand = lambda t: jax.tree.map(lambda x: x[None], t)
    return expand(out), expand(new)

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(axis), P(axis)),
                             out_specs=(P(axis), P(axis)), check_vma=check_vma))
  sharded = NamedSharding(mesh, P(axis))
  return lambda u, s: fn(jax.device_put(u, sharded), jax.device_put(s, sharded))


def _updates(seed, bad_worker=None, shape=(N, 64)):
  u = jax.random.normal(jax.random.key(seed), shape)
  if bad_worker is not None:
    u = u.at[bad_worker, 5].set(jnp.nan)
  return {"w": u}


def _check_skipped(out, before, after):
  """Every worker returned zero updates and kept its inner state bit for bit."""
  assert np.all(np.asarray(out["w"]) == 0)
  assert_same_bits(before.inner_state, after.inner_state)
  np.testing.assert_array_equal(after.last_finite, False)
  np.testing.assert_array_equal(after.notfinite_count, 1)
  np.testing.assert_array_equal(after.total_notfinite, 1)


def _run_three_steps(update, state, bad_worker):
  """A finite step, a step with a NaN on one worker, a finite step."""
  _, state = update(_updates(0), state)
  before = host_copy(state)
  out, state = update(_updates(1, bad_worker), state)
  _check_skipped(out, before, host_copy(state))
  out, state = update(_updates(2), state)
  assert np.all(np.isfinite(out["w"])) and np.any(np.asarray(out["w"]) != 0)
  np.testing.assert_array_equal(state.last_finite, True)
  np.testing.assert_array_equal(state.notfinite_count, 0)
  np.testing.assert_array_equal(state.total_notfinite, 1)
  # The inner transform counted two steps, not three.
  np.testing.assert_array_equal(state.inner_state[0].count, 2)


# -- apply_if_finite ---------------------------------------------------------------


def test_apply_if_finite_vmap_workers():
  tx = apply_if_finite(_sign_sgd("workers"), axis_name="workers")
  w = commopt.testing.vmap_workers(tx, N)
  _run_three_steps(w.update, w.init({"w": jnp.zeros(64)}), bad_worker=5)


@pytest.mark.parametrize("check_vma", [True, False])
def test_apply_if_finite_shard_map(check_vma):
  # With check_vma=False this is the case in which optax's deadlocks (below).
  # There nothing checks that per-worker residuals leave the map per worker,
  # so compressed_mean refuses to keep any (tests/test_coming_from_optax.py): no error feedback.
  mesh = jax.make_mesh((N,), ("data",))
  tx = apply_if_finite(_sign_sgd("data", "auto" if check_vma else False), axis_name="data")
  state = _stack(tx.init({"w": jnp.zeros(64)}))
  _run_three_steps(_shard_map_update(tx, mesh, "data", check_vma), state, bad_worker=3)


@pytest.mark.parametrize("check_vma, agree, alone", [
    (True, False, True),      # no exchange this step: worker 3 skips alone, no collective
    (True, True, False),      # an exchange: every worker skips
    (False, False, False),    # no varying types to tell per-worker state: every worker skips
])
def test_apply_if_finite_agrees_only_when_told(check_vma, agree, alone):
  mesh = jax.make_mesh((N,), ("data",))
  tx = apply_if_finite(optax.adam(0.1), axis_name="data",
                       agree_when=lambda inner_state: jnp.array(agree))
  update = _shard_map_update(tx, mesh, "data", check_vma)
  state = _stack(tx.init({"w": jnp.zeros(64)}))
  out, state = update(_updates(1, bad_worker=3), state)
  moved = np.any(np.asarray(out["w"]) != 0, axis=1)
  skipped = [w == 3 or not alone for w in range(N)]
  assert moved.tolist() == [not k for k in skipped]
  assert np.asarray(state.total_notfinite).tolist() == [int(k) for k in skipped]
  mu = np.asarray(state.inner_state[0].mu["w"])
  assert [not m.any() for m in mu] == skipped
  # Here every state leaf enters the map per worker, adam's count too: each worker's own.
  assert np.asarray(state.inner_state[0].count).tolist() == [int(not k) for k in skipped]


def test_agree_when_must_be_the_same_on_every_worker():
  mesh = jax.make_mesh((N,), ("data",))
  tx = apply_if_finite(optax.adam(0.1), axis_name="data",
                       agree_when=lambda inner_state: inner_state[0].mu["w"][0] > 0)
  update = _shard_map_update(tx, mesh, "data", check_vma=True)
  with pytest.raises(ValueError, match=r"`agree_when` must return the same value on every"):
    update(_updates(1), _stack(tx.init({"w": jnp.zeros(64)})))


@pytest.mark.parametrize("layout", ["shard_map", "shard_map, flat buckets",
                                    "shard_map, check_vma=False", "vmap"])
def test_the_flag_rides_in_the_dense_all_reduce(layout, monkeypatch):
  # "b" is below min_size, sent dense: the flag rides in its all-reduce. The NaN is in
  # worker 3's compressed "w", whose error-feedback residuals must stay as they were.
  # The exchange answers the skip in its state (commopt._src.finite): it carried the flag.
  from commopt.transforms import _control
  carried = []
  answers = _control._answers
  monkeypatch.setattr(_control, "_answers",
                      lambda s: (lambda r: carried.append(bool(r[0])) or r)(answers(s)))
  check_vma = layout != "shard_map, check_vma=False"
  axis = "workers" if layout == "vmap" else "data"
  cm = commopt.compressed_mean(commopt.scaled_sign(), axis_name=axis,
                               bucket_bytes=16 if "flat" in layout else "auto",
                               error_feedback="auto" if check_vma else False)
  # The clip turns the infinities of the reduced "w" finite: the output check alone would
  # let this step through, and only the input's flag skips it.
  tx = apply_if_finite(optax.chain(cm, optax.clip(0.01), optax.sgd(0.1)), axis_name=axis)
  params = {"w": jnp.zeros(4096), "b": jnp.zeros(8)}
  if layout == "vmap":
    w = commopt.testing.vmap_workers(tx, N)
    update, state = w.update, w.init(params)
  else:
    update = _shard_map_update(tx, jax.make_mesh((N,), ("data",)), "data", check_vma)
    state = _stack(tx.init(params))
  grads = lambda seed: {"w": jax.random.normal(jax.random.key(seed), (N, 4096)),
                        "b": jax.random.normal(jax.random.key(seed + 1), (N, 8))}
  _, state = update(grads(0), state)
  before = host_copy(state)
  out, state = update({**grads(2), "w": grads(2)["w"].at[3, 7].set(jnp.inf)}, state)
  assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(out))
  assert_same_bits(before.inner_state, host_copy(state.inner_state))
  np.testing.assert_array_equal(state.last_finite, False)
  out, state = update(grads(4), state)
  np.testing.assert_array_equal(state.last_finite, True)
  assert all(np.all(np.isfinite(x)) and np.any(np.asarray(x) != 0) for x in jax.tree.leaves(out))
  assert carried and all(carried)


def test_apply_if_finite_over_a_tuple_of_axes():
  mesh = jax.make_mesh((2, 4), ("node", "local"))
  axes = ("node", "local")
  mean = optax.GradientTransformation(
      lambda p: optax.EmptyState(), lambda u, s, p=None: (jax.lax.pmean(u, axes), s))
  tx = apply_if_finite(optax.chain(mean, optax.sgd(0.1)), axis_name=axes)
  update = _shard_map_update(tx, mesh, axes, check_vma=True)
  state = _stack(tx.init({"w": jnp.zeros(64)}))
  out, state = update(_updates(1, bad_worker=6), state)
  assert np.all(np.asarray(out["w"]) == 0)
  np.testing.assert_array_equal(state.last_finite, False)
  out, state = update(_updates(2), state)
  np.testing.assert_array_equal(state.last_finite, True)
  assert np.all(np.isfinite(out["w"]))


def test_optax_apply_if_finite_fails_under_shard_map():
  mesh = jax.make_mesh((N,), ("data",))
  tx = optax.apply_if_finite(_sign_sgd("data"), 3)
  state = _stack(tx.init({"w": jnp.zeros(64)}))
  update = _shard_map_update(tx, mesh, "data", check_vma=True)
  with pytest.raises(TypeError, match="cond branches must have equal output types"):
    update(_updates(1, bad_worker=3), state)


_DEADLOCK = textwrap.dedent("""
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp, optax, commopt
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((8,), ("data",))
    tx = optax.apply_if_finite(optax.chain(
        commopt.compressed_mean(commopt.scaled_sign(), axis_name="data", min_size=0,
                                error_feedback=False), optax.sgd(0.1)), 3)
    state = jax.tree.map(lambda x: jnp.broadcast_to(x, (8,) + x.shape), tx.init(jnp.zeros(64)))
    def body(u, s):
      out, new = tx.update(u[0], jax.tree.map(lambda x: x[0], s))
      return out[None], jax.tree.map(lambda x: x[None], new)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data")),
                               out_specs=(P("data"), P("data")), check_vma=False))
    sh = NamedSharding(mesh, P("data"))
    u = jnp.ones((8, 64)).at[3, 5].set(jnp.nan)
    jax.block_until_ready(fn(jax.device_put(u, sh), jax.device_put(state, sh)))
    print("finished")
""")


@pytest.mark.slow
def test_optax_apply_if_finite_deadlocks_without_vma_check():
  # Worker 3 sees a NaN and skips the branch with the all-gather; the other 7
  # wait in it. XLA:CPU's rendezvous gives up (and aborts) after a timeout,
  # shortened here so the test is quick.
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(
      os.environ.get("XLA_FLAGS", "") + " --xla_cpu_collective_call_warn_stuck_timeout_seconds=1"
      " --xla_cpu_collective_call_terminate_timeout_seconds=3").strip())
  try:
    proc = subprocess.run([sys.executable, "-c", _DEADLOCK], env=env, capture_output=True,
                          text=True, timeout=120)
  except subprocess.TimeoutExpired:
    return  # stuck for good: the deadlock, without XLA's timeout
  if "Unknown flag in XLA_FLAGS" in proc.stderr:
    pytest.skip("this XLA has no CPU collective timeout flags")
  assert proc.returncode != 0 and "finished" not in proc.stdout
  assert "only 7 of them arrived" in proc.stderr, proc.stderr[-3000:]


def test_apply_if_finite_max_consecutive_errors():
  tx = apply_if_finite(optax.sgd(1.0), max_consecutive_errors=1)
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  bad = {"w": jnp.array([jnp.inf, 1.0])}
  out, state = tx.update(bad, state, params)
  assert np.all(np.asarray(out["w"]) == 0) and int(state.notfinite_count) == 1
  out, state = tx.update(bad, state, params)  # the second in a row is applied
  assert not np.isfinite(out["w"][0]) and int(state.notfinite_count) == 2
  assert not bool(state.last_finite) and int(state.total_notfinite) == 2
  out, state = tx.update({"w": jnp.ones(2)}, state, params)
  assert int(state.notfinite_count) == 0 and int(state.total_notfinite) == 2


def test_apply_if_finite_skip_leaves_params_bit_identical():
  # A skipped step returns -0.0, so even a parameter that is -0.0 keeps its bits.
  tx = apply_if_finite(optax.sgd(1.0))
  params = {"w": jnp.array([-0.0, 0.0, 1.5])}
  out, _ = tx.update({"w": jnp.array([jnp.nan, 1.0, 1.0])}, tx.init(params), params)
  assert_same_bits(optax.apply_updates(params, out), params)


def _skip_kwargs():
  params = inspect.signature(commopt.data_parallel).parameters
  return {"skip_nonfinite": False} if "skip_nonfinite" in params else {}


def _regression_loss(p, b):
  return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)


def _regression_batch(seed, rows_per_worker, d_in, d_out, bad_worker=None):
  kx, ky = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (N * rows_per_worker, d_in))
  if bad_worker is not None:
    x = x.at[bad_worker * rows_per_worker].set(jnp.nan)
  return {"x": x, "y": jax.random.normal(ky, (N * rows_per_worker, d_out))}


def test_apply_if_finite_data_parallel():
  mesh = jax.make_mesh((N,), ("data",))
  tx = apply_if_finite(
      optax.chain(commopt.compressed_mean(commopt.scaled_sign(), axis_name="data"), optax.sgd(0.1)),
      axis_name="data")
  dp = commopt.data_parallel(_regression_loss, tx, mesh, **_skip_kwargs())
  # 32 x 64 = 2048 elements: compressed (above min_size), with residuals.
  params = {"w": 0.1 * jax.random.normal(jax.random.key(9), (32, 64))}
  state = dp.init(params)
  batch = lambda seed, bad=None: _regression_batch(seed, 4, 32, 64, bad)
  for t in range(2):
    params, state, losses = dp.step(params, state, batch(t))
  params_before, state_before = host_copy(params), host_copy(state)
  residual = state_before.inner_state[0].residual["w"]
  assert residual.shape == (N, 32, 64) and np.any(residual != 0)

  params, state, losses = dp.step(params, state, batch(2, bad=3))
  losses = np.asarray(losses)
  assert np.isnan(losses[3]) and np.all(np.isfinite(np.delete(losses, 3)))
  assert_same_bits(host_copy(params), params_before)
  assert_same_bits(host_copy(state.inner_state), state_before.inner_state)
  assert not bool(state.last_finite)
  assert int(state.total_notfinite) == 1 and int(state.notfinite_count) == 1

  for t in range(3, 5):
    params, state, losses = dp.step(params, state, batch(t))
    assert np.all(np.isfinite(losses)) and bool(state.last_finite)
  assert np.all(np.isfinite(params["w"])) and np.any(np.asarray(params["w"]) != params_before["w"])
  assert int(state.total_notfinite) == 1 and int(state.notfinite_count) == 0
  assert int(state.inner_state[0].count) == 4


# -- multi_steps -------------------------------------------------------------------


def _unwrap(state) -> MultiStepsState:
  """data_parallel may wrap the optimizer in apply_if_finite."""
  return state.inner_state if isinstance(state, ApplyIfFiniteState) else state


@pytest.mark.slow
def test_multi_steps_communicates_every_kth_call():
  calls = []

  def probe():
    # Counts, at run time, the workers that enter the inner chain.
    def update(u, s, params=None):
      jax.debug.callback(lambda _: calls.append(1), jnp.int32(0))
      return u, s
    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)

  mesh = jax.make_mesh((N,), ("data",))
  inner = optax.chain(probe(), commopt.compressed_mean(commopt.scaled_sign(), axis_name="data"),
                      optax.sgd(0.1))
  dp = commopt.data_parallel(_regression_loss, multi_steps(inner, 4), mesh)
  params = {"w": 0.1 * jax.random.normal(jax.random.key(9), (32, 64))}
  state = dp.init(params)
  per_call, counts, moved = [], [], []
  for t in range(8):
    before = host_copy(params)
    seen = len(calls)
    params, state, _ = dp.step(params, state, _regression_batch(t, 2, 32, 64))
    jax.effects_barrier()
    per_call.append(len(calls) - seen)
    ms = _unwrap(state)
    counts.append(int(ms.inner_opt_state[1].count))
    moved.append(bool(np.any(host_copy(params)["w"] != before["w"])))
    assert int(ms.mini_step) == (t + 1) % 4
  assert per_call == [0, 0, 0, N, 0, 0, 0, N]
  assert counts == [0, 0, 0, 1, 1, 1, 1, 2]
  assert moved == [False, False, False, True] * 2
  assert int(_unwrap(state).gradient_step) == 2


@pytest.mark.slow
def test_multi_steps_equals_one_step_on_the_big_batch():
  mesh = jax.make_mesh((N,), ("data",))
  inner = optax.chain(commopt.compressed_mean(commopt.compressors.identity(), axis_name="data", min_size=0),
                      optax.sgd(0.1))
  dp_acc = commopt.data_parallel(_regression_loss, multi_steps(inner, 4), mesh)
  dp_big = commopt.data_parallel(_regression_loss, inner, mesh)
  p0 = {"w": 0.1 * jax.random.normal(jax.random.key(9), (6, 3))}
  w0 = np.array(p0["w"])
  s_acc, s_big = dp_acc.init(p0), dp_big.init(p0)
  p_acc, p_big = p0, jax.tree.map(jnp.copy, p0)  # each step donates its params
  for r in range(2):
    micro = [_regression_batch(10 * r + j, 2, 6, 3) for j in range(4)]
    for b in micro:
      p_acc, s_acc, _ = dp_acc.step(p_acc, s_acc, b)
    # Worker w's shard of the big batch is the union of its 4 micro-shards.
    big = jax.tree.map(
        lambda *xs: jnp.stack([x.reshape(N, 2, -1) for x in xs], 1).reshape(N * 4 * 2, -1),
        *micro)
    p_big, s_big, _ = dp_big.step(p_big, s_big, big)
    np.testing.assert_allclose(p_acc["w"], p_big["w"], rtol=1e-5, atol=1e-6)
  assert not np.allclose(p_big["w"], w0)


def test_optax_multi_steps_under_data_parallel_names_the_equivalent():
  mesh = jax.make_mesh((N,), ("data",))
  tx = optax.MultiSteps(_sign_sgd("data"), 4)
  dp = commopt.data_parallel(_regression_loss, tx, mesh)
  params = {"w": jnp.zeros((32, 64))}
  with pytest.raises(ValueError, match="commopt.transforms.multi_steps") as e:
    dp.init(params)
  assert "cond branches must have equal output types" in str(e.value.__cause__)


def test_multi_steps_schedule():
  # k = gradient_step + 1: inner steps after calls 1, 3 and 6.
  tx = multi_steps(optax.sgd(1.0), lambda step: step + 1)
  state = tx.init({"w": jnp.zeros(())})
  emitted = []
  for t in range(6):
    out, state = tx.update({"w": jnp.asarray(float(t))}, state)
    emitted.append(float(out["w"]))
  # The means of (0), (1, 2) and (3, 4, 5).
  assert emitted == [-0.0, 0.0, -1.5, 0.0, 0.0, -4.0]
  assert int(state.gradient_step) == 3 and int(state.mini_step) == 0


def test_multi_steps_accumulates_bf16_in_float32():
  tx = multi_steps(optax.sgd(1.0), 2)
  state = tx.init({"w": jnp.zeros(4, jnp.bfloat16)})
  assert state.acc_grads["w"].dtype == jnp.float32
  out, state = tx.update({"w": jnp.ones(4, jnp.bfloat16)}, state)
  out, state = tx.update({"w": jnp.ones(4, jnp.bfloat16)}, state)
  assert out["w"].dtype == jnp.bfloat16 and np.all(np.asarray(out["w"], np.float32) == -1)


# -- arguments ----------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, name", [
    ({"inner": "sgd"}, "inner"),
    ({"axis_name": 3}, "axis_name"),
    ({"axis_name": ("data", "data")}, "axis_name"),
    ({"max_consecutive_errors": -1}, "max_consecutive_errors"),
    ({"max_consecutive_errors": True}, "max_consecutive_errors"),
    ({"max_consecutive_errors": 2.0}, "max_consecutive_errors"),
    ({"axis_name": "data", "agree_when": True}, "agree_when"),
    ({"agree_when": lambda s: True}, "agree_when"),                       # no axis
    ({"axis_name": "data", "agree_when": lambda s: True, "max_consecutive_errors": 1},
     "agree_when"),
])
def test_apply_if_finite_arguments(kwargs, name):
  kwargs = {"inner": optax.sgd(0.1), **kwargs}
  with pytest.raises(ValueError, match=rf"apply_if_finite: `{name}` .* got"):
    apply_if_finite(**kwargs)


def test_apply_if_finite_strict_false_names_its_replacement():
  with pytest.raises(ValueError, match=r"strict=False was removed.*on_skip='zero'.*"
                                       r"optax.apply_if_finite"):
    apply_if_finite(optax.sgd(0.1), axis_name="data", strict=False)
  apply_if_finite(optax.sgd(0.1), axis_name="data", strict=True)    # what it always does


@pytest.mark.parametrize("kwargs, name", [
    ({"inner": None}, "inner"),
    ({"every_k_schedule": 0}, "every_k_schedule"),
    ({"every_k_schedule": True}, "every_k_schedule"),
    ({"every_k_schedule": 2.5}, "every_k_schedule"),
])
def test_multi_steps_arguments(kwargs, name):
  kwargs = {"inner": optax.sgd(0.1), "every_k_schedule": 2, **kwargs}
  with pytest.raises(ValueError, match=rf"multi_steps: `{name}` .* got"):
    multi_steps(**kwargs)
