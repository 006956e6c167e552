"""Processes a test or benchmark started: whether they run, waiting for them, ending them.

Multi-process tests and ``benchmarks/bench_faults.py`` start workers that
write their process ids to files; these helpers check that none is left
behind and end only processes that are their own (whose command line names
a folder of theirs), never anyone else's.
"""

from __future__ import annotations

import os
import pathlib
import signal
import time
from typing import Iterable

SLEEPING_WORKER = """
import os, pathlib, sys, time
from commopt import launch
ctx = launch.initialize()
pathlib.Path(sys.argv[1], f"{ctx.process_id}.pid").write_text(str(os.getpid()))
time.sleep(600)
"""
"""A worker script for ``commopt.launch``: it joins the job, writes its process id to
``<argv[1]>/<process id>.pid`` and sleeps, for a test or a trial to kill what it started."""


def alive(pid: int) -> bool:
  """Whether process ``pid`` runs; a zombie (ended, not yet reaped) counts as ended."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().split(")")[-1].split()[0] != "Z"
  except FileNotFoundError:
    return False


def all_gone(pids: Iterable[int], seconds: float, poll: float = 0.05) -> bool:
  """Waits up to ``seconds`` for every process of ``pids`` to end; whether they all did."""
  pids = list(pids)
  deadline = time.monotonic() + seconds
  while time.monotonic() < deadline and any(alive(p) for p in pids):
    time.sleep(poll)
  return not any(alive(p) for p in pids)


def kill_own(pids: Iterable[int], marker) -> None:
  """SIGKILLs the processes of ``pids`` that still run and whose command line contains
  ``marker`` (e.g. the test's temporary folder), and no other."""
  for pid in pids:
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        ours = str(marker).encode() in f.read()
    except OSError:
      ours = False
    if ours and alive(pid):
      os.kill(pid, signal.SIGKILL)


def pids_in(folder: pathlib.Path) -> list[int]:
  """The process ids written into ``folder/*.pid`` files (one id per file, as its text)."""
  return [int(p.read_text()) for p in pathlib.Path(folder).glob("*.pid") if p.read_text().strip()]
