"""The demo and the benchmark run end to end (shortened)."""

import json
import pathlib
import subprocess
import sys

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
  assert sign["audited_bytes"] == sign["payload_bytes"]
  assert sign["dense_bytes"] / sign["payload_bytes"] > 30
  assert (tmp_path / "train_loss_vs_bytes.png").stat().st_size > 10_000


def test_demo_rejects_unknown_compressor(tmp_path):
  proc = subprocess.run([sys.executable, "examples/train.py", "--compressors", "sgn"],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0 and "unknown 'sgn'" in proc.stderr


def test_benchmark_reports_ratios(tmp_path):
  out = run(["benchmarks/bench_foundation.py", "--workers", "2", "--steps", "2",
             "--compressors", "identity,power_sgd", "--out", str(tmp_path)], tmp_path)
  assert "time vs dense" in out
  rows = json.loads((tmp_path / "foundation.json").read_text())["rows"]
  assert [r["compressor"] for r in rows] == ["identity", "power_sgd(rank=2)"]
  assert rows[0]["step_time_vs_dense"] == 1.0
  assert rows[1]["audited_bytes"] == rows[1]["payload_bytes"] < rows[0]["payload_bytes"]
