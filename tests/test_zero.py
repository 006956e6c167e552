"""ZeRO-3 data parallelism (zero_data_parallel): sharded parameters and state, commopt's own
gathers and scatters, quantized weights (qwZ) and gradients (qgZ)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import commopt
from commopt.comm import _zero as zero_comm

Q8 = commopt.int_quant(bits=8, block_size=256, rounding="nearest")
Q4 = commopt.int_quant(bits=4, block_size=256, rounding="nearest")


def loss_fn(p, b):
  h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
  return jnp.mean((h @ p["w2"] - b["y"]) ** 2)


def make_params(seed=0, hidden=37):
  rng = np.random.default_rng(seed)   # sizes not multiples of 8 workers or of a block
  return {"w1": jnp.asarray(rng.normal(size=(13, hidden)).astype(np.float32) * 0.3),
          "b1": jnp.zeros((hidden,), jnp.float32),
          "w2": jnp.asarray(rng.normal(size=(hidden, 5)).astype(np.float32) * 0.3)}


def make_batch(seed, size=64):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(size, 13)).astype(np.float32)
  return {"x": x, "y": np.tanh(x[:, :5]).astype(np.float32)}


def train(zp, steps, seed=0):
  params = zp.shard(make_params(seed))
  state = zp.init(params)
  losses = []
  for i in range(steps):
    params, state, l = zp.step(params, state, make_batch(i))
    losses.append(float(jnp.mean(l)))
  return params, state, losses


def test_shard_and_unshard_round_trip(mesh):
  zp = commopt.zero_data_parallel(loss_fn, optax.sgd(0.1), mesh)
  params = make_params()
  sharded = zp.shard(params)
  assert sharded["w1"].rows.shape == (8, 61) and sharded["w1"].shape == (13, 37)
  assert sharded["w1"].rows.sharding.spec == jax.sharding.PartitionSpec("data")
  back = zp.unshard(sharded)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               back, params)


@pytest.mark.parametrize("tx", [optax.adam(1e-2),
                                optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.1))],
                         ids=["adam", "clip_by_global_norm"])
def test_dense_zero_trains_as_replicated_data_parallel(mesh, tx):
  """Identity gathers: the same parameters as data_parallel's replicated step, to the
  rounding of a different summation order (a reduce-scatter against an all-reduce). A
  whole-tree quantity (the global norm) is computed over every device's rows."""
  zp = commopt.zero_data_parallel(loss_fn, tx, mesh)
  sharded, _, losses = train(zp, 6)
  dp = commopt.data_parallel(
      loss_fn, optax.chain(commopt.compressed_mean(commopt.compressors.make("identity"),
                                                   axis_name="data"), tx), mesh)
  params = make_params()
  state = dp.init(params)
  want = []
  for i in range(6):
    params, state, l = dp.step(params, state, make_batch(i))
    want.append(float(jnp.mean(l)))
  got = zp.unshard(sharded)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                       rtol=2e-5, atol=2e-6), got, params)
  np.testing.assert_allclose(losses, want, rtol=1e-5)


def _by_kind(collectives):
  out = {}
  for c in collectives:
    out.setdefault(c.kind, []).append(c)
  return out


@pytest.mark.slow
def test_the_wire_carries_packed_payloads(mesh):
  """From the compiled HLO: dense ZeRO-3 all-gathers and reduce-scatters float32; qwZ
  all-gathers uint32 words of int8 codes and scales; qgZ sends its int4 chunks in one
  all-to-all; no float array of a parameter's size crosses the axis compressed."""
  params, batch = make_params(hidden=1001), make_batch(0)
  kinds = {}
  for name, w, g in [("dense", None, None), ("qwZ", Q8, None), ("qgZ", None, Q4),
                     ("both", Q8, Q4)]:
    zp = commopt.zero_data_parallel(loss_fn, optax.sgd(0.1), mesh, weights=w, grads=g)
    sharded = zp.shard(params)
    found = _by_kind(commopt.wire.hlo_collectives(zp, sharded, zp.init(sharded), batch))
    kinds[name] = {k: commopt.wire.total_bytes(v) for k, v in found.items()}
    dtypes = {k: {d for c in v for d in c.dtypes} for k, v in found.items()}
    if w is None:
      assert dtypes["all-gather"] == {"f32"}
    else:
      assert dtypes["all-gather"] == {"u32"}
    if g is None:
      assert dtypes["reduce-scatter"] == {"f32"} and "all-to-all" not in found
    else:
      assert dtypes["all-to-all"] == {"u32"} and "reduce-scatter" not in found
    assert "all-reduce" not in found or kinds[name]["all-reduce"] <= 64   # the loss only
  # One device's shards: 4 bytes per coordinate dense, 1 (int8) and 1/2 (int4) packed,
  # plus a float32 scale per 256.
  shard_bytes = 4 * sum(zero_comm.shard_len(x.size, 8) for x in jax.tree.leaves(params))
  assert kinds["dense"]["all-gather"] == shard_bytes
  assert kinds["dense"]["reduce-scatter"] == 8 * shard_bytes     # every worker's whole leaf
  assert kinds["qwZ"]["all-gather"] <= (0.25 + 1 / 256 + 0.01) * shard_bytes
  assert kinds["qgZ"]["all-to-all"] <= (0.125 + 1 / 256 + 0.01) * kinds["dense"]["reduce-scatter"]
  assert kinds["both"]["all-gather"] == kinds["qwZ"]["all-gather"]
  assert kinds["both"]["all-to-all"] == kinds["qgZ"]["all-to-all"]


def test_parameters_and_state_take_one_worker_share_of_memory(mesh):
  """memory_analysis of the compiled step: the arguments (parameters and adam's two
  moments) per device are about 1/8 of the replicated step's."""
  params, batch = make_params(), make_batch(0)
  zp = commopt.zero_data_parallel(loss_fn, optax.adam(1e-3), mesh)
  sharded = zp.shard(params)
  zero = zp.lower(sharded, zp.init(sharded), batch).compile().memory_analysis()
  dp = commopt.data_parallel(loss_fn, optax.chain(commopt.compressed_mean(
      commopt.compressors.make("identity"), axis_name="data"), optax.adam(1e-3)), mesh)
  rep = dp.lower(params, dp.init(params), dp.place_batch(batch)).compile().memory_analysis()
  if zero is None or rep is None:
    pytest.skip("no memory analysis on this backend")
  batch_bytes = sum(np.asarray(v).nbytes for v in batch.values()) // 8
  n = sum(x.size for x in jax.tree.leaves(params))
  ours = zero.argument_size_in_bytes - batch_bytes
  theirs = rep.argument_size_in_bytes - batch_bytes
  assert ours <= 1.1 * 3 * 4 * n / 8 + 64, (ours, n)
  assert ours < theirs / 6, (ours, theirs)


@pytest.mark.slow
def test_quantized_weights_and_gradients_converge_with_dense(mesh):
  """qwZ (int8) and qgZ (int4) with nearest rounding, no error memory: the loss after
  60 steps is within 1.3x of dense ZeRO-3's, and far below the start."""
  dense = train(commopt.zero_data_parallel(loss_fn, optax.adam(1e-2), mesh), 60)[2]
  both = train(commopt.zero_data_parallel(loss_fn, optax.adam(1e-2), mesh, weights=Q8,
                                          grads=Q4), 60)[2]
  tail = lambda l: float(np.mean(l[-10:]))
  assert tail(dense) < 0.3 * dense[0]
  assert tail(both) < 1.3 * tail(dense), (tail(both), tail(dense))


def test_a_stochastic_compressor_takes_the_step_key(mesh):
  zp = commopt.zero_data_parallel(loss_fn, optax.sgd(0.1), mesh,
                                  grads=commopt.int_quant(bits=4))
  params = zp.shard(make_params())
  state = zp.init(params)
  with pytest.raises(ValueError, match=r"`grads`=int_quant\(.*\) draws random bits: pass key="):
    zp.step(params, state, make_batch(0))
  with pytest.raises(ValueError, match=r"PRNG key: .* pass the key by name"):
    zp.step(params, state, make_batch(0), jax.random.key(0))
  p1, _, _ = zp.step(zp.shard(make_params()), zp.init(params), make_batch(0),
                     key=jax.random.key(0))
  p2, _, _ = zp.step(zp.shard(make_params()), zp.init(params), make_batch(0),
                     key=jax.random.key(1))
  assert not np.array_equal(np.asarray(p1["w1"].rows), np.asarray(p2["w1"].rows))


def test_bad_arguments_name_themselves(mesh):
  with pytest.raises(ValueError, match="`axis_name`='model' is not an axis of the mesh"):
    commopt.zero_data_parallel(loss_fn, optax.sgd(0.1), mesh, axis_name="model")
  with pytest.raises(ValueError, match="`grads`=power_sgd.*cannot encode a flat shard"):
    commopt.zero_data_parallel(loss_fn, optax.sgd(0.1), mesh,
                               grads=commopt.compressors.make("power_sgd"))
  with pytest.raises(ValueError, match="`weights` must be None \\(dense\\) or a commopt"):
    commopt.zero_data_parallel(loss_fn, optax.sgd(0.1), mesh, weights="int8")
  with pytest.raises(ValueError, match="`gather` must be one of"):
    commopt.zero_data_parallel(loss_fn, optax.sgd(0.1), mesh, gather="layers")
  zp = commopt.zero_data_parallel(loss_fn, optax.sgd(0.1), mesh)
  with pytest.raises(ValueError, match="must come from .shard\\(params\\)"):
    zp.init(make_params())
  with pytest.raises(ValueError, match="`stacked` must hold True or False, got 'yes'"):
    zp.shard(make_params(), stacked={"w1": "yes", "b1": False, "w2": False})
  with pytest.raises(ValueError, match="`stacked` must be a prefix"):
    zp.shard(make_params(), stacked={"w1": True})


def _stack_params(seed=0, layers=6, width=96):
  rng = np.random.default_rng(seed)
  return {"embed": jnp.asarray(rng.normal(size=(13, width)) / 4, jnp.float32),
          "layers": {"w": jnp.asarray(rng.normal(size=(layers, width, width)) / width ** 0.5 / 2,
                                      jnp.float32),
                     "b": jnp.zeros((layers, width), jnp.float32)},
          "head": jnp.asarray(rng.normal(size=(width, 5)) / width ** 0.5, jnp.float32)}


STACKED = {"embed": False, "layers": True, "head": False}


def _layer(h, layer):
  return jnp.tanh(h @ layer["w"] + layer["b"]) + h, None


def whole_loss(p, b):
  h = jnp.tanh(b["x"] @ p["embed"])
  h, _ = jax.lax.scan(_layer, h, p["layers"])
  return jnp.mean((h @ p["head"] - b["y"]) ** 2)


def layer_by_layer_loss(p, b, gather):
  h = jnp.tanh(b["x"] @ gather(p["embed"]))
  body = gather.remat(lambda h, layer: _layer(h, gather(layer)))
  h, _ = jax.lax.scan(body, h, p["layers"])
  return jnp.mean((h @ gather(p["head"]) - b["y"]) ** 2)


@pytest.mark.slow
def test_layer_by_layer_gathers_under_a_scan(mesh):
  """gather='manual' on a stack sharded layer by layer: the scan gathers one layer at a
  time (rematerialised, so the backward gathers it again), trains as gathering everything
  first does, and its step holds far less temporary memory."""
  params = _stack_params()
  steps = {}
  for mode, loss in (("step", whole_loss), ("manual", layer_by_layer_loss)):
    zp = commopt.zero_data_parallel(loss, optax.adam(1e-2), mesh, gather=mode)
    sharded = zp.shard(params, stacked=STACKED)
    assert sharded["layers"]["w"].rows.shape == (6, 8, 1152)
    state = zp.init(sharded)
    temp = zp.lower(sharded, state, make_batch(0)).compile().memory_analysis().temp_size_in_bytes
    for i in range(5):
      sharded, state, losses = zp.step(sharded, state, make_batch(i))
    steps[mode] = (zp.unshard(sharded), temp)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5,
                                                       atol=2e-6),
               steps["manual"][0], steps["step"][0])
  assert steps["manual"][0]["layers"]["w"].shape == (6, 96, 96)
  layer_bytes = 96 * 96 * 4
  assert steps["step"][1] > 6 * layer_bytes             # every layer whole at once
  assert steps["manual"][1] < steps["step"][1] - 3 * layer_bytes, (steps["manual"][1],
                                                                  steps["step"][1])


def test_a_checkpoint_restores_onto_another_number_of_devices(mesh, tmp_path):
  """Parameters and adam's state unsharded, saved with orbax, restored and resharded over 4
  devices: training goes on as it would have on 8 (to the rounding of the summation; dense
  gathers: a quantized gather's blocks follow the shards, so they change with N)."""
  import orbax.checkpoint as ocp
  zp8 = commopt.zero_data_parallel(loss_fn, optax.adam(1e-2), mesh)
  sharded, state, _ = train(zp8, 3)
  whole = {"params": zp8.unshard(sharded), "opt_state": zp8.unshard(state)}
  assert whole["opt_state"].inner_state[0].mu["w1"].shape == (13, 37)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "ckpt", jax.device_get(whole))
  ckpt.wait_until_finished()
  restored = ckpt.restore(tmp_path / "ckpt")

  mesh4 = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  zp4 = commopt.zero_data_parallel(loss_fn, optax.adam(1e-2), mesh4)
  sharded4 = zp4.shard(restored["params"])
  state4 = zp4.reshard_state(restored["opt_state"], sharded4)
  assert state4.inner_state[0].mu["w1"].rows.shape == (4, 121)
  assert int(state4.inner_state[0].count) == 3
  for i in range(3, 6):
    sharded, state, _ = zp8.step(sharded, state, make_batch(i))
    sharded4, state4, _ = zp4.step(sharded4, state4, make_batch(i))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4,
                                                       atol=1e-5),
               zp4.unshard(sharded4), zp8.unshard(sharded))
  with pytest.raises(ValueError, match="the state has no leaf 'notfinite_count'"):
    zp4.reshard_state({"x": jnp.zeros(3)}, sharded4)


@pytest.mark.parametrize("grads", [None, Q4], ids=["dense", "qgZ"])
def test_a_nonfinite_gradient_skips_the_step_on_every_device(mesh, grads):
  """One worker's rows of the batch hold a NaN: every owner's part of the update is skipped
  together (parameters and adam's state kept, the skip counted), and training goes on."""
  zp = commopt.zero_data_parallel(loss_fn, optax.adam(1e-2), mesh, grads=grads)
  sharded = zp.shard(make_params())
  state = zp.init(sharded)
  sharded, state, _ = zp.step(sharded, state, make_batch(0))
  before = zp.unshard((sharded, state))
  bad = make_batch(1)
  bad["x"][3, 0] = np.nan                     # worker 0's rows only
  sharded, state, _ = zp.step(sharded, state, bad)
  after = zp.unshard((sharded, state))
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               after[0], before[0])
  assert int(state.total_notfinite) == 1
  sharded, state, losses = zp.step(sharded, state, make_batch(2))
  assert np.all(np.isfinite(np.asarray(zp.unshard(sharded)["w1"])))
  assert int(state.notfinite_count) == 0


def test_the_wire_counts_a_scan_body_per_iteration(mesh):
  """The layer-by-layer step's gathers sit in the scan's loop bodies (forward, and the
  rematerialised backward): parse_hlo gives them the loops' trip counts, and the bytes per
  run count each layer's gather twice and its reduce-scatter once."""
  params = _stack_params(layers=6)
  zp = commopt.zero_data_parallel(layer_by_layer_loss, optax.sgd(0.1), mesh, gather="manual",
                                  skip_nonfinite=False)
  sharded = zp.shard(params, stacked=STACKED)
  found = commopt.wire.parse_hlo(zp.lower(sharded, zp.init(sharded), make_batch(0))
                                 .compile().as_text())
  looped = [c for c in found if c.trips > 1]
  assert looped and {c.trips for c in looped} == {6}
  gathered = commopt.wire.total_bytes([c for c in found if c.kind == "all-gather"],
                                      per_run=True)
  scattered = commopt.wire.total_bytes([c for c in found if c.kind == "reduce-scatter"],
                                       per_run=True)
  stack = 4 * 6 * (zero_comm.shard_len(96 * 96, 8) + zero_comm.shard_len(96, 8))
  top = 4 * (zero_comm.shard_len(13 * 96, 8) + zero_comm.shard_len(96 * 5, 8))
  assert gathered == 2 * stack + top          # each layer gathered forward and backward
  assert scattered == 8 * (stack + top)       # every worker's whole gradient, once


@pytest.mark.slow
def test_the_zero_language_model_example():
  """examples/zero_lm.py: ZeRO-3 trains exactly as the replicated step (same losses), keeps
  1/8 of its arguments, and the ZeRO++-style run sends several times fewer bytes at a loss
  within 1.05x."""
  import importlib.util
  import pathlib
  path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "zero_lm.py"
  spec = importlib.util.spec_from_file_location("zero_lm", path)
  example = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(example)
  runs = example.main(["--steps", "40", "--log-every", "40", "--eval-windows", "64"])
  rep, zero, zpp = runs["replicated"], runs["zero"], runs["zero++"]
  np.testing.assert_allclose(zero["loss"], rep["loss"], rtol=1e-4)
  assert zero["argument_bytes"] < rep["argument_bytes"] / 7
  assert zpp["sent_bytes_per_step"] < zero["sent_bytes_per_step"] / 4
  assert zpp["final_loss"] < 1.05 * zero["final_loss"]
  assert zpp["final_loss"] < 0.9 * zpp["loss"][0]


def test_aux_comes_back_per_worker(mesh):
  def with_aux(p, b):
    loss = loss_fn(p, b)
    return loss, {"loss": loss, "rows": jnp.shape(b["x"])[0]}
  zp = commopt.zero_data_parallel(with_aux, optax.sgd(0.1), mesh, has_aux=True)
  sharded = zp.shard(make_params())
  sharded, state, (losses, aux) = zp.step(sharded, zp.init(sharded), make_batch(0))
  assert losses.shape == (8,) and aux["rows"].tolist() == [8] * 8
  np.testing.assert_array_equal(np.asarray(aux["loss"]), np.asarray(losses))


@pytest.mark.slow
def test_sharded_over_two_mesh_axes(mesh2d, mesh):
  """axis_name=("node", "local"): every leaf sharded over all 8 devices of the 2-D mesh, the
  gathers and scatters over both axes; the same training as on the 1-D mesh."""
  runs = {}
  for name, m, axes in (("2d", mesh2d, ("node", "local")), ("1d", mesh, "data")):
    zp = commopt.zero_data_parallel(loss_fn, optax.adam(1e-2), m, axis_name=axes,
                                    weights=Q8, grads=Q4)
    assert zp.workers == 8
    sharded, _, losses = train(zp, 4)
    assert sharded["w1"].rows.shape == (8, 61)
    runs[name] = (zp.unshard(sharded), losses)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                                                       atol=1e-6), runs["2d"][0], runs["1d"][0])
  np.testing.assert_allclose(runs["2d"][1], runs["1d"][1], rtol=1e-5)
  with pytest.raises(ValueError, match="is not an axis of the mesh \\(or a tuple"):
    commopt.zero_data_parallel(loss_fn, optax.sgd(0.1), mesh2d, axis_name=("node", "x"))


@pytest.mark.slow
def test_hierarchical_gradients_cross_the_slow_axis_less(mesh2d):
  """hierarchical=True on ("node", "local"): the encoded chunks that cross nodes are 4x
  fewer (one per node, not one per device), the mean gradient is close to the flat one,
  and training converges as the flat qgZ does."""
  def audit(zp):
    sharded = zp.shard(make_params(hidden=1001))
    found = commopt.wire.parse_hlo(zp.lower(sharded, zp.init(sharded), make_batch(0))
                                   .compile().as_text())
    return [c for c in found if c.kind == "all-to-all"]
  flat = commopt.zero_data_parallel(loss_fn, optax.sgd(0.1), mesh2d, axis_name=("node", "local"),
                                    grads=Q4)
  hier = commopt.zero_data_parallel(loss_fn, optax.sgd(0.1), mesh2d, axis_name=("node", "local"),
                                    grads=Q4, hierarchical=True)
  across = lambda cs: sum(c.sent_bytes for c in cs
                          if any(d // 4 != g[0] // 4 for g in c.replica_groups for d in g))
  flat_a2a, hier_a2a = audit(flat), audit(hier)
  assert all(c.group_size == 8 for c in flat_a2a)
  assert sorted({c.group_size for c in hier_a2a}) == [2, 4]
  # Flat: 7 of 8 chunks leave the device, 4 of them to another node. Hierarchical: across
  # nodes, one chunk (of the node's partial sums) per other node: L = 4 times fewer.
  flat_across = across(flat_a2a) * 4 / 7
  assert across(hier_a2a) * 4 == pytest.approx(flat_across, rel=0.02)
  tails = {}
  for name, zp in (("flat", flat), ("hier", hier)):
    zp = commopt.zero_data_parallel(loss_fn, optax.adam(1e-2), mesh2d,
                                    axis_name=("node", "local"), grads=Q4,
                                    hierarchical=name == "hier")
    tails[name] = float(np.mean(train(zp, 60)[2][-10:]))
  assert tails["hier"] < 1.3 * tails["flat"], tails
  # With a lossless "compressor" the two stages give the dense mean (to rounding): the
  # owners' rows are routed right.
  ident = commopt.compressors.make("identity")
  got = {}
  for name, kw in (("dense", {}), ("hier", {"grads": ident, "hierarchical": True})):
    zp = commopt.zero_data_parallel(loss_fn, optax.sgd(0.1), mesh2d,
                                    axis_name=("node", "local"), **kw)
    got[name] = zp.unshard(train(zp, 3)[0])
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                                                       atol=1e-6), got["hier"], got["dense"])
  with pytest.raises(ValueError, match="hierarchical=True .* needs `grads`"):
    commopt.zero_data_parallel(loss_fn, optax.sgd(0.1), mesh2d, axis_name=("node", "local"),
                               hierarchical=True)


@pytest.mark.slow
def test_hpz_keeps_the_backward_gathers_inside_the_node(mesh2d):
  """hpz=True on ("node", "local") with a rematerialised layer-by-layer loss: each layer
  crosses nodes once (the forward gather into the secondary partition), the backward pass
  gathers inside the node only, the secondary partition is kept (1/L of the stack per
  device), and training is the flat gather's to rounding."""
  params = _stack_params()
  runs = {}
  for name, kw in (("flat", {}), ("hpz", {"hpz": True})):
    zp = commopt.zero_data_parallel(layer_by_layer_loss, optax.adam(1e-2), mesh2d,
                                    axis_name=("node", "local"), gather="manual",
                                    skip_nonfinite=False, **kw)
    sharded = zp.shard(params, stacked=STACKED)
    state = zp.init(sharded)
    compiled = zp.lower(sharded, state, make_batch(0)).compile()
    gathers = [c for c in commopt.wire.parse_hlo(compiled.as_text()) if c.kind == "all-gather"]
    for i in range(4):
      sharded, state, losses = zp.step(sharded, state, make_batch(i))
    runs[name] = (gathers, compiled.memory_analysis().temp_size_in_bytes, zp.unshard(sharded))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5,
                                                       atol=2e-6), runs["hpz"][2], runs["flat"][2])
  crosses = lambda c: any(d // 4 != g[0] // 4 for g in c.replica_groups for d in g)
  c_w, c_b = zero_comm.shard_len(96 * 96, 8), zero_comm.shard_len(96, 8)
  flat_looped = [c for c in runs["flat"][0] if c.trips == 6]
  assert len(flat_looped) == 4 and all(crosses(c) for c in flat_looped)   # w, b; fwd + bwd
  hpz_across = [c for c in runs["hpz"][0] if crosses(c)]
  assert {c.group_size for c in hpz_across} == {2}        # across nodes: the node axis only
  assert sorted(c.sent_bytes for c in hpz_across if c.trips == 6) == [4 * c_b, 4 * c_w]
  assert all(not crosses(c) for c in runs["hpz"][0] if c.group_size == 4)
  secondary = 6 * 2 * 4 * (c_w + c_b)       # [nodes, c] float32 per layer, all 6 layers kept
  assert runs["hpz"][1] - runs["flat"][1] >= secondary, (runs["hpz"][1], runs["flat"][1])
  for kw in ({"gather": "step", "axis_name": ("node", "local")},
             {"gather": "manual", "axis_name": "node"}):
    with pytest.raises(ValueError, match="hpz=True .* needs gather='manual' and axis_name"):
      commopt.zero_data_parallel(loss_fn, optax.sgd(0.1), mesh2d, hpz=True, **kw)


@pytest.mark.slow
def test_hpz_with_quantized_weights_and_gradients_converges(mesh2d):
  """int8 weights and int4 gradients with hpz: the loss falls as with the flat gathers."""
  params = _stack_params()
  tails = {}
  for name, kw in (("flat", {}), ("hpz", {"hpz": True})):
    zp = commopt.zero_data_parallel(layer_by_layer_loss, optax.adam(1e-2), mesh2d,
                                    axis_name=("node", "local"), gather="manual", weights=Q8,
                                    grads=Q4, hierarchical=True, **kw)
    sharded = zp.shard(params, stacked=STACKED)
    state, losses = zp.init(sharded), []
    for i in range(40):
      sharded, state, l = zp.step(sharded, state, make_batch(i))
      losses.append(float(jnp.mean(l)))
    tails[name] = (losses[0], float(np.mean(losses[-10:])))
  assert tails["hpz"][1] < 0.5 * tails["hpz"][0], tails
  assert tails["hpz"][1] < 1.2 * tails["flat"][1], tails


@pytest.mark.slow
def test_the_pure_step_runs_inside_a_users_jit_and_scan(mesh):
  """step_fn under the user's own jax.jit and lax.scan over steps gives the jitted steps'
  parameters."""
  zp = commopt.zero_data_parallel(loss_fn, optax.adam(1e-2), mesh, weights=Q8, grads=Q4,
                                  donate=False)
  sharded = zp.shard(make_params())
  state = zp.init(sharded)
  batches = [make_batch(i) for i in range(3)]
  p, s = sharded, state
  for b in batches:
    p, s, _ = zp.step(p, s, b)
  stacked = {k: jax.device_put(np.stack([b[k] for b in batches]), jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(None, "data"))) for k in batches[0]}

  @jax.jit
  def run(params, opt_state, data):
    def body(carry, batch):
      params, opt_state, losses = zp.step_fn(*carry, batch)
      return (params, opt_state), losses
    return jax.lax.scan(body, (params, opt_state), data)

  with jax.set_mesh(mesh):
    (q, _), losses = run(sharded, state, stacked)
  assert losses.shape == (3, 8)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                                                       atol=1e-6), zp.unshard(q), zp.unshard(p))


@pytest.mark.slow   # the BatchNorm model of test_zero_state.py covers nnx in the default tier
def test_an_nnx_model_trains_through_split_and_merge(mesh):
  """A Flax nnx model: its nnx.Param state sharded, the loss merging it back. The same
  training as the same weights in a plain dict, and nnx.update writes the result back."""
  from flax import nnx

  class MLP(nnx.Module):
    def __init__(self, rngs):
      self.l1 = nnx.Linear(13, 37, rngs=rngs)
      self.l2 = nnx.Linear(37, 5, rngs=rngs)

    def __call__(self, x):
      return self.l2(jnp.tanh(self.l1(x)))

  model = MLP(nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def nnx_loss(p, b):
    return jnp.mean((nnx.merge(graphdef, p, rest)(b["x"]) - b["y"]) ** 2)

  as_dict = {"w1": model.l1.kernel[...], "b1": model.l1.bias[...], "w2": model.l2.kernel[...],
             "b2": model.l2.bias[...]}

  def dict_loss(p, b):
    return jnp.mean((jnp.tanh(b["x"] @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"] - b["y"]) ** 2)

  out = {}
  for name, loss, start in (("nnx", nnx_loss, params), ("dict", dict_loss, as_dict)):
    zp = commopt.zero_data_parallel(loss, optax.adam(1e-2), mesh, weights=Q8, grads=Q4)
    sharded = zp.shard(start)
    state = zp.init(sharded)
    for i in range(5):
      sharded, state, losses = zp.step(sharded, state, make_batch(i))
    out[name] = (zp.unshard(sharded), losses)
  np.testing.assert_allclose(np.asarray(out["nnx"][1]), np.asarray(out["dict"][1]), rtol=1e-5)
  nnx.update(model, out["nnx"][0])
  np.testing.assert_allclose(np.asarray(model.l1.kernel[...]), np.asarray(out["dict"][0]["w1"]),
                             rtol=1e-5, atol=1e-6)


# -- the batch and the weight compressor are checked as data_parallel checks them ---------


def _batch_error(run):
  with pytest.raises(ValueError) as e:
    run()
  return str(e.value)


@pytest.mark.parametrize("batch", [
    {"x": make_batch(0)["x"], "y": make_batch(0)["y"][:8]},   # one label row per worker
    make_batch(0, size=60),                                    # 60 rows over 8 workers
    make_batch(0, size=0),
], ids=["rows_differ", "not_divisible", "empty"])
def test_the_step_checks_its_batch_as_data_parallel_does(mesh, batch):
  """A batch whose leaves differ in rows (64 inputs, 8 labels: each worker's one label row
  would be broadcast over its inputs), whose rows do not divide over the workers, or that is
  empty: the step refuses it, naming its leaves and shapes, with data_parallel's message; in
  the step, its lowering, the pure step under a user's jit, and local_batch."""
  zp = commopt.zero_data_parallel(loss_fn, optax.sgd(0.1), mesh)
  params = zp.shard(make_params())
  state = zp.init(params)
  dp = commopt.data_parallel(loss_fn, optax.chain(commopt.compressed_mean(
      commopt.compressors.make("identity"), axis_name="data"), optax.sgd(0.1)), mesh)
  want = _batch_error(lambda: dp.place_batch(batch)).replace("data_parallel",
                                                             "zero_data_parallel")
  assert "zero_data_parallel: " in want and "batch" in want
  assert _batch_error(lambda: zp.step(params, state, batch)) == want
  assert _batch_error(lambda: zp.lower(params, state, batch)) == want
  pure = jax.jit(zp.step_fn)
  with jax.set_mesh(mesh):
    assert _batch_error(lambda: pure(params, state, batch)) == want
  local = _batch_error(lambda: dp.local_batch(batch)).replace("data_parallel",
                                                               "zero_data_parallel")
  assert _batch_error(lambda: zp.local_batch(batch)) == local
  # The parameters and state were not donated to a step that never ran.
  zp.step(params, state, make_batch(0))


@pytest.mark.parametrize("weights", [commopt.top_k(0.1),
                                     commopt.compressors.make("gradient_dropping"),
                                     commopt.compressors.make("threshold"),
                                     commopt.compressors.make("chunk_top_k")],
                         ids=lambda c: c.name)
def test_a_biased_weight_compressor_that_drops_coordinates_is_refused(mesh, weights):
  """The forward pass would run on sparsified weights: most of them zero, never in
  expectation the weights."""
  with pytest.raises(ValueError, match=r"zero_data_parallel: `weights`=.* drops coordinates") as e:
    commopt.zero_data_parallel(loss_fn, optax.sgd(0.1), mesh, weights=weights)
  assert weights.name in str(e.value) and "int_quant(bits=8" in str(e.value)
  assert f"error_kind={weights.error_kind!r}" in str(e.value)


@pytest.mark.parametrize("weights", [Q8, Q4, commopt.int_quant(bits=8), commopt.cast("bfloat16"),
                                     commopt.scaled_sign(), commopt.qsgd()],
                         ids=lambda c: c.name)
def test_quantizers_of_every_coordinate_stay_accepted_as_weight_compressors(mesh, weights):
  zp = commopt.zero_data_parallel(loss_fn, optax.sgd(0.1), mesh, weights=weights)
  assert zp.weights is weights
