"""Shared test setup: eight simulated CPU devices, a quick hypothesis profile, meshes.

Tiers: the default run skips tests marked ``slow`` (the example scripts and
the robustness studies run as subprocesses or train for many steps);
``pytest -m slow`` runs them, and CI runs both.

Both tiers are bound by compiling: they compile with XLA's backend (LLVM)
optimisation level 0 (``XLA_FLAGS=--xla_backend_optimization_level=0``, which
the processes their tests start inherit): a quarter less time on the default
tier and less than half on the slow tier's compressor checks, on 2 cores. The
HLO passes, and so every audited program, are the same
(``test_fast_compile.py``); the compiled code runs slower (2.3x per step of
``examples/sharded_lm.py``). A test marked ``optimized`` (a long training run
as a subprocess) starts its processes without the flag, so they compile as
users do; its own process keeps level 0 (XLA reads its flags once). A level
the caller set in ``XLA_FLAGS`` is kept.
"""

import importlib.util
import os
import pathlib
import subprocess
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
settings.load_profile("ci")

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKERS = 8
"""The simulated devices, all of them data-parallel workers in the 1-D mesh."""
FAST_COMPILE = "--xla_backend_optimization_level=0"
"""The default tier's compile flag (see the module docstring)."""


def pytest_configure(config):
  """Both tiers compile at :data:`FAST_COMPILE` unless ``XLA_FLAGS`` names a level, set
  before any test module starts JAX's backend."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_backend_optimization_level" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {FAST_COMPILE}".strip()


def pytest_addoption(parser):
  parser.addoption("--every", type=int, default=1, metavar="N",
                   help="run every N-th collected test only, in collection order, so that each "
                        "module is sampled (CI's second run on the newest JAX)")


def pytest_collection_modifyitems(config, items):
  """``--every N``: keeps items 0, N, 2N, ... (the same on every xdist worker)."""
  n = config.getoption("--every")
  if n < 1:
    raise pytest.UsageError(f"--every must be a positive integer, got {n}")
  if n > 1:
    config.hook.pytest_deselected(items=[t for i, t in enumerate(items) if i % n])
    items[:] = items[::n]


@pytest.fixture(autouse=True)
def _optimized_subprocesses(request, monkeypatch):
  """A test marked ``optimized`` starts its processes without :data:`FAST_COMPILE`."""
  if request.node.get_closest_marker("optimized") is None:
    return
  flags = os.environ.get("XLA_FLAGS", "").replace(FAST_COMPILE, "").strip()
  if flags:
    monkeypatch.setenv("XLA_FLAGS", flags)
  else:
    monkeypatch.delenv("XLA_FLAGS", raising=False)


@pytest.fixture(scope="session")
def mesh():
  """All 8 devices on one ``"data"`` axis."""
  return jax.make_mesh((WORKERS,), ("data",))


@pytest.fixture(scope="session")
def mesh2d():
  """2 nodes × 4 local devices: ``("node", "local")``."""
  return jax.make_mesh((2, 4), ("node", "local"))


def _namespaces() -> set:
  out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
  return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def _run_bench(script, args, timeout):
  """``(subprocess.CompletedProcess, left)``: the benchmark ``script`` run with ``args``, and
  the network namespaces its process left behind. Benchmarks name theirs
  ``commopt-net-<pid>-...`` (``benchmarks/bench_network.py``'s ``Namespace``); several may run
  beside each other under ``pytest -n``, so only this process's are looked at."""
  with subprocess.Popen([sys.executable, str(script), *args], cwd=ROOT, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True) as popen:
    try:
      out, err = popen.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      popen.kill()
      raise
  left = {n for n in _namespaces() if n.startswith(f"commopt-net-{popen.pid}-")}
  return subprocess.CompletedProcess(popen.args, popen.returncode, out, err), left


@pytest.fixture
def run_bench():
  """:func:`_run_bench`: runs a benchmark that shapes a network namespace."""
  return _run_bench


def _load_script(path):
  """A script (a benchmark, an example) imported as a module, by its path."""
  path = pathlib.Path(path)
  spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture
def load_script():
  """:func:`_load_script`: imports a script by its path."""
  return _load_script
