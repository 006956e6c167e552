"""The fault benchmark runs end to end in its quick mode and every "must be 0" column is 0."""

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_fault_benchmark_quick(tmp_path):
  out = tmp_path / "faults.json"
  proc = subprocess.run(
      [sys.executable, "benchmarks/bench_faults.py", "--quick", "--out", str(out)],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "silently wrong (must be 0)" in proc.stdout
  result = json.loads(out.read_text())
  bad = result["bad_inputs"]
  assert bad["tried"] > 100 and bad["silently_wrong"] == 0, bad
  assert bad["clear_errors"] == bad["tried"], bad["not_clear"]
  for row in result["nonfinite"]:
    assert row["wrong"] == 0, row
    assert row["skipped_exactly"] + row["applied_finite"] == row["injected"], row
  by = {r["case"]: r for r in result["nonfinite"]}
  assert by["NaN in worker 3's batch (scaled_sign)"]["skipped_exactly"] == 2
  assert by["update overflows after the exchange (sgd 1e30)"]["skipped_exactly"] == 1
  assert len(result["processes"]) == 4
  for row in result["processes"]:
    assert row["orphans"] == 0 and row["ok"], row
  soak = result["soak"]
  assert soak["steps"] == 200 and soak["skipped"] == 0
  assert soak["rss_growth_mib"] < 50, soak
