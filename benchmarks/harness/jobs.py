"""``python -m commopt.launch`` jobs inside a benchmark's namespaces (:mod:`harness.netns`).

The driver writes the job's configuration to ``CONFIG`` (JSON), launches ``script CONFIG
RESULT`` and reads ``RESULT``, which process 0 writes. The lines of the job's output that
start with two spaces (the workers' reports) are printed once it has ended. A job that fails
raises ``RuntimeError`` with its output's tail; one interrupted (Ctrl-C, SIGTERM) is ended,
its processes with it.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import tempfile

from harness import ROOT


def driver_out(args, worker) -> pathlib.Path | None:
  """A benchmark's start: in a process of its job (``--worker CONFIG RESULT``), runs
  ``worker(CONFIG, RESULT)`` and returns None; in the driver, returns the ``--out`` folder,
  made."""
  if args.worker:
    worker(*args.worker)
    return None
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  return out


def environment() -> dict:
  """This process's environment with the repository first on ``PYTHONPATH``."""
  return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def end(proc: subprocess.Popen) -> None:
  """Ends a launcher started in a session of its own: SIGTERM (the launcher ends its processes
  on it), SIGKILL if it has not ended within 30 s."""
  os.killpg(proc.pid, signal.SIGTERM)
  try:
    proc.wait(30)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def echo(out: str) -> None:
  """The workers' report lines (two spaces in) of a launcher's output."""
  for line in out.splitlines():
    if line.startswith("  "):
      print(line, flush=True)


def launch_job(ns, processes: int, cfg: dict, timeout: float, script: list,
               cpu_devices: int | None = None, xla_flags: str = "") -> dict:
  """``python -m commopt.launch`` inside the namespace: ``processes`` copies of ``script CONFIG
  RESULT`` under ``timeout`` (``cpu_devices`` CPU devices each, if given; ``xla_flags``
  added to ``XLA_FLAGS``); process 0 writes RESULT. The launcher's coordinator port is one
  it found free inside the namespace."""
  with tempfile.TemporaryDirectory(prefix="commopt-net-") as tmp:
    config, result = pathlib.Path(tmp, "config.json"), pathlib.Path(tmp, "result.json")
    config.write_text(json.dumps(cfg))
    argv = ["ip", "netns", "exec", ns.name, sys.executable, "-m", "commopt.launch",
            "--processes", str(processes), "--host-memory", cfg.get("host_memory", "reuse"),
            *(["--cpu-devices", str(cpu_devices)] if cpu_devices else []),
            "--timeout", str(timeout), *script, str(config), str(result)]
    env = environment()
    if xla_flags:
      env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + xla_flags).strip()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
      out, _ = proc.communicate(timeout=timeout + 60)
    except BaseException:
      end(proc)
      raise
    echo(out)
    if proc.returncode != 0 or not result.exists():
      raise RuntimeError(f"the {processes}-process job of {', '.join(cfg['methods'])} failed "
                         f"(exit {proc.returncode}):\n" + out[-4000:])
    return json.loads(result.read_text())


def launch_nodes(nodes, cfg: dict, timeout: float, script: list) -> dict:
  """One job over both of :class:`harness.netns.Nodes`: a launcher in each namespace running
  ``cfg["local"]`` copies of ``script CONFIG RESULT`` (one CPU device each), the coordinator
  on node 0; node 0's process 0 writes RESULT. Either launcher failing ends the other (its
  processes' collectives fail)."""
  port = random.randrange(20000, 60000)   # a fresh namespace: nothing listens there yet
  with tempfile.TemporaryDirectory(prefix="commopt-nodes-") as tmp:
    config, result = pathlib.Path(tmp, "config.json"), pathlib.Path(tmp, "result.json")
    config.write_text(json.dumps(cfg))
    procs = []
    try:
      for rank in (1, 0):
        argv = ["ip", "netns", "exec", nodes.names[rank], sys.executable, "-m",
                "commopt.launch", "--nodes", "2", "--node-rank", str(rank), "--coordinator",
                f"{nodes.addresses[0]}:{port}", "--processes", str(cfg["local"]),
                "--cpu-devices", "1", "--timeout", str(timeout), *script, str(config),
                str(result)]
        procs.append(subprocess.Popen(argv, env=environment(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
      outs = [p.communicate(timeout=timeout + 60)[0] for p in procs]
    finally:
      for p in procs:
        if p.poll() is None:
          end(p)
    echo(outs[1])
    if any(p.returncode for p in procs) or not result.exists():
      raise RuntimeError("the two-node job failed (exit codes "
                         f"{[p.returncode for p in procs]}):\n" + outs[1][-3000:]
                         + "\n--- node 1 ---\n" + outs[0][-3000:])
    return json.loads(result.read_text())
