"""ZeRO-3 and ZeRO++'s options on two "machines" joined by a slow link: wall-clock time.

Two network namespaces of this benchmark's own are two nodes. Each runs ``--local``
processes of one ``jax.distributed`` job (one CPU device each, gloo on TCP), started by a
launcher of its own (``python -m commopt.launch --nodes 2 --node-rank R --coordinator
...``, the coordinator on node 0). A veth pair joins the nodes, limited by ``tc qdisc ...
tbf`` to each ``--bandwidths`` rate in both directions (``unlimited``: no qdisc); inside a
node the processes talk over the namespace's own loopback, unshaped. Each process's gloo
binds to its node's address: ``/etc/netns/<namespace>/hosts``, which ``ip netns exec``
puts in place of ``/etc/hosts``, maps this machine's host name to it.

Every setup trains ``bench_zero.py``'s residual MLP (64 inputs, ``--layers`` stacked
``--width``-wide tanh blocks, 8 outputs; 1.6M parameters at the defaults) with
``zero_data_parallel(..., axis_name=("node", "local"), gather="manual")`` and adam, one
layer gathered at a time (forward, and again in the rematerialised backward), from the
same start on the same batches (``--rows`` per worker), for ``--steps`` steps:

- ``dense``: ZeRO-3, dense all-gathers and reduce-scatter over all the devices;
- ``qwZ``: the weights gathered as int8 (blocks of 2048, nearest rounding);
- ``qwZ+qgZ``: and the gradients reduce-scattered as int4 chunks, inside each node and
  then across nodes (``hierarchical=True``);
- ``hpZ``: a secondary partition of each layer inside the node, so the backward gathers
  stay inside it;
- ``qwZ+qgZ+hpZ``: all three.

For each, per bandwidth: the median step time (every step blocked until ready; the first,
compiling, step not timed), its ratio to dense's, the bytes one device sends per step
across nodes and in all (ring model, from the compiled step, ``harness.hlo.sent_bytes``),
the mean loss of the last 5 steps, and the time to ``--target`` (the first step whose
workers' mean loss reaches it, times the median step time; by default 1.1x dense's final
loss at the same bandwidth).

Needs root (``ip netns``, ``tc``, writing ``/etc/netns``); without it the benchmark says
why and exits 0 having measured nothing. The namespaces and their ``/etc/netns`` folders
are always removed, on errors and Ctrl-C too; the host's own interfaces are never touched.

    python benchmarks/bench_nodes.py                           # ~10 min on 2 cores
    python benchmarks/bench_nodes.py --bandwidths 1gbit --steps 20 --setups dense,hpZ

Writes ``nodes.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness import jobs, netns  # noqa: E402  (after the path)
from harness.summary import first_reaching, markdown_table  # noqa: E402

SETUPS = {
    # label: zero_data_parallel options (Q8: int8 weights, Q4: int4 gradients)
    "dense": {},
    "qwZ": {"weights": "Q8"},
    "qwZ+qgZ": {"weights": "Q8", "grads": "Q4", "hierarchical": True},
    "hpZ": {"hpz": True},
    "qwZ+qgZ+hpZ": {"weights": "Q8", "grads": "Q4", "hierarchical": True, "hpz": True},
}
STACKED = {"embed": False, "layers": True, "head": False}
TAIL = 5
"""Steps whose mean loss is a run's final loss."""


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--local", type=int, default=2, help="processes per node (2 nodes)")
  p.add_argument("--bandwidths", default="1gbit,10gbit,unlimited",
                 help="comma-separated tc rates of the link between the nodes, or unlimited")
  p.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated of {list(SETUPS)}")
  p.add_argument("--width", type=int, default=512)
  p.add_argument("--layers", type=int, default=6)
  p.add_argument("--rows", type=int, default=64, help="batch rows per worker per step")
  p.add_argument("--steps", type=int, default=40)
  p.add_argument("--lr", type=float, default=1e-3)
  p.add_argument("--target", type=float, default=None,
                 help="target loss (default: 1.1x dense's final loss at each bandwidth)")
  p.add_argument("--timeout", type=float, default=900, help="seconds per bandwidth")
  p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
  p.add_argument("--worker", nargs=2, metavar=("CONFIG", "RESULT"), help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  unknown = [s for s in args.setups.split(",") if s not in SETUPS]
  if unknown:
    p.error(f"--setups: unknown {unknown}; choose from {list(SETUPS)}")
  for name in ("local", "layers", "width", "rows", "steps"):
    if getattr(args, name) < 1:
      p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
  if args.steps <= TAIL:
    p.error(f"--steps must be more than {TAIL}, got {args.steps}")
  return args


# -- inside each process ---------------------------------------------------------------

def worker(config_path: str, result_path: str) -> None:
  from commopt import launch
  ctx = launch.initialize()
  import jax
  import numpy as np
  import optax
  from jax.experimental import multihost_utils

  import commopt
  from harness.hlo import sent_bytes
  from harness.models import quantizer, stacked_problem

  cfg = json.loads(pathlib.Path(config_path).read_text())
  local = cfg["local"]
  # Processes are numbered node by node, and each has one device: row r of the mesh is node r.
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  mesh = jax.sharding.Mesh(np.array(devices).reshape(2, local), ("node", "local"))
  params, loss_fn, batch = stacked_problem(cfg["width"], cfg["layers"])
  quant = {"Q8": quantizer(8), "Q4": quantizer(4)}
  workers = 2 * local
  size = cfg["rows"] * workers
  mine = lambda rows: {k: np.split(v, ctx.num_processes)[ctx.process_id] for k, v in rows.items()}
  out = {}
  for label in cfg["setups"]:
    kw = {k: quant.get(v, v) if isinstance(v, str) else v for k, v in SETUPS[label].items()}
    zp = commopt.zero_data_parallel(loss_fn, optax.adam(cfg["lr"]), mesh,
                                    axis_name=("node", "local"), gather="manual", **kw)
    sharded = zp.shard(params, stacked=STACKED)
    state = zp.init(sharded)
    # Every process compiles the step the same way (an executable compiled by one process
    # alone, from other arguments, may order its collectives otherwise than the others').
    text = zp.lower(sharded, state, zp.local_batch(mine(batch(0, size)))).compile().as_text()
    by_kind, _, _, ring = sent_bytes(text, mesh, local)
    row = {"total_bytes": int(sum(by_kind.values())), "cross_node_bytes": int(round(ring))}
    losses, times = [], []
    for step in range(cfg["steps"]):
      b = zp.local_batch(mine(batch(step, size)))
      t0 = time.perf_counter()
      sharded, state, l = zp.step(sharded, state, b)
      jax.block_until_ready(l)
      times.append(time.perf_counter() - t0)
      losses.append(float(np.mean(multihost_utils.process_allgather(l, tiled=True))))
    row.update(step_s=statistics.median(times[1:]), losses=losses)
    out[label] = row
    if ctx.is_main:
      print(f"  {label}: {1e3 * row['step_s']:.1f} ms/step, final loss "
            f"{np.mean(losses[-TAIL:]):.4f}", flush=True)
  if ctx.is_main:
    pathlib.Path(result_path).write_text(json.dumps(out))


def derive(rows: dict, target: float | None) -> dict:
  """Each setup's row with its final loss, ratio to dense's step, and time to the target
  (``target``, or 1.1x dense's final loss)."""
  final = {k: statistics.fmean(r["losses"][-TAIL:]) for k, r in rows.items()}
  if target is None and "dense" in final:
    target = 1.1 * final["dense"]
  out = {}
  for k, r in rows.items():
    reach = None if target is None else first_reaching(enumerate(r["losses"], 1), target)
    out[k] = {**{n: v for n, v in r.items() if n != "losses"}, "final_loss": final[k],
              "target": target, "steps_to_target": reach,
              "time_to_target_s": None if reach is None else reach * r["step_s"],
              "vs_dense": r["step_s"] / rows["dense"]["step_s"] if "dense" in rows else None}
  return out


def table(results: dict) -> str:
  head = ["link between nodes", "setup", "ms/step", "× dense", "bytes across nodes",
          "bytes sent", "final loss", "time to target"]
  lines = []
  for rate, rows in results.items():
    for k, r in rows.items():
      ttt = "not reached" if r["time_to_target_s"] is None else (
          f"{r['time_to_target_s']:.2f} s ({r['steps_to_target']} steps)")
      ratio = "" if r["vs_dense"] is None else f"{r['vs_dense']:.2f}"
      lines.append([rate, k, f"{1e3 * r['step_s']:.1f}", ratio,
                    f"{r.get('cross_node_bytes', 0):,}", f"{r.get('total_bytes', 0):,}",
                    f"{r['final_loss']:.4f}", ttt])
  return markdown_table(head, lines)


def main(argv=None) -> int:
  args = parse_args(argv)
  out = jobs.driver_out(args, worker)
  if out is None:
    return 0
  reason = netns.why_not_shaped(netns.Nodes, "cannot build two namespaces joined by a veth pair")
  if reason is not None:
    return netns.report_skip("bench_nodes", out / "nodes.json", reason, end="", indent=None)
  cfg = {"local": args.local, "setups": args.setups.split(","), "width": args.width,
         "layers": args.layers, "rows": args.rows, "steps": args.steps, "lr": args.lr}
  results = {}
  with netns.Nodes() as nodes:
    for rate in args.bandwidths.split(","):
      nodes.shape(rate)
      print(f"[{rate}] 2 nodes x {args.local} processes", flush=True)
      job = jobs.launch_nodes(nodes, cfg, args.timeout, [str(pathlib.Path(__file__)), "--worker"])
      results[rate] = derive(job, args.target)
  print(table(results))
  report = {"config": cfg, "bandwidths": args.bandwidths.split(","), "results": results,
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "command": " ".join(sys.argv)}
  (out / "nodes.json").write_text(json.dumps(report, indent=1))
  print(f"wrote {out / 'nodes.json'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
