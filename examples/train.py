"""Train a Flax (nnx) CNN on the digits dataset with compressed data parallelism.

The CNN has batch norm and dropout and trains through
``commopt.nnx_data_parallel``: batch statistics are averaged across workers
each step and every worker draws its own dropout masks. Each compressor trains
the same model from the same start on simulated CPU
devices (8 by default); per epoch it prints the loss and test accuracy, and
at the start the bytes each worker sends per step, analytic and audited from
the compiled step's HLO, against dense. It writes a plot of training loss
against cumulative bytes sent per worker, and the metrics as JSON.

    python examples/train.py                               # dense vs scaled_sign, top_k, power_sgd
    python examples/train.py --compressors top_k --ratio 0.05 --epochs 5
    python examples/train.py --compressors power_sgd --rank 4 --workers 4
    python examples/train.py --compressors identity,qsgd,int_quant,natural,signum --epochs 4
    python examples/train.py --strategy two_phase       # ~2 payloads per worker, not N-1

Besides the registry's compressors (run through compressed_mean with error
feedback, then SGD with momentum), ``signum`` runs signSGD with majority vote
on each worker's momentum: only sign bits cross the wire.
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
                 help="comma-separated registry names (identity is the dense baseline), "
                      "signum (majority vote of worker momentum signs) or dgc (deep "
                      "gradient compression with its sparsity warm-up)")
  p.add_argument("--workers", type=int, default=8, help="simulated CPU devices (data axis size)")
  p.add_argument("--epochs", type=int, default=12)
  p.add_argument("--batch-size", type=int, default=128, help="global batch, split over workers")
  p.add_argument("--lr", type=float, default=0.05)
  p.add_argument("--momentum", type=float, default=0.9)
  p.add_argument("--ratio", type=float, default=None, help="top_k: fraction of each leaf sent")
  p.add_argument("--rank", type=int, default=None, help="power_sgd: rank")
  p.add_argument("--dtype", default=None, help="cast: wire dtype (bfloat16, float16)")
  p.add_argument("--levels", type=int, default=None, help="qsgd, adaptive_levels: levels")
  p.add_argument("--bits", type=int, default=None, help="int_quant: 4 or 8")
  p.add_argument("--block-size", type=int, default=None,
                 help="scaled_sign, int_quant: coordinates per scale")
  p.add_argument("--bucket-size", type=int, default=None, help="qsgd: coordinates per norm")
  p.add_argument("--clip", type=float, default=None, help="terngrad: clipping factor")
  p.add_argument("--sign-lr", type=float, default=1e-3, help="signum: step size")
  p.add_argument("--tau", type=float, default=None, help="threshold: the threshold tau")
  p.add_argument("--drop-ratio", type=float, default=None,
                 help="gradient_dropping: fraction of coordinates dropped")
  p.add_argument("--bin-size", type=int, default=None, help="adacomp: bin size")
  p.add_argument("--dgc-warmup-epochs", type=int, default=4,
                 help="dgc: epochs of sparsity warm-up (0: none)")
  p.add_argument("--clip-norm", type=float, default=None, help="dgc: global gradient clip norm")
  p.add_argument("--no-error-feedback", action="store_true")
  p.add_argument("--strategy", default="auto", choices=["auto", "psum", "gather", "two_phase"],
                 help="compressed_mean's reduction (compressors that cannot use it run 'auto')")
  p.add_argument("--dropout", type=float, default=0.25, help="dropout rate before the last layer")
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
  from flax import nnx
  from digits_cnn import CNN, cross_entropy, load_digits_split

  if len(jax.devices()) < args.workers:
    sys.exit(f"--workers {args.workers} needs that many devices; this backend has "
             f"{len(jax.devices())} ({jax.default_backend()}).")
  names = [n.strip() for n in args.compressors.split(",") if n.strip()]
  valid = sorted(commopt.compressors.REGISTRY) + ["signum", "dgc"]
  for n in names:
    if n not in valid:
      sys.exit(f"--compressors: unknown {n!r}; valid: {valid}")

  x_train, y_train, x_test, y_test = load_digits_split(args.seed)
  batch = args.batch_size - args.batch_size % args.workers
  steps_per_epoch = len(x_train) // batch
  model = CNN(nnx.Rngs(args.seed), batch_norm=True, dropout=args.dropout)
  model.train()
  graphdef = nnx.graphdef(model)

  @jax.jit
  def accuracy(state, images, labels):
    trained = nnx.merge(graphdef, state.params, state.model_state)
    trained.eval()                                  # running statistics, no dropout
    return jnp.mean(jnp.argmax(trained(images), -1) == labels)

  mesh = jax.make_mesh((args.workers,), ("data",), devices=jax.devices()[:args.workers])
  out_dir = pathlib.Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  results = {}
  print(f"{len(x_train)} training images, {len(x_test)} test; {args.workers} workers, "
        f"global batch {batch}, {steps_per_epoch} steps/epoch, {args.epochs} epochs")

  def optimizer(name):
    """(label, optax transform, the reducing transform inside it, DGC's schedule)."""
    if name == "signum":
      vote = commopt.majority_vote("data")
      tx = optax.chain(optax.trace(decay=args.momentum), vote, optax.scale(-args.sign_lr))
      return "signum(majority vote)", tx, vote, None
    if name == "dgc":
      e = args.dgc_warmup_epochs
      densities = commopt.transforms.DGC_WARMUP_DENSITIES
      densities = densities if e else densities[-1:]
      # Four boundaries spread over the warm-up epochs (they must increase strictly).
      boundaries = tuple(max(i, steps_per_epoch * e * i // 4) for i in range(1, 5)) if e else ()
      reducer = commopt.dgc("data", densities=densities, boundaries=boundaries,
                            momentum=args.momentum, clip_norm=args.clip_norm)
      tx = optax.chain(reducer, optax.sgd(args.lr))
      # Bytes are reported for the final (steady-state) density.
      return f"dgc(density {densities[-1]})", tx, reducer, (densities, boundaries)
    flags = dict(ratio=args.ratio, rank=args.rank, dtype=args.dtype, levels=args.levels,
                 bits=args.bits, block_size=args.block_size, bucket_size=args.bucket_size,
                 clip=args.clip, tau=args.tau, drop_ratio=args.drop_ratio,
                 bin_size=args.bin_size)
    # Each compressor gets the flags it takes (the others are for other compressors).
    compressor = commopt.compressors.make(
        name, **{k: v for k, v in flags.items() if k in commopt.compressors.options(name)})
    ef = not args.no_error_feedback
    strategy = args.strategy
    # two_phase re-encodes chunks (per-leaf payloads); psum sums payloads (linear ones).
    needs = {"two_phase": "per_leaf", "psum": "linear"}.get(strategy)
    if needs and needs not in compressor.capabilities:
      print(f"{compressor.name}: strategy {strategy!r} needs a {needs} compressor, and its "
            f"capabilities are {sorted(compressor.capabilities)}; using 'auto'")
      strategy = "auto"
    label = compressor.name if strategy == "auto" else f"{compressor.name} [{strategy}]"
    reducer = commopt.compressed_mean(compressor, "data", error_feedback=ef, strategy=strategy)
    tx = optax.chain(reducer, optax.sgd(args.lr, momentum=args.momentum))
    return label, tx, reducer, None

  for name in names:
    label, tx, reducer, schedule = optimizer(name)
    trainer = commopt.nnx_data_parallel(model, cross_entropy, tx, mesh)
    state = trainer.init(model)                     # every run starts from the same model
    params = state.params
    first = {"x": x_train[:batch], "y": y_train[:batch]}

    # What the reduction plans to send, before anything compiles; the audit checks it.
    report = wire.comm_plan(reducer, params, args.workers)
    audit = wire.hlo_collectives(trainer, state, first)
    # Besides the payload: the batch statistics' mean over workers (dense) and
    # the int32 flag that makes every worker agree to skip a non-finite step.
    stats_bytes = sum(x.size * x.dtype.itemsize
                      for x in jax.tree.leaves(nnx.state(model, nnx.BatchStat)))
    skip_flag_bytes = 4
    dense_sent = report.dense_sent
    payload = report.contributed_bytes
    sent = wire.total_bytes(audit, "sent_bytes")
    print(f"\n== {label}: payload {payload / 1e3:,.1f} kB/worker/step "
          f"(HLO audit {wire.total_bytes(audit) / 1e3:,.1f} kB in {len(audit)} collectives = "
          f"payload + {stats_bytes} B batch statistics + {skip_flag_bytes} B skip flag) "
          f"vs dense {report.dense_bytes / 1e3:,.1f} kB: "
          f"{report.dense_bytes / payload:.1f}x smaller; "
          f"ring-model bytes sent {sent / 1e3:,.1f} kB vs dense all-reduce "
          f"{dense_sent / 1e3:,.1f} kB: {dense_sent / max(sent, 1):.1f}x")
    sent_at = lambda step: sent
    if schedule:
      # The compiled step holds every warm-up stage's collectives (one switch
      # branch each) but runs one per step: count the stage that runs.
      stage_sent = {d: wire.comm_plan(commopt.top_k(d), params, args.workers).sent_bytes
                    for d in schedule[0]}
      sent_at = lambda step: stage_sent[commopt.transforms.warmup_density(step, *schedule)]
      print("   dgc: the audit above sums all warm-up stages; per step, the stage that runs sends "
            + ", ".join(f"{d:g}: {b / 1e3:,.1f} kB" for d, b in stage_sent.items()))
    if name == "qsgd":
      opts = dict(commopt.compressors.DEFAULTS["qsgd"])
      opts.update({k: v for k, v in (("levels", args.levels), ("bucket_size", args.bucket_size))
                   if v is not None})
      packed = {c.leaf for c in report.collectives if c.packed}
      elias = sum(commopt.compressors.qsgd_elias_bits(p.shape, **opts)
                  for path, p in jax.tree_util.tree_flatten_with_path(params)[0]
                  if jax.tree_util.keystr(path) in packed)
      print(f"   qsgd: Elias coding of the compressed leaves would cost at most "
            f"{elias / 8e3:,.1f} kB (paper's bound) against the fixed-width packing sent")

    history = {"step": [], "loss": [], "bytes_sent": [], "epoch_acc": [], "epoch_loss": []}
    rng = np.random.default_rng(args.seed)
    step, total_sent, t0 = 0, 0.0, time.perf_counter()
    for epoch in range(args.epochs):
      perm = rng.permutation(len(x_train))
      losses = []
      bar = tqdm(range(steps_per_epoch), desc=f"{name} epoch {epoch + 1}/{args.epochs}",
                 leave=False, file=sys.stdout, dynamic_ncols=True)
      for i in bar:
        idx = perm[i * batch:(i + 1) * batch]
        state, loss = trainer.step(state, {"x": x_train[idx], "y": y_train[idx]})
        total_sent += sent_at(step)
        step += 1
        loss = float(np.mean(loss))
        losses.append(loss)
        history["step"].append(step)
        history["loss"].append(loss)
        history["bytes_sent"].append(total_sent)
        bar.set_postfix(loss=f"{loss:.3f}")
        if args.max_steps and step >= args.max_steps:
          break
      acc = float(accuracy(state, x_test, y_test))
      history["epoch_acc"].append(acc)
      history["epoch_loss"].append(float(np.mean(losses)))
      print(f"{name:>12} epoch {epoch + 1:3d}  loss {np.mean(losses):.4f}  test acc {acc:.4f}  "
            f"sent {total_sent / 1e6:8.2f} MB/worker")
      if args.max_steps and step >= args.max_steps:
        break
    history.update(seconds=time.perf_counter() - t0, payload_bytes=payload,
                   dense_bytes=report.dense_bytes, audited_bytes=wire.total_bytes(audit),
                   model_state_sync_bytes=stats_bytes, skip_flag_bytes=skip_flag_bytes,
                   skipped_steps=int(state.opt_state.total_notfinite),
                   sent_bytes_per_step=sent, dense_sent_bytes_per_step=dense_sent,
                   compressor=label)
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
  width = max(len("compressor"), *(len(h["compressor"]) for h in results.values()))
  print(f"{'compressor':<{width}} {'test acc':>9} {'payload kB':>11} {'x smaller':>10} {'seconds':>8}")
  for name, h in results.items():
    print(f"{h['compressor']:<{width}} {h['epoch_acc'][-1]:9.4f} {h['payload_bytes'] / 1e3:11.1f} "
          f"{h['dense_bytes'] / h['payload_bytes']:10.1f} {h['seconds']:8.1f}")
  return results


if __name__ == "__main__":
  main()
