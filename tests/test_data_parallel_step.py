"""The data-parallel step in a real training loop: jit, scan, eval_shape, donation,
model state, faults and tensor-parallel layouts."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import commopt

N = 8


def loss_fn(p, b):
  h = jnp.tanh(b["x"] @ p["w1"])
  return jnp.mean((h @ p["w2"] - b["y"]) ** 2)


def make_params(seed=0):
  rng = np.random.default_rng(seed)
  return {"w1": jnp.asarray(rng.normal(size=(16, 64)).astype(np.float32) * 0.3),
          "w2": jnp.asarray(rng.normal(size=(64, 4)).astype(np.float32) * 0.3)}


def make_batches(steps, size=32, seed=1):
  rng = np.random.default_rng(seed)
  return [{"x": rng.normal(size=(size, 16)).astype(np.float32),
           "y": rng.normal(size=(size, 4)).astype(np.float32)} for _ in range(steps)]


def sign_sgd():
  return optax.chain(commopt.compressed_mean(commopt.scaled_sign(), axis_name="data", min_size=0),
                     optax.sgd(0.05, momentum=0.9))


def padded(spec, ndim):
  return tuple(spec) + (None,) * (ndim - len(spec))


def host(x):
  return np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)


def copy(tree):
  return jax.tree.map(jnp.copy, tree)


def test_jit_and_scan_equal_plain_calls_bit_for_bit(mesh):
  dp = commopt.data_parallel(loss_fn, sign_sgd(), mesh)
  params, batches = make_params(), make_batches(10)
  p, s = copy(params), dp.init(params)
  losses = []
  for b in batches:
    p, s, l = dp.step(p, s, b)
    losses.append(np.asarray(l))

  @jax.jit
  def run(p, s, bs):
    def body(carry, b):
      p, s, l = dp.step(*carry, b)
      return (p, s), l
    return jax.lax.scan(body, (p, s), bs)

  stacked = jax.tree.map(lambda *x: np.stack(x), *batches)
  (p2, s2), l2 = run(copy(params), dp.init(params), stacked)
  for a, b in zip(jax.tree.leaves((p, s)), jax.tree.leaves((p2, s2))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.stack(losses), np.asarray(l2))

  # One step inside the user's own jit equals the plain call, and so does fori_loop.
  p3, s3, _ = jax.jit(lambda p, s, b: dp.step(p, s, b))(copy(params), dp.init(params), batches[0])
  p4, s4, _ = dp.step(copy(params), dp.init(params), batches[0])
  np.testing.assert_array_equal(np.asarray(p3["w1"]), np.asarray(p4["w1"]))
  p5, _ = jax.jit(lambda p, s: jax.lax.fori_loop(
      0, 3, lambda i, c: dp.step(*c, batches[0])[:2], (p, s)))(copy(params), dp.init(params))
  p6, s6 = copy(params), dp.init(params)
  for _ in range(3):
    p6, s6, _ = dp.step(p6, s6, batches[0])
  np.testing.assert_array_equal(np.asarray(p5["w2"]), np.asarray(p6["w2"]))


def test_eval_shape_of_init_matches_init(mesh):
  tx = optax.chain(commopt.compressed_mean(commopt.top_k(0.1), axis_name="data"), optax.adam(1e-3))
  dp = commopt.data_parallel(loss_fn, tx, mesh)
  params = make_params()
  abstract = jax.eval_shape(dp.init, params)
  state = dp.init(params)
  assert jax.tree.structure(abstract) == jax.tree.structure(state)
  specs = jax.tree.leaves(dp.state_specs(params), is_leaf=lambda s: isinstance(s, P))
  for a, s, spec in zip(jax.tree.leaves(abstract), jax.tree.leaves(state), specs):
    assert (a.shape, a.dtype) == (s.shape, s.dtype)
    assert padded(a.sharding.spec, s.ndim) == padded(s.sharding.spec, s.ndim) == padded(spec, s.ndim)
    assert a.sharding.mesh.shape_tuple == mesh.shape_tuple
  # The residuals are per worker; Adam's moments (after the reduction) are not.
  per_worker = dp.per_worker(params)
  inner = per_worker.inner_state
  assert inner[0].residual["w1"] and not inner[1][0].mu["w1"]
  assert state.inner_state[0].residual["w1"].shape == (N, 16, 64)


def test_step_donates_params_and_state(mesh):
  params, batch = make_params(), make_batches(1)[0]
  sizes = {}
  for donate in (True, False):
    dp = commopt.data_parallel(loss_fn, sign_sgd(), mesh, donate=donate)
    compiled = dp.lower(params, dp.init(params), batch).compile()
    sizes[donate] = compiled.memory_analysis().alias_size_in_bytes
  assert sizes[True] >= 4 * (16 * 64 + 64 * 4) and sizes[False] == 0
  dp = commopt.data_parallel(loss_fn, sign_sgd(), mesh)
  p, s = dp.place_params(copy(params)), dp.init(params)
  dp.step(p, s, batch)
  assert p["w1"].is_deleted() and jax.tree.leaves(s)[-1].is_deleted()


def test_placing_copies_so_the_callers_arrays_survive_donation(mesh):
  # Arrays on one device are copied, not aliased, when placed: the step
  # donates the placed ones, and the caller's must still be there for a
  # second run from the same start.
  params, batch = jax.device_put(make_params(), jax.devices()[0]), make_batches(1)[0]
  dp = commopt.data_parallel(loss_fn, sign_sgd(), mesh)
  for _ in range(2):
    p = dp.place_params(params)
    p, _, _ = dp.step(p, dp.init(params), batch)
  assert not params["w1"].is_deleted()
  np.testing.assert_array_equal(np.asarray(params["w1"]), np.asarray(make_params()["w1"]))


def test_init_does_not_invalidate_earlier_states(mesh):
  dp = commopt.data_parallel(loss_fn, sign_sgd(), mesh)
  small, big = make_params(), {"w1": jnp.zeros((16, 128)), "w2": jnp.zeros((128, 4))}
  first = dp.init(small)
  dp.init(big)
  params, state, losses = dp.step(copy(small), first, make_batches(1)[0])
  assert np.isfinite(np.asarray(losses)).all()


def test_has_aux_and_per_worker_keys(mesh):
  def loss_aux(p, b, key):
    noise = jax.random.uniform(key, ())
    return loss_fn(p, b), {"noise": noise, "first": b["x"][0, 0]}

  dp = commopt.data_parallel(loss_aux, sign_sgd(), mesh, has_aux=True)
  params, batch = make_params(), make_batches(1)[0]
  p, s, (losses, aux) = dp.step(copy(params), dp.init(params), batch, key=jax.random.key(0))
  assert losses.shape == (N,) and aux["noise"].shape == (N,)
  assert len(set(np.asarray(aux["noise"]).tolist())) == N            # a key per worker
  np.testing.assert_array_equal(np.asarray(aux["first"]), batch["x"][::32 // N, 0])


def test_nan_in_one_worker_skips_the_step_everywhere(mesh):
  dp = commopt.data_parallel(loss_fn, sign_sgd(), mesh)
  params, batches = make_params(), make_batches(4)
  p, s = copy(params), dp.init(params)
  p, s, _ = dp.step(p, s, batches[0])
  before = [np.asarray(x) for x in jax.tree.leaves((p, s))]
  bad = dict(batches[1], x=batches[1]["x"].copy())
  bad["x"][3 * 32 // N + 1, 5] = np.nan                                   # worker 3 only
  p, s, losses = dp.step(p, s, bad)
  losses = np.asarray(losses)
  assert np.isnan(losses[3]) and np.isfinite(np.delete(losses, 3)).all()
  after = [np.asarray(x) for x in jax.tree.leaves((p, s.inner_state))]
  before_inner = before[:2] + before[2 + 3:]                              # drop the counters
  for a, b in zip(after, before_inner):
    np.testing.assert_array_equal(a, b)
  assert int(s.total_notfinite) == 1 and not bool(s.last_finite)
  for b in batches[2:]:
    p, s, losses = dp.step(p, s, b)
  assert np.isfinite(np.asarray(losses)).all() and int(s.total_notfinite) == 1
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(p))


class BNNet(nnx.Module):
  def __init__(self, rngs):
    self.bn = nnx.BatchNorm(16, momentum=0.5, rngs=rngs)
    self.lin = nnx.Linear(16, 4, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x):
    return self.lin(self.drop(self.bn(x)))


def nnx_loss(model, b):
  mask = model.drop(jnp.ones((16,)))
  return jnp.mean((model(b["x"]) - b["y"]) ** 2), {"mask": mask}


def nnx_trainer(mesh, seed, compressor):
  """A ``BNNet`` and its trainer: ``compressor`` on every leaf, then SGD."""
  model = BNNet(nnx.Rngs(seed))
  tx = optax.chain(commopt.compressed_mean(compressor, axis_name="data", min_size=0), optax.sgd(0.05))
  return model, commopt.nnx_data_parallel(model, nnx_loss, tx, mesh, has_aux=True)


def test_nnx_batch_norm_and_dropout(mesh):
  model, trainer = nnx_trainer(mesh, 0, commopt.scaled_sign())
  state = trainer.init(model)
  batches = make_batches(3, seed=4)
  masks = []
  for i, b in enumerate(batches):
    old = np.asarray(state.model_state["bn"]["mean"][...])
    state, (losses, aux) = trainer.step(state, b)
    masks.append(np.asarray(aux["mask"]))
    new = np.asarray(state.model_state["bn"]["mean"][...])
    # Averaged across workers: the running mean moves towards the global batch mean.
    np.testing.assert_allclose(new, 0.5 * old + 0.5 * b["x"].mean(0), rtol=1e-5, atol=1e-6)
    assert losses.shape == (N,) and aux["mask"].shape == (N, 16)
  masks = np.stack(masks)                                                 # [step, worker, 16]
  assert all(not np.array_equal(masks[0, 0], masks[0, w]) for w in range(1, N))
  assert not np.array_equal(masks[0, 0], masks[1, 0])
  # The stored keys stay replicated; the merged model evaluates.
  trained = trainer.merge(state)
  trained.eval()
  assert trained(batches[0]["x"]).shape == (32, 4)


def test_nnx_nan_step_keeps_model_state(mesh):
  model, trainer = nnx_trainer(mesh, 1, commopt.compressors.identity())
  state = trainer.init(model)
  b = make_batches(1)[0]
  state, _ = trainer.step(state, b)
  before = [host(x) for x in jax.tree.leaves((state.params, state.model_state))]
  bad = dict(b, y=b["y"].copy())
  bad["y"][0, 0] = np.inf
  state, _ = trainer.step(state, bad)
  for a, c in zip(jax.tree.leaves((state.params, state.model_state)), before):
    np.testing.assert_array_equal(host(a), c)
  assert int(state.opt_state.total_notfinite) == 1


TP_SPECS = {"w1": P(None, "model"), "w2": P("model", None)}


def tp_loss(p, b):
  """``loss_fn`` written for tensor-parallel parameters (its contraction's output spec named)."""
  h = jnp.tanh(b["x"] @ p["w1"])
  return jnp.mean((jnp.matmul(h, p["w2"], out_sharding=P()) - b["y"]) ** 2)


def tp_mesh_and_params():
  """A 4 data x 2 model mesh and ``make_params()`` placed on it by ``TP_SPECS``."""
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  return mesh, {k: jax.device_put(v, NamedSharding(mesh, TP_SPECS[k]))
                for k, v in make_params().items()}


@pytest.mark.slow
def test_tensor_parallel_layout_is_kept_and_equals_replicated():
  mesh, p = tp_mesh_and_params()
  params = make_params()
  tx = sign_sgd()
  # Whole leaves (shard_local=False): one scale per leaf, as on the replicated mesh.
  # The shard-local step (one scale per shard) is tests/test_sharded.py's.
  dp = commopt.data_parallel(tp_loss, tx, mesh, shard_local=False)
  s = dp.init(p)
  residual = s.inner_state[0].residual
  assert residual["w1"].sharding.spec == P("data", None, "model")
  assert s.inner_state[1][0].trace["w2"].sharding.spec == P("model", None)
  batches = make_batches(3)
  for b in batches:
    p, s, _ = dp.step(p, s, b)
  assert {k: v.sharding.spec for k, v in p.items()} == TP_SPECS
  assert s.inner_state[0].residual["w1"].sharding.spec == P("data", None, "model")

  flat = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  dp1 = commopt.data_parallel(loss_fn, tx, flat)
  p1, s1 = copy(params), dp1.init(params)
  for b in batches:
    p1, s1, _ = dp1.step(p1, s1, b)
  for k in params:
    np.testing.assert_allclose(np.asarray(p[k]), np.asarray(p1[k]), rtol=1e-5, atol=1e-6)


def test_tensor_parallel_data_axis_carries_only_payloads():
  """Across the data axis only packed payloads (and the skip flag) move; the dense
  gathers that give the optimizer whole leaves stay inside each model group."""
  mesh, params = tp_mesh_and_params()
  compressor = commopt.scaled_sign()
  tx = optax.chain(commopt.compressed_mean(compressor, axis_name="data", min_size=0), optax.sgd(0.1))
  dp = commopt.data_parallel(tp_loss, tx, mesh, shard_local=False)
  audit = commopt.wire.hlo_collectives(dp, params, dp.init(params), make_batches(1)[0])
  data_groups = {(0, 2, 4, 6), (1, 3, 5, 7)}
  across_data = [c for c in audit if set(c.replica_groups) == data_groups]
  inside_model = [c for c in audit if c.group_size == 2]
  assert len(across_data) + len(inside_model) == len(audit)
  payload = commopt.wire.payload_bytes(compressor, make_params(), min_size=0).total
  assert commopt.wire.total_bytes(across_data) == payload + 4


def test_recorded_collectives_count_each_worker_once_on_a_2d_mesh():
  """On 4 data x 2 model (and 2 x 4) each device records its own collectives once: over
  the data axis, the payload and the skip flag (on whole leaves, every model rank sends
  the whole leaf's payload); the dense gathers inside the model group are over "model"."""
  compressor = commopt.scaled_sign()
  payload = commopt.wire.payload_bytes(compressor, make_params(), min_size=0).total
  for shape in ((4, 2), (2, 4)):
    mesh = jax.make_mesh(shape, ("data", "model"))
    params = {k: jax.device_put(v, NamedSharding(mesh, TP_SPECS[k]))
              for k, v in make_params().items()}
    with commopt.wire.record_collectives() as rec:
      tx = optax.chain(commopt.compressed_mean(compressor, axis_name="data", min_size=0), optax.sgd(0.1))
      dp = commopt.data_parallel(tp_loss, tx, mesh, shard_local=False)
      jax.block_until_ready(dp.step(params, dp.init(params), make_batches(1)[0]))
    assert len({e.index for e in rec.events}) == 8
    for device in range(8):
      assert sum(b for _, b in rec.of_worker(device, "data")) == payload + 4, (shape, device)
      assert {e.axis for e in rec.events if e.index == device} == {"data", "model"}


def test_unsupported_layouts_are_refused():
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  dp = commopt.data_parallel(loss_fn, sign_sgd(), mesh)
  fsdp = {k: jax.device_put(v, NamedSharding(mesh, P("data"))) for k, v in make_params().items()}
  with pytest.raises(ValueError, match="sharded over the data axis"):
    dp.init(fsdp)
  auto = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  dp = commopt.data_parallel(loss_fn, sign_sgd(), auto)
  tp = {k: jax.device_put(v, NamedSharding(auto, P(None, "model")))
        for k, v in make_params().items()}
  with pytest.raises(ValueError, match="not all explicit"):
    dp.init(tp)


def test_model_state_arguments(mesh):
  dp = commopt.data_parallel(loss_fn, sign_sgd(), mesh)
  params = make_params()
  with pytest.raises(ValueError, match="has_state=False"):
    dp.step(copy(params), dp.init(params), make_batches(1)[0], model_state={"a": jnp.ones(2)})
  with pytest.raises(ValueError, match="model_state_sync"):
    commopt.data_parallel(loss_fn, sign_sgd(), mesh, model_state_sync="sum")
  dp = commopt.data_parallel(loss_fn, sign_sgd(), mesh, has_aux=True)
  with pytest.raises(ValueError, match=r"has_aux=True, `loss_fn` must return \(loss, aux\)"):
    dp.step(copy(params), dp.init(params), make_batches(1)[0])
  with pytest.raises(ValueError, match="`donate` must be True or False"):
    commopt.data_parallel(loss_fn, sign_sgd(), mesh, donate="yes")


@pytest.mark.slow
def test_tensor_parallel_keys_and_nnx_state_match_the_flat_mesh():
  mesh, tp = tp_mesh_and_params()
  flat = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])

  def loss_key(p, b, key):
    return tp_loss(p, b), jax.random.uniform(key, ())

  noise = {}
  for name, m, p in (("tp", mesh, tp), ("flat", flat, make_params())):
    dp = commopt.data_parallel(loss_key, sign_sgd(), m, has_aux=True)
    _, _, (_, noise[name]) = dp.step(copy(p), dp.init(p), make_batches(1)[0],
                                     key=jax.random.key(3))
  np.testing.assert_array_equal(np.asarray(noise["tp"]), np.asarray(noise["flat"]))

  # An nnx model (integer RNG counts, batch statistics) on the 2-D mesh.
  model, trainer = nnx_trainer(mesh, 0, commopt.scaled_sign())
  state = trainer.init(model)
  b = make_batches(1, seed=4)[0]
  state, (losses, aux) = trainer.step(state, b)
  np.testing.assert_allclose(np.asarray(state.model_state["bn"]["mean"][...]),
                             0.5 * b["x"].mean(0), rtol=1e-5, atol=1e-6)
  masks = np.asarray(aux["mask"])
  assert not np.array_equal(masks[0], masks[1])


def test_replicated_params_on_a_2d_auto_mesh():
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  dp = commopt.data_parallel(loss_fn, sign_sgd(), mesh)
  params = make_params()
  p, s, losses = dp.step(copy(params), dp.init(params), make_batches(1)[0])
  assert losses.shape == (4,) and np.isfinite(np.asarray(losses)).all()


def test_state_for_another_number_of_workers_is_refused(mesh):
  params = make_params()
  state8 = commopt.data_parallel(loss_fn, sign_sgd(), mesh).init(params)
  four = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  dp4 = commopt.data_parallel(loss_fn, sign_sgd(), four)
  with pytest.raises(ValueError, match="must lead with the 4 workers"):
    dp4.step(copy(params), jax.device_get(state8), make_batches(1)[0])


def test_nnx_merge_and_update_model_survive_the_next_step(mesh):
  model, trainer = nnx_trainer(mesh, 2, commopt.compressors.identity())
  state = trainer.init(model)
  b = make_batches(1)[0]
  state, _ = trainer.step(state, b)
  trainer.update_model(model, state)
  evaluated = trainer.merge(state)
  state, _ = trainer.step(state, b)
  model.eval()
  evaluated.eval()
  assert np.isfinite(np.asarray(model(b["x"]))).all()
  assert np.isfinite(np.asarray(evaluated(b["x"]))).all()


@pytest.mark.parametrize("skip", [True, "zero"])
def test_nonfinite_model_state_alone_skips_the_step(mesh, skip):
  def loss_state(p, ms, b):
    stat = jnp.mean(b["y"])                       # reaches the state, not the gradient
    return loss_fn(p, {"x": b["x"], "y": jnp.nan_to_num(b["y"])}), {"stat": ms["stat"] + stat}

  dp = commopt.data_parallel(loss_state, sign_sgd(), mesh, has_state=True, skip_nonfinite=skip)
  params, b = make_params(), make_batches(1)[0]
  p, s = copy(params), dp.init(params)
  ms = {"stat": jnp.zeros(())}
  bad = dict(b, y=b["y"].copy())
  bad["y"][0, 0] = np.nan
  p2, s2, ms2, _ = dp.step(copy(params), s, bad, ms)
  assert int(s2.total_notfinite) == 1 and float(ms2["stat"]) == 0.0
  np.testing.assert_array_equal(np.asarray(p2["w1"]), np.asarray(params["w1"]))


def test_placement_checks_run_once_per_argument_signature(mesh, monkeypatch):
  # Every step after the first is fed the previous step's outputs, placed as the step
  # places them: the placement checks are skipped. An argument that changes type,
  # shape or placement is checked (and refused where wrong) as on the first call.
  from commopt.parallel._placement import Placer
  dp = commopt.data_parallel(loss_fn, sign_sgd(), mesh)
  params = make_params()
  state = dp.init(params)
  batches = make_batches(4)
  params, state, _ = dp.step(params, state, batches[0])   # numpy batch: placed each call
  batch = dp.place_batch(batches[1])
  params, state, _ = dp.step(params, state, batch)
  calls = []
  real = Placer.checked_layout
  monkeypatch.setattr(Placer, "checked_layout", lambda *a: calls.append(1) or real(*a))
  for _ in range(3):
    params, state, _ = dp.step(params, state, batch)
  assert calls == []
  params, state, _ = dp.step(params, state, batches[2])   # host arrays: a new signature
  assert calls == [1]
  params, state, _ = dp.step(params, state, batches[3])   # again: placed by its plan
  assert calls == [1]
  wrong = jax.tree.map(lambda x: x[:4] if x.ndim and x.shape[0] == N else x,
                       jax.device_get(state))
  with pytest.raises(ValueError, match="per-worker"):
    dp.step(params, wrong, batch)


@pytest.mark.parametrize("where", ["one device", "host"])
def test_an_unplaced_batch_is_placed_by_the_remembered_plan(mesh, monkeypatch, where):
  """A batch handed over unplaced every step, as one device's arrays or as numpy arrays (as a
  user's data loader does), is checked once; later steps place it by the plan the first call
  made, without copying it (the step does not donate the batch: the caller's arrays stay
  usable), and train exactly as the same batch placed beforehand."""
  from commopt.parallel._placement import Placer
  dp = commopt.data_parallel(loss_fn, sign_sgd(), mesh)
  params = make_params()
  batches = make_batches(6)
  if where == "one device":
    batches = [jax.tree.map(jnp.asarray, b) for b in batches]
  calls = []
  real = Placer.checked_layout
  monkeypatch.setattr(Placer, "checked_layout", lambda *a: calls.append(1) or real(*a))
  p, s = params, dp.init(params)
  checked = []
  for b in batches:
    before = len(calls)
    p, s, _ = dp.step(p, s, b)
    checked.append(len(calls) - before)
  # The first steps meet new signatures (the caller's parameters, then the step's own
  # outputs); from then on every step is placed by the plan, unchecked.
  assert checked[0] > 0 and checked[2:] == [0, 0, 0, 0], checked
  if where == "one device":
    assert all(not x.is_deleted() for b in batches for x in jax.tree.leaves(b))
  monkeypatch.setattr(Placer, "checked_layout", real)
  dp2 = commopt.data_parallel(loss_fn, sign_sgd(), mesh)
  q, t = make_params(), dp2.init(make_params())
  for b in batches:
    q, t, _ = dp2.step(q, t, dp2.place_batch(b))
  jax.tree.map(lambda a, c: np.testing.assert_array_equal(np.asarray(a), np.asarray(c)), p, q)
