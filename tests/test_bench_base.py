"""The base-step benchmark: its plain rows with optax's skip keep the guarantee they stand
for, and the benchmark runs end to end (shortened, slow tier)."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_base.py"


@pytest.mark.parametrize("label", ["plain, by-hand skip", "plain + optax.apply_if_finite",
                                   "plain (flat) + optax.apply_if_finite",
                                   "plain (1 MB buckets) + optax.apply_if_finite"])
def test_plain_skip_rows_skip_on_one_workers_nan_and_step_otherwise(mesh, label, load_script):
  params = {"w": jnp.ones((4, 2)), "b": jnp.zeros(2)}
  loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"]) ** 2)
  init, step = load_script(BENCH).steps(mesh, params, loss_fn)[label]
  put = lambda t: jax.device_put(t, NamedSharding(mesh, P("data")))
  x = np.ones((16, 4), np.float32)
  bad = x.copy()
  bad[5, 1] = np.nan                                 # one worker's rows only
  p = jax.device_put(jax.tree.map(jnp.copy, params), NamedSharding(mesh, P()))
  s = init(p)
  inner = lambda s: getattr(s, "inner_state", s)
  before = jax.tree.map(np.asarray, (p, inner(s)))
  p, s, _ = step(p, s, put({"x": bad}))
  jax.tree.map(np.testing.assert_array_equal, (p, inner(s)), before)   # all kept
  p, s, _ = step(p, s, put({"x": x}))
  assert not np.array_equal(np.asarray(p["w"]), before[0]["w"])
  assert np.all(np.isfinite(np.asarray(p["w"])))


@pytest.mark.parametrize("script", ["bench_base.py", "bench_step.py"])
def test_plain_steps_all_reduce_the_gradient_once(mesh, script, load_script):
  """The hand-written baselines average each gradient with one all-reduce: none of them
  all-reduces a gradient twice (differentiating replicated parameters, then a pmean)."""
  import optax
  from commopt import wire
  params = {"w": jnp.ones((4, 2)), "b": jnp.zeros(2)}
  loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"]) ** 2)
  module = load_script(ROOT / "benchmarks" / script)
  if script == "bench_base.py":
    rows = module.steps(mesh, params, loss_fn)
    steps = {k: v for k, v in rows.items() if k.startswith("plain")}
  else:
    opt = optax.sgd(0.1)
    steps = {"plain": (jax.jit(opt.init), module.plain_step(mesh, loss_fn, opt))}
  p = jax.device_put(params, NamedSharding(mesh, P()))
  batch = jax.device_put({"x": np.ones((16, 4), np.float32)}, NamedSharding(mesh, P("data")))
  gradient_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  for label, (init, step) in steps.items():
    sent = [c for c in wire.hlo_collectives(step, p, init(p), batch, stage="compiled")
            if c.kind == "all-reduce" and "f32" in c.dtypes]
    assert sum(c.contributed_bytes for c in sent) == gradient_bytes, (label, sent)


@pytest.mark.slow
def test_bench_base_runs_every_row(tmp_path):
  proc = subprocess.run(
      [sys.executable, str(BENCH), "--layouts", "devices", "--workers", "2", "--rows", "4",
       "--steps", "1", "--rounds", "1", "--out", str(tmp_path)],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  rows = json.loads((tmp_path / "base_cpu.json").read_text())["results"]["devices"]
  assert {"plain", "plain + optax.apply_if_finite", "identity", "identity, zero skip",
          "identity, no skip"} <= set(rows)
  assert all(r["ms"] > 0 for r in rows.values())
  fastest = min(r["ms"] for k, r in rows.items() if k.startswith("plain") and "skip" not in k
                and "optax" not in k)
  assert rows["identity"]["ratio"] == pytest.approx(rows["identity"]["ms"] / fastest)
  skip = min(r["ms"] for k, r in rows.items() if k.startswith("plain") and "optax" in k)
  assert rows["identity"]["vs_plain_skip"] == pytest.approx(rows["identity"]["ms"] / skip)
