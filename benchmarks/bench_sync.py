"""Synchronisation modes on the demo CNN: training loss against bytes sent and against steps.

Every mode trains the digits CNN (parameters only, 1.07M) over ``--workers``
simulated CPU devices from the same start with the same batches (each worker
its own rows), under ``commopt.data_parallel`` (``local_params=True`` for the
modes that keep parameters per worker):

- dense BSP: the mean gradient every step, momentum SGD;
- local SGD, H = ``--period``: the same momentum SGD on each worker, parameters
  averaged every H steps;
- DiLoCo, H: momentum SGD inside, ``diloco``'s default outer step; dense
  and with 4-bit pseudo-gradients (``int_quant(bits=4)``, unbiased, so no
  residual is kept): Nesterov SGD (0.7, 0.9); with top-k (``--top-k`` of each
  leaf, with error feedback): ``sgd(1.0)``;
- Streaming DiLoCo, H: 2 fragments, merged 1 step late with mixing 0.5, 4-bit;
- EASGD, τ = H, β = 0.9;
- SSP with staleness s = 1, 4, 16 (uniform delays; every step exchanges).

Bytes are what one worker sends (ring model, ``commopt.wire.comm_plan`` of
the mode's exchange) summed over the steps that exchange, counted from the
state's own synchronisation counter (for Streaming DiLoCo, each fragment's
share on its own steps). The table gives the final training loss
(mean of the last 10 steps), test accuracy of the global model (the anchor,
centre or server parameters; the synchronised parameters for BSP), the
synchronisations, the megabytes sent, and dense BSP's loss when it had sent
as many bytes (the comparison at equal bytes); the plot, loss against bytes
and against steps.

    python benchmarks/bench_sync.py                    # ~5 min on 2 cores
    python benchmarks/bench_sync.py --steps 40 --modes "dense BSP,DiLoCo H"
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

FRAGMENTS = 2
"""Streaming DiLoCo's fragments."""

MODES = ("dense BSP", "local SGD H", "DiLoCo H", "DiLoCo H top_k", "DiLoCo H int4",
         "Streaming DiLoCo H int4", "EASGD H", "SSP s=1", "SSP s=4", "SSP s=16")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from: {MODES}")
  p.add_argument("--workers", type=int, default=8)
  p.add_argument("--steps", type=int, default=264, help="training steps (a multiple of --period)")
  p.add_argument("--period", type=int, default=8, help="H, τ: steps between synchronisations")
  p.add_argument("--batch", type=int, default=128, help="global batch")
  p.add_argument("--lr", type=float, default=0.05)
  p.add_argument("--top-k", type=float, default=0.02, help="top_k's fraction of each leaf")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
  args = p.parse_args(argv)
  args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
  bad = [m for m in args.modes if m not in MODES]
  if bad:
    p.error(f"--modes: unknown {bad}; valid: {list(MODES)}")
  if args.steps % args.period:
    p.error(f"--steps ({args.steps}) must be a multiple of --period ({args.period}), so every "
            "run ends on a synchronisation")
  return args


def make(mode: str, args):
  """(optax transform, whether parameters are per worker, what ``wire.comm_plan`` reads)."""
  import optax

  import commopt
  inner = optax.sgd(args.lr, momentum=0.9)
  h = args.period
  identity = commopt.compressors.make("identity")
  if mode == "dense BSP":
    reducer = commopt.compressed_mean(identity, axis_name="data")
    return optax.chain(reducer, inner), False, reducer
  if mode == "local SGD H":
    tx = commopt.local_sgd(inner, axis_name="data", period=h)
  elif mode.startswith("DiLoCo H"):
    c = {"DiLoCo H": None, "DiLoCo H top_k": commopt.top_k(args.top_k),
         "DiLoCo H int4": commopt.int_quant(bits=4)}[mode]
    # 4-bit payloads gathered from 8 workers would cost half a dense all-reduce;
    # two_phase sends about two payloads whatever the number of workers.
    tx = commopt.diloco(inner, axis_name="data", period=h, compressor=c,
                        strategy="two_phase" if mode.endswith("int4") else "auto")
  elif mode == "Streaming DiLoCo H int4":
    tx = commopt.streaming_diloco(inner, axis_name="data", period=h, fragments=FRAGMENTS,
                                  delay=1, mixing=0.5, compressor=commopt.int_quant(bits=4),
                                  strategy="two_phase")
  elif mode == "EASGD H":
    tx = commopt.transforms.easgd(inner, axis_name="data", period=h, alpha=0.9 / args.workers)
  else:
    tx = commopt.transforms.stale(inner, axis_name="data", max_staleness=int(mode.split("=")[1]))
  return tx, True, tx


def global_params(mode, params, state):
  """The model a mode would ship: BSP's parameters, the anchor, the centre, the server's."""
  inner = state.inner_state
  if mode == "dense BSP":
    return params
  if mode.startswith("EASGD"):
    return inner.centre
  if mode.startswith("SSP"):
    return inner.params
  return inner.anchor


def syncs(mode, state, steps):
  """Exchanges so far: BSP and SSP exchange every step."""
  if mode == "dense BSP" or mode.startswith("SSP"):
    return steps
  return int(state.inner_state.syncs)


def fragment_bytes(plan, params) -> list[float]:
  """Bytes one worker sends per exchange of each Streaming DiLoCo fragment (ring model)."""
  import jax

  import commopt
  names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  owner = dict(zip(names, commopt.transforms.fragment_of(len(names), FRAGMENTS)))
  out = [0.0] * FRAGMENTS
  for c in plan.collectives:
    out[owner[c.leaf]] += c.sent_bytes
  return out


def sent_at(mode, step, synced, per_sync, per_fragment, period):
  """Bytes one worker sends at ``step`` (0-based): what the exchanges that ran carry."""
  if mode.startswith("Streaming"):
    return sum(b for p, b in enumerate(per_fragment)
               if (step + 1 + p * period // FRAGMENTS) % period == 0)
  return per_sync if synced else 0.0


def bsp_loss_at(bsp, sent: float):
  """Dense BSP's training loss (mean of its last 10 steps) once it had sent ``sent`` bytes
  per worker, or None without a BSP run or before its first step's bytes."""
  if not bsp:
    return None
  steps = sum(1 for b in bsp["bytes_sent"] if b <= sent)
  if steps == 0:
    return None
  part = bsp["losses"][max(0, steps - 10):steps]
  return sum(part) / len(part)


def main(argv=None):
  args = parse_args(argv)
  os.environ.setdefault("XLA_FLAGS", "")
  import jax
  jax.config.update("jax_num_cpu_devices", args.workers)
  import jax.numpy as jnp
  import numpy as np
  from tqdm.auto import tqdm

  import commopt
  from commopt import wire
  sys.path.insert(0, str(ROOT / "examples"))
  from digits_cnn import load_digits_split, model_fns

  x_train, y_train, x_test, y_test = load_digits_split(args.seed)
  params, logits_fn, loss_fn = model_fns(args.seed)
  params = jax.tree.map(np.asarray, params)
  mesh = jax.make_mesh((args.workers,), ("data",))
  rng = np.random.default_rng(args.seed)
  order = [rng.choice(len(x_train), args.batch, replace=False) for _ in range(args.steps)]
  accuracy = jax.jit(lambda p: jnp.mean(jnp.argmax(logits_fn(p, x_test), -1) == y_test))
  results = {}
  t0 = time.perf_counter()
  for mode in args.modes:
    tx, local, planned = make(mode, args)
    dp = commopt.data_parallel(loss_fn, tx, mesh, local_params=local)
    reducer_plan = wire.comm_plan(planned, params, args.workers)
    per_sync = reducer_plan.sent_bytes
    per_fragment = fragment_bytes(reducer_plan, params)
    p = dp.place_params(params)
    state = dp.init(params)
    losses, sent, count, total = [], [], 0, 0.0
    for step in tqdm(range(args.steps), desc=mode, leave=False, file=sys.stdout):
      idx = order[step]
      p, state, loss = dp.step(p, state, {"x": x_train[idx], "y": y_train[idx]})
      losses.append(float(np.mean(loss)))
      before, count = count, syncs(mode, state, step + 1)
      total += sent_at(mode, step, count > before, per_sync, per_fragment, args.period)
      sent.append(total)
    model = jax.tree.map(lambda x: np.asarray(x, np.float32), global_params(mode, p, state))
    acc = float(accuracy(model))
    results[mode] = {"losses": losses, "bytes_sent": sent, "syncs": count,
                     "bytes_per_sync": per_sync, "dense_bytes_per_step": reducer_plan.dense_sent,
                     "test_accuracy": acc, "final_loss": float(np.mean(losses[-10:]))}
    print(f"{mode:>24}: loss {results[mode]['final_loss']:.4f}  test acc {acc:.4f}  "
          f"{count} exchanges  {sent[-1] / 1e6:9.2f} MB sent/worker", flush=True)

  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  dense = results.get("dense BSP", {}).get("bytes_sent", [None])[-1]
  lines = ["| mode | final loss | test acc | exchanges | MB sent/worker | × dense bytes | "
           "dense BSP's loss at these bytes |", "|---|---|---|---|---|---|---|"]
  for mode, r in results.items():
    ratio = f"{r['bytes_sent'][-1] / dense:.3f}" if dense else "-"
    at = bsp_loss_at(results.get("dense BSP"), r["bytes_sent"][-1])
    r["dense_bsp_loss_at_these_bytes"] = at
    lines.append(f"| {mode} | {r['final_loss']:.4f} | {r['test_accuracy']:.4f} | {r['syncs']} | "
                 f"{r['bytes_sent'][-1] / 1e6:.2f} | {ratio} | "
                 f"{'-' if at is None else f'{at:.4f}'} |")
  table = "\n".join(lines)
  print(table)
  (out / "sync.json").write_text(json.dumps(
      {"config": vars(args), "results": results, "seconds": time.perf_counter() - t0}, indent=1))
  (out / "sync.md").write_text(
      f"Digits CNN, {args.workers} workers, {args.steps} steps, H = {args.period}, global "
      f"batch {args.batch}.\n\n{table}\n")
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
  for mode, r in results.items():
    smooth = np.convolve(r["losses"], np.ones(5) / 5, mode="valid")
    a.plot(np.asarray(r["bytes_sent"][4:]) / 1e6, smooth, label=mode)
    b.plot(np.arange(5, len(r["losses"]) + 1), smooth, label=mode)
  a.set_xscale("log")
  a.set_xlabel("cumulative MB sent per worker (ring model)")
  b.set_xlabel("step")
  for ax in (a, b):
    ax.set_ylabel("training loss (5-step mean)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
  b.legend(fontsize=7)
  fig.suptitle(f"digits CNN, {args.workers} workers: synchronisation modes")
  fig.tight_layout()
  fig.savefig(out / "sync.png", dpi=120)
  print(f"wrote {out / 'sync.json'}, {out / 'sync.md'} and {out / 'sync.png'} "
        f"in {time.perf_counter() - t0:.0f} s")
  return results


if __name__ == "__main__":
  main()
