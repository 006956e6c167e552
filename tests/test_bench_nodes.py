"""The two-node benchmark: end to end, shortened (two shaped namespaces, two launchers,
slow), and its derived figures on hand-made rows (default tier)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_nodes.py"


def test_derive_measures_time_to_the_target_against_dense(load_script):
  b = load_script(BENCH)
  rows = {"dense": {"step_s": 0.2, "losses": [1.0, 0.8, 0.6, 0.5, 0.5, 0.5, 0.5, 0.5]},
          "hpZ": {"step_s": 0.1, "losses": [1.0, 0.9, 0.7, 0.6, 0.54, 0.5, 0.5, 0.5]},
          "qwZ": {"step_s": 0.1, "losses": [1.0, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]}}
  out = b.derive(rows, None)
  assert out["dense"]["target"] == pytest.approx(0.55)      # 1.1x dense's final loss
  assert out["dense"]["steps_to_target"] == 4 and out["hpZ"]["steps_to_target"] == 5
  assert out["hpZ"]["time_to_target_s"] == pytest.approx(0.5)
  assert out["hpZ"]["vs_dense"] == pytest.approx(0.5)
  assert out["qwZ"]["steps_to_target"] is None and "losses" not in out["qwZ"]
  assert "not reached" in b.table({"1gbit": out})
  assert b.derive(rows, 0.95)["qwZ"]["steps_to_target"] == 2


def test_bad_arguments_are_refused(load_script):
  b = load_script(BENCH)
  with pytest.raises(SystemExit):
    b.parse_args(["--setups", "dense,zero++"])
  with pytest.raises(SystemExit):
    b.parse_args(["--steps", "3"])


def namespaces() -> set:
  out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
  return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


@pytest.mark.slow
def test_bench_nodes_runs_two_shaped_nodes_and_cleans_up(tmp_path):
  before = namespaces() if os.geteuid() == 0 else set()
  proc = subprocess.run(
      [sys.executable, str(BENCH), "--bandwidths", "1gbit", "--steps", "8", "--width", "64",
       "--layers", "2", "--setups", "dense,qwZ+qgZ+hpZ", "--out", str(tmp_path)],
      cwd=ROOT, capture_output=True, text=True, timeout=400)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  report = json.loads((tmp_path / "nodes.json").read_text())
  if "skipped" in report:
    assert "bench_nodes: skipped, " in proc.stdout
    return
  rows = report["results"]["1gbit"]
  assert set(rows) == {"dense", "qwZ+qgZ+hpZ"}
  # Fewer bytes cross the link with all three options; both train alike from one start.
  assert rows["qwZ+qgZ+hpZ"]["cross_node_bytes"] < rows["dense"]["cross_node_bytes"] / 4
  assert rows["dense"]["final_loss"] < 1.0 and rows["dense"]["step_s"] > 0
  assert namespaces() == before
  assert not any(pathlib.Path("/etc/netns").glob("commopt-node*"))
