"""Encode + decode throughput of the quantisation compressors, against copy and peers.

One run measures, side by side on the same input (float32, one device):

- every quantisation compressor's jitted ``decode(encode(x))``;
- the memory floor: a jitted one-pass read-and-write of the input (``-x``)
  and numpy's ``np.copy``;
- peers where they install: numpy ``packbits`` sign compression (scale +
  packed signs, then ``unpackbits``) beside ``scaled_sign``, and a torch CPU
  QSGD / TernGrad stochastic quantiser (levels kept as int8, not bit-packed,
  so it does less work than commopt's packed payload) beside ``qsgd`` and
  ``terngrad``.

It prints the median time, the input GB/s, the time over the XLA copy's and,
for a compressor with a peer, the time over the peer's. The table is written
to ``benchmarks/results/quantize.json``.

    python benchmarks/bench_quantize.py                      # 1M and 16M elements
    python benchmarks/bench_quantize.py --sizes 1000000 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness.timing import median_seconds  # noqa: E402  (after the path)

COMPRESSORS = ("sign", "scaled_sign", "onebit", "terngrad", "qsgd", "natural", "int_quant",
               "adaptive_levels")
PEERS = {"scaled_sign": "numpy packbits", "qsgd": "torch qsgd", "terngrad": "torch terngrad"}


def numpy_sign(x):
  scale = np.mean(np.abs(x))
  words = np.packbits(x < 0)
  return scale * (1.0 - 2.0 * np.unpackbits(words, count=x.size).astype(np.float32))


def torch_peers():
  try:
    import torch
  except ImportError:
    return {}
  torch.manual_seed(0)

  def qsgd(x, levels=7, bucket=512):
    b = x.view(-1, bucket)
    norm = b.norm(dim=1, keepdim=True)
    r = b.abs() / norm.clamp_min(1e-30) * levels
    level = torch.floor(r + torch.rand_like(r)).clamp_max(levels)
    codes = (torch.sign(b) * level).to(torch.int8)
    return (codes.to(torch.float32) * norm / levels).view(-1)

  def terngrad(x, clip=2.5):
    bound = clip * x.std()
    x = x.clamp(-bound, bound)
    s = x.abs().max()
    keep = torch.rand_like(x) < x.abs() / s
    codes = (torch.sign(x) * keep).to(torch.int8)
    return codes.to(torch.float32) * s

  def wrap(f):
    return lambda x: (lambda t: (lambda: f(t)))(torch.from_numpy(x))

  return {"torch qsgd": wrap(qsgd), "torch terngrad": wrap(terngrad)}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--sizes", default="1048576,16777216", help="comma-separated element counts")
  p.add_argument("--repeats", type=int, default=7, help="timed calls per entry (median)")
  p.add_argument("--compressors", default=",".join(COMPRESSORS))
  p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
  args = p.parse_args(argv)

  import jax
  import jax.numpy as jnp
  import commopt

  torch = torch_peers()
  rows = []
  header = (f"{'size':>10} {'method':>44} {'ms':>9} {'GB/s':>7} {'vs copy':>8} "
            f"{'vs peer':>8}")
  print(f"backend {jax.default_backend()}, {jax.device_count()} device(s); "
        f"torch peers: {'yes' if torch else 'not installed'}")
  print(header)
  for n in (int(s) for s in args.sizes.split(",")):
    # Sizes are multiples of 512 so every bucketed peer sees whole buckets.
    n -= n % 512
    host = np.random.default_rng(0).normal(size=n).astype(np.float32)
    x = jnp.asarray(host)
    key = jax.random.key(0)
    gbytes = 4 * n / 1e9

    def record(method, seconds, copy=None, peer=None, kind="commopt"):
      row = {"size": n, "method": method, "kind": kind, "ms": seconds * 1e3,
             "gb_per_s": gbytes / seconds,
             "vs_copy": seconds / copy if copy else 1.0,
             "vs_peer": seconds / peer if peer else None}
      rows.append(row)
      vs_peer = f"{row['vs_peer']:8.2f}" if peer else f"{'':>8}"
      print(f"{n:>10} {method:>44} {row['ms']:9.2f} {row['gb_per_s']:7.2f} "
            f"{row['vs_copy']:8.2f} {vs_peer}", flush=True)
      return seconds

    negate = jax.jit(lambda v: -v)
    copy = record("copy: XLA one pass (-x)",
                  median_seconds(lambda: negate(x).block_until_ready(), args.repeats), kind="floor")
    record("copy: numpy np.copy", median_seconds(lambda: np.copy(host), args.repeats),
           copy, kind="floor")
    peer_time = {"numpy packbits": record(
        "peer: numpy packbits sign", median_seconds(lambda: numpy_sign(host), args.repeats),
        copy, kind="peer")}
    for label, make in torch.items():
      peer_time[label] = record(f"peer: {label} (int8 levels)",
                                median_seconds(make(host), args.repeats), copy, kind="peer")

    for name in args.compressors.split(","):
      c = commopt.compressors.make(name)
      fn = jax.jit(lambda v, k, c=c: c.decode(c.encode(v, c.init(v), k)[0], None, v))
      seconds = median_seconds(lambda: fn(x, key).block_until_ready(), args.repeats)
      record(c.name, seconds, copy, peer_time.get(PEERS.get(name)))

  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  meta = {"backend": jax.default_backend(), "device": str(jax.devices()[0]),
          "jax": jax.__version__, "machine": platform.machine(),
          "cpus": __import__("os").cpu_count(), "repeats": args.repeats}
  (out / "quantize.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
  print(f"wrote {out / 'quantize.json'}")
  return rows


if __name__ == "__main__":
  main()
