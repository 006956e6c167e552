"""The processes :func:`commopt.launch.launch` starts on this machine: started, watched,
ended together, their output kept (see :mod:`commopt.launch` for the rules)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import signal
import subprocess
import tempfile
import threading
import time
from typing import Optional

TAIL_LINES = 30
"""Lines of a failed process's output that :class:`~commopt.launch.LaunchError`'s message
ends with."""


@dataclasses.dataclass
class ProcessResult:
  """One launched process: its id, exit code (negative: ended by that signal) and output;
  whether the launcher ended it (after another's failure, or past the timeout) and
  whether it was asked to stop (``stop_after``)."""
  process_id: int
  returncode: Optional[int]
  output: str
  ended_by_launch: bool = False
  asked_to_stop: bool = False



def catches_sigterm(pid: int) -> bool:
  """Whether process ``pid`` has a handler for SIGTERM (Linux: ``SigCgt`` in
  ``/proc/PID/status``); True where that cannot be read."""
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        if line.startswith("SigCgt:"):
          return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
  except (OSError, ValueError, IndexError):
    pass
  return True


class ProcessGroup:
  """The processes of one :func:`commopt.launch.launch` on this machine, their logs and
  their ends."""

  def __init__(self, n: int, first_id: int = 0, total: Optional[int] = None):
    self.n = n                                # processes here: local index i is process
    self.first_id = first_id                  # first_id + i of the job's `total`
    self.total = n if total is None else total
    self.procs: list[subprocess.Popen] = []
    self.logs = []
    self.done: list[threading.Event] = []
    self.exits: queue.Queue = queue.Queue()   # process ids, in the order they ended
    self.ended: set[int] = set()              # the ones the launcher ended
    self.signal: Optional[int] = None         # what ended the launcher
    self.forced = False                       # ended twice
    self.pipe: Optional[int] = None           # the write end the processes watch
    self.asked: set[int] = set()              # the ones asked to stop (stop_after)
    self.first_failed: Optional[int] = None   # a job-wide process id

  @contextlib.contextmanager
  def catching_signals(self):
    """While the run lasts, SIGTERM and SIGINT to the launcher end the run (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
      yield
      return
    previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
      yield
    finally:
      for s, handler in previous.items():
        # None: a handler not set from Python, which cannot be put back.
        signal.signal(s, signal.SIG_DFL if handler is None else handler)
    if self.signal is not None:
      raise KeyboardInterrupt(f"launch: ended by signal {self.signal}")

  def _on_signal(self, signum, frame):
    if self.signal is None:
      self.signal = signum
    else:
      self.forced = True   # a second signal: SIGKILL without waiting out the grace

  def start(self, argv, python, env_of):
    """Starts ``python argv...`` ``n`` times, process ``first_id + i`` with the environment
    ``env_of(first_id + i, read_end)`` (``read_end``: the pipe's end the process watches)."""
    # The launcher keeps the write end and never writes; when it dies, however
    # it dies, the processes read end-of-file and end (initialize's watchdog).
    read_end, self.pipe = os.pipe()
    try:
      for i in range(self.n):
        if self.signal is not None:
          return
        child_env = env_of(self.first_id + i, read_end)
        log = tempfile.TemporaryFile(prefix=f"commopt-launch-{i}-")   # gone with the launcher
        self.logs.append(log)
        p = subprocess.Popen([python, *argv], env=child_env, stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True,
                             pass_fds=(read_end,))
        self.procs.append(p)
        self.done.append(threading.Event())
        threading.Thread(target=self._reap, args=(i,), daemon=True,
                         name=f"commopt-launch-reap-{i}").start()
    finally:
      os.close(read_end)

  def _reap(self, i: int) -> None:
    self.procs[i].wait()
    self.done[i].set()
    self.exits.put(i)

  def watch(self, timeout: float, grace: float, stop_grace: float,
            stop_after: Optional[float] = None):
    """Waits for the run to end, ending it early where needed; returns why it failed, or None."""
    began = time.monotonic()
    deadline = began + timeout
    finished = 0
    while finished < len(self.procs):
      if self.signal is not None:
        self.end(range(self.n), stop_grace)
        return None
      if (stop_after is not None and not self.asked and time.monotonic() - began > stop_after
          and self._can_stop()):
        self.asked.update(i for i in range(self.n) if not self.done[i].is_set())
        self.end(sorted(self.asked), stop_grace, asked=True)   # then read their exits
      try:
        i = self.exits.get(timeout=0.05)
      except queue.Empty:
        if time.monotonic() > deadline:
          self.end(range(self.n), grace)
          return (f"the run exceeded its timeout of {timeout:g} s; every process was "
                        f"ended.{self._tails(range(self.n), lines=10)}")
        continue
      finished += 1
      if self.procs[i].returncode != 0 and not self._stopped_late(i):
        self.first_failed = self.first_id + i
        self.end(range(self.n), grace)
        return self._failure(i)
    if self.signal is not None:   # arrived while the last process ended
      self.end(range(self.n), stop_grace)
    return None

  def _can_stop(self) -> bool:
    """Whether every running process catches SIGTERM, so that a request to stop reaches it
    as a request: one still starting up (before ``initialize(handle_sigterm=True)`` or its
    own handler) would die of it instead, and look like a failure. Where the handlers
    cannot be read (no ``/proc``), True."""
    return all(self.done[i].is_set() or catches_sigterm(self.procs[i].pid)
               for i in range(len(self.procs)))

  def _stopped_late(self, i: int) -> bool:
    """Whether process ``i`` was asked to stop and was still running at the end of
    ``stop_grace``, when the launcher sent SIGKILL (whatever it then exited with, a peer's
    collective failing first included): a stop, not a failure."""
    return i in self.asked and i in self.ended

  def end(self, ids, grace: float, asked: bool = False) -> None:
    """SIGTERM to the processes ``ids`` still running (``asked``: a request to stop, which does
    not count as ending them); SIGKILL to those left after ``grace``."""
    running = [i for i in ids if i < len(self.procs) and not self.done[i].is_set()]
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
      for i in running:
        if not (asked and sig == signal.SIGTERM):
          self.ended.add(i)
        try:
          os.killpg(self.procs[i].pid, sig)   # the process and anything it started
        except (ProcessLookupError, PermissionError):
          pass
      until = time.monotonic() + wait
      while (time.monotonic() < until and not all(self.done[i].is_set() for i in running)
             and not (sig == signal.SIGTERM and self.forced)):
        time.sleep(0.02)
      running = [i for i in running if not self.done[i].is_set()]
      if not running:
        return

  def close(self) -> None:
    self.end(range(self.n), 0.0)   # a no-op unless an error left processes running
    if self.pipe is not None:
      os.close(self.pipe)
      self.pipe = None

  def output(self, i: int) -> str:
    fd = self.logs[i].fileno()
    return os.pread(fd, os.fstat(fd).st_size, 0).decode("utf-8", errors="replace")

  def results(self) -> list[ProcessResult]:
    out = [ProcessResult(self.first_id + i, p.returncode, self.output(i),
                         ended_by_launch=i in self.ended, asked_to_stop=i in self.asked)
           for i, p in enumerate(self.procs)]
    for log in self.logs:
      log.close()
    return out

  def _failure(self, first: int) -> str:
    codes = ", ".join(
        f"process {self.first_id + i} (code {p.returncode}"
        f"{', ended by launch' if i in self.ended else ''})"
        for i, p in enumerate(self.procs) if p.returncode != 0)
    return (f"process {self.first_id + first} of {self.total} failed first; exit codes: "
            f"{codes} (negative codes: ended by that signal)."
            f"{self._tails([first], lines=TAIL_LINES)}")

  def _tails(self, ids, lines: int) -> str:
    parts = []
    for i in ids:
      tail = self.output(i).splitlines()[-lines:]
      text = "\n".join(tail)[-4000:]
      name = self.first_id + i
      parts.append(f"\n--- last lines of process {name} ---\n{text}" if tail
                   else f"\n--- process {name} printed nothing ---")
    return "".join(parts)
