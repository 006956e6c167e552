"""Shared test setup: eight simulated CPU devices, a quick hypothesis profile, meshes.

Tiers: the default run skips tests marked ``slow`` (the example scripts and
the robustness studies run as subprocesses or train for many steps, and the
costlier cases of parametrized tests, :data:`HEAVY`); ``pytest -m slow`` runs
them, and CI runs both but the slow tier's :data:`LONG` tests.

Both tiers are bound by compiling: they compile with XLA's backend (LLVM)
optimisation level 0 (``XLA_FLAGS=--xla_backend_optimization_level=0``, which
the processes their tests start inherit): a quarter less time on the default
tier and less than half on the slow tier's compressor checks, on 2 cores. The
HLO passes, and so every audited program, are the same
(``test_fast_compile.py``); the compiled code runs slower (2.3x per step of
``examples/sharded_lm.py``). A test marked ``optimized`` (a long training run
as a subprocess) starts its processes without the flag, so they compile as
users do; its own process keeps level 0 (XLA reads its flags once). A level
the caller set in ``XLA_FLAGS`` is kept. Each test process keeps the programs it
compiled in a compilation cache of its own, which many tests hit (a fresh step of
the same model).
"""

import atexit
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import jax

jax.config.update("jax_num_cpu_devices", 8)
# Many tests compile the same program (a fresh step of the same model): each test process
# keeps what it compiled in a cache of its own (not shared, so no process reads an entry
# another is writing) and removes it at exit; the processes tests start do not use it.
_COMPILED = tempfile.mkdtemp(prefix="commopt-test-compiled-")
atexit.register(shutil.rmtree, _COMPILED, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _COMPILED)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

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


LONG = frozenset([
    "tests/test_bench_network.py::test_bench_network_runs_a_combined_method_and_the_pytorch_peer[diloco(8)+scaled_sign]",
    "tests/test_bench_network.py::test_bench_network_runs_a_combined_method_and_the_pytorch_peer[eager:diloco(4)+int_quant(4)]",
    "tests/test_bench_network.py::test_bench_network_runs_a_combined_method_and_the_pytorch_peer[eager(w=1):diloco(4)+int_quant(4)]",
    "tests/test_bench_network.py::test_bench_network_runs_a_combined_method_and_the_pytorch_peer[torch:power_sgd(2)]",
    "tests/test_bench_network.py::test_bench_network_runs_a_combined_method_and_the_pytorch_peer[zero+qwZ+qgZ]",
    "tests/test_bench_nodes.py::test_bench_nodes_runs_two_shaped_nodes_and_cleans_up",
    "tests/test_bench_overlap.py::test_bench_overlap_times_every_variant_and_reads_the_programs",
    "tests/test_bench_sharded.py::test_sharded_benchmark_quick",
    "tests/test_bench_zero.py::test_bench_zero_beside_tensor_parallelism",
    "tests/test_bench_zero.py::test_bench_zero_feedback",
    "tests/test_compressor_suite.py::test_gathered_sum_in_one_pass_equals_decoding_each_payload[adaptive_levels-f32]",
    "tests/test_compressor_suite.py::test_gathered_sum_in_one_pass_equals_decoding_each_payload[atomo-f32]",
    "tests/test_lowcomm.py::test_bench_lowcomm_runs_and_states_the_byte_ratios",
    "tests/test_properties.py::test_top_k_ratio_contraction",
    "tests/test_sharded_flax.py::test_example_trains_at_ten_times_the_steps",
    "tests/test_sketch.py::test_fetch_sgd_trains_the_demo_cnn",
    "tests/test_sync.py::test_bench_sync_runs_and_counts_bytes",
    "tests/test_zero.py::test_the_zero_language_model_example",
    "tests/test_zero_feedback.py::test_layer_by_layer_memories_restore_onto_another_number_of_devices",
    "tests/test_zero_feedback.py::test_memories_hold_what_the_payloads_did_not_carry",
    "tests/test_zero_tp.py::test_quantized_blocks_train_near_dense[explicit]",
    "tests/test_zero_tp.py::test_stacked_blocks_gathered_layer_by_layer[explicit]",
])
"""Slow-tier tests of 50 s or more on 2 cores (their ``--durations``) that CI leaves out to end
within its 90 minutes, marked ``long`` (``pytest -m long`` runs them): the benchmarks' smoke
runs, the longest trainings (the sharded Flax example at 10x its steps, 572 s; fetch_sgd's
CNN, 222 s) and the heaviest ZeRO and compressor checks. The README, the demo, the guide's
examples and the multi-process and elastic runs stay in CI (about 1000 s of test time)."""
HEAVY = frozenset(line.strip() for line in (ROOT / "tests" / "heavy_cases.txt").read_text()
                  .splitlines() if line.strip() and not line.startswith("#"))
"""Parametrized cases of the default tier that took 1 s or more on 2 cores, each beside a
cheaper case of its test (``tests/heavy_cases.txt``): marked ``slow``, so that the default
tier runs every test at least once and ends well within 15 minutes."""


def pytest_addoption(parser):
  parser.addoption("--every", type=int, default=1, metavar="N",
                   help="run every N-th collected test only, in collection order, so that each "
                        "module is sampled (CI's second run on the newest JAX)")


@pytest.hookimpl(tryfirst=True)   # before -m deselects by the marks added here
def pytest_collection_modifyitems(config, items):
  """Marks the :data:`LONG` tests long and the :data:`HEAVY` cases slow; ``--every N`` keeps
  items 0, N, 2N, ... (the same on every xdist worker)."""
  for item in items:
    if item.nodeid in LONG:
      item.add_marker(pytest.mark.long)
    if item.nodeid in HEAVY:
      item.add_marker(pytest.mark.slow)
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


_CALL = """
import importlib, json, sys
import jax
jax.config.update("jax_num_cpu_devices", int(sys.argv[4]))
result = getattr(importlib.import_module(sys.argv[1]), sys.argv[2])(**json.loads(sys.argv[3]))
print("RESULT " + json.dumps(result))
"""


def _call_in_process(module: str, function: str, timeout: float, devices: int = WORKERS,
                     **kwargs):
  """``function(**kwargs)`` of the test module ``module``, called in a fresh Python process
  with ``devices`` CPU devices: its result, sent back as JSON. In a test marked ``optimized``
  that process compiles as users do (a long training run at level 0 takes twice as long)."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(ROOT / "tests"), str(ROOT / "examples"), os.environ.get("PYTHONPATH", "")]))
  proc = subprocess.run([sys.executable, "-c", _CALL, module, function, json.dumps(kwargs),
                         str(devices)], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=timeout)
  lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
  assert proc.returncode == 0 and lines, (proc.returncode, proc.stdout[-3000:],
                                          proc.stderr[-3000:])
  return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture
def call_in_process():
  """:func:`_call_in_process`: a module's function run in a process of its own."""
  return _call_in_process
