"""Compute utilisation of DiLoCo over a slow link, with and without the overlapped exchange.

``--processes`` processes of one ``jax.distributed`` job (gloo over TCP, one CPU device
each) run inside a network namespace of this benchmark's own whose loopback is limited
by ``tc ... tbf`` to ``--bandwidth`` (``benchmarks/bench_network.py``'s namespace and
shaping, ``harness.netns``). Every variant trains the MLP of ``examples/digits_cnn.py``
(64 -> H -> H -> 10, H = ``--hidden``) with AdamW inside, ``--batch`` rows per worker, an
exchange every ``--period`` steps, dense float32 pseudo-gradients (the exchange that a slow
link hurts most), Nesterov outer step:

- ``compute``: the inner steps alone (no exchange; the time the workers compute), each
  worker skipping its own non-finite steps as the drivers' inner steps do;
- ``blocking``: ``commopt.parallel.overlapped_diloco(..., delay=0)``: every exchange waited for
  at once (DiLoCo, two programs);
- ``overlapped``: ``commopt.parallel.overlapped_diloco(..., delay=--delay, mixing=0.5)``: the
  exchange on a thread of its own, merged ``delay`` inner steps later;
- ``streaming_diloco``: the same update as ``overlapped`` in one program per step
  (``data_parallel(streaming_diloco(fragments=1, delay, mixing), local_params=True)``),
  whose exchange blocks the step it runs in;
- ``eager``: ``commopt.parallel.eager_diloco(...)``: each exchange overlaps the whole next inner
  phase and the outer step does not wait for it (eager updates).

Utilisation is ``--steps`` times the ``compute`` variant's median step over a variant's
wall time for ``--steps`` steps (compute time over wall time), per round; the median
over ``--rounds`` rounds is reported. The issue's target: ≥ 90% for the overlapped
exchange at 1 Gbit/s.

Needs root (``ip netns``, ``tc``); without it the benchmark says why and exits 0 having
measured nothing. The namespace is always deleted.

    python benchmarks/bench_overlap_diloco.py                        # ~2 min on 2 cores
    python benchmarks/bench_overlap_diloco.py --bandwidth 100mbit --delay 15 --period 20

Writes ``overlap_diloco.json`` and ``overlap_diloco.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness import jobs, netns  # noqa: E402  (after the path)
VARIANTS = ("compute", "blocking", "overlapped", "streaming_diloco", "eager")
TARGET = 0.90


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--processes", type=int, default=4)
  p.add_argument("--bandwidth", default="1gbit", help="tc rate of the namespace's loopback")
  p.add_argument("--hidden", type=int, default=1024)
  p.add_argument("--batch", type=int, default=1024, help="rows per worker")
  p.add_argument("--period", type=int, default=20, help="H: inner steps between exchanges")
  p.add_argument("--delay", type=int, default=10, help="τ: inner steps an exchange overlaps")
  p.add_argument("--steps", type=int, default=40, help="steps per round (a multiple of H)")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--timeout", type=float, default=900, help="seconds for the launched job")
  p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
  p.add_argument("--worker", nargs=2, metavar=("CONFIG", "RESULT"), help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.steps % args.period or not 0 <= args.delay < args.period:
    p.error(f"--steps ({args.steps}) must be a multiple of --period ({args.period}), and "
            f"0 <= --delay ({args.delay}) < --period")
  return args


def worker(config_path: str, result_path: str) -> None:
  from commopt import launch
  ctx = launch.initialize()
  import jax
  import numpy as np
  import optax
  from jax.experimental import multihost_utils

  import commopt
  from harness.data import digits_cnn

  cfg = json.loads(pathlib.Path(config_path).read_text())
  digits = digits_cnn()
  x_all, y_all = digits.load_digits_flat()
  params0, loss_fn = digits.mlp_fns(cfg["hidden"])
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  inner = optax.adamw(1e-3)

  def my_rows(step):
    idx = np.random.default_rng([step, ctx.process_id]).choice(len(x_all), cfg["batch"])
    return {"x": x_all[idx], "y": y_all[idx]}

  def overlapped(delay, mixing):
    run = commopt.parallel.overlapped_diloco(loss_fn, inner, mesh, period=cfg["period"],
                                             delay=delay, mixing=mixing)
    return run, run.inner_dp, run.step

  def streaming():
    dp = commopt.data_parallel(loss_fn, commopt.streaming_diloco(
        inner, axis_name="data", period=cfg["period"], fragments=1, delay=cfg["delay"],
        mixing=0.5), mesh, local_params=True)
    return dp, dp, dp.step

  def compute():
    dp = commopt.data_parallel(loss_fn, commopt.transforms.apply_if_finite(inner), mesh,
                               local_params=True, skip_nonfinite=False)
    return dp, dp, dp.step

  def eager():
    run = commopt.parallel.eager_diloco(loss_fn, inner, mesh, period=cfg["period"])
    return run, run.inner_dp, run.step

  makers = {"compute": compute, "blocking": lambda: overlapped(0, 0.0),
            "overlapped": lambda: overlapped(cfg["delay"], 0.5), "streaming_diloco": streaming,
            "eager": eager}
  results = {}
  for v in VARIANTS:
    run, dp, step = makers[v]()
    p, s = run.place_params(params0), run.init(params0)
    for i in range(cfg["period"]):                 # compile, warm up, one exchange
      p, s, _ = step(p, s, dp.local_batch(my_rows(i)))
    if hasattr(run, "finish"):                     # no other collective while one is in flight
      p, s = run.finish(p, s)
    jax.block_until_ready(p)
    walls, steps = [], []
    for r in range(cfg["rounds"]):
      multihost_utils.sync_global_devices(f"{v} {r}")
      began = time.perf_counter()
      for i in range(cfg["steps"]):
        t0 = time.perf_counter()
        p, s, losses = step(p, s, dp.local_batch(my_rows(1000 + r * cfg["steps"] + i)))
        jax.block_until_ready(losses)
        steps.append(time.perf_counter() - t0)
      if hasattr(run, "finish"):
        p, s = run.finish(p, s)
      jax.block_until_ready(p)
      walls.append(time.perf_counter() - began)
    if hasattr(run, "close"):
      run.close()
    results[v] = {"walls_s": walls, "steps_s": steps, "median_step_s": statistics.median(steps)}
    if ctx.is_main:
      print(f"  {v}: {statistics.median(walls) / cfg['steps'] * 1e3:.1f} ms per step (wall), "
            f"median step {statistics.median(steps) * 1e3:.1f} ms", flush=True)
  if ctx.is_main:
    pathlib.Path(result_path).write_text(json.dumps(results))


def derive(results: dict, steps: int) -> dict:
  """Per variant: wall ms per step and utilisation (compute time over wall time), the
  median over rounds of each round's ratio to the compute variant's median step."""
  compute = results["compute"]["median_step_s"]
  return {v: {"ms_per_step": statistics.median(r["walls_s"]) / steps * 1e3,
              "utilisation": statistics.median(steps * compute / w for w in r["walls_s"])}
          for v, r in results.items()}


def main(argv=None) -> int:
  args = parse_args(argv)
  out = jobs.driver_out(args, worker)
  if out is None:
    return 0
  reason = netns.why_not_shaped()
  if reason:
    return netns.report_skip("bench_overlap_diloco", out / "overlap_diloco.json", reason,
                             indent=None)
  cfg = {k: getattr(args, k) for k in ("hidden", "batch", "period", "delay", "steps",
                                       "rounds")}
  t0 = time.perf_counter()
  load = os.getloadavg()[0]
  with netns.Namespace() as ns:
    ns.shape(args.bandwidth)
    results = jobs.launch_job(ns, args.processes, dict(cfg, methods=["overlapped DiLoCo"]),
                              args.timeout, [str(pathlib.Path(__file__).resolve()), "--worker"],
                              cpu_devices=1)
  rows = derive(results, args.steps)
  lines = [f"{args.processes} processes, gloo over a loopback at {args.bandwidth}; MLP hidden "
           f"{args.hidden}, {args.batch} rows per worker, H = {args.period}, τ = {args.delay}; "
           f"{args.rounds} rounds of {args.steps} steps; load average {load:.1f} before.", "",
           "| variant | ms per step (wall) | utilisation |", "|---|---|---|"]
  for v, r in rows.items():
    lines.append(f"| {v} | {r['ms_per_step']:.1f} | {r['utilisation']:.2f} |")
  u, e = rows["overlapped"]["utilisation"], rows["eager"]["utilisation"]
  lines += ["", f"Overlapped exchange: utilisation {u:.2f} "
            f"({'meets' if u >= TARGET else 'misses'} the {TARGET:.2f} target); eager "
            f"updates {e:.2f} ({'meets' if e >= TARGET else 'misses'} it)."]
  text = "\n".join(lines)
  print(text)
  (out / "overlap_diloco.json").write_text(json.dumps(
      {"config": vars(args), "results": results, "derived": rows,
       "seconds": time.perf_counter() - t0}))
  (out / "overlap_diloco.md").write_text(text + "\n")
  print(f"wrote {out / 'overlap_diloco.json'} and {out / 'overlap_diloco.md'} in "
        f"{time.perf_counter() - t0:.0f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
