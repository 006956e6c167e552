"""ZeRO-3 data parallelism: bytes on the wire, memory and convergence, dense against
quantized weights (qwZ) and gradients (qgZ), side by side in one run.

An MLP regression (``--width`` hidden units, three layers, a fixed teacher) is trained by
``commopt.zero_data_parallel(loss_fn, optax.adam(lr), mesh, weights=..., grads=...)`` on
``--workers`` simulated CPU devices, in four setups:

- ``dense``: float32 all-gather of the weights, float32 reduce-scatter of the gradients;
- ``qwZ``: the weights gathered as ``int_quant(bits=8, block_size=2048, nearest)``
  payloads (uint32 words), the gradients dense;
- ``qgZ``: the gradients as ``int_quant(bits=4, block_size=2048, nearest)`` chunks in one
  all-to-all, summed in float32 by their owner; the weights dense;
- ``qwZ+qgZ``: both.

Each row reads the compiled step: the bytes one device sends per step in each kind of
collective (``commopt.wire.parse_hlo``'s ``sent_bytes``, a ring / pairwise model: an
all-gather or reduce-scatter sends ``(N-1)/N`` of the whole leaf, an all-to-all ``(N-1)/N``
of its input), their total and the reduction against dense; ``memory_analysis()``'s argument and temporary bytes per device, against the
replicated ``data_parallel`` step (identity ``compressed_mean`` + the same adam) of the same
model; the median step time (CPU, informative only); and the mean loss of the last 20 of
``--steps`` steps, against dense's. DeepSpeed's ZeRO++ states 4x less cross-node traffic
(3M to 0.75M in fp16 with hpZ); here the weights are float32 and gathered once per step
(autodiff keeps them for the backward pass; no second gather), so dense moves 2M.

The second section (``--section nodes``) is ZeRO++'s setting: the devices as ``--nodes``
nodes of ``workers/nodes`` devices (mesh axes ``("node", "local")``), a residual MLP of
``--layers`` stacked layers sharded layer by layer, the loss gathering one layer at a time
in a rematerialised ``lax.scan`` (``gather="manual"``: each layer gathered in the forward
pass and again in the backward, as ZeRO-3 does), in five setups: dense; qwZ; qwZ + qgZ
(the gradient reduce-scattered inside the node, then across, ``hierarchical=True``); hpZ
alone; and all three. Each row gives the bytes one device sends per step across nodes,
in two models (direct: a collective's bytes times the share of its peers on other nodes;
ring: the collective's ring, devices ordered by node, crosses on one link per node
spanned, so a device's bytes count times nodes/group size) beside its total, the
reduction of the cross-node bytes against dense (DeepSpeed states 4x for ZeRO++ in fp16:
3M to 0.75M), the temporaries per device (hpZ keeps each layer's secondary partition,
``1/L`` of the stack for ``L`` devices per node) and the loss.

The third section (``--section feedback``) is the error-feedback trade on the first
section's model and mesh: the gradient chunks through a quantizer that needs no memory
(int4, nearest), and through two biased compressors (``scaled_sign()``, ``top_k(1%)``)
without a memory, with a float32 worker-side memory and with a bfloat16 one
(``error_feedback=True, residual_dtype=...``), under momentum SGD (``--momentum-lr``,
momentum 0.9) and under adam. Each row gives the arguments per device (parameters, the
optimizer's state and the memories), the gradient bytes sent per step and the loss
against dense ZeRO-3's under the same optimizer.

The fourth section (``--section tp``) is ZeRO beside tensor parallelism on the first
section's model: the first layer column-parallel, the second row-parallel (Megatron's
pair), the last replicated, on meshes of ``(data, model)`` = ``(W, 1)`` (ZeRO alone),
``(W/2, 2)`` and ``(W/4, 4)``, dense and qwZ+qgZ. Each row gives the bytes one device sends
per step over the data axis and over the model axis (from the replica groups of the
compiled step's collectives), the arguments per device against one device's share of the
replicated step's (``1/W``), and the loss against ZeRO alone's.

``--check`` exits 1 when ``qwZ+qgZ`` moves less than 4x fewer bytes than dense, its loss
ends above 1.2x dense's, the sharded arguments exceed 1.1x one worker's share, or (nodes)
all three cut the cross-node bytes less than 4x or end above 1.2x dense's loss.

    python benchmarks/bench_zero.py                  # ~4 min on 2 cores
    python benchmarks/bench_zero.py --width 256 --steps 100 --check
    python benchmarks/bench_zero.py --section nodes --nodes 2 --layers 6
    python benchmarks/bench_zero.py --section feedback
    python benchmarks/bench_zero.py --section tp
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness.hlo import sent_bytes  # noqa: E402  (after the path)
from harness.models import problem, quantizer, stacked_problem  # noqa: E402
from harness.summary import markdown_table  # noqa: E402


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workers", type=int, default=8)
  p.add_argument("--width", type=int, default=512)
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--momentum-lr", type=float, default=0.05,
                 help="the feedback section's momentum SGD (momentum 0.9)")
  p.add_argument("--section", choices=("all", "flat", "nodes", "feedback", "tp"), default="all")
  p.add_argument("--nodes", type=int, default=2)
  p.add_argument("--layers", type=int, default=6)
  p.add_argument("--check", action="store_true")
  p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "zero.json"))
  return p.parse_args(argv)


def _measure(zp, params, batch, steps, stacked=None, local=None, specs=None):
  """One setup's row: bytes by kind from the compiled step (and across nodes, when
  ``local`` devices make a node; by mesh axis), memory per device, step time and losses."""
  import jax
  import numpy as np
  sharded = zp.shard(params, stacked=stacked, specs=specs)
  state = zp.init(sharded)
  compiled = zp.lower(sharded, state, batch(0)).compile()
  by_kind, by_axis, direct, ring = sent_bytes(compiled.as_text(), zp.mesh, local)
  memory = compiled.memory_analysis()
  losses, times = [], []
  for step in range(steps):
    b = batch(step)
    t0 = time.perf_counter()
    sharded, state, l = zp.step(sharded, state, b)
    l = jax.block_until_ready(l)
    times.append(time.perf_counter() - t0)
    losses.append(float(np.mean(l)))
  batch_bytes = sum(v.nbytes for v in batch(0).values()) // zp.workers
  row = {"bytes": by_kind, "total_bytes": sum(by_kind.values()), "bytes_by_axis": by_axis,
         "args_bytes": memory.argument_size_in_bytes - batch_bytes,
         "temp_bytes": memory.temp_size_in_bytes,
         "ms_per_step": 1e3 * statistics.median(times[2:]),
         "first_loss": losses[0], "tail_loss": float(np.mean(losses[-20:]))}
  if local is not None:
    row["cross_node_bytes"] = int(round(direct))
    row["cross_node_bytes_ring"] = int(round(ring))
  return row


def run(args):
  import jax
  jax.config.update("jax_num_cpu_devices", args.workers)
  import optax
  import commopt

  mesh = jax.make_mesh((args.workers,), ("data",))
  params, loss_fn, batch = problem(args.width)
  n = sum(x.size for x in jax.tree.leaves(params))
  q8, q4 = quantizer(8), quantizer(4)
  setups = {"dense": (None, None), "qwZ": (q8, None), "qgZ": (None, q4), "qwZ+qgZ": (q8, q4)}

  dp = commopt.data_parallel(loss_fn, optax.chain(commopt.compressed_mean(
      commopt.compressors.make("identity"), axis_name="data"), optax.adam(args.lr)), mesh)
  rep = dp.lower(params, dp.init(params), dp.place_batch(batch(0))).compile().memory_analysis()
  batch_bytes = sum(v.nbytes for v in batch(0).values()) // args.workers
  rep_args = rep.argument_size_in_bytes - batch_bytes
  rep_temp = rep.temp_size_in_bytes

  rows = []
  for name, (w, g) in setups.items():
    zp = commopt.zero_data_parallel(loss_fn, optax.adam(args.lr), mesh, weights=w, grads=g)
    rows.append({"setup": name, "params": n, **_measure(zp, params, batch, args.steps),
                 "replicated_args_bytes": rep_args, "replicated_temp_bytes": rep_temp})
  dense = rows[0]
  for r in rows:
    r["reduction"] = dense["total_bytes"] / r["total_bytes"]
    r["loss_vs_dense"] = r["tail_loss"] / dense["tail_loss"]
    r["args_vs_share"] = r["args_bytes"] / (rep_args / args.workers)
  return rows


def run_feedback(args):
  """The error-feedback section: memory, gradient bytes and loss, with and without
  worker-side memories."""
  import jax
  jax.config.update("jax_num_cpu_devices", args.workers)
  import jax.numpy as jnp
  import optax
  import commopt

  mesh = jax.make_mesh((args.workers,), ("data",))
  params, loss_fn, batch = problem(args.width)
  n = sum(x.size for x in jax.tree.leaves(params))
  q4 = quantizer(4)
  memories = {"none": {}, "float32": {"error_feedback": True},
              "bfloat16": {"error_feedback": True, "residual_dtype": jnp.bfloat16}}
  setups = [("dense", None, "none"), ("int4", q4, "none")]
  for c in (commopt.scaled_sign(), commopt.top_k(0.01)):
    setups += [(c.name, c, m) for m in memories]
  optimizers = {"momentum": lambda: optax.sgd(args.momentum_lr, momentum=0.9),
                "adam": lambda: optax.adam(args.lr)}
  rows = []
  for tx_name, tx in optimizers.items():
    dense = None
    for name, grads, memory in setups:
      zp = commopt.zero_data_parallel(loss_fn, tx(), mesh, grads=grads, **memories[memory])
      row = _measure(zp, params, batch, args.steps)
      row["gradient_bytes"] = sum(v for k, v in row["bytes"].items()
                                  if k in ("all-to-all", "reduce-scatter"))
      row = {"tx": tx_name, "setup": name, "memory": memory, "params": n, **row}
      dense = dense or row
      row["args_vs_dense"] = row["args_bytes"] / dense["args_bytes"]
      row["loss_vs_dense"] = row["tail_loss"] / dense["tail_loss"]
      rows.append(row)
  return rows


def feedback_table(rows):
  head = ["optimizer", "gradients", "memory", "args B per device", "÷ no memory", "gradient B sent",
          "tail loss", "loss ÷ dense"]
  return markdown_table(head, [[
      r["tx"], r["setup"], r["memory"], f"{r['args_bytes']:,}", f"{r['args_vs_dense']:.2f}x",
      f"{r['gradient_bytes']:,}", f"{r['tail_loss']:.4f}", f"{r['loss_vs_dense']:.3f}"]
      for r in rows])


def run_nodes(args):
  """The ``("node", "local")`` section: dense, qwZ, qwZ+qgZ, hpZ and all three, with the
  bytes that cross nodes."""
  import jax
  jax.config.update("jax_num_cpu_devices", args.workers)
  import optax
  import commopt

  if args.workers % args.nodes or args.nodes < 2 or args.workers == args.nodes:
    raise SystemExit(f"--nodes={args.nodes} must divide --workers={args.workers} into at "
                     "least two nodes of at least two devices")
  local = args.workers // args.nodes
  mesh = jax.make_mesh((args.nodes, local), ("node", "local"))
  params, loss_fn, batch = stacked_problem(args.width, args.layers)
  n = sum(x.size for x in jax.tree.leaves(params))
  q8, q4 = quantizer(8), quantizer(4)
  setups = {"dense": {}, "qwZ": {"weights": q8},
            "qwZ+qgZ": {"weights": q8, "grads": q4, "hierarchical": True},
            "hpZ": {"hpz": True},
            "qwZ+qgZ+hpZ": {"weights": q8, "grads": q4, "hierarchical": True, "hpz": True}}
  rows = []
  for name, kw in setups.items():
    zp = commopt.zero_data_parallel(loss_fn, optax.adam(args.lr), mesh,
                                    axis_name=("node", "local"), gather="manual", **kw)
    rows.append({"setup": name, "params": n, "nodes": args.nodes, "local": local,
                 **_measure(zp, params, batch, args.steps,
                            stacked={"embed": False, "layers": True, "head": False},
                            local=local)})
  dense = rows[0]
  for r in rows:
    r["cross_reduction"] = dense["cross_node_bytes"] / r["cross_node_bytes"]
    r["cross_reduction_ring"] = dense["cross_node_bytes_ring"] / r["cross_node_bytes_ring"]
    r["loss_vs_dense"] = r["tail_loss"] / dense["tail_loss"]
    r["temp_vs_dense"] = r["temp_bytes"] - dense["temp_bytes"]
  return rows


def run_tp(args):
  """The tensor-parallel section: ZeRO over the data axis beside a model axis of 1, 2, 4."""
  import jax
  jax.config.update("jax_num_cpu_devices", args.workers)
  import optax
  from jax.sharding import PartitionSpec as P
  import commopt

  params, loss_fn, batch = problem(args.width)
  n = sum(x.size for x in jax.tree.leaves(params))
  specs = {"w0": P(None, "model"), "b0": P("model"), "w1": P("model", None), "b1": None,
           "w2": None, "b2": None}
  q8, q4 = quantizer(8), quantizer(4)
  rep_args = 4 * 3 * n          # parameters and adam's two moments, float32, replicated
  rows, base = [], {}
  for model in (1, 2, 4):
    if args.workers % model or args.width % model:
      continue
    mesh = jax.make_mesh((args.workers // model, model), ("data", "model"))
    for name, (w, g) in {"dense": (None, None), "qwZ+qgZ": (q8, q4)}.items():
      zp = commopt.zero_data_parallel(loss_fn, optax.adam(args.lr), mesh, weights=w, grads=g)
      row = _measure(zp, params, batch, args.steps, specs=specs if model > 1 else None)
      row = {"setup": name, "data": args.workers // model, "model": model, "params": n, **row}
      row["data_bytes"] = row["bytes_by_axis"].get("data", 0)
      row["model_bytes"] = row["bytes_by_axis"].get("model", 0)
      row["args_vs_share"] = row["args_bytes"] / (rep_args / args.workers)
      base.setdefault(name, row)
      row["data_bytes_vs_zero"] = base[name]["data_bytes"] / row["data_bytes"]
      row["loss_vs_zero"] = row["tail_loss"] / base["dense"]["tail_loss"]
      rows.append(row)
  return rows


def tp_table(rows):
  head = ["mesh (data x model)", "setup", "data-axis B", "÷ ZeRO alone", "model-axis B",
          "args B (÷ repl/W)", "temp B", "ms/step", "tail loss", "loss ÷ ZeRO dense"]
  return markdown_table(head, [[
      f"{r['data']} x {r['model']}", r["setup"], f"{r['data_bytes']:,}",
      f"{r['data_bytes_vs_zero']:.2f}x fewer", f"{r['model_bytes']:,}",
      f"{r['args_bytes']:,} ({r['args_vs_share']:.2f})", f"{r['temp_bytes']:,}",
      f"{r['ms_per_step']:.1f}", f"{r['tail_loss']:.4f}", f"{r['loss_vs_zero']:.3f}"]
      for r in rows]) + (
      f"\n\n{rows[0]['params']:,} parameters; bytes one device sends per step, by the "
      "mesh axis its collective spans; arguments: parameters and adam's state.")


def nodes_table(rows):
  head = ["setup", "across nodes B (direct)", "÷ dense", "across nodes B (ring)", "÷ dense",
          "total B", "args B", "temp B", "temp − dense B", "ms/step", "tail loss",
          "loss ÷ dense"]
  cells = [[r["setup"], f"{r['cross_node_bytes']:,}", f"{r['cross_reduction']:.2f}x fewer",
            f"{r['cross_node_bytes_ring']:,}", f"{r['cross_reduction_ring']:.2f}x fewer",
            f"{r['total_bytes']:,}", f"{r['args_bytes']:,}",
            f"{r['temp_bytes']:,}", f"{r['temp_vs_dense']:+,}", f"{r['ms_per_step']:.1f}",
            f"{r['tail_loss']:.4f}", f"{r['loss_vs_dense']:.3f}"] for r in rows]
  r = rows[0]
  return markdown_table(head, cells) + (
      f"\n\n{r['params']:,} parameters, {r['nodes']} nodes of {r['local']} devices; "
      "bytes one device sends per step (mean over devices). Across nodes, direct: "
      "each peer sent its share itself, the shares to other nodes counted; ring: a "
      "collective's ring, its devices ordered by node, crosses on one link per node.")


def table(rows, workers):
  kinds = sorted({k for r in rows for k in r["bytes"]})
  head = (["setup"] + [f"{k} B" for k in kinds] +
          ["total B", "vs dense", "args B (÷ repl/N)", "temp B", "ms/step", "tail loss",
           "loss ÷ dense"])
  cells = [[r["setup"]] + [f"{r['bytes'].get(k, 0):,}" for k in kinds] +
           [f"{r['total_bytes']:,}", f"{r['reduction']:.2f}x",
            f"{r['args_bytes']:,} ({r['args_vs_share']:.2f})", f"{r['temp_bytes']:,}",
            f"{r['ms_per_step']:.1f}", f"{r['tail_loss']:.4f}", f"{r['loss_vs_dense']:.3f}"]
           for r in rows]
  rep = rows[0]["replicated_args_bytes"]
  return markdown_table(head, cells) + (
      f"\n\n{rows[0]['params']:,} parameters, {workers} workers; the replicated "
      f"data_parallel step (identity compressed_mean + adam): arguments {rep:,} B, "
      f"temporaries {rows[0]['replicated_temp_bytes']:,} B per device.")


def misses(rows, nodes_rows=(), tp_rows=()):
  out = []
  for r in tp_rows:
    if r["model"] > 1 and r["data_bytes_vs_zero"] < r["model"] * 0.9:
      out.append(f"{r['data']} x {r['model']} {r['setup']}: {r['data_bytes_vs_zero']:.2f}x "
                 f"fewer data-axis bytes than ZeRO alone (target >= 0.9 x {r['model']})")
    if r["loss_vs_zero"] > 1.2:
      out.append(f"{r['data']} x {r['model']} {r['setup']}: loss {r['loss_vs_zero']:.3f}x "
                 "ZeRO alone's dense (target <= 1.2x)")
  if rows:
    both = next(r for r in rows if r["setup"] == "qwZ+qgZ")
    if both["reduction"] < 4.0:
      out.append(f"qwZ+qgZ moves {both['reduction']:.2f}x fewer bytes than dense (target >= 4x)")
    if both["loss_vs_dense"] > 1.2:
      out.append(f"qwZ+qgZ ends at {both['loss_vs_dense']:.3f}x dense's loss (target <= 1.2x)")
    for r in rows:
      if r["args_vs_share"] > 1.1:
        out.append(f"{r['setup']}: arguments {r['args_vs_share']:.2f}x one worker's share "
                   "(target <= 1.1x)")
  for r in nodes_rows:
    worst = min(r.get("cross_reduction", 0), r.get("cross_reduction_ring", 0))
    if r["setup"] == "qwZ+qgZ+hpZ" and worst < 4.0:
      out.append(f"qwZ+qgZ+hpZ sends {worst:.2f}x fewer bytes across nodes than dense "
                 "(target >= 4x)")
    if r["setup"] == "qwZ+qgZ+hpZ" and r["loss_vs_dense"] > 1.2:
      out.append(f"qwZ+qgZ+hpZ ends at {r['loss_vs_dense']:.3f}x dense's loss (target <= 1.2x)")
  return out


def main(argv=None):
  args = parse_args(argv)
  rows = run(args) if args.section in ("all", "flat") else []
  nodes_rows = run_nodes(args) if args.section in ("all", "nodes") else []
  feedback_rows = run_feedback(args) if args.section in ("all", "feedback") else []
  tp_rows = run_tp(args) if args.section in ("all", "tp") else []
  if rows:
    print(table(rows, args.workers))
  if nodes_rows:
    print(nodes_table(nodes_rows))
  if feedback_rows:
    print(feedback_table(feedback_rows))
  if tp_rows:
    print(tp_table(tp_rows))
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"args": vars(args), "rows": rows, "nodes": nodes_rows,
                                 "feedback": feedback_rows, "tp": tp_rows}, indent=1))
  print(f"wrote {out}")
  missed = misses(rows, nodes_rows, tp_rows)
  for m in missed:
    print("MISSED:", m)
  return 1 if (args.check and missed) else 0


if __name__ == "__main__":
  raise SystemExit(main())
