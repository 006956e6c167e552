"""The 8-device data-parallel step of an MLP, audited from its compiled HLO."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import commopt
from commopt import wire
from commopt.compressors import REGISTRY, make

N = 8


def mlp_params(key=0):
  k1, k2 = jax.random.split(jax.random.PRNGKey(key))
  return {"w1": jax.random.normal(k1, (1024, 512)) * 0.03, "b1": jnp.zeros(512),
          "w2": jax.random.normal(k2, (512, 10)) * 0.05, "b2": jnp.zeros(10)}


def loss_fn(p, batch):
  h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
  logits = h @ p["w2"] + p["b2"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def make_batch(seed=0, size=64):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(size, 1024)).astype(np.float32)
  return {"x": x, "y": (x[:, :10].argmax(1)).astype(np.int32)}


@functools.cache
def audit(name):
  """The step's collectives and the analytic payload of one compressor, compiled once
  per process and only for the compressors the tests that run here ask for."""
  params = mlp_params()
  tx = optax.chain(commopt.compressed_mean(make(name), axis_name="data"), optax.sgd(0.1))
  # The compressor's collectives alone (the non-finite skip adds one int32 flag).
  dp = commopt.data_parallel(loss_fn, tx, jax.make_mesh((N,), ("data",)), skip_nonfinite=False)
  state = dp.init(params)
  return (wire.hlo_collectives(dp, params, state, make_batch()),
          wire.payload_bytes(make(name), params))


# One compressor of each protocol in the default tier (dense, casts, signs, sparse values and
# indices, quantizers, low rank, a summed sketch); every other one compiles in the slow tier.
AUDITED = {"identity", "cast", "scaled_sign", "top_k", "qsgd", "power_sgd", "count_sketch"}


@pytest.mark.parametrize("name", [n if n in AUDITED else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(REGISTRY)])
def test_audited_bytes_equal_payload_bytes(name):
  collectives, report = audit(name)
  assert wire.total_bytes(collectives) == report.total
  assert all(c.group_size == N for c in collectives)


@pytest.mark.parametrize("name", ["scaled_sign", "top_k", "power_sgd"])
def test_no_dense_gradient_all_reduce(name):
  collectives, _ = audit(name)
  weight_sizes = {1024 * 512, 512 * 10}
  for c in collectives:
    if c.kind != "all-reduce":
      continue
    for dtype, shape in zip(c.dtypes, c.shapes):
      assert not (dtype.startswith(("f", "bf")) and int(np.prod(shape)) in weight_sizes), c.line


@pytest.mark.parametrize("min_size", [None, 0])
def test_nonfinite_skip_adds_one_flag_of_four_bytes(mesh, min_size):
  # Small leaves sent dense (the default min_size): the flag is one more float32 element
  # of their all-reduce. Every leaf compressed (min_size=0): an int32 all-reduce of its own.
  kw = {} if min_size is None else {"min_size": min_size}
  tx = optax.chain(commopt.compressed_mean(make("scaled_sign"), axis_name="data", **kw),
                   optax.sgd(0.1))
  params, batch = mlp_params(), make_batch()
  audits = {}
  for skip in (False, True):
    dp = commopt.data_parallel(loss_fn, tx, mesh, skip_nonfinite=skip)
    audits[skip] = wire.hlo_collectives(dp, params, dp.init(params), batch)
  assert wire.total_bytes(audits[True]) == wire.total_bytes(audits[False]) + 4
  flags = [c for c in audits[True] if "s32" in c.dtypes and c.kind == "all-reduce"]
  assert len(audits[True]) == len(audits[False]) + (min_size == 0)
  assert len(flags) == (min_size == 0) and all(c.group_size == N for c in flags)


def test_identity_is_the_dense_baseline():
  collectives, report = audit("identity")
  assert report.ratio == 1.0
  assert any(c.kind == "all-reduce" and (1024, 512) in c.shapes for c in collectives)


def test_compression_ratios():
  assert audit("scaled_sign")[1].ratio >= 30
  assert audit("top_k")[1].ratio >= 45
  # PowerSGD: every weight's P in one all-reduce (w1's [1024, 2] and w2's [512, 2] end to
  # end), every Q in another (w1's [512, 2] and w2's [10, 2]).
  collectives, report = audit("power_sgd")
  assert report.per_leaf["w1"] * 150 <= 1024 * 512 * 4
  shapes = [s for c in collectives for s in c.shapes]
  assert ((1024 + 512) * 2,) in shapes and ((512 + 10) * 2,) in shapes


@pytest.mark.slow
def test_training_reduces_loss_and_keeps_replicas_equal(mesh):
  tx = optax.chain(commopt.compressed_mean(commopt.scaled_sign(), axis_name="data"), optax.sgd(0.05))
  dp = commopt.data_parallel(loss_fn, tx, mesh)
  params = mlp_params()
  state = dp.init(params)
  batch = make_batch(1)
  first = None
  for _ in range(15):
    params, state, losses = dp.step(params, state, batch)
    first = float(np.mean(losses)) if first is None else first
  assert losses.shape == (N,)
  assert float(np.mean(losses)) < 0.8 * first
  # Residuals are per worker (stacked, sharded); parameters are replicated.
  residual = state.inner_state[0].residual["w1"]
  assert residual.shape == (N, 1024, 512)
  assert params["w1"].sharding.is_fully_replicated
  shards = [np.asarray(s.data) for s in params["w1"].addressable_shards]
  for s in shards[1:]:
    np.testing.assert_array_equal(s, shards[0])


@pytest.mark.slow
def test_equals_simulated_workers(mesh):
  """data_parallel's step equals hand-computed per-worker gradients through vmap workers."""
  tx = optax.chain(commopt.compressed_mean(commopt.top_k(0.05), axis_name="data"), optax.sgd(0.1))
  dp = commopt.data_parallel(loss_fn, tx, mesh)
  params = mlp_params(3)
  batch = make_batch(2, size=16)
  new_params, _, _ = dp.step(jax.tree.map(jnp.copy, params), dp.init(params), batch)
  shards = jax.tree.map(lambda x: x.reshape(N, -1, *x.shape[1:]), batch)
  grads = jax.vmap(jax.grad(loss_fn), in_axes=(None, 0))(params, shards)
  workers = commopt.testing.vmap_workers(tx, N, "data")
  updates, _ = workers.update(grads, workers.init(params))
  expected = optax.apply_updates(params, jax.tree.map(lambda u: u[0], updates))
  for a, b in zip(jax.tree.leaves(new_params), jax.tree.leaves(expected)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_momentum_before_the_reduction_is_per_worker(mesh):
  tx = optax.chain(optax.trace(0.9), commopt.compressed_mean(commopt.scaled_sign(), axis_name="data"),
                   optax.scale(-0.01))
  dp = commopt.data_parallel(loss_fn, tx, mesh)
  dp.init(mlp_params())
  # trace's momentum and the residuals vary per worker; counters and keys do not.
  assert sum(jax.tree.leaves(dp.per_worker(mlp_params()))) == 4 + 2


def test_transform_without_reduction_is_rejected(mesh):
  dp = commopt.data_parallel(loss_fn, optax.sgd(0.1), mesh)
  params = mlp_params()
  state = dp.init(params)
  with pytest.raises(ValueError, match="differs between workers"):
    dp.step(params, state, make_batch())


def test_bad_mesh_and_batch(mesh):
  tx = optax.chain(commopt.compressed_mean(commopt.scaled_sign(), axis_name="data"), optax.sgd(0.1))
  with pytest.raises(ValueError, match=r"\['model'\] is not among them"):
    commopt.data_parallel(loss_fn, tx, mesh, axis_name="model")
  dp = commopt.data_parallel(loss_fn, tx, mesh)
  params = mlp_params()
  state = dp.init(params)
  with pytest.raises(ValueError, match="divisible by the 8 workers"):
    dp.step(params, state, make_batch(size=12))


@pytest.mark.parametrize("line, kind, contributed, sent", [
    ("%a = f32[1024]{0} all-reduce(%x), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%r",
     "all-reduce", 4096, 7168),
    ("%a = (f32[1024]{0}, f32[8,1024]{1,0}) all-gather-start(%x), replica_groups=[1,8]<=[8], dimensions={0}",
     "all-gather", 4096, 28672),
    ("%a = ((f32[1024]{0}), f32[128]{0}) reduce-scatter-start(%x), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}",
     "reduce-scatter", 4096, 3584),
    ("%a = (f32[1024]{0}, f32[1024]{0}, u32[], u32[]) collective-permute-start(%x), source_target_pairs={{0,1},{1,0}}",
     "collective-permute", 4096, 4096),
    ("%a = (s4[64]{0}, f8e4m3fn[32]{0}) all-reduce(%x, %y), replica_groups=[2,4]<=[4,2]T(1,0), to_apply=%r",
     "all-reduce", 64, 96),
])
def test_hlo_parser_forms(line, kind, contributed, sent):
  (c,) = wire.parse_hlo(line, num_devices=8)
  assert (c.kind, c.contributed_bytes, c.sent_bytes) == (kind, contributed, sent)


@pytest.mark.parametrize("groups, expected", [
    ("mesh['data'=4,'model'=2] {'model'}", ((0, 1), (2, 3), (4, 5), (6, 7))),
    ("mesh['data'=4,'model'=2] {'data'}", ((0, 2, 4, 6), (1, 3, 5, 7))),
    ("mesh['node'=2,'local'=4] {'node','local'}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
    ("mesh['axis_0'=1,'axis_1'=2,'axis_2'=4], device_ids=([4,2]T(1,0)) {'axis_1'}",
     ((0, 1), (2, 3), (4, 5), (6, 7))),
])
def test_hlo_parser_mesh_axis_groups(groups, expected):
  """Newer XLA names the mesh axes a collective runs over instead of listing groups."""
  (c,) = wire.parse_hlo(f"%a = f32[8]{{0}} all-gather(%x), replica_groups={groups}, "
                        "dimensions={0}", num_devices=8)
  assert c.replica_groups == expected and c.group_size == len(expected[0])


def test_hlo_parser_iota_groups():
  (c,) = wire.parse_hlo("%a = f32[4]{0} all-reduce(%x), replica_groups=[2,4]<=[4,2]T(1,0), to_apply=%r",
                        num_devices=8)
  assert c.replica_groups == ((0, 2, 4, 6), (1, 3, 5, 7)) and c.group_size == 4
