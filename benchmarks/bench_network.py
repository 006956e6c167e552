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
  first, compiling, step is not timed);
- compute: the same step on one worker (a mesh of this process's device
  alone: the same local batch, encode and decode, no network), with every
  process running it at once, as they share the machine's cores during the
  real step; communication is the rest of the step time;
- bytes each worker sends per step (ring model, ``commopt.wire.comm_plan``)
  and the rate all workers together put through the link in the
  communication time;
- time to ``--target-loss``: the first step at which the training loss
  (mean over workers, averaged over 5 steps) reaches the target, times the
  measured step times up to it; and the final loss (the same average over
  the last 5 steps), so a run that reaches the target and then diverges
  shows it.

Methods: dense (identity, all-reduce), cast to bfloat16, scaled_sign,
top_k (1%), qsgd and power_sgd (rank 2), each under ``gather`` and
``two_phase`` where it takes them (cast and identity all-reduce; power_sgd
runs its own all-reduce protocol), with error feedback except for QSGD (see
``METHODS``), then momentum SGD.

Needs root (``ip netns``, ``tc``); without it the benchmark says why and
exits 0 having measured nothing. Namespaces are named
``commopt-net-<pid>-<random>`` and always deleted, on errors and Ctrl-C too;
the host's own interfaces are never touched.

    sudo python benchmarks/bench_network.py                       # ~25 min on 2 cores
    python benchmarks/bench_network.py --processes 2 --bandwidths 1gbit --steps 20 \\
        --methods dense,scaled_sign/gather                        # a quick look

Writes ``network.json`` and ``network.png`` (time to the target loss against
bandwidth, one line per method, one panel per process count) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

METHODS = {
    # label: (registry name, options, strategy, error feedback)
    "dense": ("identity", {}, "auto", False),
    "cast(bf16)": ("cast", {"dtype": "bfloat16"}, "auto", True),
    "scaled_sign/gather": ("scaled_sign", {}, "gather", True),
    "scaled_sign/two_phase": ("scaled_sign", {}, "two_phase", True),
    "top_k(0.01)/gather": ("top_k", {"ratio": 0.01}, "gather", True),
    "top_k(0.01)/two_phase": ("top_k", {"ratio": 0.01}, "two_phase", True),
    # Unbiased, and with 7 levels per 512-value bucket its variance bound is
    # ~3.2x the input's: error feedback is not a contraction for it and
    # diverges, so QSGD runs as published, without it.
    "qsgd/gather": ("qsgd", {}, "gather", False),
    "qsgd/two_phase": ("qsgd", {}, "two_phase", False),
    "power_sgd(2)": ("power_sgd", {"rank": 2}, "auto", True),
}
BURST = {"1gbit": "128kb", "10gbit": "1280kb"}
"""tbf bucket per rate: at least rate / HZ (one timer tick of data)."""


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--processes", default="2,4", help="comma-separated process counts")
  p.add_argument("--bandwidths", default="1gbit,10gbit,unlimited",
                 help="comma-separated tc rates (e.g. 1gbit, 500mbit) or unlimited")
  p.add_argument("--methods", default=",".join(METHODS),
                 help=f"comma-separated, from: {', '.join(METHODS)}")
  p.add_argument("--steps", type=int, default=60, help="training steps per method")
  p.add_argument("--compute-steps", type=int, default=8, help="steps timed for compute alone")
  p.add_argument("--hidden", type=int, default=2048, help="the MLP's hidden width")
  p.add_argument("--batch", type=int, default=32, help="rows per worker per step")
  p.add_argument("--lr", type=float, default=0.02)
  p.add_argument("--target-loss", type=float, default=0.3)
  p.add_argument("--timeout", type=float, default=1800, help="seconds per launched job")
  p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
  p.add_argument("--from-json", default=None,
                 help="re-render the table and plot of an earlier run's network.json "
                      "(with this --target-loss) instead of measuring")
  p.add_argument("--worker", nargs=2, metavar=("CONFIG", "RESULT"), help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  args.processes = [int(x) for x in args.processes.split(",") if x.strip()]
  args.bandwidths = [x.strip() for x in args.bandwidths.split(",") if x.strip()]
  args.methods = [x.strip() for x in args.methods.split(",") if x.strip()]
  bad = [m for m in args.methods if m not in METHODS]
  if bad:
    p.error(f"--methods: unknown {bad}; valid: {list(METHODS)}")
  if any(n < 2 for n in args.processes):
    p.error(f"--processes: each count must be at least 2, got {args.processes}")
  if args.steps < 10:
    p.error(f"--steps must be at least 10, got {args.steps}")
  return args


# -- the worker: one process of the job ------------------------------------------------

def smoothed(losses, window=5):
  out = []
  for i in range(len(losses)):
    part = losses[max(0, i - window + 1):i + 1]
    out.append(sum(part) / len(part))
  return out


def worker(config_path: str, result_path: str) -> None:
  from commopt import launch
  ctx = launch.initialize()
  import jax
  import numpy as np
  import optax
  from jax.experimental import multihost_utils

  import commopt
  from commopt import wire
  sys.path.insert(0, str(ROOT / "examples"))
  from digits_cnn import load_digits_flat, mlp_fns

  cfg = json.loads(pathlib.Path(config_path).read_text())
  x_all, y_all = load_digits_flat()
  workers, hidden, rows = jax.device_count(), cfg["hidden"], cfg["batch"]
  params0, loss_fn = mlp_fns(hidden)      # host copies: every run places its own

  def my_rows(step):
    idx = np.random.default_rng([step, 7]).choice(len(x_all), rows * workers, replace=False)
    mine = np.split(idx, ctx.num_processes)[ctx.process_id]
    return {"x": x_all[mine], "y": y_all[mine]}

  global_mesh = jax.make_mesh((workers,), ("data",))
  local_mesh = jax.make_mesh((1,), ("data",), devices=jax.local_devices()[:1])
  results = {}
  for label in cfg["methods"]:
    name, opts, strategy, ef = METHODS[label]
    reducer = commopt.compressed_mean(commopt.compressors.make(name, **opts), axis_name="data",
                                      strategy=strategy, error_feedback=ef)
    tx = optax.chain(reducer, optax.sgd(cfg["lr"], momentum=0.9))
    plan = wire.comm_plan(reducer, params0, workers)
    dp = commopt.data_parallel(loss_fn, tx, global_mesh)
    params, state = dp.place_params(params0), dp.init(params0)
    times, losses = [], []
    for step in range(cfg["steps"]):
      batch = dp.local_batch(my_rows(step))
      t0 = time.perf_counter()
      params, state, loss = dp.step(params, state, batch)
      jax.block_until_ready((params, state))
      times.append(time.perf_counter() - t0)
      losses.append(loss)
    losses = [float(np.mean(v)) for v in multihost_utils.process_allgather(losses, tiled=True)]
    # Compute alone: the same step on this process's device, every process at once.
    local = commopt.data_parallel(loss_fn, tx, local_mesh)
    lp, ls = local.place_params(params0), local.init(params0)
    batch = my_rows(0)
    multihost_utils.sync_global_devices(f"compute {label}")
    compute = []
    for _ in range(cfg["compute_steps"] + 1):
      t0 = time.perf_counter()
      lp, ls, _ = local.step(lp, ls, batch)
      jax.block_until_ready((lp, ls))
      compute.append(time.perf_counter() - t0)
    multihost_utils.sync_global_devices(f"computed {label}")
    step_s = statistics.median(times[1:])
    compute_s = statistics.median(compute[1:])
    comm_s = max(step_s - compute_s, 0.0)
    results[label] = {
        "step_s": step_s, "compute_s": compute_s, "comm_s": comm_s,
        "sent_bytes": plan.sent_bytes, "dense_sent_bytes": plan.dense_sent,
        "losses": losses, "step_times": times, "compile_s": times[0],
    }
    if ctx.is_main:
      print(f"  {label}: {step_s * 1e3:.1f} ms/step (compute {compute_s * 1e3:.1f}, "
            f"communication {comm_s * 1e3:.1f}), {plan.sent_bytes / 1e6:.2f} MB sent/worker, "
            f"loss {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)
  if ctx.is_main:
    pathlib.Path(result_path).write_text(json.dumps(results))


# -- the driver: namespaces, shaping, launching ---------------------------------------

def sh(*cmd, check=True) -> subprocess.CompletedProcess:
  return subprocess.run(cmd, capture_output=True, text=True, check=check)


def cannot_shape() -> str | None:
  """Why this machine cannot run the benchmark, or None."""
  if os.geteuid() != 0:
    return "needs root to create a network namespace and shape it with tc (run it with sudo)"
  for tool in ("ip", "tc"):
    if shutil.which(tool) is None:
      return f"needs the `{tool}` command (iproute2)"
  return None


class Namespace:
  """A network namespace of this benchmark's own, with its loopback up; deleted on exit."""

  def __init__(self):
    self.name = f"commopt-net-{os.getpid()}-{secrets.token_hex(3)}"

  def __enter__(self):
    sh("ip", "netns", "add", self.name)
    try:
      sh("ip", "-n", self.name, "link", "set", "lo", "up")
    except BaseException:
      self.delete()
      raise
    return self

  def shape(self, rate: str) -> None:
    sh("tc", "-n", self.name, "qdisc", "del", "dev", "lo", "root", check=False)
    if rate != "unlimited":
      burst = BURST.get(rate, "128kb")
      sh("tc", "-n", self.name, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate,
         "burst", burst, "latency", "20ms")

  def delete(self) -> None:
    sh("ip", "netns", "del", self.name, check=False)

  def __exit__(self, *exc):
    self.delete()


def run_job(ns: Namespace, processes: int, cfg: dict, timeout: float) -> dict:
  with tempfile.TemporaryDirectory(prefix="commopt-net-") as tmp:
    config, result = pathlib.Path(tmp, "config.json"), pathlib.Path(tmp, "result.json")
    config.write_text(json.dumps(cfg))
    argv = ["ip", "netns", "exec", ns.name, sys.executable, "-m", "commopt.launch",
            "--processes", str(processes), "--cpu-devices", "1", "--timeout", str(timeout),
            str(pathlib.Path(__file__).resolve()), "--worker", str(config), str(result)]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
      out, _ = proc.communicate(timeout=timeout + 60)
    except BaseException:
      # The launcher ends its processes on SIGTERM; SIGKILL if it has not within 30 s.
      os.killpg(proc.pid, signal.SIGTERM)
      try:
        proc.wait(30)
      except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
      raise
    for line in out.splitlines():
      if line.startswith("  "):
        print(line, flush=True)
    if proc.returncode != 0 or not result.exists():
      raise RuntimeError(f"the {processes}-process job failed (exit {proc.returncode}):\n"
                         + out[-4000:])
    return json.loads(result.read_text())


def derive(r: dict, processes: int, target: float) -> dict:
  """Time to the target loss and achieved rates, from one method's measurements."""
  curve = smoothed(r["losses"])
  hit = next((i for i, v in enumerate(curve) if v <= target), None)
  # The compiling first step counts as a typical one.
  times = [r["step_s"]] + r["step_times"][1:]
  comm = r["comm_s"]
  return dict(r, final_loss=curve[-1], steps_to_target=None if hit is None else hit + 1,
              time_to_target_s=None if hit is None else sum(times[:hit + 1]),
              # What one worker sends, and what all of them put through the one link.
              achieved_bytes_per_s=r["sent_bytes"] / comm if comm > 0 else None,
              link_bytes_per_s=r["sent_bytes"] * processes / comm if comm > 0 else None)


def rate_bits(rate: str) -> float:
  units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
  for suffix, scale in units.items():
    if rate.endswith(suffix):
      return float(rate[:-len(suffix)]) * scale
  raise ValueError(f"--bandwidths: cannot read the rate {rate!r} (use e.g. 1gbit, 500mbit)")


def table(results: dict, bandwidths, processes) -> str:
  lines = ["| processes | bandwidth | method | step ms | × dense | compute ms | comm ms | "
           "MB sent/worker | link Gbit/s | steps to target | time to target s | final loss |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for n in processes:
    for bw in bandwidths:
      rows = results.get(str(n), {}).get(bw, {})
      dense = rows.get("dense", {}).get("step_s")
      for label, r in rows.items():
        achieved, ttt = r["link_bytes_per_s"], r["time_to_target_s"]
        lines.append(
            f"| {n} | {bw} | {label} | {r['step_s'] * 1e3:.1f} | "
            f"{(r['step_s'] / dense) if dense else float('nan'):.2f} | "
            f"{r['compute_s'] * 1e3:.1f} | {r['comm_s'] * 1e3:.1f} | "
            f"{r['sent_bytes'] / 1e6:.2f} | "
            f"{'-' if not achieved else f'{achieved * 8 / 1e9:.2f}'} | "
            f"{r['steps_to_target'] or 'not reached'} | "
            f"{'-' if ttt is None else f'{ttt:.1f}'} | {r['final_loss']:.3f} |")
  return "\n".join(lines)


def plot(results: dict, bandwidths, processes, target: float, path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  shaped = [b for b in bandwidths if b != "unlimited"]
  xs = {b: rate_bits(b) / 1e9 for b in shaped}
  fig, axes = plt.subplots(1, len(processes), figsize=(6.5 * len(processes), 4.5), squeeze=False)
  for ax, n in zip(axes[0], processes):
    by_bw = results.get(str(n), {})
    methods = sorted({m for rows in by_bw.values() for m in rows}, key=list(METHODS).index)
    top = max(xs.values(), default=1) * 4
    for m in methods:
      pts = [(xs.get(b, top), by_bw[b][m]["time_to_target_s"]) for b in bandwidths
             if m in by_bw.get(b, {}) and by_bw[b][m]["time_to_target_s"] is not None]
      if pts:
        pts.sort()
        # One colour per method in every panel.
        ax.plot(*zip(*pts), marker="o", label=m, color=f"C{list(METHODS).index(m) % 10}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ticks = sorted(xs.values()) + ([top] if "unlimited" in bandwidths else [])
    ax.set_xticks(ticks, [f"{t:g}" for t in sorted(xs.values())]
                  + (["unlimited"] if "unlimited" in bandwidths else []))
    ax.set_xlabel("loopback rate (Gbit/s, tc tbf)")
    ax.set_ylabel(f"seconds to training loss {target}")
    ax.set_title(f"{n} processes × 1 CPU device, gloo")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.worker:
    worker(*args.worker)
    return 0
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  if args.from_json:
    report = json.loads(pathlib.Path(args.from_json).read_text())
    if "skipped" in report:
      print(f"bench_network: {args.from_json} measured nothing: {report['skipped']}")
      return 0
    render(report, args.target_loss, out)
    return 0
  for bw in args.bandwidths:
    if bw != "unlimited":
      rate_bits(bw)
  reason = cannot_shape()
  meta = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
          "argv": sys.argv[1:]}
  if reason is None:
    try:
      with Namespace():
        pass
    except subprocess.CalledProcessError as e:
      reason = f"cannot create a network namespace: {e.stderr.strip() or e}"
  if reason:
    print(f"bench_network: skipped, {reason}.")
    (out / "network.json").write_text(json.dumps({"skipped": reason, **meta}, indent=1))
    return 0
  import jax
  meta["jax"] = jax.__version__
  cfg = {k: getattr(args, k) for k in ("methods", "steps", "compute_steps", "hidden", "batch",
                                       "lr", "target_loss")}
  results: dict = {}
  t0 = time.perf_counter()
  # SIGTERM ends the run like Ctrl-C, so the namespace is deleted either way.
  signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
  with Namespace() as ns:
    print(f"namespace {ns.name}")
    for bw in args.bandwidths:
      ns.shape(bw)
      for n in args.processes:
        print(f"{n} processes at {bw} ({time.perf_counter() - t0:.0f} s)", flush=True)
        results.setdefault(str(n), {})[bw] = run_job(ns, n, cfg, args.timeout)
  report = {"config": cfg, "meta": meta, "bandwidths": args.bandwidths,
            "processes": args.processes, "results": results, "seconds": time.perf_counter() - t0}
  (out / "network.json").write_text(json.dumps(report, indent=1))
  render(report, args.target_loss, out)
  print(f"wrote {out / 'network.json'} in {time.perf_counter() - t0:.0f} s")
  return 0


def render(report: dict, target: float, out: pathlib.Path) -> None:
  """The table (printed and written as network.md) and the plot, from a report."""
  bandwidths, processes = report["bandwidths"], report["processes"]
  results = {n: {bw: {m: derive(r, int(n), target) for m, r in rows.items()}
                 for bw, rows in by_bw.items()} for n, by_bw in report["results"].items()}
  text = table(results, bandwidths, processes)
  summary = verdicts(results, bandwidths, processes)
  print(text + "\n\n" + summary)
  (out / "network.md").write_text(
      f"Target training loss {target}; {report['config']['steps']} steps per method; "
      f"MLP hidden {report['config']['hidden']}, {report['config']['batch']} rows per worker.\n\n"
      + text + "\n\n" + summary + "\n")
  plot(results, bandwidths, processes, target, out / "network.png")
  print(f"wrote {out / 'network.md'} and {out / 'network.png'}")


def verdicts(results: dict, bandwidths, processes) -> str:
  """Per process count and bandwidth: the fastest compressed method per step against dense,
  and the soonest to the target loss, among the runs that reached it."""
  lines = []
  times = lambda a, b: f"{a / b:.2f}x faster" if a >= b else f"{b / a:.2f}x slower"
  for n in processes:
    for bw in bandwidths:
      rows = results.get(str(n), {}).get(bw, {})
      dense = rows.get("dense")
      others = [m for m in rows if m != "dense"]
      if dense is None or not others:
        continue
      best = min(others, key=lambda m: rows[m]["step_s"])
      line = (f"- {n} processes, {bw}: per step, {best} is {times(dense['step_s'], rows[best]['step_s'])} "
              f"than dense ({rows[best]['step_s'] * 1e3:.1f} against {dense['step_s'] * 1e3:.1f} ms)")
      reached = [m for m in others if rows[m]["time_to_target_s"] is not None]
      if reached and dense["time_to_target_s"] is not None:
        soon = min(reached, key=lambda m: rows[m]["time_to_target_s"])
        line += (f"; to the target loss, {soon} is {times(dense['time_to_target_s'], rows[soon]['time_to_target_s'])} "
                 f"({rows[soon]['time_to_target_s']:.1f} against {dense['time_to_target_s']:.1f} s)")
      slower = [m for m in others if rows[m]["step_s"] > dense["step_s"]]
      if slower:
        line += f"; slower than dense per step: {', '.join(slower)}"
      lines.append(line + ".")
  return "\n".join(lines)


if __name__ == "__main__":
  sys.exit(main())
