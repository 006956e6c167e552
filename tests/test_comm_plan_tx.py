"""wire.comm_plan on the ``tx`` users pass to data_parallel: chains, multi_transform, wrappers."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import commopt
from commopt import wire
from commopt.comm import _plan

N = 8


def params_like():
  # "b" is below compressed_mean's min_size: it goes dense, inside the same reduction.
  return {"w": jnp.zeros((64, 48)), "v": jnp.zeros((4096,)), "b": jnp.zeros((10,)),
          "frozen": None}


def sign_mean(axis="data"):
  return commopt.compressed_mean(commopt.scaled_sign(), axis_name=axis)


def bare_plan(params=None, n=N):
  return wire.comm_plan(sign_mean(), params_like() if params is None else params, n)


def by_leaf(entries):
  return sorted(entries)


def bytes_by_kind(entries):
  out = {}
  for e in entries:
    out[e.kind] = out.get(e.kind, 0) + e.contributed_bytes
  return out


def test_a_chain_plans_as_the_reduction_inside_it():
  bare = bare_plan()
  assert bare.uncovered == ()
  assert {c.kind for c in bare.collectives} == {"all-gather", "all-reduce"}
  got = wire.comm_plan(optax.chain(sign_mean(), optax.adam(1e-3)), params_like(), N)
  assert got == bare
  # A transform before the reduction changes nothing either.
  got = wire.comm_plan(optax.chain(optax.clip_by_global_norm(1.0), sign_mean(),
                                   optax.adam(1e-3)), params_like(), N)
  assert got == bare
  # A bare reduction and a compressor keep their plans, and report nothing uncovered.
  assert wire.comm_plan(commopt.scaled_sign(), params_like(), N).collectives == bare.collectives


def test_multi_transform_plans_each_reduction_on_its_labels_leaves():
  params = params_like()
  labels = {"w": "sign", "v": "topk", "b": "local", "frozen": None}
  topk = commopt.compressed_mean(commopt.qsgd(), axis_name="data", strategy="two_phase")
  tx = optax.multi_transform(
      {"sign": optax.chain(sign_mean(), optax.sgd(0.1)),
       "topk": optax.chain(topk, optax.adam(1e-3)),
       "local": optax.sgd(0.1)}, labels)
  got = wire.comm_plan(tx, params, N)
  want = (wire.comm_plan(sign_mean(), {"w": params["w"]}, N).collectives
          + wire.comm_plan(topk, {"v": params["v"]}, N).collectives)
  assert by_leaf(got.collectives) == by_leaf(want)
  assert {c.leaf for c in got.collectives} == {"['w']", "['v']"}
  assert {c.kind for c in got.collectives} >= {"all-gather", "all-to-all"}
  assert got.uncovered == ("['b']",)
  # The dense baseline still counts every leaf, the uncovered one included.
  assert got.dense_bytes == (64 * 48 + 4096 + 10) * 4


def test_multi_transform_plan_matches_the_lowered_program(mesh):
  params = {"w": jnp.zeros((64, 48)), "v": jnp.zeros((4096,)), "b": jnp.zeros((10,))}
  tx = optax.multi_transform(
      {"sign": optax.chain(sign_mean(), optax.sgd(0.1)),
       "vote": commopt.majority_vote(axis_name="data"),
       "local": optax.sgd(0.1)}, {"w": "sign", "v": "vote", "b": "local"})
  rng = np.random.default_rng(0)
  u = {k: jnp.asarray(rng.normal(size=(N,) + v.shape), jnp.float32) for k, v in params.items()}
  sm = commopt.testing.shard_map_workers(tx, mesh, "data")
  audit = wire.hlo_collectives(sm.update, u, sm.init(params), stage="lowered")
  plan = wire.comm_plan(tx, params, N)
  assert plan.uncovered == ("['b']",)
  assert bytes_by_kind(plan.collectives) == bytes_by_kind(audit)


def test_a_label_with_no_leaves_plans_nothing():
  tx = optax.multi_transform({"a": sign_mean(), "b": optax.sgd(0.1)},
                             {"w": "b", "v": "b", "b": "b", "frozen": None})
  got = wire.comm_plan(tx, params_like(), N)
  assert got.collectives == []
  assert got.uncovered == ("['b']", "['v']", "['w']")


def test_inject_hyperparams_around_a_chain():
  make = lambda learning_rate: optax.chain(sign_mean(), optax.sgd(learning_rate))
  tx = optax.inject_hyperparams(make)(learning_rate=0.1)
  assert wire.comm_plan(tx, params_like(), N) == bare_plan()


@pytest.mark.parametrize("wrap", ["apply_if_finite", "multi_steps", "both", "injected_steps"])
def test_wrappers_plan_their_reduction_once(wrap):
  """multi_steps traces its inner update several times (its cond's branches are shaped by
  jax.eval_shape); only the trace that lands in the program counts."""
  chain = optax.chain(sign_mean(), optax.adam(1e-3))
  tx = {
      "apply_if_finite": lambda: commopt.transforms.apply_if_finite(chain, axis_name="data"),
      "multi_steps": lambda: commopt.multi_steps(chain, 4),
      "both": lambda: commopt.apply_if_finite(commopt.multi_steps(chain, 4), axis_name="data",
                                              max_consecutive_errors=2),
      "injected_steps": lambda: commopt.multi_steps(optax.inject_hyperparams(
          lambda learning_rate: optax.chain(sign_mean(), optax.sgd(learning_rate)))(
              learning_rate=0.1), 3),
  }[wrap]()
  assert wire.comm_plan(tx, params_like(), N) == bare_plan()


def test_several_reductions_in_one_chain_add_up():
  topk = commopt.compressed_mean(commopt.top_k(0.1), axis_name="data")
  params = params_like()
  got = wire.comm_plan(optax.chain(sign_mean(), optax.sgd(0.1), topk), params, N)
  want = bare_plan().collectives + wire.comm_plan(topk, params, N).collectives
  assert got.collectives == want
  # The same instance twice runs twice.
  r = sign_mean()
  twice = wire.comm_plan(optax.chain(r, r), params, N)
  assert twice.collectives == bare_plan().collectives * 2
  assert twice.contributed_bytes == 2 * bare_plan().contributed_bytes


def test_a_reduction_inside_a_reduction_is_planned_by_the_outer_one():
  """dgc runs a compressed_mean; a synchronisation mode runs its reducer."""
  params = params_like()
  for tx in (commopt.transforms.dgc(axis_name="data", densities=0.05, min_size=100),
             commopt.local_sgd(optax.sgd(0.1), axis_name="data", period=2,
                               compressor=commopt.scaled_sign())):
    assert wire.comm_plan(optax.chain(optax.clip(1.0), tx), params, N) == \
        wire.comm_plan(tx, params, N)


@pytest.mark.parametrize("mode", ["local_sgd", "diloco"])
def test_step_goes_through_a_chain_for_a_periodic_mode(mode):
  make = {"local_sgd": lambda: commopt.local_sgd(optax.sgd(0.1), axis_name="data", period=3,
                                                 compressor=commopt.scaled_sign()),
          "diloco": lambda: commopt.diloco(optax.adam(1e-3), axis_name="data", period=3,
                                           warmup_steps=1)}[mode]
  bare, params = make(), params_like()
  tx = optax.chain(optax.clip_by_global_norm(1.0), make())
  sizes = []
  for step in range(7):
    got = wire.comm_plan(tx, params, N, step=step)
    assert got == wire.comm_plan(bare, params, N, step=step), step
    sizes.append(got.contributed_bytes)
  # local_sgd synchronises after steps 2 and 5; diloco after its warm-up step 0, then 3, 6.
  synced = {"local_sgd": {2, 5}, "diloco": {0, 3, 6}}[mode]
  assert {t for t, b in enumerate(sizes) if b} == synced
  assert wire.comm_plan(tx, params, N) == wire.comm_plan(bare, params, N)


def test_tuple_axes_bind_every_axis():
  axes = ("node", "local")
  tx = commopt.compressed_mean(commopt.scaled_sign(), axis_name=axes, strategy="hierarchical")
  got = wire.comm_plan(optax.chain(tx, optax.sgd(0.1)), params_like(), (2, 4), axis_name=axes)
  assert got == wire.comm_plan(tx, params_like(), (2, 4))
  assert {c.axis for c in got.collectives} == set(axes)


def test_a_chain_without_a_reduction_is_refused():
  with pytest.raises(ValueError, match="contains no reduction made by commopt.*optax.chain"):
    wire.comm_plan(optax.chain(optax.clip(1.0), optax.adam(1e-3)), params_like(), N)
  with pytest.raises(ValueError, match="reducing transform made by commopt"):
    wire.comm_plan(optax.sgd(0.1), params_like(), N)
  with pytest.raises(ValueError, match="must be a commopt Compressor"):
    wire.comm_plan("scaled_sign", params_like(), N)


def test_an_axis_not_bound_is_named():
  tx = optax.chain(sign_mean("model"), optax.sgd(0.1))
  with pytest.raises(ValueError, match="comm_plan.*'model'.*axis_name"):
    wire.comm_plan(tx, params_like(), N)
  assert wire.comm_plan(tx, params_like(), N, axis_name="model").collectives == [
      c._replace(axis="model") for c in bare_plan().collectives]


def test_nothing_is_computed_for_a_large_model_on_many_workers():
  """20 × 2^26 float32 gradients on each of 4096 workers would be 20 TiB."""
  params = {f"w{i}": jax.ShapeDtypeStruct((8192, 8192), jnp.float32) for i in range(20)}
  tx = optax.chain(sign_mean(), optax.adam(1e-3))
  got = wire.comm_plan(tx, params, 4096)
  assert got == wire.comm_plan(sign_mean(), params, 4096)
  assert len(got.collectives) == 20


def test_the_planner_wrapper_is_transparent_outside_comm_plan():
  tx = sign_mean()
  assert _plan.planner_of(tx) is not None
  assert _plan.planner_of(optax.chain(tx)) is None
  params = {"w": jnp.zeros((64, 48))}
  g = {"w": jnp.ones((N, 64, 48))}
  fn = jax.vmap(lambda g: tx.update(g, tx.init(params), params), axis_name="data")
  # No marker, no recording: the program is the transform's own.
  assert _plan._marks(jax.make_jaxpr(fn)(g).jaxpr) == set()
  assert _plan._RECORDING.get() is None


def test_a_chain_ending_in_reduce_on_plateau_plans_like_its_reduction():
  params = {"w": jnp.zeros((64, 32))}
  mean = commopt.compressed_mean(commopt.scaled_sign(), axis_name="data", min_size=0)
  tx = optax.chain(mean, optax.sgd(0.1), optax.contrib.reduce_on_plateau())
  assert (commopt.wire.comm_plan(tx, params, 4).collectives
          == commopt.wire.comm_plan(mean, params, 4).collectives)
