"""Start a multi-process JAX program on this machine, and join one from inside it.

:func:`launch` runs ``N`` copies of a Python script, process ``i`` of ``N``,
connected through ``jax.distributed`` (gloo on CPUs, NCCL on GPUs), the way a
cluster scheduler would start them on ``N`` hosts; tests, benchmarks and the
demo (``--processes N``) use it. The script calls :func:`initialize` first
thing, which reads what :func:`launch` put in its environment; run alone,
:func:`initialize` does nothing and the script is an ordinary one-process
program.

A run ends in bounded time whatever happens, and leaves no process behind:

- **A process fails** (exits non-zero, crashes, or raises): :func:`launch`
  sends the others ``SIGTERM`` at once, ``SIGKILL`` to any left after
  ``grace`` seconds (1 s), and raises :class:`LaunchError` naming the process
  that failed first, its exit code and its last lines of output, about a
  second after the failure. An uncaught exception ends its process as soon as
  the traceback is printed (:func:`initialize` installs that exception hook),
  instead of waiting at ``jax.distributed``'s shutdown barrier for peers that
  are blocked on it.
- **The launcher is ended** (``SIGTERM``, or Ctrl-C): it sends ``SIGTERM`` to
  every process, ``SIGKILL`` to any left after ``stop_grace`` seconds, and
  raises ``KeyboardInterrupt`` (the command line exits 130, saying so). A
  process ends at once on ``SIGTERM``: :func:`initialize` takes back the
  signal from ``jax.distributed``'s preemption handler, which would otherwise
  ignore it.
- **The launcher dies** (``SIGKILL``, a crash): its processes die with it.
  Each holds the read end of a pipe whose write end only the launcher holds; a
  thread that :func:`initialize` starts ends the process when the pipe reads
  end-of-file, which the kernel brings about however the launcher died. On
  Linux each process also asks the kernel for ``SIGKILL`` when its parent
  exits (``PR_SET_PDEATHSIG``), which acts even when the process's Python
  is stuck.
- **Past** ``timeout``: every process is ended as after a failure, and
  :class:`LaunchError` says so.

A script that should save a checkpoint before it stops asks for ``SIGTERM``
to reach it as a request: ``initialize(handle_sigterm=True)``, then a call to
:func:`should_stop` once per step. Every process gets the same answer at the
same step (``jax.distributed``'s preemption sync point), so a checkpoint
written by every process together is consistent; the launcher waits
``stop_grace`` seconds for them (:func:`should_stop` shows the loop).
:func:`commopt.elastic.supervise` (``--supervise``) restarts a job on the
processes left when one dies.

Example (a script ``train.py`` that calls ``commopt.launch.initialize()``)::

    from commopt import launch
    launch.launch(["train.py", "--steps", "10"], processes=2, devices_per_process=4)

or from a shell::

    python -m commopt.launch --processes 2 --cpu-devices 4 train.py --steps 10
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional, Sequence

from commopt._src import base

ENV_PROCESS_ID = "COMMOPT_PROCESS_ID"
ENV_NUM_PROCESSES = "COMMOPT_NUM_PROCESSES"
ENV_COORDINATOR = "COMMOPT_COORDINATOR"
ENV_LOCAL_DEVICES = "COMMOPT_LOCAL_DEVICES"
ENV_HEARTBEAT = "COMMOPT_HEARTBEAT_TIMEOUT"
ENV_LAUNCHER_PID = "COMMOPT_LAUNCHER_PID"
ENV_LAUNCHER_FD = "COMMOPT_LAUNCHER_FD"
ENV_ATTEMPT = "COMMOPT_ATTEMPT"
"""Set by :func:`supervise`: which start of the job this is (0 the first, then one more per
restart); read it with :func:`attempt`."""

TAIL_LINES = 30
"""Lines of a failed process's output that :class:`LaunchError`'s message ends with."""

_PR_SET_PDEATHSIG = 1   # <linux/prctl.h>


class LaunchError(RuntimeError):
  """A launched process failed or the run timed out; ``results`` holds every process's outcome
  and ``first_failed`` the id of the process that failed first (None after a timeout)."""

  def __init__(self, message: str, results: list, first_failed: Optional[int] = None):
    super().__init__(message)
    self.results = results
    self.first_failed = first_failed


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


@dataclasses.dataclass(frozen=True)
class Context:
  """What :func:`initialize` joined: this process's id and the number of processes."""
  process_id: int
  num_processes: int

  @property
  def is_main(self) -> bool:
    """Process 0, the one that prints and writes files."""
    return self.process_id == 0


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on now."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


# -- the launcher ----------------------------------------------------------------------

def launch(argv: Sequence[str], processes: int, *, devices_per_process: Optional[int] = None,
           timeout: float = 600.0, grace: float = 1.0, stop_grace: float = 10.0,
           heartbeat_timeout: int = 20, coordinator: Optional[str] = None,
           env: Optional[dict] = None, python: str = sys.executable,
           echo: bool = False, stop_after: Optional[float] = None) -> list[ProcessResult]:
  """Runs ``python argv...`` as ``processes`` processes of one ``jax.distributed`` job.

  Each process runs in a session of its own (so a terminal's Ctrl-C reaches
  only the launcher, which then ends them) and dies with the launcher (see the
  module's docstring). Call from the thread that will wait for the run: on
  Linux a process's parent-death signal follows the thread that started it.

  Args:
    argv: the script and its arguments.
    processes: how many processes (>= 1).
    devices_per_process: CPU devices each process simulates
      (``jax_num_cpu_devices``); None keeps the backend's own devices (GPUs).
    timeout: seconds the whole run may take before every process is ended.
    grace: seconds between ``SIGTERM`` and ``SIGKILL`` for the processes left
      when one fails or the run times out (>= 0).
    stop_grace: seconds between ``SIGTERM`` and ``SIGKILL`` when the launcher
      is itself ended (``SIGTERM``, Ctrl-C): the time a process that polls
      :func:`should_stop` has to save a checkpoint and exit (>= 0). A second
      ``SIGTERM`` or Ctrl-C sends ``SIGKILL`` at once.
    heartbeat_timeout: ``jax.distributed``'s heartbeat timeout in the processes.
    coordinator: ``host:port`` of process 0's coordinator (default: a free
      local port).
    env: extra environment variables for every process.
    python: the interpreter.
    echo: print each process's output as it ends.
    stop_after: seconds after which every process still running is asked to
      stop (``SIGTERM``, which a process that polls :func:`should_stop`
      receives as a request; ``SIGKILL`` after ``stop_grace``); those that
      then exit 0 end the run normally, marked ``asked_to_stop``. None (the
      default) never asks.

  Returns:
    One :class:`ProcessResult` per process, in process order, all exit code 0.

  Raises:
    LaunchError: a process exited non-zero (the others are ended at once), or
      the run exceeded ``timeout``; its message names the process that failed
      first and ends with its last :data:`TAIL_LINES` lines of output.
    KeyboardInterrupt: the launcher received ``SIGTERM`` or ``SIGINT``; every
      process was ended first.
  """
  for name, value in (("processes", processes), ("heartbeat_timeout", heartbeat_timeout)):
    base.check_positive_int(name, value, fn="launch")
  if devices_per_process is not None:
    base.check_positive_int("devices_per_process", devices_per_process, fn="launch")
  base.check_number("timeout", timeout, fn="launch", low=0, what="a positive number of seconds")
  if stop_after is not None:
    base.check_number("stop_after", stop_after, fn="launch", low=0, low_open=False,
                      what="None or a number of seconds >= 0")
  for name, value in (("grace", grace), ("stop_grace", stop_grace)):
    base.check_number(name, value, fn="launch", low=0, low_open=False,
                      what="a number of seconds >= 0")
  coordinator = coordinator or f"127.0.0.1:{free_port()}"
  run = _Run(processes)
  with run.catching_signals():
    try:
      run.start(argv, python, env, coordinator, devices_per_process, heartbeat_timeout)
      reason = run.watch(timeout, grace, stop_grace, stop_after)
    finally:
      run.close()   # every process ended and reaped; the launcher's pipe end closed
  results = run.results()
  if echo:
    for r in results:
      print(f"--- process {r.process_id} (exit {r.returncode}) ---\n{r.output}", flush=True)
  if reason is not None:
    raise LaunchError(f"launch: {reason}", results, run.first_failed)
  return results


def __getattr__(name):
  # The supervisor lives in commopt.elastic (which imports this module): re-exported lazily.
  if name in ("supervise", "Attempt"):
    from commopt import elastic
    return getattr(elastic, name)
  raise AttributeError(f"module 'commopt.launch' has no attribute {name!r}")


def attempt() -> int:
  """Which start of a :func:`supervise` job this process belongs to (0 the first; 0 alone)."""
  return int(os.environ.get(ENV_ATTEMPT, "0"))


class _Run:
  """The processes of one :func:`launch`, their logs and their ends."""

  def __init__(self, n: int):
    self.n = n
    self.procs: list[subprocess.Popen] = []
    self.logs = []
    self.done: list[threading.Event] = []
    self.exits: queue.Queue = queue.Queue()   # process ids, in the order they ended
    self.ended: set[int] = set()              # the ones the launcher ended
    self.signal: Optional[int] = None         # what ended the launcher
    self.forced = False                       # ended twice
    self.pipe: Optional[int] = None           # the write end the processes watch
    self.asked: set[int] = set()              # the ones asked to stop (stop_after)
    self.first_failed: Optional[int] = None

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

  def start(self, argv, python, env, coordinator, devices_per_process, heartbeat_timeout):
    # The launcher keeps the write end and never writes; when it dies, however
    # it dies, the processes read end-of-file and end (initialize's watchdog).
    read_end, self.pipe = os.pipe()
    try:
      for i in range(self.n):
        if self.signal is not None:
          return
        child_env = dict(os.environ, **(env or {}))
        child_env.update({ENV_PROCESS_ID: str(i), ENV_NUM_PROCESSES: str(self.n),
                          ENV_COORDINATOR: coordinator, ENV_HEARTBEAT: str(heartbeat_timeout),
                          ENV_LAUNCHER_PID: str(os.getpid()), ENV_LAUNCHER_FD: str(read_end)})
        if devices_per_process is not None:
          child_env[ENV_LOCAL_DEVICES] = str(devices_per_process)
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
      if stop_after is not None and not self.asked and time.monotonic() - began > stop_after:
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
      if self.procs[i].returncode != 0:
        self.first_failed = i
        self.end(range(self.n), grace)
        return self._failure(i)
    if self.signal is not None:   # arrived while the last process ended
      self.end(range(self.n), stop_grace)
    return None

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
    out = [ProcessResult(i, p.returncode, self.output(i), ended_by_launch=i in self.ended,
                         asked_to_stop=i in self.asked) for i, p in enumerate(self.procs)]
    for log in self.logs:
      log.close()
    return out

  def _failure(self, first: int) -> str:
    codes = ", ".join(
        f"process {i} (code {p.returncode}{', ended by launch' if i in self.ended else ''})"
        for i, p in enumerate(self.procs) if p.returncode != 0)
    return (f"process {first} of {self.n} failed first; exit codes: {codes} (negative codes: "
            f"ended by that signal).{self._tails([first], lines=TAIL_LINES)}")

  def _tails(self, ids, lines: int) -> str:
    parts = []
    for i in ids:
      tail = self.output(i).splitlines()[-lines:]
      text = "\n".join(tail)[-4000:]
      parts.append(f"\n--- last lines of process {i} ---\n{text}" if tail
                   else f"\n--- process {i} printed nothing ---")
    return "".join(parts)


# -- inside a launched process ---------------------------------------------------------

@dataclasses.dataclass
class _Stop:
  """How this process meets SIGTERM: mode None (it ends), "sync" (JAX's sync point) or "flag"."""
  mode: Optional[str] = None
  calls: int = 0
  stopping: bool = False
  requested: threading.Event = dataclasses.field(default_factory=threading.Event)


_STOP = _Stop()


def initialize(*, handle_sigterm: bool = False) -> Context:
  """Joins the job :func:`launch` started (call before any other JAX use); alone, a no-op.

  Sets ``jax_num_cpu_devices`` when the launcher asked for simulated CPU
  devices, picks gloo for CPU collectives, and calls
  ``jax.distributed.initialize`` with the coordinator, process count, id and
  heartbeat timeout from the environment (the heartbeat also bounds the
  shutdown barrier a process passes at exit). Before that, it makes the
  process end with the launcher (a thread watching the launcher's pipe; on
  Linux, the parent-death signal) and end at once on an uncaught exception.

  Args:
    handle_sigterm: False (the default): ``SIGTERM`` ends the process at once,
      whatever ``jax.distributed`` installed for it. True: ``SIGTERM`` is a
      request to stop that :func:`should_stop` reports, so the script can save
      a checkpoint first; alone (not launched), a handler of this process
      records it.

  Returns:
    This process's :class:`Context`; ``Context(0, 1)`` when not launched.

  Example:
    >>> from commopt import launch
    >>> ctx = launch.initialize()
    >>> ctx.process_id, ctx.num_processes
    (0, 1)
  """
  if not isinstance(handle_sigterm, bool):
    raise ValueError(
        f"initialize: `handle_sigterm` must be True or False, got {handle_sigterm!r}.")
  if ENV_PROCESS_ID not in os.environ:
    if handle_sigterm:
      _record_sigterm()
    return Context(0, 1)
  pid, n = int(os.environ[ENV_PROCESS_ID]), int(os.environ[ENV_NUM_PROCESSES])
  _die_with_launcher(pid)
  sys.excepthook = _exit_after(sys.excepthook)
  import jax
  if ENV_LOCAL_DEVICES in os.environ:
    jax.config.update("jax_num_cpu_devices", int(os.environ[ENV_LOCAL_DEVICES]))
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  heartbeat = int(os.environ.get(ENV_HEARTBEAT, 20))
  # The shutdown barrier at exit waits for every process; bounded by the
  # heartbeat too, so a process that fails exits (with its code) instead of
  # waiting 300 s for peers that will never arrive.
  jax.distributed.initialize(coordinator_address=os.environ[ENV_COORDINATOR], num_processes=n,
                             process_id=pid, heartbeat_timeout_seconds=heartbeat,
                             shutdown_timeout_seconds=heartbeat)
  # jax.distributed.initialize has just given SIGTERM to its preemption
  # service, whose handler only notes a preemption (for the sync point) and
  # leaves the process running: keep it for a process that polls should_stop,
  # give SIGTERM back its default otherwise.
  if handle_sigterm and getattr(jax.config, "jax_enable_preemption_service", False):
    _STOP.mode = "sync"
  elif handle_sigterm:
    _record_sigterm()
  elif threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
  return Context(pid, n)


def should_stop() -> bool:
  """Whether this job was asked to stop (``SIGTERM``) and should save and return now.

  Call once per step on every process, after ``initialize(handle_sigterm=True)``.
  In a launched job the answer is the same on every process at the same call:
  when ``SIGTERM`` reaches any of them, ``jax.distributed``'s preemption sync
  point picks the next call every process has still to make (about a second
  later), so a checkpoint that every process writes together has one step.
  Alone, it is True from the first call after ``SIGTERM``. Once True, it
  stays True. The launcher sends ``SIGKILL`` ``stop_grace`` seconds after
  ``SIGTERM`` to a process still running. A training loop::

    ctx = launch.initialize(handle_sigterm=True)
    ...
    for step in range(first_step, steps):
      params, opt_state, _ = dp.step(params, opt_state, dp.local_batch(my_rows(step)))
      if launch.should_stop():
        checkpoint.save(f"{ckpt_dir}/step_{step + 1}", params, opt_state, step=step + 1)
        break

  Returns:
    True from the step to stop at on.

  Raises:
    RuntimeError: :func:`initialize` was not called with ``handle_sigterm=True``
      (then ``SIGTERM`` ends the process and there is nothing to poll).
  """
  if _STOP.mode is None:
    raise RuntimeError(
        "should_stop: SIGTERM ends this process at once, so there is no request to poll; "
        "call launch.initialize(handle_sigterm=True) first to receive it as one.")
  if not _STOP.stopping:
    if _STOP.mode == "sync":
      from jax.experimental import multihost_utils
      _STOP.stopping = multihost_utils.reached_preemption_sync_point(_STOP.calls)
    else:
      _STOP.stopping = _STOP.requested.is_set()
    _STOP.calls += 1
  return _STOP.stopping


def _record_sigterm() -> None:
  """SIGTERM sets the request that :func:`should_stop` reads (a handler needs the main thread)."""
  if threading.current_thread() is not threading.main_thread():
    raise RuntimeError("initialize: `handle_sigterm=True` installs a signal handler, which "
                       "only the main thread can do; call initialize from the main thread.")
  signal.signal(signal.SIGTERM, lambda signum, frame: _STOP.requested.set())
  _STOP.mode = "flag"


def _die_with_launcher(process_id: int) -> None:
  """Ends this process when the launcher ends, however it ends."""
  fd = os.environ.get(ENV_LAUNCHER_FD)
  try:
    watch = fd is not None and stat.S_ISFIFO(os.fstat(int(fd)).st_mode)
  except (OSError, ValueError):   # not the launcher's pipe (this process was not launched)
    watch = False
  if watch:
    threading.Thread(target=_watch_launcher, args=(int(fd), process_id), daemon=True,
                     name="commopt-launch-watchdog").start()
  launcher = os.environ.get(ENV_LAUNCHER_PID)
  # Only when the launcher is the parent: an interpreter wrapper in between is
  # the parent otherwise (the pipe covers that case).
  if (sys.platform.startswith("linux") and launcher is not None
      and os.getppid() == int(launcher)):
    import ctypes
    try:
      libc = ctypes.CDLL(None, use_errno=True)
      libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
      return
    if os.getppid() != int(launcher):   # it died before the request took hold
      _exit_now(process_id)


def _watch_launcher(fd: int, process_id: int) -> None:
  try:
    while os.read(fd, 1):   # the launcher never writes: this returns b"" when it ends
      pass
  except OSError:
    return
  _exit_now(process_id)


def _exit_now(process_id: int) -> None:
  try:
    sys.stderr.write(f"commopt.launch: process {process_id}: the launcher has ended; "
                     "ending too.\n")
    sys.stderr.flush()
  finally:
    os._exit(1)


def _exit_after(hook):
  """An exception hook that prints as ``hook`` does, then ends the process at once.

  Without it, a process that raises would wait at ``jax.distributed``'s
  shutdown barrier (up to the heartbeat timeout) for peers that are blocked
  waiting for it, and the launcher would learn of the failure that much later.
  """

  def exit_after(kind, value, tb):
    try:
      hook(kind, value, tb)
      sys.stdout.flush()
      sys.stderr.flush()
    finally:
      os._exit(1)

  return exit_after


def main(argv=None) -> int:
  """``python -m commopt.launch --processes N [--cpu-devices D] [--supervise] script [args]``."""
  import argparse
  p = argparse.ArgumentParser(prog="python -m commopt.launch", description=main.__doc__)
  p.add_argument("--processes", type=int, required=True)
  p.add_argument("--cpu-devices", type=int, default=None,
                 help="simulated CPU devices per process (default: the backend's devices)")
  p.add_argument("--timeout", type=float, default=3600.0)
  p.add_argument("--grace", type=float, default=1.0,
                 help="seconds from SIGTERM to SIGKILL for the others when a process fails")
  p.add_argument("--stop-grace", type=float, default=10.0,
                 help="seconds from SIGTERM to SIGKILL when the launcher is ended (SIGTERM, "
                      "Ctrl-C): what a process that polls launch.should_stop() has to save")
  from commopt import elastic
  elastic.add_arguments(p)
  p.add_argument("script")
  p.add_argument("args", nargs=argparse.REMAINDER)
  args = p.parse_args(argv)
  argv = [args.script, *args.args]
  common = dict(devices_per_process=args.cpu_devices, timeout=args.timeout, grace=args.grace,
                stop_grace=args.stop_grace)
  try:
    if args.supervise:
      outputs = elastic.from_arguments(argv, args, common)
    else:
      outputs = [(f"process {r.process_id}", r.output)
                 for r in launch(argv, args.processes, **common)]
  except (LaunchError, ValueError) as e:
    print(e, file=sys.stderr)
    return 1
  except KeyboardInterrupt as e:
    print(f"{e or 'launch: interrupted'}; every process was ended.", file=sys.stderr)
    return 130
  for title, out in outputs:
    print(f"--- {title} ---\n{out}", end="" if out.endswith("\n") else "\n")
  return 0

if __name__ == "__main__":
  sys.exit(main())
