"""The command line: ``python -m commopt.launch``.

It runs a script as :func:`commopt.launch.launch` does or, with ``--supervise``, as
:func:`commopt.elastic.supervise` does (restarted on the processes left when one dies),
and prints each process's output::

    python -m commopt.launch --processes 2 --cpu-devices 4 train.py --steps 10
"""

from __future__ import annotations

import argparse
import sys

from commopt import elastic
from commopt._src import host_memory as _host_memory
from commopt.launch import LaunchError, launch


def main(argv=None) -> int:
  """``python -m commopt.launch --processes N [--cpu-devices D] [--supervise] script [args]``;
  on each of several machines, ``--nodes M --node-rank R --coordinator HOST:PORT`` too."""
  p = argparse.ArgumentParser(prog="python -m commopt.launch", description=main.__doc__)
  p.add_argument("--processes", type=int, required=True)
  p.add_argument("--cpu-devices", type=int, default=None,
                 help="simulated CPU devices per process (default: the backend's devices)")
  p.add_argument("--timeout", type=float, default=3600.0)
  p.add_argument("--grace", type=float, default=1.0,
                 help="seconds from SIGTERM to SIGKILL for the others when a process fails")
  p.add_argument("--stop-grace", type=float, default=10.0,
                 help="seconds from SIGTERM to SIGKILL when the launcher is ended (SIGTERM, "
                      "Ctrl-C): what a process that polls launch.should_stop() has to save")
  p.add_argument("--nodes", type=int, default=1,
                 help="machines running the job, each with a launcher of its own")
  p.add_argument("--node-rank", type=int, default=0, help="this machine's rank, 0 to nodes-1")
  p.add_argument("--coordinator", default=None,
                 help="HOST:PORT of node 0's coordinator, reachable from every node "
                      "(default, one node: a free local port)")
  p.add_argument("--host-memory", default="reuse", choices=_host_memory.MODES,
                 help="reuse: each process's malloc keeps the memory it frees (no mmap, no "
                      "trimming, one arena), unless a MALLOC_* variable or glibc.malloc "
                      "tunable of yours is set; system: the C library's defaults")
  _add_supervise_arguments(p)
  p.add_argument("script")
  p.add_argument("args", nargs=argparse.REMAINDER)
  args = p.parse_args(argv)
  argv = [args.script, *args.args]
  common = dict(devices_per_process=args.cpu_devices, timeout=args.timeout, grace=args.grace,
                stop_grace=args.stop_grace, host_memory=args.host_memory)
  nodes = dict(nodes=args.nodes, node_rank=args.node_rank, coordinator=args.coordinator)
  try:
    if args.supervise and args.nodes != 1:
      raise ValueError("launch: --supervise restarts the job on this machine's processes; it "
                       f"does not run across machines (got --nodes {args.nodes}).")
    if args.supervise:
      outputs = _supervise(argv, args, common)
    else:
      outputs = [(f"process {r.process_id}", r.output)
                 for r in launch(argv, args.processes, **common, **nodes)]
  except (LaunchError, ValueError) as e:
    print(e, file=sys.stderr)
    return 1
  except KeyboardInterrupt as e:
    print(f"{e or 'launch: interrupted'}; every process was ended.", file=sys.stderr)
    return 130
  for title, out in outputs:
    print(f"--- {title} ---\n{out}", end="" if out.endswith("\n") else "\n")
  return 0


def _add_supervise_arguments(parser) -> None:
  """The flags of :func:`commopt.elastic.supervise`."""
  parser.add_argument("--supervise", action="store_true",
                      help="restart on the processes left when one fails (elastic.supervise)")
  parser.add_argument("--min-processes", type=int, default=1,
                      help="with --supervise: the fewest processes to continue on")
  parser.add_argument("--max-restarts", type=int, default=3,
                      help="with --supervise: restarts after failures before giving up")
  parser.add_argument("--rejoin-after", type=float, default=None,
                      help="with --supervise: seconds on fewer processes before all start again")


def _supervise(argv, args, common: dict) -> list:
  """:func:`commopt.elastic.supervise` from the command line's ``args``: ``(title, output)``
  of process 0 of each start."""
  attempts = elastic.supervise(argv, args.processes, min_processes=args.min_processes,
                               max_restarts=args.max_restarts, rejoin_after=args.rejoin_after,
                               **common)
  return [(f"start {i}: {a.processes} processes ({a.why}), process 0",
           a.results[0].output if a.results else "") for i, a in enumerate(attempts)]


if __name__ == "__main__":
  sys.exit(main())
