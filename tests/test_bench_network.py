"""The network benchmark end to end, shortened: a shaped namespace, two processes, two methods."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_network.py"


def namespaces() -> set:
  out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
  return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def test_bench_network_measures_a_shaped_link_and_cleans_up(tmp_path):
  before = namespaces() if os.geteuid() == 0 else set()
  proc = subprocess.run(
      [sys.executable, str(BENCH), "--processes", "2", "--bandwidths", "1gbit", "--steps", "10",
       "--compute-steps", "3", "--hidden", "1024", "--methods", "dense,scaled_sign/gather",
       "--target-loss", "1.0", "--out", str(tmp_path)],
      cwd=ROOT, capture_output=True, text=True, timeout=400)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  report = json.loads((tmp_path / "network.json").read_text())
  if "skipped" in report:
    assert "bench_network: skipped, " in proc.stdout
    pytest.skip(f"the benchmark cannot shape a network here: {report['skipped']}")
  assert namespaces() == before                       # its namespace is gone
  rows = report["results"]["2"]["1gbit"]
  dense, sign = rows["dense"], rows["scaled_sign/gather"]
  # Dense moves ~4.5 MB per worker per step through a 1 Gbit/s link shared by two
  # workers: the link, not the 2 cores, sets its step time (at most ~1.2 Gbit/s
  # goes through, tbf's burst allowing).
  link = dense["sent_bytes"] * 2 / dense["comm_s"] * 8 / 1e9
  assert 0.3 < link < 1.2, link
  assert sign["sent_bytes"] * 25 < dense["sent_bytes"]
  assert sign["step_s"] < dense["step_s"]
  assert dense["losses"][-1] < dense["losses"][0]
  assert "| 2 | 1gbit | dense |" in proc.stdout
  assert (tmp_path / "network.png").stat().st_size > 10_000
  # The table re-renders from the JSON.
  again = subprocess.run([sys.executable, str(BENCH), "--from-json", str(tmp_path / "network.json"),
                          "--out", str(tmp_path / "re")], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
  assert again.returncode == 0 and "| 2 | 1gbit | scaled_sign/gather |" in again.stdout
  # The α-β model beside the measurement: a bandwidth-bound dense step is priced
  # by its bytes over the shared link (the link check above bounds the error).
  model = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "network_model.py"),
                          "--from-json", str(tmp_path / "network.json"), "--out",
                          str(tmp_path / "model")], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
  assert model.returncode == 0, model.stdout[-3000:] + model.stderr[-3000:]
  rows = json.loads((tmp_path / "model" / "network_model.json").read_text())["rows"]
  assert {r["method"] for r in rows} == {"dense", "scaled_sign/gather"}
  dense_row = next(r for r in rows if r["method"] == "dense")
  assert abs(dense_row["comm_error"]) < 0.7, dense_row
  assert "The α that fits" in model.stdout
