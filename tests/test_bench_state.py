"""The optimizer-state benchmark runs end to end (small parameters) and its bytes add up."""

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_state_benchmark_rows(tmp_path):
  proc = subprocess.run(
      [sys.executable, "benchmarks/bench_state.py", "--inputs", "128", "--hidden", "64",
       "--classes", "4", "--compressors", "scaled_sign,power_sgd", "--out", str(tmp_path)],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "skipped power_sgd(rank=2) with strategy='two_phase'" in proc.stdout
  assert "skipped power_sgd(rank=2) with strategy='hierarchical'" in proc.stdout
  rows = json.loads((tmp_path / "state.json").read_text())["rows"]
  by = {(r["compressor"], r["strategy"]): r for r in rows}
  assert set(by) == {("power_sgd(rank=2)", "auto")} | {
      ("scaled_sign", s) for s in ("auto", "two_phase", "hierarchical", "hierarchical+two_phase")}
  # Only w1 (128x64 = 8192 floats) is compressed; the rest is under min_size.
  n, f32 = 128 * 64, 4
  params = (n + 64 + 64 * 4 + 4) * f32
  expected = {"auto": (n, 0), "two_phase": (n, n // 8), "hierarchical": (n // 4, 0),
              "hierarchical+two_phase": (n // 4, n // 8)}
  for strategy, (residual, server) in expected.items():
    r = by["scaled_sign", strategy]
    assert r["param_bytes"] == params
    assert (r["residual_bytes"], r["server_bytes"]) == (residual * f32, server * f32), r
    # Besides: SGD's momentum (as large as the parameters) and counters and keys.
    assert 0 <= r["workers_bytes"] - params - (residual + server) * f32 <= 64, r
    assert r["dp_ratio"] <= r["workers_ratio"] + 0.01, r
  for strategy in ("two_phase", "hierarchical", "hierarchical+two_phase"):
    assert by["scaled_sign", strategy]["workers_ratio"] <= 2.1
