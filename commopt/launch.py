"""Start a multi-process JAX program on this machine, and join one from inside it.

:func:`launch` runs ``N`` copies of a Python script, process ``i`` of ``N``,
connected through ``jax.distributed`` (gloo on CPUs, NCCL on GPUs), the way a
cluster scheduler would start them on ``N`` hosts; tests, benchmarks and the
demo (``--processes N``) use it. The script calls :func:`initialize` first
thing, which reads what :func:`launch` put in its environment; run alone,
:func:`initialize` does nothing and the script is an ordinary one-process
program.

Failures end the run within a bounded time instead of hanging it: when one
process exits with an error, :func:`launch` ends the others after ``grace``
seconds and raises :class:`LaunchError` naming the first to fail and its exit
code; past ``timeout`` it ends them all. Inside the processes,
``jax.distributed``'s heartbeat (``heartbeat_timeout`` seconds) makes a peer
stuck waiting on a dead process fail by itself as well.

A process that dies (killed, crashed) is reported by :func:`launch` at once.
One that raises a Python error waits at ``jax.distributed``'s shutdown barrier
for at most the heartbeat timeout, and JAX then aborts every process
(``SIGABRT``, code -6), so the run still ends within that bound.

Example (a script ``train.py`` that calls ``commopt.launch.initialize()``)::

    from commopt import launch
    launch.launch(["train.py", "--steps", "10"], processes=2, devices_per_process=4)

or from a shell::

    python -m commopt.launch --processes 2 --cpu-devices 4 train.py --steps 10
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
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


class LaunchError(RuntimeError):
  """A launched process failed or the run timed out; ``results`` holds every process's outcome."""

  def __init__(self, message: str, results: list):
    super().__init__(message)
    self.results = results


@dataclasses.dataclass
class ProcessResult:
  """One launched process: its id, exit code (negative: ended by that signal) and output."""
  process_id: int
  returncode: Optional[int]
  output: str


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


def launch(argv: Sequence[str], processes: int, *, devices_per_process: Optional[int] = None,
           timeout: float = 600.0, grace: float = 10.0, heartbeat_timeout: int = 20,
           coordinator: Optional[str] = None, env: Optional[dict] = None,
           python: str = sys.executable, echo: bool = False) -> list[ProcessResult]:
  """Runs ``python argv...`` as ``processes`` processes of one ``jax.distributed`` job.

  Args:
    argv: the script and its arguments.
    processes: how many processes (>= 1).
    devices_per_process: CPU devices each process simulates
      (``jax_num_cpu_devices``); None keeps the backend's own devices (GPUs).
    timeout: seconds the whole run may take before every process is ended.
    grace: seconds the others get to finish after one fails.
    heartbeat_timeout: ``jax.distributed``'s heartbeat timeout in the processes.
    coordinator: ``host:port`` of process 0's coordinator (default: a free
      local port).
    env: extra environment variables for every process.
    python: the interpreter.
    echo: print each process's output as it ends.

  Returns:
    One :class:`ProcessResult` per process, in process order, all exit code 0.

  Raises:
    LaunchError: a process exited non-zero (the others are ended after
      ``grace``), or the run exceeded ``timeout``.
  """
  for name, value in (("processes", processes), ("heartbeat_timeout", heartbeat_timeout)):
    base.check_positive_int(name, value, fn="launch")
  if devices_per_process is not None:
    base.check_positive_int("devices_per_process", devices_per_process, fn="launch")
  for name, value in (("timeout", timeout), ("grace", grace)):
    base.check_number(name, value, fn="launch", low=0, what="a positive number of seconds")
  coordinator = coordinator or f"127.0.0.1:{free_port()}"
  logs, procs = [], []
  for i in range(processes):
    child_env = dict(os.environ, **(env or {}))
    child_env.update({ENV_PROCESS_ID: str(i), ENV_NUM_PROCESSES: str(processes),
                      ENV_COORDINATOR: coordinator, ENV_HEARTBEAT: str(heartbeat_timeout)})
    if devices_per_process is not None:
      child_env[ENV_LOCAL_DEVICES] = str(devices_per_process)
    log = open(_log_path(i), "w+")
    logs.append(log)
    procs.append(subprocess.Popen([python, *argv], env=child_env, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True))
  deadline = time.monotonic() + timeout
  failed, stop_at, reason = None, None, None
  # Ended by SIGTERM (a benchmark's driver, a scheduler): end the processes too.
  previous = None
  if threading.current_thread() is threading.main_thread():
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
  try:
    while True:
      codes = [p.poll() for p in procs]   # every process, each time
      if all(c is not None for c in codes):
        break
      now = time.monotonic()
      if failed is None:
        failed = next((i for i, c in enumerate(codes) if c not in (None, 0)), None)
        if failed is not None:
          stop_at = now + grace
      if now > deadline:
        reason = f"the run exceeded its timeout of {timeout:g} s"
        break
      if stop_at is not None and now > stop_at:
        break
      time.sleep(0.05)
  finally:
    for p in procs:
      _end(p)
    if previous is not None:
      signal.signal(signal.SIGTERM, previous)
  results = []
  for i, (p, log) in enumerate(zip(procs, logs)):
    log.seek(0)
    results.append(ProcessResult(i, p.returncode, log.read()))
    log.close()
    os.unlink(log.name)
    if echo:
      print(f"--- process {i} (exit {p.returncode}) ---\n{results[-1].output}", flush=True)
  if failed is None:
    failed = next((i for i, r in enumerate(results) if r.returncode != 0), None)
  if reason is None and failed is not None:
    bad = ", ".join(f"process {r.process_id} (code {r.returncode})" for r in results
                    if r.returncode != 0)
    reason = (f"process {failed} of {processes} failed first; exited with an error: {bad} "
              "(negative codes: ended by that signal)")
  if reason is not None:
    tail = results[failed].output[-3000:] if failed is not None else ""
    raise LaunchError(f"launch: {reason}.\n{tail}", results)
  return results


def _raise_interrupt(signum, frame):
  raise KeyboardInterrupt(f"launch: ended by signal {signum}")


def _log_path(i: int) -> str:
  fd, path = tempfile.mkstemp(prefix=f"commopt-launch-{i}-", suffix=".log")
  os.close(fd)
  return path


def _end(p: subprocess.Popen) -> None:
  """Ends ``p`` and its children (its own session): SIGTERM, then SIGKILL after 5 s."""
  if p.poll() is not None:
    return
  for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
    try:
      os.killpg(p.pid, sig)
    except ProcessLookupError:
      return
    try:
      p.wait(wait)
      return
    except subprocess.TimeoutExpired:
      continue


def initialize() -> Context:
  """Joins the job :func:`launch` started (call before any other JAX use); alone, a no-op.

  Sets ``jax_num_cpu_devices`` when the launcher asked for simulated CPU
  devices, picks gloo for CPU collectives, and calls
  ``jax.distributed.initialize`` with the coordinator, process count, id and
  heartbeat timeout from the environment (the heartbeat also bounds the
  shutdown barrier a process passes at exit).
  """
  import jax
  if ENV_PROCESS_ID not in os.environ:
    return Context(0, 1)
  pid, n = int(os.environ[ENV_PROCESS_ID]), int(os.environ[ENV_NUM_PROCESSES])
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
  return Context(pid, n)


def main(argv=None) -> int:
  """``python -m commopt.launch --processes N [--cpu-devices D] script.py [args...]``."""
  import argparse
  p = argparse.ArgumentParser(prog="python -m commopt.launch", description=main.__doc__)
  p.add_argument("--processes", type=int, required=True)
  p.add_argument("--cpu-devices", type=int, default=None,
                 help="simulated CPU devices per process (default: the backend's devices)")
  p.add_argument("--timeout", type=float, default=3600.0)
  p.add_argument("script")
  p.add_argument("args", nargs=argparse.REMAINDER)
  args = p.parse_args(argv)
  try:
    results = launch([args.script, *args.args], args.processes,
                     devices_per_process=args.cpu_devices, timeout=args.timeout)
  except (LaunchError, ValueError) as e:
    print(e, file=sys.stderr)
    return 1
  except KeyboardInterrupt as e:
    print(f"{e or 'launch: interrupted'}; every process was ended.", file=sys.stderr)
    return 130
  for r in results:
    print(f"--- process {r.process_id} ---\n{r.output}", end="" if r.output.endswith("\n") else "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
