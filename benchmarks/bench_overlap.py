"""Whether the exchange of a pipelined (one-step-delayed) step hides behind compute.

``commopt.transforms.pipelined(inner)`` runs ``inner`` (the exchange and the optimizer)
on the gradient kept from the previous step, so a step's collective need not
depend on its own forward and backward pass. Whether it then runs *beside*
them is up to the runtime. This benchmark measures it on XLA:CPU with gloo.

Processes of one ``jax.distributed`` job (collectives over gloo on TCP) run
inside a network namespace of this benchmark's own whose loopback is limited
by ``tc ... tbf`` to ``--bandwidth`` (the namespace and shaping of
``benchmarks/bench_network.py``, ``harness.netns``). Each process has two CPU
devices when ``split/2dev`` runs (one otherwise); every other variant uses
the first. Every variant trains the MLP of ``examples/digits_cnn.py`` (64 ->
H -> H -> 10, H = ``--hidden``) with ``--batch`` rows per worker and plain
SGD, per method (``dense``: identity, all-reduce; ``scaled_sign``: gather,
with error feedback):

- ``undelayed``: ``data_parallel(loss, chain(compressed_mean, sgd))``;
- ``delayed``: ``pipelined`` of the same ``tx`` under data_parallel's own
  agreed skip (``skip_nonfinite=True``), whose agreement reads this step's
  gradient;
- ``delayed/kept``: ``pipelined(apply_if_finite(inner, axis_name="data"))``
  with ``skip_nonfinite=False``: the agreement is on the kept gradient, and
  no collective reads this step's gradient;
- ``split``: the same delayed update as two jitted programs per step, the
  exchange of the kept gradient dispatched first and the forward/backward
  second, at the same parameters (JAX dispatches both before either ends);
- ``split/2dev``: the same, the exchange on each process's second CPU
  device and the forward/backward on its first (parameters and gradients
  copied between them each step);
- ``split/thread``: ``split`` with the exchange dispatched from a thread of
  its own: :func:`commopt.parallel.overlapped_data_parallel` itself;
- ``compute``: the undelayed step on a mesh of this process's first device
  alone (no network), every process at once, as they share the cores;
- ``comm``: the undelayed step on the global mesh with a loss whose
  gradient costs nothing (a linear function of the parameters): the
  exchange, its encode/decode and the update alone.

Timing: ``--rounds`` rounds; in each, every variant in turn runs ``--steps``
steps, each blocked until ready. A variant's step time is the median over
all its steps; its ratios to ``compute + comm`` (no overlap) and to
``max(compute, comm)`` (perfect overlap; the target is a delayed step at
most 1.2 times that) are taken per round, from that round's medians (the
variants of a round ran seconds apart, under the same load), and their
median over rounds is reported. From each data_parallel program's compiled
HLO it also reports which collectives wait for the batch
(:func:`harness.hlo.batch_dependent_collectives`). ``--xla-flags`` runs the job once per
set of flags (e.g. with XLA:CPU's
``--xla_cpu_enable_concurrency_optimized_scheduler=false``).

Needs root (``ip netns``, ``tc``); without it the benchmark says why and
exits 0 having measured nothing. The namespace is always deleted.

    python benchmarks/bench_overlap.py                                  # ~4 min on 2 cores
    python benchmarks/bench_overlap.py --methods dense --batch 1024 --rounds 6

Writes ``overlap.json`` and ``overlap.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time
from typing import Any, Callable, NamedTuple

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness import jobs, netns  # noqa: E402  (after the path)
from harness.arrays import global_batch, moved, zeros_per_worker  # noqa: E402
from harness.hlo import batch_dependent_collectives, waiting  # noqa: E402
from harness.summary import markdown_table, meta  # noqa: E402
from harness.timing import round_medians  # noqa: E402

METHODS = {
    # label: (registry name, options, strategy, error feedback)
    "dense": ("identity", {}, "auto", False),
    "scaled_sign": ("scaled_sign", {}, "gather", True),
}
VARIANTS = ("undelayed", "delayed", "delayed/kept", "split", "split/2dev", "split/thread",
            "compute", "comm")
SPLITS = ("delayed", "delayed/kept", "split", "split/2dev", "split/thread")
TARGET = 1.2
"""A delayed step should cost at most this times ``max(compute, comm)``."""


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--processes", type=int, default=2, help="processes (workers), >= 2")
  p.add_argument("--bandwidth", default="1gbit", help="tc rate (e.g. 1gbit) or unlimited")
  p.add_argument("--methods", default=",".join(METHODS),
                 help=f"comma-separated, from: {', '.join(METHODS)}")
  p.add_argument("--variants", default=",".join(VARIANTS),
                 help=f"comma-separated, from: {', '.join(VARIANTS)}")
  p.add_argument("--hidden", type=int, default=1024, help="the MLP's hidden width")
  p.add_argument("--batch", type=int, default=512, help="rows per worker per step")
  p.add_argument("--lr", type=float, default=0.02)
  p.add_argument("--rounds", type=int, default=12, help="rounds of timed steps per variant")
  p.add_argument("--steps", type=int, default=3, help="timed steps per variant and round")
  p.add_argument("--xla-flags", default="",
                 help="';'-separated sets of XLA flags, one job per set (an empty set: none), "
                      "e.g. --xla-flags=';--xla_cpu_enable_concurrency_optimized_scheduler=false'")
  p.add_argument("--timeout", type=float, default=900, help="seconds per launched job")
  p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
  p.add_argument("--worker", nargs=2, metavar=("CONFIG", "RESULT"), help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  args.methods = [x.strip() for x in args.methods.split(",") if x.strip()]
  args.xla_flags = [x.strip() for x in args.xla_flags.split(";")]
  args.variants = [x.strip() for x in args.variants.split(",") if x.strip()]
  for name, given, valid in (("--methods", args.methods, METHODS),
                             ("--variants", args.variants, VARIANTS)):
    bad = [m for m in given if m not in valid]
    if bad:
      p.error(f"{name}: unknown {bad}; valid: {list(valid)}")
  if args.processes < 2:
    p.error(f"--processes must be at least 2, got {args.processes}")
  if args.rounds < 1 or args.steps < 1:
    p.error(f"--rounds and --steps must be at least 1, got {args.rounds} and {args.steps}")
  return args


# -- the worker: one process of the job ------------------------------------------------

class _Program(NamedTuple):
  """One variant: ``init() -> carry``, ``step(carry, batch) -> carry``, ``batch(rows)`` (this
  process's rows as the step takes them) and the ``DataParallel`` whose HLO to read (or None)."""
  init: Callable
  step: Callable
  batch: Callable
  audited: Any = None


def _programs(cfg, label, meshes, loss_fn, params0) -> dict:
  """The variants' programs for one method, ``{variant: _Program}``. ``meshes``: ``"data"``
  (each process's first device), ``"local"`` (this process's first device alone) and
  ``"comm"`` (each process's second device, for ``split/2dev``)."""
  import optax

  import commopt

  name, opts, strategy, ef = METHODS[label]
  mesh = meshes["data"]

  def inner():
    reducer = commopt.compressed_mean(commopt.compressors.make(name, **opts),
                                      axis_name="data", strategy=strategy, error_feedback=ef)
    return optax.chain(reducer, optax.sgd(cfg["lr"]))

  def plain(dp, audited=True, batch=None):
    def init():
      return dp.place_params(params0), dp.init(params0)

    def step(carry, b):
      params, state, _ = dp.step(*carry, b)
      return params, state
    return _Program(init, step, batch or dp.local_batch, dp if audited else None)

  def comm_only():
    dp = commopt.data_parallel(_linear, inner(), mesh)
    g = zeros_per_worker(mesh, params0)
    return plain(dp, audited=False, batch=lambda rows: {"g": g})

  make = {
      "undelayed": lambda: plain(commopt.data_parallel(loss_fn, inner(), mesh)),
      "delayed": lambda: plain(commopt.data_parallel(
          loss_fn, commopt.transforms.pipelined(inner()), mesh)),
      "delayed/kept": lambda: plain(commopt.data_parallel(
          loss_fn, commopt.transforms.pipelined(commopt.apply_if_finite(inner(), axis_name="data")),
          mesh, skip_nonfinite=False)),
      "split": lambda: _split(mesh, mesh, inner(), loss_fn, params0),
      "split/2dev": lambda: _split(mesh, meshes["comm"], inner(), loss_fn, params0),
      "split/thread": lambda: _overlapped(mesh, inner(), loss_fn, params0),
      "compute": lambda: plain(commopt.data_parallel(loss_fn, inner(), meshes["local"]),
                               audited=False, batch=lambda rows: rows),
      "comm": comm_only,
  }
  return {v: make[v]() for v in cfg["variants"]}


def _linear(p, b):
  """A loss whose gradient is ``b["g"][0]``: a step with it is the exchange with no compute
  (the loss ``overlapped_data_parallel`` exchanges its kept gradient with)."""
  from commopt.parallel._overlapped import _kept_loss
  return _kept_loss(p, b)


def _split(mesh, comm_mesh, inner, loss_fn, params0) -> _Program:
  """The delayed update as two jitted programs per step: the exchange of the kept gradient
  (a data_parallel step on :func:`_linear`, on ``comm_mesh``), dispatched first, then the
  forward/backward on ``mesh``, both at the same parameters. On one mesh the two programs
  share each process's device; on two (``split/2dev``) each process runs the exchange on a
  second CPU device, and the parameters and gradients are copied between the two."""
  import jax
  from jax.sharding import PartitionSpec as P

  import commopt

  exchange = commopt.data_parallel(_linear, inner, comm_mesh, donate=False)
  grad = commopt.local_value_and_grad(loss_fn, "data")
  backward = jax.jit(jax.shard_map(
      lambda p, b: jax.tree.map(lambda x: x[None], grad(p, b)[1]), mesh=mesh,
      in_specs=(P(), P("data")), out_specs=P("data")))
  apart = comm_mesh is not mesh

  def init():
    params = exchange.place_params(params0)
    return (params, exchange.init(params0), zeros_per_worker(comm_mesh, params0),
            moved(params, mesh, P()) if apart else params)

  def step(carry, batch):
    params, state, kept, here = carry
    new_params, state, _ = exchange.step(params, state, {"g": kept})   # dispatched first
    with jax.set_mesh(mesh):
      grads = backward(here, batch)                                    # then this
    if not apart:
      return new_params, state, grads, new_params
    return new_params, state, moved(grads, comm_mesh, P("data")), moved(new_params, mesh, P())

  return _Program(init, step, lambda rows: global_batch(mesh, rows))


def _overlapped(mesh, inner, loss_fn, params0) -> _Program:
  """``split`` with the exchange dispatched from a thread of its own: the
  :func:`commopt.parallel.overlapped_data_parallel` driver itself (two programs on one device
  dispatched from two threads run at once on XLA:CPU; from one thread they do not)."""
  import commopt

  run = commopt.parallel.overlapped_data_parallel(loss_fn, inner, mesh)

  def init():
    return run.place_params(params0), run.init(params0)

  def step(carry, batch):
    params, state, _ = run.step(*carry, batch)
    return params, state

  return _Program(init, step, lambda rows: global_batch(mesh, rows))


def worker(config_path: str, result_path: str) -> None:
  from commopt import launch
  ctx = launch.initialize()
  import jax
  import numpy as np
  from jax.experimental import multihost_utils

  from harness.data import digits_cnn

  cfg = json.loads(pathlib.Path(config_path).read_text())
  digits = digits_cnn()
  x_all, y_all = digits.load_digits_flat()
  rows = cfg["batch"]
  params0, loss_fn = digits.mlp_fns(cfg["hidden"])
  by_process: dict = {}
  for d in jax.devices():
    by_process.setdefault(d.process_index, []).append(d)
  firsts = [ds[0] for _, ds in sorted(by_process.items())]
  workers = len(firsts)
  meshes = {"data": jax.make_mesh((workers,), ("data",), devices=firsts),
            "local": jax.make_mesh((1,), ("data",), devices=jax.local_devices()[:1])}
  if all(len(ds) > 1 for ds in by_process.values()):
    meshes["comm"] = jax.make_mesh((workers,), ("data",),
                                   devices=[ds[1] for _, ds in sorted(by_process.items())])

  def my_rows(step):
    idx = np.random.default_rng([step, 7]).choice(len(x_all), rows * workers,
                                                  replace=len(x_all) < rows * workers)
    mine = np.split(idx, ctx.num_processes)[ctx.process_id]
    return {"x": x_all[mine], "y": y_all[mine]}

  results = {}
  for label in cfg["methods"]:
    programs = _programs(cfg, label, meshes, loss_fn, params0)
    carries, times, hlo = {}, {v: [] for v in programs}, {}
    for v, prog in programs.items():
      carry = prog.init()
      for s in range(2):                  # compile and warm up
        carry = jax.block_until_ready(prog.step(carry, prog.batch(my_rows(s))))
      carries[v] = carry
      if prog.audited is not None:
        text = prog.audited.lower(*carry[:2], prog.batch(my_rows(0))).compile().as_text()
        hlo[v] = batch_dependent_collectives(text)
    for r in range(cfg["rounds"]):
      for v, prog in programs.items():
        multihost_utils.sync_global_devices(f"{label} {v} {r}")
        for s in range(cfg["steps"]):
          b = prog.batch(my_rows(100 + r * cfg["steps"] + s))
          t0 = time.perf_counter()
          carries[v] = jax.block_until_ready(prog.step(carries[v], b))
          times[v].append(time.perf_counter() - t0)
    results[label] = {"median_s": {v: statistics.median(t) for v, t in times.items()},
                      "times_s": times, "collectives": hlo}
    if ctx.is_main:
      print("  " + label + ": " + ", ".join(
          f"{v} {statistics.median(t) * 1e3:.1f} ms" for v, t in times.items()), flush=True)
  if ctx.is_main:
    pathlib.Path(result_path).write_text(json.dumps(results))


# -- the driver ------------------------------------------------------------------------

def derive(r: dict, steps: int) -> dict:
  """Each delayed or undelayed variant's step against no overlap (``compute + comm``) and
  perfect overlap (``max(compute, comm)``): per round, the ratio of the round's medians
  (the variants of a round ran minutes apart at most, under the same load), then the
  median over rounds."""
  t = r["times_s"]
  if "compute" not in t or "comm" not in t:
    return {}
  rounds = lambda v: round_medians(t[v], steps)
  compute, comm = rounds("compute"), rounds("comm")
  out = {}
  for v in ("undelayed",) + SPLITS:
    if v in t:
      mine = rounds(v)
      out[v] = {"vs_sum": statistics.median(m / (a + b) for m, a, b in zip(mine, compute, comm)),
                "vs_max": statistics.median(m / max(a, b) for m, a, b in zip(mine, compute, comm))}
  return out


def table(report: dict) -> str:
  lines = []
  for flags, by_method in report["results"].items():
    for label, r in by_method.items():
      ratios = derive(r, report["config"]["steps"])
      for v, t in r["median_s"].items():
        q = ratios.get(v)
        vs_sum, vs_max = ("", "") if q is None else (f"{q['vs_sum']:.2f}", f"{q['vs_max']:.2f}")
        lines.append([flags or "(none)", label, v, f"{t * 1e3:.1f}", vs_sum, vs_max,
                      waiting(r["collectives"].get(v, []))])
  return markdown_table(["XLA flags", "method", "variant", "step ms", "/ (compute + comm)",
                         "/ max(compute, comm)", "collectives that wait for the batch"], lines)


def verdicts(report: dict) -> str:
  lines = []
  for flags, by_method in report["results"].items():
    for label, r in by_method.items():
      q = derive(r, report["config"]["steps"])
      for v in SPLITS:
        if v in q:
          ok = "meets" if q[v]["vs_max"] <= TARGET else "misses"
          lines.append(f"- {flags or 'default flags'}, {label}, {v}: {q[v]['vs_max']:.2f}x "
                       f"max(compute, comm) ({ok} the {TARGET}x target), "
                       f"{q[v]['vs_sum']:.2f}x compute + comm.")
  return "\n".join(lines)


def main(argv=None) -> int:
  args = parse_args(argv)
  out = jobs.driver_out(args, worker)
  if out is None:
    return 0
  info = meta(load_before=os.getloadavg())
  reason = netns.why_not_shaped()
  if reason:
    return netns.report_skip("bench_overlap", out / "overlap.json", reason, info)
  import jax
  info["jax"] = jax.__version__
  cfg = {k: getattr(args, k) for k in ("methods", "variants", "hidden", "batch", "lr",
                                       "rounds", "steps")}
  results: dict = {}
  t0 = time.perf_counter()
  netns.interrupt_on_sigterm()
  with netns.Namespace() as ns:
    ns.shape(args.bandwidth)
    for flags in args.xla_flags:
      print(f"{args.processes} processes at {args.bandwidth}, XLA_FLAGS={flags!r} "
            f"({time.perf_counter() - t0:.0f} s)", flush=True)
      results[flags] = jobs.launch_job(
          ns, args.processes, cfg, args.timeout,
          [str(pathlib.Path(__file__).resolve()), "--worker"],
          cpu_devices=2 if "split/2dev" in cfg["variants"] else 1, xla_flags=flags)
  info["load_after"] = os.getloadavg()
  report = {"config": cfg, "meta": info, "processes": args.processes,
            "bandwidth": args.bandwidth, "results": results,
            "seconds": time.perf_counter() - t0}
  (out / "overlap.json").write_text(json.dumps(report, indent=1))
  text = table(report) + "\n\n" + verdicts(report)
  print(text)
  (out / "overlap.md").write_text(
      f"{args.processes} processes x {2 if 'split/2dev' in args.variants else 1} CPU devices, "
      f"gloo, loopback at {args.bandwidth}; MLP "
      f"hidden {args.hidden}, {args.batch} rows per worker; medians of {args.rounds} x "
      f"{args.steps} steps; load average {info['load_before'][0]:.1f} before, "
      f"{info['load_after'][0]:.1f} after ({info['cpus']} CPUs).\n\n" + text + "\n")
  print(f"wrote {out / 'overlap.json'} and {out / 'overlap.md'} in "
        f"{time.perf_counter() - t0:.0f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
