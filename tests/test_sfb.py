"""Sufficient-factor broadcasting: exact gradients, B·(n + m) on the wire, the cost rule."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import commopt
from commopt import wire
from commopt.transforms import sfb_dense, sfb_mean, sfb_pays

N, ROWS = 8, 16                          # workers, rows per worker
# Layer 1 (64 -> 256): 16·320 < 64·256, sent as factors.
# Layer 2 (256 -> 10): 16·266 > 256·10, sent as usual.


def make_params(seed=0):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {"w1": jax.random.normal(k1, (64, 256)) / 8, "b1": jnp.zeros(256),
          "w2": jax.random.normal(k2, (256, 10)) / 16}


def loss_with(dense):
  def loss_fn(p, batch):
    h = jax.nn.relu(dense(batch["x"], p["w1"]) + p["b1"])
    logits = dense(h, p["w2"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
  return loss_fn


def batch(step):
  rng = np.random.default_rng(step)
  return {"x": rng.normal(size=(N * ROWS, 64)).astype(np.float32),
          "y": rng.integers(0, 10, N * ROWS).astype(np.int32)}


MASK = {"w1": True, "b1": False, "w2": True}


def train(loss_fn, reducer, mesh, steps=3):
  dp = commopt.data_parallel(loss_fn, optax.chain(reducer, optax.sgd(0.5)), mesh)
  params = make_params()
  p, s = dp.place_params(params), dp.init(params)
  for t in range(steps):
    p, s, _ = dp.step(p, s, batch(t))
  return dp, p, s


def test_the_cost_rule():
  assert sfb_pays(ROWS, 64, 256) and not sfb_pays(ROWS, 256, 10)
  assert not sfb_pays(4, 8, 8) and sfb_pays(3, 8, 8)       # 4·16 = 64 is not less than 64


@pytest.mark.slow
def test_backward_packs_the_factors_only_where_they_pay():
  for n, m, packs in ((64, 256, True), (256, 10, False)):
    x = jax.random.normal(jax.random.key(n), (ROWS, n))
    w = jax.random.normal(jax.random.key(m), (n, m))
    dy = jax.random.normal(jax.random.key(2), (ROWS, m))
    (dx, dw), (dx_ref, dw_ref) = (jax.vjp(f, x, w)[1](dy) for f in (sfb_dense, jnp.matmul))
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-6)
    if packs:
      flat = dw.reshape(-1)
      np.testing.assert_array_equal(flat[:ROWS * n], x.reshape(-1))
      np.testing.assert_array_equal(flat[ROWS * n:ROWS * (n + m)], dy.reshape(-1))
      assert float(flat[-1]) == ROWS and not jnp.any(flat[ROWS * (n + m):-1])
    else:
      np.testing.assert_allclose(dw, dw_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_training_equals_the_dense_mean_to_float_rounding(mesh):
  _, sfb_params, _ = train(loss_with(sfb_dense), sfb_mean(ROWS, MASK, axis_name="data"), mesh)
  dense = commopt.compressed_mean(commopt.compressors.identity(), axis_name="data")
  _, ref_params, _ = train(loss_with(jnp.matmul), dense, mesh)
  for k in ref_params:
    np.testing.assert_allclose(np.asarray(sfb_params[k]), np.asarray(ref_params[k]),
                               rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("check_rows", [False, True])
def test_the_wire_carries_b_times_n_plus_m_for_the_chosen_layer_only(mesh, check_rows):
  reducer = sfb_mean(ROWS, MASK, axis_name="data", check_rows=check_rows)
  dp, p, s = train(loss_with(sfb_dense), reducer, mesh, steps=1)
  compiled = wire.hlo_collectives(dp, p, s, dp.place_batch(batch(0)))
  values = ROWS * (64 + 256) + check_rows          # the factors (and the row count)
  gathers = [c for c in compiled if c.kind == "all-gather"]
  assert [(c.shapes, c.contributed_bytes) for c in gathers] == [(((N, values),), values * 4)]
  shapes = {s for c in compiled for s in c.shapes}
  assert (64, 256) not in shapes and (256, 10) in shapes        # w2 all-reduced dense
  plan = wire.comm_plan(sfb_mean(ROWS, MASK, axis_name="data", check_rows=check_rows),
                        make_params(), N)
  assert [(c.leaf, c.kind, c.contributed_bytes) for c in plan.collectives
          if c.kind == "all-gather"] == [("['w1']", "all-gather", values * 4)]
  # The step's non-finite skip adds only its flag, one more float32 in the dense bucket.
  assert not [c for c in compiled if c.kind == "all-reduce" and all(x == () for x in c.shapes)]
  assert plan.contributed_bytes + 4 == wire.total_bytes(compiled)


def test_a_mismatched_batch_rows_is_refused_when_traced(mesh):
  dp = commopt.data_parallel(loss_with(sfb_dense),
                             optax.chain(sfb_mean(ROWS * 2, MASK, axis_name="data"),
                                         optax.sgd(0.1)), mesh)
  params = make_params()
  with pytest.raises(ValueError, match=f"`batch_rows` is {2 * ROWS}.*{ROWS} rows"):
    dp.step(dp.place_params(params), dp.init(params), batch(0))


def test_a_kernel_used_twice_fails_loudly_not_silently(mesh):
  # Two uses add two packed buffers: the row count in the last element is then
  # 2·ROWS, and the leaf's mean is NaN on every worker instead of a wrong value;
  # the step refuses it (skip_nonfinite=False shows it) rather than train on it.
  def twice(p, b):
    h = sfb_dense(b["x"], p["w1"]) + sfb_dense(b["x"], p["w1"])
    return jnp.mean(h ** 2) + jnp.sum(p["w2"]) * 0 + jnp.sum(p["b1"]) * 0
  tx = optax.chain(sfb_mean(ROWS, MASK, axis_name="data"), optax.sgd(0.1))
  params = make_params()
  raw = commopt.data_parallel(twice, tx, mesh, skip_nonfinite=False)
  p, _, _ = raw.step(raw.place_params(params), raw.init(params), batch(0))
  assert np.isnan(np.asarray(p["w1"])).all() and np.isfinite(np.asarray(p["w2"])).all()
  dp = commopt.data_parallel(twice, tx, mesh)
  p, state, _ = dp.step(dp.place_params(params), dp.init(params), batch(0))
  np.testing.assert_array_equal(np.asarray(p["w1"]), np.asarray(params["w1"]))
  assert int(state.total_notfinite) == 1


class Net(nnx.Module):
  def __init__(self, linear, rngs):
    self.l1 = linear(64, 256, rngs=rngs)
    self.l2 = linear(256, 10, rngs=rngs)

  def __call__(self, x):
    return self.l2(nnx.relu(self.l1(x)))


@pytest.mark.slow
def test_nnx_layer_trains_like_nnx_linear(mesh):
  def loss_fn(model, b):
    return optax.softmax_cross_entropy_with_integer_labels(model(b["x"]), b["y"]).mean()

  results = {}
  for name, linear, reducer in (
      ("sfb", commopt.parallel.SFBLinear,
       sfb_mean(ROWS, commopt.parallel.sfb_mask, axis_name="data")),
      ("dense", nnx.Linear,
       commopt.compressed_mean(commopt.compressors.identity(), axis_name="data"))):
    model = Net(linear, nnx.Rngs(0))
    trainer = commopt.nnx_data_parallel(model, loss_fn, optax.chain(reducer, optax.sgd(0.5)),
                                        mesh)
    state = trainer.init(model)
    for t in range(3):
      state, _ = trainer.step(state, batch(t))
    trainer.update_model(model, state)
    results[name] = jax.tree.leaves(nnx.state(model, nnx.Param))
  for a, b in zip(results["sfb"], results["dense"]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
