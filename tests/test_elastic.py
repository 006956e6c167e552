"""A run that survives losing a worker: the supervisor restarts on the processes left and
takes the lost ones back; the elastic DiLoCo example goes on from its last outer step.

The fast tests use tiny worker scripts (no JAX) that write their pids into ``tmp_path``;
whatever is left at the end is killed by pid (only processes these tests started).
"""

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

from commopt import elastic, launch
from commopt.testing.processes import all_gone, kill_own, pids_in

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def handlers_shown() -> bool:
  """Whether this machine shows which signals a process catches (the launcher waits for
  SIGTERM's handler only there)."""
  status = pathlib.Path("/proc/self/status")
  return status.exists() and "SigCgt:" in status.read_text()

# Start 0: the last process dies (SIGKILL). Start 1: every process waits for a stop
# request and exits 0 on it. Later starts end at once.
# Mode "late": start 1 catches SIGTERM only after 2 s (a slow start-up, as importing JAX).
# Mode "deaf": start 1 ignores a request to stop (SIGKILL ends it at stop_grace).
WORKER = """
import os, pathlib, signal, sys, time
pid, n = int(os.environ["COMMOPT_PROCESS_ID"]), int(os.environ["COMMOPT_NUM_PROCESSES"])
start = int(os.environ["COMMOPT_ATTEMPT"])
if start == 1 and sys.argv[2] == "late":
  time.sleep(2.0)
signal.signal(signal.SIGTERM, (lambda *a: None) if start == 1 and sys.argv[2] == "deaf"
              else (lambda *a: sys.exit(0)))              # a stop request: exit 0
out = pathlib.Path(sys.argv[1])
(out / f"{start}-{pid}.pid").write_text(str(os.getpid()))
(out / f"{start}-{pid}.n").write_text(str(n))
if start == 0 and pid == n - 1:
  os.kill(os.getpid(), signal.SIGKILL)
if start == 0 or (start == 1 and sys.argv[2] in ("wait", "late", "deaf")):
  time.sleep(120)
"""


def _script(tmp_path):
  path = tmp_path / "worker.py"
  path.write_text(WORKER)
  return path


def _run(tmp_path, mode, **kwargs):
  env = {"PYTHONPATH": str(ROOT)}
  lines = []
  try:
    return elastic.supervise([str(_script(tmp_path)), str(tmp_path), mode], 4, env=env,
                             timeout=60, say=lines.append, **kwargs), lines
  finally:
    pids = pids_in(tmp_path)
    assert all_gone(pids, 10), "a worker outlived the supervisor"
    kill_own(pids, str(tmp_path))


def test_the_supervisor_restarts_on_the_processes_left_and_takes_them_back(tmp_path):
  attempts, lines = _run(tmp_path, "wait", min_processes=2, rejoin_after=2.0)
  assert [(a.processes, a.why) for a in attempts] == [(4, "start"), (3, "lost"), (4, "rejoin")]
  assert attempts[0].lost == (3,) and attempts[0].results[3].returncode == -9
  assert attempts[1].stopped and not attempts[2].stopped
  # Each start told its processes how many there are and which start it is.
  assert sorted(p.name for p in tmp_path.glob("1-*.n")) == ["1-0.n", "1-1.n", "1-2.n"]
  assert {p.read_text() for p in tmp_path.glob("2-*.n")} == {"4"}
  assert lines[1] == "supervise: processes 3 (code -9) failed; restarting on 3"


@pytest.mark.skipif(not handlers_shown(), reason="no /proc/PID/status SigCgt here")
def test_a_request_to_stop_waits_until_every_process_catches_it(tmp_path):
  """rejoin_after (0.5 s) ends before start 1's processes catch SIGTERM (2 s): asked at
  once, they would die of it and count as lost; asked later, they stop and rejoin."""
  t0 = time.monotonic()
  attempts, _ = _run(tmp_path, "late", min_processes=2, rejoin_after=0.5)
  assert [(a.processes, a.why) for a in attempts] == [(4, "start"), (3, "lost"), (4, "rejoin")]
  assert attempts[1].stopped and attempts[1].seconds >= 2.0
  assert {r.returncode for r in attempts[1].results} == {0}
  assert time.monotonic() - t0 < 30


def test_a_run_that_overruns_its_stop_grace_counts_as_stopped(tmp_path):
  """Start 1 does not stop within stop_grace: SIGKILL ends it, and that is a stop (the
  rejoin follows), not 3 more lost workers."""
  attempts, lines = _run(tmp_path, "deaf", min_processes=2, rejoin_after=0.5, stop_grace=0.5)
  assert [(a.processes, a.why) for a in attempts] == [(4, "start"), (3, "lost"), (4, "rejoin")]
  assert attempts[1].stopped
  assert [(r.returncode, r.ended_by_launch) for r in attempts[1].results] == [(-9, True)] * 3
  assert "processes 0, 1, 2 did not stop within stop_grace (0.5 s)" in lines[3]


def test_without_rejoin_the_run_finishes_on_the_processes_left(tmp_path):
  attempts, _ = _run(tmp_path, "go", min_processes=3)
  assert [(a.processes, a.why) for a in attempts] == [(4, "start"), (3, "lost")]


def test_the_supervisor_gives_up_below_min_processes(tmp_path):
  with pytest.raises(launch.LaunchError, match=r"3 left, min_processes is 4") as e:
    _run(tmp_path, "go", min_processes=4)
  assert e.value.results[3].returncode == -9


def test_supervise_checks_its_arguments(tmp_path):
  with pytest.raises(ValueError, match=r"supervise: `min_processes` must be an integer from 1 "
                                       r"to processes \(4\), got 5"):
    elastic.supervise(["x.py"], 4, min_processes=5)
  with pytest.raises(ValueError, match=r"supervise: `rejoin_after`"):
    elastic.supervise(["x.py"], 4, rejoin_after=-1)
  with pytest.raises(ValueError, match=r"launch: `stop_after`"):
    launch.launch(["x.py"], 1, stop_after=-1)


@pytest.mark.slow
@pytest.mark.optimized
def test_elastic_diloco_loses_one_worker_goes_on_with_three_and_takes_it_back(tmp_path):
  """4 processes; one is killed mid-period at step 27; the run goes on with 3 from the outer
  step at 20, then the fourth joins back at an outer step; it trains throughout."""
  log = tmp_path / "log.jsonl"
  cmd = [sys.executable, "-m", "commopt.launch", "--processes", "4", "--cpu-devices", "1",
         "--supervise", "--min-processes", "2", "--rejoin-after", "15", "--stop-grace", "60",
         "--timeout", "400",
         str(ROOT / "examples" / "elastic.py"), "--ckpt", str(tmp_path / "ckpt"), "--log",
         str(log), "--steps", "300", "--kill-at", "27"]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=450,
                        env=dict(os.environ, PYTHONPATH=str(ROOT)))
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [json.loads(line) for line in log.read_text().splitlines()]
  starts = {}
  for r in rows:
    starts.setdefault(r["start"], []).append(r)
  assert sorted(starts) == [0, 1, 2]
  assert [starts[s][0]["workers"] for s in (0, 1, 2)] == [4, 3, 4]
  assert starts[0][-1]["step"] == 27                 # killed after step 27 ...
  assert starts[1][0]["step"] == 21                  # ... back to the outer step at 20: 7 lost
  assert (starts[2][0]["step"] - 1) % 10 == 0        # rejoined at an outer step: none lost
  assert starts[2][0]["step"] - 1 == starts[1][-1]["step"]
  assert starts[2][-1]["step"] == 300
  first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-10:]) / 10
  assert last < 0.2 * first, (first, last)
  assert "start 2 on 4 of 4 processes (rejoin)" in proc.stdout + proc.stderr
  left = subprocess.run(["pgrep", "-f", str(tmp_path / "ckpt")], capture_output=True, text=True)
  assert left.stdout.strip() == "", f"processes left: {left.stdout}"
