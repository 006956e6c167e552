"""The shard-local benchmark runs end to end (--quick, 2x4 mesh) and meets its targets."""

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_sharded_benchmark_quick(tmp_path):
  out = tmp_path / "sharded.json"
  proc = subprocess.run(
      [sys.executable, "benchmarks/bench_sharded.py", "--quick", "--exact", "--check", "--json",
       str(out)],
      cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "skipped (compressed_mean: strategy='two_phase'" in proc.stdout
  result = json.loads(out.read_text())
  mesh = result["meta"]["meshes"]["2x4"]
  assert mesh["model_ranks"] == 4
  # w1: 256 x 2048 and w2: 2048 x 256, four model ranks: 131072 elements a shard.
  assert mesh["shard_elements"] == 256 * 2048 // 4
  rows = result["rows"]
  by = {(r["compressor"], r["strategy"]): r for r in rows}
  assert set(by) == {(c, s) for c in ("identity", "scaled_sign", "power_sgd")
                     for s in ("auto", "gather", "two_phase")}
  assert "skipped" in by["power_sgd", "two_phase"]
  measured = [r for r in rows if "skipped" not in r]
  assert len(measured) == 8
  for r in measured:
    local, whole, repl = r["local"], r["whole"], r["repl"]
    what = (r["compressor"], r["strategy"])
    assert local["layout"] == "shard_local" and whole["layout"] == "whole", what
    assert not local["warnings"] and not whole["warnings"], (what, local["warnings"])
    # 1. Each device sends its shard of w1, w2 over the data axis: about 1/4 of whole leaves.
    assert 0 < local["data_sharded"] <= 0.3 * whole["data_sharded"], what
    assert r["data_ratio"] <= 0.3, what
    # The rest: the replicated bias (256 floats, under min_size, sent dense), split over
    # the 4 model ranks on the shard-local step, whole on whole leaves; and a scalar or two
    # (the agreed non-finite check).
    assert 256 <= local["data_other"] <= 256 + 16, (what, local["data_other"])
    assert 256 * 4 <= whole["data_other"] <= 256 * 4 + 16, (what, whole["data_other"])
    # 2. No parameter-sized (not even shard-sized) all-gather over the model axis in
    # shard-local mode; the whole-leaf mode gathers whole leaves, so the audit sees them.
    assert local["model_gather_max"] < mesh["shard_elements"], what
    assert whole["model_gather_max"] >= 256 * 2048, what
    assert local["model_added"] <= 0.01 * mesh["sharded_bytes"], what
    assert whole["model_added"] >= 0.5 * mesh["sharded_bytes"], what
    # 3. Memory per device: parameters, moments and residuals sharded four ways.
    assert r["memory_ratio"] <= 0.3, what
    assert local["memory"] < whole["memory"] <= repl["memory"] * 1.05, what
  # scaled_sign sends packed sign bits: 1/32 of identity's f32 payload (plus a scale).
  sign, dense = by["scaled_sign", "auto"]["local"], by["identity", "auto"]["local"]
  assert sign["data_sharded"] <= dense["data_sharded"] / 32 + 64
  # PowerSGD's factors need a small model-axis collective on the shard-local step.
  assert 0 < by["power_sgd", "auto"]["local"]["model_added"]
  assert by["scaled_sign", "gather"].get("same_as") == "auto"
  # Sharded = unsharded for every compressor the sharded page says is exact.
  exact = {r["compressor"]: r for r in result["exact"]}
  assert {"identity", "power_sgd(rank=2)", "top_k(leaf threshold)"} <= set(exact)
  for r in exact.values():
    assert r["kept"], r
    assert r["max_diff"] == 0 or r["promise"] == "to rounding", r
