"""The demo and the benchmark run end to end (shortened)."""

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(args, tmp_path):
  proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout


def test_demo_trains_and_plots(tmp_path):
  out = run(["examples/train.py", "--compressors", "identity,scaled_sign", "--epochs", "1",
             "--max-steps", "4", "--workers", "4", "--out", str(tmp_path)], tmp_path)
  assert "HLO audit" in out and "test acc" in out
  metrics = json.loads((tmp_path / "train_metrics.json").read_text())
  assert set(metrics) == {"identity", "scaled_sign"}
  sign = metrics["scaled_sign"]
  # The audit holds the payload, the batch statistics' mean and the skip flag.
  assert sign["audited_bytes"] == (sign["payload_bytes"] + sign["model_state_sync_bytes"]
                                   + sign["skip_flag_bytes"])
  assert sign["model_state_sync_bytes"] == 2 * 64 * 4 and sign["skipped_steps"] == 0
  assert sign["dense_bytes"] / sign["payload_bytes"] > 30
  assert (tmp_path / "train_loss_vs_bytes.png").stat().st_size > 10_000


def test_demo_runs_quantizers_and_signum(tmp_path):
  out = run(["examples/train.py", "--compressors", "qsgd,int_quant,signum", "--epochs", "1",
             "--max-steps", "2", "--workers", "2", "--bits", "4", "--levels", "3",
             "--out", str(tmp_path)], tmp_path)
  assert "Elias coding" in out
  metrics = json.loads((tmp_path / "train_metrics.json").read_text())
  assert metrics["int_quant"]["compressor"].startswith("int_quant(bits=4")
  assert metrics["qsgd"]["compressor"].startswith("qsgd(levels=3")
  for h in metrics.values():
    assert h["audited_bytes"] == (h["payload_bytes"] + h["model_state_sync_bytes"]
                                  + h["skip_flag_bytes"])
  assert metrics["signum"]["dense_bytes"] / metrics["signum"]["payload_bytes"] > 30


def test_demo_rejects_unknown_compressor(tmp_path):
  proc = subprocess.run([sys.executable, "examples/train.py", "--compressors", "sgn"],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0 and "unknown 'sgn'" in proc.stderr


def test_benchmark_reports_ratios(tmp_path):
  out = run(["benchmarks/bench_foundation.py", "--workers", "2", "--steps", "2",
             "--compressors", "power_sgd,scaled_sign", "--strategies", "auto,two_phase",
             "--out", str(tmp_path)], tmp_path)
  assert "time vs dense" in out
  assert "skipped power_sgd(rank=2) with strategy='two_phase'" in out
  rows = json.loads((tmp_path / "foundation.json").read_text())["rows"]
  assert [r["compressor"] for r in rows] == [
      "identity", "power_sgd(rank=2)", "scaled_sign", "scaled_sign [two_phase]"]
  assert rows[0]["step_time_vs_dense"] == 1.0
  assert rows[1]["audited_bytes"] == rows[1]["payload_bytes"] < rows[0]["payload_bytes"]
  assert rows[3]["sent_bytes"] < rows[2]["sent_bytes"] * 1.5   # two workers: about even


def test_quantize_benchmark_puts_baselines_beside(tmp_path):
  run(["benchmarks/bench_quantize.py", "--sizes", "4096", "--repeats", "1",
       "--compressors", "scaled_sign,qsgd", "--out", str(tmp_path)], tmp_path)
  rows = json.loads((tmp_path / "quantize.json").read_text())["rows"]
  methods = [r["method"] for r in rows]
  assert methods[0].startswith("copy") and "peer: numpy packbits sign" in methods
  sign = next(r for r in rows if r["method"] == "scaled_sign")
  assert sign["vs_peer"] is not None and sign["vs_copy"] > 0
