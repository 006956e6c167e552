"""The test tiers' own machinery (``tests/conftest.py``): both compile at XLA's backend
optimisation level 0 (``conftest.FAST_COMPILE``), whose optimised HLO, which every audit reads,
is the same as at the default level; a test marked ``optimized`` starts its processes (and
``call_in_process``'s) at the default level; ``--every N`` samples; the ``LONG`` and ``HEAVY``
lists name tests that exist."""

import os
import re
import subprocess
import sys

import pytest

SCRIPT = r'''
import re, jax, jax.numpy as jnp, optax
jax.config.update("jax_num_cpu_devices", 8)
import commopt
mesh = jax.make_mesh((8,), ("data",))
params = {"w": jnp.ones((64, 32)), "b": jnp.zeros(32)}
tx = commopt.transforms.apply_if_finite(optax.chain(
    commopt.compressed_mean(commopt.scaled_sign(), axis_name="data", min_size=100),
    optax.adam(1e-3)), axis_name="data")
sm = commopt.testing.shard_map_workers(tx, mesh, "data")
g = jax.tree.map(lambda x: jnp.ones((8,) + x.shape), params)
text = jax.jit(sm.update).lower(g, sm.init(params)).compile().as_text()
print(re.sub(r"metadata=\{[^}]*\}", "", text))
'''


def optimized_hlo(flags: str) -> str:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  if flags:
    env["XLA_FLAGS"] = flags
  proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout


def conftest(request):
  """``tests/conftest.py`` as loaded (not importable by name under ``--import-mode=importlib``)."""
  return request.config.pluginmanager.get_plugin(
      os.path.join(os.path.dirname(__file__), "conftest.py"))


def fast_compile(request) -> str:
  return conftest(request).FAST_COMPILE


@pytest.mark.slow
def test_level_0_compiles_the_same_optimized_hlo(request):
  fast = fast_compile(request)
  default, level0 = optimized_hlo(""), optimized_hlo(fast)
  assert re.search(r"all-reduce|all-gather", default)   # the program exchanges
  assert default == level0


def test_processes_started_by_a_test_inherit_level_0(request):
  flags = os.environ.get("XLA_FLAGS", "").split()
  if fast_compile(request) not in flags and any("optimization_level" in f for f in flags):
    pytest.skip("XLA_FLAGS names another level, which the tiers keep")
  assert fast_compile(request) in flags


@pytest.mark.optimized
def test_processes_started_by_an_optimized_test_compile_as_users_do(request):
  assert fast_compile(request) not in os.environ.get("XLA_FLAGS", "").split()


def process_facts() -> dict:
  """What :func:`test_call_in_process_runs_a_function_where_users_would` reads in its process."""
  import jax
  return {"devices": jax.device_count(), "flags": os.environ.get("XLA_FLAGS", "")}


@pytest.mark.optimized
def test_call_in_process_runs_a_function_where_users_would(request, call_in_process):
  facts = call_in_process("test_fast_compile", "process_facts", timeout=120)
  assert facts["devices"] == 8 and fast_compile(request) not in facts["flags"].split()


def collected(*args, where=__file__) -> tuple[list[str], str]:
  """The node ids ``pytest --co`` lists under ``where`` with ``args``, and its whole output."""
  proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "--co", "-p", "no:cacheprovider",
                         *args, where], capture_output=True, text=True, timeout=300,
                        cwd=os.path.dirname(os.path.dirname(__file__)))
  return [line for line in proc.stdout.splitlines() if "::" in line], proc.stdout + proc.stderr


@pytest.mark.slow
def test_every_n_keeps_every_n_th_test_in_collection_order():
  every = ("-m", "slow or not slow")
  whole, _ = collected(*every)
  assert len(whole) == 7, whole
  assert collected(*every, "--every", "2")[0] == whole[::2]
  assert "--every must be a positive integer, got 0" in collected("--every", "0")[1]


@pytest.mark.slow
def test_every_test_listed_long_exists_and_is_slow(request):
  listed, _ = collected("-m", "long and slow", where="tests")
  assert set(listed) == conftest(request).LONG


@pytest.mark.slow
def test_every_heavy_case_is_slow_beside_a_case_of_its_test_in_the_default_tier(request):
  heavy = conftest(request).HEAVY
  default, _ = collected(where="tests")
  assert heavy and not heavy & set(default)
  slow, _ = collected("-m", "slow", where="tests")
  assert heavy <= set(slow), sorted(heavy - set(slow))[:5]
  tests = {nodeid.split("[")[0] for nodeid in default}
  assert all(nodeid.split("[")[0] in tests for nodeid in heavy)
