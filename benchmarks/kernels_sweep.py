"""Tuning sweep of the sign kernels on a GPU: elements per program, warps, partial-sum length.

``sign_pack`` over (partial sums of at most 256, 1024 elements or a program's chunk) x
(4, 8 warps) x (8192, 16384, 32768 elements per program), and ``sign_feedback`` (one
scale, and per block of 256) over (4, 8 warps) x (4096, 8192, 16384), at 16M and 64M
float32 elements. Every row checks its bits against the XLA reference (``ok``) and gives
the fraction of a device copy's bandwidth (``vs_copy``; for ``sign_feedback`` of the
one-pass limit, 12 bytes per element) and, for ``sign_feedback``, its speed over the
reference. One JSON line per row; the rows also go to ``$OUT/sweep.json`` (``/tmp``).
GPU only (the Triton lowering): elsewhere it says so and stops.

    PYTHONPATH=$PWD python3 benchmarks/kernels_sweep.py
"""
import json, os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax, jax.numpy as jnp
from commopt import kernels
from commopt.kernels import _dispatch as dispatch
from commopt.kernels.pack import reference
from harness.timing import device_seconds
if jax.default_backend() != "gpu":
  sys.exit(f"kernels_sweep.py needs a GPU backend, got {jax.default_backend()!r}.")
OUT = os.environ.get("OUT", "/tmp"); rows = []
def rec(**r):
  rows.append(r); print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
M = 1 << 20
for n in (16 * M, 64 * M):
  x = jax.random.normal(jax.random.key(0), (n,), jnp.float32); e = 0.1 * x[::-1]
  t_copy = device_seconds(lambda f=jax.jit(lambda v: v + 0.0): f(x), 10)
  want = jax.jit(lambda v: kernels.sign_pack(v, implementation="xla"))(x)
  for seg in (None, 1024, 256):
    reference.SEGMENT = seg
    for warps in (4, 8):
      dispatch._NUM_WARPS = warps
      for block in (8192, 16384, 32768):
        try:
          f = jax.jit(lambda v, b=block: kernels.sign_pack(v, implementation="pallas", block=b))
          got = f(x); ok = bool((got[0] == want[0]).all() & (got[1] == want[1]).all())
          t = device_seconds(lambda: f(x), 10)
          rec(op="sign_pack", n=n, seg=seg, warps=warps, block=block, ok=ok, vs_copy=(4 * n + n // 8) / t / (8 * n / t_copy))
        except Exception as ex:
          rec(op="sign_pack", n=n, seg=seg, warps=warps, block=block, error=str(ex)[:200])
  reference.SEGMENT = None
  for bs in (None, 256):
    wantf = jax.jit(lambda u, r: kernels.sign_feedback(u, r, bs, implementation="xla"))(x, e)
    tx = device_seconds(lambda f=jax.jit(lambda u, r: kernels.sign_feedback(u, r, bs, implementation="xla")): f(x, e), 10)
    for warps in (4, 8):
      dispatch._NUM_WARPS = warps
      for block in (4096, 8192, 16384):
        try:
          f = jax.jit(lambda u, r, b=block: kernels.sign_feedback(u, r, bs, implementation="pallas", block=b))
          got = f(x, e); ok = all(bool((a == b).all()) for a, b in zip(got, wantf))
          t = device_seconds(lambda: f(x, e), 10)
          rec(op="sign_feedback", bs=bs, n=n, warps=warps, block=block, ok=ok, vs_xla=tx / t,
              vs_copy=(12 * n) / t / (8 * n / t_copy))
        except Exception as ex:
          rec(op="sign_feedback", bs=bs, n=n, warps=warps, block=block, error=str(ex)[:200])
  dispatch._NUM_WARPS = 4
json.dump(rows, open(os.path.join(OUT, "sweep.json"), "w"), indent=1)
