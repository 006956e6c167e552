"""Wall-clock time of compressed data parallelism over a real, rate-limited network.

Processes of one ``jax.distributed`` job (one CPU device each, collectives
over gloo on TCP) run inside a Linux network namespace of this benchmark's
own, whose loopback is limited by ``tc qdisc ... tbf`` to each
``--bandwidths`` rate (``unlimited``: no qdisc). Every process's traffic
crosses that one shaped loopback, so the processes share the rate, as
workers behind one link would.

Every method trains the same MLP on the bundled digits (64 -> H -> H -> 10,
H = ``--hidden``; 4.3M parameters, 17 MB of float32 gradients at the default
2048) from the same start, with the same batches (``--batch`` rows per
worker), for ``--steps`` steps, and reports:

- step time: the median of the timed steps (each blocked until ready; the
  first, compiling, step is not timed, nor a periodic method's first period,
  whose exchange is its program's first cross-process collective: 0.05-1.1 s
  measured there, against 20-90 ms for the next);
- compute: the same step on one worker (a mesh of this process's device
  alone: the same local batch, encode and decode, no network), with every
  process running it at once, as they share the machine's cores during the
  real step; communication is the rest of the step time;
- bytes each worker sends per step (ring model, ``commopt.wire.comm_plan``)
  and the rate all workers together put through the link in the
  communication time;
- time to ``--target-loss``: the first step after which the global model's
  loss on 512 fixed digits (``EVAL_ROWS``, scored untimed after every step)
  reaches the target, times the measured step times up to it; the final
  training loss (mean over workers, averaged over the last 5 steps), so a
  run that reaches the target and then diverges shows it; and the global
  model's loss on all the digits at the end.

Methods (``--methods``):

- commopt per step (``METHODS``): dense (identity, all-reduce), cast to
  bfloat16, scaled_sign, top_k (1%), qsgd and power_sgd (rank 2), each under
  ``gather`` and ``two_phase`` where it takes them (cast and identity
  all-reduce; power_sgd runs its own all-reduce protocol), with error
  feedback except for QSGD, then momentum SGD.
- commopt combined (``COMBINED``): ``diloco(H)+<compressor>``, DiLoCo with
  the same momentum SGD inside and every ``H`` steps an outer step
  (``optax.sgd(1.0)``: over momentum SGD, DiLoCo's Nesterov 0.7/0.9
  diverges) on the mean pseudo-gradient, exchanged (``two_phase``) through
  scaled_sign with error feedback or through 4-bit int_quant (unbiased, no
  residual). Their step time is the median over runs of ``H`` steps of the
  mean step (one exchange each), and so is their compute time; their bytes
  are one exchange's over ``H``. Between exchanges each worker trains a
  model of its own and the global model (the anchor) moves only at an
  exchange, so they reach the target at an exchange.
- commopt eager (``EAGER``): ``eager:diloco(H)+int_quant(4)``, the same DiLoCo with
  eager outer steps (``eager_diloco``): each exchange runs on a thread of its own beside
  the whole next inner phase and the outer step is taken at once on the eager estimate of
  the mean (the worker's own pseudo-gradient for its share, the others' from the exchange
  before); ``eager(w=1):...`` lets the worker's own pseudo-gradient stand for the whole
  mean until the exchange arrives (``own_weight=1.0``). The global model scored is the
  workers' mean anchor after each outer step, kept on the host and scored after the run
  (no collective while an exchange is in flight). Its steps that compile or wait for a
  compiled program (the first, the first outer step's and the one that collects the first
  exchange: ``compiled_at``) count as typical ones; its step time is the median over the
  periods after the first two.
- commopt overlapped (``OVERLAPPED``): ``overlap:dense`` and
  ``overlap:scaled_sign/gather``, the per-step method one step delayed
  (``overlapped_data_parallel``: its exchange of the gradient kept from the
  step before runs on a thread of its own beside the next backward pass).
- commopt ZeRO-3 (``ZERO``): ``zero_data_parallel`` with the same momentum SGD,
  parameters and state sharded over the workers, dense gathers and reduce-scatters,
  int8 weight gathers (qwZ), int4 gradient chunks (qgZ), or both (int_quant, nearest,
  blocks of 2048); bytes from the compiled step.
- PyTorch (``TORCH_METHODS``, ``benchmarks/harness/torch_peer.py``, optional: the
  ``peers`` extra; without torch they are skipped, saying why): DDP over
  gloo on CPU, the same MLP from the same initial weights, the same batches,
  ``torch.optim.SGD`` with the same learning rate and momentum 0.9, in the
  same namespace: ``torch:dense`` (plain DDP), ``torch:fp16`` (DDP's
  ``fp16_compress_hook``) and ``torch:power_sgd(2)`` (DDP's PowerSGD hook,
  rank 2, error feedback, warm start, compressing from step 2). Their rows
  report the same fields, bytes under the same ring model.

After the table, a summary per process count and bandwidth: commopt dense,
commopt's best per-step compressed method, its best combined method, and
PyTorch's dense, fp16 and PowerSGD (step time, time to the target), and a
verdict: whether commopt's best reaches the target no later than PyTorch's
best. ``network.json`` holds it under ``summary``.

Needs root (``ip netns``, ``tc``); without it the benchmark says why and
exits 0 having measured nothing. Namespaces are named
``commopt-net-<pid>-<random>`` and always deleted, on errors and Ctrl-C too;
the host's own interfaces are never touched.

    sudo python benchmarks/bench_network.py                       # ~60 min on 2 cores
    python benchmarks/bench_network.py --processes 2 --bandwidths 1gbit --steps 20 \\
        --methods 'dense,scaled_sign/gather,diloco(8)+scaled_sign,torch:power_sgd(2)'

Writes ``network.json`` and ``network.png`` (time to the target loss against
bandwidth, one line per method, one panel per process count) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness import jobs, netns, plots, torch_peer  # noqa: E402  (after the path)
from harness.data import EVAL_ROWS  # noqa: E402
from harness.summary import (  # noqa: E402, F401  (derive: the tests read it here)
    comparison_lines, derive, derived, meta, summarize, summary_table, table, verdicts)
from harness.trainers import ALL_METHODS, COMBINED, EAGER, TORCH_METHODS, Job  # noqa: E402


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--processes", default="2,4", help="comma-separated process counts")
  p.add_argument("--bandwidths", default="1gbit,10gbit,unlimited",
                 help="comma-separated tc rates (e.g. 1gbit, 500mbit) or unlimited")
  p.add_argument("--methods", default=",".join(ALL_METHODS),
                 help=f"comma-separated, from: {', '.join(ALL_METHODS)}")
  p.add_argument("--steps", type=int, default=60, help="training steps per method")
  p.add_argument("--compute-steps", type=int, default=8, help="steps timed for compute alone")
  p.add_argument("--hidden", type=int, default=2048, help="the MLP's hidden width")
  p.add_argument("--batch", type=int, default=32, help="rows per worker per step")
  p.add_argument("--lr", type=float, default=0.02)
  p.add_argument("--target-loss", type=float, default=0.3)
  p.add_argument("--timeout", type=float, default=1800, help="seconds per launched job")
  p.add_argument("--host-memory", default="reuse", choices=("reuse", "system"),
                 help="the launcher's host_memory for both sides' processes (reuse: malloc "
                      "keeps freed memory; system: the C library's defaults)")
  p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
  p.add_argument("--from-json", default=None,
                 help="re-render the table and plot of an earlier run's network.json "
                      "(with this --target-loss) instead of measuring")
  p.add_argument("--worker", nargs=2, metavar=("CONFIG", "RESULT"), help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  args.processes = [int(x) for x in args.processes.split(",") if x.strip()]
  args.bandwidths = [x.strip() for x in args.bandwidths.split(",") if x.strip()]
  args.methods = [x.strip() for x in args.methods.split(",") if x.strip()]
  bad = [m for m in args.methods if m not in ALL_METHODS]
  if bad:
    p.error(f"--methods: unknown {bad}; valid: {ALL_METHODS}")
  if any(n < 2 for n in args.processes):
    p.error(f"--processes: each count must be at least 2, got {args.processes}")
  if args.steps < 10:
    p.error(f"--steps must be at least 10, got {args.steps}")
  eager = [COMBINED[EAGER[m][0]][0] for m in args.methods if m in EAGER]
  if eager and args.steps < 3 * max(eager):
    p.error(f"--steps must be at least {3 * max(eager)} with an eager method (three periods: "
            f"two compile, one is timed), got {args.steps}")
  periodic = [COMBINED[m][0] for m in args.methods if m in COMBINED]
  if periodic and args.steps < 2 * max(periodic):
    p.error(f"--steps must be at least {2 * max(periodic)} with a periodic method (two periods: "
            f"the first compiles and makes the first exchange, one is timed), got {args.steps}")
  return args


def worker(config_path: str, result_path: str) -> None:
  """One process of the job: every commopt method of the config, in turn (:class:`Job`)."""
  from commopt import launch
  ctx = launch.initialize()
  job = Job(ctx, json.loads(pathlib.Path(config_path).read_text()))
  results = {label: job.measure(label) for label in job.cfg["methods"]}
  if ctx.is_main:
    pathlib.Path(result_path).write_text(json.dumps(results))


# -- the driver: a shaped namespace, a job per process count and bandwidth --------------

def run_job(ns: netns.Namespace, processes: int, cfg: dict, timeout: float) -> dict:
  """Every method of ``cfg``: commopt's in one JAX job, then PyTorch's in one torch job."""
  ours = [m for m in cfg["methods"] if m not in TORCH_METHODS]
  theirs = [m for m in cfg["methods"] if m in TORCH_METHODS]
  results = {}
  if ours:
    results.update(jobs.launch_job(ns, processes, dict(cfg, methods=ours), timeout,
                                   [str(pathlib.Path(__file__).resolve()), "--worker"],
                                   cpu_devices=1))
  if theirs:
    results.update(jobs.launch_job(ns, processes, dict(cfg, methods=theirs), timeout,
                                   [str(torch_peer.SCRIPT)]))
  return results


def main(argv=None) -> int:
  args = parse_args(argv)
  out = jobs.driver_out(args, worker)
  if out is None:
    return 0
  if args.from_json:
    report = json.loads(pathlib.Path(args.from_json).read_text())
    if "skipped" in report:
      print(f"bench_network: {args.from_json} measured nothing: {report['skipped']}")
      return 0
    render(report, args.target_loss, out)
    return 0
  for bw in args.bandwidths:
    if bw != "unlimited":
      netns.rate_bits(bw)
  info = meta()
  theirs = [m for m in args.methods if m in TORCH_METHODS]
  if theirs:
    why = torch_peer.unavailable()
    if why:
      # PyTorch is optional (the `peers` extra): its methods are left out, the rest runs.
      print(f"bench_network: skipping {', '.join(theirs)}: {why}; install the `peers` extra "
            f"(pip install -e '.[peers]') to run them.")
      args.methods = [m for m in args.methods if m not in TORCH_METHODS]
      info["left_out"] = {"methods": theirs, "why": why}
    else:
      import torch
      info["torch"] = torch.__version__
  reason = None if args.methods else "no method left to measure"
  reason = reason or netns.why_not_shaped()
  if reason:
    return netns.report_skip("bench_network", out / "network.json", reason, info)
  import jax
  info["jax"] = jax.__version__
  cfg = {k: getattr(args, k) for k in ("methods", "steps", "compute_steps", "hidden", "batch",
                                       "lr", "target_loss", "host_memory")}
  results: dict = {}
  failed: dict = {}
  t0 = time.perf_counter()
  netns.interrupt_on_sigterm()
  with tempfile.TemporaryDirectory(prefix="commopt-net-") as tmp, netns.Namespace() as ns:
    if theirs and not info.get("left_out"):
      # The PyTorch peer starts from the JAX side's weights, on the same digits.
      cfg_torch = torch_peer.peer_arrays(args.hidden, pathlib.Path(tmp, "peer.npz"))
    else:
      cfg_torch = {}
    print(f"namespace {ns.name}")
    for bw in args.bandwidths:
      ns.shape(bw)
      for n in args.processes:
        print(f"{n} processes at {bw} ({time.perf_counter() - t0:.0f} s)", flush=True)
        try:
          results.setdefault(str(n), {})[bw] = run_job(ns, n, dict(cfg, **cfg_torch),
                                                       args.timeout)
        except RuntimeError as e:   # a job that died: said, kept in the report; the rest runs
          print(f"bench_network: {n} processes at {bw} failed, the other jobs go on:\n{e}",
                flush=True)
          failed.setdefault(str(n), {})[bw] = str(e)[-3000:]
  report = {"config": cfg, "meta": info, "bandwidths": args.bandwidths,
            "processes": args.processes, "results": results, "failed": failed,
            "seconds": time.perf_counter() - t0}
  report["summary"] = summarize(derived(report, args.target_loss), args.bandwidths,
                                args.processes)
  (out / "network.json").write_text(json.dumps(report, indent=1))
  render(report, args.target_loss, out)
  print(f"wrote {out / 'network.json'} in {time.perf_counter() - t0:.0f} s")
  if failed:
    print("bench_network: failed jobs (in network.json under `failed`): " + ", ".join(
        f"{n} processes at {bw}" for n, by_bw in failed.items() for bw in by_bw))
    return 1
  return 0


def render(report: dict, target: float, out: pathlib.Path) -> None:
  """The tables (printed and written as network.md) and the plot, from a report."""
  bandwidths, processes = report["bandwidths"], report["processes"]
  results = derived(report, target)
  text = table(results, bandwidths, processes)
  summary = verdicts(results, bandwidths, processes)
  versus = summarize(results, bandwidths, processes)
  comparison = summary_table(versus) + "\n\n" + comparison_lines(versus)
  left_out = report.get("meta", {}).get("left_out")
  if left_out:
    comparison += (f"\n\nLeft out: {', '.join(left_out['methods'])} ({left_out['why']}).")
  print(text + "\n\n" + summary + "\n\n" + comparison)
  (out / "network.md").write_text(
      f"Target loss {target} (the global model on {EVAL_ROWS} digits); "
      f"{report['config']['steps']} steps per method; "
      f"MLP hidden {report['config']['hidden']}, {report['config']['batch']} rows per worker.\n\n"
      + text + "\n\n" + summary + "\n\n" + comparison + "\n")
  plots.time_to_target(results, bandwidths, processes, target, out / "network.png")
  print(f"wrote {out / 'network.md'} and {out / 'network.png'}")


if __name__ == "__main__":
  sys.exit(main())
