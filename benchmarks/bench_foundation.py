"""Payload bytes and step time of every compressor on the demo model, against dense.

Runs the digits CNN's data-parallel step on simulated CPU devices (8 by
default). For each registered compressor it reports the payload one worker
contributes per step (analytic, and audited from the compiled HLO), the bytes
sent per worker under a ring model, and the median step time; ratios are
against the dense baseline (identity) measured in the same run.

    python benchmarks/bench_foundation.py [--workers 8] [--steps 30] [--out benchmarks/results]
    python benchmarks/bench_foundation.py --compressors identity,scaled_sign,top_k --strategies gather,two_phase
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workers", type=int, default=8)
  p.add_argument("--steps", type=int, default=30, help="timed steps per compressor")
  p.add_argument("--batch-size", type=int, default=256)
  p.add_argument("--compressors", default="identity,cast,scaled_sign,top_k,power_sgd")
  p.add_argument("--strategies", default="auto",
                 help="comma-separated compressed_mean strategies to run each compressor "
                      "with (auto, gather, two_phase, ...); unsupported pairs are skipped")
  p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
  args = p.parse_args(argv)

  import jax
  jax.config.update("jax_num_cpu_devices", args.workers)
  import numpy as np
  import jax.numpy as jnp
  import optax

  import commopt
  from commopt import wire
  sys.path.insert(0, str(ROOT / "examples"))
  from digits_cnn import load_digits_split, model_fns

  x, y, _, _ = load_digits_split(0)
  params, _, loss_fn = model_fns(0)
  mesh = jax.make_mesh((args.workers,), ("data",), devices=jax.devices()[:args.workers])
  batches = [{"x": x[i:i + args.batch_size], "y": y[i:i + args.batch_size]}
             for i in range(0, len(x) - args.batch_size + 1, args.batch_size)]

  rows = []
  # The dense baseline (identity, all-reduced) always runs first.
  pairs = [("identity", "auto")] + [
      (n, s) for n in args.compressors.split(",") for s in args.strategies.split(",")
      if (n, s) != ("identity", "auto")]
  for name, strategy in pairs:
    compressor = commopt.compressors.make(name)
    try:
      reduce = commopt.compressed_mean(compressor, axis_name="data", strategy=strategy)
    except ValueError as e:
      print(f"skipped {compressor.name} with strategy={strategy!r}: {e}")
      continue
    label = compressor.name if strategy == "auto" else f"{compressor.name} [{strategy}]"
    tx = optax.chain(reduce, optax.sgd(0.05, momentum=0.9))
    # The compressor alone: no non-finite skip (its int32 flag is not a payload).
    dp = commopt.data_parallel(loss_fn, tx, mesh, skip_nonfinite=False)
    p_, s_ = jax.tree.map(jnp.copy, params), dp.init(params)   # the step donates its inputs
    audit = wire.hlo_collectives(dp, p_, s_, batches[0])
    report = wire.payload_bytes(compressor, params)
    for b in batches[:2]:  # compile and warm up
      p_, s_, loss = dp.step(p_, s_, b)
    jax.block_until_ready(loss)
    times = []
    for i in range(args.steps):
      t = time.perf_counter()
      p_, s_, loss = dp.step(p_, s_, batches[i % len(batches)])
      jax.block_until_ready((p_, s_, loss))
      times.append(time.perf_counter() - t)
    rows.append({"compressor": label, "strategy": strategy, "payload_bytes": report.total,
                 "audited_bytes": wire.total_bytes(audit), "dense_bytes": report.dense,
                 "sent_bytes": wire.total_bytes(audit, "sent_bytes"),
                 "step_ms": 1e3 * float(np.median(times)),
                 "step_ms_iqr": 1e3 * float(np.subtract(*np.percentile(times, [75, 25])))})
    print(f"measured {label}: {rows[-1]['step_ms']:.1f} ms/step", flush=True)

  base = rows[0]
  for r in rows:
    r["payload_ratio"] = r["dense_bytes"] / r["payload_bytes"]
    r["sent_ratio"] = base["sent_bytes"] / max(r["sent_bytes"], 1)
    r["step_time_vs_dense"] = r["step_ms"] / base["step_ms"]

  print(f"\ndigits CNN ({sum(v.size for v in jax.tree.leaves(params)):,} parameters), "
        f"{args.workers} {jax.default_backend()} devices, global batch {args.batch_size}, "
        f"median of {args.steps} steps")
  width = max(20, *(len(r["compressor"]) for r in rows))
  head = (f"{'compressor':>{width}} {'payload kB':>11} {'audited kB':>11} {'dense/payload':>14} "
          f"{'sent kB':>9} {'dense/sent':>11} {'step ms':>8} {'time vs dense':>14}")
  print(head)
  for r in rows:
    print(f"{r['compressor']:>{width}} {r['payload_bytes'] / 1e3:11.1f} {r['audited_bytes'] / 1e3:11.1f} "
          f"{r['payload_ratio']:14.1f} {r['sent_bytes'] / 1e3:9.1f} {r['sent_ratio']:11.1f} "
          f"{r['step_ms']:8.1f} {r['step_time_vs_dense']:14.2f}")
  if jax.default_backend() == "cpu":
    print("(cast is audited before XLA:CPU widens 16-bit all-reduces to f32 at compile time.)")
  print("(payload: the analytic per-leaf payload; audited: what the compiled step's collectives "
        "take in, which for two_phase is about two payloads; sent: ring-model bytes out.)")
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  meta = {"backend": jax.default_backend(), "workers": args.workers, "jax": jax.__version__,
          "machine": platform.machine(), "processor": platform.processor(), "steps": args.steps}
  (out / "foundation.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
  print(f"wrote {out / 'foundation.json'}")
  return rows


if __name__ == "__main__":
  main()
