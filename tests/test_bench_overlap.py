"""The overlap benchmark end to end, shortened: a shaped namespace, two processes, both methods."""

import json
import pathlib

import pytest

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_overlap.py"


def test_bench_overlap_times_every_variant_and_reads_the_programs(tmp_path, run_bench):
  proc, left = run_bench(
      BENCH, ["--processes", "2", "--bandwidth", "1gbit", "--rounds", "2", "--steps", "2",
              "--hidden", "256", "--batch", "32", "--out", str(tmp_path)], timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  report = json.loads((tmp_path / "overlap.json").read_text())
  if "skipped" in report:
    assert "bench_overlap: skipped, " in proc.stdout
    pytest.skip(f"the benchmark cannot shape a network here: {report['skipped']}")
  assert not left                                     # its namespace is gone
  for method in ("dense", "scaled_sign"):
    r = report["results"][""][method]
    assert set(r["median_s"]) == {"undelayed", "delayed", "delayed/kept", "split", "split/2dev",
                                  "split/thread", "compute", "comm"}
    assert all(len(t) == 4 and min(t) > 0 for t in r["times_s"].values())
    hlo = r["collectives"]
    # Undelayed, every collective waits for the batch; with the agreed skip on the kept
    # gradient inside pipelined (skip_nonfinite=False), none does.
    assert hlo["undelayed"] and all(c["batch"] for c in hlo["undelayed"])
    assert hlo["delayed/kept"] and not any(c["batch"] for c in hlo["delayed/kept"])
  assert "| (none) | scaled_sign | split/2dev |" in proc.stdout
  assert "scaled_sign, split/thread: " in proc.stdout
  assert (tmp_path / "overlap.md").read_text().count("\n| (none) |") == 16


def test_bench_overlap_diloco_measures_every_variants_utilisation(tmp_path, run_bench):
  proc, left = run_bench(
      ROOT / "benchmarks" / "bench_overlap_diloco.py",
      ["--processes", "2", "--rounds", "1", "--steps", "8", "--period", "4", "--delay", "2",
       "--hidden", "128", "--batch", "32", "--out", str(tmp_path)], timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  report = json.loads((tmp_path / "overlap_diloco.json").read_text())
  if "skipped" in report:
    pytest.skip(f"the benchmark cannot shape a network here: {report['skipped']}")
  assert not left
  derived = report["derived"]
  assert set(derived) == {"compute", "blocking", "overlapped", "streaming_diloco", "eager"}
  assert all(0 < d["utilisation"] and d["ms_per_step"] > 0 for d in derived.values())
  assert "Overlapped exchange: utilisation" in (tmp_path / "overlap_diloco.md").read_text()
