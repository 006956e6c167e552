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
processes left when one dies. The command line (``python -m commopt.launch``) is
:mod:`commopt.launch.__main__`.

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
import stat
import sys
import threading
from typing import Optional, Sequence

from commopt._src import base
from commopt._src import host_memory as _host_memory
from commopt._src.process_group import TAIL_LINES, ProcessGroup, ProcessResult  # noqa: F401

ENV_PROCESS_ID = "COMMOPT_PROCESS_ID"
ENV_NUM_PROCESSES = "COMMOPT_NUM_PROCESSES"
ENV_COORDINATOR = "COMMOPT_COORDINATOR"
ENV_LOCAL_DEVICES = "COMMOPT_LOCAL_DEVICES"
ENV_HEARTBEAT = "COMMOPT_HEARTBEAT_TIMEOUT"
ENV_LAUNCHER_PID = "COMMOPT_LAUNCHER_PID"
ENV_LAUNCHER_FD = "COMMOPT_LAUNCHER_FD"
ENV_ATTEMPT = "COMMOPT_ATTEMPT"
"""Set by :func:`commopt.elastic.supervise`: which start of the job this is (0 the first,
then one more per restart); read it with :func:`attempt`."""

_PR_SET_PDEATHSIG = 1   # <linux/prctl.h>


class LaunchError(RuntimeError):
  """A launched process failed or the run timed out; ``results`` holds every process's outcome
  and ``first_failed`` the id of the process that failed first (None after a timeout)."""

  def __init__(self, message: str, results: list, first_failed: Optional[int] = None):
    super().__init__(message)
    self.results = results
    self.first_failed = first_failed


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
           echo: bool = False, stop_after: Optional[float] = None, nodes: int = 1,
           node_rank: int = 0, host_memory: str = "reuse") -> list[ProcessResult]:
  """Runs ``python argv...`` as ``processes`` processes of one ``jax.distributed`` job.

  On several machines (``nodes > 1``) run it once on each, with the same
  ``processes``, ``nodes`` and ``coordinator`` and its own ``node_rank``: the
  job's ``nodes * processes`` processes are numbered node by node (node ``r``
  runs processes ``r * processes`` to ``(r + 1) * processes - 1``), and
  process 0, on node 0, hosts the coordinator. Each launcher ends the
  processes of its own machine; those of another machine notice a failure
  through ``jax.distributed`` (its heartbeat, or the collective that fails)
  and end with an error, which ends their launcher's run in turn.

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
      local port); with ``nodes > 1`` it is required: an address of node 0 that
      every node reaches, and a port free there.
    env: extra environment variables for every process.
    python: the interpreter.
    echo: print each process's output as it ends.
    stop_after: seconds after which every process still running is asked to
      stop (``SIGTERM``, which a process that polls :func:`should_stop`
      receives as a request; ``SIGKILL`` after ``stop_grace``); those that
      then exit 0 end the run normally, marked ``asked_to_stop``, and so do
      those still running at the end of ``stop_grace`` (code ``-9``, also
      ``ended_by_launch``: what they did since their last checkpoint is lost;
      give a DiLoCo script a ``stop_grace`` longer than a period). On Linux the
      request waits until every process catches ``SIGTERM`` (it has called
      ``initialize(handle_sigterm=True)`` or set a handler of its own), so that
      a process still starting up is not killed by it; one that never catches
      it is never asked. None (the default) never asks.
    nodes: how many machines run the job (>= 1), each with a launcher of its own.
    node_rank: which of them this one is (``0 <= node_rank < nodes``).
    host_memory: ``"reuse"`` (the default): each process's glibc ``malloc`` keeps the
      memory it frees (``MALLOC_MMAP_MAX_=0``, ``MALLOC_TRIM_THRESHOLD_`` at its
      largest and ``MALLOC_ARENA_MAX=1`` in its environment: one arena for every thread,
      since a thread's own arena maps any block above 64 MB afresh), so a step's
      temporaries are not mapped and faulted in afresh at every step (see
      :func:`reuse_host_memory`), unless the environment
      already holds a malloc setting of yours (a ``MALLOC_*`` variable, a
      ``glibc.malloc.*`` tunable); ``"system"``: the C library's defaults.

  Returns:
    One :class:`ProcessResult` per process of this machine, in process order (their
    ``process_id`` is the job's), all exit code 0 but those ended at the end of
    ``stop_grace`` after a request to stop.

  Raises:
    LaunchError: a process exited non-zero (the others are ended at once), or
      the run exceeded ``timeout``; its message names the process that failed
      first and ends with its last :data:`TAIL_LINES` lines of output.
    KeyboardInterrupt: the launcher received ``SIGTERM`` or ``SIGINT``; every
      process was ended first.
  """
  for name, value in (("processes", processes), ("heartbeat_timeout", heartbeat_timeout),
                      ("nodes", nodes)):
    base.check_positive_int(name, value, fn="launch")
  if not isinstance(node_rank, int) or isinstance(node_rank, bool) or not 0 <= node_rank < nodes:
    raise ValueError(f"launch: `node_rank` must be an integer in [0, nodes={nodes}), got "
                     f"{node_rank!r}.")
  if nodes > 1 and not coordinator:
    raise ValueError(f"launch: with nodes={nodes}, `coordinator` must be node 0's "
                     "'host:port' (an address every node reaches, a free port there); got "
                     f"{coordinator!r}.")
  if devices_per_process is not None:
    base.check_positive_int("devices_per_process", devices_per_process, fn="launch")
  base.check_number("timeout", timeout, fn="launch", low=0, what="a positive number of seconds")
  if stop_after is not None:
    base.check_number("stop_after", stop_after, fn="launch", low=0, low_open=False,
                      what="None or a number of seconds >= 0")
  for name, value in (("grace", grace), ("stop_grace", stop_grace)):
    base.check_number(name, value, fn="launch", low=0, low_open=False,
                      what="a number of seconds >= 0")
  memory_env = _host_memory.env_for({**os.environ, **(env or {})},
                                    _host_memory.check_mode(host_memory, "launch"))
  coordinator = coordinator or f"127.0.0.1:{free_port()}"
  total = nodes * processes

  def env_of(process_id: int, read_end: int) -> dict:
    child = dict(os.environ, **memory_env, **(env or {}))
    child.update({ENV_PROCESS_ID: str(process_id), ENV_NUM_PROCESSES: str(total),
                  ENV_COORDINATOR: coordinator, ENV_HEARTBEAT: str(heartbeat_timeout),
                  ENV_LAUNCHER_PID: str(os.getpid()), ENV_LAUNCHER_FD: str(read_end)})
    if devices_per_process is not None:
      child[ENV_LOCAL_DEVICES] = str(devices_per_process)
    return child

  run = ProcessGroup(processes, first_id=node_rank * processes, total=total)
  with run.catching_signals():
    try:
      run.start(argv, python, env_of)
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


def reuse_host_memory() -> bool:
  """Keeps the memory this process frees for its next allocations (glibc ``malloc``: no
  ``mmap`` for large requests, no trimming, one arena for every thread), from now on;
  what :func:`launch` asks for in its processes by default (``host_memory="reuse"``).
  Call it first thing in a one-process program on CPUs.

  XLA:CPU allocates a step's temporary buffers at every execution and frees them at its
  end; by default glibc maps each large one afresh and unmaps it at ``free``, so every step
  faults its pages in again. The process then keeps its peak heap for its lifetime. Threads
  that allocated before the call keep their own arenas, where a block above 64 MB is
  still mapped afresh: it warns when JAX has already started. Returns False (with one log
  line) where the C library is not glibc or refuses.
  """
  return _host_memory.reuse()


def attempt() -> int:
  """Which start of a :func:`commopt.elastic.supervise` job this process belongs to (0 the
  first; 0 alone)."""
  return int(os.environ.get(ENV_ATTEMPT, "0"))


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


MOVED = {
    "supervise": ("commopt.elastic.supervise", "the supervisor is commopt.elastic's"),
    "Attempt": ("commopt.elastic.Attempt", "the supervisor is commopt.elastic's"),
    "main": ("commopt.launch.__main__.main", "the command line is a module of its own"),
}
"""Names that left this module: ``{name: (new home, why)}`` (see CHANGELOG.md)."""


def __getattr__(name):
  if name in MOVED:
    home, why = MOVED[name]
    raise AttributeError(f"commopt.launch.{name} moved to {home} ({why}); see CHANGELOG.md.",
                         name=name, obj=None)
  raise AttributeError(f"module 'commopt.launch' has no attribute {name!r}")
