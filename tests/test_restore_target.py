"""``jax.eval_shape(init, params)``, the restore target every orbax and JAX guide shows, gives
the optimizer state's shardings on the mesh's devices for data_parallel, zero_data_parallel
and nnx_data_parallel: orbax's StandardCheckpointer and CheckpointManager restore a trained
state onto it, equal to what was saved, and the next step is the step of the run that was
not interrupted, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import commopt


def loss_fn(p, b):
  return jnp.mean((jnp.tanh(b["x"] @ p["w"] + p["b"]) - b["y"]) ** 2)


def make_params():
  rng = np.random.default_rng(0)
  return {"w": jnp.asarray(rng.normal(size=(12, 6)).astype(np.float32) * 0.3),
          "b": jnp.zeros((6,), jnp.float32)}


def make_batch(seed):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(16, 12)).astype(np.float32)
  return {"x": x, "y": np.tanh(x[:, :6]).astype(np.float32)}


def _tx():
  """Error feedback over the data axis (per-worker residuals, stacked and sharded over it)
  and adam (replicated moments)."""
  return optax.chain(commopt.compressed_mean(commopt.top_k(0.25), axis_name="data", min_size=0),
                     optax.adam(1e-2))


# Each run: (the target, the trained tree to save, and a step of such trees).


def _data_parallel(mesh):
  dp = commopt.data_parallel(loss_fn, _tx(), mesh)
  params, state = make_params(), dp.init(make_params())
  for i in range(2):
    params, state, _ = dp.step(params, state, make_batch(i))
  target = {"params": dp.place_params(make_params()),
            "opt_state": jax.eval_shape(dp.init, make_params())}

  def step(tree, batch):
    p, s, losses = dp.step(tree["params"], tree["opt_state"], batch)
    return {"params": p, "opt_state": s}, losses
  return target, {"params": params, "opt_state": state}, step


def _zero(mesh):
  zp = commopt.zero_data_parallel(loss_fn, optax.adam(1e-2), mesh,
                                  grads=commopt.scaled_sign(), error_feedback=True)
  params = zp.shard(make_params())
  state = zp.init(params)
  for i in range(2):
    params, state, _ = zp.step(params, state, make_batch(i))
  fresh = zp.shard(make_params())
  target = {"params": fresh, "opt_state": jax.eval_shape(zp.init, fresh)}

  def step(tree, batch):
    p, s, losses = zp.step(tree["params"], tree["opt_state"], batch)
    return {"params": p, "opt_state": s}, losses
  return target, {"params": params, "opt_state": state}, step


def _nnx(mesh):
  from flax import nnx

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(12, 6, rngs=rngs)
      self.bn = nnx.BatchNorm(6, rngs=rngs)

    def __call__(self, x):
      return jnp.tanh(self.bn(self.lin(x)))

  net_loss = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
  trainer = commopt.nnx_data_parallel(Net(nnx.Rngs(0)), net_loss, _tx(), mesh)
  state = trainer.init(Net(nnx.Rngs(0)))
  for i in range(2):
    state, _ = trainer.step(state, make_batch(i))
  return jax.eval_shape(trainer.init, Net(nnx.Rngs(0))), state, trainer.step


RUNS = {"data_parallel": _data_parallel, "zero_data_parallel": _zero, "nnx_data_parallel": _nnx}


def _save_and_restore(how, path, tree, target):
  if how == "StandardCheckpointer":
    with ocp.StandardCheckpointer() as ckpt:
      ckpt.save(path, tree)
      ckpt.wait_until_finished()
      return ckpt.restore(path, target)
  options = ocp.CheckpointManagerOptions(max_to_keep=2)
  with ocp.CheckpointManager(path, options=options) as mgr:
    mgr.save(2, args=ocp.args.StandardSave(tree))
    mgr.wait_until_finished()
    return mgr.restore(mgr.latest_step(), args=ocp.args.StandardRestore(target))


@pytest.mark.parametrize("how", ["StandardCheckpointer", "CheckpointManager"])
@pytest.mark.parametrize("run", list(RUNS))
def test_a_state_restored_onto_eval_shape_of_init_continues_the_run(mesh, tmp_path, run, how):
  target, trained, step = RUNS[run](mesh)
  for leaf in jax.tree.leaves(target):
    assert isinstance(leaf.sharding, jax.sharding.NamedSharding), leaf
    assert isinstance(leaf.sharding.mesh, jax.sharding.Mesh), leaf.sharding   # the devices
  restored = _save_and_restore(how, tmp_path / "ckpt", trained, target)

  assert jax.tree.structure(restored) == jax.tree.structure(trained)
  for got, want, like in zip(jax.tree.leaves(restored), jax.tree.leaves(trained),
                             jax.tree.leaves(target)):
    assert (got.shape, got.dtype) == (want.shape, want.dtype) == (like.shape, like.dtype)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert got.sharding.is_equivalent_to(want.sharding, want.ndim), (got.sharding,
                                                                     want.sharding)
    assert got.sharding.is_equivalent_to(like.sharding, want.ndim), (got.sharding,
                                                                     like.sharding)

  after_restore, restored_losses = step(restored, make_batch(2))
  after, losses = step(trained, make_batch(2))
  np.testing.assert_array_equal(np.asarray(restored_losses), np.asarray(losses))
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               after_restore, after)


def test_abstract_state_is_eval_shape_of_init(mesh):
  dp = commopt.data_parallel(loss_fn, _tx(), mesh)
  params = make_params()
  _, state = dp.abstract_state(params)
  assert state == jax.eval_shape(dp.init, params)
  per_worker = jax.eval_shape(dp.init, params).inner_state[0].residual["w"]
  assert per_worker.shape[0] == 8 and per_worker.sharding.spec[0] == "data"
