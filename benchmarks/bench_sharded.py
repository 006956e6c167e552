"""Bytes and memory of the shard-local step against whole leaves, and sharded = unsharded.

A tensor-parallel MLP (``w1: [D, H]`` sharded ``P(None, "model")``, ``w2: [H, D]``
sharded ``P("model", None)``, a replicated bias ``b: [D]``) is trained by
``data_parallel(loss_fn, chain(compressed_mean(c, axis_name="data", strategy=s),
adam(lr)), mesh)`` for each compressor ``c`` and strategy ``s``, in three setups on the
same mesh: ``local``, the shard-local step (each device compresses and sends its shard;
state sharded like the parameters); ``whole``, ``shard_local=False`` (``tx`` on whole
leaves all-gathered over the model axis); ``repl``, every parameter replicated (the
memory baseline). Each row reads the compiled step (``jax.jit(dp.step_fn)`` lowered for
``dp.abstract_state(params)``, nothing run):

1. data-axis bytes one device contributes per step (as ``commopt.wire`` counts them),
   for the sharded leaves and for the rest (the dense bias, split over the model ranks
   on the shard-local step, and scalars); ``local/whole``, ideally 1/M with M model ranks;
2. model-axis bytes the optimizer adds beyond the forward and backward pass's own, and the
   largest model-axis all-gather in elements (a parameter-sized one means a whole leaf);
3. memory per device: ``argument_size_in_bytes + temp_size_in_bytes``, and local/repl.

Then the sharded = unsharded table (``bench_sharded_exact.py``): every compressor
``docs/guide/sharded.md`` calls exact, on the same gradients sharded and replicated.

Refused combinations are listed as skipped with the reason; a strategy compiling the same
programs as another is marked ``= auto``. ``--check`` exits 1 when a row misses a target
(:data:`TARGET_FACTOR`) or an exact compressor differs. On CPU a 16-bit collective's bytes
are read from the lowered HLO (XLA:CPU widens them to f32 when it compiles), as
``commopt.wire.hlo_collectives`` does. Runs on 8 simulated CPU devices.

    python benchmarks/bench_sharded.py                      # 2x4, every compressor
    python benchmarks/bench_sharded.py --meshes 2x4,4x2 --json /tmp/sharded.json
    python benchmarks/bench_sharded.py --quick --check      # 3 compressors, a smoke run
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import pathlib
import platform
import sys
import time
import warnings

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness.hlo import axis_groups, on_groups, operand_bytes  # noqa: E402  (after the path)
from bench_sharded_exact import exact_rows, exact_table  # noqa: E402

COMPRESSORS = {
    "identity": {},
    "cast": {"dtype": "bfloat16"},
    "scaled_sign": {},
    "int_quant": {"bits": 8},
    "qsgd": {},
    "top_k": {"ratio": 0.01},
    "random_k": {"ratio": 0.01},
    "power_sgd": {"rank": 2},
}
"""The compressors measured, with the options given to ``commopt.compressors.make``."""

QUICK = ("identity", "scaled_sign", "power_sgd")
"""The compressors of ``--quick``."""

STRATEGIES = ("auto", "gather", "two_phase")

TARGET_FACTOR = 1.2
"""On a mesh with M model ranks, the shard-local step may cost at most ``1.2 / M`` of the
whole-leaf step's data-axis bytes over the sharded leaves (``data_ratio``) and of the
replicated model's memory per device (``memory_ratio``): 0.3 on 2x4. Its largest
model-axis all-gather must also be smaller than one device's shard of a sharded leaf."""

NARROW_FLOATS = ("bf16", "f16")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--meshes", default="2x4",
                 help="comma-separated DATAxMODEL meshes of the 8 devices (2x4, 4x2)")
  p.add_argument("--compressors", default="all",
                 help=f"comma-separated names among {', '.join(COMPRESSORS)}; or all")
  p.add_argument("--strategies", default=",".join(STRATEGIES),
                 help="comma-separated compressed_mean strategies")
  p.add_argument("--quick", action="store_true",
                 help=f"a smoke run: {', '.join(QUICK)} on the first mesh")
  p.add_argument("--inputs", type=int, default=256, help="D: the MLP is D -> H -> D")
  p.add_argument("--hidden", type=int, default=2048, help="H")
  p.add_argument("--batch", type=int, default=32, help="global batch")
  p.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate")
  p.add_argument("--json", default=None, help="write the rows here as JSON")
  p.add_argument("--check", action="store_true", help="exit 1 when a row misses a target")
  p.add_argument("--exact", action="store_true",
                 help="with --quick, also the sharded = unsharded table (always run without)")
  p.add_argument("--exact-steps", type=int, default=3,
                 help="calls of the exchange in the sharded = unsharded comparison")
  args = p.parse_args(argv)
  meshes = []
  for m in args.meshes.split(","):
    try:
      data, model = (int(s) for s in m.strip().split("x"))
    except ValueError:
      p.error(f"--meshes: {m!r} is not DATAxMODEL")
    if data * model != 8 or data < 2 or model < 2:
      p.error(f"--meshes: {m!r} must use the 8 devices, with both axes >= 2")
    meshes.append((data, model))
  args.meshes = meshes[:1] if args.quick else meshes
  names = (list(QUICK) if args.quick else list(COMPRESSORS) if args.compressors == "all"
           else [n.strip() for n in args.compressors.split(",") if n.strip()])
  for n in names:
    if n not in COMPRESSORS:
      p.error(f"--compressors: unknown {n!r}; valid: {list(COMPRESSORS)}")
  args.compressors = names
  args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
  for s in args.strategies:
    if s not in STRATEGIES:
      p.error(f"--strategies: {s!r} is not one of {STRATEGIES}")
  if args.hidden % 4 or args.batch % 8:
    p.error("--hidden must be a multiple of 4 and --batch of 8")
  return args


class Setup:
  """The model, its batch and its two placements on one ``(data, model)`` mesh."""

  def __init__(self, data, model, inputs, hidden, batch):
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    self.mesh = jax.make_mesh((data, model), ("data", "model"),
                              devices=jax.devices()[:data * model])
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    self.raw = {"w1": jax.random.normal(k1, (inputs, hidden)) / inputs ** 0.5,
                "w2": jax.random.normal(k2, (hidden, inputs)) / hidden ** 0.5,
                "b": jnp.zeros((inputs,))}
    self.specs = {"sharded": {"w1": P(None, "model"), "w2": P("model", None), "b": P()},
                  "replicated": {"w1": P(), "w2": P(), "b": P()}}
    x = jax.random.normal(k3, (batch, inputs))
    self.batch = {"x": x, "y": jnp.sin(x)}
    self.model_ranks = model
    self.data_groups = axis_groups(self.mesh, "data")
    self.model_groups = axis_groups(self.mesh, "model")
    self.param_bytes = sum(int(v.nbytes) for v in self.raw.values())
    self.sharded_bytes = int(self.raw["w1"].nbytes + self.raw["w2"].nbytes)
    self.shard_elements = min(self.raw["w1"].size, self.raw["w2"].size) // model
    # The leaves every device holds whole (the bias, or its part where the model ranks
    # split it, the flag riding along) and scalars: not the sharded leaves' collectives.
    self.other_elements = self.raw["b"].size + 1

  @staticmethod
  def loss_fn(p, b):
    """Mean squared error of ``tanh(x @ w1) @ w2 + b``; the contraction over the
    model-sharded hidden dimension names its (replicated) output sharding."""
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    h = jnp.tanh(b["x"] @ p["w1"])
    out = jnp.einsum("bh,ho->bo", h, p["w2"], out_sharding=P())
    return jnp.mean((out + p["b"] - b["y"]) ** 2)

  def params(self, placement):
    """The parameters placed on the mesh, ``"sharded"`` or ``"replicated"``."""
    import jax
    from jax.sharding import NamedSharding
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(self.mesh, s)),
                        self.raw, self.specs[placement])

  def measure(self, tx, placement, shard_local, cache):
    """One step compiled for ``placement`` and ``shard_local``: its bytes by axis, its
    memory per device and notes.

    The step is ``jax.jit(dp.step_fn)`` with the donation ``dp.step`` uses, lowered
    for ``dp.abstract_state(params)``: nothing runs, not even ``dp.init``. A program
    whose lowered text is in ``cache`` (the one another strategy gave) is not compiled
    again.
    """
    import jax
    import commopt
    from commopt import wire

    params = self.params(placement)
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      dp = commopt.data_parallel(self.loss_fn, tx, self.mesh, "data", shard_local=shard_local)
      abstract_params, abstract_state = dp.abstract_state(params)
      step = jax.jit(dp.step_fn, donate_argnames=("params", "opt_state", "model_state"))
      lowered = step.lower(abstract_params, abstract_state, self.batch)
    key = hashlib.sha1(lowered.as_text().encode()).hexdigest()
    if key in cache:
      return dict(cache[key], program=key)
    before = wire.parse_hlo(lowered.as_text(dialect="hlo"))
    cpu = jax.default_backend() == "cpu"
    compiled = lowered.compile()
    memory = compiled.memory_analysis()
    after = wire.parse_hlo(compiled.as_text())
    # Data-axis bytes as commopt.wire.hlo_collectives(step, ...) reads them: from the
    # compiled program, or on CPU from the lowered one where a collective moves a 16-bit
    # float (XLA:CPU widens those to f32). The rest always from the compiled program: the
    # model-axis collectives of the forward and backward pass are the SPMD partitioner's,
    # absent before it runs.
    narrow = cpu and any(set(c.dtypes) & set(NARROW_FLOATS) for c in before)
    out = {"data_sharded": 0, "data_other": 0, "model_bytes": 0, "model_gather_bytes": 0,
           "model_gather_max": 0, "other_bytes": 0}
    for c in before if narrow else after:
      if on_groups(c, self.data_groups):
        for shape, nbytes in operand_bytes(c):
          small = math.prod(shape) <= self.other_elements
          out["data_other" if small else "data_sharded"] += nbytes
    for c in after:
      if on_groups(c, self.data_groups):
        continue
      if on_groups(c, self.model_groups):
        out["model_bytes"] += c.contributed_bytes
        if c.kind == "all-gather":
          out["model_gather_bytes"] += c.contributed_bytes
          out["model_gather_max"] = max([out["model_gather_max"]]
                                        + [math.prod(s) for s in c.shapes])
      else:
        out["other_bytes"] += c.contributed_bytes
    out.update(memory=int(memory.argument_size_in_bytes + memory.temp_size_in_bytes),
               argument_bytes=int(memory.argument_size_in_bytes),
               temp_bytes=int(memory.temp_size_in_bytes),
               layout="shard_local" if dp.layout(params).shard_local else "whole",
               warnings=sorted({str(w.message)[:300] for w in caught}))
    cache[key] = out
    return dict(out, program=key)


def make_tx(name, strategy, lr):
  """``chain(compressed_mean(name, strategy), adam(lr))``, or why it is refused."""
  import optax
  import commopt
  compressor = commopt.compressors.make(name, **COMPRESSORS[name])
  try:
    reduce = commopt.compressed_mean(compressor, axis_name="data", strategy=strategy)
  except ValueError as e:
    return str(e).split(";")[0]
  return optax.chain(reduce, optax.adam(lr))


def run_mesh(setup, args, label):
  """The rows of one mesh: one per compressor and strategy."""
  import optax
  import commopt

  t0 = time.perf_counter()
  cache = {}
  base_tx = optax.chain(commopt.compressed_mean(commopt.compressors.identity(),
                                                axis_name="data"), optax.sgd(args.lr))
  base = setup.measure(base_tx, "sharded", "auto", cache)["model_bytes"]
  print(f"[{label}] the forward and backward pass's own model-axis bytes: {base} "
        f"({time.perf_counter() - t0:.1f} s)", flush=True)
  rows = []
  for name in args.compressors:
    programs = {}
    for strategy in args.strategies:
      row = {"mesh": label, "compressor": name, "strategy": strategy}
      rows.append(row)
      tx = make_tx(name, strategy, args.lr)
      if isinstance(tx, str):
        row["skipped"] = tx
        print(f"[{label}] {name} [{strategy}]: skipped ({tx})", flush=True)
        continue
      t0 = time.perf_counter()
      try:
        modes = {"local": setup.measure(tx, "sharded", "auto", cache),
                 "whole": setup.measure(tx, "sharded", False, cache),
                 "repl": setup.measure(tx, "replicated", "auto", cache)}
      except ValueError as e:
        row["skipped"] = str(e).split(";")[0][:300]
        print(f"[{label}] {name} [{strategy}]: skipped ({row['skipped']})", flush=True)
        continue
      for mode, m in modes.items():
        m["model_added"] = m["model_bytes"] - (base if mode != "repl" else 0)
        row[mode] = m
      local, whole, repl = modes["local"], modes["whole"], modes["repl"]
      same = programs.get(tuple(m["program"] for m in modes.values()))
      if same:
        row["same_as"] = same
      programs.setdefault(tuple(m["program"] for m in modes.values()), strategy)
      row["data_ratio"] = local["data_sharded"] / max(whole["data_sharded"], 1)
      row["memory_ratio"] = local["memory"] / repl["memory"]
      row["whole_memory_ratio"] = whole["memory"] / repl["memory"]
      row["seconds"] = time.perf_counter() - t0
      row["missed"] = misses(row, setup)
      print(f"[{label}] {name} [{strategy}]: data-axis bytes {local['data_sharded']} local, "
            f"{whole['data_sharded']} whole ({row['data_ratio']:.3f}); memory "
            f"{row['memory_ratio']:.3f}x replicated ({row['seconds']:.1f} s)"
            + (f"; MISSED {', '.join(row['missed'])}" if row["missed"] else ""), flush=True)
  return rows


def misses(row, setup):
  """The targets ``row`` misses (:data:`TARGET_FACTOR`)."""
  limit = TARGET_FACTOR / setup.model_ranks
  out = [f"{k} {row[k]:.3f} > {limit:.3f}" for k in ("data_ratio", "memory_ratio")
         if row[k] > limit]
  if row["local"]["model_gather_max"] >= setup.shard_elements:
    out.append(f"shard-local model-axis all-gather of {row['local']['model_gather_max']} "
               f"elements >= a shard's {setup.shard_elements}")
  if row["local"]["layout"] != "shard_local":
    out.append("the shard-local step ran on whole leaves")
  return out


def table(rows):
  """The printed (markdown) table of ``rows``."""
  def kib(n):
    return f"{n / 1024:.1f}"

  def mib(n):
    return f"{n / 2**20:.2f}"

  lines = ["| mesh | compressor | strategy | data KiB local | data KiB whole | local/whole "
           "| data KiB rest l/w | model KiB added l/w | model gather max l/w "
           "| MiB local | MiB whole | MiB repl | local/repl | whole/repl |",
           "|" + "---|" * 14]
  for r in rows:
    strategy = r["strategy"] + (f" (= {r['same_as']})" if r.get("same_as") else "")
    head = f"| {r['mesh']} | {r['compressor']} | {strategy} |"
    if "skipped" in r:
      lines.append(f"{head} skipped: {r['skipped']} |" + " |" * 10)
      continue
    loc, who, rep = r["local"], r["whole"], r["repl"]
    fell_back = "" if loc["layout"] == "shard_local" else " (whole leaves!)"
    lines.append(
        f"{head} {kib(loc['data_sharded'])}{fell_back} | {kib(who['data_sharded'])} | "
        f"{r['data_ratio']:.3f} | {kib(loc['data_other'])} / {kib(who['data_other'])} | "
        f"{kib(loc['model_added'])} / {kib(who['model_added'])} | "
        f"{loc['model_gather_max']} / {who['model_gather_max']} | "
        f"{mib(loc['memory'])} | {mib(who['memory'])} | "
        f"{mib(rep['memory'])} | {r['memory_ratio']:.3f} | "
        f"{r['whole_memory_ratio']:.3f}{' **missed**' if r['missed'] else ''} |")
  return "\n".join(lines)


LEGEND = (
    "data KiB: bytes one device contributes per step to data-axis collectives for the "
    "sharded leaves w1, w2 (local: shard-local step; whole: shard_local=False); local/whole "
    "is their ratio. data KiB rest: the same for the dense bias and scalars. model KiB added: "
    "model-axis bytes beyond the forward and backward pass's own. model gather max: the "
    "largest model-axis all-gather, in elements. MiB: argument + temp bytes per device "
    "(repl: the same model with replicated parameters). (= auto): the same programs as auto.")


def main(argv=None):
  args = parse_args(argv)
  import jax
  jax.config.update("jax_num_cpu_devices", 8)   # the CPU backend only
  if len(jax.devices()) < 8:
    sys.exit(f"needs 8 devices, found {len(jax.devices())}")

  t_start = time.perf_counter()
  print(f"{jax.default_backend()}, jax {jax.__version__}: MLP {args.inputs} -> {args.hidden} "
        f"-> {args.inputs} + bias, chain(compressed_mean(c, strategy=s), adam)", flush=True)
  rows, setups = [], {}
  for data, model in args.meshes:
    label = f"{data}x{model}"
    setups[label] = Setup(data, model, args.inputs, args.hidden, args.batch)
    rows += run_mesh(setups[label], args, label)

  print()
  for label, s in setups.items():
    print(f"{label} (data x model): parameters {s.param_bytes / 2**20:.2f} MiB, of which "
          f"w1, w2 (sharded over model) {s.sharded_bytes / 2**20:.2f} MiB; targets: "
          f"local/whole and local/repl <= {TARGET_FACTOR / s.model_ranks:.3f}")
  print(table(rows))
  print(LEGEND)
  exact = [] if args.quick and not args.exact else exact_rows(
      next(iter(setups.values())), args.exact_steps)
  if exact:
    print("\n" + exact_table(exact))
  missed = [r for r in rows if r.get("missed")] + [r for r in exact if not r["kept"]]
  for r in missed:
    print(f"MISSED {r.get('mesh', 'exact')} {r['compressor']} [{r.get('strategy', r.get('promise'))}]"
          f": {'; '.join(r.get('missed', ['differs from the replicated run']))}")
  measured = sum("skipped" not in r for r in rows) + len(exact)
  print(f"{len(missed)} of {measured} rows missed a target; "
        f"{sum('skipped' in r for r in rows)} skipped; {time.perf_counter() - t_start:.0f} s")
  if args.json:
    meta = {"backend": jax.default_backend(), "jax": jax.__version__,
            "python": platform.python_version(), "machine": platform.machine(),
            "inputs": args.inputs, "hidden": args.hidden, "batch": args.batch, "lr": args.lr,
            "target_factor": TARGET_FACTOR,
            "meshes": {k: {"model_ranks": s.model_ranks, "param_bytes": s.param_bytes,
                           "sharded_bytes": s.sharded_bytes,
                           "shard_elements": s.shard_elements}
                       for k, s in setups.items()}}
    path = pathlib.Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "rows": rows, "exact": exact}, indent=1))
    print(f"wrote {path}")
  if args.check and missed:
    sys.exit(1)
  return rows


if __name__ == "__main__":
  main()
