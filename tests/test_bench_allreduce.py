"""The all-reduce benchmark end to end, shortened: two processes, one small buffer."""

import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_allreduce.py"


def test_bench_allreduce_times_both_sides_on_the_same_bytes():
  proc = subprocess.run([sys.executable, str(BENCH), "--processes", "2", "--mb", "0.5",
                         "--steps", "3"], cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  row = re.search(r"^\| 0\.5 \| ([\d.]+) \| (\S+) \| (\S+) \|$", proc.stdout, re.M)
  assert row, proc.stdout
  assert float(row.group(1)) > 0
  try:
    import torch  # noqa: F401
  except ImportError:
    assert row.group(2) == "–" and "torch side skipped" in proc.stdout
  else:
    xla, peer, ratio = (float(row.group(i)) for i in (1, 2, 3))
    assert peer > 0
    # The printed figures are rounded to 0.1 ms and 0.01.
    assert (xla - 0.05) / (peer + 0.05) - 0.005 <= ratio <= (xla + 0.05) / (peer - 0.05) + 0.005


def test_bench_allreduce_names_a_bad_argument():
  proc = subprocess.run([sys.executable, str(BENCH), "--processes", "1"], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2 and "--processes must be at least 2, got 1" in proc.stderr
