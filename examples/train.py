"""Train a Flax (nnx) CNN on the digits dataset with compressed data parallelism.

The CNN has batch norm and dropout and trains through
``commopt.nnx_data_parallel``: batch statistics are averaged across workers
each step and every worker draws its own dropout masks. Each compressor trains
the same model from the same start on simulated CPU
devices (8 by default); per epoch it prints the loss and test accuracy, and
at the start the bytes each worker sends per step, analytic and audited from
the compiled step's HLO, against dense. It writes a plot of training loss
against cumulative bytes sent per worker, and the metrics as JSON.

    python examples/train.py                               # dense vs scaled_sign, top_k, power_sgd
    python examples/train.py --compressors top_k --ratio 0.05 --epochs 5
    python examples/train.py --compressors power_sgd --rank 4 --workers 4
    python examples/train.py --compressors identity,qsgd,int_quant,natural,signum --epochs 4
    python examples/train.py --strategy two_phase       # ~2 payloads per worker, not N-1
    python examples/train.py --processes 2              # 2 processes x 4 devices, gloo
    python examples/train.py --checkpoint-dir ckpt      # a checkpoint per epoch and run
    python examples/train.py --checkpoint-dir ckpt --resume   # continue where it stopped
    python examples/train.py --sync diloco --period 8 --compressors identity,top_k,int_quant
    python examples/train.py --sync stale --staleness 4 --compressors identity

Besides the registry's compressors (run through compressed_mean with error
feedback, then SGD with momentum), ``signum`` runs signSGD with majority vote
on each worker's momentum: only sign bits cross the wire; ``onebit_adam`` is
1-bit Adam (dense Adam for ``--freeze-step`` steps, then 1-bit momentum with
the variance frozen); ``onebit_lamb`` is 1-bit LAMB (the same with LAMB's
per-layer trust ratio); ``zero_one_adam`` is 0/1 Adam (the variance updated on
a doubling schedule until ``--freeze-step``, then local steps with 1-bit
synchronisations ever further apart; each worker keeps its own parameters, and
test accuracy is the synchronised model).

``--processes N`` runs the same training as N processes of this machine, each
simulating ``--workers / N`` CPU devices, joined by ``jax.distributed`` over
gloo (started by ``commopt.launch``): each process feeds only its rows of
every global batch, and the losses equal the one-process run's to float
rounding (all-reduces add in another order across processes; over many steps
training amplifies such differences). Process 0 prints (its output shows when
the run ends) and writes the files.

``--sync MODE`` exchanges less often than every step: ``local_sgd``,
``diloco``, ``streaming_diloco`` and ``easgd`` every ``--period`` steps,
``stale`` every step but with gradients up to ``--staleness`` steps old
(simulated SSP). Each worker keeps its own parameters
(``data_parallel(..., local_params=True)``), what the workers exchange goes
through each ``--compressors`` entry (``identity``: dense) with error
feedback, the bytes count only the steps that exchange, and test accuracy is
the mode's global model (``commopt.transforms.global_params``: the anchor, centre or
server parameters).

``--checkpoint-dir DIR`` saves each compressor's run in ``DIR/<compressor>``
at the end of every epoch, and where ``--max-steps`` stops it
(``commopt.checkpoint``: parameters, optimizer
state with every worker's residuals, batch statistics and dropout RNG state),
with ``progress.json`` beside it (the position in the data and the history so
far). ``--resume`` continues each run from there: the skipped epochs' data
permutations are drawn again, so a run stopped and resumed gives the losses
of an uninterrupted one; a finished run is reported, not retrained. Resuming
onto another ``--workers`` resizes the optimizer state (the global batch may
change with it).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROGRESS = "progress.json"
# Flags a resumed run may change; every other flag must be the saved run's.
RESUMABLE = frozenset({"compressors", "workers", "processes", "epochs", "max_steps", "out",
                       "checkpoint_dir", "resume"})
LAUNCH_TIMEOUT = 6 * 3600.0   # seconds a --processes run may take in all
SYNC_MODES = ("bsp", "local_sgd", "diloco", "streaming_diloco", "easgd", "stale")
ADAPTIVE = ("onebit_adam", "onebit_lamb", "zero_one_adam")   # compressed Adam and LAMB


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--compressors", default="identity,scaled_sign,top_k,power_sgd",
                 help="comma-separated registry names (identity is the dense baseline), "
                      "signum (majority vote of worker momentum signs), onebit_adam, onebit_lamb, "
                      "zero_one_adam, fetch_sgd (momentum and error in a count sketch), or dgc "
                      "(deep gradient compression with its sparsity warm-up)")
  p.add_argument("--workers", type=int, default=8, help="simulated CPU devices (data axis size)")
  p.add_argument("--processes", type=int, default=1,
                 help="run as this many processes on this machine, each with --workers / "
                      "--processes CPU devices, joined by jax.distributed over gloo")
  p.add_argument("--epochs", type=int, default=12)
  p.add_argument("--batch-size", type=int, default=128, help="global batch, split over workers")
  p.add_argument("--steps-per-epoch", type=int, default=None,
                 help="at most this many steps per epoch (default: the whole training set)")
  p.add_argument("--lr", type=float, default=0.05)
  p.add_argument("--momentum", type=float, default=0.9)
  p.add_argument("--ratio", type=float, default=None, help="top_k: fraction of each leaf sent")
  p.add_argument("--rank", type=int, default=None, help="power_sgd: rank")
  p.add_argument("--dtype", default=None, help="cast: wire dtype (bfloat16, float16)")
  p.add_argument("--levels", type=int, default=None, help="qsgd, adaptive_levels: levels")
  p.add_argument("--bits", type=int, default=None, help="int_quant: 4 or 8")
  p.add_argument("--block-size", type=int, default=None,
                 help="scaled_sign, int_quant: coordinates per scale")
  p.add_argument("--bucket-size", type=int, default=None, help="qsgd: coordinates per norm")
  p.add_argument("--clip", type=float, default=None, help="terngrad: clipping factor")
  p.add_argument("--sign-lr", type=float, default=1e-3, help="signum: step size")
  p.add_argument("--adam-lr", type=float, default=1e-3,
                 help="onebit_adam, onebit_lamb, zero_one_adam: learning rate")
  p.add_argument("--adam-eps", type=float, default=1e-4,
                 help="onebit_adam, onebit_lamb, zero_one_adam: epsilon (a coordinate whose "
                      "frozen variance is tiny takes a step of about lr·|1-bit momentum|/eps: "
                      "1e-8 diverges on this CNN after a 20-step warm-up, 1e-4 trains)")
  p.add_argument("--freeze-step", type=int, default=20,
                 help="onebit_adam, onebit_lamb: dense steps before the variance freezes; "
                      "zero_one_adam: var_freeze_step (steps of its variance phase)")
  p.add_argument("--var-update-scaler", type=int, default=16,
                 help="zero_one_adam: variance updates at each interval before it doubles")
  p.add_argument("--local-step-scaler", type=int, default=16,
                 help="zero_one_adam: steps at each local-step interval before it doubles "
                      "(DeepSpeed's default, 32678, is for runs of 100k steps)")
  p.add_argument("--local-step-clipper", type=int, default=16,
                 help="zero_one_adam: the largest local-step interval")
  p.add_argument("--tau", type=float, default=None, help="threshold: the threshold tau")
  p.add_argument("--drop-ratio", type=float, default=None,
                 help="gradient_dropping: fraction of coordinates dropped")
  p.add_argument("--bin-size", type=int, default=None, help="adacomp: bin size")
  p.add_argument("--dgc-warmup-epochs", type=int, default=4,
                 help="dgc: epochs of sparsity warm-up (0: none)")
  p.add_argument("--clip-norm", type=float, default=None, help="dgc: global gradient clip norm")
  p.add_argument("--no-error-feedback", action="store_true")
  p.add_argument("--sfb", action="store_true",
                 help="sufficient-factor broadcasting: the CNN's dense layers are "
                      "commopt.parallel.SFBLinear, and a layer whose factors (its input and output "
                      "gradient, rows·(in + out) values per worker) cost less than its weight "
                      "gradient sends them instead (fc1); the others go through the compressor")
  p.add_argument("--sync", default="bsp", choices=SYNC_MODES,
                 help="when workers exchange: every step (bsp), or a mode of commopt's "
                      "(the compressor then compresses what the mode exchanges)")
  p.add_argument("--period", type=int, default=8,
                 help="local_sgd, diloco, streaming_diloco, easgd: steps between exchanges")
  p.add_argument("--sync-warmup", type=int, default=0,
                 help="local_sgd, diloco: steps at the start that exchange every step")
  p.add_argument("--outer-lr", type=float, default=0.7, help="diloco, streaming_diloco: "
                 "outer Nesterov SGD's learning rate (momentum 0.9)")
  p.add_argument("--fragments", type=int, default=2, help="streaming_diloco: fragments")
  p.add_argument("--delay", type=int, default=1,
                 help="streaming_diloco: steps between a fragment's exchange and its merge")
  p.add_argument("--mixing", type=float, default=0.5,
                 help="streaming_diloco: weight of the local parameters in the merge")
  p.add_argument("--alpha", type=float, default=None,
                 help="easgd: the workers' pull towards the centre (default 0.9 / workers)")
  p.add_argument("--staleness", type=int, default=4, help="stale: the bound s on the delay")
  p.add_argument("--byte-budget", type=int, default=None,
                 help="stale: bytes each worker sends per step, largest entries first "
                      "(instead of a compressor; needs --compressors identity)")
  p.add_argument("--strategy", default="auto", choices=["auto", "psum", "gather", "two_phase"],
                 help="compressed_mean's reduction (compressors that cannot use it run 'auto')")
  p.add_argument("--dropout", type=float, default=0.25, help="dropout rate before the last layer")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="runs", help="folder for the plot and metrics")
  p.add_argument("--max-steps", type=int, default=None,
                 help="stop each run after this many steps in all (smoke tests); with "
                      "--checkpoint-dir the stopping point is saved and --resume continues it")
  p.add_argument("--checkpoint-dir", default=None,
                 help="save each compressor's run in DIR/<compressor> at the end of every epoch")
  p.add_argument("--resume", action="store_true",
                 help="with --checkpoint-dir: continue each run from its last checkpoint "
                      "(runs without one start afresh; finished ones are not retrained)")
  return p.parse_args(argv)


def run_config(args) -> dict:
  """The flags that define a run's trajectory: a resumed run must have the saved ones."""
  return {k: v for k, v in sorted(vars(args).items()) if k not in RESUMABLE}


def read_progress(run_dir: pathlib.Path):
  """The saved progress of one compressor's run, or None when it has none."""
  path = run_dir / PROGRESS
  return json.loads(path.read_text()) if path.is_file() else None


def finished(saved: dict, args) -> bool:
  """Whether a saved run already has what this command asks for (its epochs, or steps)."""
  return saved["epochs_done"] >= args.epochs or bool(args.max_steps
                                                     and saved["step"] >= args.max_steps)


def check_flags(args, valid) -> list[str]:
  """The compressor names to run; exits with a message naming the flag on a bad combination."""
  for flag, value in (("--workers", args.workers), ("--processes", args.processes),
                      ("--epochs", args.epochs), ("--batch-size", args.batch_size),
                      ("--steps-per-epoch", args.steps_per_epoch),
                      ("--max-steps", args.max_steps)):
    if value is not None and value < 1:
      sys.exit(f"{flag} must be >= 1, got {value}")
  if args.batch_size < args.workers:
    sys.exit(f"--batch-size {args.batch_size} is smaller than --workers {args.workers}: the "
             "global batch needs at least one row per worker")
  if args.workers % args.processes:
    sys.exit(f"--workers {args.workers} is not divisible by --processes {args.processes}: "
             f"each process hosts --workers / --processes devices (valid --processes for "
             f"--workers {args.workers}: "
             f"{[n for n in range(1, args.workers + 1) if args.workers % n == 0]})")
  names = list(dict.fromkeys(n.strip() for n in args.compressors.split(",") if n.strip()))
  for n in names:
    if n not in valid:
      sys.exit(f"--compressors: unknown {n!r}; valid: {valid}")
  if not names:
    sys.exit(f"--compressors: no compressor named in {args.compressors!r}; valid: {valid}")
  if args.sync != "bsp":
    special = [n for n in names if n in ADAPTIVE + ("signum", "dgc", "fetch_sgd")]
    if special:
      sys.exit(f"--sync {args.sync}: {special} reduce every step by their own rule; with a "
               "synchronisation mode use a registry compressor (identity: dense)")
    for flag, value in (("--period", args.period), ("--fragments", args.fragments)):
      if value < 1:
        sys.exit(f"{flag} must be >= 1, got {value}")
  if args.sfb:
    special = [n for n in names if n in ADAPTIVE + ("signum", "dgc", "fetch_sgd")]
    if args.sync != "bsp" or special:
      sys.exit(f"--sfb sends the dense layers' factors every step, beside a registry "
               f"compressor: use it with --sync bsp and registry compressors, not --sync "
               f"{args.sync}" + (f" and {special}" if special else ""))
  if args.byte_budget is not None and (args.sync != "stale" or names != ["identity"]):
    sys.exit(f"--byte-budget {args.byte_budget} is for --sync stale with --compressors "
             f"identity (the budget chooses what is sent), got --sync {args.sync} and "
             f"--compressors {args.compressors}")
  if args.byte_budget is not None and args.strategy not in ("auto", "gather"):
    sys.exit(f"--byte-budget sends a top-k over the whole model, which is gathered: use "
             f"--strategy auto or gather, not {args.strategy}")
  if args.resume and not args.checkpoint_dir:
    sys.exit("--resume needs --checkpoint-dir DIR, the folder the runs to continue were "
             "saved in")
  if args.checkpoint_dir:
    import importlib.util
    if importlib.util.find_spec("orbax") is None:
      sys.exit("--checkpoint-dir needs orbax-checkpoint (`pip install orbax-checkpoint`, or "
               "commopt's `examples` or `checkpoint` extra)")
    root = pathlib.Path(args.checkpoint_dir)
    if root.exists() and not root.is_dir():
      sys.exit(f"--checkpoint-dir {args.checkpoint_dir!r} is a file; it must be a folder "
               "(new or from an earlier run)")
    config, defaults = run_config(args), run_config(parse_args([]))
    for n in names:
      saved = read_progress(root / n)
      if saved is None:
        continue
      if not args.resume:
        sys.exit(f"--checkpoint-dir {args.checkpoint_dir!r} already holds a {n} run (step "
                 f"{saved['step']}); pass --resume to continue it, or use a new "
                 "--checkpoint-dir")
      # A run saved before a flag existed ran with its default.
      for k, v in {**defaults, **saved["config"]}.items():
        if config.get(k) != v:
          flag = "--" + k.replace("_", "-")
          shown = lambda v: f"{flag} {'on' if v else 'off'}" if isinstance(v, bool) else (
              f"{flag} unset" if v is None else f"{flag} {v}")
          sys.exit(f"--resume: {root / n} was saved with {shown(v)}, this run has "
                   f"{shown(config.get(k))}; resume with the saved flags or use a new "
                   "--checkpoint-dir")
      if not finished(saved, args) and not (root / n / saved["checkpoint"]).is_dir():
        sys.exit(f"--resume: {root / n / PROGRESS} names the checkpoint {saved['checkpoint']}, "
                 "which is missing; use a new --checkpoint-dir")
  return names


def relaunch(args, argv):
  """Runs this script as ``--processes`` processes of one job; prints process 0's output."""
  from commopt import launch
  argv = sys.argv[1:] if argv is None else list(argv)
  n = args.processes
  print(f"{n} processes x {args.workers // n} CPU devices, jax.distributed over gloo; "
        "process 0's output follows when they end", flush=True)
  path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
  try:
    results = launch.launch([str(pathlib.Path(__file__).resolve()), *argv], processes=n,
                            devices_per_process=args.workers // n, timeout=LAUNCH_TIMEOUT,
                            env={"PYTHONPATH": path})
  except launch.LaunchError as e:
    sys.exit(f"--processes {n}: {e}")
  # Process 0's output, less gloo's connection notices.
  sys.stdout.write("".join(line for line in results[0].output.splitlines(keepends=True)
                           if not line.startswith("[Gloo] ")))
  sys.stdout.flush()
  return json.loads((pathlib.Path(args.out) / "train_metrics.json").read_text())


def main(argv=None):
  args = parse_args(argv)
  os.environ.setdefault("XLA_FLAGS", "")
  import commopt
  from commopt import launch
  names = check_flags(args, sorted(commopt.compressors.REGISTRY)
                      + ["signum", "dgc", "fetch_sgd", *ADAPTIVE])
  if args.processes > 1 and launch.ENV_PROCESS_ID not in os.environ:
    return relaunch(args, argv)
  ctx = launch.initialize()          # joins the job (and sets its CPU devices) when launched
  import jax
  if ctx.num_processes == 1:
    jax.config.update("jax_num_cpu_devices", args.workers)
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.experimental import multihost_utils
  from jax.sharding import NamedSharding, PartitionSpec as P
  from tqdm.auto import tqdm

  from commopt import checkpoint, wire
  from commopt.parallel import NnxTrainState
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
  from flax import nnx
  from digits_cnn import CNN, cross_entropy, load_digits_split

  say = print if ctx.is_main else (lambda *a, **k: None)
  if ctx.num_processes > 1 and jax.device_count() != args.workers:
    sys.exit(f"--workers {args.workers}: this job has {jax.device_count()} devices in "
             f"{ctx.num_processes} processes; across processes --workers must be all of them")
  if len(jax.devices()) < args.workers:
    sys.exit(f"--workers {args.workers} needs that many devices; this backend has "
             f"{len(jax.devices())} ({jax.default_backend()}).")

  x_train, y_train, x_test, y_test = load_digits_split(args.seed)
  batch = args.batch_size - args.batch_size % args.workers
  steps_per_epoch = len(x_train) // batch
  if args.steps_per_epoch:
    steps_per_epoch = min(steps_per_epoch, args.steps_per_epoch)
  mesh = jax.make_mesh((args.workers,), ("data",), devices=jax.devices()[:args.workers])
  replicated = NamedSharding(mesh, P())
  model = CNN(nnx.Rngs(args.seed), batch_norm=True, dropout=args.dropout, sfb=args.sfb)
  model.train()
  graphdef = nnx.graphdef(model)

  @jax.jit
  def accuracy(params, model_state, images, labels):
    trained = nnx.merge(graphdef, params, model_state)
    trained.eval()                                  # running statistics, no dropout
    return jnp.mean(jnp.argmax(trained(images), -1) == labels)

  # The test set, replicated on the mesh beside the (global) train state.
  test_x, test_y = (jax.make_array_from_process_local_data(replicated, a)
                    for a in (x_test, y_test))

  def host(x):
    """A global array's value, on every process (unless replicated, a collective)."""
    if x.is_fully_replicated:
      return np.asarray(x.addressable_data(0))
    if x.is_fully_addressable:
      return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  def rows(a):
    """This process's rows of a global batch (process p hosts the p-th block of workers)."""
    return np.split(a, ctx.num_processes)[ctx.process_id]

  out_dir = pathlib.Path(args.out)
  if ctx.is_main:
    out_dir.mkdir(parents=True, exist_ok=True)
  ckpt_root = pathlib.Path(args.checkpoint_dir).resolve() if args.checkpoint_dir else None
  config = run_config(args)
  results = {}
  where = f" in {ctx.num_processes} processes" if ctx.num_processes > 1 else ""
  say(f"{len(x_train)} training images, {len(x_test)} test; {args.workers} workers{where}, "
      f"global batch {batch}, {steps_per_epoch} steps/epoch, {args.epochs} epochs")

  def optimizer(name):
    """(label, optax transform, the reducing transform inside it, DGC's schedule)."""
    if name == "signum":
      vote = commopt.majority_vote(axis_name="data")
      tx = optax.chain(optax.trace(decay=args.momentum), vote, optax.scale(-args.sign_lr))
      return "signum(majority vote)", tx, vote, None
    if name in ("onebit_adam", "onebit_lamb"):
      tx = getattr(commopt.transforms, name)(args.adam_lr, args.freeze_step, axis_name="data",
                                  eps=args.adam_eps)
      return f"{name}(freeze {args.freeze_step})", tx, tx, None
    if name == "zero_one_adam":
      tx = commopt.transforms.zero_one_adam(args.adam_lr, axis_name="data", eps=args.adam_eps,
                                 var_freeze_step=args.freeze_step,
                                 var_update_scaler=args.var_update_scaler,
                                 local_step_scaler=args.local_step_scaler,
                                 local_step_clipper=args.local_step_clipper)
      return (f"zero_one_adam(freeze {args.freeze_step}, H={args.local_step_clipper})", tx, tx,
              None)
    if name == "fetch_sgd":
      # FetchSGD: momentum and error in one 5 x 20,000 count sketch of the whole
      # model (shared by every worker); the top 10,000 of its estimates move.
      tx = commopt.transforms.fetch_sgd(4 * args.lr, 10_000, 5, 20_000, momentum=args.momentum,
                             axis_name="data")
      return "fetch_sgd(k 10000, 5x20000)", tx, tx, None
    if name == "dgc":
      e = args.dgc_warmup_epochs
      densities = commopt.transforms.DGC_WARMUP_DENSITIES
      densities = densities if e else densities[-1:]
      # Four boundaries spread over the warm-up epochs (they must increase strictly).
      boundaries = tuple(max(i, steps_per_epoch * e * i // 4) for i in range(1, 5)) if e else ()
      reducer = commopt.transforms.dgc(axis_name="data", densities=densities, boundaries=boundaries,
                            momentum=args.momentum, clip_norm=args.clip_norm)
      tx = optax.chain(reducer, optax.sgd(args.lr))
      # Bytes are reported for the final (steady-state) density.
      return f"dgc(density {densities[-1]})", tx, reducer, (densities, boundaries)
    if args.sync != "bsp":
      return sync_optimizer(name)
    compressor, strategy = make_compressor(name)
    label = compressor.name if strategy == "auto" else f"{compressor.name} [{strategy}]"
    reducer = commopt.compressed_mean(compressor, axis_name="data", error_feedback=ef,
                                      strategy=strategy)
    if args.sfb:
      # The dense layers' factors first; every other leaf through the compressor.
      reducer = commopt.transforms.sfb_mean(batch // args.workers, commopt.parallel.sfb_mask,
                                            axis_name="data", other=reducer)
      label = f"sfb + {label}"
    tx = optax.chain(reducer, optax.sgd(args.lr, momentum=args.momentum))
    return label, tx, reducer, None

  ef = not args.no_error_feedback

  def make_compressor(name):
    """The registry compressor with the flags it takes, and the strategy it can run."""
    flags = dict(ratio=args.ratio, rank=args.rank, dtype=args.dtype, levels=args.levels,
                 bits=args.bits, block_size=args.block_size, bucket_size=args.bucket_size,
                 clip=args.clip, tau=args.tau, drop_ratio=args.drop_ratio,
                 bin_size=args.bin_size)
    # Each compressor gets the flags it takes (the others are for other compressors).
    compressor = commopt.compressors.make(
        name, **{k: v for k, v in flags.items() if k in commopt.compressors.options(name)})
    strategy = args.strategy
    # two_phase re-encodes chunks (per-leaf payloads); psum sums payloads (linear ones).
    needs = {"two_phase": "per_leaf", "psum": "linear"}.get(strategy)
    if needs and needs not in compressor.capabilities:
      say(f"{compressor.name}: strategy {strategy!r} needs a {needs} compressor, and its "
          f"capabilities are {sorted(compressor.capabilities)}; using 'auto'")
      strategy = "auto"
    return compressor, strategy

  def sync_optimizer(name):
    """(label, the synchronisation mode's transform, the same, no schedule)."""
    compressor, strategy = make_compressor(name)
    dense = name == "identity"
    common = dict(axis_name="data", compressor=None if dense else compressor,
                  error_feedback=ef, strategy=strategy)
    inner = optax.sgd(args.lr, momentum=args.momentum)
    outer = optax.sgd(args.outer_lr, momentum=0.9, nesterov=True)
    h = args.period
    if args.sync == "local_sgd":
      tx = commopt.local_sgd(inner, period=h, warmup_steps=args.sync_warmup, **common)
    elif args.sync == "diloco":
      tx = commopt.diloco(inner, outer, period=h, warmup_steps=args.sync_warmup, **common)
    elif args.sync == "streaming_diloco":
      tx = commopt.streaming_diloco(inner, outer, period=h, fragments=args.fragments,
                                    delay=args.delay, mixing=args.mixing, **common)
    elif args.sync == "easgd":
      alpha = 0.9 / args.workers if args.alpha is None else args.alpha
      tx = commopt.transforms.easgd(inner, alpha=alpha, period=h, **common)
    else:
      if args.byte_budget is not None:
        common.update(compressor=None, byte_budget=args.byte_budget)
      tx = commopt.transforms.stale(inner, max_staleness=args.staleness, **common)
    what = {"stale": f"s={args.staleness}" + (f", {args.byte_budget} B/step"
                                              if args.byte_budget else "")}.get(args.sync,
                                                                                f"H={h}")
    label = f"{args.sync}({what}) {'dense' if dense else compressor.name}"
    return label, tx, tx, None

  for name in names:
    run_dir = ckpt_root / name if ckpt_root else None
    saved = read_progress(run_dir) if args.resume else None
    if saved and finished(saved, args):
      h = saved["history"]
      say(f"\n== {h['compressor']}: already trained ({len(h['epoch_acc'])} epochs, "
          f"{saved['step']} steps) in {run_dir}; not retrained")
      results[name] = h
      continue
    label, tx, reducer, schedule = optimizer(name)
    # Each worker keeps its own parameters (0/1 Adam between its synchronisations).
    local = args.sync != "bsp" or name == "zero_one_adam"
    # What these exchange changes from step to step (a synchronisation
    # schedule; 1-bit Adam's dense warm-up): count each step's own plan.
    stepwise = local or name in ADAPTIVE
    trainer = commopt.nnx_data_parallel(model, cross_entropy, tx, mesh, local_params=local)
    state = trainer.init(model)                     # every run starts from the same model
    params = trainer.split(model)[0]                # one worker's parameters

    def global_model(state):
      """The parameters to evaluate: the synchronisation mode's global model, or the
      (replicated) parameters themselves."""
      if not local:
        return state.params
      if name == "zero_one_adam":      # the parameters at the last synchronisation
        return jax.tree.map(lambda p, u: (host(p)[0] - host(u)[0]).astype(p.dtype),
                            state.params, state.opt_state.inner_state.moved)
      return jax.tree.map(lambda g, p: g.astype(p.dtype),
                          commopt.transforms.global_params(state.opt_state), params)

    def feed(idx):
      """The global batch of rows ``idx``; this process passes only its own rows of it."""
      return trainer.dp.local_batch({"x": rows(x_train[idx]), "y": rows(y_train[idx])})

    # What the reduction plans to send, before anything compiles; the audit checks it.
    report = wire.comm_plan(reducer, params, args.workers)
    audit = wire.hlo_collectives(trainer, state, feed(np.arange(batch)))
    # Besides the payload: the batch statistics' mean over workers (dense) and
    # the int32 flag that makes every worker agree to skip a non-finite step.
    stats_bytes = sum(x.size * x.dtype.itemsize
                      for x in jax.tree.leaves(nnx.state(model, nnx.BatchStat)))
    skip_flag_bytes = 4
    dense_sent = report.dense_sent
    payload = report.contributed_bytes
    sent = wire.total_bytes(audit, "sent_bytes")
    sent_at = lambda step: sent
    if stepwise:
      # The exchange differs between steps (the compiled step holds each form
      # in a cond): each step counts the plan of what runs then, besides the
      # batch statistics and the skip flag, which every step all-reduces.
      every_step = sum(wire.ring_sent_bytes("all-reduce", b, args.workers)
                       for b in (stats_bytes, skip_flag_bytes))
      sent_at = lambda step: (wire.comm_plan(reducer, params, args.workers, step=step).sent_bytes
                              + every_step)
    if local:
      say(f"\n== {label}: {payload / 1e3:,.1f} kB/worker per exchange (dense "
          f"{report.dense_bytes / 1e3:,.1f} kB: {report.dense_bytes / max(payload, 1):.1f}x "
          f"smaller); ring-model bytes sent per exchange {report.sent_bytes / 1e3:,.1f} kB, "
          f"against a dense all-reduce every step {dense_sent / 1e3:,.1f} kB; the compiled "
          f"step holds {len(audit)} collectives, each exchange in a cond")
    else:
      say(f"\n== {label}: payload {payload / 1e3:,.1f} kB/worker/step "
        f"(HLO audit {wire.total_bytes(audit) / 1e3:,.1f} kB in {len(audit)} collectives = "
        f"payload + {stats_bytes} B batch statistics + {skip_flag_bytes} B skip flag) "
        f"vs dense {report.dense_bytes / 1e3:,.1f} kB: "
        f"{report.dense_bytes / payload:.1f}x smaller; "
        f"ring-model bytes sent {sent / 1e3:,.1f} kB vs dense all-reduce "
        f"{dense_sent / 1e3:,.1f} kB: {dense_sent / max(sent, 1):.1f}x")
    if name in ADAPTIVE and args.freeze_step:
      warm = wire.comm_plan(reducer, params, args.workers, step=0)
      then = ("on a doubling schedule (1-bit gradients between), then 1-bit "
              "synchronisations ever further apart" if name == "zero_one_adam"
              else "then the 1-bit momentum")
      say(f"   {name}: the audit above holds every phase (a cond); the first "
          f"{args.freeze_step} steps all-reduce {warm.contributed_bytes / 1e3:,.1f} kB dense "
          f"{then}")
    if schedule:
      # The compiled step holds every warm-up stage's collectives (one switch
      # branch each) but runs one per step: count the stage that runs.
      stage_sent = {d: wire.comm_plan(commopt.top_k(d), params, args.workers).sent_bytes
                    for d in schedule[0]}
      sent_at = lambda step: stage_sent[commopt.transforms.warmup_density(step, *schedule)]
      say("   dgc: the audit above sums all warm-up stages; per step, the stage that runs sends "
          + ", ".join(f"{d:g}: {b / 1e3:,.1f} kB" for d, b in stage_sent.items()))
    if name == "qsgd":
      opts = dict(commopt.compressors.DEFAULTS["qsgd"])
      opts.update({k: v for k, v in (("levels", args.levels), ("bucket_size", args.bucket_size))
                   if v is not None})
      packed = {c.leaf for c in report.collectives if c.packed}
      elias = sum(commopt.compressors.qsgd_elias_bits(p.shape, **opts)
                  for path, p in jax.tree_util.tree_flatten_with_path(params)[0]
                  if jax.tree_util.keystr(path) in packed)
      say(f"   qsgd: Elias coding of the compressed leaves would cost at most "
          f"{elias / 8e3:,.1f} kB (paper's bound) against the fixed-width packing sent")

    history = {"step": [], "loss": [], "bytes_sent": [], "epoch_acc": [], "epoch_loss": []}
    rng = np.random.default_rng(args.seed)
    step, total_sent, seconds = 0, 0.0, 0.0
    start_epoch, start_batch = 0, 0
    if saved:
      got = checkpoint.restore(run_dir / saved["checkpoint"], trainer.dp, params,
                               model_state=state.model_state)
      assert got.step == saved["step"], (got.step, saved["step"])
      state = NnxTrainState(got.params, got.model_state, got.opt_state)
      history = {k: saved["history"][k] for k in history}
      step, total_sent, seconds = saved["step"], saved["total_sent"], saved["history"]["seconds"]
      start_epoch, start_batch = saved["epochs_done"], saved["batches_done"]
      if start_batch:               # stopped inside that epoch: its summary comes at its end
        del history["epoch_acc"][-1], history["epoch_loss"][-1]
      for _ in range(start_epoch):  # the finished epochs' data orders, drawn again
        rng.permutation(len(x_train))
      within = f" after {start_batch} of its steps" if start_batch else ""
      say(f"   resumed from {run_dir / saved['checkpoint']}: epoch {start_epoch + 1}{within}, "
          f"step {step}")
      saved_workers = got.saved_workers or saved["workers"]
      if saved_workers != args.workers:
        change = (f"global batch {saved['batch']} -> {batch}" if saved["batch"] != batch
                  else f"global batch {batch} as saved")
        say(f"   saved by {saved_workers} workers, restored onto {args.workers}: optimizer "
            f"state resized; {change}")
    elif run_dir is not None and args.resume:
      say(f"   no checkpoint in {run_dir}: starting afresh")

    def save(epochs_done, batches_done):
      """A checkpoint of the run where it stands, then (process 0) its progress beside it."""
      nonlocal seconds
      began = time.perf_counter()
      ckpt = f"step_{step:08d}"
      run_dir.mkdir(parents=True, exist_ok=True)
      skipped = int(host(state.opt_state.total_notfinite))
      checkpoint.save(run_dir / ckpt, state.params, state.opt_state,
                      model_state=state.model_state, step=step, force=True)
      seconds -= time.perf_counter() - began      # the run's time is training time
      if not ctx.is_main:
        return
      progress = dict(config=config, workers=args.workers, batch=batch, checkpoint=ckpt,
                      epochs_done=epochs_done, batches_done=batches_done, step=step,
                      total_sent=total_sent, history=dict(history, **summary(skipped)))
      tmp = run_dir / (PROGRESS + ".tmp")
      tmp.write_text(json.dumps(progress, indent=1))
      tmp.replace(run_dir / PROGRESS)
      for old in run_dir.glob("step_*"):            # only the latest checkpoint is kept
        if old.name != ckpt:
          shutil.rmtree(old, ignore_errors=True)

    def summary(skipped):
      return dict(seconds=seconds + time.perf_counter() - t0, payload_bytes=payload,
                  dense_bytes=report.dense_bytes, audited_bytes=wire.total_bytes(audit),
                  model_state_sync_bytes=stats_bytes, skip_flag_bytes=skip_flag_bytes,
                  skipped_steps=skipped,
                  # stepwise: the mean over the steps run (the audit holds every branch)
                  sent_bytes_per_step=total_sent / step if stepwise and step else sent,
                  dense_sent_bytes_per_step=dense_sent, compressor=label)

    # Steps skipped for a non-finite gradient leave the optimizer state, its
    # step count included, as it was: the schedules (synchronisation, 1-bit
    # Adam's freeze, DGC's warm-up) follow that count, not this loop's.
    skipped_so_far = int(host(state.opt_state.total_notfinite))
    t0 = time.perf_counter()
    for epoch in range(start_epoch, args.epochs):
      perm = rng.permutation(len(x_train))
      first = start_batch if epoch == start_epoch else 0
      losses = history["loss"][len(history["loss"]) - first:] if first else []
      bar = tqdm(range(first, steps_per_epoch), desc=f"{name} epoch {epoch + 1}/{args.epochs}",
                 leave=False, file=sys.stdout, dynamic_ncols=True,
                 disable=ctx.num_processes > 1)   # other processes' output is a log file
      done = first
      for i in bar:
        state, loss = trainer.step(state, feed(perm[i * batch:(i + 1) * batch]))
        total_sent += sent_at(step - skipped_so_far)
        skipped_so_far = int(host(state.opt_state.total_notfinite))
        step += 1
        done = i + 1
        loss = float(host(jnp.mean(loss)))      # the workers' mean, on the mesh
        losses.append(loss)
        history["step"].append(step)
        history["loss"].append(loss)
        history["bytes_sent"].append(total_sent)
        bar.set_postfix(loss=f"{loss:.3f}")
        if args.max_steps and step >= args.max_steps:
          break
      acc = float(host(accuracy(global_model(state), state.model_state, test_x, test_y)))
      history["epoch_acc"].append(acc)
      history["epoch_loss"].append(float(np.mean(losses)))
      say(f"{name:>12} epoch {epoch + 1:3d}  loss {np.mean(losses):.4f}  test acc {acc:.4f}  "
          f"sent {total_sent / 1e6:8.2f} MB/worker")
      if run_dir is not None:
        whole = done >= steps_per_epoch
        save(epoch + 1 if whole else epoch, 0 if whole else done)
      if args.max_steps and step >= args.max_steps:
        break
    history.update(summary(int(host(state.opt_state.total_notfinite))))
    results[name] = history

  if not ctx.is_main:
    return results
  (out_dir / "train_metrics.json").write_text(json.dumps(results, indent=1))
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name, h in results.items():
    ax.plot(np.asarray(h["bytes_sent"]) / 1e6, h["loss"],
            label=f"{h['compressor']} (acc {h['epoch_acc'][-1]:.3f})")
  ax.set_xscale("log")
  ax.set_xlabel("cumulative MB sent per worker (ring model, from the HLO audit)")
  ax.set_ylabel("training loss")
  ax.set_title(f"digits CNN, {args.workers} workers: loss against bytes on the wire")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(loc="lower left")
  fig.tight_layout()
  fig.savefig(out_dir / "train_loss_vs_bytes.png", dpi=120)
  print(f"\nwrote {out_dir / 'train_loss_vs_bytes.png'} and {out_dir / 'train_metrics.json'}")
  width = max(len("compressor"), *(len(h["compressor"]) for h in results.values()))
  print(f"{'compressor':<{width}} {'test acc':>9} {'payload kB':>11} {'x smaller':>10} "
        f"{'seconds':>8}")
  for name, h in results.items():
    print(f"{h['compressor']:<{width}} {h['epoch_acc'][-1]:9.4f} {h['payload_bytes'] / 1e3:11.1f} "
          f"{h['dense_bytes'] / h['payload_bytes']:10.1f} {h['seconds']:8.1f}")
  return results


if __name__ == "__main__":
  main()
