"""Elastic runs: a job restarted on the processes left when one dies, and the lost ones
taken back later.

:func:`supervise` (``python -m commopt.launch --supervise`` on the command line) runs a
script as :func:`commopt.launch.launch` does and starts it again on the processes that are
left after a failure; the script restores its latest checkpoint
onto however many workers it now has (:mod:`commopt.checkpoint`'s resize rule).
``examples/elastic.py`` is such a script.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Optional, Sequence

from commopt._src import base
from commopt.launch import ENV_ATTEMPT, LaunchError, launch


@dataclasses.dataclass
class Attempt:
  """One start of a supervised job (:func:`supervise`).

  Attributes:
    processes: how many processes it ran.
    why: why it started: ``"start"``, ``"lost"`` (after processes failed) or
      ``"rejoin"`` (back to the full count after a run on fewer).
    results: every process's :class:`ProcessResult`.
    lost: the id of the process that failed first (the others may fail a
      moment later, when their collectives find it gone), empty when it
      ended normally.
    seconds: how long it ran.
  """
  processes: int
  why: str
  results: list
  lost: tuple
  seconds: float

  @property
  def stopped(self) -> bool:
    """Whether it ended because the supervisor asked it to (to let workers rejoin)."""
    return not self.lost and any(r.asked_to_stop for r in self.results)


def supervise(argv: Sequence[str], processes: int, *, min_processes: int = 1,
              max_restarts: int = 3, rejoin_after: Optional[float] = None,
              devices_per_process: Optional[int] = None, timeout: float = 3600.0,
              grace: float = 1.0, stop_grace: float = 30.0, heartbeat_timeout: int = 20,
              env: Optional[dict] = None, python: str = sys.executable,
              say=None, host_memory: str = "reuse") -> list[Attempt]:
  """Runs ``argv`` as :func:`launch` does, and restarts it on the workers left when one dies.

  A supervisor on top of :func:`launch`: when processes fail (a crash, a
  ``SIGKILL``, a non-zero exit), the launcher ends the others (they would
  wait forever in their next collective) and the supervisor starts the job
  again on the processes that are left, ``processes − lost``, as long as at
  least ``min_processes`` are and fewer than ``max_restarts`` restarts were
  needed. With ``rejoin_after``, a job running on fewer than ``processes``
  is asked to stop that many seconds after it started (``SIGTERM``, which
  :func:`should_stop` reports) and is started again on all ``processes``:
  the lost workers join back.

  The script makes the restarts work; ``examples/elastic.py`` is one:

  - it saves checkpoints as it goes (for DiLoCo, at every outer step: the
    inner steps since then are all a failure can lose) and, when started,
    restores the latest one with :mod:`commopt.checkpoint`, which resizes
    the optimizer state (error-feedback residuals, per-worker parameters)
    onto the number of workers it now has by the documented rule;
  - it splits a fixed global batch over the devices it has;
  - it calls ``initialize(handle_sigterm=True)`` and :func:`should_stop` once
    per step, and on a stop request saves and exits 0 (at the next outer-step
    boundary, for DiLoCo: a rejoin loses nothing);
  - :func:`attempt` tells it which start this is.

  A job of one process per host would be restarted the same way by a
  cluster's scheduler; this supervisor does it for processes on this machine.
  Every start waits for the previous one's processes to be gone.

  Args:
    argv: the script and its arguments.
    processes: processes at the start (and after a rejoin).
    min_processes: the fewest to continue on (>= 1).
    max_restarts: restarts after failures before giving up (>= 0).
    rejoin_after: seconds a run on fewer processes lasts before the full
      count is started again (the request to stop waits until every process
      catches ``SIGTERM``, as :func:`launch`'s ``stop_after``); None never
      rejoins.
    devices_per_process: as in :func:`launch`.
    timeout: seconds for the whole supervised job, every start included.
    grace: as in :func:`launch`.
    stop_grace: seconds a process asked to stop has before ``SIGKILL`` (give it
      time to reach its next checkpoint; one ended then still counts as stopped,
      and the rejoin starts from its last checkpoint).
    heartbeat_timeout: as in :func:`launch` (it also bounds how long the
      survivors of a failure wait in a collective before they fail).
    env: extra environment variables; :data:`ENV_ATTEMPT` is added.
    python: the interpreter.
    say: where progress lines go (None: printed, flushed).
    host_memory: as :func:`~commopt.launch.launch`'s.

  Returns:
    Every :class:`Attempt`, in order; the last one ended normally.

  Raises:
    LaunchError: fewer than ``min_processes`` were left, ``max_restarts``
      restarts did not suffice, or the job exceeded ``timeout``; ``results``
      holds the last start's processes.

  Example::

    from commopt import elastic
    attempts = elastic.supervise(["examples/elastic.py"], processes=4, min_processes=2,
                                rejoin_after=60, devices_per_process=1)
  """
  fn = "supervise"
  base.check_positive_int("processes", processes, fn=fn)
  min_processes = base.check_integer("min_processes", min_processes, fn=fn,
                                     rule=f"an integer from 1 to processes ({processes})",
                                     ok=lambda v: 1 <= v <= processes)
  max_restarts = base.check_int("max_restarts", max_restarts, fn=fn, minimum=0)
  if rejoin_after is not None:
    base.check_number("rejoin_after", rejoin_after, fn=fn, low=0,
                      what="None or a positive number of seconds")
  base.check_number("timeout", timeout, fn=fn, low=0, what="a positive number of seconds")
  say = say or (lambda line: print(line, flush=True))
  deadline = time.monotonic() + timeout
  attempts: list[Attempt] = []
  n, why, restarts = processes, "start", 0
  while True:
    left = deadline - time.monotonic()
    if left <= 0:
      raise LaunchError(f"{fn}: the job exceeded its timeout of {timeout:g} s after "
                        f"{len(attempts)} starts.", attempts[-1].results if attempts else [])
    say(f"{fn}: start {len(attempts)} on {n} of {processes} processes ({why})")
    began = time.monotonic()
    try:
      results = launch(argv, n, devices_per_process=devices_per_process, timeout=left,
                       grace=grace, stop_grace=stop_grace, heartbeat_timeout=heartbeat_timeout,
                       env=dict(env or {}, **{ENV_ATTEMPT: str(len(attempts))}), python=python,
                       stop_after=rejoin_after if n < processes else None,
                       host_memory=host_memory)
      error = None
    except LaunchError as e:
      results, error = e.results, e
    # The first to fail is the one lost: the others may fail on their own a moment later,
    # when their collectives find it gone.
    lost = () if error is None or error.first_failed is None else (error.first_failed,)
    if error is not None and not lost:   # the timeout ended it
      raise error
    attempts.append(Attempt(processes=n, why=why, results=results, lost=lost,
                            seconds=time.monotonic() - began))
    if error is None and not attempts[-1].stopped:
      say(f"{fn}: done after {len(attempts)} starts")
      return attempts
    if error is None:
      late = [r.process_id for r in results if r.asked_to_stop and r.ended_by_launch]
      if late:
        say(f"{fn}: processes {', '.join(map(str, late))} did not stop within stop_grace "
            f"({stop_grace:g} s) of the request and were ended; their steps since the last "
            "checkpoint are lost")
      n, why = processes, "rejoin"
      continue
    restarts += 1
    codes = ", ".join(f"{i} (code {results[i].returncode})" for i in lost)
    if n - len(lost) < min_processes or restarts > max_restarts:
      raise LaunchError(
          f"{fn}: processes {codes} failed; {n - len(lost)} left, min_processes is "
          f"{min_processes}, restarts so far {restarts} of at most {max_restarts}. {error}",
          results)
    say(f"{fn}: processes {codes} failed; restarting on {n - len(lost)}")
    n, why = n - len(lost), "lost"
