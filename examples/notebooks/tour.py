# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # A tour of commopt
#
# Four steps, each building on the last:
#
# 1. **Compress** one gradient: what a compressor sends and what comes back.
# 2. **Chain** a compressor into an Optax optimizer: `compressed_mean` averages
#    over a named axis and keeps each worker's error-feedback residual in the
#    optimizer state.
# 3. **Train** data-parallel on 8 simulated CPU devices: dense against three
#    compressors on an MLP over the digits bundled with scikit-learn.
# 4. **Audit the wire**: the bytes each worker should send, predicted before
#    anything compiles, and the collectives read out of the compiled step.
#
# Set `COMMOPT_NOTEBOOK_SMALL=1` for a shorter training run.

# %%
import pathlib
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import optax

import commopt
from commopt import wire

HERE = pathlib.Path(globals().get("__file__", pathlib.Path.cwd() / "notebook.py")).resolve().parent
sys.path.insert(0, str(HERE.parent))
from digits_cnn import load_digits_flat, mlp_fns, notebook_settings  # noqa: E402

SMALL, OUT = notebook_settings()
STEPS = 40 if SMALL else 300

# %% [markdown]
# ## 1. Compress one gradient
#
# A compressor is a pair of pure functions: `encode(x, state, key)` gives a
# packed payload (uint32 words, a few floats) and `decode(payload, state, like)`
# gives the reconstruction. `payload_bits` says how many bits cross the wire.
# Here a 256×256 "gradient" with a decaying spectrum goes through four of them.
# The unbiased ones (QSGD) pay for unbiasedness with variance; the biased ones
# (scaled sign, top-k, PowerSGD) rely on error feedback, step 2.

# %%
k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
u = jax.random.normal(k1, (256, 8))
v = jax.random.normal(k2, (8, 256))
g = u @ (v * (0.5 ** jnp.arange(8))[:, None]) + 0.05 * jax.random.normal(k3, (256, 256))

compressors = {
    "scaled_sign": commopt.scaled_sign(),
    "qsgd(4 levels)": commopt.qsgd(levels=4),
    "top_k(1%)": commopt.top_k(ratio=0.01),
    "power_sgd(rank 2)": commopt.power_sgd(rank=2),
}
dense_bits = g.size * 32
print(f"{'compressor':20s} {'bits sent':>10s} {'ratio':>7s} {'relative error':>15s}")
for name, c in compressors.items():
  state = c.init(g) if c.stateful else None
  payload, _ = c.encode(g, state, jax.random.key(1))
  back = c.decode(payload, state, g)
  bits = c.payload_bits(g.shape, g.dtype)
  err = float(jnp.linalg.norm(back - g) / jnp.linalg.norm(g))
  print(f"{name:20s} {bits:10,d} {dense_bits / bits:6.1f}x {err:15.3f}")

# %% [markdown]
# The payload is what moves: for `scaled_sign`, 2,048 uint32 words (one sign
# bit per element) and one float32 scale.

# %%
payload, _ = commopt.scaled_sign().encode(g, None, None)
print(jax.tree.map(lambda a: (a.dtype.name, a.shape), payload))

# %% [markdown]
# ## 2. Chain it into an optimizer
#
# `compressed_mean(compressor, axis_name=axis_name)` is an Optax transform: each worker
# encodes its gradient plus its residual, the payloads are exchanged over
# `axis_name`, and every worker gets the mean of the decoded payloads. What a
# worker's payload left out stays in its residual (error feedback), inside the
# optimizer state. `commopt.testing.vmap_workers` simulates N workers with
# `jax.vmap`, which is the quickest way to see it.

# %%
tx = optax.chain(commopt.compressed_mean(commopt.scaled_sign(), axis_name="workers"),
                 optax.sgd(0.1, momentum=0.9))
workers = commopt.testing.vmap_workers(tx, 4)
grads = {"w": jax.random.normal(jax.random.key(2), (4, 64, 64))}    # one gradient per worker
state = workers.init({"w": jnp.zeros((64, 64))})
updates, state = workers.update(grads, state)
residual = state[0].residual["w"]                                   # per worker: [4, 64, 64]
print("every worker applies the same update:",
      bool(jnp.all(updates["w"] == updates["w"][0])))
print("residual norms per worker:", np.round(np.linalg.norm(residual.reshape(4, -1), axis=1), 2))

# %% [markdown]
# What error feedback keeps: each worker's input equals what it sent plus its
# new residual, so nothing is lost, only delayed.

# %%
sent = grads["w"] - residual
c = commopt.scaled_sign()
decoded = jax.vmap(lambda x: c.decode(c.encode(x, None, None)[0], None, x))(grads["w"])
print("input = decoded payload + residual:",
      bool(jnp.allclose(decoded, sent, atol=1e-6)))

# %% [markdown]
# ## 3. Train data-parallel on 8 devices
#
# `data_parallel(loss_fn, tx, mesh)` builds a jitted step: parameters
# replicated, the batch sharded over `"data"`, each worker's gradient kept on
# the worker, and the optimizer doing the only communication. The MLP is
# 64 → 256 → 256 → 10 on the 1,797 digits, 32 rows per worker per step.

# %%
x_all, y_all = load_digits_flat()
params, loss_fn = mlp_fns(256)
mesh = jax.make_mesh((8,), ("data",))


def batch(step):
  idx = np.random.default_rng([step, 3]).choice(len(x_all), 8 * 32, replace=False)
  return {"x": x_all[idx], "y": y_all[idx]}


def accuracy(p):
  h = x_all
  for i in range(3):
    h = h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"]
    h = jax.nn.relu(h) if i < 2 else h
  return float(jnp.mean(jnp.argmax(h, -1) == y_all))


RUNS = {
    "dense": commopt.compressors.identity(),
    "scaled_sign": commopt.scaled_sign(),
    "top_k(1%)": commopt.top_k(ratio=0.01),
    "power_sgd(rank 2)": commopt.power_sgd(rank=2),
}
curves, steps = {}, {}
for name, c in RUNS.items():
  tx = optax.chain(commopt.compressed_mean(c, axis_name="data"), optax.sgd(0.05, momentum=0.9))
  dp = commopt.data_parallel(loss_fn, tx, mesh)
  p, s = dp.place_params(params), dp.init(params)
  losses = []
  for step in range(STEPS):
    p, s, loss = dp.step(p, s, batch(step))
    losses.append(float(loss.mean()))
  curves[name], steps[name] = losses, (dp, p, s)
  print(f"{name:20s} loss {losses[0]:.3f} -> {np.mean(losses[-10:]):.3f}, "
        f"accuracy {accuracy(p):.3f}")

# %%
fig, ax = plt.subplots(figsize=(7, 4))
for name, losses in curves.items():
  smooth = np.convolve(losses, np.ones(5) / 5, mode="valid")
  ax.plot(np.arange(len(smooth)) + 5, smooth, label=name)
ax.set_xlabel("step")
ax.set_ylabel("training loss (5-step mean)")
ax.set_yscale("log")
ax.grid(True, alpha=0.3)
ax.legend()
ax.set_title("MLP on digits, 8 workers")
fig.tight_layout()
fig.savefig(OUT / "tour_training.png", dpi=110)

# %% [markdown]
# ## 4. Audit the wire
#
# `wire.comm_plan` predicts every collective a reducing transform runs per
# step, before anything compiles; `wire.hlo_collectives` reads the collectives
# out of the compiled step. The two agree, and no float array of a
# parameter's size crosses the axis.

# %%
batch0 = batch(0)
print(f"{'method':20s} {'predicted B':>12s} {'compiled B':>11s} {'vs dense':>9s}  collectives")
for name, c in RUNS.items():
  dp, p, s = steps[name]
  plan = wire.comm_plan(commopt.compressed_mean(c, axis_name="data"), params, 8)
  compiled = wire.hlo_collectives(dp, p, s, dp.place_batch(batch0))
  # Beyond the optimizer's exchange the step all-reduces a few scalars of its
  # own (the workers' agreement to skip a non-finite step): listed apart.
  own = [x for x in compiled if x.kind == "all-reduce" and all(s == () for s in x.shapes)]
  moved = [x for x in compiled if x not in own]
  kinds = sorted({f"{x.kind} {'/'.join(x.dtypes)}" for x in moved})
  print(f"{name:20s} {plan.contributed_bytes:12,d} {wire.total_bytes(moved):11,d} "
        f"{plan.ratio:8.1f}x  {', '.join(kinds)}  (+ {wire.total_bytes(own)} B of step scalars)")

# %% [markdown]
# `predicted B` is what one worker puts into the collectives per step;
# `compiled B` is the same quantity read from the compiled program (XLA may
# merge the small dense leaves' all-reduces into one). The compressed methods
# move uint32 words (signs, indices), float32 scales and PowerSGD's
# factors, never a float32 array the size of a weight matrix. `vs dense` is
# bytes *sent* under the ring model: a dense all-reduce sends about twice the
# gradient whatever the number of workers, while `gather` sends each payload
# to the N − 1 others, which is why scaled_sign's 32× smaller payload saves
# 7.7× at 8 workers; `strategy="two_phase"` sends about two payloads instead
# (see the wire notebook).
