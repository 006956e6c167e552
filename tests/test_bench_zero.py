"""benchmarks/bench_zero.py runs and its figures hold on a small model."""

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_zero  # noqa: E402


@pytest.mark.slow
def test_bench_zero_small(tmp_path):
  args = bench_zero.parse_args(["--width", "256", "--steps", "40", "--out",
                                str(tmp_path / "zero.json")])
  rows = {r["setup"]: r for r in bench_zero.run(args)}
  # the skip of non-finite steps adds one tiny all-reduce (the verdict)
  assert rows["dense"]["bytes"].keys() - {"all-reduce"} == {"all-gather", "reduce-scatter"}
  assert rows["qwZ+qgZ"]["bytes"].keys() - {"all-reduce"} == {"all-gather", "all-to-all"}
  assert all(r["bytes"].get("all-reduce", 0) <= 64 for r in rows.values())
  assert rows["qwZ+qgZ"]["reduction"] > 4.0
  assert all(r["args_vs_share"] < 1.1 for r in rows.values())
  assert rows["qwZ+qgZ"]["tail_loss"] < 0.5 * rows["qwZ+qgZ"]["first_loss"]
  assert not bench_zero.misses(list(rows.values()))
  assert "qwZ+qgZ" in bench_zero.table(list(rows.values()), 8)
