"""Sharded = unsharded: every compressor ``docs/guide/sharded.md`` calls exact on a shard.

Each one's ``compressed_mean(c, axis_name="data", min_size=0)`` runs ``--steps`` times on
the same per-worker gradients of ``bench_sharded.py``'s MLP (``w1: [D, H]`` sharded
``P(None, "model")``, ``w2: [H, D]`` sharded ``P("model", None)``), once with each leaf
sharded as the model shards it (``commopt.comm.model_sharding`` stated) and once
replicated, in a ``shard_map`` over the same ("data", "model") mesh; the table gives the
largest difference of the means against their largest magnitude. ``bench_sharded.py``
prints it after its own tables.

    python benchmarks/bench_sharded_exact.py            # 2x4, D=256, H=2048, 3 steps
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness.summary import markdown_table  # noqa: E402  (after the path)

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
  import jax.numpy as jnp
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
    c = eval("commopt." + expr.format(model=setup.model_ranks),   # noqa: S307
             {"commopt": commopt, "jnp": jnp})
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


def exact_table(rows) -> str:
  """The Markdown table of :func:`exact_rows`'s rows."""
  return markdown_table(
      ("compressor", "promise", "max abs diff, sharded vs replicated", "largest mean", "kept"),
      [(r["compressor"], r["promise"], f"{r['max_diff']:.2e}", f"{r['scale']:.2e}",
        "yes" if r["kept"] else "**no**") for r in rows])


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--inputs", type=int, default=256, help="D")
  p.add_argument("--hidden", type=int, default=2048, help="H, a multiple of 4")
  p.add_argument("--steps", type=int, default=3, help="calls of the exchange")
  args = p.parse_args(argv)
  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  from bench_sharded import Setup
  rows = exact_rows(Setup(2, 4, args.inputs, args.hidden, 32), args.steps)
  print(exact_table(rows))
  if not all(r["kept"] for r in rows):
    sys.exit(1)
  return rows


if __name__ == "__main__":
  main()
