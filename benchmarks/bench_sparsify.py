"""Top-k selection time on CPU: exact, approximate, sampled threshold, and torch.topk.

For each size and density it times selecting the ``k = ⌈density · size⌉``
largest magnitudes of a float32 vector (the indices, ``|x|`` included) with

- ``lax.top_k``: exact, what ``commopt.top_k()`` runs;
- ``approx_max_k``: ``jax.lax.approx_max_k`` (``top_k(approx=True)``);
- ``sampled``: DGC's threshold from a 1% sample, then the first k coordinates
  above it into k slots (``top_k(method="sample")``);
- ``torch.topk``: PyTorch on CPU, the peer (skipped with a note when torch is
  not installed; it is not a dependency of commopt).

Times are medians over ``--repeats`` runs after a warm-up; ratios are against
``lax.top_k`` at the same size and density. The table is printed and written
to ``--out``/sparsify.json.

    python benchmarks/bench_sparsify.py [--sizes 1M,16M] [--densities 0.01,0.001] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import platform
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness.timing import median_seconds  # noqa: E402  (after the path)


def parse_size(text: str) -> int:
  text = text.strip().upper()
  scale = {"K": 2**10, "M": 2**20}.get(text[-1:], 1)
  return int(float(text.rstrip("KM")) * scale)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--sizes", default="1M,16M", help="comma-separated, with K/M suffixes")
  p.add_argument("--densities", default="0.01,0.001")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--sample-ratio", type=float, default=0.01)
  p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
  args = p.parse_args(argv)
  if args.repeats < 1:
    p.error(f"--repeats must be >= 1, got {args.repeats}")

  import jax
  import jax.numpy as jnp
  import numpy as np

  from commopt.compressors._sparse import first_true, sampled_threshold

  try:
    import torch
    torch_note = f"torch {torch.__version__}, {torch.get_num_threads()} threads"
  except ImportError:
    torch = None
    torch_note = "torch not installed: torch.topk skipped (pip install torch to compare)"

  def jax_methods(k, sample_ratio):
    def exact(x, key):
      return jax.lax.top_k(jnp.abs(x), k)[1]

    def approx(x, key):
      return jax.lax.approx_max_k(jnp.abs(x), k)[1]

    def sampled(x, key):
      magnitude = jnp.abs(x)
      threshold = sampled_threshold(magnitude, k / x.size, key, sample_ratio)
      return first_true((magnitude >= threshold) & (magnitude > 0), k)

    return {"lax.top_k": exact, "approx_max_k": approx, "sampled": sampled}

  rows = []
  for size in [parse_size(s) for s in args.sizes.split(",")]:
    x_np = np.random.default_rng(0).normal(size=size).astype(np.float32)
    x = jnp.asarray(x_np)
    key = jax.random.PRNGKey(0)
    for density in [float(d) for d in args.densities.split(",")]:
      k = math.ceil(density * size)
      exact_set = None
      for name, fn in jax_methods(k, args.sample_ratio).items():
        jitted = jax.jit(fn)
        seconds = median_seconds(lambda: jitted(x, key).block_until_ready(), args.repeats)
        idx = np.asarray(jitted(x, key))
        idx = idx[idx < size]
        if exact_set is None:
          exact_set = set(idx.tolist())
        recall = len(exact_set & set(idx.tolist())) / k
        rows.append({"size": size, "density": density, "k": k, "method": name,
                     "ms": 1e3 * seconds, "recall": recall, "filled": len(idx) / k})
        print(f"measured {name} size={size} density={density}: {1e3 * seconds:.1f} ms",
              flush=True)
      if torch is not None:
        xt = torch.from_numpy(x_np)
        seconds = median_seconds(lambda: xt.abs().topk(k, sorted=False), args.repeats)
        idx = xt.abs().topk(k, sorted=False).indices.numpy()
        rows.append({"size": size, "density": density, "k": k, "method": "torch.topk",
                     "ms": 1e3 * seconds, "recall": len(exact_set & set(idx.tolist())) / k,
                     "filled": 1.0})

  for r in rows:
    base = next(b for b in rows if b["size"] == r["size"] and b["density"] == r["density"]
                and b["method"] == "lax.top_k")
    r["vs_lax_top_k"] = r["ms"] / base["ms"]

  info = {"jax": jax.__version__, "backend": jax.default_backend(),
          "devices": str(jax.devices()[0]), "cpu": platform.processor() or platform.machine(),
          "cores": __import__("os").cpu_count(), "torch": torch_note,
          "repeats": args.repeats, "sample_ratio": args.sample_ratio}
  print(f"\nTop-k selection on {info['backend']} ({info['cores']} cores, jax {info['jax']}; "
        f"{torch_note}); median of {args.repeats}, time relative to lax.top_k")
  print(f"{'size':>10} {'density':>8} {'k':>8} {'method':>13} {'ms':>9} {'vs top_k':>9} "
        f"{'recall':>7} {'filled':>7}")
  for r in rows:
    print(f"{r['size']:>10,} {r['density']:>8g} {r['k']:>8,} {r['method']:>13} "
          f"{r['ms']:>9.1f} {r['vs_lax_top_k']:>8.2f}x {r['recall']:>7.3f} {r['filled']:>7.3f}")
  print("recall: the share of lax.top_k's indices found; filled: the share of the k slots used")

  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "sparsify.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))
  print(f"wrote {out / 'sparsify.json'}")
  return rows


if __name__ == "__main__":
  main()
