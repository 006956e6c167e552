"""How a launched run ends: with its launcher, on SIGTERM, and at a process's failure.

Each test writes a tiny worker script into its ``tmp_path``; the workers write
their pids there, every subprocess runs under a timeout, and whatever is left
at the end is killed by pid (only processes these tests started).
"""

import os
import pathlib
import platform
import re
import signal
import subprocess
import sys
import time

import pytest

from commopt import launch
from commopt.launch import __main__ as launch_cli
from commopt.testing.processes import SLEEPING_WORKER, all_gone, kill_own, pids_in

# The checks read processes' states and parents from /proc.
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))

SLEEPS = SLEEPING_WORKER

# A training loop in lockstep (a collective per step) that saves when asked.
SAVES = """
import os, pathlib, sys
from commopt import launch
ctx = launch.initialize(handle_sigterm=True)
from jax.experimental import multihost_utils
out = pathlib.Path(sys.argv[1])
(out / f"{ctx.process_id}.pid").write_text(str(os.getpid()))
step = 0
while not launch.should_stop():
  multihost_utils.sync_global_devices("step")
  step += 1
(out / f"{ctx.process_id}.saved").write_text(str(step))
"""

# Process 1 fails (raises, or is killed) while process 0 waits for it in a barrier.
FAILS = """
import os, pathlib, signal, sys, time
from commopt import launch
ctx = launch.initialize()
from jax.experimental import multihost_utils
out, how = pathlib.Path(sys.argv[1]), sys.argv[2]
(out / f"{ctx.process_id}.pid").write_text(str(os.getpid()))
multihost_utils.sync_global_devices("joined")
if ctx.process_id == 1:
  for step in range(3):
    print(f"process 1 at step {step}", flush=True)
  (out / "failed_at").write_text(repr(time.time()))
  if how == "raises":
    raise RuntimeError("process 1 broke at step 3")
  os.kill(os.getpid(), signal.SIGKILL)
# Process 0 waits outside any collective: one blocked in a collective fails on its own when
# its peer's connection drops, milliseconds later, and which exit the launcher sees first
# is then a race.
time.sleep(600)
"""


def _wait_for(paths, n: int, proc: subprocess.Popen, seconds: float = 90):
  deadline = time.monotonic() + seconds
  while time.monotonic() < deadline and len(list(paths())) < n and proc.poll() is None:
    time.sleep(0.1)
  found = list(paths())
  assert len(found) == n, (proc.poll(), found)
  return found


@pytest.fixture
def out(tmp_path):
  """A folder for the workers' files; the workers found there are killed at the end."""
  yield tmp_path
  kill_own(pids_in(tmp_path), tmp_path)


def _cli(script: pathlib.Path, out: pathlib.Path, *args: str) -> subprocess.Popen:
  return subprocess.Popen(
      [sys.executable, "-m", "commopt.launch", "--processes", "2", "--cpu-devices", "1",
       "--timeout", "120", *args, str(script), str(out)],
      cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_the_processes_die_with_a_killed_launcher(out):
  script = out / "sleeps.py"
  script.write_text(SLEEPS)
  proc = _cli(script, out)
  try:
    _wait_for(lambda: out.glob("*.pid"), 2, proc)
    proc.kill()   # SIGKILL: the launcher cleans nothing up
    proc.communicate(timeout=30)
    assert all_gone(pids_in(out), 5), "a process outlived its launcher"
  finally:
    proc.kill()


@pytest.mark.slow
def test_the_processes_die_with_a_killed_launcher_that_is_not_their_parent(out):
  """An interpreter wrapper stands between them (no parent-death signal): the pipe ends them."""
  script = out / "sleeps.py"
  script.write_text(SLEEPS)
  wrapper = out / "python.sh"
  wrapper.write_text(f'#!/bin/sh\n"{sys.executable}" "$@"\nexit $?\n')
  wrapper.chmod(0o755)
  driver = out / "driver.py"
  driver.write_text(
      "import sys\nfrom commopt import launch\n"
      f"launch.launch([{str(script)!r}, {str(out)!r}], processes=2, devices_per_process=1, "
      f"timeout=120, python={str(wrapper)!r})\n")
  proc = subprocess.Popen([sys.executable, str(driver)], cwd=ROOT, env=ENV,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    _wait_for(lambda: out.glob("*.pid"), 2, proc)
    pids = pids_in(out)
    assert all(_parent(p) != proc.pid for p in pids)   # the wrapper is their parent
    proc.kill()
    proc.communicate(timeout=30)
    assert all_gone(pids, 5), "a process outlived its launcher"
  finally:
    proc.kill()


def _parent(pid: int) -> int:
  with open(f"/proc/{pid}/stat") as f:
    return int(f.read().split(")")[-1].split()[1])


@pytest.mark.slow
def test_sigterm_ends_the_processes_at_once(out):
  """jax.distributed's preemption handler would have them ignore SIGTERM; they end at once."""
  script = out / "sleeps.py"
  script.write_text(SLEEPS)
  proc = _cli(script, out)
  try:
    _wait_for(lambda: out.glob("*.pid"), 2, proc)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert all_gone(pids_in(out), 2), "a process outlived SIGTERM by 2 s"
    text, _ = proc.communicate(timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 130, text
    assert "launch: ended by signal 15; every process was ended." in text, text
    assert took < 5, f"the launcher took {took:.1f} s to end"
  finally:
    proc.kill()


@pytest.mark.slow
def test_sigterm_lets_every_process_save_at_the_same_step(out):
  script = out / "saves.py"
  script.write_text(SAVES)
  proc = _cli(script, out)
  try:
    _wait_for(lambda: out.glob("*.pid"), 2, proc)
    time.sleep(1)   # some steps in
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    text, _ = proc.communicate(timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 130 and "ended by signal 15" in text, text
    saved = sorted(out.glob("*.saved"))
    assert [p.name for p in saved] == ["0.saved", "1.saved"], text
    steps = {int(p.read_text()) for p in saved}
    assert len(steps) == 1 and steps.pop() > 0, "the processes stopped at different steps"
    assert took < 8, f"the launcher took {took:.1f} s to end"
    assert all_gone(pids_in(out), 1)
  finally:
    proc.kill()


@pytest.mark.parametrize("how", ["raises", "killed"])
def test_a_failure_ends_the_run_at_once_naming_the_process(out, how):
  script = out / "fails.py"
  script.write_text(FAILS)
  with pytest.raises(launch.LaunchError) as err:
    launch.launch([str(script), str(out), how], processes=2, devices_per_process=1,
                  timeout=120, env={"PYTHONPATH": str(ROOT)})
  took = time.time() - float((out / "failed_at").read_text())
  assert took < 5, f"the run ended {took:.1f} s after the failure"
  message = str(err.value)
  code = 1 if how == "raises" else -signal.SIGKILL
  assert "process 1 of 2 failed first; exit codes: " in message, message
  assert f"process 1 (code {code})" in message, message
  assert "process 1 at step 2" in message, message
  if how == "raises":
    assert "RuntimeError: process 1 broke at step 3" in message, message
  assert [r.process_id for r in err.value.results] == [0, 1]
  assert all(r.returncode not in (None, 0) for r in err.value.results)
  assert all_gone(pids_in(out), 1)


def test_should_stop_needs_handle_sigterm():
  with pytest.raises(RuntimeError, match=r"should_stop: .*initialize\(handle_sigterm=True\)"):
    launch.should_stop()
  with pytest.raises(ValueError, match=r"initialize: `handle_sigterm` must be True or False, "
                                       r"got 'yes'"):
    launch.initialize(handle_sigterm="yes")


def test_should_stop_alone_turns_true_at_sigterm():
  code = ("import os, signal\nfrom commopt import launch\n"
          "launch.initialize(handle_sigterm=True)\n"
          "before = launch.should_stop()\n"
          "os.kill(os.getpid(), signal.SIGTERM)\n"
          "print(before, launch.should_stop(), launch.should_stop())\n")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split() == ["False", "True", "True"], proc.stdout


def test_launch_checks_its_graces():
  for name in ("grace", "stop_grace"):
    with pytest.raises(ValueError, match=rf"launch: `{name}` must be a number of seconds >= 0, "
                                         r"got -1"):
      launch.launch(["x.py"], processes=1, **{name: -1})


IGNORES = """
import os, pathlib, sys, time
from commopt import launch
ctx = launch.initialize(handle_sigterm=True)   # and never asks should_stop
pathlib.Path(sys.argv[1], f"{ctx.process_id}.pid").write_text(str(os.getpid()))
time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.parametrize("twice", [False, True])
def test_a_process_that_does_not_stop_is_killed_after_stop_grace(out, twice):
  """SIGKILL after ``--stop-grace``; at once when the launcher is ended a second time."""
  script = out / "ignores.py"
  script.write_text(IGNORES)
  proc = _cli(script, out, "--stop-grace", "30" if twice else "1.5")
  try:
    _wait_for(lambda: out.glob("*.pid"), 2, proc)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    if twice:
      time.sleep(0.5)
      proc.send_signal(signal.SIGTERM)
    text, _ = proc.communicate(timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 130 and "ended by signal 15" in text, text
    assert (took < 3) if twice else (1.5 <= took < 4), f"the launcher took {took:.1f} s to end"
    assert all_gone(pids_in(out), 1)
  finally:
    proc.kill()


@pytest.mark.slow
def test_a_run_past_its_timeout_is_ended(out):
  script = out / "sleeps.py"
  script.write_text(SLEEPS)
  t0 = time.monotonic()
  with pytest.raises(launch.LaunchError, match=r"launch: the run exceeded its timeout of 3 s; "
                                               r"every process was ended") as err:
    launch.launch([str(script), str(out)], processes=2, devices_per_process=1, timeout=3,
                  env={"PYTHONPATH": str(ROOT)})
  assert time.monotonic() - t0 < 6
  assert all(r.returncode is not None for r in err.value.results)
  assert all_gone(pids_in(out), 1)


# Every process's id, and a sum over every device of the job.
JOINS = """
import pathlib, sys
from commopt import launch
ctx = launch.initialize()
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import multihost_utils
mesh = jax.make_mesh((jax.device_count(),), ("d",))
ids = multihost_utils.process_allgather(np.array([ctx.process_id]))
total = jax.jit(lambda x: x.sum())(multihost_utils.host_local_array_to_global_array(
    np.full((jax.local_device_count(),), ctx.process_id + 1.0), mesh, jax.P("d")))
print(f"process {ctx.process_id} of {ctx.num_processes}: ids {sorted(ids.ravel().tolist())} "
      f"sum {float(total)}", flush=True)
"""


def _node_one(coordinator: str, devices: int, *argv) -> subprocess.Popen:
  """Node 1 of two, two processes of ``devices`` CPU devices each, from the command line."""
  return subprocess.Popen(
      [sys.executable, "-m", "commopt.launch", "--nodes", "2", "--node-rank", "1",
       "--coordinator", coordinator, "--processes", "2", "--cpu-devices", str(devices),
       "--timeout", "120", *argv],
      env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_two_launchers_run_one_job_as_two_nodes(tmp_path):
  """Two launchers, node 0 here and node 1 from the command line, each with two processes of
  two devices: one job of four processes numbered node by node, a sum over all 8 devices."""
  script = tmp_path / "joins.py"
  script.write_text(JOINS)
  coordinator = f"127.0.0.1:{launch.free_port()}"
  other = _node_one(coordinator, 2, str(script))
  try:
    here = launch.launch([str(script)], 2, devices_per_process=2, nodes=2, node_rank=0,
                         coordinator=coordinator, timeout=120, env={"PYTHONPATH": str(ROOT)})
    out, _ = other.communicate(timeout=120)
  finally:
    other.kill()
  assert other.returncode == 0, out
  assert [r.process_id for r in here] == [0, 1]
  want = "ids [0, 1, 2, 3] sum 20.0"           # 2 devices each of processes 1..4
  for r in here:
    assert f"process {r.process_id} of 4: {want}" in r.output
  for i in (2, 3):
    assert f"--- process {i} ---\n" in out and f"process {i} of 4: {want}" in out


def test_nodes_need_a_coordinator_and_a_rank_in_range():
  with pytest.raises(ValueError, match=r"nodes=2, `coordinator` must be node 0's 'host:port'"):
    launch.launch(["x.py"], 2, nodes=2, node_rank=1)
  with pytest.raises(ValueError, match=r"`node_rank` must be an integer in \[0, nodes=2\), got 2"):
    launch.launch(["x.py"], 2, nodes=2, node_rank=2, coordinator="127.0.0.1:1")
  with pytest.raises(ValueError, match="`nodes` must be"):
    launch.launch(["x.py"], 2, nodes=0)
  assert launch_cli.main(["--processes", "1", "--nodes", "2", "--coordinator", "h:1",
                          "--supervise", "x.py"]) == 1


def test_a_name_that_left_launch_says_where_it_went():
  changelog = (ROOT / "CHANGELOG.md").read_text()
  for name, (home, _) in launch.MOVED.items():
    with pytest.raises(AttributeError, match=f"commopt.launch.{name} moved to {re.escape(home)}"):
      getattr(launch, name)
    assert f"`commopt.launch.{name}`" in changelog, name


# Process 3 raises once every process has joined; the others wait for it in a barrier.
NODE_FAILS = """
import os, pathlib, sys
from commopt import launch
ctx = launch.initialize()
from jax.experimental import multihost_utils
(pathlib.Path(sys.argv[1]) / f"{ctx.process_id}.pid").write_text(str(os.getpid()))
multihost_utils.sync_global_devices("joined")
if ctx.process_id == 3:
  raise RuntimeError("process 3 broke")
multihost_utils.sync_global_devices("never")
"""


@pytest.mark.slow
def test_a_failure_on_one_node_ends_the_other_nodes_run(tmp_path):
  """Process 3 (node 1) raises once every process has joined: node 1's launcher reports it,
  and node 0's processes, waiting for it in a barrier, fail through jax.distributed, so
  node 0's run ends too, with an error, in bounded time."""
  script = tmp_path / "fails.py"
  script.write_text(NODE_FAILS)
  coordinator = f"127.0.0.1:{launch.free_port()}"
  other = _node_one(coordinator, 1, str(script), str(tmp_path))
  began = time.monotonic()
  try:
    with pytest.raises(launch.LaunchError, match=r"process [01] of 4 failed first"):
      launch.launch([str(script), str(tmp_path)], 2, devices_per_process=1, nodes=2,
                    node_rank=0, coordinator=coordinator, timeout=120, heartbeat_timeout=5,
                    env={"PYTHONPATH": str(ROOT)})
    out, _ = other.communicate(timeout=120)
  finally:
    other.kill()
    kill_own(pids_in(tmp_path), tmp_path)
  assert time.monotonic() - began < 90
  # Node 1's launcher names process 3, or process 2 when 2's broken connection ends it
  # first: which exit it reads first is a race.
  assert other.returncode == 1 and re.search(r"process [23] of 4 failed first", out), out
  assert "process 3 broke" in out or "process 3 (code 1" in out, out


# -- host memory ------------------------------------------------------------------------

PRINTS_MALLOC = "import os; print(os.environ.get('MALLOC_MMAP_MAX_'), " \
                "os.environ.get('MALLOC_TRIM_THRESHOLD_'), os.environ.get('MALLOC_ARENA_MAX'))"


def _without_malloc_settings(monkeypatch):
  for key in [k for k in os.environ if k.startswith("MALLOC_")] + ["GLIBC_TUNABLES"]:
    monkeypatch.delenv(key, raising=False)


@pytest.mark.parametrize("mode,extra,want", [
    ("reuse", {}, "0 2147483647 1"),
    ("system", {}, "None None None"),
    ("reuse", {"MALLOC_ARENA_MAX": "2"}, "None None 2"),     # a setting of the user's own
    ("reuse", {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}, "None None None"),
    ("reuse", {"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=512"}, "0 2147483647 1"),
])
def test_the_host_memory_setting_reaches_every_process(tmp_path, monkeypatch, mode, extra,
                                                       want):
  _without_malloc_settings(monkeypatch)
  script = tmp_path / "malloc.py"
  script.write_text(PRINTS_MALLOC)
  results = launch.launch([str(script)], 2, host_memory=mode, env=extra, timeout=120)
  assert [r.output.strip() for r in results] == [want, want]


def test_the_host_memory_setting_from_the_command_line(tmp_path, capsys, monkeypatch):
  _without_malloc_settings(monkeypatch)
  script = tmp_path / "malloc.py"
  script.write_text(PRINTS_MALLOC)
  assert launch_cli.main(["--processes", "1", "--host-memory", "system", str(script)]) == 0
  assert "None None None" in capsys.readouterr().out
  with pytest.raises(ValueError, match="`host_memory` must be one of .*'fast'"):
    launch.launch([str(script)], 1, host_memory="fast")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_reuse_host_memory_sets_glibc_in_this_process():
  # In a process of its own: the setting lasts for the process's lifetime.
  code = "from commopt import launch; print(launch.reuse_host_memory())"
  out = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-2000:]
  assert "after JAX started" not in out.stderr


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_reuse_host_memory_after_jax_started_says_to_call_it_first():
  # JAX's threads keep the arenas they have: the setting cannot reach them any more.
  code = ("import jax; jax.numpy.ones(3).block_until_ready(); from commopt import launch; "
          "print(launch.reuse_host_memory())")
  out = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-2000:]
  assert "called after JAX started its runtime" in out.stderr and "first thing" in out.stderr


# A thread other than the main one allocates and frees 96 MB four times (as XLA:CPU does a
# large step's temporaries at every execution): the page faults of each round.
FAULTS_OF_A_THREAD = """
import ctypes, resource, sys, threading
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)   # PR_SET_THP_DISABLE: count 4 kB pages
import numpy as np
if sys.argv[1] == "reuse":
  from commopt import launch
  assert launch.reuse_host_memory()
def rounds():
  a = np.ones(96 * 2**20 // 8)
  del a
faults = []
for _ in range(4):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  t = threading.Thread(target=rounds)
  t.start()
  t.join()
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_reused_host_memory_serves_a_threads_large_request_again():
  # glibc maps a request larger than a thread arena's 64 MB heap afresh, whatever
  # M_MMAP_MAX says, so each round faults its pages in again; with one arena for every
  # thread the memory freed by the first round serves the next ones.
  def faults(mode):
    env = {k: v for k, v in ENV.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env["NUMPY_MADVISE_HUGEPAGE"] = "0"
    out = subprocess.run([sys.executable, "-c", FAULTS_OF_A_THREAD, mode], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return [int(f) for f in out.stdout.split()]

  system, reuse = faults("system"), faults("reuse")
  pages = 96 * 2**20 // 4096
  assert min(system[1:]) > pages // 2 and max(reuse[1:]) < pages // 20, (system, reuse)
