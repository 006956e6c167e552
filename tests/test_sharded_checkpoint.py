"""Checkpoints of a shard-local run: optimizer state sharded like model-sharded parameters.

Saved on a ``("data", "model")`` mesh and restored onto the same mesh (bit for
bit, the run continuing identically) or onto another shape (2x4 <-> 4x2, 2x4
-> 2x2): the number of workers changes, so per-worker state is resized
keeping the workers' mean residual, and the model axis changes, so every
leaf is placed onto the new layout; a two-phase server memory, which holds
each device's block of its parameter, flattened, is carried over in the
parameter's coordinates.
"""

import math
import pathlib
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import commopt
from commopt import checkpoint
from commopt.parallel import _resize
from commopt.testing import assert_same_bits

SPECS = {"w1": P(None, "model"), "w2": P("model", None), "b": P()}
SHAPES = {"w1": (16, 32), "w2": (32, 8), "b": (8,)}
GUIDE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "guide" / "checkpoints.md"


def loss_fn(p, b):
  """A two-layer model; the sharded contraction names its output sharding."""
  h = jnp.tanh(b["x"] @ p["w1"])
  out = jnp.einsum("bh,ho->bo", h, p["w2"], out_sharding=P())
  return jnp.mean((out + p["b"] - b["y"]) ** 2)


def _mesh(shape):
  """A ``("data", "model")`` mesh of ``shape`` on the first devices."""
  return jax.make_mesh(shape, ("data", "model"), devices=jax.devices()[:math.prod(shape)])


def _params(mesh):
  """The parameters, placed on ``mesh`` by :data:`SPECS` (the same values on every mesh)."""
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  raw = {"w1": jax.random.normal(k1, SHAPES["w1"]) * 0.3,
         "w2": jax.random.normal(k2, SHAPES["w2"]) * 0.3, "b": jnp.zeros(SHAPES["b"])}
  return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), raw, SPECS)


def _like(mesh):
  """The parameters as shapes placed on ``mesh``: what a restore needs of them."""
  return {k: jax.ShapeDtypeStruct(SHAPES[k], jnp.float32, sharding=NamedSharding(mesh, s))
          for k, s in SPECS.items()}


def _batches(n):
  """``n`` batches of 16 rows (numpy, placed by the step)."""
  rng = np.random.default_rng(0)
  out = []
  for _ in range(n):
    x = rng.normal(size=(16, 16)).astype(np.float32)
    out.append({"x": x, "y": np.sin(x[:, :8])})
  return out


def _tx():
  """PowerSGD for ``w1`` (its Q factor tiled over "model"), and for ``w2`` and ``b`` a
  two-phase exchange with server memories (``w2``'s tiled over "model") of an element-wise
  compressor (capacity 1), so that a step computes the same values on any model split; then
  Adam (moments sharded like the parameters)."""
  reducers = {
      "power": commopt.compressed_mean(commopt.power_sgd(), axis_name="data", min_size=0),
      "two_phase": commopt.compressed_mean(commopt.compressors.threshold(0.05, capacity=1.0),
                                           axis_name="data", min_size=0, strategy="two_phase")}
  return optax.chain(optax.partition(reducers, {"w1": "power", "w2": "two_phase",
                                                "b": "two_phase"}), optax.adam(1e-2))


def _dp(shape, **kwargs):
  """The step of :func:`_tx` on a ``("data", "model")`` mesh of ``shape``."""
  return commopt.data_parallel(loss_fn, _tx(), _mesh(shape), donate=False, **kwargs)


def _trained(dp, batches, local_params=False):
  """``(params, opt_state)`` after a step on each of ``batches``."""
  p0 = _params(dp.mesh)
  p, s = (dp.place_params(p0) if local_params else p0), dp.init(p0)
  for b in batches:
    p, s, _ = dp.step(p, s, b)
  return p, s


class Run(NamedTuple):
  """Two steps on the 2x4 mesh: the step, its parameters and state after them, and the
  batches (the first two were trained on)."""
  dp: Any
  params: Any
  opt_state: Any
  batches: list


@pytest.fixture(scope="module")
def run():
  dp, batches = _dp((2, 4)), _batches(5)
  assert dp.layout(_params(dp.mesh)).shard_local
  p, s = _trained(dp, batches[:2])
  return Run(dp, p, s, batches)


def _state(s, name):
  """The compressed_mean state of ``name`` (``"power"`` or ``"two_phase"``) in ``s``."""
  return s.inner_state[0].inner_states[name].inner_state


def _host(tree):
  """Every leaf as numpy."""
  return jax.tree.map(np.asarray, tree)


def _leaves(tree):
  """The leaves of ``tree`` by key path (plain names, as the resize rule reads them)."""
  return {_resize.path_key(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _shardings_equal(got, want):
  """Every leaf of ``got`` has the sharding of ``want``'s leaf (arrays or shapes)."""
  assert jax.tree.structure(got) == jax.tree.structure(want)
  bad = [jax.tree_util.keystr(p) for (p, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                                                      jax.tree.leaves(want))
         if a.sharding != b.sharding or a.shape != b.shape]
  assert not bad, bad


def _server_in_param_coordinates(x, key, mesh):
  """A two-phase server memory (one data axis), ``[workers, blocks * chunk]``, in its
  parameter's coordinates: each device's chunks are of its block of the parameter,
  flattened; the blocks are tiled over the model axis."""
  x = np.asarray(x)
  shape, spec = SHAPES[key], tuple(SPECS[key]) + (None,) * (len(SHAPES[key]) - len(SPECS[key]))
  blocks = mesh.shape["model"] if "model" in spec else 1
  local = tuple(n // blocks if e == "model" else n for n, e in zip(shape, spec))
  chunk = x.shape[1] // blocks
  out = np.zeros(shape, x.dtype)
  for m in range(blocks):
    flat = x[:, m * chunk:(m + 1) * chunk].reshape(-1)[:math.prod(local)]
    out[tuple(slice(m * n, (m + 1) * n) if e == "model" else slice(None)
              for n, e in zip(local, spec))] = flat.reshape(local)
  return out


def _check_resized(saved, restored, dp_new, old_mesh):
  """What a restore onto another mesh must give: the new layout's shardings on every leaf,
  the workers' mean of every per-worker float leaf kept, the server memories carried in
  their parameters' coordinates, and every other leaf carried as saved."""
  like = _like(dp_new.mesh)
  new_workers = dp_new.mesh.shape["data"]
  _shardings_equal((restored.params, restored.opt_state), dp_new.abstract_state(like))
  for name, key, spec in (("power", "w1", P("data", None, "model")),
                          ("two_phase", "w2", P("data", "model", None))):
    residual = _state(restored.opt_state, name).residual[key]
    assert residual.shape == (new_workers,) + SHAPES[key] and residual.sharding.spec == spec
    assert dict(residual.sharding.mesh.shape) == dict(dp_new.mesh.shape)
  assert _state(restored.opt_state, "power").compressor_state["w1"].q.sharding.spec == P(
      "model", None)
  assert restored.saved_workers == old_mesh.shape["data"]
  assert_same_bits(_host(restored.params), _host(saved[0]))
  before, after = _leaves(saved[1]), _leaves(restored.opt_state)
  flags = dict(zip(after, jax.tree.leaves(dp_new.per_worker(like))))
  owed, servers = 0, 0
  for k, x in after.items():
    if _resize.SERVER_FIELD in k:
      servers += 1
      np.testing.assert_array_equal(
          _server_in_param_coordinates(x, k[-1], x.sharding.mesh),
          _server_in_param_coordinates(before[k], k[-1], before[k].sharding.mesh),
          err_msg=str(k))
    elif flags[k] and jnp.issubdtype(x.dtype, jnp.floating):
      assert x.shape[0] == new_workers, k
      owed += bool(np.abs(np.asarray(before[k])).max() > 0)
      np.testing.assert_allclose(np.asarray(x, np.float64).mean(0),
                                 np.asarray(before[k], np.float64).mean(0),
                                 rtol=1e-6, atol=1e-7, err_msg=str(k))
    else:
      np.testing.assert_array_equal(np.asarray(x), np.asarray(before[k]), err_msg=str(k))
  assert owed == 3 and servers == 2, (owed, servers)   # the residuals of w1, w2 and b


# --- the same mesh: bit for bit ------------------------------------------------------


def test_the_same_mesh_restores_bit_for_bit_and_the_run_continues_identically(run, tmp_path):
  dp, p, s, batches = run
  with checkpoint.CheckpointManager(tmp_path / "run", async_save=True) as mgr:
    mgr.save(2, p, s)
    got = mgr.restore(dp, _like(dp.mesh))
  assert (got.step, got.saved_workers) == (2, 2)
  assert_same_bits(_host((got.params, got.opt_state)), _host((p, s)))
  _shardings_equal((got.params, got.opt_state), (p, s))            # the step's own layout
  _shardings_equal((got.params, got.opt_state), dp.abstract_state(_like(dp.mesh)))
  assert _state(got.opt_state, "two_phase").server_residual["w2"].sharding.spec == P(
      "data", "model")
  p2, s2 = got.params, got.opt_state
  for b in batches[2:4]:
    p, s, losses = dp.step(p, s, b)
    p2, s2, losses2 = dp.step(p2, s2, b)
    assert_same_bits(np.asarray(losses2), np.asarray(losses))
  assert_same_bits(_host((p2, s2)), _host((p, s)))


# --- another mesh shape ----------------------------------------------------------------


def _guide_block() -> str:
  """The guide's "Sharded models" example (the Python block that defines ``mesh42``)."""
  blocks = re.findall(r"^```python\n(.*?)^```", GUIDE.read_text(), flags=re.S | re.M)
  return next(b for b in blocks if "mesh42" in b)


@pytest.mark.slow
def test_the_guides_restore_onto_4x2_and_back_onto_2x4(run, tmp_path):
  """The guide's "Sharded models" example as written (2x4 -> 4x2), a step there, and that
  state restored onto 2x4."""
  dp, p, s, batches = run
  ns = dict(commopt=commopt, loss_fn=loss_fn, tx=dp.tx, params=p, opt_state=s,
            ckpt_dir=str(tmp_path))
  exec(compile(_guide_block(), str(GUIDE), "exec"), ns)  # noqa: S102
  dp42, restored = ns["dp42"], ns["restored"]
  assert dict(dp42.mesh.shape) == {"data": 4, "model": 2} and restored.step == 100
  _check_resized((p, s), restored, dp42, dp.mesh)
  # The rule is DataParallel.resize_state's: the live state, its shardings telling its layout.
  assert_same_bits(_host(dp42.resize_state(s, ns["like"])), _host(restored.opt_state))
  p42, s42, losses = dp42.step(ns["params42"], ns["opt_state42"], batches[2])
  assert np.isfinite(np.asarray(losses)).all() and losses.shape == (4,)
  _shardings_equal((p42, s42), dp42.abstract_state(ns["like"]))   # the step keeps the layout
  # 4x2 -> 2x4.
  checkpoint.save(tmp_path / "ck42", p42, s42, step=3)
  back = checkpoint.restore(tmp_path / "ck42", dp, _params(dp.mesh))
  assert back.step == 3
  _check_resized((p42, s42), back, dp, dp42.mesh)
  p24, s24, losses = dp.step(back.params, back.opt_state, batches[3])
  assert np.isfinite(np.asarray(losses)).all() and losses.shape == (2,)
  _shardings_equal((p24, s24), (p, s))


def test_a_new_model_split_with_as_many_workers_moves_the_server_memory(run, tmp_path):
  """2x4 -> 2x2: every shape is kept, but each device's block of the parameters is another;
  read as it is, the server memory would land in other coordinates. Restored, the run
  computes what it would have computed on 2x4 (the same math, summed in another order)."""
  dp, p, s, batches = run
  dp22 = _dp((2, 2))
  server = _state(s, "two_phase").server_residual["w2"]
  assert server.sharding.spec == P("data", "model") and np.abs(np.asarray(server)).max() > 0
  with checkpoint.CheckpointManager(tmp_path / "run") as mgr:
    mgr.save(2, p, s)
    got = mgr.restore(dp22, _like(dp22.mesh))
  assert _state(got.opt_state, "two_phase").server_residual["w2"].shape == server.shape
  _check_resized((p, s), got, dp22, dp.mesh)
  p2, s2 = got.params, got.opt_state
  for b in batches[2:4]:
    p, s, _ = dp.step(p, s, b)
    p2, s2, _ = dp22.step(p2, s2, b)
  for k in SHAPES:
    np.testing.assert_allclose(np.asarray(p2[k]), np.asarray(p[k]), rtol=1e-5, atol=1e-6,
                               err_msg=k)


def test_a_server_memory_of_unknown_layout_is_refused_onto_a_split_one(run):
  """Host arrays do not tell how a server memory was split over the model axes: resize_state
  refuses them onto a layout that splits it, rather than guess the blocks' order."""
  dp42 = _dp((4, 2))
  with pytest.raises(ValueError, match=r"resize_state: server memory .*server_residual\['w2'\] "
                                       r"is split over the model axes here, but how it was "
                                       r"split when saved is unknown"):
    dp42.resize_state(_host(run.opt_state), _like(dp42.mesh))


# --- per-worker parameters: DiLoCo on sharded replicas ---------------------------------


@pytest.mark.slow
def test_diloco_replicas_sharded_over_model_restore_onto_another_mesh(tmp_path):
  def make(shape):
    """DiLoCo (Adam inside, top-k outer exchange) on a ``("data", "model")`` mesh."""
    tx = commopt.diloco(optax.adam(1e-2), axis_name="data", period=2,
                        compressor=commopt.top_k(0.25), min_size=0)
    return commopt.data_parallel(loss_fn, tx, _mesh(shape), local_params=True, donate=False)

  dp, dp42, batches = make((2, 4)), make((4, 2)), _batches(4)
  p, s = _trained(dp, batches[:3], local_params=True)   # a synchronisation, then a step apart
  assert p["w1"].shape == (2, 16, 32) and p["w1"].sharding.spec == P("data", None, "model")
  w1 = np.asarray(p["w1"])
  assert np.abs(w1[0] - w1[1]).max() > 0                 # the replicas differ
  with checkpoint.CheckpointManager(tmp_path / "run") as mgr:
    mgr.save(3, p, s)
    same = mgr.restore(dp, _like(dp.mesh))
    got = mgr.restore(dp42, _like(dp42.mesh))
  assert_same_bits(_host((same.params, same.opt_state)), _host((p, s)))
  _shardings_equal((same.params, same.opt_state), (p, s))
  _shardings_equal((got.params, got.opt_state), dp42.abstract_state(_like(dp42.mesh)))
  assert got.saved_workers == 2 and got.params["w1"].shape == (4, 16, 32)
  assert got.params["w1"].sharding.spec == P("data", None, "model")
  for k in SHAPES:                        # the replicas' mean, the model a sync would give
    np.testing.assert_allclose(np.asarray(got.params[k], np.float64).mean(0),
                               np.asarray(p[k], np.float64).mean(0), rtol=1e-6, atol=1e-7)
  inner, saved_inner = got.opt_state.inner_state, s.inner_state
  for k in SHAPES:
    np.testing.assert_array_equal(np.asarray(inner.anchor[k]), np.asarray(saved_inner.anchor[k]))
    np.testing.assert_allclose(np.asarray(inner.reducer_state.residual[k], np.float64).mean(0),
                               np.asarray(saved_inner.reducer_state.residual[k],
                                          np.float64).mean(0), rtol=1e-6, atol=1e-7)
  assert inner.anchor["w2"].sharding.spec == P("model", None)
  p4, s4, losses = dp42.step(got.params, got.opt_state, batches[3])
  assert np.isfinite(np.asarray(losses)).all() and losses.shape == (4,)
  _shardings_equal((p4, s4), (got.params, got.opt_state))


def test_resize_state_told_the_saved_shardings_moves_the_server_memory(run):
  """A state read whole (host arrays) with the shardings it was saved with (as orbax's
  metadata gives them): resize_state lays the server memories out as a restore does."""
  dp42 = _dp((4, 2))
  shardings = jax.tree.map(lambda x: x.sharding, run.opt_state)
  live = dp42.resize_state(run.opt_state, _like(dp42.mesh))
  told = dp42.resize_state(_host(run.opt_state), _like(dp42.mesh), saved_shardings=shardings)
  assert_same_bits(_host(told), _host(live))
