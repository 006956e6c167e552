"""Two-phase and hierarchical reductions: exactness, conservation, and the wire."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import commopt
from commopt import wire
from commopt.comm._words import to_words

N = 8
AXES = ("node", "local")


def params_like():
  # 1001 and 13 are not multiples of 8: chunks are padded.
  return {"w": jnp.zeros((64, 48)), "v": jnp.zeros((1001,)), "s": jnp.zeros((13,)),
          "frozen": None}


def updates(seed, n=N):
  rng = np.random.default_rng(seed)
  return {k: None if v is None else jnp.asarray(rng.normal(size=(n,) + v.shape), jnp.float32)
          for k, v in params_like().items()}


def leaves(tree):
  return {k: np.asarray(v) for k, v in tree.items() if v is not None}


def whole_init(tx, n=N):
  """The state of a plain ``tx.init`` outside any map (whole memories), stacked per worker."""
  return lambda params: jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape),
                                     tx.init(params))


def joined(parts, n):
  """Per-worker parts ``[W, c]`` laid end to end in worker order: the leaf's ``[n]``."""
  return np.asarray(parts).reshape(-1)[:n]


def shard_parts(parts, n, nodes=2, ranks=4):
  """Hierarchical parts ``[nodes·ranks, c]`` (node-major) of a leaf of ``n``: ``[nodes, n]``."""
  return np.asarray(parts).reshape(nodes, -1)[:, :n]


def server_parts(parts, n, nodes=2, ranks=4):
  """Hierarchical server parts: worker (s, l) holds chunk s of shard l. Returns ``[n]``."""
  parts = np.asarray(parts)
  shard = -(-n // ranks)
  by_shard = parts.reshape(nodes, ranks, -1).transpose(1, 0, 2).reshape(ranks, -1)[:, :shard]
  return by_shard.reshape(-1)[:n]


def run_sums(sm, seed, steps, init=None):
  """Runs ``steps`` updates; returns (Σ outputs, Σ mean inputs) of leaf "v", and the state."""
  state = (init or sm.init)(params_like())
  sum_out = sum_in = 0.0
  for step in range(steps):
    u = updates(seed + step)
    out, state = sm.update(u, state)
    sum_out = sum_out + leaves(out)["v"][0]
    sum_in = sum_in + np.asarray(u["v"]).mean(0)
  return sum_out, sum_in, state


def test_to_words_round_trip_mixed_dtypes():
  payload = {"a": jnp.arange(5, dtype=jnp.uint32), "b": jnp.ones((3,), jnp.bfloat16),
             "c": jnp.array([-1, 7], jnp.int32), "d": jnp.array([2.5], jnp.float32)}
  stacked = jax.tree.map(lambda x: jnp.stack([x, x + 1]), payload)
  words, unpack = to_words(stacked, batch_dims=1)
  assert words.dtype == jnp.uint32 and words.shape == (2, 5 + 2 + 2 + 1)
  for k, v in unpack(words).items():
    np.testing.assert_array_equal(np.asarray(v, np.float32), np.asarray(stacked[k], np.float32))


# --- two_phase -----------------------------------------------------------------


@pytest.mark.parametrize("name,atol", [("identity", 1e-6), ("cast", 2e-2)])
def test_two_phase_linear_is_the_exact_mean(mesh, name, atol):
  c = commopt.compressors.make(name)
  tx = commopt.compressed_mean(c, axis_name="data", strategy="two_phase", min_size=0)
  sm = commopt.testing.shard_map_workers(tx, mesh, "data")
  u = updates(0)
  out, _ = sm.update(u, sm.init(params_like()))
  assert out["frozen"] is None
  for k, v in leaves(out).items():
    np.testing.assert_allclose(v, np.broadcast_to(np.asarray(u[k]).mean(0), v.shape),
                               atol=atol, rtol=1e-2 if name == "cast" else 1e-6)


@pytest.mark.parametrize("name", ["scaled_sign", "top_k", "qsgd",
                                  pytest.param("int_quant", marks=pytest.mark.slow), "onebit"])
def test_two_phase_conservation_of_both_memories(mesh, name):
  """Σ outputs + mean worker residual + the server memory = Σ mean inputs (with error
  feedback asked for: C/(1+ω) for the unbiased qsgd and int_quant)."""
  tx = commopt.compressed_mean(commopt.compressors.make(name), axis_name="data",
                               strategy="two_phase", min_size=0, error_feedback=True)
  sum_out, sum_in, state = run_sums(commopt.testing.shard_map_workers(tx, mesh, "data"), 10, 5)
  worker = np.asarray(state.residual["v"]).mean(0)
  # Each worker keeps the server memory of its own chunk only.
  server = np.asarray(state.server_residual["v"])
  assert server.shape == (N, -(-1001 // N))
  np.testing.assert_allclose(sum_out + worker + joined(server, 1001), sum_in, atol=2e-4,
                             rtol=1e-4)
  assert np.abs(server).sum() > 0


def test_two_phase_whole_memory_from_a_plain_init(mesh):
  """A state from tx.init outside any map keeps whole memories: zeros outside the own chunk."""
  tx = commopt.compressed_mean(commopt.scaled_sign(), axis_name="data", strategy="two_phase",
                               min_size=0)
  sm = commopt.testing.shard_map_workers(tx, mesh, "data")
  sum_out, sum_in, state = run_sums(sm, 10, 5, init=whole_init(tx))
  worker = np.asarray(state.residual["v"]).mean(0)
  server = np.asarray(state.server_residual["v"])
  assert server.shape == (N, 1001)
  chunk = -(-1001 // N)
  for w in range(N):
    outside = np.ones(1001, bool)
    outside[w * chunk:(w + 1) * chunk] = False
    assert np.all(server[w][outside] == 0)
  np.testing.assert_allclose(sum_out + worker + server.sum(0), sum_in, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("strategy", ["two_phase",
                                      pytest.param("hierarchical", marks=pytest.mark.slow)])
def test_whole_and_per_worker_memories_agree(mesh, mesh2d, strategy):
  """The same steps from either layout: equal outputs, and equal memories once joined."""
  if strategy == "two_phase":
    tx = commopt.compressed_mean(commopt.qsgd(), axis_name="data", strategy="two_phase", min_size=0,
                                 error_feedback=True)
    sm = commopt.testing.shard_map_workers(tx, mesh, "data")
  else:
    tx = hierarchical(commopt.scaled_sign(), "two_phase")
    sm = commopt.testing.shard_map_workers(tx, mesh2d, AXES)
  s_part, s_whole = sm.init(params_like()), whole_init(tx)(params_like())
  for step in range(3):
    u = updates(50 + step)
    o_part, s_part = sm.update(u, s_part)
    o_whole, s_whole = sm.update(u, s_whole)
    for k in leaves(o_part):
      np.testing.assert_array_equal(leaves(o_part)[k], leaves(o_whole)[k])
  for k, n in (("w", 64 * 48), ("v", 1001), ("s", 13)):
    part, whole = np.asarray(s_part.server_residual[k]), np.asarray(s_whole.server_residual[k])
    if strategy == "two_phase":
      np.testing.assert_array_equal(joined(part, n), whole.sum(0))
      np.testing.assert_array_equal(s_part.residual[k], s_whole.residual[k])
    else:
      np.testing.assert_array_equal(server_parts(part, n), whole.sum(0))
      residual = np.asarray(s_whole.residual[k]).reshape(2, 4, n).sum(1)
      np.testing.assert_array_equal(shard_parts(s_part.residual[k], n), residual)


def test_per_worker_memory_shapes_and_a_state_for_other_workers(mesh2d):
  n = 1001
  tx = commopt.compressed_mean(commopt.scaled_sign(), axis_name="data", strategy="two_phase",
                               min_size=0)
  state = commopt.testing.vmap_workers(tx, N, "data").init(params_like())
  assert state.server_residual["v"].shape == (N, -(-n // N))
  assert state.residual["v"].shape == (N, n)
  hier = hierarchical(commopt.scaled_sign(), "two_phase")
  s_h = commopt.testing.shard_map_workers(hier, mesh2d, AXES).init(params_like())
  assert s_h.residual["v"].shape == (N, -(-n // 4))
  assert s_h.server_residual["v"].shape == (N, -(-(-(-n // 4)) // 2))
  # Parts made for 8 workers do not fit 4: refused, not silently misread.
  four = commopt.testing.vmap_workers(tx, 4, "data")
  with pytest.raises(ValueError, match=r"state does not match.*leaf \['s'\] has a server memory "
                                       r"of shape \(2,\), but .* needs one of \[\(4,\), \(13,\)\]"):
    four.update(updates(0, n=4), jax.tree.map(lambda x: x[:4], state))


@pytest.mark.slow
def test_two_phase_vmap_equals_shard_map(mesh):
  tx = commopt.compressed_mean(commopt.qsgd(), axis_name="data", strategy="two_phase", min_size=0,
                                 error_feedback=True)
  sm = commopt.testing.shard_map_workers(tx, mesh, "data")
  vm = commopt.testing.vmap_workers(tx, N, "data")
  s_s, s_v = sm.init(params_like()), vm.init(params_like())
  for step in range(2):
    u = updates(20 + step)
    o_s, s_s = sm.update(u, s_s)
    o_v, s_v = vm.update(u, s_v)
  for a, b in zip(jax.tree.leaves((o_s, s_s)), jax.tree.leaves((o_v, s_v))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.parametrize("strategy,name", [
    pytest.param("two_phase", "scaled_sign", marks=pytest.mark.slow), ("two_phase", "qsgd")])
def test_compressed_leaves_cross_in_one_collective_a_round(mesh, monkeypatch, strategy, name):
  """Three compressed leaves cross two-phase in one all-to-all and one all-gather of uint32
  words (their payloads end to end); every output and memory is, bit for bit, what each
  leaf exchanged on its own gives (stochastic rounding included: the keys are the same)."""
  from commopt.comm import _strategies

  def run():
    tx = commopt.compressed_mean(commopt.compressors.make(name), axis_name="data",
                                 strategy=strategy, min_size=0, error_feedback=True)
    sm = commopt.testing.shard_map_workers(tx, mesh, "data")
    state = sm.init(params_like())
    outs = []
    for step in range(2):
      out, state = sm.update(updates(40 + step), state)
      outs.append(out)
    audit = wire.hlo_collectives(sm.update, updates(42), state, stage="lowered")
    return jax.tree.map(np.asarray, (outs, state)), sorted(c.kind for c in audit)

  packed, packed_kinds = run()
  together = _strategies.run_together
  monkeypatch.setattr(_strategies, "run_together",
                      lambda exchanges, axis, around, wait_for: [
                          together([e], axis, lambda _, i=i: around(i), wait_for)[0]
                          for i, e in enumerate(exchanges)])
  alone, alone_kinds = run()
  rounds = ["all-gather", "all-to-all"] if strategy == "two_phase" else ["all-gather"]
  assert packed_kinds == rounds
  assert alone_kinds == sorted(rounds * 3)
  for a, b in zip(jax.tree.leaves(packed), jax.tree.leaves(alone)):
    commopt.testing.assert_same_bits(a, b)


def mlp_params():
  rng = np.random.default_rng(0)
  return {"w1": jnp.asarray(rng.normal(size=(1024, 512)) * 0.03, jnp.float32),
          "b1": jnp.zeros((512,)), "w2": jnp.asarray(rng.normal(size=(512, 10)) * 0.05,
                                                      jnp.float32), "b2": jnp.zeros((10,))}


def mlp_loss(p, b):
  h = jax.nn.relu(b["x"] @ p["w1"] + p["b1"])
  return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"] + p["b2"], b["y"]).mean()


def mlp_batch():
  rng = np.random.default_rng(1)
  return {"x": jnp.asarray(rng.normal(size=(64, 1024)), jnp.float32),
          "y": jnp.asarray(rng.integers(0, 10, size=64))}


@pytest.mark.slow
@pytest.mark.parametrize("name,options,at_least", [
    ("scaled_sign", {}, 25), ("top_k", {"ratio": 0.01}, 40)])
def test_two_phase_audit_keeps_the_ratio_at_8_workers(mesh, name, options, at_least):
  c = commopt.compressors.make(name, **options)
  params = mlp_params()
  results = {}
  for strategy in ("gather", "two_phase"):
    tx = optax.chain(commopt.compressed_mean(c, axis_name="data", strategy=strategy),
                     optax.sgd(0.1))
    dp = commopt.data_parallel(mlp_loss, tx, mesh)
    results[strategy] = wire.hlo_collectives(dp, params, dp.init(params), mlp_batch())
  audit = results["two_phase"]
  packed = [col for col in audit if col.kind in ("all-to-all", "all-gather")]
  # Two compressed leaves (the weights), packed: one all-to-all and one all-gather for both.
  assert sorted(col.kind for col in packed) == ["all-gather", "all-to-all"]
  assert all(set(col.dtypes) == {"u32"} for col in packed)
  dense_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))
  dense_sent = 2 * (N - 1) / N * dense_bytes
  ratio = dense_sent / wire.total_bytes(audit, "sent_bytes")
  assert ratio >= at_least, ratio
  # And gather, whose traffic grows with N, does not keep it.
  assert dense_sent / wire.total_bytes(results["gather"], "sent_bytes") < ratio / 2


# --- hierarchical ----------------------------------------------------------------


def hierarchical(c, inner="auto", **kw):
  return commopt.compressed_mean(c, axis_name=AXES, strategy="hierarchical", inner_strategy=inner,
                                 min_size=0, **kw)


@pytest.mark.parametrize("inner", ["gather", "two_phase"])
def test_hierarchical_identity_equals_flat(mesh, mesh2d, inner):
  flat = commopt.testing.shard_map_workers(
      commopt.compressed_mean(commopt.compressors.identity(), axis_name="data", min_size=0), mesh,
      "data")
  hier = commopt.testing.shard_map_workers(hierarchical(commopt.compressors.identity(), inner),
                                           mesh2d, AXES)
  u = updates(30)
  o_f, _ = flat.update(u, flat.init(params_like()))
  o_h, _ = hier.update(u, hier.init(params_like()))
  for k in leaves(o_f):
    np.testing.assert_allclose(leaves(o_h)[k], leaves(o_f)[k], atol=1e-6)


def crosses_nodes(col):
  return any(len({d // 4 for d in g}) > 1 for g in col.replica_groups)


@pytest.mark.parametrize("inner", ["gather", "two_phase"])
def test_hierarchical_compressed_bytes_cross_only_the_slow_axis(mesh2d, inner):
  """Packed words cross the slow axis; the small dense leaves (below ``min_size``)
  cross it too, accounted for one by one: a mean inside each node, then one
  between the same local rank of the two nodes, never over all eight devices."""
  c = commopt.scaled_sign()
  tx = commopt.compressed_mean(c, axis_name=AXES, strategy="hierarchical", inner_strategy=inner,
                               min_size=100)
  sm = commopt.testing.shard_map_workers(tx, mesh2d, AXES)
  params = {"w": jnp.zeros((64, 48)), "b": jnp.zeros((48,)), "s": jnp.zeros((3,))}
  rng = np.random.default_rng(31)
  u = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=(N,) + p.shape), jnp.float32), params)
  audit = wire.hlo_collectives(sm.update, u, sm.init(params))
  assert not any(len(g) == N for col in audit for g in col.replica_groups), audit
  slow = [col for col in audit if crosses_nodes(col)]
  fast = [col for col in audit if not crosses_nodes(col)]
  assert all(g in ((0, 4), (1, 5), (2, 6), (3, 7)) for col in slow for g in col.replica_groups)
  # The dense leaves: all-reduces of exactly their shapes, once per axis.
  dense = [col for col in audit if col.kind == "all-reduce"]
  dense_shapes = sorted(s for col in dense for s in col.shapes)
  assert dense_shapes == sorted([(48,), (3,)] * 2), dense
  assert wire.total_bytes([col for col in slow if col.kind == "all-reduce"]) == (48 + 3) * 4
  # Everything else across nodes: packed words (and the f32 scales), never a
  # float array of the shard's size.
  packed = [col for col in slow if col.kind != "all-reduce"]
  assert packed and any("u32" in col.dtypes for col in packed)
  assert all(d == "u32" or np.prod(shape) <= 2 for col in packed
             for d, shape in zip(col.dtypes, col.shapes)), packed
  # Inside a node: the dense reduce-scatter and all-gather of "w", and the dense leaves.
  assert {col.kind for col in fast} == {"reduce-scatter", "all-gather", "all-reduce"}
  assert all("f32" in col.dtypes for col in fast)
  # Each local rank compresses a quarter of the leaf: 768 coordinates.
  shard = c.payload_bits((768,), jnp.float32) // 8
  if inner == "gather":
    assert wire.total_bytes(packed) == shard
  else:
    assert wire.total_bytes(packed) == 2 * 4 * (-(-c.payload_bits((384,), jnp.float32) // 32)) + \
        4 * (-(-c.payload_bits((384,), jnp.float32) // 32))
  # The plan names the same collectives, the dense leaves included.
  plan = wire.comm_plan(tx, params, (2, 4))
  planned_dense = [e for e in plan.collectives if e.kind == "all-reduce"]
  assert sorted((e.leaf, e.axis) for e in planned_dense) == sorted(
      (leaf, axis) for leaf in ("['b']", "['s']") for axis in AXES)
  assert not any(e.packed for e in planned_dense)
  assert sum(e.contributed_bytes for e in planned_dense) == wire.total_bytes(dense)


def test_hierarchical_dense_leaves_are_the_mean(mesh2d):
  tx = commopt.compressed_mean(commopt.scaled_sign(), axis_name=AXES, strategy="hierarchical",
                               min_size=100)
  sm = commopt.testing.shard_map_workers(tx, mesh2d, AXES)
  params = {"w": jnp.zeros((64, 48)), "b": jnp.zeros((48,))}
  u = jax.tree.map(lambda p: jnp.asarray(np.random.default_rng(2).normal(size=(N,) + p.shape),
                                         jnp.float32), params)
  out, _ = sm.update(u, sm.init(params))
  np.testing.assert_allclose(out["b"], np.broadcast_to(u["b"].mean(0), u["b"].shape), rtol=1e-6,
                             atol=1e-7)


@pytest.mark.parametrize("inner", ["gather", "two_phase"])
def test_hierarchical_conservation(mesh2d, inner):
  sm = commopt.testing.shard_map_workers(hierarchical(commopt.scaled_sign(), inner), mesh2d, AXES)
  sum_out, sum_in, state = run_sums(sm, 40, 4)
  # The memory lives on the compressed shard: a node's memory is its local
  # ranks' shards end to end, and the mean over nodes enters the balance.
  residual = shard_parts(state.residual["v"], 1001).mean(0)
  server = 0.0
  if inner == "two_phase":
    server = server_parts(state.server_residual["v"], 1001)
  else:
    assert isinstance(state.server_residual["v"], optax.MaskedNode)
  np.testing.assert_allclose(sum_out + residual + server, sum_in, atol=2e-4, rtol=1e-4)


def is_cm_state(x):
  return isinstance(x, commopt.transforms.CompressedMeanState)


@pytest.mark.slow
def test_data_parallel_on_a_2d_mesh(mesh, mesh2d):
  params = {"w": jnp.zeros((32, 4)), "b": jnp.zeros((4,))}
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.normal(size=(64, 32)), jnp.float32)
  batch = {"x": x, "y": x @ jnp.asarray(rng.normal(size=(32, 4)), jnp.float32)}
  loss = lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)
  flat = commopt.data_parallel(
      loss, optax.chain(commopt.compressed_mean(commopt.compressors.identity(), axis_name="data"),
                        optax.sgd(0.05)),
      mesh)
  hier = commopt.data_parallel(
      loss, optax.chain(hierarchical(commopt.compressors.identity()), optax.sgd(0.05)), mesh2d,
      AXES)
  assert hier.num_workers == 8
  # Each trainer gets its own copy: the step donates what it is given.
  fresh = lambda: jax.tree.map(jnp.copy, params)
  p_f, s_f, p_h, s_h = fresh(), flat.init(params), fresh(), hier.init(params)
  for _ in range(5):
    p_f, s_f, l_f = flat.step(p_f, s_f, batch)
    p_h, s_h, l_h = hier.step(p_h, s_h, batch)
  np.testing.assert_allclose(np.asarray(p_h["w"]), np.asarray(p_f["w"]), atol=1e-5)
  np.testing.assert_allclose(np.asarray(l_h), np.asarray(l_f), rtol=1e-5)
  # With compression, the per-worker memory is stacked over both axes.
  tx = optax.chain(hierarchical(commopt.scaled_sign(), "two_phase"), optax.sgd(0.05))
  dp = commopt.data_parallel(loss, tx, mesh2d, AXES)
  first = float(np.mean(np.asarray(dp.step(fresh(), dp.init(params), batch)[2])))
  p, state = fresh(), dp.init(params)
  for _ in range(60):
    p, state, losses = dp.step(p, state, batch)
  assert float(np.mean(np.asarray(losses))) < 0.5 * first
  # data_parallel runs init inside its shard_map: each worker keeps its rank's quarter.
  cm = next(s for s in jax.tree.leaves(state, is_leaf=is_cm_state) if is_cm_state(s))
  assert cm.residual["w"].shape == (8, 32)


# --- errors --------------------------------------------------------------------------


@pytest.mark.parametrize("make,match", [
    (lambda: commopt.compressed_mean(commopt.power_sgd(2), axis_name="data", strategy="two_phase"),
     "needs a stateless per-leaf compressor"),
    (lambda: commopt.compressed_mean(commopt.scaled_sign(), axis_name="data",
                                     strategy="hierarchical"),
     r"`axis_name` = \(slow, fast\)"),
    (lambda: commopt.compressed_mean(commopt.scaled_sign(), axis_name=("a", "a"),
                                     strategy="hierarchical"),
     "two distinct mesh axis names"),
    (lambda: commopt.compressed_mean(commopt.scaled_sign(), axis_name=AXES),
     "needs strategy='hierarchical'"),
    (lambda: commopt.compressed_mean(commopt.scaled_sign(), axis_name=AXES, strategy="hierarchical",
                                     inner_strategy="ring"), "`inner_strategy` must be one of"),
    (lambda: commopt.compressed_mean(commopt.scaled_sign(), axis_name=AXES, strategy="hierarchical",
                                     inner_strategy="psum"), "needs a linear compressor"),
])
def test_bad_strategy_arguments(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_data_parallel_rejects_a_mesh_without_the_axes(mesh):
  loss = lambda p, b: jnp.sum(p["w"])
  tx = optax.chain(hierarchical(commopt.scaled_sign()), optax.sgd(0.1))
  with pytest.raises(ValueError, match=r"must name distinct axes of the mesh, whose axes are "
                                       r"\('data',\); \['node', 'local'\] are not among them"):
    commopt.data_parallel(loss, tx, mesh, AXES)


@pytest.mark.parametrize("strategy", ["auto", "psum", "gather",
                                      pytest.param("two_phase", marks=pytest.mark.slow)])
def test_every_strategy_runs_on_one_device_without_an_axis(strategy):
  """axis_name=None is one local worker: each strategy reduces over it (two_phase's
  all-to-all and all-gather included) and returns that worker's reconstruction."""
  c = commopt.cast(jnp.bfloat16) if strategy == "psum" else commopt.scaled_sign()
  tx = commopt.compressed_mean(c, axis_name=None, strategy=strategy, min_size=0,
                               error_feedback=True)
  x = {"w": jnp.linspace(-1.0, 2.0, 50)}
  out, state = tx.update(x, tx.init(x))
  payload, _ = c.encode(x["w"], c.init(x["w"]), jax.random.PRNGKey(0))
  np.testing.assert_allclose(out["w"], c.decode(payload, None, x["w"]), rtol=1e-6)
  np.testing.assert_allclose(state.residual["w"], x["w"] - out["w"], rtol=1e-5, atol=1e-6)


def test_hierarchical_without_an_axis_is_refused_by_name():
  with pytest.raises(ValueError, match="on one device .* use any other strategy"):
    commopt.compressed_mean(commopt.scaled_sign(), axis_name=None, strategy="hierarchical")


def _bytes_by_kind(entries):
  out = {}
  for e in entries:
    out[e.kind] = out.get(e.kind, 0) + e.contributed_bytes
  return out


@pytest.mark.parametrize("strategy,inner", [
    ("gather", "auto"), ("two_phase", "auto"), ("psum", "auto"),
    ("hierarchical", "gather"), ("hierarchical", "two_phase")])
def test_comm_plan_predicts_the_compiled_collectives(mesh, mesh2d, strategy, inner):
  """wire.comm_plan's collectives, kind by kind, carry the bytes the compiled program moves."""
  c = commopt.cast(jnp.bfloat16) if strategy == "psum" else commopt.scaled_sign()
  params = {"w": jnp.zeros((64, 48)), "b": jnp.zeros((10,))}
  flat = strategy != "hierarchical"
  axes, m, workers = ("data", mesh, N) if flat else (AXES, mesh2d, (2, 4))
  tx = commopt.compressed_mean(c, axis_name=axes, strategy=strategy, inner_strategy=inner,
                               min_size=100)
  sm = commopt.testing.shard_map_workers(tx, m, axes)
  u = {"w": updates(32)["w"], "b": jnp.ones((N, 10))}
  audit = wire.hlo_collectives(sm.update, u, sm.init(params), stage="lowered")
  plan = wire.comm_plan(c, params, workers, axis_name=axes, strategy=strategy,
                        inner_strategy=inner, min_size=100)
  assert _bytes_by_kind(plan.collectives) == _bytes_by_kind(audit)
  assert plan.contributed_bytes == wire.total_bytes(audit)
  assert plan.sent_bytes == pytest.approx(wire.total_bytes(audit, "sent_bytes"), abs=len(audit))


@pytest.mark.parametrize("axes", ["data", AXES])
def test_every_reducing_transform_reports_a_plan_that_the_compiled_step_follows(
    mesh, mesh2d, axes):
  """majority_vote, a robust rule (dense and compressed), dgc and compressed_mean: their
  comm_plan carries the bytes, kind by kind, that their compiled collectives move."""
  params = {"w": jnp.zeros((64, 48)), "b": jnp.zeros((10,))}
  m, workers = (mesh, N) if axes == "data" else (mesh2d, (2, 4))
  u = {"w": updates(33)["w"], "b": jnp.ones((N, 10))}
  txs = [commopt.majority_vote(axis_name=axes),
         commopt.aggregators.coordinate_median(axis_name=axes),
         commopt.aggregators.coordinate_median(axis_name=axes, compressor=commopt.int_quant(),
                                               min_size=100)]
  if axes == "data":
    txs += [commopt.transforms.dgc(axis_name=axes, densities=0.05, min_size=100),
            commopt.compressed_mean(commopt.scaled_sign(), axis_name=axes, min_size=100)]
  for tx in txs:
    sm = commopt.testing.shard_map_workers(tx, m, axes)
    audit = wire.hlo_collectives(sm.update, u, sm.init(params), stage="lowered")
    plan = wire.comm_plan(tx, params, workers)
    assert _bytes_by_kind(plan.collectives) == _bytes_by_kind(audit), tx
  with pytest.raises(ValueError, match="reducing transform made by commopt"):
    wire.comm_plan(optax.sgd(0.1), params, N)


@pytest.mark.parametrize("strategy,axis", [("two_phase", "data"),
                                           ("hierarchical", ("node", "local"))])
def test_a_compressor_that_saves_nothing_on_flat_chunks_is_refused(strategy, axis):
  atomo = commopt.compressors.make("atomo")
  assert "per_leaf" in atomo.capabilities and "flat_chunks" not in atomo.capabilities
  with pytest.raises(ValueError, match=r"declares flat_chunks=False.*would save nothing.*"
                                       r"strategy='gather'"):
    commopt.compressed_mean(atomo, axis_name=axis, strategy=strategy)
  commopt.compressed_mean(atomo, axis_name="data", strategy="gather")
  for name in ("scaled_sign", "qsgd", "top_k", "identity", "int_quant"):
    assert "flat_chunks" in commopt.compressors.make(name).capabilities, name
  # Declared, not probed: an absolute k past a probe's size is still taken.
  big_k = commopt.top_k(k=5000)
  assert "flat_chunks" in big_k.capabilities
  commopt.compressed_mean(commopt.top_k(k=2048), axis_name="data", strategy="two_phase")


def test_a_top_k_with_an_absolute_k_reduces_as_before():
  tx = commopt.compressed_mean(commopt.top_k(k=5000), min_size=0)
  params = {"w": jnp.arange(10000.0).reshape(100, 100)}
  out, _ = tx.update(params, tx.init(params))
  assert int(jnp.sum(out["w"] != 0)) == 5000


def test_a_16_bit_psum_between_cpu_processes_warns(mesh, monkeypatch):
  # XLA:CPU widens a 16-bit all-reduce to float32 when it compiles: between processes a
  # cast payload under psum crosses at the dense size, which the user is told; two-phase
  # (16 bits on the wire) and one process are not warned about.
  import warnings
  from commopt.comm import _collectives
  u = {"w": jnp.ones((N, 64, 64))}
  for crosses, strategy, warns in ((True, "psum", True), (True, "two_phase", False),
                                   (False, "psum", False)):
    monkeypatch.setattr(_collectives, "crosses_processes", lambda c=crosses: c)
    tx = commopt.compressed_mean(commopt.cast("bfloat16"), axis_name="data", strategy=strategy)
    sm = commopt.testing.shard_map_workers(tx, mesh, "data")
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      sm.update(u, sm.init({"w": jnp.ones((64, 64))}))
    said = [str(w.message) for w in caught if issubclass(w.category, commopt.WireSizeWarning)]
    assert bool(said) == warns, (crosses, strategy, said)
    if warns:
      assert "cast(bfloat16)" in said[0] and "widens a 16-bit all-reduce" in said[0]
      assert "strategy='two_phase'" in said[0]
