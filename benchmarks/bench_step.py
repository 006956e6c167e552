"""Step time of every compressor against dense (identity), under data_parallel.

Each row is one ``commopt.data_parallel`` training step with
``optax.chain(compressed_mean(c, axis_name="data", strategy=s), optax.sgd(0.1))``, and is
reported as a ratio to the identity compressor's step on the same model. A row is timed
in ``--rounds`` rounds of ``--steps`` steps (after a compile and one warm-up step), each
round beside a round of identity's step, every step blocked until ready: its ratio is the
median over the rounds of the row's median against identity's median of the same round,
so that a slow spell of a shared machine hits both sides of a ratio alike (the ms figure
is the row's best round, so two rows' ms need not divide to their ratio; the JSON keeps
every round). ``majority_vote`` and ``dgc`` are their own reducing
transforms; ``power_sgd`` runs its own protocol whatever the strategy.

Models (``--models``):

- ``mlp``: 1024 -> 1024 -> 10 (1.06M parameters), global batch 256.
- ``cnn``: the demo's digits CNN without batch norm or dropout (1.07M
  parameters), global batch 256 of the bundled 8x8 digits.

On CPU it simulates ``--workers`` devices (8 by default), with the host memory kept from
step to step (``--host-memory reuse``, :func:`commopt.launch.reuse_host_memory`); on a GPU
it uses the GPUs present (one worker per GPU). ``--check`` exits 1 when a ratio misses
its target (``TARGETS``), or when the identity step costs more than
``BASE_TARGET`` times the hand-written step beside it (``plain``: the same
model and sgd in ``jax.jit(jax.shard_map(...))`` with ``lax.pmean`` on the
gradients, timed in the same interleaved rounds); the identity step without the
non-finite skip (``identity, no skip``) is reported beside it. Every step is given a batch
placed beforehand, as the plain one is.

    python benchmarks/bench_step.py                            # everything, ~23 min on 2 cores
    python benchmarks/bench_step.py --compressors scaled_sign,top_k --models mlp --check
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness.summary import markdown_table  # noqa: E402  (after the path)
from harness.timing import interleaved, ratio, runner  # noqa: E402  (bench_base.py's too)

TARGETS = {
    **dict.fromkeys(["sign", "scaled_sign", "onebit", "cast", "random_k", "power_sgd",
                     "majority_vote"], 1.5),
    **dict.fromkeys(["terngrad", "qsgd", "natural", "int_quant"], 2.0),
    **dict.fromkeys(["top_k", "threshold", "gradient_dropping", "adacomp",
                     "variance_balanced", "dgc"], 3.0),
}
"""The most a step may cost, as a multiple of identity's step (adaptive_levels: reported only)."""

TRANSFORMS = ("majority_vote", "dgc")
BASE_TARGET = 1.05
"""The most the identity step may cost, as a multiple of the plain shard_map + pmean step."""


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--compressors", default="all",
                 help="comma-separated registry names, majority_vote, dgc; or all")
  p.add_argument("--strategies", default="gather,two_phase,auto",
                 help="compressed_mean strategies to time (each where the compressor takes "
                      "it); auto is timed only where it is neither of the others (psum)")
  p.add_argument("--models", default="mlp,cnn", help="mlp, cnn or both (comma-separated)")
  p.add_argument("--steps", type=int, default=4, help="timed steps per row and round (median)")
  p.add_argument("--rounds", type=int, default=3,
                 help="rounds per row, each beside a round of identity's step (median ratio)")
  p.add_argument("--workers", type=int, default=8, help="simulated CPU devices (CPU only)")
  p.add_argument("--batch", type=int, default=256, help="global batch")
  p.add_argument("--host-memory", default="reuse", choices=("reuse", "system"),
                 help="reuse: malloc keeps freed memory (commopt.launch.reuse_host_memory, "
                      "set before JAX starts; it matters on CPUs); system: glibc's defaults")
  p.add_argument("--check", action="store_true", help="exit 1 when a row misses its target")
  p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
  args = p.parse_args(argv)
  if args.steps < 1:
    p.error(f"--steps must be >= 1, got {args.steps}")
  if args.rounds < 1:
    p.error(f"--rounds must be >= 1, got {args.rounds}")
  if args.workers < 1:
    p.error(f"--workers must be >= 1, got {args.workers}")
  return args


def models(names, batch, seed=0):
  """{name: (params, loss_fn, batch)} with batches of ``batch`` examples."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  out = {}
  rng = np.random.default_rng(seed)
  if "mlp" in names:
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {"w1": jax.random.normal(k1, (1024, 1024)) / 32, "b1": jnp.zeros(1024),
              "w2": jax.random.normal(k2, (1024, 10)) / 32, "b2": jnp.zeros(10)}

    def mlp_loss(p, b):
      h = jax.nn.relu(b["x"] @ p["w1"] + p["b1"])
      return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"] + p["b2"], b["y"]).mean()

    data = {"x": jnp.asarray(rng.normal(size=(batch, 1024)), jnp.float32),
            "y": jnp.asarray(rng.integers(0, 10, batch), jnp.int32)}
    out["mlp"] = (params, mlp_loss, data)
  if "cnn" in names:
    sys.path.insert(0, str(ROOT / "examples"))
    from digits_cnn import load_digits_split, model_fns
    params, _, cnn_loss = model_fns(seed)
    x, y, _, _ = load_digits_split(seed)
    out["cnn"] = (params, cnn_loss, {"x": jnp.asarray(x[:batch]), "y": jnp.asarray(y[:batch])})
  return out


def reducer(name, strategy):
  """The reducing transform for ``name`` under ``strategy``, or a reason it does not apply."""
  import commopt
  if name == "majority_vote":
    return commopt.majority_vote(axis_name="data") if strategy == "gather" else "its own protocol"
  if name == "dgc":
    return (commopt.transforms.dgc(axis_name="data", densities=0.01) if strategy == "gather"
            else "its own protocol")
  c = commopt.compressors.make(name)
  if name == "identity":
    return commopt.compressed_mean(c, axis_name="data")
  if strategy == "auto":
    if not c.linear or "protocol" in c.capabilities:
      return "auto is gather here"
    strategy = "psum"
  if "protocol" in c.capabilities:
    if strategy != "gather":
      return "its own protocol"
    return commopt.compressed_mean(c, axis_name="data")
  try:
    return commopt.compressed_mean(c, axis_name="data", strategy=strategy)
  except ValueError as e:
    return str(e).split(";")[0]


def dp_runner(dp, params, batch):
  """``(run, compile seconds)`` for ``dp.step`` (:func:`runner`), after its compile and one
  warm-up step, on a batch placed once beforehand (``dp.place_batch``), as
  :func:`plain_runner` places its own: an input pipeline that prefetches hands the step a
  placed batch, and a step given a batch on one device would also time splitting it over
  the devices."""
  import jax
  params = jax.tree.map(lambda x: x.copy(), params)   # the step donates what it is given
  batch = jax.block_until_ready(dp.place_batch(batch))
  t0 = time.perf_counter()
  state = dp.init(params)
  p, s, _ = jax.block_until_ready(dp.step(params, state, batch)[:3])
  compile_s = time.perf_counter() - t0
  run = runner(dp.step, p, s, batch)
  run(1)
  return run, compile_s


def plain_step(mesh, loss_fn, opt):
  """``step(params, state, batch)``: ``jax.jit(jax.shard_map(...))`` whose gradients are
  averaged by ``lax.pmean``, the step a JAX user writes by hand, with donation."""
  import jax
  import optax
  from jax.sharding import PartitionSpec as P

  def body(p, s, b):
    # Parameters cast to per-worker values, so the gradients stay per worker and one
    # pmean averages them (differentiating the replicated parameters would all-reduce
    # each gradient already, and a pmean after that would sum the workers' gradients).
    local = jax.tree.map(lambda x: jax.lax.pcast(x, "data", to="varying"), p)
    loss, g = jax.value_and_grad(loss_fn)(local, b)
    u, s = opt.update(jax.lax.pmean(g, "data"), s, p)
    return optax.apply_updates(p, u), s, loss[None]

  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data")),
                               out_specs=(P(), P(), P("data"))), donate_argnums=(0, 1))


def plain_runner(mesh, loss_fn, params, batch):
  """:func:`runner` for :func:`plain_step` (sgd 0.1, as the rows), after two warm-up steps."""
  import jax
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P
  opt = optax.sgd(0.1)
  step = plain_step(mesh, loss_fn, opt)
  replicated = NamedSharding(mesh, P())
  p = jax.device_put(jax.tree.map(lambda x: x.copy(), params), replicated)
  s = jax.device_put(opt.init(p), replicated)
  run = runner(step, p, s, jax.device_put(batch, NamedSharding(mesh, P("data"))))
  run(2)
  return run


def main(argv=None):
  args = parse_args(argv)
  if args.host_memory == "reuse":
    from commopt import launch
    launch.reuse_host_memory()   # before JAX starts its runtime
  import jax
  jax.config.update("jax_num_cpu_devices", args.workers)   # the CPU backend only
  import optax

  import commopt

  workers = args.workers if jax.default_backend() == "cpu" else len(jax.devices())
  names = (sorted(commopt.compressors.REGISTRY) + list(TRANSFORMS)
           if args.compressors == "all" else [n.strip() for n in args.compressors.split(",")])
  valid = set(commopt.compressors.REGISTRY) | set(TRANSFORMS)
  for n in names:
    if n not in valid:
      sys.exit(f"--compressors: unknown {n!r}; valid: {sorted(valid)}")
  strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
  for s in strategies:
    if s not in ("gather", "two_phase", "auto"):
      sys.exit(f"--strategies: {s!r} is not 'gather', 'two_phase' or 'auto'")
  model_names = [m.strip() for m in args.models.split(",") if m.strip()]
  for m in model_names:
    if m not in ("mlp", "cnn"):
      sys.exit(f"--models: {m!r} is not 'mlp' or 'cnn'")
  if args.batch % workers:
    sys.exit(f"--batch {args.batch} must be a multiple of the {workers} workers")

  mesh = jax.make_mesh((workers,), ("data",), devices=jax.devices()[:workers])
  print(f"{jax.default_backend()} ({jax.devices()[0].device_kind}), {workers} workers, "
        f"jax {jax.__version__}, {args.rounds} rounds of {args.steps} steps per row, each "
        f"beside a round of identity's", flush=True)
  rows, misses = [], []
  for model, (params, loss_fn, batch) in models(model_names, args.batch).items():
    def dp_for(tx, skip_nonfinite=True):
      return commopt.data_parallel(loss_fn, optax.chain(tx, optax.sgd(0.1)), mesh,
                                   skip_nonfinite=skip_nonfinite)

    identity, base_compile = dp_runner(dp_for(reducer("identity", "gather")), params, batch)
    bare, _ = dp_runner(dp_for(reducer("identity", "gather"), False), params, batch)
    t = interleaved({"plain": plain_runner(mesh, loss_fn, params, batch),
                     "identity": identity, "no skip": bare}, args.rounds, args.steps)
    vs_plain = ratio(t["identity"], t["plain"])
    ok = vs_plain <= BASE_TARGET
    bare_vs_plain = ratio(t["no skip"], t["plain"])
    print(f"[{model}] plain shard_map + pmean: {min(t['plain']) * 1e3:.1f} ms/step; identity: "
          f"{min(t['identity']) * 1e3:.1f} ms/step, {vs_plain:.2f}x plain (target <= "
          f"{BASE_TARGET}x{'' if ok else ', MISSED'}; compile {base_compile:.1f} s)", flush=True)
    rows.append({"model": model, "compressor": "plain (shard_map + pmean)", "strategy": "-",
                 "ms": min(t["plain"]) * 1e3, "ratio": ratio(t["plain"], t["identity"]),
                 "round_ms": [x * 1e3 for x in t["plain"]]})
    rows.append({"model": model, "compressor": "identity", "strategy": "psum",
                 "ms": min(t["identity"]) * 1e3, "ratio": 1.0, "vs_plain": vs_plain,
                 "target_vs_plain": BASE_TARGET, "met": ok,
                 "round_ms": [x * 1e3 for x in t["identity"]]})
    if not ok:
      misses.append(rows[-1])
    # The same step without the non-finite skip, whose guarantee the plain step lacks.
    print(f"[{model}] identity, no skip: {min(t['no skip']) * 1e3:.1f} ms/step, "
          f"{bare_vs_plain:.2f}x plain", flush=True)
    rows.append({"model": model, "compressor": "identity, no skip", "strategy": "psum",
                 "ms": min(t["no skip"]) * 1e3, "ratio": ratio(t["no skip"], t["identity"]),
                 "vs_plain": bare_vs_plain, "round_ms": [x * 1e3 for x in t["no skip"]]})
    del bare, t
    # The identity runner goes on training on the one batch through every row of the model:
    # its step's cost does not depend on the values.
    for name in names:
      if name == "identity":
        continue
      for strategy in strategies:
        tx = reducer(name, strategy)
        if isinstance(tx, str):
          if (strategy == strategies[0] or tx != "its own protocol") and strategy != "auto":
            print(f"[{model}] {name} [{strategy}]: skipped ({tx})", flush=True)
          continue
        run, compile_s = dp_runner(dp_for(tx), params, batch)
        t = interleaved({"identity": identity, "row": run}, args.rounds, args.steps)
        del run
        label = "auto (psum)" if strategy == "auto" else strategy
        r = ratio(t["row"], t["identity"])
        target = TARGETS.get(name)
        ok = target is None or r <= target
        row = {"model": model, "compressor": name, "strategy": label,
               "ms": min(t["row"]) * 1e3, "ratio": r, "target": target, "met": ok,
               "compile_s": compile_s, "round_ms": [x * 1e3 for x in t["row"]],
               "identity_round_ms": [x * 1e3 for x in t["identity"]],
               "round_ratios": [a / b for a, b in zip(t["row"], t["identity"])]}
        rows.append(row)
        if not ok:
          misses.append(row)
        print(f"[{model}] {name} [{label}]: {row['ms']:.1f} ms/step, {r:.2f}x identity"
              f" (target {'-' if target is None else f'<= {target}x'}"
              f"{'' if ok else ', MISSED'}; compile {compile_s:.1f} s)", flush=True)
    del identity

  cells = []
  for r in rows:
    target = r.get("target")
    mark = "" if target is None else (f"≤ {target}" + ("" if r["met"] else " **missed**"))
    if "target_vs_plain" in r:
      mark = (f"{r['vs_plain']:.2f}× plain, ≤ {BASE_TARGET}"
              + ("" if r["met"] else " **missed**"))
    elif "vs_plain" in r:
      mark = f"{r['vs_plain']:.2f}× plain"
    cells.append([r["model"], r["compressor"], r["strategy"], f"{r['ms']:.1f}",
                  f"{r['ratio']:.2f}", mark])
  print("\n" + markdown_table(["model", "compressor", "strategy", "ms/step", "× identity",
                               "target"], cells))
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  path = out / f"step_{jax.default_backend()}.json"
  meta = {"jax": jax.__version__, "backend": jax.default_backend(), "workers": workers,
          "device": str(jax.devices()[0].device_kind), "python": platform.python_version(),
          "steps": args.steps, "rounds": args.rounds, "batch": args.batch,
          "host_memory": args.host_memory}
  path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
  judged = [r for r in rows if "met" in r]
  print(f"wrote {path}; {len(misses)} of {len(judged)} rows missed their target")
  if args.check and misses:
    sys.exit(1)


if __name__ == "__main__":
  main()
