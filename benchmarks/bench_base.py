"""The base step against hand-written JAX: what ``data_parallel`` costs before any compression.

Every row trains the same MLP (64 -> 1024 -> 1024 -> 1024 -> 10, 2.1M
parameters, adam, ``--rows`` rows per worker) one step at a time, and is
timed as the median of ``--steps`` steps (each blocked until ready), in
``--rounds`` interleaved rounds so that a slow spell on a shared machine hits
every row alike; the best round's median is reported, and each row's ratios to
the same round's baselines, their medians over the rounds:

- ``plain``: ``jax.jit(jax.shard_map(step))`` whose gradients are averaged by
  ``lax.pmean`` on the tree (the parameters cast to per-worker values first, so the
  gradients stay per worker until that one all-reduce per leaf);
- ``plain (flat)``: the same with the gradients concatenated into one buffer
  for one all-reduce (what DDP's buckets do);
- ``plain (1 MB buckets)``: the same, the gradients concatenated in order
  into buffers of at most 1 MB (a larger leaf alone), one all-reduce each;
- ``... + optax.apply_if_finite``: each of those with adam wrapped in
  ``optax.apply_if_finite`` (a ``lax.cond`` on whether the mean is finite: the mean is
  the same on every worker, so this is what a user writes by hand for a skip);
- ``plain, by-hand skip``: ``plain`` with the default skip's guarantee written out (the
  update checked, which a NaN anywhere reaches for a dense mean and adam, as an overflow
  inside adam does; on a skip the parameters and adam's state kept by a select per leaf):
  what that guarantee costs a hand-written step, beside what it costs ``identity``;
- ``identity``: ``data_parallel(loss, chain(compressed_mean(identity()), adam))``
  with its defaults (the agreed non-finite skip, every state kept on a skip);
- ``identity, zero skip``: the same with ``skip_nonfinite="zero"`` (on a skip
  the optimizer takes a zero gradient);
- ``identity, no skip``: the same with ``skip_nonfinite=False``.

The two ratios the targets name: ``identity`` against the fastest ``plain ... +
optax.apply_if_finite`` row (``× plain skip``), and ``identity, no skip`` against the
fastest plain row (``× fastest plain``); both at most ``TARGET``.

Two layouts (``--layouts``): ``devices``, one process with ``--workers``
CPU devices (on a GPU host, its GPUs); ``processes``, ``--workers``
processes of one CPU device each, connected by ``jax.distributed`` over gloo
(started by :func:`commopt.launch.launch`). ``--check`` exits 1 when either
ratio misses ``TARGET``.
``--host-memory system`` measures with the C library's own malloc settings, under
which every step maps and faults in its large temporaries afresh (the default,
``reuse``, is what :func:`commopt.launch.launch` gives its processes).

    python benchmarks/bench_base.py                     # both layouts, ~3 min on 2 cores
    python benchmarks/bench_base.py --layouts processes --workers 4 --check
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_step import ratio, runner  # noqa: E402  (after the path)

TARGET = 1.05
"""The most the identity step may cost, as a multiple of the fastest plain step of the same
guarantee (with the skip: the fastest plain step wrapped in ``optax.apply_if_finite``)."""
OPTAX_SKIP = " + optax.apply_if_finite"
SIZES = (64, 1024, 1024, 1024, 10)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--layouts", default="devices,processes",
                 help="comma-separated: devices (one process) and/or processes (gloo)")
  p.add_argument("--workers", type=int, default=4, help="devices or processes")
  p.add_argument("--rows", type=int, default=64, help="rows per worker per step")
  p.add_argument("--steps", type=int, default=15, help="timed steps per row and round")
  p.add_argument("--rounds", type=int, default=3,
                 help="interleaved rounds (best time, median ratio)")
  p.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                 help="wall: seconds per step; cpu: this process's CPU seconds per step "
                      "(the work done, steadier on a shared machine; devices layout only)")
  p.add_argument("--host-memory", default="reuse", choices=("reuse", "system"),
                 help="reuse: malloc keeps freed memory (commopt.launch.reuse_host_memory in "
                      "this process; the launcher's default for the processes); system: the C "
                      "library's defaults (each step maps its large temporaries afresh)")
  p.add_argument("--check", action="store_true",
                 help=f"exit 1 when identity costs more than {TARGET}x plain")
  p.add_argument("--timeout", type=float, default=900, help="seconds for the process layout")
  p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
  p.add_argument("--worker", metavar="RESULT", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  args.layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
  bad = [x for x in args.layouts if x not in ("devices", "processes")]
  if bad:
    p.error(f"--layouts: {bad} not among 'devices', 'processes'")
  for name in ("workers", "rows", "steps", "rounds"):
    if getattr(args, name) < 1:
      p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
  return args


def model(workers: int, rows: int, seed: int = 0):
  """``(params, loss_fn, batch)``: the MLP and a global batch of ``workers * rows`` rows."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  keys = jax.random.split(jax.random.key(seed), len(SIZES) - 1)
  params = {f"l{i}": {"w": jax.random.normal(keys[i], (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
            for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:]))}

  def loss_fn(p, batch):
    h = batch["x"]
    for i in range(len(SIZES) - 1):
      h = h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"]
      if i < len(SIZES) - 2:
        h = jax.nn.relu(h)
    return optax.softmax_cross_entropy_with_integer_labels(h, batch["y"]).mean()

  rng = np.random.default_rng(seed)
  batch = {"x": rng.normal(size=(workers * rows, SIZES[0])).astype(np.float32),
           "y": rng.integers(0, SIZES[-1], workers * rows).astype(np.int32)}
  return params, loss_fn, batch


def steps(mesh, params, loss_fn):
  """``{label: (init, step)}`` of every row: ``step(params, state, batch)``."""
  import jax
  import jax.numpy as jnp
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P

  import commopt

  opt = optax.adam(1e-3)
  replicated = NamedSharding(mesh, P())

  def bucketed_pmean(g, cap):
    leaves, treedef = jax.tree.flatten(g)
    groups, room = [], 0            # consecutive leaves, each group at most `cap` bytes
    for i, x in enumerate(leaves):
      if not groups or x.nbytes > room:
        groups.append([])
        room = cap
      groups[-1].append(i)
      room -= x.nbytes
    out = list(leaves)
    for group in groups:
      mean = jax.lax.pmean(jnp.concatenate([leaves[i].ravel() for i in group]), "data")
      offsets = [0]
      for i in group:
        offsets.append(offsets[-1] + leaves[i].size)
      for i, a, z in zip(group, offsets, offsets[1:]):
        out[i] = mean[a:z].reshape(leaves[i].shape)
    return treedef.unflatten(out)

  def finite(tree):
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))

  def plain_step(flat, skip=False):
    step_opt = (optax.apply_if_finite(opt, max_consecutive_errors=2**31 - 1)
                if skip == "optax" else opt)

    def body(p, s, b):
      # Parameters cast to per-worker values, so the gradients stay per worker until the
      # exchange: differentiating the replicated parameters would all-reduce each
      # gradient leaf already (a pmean after that would sum the workers' gradients).
      local = jax.tree.map(lambda x: jax.lax.pcast(x, "data", to="varying"), p)
      loss, g = jax.value_and_grad(loss_fn)(local, b)
      if flat == "buckets":
        g = bucketed_pmean(g, 2**20)
      elif flat:
        vec, unravel = jax.flatten_util.ravel_pytree(g)
        g = unravel(jax.lax.pmean(vec, "data"))
      else:
        g = jax.lax.pmean(g, "data")
      # optax.apply_if_finite: one lax.cond on the mean (the same on every worker).
      u, new_s = step_opt.update(g, s, p)
      if skip == "by hand":
        # The default skip's guarantee written out for a dense mean: a NaN or an infinity
        # in any worker's gradient reaches the mean and adam's update, and an overflow
        # inside adam reaches it too, so one check of the update decides; on a skip the
        # parameters and adam's state stay as they were (a select per leaf).
        ok = finite(u)
        u = jax.tree.map(lambda x: jnp.where(ok, x, -0.0), u)
        new_s = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_s, s)
      return optax.apply_updates(p, u), new_s, loss[None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data")),
                               out_specs=(P(), P(), P("data"))), donate_argnums=(0, 1))
    init = lambda p: jax.device_put(step_opt.init(p), replicated)
    return init, fn

  def identity(skip):
    tx = optax.chain(commopt.compressed_mean(commopt.compressors.identity(), axis_name="data"),
                     opt)
    dp = commopt.data_parallel(loss_fn, tx, mesh, skip_nonfinite=skip)
    return dp.init, lambda p, s, b: dp.step(p, s, b)[:3]

  import jax.flatten_util  # noqa: F401  (ravel_pytree)
  rows = {}
  for label, flat in (("plain", False), ("plain (flat)", True),
                      ("plain (1 MB buckets)", "buckets")):
    rows[label] = plain_step(flat)
    rows[label + OPTAX_SKIP] = plain_step(flat, skip="optax")
  rows["plain, by-hand skip"] = plain_step(False, skip="by hand")
  rows.update({"identity": identity(True), "identity, zero skip": identity("zero"),
               "identity, no skip": identity(False)})
  return rows


def measure(mesh, params, loss_fn, batch, n_steps: int, rounds: int, log=print,
            clock=time.perf_counter) -> dict:
  """``{label: [each round's median seconds]}`` by ``clock``, rows interleaved round by
  round."""
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P

  rows = steps(mesh, params, loss_fn)
  replicated = NamedSharding(mesh, P())
  runs = {}
  for label, (init, step) in rows.items():
    p = jax.device_put(jax.tree.map(lambda x: x.copy(), params), replicated)
    runs[label] = runner(step, p, init(p), batch, clock)
    runs[label](2)                           # compile, then one warm step
  per_round = {label: [] for label in rows}
  for r in range(rounds):
    for label, run in runs.items():
      per_round[label].append(run(n_steps))
    log(f"  round {r + 1}: " + ", ".join(f"{k} {v[-1] * 1e3:.1f} ms"
                                         for k, v in per_round.items()))
  return per_round


def summary(per_round: dict) -> dict:
  """``{label: {"ms": best round's median, "ratio": median over rounds of the row against
  that round's fastest plain row, "vs_plain_skip": the same against the fastest plain row
  wrapped in optax.apply_if_finite, "vs_no_skip": against identity without the skip}}``:
  a ratio taken within each round is what a machine whose speed drifts between rounds
  leaves comparable."""
  def fastest(labels):
    n = len(per_round[labels[0]])
    return [min(per_round[k][r] for k in labels) for r in range(n)]
  plains = [k for k in per_round if k.startswith("plain") and "skip" not in k
            and not k.endswith(OPTAX_SKIP)]
  skipped = [k for k in per_round if k.startswith("plain") and k.endswith(OPTAX_SKIP)]
  plain, plain_skip = fastest(plains), fastest(skipped)
  return {k: {"ms": min(v) * 1e3, "ratio": ratio(v, plain),
              "vs_plain_skip": ratio(v, plain_skip),
              "vs_no_skip": ratio(v, per_round["identity, no skip"])}
          for k, v in per_round.items()}


def misses(rows: dict) -> list[str]:
  """The targets ``rows`` (one layout's :func:`summary`) misses."""
  out = []
  if rows["identity"]["vs_plain_skip"] > TARGET:
    out.append(f"identity {rows['identity']['vs_plain_skip']:.2f}x plain{OPTAX_SKIP}")
  if rows["identity, no skip"]["ratio"] > TARGET:
    out.append(f"identity, no skip {rows['identity, no skip']['ratio']:.2f}x plain")
  return out


def run_devices(args) -> dict:
  if args.host_memory == "reuse":
    from commopt import launch
    launch.reuse_host_memory()
  import jax
  jax.config.update("jax_num_cpu_devices", args.workers)   # the CPU backend only
  workers = args.workers if jax.default_backend() == "cpu" else len(jax.devices())
  mesh = jax.make_mesh((workers,), ("data",), devices=jax.devices()[:workers])
  params, loss_fn, batch = model(workers, args.rows)
  from jax.sharding import NamedSharding, PartitionSpec as P
  batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
  print(f"[devices] {workers} {jax.default_backend()} devices in one process, "
        f"{args.clock} time", flush=True)
  return measure(mesh, params, loss_fn, batch, args.steps, args.rounds,
                 log=lambda s: print(s, flush=True),
                 clock=time.process_time if args.clock == "cpu" else time.perf_counter)


def worker(args) -> None:
  """One process of the ``processes`` layout: measures, and process 0 writes the result."""
  from commopt import launch
  ctx = launch.initialize()
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P

  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  params, loss_fn, batch = model(jax.device_count(), args.rows)
  mine = jax.tree.map(lambda x: np.split(x, ctx.num_processes)[ctx.process_id], batch)
  batch = jax.tree.map(lambda x: jax.make_array_from_process_local_data(
      NamedSharding(mesh, P("data")), x), mine)
  log = (lambda s: print(s, flush=True)) if ctx.process_id == 0 else (lambda s: None)
  best = measure(mesh, params, loss_fn, batch, args.steps, args.rounds, log=log)
  if ctx.process_id == 0:
    pathlib.Path(args.worker).write_text(json.dumps(best))


def run_processes(args) -> dict:
  from commopt import launch
  print(f"[processes] {args.workers} processes of one CPU device, gloo", flush=True)
  with tempfile.TemporaryDirectory() as tmp:
    result = pathlib.Path(tmp) / "result.json"
    argv = [__file__, "--worker", str(result), "--rows", str(args.rows), "--steps",
            str(args.steps), "--rounds", str(args.rounds)]
    launch.launch(argv, processes=args.workers, devices_per_process=1, timeout=args.timeout,
                  host_memory=args.host_memory)
    return json.loads(result.read_text())


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.worker:
    worker(args)
    return 0
  results, missed = {}, {}
  for layout in args.layouts:
    per_round = run_devices(args) if layout == "devices" else run_processes(args)
    results[layout] = summary(per_round)
    missed[layout] = misses(results[layout])
  import jax
  unit = "CPU ms/step" if args.clock == "cpu" else "ms/step"
  print(f"\n| layout | step | {unit} (best round) | × fastest plain | × fastest plain"
        f"{OPTAX_SKIP} | × identity, no skip |\n|---|---|---|---|---|---|")
  for layout, rows in results.items():
    for label, r in rows.items():
      print(f"| {layout} ({args.workers}) | {label} | {r['ms']:.1f} | {r['ratio']:.2f} "
            f"| {r['vs_plain_skip']:.2f} | {r['vs_no_skip']:.2f} |")
  for layout in results:
    print(f"{layout}: identity {results[layout]['identity']['vs_plain_skip']:.2f}x the "
          f"fastest plain step{OPTAX_SKIP}, identity without the skip "
          f"{results[layout]['identity, no skip']['ratio']:.2f}x the fastest plain step "
          f"(targets <= {TARGET}): "
          + ("missed: " + "; ".join(missed[layout]) if missed[layout] else "met"))
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  path = out / f"base_{jax.default_backend()}.json"
  meta = {"jax": jax.__version__, "backend": jax.default_backend(), "workers": args.workers,
          "rows": args.rows, "steps": args.steps, "rounds": args.rounds, "clock": args.clock,
          "host_memory": args.host_memory,
          "python": platform.python_version(), "target": TARGET}
  path.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
  print(f"wrote {path}")
  return 1 if args.check and any(missed.values()) else 0


if __name__ == "__main__":
  sys.exit(main())
