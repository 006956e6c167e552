"""The zero-gradient skip: ``data_parallel(..., skip_nonfinite="zero")``.

On a step with a non-finite gradient on any worker the exchange returns a zero
mean and keeps its own state, the optimizer after it takes that zero gradient
(adam's moments decay, its count advances), and the parameters stay as they were.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import commopt
from commopt.testing import assert_same_bits, host_copy
from commopt.transforms import apply_if_finite

N = 8
B1, B2 = 0.9, 0.999


def _loss(p, b):
  return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)


def _params():
  return {"w": 0.1 * jax.random.normal(jax.random.key(9), (32, 64)), "b": jnp.zeros(64)}


def _batch(seed, bad_worker=None, rows=4):
  kx, ky = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (N * rows, 32))
  if bad_worker is not None:
    x = x.at[bad_worker * rows, 3].set(jnp.nan)
  return {"x": x, "y": jax.random.normal(ky, (N * rows, 64))}


def _adam(state):
  """adam's ScaleByAdamState inside data_parallel's optimizer state."""
  return state.inner_state[1][0]


def _good_then_bad(dp, bad_worker, rows=4):
  """One finite step, then one with a NaN on ``bad_worker``: the host copies of params and
  state before the bad step, and the params and state after it."""
  params = _params()
  state = dp.init(params)
  params, state, _ = dp.step(params, state, _batch(0, rows=rows))
  before_p, before = host_copy(params), host_copy(state)
  params, state, _ = dp.step(params, state, _batch(1, bad_worker=bad_worker, rows=rows))
  return before_p, before, params, state


COMPRESSORS = {
    # Both leaves dense: the flag rides in the one bucket.
    "identity": dict(compressor=commopt.compressors.identity()),
    # w compressed with an error-feedback residual, b dense (carries the flag).
    "scaled_sign": dict(compressor=commopt.scaled_sign()),
    # Every leaf compressed: no dense bucket, the flag's own all-reduce.
    "top_k": dict(compressor=commopt.top_k(0.1), min_size=0),
}


@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_a_skipped_step_is_a_zero_gradient_for_the_optimizer(mesh, name):
  tx = optax.chain(commopt.compressed_mean(axis_name="data", **COMPRESSORS[name]),
                   optax.adam(1e-2, b1=B1, b2=B2))
  dp = commopt.data_parallel(_loss, tx, mesh, skip_nonfinite="zero")
  params = _params()
  state = dp.init(params)
  for t in range(2):
    params, state, _ = dp.step(params, state, _batch(t))
  before_p, before = host_copy(params), host_copy(state)
  if name != "identity":
    assert np.any(np.asarray(before.inner_state[0].residual["w"]) != 0)

  params, state, losses = dp.step(params, state, _batch(2, bad_worker=3))
  assert np.isnan(np.asarray(losses)[3])
  assert_same_bits(host_copy(params), before_p)
  # The exchange kept its state (residuals, count); adam took a zero gradient.
  assert_same_bits(host_copy(state.inner_state[0]), before.inner_state[0])
  assert int(_adam(state).count) == 3
  for k in ("w", "b"):
    np.testing.assert_allclose(_adam(state).mu[k], B1 * _adam(before).mu[k], rtol=1e-6)
    np.testing.assert_allclose(_adam(state).nu[k], B2 * _adam(before).nu[k], rtol=1e-6)
  assert not bool(state.last_finite)
  assert int(state.total_notfinite) == 1 and int(state.notfinite_count) == 1

  for t in range(3, 5):
    params, state, losses = dp.step(params, state, _batch(t))
    assert np.all(np.isfinite(losses)) and bool(state.last_finite)
  assert np.all(np.isfinite(params["w"])) and np.any(np.asarray(params["w"]) != before_p["w"])
  assert int(state.total_notfinite) == 1 and int(_adam(state).count) == 5


def test_finite_steps_are_the_default_skips_bit_for_bit(mesh):
  tx = optax.chain(commopt.compressed_mean(commopt.scaled_sign(), axis_name="data"),
                   optax.adam(1e-2))
  runs = {}
  for skip in (True, "zero"):
    dp = commopt.data_parallel(_loss, tx, mesh, skip_nonfinite=skip)
    params, state = _params(), dp.init(_params())
    for t in range(3):
      params, state, _ = dp.step(params, state, _batch(t))
    runs[skip] = host_copy((params, state))
  assert_same_bits(runs[True], runs["zero"])


def test_without_a_leading_exchange_the_whole_state_is_kept(mesh):
  # The exchange after the optimizer (EF-SGD style) sees updates, not the wrapper's
  # input: nothing claims the verdict, so the skip keeps everything as the default does.
  tx = optax.chain(optax.adam(1e-2),
                   commopt.compressed_mean(commopt.scaled_sign(), axis_name="data"))
  dp = commopt.data_parallel(_loss, tx, mesh, skip_nonfinite="zero")
  before_p, before, params, state = _good_then_bad(dp, bad_worker=5)
  assert_same_bits(host_copy(params), before_p)
  assert_same_bits(host_copy(state.inner_state), before.inner_state)
  assert int(state.total_notfinite) == 1


def test_a_mean_that_overflows_from_finite_gradients_is_skipped(mesh):
  # One gradient element of 1e38 on every worker: each worker's gradients, and their
  # sums, are finite (the input flag passes), but the sum over 8 workers overflows inside
  # the exchange; the exchange's check of its own mean skips the step.
  tx = optax.chain(commopt.compressed_mean(commopt.compressors.identity(), axis_name="data"),
                   optax.adam(1e-2))
  dp = commopt.data_parallel(lambda p, b: jnp.mean(b["x"] @ p["w"]), tx, mesh,
                             skip_nonfinite="zero")
  params = {"w": jnp.zeros(4)}
  state = dp.init(params)
  x = jnp.tile(jnp.array([1e38, 1.0, 1.0, 1.0]), (N, 1))
  params, state, losses = dp.step(params, state, {"x": x})
  assert np.all(np.isfinite(losses))
  assert_same_bits(host_copy(params), {"w": np.zeros(4, np.float32)})
  assert int(state.total_notfinite) == 1 and int(_adam(state).count) == 1
  assert all(np.all(np.asarray(x) == 0) for x in (_adam(state).mu["w"], _adam(state).nu["w"]))


def test_a_nonfinite_shard_of_a_tensor_parallel_model(mesh):
  # Leaves sharded over a model axis: the workers agree before the exchange (no flag
  # rides), and the exchange of each shard zeroes its mean on that verdict.
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  specs = {"w": P(None, "model"), "b": P("model")}
  place = lambda p: {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in p.items()}
  tx = optax.chain(commopt.compressed_mean(commopt.top_k(0.1), axis_name="data", min_size=0),
                   optax.adam(1e-2, b1=B1, b2=B2))
  dp = commopt.data_parallel(_loss, tx, mesh, skip_nonfinite="zero", donate=False)
  params = place(_params())
  state = dp.init(params)
  params, state, _ = dp.step(params, state, _batch(0, rows=16))
  before_p, before = host_copy(params), host_copy(state)
  bad = _batch(1, rows=16)
  bad["y"] = bad["y"].at[0, 0].set(jnp.inf)      # worker 0, the shard of column 0 only
  params, state, _ = dp.step(params, state, bad)
  assert_same_bits(host_copy(params), before_p)
  assert_same_bits(host_copy(state.inner_state[0]), before.inner_state[0])
  np.testing.assert_allclose(_adam(state).mu["w"], B1 * _adam(before).mu["w"], rtol=1e-6)
  assert int(_adam(state).count) == 2 and int(state.total_notfinite) == 1
  assert params["w"].sharding.spec == specs["w"]


def test_the_step_inside_a_users_jit_and_scan(mesh):
  tx = optax.chain(commopt.compressed_mean(commopt.scaled_sign(), axis_name="data"),
                   optax.adam(1e-2))
  dp = commopt.data_parallel(_loss, tx, mesh, skip_nonfinite="zero", donate=False)
  batches = [_batch(t, bad_worker=2 if t == 3 else None) for t in range(6)]
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *batches)
  params = _params()

  @jax.jit
  def train(params, state, stacked):
    def body(carry, b):
      p, s = carry
      p, s, losses = dp.step_fn(p, s, b)
      return (p, s), jnp.mean(losses)
    return jax.lax.scan(body, (params, state), stacked)

  (p_scan, s_scan), _ = train(params, dp.init(params), stacked)
  p, s = params, dp.init(params)
  for b in batches:
    p, s, _ = dp.step(p, s, b)
  assert int(s_scan.total_notfinite) == 1 == int(s.total_notfinite)
  np.testing.assert_allclose(p_scan["w"], p["w"], rtol=1e-5, atol=1e-6)


def test_training_with_occasional_nans_reaches_the_default_skips_loss(mesh):
  # A linear model, a NaN on some worker every fifth step: the zero skip's loss ends
  # where the default skip's does (adam's moments decay over 8 skips of 40).
  rng = np.random.default_rng(0)
  w_true = rng.normal(size=(32, 64)).astype(np.float32)
  def batch(t):
    x = rng.normal(size=(N * 4, 32)).astype(np.float32)
    b = {"x": jnp.asarray(x), "y": jnp.asarray(x @ w_true)}
    if t % 5 == 4:
      b["x"] = b["x"].at[(t % N) * 4, 0].set(jnp.nan)
    return b
  batches = [batch(t) for t in range(40)]
  tx = optax.chain(commopt.compressed_mean(commopt.scaled_sign(), axis_name="data"),
                   optax.adam(0.05))
  final = {}
  for skip in (True, "zero"):
    dp = commopt.data_parallel(_loss, tx, mesh, skip_nonfinite=skip)
    params = {"w": jnp.zeros((32, 64)), "b": jnp.zeros(64)}
    state = dp.init(params)
    first = None
    for b in batches:
      params, state, losses = dp.step(params, state, b)
      first = float(np.nanmean(losses)) if first is None else first
    assert int(state.total_notfinite) == 8
    final[skip] = float(jnp.mean(jnp.stack([_loss(params, b) for b in batches[:4]])))
  assert final["zero"] < 0.2 * first
  assert final["zero"] < 1.5 * final[True]


def test_hierarchical_dense_means_are_judged_as_means(mesh2d):
  # A hierarchical exchange averages its dense leaves inside each node, then across: no
  # all-reduce spans every worker, so the dense means are judged themselves (the
  # inner sums differ between the nodes). The step traces, and a NaN skips it.
  axes = ("node", "local")
  tx = optax.chain(commopt.compressed_mean(commopt.scaled_sign(), axis_name=axes,
                                           strategy="hierarchical"),
                   optax.adam(1e-2, b1=B1, b2=B2))
  dp = commopt.data_parallel(_loss, tx, mesh2d, axes, skip_nonfinite="zero")
  before_p, before, params, state = _good_then_bad(dp, bad_worker=6)
  assert_same_bits(host_copy(params), before_p)
  assert_same_bits(host_copy(state.inner_state[0]), before.inner_state[0])
  np.testing.assert_allclose(_adam(state).nu["b"], B2 * _adam(before).nu["b"], rtol=1e-6)
  assert int(_adam(state).count) == 2 and int(state.total_notfinite) == 1


@pytest.mark.parametrize("named", [False, True])
def test_a_stateful_transform_before_the_exchange_keeps_its_state(mesh, named):
  # A gradient-norm logger first, returning the updates as they came: the exchange gets the
  # very input, but the logger's state took the NaN, so the skip keeps the whole state.
  # In a named chain the logger's name sorts after the exchange's, as a pytree flattens
  # a dict: what counts is the order the transforms ran in.
  def logger():
    return optax.GradientTransformation(lambda p: jnp.zeros(()),
                                        lambda u, s, p=None: (u, s + optax.tree.norm(u)))
  mean = commopt.compressed_mean(commopt.compressors.identity(), axis_name="data")
  tx = (optax.named_chain(("z_logger", logger()), ("a_mean", mean), ("b_adam", optax.adam(1e-2)))
        if named else optax.chain(logger(), mean, optax.adam(1e-2)))
  dp = commopt.data_parallel(_loss, tx, mesh, skip_nonfinite="zero")
  _, before, params, state = _good_then_bad(dp, bad_worker=2)
  assert_same_bits(host_copy(state.inner_state), before.inner_state)
  logged = state.inner_state["z_logger"] if named else state.inner_state[0]
  assert np.all(np.isfinite(np.asarray(logged)))
  assert int(state.total_notfinite) == 1


def test_apply_if_finite_zero_in_a_users_shard_map(mesh):
  tx = apply_if_finite(optax.chain(
      commopt.compressed_mean(commopt.compressors.identity(), axis_name="data"),
      optax.sgd(0.1, momentum=0.9)), axis_name="data", on_skip="zero")
  params = jnp.zeros(3)

  @jax.jit
  def run(x, trace):
    def body(g, trace):
      state = tx.init(params)
      sgd = (optax.TraceState(trace=trace),) + state.inner_state[1][1:]
      state = state._replace(inner_state=(state.inner_state[0], sgd))
      u, s = tx.update(g[0], state, params)
      return u[None], s.last_finite[None], s.inner_state[1][0].trace
    return jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P()),
                         out_specs=(P("data"), P("data"), P()))(x, trace)

  put = lambda v: jax.device_put(v, NamedSharding(mesh, P("data")))
  x = jnp.arange(N * 3, dtype=jnp.float32).reshape(N, 3)
  trace = jnp.array([1.0, 2.0, 3.0])
  u, ok, new_trace = run(put(x), trace)
  assert np.all(np.asarray(ok))
  np.testing.assert_allclose(new_trace, 0.9 * trace + np.asarray(x).mean(0), rtol=1e-6)
  u, ok, new_trace = run(put(x.at[3, 1].set(jnp.nan)), trace)
  assert not np.any(np.asarray(ok)) and np.all(np.asarray(u) == 0)
  np.testing.assert_allclose(new_trace, 0.9 * trace, rtol=1e-6)      # a zero gradient


@pytest.mark.parametrize("kwargs, match", [
    ({"on_skip": "drop"}, r"`on_skip` .* got 'drop'"),
    ({"on_skip": 0}, r"`on_skip`"),
    ({"on_skip": "zero", "max_consecutive_errors": 2}, r"max_consecutive_errors=2"),
    ({"on_skip": "zero", "agree_when": lambda s: True}, r"`on_skip` 'zero' needs .* agree_when="),
])
def test_apply_if_finite_on_skip_is_checked(kwargs, match):
  with pytest.raises(ValueError, match=match):
    apply_if_finite(optax.sgd(0.1), axis_name="data", **kwargs)


def test_data_parallel_names_the_skip_modes(mesh):
  with pytest.raises(ValueError, match=r"`skip_nonfinite` must be True, False or 'zero', "
                                       r"got 'zeros'"):
    commopt.data_parallel(_loss, optax.sgd(0.1), mesh, skip_nonfinite="zeros")
  # The removed mode names its replacements.
  with pytest.raises(ValueError, match=r"skip_nonfinite='fast' was removed: use True .* 'zero'"):
    commopt.data_parallel(_loss, optax.sgd(0.1), mesh, skip_nonfinite="fast")


def test_a_bfloat16_model_is_judged_from_its_means(mesh):
  # 16-bit leaves are summed pre-scaled and their means scaled up after, so their sums
  # do not judge the means: the exchange reads the means themselves. Training moves the
  # parameters, and a NaN on one worker still skips the step.
  tx = optax.chain(commopt.compressed_mean(commopt.compressors.identity(), axis_name="data"),
                   optax.adam(1e-2))
  loss = lambda p, b: jnp.mean((b["x"].astype(jnp.bfloat16) @ p["w"]).astype(jnp.float32) ** 2)
  dp = commopt.data_parallel(loss, tx, mesh, skip_nonfinite="zero", donate=False)
  params = {"w": jnp.ones((32, 4), jnp.bfloat16)}
  state = dp.init(params)
  p1, state, _ = dp.step(params, state, _batch(0))
  assert p1["w"].dtype == jnp.bfloat16 and np.any(np.asarray(p1["w"] != params["w"]))
  p2, state, _ = dp.step(p1, state, _batch(1, bad_worker=6))
  assert_same_bits(host_copy(p2), host_copy(p1))
  assert int(state.total_notfinite) == 1 and int(_adam(state).count) == 2   # settled


@pytest.mark.parametrize("wrap", ["masked", "multi_transform"])
def test_an_exchange_of_part_of_the_updates_does_not_settle_the_skip(mesh, wrap):
  """Only an exchange of the skip's very updates (their tree structure) settles the zero
  skip: under optax.masked or multi_transform it reduces part of them, so the skip checks
  the output and keeps the whole state, and nothing non-finite gets through."""
  mean = lambda: commopt.compressed_mean(commopt.compressors.identity(), axis_name="data")
  if wrap == "masked":
    tx = optax.chain(optax.masked(mean(), {"w": True, "b": False}),
                     optax.masked(mean(), {"w": False, "b": True}), optax.adam(1e-2))
  else:
    tx = optax.multi_transform({"a": optax.chain(mean(), optax.adam(1e-2)),
                                "b": optax.chain(optax.trace(0.9), mean())},
                               {"w": "b", "b": "a"})
  dp = commopt.data_parallel(_loss, tx, mesh, skip_nonfinite="zero")
  before_p, before, params, state = _good_then_bad(dp, bad_worker=2)
  assert int(state.total_notfinite) == 1
  assert_same_bits(host_copy(params), before_p)
  assert_same_bits(host_copy(state.inner_state), before.inner_state)


def test_a_skip_inside_data_parallels_skip(mesh):
  """A transform that is itself an apply_if_finite (optax's max_consecutive_errors, say)
  under data_parallel's skip: the outer skip's flag is not passed on twice."""
  inner = apply_if_finite(optax.chain(
      commopt.compressed_mean(commopt.scaled_sign(), axis_name="data"), optax.sgd(0.1)),
      axis_name="data", max_consecutive_errors=3)
  for skip in (True, "zero"):
    dp = commopt.data_parallel(_loss, inner, mesh, skip_nonfinite=skip)
    before_p, _, params, state = _good_then_bad(dp, bad_worker=5)
    assert int(state.total_notfinite) == 1
    assert_same_bits(host_copy(params), before_p)
