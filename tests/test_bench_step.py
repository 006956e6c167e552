"""bench_step.py: each row timed in rounds beside identity's, its ratio the median of the
rounds' ratios; and the benchmark end to end, shortened (slow tier)."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_step.py"


def test_interleaved_runs_each_row_once_a_round_in_order(load_script):
  module = load_script(BENCH)
  calls = []
  speeds = {"identity": iter([1.0, 2.0, 4.0]), "row": iter([1.5, 2.0, 10.0])}

  def run_for(label):
    def run(n):
      calls.append((label, n))
      return next(speeds[label])
    return run

  times = module.interleaved({"identity": run_for("identity"), "row": run_for("row")},
                             rounds=3, steps=5)
  # Reversed every other round, so that neither always runs first.
  assert calls == [("identity", 5), ("row", 5), ("row", 5), ("identity", 5),
                   ("identity", 5), ("row", 5)]
  assert times == {"identity": [1.0, 2.0, 4.0], "row": [1.5, 2.0, 10.0]}
  # Per-round ratios 1.5, 1.0, 2.5: their median, not the ratio of the medians (1.0).
  assert module.ratio(times["row"], times["identity"]) == 1.5


def test_runner_carries_the_state_from_call_to_call(load_script):
  seen = []

  def step(p, s, batch):
    seen.append((p, s, batch))
    return p + 1, s * 2, None

  run = load_script(BENCH).runner(step, 0, 1, "b")
  assert run(2) >= 0
  run(1)
  assert seen == [(0, 1, "b"), (1, 2, "b"), (2, 4, "b")]


@pytest.mark.parametrize("argv, message", [(["--steps", "0"], "--steps must be >= 1"),
                                          (["--rounds", "0"], "--rounds must be >= 1"),
                                          (["--host-memory", "big"], "invalid choice")])
def test_bad_arguments_are_named(argv, message, load_script, capsys):
  with pytest.raises(SystemExit):
    load_script(BENCH).parse_args(argv)
  assert message in capsys.readouterr().err


@pytest.mark.slow
def test_bench_step_reports_every_row_against_identity(tmp_path):
  proc = subprocess.run(
      [sys.executable, str(BENCH), "--models", "mlp", "--compressors", "onebit,scaled_sign",
       "--strategies", "gather,two_phase", "--workers", "2", "--batch", "8", "--steps", "1",
       "--rounds", "2", "--out", str(tmp_path)],
      capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  report = json.loads((tmp_path / "step_cpu.json").read_text())
  assert report["meta"]["rounds"] == 2 and report["meta"]["host_memory"] == "reuse"
  rows = {(r["compressor"], r["strategy"]): r for r in report["rows"]}
  assert set(rows) == {("plain (shard_map + pmean)", "-"), ("identity", "psum"),
                       ("identity, no skip", "psum"), ("onebit", "gather"),
                       ("onebit", "two_phase"), ("scaled_sign", "gather"),
                       ("scaled_sign", "two_phase")}
  for (name, _), r in rows.items():
    assert r["ms"] > 0
    assert len(r["round_ms"]) == 2 and r["ms"] == min(r["round_ms"])
    if name in ("onebit", "scaled_sign"):
      assert r["round_ratios"] == pytest.approx(
          [a / b for a, b in zip(r["round_ms"], r["identity_round_ms"])])
      assert r["ratio"] == pytest.approx(sum(r["round_ratios"]) / 2)   # two rounds' median
      assert r["met"] == (r["ratio"] <= r["target"])
  assert "| mlp | onebit | two_phase |" in proc.stdout
  assert "after JAX started" not in proc.stderr   # the host memory set before JAX starts
