"""Optimizer-state memory per worker, for every compressor and reduction strategy.

For each registered compressor and each strategy (auto, two_phase,
hierarchical, and hierarchical+two_phase: inner_strategy="two_phase") it
builds ``optax.chain(compressed_mean(c, axis_name=axis, error_feedback=True,
strategy=s), optax.sgd(lr, momentum=0.9))`` for an MLP and measures the bytes
of optimizer state that one device holds, summed over the actual arrays
(``leaf.addressable_shards[0].data.nbytes``), as a multiple of the
parameters' bytes. Two states are measured: the one
``commopt.data_parallel(...).init(params)`` returns (dp) and the one
``commopt.testing.shard_map_workers(...).init(params)`` returns (workers);
both run ``tx.init`` inside their shard_map. The residual and server columns
break the workers state down: the error-feedback residual and the second
(server) memory of two_phase. Pairs a compressor refuses (a ValueError) are
skipped with a printed line.

Runs on 8 simulated CPU devices: a 1-D mesh ("data",) of 8 for auto and
two_phase, a 2x4 ("node", "local") mesh for hierarchical.

    python benchmarks/bench_state.py [--compressors all] [--strategies auto,two_phase,...]
    python benchmarks/bench_state.py --inputs 64 --hidden 32 --classes 4 --out /tmp/state
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform

ROOT = pathlib.Path(__file__).resolve().parents[1]


def shard_bytes(tree) -> int:
  """Bytes of ``tree``'s arrays held by one device (the first shard of each)."""
  import jax
  return sum(int(leaf.addressable_shards[0].data.nbytes) for leaf in jax.tree.leaves(tree))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--nodes", type=int, default=2,
                 help="nodes of the hierarchical mesh (8 devices: nodes x 8/nodes)")
  p.add_argument("--inputs", type=int, default=1024)
  p.add_argument("--hidden", type=int, default=512)
  p.add_argument("--classes", type=int, default=10)
  p.add_argument("--compressors", default="all", help="comma-separated names, or all")
  p.add_argument("--strategies", default="auto,two_phase,hierarchical,hierarchical+two_phase",
                 help="comma-separated; hierarchical+two_phase sets inner_strategy")
  p.add_argument("--lr", type=float, default=0.05)
  p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
  args = p.parse_args(argv)

  import jax
  workers = 8
  jax.config.update("jax_num_cpu_devices", workers)
  import jax.numpy as jnp
  import optax

  import commopt

  if workers % args.nodes:
    p.error(f"--nodes must divide {workers}, got {args.nodes}")
  devices = jax.devices()[:workers]
  flat = ("data", jax.make_mesh((workers,), ("data",), devices=devices))
  two_d = (("node", "local"),
           jax.make_mesh((args.nodes, workers // args.nodes), ("node", "local"), devices=devices))

  params = {"w1": jnp.zeros((args.inputs, args.hidden)), "b1": jnp.zeros((args.hidden,)),
            "w2": jnp.zeros((args.hidden, args.classes)), "b2": jnp.zeros((args.classes,))}
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))

  def loss_fn(p_, batch):
    h = jax.nn.relu(batch["x"] @ p_["w1"] + p_["b1"])
    return optax.softmax_cross_entropy_with_integer_labels(
        h @ p_["w2"] + p_["b2"], batch["y"]).mean()

  def memories(state):
    """(residual bytes, server bytes) of the compressed_mean state inside ``state``."""
    is_cm = lambda x: isinstance(x, commopt.transforms.CompressedMeanState)
    cm = [s for s in jax.tree.leaves(state, is_leaf=is_cm) if is_cm(s)]
    return shard_bytes([s.residual for s in cm]), shard_bytes([s.server_residual for s in cm])

  names = (sorted(commopt.compressors.REGISTRY) if args.compressors == "all"
           else args.compressors.split(","))
  rows = []
  for name in names:
    compressor = commopt.compressors.make(name)
    for label in args.strategies.split(","):
      strategy, _, inner = label.partition("+")
      axis, mesh = two_d if strategy == "hierarchical" else flat
      try:
        reduce = commopt.compressed_mean(compressor, axis_name=axis, error_feedback=True,
                                         strategy=strategy, inner_strategy=inner or "auto")
      except ValueError as e:
        print(f"skipped {compressor.name} with strategy={label!r}: {e}")
        continue
      tx = optax.chain(reduce, optax.sgd(args.lr, momentum=0.9))
      dp_state = commopt.data_parallel(loss_fn, tx, mesh, axis).init(params)
      w_state = commopt.testing.shard_map_workers(tx, mesh, axis).init(params)
      residual, server = memories(w_state)
      rows.append({"compressor": compressor.name, "strategy": label,
                   "mesh": "x".join(str(s) for s in mesh.devices.shape),
                   "param_bytes": param_bytes, "dp_bytes": shard_bytes(dp_state),
                   "workers_bytes": shard_bytes(w_state), "residual_bytes": residual,
                   "server_bytes": server})
      r = rows[-1]
      for k in ("dp", "workers", "residual", "server"):
        r[f"{k}_ratio"] = r[f"{k}_bytes"] / param_bytes
      print(f"measured {compressor.name} [{label}]: {r['workers_ratio']:.3f}x parameters",
            flush=True)

  print(f"\nMLP {args.inputs}x{args.hidden}x{args.classes} ({param_bytes / 1e6:.2f} MB of "
        f"parameters), {workers} {jax.default_backend()} devices; optimizer state held by "
        "one device, as a multiple of the parameters' bytes")
  width = max([20] + [len(r["compressor"]) for r in rows])
  swidth = max([12] + [len(r["strategy"]) for r in rows])
  print(f"{'compressor':>{width}} {'strategy':>{swidth}} {'mesh':>5} {'dp':>7} {'workers':>8} "
        f"{'residual':>9} {'server':>7}")
  for r in rows:
    print(f"{r['compressor']:>{width}} {r['strategy']:>{swidth}} {r['mesh']:>5} "
          f"{r['dp_ratio']:7.3f} {r['workers_ratio']:8.3f} {r['residual_ratio']:9.3f} "
          f"{r['server_ratio']:7.3f}")
  print("(dp: commopt.data_parallel(...).init; workers: commopt.testing.shard_map_workers"
        "(...).init; residual and server: the error memories inside the workers state; the "
        "rest is SGD's momentum, 1x, compressor state (adacomp, power_sgd, random_k) and "
        "counters.)")
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  meta = {"backend": jax.default_backend(), "workers": workers, "nodes": args.nodes,
          "jax": jax.__version__, "machine": platform.machine(),
          "params": {k: list(v.shape) for k, v in params.items()}}
  (out / "state.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
  print(f"wrote {out / 'state.json'}")
  return rows


if __name__ == "__main__":
  main()
