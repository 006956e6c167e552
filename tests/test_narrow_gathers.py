"""Narrow floats cross a gather as their own bytes: XLA:CPU widens a bfloat16 all-gather to
float32 (and an 8-bit float one to float16) when it compiles, so commopt's gathers and
all-to-alls move them as unsigned integers of their width, bit for bit."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import commopt
from commopt import wire
from commopt.comm import _collectives as coll
from commopt.testing import assert_same_bits

DTYPES = [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn]


def _values(dtype):
  x = np.random.default_rng(0).normal(size=(8, 6, 5)).astype(np.float32) * 3
  x[0, 0, :3] = [np.nan, -0.0, np.inf] if dtype != jnp.float8_e4m3fn else [np.nan, -0.0, 448]
  return jnp.asarray(x, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_gathers_and_all_to_all_keep_every_bit(mesh, dtype):
  x = jax.device_put(_values(dtype), jax.NamedSharding(mesh, P("data")))

  def body(v):
    v = v[0]                                           # this worker's [6, 5]
    return (coll.all_gather(v, "data")[None], coll.all_gather_tiled(v, "data", 0)[None],
            coll.all_to_all(jnp.stack([v] * 8), "data")[None])   # row w: worker w's v

  gathered, tiled, swapped = jax.jit(jax.shard_map(
      body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))(x)
  want = np.asarray(x)
  gathered, tiled, swapped = (np.asarray(a) for a in (gathered, tiled, swapped))
  for w in range(8):
    assert_same_bits(gathered[w], want)
    assert_same_bits(tiled[w], want.reshape(48, 5))
    assert_same_bits(swapped[w], want)


def test_a_bfloat16_payload_crosses_a_compiled_gather_in_16_bits(mesh):
  tx = commopt.compressed_mean(commopt.cast("bfloat16"), axis_name="data", strategy="gather",
                               min_size=0)
  sm = commopt.testing.shard_map_workers(tx, mesh, "data")
  u = {"w": jax.random.normal(jax.random.key(0), (8, 64, 32))}
  state = sm.init({"w": np.asarray(u["w"])[0]})
  compiled = wire.hlo_collectives(sm.update, u, state, stage="compiled")
  gathers = [c for c in compiled if c.kind == "all-gather"]
  assert gathers and all(c.dtypes == ("u16",) and c.contributed_bytes == 64 * 32 * 2
                         for c in gathers)
  out, _ = sm.update(u, state)
  want = jnp.mean(u["w"].astype(jnp.bfloat16).astype(jnp.float32), 0)
  np.testing.assert_allclose(np.asarray(out["w"])[0], np.asarray(want), rtol=1e-6, atol=1e-6)


def test_a_gather_of_narrow_floats_differentiates(mesh):
  """The tangent moves as the plain collective moves floats: a gradient through it is the
  gradient through ``jax.lax.all_gather``."""
  x = jax.device_put(jnp.linspace(-1, 1, 32, dtype=jnp.float32).reshape(8, 4),
                     jax.NamedSharding(mesh, P("data")))

  def loss(gather, v):
    f = jax.shard_map(lambda r: gather(r.astype(jnp.bfloat16)).astype(jnp.float32)[None],
                      mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False)
    return jnp.sum(jnp.sin(f(v)))

  ours = jax.jit(jax.grad(lambda v: loss(lambda r: coll.all_gather_varying(r, "data"), v)))(x)
  plain = jax.jit(jax.grad(lambda v: loss(lambda r: jax.lax.all_gather(r, "data"), v)))(x)
  assert_same_bits(np.asarray(ours), np.asarray(plain))
