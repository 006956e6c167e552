"""Orbax checkpoints of a data_parallel run: save, restore onto an abstract target, continue."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import commopt


def host(tree):
  """Every leaf as numpy, typed PRNG keys as their key data."""
  def one(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    return np.asarray(x)
  return jax.tree.map(one, tree)


@pytest.mark.parametrize("name", ["scaled_sign", "top_k", "power_sgd"])
def test_a_restored_run_continues_bit_identically(name, mesh, tmp_path):
  params = {"w": jnp.ones((64, 48)) * 0.1, "b": jnp.zeros(48)}
  tx = optax.chain(commopt.compressed_mean(commopt.compressors.make(name), "data", min_size=0),
                   optax.sgd(0.1, momentum=0.9))
  dp = commopt.data_parallel(lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2),
                             tx, mesh, donate=False)
  rng = np.random.default_rng(0)
  batches = [{"x": rng.normal(size=(32, 64)).astype(np.float32),
              "y": rng.normal(size=(32, 48)).astype(np.float32)} for _ in range(5)]
  p, s = params, dp.init(params)
  for b in batches[:2]:
    p, s, _ = dp.step(p, s, b)
  path = tmp_path / "step2"
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(path, {"params": p, "opt_state": s})
  # Fresh target: shapes, dtypes and shardings only, nothing computed.
  target = dict(zip(("params", "opt_state"), dp.abstract_state(params)))
  with ocp.StandardCheckpointer() as ckpt:
    restored = ckpt.restore(path, target)
  residual = restored["opt_state"].inner_state[0].residual["w"]
  assert residual.shape[0] == mesh.size and residual.sharding.spec[0] == "data"
  p2, s2 = restored["params"], restored["opt_state"]
  for b in batches[2:]:
    p, s, _ = dp.step(p, s, b)
    p2, s2, _ = dp.step(p2, s2, b)
  jax.tree.map(np.testing.assert_array_equal, host((p2, s2)), host((p, s)))
