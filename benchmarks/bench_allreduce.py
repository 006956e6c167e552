"""One all-reduce of the same bytes across processes: XLA's against torch.distributed's.

Where commopt's dense step and PyTorch DDP's differ on CPUs, part of it is the
collective itself, not commopt: this measures it alone. ``--processes`` processes of
one CPU device each (started by :func:`commopt.launch.launch`) hold a float32 buffer
of ``--mb`` MB and sum it over all of them, in turn:

- ``xla``: ``jax.jit(jax.shard_map(lax.psum))`` over the processes' mesh, which
  XLA:CPU runs as one gloo all-reduce (``jax.distributed``);
- ``torch``: ``torch.distributed.all_reduce`` of a tensor of the same size over a
  gloo process group of the same processes (skipped, saying why, without torch:
  ``pip install -e ".[peers]"``).

Each is timed as the median of ``--steps`` calls after one warm-up (each blocked
until done), the two interleaved call by call; process 0 prints the table. XLA writes
each sum into a new buffer, torch into its tensor in place (refilled between calls,
untimed).

    python benchmarks/bench_allreduce.py                       # 4 processes, 1 and 17 MB
    python benchmarks/bench_allreduce.py --processes 2 --mb 64
"""

from __future__ import annotations

import argparse
import json
import pathlib
import socket
import statistics
import sys
import tempfile
import time


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--processes", type=int, default=4)
  p.add_argument("--mb", default="1,17", help="comma-separated buffer sizes in MB")
  p.add_argument("--steps", type=int, default=12, help="timed calls per size (median)")
  p.add_argument("--timeout", type=float, default=600, help="seconds for the whole job")
  p.add_argument("--worker", nargs=2, metavar=("RESULT", "TORCH_PORT"), help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.processes < 2:
    p.error(f"--processes must be at least 2, got {args.processes}")
  try:
    args.mb = [float(m) for m in args.mb.split(",")]
  except ValueError:
    p.error(f"--mb must be comma-separated numbers, got {args.mb!r}")
  if not args.mb or min(args.mb) <= 0:
    p.error(f"--mb must be positive sizes, got {args.mb}")
  if args.steps < 1:
    p.error(f"--steps must be at least 1, got {args.steps}")
  return args


def _torch_group(process_id: int, processes: int, port: str):
  """A gloo process group of the job's processes, or the reason there is none."""
  try:
    import datetime

    import torch.distributed as dist
  except ImportError as e:
    return None, f"torch is not installed ({e}); pip install -e '.[peers]'"
  dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=process_id,
                          world_size=processes, timeout=datetime.timedelta(seconds=300))
  return dist, None


def worker(args) -> None:
  from commopt import launch
  ctx = launch.initialize()
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P

  result, port = args.worker
  dist, why = _torch_group(ctx.process_id, ctx.num_processes, port)
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  psum = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh,
                               in_specs=P("data"), out_specs=P("data")))
  rows = []
  for mb in args.mb:
    n = int(mb * 2**20 / 4)
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")),
                                               np.ones(n, np.float32))
    t = None
    if dist is not None:
      import torch
      t = torch.ones(n)
    times = {"xla": [], "torch": []}
    for _ in range(args.steps + 1):
      start = time.perf_counter()
      psum(x).block_until_ready()
      times["xla"].append(time.perf_counter() - start)
      if t is not None:
        t.fill_(1.0)
        start = time.perf_counter()
        dist.all_reduce(t)
        times["torch"].append(time.perf_counter() - start)
    med = {k: statistics.median(v[1:]) * 1e3 if v else None for k, v in times.items()}
    rows.append({"mb": mb, "xla_ms": med["xla"], "torch_ms": med["torch"]})
  if ctx.process_id == 0:
    pathlib.Path(result).write_text(json.dumps({"rows": rows, "torch": why}))
  if dist is not None:
    dist.destroy_process_group()


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.worker:
    worker(args)
    return 0
  from commopt import launch
  with tempfile.TemporaryDirectory() as tmp:
    result = pathlib.Path(tmp) / "result.json"
    argv = [__file__, "--worker", str(result), str(_free_port()), "--steps", str(args.steps),
            "--mb", ",".join(str(m) for m in args.mb)]
    launch.launch(argv, processes=args.processes, devices_per_process=1, timeout=args.timeout)
    out = json.loads(result.read_text())
  if out["torch"]:
    print(f"torch side skipped: {out['torch']}")
  print(f"\n{args.processes} processes, one all-reduce of float32 (median of {args.steps})\n")
  print("| MB | XLA psum ms | torch all_reduce ms | XLA × torch |\n|---|---|---|---|")
  for r in out["rows"]:
    torch_ms = "–" if r["torch_ms"] is None else f"{r['torch_ms']:.1f}"
    ratio = "–" if r["torch_ms"] is None else f"{r['xla_ms'] / r['torch_ms']:.2f}"
    print(f"| {r['mb']:g} | {r['xla_ms']:.1f} | {torch_ms} | {ratio} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
