"""bench_eager.py end to end, shortened: every variant's global model scored at each outer step."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_eager.py"


@pytest.mark.slow
def test_bench_eager_scores_blocking_and_each_weight(tmp_path):
  proc = subprocess.run(
      [sys.executable, str(BENCH), "--workers", "2", "--periods", "2,3", "--weights", "1/M,1",
       "--steps", "6", "--hidden", "64", "--target-loss", "2.3", "--out", str(tmp_path)],
      capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  report = json.loads((tmp_path / "eager.json").read_text())
  rows = report["rows"]
  assert [(r["period"], r["method"], r["own_weight"]) for r in rows] == [
      (2, "blocking", None), (2, "eager", "1/M"), (2, "eager", "1"),
      (3, "blocking", None), (3, "eager", "1/M"), (3, "eager", "1")]
  for r in rows:
    assert [k for k, _ in r["losses"]] == list(range(r["period"], 7, r["period"]))
    assert r["losses"][-1][1] < r["losses"][0][1]
    reached = [k for k, loss in r["losses"] if loss <= 2.3]
    assert r["steps_to_target"] == (reached[0] if reached else None)
    assert r["last"] == r["losses"][-1][1]
  # At the first outer step (the same inner phase from the same start), w = 1 moves the mean
  # anchor by the whole mean at once, as blocking DiLoCo moves its anchor (which takes the
  # exchange's 4-bit mean, the mean anchor the exact one: close, not equal), w = 1/M by half.
  for period in (2, 3):
    block, share, whole = (r for r in rows if r["period"] == period)
    assert whole["losses"][0][1] == pytest.approx(block["losses"][0][1], rel=1e-3)
    assert share["losses"][0][1] > whole["losses"][0][1]
  assert (tmp_path / "eager.png").stat().st_size > 0
  assert "| 3 | eager | 1 |" in proc.stdout


def test_bench_eager_checks_its_arguments(load_script, capsys):
  b = load_script(BENCH)
  for argv, message in [(["--weights", "2"], "--weights: each is 1/M or a number in [0, 1]"),
                        (["--weights", "half"], "--weights: each is 1/M or a number in [0, 1]"),
                        (["--periods", "0"], "--periods: each period must be at least 1"),
                        (["--periods", "4", "--steps", "6"], "--steps must be at least twice"),
                        (["--workers", "1"], "--workers must be at least 2")]:
    with pytest.raises(SystemExit):
      b.parse_args(argv)
    assert message in capsys.readouterr().err
  assert b.parse_args(["--weights", "1/M,0.5"]).weights == [None, 0.5]
