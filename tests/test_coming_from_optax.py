"""An optax / Flax user's own idioms: what works, and a clear error for each usual mistake."""

import pathlib
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import commopt

N = 4


def _mesh():
  return jax.make_mesh((N,), ("data",))


def _loss(p, b):
  return jnp.mean(jnp.square(b["x"] @ p["w"] - b["y"]))


def _problem(rows=16):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(rows, 64)).astype(np.float32)
  return {"w": jnp.zeros((64, 32))}, {"x": x, "y": x @ rng.normal(size=(64, 32)).astype(np.float32)}


def _sign_sgd(axis="data", **options):
  return optax.chain(commopt.compressed_mean(commopt.scaled_sign(), axis_name=axis, min_size=0,
                                             **options), optax.sgd(0.05))


def _own_step(tx, mesh, grad_fn):
  """A user's own shard_map step: params replicated, batch sharded, state per worker."""
  @jax.jit
  @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("data"), P("data")),
           out_specs=(P(), P("data")))
  def step(params, state, batch):
    state = jax.tree.map(lambda x: x[0], state)
    _, grads = grad_fn(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), jax.tree.map(lambda x: x[None], state)

  return step


def _stacked_state(tx, params, mesh):
  state = jax.tree.map(lambda x: jnp.broadcast_to(x, (N,) + x.shape), tx.init(params))
  return jax.device_put(state, NamedSharding(mesh, P("data")))


# -- 1. gradients JAX already summed -----------------------------------------------


def test_gradients_already_reduced_by_jax_are_refused_with_the_fix_named():
  mesh, tx = _mesh(), _sign_sgd()
  params, batch = _problem()
  step = _own_step(tx, mesh, jax.value_and_grad(_loss))
  batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
  with pytest.raises(ValueError, match=r"already the same on every worker of axis 'data'") as e:
    step(params, _stacked_state(tx, params, mesh), batch)
  assert "commopt.local_value_and_grad(loss_fn, 'data')" in str(e.value)
  assert "jax.lax.pcast" in str(e.value)


def test_local_gradients_in_a_users_shard_map_send_only_the_payload():
  mesh, tx = _mesh(), _sign_sgd()
  params, batch = _problem()
  step = _own_step(tx, mesh, commopt.local_value_and_grad(_loss, "data"))
  batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
  state = _stacked_state(tx, params, mesh)
  collectives = commopt.wire.hlo_collectives(step, params, state, batch)
  # Only the compressed exchange: the packed sign words and the scales are
  # gathered; no all-reduce, nothing near the dense gradient's bytes.
  assert {c.kind for c in collectives} == {"all-gather"}, collectives
  assert any("u32" in c.dtypes for c in collectives)
  assert commopt.wire.total_bytes(collectives) < 64 * 32 * 4 / 16
  new_params, _ = step(params, state, batch)
  assert float(_loss(new_params, batch)) < float(_loss(params, batch))


def test_a_value_the_same_on_every_worker_goes_through_once_cast_to_varying():
  mesh, tx = _mesh(), _sign_sgd()
  params, batch = _problem()

  def cast_grad(p, b):
    value, grads = jax.value_and_grad(_loss)(p, b)
    return value, jax.lax.pcast(grads, "data", to="varying")

  step = _own_step(tx, mesh, cast_grad)
  batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
  new_params, _ = step(params, _stacked_state(tx, params, mesh), batch)
  assert np.isfinite(np.asarray(new_params["w"])).all()


@pytest.mark.parametrize("make", [
    lambda: commopt.majority_vote(axis_name="data"),
    lambda: commopt.aggregators.coordinate_median(axis_name="data"),
    lambda: commopt.transforms.dgc(axis_name="data", densities=0.1),
    lambda: commopt.local_sgd(optax.sgd(0.1), axis_name="data", period=2),
], ids=["majority_vote", "coordinate_median", "dgc", "local_sgd"])
def test_every_reduction_refuses_input_already_reduced(make):
  mesh, tx = _mesh(), make()
  params, _ = _problem()

  @partial(jax.shard_map, mesh=mesh, in_specs=(P(),), out_specs=P())
  def update(g):
    return jax.tree.map(jnp.sum, tx.update(g, tx.init(params), params)[0])

  with pytest.raises(ValueError, match="already the same on every worker"):
    jax.eval_shape(update, params)


# -- 2. nnx.Optimizer under nnx.shard_map ----------------------------------------------


@pytest.mark.parametrize("check_vma", [True, False])
def test_nnx_optimizer_in_nnx_shard_map_never_keeps_one_residual_for_all(check_vma):
  from flax import nnx

  mesh = _mesh()
  model = nnx.Linear(64, 32, rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(model, _sign_sgd(), wrt=nnx.Param)
  x = jax.device_put(_problem()[1]["x"], NamedSharding(mesh, P("data")))

  @nnx.jit
  def step(model, opt, x):
    @nnx.shard_map(mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P(),
                   check_vma=check_vma)
    def inner(model, opt, x):
      loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - x[:, :32]) ** 2))(model)
      opt.update(model, grads)
      return loss
    return inner(model, opt, x)

  # check_vma=True: the gradients are JAX's dense mean already; check_vma=False:
  # shard_map would keep worker 0's residual and drop the other three.
  match = ("already the same on every worker" if check_vma
           else "check_vma=False, where nothing checks that each worker's copy")
  with pytest.raises(ValueError, match=match) as e:
    step(model, opt, x)
  assert "nnx_data_parallel" in str(e.value)


def test_without_error_feedback_check_vma_false_is_allowed():
  mesh = _mesh()
  params, batch = _problem()
  tx = _sign_sgd(error_feedback=False)

  @jax.jit
  @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(),
           check_vma=False)
  def step(params, batch):
    grads = jax.grad(_loss)(params, batch)        # local: check_vma=False inserts no psum
    updates, _ = tx.update(grads, tx.init(params), params)
    return optax.apply_updates(params, updates)

  new = step(params, jax.device_put(batch, NamedSharding(mesh, P("data"))))
  assert float(_loss(new, batch)) < float(_loss(params, batch))


# -- 3. the restore target -----------------------------------------------------------


def test_abstract_state_and_eval_shape_of_init_are_on_devices():
  mesh = _mesh()
  params, _ = _problem()
  dp = commopt.data_parallel(_loss, _sign_sgd(), mesh)
  target_params, target_state = dp.abstract_state(params)
  for leaf in jax.tree.leaves((target_params, target_state)):
    assert isinstance(leaf.sharding.mesh, jax.sharding.Mesh)   # concrete devices
  shapes = jax.eval_shape(dp.init, params)
  assert [(a.shape, a.dtype) for a in jax.tree.leaves(shapes)] == [
      (a.shape, a.dtype) for a in jax.tree.leaves(target_state)]
  assert [a.sharding for a in jax.tree.leaves(shapes)] == [
      a.sharding for a in jax.tree.leaves(target_state)]
  assert isinstance(jax.tree.leaves(shapes)[0].sharding.mesh, jax.sharding.Mesh)


# -- 4. axis names -------------------------------------------------------------------


def test_a_wrong_axis_name_is_named_when_data_parallel_is_built():
  with pytest.raises(commopt.AxisNameError) as e:
    commopt.data_parallel(_loss, _sign_sgd("batch"), _mesh())
  message = str(e.value)
  for word in ("compressed_mean", "'batch'", "'data'", "axis_name='data'"):
    assert word in message, word
  assert isinstance(e.value, NameError) and isinstance(e.value, ValueError)


def test_a_wrong_axis_name_the_build_cannot_see_is_named_at_init():
  # Labels that name the real parameters: the build's one-scalar trace cannot run
  # this tx, so the first trace with the parameters (init) names the axis.
  params, _ = _problem()
  tx = optax.multi_transform({"a": _sign_sgd("batch")}, {"w": "a"})
  dp = commopt.data_parallel(_loss, tx, _mesh())
  with pytest.raises(commopt.AxisNameError, match=r"compressed_mean: .*'batch'.*\('data',\)"):
    dp.init(params)


def test_a_wrong_axis_name_in_a_users_shard_map_names_the_axes_bound():
  mesh, tx = _mesh(), _sign_sgd("batch")
  params, batch = _problem()
  step = _own_step(tx, mesh, commopt.local_value_and_grad(_loss, "data"))
  batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
  with pytest.raises(commopt.AxisNameError, match=r"'batch'.*the axes bound here are \('data',\)"):
    step(params, _stacked_state(tx, params, mesh), batch)


def test_an_axis_name_outside_any_map_says_none_is_bound():
  tx = commopt.majority_vote(axis_name="data")
  params, _ = _problem()
  with pytest.raises(commopt.AxisNameError, match="majority_vote: .*no axis is bound here"):
    tx.update(params, tx.init(params), params)


# -- 6. extra arguments --------------------------------------------------------------


def test_reduce_on_plateau_at_the_end_of_a_commopt_chain_gets_the_mean_loss():
  mesh = _mesh()
  params, batch = _problem()
  tx = optax.chain(_sign_sgd(), optax.contrib.reduce_on_plateau(patience=1, accumulation_size=1))
  dp = commopt.data_parallel(_loss, tx, mesh)
  assert dp.layout(params).reads_value
  state = dp.init(params)
  params, state, losses = dp.step(params, state, batch)
  plateau = state.inner_state[-1]
  np.testing.assert_allclose(float(plateau.best_value), float(np.mean(losses)), rtol=1e-6)
  # A value given to the step (say, a validation loss) is the one used.
  params, state, losses = dp.step(params, state, batch, value=jnp.float32(-1.0))
  assert float(state.inner_state[-1].best_value) == -1.0


def test_the_mean_loss_costs_an_all_reduce_only_when_tx_reads_it():
  mesh = _mesh()
  params, batch = _problem()
  plain = commopt.data_parallel(_loss, _sign_sgd(), mesh)
  plateau = commopt.data_parallel(
      _loss, optax.chain(_sign_sgd(), optax.contrib.reduce_on_plateau()), mesh)
  assert not plain.layout(params).reads_value

  def scalar_f32_reduces(dp):
    state = dp.init(params)
    return [c for c in commopt.wire.hlo_collectives(dp, params, state, batch)
            if c.kind == "all-reduce" and c.dtypes == ("f32",) and c.shapes == ((),)]

  assert scalar_f32_reduces(plain) == []
  assert len(scalar_f32_reduces(plateau)) == 1


def test_extra_arguments_reach_a_transform_that_takes_them():
  mesh = _mesh()
  params, batch = _problem()

  def update(updates, state, params=None, *, scale=1.0, **extra):
    del extra
    return jax.tree.map(lambda u: u * scale, updates), state

  scaled = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)
  dp = commopt.data_parallel(_loss, optax.chain(_sign_sgd(), scaled), mesh, donate=False)
  state = dp.init(params)
  one, _, _ = dp.step(params, state, batch)
  three, _, _ = dp.step(params, state, batch, scale=jnp.float32(3.0))
  np.testing.assert_allclose(np.asarray(three["w"]), 3 * np.asarray(one["w"]), rtol=1e-6)


def test_an_extra_argument_without_a_default_is_named():
  def update(updates, state, params=None, *, scale, **extra):
    del extra
    return jax.tree.map(lambda u: u * scale, updates), state

  tx = optax.chain(_sign_sgd(), optax.GradientTransformationExtraArgs(
      lambda p: optax.EmptyState(), update))
  dp = commopt.data_parallel(_loss, tx, _mesh())
  with pytest.raises(TypeError, match=r"data_parallel: .*'scale'.*default"):
    dp.init(_problem()[0])


def test_a_transform_of_ones_own_without_extra_arguments_still_runs():
  def update(updates, state, params=None):
    return jax.tree.map(lambda u: -0.05 * u, updates), state

  mean = commopt.compressed_mean(commopt.scaled_sign(), axis_name="data", min_size=0)
  tx = optax.GradientTransformationExtraArgs(
      mean.init, lambda u, s, p=None: update(*mean.update(u, s, p), p))
  params, batch = _problem()
  dp = commopt.data_parallel(_loss, tx, _mesh())
  state = dp.init(params)
  new, state, losses = dp.step(params, state, batch)
  assert float(_loss(new, batch)) < float(np.mean(losses))


# -- the "Coming from optax / Flax" page -----------------------------------------------

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "guide" / "from_optax.md"


@pytest.mark.slow
def test_the_coming_from_optax_page_runs_in_order(capsys):
  blocks = re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), flags=re.S | re.M)
  for idiom in ("inject_hyperparams", "multi_transform", "comm_plan", "reduce_on_plateau",
                "TrainState", "abstract_state"):
    assert any(idiom in b for b in blocks), idiom
  ns = {}
  for block in blocks:
    exec(compile(block, str(PAGE), "exec"), ns)   # noqa: S102 - the page's own code
  out = capsys.readouterr().out
  assert "learning-rate scale" in out and "()" in out     # comm_plan: no uncovered leaf
  state, batch = ns["state"], ns["batch"]
  assert int(state.step) == 30
  # From about 0.86 (the targets' mean square) at initialisation, 0.34 in one run.
  assert float(ns["mlp_loss"](state.params, batch)) < 0.5 * float(np.mean(
      (np.asarray(batch["y"])) ** 2))
  assert isinstance(jax.tree.leaves(ns["target_state"])[0].sharding.mesh, jax.sharding.Mesh)


def test_nnx_data_parallel_hands_reduce_on_plateau_the_mean_loss():
  from flax import nnx

  model = nnx.Linear(64, 32, rngs=nnx.Rngs(0))
  _, batch = _problem()
  tx = optax.chain(_sign_sgd(), optax.contrib.reduce_on_plateau(accumulation_size=1))
  trainer = commopt.nnx_data_parallel(model, lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2),
                                      tx, _mesh())
  state, losses = trainer.step(trainer.init(model), batch)
  best = float(state.opt_state.inner_state[-1].best_value)
  np.testing.assert_allclose(best, float(np.mean(losses)), rtol=1e-6)


def test_a_wrong_axis_in_a_transform_outside_commopts_reductions_is_named_too():
  # An attack model (no reduction of its own) over an axis the step does not map: JAX's
  # bare unbound-axis NameError becomes an AxisNameError naming the step's axis.
  from commopt.aggregators import attacks
  tx = optax.chain(attacks.attack("alie", (0,), axis_name="batch"),
                   commopt.aggregators.coordinate_median(axis_name="data"), optax.sgd(0.1))
  with pytest.raises(commopt.AxisNameError, match=r"axis_name='data'.*unbound axis name: batch"):
    commopt.data_parallel(_loss, tx, _mesh())
