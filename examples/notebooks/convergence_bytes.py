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
# # Convergence against bytes
#
# Every family of commopt on the demo's digits CNN (1.07 M parameters, the
# 1,797 8×8 digits bundled with scikit-learn), 8 simulated workers, the same
# data order and the same number of steps for every method:
#
# - **dense**: the all-reduce every other method is measured against;
# - **quantisation**: scaled sign (1 bit and a scale, error feedback), QSGD
#   (unbiased, no error feedback), 4-bit integers;
# - **sparsification**: top-k and random-k at 1%, DGC;
# - **low rank**: PowerSGD at rank 2;
# - **synchronising less often**: local SGD and DiLoCo, every 8 steps;
# - **compressed optimizers**: 1-bit Adam.
#
# Bytes are what one worker sends per step under the ring model, as
# `commopt.wire.comm_plan` predicts them step by step (so warm-ups and
# periodic exchanges are counted when they happen); the tests check those
# predictions against the compiled programs. Plots: training loss against
# steps and against cumulative bytes sent, and test accuracy against total
# bytes.
#
# Set `COMMOPT_NOTEBOOK_SMALL=1` for four methods and a few steps.

# %%
import pathlib
import sys
import time

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
from digits_cnn import load_digits_split, model_fns, notebook_settings  # noqa: E402

SMALL, OUT = notebook_settings()
WORKERS = 8
ROWS = 16                                      # per worker per step: a global batch of 128
STEPS = 10 if SMALL else 360                   # 360 steps: about 32 epochs
LR, MOMENTUM, PERIOD = 0.05, 0.9, 8

# %% [markdown]
# ## The methods

# %%
def sgd():
  return optax.sgd(LR, momentum=MOMENTUM)


def mean_of(name, strategy="auto", error_feedback=True, **opts):
  """A compressed mean of the gradients, then momentum SGD: (the full tx, its reducing part)."""
  reducer = commopt.compressed_mean(commopt.compressors.make(name, **opts), axis_name="data",
                                    strategy=strategy, error_feedback=error_feedback)
  return optax.chain(reducer, sgd()), reducer


def sync(kind):
  outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
  tx = (commopt.local_sgd(sgd(), axis_name="data", period=PERIOD) if kind == "local_sgd"
        else commopt.diloco(sgd(), outer, axis_name="data", period=PERIOD))
  return tx, tx


def dgc():
  reducer = commopt.transforms.dgc(axis_name="data", momentum=MOMENTUM)
  return optax.chain(reducer, optax.sgd(LR)), reducer


def onebit_adam():
  # eps 1e-4: with 1e-8 a coordinate whose frozen variance is tiny takes a step of
  # lr·|1-bit value|/eps after the freeze, and this small CNN diverges.
  tx = commopt.onebit_adam(1e-3, 40, axis_name="data", eps=1e-4)
  return tx, tx


METHODS = {                                    # label: (family, builder)
    "dense": ("dense", lambda: mean_of("identity")),
    "scaled_sign": ("quantisation", lambda: mean_of("scaled_sign", "two_phase")),
    "qsgd": ("quantisation", lambda: mean_of("qsgd", "two_phase", error_feedback=False)),
    "int4": ("quantisation", lambda: mean_of("int_quant", "two_phase", bits=4)),
    "top_k(1%)": ("sparsification", lambda: mean_of("top_k", "two_phase", ratio=0.01)),
    "random_k(1%)": ("sparsification", lambda: mean_of("random_k", ratio=0.01)),
    "dgc": ("sparsification", dgc),
    "power_sgd(2)": ("low rank", lambda: mean_of("power_sgd", rank=2)),
    "local_sgd(H=8)": ("synchronising less", lambda: sync("local_sgd")),
    "diloco(H=8)": ("synchronising less", lambda: sync("diloco")),
    "onebit_adam": ("compressed optimizer", onebit_adam),
}
LOCAL = {"local_sgd(H=8)", "diloco(H=8)"}      # each worker keeps its own parameters
if SMALL:
  METHODS = {k: METHODS[k] for k in ("dense", "scaled_sign", "power_sgd(2)", "local_sgd(H=8)")}

# %% [markdown]
# ## Training
#
# The same batches for every method: step `t` draws its rows from a generator
# seeded with `t`. Test accuracy is measured on the held-out fifth of the
# digits, with the global model for the methods that keep per-worker
# parameters (`commopt.transforms.global_params`).

# %%
x_train, y_train, x_test, y_test = load_digits_split()
params, logits_fn, loss_fn = model_fns()


def batch(step):
  idx = np.random.default_rng([step, 11]).choice(len(x_train), WORKERS * ROWS, replace=False)
  return {"x": x_train[idx], "y": y_train[idx]}


def test_accuracy(p):
  return float(jnp.mean(jnp.argmax(logits_fn(p, x_test), -1) == y_test))


mesh = jax.make_mesh((WORKERS,), ("data",))
results = {}
for label, (family, build) in METHODS.items():
  tx, reducer = build()
  dp = commopt.data_parallel(loss_fn, tx, mesh, local_params=label in LOCAL)
  p, s = dp.place_params(params), dp.init(params)
  losses, sent = [], []
  t0 = time.perf_counter()
  for step in range(STEPS):
    p, s, loss = dp.step(p, s, batch(step))
    losses.append(float(np.mean(loss)))
    sent.append(wire.comm_plan(reducer, params, WORKERS, step=step).sent_bytes)
  final = commopt.transforms.global_params(s) if label in LOCAL else p
  results[label] = dict(family=family, losses=np.array(losses), bytes=np.cumsum(sent),
                        accuracy=test_accuracy(final))
  print(f"{label:16s} loss {losses[0]:.3f} -> {np.mean(losses[-10:]):.3f}  "
        f"test accuracy {results[label]['accuracy']:.3f}  "
        f"{np.sum(sent) / 1e6:8.2f} MB sent per worker  ({time.perf_counter() - t0:.0f} s)")

# %% [markdown]
# ## Loss against steps and against bytes

# %%
def smooth(v, w=10 if not SMALL else 2):
  return np.convolve(v, np.ones(w) / w, mode="valid"), w


fig, (by_step, by_bytes) = plt.subplots(1, 2, figsize=(14, 5))
styles = {"dense": "-", "quantisation": "--", "sparsification": "-.", "low rank": ":",
          "synchronising less": (0, (5, 1)), "compressed optimizer": (0, (1, 1))}
for i, (label, r) in enumerate(results.items()):
  y, w = smooth(r["losses"])
  kw = dict(label=label, color=f"C{i % 10}", linestyle=styles[r["family"]])
  by_step.plot(np.arange(len(y)) + w, y, **kw)
  by_bytes.plot(r["bytes"][w - 1:] / 1e6, y, **kw)
by_step.set_xlabel("step")
by_bytes.set_xlabel("MB sent per worker (cumulative, ring model)")
by_bytes.set_xscale("log")
for ax in (by_step, by_bytes):
  ax.set_ylabel(f"training loss ({w}-step mean)")
  ax.set_yscale("log")
  ax.grid(True, which="both", alpha=0.3)
by_bytes.legend(fontsize=8)
fig.suptitle(f"Digits CNN, {WORKERS} workers, global batch {WORKERS * ROWS}")
fig.tight_layout()
fig.savefig(OUT / "convergence_bytes.png", dpi=110)

# %% [markdown]
# ## Accuracy against the bytes it cost

# %%
fig, ax = plt.subplots(figsize=(7, 5))
for i, (label, r) in enumerate(results.items()):
  ax.scatter(r["bytes"][-1] / 1e6, r["accuracy"], color=f"C{i % 10}")
  ax.annotate(label, (r["bytes"][-1] / 1e6, r["accuracy"]), fontsize=8,
              xytext=(4, 4), textcoords="offset points")
ax.set_xscale("log")
ax.set_xlabel(f"MB sent per worker over {STEPS} steps")
ax.set_ylabel("test accuracy")
ax.grid(True, which="both", alpha=0.3)
fig.tight_layout()
fig.savefig(OUT / "convergence_accuracy.png", dpi=110)

dense = results["dense"]
print(f"{'method':16s} {'family':22s} {'final loss':>10s} {'accuracy':>9s} {'bytes vs dense':>15s}")
for label, r in results.items():
  print(f"{label:16s} {r['family']:22s} {np.mean(r['losses'][-10:]):10.3f} "
        f"{r['accuracy']:9.3f} {r['bytes'][-1] / dense['bytes'][-1]:15.4f}")
