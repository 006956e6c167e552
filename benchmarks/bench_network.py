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
- PyTorch (``TORCH_METHODS``, ``benchmarks/_torch_peer.py``, optional: the
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
import types

ROOT = pathlib.Path(__file__).resolve().parents[1]

METHODS = {
    # label: (registry name, options, strategy, error feedback)
    "dense": ("identity", {}, "auto", False),
    "cast(bf16)": ("cast", {"dtype": "bfloat16"}, "auto", True),
    # DDP's fp16 hook as commopt runs it: float16 chunks (moved as 16-bit words) to their
    # owners, summed there in float32, the float16 means gathered back; no residual, as the hook.
    "cast(fp16)/two_phase": ("cast", {"dtype": "float16"}, "two_phase", False),
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
"""commopt's per-step methods: every step all-reduces through the compressor."""
COMBINED = {
    # label: (period H, registry name, options, strategy, outer optimizer)
    # DiLoCo with the same momentum SGD inside, its pseudo-gradients exchanged every H steps
    # through a compressor. Outer: sgd(1.0) throughout, the module's choice over an
    # error-feedback residual (scaled_sign), passed for int_quant, which keeps none (its default
    # there, Nesterov 0.7/0.9, compounds with the inner momentum and diverges on this MLP).
    "diloco(3)+int_quant(4)": (3, "int_quant", {"bits": 4}, "two_phase", "sgd(1.0)"),
    "diloco(4)+int_quant(4)": (4, "int_quant", {"bits": 4}, "two_phase", "sgd(1.0)"),
    "diloco(8)+int_quant(4)": (8, "int_quant", {"bits": 4}, "two_phase", "sgd(1.0)"),
    "diloco(8)+scaled_sign": (8, "scaled_sign", {}, "two_phase", None),
}
"""commopt's combined methods: DiLoCo (``period`` local steps) with compressed outer gradients."""
ZERO = {
    # label: (weights, grads): zero_data_parallel's gathers, int_quant nearest, blocks of 2048
    "zero": (None, None),
    "zero+qwZ": (8, None),
    "zero+qgZ": (None, 4),
    "zero+qwZ+qgZ": (8, 4),
}
"""commopt's ZeRO-3 (parameters and state sharded over the workers): dense, int8 weights
(qwZ), int4 gradients (qgZ), both; the same momentum SGD."""
OVERLAPPED = {
    # label: the per-step method whose exchange overlaps the next backward pass
    "overlap:dense": "dense",
    "overlap:scaled_sign/gather": "scaled_sign/gather",
}
"""commopt's per-step methods one step delayed, run by ``overlapped_data_parallel``: the
exchange of the kept gradient on a thread of its own beside the next backward pass."""
EAGER = {
    # label: (the combined method (COMBINED) whose outer steps are eager, own_weight)
    "eager:diloco(4)+int_quant(4)": ("diloco(4)+int_quant(4)", None),
    "eager:diloco(8)+int_quant(4)": ("diloco(8)+int_quant(4)", None),
    "eager(w=1):diloco(3)+int_quant(4)": ("diloco(3)+int_quant(4)", 1.0),
    "eager(w=1):diloco(4)+int_quant(4)": ("diloco(4)+int_quant(4)", 1.0),
    "eager(w=1):diloco(8)+int_quant(4)": ("diloco(8)+int_quant(4)", 1.0),
}
"""commopt's combined methods with eager outer steps (``eager_diloco``): each outer exchange on
a thread of its own beside the whole next inner phase, the outer step taken at once; the
worker's own pseudo-gradient weighs 1/M in its estimate (the paper's), or 1 (``w=1``)."""
TORCH_METHODS = ("torch:dense", "torch:fp16", "torch:power_sgd(2)")
"""The PyTorch peer (``benchmarks/_torch_peer.py``): DDP over gloo, plain and with its hooks."""
ALL_METHODS = [*METHODS, *COMBINED, *EAGER, *OVERLAPPED, *ZERO, *TORCH_METHODS]
BURST = {"1gbit": "128kb", "10gbit": "1280kb"}
"""tbf bucket per rate: at least rate / HZ (one timer tick of data)."""


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


# -- the worker: one process of the job ------------------------------------------------

def smoothed(losses, window=5):
  out = []
  for i in range(len(losses)):
    part = losses[max(0, i - window + 1):i + 1]
    out.append(sum(part) / len(part))
  return out


EVAL_ROWS = 512
"""Digits (drawn once from the training digits, the same for every method) the global model is
scored on after each step, for the time to the target loss."""


def eval_rows(n: int):
  """The indices of the :data:`EVAL_ROWS` digits (of ``n``) that the time to the target uses."""
  import numpy as np
  return np.sort(np.random.default_rng(2024).choice(n, min(EVAL_ROWS, n), replace=False))


def batch_rows(n: int, step: int, rows: int):
  """The indices (of ``n`` digits) of step ``step``'s global batch of ``rows`` rows, the same
  for every method, the PyTorch peer and ``bench_eager.py``; worker ``i`` takes the ``i``-th
  share."""
  import numpy as np
  return np.random.default_rng([step, 7]).choice(n, rows, replace=False)


def per_step(times, period: int = 1) -> float:
  """A typical step: the median of ``times``; for a method that exchanges every ``period`` steps,
  the median over consecutive runs of ``period`` steps (each holding one exchange) of their mean."""
  if period <= 1:
    return statistics.median(times)
  runs = [times[i:i + period] for i in range(0, len(times) - period + 1, period)]
  return statistics.median(sum(r) / period for r in runs) if runs else sum(times) / len(times)


def combined_options(label: str, lr: float) -> dict:
  """The arguments of a combined method's DiLoCo (``COMBINED``): inner and outer optimizers,
  period, strategy and compressor, as ``diloco`` and ``eager_diloco`` take them."""
  import optax

  import commopt
  period, name, opts, strategy, outer = COMBINED[label]
  return dict(inner=optax.sgd(lr, momentum=0.9),
              outer={None: None, "sgd(1.0)": optax.sgd(1.0)}[outer], period=period,
              strategy=strategy, compressor=commopt.compressors.make(name, **opts))


def make_tx(label: str, lr: float):
  """(optax transform, period, whether each worker keeps its own parameters) of a commopt method."""
  import optax

  import commopt
  inner = optax.sgd(lr, momentum=0.9)
  if label in COMBINED:
    options = combined_options(label, lr)
    return commopt.diloco(axis_name="data", **options), options["period"], True
  name, opts, strategy, ef = METHODS[label]
  reducer = commopt.compressed_mean(commopt.compressors.make(name, **opts), axis_name="data",
                                    strategy=strategy, error_feedback=ef)
  return optax.chain(reducer, inner), 1, False


class ZeroTrainer:
  """A ``zero_data_parallel`` run behind the few calls the worker makes of ``data_parallel``
  (``place_params``, ``init``, ``local_batch``, ``step``), and ``whole`` for its model."""

  def __init__(self, label: str, loss_fn, lr: float, mesh):
    import optax

    import commopt
    quant = lambda bits: None if bits is None else commopt.int_quant(
        bits=bits, block_size=2048, rounding="nearest")
    weights, grads = ZERO[label]
    self.zp = commopt.zero_data_parallel(loss_fn, optax.sgd(lr, momentum=0.9), mesh,
                                         weights=quant(weights), grads=quant(grads))

  def place_params(self, params):
    return self.zp.shard(params)

  def init(self, params):
    return self.zp.init(self.zp.shard(params))

  def local_batch(self, rows):
    return self.zp.local_batch(rows)

  def step(self, params, state, batch):
    return self.zp.step(params, state, batch)

  def whole(self, params):
    return self.zp.unshard(params)

  def sent_bytes(self, params, state, batch) -> int:
    """What one worker sends per step (ring model), from the compiled step."""
    from commopt import wire
    text = self.zp.lower(params, state, batch).compile().as_text()
    return wire.total_bytes(wire.parse_hlo(text), "sent_bytes", per_run=True)


class EagerTrainer:
  """An ``eager_diloco`` run behind the calls the worker makes of ``data_parallel``, and what
  scoring its global model needs while an exchange may be in flight (no collective then)."""

  def __init__(self, label: str, loss_fn, lr: float, mesh):
    import commopt
    combined, own_weight = EAGER[label]
    self.run = commopt.eager_diloco(loss_fn, mesh=mesh, own_weight=own_weight,
                                    **combined_options(combined, lr))
    self.place_params, self.local_batch = self.run.place_params, self.run.local_batch
    self.init, self.step = self.run.init, self.run.step

  @staticmethod
  def ready(params, state):
    """What a step's time waits for: the inner step and the outer step, not the exchange."""
    return params, state.inner, state.anchors

  @staticmethod
  def snapshot(state):
    """This process's workers' anchors, stacked on the host (no collective)."""
    import jax
    import numpy as np
    return jax.tree.map(lambda a: np.concatenate(
        [np.asarray(s.data) for s in a.addressable_shards]), state.anchors)

  def finish(self, params, state):
    params, state = self.run.finish(params, state)
    self.run.close()
    return params, state


def worker(config_path: str, result_path: str) -> None:
  from commopt import launch
  ctx = launch.initialize()
  import jax
  import numpy as np
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
    idx = batch_rows(len(x_all), step, rows * workers)
    mine = np.split(idx, ctx.num_processes)[ctx.process_id]
    return {"x": x_all[mine], "y": y_all[mine]}

  global_mesh = jax.make_mesh((workers,), ("data",))
  local_mesh = jax.make_mesh((1,), ("data",), devices=jax.local_devices()[:1])
  score = jax.jit(loss_fn)

  barriers = iter(range(1 << 30))

  def barrier():
    """Every process here, through the coordination service (not a device collective), so
    that the evaluation's gather never starts while a step's collectives run on another
    process."""
    from jax._src import distributed
    distributed.global_state.client.wait_at_barrier(f"bench_network_{next(barriers)}", 600_000)

  def global_loss(model, rows=None) -> float:
    """The loss of a (replicated) global model, or of host arrays the same on every process,
    on ``rows`` of the digits (all by default): each process scores its share, and the
    processes add up (untimed)."""
    rows = np.arange(len(x_all)) if rows is None else rows
    share = np.array_split(rows, ctx.num_processes)[ctx.process_id]
    host = jax.tree.map(lambda a: a if isinstance(a, np.ndarray)
                        else np.asarray(a.addressable_data(0)), model)
    part = float(score(host, {"x": x_all[share], "y": y_all[share]})) * len(share)
    barrier()
    total = float(np.sum(multihost_utils.process_allgather(np.float64(part)))) / len(rows)
    barrier()
    return total

  scored = eval_rows(len(x_all))

  results = {}
  for label in cfg["methods"]:
    zero, eager = label in ZERO, label in EAGER
    overlapped = label in OVERLAPPED
    if zero:
      dp, period, local_params = ZeroTrainer(label, loss_fn, cfg["lr"], global_mesh), 1, False
      whole = dp.whole
    elif eager:
      tx, period, local_params = make_tx(EAGER[label][0], cfg["lr"])
      dp = EagerTrainer(label, loss_fn, cfg["lr"], global_mesh)
    elif overlapped:
      tx, period, local_params = make_tx(OVERLAPPED[label], cfg["lr"])
      dp = commopt.overlapped_data_parallel(loss_fn, tx, global_mesh)
      whole = lambda p: p
    else:
      tx, period, local_params = make_tx(label, cfg["lr"])
      dp = commopt.data_parallel(loss_fn, tx, global_mesh, local_params=local_params)
      whole = lambda p: p
    params, state = dp.place_params(params0), dp.init(params0)
    # What one synchronisation sends; a periodic method's per-step share is 1/period of it.
    if zero:
      dense = wire.comm_plan(make_tx("dense", cfg["lr"])[0], params0, workers)
      sent = dp.sent_bytes(params, state, dp.local_batch(my_rows(0)))
      plan = types.SimpleNamespace(sent_bytes=sent, dense_sent=dense.dense_sent)
    else:
      plan = wire.comm_plan(tx, params0, workers)
    times, losses, global_losses, anchors = [], [], [], []
    for step in range(cfg["steps"]):
      batch = dp.local_batch(my_rows(step))
      t0 = time.perf_counter()
      params, state, loss = dp.step(params, state, batch)
      jax.block_until_ready((params, state.opt, state.kept) if overlapped else
                            dp.ready(params, state) if eager else (params, state))
      times.append(time.perf_counter() - t0)
      losses.append(loss)
      # The global model after this step, scored untimed: the parameters, or a periodic
      # method's anchor, which only a synchronisation moves. An eager run's exchange may be
      # in flight: its anchors are kept on the host and scored once it has finished.
      if not local_params:
        global_losses.append([step + 1, global_loss(whole(params), scored)])
      elif commopt.transforms.is_sync_step(step, period, 0):
        if eager:
          anchors.append([step + 1, dp.snapshot(state)])
        else:
          global_losses.append([step + 1, global_loss(commopt.global_params(state), scored)])
    if eager:
      params, state = dp.finish(params, state)
      for k, mine in anchors:     # the mean of every worker's anchor, over the processes
        every = multihost_utils.process_allgather(mine)
        model = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]).mean(axis=0), every)
        global_losses.append([k, global_loss(model, scored)])
    losses = [float(np.mean(v)) for v in multihost_utils.process_allgather(losses, tiled=True)]
    model = dp.run.global_params(state) if eager else (
        commopt.global_params(state) if local_params else whole(params))
    eval_loss = global_loss(model)
    # Compute alone: the same step on this process's device, every process at once (whole
    # periods of a periodic method, each with its one exchange, encoding and decoding).
    local = (ZeroTrainer(label, loss_fn, cfg["lr"], local_mesh) if zero else
             EagerTrainer(label, loss_fn, cfg["lr"], local_mesh) if eager else
             commopt.data_parallel(loss_fn, tx, local_mesh, local_params=local_params))
    lp, ls = local.place_params(params0), local.init(params0)
    batch = my_rows(0)
    multihost_utils.sync_global_devices(f"compute {label}")
    compute = []
    # Compiling steps: the first (and an overlapped method's second, the exchange's first; an
    # eager method's first two periods: its outer step's, then the wait for its first exchange;
    # a periodic method's first period, whose last step makes its program's first cross-process
    # collective, as the dense step does in its first step: 0.6-1.1 s in two runs of three).
    compiling = 2 if overlapped else 2 * period if eager else period
    warm = compiling if eager else 1     # compute alone: an overlapped step has no exchange
    for _ in range(period * -(-cfg["compute_steps"] // period) + warm):
      t0 = time.perf_counter()
      lp, ls, _ = local.step(lp, ls, batch)
      jax.block_until_ready(local.ready(lp, ls) if eager else (lp, ls))
      compute.append(time.perf_counter() - t0)
    if eager:
      local.finish(lp, ls)
    multihost_utils.sync_global_devices(f"computed {label}")
    if overlapped:
      dp.close()
    step_s = per_step(times[compiling:], period)
    compute_s = per_step(compute[warm:], period)
    comm_s = max(step_s - compute_s, 0.0)
    results[label] = {
        "step_s": step_s, "compute_s": compute_s, "comm_s": comm_s,
        "sent_bytes": plan.sent_bytes / period, "dense_sent_bytes": plan.dense_sent,
        "period": period, "sync_sent_bytes": plan.sent_bytes, "global_losses": global_losses,
        "losses": losses, "step_times": times, "compile_s": times[0], "eval_loss": eval_loss,
        "compiling_steps": compiling,
        # The steps that compile or wait for a compiled program, counted as typical ones.
        "compiled_at": ([0, period - 1, 2 * period - 1] if eager else [0, period - 1]
                        if period > 1 else list(range(compiling))),
    }
    if ctx.is_main:
      print(f"  {label}: {step_s * 1e3:.1f} ms/step (compute {compute_s * 1e3:.1f}, "
            f"communication {comm_s * 1e3:.1f}), {plan.sent_bytes / period / 1e6:.2f} MB "
            f"sent/worker, loss {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)
  if ctx.is_main:
    pathlib.Path(result_path).write_text(json.dumps(results))


# -- the driver: namespaces, shaping, launching ---------------------------------------

def torch_peer():
  """benchmarks/_torch_peer.py as a module (it imports torch only when it runs or is asked)."""
  import importlib.util
  spec = importlib.util.spec_from_file_location("_torch_peer",
                                                ROOT / "benchmarks" / "_torch_peer.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def peer_arrays(hidden: int, path: pathlib.Path) -> dict:
  """Writes the JAX side's initial MLP weights and the digits for the PyTorch peer; its config."""
  import numpy as np
  sys.path.insert(0, str(ROOT / "examples"))
  from digits_cnn import load_digits_flat, mlp_fns
  params0, _ = mlp_fns(hidden)
  x_all, y_all = load_digits_flat()
  layers = sorted(params0)
  np.savez(path, x=x_all, y=y_all, scored=eval_rows(len(x_all)),
           **{f"{k}.{leaf}": params0[k][leaf] for k in layers for leaf in ("w", "b")})
  return {"arrays": str(path), "layers": layers}

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


def why_not_shaped() -> str | None:
  """Why this machine cannot run a shaped benchmark, or None when it can (a namespace of
  this benchmark's own is created and deleted to find out)."""
  reason = cannot_shape()
  if reason is None:
    try:
      with Namespace():
        pass
    except subprocess.CalledProcessError as e:
      reason = f"cannot create a network namespace: {e.stderr.strip() or e}"
  return reason


def run_job(ns: Namespace, processes: int, cfg: dict, timeout: float) -> dict:
  """Every method of ``cfg``: commopt's in one JAX job, then PyTorch's in one torch job."""
  ours = [m for m in cfg["methods"] if m not in TORCH_METHODS]
  theirs = [m for m in cfg["methods"] if m in TORCH_METHODS]
  results = {}
  if ours:
    results.update(launch_job(ns, processes, dict(cfg, methods=ours), timeout,
                              [str(pathlib.Path(__file__).resolve()), "--worker"], cpu_devices=1))
  if theirs:
    results.update(launch_job(ns, processes, dict(cfg, methods=theirs), timeout,
                              [str(ROOT / "benchmarks" / "_torch_peer.py")]))
  return results


def launch_job(ns: Namespace, processes: int, cfg: dict, timeout: float, script: list,
               cpu_devices: int | None = None, xla_flags: str = "") -> dict:
  """``python -m commopt.launch`` inside the namespace: ``processes`` copies of ``script CONFIG
  RESULT`` under ``timeout`` (``cpu_devices`` CPU devices each, if given; ``xla_flags``
  added to ``XLA_FLAGS``); process 0 writes RESULT. The launcher's coordinator port is one
  it found free inside the namespace."""
  with tempfile.TemporaryDirectory(prefix="commopt-net-") as tmp:
    config, result = pathlib.Path(tmp, "config.json"), pathlib.Path(tmp, "result.json")
    config.write_text(json.dumps(cfg))
    argv = ["ip", "netns", "exec", ns.name, sys.executable, "-m", "commopt.launch",
            "--processes", str(processes), "--host-memory", cfg.get("host_memory", "reuse"),
            *(["--cpu-devices", str(cpu_devices)] if cpu_devices else []),
            "--timeout", str(timeout), *script, str(config), str(result)]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if xla_flags:
      env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + xla_flags).strip()
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
      raise RuntimeError(f"the {processes}-process job of {', '.join(cfg['methods'])} failed "
                         f"(exit {proc.returncode}):\n" + out[-4000:])
    return json.loads(result.read_text())


def derive(r: dict, processes: int, target: float) -> dict:
  """Time to the target loss and achieved rates, from one method's measurements.

  The steps to the target: the first step after which the global model scores the target on
  :data:`EVAL_ROWS` digits (a periodic method's anchor moves only when it synchronises). A report of an earlier version, which has no such scores, counts on the
  workers' training loss (smoothed) instead.
  """
  curve = smoothed(r["losses"])
  if r.get("global_losses"):
    done = next((k for k, v in r["global_losses"] if v <= target), None)
  else:
    done = next((i + 1 for i, v in enumerate(curve) if v <= target), None)
  # The compiling steps count as typical ones (a report without `compiled_at`: the first
  # `compiling_steps`).
  compiled = set(r.get("compiled_at", range(r.get("compiling_steps", 1))))
  times = [r["step_s"] if i in compiled else t for i, t in enumerate(r["step_times"])]
  comm = r["comm_s"]
  return dict(r, final_loss=curve[-1], steps_to_target=done,
              time_to_target_s=None if done is None else sum(times[:done]),
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
           "MB sent/worker | link Gbit/s | steps to target | time to target s | final loss | "
           "global model's loss |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for n in processes:
    for bw in bandwidths:
      rows = results.get(str(n), {}).get(bw, {})
      dense = rows.get("dense", {}).get("step_s")
      for label, r in rows.items():
        achieved, ttt, ev = r["link_bytes_per_s"], r["time_to_target_s"], r.get("eval_loss")
        lines.append(
            f"| {n} | {bw} | {label} | {r['step_s'] * 1e3:.1f} | "
            f"{(r['step_s'] / dense) if dense else float('nan'):.2f} | "
            f"{r['compute_s'] * 1e3:.1f} | {r['comm_s'] * 1e3:.1f} | "
            f"{r['sent_bytes'] / 1e6:.2f} | "
            f"{'-' if not achieved else f'{achieved * 8 / 1e9:.2f}'} | "
            f"{r['steps_to_target'] or 'not reached'} | "
            f"{'-' if ttt is None else f'{ttt:.1f}'} | {r['final_loss']:.3f} | "
            f"{'-' if ev is None else f'{ev:.3f}'} |")
  return "\n".join(lines)


def order(label: str) -> int:
  """A method's place in tables and plots (labels this version does not know last)."""
  return ALL_METHODS.index(label) if label in ALL_METHODS else len(ALL_METHODS)


def plot(results: dict, bandwidths, processes, target: float, path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  shaped = [b for b in bandwidths if b != "unlimited"]
  xs = {b: rate_bits(b) / 1e9 for b in shaped}
  palette = [*plt.cm.tab20.colors, *plt.cm.tab20b.colors]    # one colour per known method
  fig, axes = plt.subplots(1, len(processes), figsize=(6.5 * len(processes), 4.5), squeeze=False)
  for ax, n in zip(axes[0], processes):
    by_bw = results.get(str(n), {})
    methods = sorted({m for rows in by_bw.values() for m in rows}, key=order)
    top = max(xs.values(), default=1) * 4
    for m in methods:
      pts = [(xs.get(b, top), by_bw[b][m]["time_to_target_s"]) for b in bandwidths
             if m in by_bw.get(b, {}) and by_bw[b][m]["time_to_target_s"] is not None]
      if pts:
        pts.sort()
        # One colour per method in every panel.
        ax.plot(*zip(*pts), marker="o", label=m, color=palette[order(m) % len(palette)],
                linestyle="--" if m in TORCH_METHODS else ":" if m in COMBINED or m in OVERLAPPED
                or m in EAGER else "-")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ticks = sorted(xs.values()) + ([top] if "unlimited" in bandwidths else [])
    ax.set_xticks(ticks, [f"{t:g}" for t in sorted(xs.values())]
                  + (["unlimited"] if "unlimited" in bandwidths else []))
    ax.set_xlabel("loopback rate (Gbit/s, tc tbf)")
    ax.set_ylabel(f"seconds to loss {target} (global model, {EVAL_ROWS} digits)")
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
  meta = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
          "argv": sys.argv[1:]}
  theirs = [m for m in args.methods if m in TORCH_METHODS]
  if theirs:
    why = torch_peer().unavailable()
    if why:
      # PyTorch is optional (the `peers` extra): its methods are left out, the rest runs.
      print(f"bench_network: skipping {', '.join(theirs)}: {why}; install the `peers` extra "
            f"(pip install -e '.[peers]') to run them.")
      args.methods = [m for m in args.methods if m not in TORCH_METHODS]
      meta["left_out"] = {"methods": theirs, "why": why}
    else:
      import torch
      meta["torch"] = torch.__version__
  reason = None if args.methods else "no method left to measure"
  reason = reason or why_not_shaped()
  if reason:
    print(f"bench_network: skipped, {reason}.")
    (out / "network.json").write_text(json.dumps({"skipped": reason, **meta}, indent=1))
    return 0
  import jax
  meta["jax"] = jax.__version__
  cfg = {k: getattr(args, k) for k in ("methods", "steps", "compute_steps", "hidden", "batch",
                                       "lr", "target_loss", "host_memory")}
  results: dict = {}
  failed: dict = {}
  t0 = time.perf_counter()
  # SIGTERM ends the run like Ctrl-C, so the namespace is deleted either way.
  signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
  with tempfile.TemporaryDirectory(prefix="commopt-net-") as tmp, Namespace() as ns:
    if theirs and not meta.get("left_out"):
      # The PyTorch peer starts from the JAX side's weights, on the same digits.
      cfg_torch = peer_arrays(args.hidden, pathlib.Path(tmp, "peer.npz"))
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
  report = {"config": cfg, "meta": meta, "bandwidths": args.bandwidths,
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


def derived(report: dict, target: float) -> dict:
  """``report["results"]`` with each row's time to ``target`` and rates (:func:`derive`)."""
  return {n: {bw: {m: derive(r, int(n), target) for m, r in rows.items()}
              for bw, rows in by_bw.items()} for n, by_bw in report["results"].items()}


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
  plot(results, bandwidths, processes, target, out / "network.png")
  print(f"wrote {out / 'network.md'} and {out / 'network.png'}")


def verdicts(results: dict, bandwidths, processes) -> str:
  """Per process count and bandwidth, among commopt's methods: the fastest compressed method per
  step against dense, and the soonest to the target loss, among the runs that reached it."""
  lines = []
  times = lambda a, b: f"{a / b:.2f}x faster" if a >= b else f"{b / a:.2f}x slower"
  for n in processes:
    for bw in bandwidths:
      rows = {m: r for m, r in results.get(str(n), {}).get(bw, {}).items()
              if m not in TORCH_METHODS}
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



# -- commopt against PyTorch ----------------------------------------------------------

ROLES = ("commopt dense", "commopt best compressed", "commopt best combined",
         "PyTorch dense", "PyTorch fp16", "PyTorch PowerSGD")
"""The rows of the summary: one method each, picked per process count and bandwidth."""


def soonest(rows: dict, labels) -> str | None:
  """The label soonest to the target; among none that reached it, the fastest per step."""
  labels = [m for m in labels if m in rows]
  if not labels:
    return None
  return min(labels, key=lambda m: (rows[m]["time_to_target_s"] is None,
                                    rows[m]["time_to_target_s"] or 0.0, rows[m]["step_s"]))


def summarize(results: dict, bandwidths, processes) -> dict:
  """Per process count and bandwidth, from derived rows: the method in each role (:data:`ROLES`)
  with its step time and time to the target, and commopt's best against PyTorch's best.

  ``{n: {bw: {"roles": {role: row}, "commopt_best": row, "torch_best": row,
  "commopt_not_slower": bool, "combined_vs_dense": float}}}``, a row being ``{"method",
  "step_s", "steps_to_target", "time_to_target_s"}`` (None where that side did not run).
  ``commopt_not_slower``: whether commopt's best reached the target no later than PyTorch's best
  (True where only commopt's reached it; None where neither did or a side did not run).
  ``combined_vs_dense``: commopt dense's time to the target over the best combined method's,
  None unless both reached it.
  """
  out: dict = {}
  for n in processes:
    for bw in bandwidths:
      rows = results.get(str(n), {}).get(bw, {})
      if not rows:
        continue
      torch = [m for m in rows if m.startswith("torch:")]
      ours = [m for m in rows if m not in torch]
      row = lambda m: None if m is None else {
          "method": m, "step_s": rows[m]["step_s"], "steps_to_target": rows[m]["steps_to_target"],
          "time_to_target_s": rows[m]["time_to_target_s"]}
      picks = {
          "commopt dense": "dense" if "dense" in rows else None,
          "commopt best compressed": soonest(rows, [m for m in ours if m in METHODS
                                                    and m != "dense"]),
          "commopt best combined": soonest(rows, [m for m in ours if m in COMBINED
                                                  or m in OVERLAPPED or m in EAGER
                                                  or m.startswith(("diloco(", "overlap:",
                                                                   "eager:", "eager("))]),
          "PyTorch dense": "torch:dense" if "torch:dense" in rows else None,
          "PyTorch fp16": "torch:fp16" if "torch:fp16" in rows else None,
          "PyTorch PowerSGD": soonest(rows, [m for m in torch if m.startswith("torch:power_sgd")]),
      }
      best_ours, best_torch = row(soonest(rows, ours)), row(soonest(rows, torch))
      ttt = lambda r: None if r is None else r["time_to_target_s"]
      if best_ours is None or best_torch is None or (ttt(best_ours) is None
                                                     and ttt(best_torch) is None):
        not_slower = None
      elif ttt(best_torch) is None or ttt(best_ours) is None:
        not_slower = ttt(best_ours) is not None
      else:
        not_slower = ttt(best_ours) <= ttt(best_torch)
      dense_t = ttt(row(picks["commopt dense"]))
      combined_t = ttt(row(picks["commopt best combined"]))
      out.setdefault(str(n), {})[bw] = {
          "roles": {role: row(m) for role, m in picks.items() if m is not None},
          "commopt_best": best_ours, "torch_best": best_torch, "commopt_not_slower": not_slower,
          "combined_vs_dense": dense_t / combined_t if dense_t and combined_t else None}
  return out


def summary_table(summary: dict) -> str:
  """The summary's rows: per process count and bandwidth, one method per role."""
  lines = ["| processes | bandwidth | role | method | step ms | steps to target | "
           "time to target s |", "|---|---|---|---|---|---|---|"]
  for n, by_bw in summary.items():
    for bw, s in by_bw.items():
      for role in ROLES:
        r = s["roles"].get(role)
        if r is not None:
          ttt = r["time_to_target_s"]
          lines.append(f"| {n} | {bw} | {role} | {r['method']} | {r['step_s'] * 1e3:.1f} | "
                       f"{r['steps_to_target'] or 'not reached'} | "
                       f"{'-' if ttt is None else f'{ttt:.2f}'} |")
  return "\n".join(lines)


def comparison_lines(summary: dict) -> str:
  """One verdict per process count and bandwidth: commopt's best against PyTorch's best, to the
  target loss; and commopt's best combined method against its dense."""
  def reached(side, r):
    t = r["time_to_target_s"]
    return f"{side}'s best, {r['method']}, " + ("did not reach the target" if t is None
                                                else f"reached it in {t:.2f} s")

  def sooner(a, b):      # a, b: seconds; how a compares with b
    return f"{b / a:.1f}x sooner" if a <= b else f"{a / b:.1f}x later"

  lines = []
  for n, by_bw in summary.items():
    for bw, s in by_bw.items():
      ours, theirs = s["commopt_best"], s["torch_best"]
      if ours is None or theirs is None:
        text = f"{'PyTorch' if theirs is None else 'commopt'} did not run: no verdict"
      else:
        verdict = {True: "commopt's best ≤ PyTorch's best: yes",
                   False: "commopt's best ≤ PyTorch's best: no",
                   None: "neither reached the target: no verdict"}[s["commopt_not_slower"]]
        text = f"{reached('commopt', ours)}; {reached('PyTorch', theirs)}: {verdict}"
        if ours["time_to_target_s"] and theirs["time_to_target_s"]:
          text += f" ({sooner(ours['time_to_target_s'], theirs['time_to_target_s'])})"
      if s["combined_vs_dense"] is not None:
        combined = s["roles"]["commopt best combined"]
        text += (f"; {combined['method']} against commopt dense: "
                 f"{sooner(1.0, s['combined_vs_dense'])} to the target")
      lines.append(f"- {n} processes, {bw}: {text}.")
  return "\n".join(lines)

if __name__ == "__main__":
  sys.exit(main())
