"""Train a Flax (nnx) CNN on the digits dataset with compressed data parallelism.

Each compressor trains the same model from the same start on simulated CPU
devices (8 by default); per epoch it prints the loss and test accuracy, and
at the start the bytes each worker sends per step, analytic and audited from
the compiled step's HLO, against dense. It writes a plot of training loss
against cumulative bytes sent per worker, and the metrics as JSON.

    python examples/train.py                               # dense vs scaled_sign, top_k, power_sgd
    python examples/train.py --compressors top_k --ratio 0.05 --epochs 5
    python examples/train.py --compressors power_sgd --rank 4 --workers 4
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--compressors", default="identity,scaled_sign,top_k,power_sgd",
                 help="comma-separated registry names (identity is the dense baseline)")
  p.add_argument("--workers", type=int, default=8, help="simulated CPU devices (data axis size)")
  p.add_argument("--epochs", type=int, default=12)
  p.add_argument("--batch-size", type=int, default=128, help="global batch, split over workers")
  p.add_argument("--lr", type=float, default=0.05)
  p.add_argument("--momentum", type=float, default=0.9)
  p.add_argument("--ratio", type=float, default=None, help="top_k: fraction of each leaf sent")
  p.add_argument("--rank", type=int, default=None, help="power_sgd: rank")
  p.add_argument("--dtype", default=None, help="cast: wire dtype (bfloat16, float16)")
  p.add_argument("--no-error-feedback", action="store_true")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="runs", help="folder for the plot and metrics")
  p.add_argument("--max-steps", type=int, default=None, help="stop each run early (smoke tests)")
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  if args.workers < 1:
    sys.exit(f"--workers must be >= 1, got {args.workers}")
  os.environ.setdefault("XLA_FLAGS", "")
  import jax
  jax.config.update("jax_num_cpu_devices", args.workers)
  import jax.numpy as jnp
  import numpy as np
  import optax
  from tqdm.auto import tqdm

  import commopt
  from commopt import wire
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
  from digits_cnn import load_digits_split, model_fns

  if len(jax.devices()) < args.workers:
    sys.exit(f"--workers {args.workers} needs that many devices; this backend has "
             f"{len(jax.devices())} ({jax.default_backend()}).")
  names = [n.strip() for n in args.compressors.split(",") if n.strip()]
  for n in names:
    if n not in commopt.compressors.REGISTRY:
      sys.exit(f"--compressors: unknown {n!r}; valid: {sorted(commopt.compressors.REGISTRY)}")

  x_train, y_train, x_test, y_test = load_digits_split(args.seed)
  batch = args.batch_size - args.batch_size % args.workers
  steps_per_epoch = len(x_train) // batch
  init_params, logits_fn, loss_fn = model_fns(args.seed)

  @jax.jit
  def accuracy(params, images, labels):
    return jnp.mean(jnp.argmax(logits_fn(params, images), -1) == labels)

  mesh = jax.make_mesh((args.workers,), ("data",), devices=jax.devices()[:args.workers])
  out_dir = pathlib.Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  results = {}
  print(f"{len(x_train)} training images, {len(x_test)} test; {args.workers} workers, "
        f"global batch {batch}, {steps_per_epoch} steps/epoch, {args.epochs} epochs")

  for name in names:
    compressor = commopt.compressors.make(name, ratio=args.ratio, rank=args.rank, dtype=args.dtype)
    tx = optax.chain(
        commopt.compressed_mean(compressor, "data", error_feedback=not args.no_error_feedback),
        optax.sgd(args.lr, momentum=args.momentum))
    dp = commopt.data_parallel(loss_fn, tx, mesh)
    params = init_params
    state = dp.init(params)
    first = {"x": x_train[:batch], "y": y_train[:batch]}

    report = wire.payload_bytes(compressor, params)
    audit = wire.hlo_collectives(dp, params, state, first)
    dense_sent = 2 * (args.workers - 1) / args.workers * report.dense
    sent = wire.total_bytes(audit, "sent_bytes")
    print(f"\n== {compressor.name}: payload {report.total / 1e3:,.1f} kB/worker/step "
          f"(HLO audit {wire.total_bytes(audit) / 1e3:,.1f} kB, {len(audit)} collectives) "
          f"vs dense {report.dense / 1e3:,.1f} kB: {report.ratio:.1f}x smaller; "
          f"ring-model bytes sent {sent / 1e3:,.1f} kB vs dense all-reduce "
          f"{dense_sent / 1e3:,.1f} kB: {dense_sent / max(sent, 1):.1f}x")

    history = {"step": [], "loss": [], "bytes_sent": [], "epoch_acc": [], "epoch_loss": []}
    rng = np.random.default_rng(args.seed)
    step, t0 = 0, time.perf_counter()
    for epoch in range(args.epochs):
      perm = rng.permutation(len(x_train))
      losses = []
      bar = tqdm(range(steps_per_epoch), desc=f"{name} epoch {epoch + 1}/{args.epochs}",
                 leave=False, file=sys.stdout, dynamic_ncols=True)
      for i in bar:
        idx = perm[i * batch:(i + 1) * batch]
        params, state, loss = dp.step(params, state, {"x": x_train[idx], "y": y_train[idx]})
        step += 1
        loss = float(np.mean(loss))
        losses.append(loss)
        history["step"].append(step)
        history["loss"].append(loss)
        history["bytes_sent"].append(step * sent)
        bar.set_postfix(loss=f"{loss:.3f}")
        if args.max_steps and step >= args.max_steps:
          break
      acc = float(accuracy(params, x_test, y_test))
      history["epoch_acc"].append(acc)
      history["epoch_loss"].append(float(np.mean(losses)))
      print(f"{name:>12} epoch {epoch + 1:3d}  loss {np.mean(losses):.4f}  test acc {acc:.4f}  "
            f"sent {step * sent / 1e6:8.2f} MB/worker")
      if args.max_steps and step >= args.max_steps:
        break
    history.update(seconds=time.perf_counter() - t0, payload_bytes=report.total,
                   dense_bytes=report.dense, audited_bytes=wire.total_bytes(audit),
                   sent_bytes_per_step=sent, dense_sent_bytes_per_step=dense_sent,
                   compressor=compressor.name)
    results[name] = history

  (out_dir / "train_metrics.json").write_text(json.dumps(results, indent=1))
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name, h in results.items():
    ax.plot(np.asarray(h["bytes_sent"]) / 1e6, h["loss"],
            label=f"{h['compressor']} (acc {h['epoch_acc'][-1]:.3f})")
  ax.set_xscale("log")
  ax.set_xlabel("cumulative MB sent per worker (ring model, from the HLO audit)")
  ax.set_ylabel("training loss")
  ax.set_title(f"digits CNN, {args.workers} workers: loss against bytes on the wire")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(loc="lower left")
  fig.tight_layout()
  fig.savefig(out_dir / "train_loss_vs_bytes.png", dpi=120)
  print(f"\nwrote {out_dir / 'train_loss_vs_bytes.png'} and {out_dir / 'train_metrics.json'}")
  print(f"{'compressor':>22} {'test acc':>9} {'payload kB':>11} {'x smaller':>10} {'seconds':>8}")
  for name, h in results.items():
    print(f"{h['compressor']:>22} {h['epoch_acc'][-1]:9.4f} {h['payload_bytes'] / 1e3:11.1f} "
          f"{h['dense_bytes'] / h['payload_bytes']:10.1f} {h['seconds']:8.1f}")
  return results


if __name__ == "__main__":
  main()
