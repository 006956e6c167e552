"""One suite, every registered compressor: the checks of DESIGN's Testing section."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import commopt
from commopt import wire
from commopt.compressors import REGISTRY, make

NAMES = sorted(REGISTRY)
N = 8


def params_like(dtype=jnp.float32):
  # A compressible matrix, a small dense vector, and a None leaf.
  return {"w": jnp.zeros((64, 48), dtype), "b": jnp.zeros((16,), dtype), "frozen": None}


def worker_updates(seed, dtype=jnp.float32, n=N):
  rng = np.random.default_rng(seed)
  return {"w": jnp.asarray(rng.normal(size=(n, 64, 48)), dtype),
          "b": jnp.asarray(rng.normal(size=(n, 16)), dtype), "frozen": None}


def first(tree):
  return jax.tree.map(lambda x: x[0], tree)


def tx_for(name, axis_name=None, **kw):
  return commopt.compressed_mean(make(name), axis_name, min_size=256, **kw)


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((N,), ("data",))


@pytest.mark.parametrize("name", NAMES)
def test_jit_without_retrace(name):
  tx = tx_for(name)
  traces = []

  @jax.jit
  def step(u, s):
    traces.append(1)
    return tx.update(u, s)

  state = tx.init(params_like())
  u = first(worker_updates(0))
  out, state = step(u, state)
  out, state = step(jax.tree.map(lambda x: x + 1.0, u), state)
  assert len(traces) == 1
  assert out["frozen"] is None
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(out))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", NAMES)
def test_dtypes_and_none_leaves(name, dtype):
  tx = tx_for(name)
  state = tx.init(params_like(dtype))
  u = first(worker_updates(1, dtype))
  out, state = jax.jit(tx.update)(u, state)
  assert out["frozen"] is None
  for key in ("w", "b"):
    assert out[key].dtype == dtype and out[key].shape == u[key].shape
    assert bool(jnp.all(jnp.isfinite(out[key].astype(jnp.float32))))
  # The reconstruction points the same way as the input.
  cos = jnp.vdot(out["w"].astype(jnp.float32), u["w"].astype(jnp.float32))
  assert float(cos) > 0


@pytest.mark.parametrize("name", NAMES)
def test_vmap_workers_equal_shard_map_workers(name, mesh):
  tx = tx_for(name, "data")
  vm = commopt.testing.vmap_workers(tx, N, "data")
  sm = commopt.testing.shard_map_workers(tx, mesh, "data")
  params = params_like()
  s_v, s_s = vm.init(params), sm.init(params)
  # A bf16 payload summed by the all-reduce rounds in a backend-specific order
  # (XLA:CPU sums in f32, vmap in bf16): allow a few bf16 ulps there.
  atol = 3e-2 if name == "cast" else 1e-6
  for step in range(3):
    u = worker_updates(10 + step)
    o_v, s_v = vm.update(u, s_v)
    o_s, s_s = sm.update(u, s_s)
    for a, b in zip(jax.tree.leaves((o_v, s_v)), jax.tree.leaves((o_s, s_s))):
      np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                 rtol=1e-5, atol=atol)
  # Every worker receives the same mean.
  o_s = np.asarray(o_s["w"])
  np.testing.assert_allclose(o_s, np.broadcast_to(o_s[0], o_s.shape), rtol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_one_device_shard_map_equals_local(name):
  mesh1 = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
  local = tx_for(name)
  sm = commopt.testing.shard_map_workers(tx_for(name, "data"), mesh1, "data")
  params = params_like()
  s_l, s_s = local.init(params), sm.init(params)
  for step in range(3):
    u = worker_updates(20 + step, n=1)
    o_s, s_s = sm.update(u, s_s)
    o_l, s_l = jax.jit(local.update)(jax.tree.map(lambda x: x[0], u), s_l)
    for a, b in zip(jax.tree.leaves(o_l), jax.tree.leaves(o_s)):
      np.testing.assert_allclose(a, np.asarray(b)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_error_feedback_conservation(name, mesh):
  """Over T steps: sum of outputs + mean final residual = sum of mean inputs."""
  tx = tx_for(name, "data")
  sm = commopt.testing.shard_map_workers(tx, mesh, "data")
  state = sm.init(params_like())
  sum_out = sum_in = 0.0
  for step in range(6):
    u = worker_updates(30 + step)
    out, state = sm.update(u, state)
    sum_out = sum_out + np.asarray(out["w"])[0]
    sum_in = sum_in + np.asarray(u["w"]).mean(0)
  residual = np.asarray(state.residual["w"]).mean(0)
  # Each worker's residual holds what its payload missed; a bf16 all-reduce
  # also rounds the sum itself, which no worker sees, so casts get bf16 slack.
  atol = 6e-2 if name == "cast" else 1e-4
  np.testing.assert_allclose(sum_out + residual, sum_in, rtol=1e-4, atol=atol)


@pytest.mark.parametrize("name", NAMES)
def test_payload_bytes_equal_hlo_audit(name, mesh):
  tx = tx_for(name, "data")
  sm = commopt.testing.shard_map_workers(tx, mesh, "data")
  params = params_like()
  u = worker_updates(40)
  collectives = wire.hlo_collectives(sm.update, u, sm.init(params))
  # XLA:CPU widens 16-bit all-reduces to f32 when it compiles (GPUs keep them);
  # stage="auto" then reads the wire format before that pass.
  if name == "cast" and jax.default_backend() == "cpu":
    compiled = wire.hlo_collectives(sm.update, u, sm.init(params), stage="compiled")
    assert any("f32" in c.dtypes for c in compiled)
    assert any("bf16" in c.dtypes for c in collectives)
  expected = wire.payload_bytes(make(name), params, min_size=256)
  assert wire.total_bytes(collectives) == expected.total
  if name not in ("identity", "cast"):
    assert expected.ratio > 3   # int8 and natural (9 bits) are the least
