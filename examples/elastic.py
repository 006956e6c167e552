"""Elastic DiLoCo: training that goes on when a worker dies, and takes it back later.

Run it under the supervisor (one CPU device per process)::

    python -m commopt.launch --processes 4 --cpu-devices 1 --supervise --min-processes 2 \\
        --rejoin-after 40 --stop-grace 60 examples/elastic.py --ckpt /tmp/elastic --kill-at 37

Every process trains a small MLP regression (a fixed random teacher, offline data)
with :func:`commopt.transforms.sparseloco` (AdamW inside, chunked top-k 2-bit pseudo-gradients with
error feedback every ``--period`` steps) under ``commopt.data_parallel(...,
local_params=True)``, one worker per device. It saves a checkpoint at every outer step
(a :class:`commopt.checkpoint.CheckpointManager` under ``--ckpt``) and, when it starts,
restores the latest one, resized onto however many workers it now has (the error
feedback's residuals keep their mean, so nothing it owes the model is lost).

``--kill-at S`` is fault injection: on the first start, process ``--kill-process`` (the
last by default) sends itself ``SIGKILL`` after step ``S``, with no chance to clean up.
The supervisor ends the others, starts the job again on the processes left, which go
back to the last outer step; ``--rejoin-after`` seconds later it asks that run to stop
(it saves at the next outer step and exits; ``--stop-grace`` bounds how long that may
take) and starts it on all of them again.

The global batch (``--batch`` rows, drawn from the step number) is the same whatever the
number of workers, split over them. Process 0 appends one JSON line per step to
``--log`` (start, workers, step, mean loss over the workers): the steps a failure cost
are the ones that appear twice.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--ckpt", required=True, help="checkpoint directory (kept between starts)")
  p.add_argument("--log", default=None, help="append one JSON line per step here (process 0)")
  p.add_argument("--steps", type=int, default=120)
  p.add_argument("--period", type=int, default=10, help="H: inner steps between outer steps")
  p.add_argument("--batch", type=int, default=48, help="global batch (divisible by 1 to 4)")
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--kill-at", type=int, default=None,
                 help="on the first start, --kill-process sends itself SIGKILL after this step")
  p.add_argument("--kill-process", type=int, default=None, help="default: the last process")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  if args.steps % args.period:
    p.error(f"--steps ({args.steps}) must be a multiple of --period ({args.period})")
  return args


def teacher(seed: int):
  import numpy as np
  rng = np.random.default_rng(seed)
  return rng.normal(size=(32, 64)) / np.sqrt(32), rng.normal(size=(64, 8)) / np.sqrt(64)


def global_batch(step: int, rows: int, seed: int) -> dict:
  """The step's rows, the same whatever the number of workers."""
  import numpy as np
  w1, w2 = teacher(seed)
  x = np.random.default_rng([seed, step]).normal(size=(rows, 32))
  return {"x": x.astype(np.float32), "y": (np.tanh(x @ w1) @ w2).astype(np.float32)}


def main(argv=None) -> int:
  args = parse_args(argv)
  from commopt import launch
  ctx = launch.initialize(handle_sigterm=True)
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.experimental import multihost_utils

  import commopt
  from commopt import checkpoint

  workers = jax.device_count()
  if args.batch % workers:
    sys.exit(f"--batch ({args.batch}) must be divisible by the {workers} workers")
  mesh = jax.make_mesh((workers,), ("data",))
  rng = np.random.default_rng(args.seed + 1)
  params0 = {"w1": (rng.normal(size=(32, 128)) / np.sqrt(32)).astype(np.float32),
             "b1": np.zeros(128, np.float32),
             "w2": (rng.normal(size=(128, 8)) / np.sqrt(128)).astype(np.float32)}

  def loss(p, b):
    return jnp.mean((jnp.tanh(b["x"] @ p["w1"] + p["b1"]) @ p["w2"] - b["y"]) ** 2)

  tx = commopt.transforms.sparseloco(optax.adamw(args.lr), axis_name="data", period=args.period,
                                     k=64, min_size=0)
  dp = commopt.data_parallel(loss, tx, mesh, local_params=True)
  manager = checkpoint.CheckpointManager(args.ckpt, max_to_keep=2)
  if manager.latest_step() is not None:
    restored = manager.restore(dp, params0)
    params, state, first = restored.params, restored.opt_state, restored.step
  else:
    params, state, first = dp.place_params(params0), dp.init(params0), 0
  start = launch.attempt()
  if ctx.is_main:
    print(f"start {start}: {workers} workers from step {first}", flush=True)
  kill = args.kill_process if args.kill_process is not None else ctx.num_processes - 1
  per_process = args.batch // ctx.num_processes
  step = first
  for step in range(first, args.steps):
    rows = global_batch(step, args.batch, args.seed)
    mine = {k: v[ctx.process_id * per_process:(ctx.process_id + 1) * per_process]
            for k, v in rows.items()}
    params, state, losses = dp.step(params, state, dp.local_batch(mine))
    value = float(np.mean(multihost_utils.process_allgather(losses, tiled=True)))
    if ctx.is_main and args.log:
      with open(args.log, "a") as f:
        f.write(json.dumps({"start": start, "workers": workers, "step": step + 1,
                            "loss": value}) + "\n")
    if start == 0 and args.kill_at == step + 1 and ctx.process_id == kill:
      os.kill(os.getpid(), signal.SIGKILL)       # a worker lost, mid-period, without warning
    stop = launch.should_stop()                  # every step, on every process (a sync point)
    if (step + 1) % args.period == 0:            # an outer step: everything is in the anchor
      manager.save(step + 1, params, state)
      if stop:
        break
  manager.close()
  if ctx.is_main:
    print(f"start {start}: stopped after step {step + 1} of {args.steps}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
