"""zero_data_parallel(..., error_feedback=True): worker-side error memories for the
compressed gradient reduce-scatter (what they hold, what they cost, what they survive)."""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import commopt
from commopt.comm import _zero as zero_comm

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from test_zero import (STACKED, _stack_params, layer_by_layer_loss, loss_fn,  # noqa: E402
                       make_batch, make_params)

SIGN = commopt.scaled_sign()


def _worker_grads(params, batch, workers):
  """Each worker's gradient of the whole parameters on its rows of the batch."""
  rows = len(batch["x"]) // workers
  return [jax.grad(loss_fn)(params, {k: v[w * rows:(w + 1) * rows] for k, v in batch.items()})
          for w in range(workers)]


def _sent(compressor, g, workers):
  """What a worker's encoded chunks of ``g`` carry, decoded: each owner's row by itself."""
  rows = zero_comm.shard_flat(np.asarray(g, np.float32), workers)
  like = jax.ShapeDtypeStruct(rows.shape[1:], jnp.float32)
  empty = compressor.init(like)
  out = np.stack([np.asarray(compressor.decode(compressor.encode(jnp.asarray(r), empty, None)[0],
                                               empty, like)) for r in rows])
  return out.reshape(-1)[:np.size(g)].reshape(np.shape(g))


@pytest.mark.slow
def test_memories_hold_what_the_payloads_did_not_carry(mesh):
  """Two sgd steps with scaled_sign chunks, checked against the compressor run by hand on
  every worker's gradient: the update is the mean of what the payloads carry of g + e, and
  each worker's memory is g + e minus that."""
  zp = commopt.zero_data_parallel(loss_fn, optax.sgd(0.1), mesh, grads=SIGN,
                                  error_feedback=True)
  params = make_params()
  sharded = zp.shard(params)
  state = zp.init(sharded)
  memory = [jax.tree.map(jnp.zeros_like, params) for _ in range(8)]
  for step in range(2):
    batch = make_batch(step)
    sharded, state, _ = zp.step(sharded, state, batch)
    p = [jax.tree.map(lambda g, e: np.asarray(g) + np.asarray(e), g, e)
         for g, e in zip(_worker_grads(params, batch, 8), memory)]
    sent = [jax.tree.map(lambda x: _sent(SIGN, x, 8), pw) for pw in p]
    memory = [jax.tree.map(lambda a, b: a - b, pw, s) for pw, s in zip(p, sent)]
    params = jax.tree.map(lambda w, *s: w - 0.1 * np.mean(s, axis=0), params, *sent)
    got = zp.unshard(state.residuals)
    for name in params:
      np.testing.assert_allclose(np.asarray(got[name]), np.stack([m[name] for m in memory]),
                                 rtol=1e-4, atol=1e-6)
      np.testing.assert_allclose(np.asarray(zp.unshard(sharded)[name]), params[name],
                                 rtol=1e-5, atol=1e-6)
  assert float(np.abs(got["w1"]).max()) > 0
  # A sign sends ±scale for the zeros of the padding: the gather gives them no gradient.
  assert np.all(np.asarray(sharded["b1"].rows).reshape(-1)[37:] == 0)
  assert np.all(np.asarray(state.residuals["b1"].rows).reshape(8, -1)[:, 37:] == 0)


@pytest.mark.slow
def test_a_memory_costs_one_gradient_per_device_in_its_dtype(mesh):
  """From the compiled step's arguments: float32 memories add the whole model per device,
  bfloat16 half of it; without error feedback nothing."""
  n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(make_params()))
  padded = sum(8 * zero_comm.shard_len(int(np.prod(x.shape)), 8)
               for x in jax.tree.leaves(make_params()))
  args = {}
  for name, kw in (("none", {}), ("float32", {"error_feedback": True}),
                   ("bfloat16", {"error_feedback": True, "residual_dtype": jnp.bfloat16})):
    zp = commopt.zero_data_parallel(loss_fn, optax.adam(1e-2), mesh, grads=SIGN, **kw)
    sharded = zp.shard(make_params())
    args[name] = zp.lower(sharded, zp.init(sharded), make_batch(0)).compile() \
        .memory_analysis().argument_size_in_bytes
  assert args["float32"] - args["none"] == 4 * padded >= 4 * n
  assert args["bfloat16"] - args["none"] == 2 * padded


def test_a_skipped_step_keeps_the_memories(mesh):
  zp = commopt.zero_data_parallel(loss_fn, optax.adam(1e-2), mesh, grads=SIGN,
                                  error_feedback=True)
  sharded = zp.shard(make_params())
  sharded, state, _ = zp.step(sharded, zp.init(sharded), make_batch(0))
  before = zp.unshard(state.residuals)
  bad = make_batch(1)
  bad["x"][3, 2] = np.nan
  sharded, state, _ = zp.step(sharded, state, bad)
  assert int(state.opt_state.total_notfinite) == 1
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               zp.unshard(state.residuals), before)


@pytest.mark.slow
def test_layer_by_layer_memories_restore_onto_another_number_of_devices(mesh, tmp_path):
  """A stack gathered one layer at a time keeps one memory per layer and worker; saved
  whole with orbax and restored onto 4 devices, the mean memory over workers (what error
  feedback still owes) is the same."""
  import orbax.checkpoint as ocp
  zp8 = commopt.zero_data_parallel(layer_by_layer_loss, optax.adam(1e-2), mesh,
                                   gather="manual", grads=SIGN, error_feedback=True,
                                   residual_dtype=jnp.bfloat16)
  sharded = zp8.shard(_stack_params(), stacked=STACKED)
  state = zp8.init(sharded)
  for i in range(3):
    sharded, state, losses = zp8.step(sharded, state, make_batch(i))
  assert np.all(np.isfinite(np.asarray(losses)))
  whole = {"params": zp8.unshard(sharded), "opt_state": zp8.unshard(state)}
  memories = whole["opt_state"].residuals
  assert memories["layers"]["w"].shape == (8, 6, 96, 96)
  assert memories["layers"]["w"].dtype == jnp.bfloat16
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "ckpt", jax.device_get(whole))
  ckpt.wait_until_finished()
  restored = ckpt.restore(tmp_path / "ckpt")

  mesh4 = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  zp4 = commopt.zero_data_parallel(layer_by_layer_loss, optax.adam(1e-2), mesh4,
                                   gather="manual", grads=SIGN, error_feedback=True,
                                   residual_dtype=jnp.bfloat16)
  sharded4 = zp4.shard(restored["params"], stacked=STACKED)
  state4 = zp4.reshard_state(restored["opt_state"], sharded4)
  again = zp4.unshard(state4.residuals)
  assert again["layers"]["w"].shape == (4, 6, 96, 96)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(
      np.asarray(a, np.float32).mean(0), np.asarray(b, np.float32).mean(0), rtol=2e-2,
      atol=1e-3), again, memories)
  sharded4, state4, losses4 = zp4.step(sharded4, state4, make_batch(3))
  assert np.all(np.isfinite(np.asarray(losses4)))


def test_a_parameter_gathered_twice_or_never(mesh):
  """Gathering a parameter twice would send its memory twice: refused. One the loss never
  gathers keeps its memory."""
  def twice(p, b, gather):
    return loss_fn(gather(p), b) + 0.0 * jnp.sum(gather(p)["b1"])
  zp = commopt.zero_data_parallel(twice, optax.sgd(0.1), mesh, gather="manual", grads=SIGN,
                                  error_feedback=True)
  sharded = zp.shard(make_params())
  with pytest.raises(ValueError, match="gather each parameter once per step"):
    zp.step(sharded, zp.init(sharded), make_batch(0))

  def skips_b1(p, b, gather):
    whole = gather({"w1": p["w1"], "w2": p["w2"]})
    return loss_fn({**whole, "b1": jnp.zeros((37,))}, b)
  zp = commopt.zero_data_parallel(skips_b1, optax.sgd(0.1), mesh, gather="manual",
                                  grads=SIGN, error_feedback=True)
  sharded = zp.shard(make_params())
  state = zp.init(sharded)
  memories = state.residuals
  memories["b1"].rows = jnp.ones_like(memories["b1"].rows)   # something to keep
  _, state, _ = zp.step(sharded, state, make_batch(0))
  assert np.all(np.asarray(state.residuals["b1"].rows) == 1)
  assert np.any(np.asarray(state.residuals["w1"].rows) != 0)


def test_bad_feedback_arguments_name_themselves(mesh, mesh2d):
  with pytest.raises(ValueError, match="error_feedback=True keeps the error .* needs `grads`"):
    commopt.zero_data_parallel(loss_fn, optax.sgd(0.1), mesh, error_feedback=True)
  with pytest.raises(ValueError, match="does not run with hierarchical=True or hpz=True"):
    commopt.zero_data_parallel(loss_fn, optax.sgd(0.1), mesh2d, axis_name=("node", "local"),
                               grads=SIGN, hierarchical=True, error_feedback=True)
  with pytest.raises(ValueError, match="`residual_dtype`=.*int32.* floating-point"):
    commopt.zero_data_parallel(loss_fn, optax.sgd(0.1), mesh, grads=SIGN, error_feedback=True,
                               residual_dtype=jnp.int32)
  with pytest.raises(ValueError, match="`residual_dtype`=.* with error_feedback resolved"):
    commopt.zero_data_parallel(loss_fn, optax.sgd(0.1), mesh, grads=SIGN,
                               residual_dtype=jnp.bfloat16)
  with pytest.raises(TypeError, match="`error_feedback` must be 'auto', True or False"):
    commopt.zero_data_parallel(loss_fn, optax.sgd(0.1), mesh, grads=SIGN, error_feedback="yes")
