"""The base-step benchmark: its by-hand skip rows keep the guarantee they stand for, and
the benchmark runs end to end (shortened, slow tier)."""

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


@pytest.mark.parametrize("label", ["plain, by-hand skip", "plain (flat), by-hand skip"])
def test_by_hand_skip_rows_skip_on_one_workers_nan_and_step_otherwise(mesh, label, load_script):
  params = {"w": jnp.ones((4, 2)), "b": jnp.zeros(2)}
  loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"]) ** 2)
  init, step = load_script(BENCH).steps(mesh, params, loss_fn)[label]
  put = lambda t: jax.device_put(t, NamedSharding(mesh, P("data")))
  x = np.ones((16, 4), np.float32)
  bad = x.copy()
  bad[5, 1] = np.nan                                 # one worker's rows only
  p = jax.device_put(jax.tree.map(jnp.copy, params), NamedSharding(mesh, P()))
  s = init(p)
  before = jax.tree.map(np.asarray, (p, s))
  p, s, _ = step(p, s, put({"x": bad}))
  after = jax.tree.map(np.asarray, (p, s))
  jax.tree.map(np.testing.assert_array_equal, after, before)   # params and adam state kept
  p, s, _ = step(p, s, put({"x": x}))
  assert not np.array_equal(np.asarray(p["w"]), before[0]["w"])
  assert np.all(np.isfinite(np.asarray(p["w"])))


@pytest.mark.slow
def test_bench_base_runs_every_row(tmp_path):
  proc = subprocess.run(
      [sys.executable, str(BENCH), "--layouts", "devices", "--workers", "2", "--rows", "4",
       "--steps", "1", "--rounds", "1", "--out", str(tmp_path)],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  rows = json.loads((tmp_path / "base_cpu.json").read_text())["results"]["devices"]
  assert {"plain", "plain, by-hand skip", "identity", "identity, no skip"} <= set(rows)
  assert all(r["ms"] > 0 for r in rows.values())
  fastest = min(r["ms"] for k, r in rows.items() if k.startswith("plain") and "skip" not in k)
  assert rows["identity"]["ratio"] == pytest.approx(rows["identity"]["ms"] / fastest)
