"""Model state under zero_data_parallel (has_state): batch statistics averaged over the
workers as data_parallel averages them, kept on a skipped step, and a Flax nnx model whose
BatchNorm statistics change in training."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import commopt

IDENTITY = commopt.compressors.make("identity")


def make_params(seed=0, hidden=37):
  rng = np.random.default_rng(seed)
  return {"w1": jnp.asarray(rng.normal(size=(13, hidden)).astype(np.float32) * 0.3),
          "w2": jnp.asarray(rng.normal(size=(hidden, 5)).astype(np.float32) * 0.3)}


def make_batch(seed, size=64):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(size, 13)).astype(np.float32) * (1 + np.arange(13, dtype=np.float32))
  return {"x": x, "y": np.tanh(x[:, :5] / 4).astype(np.float32)}


def start_state():
  return {"mean": jnp.zeros((37,), jnp.float32), "var": jnp.ones((37,), jnp.float32),
          "seen": jnp.zeros((), jnp.int32)}


def bn_loss(p, ms, b):
  """A batch-normalised hidden layer whose running statistics are the model state (each
  worker's own batch statistics: they differ between workers until averaged)."""
  h = b["x"] @ p["w1"]
  mean, var = jnp.mean(h, 0), jnp.var(h, 0)
  new = {"mean": 0.9 * ms["mean"] + 0.1 * mean, "var": 0.9 * ms["var"] + 0.1 * var,
         "seen": ms["seen"] + 1}
  out = jnp.tanh((h - mean) / jnp.sqrt(var + 1e-5)) @ p["w2"]
  return jnp.mean((out - b["y"]) ** 2), new


def manual_bn_loss(p, ms, b, gather):
  return bn_loss(gather(p), ms, b)


def _close(a, b, **kw):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), **kw),
               a, b)


@pytest.mark.parametrize("gather", ["step", "manual"])
def test_model_state_is_averaged_as_data_parallel_averages_it(mesh, gather):
  """Dense ZeRO-3 with model state trains as data_parallel's replicated step with
  has_state=True: the same parameters, losses and running statistics (the workers' mean),
  to the rounding of a different summation order."""
  loss = bn_loss if gather == "step" else manual_bn_loss
  zp = commopt.zero_data_parallel(loss, optax.adam(1e-2), mesh, has_state=True, gather=gather)
  dp = commopt.data_parallel(
      bn_loss, optax.chain(commopt.compressed_mean(IDENTITY, axis_name="data"),
                           optax.adam(1e-2)), mesh, has_state=True)
  sharded = zp.shard(make_params())
  zstate, zms = zp.init(sharded), start_state()
  params = make_params()
  dstate, dms = dp.init(params), start_state()
  for i in range(5):
    sharded, zstate, zms, zl = zp.step(sharded, zstate, make_batch(i), zms)
    params, dstate, dms, dl = dp.step(params, dstate, make_batch(i), dms)
    np.testing.assert_allclose(np.asarray(zl), np.asarray(dl), rtol=1e-5)
  _close(zp.unshard(sharded), params, rtol=2e-5, atol=2e-6)
  _close(zms, dms, rtol=1e-5, atol=1e-6)
  assert int(zms["seen"]) == 5
  # The average of the workers' own statistics, not one worker's: worker 0's would differ.
  h = make_batch(4)["x"][:8] @ np.asarray(zp.unshard(sharded)["w1"])
  assert not np.allclose(np.asarray(zms["mean"]), 0.9 * np.asarray(dms["mean"]) + 0.1 * h.mean(0))
  assert zms["mean"].sharding.is_fully_replicated


def test_a_nonfinite_model_state_skips_the_step_and_keeps_it(mesh):
  """A worker whose new statistics are not finite skips the step on every device:
  parameters, optimizer state and model state kept, the skip counted."""
  zp = commopt.zero_data_parallel(bn_loss, optax.adam(1e-2), mesh, has_state=True)
  sharded = zp.shard(make_params())
  state, ms = zp.init(sharded), start_state()
  sharded, state, ms, _ = zp.step(sharded, state, make_batch(0), ms)
  before = jax.device_get((zp.unshard((sharded, state)), ms))
  bad = make_batch(1)
  bad["x"][3, 0] = 1e30                        # worker 0: h finite, its variance overflows
  sharded, state, ms, losses = zp.step(sharded, state, bad, ms)
  after = jax.device_get((zp.unshard((sharded, state)), ms))
  kept = lambda t: (t[0][0], t[0][1].inner_state, t[1])     # params, adam's state, model state
  jax.tree.map(np.testing.assert_array_equal, kept(after), kept(before))
  assert int(state.total_notfinite) == 1
  sharded, state, ms, _ = zp.step(sharded, state, make_batch(2), ms)
  assert int(state.total_notfinite) == 1 and int(ms["seen"]) == 2
  assert np.all(np.isfinite(np.asarray(ms["var"])))


def test_model_state_arguments_name_themselves(mesh):
  zp = commopt.zero_data_parallel(bn_loss, optax.sgd(0.1), mesh, has_state=True)
  sharded = zp.shard(make_params())
  state = zp.init(sharded)
  with pytest.raises(ValueError, match="has_state=True needs `model_state`"):
    zp.step(sharded, state, make_batch(0))
  plain = commopt.zero_data_parallel(lambda p, b: bn_loss(p, start_state(), b)[0],
                                     optax.sgd(0.1), mesh)
  with pytest.raises(ValueError, match="`model_state` was given but has_state=False"):
    plain.step(plain.shard(make_params()), plain.init(plain.shard(make_params())),
               make_batch(0), start_state())
  with pytest.raises(ValueError, match="model_state_sync"):
    commopt.zero_data_parallel(bn_loss, optax.sgd(0.1), mesh, has_state=True,
                               model_state_sync="median")
  strict = commopt.zero_data_parallel(bn_loss, optax.sgd(0.1), mesh, has_state=True,
                                      model_state_sync="none")
  with pytest.raises(ValueError, match=r"model state leaf \['mean'\].*differs between workers"):
    strict.step(sharded, state, make_batch(0), start_state())
  bare = commopt.zero_data_parallel(lambda p, ms, b: bn_loss(p, ms, b)[0], optax.sgd(0.1),
                                    mesh, has_state=True)
  with pytest.raises(ValueError, match=r"zero_data_parallel: with has_state=True, `loss_fn` "
                                       r"must return \(loss, new_model_state\)"):
    bare.step(sharded, state, make_batch(0), start_state())


@pytest.mark.slow
def test_an_nnx_model_with_batch_norm_trains_its_statistics(mesh):
  """A Flax nnx model with BatchNorm: parameters sharded, batch statistics as model state
  (averaged over the workers each step), the rest constant. The same as data_parallel on
  the same split, and nnx.update writes both back into the model."""
  from flax import nnx

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.l1 = nnx.Linear(13, 37, rngs=rngs)
      self.bn = nnx.BatchNorm(37, momentum=0.9, rngs=rngs)
      self.l2 = nnx.Linear(37, 5, rngs=rngs)

    def __call__(self, x):
      return self.l2(jnp.tanh(self.bn(self.l1(x))))

  model = Net(nnx.Rngs(0))
  graphdef, params, stats, rest = nnx.split(model, nnx.Param, nnx.BatchStat, ...)

  def loss(p, ms, b):
    m = nnx.merge(graphdef, p, ms, rest)
    out = jnp.mean((m(b["x"]) - b["y"]) ** 2)
    return out, nnx.state(m, nnx.BatchStat)

  zp = commopt.zero_data_parallel(loss, optax.adam(1e-2), mesh, has_state=True,
                                  weights=commopt.int_quant(bits=8, rounding="nearest"))
  dp = commopt.data_parallel(loss, optax.chain(
      commopt.compressed_mean(IDENTITY, axis_name="data"), optax.adam(1e-2)), mesh,
      has_state=True)
  sharded = zp.shard(params)
  zstate, zms = zp.init(sharded), stats
  dparams, dstate, dms = params, dp.init(params), jax.tree.map(jnp.copy, stats)
  first = None
  for i in range(30):
    sharded, zstate, zms, zl = zp.step(sharded, zstate, make_batch(i), zms)
    dparams, dstate, dms, dl = dp.step(dparams, dstate, make_batch(i), dms)
    first = float(jnp.mean(zl)) if first is None else first
  assert float(jnp.mean(zl)) < 0.5 * first
  np.testing.assert_allclose(float(jnp.mean(zl)), float(jnp.mean(dl)), rtol=0.05)
  # int8 weights in the forward pass: statistics close to the dense step's, not equal.
  np.testing.assert_allclose(np.asarray(zms["bn"]["mean"][...]),
                             np.asarray(dms["bn"]["mean"][...]), rtol=0.05, atol=0.05)
  assert not np.allclose(np.asarray(zms["bn"]["mean"][...]), 0.0)
  nnx.update(model, zp.unshard(sharded), zms)
  np.testing.assert_array_equal(np.asarray(model.bn.mean[...]), np.asarray(zms["bn"]["mean"][...]))


def test_model_state_beside_a_tensor_parallel_axis():
  """On 4 data ranks × 2 model ranks (the hidden layer split over `model`), the averaged
  statistics, of a model-sharded activation too, equal those of the same run on the 4
  data ranks alone, to rounding."""
  from jax.sharding import AxisType, PartitionSpec as P
  tp = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  data = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  specs = {"w1": P(None, "model"), "w2": P("model", None)}

  def loss(p, ms, b):
    h = jnp.tanh(b["x"] @ p["w1"])
    out = jnp.einsum("bh,ho->bo", h, p["w2"], out_sharding=P())
    new = {"h": 0.9 * ms["h"] + 0.1 * jnp.mean(h, 0),
           "out": 0.9 * ms["out"] + 0.1 * jnp.mean(out, 0)}
    return jnp.mean((out - b["y"]) ** 2), new

  got = {}
  for name, mesh, kw in (("tp", tp, {"specs": specs}), ("data", data, {})):
    zp = commopt.zero_data_parallel(loss, optax.adam(1e-2), mesh, has_state=True)
    sharded = zp.shard({k: np.asarray(v) for k, v in make_params(hidden=38).items()}, **kw)
    state, ms = zp.init(sharded), {"h": jnp.zeros(38), "out": jnp.zeros(5)}
    for i in range(4):
      sharded, state, ms, _ = zp.step(sharded, state, make_batch(i, 32), ms)
    got[name] = jax.device_get(ms)
  _close(got["tp"], got["data"], rtol=1e-5, atol=1e-6)
  assert not np.allclose(got["tp"]["h"], 0.0)
