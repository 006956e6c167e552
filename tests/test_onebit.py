"""1-bit Adam, 0/1 Adam and 1-bit LAMB against step-by-step NumPy transcriptions, their wire,
and (with hierarchical local SGD) inside a user's scan."""

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


def two_phase_np(inputs, worker_mem, server_mem):
  """compressed_mean(scaled_sign(), strategy="two_phase") of the rows of ``inputs`` [n, d].

  Each worker i sends C(inputᵢ + eᵢ) chunk by chunk (eᵢ its error memory);
  the owner of chunk j averages the N decoded chunks, adds its server memory
  sⱼ, sends C(·) of that, and keeps the rest in sⱼ. The memories are updated
  in place; returns the gathered chunks.
  """
  n, d = inputs.shape
  c = d // n
  sent = np.zeros((n, d), np.float32)
  for i in range(n):
    p = inputs[i] + worker_mem[i]
    sent[i] = np.concatenate([scaled_sign_np(p[j * c:(j + 1) * c]) for j in range(n)])
    worker_mem[i] = p - sent[i]
  out = np.zeros(d, np.float32)
  for j in range(n):
    q = sum(sent[i, j * c:(j + 1) * c] for i in range(n)) / np.float32(n) + server_mem[j]
    back = scaled_sign_np(q)
    server_mem[j] = q - back
    out[j * c:(j + 1) * c] = back
  return out


def mean_np(g):
  """The dense all-reduce mean of the rows of ``g`` [n, d]."""
  return np.float32(sum(g[i] for i in range(len(g))) / np.float32(len(g)))


def onebit_adam_np(grads, freeze):
  """The algorithm, transcribed: ``grads[t][i]`` is worker i's flat float32 gradient at step t.

  Warm-up (t < freeze): Adam on the mean gradient. After: m is the two-phase
  1-bit mean of the workers' β₁m + (1−β₁)gᵢ.
  Returns, per step: the update, m, v, the worker memories and server memories.
  """
  n, d = grads[0].shape
  m, v = np.zeros(d, np.float32), np.zeros(d, np.float32)
  worker_mem, server_mem = np.zeros((n, d), np.float32), np.zeros((n, d // n), np.float32)
  out = []
  for t, g in enumerate(grads):
    if t < freeze:
      mean = mean_np(g)
      m = B1 * m + (1 - B1) * mean
      v = B2 * v + (1 - B2) * mean * mean
    else:
      m = two_phase_np(B1 * m + (1 - B1) * g, worker_mem, server_mem)
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


@pytest.mark.slow
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


def zero_one_schedule_np(steps, var_freeze_step, var_update_scaler, local_step_scaler,
                         local_step_clipper):
  """DeepSpeed's ZeroOneAdam counters, transcribed: what each of ``steps`` updates does.

  ``"variance"`` (dense all-reduce, v updated), ``"1-bit"`` (1-bit gradients, v kept),
  ``"sync"`` (frozen, 1-bit exchange of the accumulated moves), ``"local"`` (frozen, no
  exchange). DeepSpeed's first step() call only allocates buffers and counts as step 1.
  """
  step, var_interval, var_counter, local_interval, local_counter = 1, 1, 0, 1, 0
  frozen, kinds = False, []
  for _ in range(steps):
    step += 1
    if not frozen:
      kinds.append("variance" if step % var_interval == 0 else "1-bit")
      if step % var_interval == 0:
        var_counter += 1
        if var_counter == var_update_scaler:
          var_counter, var_interval = 0, var_interval * 2
    else:
      kinds.append("sync" if step % local_interval == 0 else "local")
      local_counter += 1
      if local_counter == local_step_scaler:
        local_counter, local_interval = 0, min(local_step_clipper, local_interval * 2)
    frozen = frozen or step > var_freeze_step
  return kinds


def zero_one_adam_np(grads, params, lrs, kinds, wd):
  """DeepSpeed's ZeroOneAdam.step, transcribed for N workers with per-worker parameters.

  ``grads[t]`` and ``params`` are [n, d]; ``lrs[t]`` the learning rate of step t;
  ``kinds`` from :func:`zero_one_schedule_np`. Returns per step the parameters, m, v,
  the accumulated moves (momentum_accumulator), lrs and both error memories.
  """
  n, d = grads[0].shape
  p = params.copy()
  m, v = np.zeros((n, d), np.float32), np.zeros(d, np.float32)
  acc = np.zeros((n, d), np.float32)
  worker_mem, server_mem = np.zeros((n, d), np.float32), np.zeros((n, d // n), np.float32)
  lr_sum, out = np.float32(0), []
  for t, (g, kind) in enumerate(zip(grads, kinds)):
    lr = np.float32(lrs[t])
    frozen = kind in ("sync", "local")
    if frozen and kinds[t - 1] in ("variance", "1-bit"):        # reinitial_error_buffer
      worker_mem[:], server_mem[:] = 0, 0
    if kind == "variance":
      mean = mean_np(g)
      v = B2 * v + (1 - B2) * mean * mean
      m = B1 * m + (1 - B1) * mean
    elif kind == "1-bit":
      m = B1 * m + (1 - B1) * two_phase_np(g, worker_mem, server_mem)
    else:
      m = B1 * m + (1 - B1) * g
      lr_sum = lr_sum + lr
    update = m / (np.sqrt(v) + EPS) + wd * p
    p = p - lr * update
    if frozen:
      acc = acc - lr * update
    if kind == "sync":
      p = p - acc
      acc = acc * (np.sqrt(v) + EPS)
      acc = np.broadcast_to(two_phase_np(acc, worker_mem, server_mem), (n, d))
      m = -acc / lr_sum
      p = p + acc / (np.sqrt(v) + EPS)
      acc, lr_sum = np.zeros((n, d), np.float32), np.float32(0)
    out.append(dict(params=p.copy(), m=np.broadcast_to(m, (n, d)).copy(), v=v.copy(),
                    acc=acc.copy(), lr_sum=lr_sum, worker=worker_mem.copy(),
                    server=server_mem.copy()))
  return out


ZERO_ONE = dict(var_freeze_step=10, var_update_scaler=2, local_step_scaler=3,
                local_step_clipper=4)


def _linear_loss(p, b):
  """A loss whose gradient on each worker is its row of the batch: fixed gradients."""
  return sum(jnp.sum(p[k] * b[k]) for k in p)


def _scanned(dp, p, s, batches):
  """The steps over ``batches`` (stacked) as one lax.scan inside a jit."""
  step = lambda c, b: (dp.step(*c, b)[:2], None)
  return jax.jit(lambda p, s: jax.lax.scan(step, (p, s), batches)[0])(p, s)


def _assert_bitwise_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 8])
def test_zero_one_adam_matches_the_transcription(n):
  """24 steps through data_parallel on n workers, each with fixed gradients: variance
  steps (dense) at DeepSpeed's counter 2, 3, 4, 6, 8, 1-bit gradient steps between them
  up to step 10, then the frozen phase: every step synchronises for 3 steps, then every
  2nd, then every 4th (the clipper). At every step: every worker's parameters, m (per
  worker), v, the accumulated moves, the summed learning rates and every error memory
  equal the transcription's (float32 rounding); the workers' momenta differ exactly on
  the local steps; the bytes each step moves (recorded at run time) are comm_plan's for
  that step: dense on the variance steps, none on the local ones. On 8 workers, the same
  24 steps as one lax.scan inside a jit give the plain calls' parameters and state bit for
  bit."""
  rng = np.random.default_rng(n)
  shape, steps, wd = (64, 48), 24, 0.01
  d = shape[0] * shape[1]
  kinds = zero_one_schedule_np(steps, **ZERO_ONE)
  assert kinds[:10] == ["variance"] * 3 + ["1-bit", "variance"] * 2 + ["1-bit"] * 3
  assert kinds[10:] == (["sync"] * 3 + ["local", "sync", "local"] + ["local"] * 2
                        + ["sync"] + ["local"] * 3 + ["sync", "local"])
  schedule = optax.linear_schedule(2e-2, 5e-3, steps)
  grads = [rng.normal(size=(n, d)).astype(np.float32) for _ in range(steps)]
  start = rng.normal(size=d).astype(np.float32)
  want = zero_one_adam_np(grads, np.broadcast_to(start, (n, d)),
                          [schedule(t) for t in range(steps)], kinds, wd)
  tx = commopt.transforms.zero_one_adam(schedule, axis_name="data", b1=B1, b2=B2, eps=EPS,
                             weight_decay=wd, min_size=0, **ZERO_ONE)
  mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
  params = {"w": start.reshape(shape)}
  batches = {"w": np.stack(grads).reshape(steps, n, *shape)}
  with wire.record_collectives() as rec:
    dp = commopt.data_parallel(_linear_loss, tx, mesh, local_params=True)
    p, s = dp.place_params(params), dp.init(params)
    first = jax.tree.map(jnp.copy, (p, s))
    rec.clear()
    for t in range(steps):
      p, s, _ = dp.step(p, s, {"w": batches["w"][t]})
      jax.block_until_ready(p)
      moved = sum(b for _, b in rec.of_worker(0)) - 4                  # less the skip flag
      rec.clear()
      assert moved == wire.comm_plan(tx, params, n, step=t).contributed_bytes, (t, kinds[t])
      assert (moved == d * 4, moved == 0) == (kinds[t] == "variance", kinds[t] == "local")
      w, inner = want[t], s.inner_state
      close = lambda got, ref, what, atol=2e-6: np.testing.assert_allclose(
          np.asarray(got).reshape(np.shape(ref)), ref, rtol=2e-5, atol=atol,
          err_msg=f"step {t} ({kinds[t]}) {what}")
      close(p["w"], w["params"], "parameters of every worker")
      close(inner.mu["w"], w["m"], "m of every worker", atol=2e-5)
      close(inner.nu["w"], w["v"], "v")
      close(inner.moved["w"], w["acc"], "accumulated moves")
      close(inner.lr_sum, w["lr_sum"], "summed learning rates")
      close(inner.reducer_state.residual["w"], w["worker"], "worker memories", atol=2e-5)
      close(inner.reducer_state.server_residual["w"], w["server"], "server memories",
            atol=2e-5)
      mu = np.asarray(inner.mu["w"])
      spread = np.abs(mu - mu[:1]).max()
      assert (spread == 0) == (kinds[t] != "local"), (t, kinds[t], spread)
    if n == 8:
      _assert_bitwise_equal((p, s), _scanned(dp, *first, batches))


def test_zero_one_adam_exchanges_only_on_its_schedule():
  """Over 64 steps the steps with bytes on the wire (comm_plan per step, which the recorded
  run above matches) are exactly the schedule's: all 16 of the variance phase (dense on
  T_v, 1-bit between) and the 17 frozen steps in T_u, as the local-step interval doubles
  from 1 to the clipper, 8."""
  params, _ = _problem()
  cfg = dict(var_freeze_step=16, var_update_scaler=4, local_step_scaler=8, local_step_clipper=8)
  kinds = zero_one_schedule_np(64, **cfg)
  tx = commopt.transforms.zero_one_adam(1e-3, axis_name="data", **cfg)
  plans = [wire.comm_plan(tx, params, 8, step=t) for t in range(64)]
  dense = (256 * 64 + 64) * 4
  assert [plan.contributed_bytes == dense for plan in plans] == [k == "variance" for k in kinds]
  assert [bool(plan.collectives) for plan in plans] == [k != "local" for k in kinds]
  assert sum(bool(plan.collectives) for plan in plans) == 16 + 17
  # T_u (0-based steps): every step, then every 2nd, 4th and (clipped) 8th of the counter.
  assert [t for t, k in enumerate(kinds) if k == "sync"] == [*range(16, 24), 24, 26, 28, 30,
                                                             34, 38, 46, 54, 62]
  assert kinds.count("variance") == 9
  for plan, kind in zip(plans, kinds):
    if kind in ("1-bit", "sync"):
      w = [c for c in plan.collectives if c.leaf == "['w']"]
      assert [c.kind for c in w] == ["all-to-all", "all-gather"] and all(c.packed for c in w)


def test_zero_one_adam_checks_its_arguments():
  with pytest.raises(ValueError, match=r"zero_one_adam: `local_step_clipper` must be a "
                                       r"positive integer, got 0"):
    commopt.transforms.zero_one_adam(1e-3, axis_name="data", local_step_clipper=0)
  with pytest.raises(ValueError, match=r"zero_one_adam: `var_freeze_step` must be an integer "
                                       r">= 0, got -1"):
    commopt.transforms.zero_one_adam(1e-3, axis_name="data", var_freeze_step=-1)
  tx = commopt.transforms.zero_one_adam(1e-3, axis_name="data", weight_decay=0.1)
  with pytest.raises(ValueError, match=r"zero_one_adam: `weight_decay` needs `params`"):
    tx.update({"w": jnp.ones(3)}, tx.init({"w": jnp.ones(3)}))


def onebit_lamb_np(grads, params, freeze, lr, wd, max_coeff=10.0, min_coeff=0.01,
                   coeff_beta=0.9, factor_max=4.0, factor_min=0.5, factor_threshold=0.1):
  """DeepSpeed's OnebitLamb.step, transcribed (its momenta compressed leaf by leaf, as
  commopt's per-leaf compressors do); ``grads[t][leaf]`` is [n, d], ``params[leaf]`` [d].

  Returns per step, per leaf: the parameters, m, v, v_fresh, lamb_coeff_freeze,
  last_factor, scaling_coeff, the coefficient applied and the clipping rules that fired.
  """
  n = len(next(iter(grads[0].values())))
  p = {k: x.copy() for k, x in params.items()}
  zeros = lambda: {k: np.zeros_like(x) for k, x in p.items()}
  m, v, fresh = zeros(), zeros(), zeros()
  coeff_freeze, last_factor = dict.fromkeys(p, np.float32(0)), dict.fromkeys(p, np.float32(1))
  worker_mem = {k: np.zeros((n, x.size), np.float32) for k, x in p.items()}
  server_mem = {k: np.zeros((n, x.size // n), np.float32) for k, x in p.items()}
  scaling, norm, out = None, lambda x: np.sqrt(np.sum(x * x)), []
  for t, g in enumerate(grads):
    coeffs, fired = {}, {k: set() for k in p}
    if t >= freeze and scaling is None:                  # the momenta's scales at the freeze
      scales = {k: norm(m[k]) / np.sqrt(m[k].size) for k in p}
      united = sum(scales.values()) / len(scales)
      scaling = {k: np.float32(united / scales[k]) for k in p}
    for k in p:
      if t < freeze:                                     # warm-up: LAMB
        mean = mean_np(g[k])
        m[k] = B1 * m[k] + (1 - B1) * mean
        v[k] = B2 * v[k] + (1 - B2) * mean * mean
        if t == freeze - 1:
          fresh[k] = v[k].copy()
        update = m[k] / (np.sqrt(v[k]) + EPS) + wd * p[k]
        w_norm, u_norm, coeff = norm(p[k]), norm(update), np.float32(1)
        if w_norm != 0 and u_norm != 0:
          coeff = w_norm / u_norm
          if coeff > max_coeff:
            coeff = np.float32(max_coeff); fired[k].add("max_coeff")
          if coeff < min_coeff:
            coeff = np.float32(min_coeff); fired[k].add("min_coeff")
        if coeff != 1.0:
          coeff_freeze[k] = coeff_beta * coeff_freeze[k] + (1 - coeff_beta) * coeff
      else:                                              # compression
        last = m[k].copy()
        local = (B1 * m[k] + (1 - B1) * g[k]) * scaling[k]
        m[k] = two_phase_np(local, worker_mem[k], server_mem[k]) / scaling[k]
        rec = (m[k] - last * B1) / (1 - B1)
        fresh[k] = B2 * fresh[k] + (1 - B2) * rec * rec
        denom = np.sqrt(v[k]) + EPS
        prelim = m[k] / denom
        update = prelim + wd * p[k]
        factor = np.max(denom / (np.sqrt(fresh[k]) + EPS))
        if wd > 0:
          ratio = min(1.0, norm(prelim) / norm(update))
          factor = factor * ratio + (1.0 - ratio)
        high = last_factor[k] * (1 + factor_threshold)
        low = last_factor[k] * (1 - factor_threshold)
        for rule, bad, bound in (("factor_max", lambda f: f > factor_max, factor_max),
                                 ("factor_min", lambda f: f < factor_min, factor_min),
                                 ("threshold", lambda f: f > high, high),
                                 ("threshold", lambda f: f < low, low)):
          if bad(factor):                                # DeepSpeed's ifs, one after another
            factor = bound
            fired[k].add(rule)
        last_factor[k] = np.float32(factor)
        coeff = coeff_freeze[k] * last_factor[k]
      p[k] = p[k] + -lr * coeff * update
      coeffs[k] = coeff
    out.append(dict(params={k: x.copy() for k, x in p.items()},
                    m={k: x.copy() for k, x in m.items()}, v=dict(v),
                    fresh={k: x.copy() for k, x in fresh.items()},
                    coeff_freeze=dict(coeff_freeze),
                    last_factor=dict(last_factor), scaling=scaling, coeff=coeffs, fired=fired))
  return out


@pytest.mark.slow
def test_onebit_lamb_matches_the_transcription(mesh):
  """3 warm-up steps and 4 compressed ones through data_parallel on 8 workers with fixed
  gradients, weight decay and three leaves: one whose trust ratio exceeds max_coeff, one
  below min_coeff, one between. The factors (about 1.0005 at the first compressed step,
  then falling towards 0.99) meet every rule: factor_max 1.0003 clips the first,
  factor_min 0.996 and the 0.25% threshold later ones, and some pass unclipped. At every
  step each leaf's parameters, m, v, v_fresh, the running trust ratio, the factor, the
  momentum scaling and the coefficient applied equal the transcription's (float32
  rounding). The same steps as one lax.scan inside a jit give the plain calls' parameters
  and state bit for bit."""
  n, freeze, steps, lr, wd = 8, 3, 7, 1e-2, 0.01
  rng = np.random.default_rng(7)
  params = {"big": 50 + rng.normal(size=32 * 48), "small": 1e-3 * rng.normal(size=16 * 48),
            "mid": rng.normal(size=64 * 48)}
  params = {k: x.astype(np.float32) for k, x in params.items()}
  grads = [{k: rng.normal(size=(n, x.size)).astype(np.float32) for k, x in params.items()}
           for _ in range(steps)]
  kw = dict(factor_max=1.0003, factor_min=0.996, factor_threshold=0.0025)
  want = onebit_lamb_np(grads, params, freeze, lr, wd, **kw)
  fired = [w["fired"] for w in want]
  assert [f["big"] for f in fired[:freeze]] == [{"max_coeff"}] * freeze
  assert [f["small"] for f in fired[:freeze]] == [{"min_coeff"}] * freeze
  assert not any(f["mid"] for f in fired[:freeze])
  assert set().union(*(f[k] for f in fired[freeze:] for k in params)) == {
      "factor_max", "factor_min", "threshold"}
  assert sum(not f[k] for f in fired[freeze:] for k in params) >= 2
  tx = commopt.transforms.onebit_lamb(lr, freeze, axis_name="data", b1=B1, b2=B2, eps=EPS,
                           weight_decay=wd, min_size=0, **kw)
  dp = commopt.data_parallel(_linear_loss, tx, mesh)
  p, s = dp.place_params(params), dp.init(params)
  first = jax.tree.map(jnp.copy, (p, s))
  for t, g in enumerate(grads):
    p, s, _ = dp.step(p, s, g)
    w, inner = want[t], s.inner_state
    for k in params:
      close = lambda got, ref, what, rtol=2e-5: np.testing.assert_allclose(
          np.asarray(got), ref, rtol=rtol, atol=1e-6, err_msg=f"step {t} leaf {k} {what}")
      close(p[k], w["params"][k], "parameters")
      close(inner.mu[k], w["m"][k], "m")
      close(inner.nu[k], w["v"][k], "v")
      if t >= freeze - 1:
        close(inner.fresh_nu[k], w["fresh"][k], "v_fresh")
      close(inner.frozen_ratio[k], w["coeff_freeze"][k], "running trust ratio")
      close(inner.last_factor[k], w["last_factor"][k], "factor", rtol=1e-6)
      close(inner.trust_ratio[k], w["coeff"][k], "coefficient applied")
      if t >= freeze:
        close(inner.scaling[k], w["scaling"][k], "momentum scaling")
  assert float(inner.trust_ratio["big"]) > 1 > float(inner.trust_ratio["small"])
  _assert_bitwise_equal((p, s), _scanned(dp, *first, {k: np.stack([g[k] for g in grads])
                                                      for k in params}))


def test_onebit_lamb_checks_its_arguments():
  with pytest.raises(ValueError, match=r"onebit_lamb: `max_coeff` must be a number >= "
                                       r"min_coeff \(0.5\), got 0.1"):
    commopt.transforms.onebit_lamb(1e-3, 10, axis_name="data", min_coeff=0.5, max_coeff=0.1)
  with pytest.raises(ValueError, match=r"onebit_lamb: `factor_max` must be a number >= "
                                       r"factor_min \(0.5\), got 0.25"):
    commopt.transforms.onebit_lamb(1e-3, 10, axis_name="data", factor_max=0.25)
  with pytest.raises(ValueError, match=r"onebit_lamb: `coeff_beta` must be a number in \[0, 1\)"):
    commopt.transforms.onebit_lamb(1e-3, 10, axis_name="data", coeff_beta=1.0)
  tx = commopt.transforms.onebit_lamb(1e-3, 10, axis_name="data")
  with pytest.raises(ValueError, match=r"onebit_lamb: `update` needs `params`"):
    tx.update({"w": jnp.ones(3)}, tx.init({"w": jnp.ones(3)}))


@pytest.mark.parametrize("case", ["onebit_adam", "hierarchical local_sgd"])
def test_steps_inside_the_users_scan_equal_plain_calls(case, mesh, mesh2d):
  """Across the freeze (1-bit Adam) and both levels (hierarchical local SGD), a lax.scan of
  the step inside the user's jit gives the plain calls' parameters and state bit for bit
  (0/1 Adam's and 1-bit LAMB's tests above check theirs)."""
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

  _assert_bitwise_equal((p, s), run(copy(dp.place_params(params)), dp.init(params)))


# ---------------------------------------------------------------------------
# exp_avg_mask (DeepSpeed's momentum mask).

MASK_WORKERS, MASKED_ROWS = 4, slice(20, 28)       # rows 20-27 of w: parts of two chunks
MASK_FREEZE = {"onebit_adam": 3, "zero_one_adam": 4, "onebit_lamb": 3}


def _masked_tx(name, **kw):
  if name == "zero_one_adam":
    return commopt.transforms.zero_one_adam(1e-2, axis_name="data", eps=1e-4, min_size=0,
                                 var_freeze_step=MASK_FREEZE[name], var_update_scaler=1,
                                 local_step_scaler=2, local_step_clipper=4, **kw)
  return getattr(commopt.transforms, name)(1e-2, MASK_FREEZE[name], axis_name="data", eps=1e-4,
                                min_size=0, **kw)


def _row_mask():
  """w's mask: 0 on MASKED_ROWS, 1 elsewhere."""
  mask = np.ones((32, 16), np.float32)
  mask[MASKED_ROWS] = 0
  return mask


def _masked_run(tx, steps, *, zero_rows, seed=0):
  """``tx`` on MASK_WORKERS workers (vmap), each with its own gradients (zero on w's
  MASKED_ROWS if ``zero_rows``), from the same parameters {"w": [32, 16], "b": [16]}:
  per step, the parameters after it and the state."""
  rng = np.random.default_rng(seed)
  n = MASK_WORKERS
  start = {"w": rng.normal(size=(32, 16)), "b": rng.normal(size=16)}
  params = {k: np.broadcast_to(x, (n, *x.shape)).astype(np.float32) for k, x in start.items()}
  update = jax.jit(jax.vmap(tx.update, axis_name="data"))
  p, s, out = params, jax.vmap(tx.init, axis_name="data")(params), []
  for _ in range(steps):
    g = {k: rng.normal(size=x.shape).astype(np.float32) for k, x in params.items()}
    if zero_rows:
      g["w"][:, MASKED_ROWS] = 0
    u, s = update(g, s, p)
    p = optax.apply_updates(p, u)
    out.append((p, s))
  return out


@pytest.mark.parametrize("name", list(MASK_FREEZE))
@pytest.mark.slow
def test_an_exp_avg_mask_of_ones_changes_nothing(name):
  """Masks of ones (float32 for w, bool for b) give the unmasked run's parameters and state
  bit for bit, across the freeze (and 0/1 Adam's 1-bit, local and synchronising steps)."""
  ones = {"w": np.ones((32, 16), np.float32), "b": np.ones(16, bool)}
  plain = _masked_run(_masked_tx(name, weight_decay=0.01), 12, zero_rows=False)
  masked = _masked_run(_masked_tx(name, weight_decay=0.01, exp_avg_mask=ones), 12,
                       zero_rows=False)
  _assert_bitwise_equal(plain, masked)


@pytest.mark.parametrize("name", ["onebit_adam", "onebit_lamb"])
def test_exp_avg_mask_zeroes_the_momentum_and_stops_the_parameters_after_the_freeze(name):
  """With gradients everywhere, from the freeze on the masked rows' momentum is exactly 0 on
  every worker and (without weight decay) their parameters stay as the warm-up left them;
  the other rows, and b (None: unmasked), keep moving."""
  freeze = MASK_FREEZE[name]
  run = _masked_run(_masked_tx(name, exp_avg_mask={"w": _row_mask(), "b": None}), 8,
                    zero_rows=False)
  warm = np.asarray(run[freeze - 1][0]["w"])
  assert np.abs(np.asarray(run[freeze - 1][1].mu["w"])[:, MASKED_ROWS]).min() > 0
  for t in range(freeze, len(run)):
    p, s = run[t]
    mu, w = np.asarray(s.mu["w"]), np.asarray(p["w"])
    assert (mu[:, MASKED_ROWS] == 0).all(), t
    np.testing.assert_array_equal(w[:, MASKED_ROWS], warm[:, MASKED_ROWS], err_msg=str(t))
    assert (w[:, :20] != np.asarray(run[t - 1][0]["w"])[:, :20]).all(), t
    assert (np.asarray(p["b"]) != np.asarray(run[t - 1][0]["b"])).all(), t


@pytest.mark.slow
def test_exp_avg_mask_makes_zero_one_adams_synchronisations_undo_the_masked_moves():
  """0/1 Adam with gradients everywhere: the masked rows move on the local steps, but every
  synchronisation leaves their momentum exactly 0 on every worker and their parameters as
  the previous synchronisation (or the freeze) left them; the other rows move on."""
  kinds = zero_one_schedule_np(14, var_freeze_step=4, var_update_scaler=1, local_step_scaler=2,
                               local_step_clipper=4)
  assert "local" in kinds and kinds.count("sync") >= 4
  run = _masked_run(_masked_tx("zero_one_adam", exp_avg_mask={"w": _row_mask(), "b": None}),
                    14, zero_rows=False)
  last = np.asarray(run[MASK_FREEZE["zero_one_adam"] - 1][0]["w"])
  for t, kind in enumerate(kinds):
    if kind != "sync":
      continue
    mu, w = np.asarray(run[t][1].mu["w"]), np.asarray(run[t][0]["w"])
    assert (mu[:, MASKED_ROWS] == 0).all(), t
    np.testing.assert_allclose(w[:, MASKED_ROWS], last[:, MASKED_ROWS], rtol=0, atol=1e-6,
                               err_msg=str(t))
    assert np.abs(w[:, :20] - last[:, :20]).min() > 0, t
    last = w
  local = next(t for t, k in enumerate(kinds) if k == "local")
  assert np.abs(np.asarray(run[local][1].mu["w"])[:, MASKED_ROWS]).min() > 0


@pytest.mark.parametrize("name", list(MASK_FREEZE))
@pytest.mark.slow
def test_exp_avg_mask_stops_the_drift_of_coordinates_without_gradients(name):
  """DeepSpeed's case: rows whose gradient is always 0 (position embeddings past the trained
  sequence length). Without the mask the 1-bit exchanges (which cannot send an exact 0)
  give them momentum and they drift; with it their momentum is exactly 0 at every step
  and their parameters never move."""
  plain = _masked_run(_masked_tx(name), 10, zero_rows=True)
  masked = _masked_run(_masked_tx(name, exp_avg_mask={"w": _row_mask(), "b": None}), 10,
                       zero_rows=True)
  start = np.asarray(plain[0][0]["w"])[:, MASKED_ROWS]
  assert np.abs(np.asarray(plain[-1][1].mu["w"])[:, MASKED_ROWS]).min() > 0
  assert (np.asarray(plain[-1][0]["w"])[:, MASKED_ROWS] != start).all()
  for t, (p, s) in enumerate(masked):
    assert (np.asarray(s.mu["w"])[:, MASKED_ROWS] == 0).all(), t
    np.testing.assert_array_equal(np.asarray(p["w"])[:, MASKED_ROWS], start, err_msg=str(t))


def test_exp_avg_mask_under_data_parallel(mesh):
  """1-bit Adam with a mask on w's first 16 rows through data_parallel on 8 workers: the
  mask is a constant of the step; after the freeze those rows' momentum is 0 and their
  parameters stay put."""
  params, batch = _problem()
  mask = {"w": np.ones((256, 64), bool), "b": None}
  mask["w"][:16] = False
  dp = commopt.data_parallel(_loss, commopt.onebit_adam(1e-3, 2, axis_name="data",
                                                        exp_avg_mask=mask), mesh)
  p, s = dp.place_params(params), dp.init(params)
  for t in range(5):
    p, s, _ = dp.step(p, s, batch)
    if t == 1:
      warm = np.asarray(p["w"])
  assert (np.asarray(s.inner_state.mu["w"])[:16] == 0).all()
  np.testing.assert_array_equal(np.asarray(p["w"])[:16], warm[:16])
  assert (np.asarray(p["w"])[16:] != warm[16:]).any()


def test_exp_avg_mask_is_checked():
  """Values other than 0 and 1, or a leaf that is no array, at construction; a structure or
  a shape unlike the parameters' at init. Each message names the argument and the leaf."""
  with pytest.raises(ValueError, match=r"zero_one_adam: `exp_avg_mask` leaf \['w'\] must hold "
                                       r"only 0s and 1s .*, got 0\.5 among its values"):
    commopt.transforms.zero_one_adam(1e-3, axis_name="data",
                                     exp_avg_mask={"w": np.full((4, 3), 0.5)})
  with pytest.raises(ValueError, match=r"onebit_lamb: `exp_avg_mask` leaf \['w'\] must be an "
                                       r"array of 0s and 1s .*, got str"):
    commopt.transforms.onebit_lamb(1e-3, 10, axis_name="data", exp_avg_mask={"w": "rows 0-3"})
  params = {"w": jnp.ones((4, 3)), "b": jnp.ones(3)}
  for name in MASK_FREEZE:
    bad_structure = _masked_tx(name, exp_avg_mask={"w": np.ones((4, 3))})
    with pytest.raises(ValueError, match=rf"{name}: `exp_avg_mask` must be a pytree with the "
                                         r"parameters' structure"):
      bad_structure.init(params)
    bad_shape = _masked_tx(name, exp_avg_mask={"w": np.ones((3, 4)), "b": None})
    with pytest.raises(ValueError, match=rf"{name}: `exp_avg_mask` leaf \['w'\] has shape "
                                         r"\(3, 4\), but its parameter has shape \(4, 3\)"):
      bad_shape.init(params)
  fine = _masked_tx("onebit_adam", exp_avg_mask={"w": np.eye(4, 3, dtype=int), "b": None})
  assert fine.init(params).mu["w"].shape == (4, 3)
