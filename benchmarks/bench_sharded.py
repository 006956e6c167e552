"""Bytes and memory of the shard-local step against whole leaves, on a ("data", "model") mesh.

A tensor-parallel MLP (a column-parallel dense layer ``w1: [D, H]`` sharded
``P(None, "model")``, a row-parallel one ``w2: [H, D]`` sharded
``P("model", None)``, and a replicated bias ``b: [D]``) is trained by
``commopt.data_parallel(loss_fn, optax.chain(compressed_mean(c,
axis_name="data", strategy=s), optax.adam(lr)), mesh)`` for each compressor
``c`` and strategy ``s``, in three setups on the same mesh:

- ``local``: the shard-local step (``shard_local="auto"``): ``tx`` runs on
  each device's shard, so each device compresses and sends only its shard
  over the data axis, and residuals and Adam's moments are sharded like the
  parameters.
- ``whole``: ``shard_local=False``: ``tx`` runs on whole leaves, all-gathered
  over the model axis, so every model rank compresses and sends whole leaves.
- ``repl``: the same model with every parameter replicated (the memory
  baseline).

Each row reads the compiled step (the ``jax.jit`` of ``dp.step_fn`` that
``dp.step`` runs, lowered for ``dp.abstract_state(params)``):

1. data-axis bytes: what one device contributes per step to collectives whose
   replica groups are the data-axis groups (as ``commopt.wire`` counts
   ``contributed_bytes``), split into the sharded leaves (``w1``, ``w2``) and
   the rest (the bias, under ``min_size`` and so sent dense, and scalars);
   ``ratio`` is local / whole over the sharded leaves, ideally 1/M with M
   model ranks.
2. model-axis bytes added by the optimizer: the bytes of collectives over the
   model-axis groups, less those of the model's own forward and backward pass
   (measured once per mesh on the shard-local step of
   ``chain(compressed_mean(identity), sgd)``, which adds none); and the
   largest model-axis all-gather, in elements (a parameter-sized one means a
   whole leaf was gathered).
3. memory per device: ``argument_size_in_bytes + temp_size_in_bytes`` of the
   compiled step's ``memory_analysis()``, for local, whole and repl, and the
   ratios local / repl and whole / repl.

Combinations the library refuses (a ValueError) are listed as skipped with the
reason. A strategy whose programs are the ones another strategy compiled (e.g.
``gather`` where ``auto`` gathers) is measured once and marked ``= auto``.
``--check`` exits 1 when a row misses a target (:data:`TARGET_FACTOR`).

XLA:CPU aborts the process (``Invalid binary instruction opcode copy``, in its
``all-reduce-promotion`` pass) when it compiles a 16-bit float all-reduce
inside a ``shard_map`` that is manual over only some mesh axes, as the
replicated step on this mesh is: ``cast(bfloat16)`` with replicated
parameters. Every program whose lowered HLO holds a 16-bit float all-reduce
is therefore compiled with that pass disabled (memory marked ``*``; it
changes the shard-local ``cast`` step's memory by under 200 bytes), and its
bytes are read from the lowered HLO, as ``commopt.wire.hlo_collectives`` does
on CPU, where XLA widens such collectives to f32.

Runs on 8 simulated CPU devices.

    python benchmarks/bench_sharded.py                      # 2x4, every compressor (~3 min)
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
SAFE_OPTIONS = {"xla_disable_hlo_passes": "all-reduce-promotion"}
"""Compiler options for programs with a 16-bit float all-reduce (see the module docstring)."""


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


def axis_groups(mesh, axis):
  """The replica groups of collectives over ``axis``: a set of sorted tuples of device ids."""
  import numpy as np
  ids = np.vectorize(lambda d: d.id)(mesh.devices)
  moved = np.moveaxis(ids, mesh.axis_names.index(axis), -1).reshape(-1, mesh.shape[axis])
  return {tuple(sorted(int(i) for i in g)) for g in moved}


def on_groups(collective, groups) -> bool:
  """Whether every replica group of ``collective`` is one of ``groups``."""
  return bool(collective.replica_groups) and all(
      tuple(sorted(g)) in groups for g in collective.replica_groups)


def operand_bytes(collective):
  """``(shape, bytes)`` of each operand of ``collective`` (a combined collective has
  several), the bytes one device contributes, counted as ``commopt.wire`` counts
  ``contributed_bytes``."""
  n = max(collective.group_size, 1)
  out = []
  for dtype, shape in zip(collective.dtypes, collective.shapes):
    bits = 8 if dtype == "pred" else int("".join(ch for ch in dtype if ch.isdigit()))
    nbytes = -(-bits * math.prod(shape) // 8)
    nbytes = {"all-gather": nbytes // n, "reduce-scatter": nbytes * n}.get(collective.kind,
                                                                         nbytes)
    out.append((tuple(shape), nbytes))
  return out


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
    # The leaves every device holds whole (the bias) and scalars: their data-axis
    # collectives are not the sharded leaves'.
    self.replicated_shapes = {(), tuple(self.raw["b"].shape)}

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
    narrow_reduce = cpu and any(
        c.kind == "all-reduce" and set(c.dtypes) & set(NARROW_FLOATS) for c in before)
    compiled = lowered.compile(SAFE_OPTIONS if narrow_reduce else None)
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
          out["data_other" if shape in self.replicated_shapes else "data_sharded"] += nbytes
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
               safe_compile=bool(narrow_reduce),
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


EXACT = {
    "identity": ("compressors.identity()", "bit for bit"),
    "cast": ("cast(jnp.bfloat16)", "bit for bit"),
    "sign": ("sign()", "bit for bit"),
    "scaled_sign(block_size=64)": ("scaled_sign(block_size=64)", "bit for bit"),
    "int_quant(block_size=64, nearest)": (
        "int_quant(bits=8, block_size=64, rounding='nearest')", "bit for bit"),
    "top_k(leaf threshold)": ("top_k(0.01, shard_threshold='leaf', capacity={model})",
                              "bit for bit"),
    "power_sgd(rank=2)": ("power_sgd(rank=2)", "to rounding"),
}
"""The compressors docs/guide/sharded.md says equal the unsharded run: (commopt expression,
the promise)."""


def exact_rows(setup, steps):
  """``steps`` calls of ``compressed_mean(c, axis_name="data", min_size=0)`` on the same
  per-worker gradients of ``w1`` and ``w2``, each leaf sharded as the model shards it
  (``commopt.comm.model_sharding`` stated) and replicated, in a ``shard_map`` over the
  mesh: the largest difference of the means, against their largest magnitude."""
  import jax
  import jax.numpy as jnp  # noqa: F401  (the expressions' namespace)
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  import commopt
  names = ("w1", "w2")
  shapes = {k: tuple(setup.raw[k].shape) for k in names}
  keys = jax.random.split(jax.random.key(5), steps)
  grads = [{k: jax.random.normal(jax.random.fold_in(key, i), (2, *shapes[k]))
            for i, k in enumerate(names)} for key in keys]
  rows = []
  for label, (expr, promise) in EXACT.items():
    c = eval("commopt." + expr.format(model=setup.model_ranks))   # noqa: S307
    tx = commopt.compressed_mean(c, axis_name="data", min_size=0)
    out = {}
    for placement in ("sharded", "replicated"):
      specs = {k: setup.specs[placement][k] for k in names}

      def body(gs, specs=specs):
        with commopt.comm.model_sharding(specs, shapes, setup.mesh):
          state = tx.init(jax.tree.map(lambda g: g[0], gs[0]))
          means = []
          for g in gs:
            mean, state = tx.update(jax.tree.map(lambda x: x[0], g), state)
            means.append(mean)
        return means

      in_specs = [{k: P("data", *specs[k]) for k in names}] * steps
      fn = jax.jit(jax.shard_map(body, mesh=setup.mesh, in_specs=(in_specs,),
                                 out_specs=[specs] * steps))
      placed = [{k: jax.device_put(g[k], NamedSharding(setup.mesh, in_specs[0][k]))
                 for k in names} for g in grads]
      out[placement] = jax.device_get(fn(placed))
    diff = max(float(np.max(np.abs(a[k] - b[k])))
               for a, b in zip(out["sharded"], out["replicated"]) for k in names)
    scale = max(float(np.max(np.abs(b[k]))) for b in out["replicated"] for k in names)
    ok = diff == 0 if promise == "bit for bit" else diff <= 1e-5 * scale
    rows.append({"compressor": label, "promise": promise, "max_diff": diff, "scale": scale,
                 "kept": bool(ok)})
    print(f"[exact] {label}: max |sharded - replicated| {diff:.2e} of means up to {scale:.2e} "
          f"({promise}: {'kept' if ok else 'MISSED'})", flush=True)
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
    star = lambda m: "*" if m["safe_compile"] else ""
    fell_back = "" if loc["layout"] == "shard_local" else " (whole leaves!)"
    lines.append(
        f"{head} {kib(loc['data_sharded'])}{fell_back} | {kib(who['data_sharded'])} | "
        f"{r['data_ratio']:.3f} | {kib(loc['data_other'])} / {kib(who['data_other'])} | "
        f"{kib(loc['model_added'])} / {kib(who['model_added'])} | "
        f"{loc['model_gather_max']} / {who['model_gather_max']} | "
        f"{mib(loc['memory'])}{star(loc)} | {mib(who['memory'])}{star(who)} | "
        f"{mib(rep['memory'])}{star(rep)} | {r['memory_ratio']:.3f} | "
        f"{r['whole_memory_ratio']:.3f}{' **missed**' if r['missed'] else ''} |")
  return "\n".join(lines)


LEGEND = (
    "data KiB: bytes one device contributes per step to data-axis collectives for the "
    "sharded leaves w1, w2 (local: shard-local step; whole: shard_local=False); local/whole "
    "is their ratio. data KiB rest: the same for the dense bias and scalars. model KiB added: "
    "model-axis bytes beyond the forward and backward pass's own. model gather max: the "
    "largest model-axis all-gather, in elements. MiB: argument + temp bytes per device "
    "(repl: the same model with replicated parameters); * compiled without XLA:CPU's "
    "all-reduce promotion (see the module docstring). (= auto): the same programs as auto.")


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
    print("\n| compressor | promise | max abs diff, sharded vs replicated | largest mean | kept |\n"
          "|---|---|---|---|---|")
    for r in exact:
      print(f"| {r['compressor']} | {r['promise']} | {r['max_diff']:.2e} | {r['scale']:.2e} | "
            f"{'yes' if r['kept'] else '**no**'} |")
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
