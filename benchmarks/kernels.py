"""commopt.kernels against their baselines, side by side in one run.

GPU section (skipped without a GPU), float32 at 4M, 16M, 64M and 128M elements.
Times are the device's per call: :func:`device_seconds` queues calls back to back
and blocks once, so the host's dispatch latency does not count.

- Every Pallas kernel (``sign_pack`` per leaf and per block, ``sign_feedback``
  (error feedback fused with the sign encoding; its bytes are the one-pass limit:
  read ``u`` and ``e``, write ``e′`` and the payload), ``pack_bits``,
  ``unpack_bits``, ``quantize_pack``, ``first_true``) beside its XLA reference: bytes moved
  (read + written), GB/s, the fraction of a device copy's bandwidth
  (``x + 0``, 8 bytes per element, same run) and the speed-up over the
  reference. Target: ``sign_pack`` ≥ 90% of the copy's bandwidth from 4M up.
- ``select_top_k`` (the sampled two-pass select; the radix select it falls back
  to) at k = 0.1% and 1% against ``lax.top_k`` and ``lax.approx_max_k`` on
  ``|x|``, the XLA reference, and two reads of the input (twice one
  ``sum(x)``). Targets: ≥ 5× faster than ``lax.top_k`` and within 2× of two
  reads.

CPU section: the XLA path of every op against numpy and (when importable)
torch equivalents at 1M and 16M elements.

The table is printed and written to ``benchmarks/results/kernels.json``.

    python benchmarks/kernels.py                    # both sections (GPU skipped on CPU)
    python benchmarks/kernels.py --section gpu      # on an H100/H200
    python benchmarks/kernels.py --section cpu --sizes 1000000 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

from commopt import kernels

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness.timing import device_seconds, median_seconds  # noqa: E402  (after the path)

M = 1 << 20


def row(section, op, impl, n, seconds, nbytes=None, **extra):
  out = {"section": section, "op": op, "impl": impl, "n": n, "ms": seconds * 1e3}
  if nbytes is not None:
    out["MB"] = nbytes / 1e6
    out["GB/s"] = nbytes / seconds / 1e9
  out.update(extra)
  return out


def gpu_rows(sizes, repeats, interpret=False):
  """Every kernel against its XLA reference (and a copy of the same bytes); the selection
  against ``lax.top_k``, ``lax.approx_max_k`` and two reads of its input. ``interpret``
  runs the kernels through the Pallas interpreter (a smoke test of this code off a GPU;
  its times mean nothing)."""
  from commopt.kernels.select import pallas as select_pallas

  scope = kernels.implementation("auto", interpret=interpret)
  scope.__enter__()
  rows = []
  for n in sizes:
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    bits = jax.random.bits(jax.random.key(1), (n,), jnp.uint32)
    copy = jax.jit(lambda v: v + 0.0)
    t_copy = device_seconds(lambda: copy(x), repeats)
    copy_gbs = 8 * n / t_copy / 1e9
    rows.append(row("gpu", "copy", "xla", n, t_copy, 8 * n, vs_copy_bandwidth=1.0))

    def timed(op, moved, make, *arrays, impls=("pallas", "xla")):
      """One row per implementation; ``vs_reference`` = reference time / this time.
      ``make(impl)`` takes ``arrays`` as arguments: an array closed over would be a
      constant of the program, which XLA folds at compile time.
      An op that fails to compile or run gives a row with its error, not a dead run."""
      try:
        times = {impl: device_seconds(lambda f=jax.jit(make(impl)): f(*arrays), repeats)
                 for impl in impls}
      except Exception as e:   # noqa: BLE001 - reported in the table and the JSON
        rows.append({"section": "gpu", "op": op, "impl": "pallas", "n": n,
                     "error": f"{type(e).__name__}: {str(e)[:300]}"})
        return
      for impl, t in times.items():
        rows.append(row("gpu", op, impl, n, t, moved, vs_copy_bandwidth=moved / t / 1e9 / copy_gbs,
                        vs_reference=times["xla"] / t))

    words1 = 4 * -(-n // 32)
    timed("sign_pack", 4 * n + words1 + 4,
          lambda impl: lambda v: kernels.sign_pack(v, implementation=impl), x)
    timed("sign_pack(block_size=4096)", 4 * n + words1 + 4 * -(-n // 4096),
          lambda impl: lambda v: kernels.sign_pack(v, 4096, implementation=impl), x)
    e = 0.1 * x[::-1]
    for bs in (None, 256):
      # The limit: read u and e, write e' and the payload. The reference runs u + e,
      # sign_pack and p - decode as XLA fuses them.
      timed(f"sign_feedback(block_size={bs})", 12 * n + words1 + 4 * -(-n // (bs or n)),
            lambda impl, bs=bs: lambda u, r: kernels.sign_feedback(u, r, bs, implementation=impl),
            x, e)
    codes = (bits & 15).astype(jnp.uint8)
    timed("pack_bits(4)", n + n // 2,
          lambda impl: lambda c: kernels.pack_bits(c, 4, implementation=impl), codes)
    words4 = kernels.pack_bits(codes, 4, implementation="xla")
    timed("unpack_bits(4)", n // 2 + 4 * n,
          lambda impl: lambda w: kernels.unpack_bits(w, 4, n, implementation=impl), words4)
    norms = jnp.linalg.norm(jnp.pad(x, (0, -n % 512)).reshape(-1, 512), axis=1)
    timed("quantize_pack(qsgd, 7)", 8 * n + n // 2,
          lambda impl: lambda v, b, s: kernels.quantize_pack(v, b, 7, s, block_size=512,
                                                             implementation=impl),
          x, bits, norms)

    mask = x > 2.326                                   # about 1% true
    capacity = max(1, n // 100)
    timed("first_true(1%)", n + 4 * capacity,
          lambda impl: lambda m: kernels.first_true(m, capacity, implementation=impl), mask)

    one_read = jax.jit(jnp.sum)
    t_reads = 2 * device_seconds(lambda: one_read(x), repeats)
    rows.append(row("gpu", "two reads", "xla", n, t_reads, 8 * n))
    for frac in (0.001, 0.01):
      k = max(1, int(frac * n))
      op = f"top-k {frac:.1%}"
      baselines = {
          "lax.top_k": jax.jit(lambda v: jax.lax.top_k(jnp.abs(v), k)),
          "lax.approx_max_k": jax.jit(lambda v: jax.lax.approx_max_k(jnp.abs(v), k)),
          "select_top_k xla": jax.jit(lambda v: kernels.select_top_k(v, k, implementation="xla")),
          "select_top_k pallas radix": jax.jit(
              lambda v: select_pallas.select_top_k(v, k, 4, 1024, interpret)),
          "select_top_k pallas": jax.jit(
              lambda v: kernels.select_top_k(v, k, implementation="pallas")),
      }
      times = {}
      for name, f in baselines.items():
        try:
          times[name] = device_seconds(lambda f=f: f(x), max(3, repeats // 2))
        except Exception as e:   # noqa: BLE001 - reported in the table and the JSON
          rows.append({"section": "gpu", "op": op, "impl": name, "n": n, "k": k,
                       "error": f"{type(e).__name__}: {str(e)[:300]}"})
      try:
        bracketed = bool(select_pallas.sampled_bound(x, k, 1024)[3])
      except Exception as e:   # noqa: BLE001
        bracketed = f"{type(e).__name__}"
      for name, t in times.items():
        rows.append(row("gpu", op, name, n, t, k=k, speedup_vs_top_k=times.get("lax.top_k", np.nan) / t,
                        vs_two_reads=t / t_reads,
                        **({"bracketed": bracketed} if name == "select_top_k pallas" else {})))
  scope.__exit__(None, None, None)
  return rows


def torch_ops():
  try:
    import torch
  except ImportError:
    return None
  torch.set_num_threads(max(1, torch.get_num_threads()))
  return torch


def cpu_rows(sizes, repeats):
  torch = torch_ops()
  rows = []
  for n in sizes:
    xn = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    x = jnp.asarray(xn)
    r = jax.random.bits(jax.random.key(1), (n,), jnp.uint32)
    moved = 4 * n + n // 8

    sign = jax.jit(lambda v: kernels.sign_pack(v, implementation="xla"))
    rows.append(row("cpu", "sign_pack", "xla", n, median_seconds(lambda: sign(x), repeats), moved))
    rows.append(row("cpu", "sign_pack", "numpy", n, median_seconds(
        lambda: (np.mean(np.abs(xn)), np.packbits(xn < 0, bitorder="little")), repeats), moved))
    if torch is not None:
      xt = torch.from_numpy(xn)
      weights = 2 ** torch.arange(8, dtype=torch.uint8)

      def torch_sign():
        neg = (xt < 0).to(torch.uint8)
        neg = torch.nn.functional.pad(neg, (0, -n % 8)).view(-1, 8)
        return xt.abs().mean(), (neg * weights).sum(1, dtype=torch.uint8)

      rows.append(row("cpu", "sign_pack", "torch", n, median_seconds(torch_sign, repeats), moved))

    codes = (r & 15).astype(jnp.uint8)
    pack = jax.jit(lambda c: kernels.pack_bits(c, 4, implementation="xla"))
    rows.append(row("cpu", "pack_bits(4)", "xla", n, median_seconds(lambda: pack(codes), repeats),
                    n + n // 2))
    cn = np.asarray(codes)
    rows.append(row("cpu", "pack_bits(4)", "numpy", n, median_seconds(
        lambda: cn[0::2] | (cn[1::2] << 4), repeats), n + n // 2))

    norms = jnp.linalg.norm(jnp.pad(x, (0, -n % 512)).reshape(-1, 512), axis=1)
    qsgd = jax.jit(lambda v, b, s: kernels.quantize_pack(v, b, 7, s, block_size=512,
                                                         implementation="xla"))
    rows.append(row("cpu", "quantize_pack(qsgd,7)", "xla", n,
                    median_seconds(lambda: qsgd(x, r, norms), repeats), 8 * n + n // 2))
    if torch is not None:
      un = torch.from_numpy(np.array(kernels.uniform_from_bits(r)))
      nt = torch.from_numpy(np.array(norms))

      def torch_qsgd():   # levels as int8, not packed: less work than the packed payload
        v = xt[: n - n % 512].view(-1, 512)
        lvl = torch.clamp(torch.floor(v.abs() / nt[: v.shape[0], None] * 7
                                      + un[: v.numel()].view(-1, 512)), max=7)
        return (torch.sign(v) * lvl).to(torch.int8)

      rows.append(row("cpu", "quantize_pack(qsgd,7)", "torch int8", n,
                      median_seconds(torch_qsgd, repeats), 8 * n + n // 2))

    for frac in (0.001, 0.01):
      k = max(1, int(frac * n))
      op = f"select_top_k {frac:.1%}"
      f = jax.jit(lambda v, k=k: kernels.select_top_k(v, k, implementation="xla"))
      rows.append(row("cpu", op, "xla", n, median_seconds(lambda: f(x), repeats), k=k))
      rows.append(row("cpu", op, "numpy argpartition", n, median_seconds(
          lambda: np.sort(np.argpartition(-np.abs(xn), k - 1)[:k]), repeats), k=k))
      if torch is not None:
        rows.append(row("cpu", op, "torch.topk", n, median_seconds(
            lambda: torch.sort(torch.topk(xt.abs(), k).indices).values, repeats), k=k))
  return rows


def print_table(rows):
  cols = ["section", "op", "impl", "n", "k", "ms", "MB", "GB/s", "vs_copy_bandwidth",
          "vs_reference", "speedup_vs_top_k", "vs_two_reads", "bracketed", "error"]
  cols = [c for c in cols if any(c in r for r in rows)]
  print(" | ".join(f"{c:>20}" for c in cols))
  for r in rows:
    cells = []
    for c in cols:
      v = r.get(c, "")
      cells.append(f"{v:>20.3f}" if isinstance(v, float) else f"{v!s:>20}")
    print(" | ".join(cells))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--section", choices=("all", "gpu", "cpu"), default="all")
  parser.add_argument("--sizes", type=int, nargs="*", help="element counts (default per section)")
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kernels.json"))
  args = parser.parse_args()

  rows, notes = [], []
  if args.section in ("all", "gpu"):
    if jax.default_backend() == "gpu":
      rows += gpu_rows(args.sizes or [4 * M, 16 * M, 64 * M, 128 * M], args.repeats)
    else:
      notes.append(f"GPU section skipped: backend is {jax.default_backend()!r}.")
  if args.section in ("all", "cpu"):
    rows += cpu_rows(args.sizes or [1 * M, 16 * M], args.repeats)
  for note in notes:
    print(note)
  print_table(rows)
  meta = {"jax": jax.__version__, "backend": jax.default_backend(),
          "device": str(jax.devices()[0].device_kind), "python": platform.python_version(),
          "notes": notes}
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
