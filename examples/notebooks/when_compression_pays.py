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
# # When compression pays
#
# Compression trades compute (encode, decode) for bytes. Whether a step gets
# faster depends on the network and on the number of workers. This notebook
# measures what the trade costs on this machine and prices the bytes with
# the α-β model (`commopt.sim.network`):
#
# 1. **Compute**: one `data_parallel` step of an MLP on one device, per method
#    (gradient, encode and decode; the identity compressor is the dense baseline),
#    the fastest of interleaved timed rounds.
# 2. **Steps to a target loss**: the same MLP trained on 8 simulated workers.
# 3. **Step time and time to the target** against bandwidth (1 to 100 Gbit/s)
#    and worker count (8 to 1024): measured compute plus the model's
#    communication for each method's plan at that scale, on a ring of links
#    with 5 µs per message.
#
# What it assumes: compute does not overlap communication; steps to the target
# do not change with the worker count (measured at 8); every link has the
# same rate. `benchmarks/network_model.py` compares the model with
# measurements on a shaped loopback.
#
# Set `COMMOPT_NOTEBOOK_SMALL=1` for a small MLP, three methods and a short run (seconds).

# %%
import pathlib
import statistics
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import optax

import commopt
from commopt.sim import network

# examples/, for the digits and the MLP (as a script, or in Jupyter from this folder).
HERE = pathlib.Path(globals().get("__file__", pathlib.Path.cwd() / "notebook.py")).resolve().parent
sys.path.insert(0, str(HERE.parent))
from digits_cnn import load_digits_flat, mlp_fns, notebook_settings  # noqa: E402

SMALL, OUT = notebook_settings()
HIDDEN = 256 if SMALL else 2048
STEPS = 12 if SMALL else 60
TIMED = 3 if SMALL else 20
TARGET = 2.0 if SMALL else 0.3
ROWS = 32                                      # per worker per step
LATENCY = 5e-6
BANDWIDTHS = np.geomspace(1, 100, 9 if SMALL else 25)
WORKERS = (8, 64, 1024)

METHODS = {
    "dense": ("identity", {}, "auto"),
    "scaled_sign/gather": ("scaled_sign", {}, "gather"),
    "scaled_sign/two_phase": ("scaled_sign", {}, "two_phase"),
    "top_k(0.01)/two_phase": ("top_k", {"ratio": 0.01}, "two_phase"),
    "qsgd/two_phase": ("qsgd", {}, "two_phase"),
    "power_sgd(2)": ("power_sgd", {"rank": 2}, "auto"),
}
if SMALL:                                      # one of each kind: dense, quantised, low rank
  METHODS = {k: METHODS[k] for k in ("dense", "scaled_sign/two_phase", "power_sgd(2)")}


def reducer(label, axis="data"):
  name, opts, strategy = METHODS[label]
  # Dense has nothing to feed back; QSGD runs as published, without error
  # feedback (its variance makes error feedback diverge).
  return commopt.compressed_mean(commopt.compressors.make(name, **opts), axis_name=axis,
                                 strategy=strategy, error_feedback=name not in ("identity", "qsgd"))


# %% [markdown]
# ## The model and the data

# %%
x_all, y_all = load_digits_flat()
params, loss_fn = mlp_fns(HIDDEN)          # the MLP of benchmarks/bench_network.py


def batch(step, workers):
  idx = np.random.default_rng([step, 7]).choice(len(x_all), ROWS * workers, replace=False)
  return {"x": x_all[idx], "y": y_all[idx]}


print(f"MLP 64-{HIDDEN}-{HIDDEN}-10: {sum(x.size for x in jax.tree.leaves(params)) / 1e6:.2f} M "
      "parameters")

# %% [markdown]
# ## 1. Compute per step, on one device

# %%
# Every method is compiled first, then timed in interleaved rounds, so no method
# runs on a colder or busier machine than another; the fastest of the rounds
# is the step's cost (the rest is interference from other work on the machine).
one = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
runs = {}
for label in METHODS:
  tx = optax.chain(reducer(label), optax.sgd(0.02, momentum=0.9))
  dp = commopt.data_parallel(loss_fn, tx, one)
  p, s = dp.place_params(params), dp.init(params)
  p, s, _ = dp.step(p, s, batch(0, 1))               # compiles
  runs[label] = [dp, jax.block_until_ready((p, s))]
times = {label: [] for label in METHODS}
for step in range(TIMED):
  for label, run in runs.items():
    dp, (p, s) = run
    t0 = time.perf_counter()
    p, s, _ = dp.step(p, s, batch(step, 1))
    run[1] = jax.block_until_ready((p, s))
    times[label].append(time.perf_counter() - t0)
compute = {label: min(t) for label, t in times.items()}
for label in METHODS:
  print(f"{label:24s} {compute[label] * 1e3:8.2f} ms (median {statistics.median(times[label]) * 1e3:.2f})")

# %% [markdown]
# ## 2. Steps to the target loss, 8 simulated workers

# %%
eight = jax.make_mesh((8,), ("data",))


def smoothed(v, w=5):
  return [float(np.mean(v[max(0, i - w + 1):i + 1])) for i in range(len(v))]


steps_to_target, curves = {}, {}
for label in METHODS:
  tx = optax.chain(reducer(label), optax.sgd(0.02, momentum=0.9))
  dp = commopt.data_parallel(loss_fn, tx, eight)
  p, s = dp.place_params(params), dp.init(params)
  losses = []
  for step in range(STEPS):
    p, s, loss = dp.step(p, s, batch(step, 8))
    losses.append(float(np.mean(loss)))
  curves[label] = smoothed(losses)
  steps_to_target[label] = next((i + 1 for i, v in enumerate(curves[label]) if v <= TARGET), None)
  print(f"{label:24s} loss {losses[0]:.3f} -> {curves[label][-1]:.3f}, "
        f"{steps_to_target[label] or 'not reached'} steps to {TARGET}")

# %% [markdown]
# ## 3. Step time and time to the target against bandwidth and workers

# %%
def step_time(label, gbit, workers):
  net = network.Network(network.Link.gbit(gbit, LATENCY))
  return network.predict(reducer(label), params, workers, net, compute_s=compute[label]).step_s


grid = {(label, n): [step_time(label, b, n) for b in BANDWIDTHS]
        for label in METHODS for n in WORKERS}

fig, axes = plt.subplots(2, len(WORKERS), figsize=(5 * len(WORKERS), 8), squeeze=False)
for col, n in enumerate(WORKERS):
  for i, label in enumerate(METHODS):
    t = np.asarray(grid[label, n])
    axes[0, col].plot(BANDWIDTHS, t * 1e3, label=label, color=f"C{i}")
    if steps_to_target[label]:
      axes[1, col].plot(BANDWIDTHS, t * steps_to_target[label], label=label, color=f"C{i}")
  axes[0, col].set_title(f"{n} workers")
  axes[0, col].set_ylabel("step time (ms)")
  axes[1, col].set_ylabel(f"seconds to training loss {TARGET}")
  for ax in axes[:, col]:
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link bandwidth (Gbit/s)")
    ax.grid(True, which="both", alpha=0.3)
axes[0, 0].legend(fontsize=8)
fig.suptitle(f"MLP {HIDDEN} wide: measured compute + α-β communication (ring, α = "
             f"{LATENCY * 1e6:g} µs)")
fig.tight_layout()
fig.savefig(OUT / "when_compression_pays.png", dpi=110)

# %% [markdown]
# ## Where each method stops paying
#
# The bandwidth below which a method's step is faster than dense, per worker
# count ("always": at every bandwidth of the range; "never": at none).

# %%
lines = ["| method | " + " | ".join(f"{n} workers" for n in WORKERS) + " |",
         "|---|" + "---|" * len(WORKERS)]
for label in METHODS:
  if label == "dense":
    continue
  cells = []
  for n in WORKERS:
    wins = np.asarray(grid[label, n]) < np.asarray(grid["dense", n])
    if wins.all():
      cells.append("always")
    elif not wins.any():
      cells.append("never")
    else:
      cells.append(f"below {BANDWIDTHS[~wins].min():.1f} Gbit/s" if wins[0] else
                   f"above {BANDWIDTHS[wins].min():.1f} Gbit/s")
  lines.append(f"| {label} | " + " | ".join(cells) + " |")
crossover = "\n".join(lines)
print(crossover)
(OUT / "when_compression_pays.md").write_text(crossover + "\n")
print(f"wrote {OUT / 'when_compression_pays.png'} and {OUT / 'when_compression_pays.md'}")
