"""The default tier compiles at XLA's backend optimisation level 0 (``conftest.FAST_COMPILE``):
the optimised HLO, which every audit of the tier reads, is the same as at the default level."""

import os
import re
import subprocess
import sys

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


def test_level_0_compiles_the_same_optimized_hlo(request):
  fast = request.config.pluginmanager.get_plugin(
      os.path.join(os.path.dirname(__file__), "conftest.py")).FAST_COMPILE
  default, level0 = optimized_hlo(""), optimized_hlo(fast)
  assert re.search(r"all-reduce|all-gather", default)   # the program exchanges
  assert default == level0
