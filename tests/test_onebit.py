"""1-bit Adam against a step-by-step NumPy transcription, its wire, and (with hierarchical local SGD) inside a user's scan."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import commopt
from commopt import wire

LR, B1, B2, EPS = 1e-2, 0.9, 0.999, 1e-8


def scaled_sign_np(x):
  """commopt.scaled_sign on one chunk: its mean magnitude times the signs (zeros as +)."""
  return np.float32(np.mean(np.abs(x))) * np.where(x >= 0, np.float32(1), np.float32(-1))


def onebit_adam_np(grads, freeze):
  """The algorithm, transcribed: ``grads[t][i]`` is worker i's flat float32 gradient at step t.

  Warm-up (t < freeze): Adam on the mean gradient. After: each worker sends
  C(β₁m + (1−β₁)gᵢ + eᵢ) chunk by chunk (eᵢ its error memory); the owner of
  chunk j averages the N decoded chunks, adds its server memory sⱼ, sends
  C(·) of that, and keeps the rest in sⱼ; m is the gathered chunks.
  Returns, per step: the update, m, v, the worker memories and server memories.
  """
  n, d = grads[0].shape
  c = d // n
  m, v = np.zeros(d, np.float32), np.zeros(d, np.float32)
  worker_mem, server_mem = np.zeros((n, d), np.float32), np.zeros((n, c), np.float32)
  out = []
  for t, g in enumerate(grads):
    if t < freeze:
      mean = np.float32(sum(g[i] for i in range(n)) / np.float32(n))
      m = B1 * m + (1 - B1) * mean
      v = B2 * v + (1 - B2) * mean * mean
    else:
      sent = np.zeros((n, d), np.float32)
      for i in range(n):
        p = B1 * m + (1 - B1) * g[i] + worker_mem[i]
        sent[i] = np.concatenate([scaled_sign_np(p[j * c:(j + 1) * c]) for j in range(n)])
        worker_mem[i] = p - sent[i]
      new_m = np.zeros(d, np.float32)
      for j in range(n):
        q = sum(sent[i, j * c:(j + 1) * c] for i in range(n)) / np.float32(n) + server_mem[j]
        back = scaled_sign_np(q)
        server_mem[j] = q - back
        new_m[j * c:(j + 1) * c] = back
      m = new_m
    out.append(dict(update=-LR * m / (np.sqrt(v) + EPS), m=m.copy(), v=v.copy(),
                    worker=worker_mem.copy(), server=server_mem.copy()))
  return out


@pytest.mark.parametrize("n", [2, 8])
def test_onebit_adam_matches_the_transcription(n):
  """Steps 0-2 are warm-up, 3-7 compressed; at every step the update, m, v, every
  worker's error memory and every server memory are compared (float32 rounding)."""
  rng = np.random.default_rng(n)
  d, freeze, steps = 64 * 48, 3, 8
  grads = [rng.normal(size=(n, d)).astype(np.float32) for _ in range(steps)]
  want = onebit_adam_np(grads, freeze)
  tx = commopt.onebit_adam(LR, freeze, axis_name="w", b1=B1, b2=B2, eps=EPS, min_size=0)
  init = jax.vmap(tx.init, in_axes=None, axis_size=n, axis_name="w")
  update = jax.jit(jax.vmap(tx.update, axis_name="w"))
  state = init({"w": jnp.zeros((64, 48))})
  for t, g in enumerate(grads):
    u, state = update({"w": jnp.asarray(g.reshape(n, 64, 48))}, state)
    w = want[t]
    close = lambda got, ref, what: np.testing.assert_allclose(
        np.asarray(got).reshape(ref.shape), ref, rtol=2e-5, atol=2e-6, err_msg=f"step {t} {what}")
    for i in range(n):                     # every worker applies the same update
      close(u["w"][i], w["update"], f"update of worker {i}")
    close(state.mu["w"][0], w["m"], "m")
    close(state.nu["w"][0], w["v"], "v")
    close(state.reducer_state.residual["w"], w["worker"], "worker memories")
    close(state.reducer_state.server_residual["w"], w["server"], "server memories")
  assert np.abs(want[-1]["server"]).max() > 0 and np.abs(want[-1]["worker"]).max() > 0


def _problem(seed=0):
  rng = np.random.default_rng(seed)
  params = {"w": (rng.normal(size=(256, 64)) * 0.05).astype(np.float32),
            "b": np.zeros(64, np.float32)}
  x = rng.normal(size=(64, 256)).astype(np.float32)
  return params, {"x": x, "y": np.tanh(x[:, :64])}


def _loss(p, b):
  return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)


def test_onebit_adam_sends_one_bit_after_the_freeze_and_trains(mesh):
  params, batch = _problem()
  freeze = 10                                 # the variance needs some steps to settle
  tx = commopt.onebit_adam(1e-3, freeze, axis_name="data")
  dense = wire.comm_plan(tx, params, 8, step=0)
  frozen = wire.comm_plan(tx, params, 8, step=freeze)
  assert all(c.kind == "all-reduce" and not c.packed for c in dense.collectives)
  assert dense.contributed_bytes == (256 * 64 + 64) * 4
  # The momentum of the big leaf: 1-bit words and one scale per chunk, twice (two phases).
  w = [c for c in frozen.collectives if c.leaf == "['w']"]
  assert [c.kind for c in w] == ["all-to-all", "all-gather"] and all(c.packed for c in w)
  words = 256 * 64 // 32 + 8                       # sign words + one f32 scale per chunk
  assert w[0].contributed_bytes == words * 4 and w[1].contributed_bytes == words * 4 // 8
  ring = sum(c.sent_bytes for c in w)
  assert 256 * 64 * 4 * 2 * 7 / 8 / ring > 29        # ~1/32 of a float32 all-reduce
  with wire.record_collectives() as rec:
    dp = commopt.data_parallel(_loss, tx, mesh)
    p, s = dp.place_params(params), dp.init(params)
    rec.clear()
    losses = []
    for t in range(40):
      p, s, loss = dp.step(p, s, batch)
      jax.block_until_ready(p)
      moved = sum(b for _, b in rec.of_worker(0)) - 4          # less the skip flag
      plan = wire.comm_plan(tx, params, 8, step=t)
      assert moved == plan.contributed_bytes, (t, rec.of_worker(0))
      rec.clear()
      losses.append(float(np.mean(loss)))
  assert losses[-1] < 0.1 * losses[0], losses


def test_onebit_adam_checks_its_arguments():
  with pytest.raises(ValueError, match=r"onebit_adam: `freeze_step` must be an integer >= 0"):
    commopt.onebit_adam(1e-3, -1, axis_name="data")
  with pytest.raises(ValueError, match=r"onebit_adam: `strategy` must be one of \('two_phase', "
                                       r"'gather'\), got 'psum'"):
    commopt.onebit_adam(1e-3, 10, axis_name="data", strategy="psum")
  with pytest.raises(ValueError, match=r"onebit_adam: `axis_name` must name the data axis"):
    commopt.onebit_adam(1e-3, 10, axis_name=None)
  with pytest.raises(ValueError, match=r"onebit_adam: `b1` must be a number in \[0, 1\)"):
    commopt.onebit_adam(1e-3, 10, axis_name="data", b1=1.0)


@pytest.mark.parametrize("case", ["onebit_adam", "hierarchical local_sgd"])
def test_steps_inside_the_users_scan_equal_plain_calls(case, mesh, mesh2d):
  """Across the freeze (1-bit Adam) and both levels (hierarchical local SGD), a lax.scan of
  the step inside the user's jit gives the plain calls' parameters and state bit for bit."""
  params, batch = _problem()
  if case == "onebit_adam":
    dp = commopt.data_parallel(_loss, commopt.onebit_adam(1e-3, 2, axis_name="data"), mesh)
  else:
    axes = ("node", "local")
    tx = commopt.local_sgd(optax.sgd(0.05), axis_name=axes, period={"local": 2, "node": 4},
                           compressor=commopt.scaled_sign())
    dp = commopt.data_parallel(_loss, tx, mesh2d, axis_name=axes, local_params=True)
  copy = lambda t: jax.tree.map(jnp.copy, t)
  p, s = dp.place_params(params), dp.init(params)
  for _ in range(5):
    p, s, _ = dp.step(p, s, batch)

  @jax.jit
  def run(p, s):
    return jax.lax.scan(lambda c, _: (dp.step(*c, batch)[:2], None), (p, s), None, length=5)[0]

  p2, s2 = run(copy(dp.place_params(params)), dp.init(params))
  for a, b in zip(jax.tree.leaves((p, s)), jax.tree.leaves((p2, s2))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
