"""Faults injected into steps and launched jobs, and how each is classed (``bench_faults.py``).

- a bad call: :func:`try_call` classes it as a clear error (``TypeError`` or ``ValueError``
  naming the argument), an unclear one, or silently accepted;
- a step given non-finite or overflowing values: :func:`run_injected` classes each injected
  step as skipped exactly, applied finite, or wrong;
- a launcher killed with SIGKILL (:func:`killed_launcher`) and a worker that raises
  (:func:`raising_worker`): the workers left alive (orphans), and how soon the launcher saw it;
- :func:`rss_mib`: this process's resident memory, for a soak's growth.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import time

from commopt.testing.processes import SLEEPING_WORKER, alive, all_gone, kill_own, pids_in

from harness import ROOT

ENV = dict(os.environ, PYTHONPATH=str(ROOT))
"""The environment of the processes a trial starts."""

SLEEPS = SLEEPING_WORKER

RAISES = """
import os, pathlib, sys, time
from commopt import launch
ctx = launch.initialize()
from jax.experimental import multihost_utils
out = pathlib.Path(sys.argv[1])
(out / f"{ctx.process_id}.pid").write_text(str(os.getpid()))
multihost_utils.sync_global_devices("joined")
if ctx.process_id == 1:
  (out / "failed_at").write_text(repr(time.time()))
  raise RuntimeError("process 1 broke")
multihost_utils.sync_global_devices("never")
time.sleep(600)
"""


def wait_until(ready, proc, seconds: float) -> bool:
  """Whether ``ready()`` holds within ``seconds`` (polled every 0.1 s; asked a last time at
  once when ``proc``, if given, has ended)."""
  deadline = time.monotonic() + seconds
  while time.monotonic() < deadline and not ready():
    if proc is not None and proc.poll() is not None:
      return ready()
    time.sleep(0.1)
  return ready()


def kill_ours(folder: pathlib.Path) -> None:
  """SIGKILL the workers whose pids ``folder`` holds and whose command line names it."""
  kill_own(pids_in(folder), folder)


def names(message: str, argument: str) -> bool:
  """Whether an error's ``message`` names ``argument`` (as `argument` or as a word)."""
  return f"`{argument}`" in message or re.search(rf"\b{re.escape(argument)}\b", message) is not None


def try_call(call, argument: str) -> str:
  """``"clear"``, ``"unclear"`` (raised, but not a TypeError/ValueError naming
  ``argument``) or ``"silent"`` (nothing raised)."""
  try:
    call()
  except (TypeError, ValueError) as e:
    return "clear" if names(str(e), argument) else "unclear"
  except Exception:   # noqa: BLE001 - an error, but not a clear one
    return "unclear"
  return "silent"


def run_injected(dp, params, batch, injected, steps, expected=None):
  """Runs ``steps`` steps; ``batch(i)`` is step ``i``'s batch. Classes each injected step;
  for one applied, the relative error of the parameters' mean change against ``expected``."""
  import jax
  import numpy as np
  host = lambda t: jax.tree.map(lambda x: np.asarray(jax.device_get(x)).copy(), t)
  state = dp.init(params)
  counts = {"skipped": 0, "applied_finite": 0, "wrong": 0, "rel_error": None}
  for i in range(steps):
    before, count = host(params), int(state.total_notfinite)
    params, state, _ = dp.step(params, state, batch(i))
    after, now = host(params), int(state.total_notfinite)
    finite = all(np.all(np.isfinite(x.astype(np.float32))) for x in jax.tree.leaves(after))
    same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(after),
                                                     jax.tree.leaves(before)))
    if i not in injected:
      if not finite or now != count:
        counts["wrong"] += 1   # an ordinary step must be applied
      continue
    if finite and same and now == count + 1:
      counts["skipped"] += 1
    elif finite and not same and now == count:
      counts["applied_finite"] += 1
      if expected is not None:
        change = np.mean([np.mean(a.astype(np.float64) - b.astype(np.float64))
                          for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before))])
        rel = abs(change - expected) / abs(expected)
        counts["rel_error"] = float(max(rel, counts["rel_error"] or 0.0))
    else:
      counts["wrong"] += 1
  return counts


def killed_launcher(work: pathlib.Path, log):
  """A launcher of two sleeping workers killed with SIGKILL: its workers still alive 5 s
  later are orphans (a row of the processes' table)."""
  out = work / "launcher"
  out.mkdir()
  script = out / "sleeps.py"
  script.write_text(SLEEPS)
  proc = subprocess.Popen(
      [sys.executable, "-m", "commopt.launch", "--processes", "2", "--cpu-devices", "1",
       "--timeout", "120", str(script), str(out)],
      cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    started = wait_until(lambda: len(pids_in(out)) == 2, proc, 120)
    pids = pids_in(out)
    proc.kill()   # SIGKILL: the launcher cleans nothing up
    proc.wait(timeout=30)
    time.sleep(5)
    orphans = sum(alive(p) for p in pids)
  finally:
    if proc.poll() is None:
      proc.kill()
    kill_ours(out)
  log(f"processes: launcher SIGKILL: {len(pids)} workers started ({started}), "
      f"{orphans} alive 5 s later")
  return {"case": "launcher killed (SIGKILL)", "killed": 1, "workers": len(pids),
          "resumed_bit_identical": None, "orphans": orphans, "ok": started and orphans == 0}


def raising_worker(work: pathlib.Path, log):
  """A job whose process 1 raises: the seconds until :class:`commopt.launch.LaunchError`,
  and the workers left alive (a row of the processes' table)."""
  from commopt import launch
  out = work / "raises"
  out.mkdir()
  script = out / "raises.py"
  script.write_text(RAISES)
  raised, took = False, None
  try:
    launch.launch([str(script), str(out)], processes=2, devices_per_process=1, timeout=120,
                  env={"PYTHONPATH": str(ROOT)})
  except launch.LaunchError:
    raised = True
    took = time.time() - float((out / "failed_at").read_text())
  pids = pids_in(out)
  all_gone(pids, 5)
  orphans = sum(alive(p) for p in pids)
  kill_ours(out)
  log(f"processes: worker raises: LaunchError={raised} after {took} s, {orphans} orphans")
  return {"case": "a worker raises", "killed": 1, "workers": len(pids),
          "seconds_to_launch_error": took, "resumed_bit_identical": None, "orphans": orphans,
          "ok": raised and orphans == 0}


def rss_mib() -> float:
  """This process's resident memory, MiB."""
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20
