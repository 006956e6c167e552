"""Sharded models: each device compresses its own shard of a parameter sharded over model axes.

Tensor parallel on ("data", "model") 2 x 4, HSDP on ("replica", "fsdp",
"tensor"), DiLoCo over sharded replicas, the user's own ``shard_map``; the
bytes over the data axis from the compiled HLO, the step's memory, and the
fallback to whole leaves for a ``tx`` that reduces a leaf by itself.
"""

import contextlib
import pathlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import commopt
from commopt import wire
from commopt._src import vma

TP = {"w1": P(None, "model"), "w2": P("model", None), "b": P()}
SHAPES = {"w1": (16, 256), "w2": (256, 8), "b": (8,)}


def raw_params():
  keys = jax.random.split(jax.random.PRNGKey(0), 2)
  return {"w1": jax.random.normal(keys[0], SHAPES["w1"]) * 0.3,
          "w2": jax.random.normal(keys[1], SHAPES["w2"]) * 0.3, "b": jnp.zeros(SHAPES["b"])}


def placed(mesh, specs, params=None):
  params = raw_params() if params is None else params
  return {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}


def loss_fn(p, b):
  h = jnp.tanh(b["x"] @ p["w1"])
  out = jnp.einsum("bh,ho->bo", h, p["w2"], out_sharding=P(None, None))
  return jnp.mean((out + p["b"] - b["y"]) ** 2)


def batch(seed=2, rows=32):
  x = jax.random.normal(jax.random.PRNGKey(seed), (rows, 16))
  return {"x": x, "y": jnp.sin(x[:, :8])}


def tp_mesh():
  return jax.make_mesh((2, 4), ("data", "model"))


def data_groups(mesh, axis="data"):
  """The device-id groups of ``axis`` (the replica groups of a collective over it)."""
  ids = np.vectorize(lambda d: d.id)(mesh.devices)
  moved = np.moveaxis(ids, mesh.axis_names.index(axis), -1).reshape(-1, mesh.shape[axis])
  return {tuple(sorted(g)) for g in moved}


def bytes_over(audit, groups):
  """Bytes one device puts into the collectives whose groups are ``groups``."""
  return sum(c.contributed_bytes for c in audit
             if c.replica_groups and {tuple(sorted(g)) for g in c.replica_groups} <= groups)


def local_shapes(mesh, specs):
  out = {}
  for k, shape in SHAPES.items():
    spec = list(specs[k]) + [None] * (len(shape) - len(specs[k]))
    out[k] = jax.ShapeDtypeStruct(
        tuple(n // (mesh.shape[a] if a else 1) for n, a in zip(shape, spec)), jnp.float32)
  return out


def sgd_tx(compressor, **kwargs):
  return optax.chain(commopt.compressed_mean(compressor, axis_name="data", min_size=0, **kwargs),
                     optax.sgd(0.1))


# -- the step on tensor-parallel parameters ------------------------------------------------

@pytest.mark.parametrize("name", ["scaled_sign", "int_quant", "qsgd", "top_k", "random_k", "cast"])
def test_each_device_sends_the_payload_of_its_shard(name):
  """Over the data axis, each device moves exactly its shard's payload (a quarter of the
  whole leaf's on 2 x 4); over the model axis nothing parameter-sized is gathered."""
  mesh = tp_mesh()
  compressor = commopt.compressors.make(name)
  params = placed(mesh, TP)
  dp = commopt.data_parallel(loss_fn, sgd_tx(compressor), mesh)
  layout = dp.layout(params)
  assert layout.shard_local
  state = dp.init(params)
  residual = state.inner_state[0].residual["w1"]
  if not isinstance(residual, optax.MaskedNode):   # unbiased and rounding ones keep none
    assert residual.sharding.spec == P("data", None, "model")
    assert residual.addressable_shards[0].data.shape == (1, 16, 64)
  audit = wire.hlo_collectives(dp, params, state, batch())
  payload = wire.payload_bytes(compressor, local_shapes(mesh, TP), min_size=0).total
  assert bytes_over(audit, data_groups(mesh)) == payload
  whole = wire.payload_bytes(compressor, {k: jax.ShapeDtypeStruct(s, jnp.float32)
                                          for k, s in SHAPES.items()}, min_size=0).total
  assert bytes_over(audit, data_groups(mesh)) < 0.3 * whole
  model = data_groups(mesh, "model")
  gathers = [c for c in audit if c.kind == "all-gather"
             and {tuple(sorted(g)) for g in c.replica_groups} <= model]
  assert not gathers, [c.line for c in gathers]


def test_flat_buckets_of_model_shards_move_each_shard_once():
  """identity's dense leaves packed into flat buckets on 2 x 4: the shards of w1 and w2
  (varying over "model") share one bucket, b (replicated over it) has its own, which the
  4 model ranks split; over the data axis each device moves its shards' bytes and a
  quarter of b's, and the step is the tuple all-reduce's bit for bit."""
  mesh = tp_mesh()
  steps = {}
  for bucket_bytes in (None, 2**20):
    params = placed(mesh, TP)
    dp = commopt.data_parallel(loss_fn, sgd_tx(commopt.compressors.identity(),
                                               bucket_bytes=bucket_bytes), mesh, donate=False)
    state = dp.init(params)
    audit = wire.hlo_collectives(dp, params, state, batch())
    if bucket_bytes:
      shards = 4 * (np.prod(local_shapes(mesh, TP)["w1"].shape)
                    + np.prod(local_shapes(mesh, TP)["w2"].shape) + SHAPES["b"][0] // 4)
      assert bytes_over(audit, data_groups(mesh)) == shards
      reduces = [c for c in audit if c.kind == "all-reduce" and "f32" in c.dtypes
                 and {tuple(sorted(g)) for g in c.replica_groups} <= data_groups(mesh)]
      # Two flat buffers (XLA combines them into one all-reduce in one process).
      assert sum(len(c.dtypes) for c in reduces) == 2, [c.line for c in reduces]
    steps[bucket_bytes] = dp.step(params, state, batch())[0]
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               steps[None], steps[2**20])


@pytest.mark.slow
def test_whole_leaves_on_request_and_for_a_tx_that_reduces_a_leaf():
  mesh = tp_mesh()
  params = placed(mesh, TP)
  clipped = optax.chain(optax.clip_by_global_norm(1.0),
                        commopt.compressed_mean(commopt.scaled_sign(), axis_name="data"),
                        optax.sgd(0.1))
  with pytest.warns(UserWarning, match=r"reduce_sum.*runs on whole leaves"):
    layout = commopt.data_parallel(loss_fn, clipped, mesh).layout(params)
  assert not layout.shard_local
  with pytest.raises(ValueError, match="shard_local=True, but `tx` computes over whole leaves"):
    commopt.data_parallel(loss_fn, clipped, mesh, shard_local=True).layout(params)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    dp = commopt.data_parallel(loss_fn, clipped, mesh, shard_local=False)
    assert not dp.layout(params).shard_local
    p, s = params, dp.init(params)
    p, s, losses = dp.step(p, s, batch())
  assert np.all(np.isfinite(np.asarray(losses)))
  with pytest.raises(ValueError, match="`shard_local` must be 'auto', True or False"):
    commopt.data_parallel(loss_fn, clipped, mesh, shard_local="yes")


def test_a_nonfinite_shard_skips_the_step_on_every_device():
  mesh = tp_mesh()
  params = placed(mesh, TP)
  dp = commopt.data_parallel(loss_fn, sgd_tx(commopt.scaled_sign()), mesh, donate=False)
  state = dp.init(params)
  bad = batch()
  bad["y"] = bad["y"].at[0, 0].set(jnp.inf)     # worker 0 only, reaching every shard of w1
  new, new_state, _ = dp.step(params, state, bad)
  for k in params:
    np.testing.assert_array_equal(np.asarray(new[k]), np.asarray(params[k]))
  assert int(new_state.total_notfinite) == 1
  # A NaN in one shard's gradient only (column 0 of w1 lives on model rank 0).
  w1 = np.array(params["w1"])
  w1[:, 0] = np.nan
  p = placed(mesh, TP, dict(raw_params(), w1=jnp.asarray(w1)))
  new, new_state, _ = dp.step(p, state, batch())
  assert int(new_state.total_notfinite) == 1
  np.testing.assert_array_equal(np.asarray(new["w2"]), np.asarray(p["w2"]))


@pytest.mark.slow
def test_step_memory_shrinks_with_the_model_axis():
  """memory_analysis of the step on 2 x 4: the shard-local step's arguments and
  temporaries are within 1.1x of a quarter of the same step's with replicated
  parameters, the default non-finite skip's copies included."""
  mesh = tp_mesh()
  keys = jax.random.split(jax.random.PRNGKey(1), 2)
  big = {"w1": jax.random.normal(keys[0], (64, 512)) * 0.1,
         "w2": jax.random.normal(keys[1], (512, 64)) * 0.1}

  def loss(p, b):
    h = jnp.tanh(b["x"] @ p["w1"])
    return jnp.mean((jnp.einsum("bh,ho->bo", h, p["w2"], out_sharding=P()) - b["y"]) ** 2)

  x = jax.random.normal(jax.random.PRNGKey(3), (16, 64))
  b = {"x": x, "y": jnp.sin(x)}
  tx = optax.chain(commopt.compressed_mean(commopt.scaled_sign(), axis_name="data"),
                   optax.adam(1e-3))
  used = {}
  for label, specs in (("sharded", {"w1": P(None, "model"), "w2": P("model", None)}),
                       ("replicated", {"w1": P(), "w2": P()})):
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in big.items()}
    dp = commopt.data_parallel(loss, tx, mesh)
    m = dp.lower(params, dp.init(params), b).compile().memory_analysis()
    used[label] = m.argument_size_in_bytes + m.temp_size_in_bytes
  assert used["sharded"] <= 1.1 / 4 * used["replicated"], used


# -- the exchange in the user's own shard_map ------------------------------------------

def mean_of(compressor, grads, mesh, in_spec, out_spec, q=None, q_spec=None, spec=None):
  """``compressed_mean`` over "data" in the user's own ``shard_map``: ``grads`` stacks the
  workers' gradients ``[workers, ...]`` of one leaf "w"; PowerSGD's ``q`` may be given."""
  tx = commopt.compressed_mean(compressor, axis_name="data", min_size=0)

  given = q is not None

  def body(g, q):
    g = {"w": g[0]}
    ctx = (commopt.comm.model_sharding({"w": spec}, {"w": grads.shape[1:]}, mesh)
           if spec is not None else contextlib.nullcontext())
    if spec is None and any(out_spec):   # the model axes declared, the dimensions not
      ctx = commopt.comm._collectives.model_axes({"model"})
    with ctx:
      state = tx.init(g)
      if given:
        state = state._replace(compressor_state={"w": state.compressor_state["w"]._replace(q=q)})
      out, _ = tx.update(g, state)
    return out["w"]

  q_in = jnp.zeros(()) if q is None else q
  if not vma.is_tracer(grads):   # arguments placed as in_specs say
    grads = jax.device_put(grads, NamedSharding(mesh, in_spec))
    q_in = jax.device_put(q_in, NamedSharding(mesh, q_spec or P()))
  fn = jax.shard_map(body, mesh=mesh, in_specs=(in_spec, q_spec or P()), out_specs=out_spec)
  return fn(grads, q_in) if vma.is_tracer(grads) else jax.jit(fn)(grads, q_in)


def flat_mesh():
  return jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])


@pytest.mark.parametrize("compressor", [
    commopt.compressors.identity(), commopt.cast(jnp.bfloat16), commopt.sign(),
    commopt.scaled_sign(block_size=64),
    commopt.int_quant(bits=8, block_size=64, rounding="nearest")], ids=lambda c: c.name)
@pytest.mark.parametrize("spec", [P(None, None, "model"), P(None, "model", None)],
                         ids=["columns", "rows"])
def test_aligned_blocks_equal_the_unsharded_mean_bit_for_bit(compressor, spec):
  """Elementwise compressors, and blockwise ones whose blocks (64 values) fall inside a
  shard, give on each shard exactly the unsharded mean's block."""
  grads = jax.random.normal(jax.random.PRNGKey(4), (2, 16, 256))
  if spec == P(None, "model", None):
    grads = grads.reshape(2, 256, 16)
  sharded = mean_of(compressor, grads, tp_mesh(), P("data", *spec[1:]), P(*spec[1:]))
  whole = mean_of(compressor, grads, flat_mesh(), P("data"), P())
  np.testing.assert_array_equal(np.asarray(sharded), np.asarray(whole))


def test_per_leaf_scales_become_per_shard_scales():
  """scaled_sign's one scale per leaf is one scale per shard on a sharded leaf: the same
  as scaled_sign(block_size=shard) on the whole leaf when shards are contiguous (rows)."""
  grads = jax.random.normal(jax.random.PRNGKey(5), (2, 256, 16))
  sharded = mean_of(commopt.scaled_sign(), grads, tp_mesh(), P("data", "model", None),
                    P("model", None))
  blocks = mean_of(commopt.scaled_sign(block_size=64 * 16), grads, flat_mesh(), P("data"), P())
  np.testing.assert_array_equal(np.asarray(sharded), np.asarray(blocks))


@pytest.mark.parametrize("spec", [P(None, "model"), P("model", None)], ids=["columns", "rows"])
@pytest.mark.parametrize("view", ["last", "first"])
def test_power_sgd_on_a_sharded_matrix_equals_the_unsharded_protocol(spec, view):
  """P = M Q summed over the column shards, P gathered over the row shards to be
  orthogonalised, Q' = Mᵀ P̂ summed over the row shards: the unsharded result to rounding,
  with each factor crossing the data axis once per model group (a quarter per device)."""
  mesh = tp_mesh()
  compressor = commopt.power_sgd(rank=2, min_compression_rate=0, view=view)
  grads = jax.random.normal(jax.random.PRNGKey(6), (2, 32, 64))
  q = jax.random.normal(jax.random.PRNGKey(7), (64 if view == "last" else 64, 2))
  cols = spec == P(None, "model")
  q_spec = P("model", None) if cols else P()
  sharded = mean_of(compressor, grads, mesh, P("data", *spec), spec, q=q, q_spec=q_spec,
                    spec=spec)
  whole = mean_of(compressor, grads, flat_mesh(), P("data"), P(), q=q)
  np.testing.assert_allclose(np.asarray(sharded), np.asarray(whole), rtol=2e-5, atol=2e-6)
  fn = jax.jit(lambda g, q: mean_of(compressor, g, mesh, P("data", *spec), spec, q=q,
                                    q_spec=q_spec, spec=spec))
  audit = wire.hlo_collectives(fn, jax.device_put(grads, NamedSharding(mesh, P("data", *spec))),
                               jax.device_put(q, NamedSharding(mesh, q_spec)))
  n, m = (32, 64)
  assert bytes_over(audit, data_groups(mesh)) == (n + m) * 2 * 4 // 4


def test_power_sgd_without_the_leaf_spec_compresses_each_shard_as_its_own_matrix():
  """Without model_sharding a sharded leaf's dimensions are unknown: each shard is its own
  matrix (rank r per shard), still a valid low-rank compression of the leaf."""
  mesh = tp_mesh()
  compressor = commopt.power_sgd(rank=1, min_compression_rate=0)
  grads = jnp.broadcast_to(jnp.outer(jnp.arange(1.0, 33.0), jnp.ones(64)), (2, 32, 64))
  out = mean_of(compressor, grads, mesh, P("data", None, "model"), P(None, "model"))
  np.testing.assert_allclose(np.asarray(out), np.asarray(grads[0]), rtol=1e-4)


# -- HSDP and synchronisation modes over sharded replicas ------------------------------

@pytest.mark.slow
def test_hsdp_diloco_keeps_every_state_sharded():
  """("replica", "fsdp", "tensor"): DiLoCo's per-replica parameters, anchor, inner Adam and
  outer momentum all keep the model sharding; the outer exchange runs over "replica"."""
  mesh = jax.make_mesh((2, 2, 2), ("replica", "fsdp", "tensor"))
  specs = {"w1": P("fsdp", "tensor"), "w2": P("tensor", "fsdp"), "b": P()}
  params = placed(mesh, specs)
  tx = commopt.diloco(optax.adam(1e-2), axis_name="replica", period=2,
                      compressor=commopt.int_quant(bits=4), min_size=0)
  dp = commopt.data_parallel(loss_fn, tx, mesh, axis_name="replica", local_params=True)
  assert dp.layout(params).shard_local
  state, p = dp.init(params), dp.place_params(params)
  assert p["w1"].sharding.spec == P("replica", "fsdp", "tensor")
  losses = []
  for _ in range(6):
    p, state, loss = dp.step(p, state, batch())
    losses.append(float(np.mean(np.asarray(loss))))
  assert losses[-1] < losses[0]
  assert p["w2"].sharding.spec == P("replica", "tensor", "fsdp")
  inner = state.inner_state
  assert inner.anchor["w1"].sharding.spec == P("fsdp", "tensor")
  assert inner.inner_state[0].mu["w1"].sharding.spec == P("replica", "fsdp", "tensor")
  assert inner.outer_state[0].trace["w2"].sharding.spec == P("tensor", "fsdp")
  assert inner.anchor["w1"].addressable_shards[0].data.shape == (8, 128)


@pytest.mark.slow
def test_hsdp_diloco_skips_a_nonfinite_replica_alone_between_exchanges():
  """A NaN in one replica's rows: between exchanges that replica (every shard of it) keeps
  its parameters alone, with no collective over "replica"; on an exchange step every
  replica skips and the exchange waits a step."""
  mesh = jax.make_mesh((2, 2, 2), ("replica", "fsdp", "tensor"))
  params = placed(mesh, {"w1": P("fsdp", "tensor"), "w2": P("tensor", "fsdp"), "b": P()})
  tx = commopt.diloco(optax.adam(1e-2), axis_name="replica", period=2,
                      compressor=commopt.int_quant(bits=4), min_size=0)
  dp = commopt.data_parallel(loss_fn, tx, mesh, axis_name="replica", local_params=True)
  state, p = dp.init(params), dp.place_params(params)
  good = jax.tree.map(np.asarray, batch())
  bad = {**good, "x": good["x"].copy()}
  bad["x"][-1] = np.nan                                  # a row of the last replica
  before = jax.tree.map(np.asarray, p)
  p, state, _ = dp.step(p, state, bad)
  after = jax.tree.map(np.asarray, p)
  for k in after:
    assert [np.array_equal(after[k][r], before[k][r]) for r in range(2)] == [False, True], k
  assert np.asarray(state.notfinite_count).tolist() == [0, 1]
  p, state, _ = dp.step(p, state, good)                  # the exchange
  assert int(state.inner_state.syncs) == 1
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(p))
  p, state, _ = dp.step(p, state, good)
  p, state, _ = dp.step(p, state, bad)                   # an exchange step: all skip
  assert int(state.inner_state.syncs) == 1 and int(state.inner_state.count) == 3
  assert np.asarray(state.total_notfinite).tolist() == [1, 2]


@pytest.mark.parametrize("mode", ["local_sgd", "streaming_diloco", "easgd"])
def test_other_sync_modes_keep_local_parameters_sharded(mode):
  mesh = tp_mesh()
  inner = optax.sgd(0.1)
  tx = {"local_sgd": lambda: commopt.local_sgd(inner, axis_name="data", period=2,
                                               compressor=commopt.scaled_sign(), min_size=0),
        "streaming_diloco": lambda: commopt.streaming_diloco(
            inner, axis_name="data", period=2, compressor=commopt.scaled_sign(), min_size=0),
        "easgd": lambda: commopt.transforms.easgd(
            inner, axis_name="data", alpha=0.1, period=2)}[mode]()
  params = placed(mesh, TP)
  dp = commopt.data_parallel(loss_fn, tx, mesh, local_params=True)
  assert dp.layout(params).shard_local
  state, p = dp.init(params), dp.place_params(params)
  losses = []
  for _ in range(4):
    p, state, loss = dp.step(p, state, batch())
    losses.append(float(np.mean(np.asarray(loss))))
  assert losses[-1] < losses[0]
  assert p["w1"].sharding.spec == P("data", None, "model")
  specs = {s for s in jax.tree.leaves(jax.tree.map(lambda x: x.sharding.spec, state))
           if "model" in s}
  assert specs, "no state leaf kept the model sharding"


@pytest.mark.parametrize("strategy", ["two_phase", "hierarchical"])
def test_strategies_chunk_the_local_shard(strategy):
  """two_phase's server memory is this worker's chunk of its shard; hierarchical runs over
  ("node", "local") with the model axis beside them."""
  if strategy == "two_phase":
    mesh, axes = tp_mesh(), "data"
  else:
    mesh, axes = jax.make_mesh((2, 2, 2), ("node", "local", "model")), ("node", "local")
  tx = optax.chain(commopt.compressed_mean(commopt.scaled_sign(), axis_name=axes, min_size=0,
                                           strategy=strategy), optax.sgd(0.1))
  params = placed(mesh, TP)
  dp = commopt.data_parallel(loss_fn, tx, mesh, axis_name=axes)
  assert dp.layout(params).shard_local
  state, p = dp.init(params), params
  first = None
  for _ in range(4):
    p, state, loss = dp.step(p, state, batch())
    first = float(np.mean(np.asarray(loss))) if first is None else first
  assert float(np.mean(np.asarray(loss))) < first
  if strategy == "two_phase":
    server = state.inner_state[0].server_residual["w1"]
    # 16 x 64 values per shard, in 2 chunks: 512 per device.
    assert server.addressable_shards[0].data.shape == (1, 512)
    # Each round packs the model-sharded leaves' shards in one buffer and the replicated
    # bias in another: a device's all-to-all rows carry its shards' payload words exactly.
    from commopt.comm._words import payload_words
    words = lambda n: payload_words(commopt.scaled_sign(), -(-n // 2), jnp.float32)
    audit = commopt.wire.hlo_collectives(dp, p, state, batch())
    rows = {shape[-1] for col in audit if col.kind == "all-to-all" for shape in col.shapes}
    assert rows == {words(16 * 64) + words(64 * 8), words(8)}, audit


def test_top_k_with_the_leaf_threshold_selects_the_whole_leafs_largest():
  """shard_threshold="leaf": one threshold for the leaf, from the shards' candidates; with
  slots for every selected coordinate (capacity = shards) it is the unsharded top-k, where
  each shard's own top-k ("shard") is not when the large entries crowd into one shard."""
  grads = jax.random.normal(jax.random.PRNGKey(8), (2, 16, 256)) * 0.01
  grads = grads.at[:, :, :8].add(jnp.arange(1.0, 129.0).reshape(16, 8))   # model rank 0's
  spec = P(None, "model")
  whole = mean_of(commopt.top_k(ratio=0.02), grads, flat_mesh(), P("data"), P())
  leaf = mean_of(commopt.top_k(ratio=0.02, shard_threshold="leaf", capacity=4), grads,
                 tp_mesh(), P("data", *spec), spec)
  own = mean_of(commopt.top_k(ratio=0.02), grads, tp_mesh(), P("data", *spec), spec)
  np.testing.assert_array_equal(np.asarray(leaf), np.asarray(whole))
  assert np.count_nonzero(np.asarray(whole)[:, 64:]) == 0     # all on model rank 0
  assert np.count_nonzero(np.asarray(own)[:, 64:]) > 0       # each shard sent its own
  with pytest.raises(ValueError, match="shard_threshold='leaf' finds one threshold"):
    commopt.top_k(k=3, shard_threshold="leaf")


# -- the "Sharded models" page -----------------------------------------------------------

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "guide" / "sharded.md"


@pytest.mark.slow
def test_the_sharded_models_page_runs_in_order(capsys):
  blocks = re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), flags=re.S | re.M)
  ns = {}
  for block in blocks:
    exec(compile(block, str(PAGE), "exec"), ns)   # noqa: S102 - the page's own code
  out = capsys.readouterr().out.splitlines()
  assert out[0] == "P('replica', 'fsdp', 'tensor')" and out[2] == out[0]
  assert out[4] == "False" and out[5] == "P('fsdp', 'tensor')"
  start = float(jnp.mean((ns["batch"]["y"]) ** 2))    # about the loss at initialisation
  assert float(out[1]) < 0.5 * start
  assert float(out[3].split()[-1]) < float(out[1])
  assert ns["dl"].layout(ns["params"]).shard_local and ns["dp"].layout(ns["params"]).shard_local


CASES = [(n, {}) for n in sorted(commopt.compressors.REGISTRY)] + [
    (n, v) for n in sorted(commopt.compressors.REGISTRY) for v in commopt.compressors.VARIANTS[n]]


@pytest.mark.slow
@pytest.mark.parametrize("name,options", CASES, ids=[f"{n}{o or ''}" for n, o in CASES])
def test_every_registered_compressor_trains_shard_local(name, options):
  """Every registered compressor and variant: the shard-local step on 2 x 4 runs, its loss
  stays finite, and the bytes over the data axis are at most 0.3 of the whole-leaf step's
  (a payload of fixed size, `k=` or `cols=`, is that size per shard: no more than whole;
  a per-leaf scalar is each shard's)."""
  mesh = tp_mesh()
  tx = sgd_tx(commopt.compressors.make(name, **options))
  sent = {}
  for mode in ("auto", False):
    params = placed(mesh, TP)
    dp = commopt.data_parallel(loss_fn, tx, mesh, shard_local=mode)
    assert dp.layout(params).shard_local == (mode == "auto")
    state = dp.init(params)
    sent[mode] = bytes_over(wire.hlo_collectives(dp, params, state, batch()), data_groups(mesh))
    for _ in range(3):
      params, state, losses = dp.step(params, state, batch())
    assert np.all(np.isfinite(np.asarray(losses))), (name, mode)
  fixed = "k" in options or "cols" in options
  # A per-leaf scalar (a scale, threshold's relative tau) is sent by every shard.
  assert sent["auto"] <= (1.0 if fixed else 0.3) * sent[False] + 4 * len(SHAPES), sent


def test_power_sgd_with_a_callable_view_on_a_sharded_leaf_names_the_leaf():
  mesh = tp_mesh()
  compressor = commopt.power_sgd(rank=1, min_compression_rate=0, view=lambda s: (s[0], s[1]))
  grads = jax.random.normal(jax.random.PRNGKey(9), (2, 32, 64))
  with pytest.raises(ValueError, match=r"leaf \['w'\] \(sharded P\(None, 'model'\)\)"
                                       r".*view='last' or view='first'"):
    mean_of(compressor, grads, mesh, P("data", None, "model"), P(None, "model"),
            spec=P(None, "model"))


@pytest.mark.parametrize("compressor", [commopt.top_k(ratio=0.02), commopt.scaled_sign(),
                                        commopt.compressors.threshold(tau=1.0, capacity=0.05)],
                         ids=lambda c: c.name)
def test_selections_and_per_leaf_scales_work_per_shard(compressor):
  """The documented per-shard semantics: on a leaf sharded by columns, each shard's block of
  the mean is what the compressor gives on that block taken as a leaf of its own."""
  grads = jax.random.normal(jax.random.PRNGKey(10), (2, 16, 256))
  sharded = np.asarray(mean_of(compressor, grads, tp_mesh(), P("data", None, "model"),
                               P(None, "model")))
  for j in range(4):
    block = grads[:, :, 64 * j:64 * (j + 1)]
    alone = mean_of(compressor, block, flat_mesh(), P("data"), P())
    np.testing.assert_array_equal(sharded[:, 64 * j:64 * (j + 1)], np.asarray(alone), err_msg=j)


def test_min_size_judges_the_whole_leaf_not_its_shard():
  """A leaf of 2048 elements, 512 per shard, is compressed under the default min_size (1024),
  as it is on a replicated mesh: the residual is the shard's."""
  mesh = tp_mesh()
  w = jax.device_put(jnp.ones((32, 64)), NamedSharding(mesh, P(None, "model")))
  tx = optax.chain(commopt.compressed_mean(commopt.scaled_sign(), axis_name="data"),
                   optax.sgd(0.1))
  dp = commopt.data_parallel(lambda p, b: jnp.mean((b @ p["w"]) ** 2), tx, mesh)
  residual = dp.init({"w": w}).inner_state[0].residual["w"]
  assert residual.sharding.spec == P("data", None, "model")
  assert residual.addressable_shards[0].data.shape == (1, 32, 16)


def test_a_transform_without_an_axis_keeps_per_worker_values_per_worker():
  """apply_if_finite(axis_name=None) inside a shard_map over "data": a value varying over
  "data" is per worker, not a shard (no model axis is declared), so nothing is agreed."""
  mesh = jax.make_mesh((8,), ("data",))
  tx = commopt.transforms.apply_if_finite(optax.sgd(0.1))

  def f(g):
    s = tx.init(g)
    _, s = tx.update(g, s)
    return s.notfinite_count[None]

  g = jax.device_put(jnp.ones((8, 4)).at[0, 0].set(jnp.nan), NamedSharding(mesh, P("data")))
  fn = jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
  assert "psum" not in str(jax.make_jaxpr(fn)(g))
  np.testing.assert_array_equal(np.asarray(jax.jit(fn)(g)), [1, 0, 0, 0, 0, 0, 0, 0])


@pytest.mark.slow
def test_a_tx_that_cannot_run_on_shards_runs_on_whole_leaves():
  """A mask shaped like whole leaves (1-bit Adam's exp_avg_mask) cannot run on shards: with
  shard_local="auto" the step warns and runs on whole leaves; True raises."""
  mesh = tp_mesh()
  params = placed(mesh, TP)
  mask = {k: jnp.ones(s) for k, s in SHAPES.items()}
  tx = commopt.onebit_adam(1e-2, 2, axis_name="data", min_size=0, exp_avg_mask=mask)
  with pytest.warns(UserWarning, match="does not run on the shards"):
    dp = commopt.data_parallel(loss_fn, tx, mesh)
    assert not dp.layout(params).shard_local
  p, s, losses = dp.step(params, dp.init(params), batch())
  assert np.all(np.isfinite(np.asarray(losses)))
  with pytest.raises(ValueError, match="exp_avg_mask"):
    commopt.data_parallel(loss_fn, tx, mesh, shard_local=True).layout(placed(mesh, TP))


def test_random_arrays_drawn_by_tx_send_it_to_whole_leaves():
  """optax.add_noise draws one array from a key every shard shares: on shards each block
  would get the same noise, so the step runs on whole leaves (with a warning)."""
  mesh = tp_mesh()
  tx = optax.chain(commopt.compressed_mean(commopt.compressors.identity(), axis_name="data"),
                   optax.add_noise(1.0, 0.0, 0), optax.sgd(0.1))
  with pytest.warns(UserWarning, match="random_bits"):
    assert not commopt.data_parallel(loss_fn, tx, mesh).layout(placed(mesh, TP)).shard_local


def test_the_shard_local_step_inside_the_users_jit_and_scan_equals_plain_calls():
  mesh = tp_mesh()
  params = placed(mesh, TP)
  dp = commopt.data_parallel(loss_fn, sgd_tx(commopt.scaled_sign()), mesh, donate=False)
  assert dp.layout(params).shard_local
  state, b = dp.init(params), batch()
  p1, s1 = params, state
  for _ in range(3):
    p1, s1, _ = dp.step(p1, s1, b)

  def body(carry, _):
    p, s, losses = dp.step_fn(*carry, b)
    return (p, s), losses

  (p2, _), losses = jax.jit(lambda p, s: jax.lax.scan(body, (p, s), None, length=3))(params,
                                                                                     state)
  assert losses.shape == (3, 2)
  for k in p1:
    np.testing.assert_array_equal(np.asarray(p2[k]), np.asarray(p1[k]))


@pytest.mark.parametrize("view", ["last", "first"])
def test_power_sgd_shard_local_steps_equal_the_replicated_steps(view):
  """Two data_parallel steps of power_sgd(rank=2) on tensor-parallel shards equal the same
  steps on replicated parameters, to float rounding: each shard's initial Q is its block
  of the whole leaf's Q, drawn from the one seed."""
  mesh = tp_mesh()
  tx = sgd_tx(commopt.power_sgd(rank=2, min_compression_rate=0, view=view))
  out = {}
  for label, specs in (("sharded", TP), ("replicated", {k: P() for k in TP})):
    params = placed(mesh, specs)
    dp = commopt.data_parallel(loss_fn, tx, mesh)
    state = dp.init(params)
    for _ in range(2):
      params, state, _ = dp.step(params, state, batch())
    out[label] = params
  start = raw_params()
  for k in ("w1", "w2"):
    moved = float(jnp.max(jnp.abs(out["replicated"][k] - start[k])))
    assert moved > 1e-4, k
    np.testing.assert_allclose(np.asarray(out["sharded"][k]), np.asarray(out["replicated"][k]),
                               rtol=0, atol=2e-6, err_msg=k)


def test_a_16_bit_exchange_of_replicated_parameters_on_a_tensor_parallel_mesh_compiles():
  """Replicated parameters on an explicit 2 x 4 mesh run in a shard_map manual over every
  axis (shard-local, each shard a whole leaf): cast(bfloat16)'s all-reduce compiles and
  trains (manual over the data axis alone, XLA:CPU aborted the process)."""
  mesh = tp_mesh()
  params = placed(mesh, {k: P() for k in TP})
  dp = commopt.data_parallel(loss_fn, sgd_tx(commopt.cast(jnp.bfloat16)), mesh)
  assert dp.layout(params).shard_local
  state, losses = dp.init(params), []
  for _ in range(4):
    params, state, loss = dp.step(params, state, batch())
    losses.append(loss)
  assert np.all(np.isfinite(np.asarray(losses)))
  assert float(np.mean(losses[-1])) < float(np.mean(losses[0]))


@pytest.mark.parametrize("name", ["identity", "scaled_sign", "top_k", "cast"])
@pytest.mark.parametrize("placement", ["sharded", "replicated"])
def test_comm_plan_of_sharded_parameters_predicts_each_devices_bytes(name, placement):
  """wire.comm_plan on parameters placed on a 2 x 4 mesh plans what the step runs: each
  device's shard (a quarter of the whole leaf), and a quarter of a dense leaf replicated
  over the model axis (the model ranks split its all-reduce); the HLO's data-axis bytes,
  up to the non-finite skip's flag riding in the dense bucket."""
  mesh = tp_mesh()
  params = placed(mesh, TP if placement == "sharded" else {k: P() for k in TP})
  tx = sgd_tx(commopt.compressors.make(name))
  dp = commopt.data_parallel(loss_fn, tx, mesh)
  hlo = bytes_over(wire.hlo_collectives(dp, params, dp.init(params), batch()), data_groups(mesh))
  plan = wire.comm_plan(tx, params, 2)
  planned = sum(c.contributed_bytes for c in plan.collectives)
  assert planned <= hlo <= planned + 4, (planned, hlo)
  if placement == "sharded" or name == "identity":   # compressed replicated leaves: whole
    whole = wire.comm_plan(tx, raw_params(), 2)
    assert planned < 0.3 * sum(c.contributed_bytes for c in whole.collectives)
  with pytest.raises(ValueError, match="workers=4, but the mesh"):
    wire.comm_plan(tx, params, 4)
