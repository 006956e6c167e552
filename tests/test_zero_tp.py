"""zero_data_parallel beside tensor parallelism: parameters sharded over a model axis keep
that sharding, and each model rank's block is sharded over the data axis by ZeRO (every
device gathers, compresses and reduce-scatters only its own block)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import commopt
from commopt.comm import _zero as zero_comm

Q8 = commopt.int_quant(bits=8, block_size=64, rounding="nearest")
Q4 = commopt.int_quant(bits=4, block_size=64, rounding="nearest")
SPECS = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": None}


@pytest.fixture(scope="module", params=["explicit", pytest.param("auto", marks=pytest.mark.slow)])
def tp_mesh(request):
  """4 data ranks × 2 model ranks, the model axis explicit (jax.make_mesh's default) or
  auto."""
  kind = AxisType.Explicit if request.param == "explicit" else AxisType.Auto
  return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit, kind))


def loss_fn(p, b):
  """A two-layer MLP, column- then row-parallel: the second contraction names its output's
  sharding (explicit axes ask for it)."""
  h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
  out = jnp.einsum("bh,ho->bo", h, p["w2"], out_sharding=P()) + p["b2"]
  return jnp.mean((out - b["y"]) ** 2)


def make_params(seed=0, hidden=38):
  rng = np.random.default_rng(seed)      # block sizes not multiples of the 4 data ranks
  return {"w1": rng.normal(size=(13, hidden)).astype(np.float32) * 0.3,
          "b1": np.zeros((hidden,), np.float32),
          "w2": rng.normal(size=(hidden, 5)).astype(np.float32) * 0.3,
          "b2": np.zeros((5,), np.float32)}


def make_batch(seed, size=32):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(size, 13)).astype(np.float32)
  return {"x": x, "y": np.tanh(x[:, :5]).astype(np.float32)}


def run(zp, params, steps, specs=None, **kw):
  sharded = zp.shard(params, specs=specs, **kw)
  state = zp.init(sharded)
  losses = []
  for i in range(steps):
    sharded, state, l = zp.step(sharded, state, make_batch(i))
    losses.append(np.asarray(l))
  return sharded, state, np.stack(losses)


def test_blocks_round_trip_from_specs_or_placed_arrays(tp_mesh):
  zp = commopt.zero_data_parallel(loss_fn, optax.sgd(0.1), tp_mesh)
  params = make_params()
  sharded = zp.shard(params, specs=SPECS)
  # w1's block is 13 x 19 = 247 coordinates: c = 62 per data rank, two blocks side by side.
  assert sharded["w1"].rows.shape == (4, 2 * 62) and sharded["w1"].tp == P(None, "model")
  assert sharded["w1"].rows.sharding.spec == P("data", "model")
  assert sharded["b2"].tp is None and sharded["b2"].rows.sharding.spec == P("data")
  jax.tree.map(np.testing.assert_array_equal, zp.unshard(sharded), params)
  placed = {k: jax.device_put(v, NamedSharding(tp_mesh, SPECS[k] or P()))
            for k, v in params.items()}
  again = zp.shard(placed)
  assert {k: v.tp for k, v in again.items()} == {k: v.tp for k, v in sharded.items()}
  jax.tree.map(np.testing.assert_array_equal, jax.tree.leaves(again), jax.tree.leaves(sharded))


def test_dense_blocks_train_as_zero_without_the_model_axis(tp_mesh):
  """Dense gathers: the same parameters and losses as ZeRO-3 over the 4 data ranks alone
  (the model replicated), to the rounding of a different summation order."""
  params = make_params()
  tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2))
  zp = commopt.zero_data_parallel(loss_fn, tx, tp_mesh)
  got, _, losses = run(zp, params, 5, SPECS)
  plain = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  zq = commopt.zero_data_parallel(loss_fn, tx, plain)
  want, _, want_losses = run(zq, params, 5)
  np.testing.assert_allclose(losses, want_losses, rtol=2e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                       rtol=2e-5, atol=2e-6),
               zp.unshard(got), zq.unshard(want))


def _collectives(zp, sharded, batch):
  found = commopt.wire.hlo_collectives(zp, sharded, zp.init(sharded), batch)
  data = [c for c in found if c.group_size == 4]
  model = [c for c in found if c.group_size == 2]
  return data, model


@pytest.mark.slow
def test_each_device_moves_only_its_block(tp_mesh):
  """From the compiled HLO: over the data axis each device gathers its block's shards
  (half of the leaf's for the model-sharded leaves), dense or as packed words; nothing of
  a parameter's size crosses the model axis (only the row-parallel layer's activations)."""
  params, batch = make_params(hidden=1000), make_batch(0)
  blocks = {k: v.size // (2 if SPECS[k] is not None else 1) for k, v in params.items()}
  shard_bytes = 4 * sum(zero_comm.shard_len(n, 4) for n in blocks.values())
  for w, g in [(None, None), (Q8, Q4)]:
    zp = commopt.zero_data_parallel(loss_fn, optax.sgd(0.1), tp_mesh, weights=w, grads=g)
    sharded = zp.shard(params, specs=SPECS)
    data, model = _collectives(zp, sharded, batch)
    gathered = commopt.wire.total_bytes([c for c in data if c.kind == "all-gather"])
    dtypes = {d for c in data if c.kind != "all-reduce" for d in c.dtypes}   # not the skip's
    if w is None:
      assert gathered == shard_bytes and dtypes == {"f32"}
    else:
      assert gathered <= (0.25 + 1 / 64 + 0.02) * shard_bytes and dtypes == {"u32"}
    assert all(c.kind == "all-reduce" for c in model), [c.line[:80] for c in model]
    assert commopt.wire.total_bytes(model) <= 4 * 8 * 5 * 2   # [8, 5] activations, fwd+bwd


@pytest.mark.slow
def test_quantized_blocks_train_near_dense(tp_mesh):
  params = make_params()
  dense = commopt.zero_data_parallel(loss_fn, optax.adam(1e-2), tp_mesh)
  quant = commopt.zero_data_parallel(loss_fn, optax.adam(1e-2), tp_mesh, weights=Q8, grads=Q4)
  _, _, want = run(dense, params, 30, SPECS)
  _, _, got = run(quant, params, 30, SPECS)
  assert got[-1].mean() < 0.5 * got[0].mean()
  assert got[-1].mean() < 1.15 * want[-1].mean()


@pytest.mark.slow
def test_stacked_blocks_gathered_layer_by_layer(tp_mesh):
  """gather='manual' over a stack of column-parallel layers (a scan, one layer gathered
  at a time under remat): the same step, and the same error memories of a signed
  reduce-scatter, as gathering the whole tree first."""
  rng = np.random.default_rng(3)
  params = {"layers": rng.normal(size=(3, 8, 8)).astype(np.float32) * 0.4,
            "out": rng.normal(size=(8, 5)).astype(np.float32) * 0.3}
  specs = {"layers": P(None, None, "model"), "out": None}

  def forward(h, layers, out):
    for w in layers:
      h = jnp.tanh(jnp.einsum("bi,io->bo", h, w, out_sharding=P()))
    return jnp.mean((h @ out - jnp.tanh(h[:, :5])) ** 2)

  def step_loss(p, b):
    return forward(b["x"][:, :8], p["layers"], p["out"])

  def manual_loss(p, b, gather):
    def body(h, rows):
      w = gather(rows)
      return jnp.tanh(jnp.einsum("bi,io->bo", h, w, out_sharding=P())), None
    h, _ = jax.lax.scan(gather.remat(body), b["x"][:, :8], p["layers"])
    out = gather(p["out"])
    return jnp.mean((h @ out - jnp.tanh(h[:, :5])) ** 2)

  results = []
  for loss, mode in ((step_loss, "step"), (manual_loss, "manual")):
    zp = commopt.zero_data_parallel(loss, optax.adam(1e-2), tp_mesh, gather=mode,
                                    weights=Q8, grads=commopt.scaled_sign(), error_feedback=True)
    got, state, losses = run(zp, params, 4, specs, stacked={"layers": True, "out": False})
    results.append(((zp.unshard(got), zp.unshard(state.residuals)), losses))
  np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                       rtol=1e-5, atol=1e-6),
               results[0][0], results[1][0])


@pytest.mark.slow
def test_state_moves_onto_another_mesh():
  """The whole state (unshard) of a run on 4 x 2 restored onto 2 data x 4 model ranks: the
  parameters and adam's moments each resharded by the new mesh's blocks, and training
  goes on from the same values."""
  params = make_params(hidden=40)
  big = jax.make_mesh((4, 2), ("data", "model"))
  zp = commopt.zero_data_parallel(loss_fn, optax.adam(1e-2), big)
  sharded, state, _ = run(zp, params, 3, SPECS)
  whole_p, whole_s = zp.unshard(sharded), zp.unshard(state)
  other = jax.make_mesh((2, 4), ("data", "model"))
  zo = commopt.zero_data_parallel(loss_fn, optax.adam(1e-2), other)
  moved = zo.shard(whole_p, specs=SPECS)
  moved_state = zo.reshard_state(whole_s, moved)
  assert moved["w1"].rows.shape == (2, 4 * zero_comm.shard_len(13 * 10, 2))
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               zo.unshard(moved_state), whole_s)
  a, sa, la = zp.step(sharded, state, make_batch(9))
  b, sb, lb = zo.step(moved, moved_state, make_batch(9))
  np.testing.assert_allclose(np.mean(la), np.mean(lb), rtol=1e-5)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y),
                                                       rtol=2e-5, atol=2e-6),
               zp.unshard(a), zo.unshard(b))


@pytest.mark.parametrize("specs, message", [
    (dict(SPECS, w1=P("data", None)), "may name only the mesh's model axes"),
    (dict(SPECS, b2=P("model")), "must be a multiple"),
    (dict(SPECS, w1=P(None, None, "model")), "more entries"),
])
def test_bad_specs_are_refused(specs, message):
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  zp = commopt.zero_data_parallel(loss_fn, optax.sgd(0.1), mesh)
  params = make_params()
  with pytest.raises(ValueError, match=message):
    zp.shard(params, specs=specs)


def _crosses_nodes(collective, mesh) -> bool:
  """Whether a compiled collective's groups span two values of the mesh's first axis."""
  node = {d.id: i for i, row in enumerate(mesh.devices.reshape(mesh.shape["node"], -1))
          for d in row}
  return any(node[d] != node[g[0]] for g in collective.replica_groups for d in g)


@pytest.mark.slow
def test_hpz_on_model_blocks_keeps_the_backward_gathers_inside_the_node():
  """hpz=True beside a model axis (ZeRO over ("node", "local"), tensor parallel over
  "model", 2 x 2 x 2) on a stack gathered layer by layer under remat: each device's block
  crosses nodes once per layer, into its part of the secondary partition, the backward
  pass gathers inside the node only, and training is the flat gathers' to rounding."""
  mesh = jax.make_mesh((2, 2, 2), ("node", "local", "model"))
  rng = np.random.default_rng(4)
  params = {"layers": rng.normal(size=(3, 8, 8)).astype(np.float32) * 0.4,
            "out": rng.normal(size=(8, 5)).astype(np.float32) * 0.3}
  specs = {"layers": P(None, None, "model"), "out": None}

  def manual_loss(p, b, gather):
    def body(h, rows):
      return jnp.tanh(jnp.einsum("bi,io->bo", h, gather(rows), out_sharding=P())), None
    h, _ = jax.lax.scan(gather.remat(body), b["x"][:, :8], p["layers"])
    return jnp.mean((h @ gather(p["out"]) - b["y"]) ** 2)

  runs = {}
  for name, kw in (("flat", {}), ("hpz", {"hpz": True})):
    zp = commopt.zero_data_parallel(manual_loss, optax.adam(1e-2), mesh, gather="manual",
                                    axis_name=("node", "local"), **kw)
    sharded = zp.shard(params, specs=specs, stacked={"layers": True, "out": False})
    assert sharded["layers"].rows.sharding.spec == P(None, ("node", "local"), "model")
    state = zp.init(sharded)
    text = zp.lower(sharded, state, make_batch(0)).compile().as_text()
    gathers = [c for c in commopt.wire.parse_hlo(text) if c.kind == "all-gather"]
    for i in range(4):
      sharded, state, _ = zp.step(sharded, state, make_batch(i))
    runs[name] = (gathers, zp.unshard(sharded))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5,
                                                       atol=2e-6), runs["hpz"][1], runs["flat"][1])
  crosses = lambda c: _crosses_nodes(c, mesh)
  looped = {name: [c for c in g if c.trips == 3 and crosses(c)] for name, (g, _) in runs.items()}
  assert len(looped["flat"]) == 2 and {c.group_size for c in looped["flat"]} == {4}  # fwd, bwd
  assert len(looped["hpz"]) == 1 and looped["hpz"][0].group_size == 2   # the forward only
  # 8 x 4 = 32 coordinates per block, 8 float32 per owner, sent once to the other node.
  assert looped["hpz"][0].sent_bytes == 8 * 4
  assert not any(crosses(c) for c in runs["hpz"][0] if c.trips == 3 and c is not looped["hpz"][0])


@pytest.mark.slow
def test_hpz_on_model_blocks_with_quantized_gathers_converges():
  """qwZ + qgZ + hpZ beside a model axis: int8 weights into the secondary partition, int4
  gradients back, the loss after 40 steps within 10% of the dense flat gathers', and every
  data-axis gather or all-to-all across nodes moves packed words."""
  mesh = jax.make_mesh((2, 2, 2), ("node", "local", "model"))
  specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": None}

  def manual_loss(p, b, gather):
    return loss_fn(gather(p), b)

  tails = {}
  for name, kw in (("flat", {}), ("all three", dict(hpz=True, weights=Q8, grads=Q4))):
    zp = commopt.zero_data_parallel(manual_loss, optax.adam(1e-2), mesh, gather="manual",
                                    axis_name=("node", "local"), **kw)
    sharded, state, losses = run(zp, make_params(), 40, specs)
    tails[name] = float(losses[-10:].mean())
  assert tails["all three"] < 1.1 * tails["flat"], tails
  found = commopt.wire.hlo_collectives(zp, sharded, state, make_batch(0))
  across = {d for c in found if c.kind in ("all-gather", "all-to-all") and _crosses_nodes(c, mesh)
            for d in c.dtypes}
  assert across == {"u32"}, across


@pytest.mark.slow
def test_two_data_axes_beside_the_model_axis():
  """HSDP's layout, ZeRO over ("node", "local") and tensor parallel over "model" on a
  2 x 2 x 2 mesh: the hierarchical quantized reduce-scatter (inside the node, then
  across) trains as the dense one, and moves only packed words over the data axes."""
  mesh = jax.make_mesh((2, 2, 2), ("node", "local", "model"))
  params, out = make_params(), {}
  for name, kw in [("dense", {}), ("quantized", dict(weights=Q8, grads=Q4, hierarchical=True))]:
    zp = commopt.zero_data_parallel(loss_fn, optax.adam(1e-2), mesh,
                                    axis_name=("node", "local"), **kw)
    sharded, _, losses = run(zp, params, 20, SPECS)
    assert sharded["w1"].rows.sharding.spec == P(("node", "local"), "model")
    out[name] = losses[-1].mean()
    if name == "quantized":
      found = commopt.wire.hlo_collectives(zp, sharded, zp.init(sharded), make_batch(0))
      moved = {d for c in found if c.kind in ("all-gather", "all-to-all") for d in c.dtypes}
      assert moved == {"u32"}
  assert out["quantized"] < 1.05 * out["dense"]


@pytest.mark.slow
def test_error_memories_of_model_blocks_conserve_the_mean_gradient():
  """error_feedback=True beside a model axis: each worker keeps a memory of its blocks. One
  sgd(1) step from zero memories: the workers' mean memory is what the payloads did not
  carry of the mean gradient (the dense step's move minus the signed step's), nonzero; the
  memories go whole and back (unshard, reshard_state) unchanged."""
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  params, batch = make_params(), make_batch(0)
  moved = {}
  for name, kw in [("dense", {}), ("sign", dict(grads=commopt.scaled_sign(),
                                                error_feedback=True))]:
    zp = commopt.zero_data_parallel(loss_fn, optax.sgd(1.0), mesh, **kw)
    sharded = zp.shard(params, specs=SPECS)
    state = zp.init(sharded)
    sharded, state, _ = zp.step(sharded, state, batch)
    moved[name] = zp.unshard(sharded)
  memories = zp.unshard(state.residuals)
  assert memories["w1"].shape == (4, 13, 38)
  for k in params:
    np.testing.assert_allclose(np.asarray(memories[k]).mean(axis=0),
                               np.asarray(moved["sign"][k]) - np.asarray(moved["dense"][k]),
                               rtol=1e-4, atol=2e-6, err_msg=k)
  assert float(np.abs(np.asarray(memories["w1"])).max()) > 1e-3
  back = zp.reshard_state(zp.unshard(state), sharded)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               zp.unshard(back.residuals), memories)
  sharded, back, losses = zp.step(sharded, back, make_batch(1))
  assert np.isfinite(np.asarray(losses)).all()
