"""Data parallelism across processes: each process feeds its own rows of the batch.

Run on one machine as two processes of four simulated CPU devices each:

    python -m commopt.launch --processes 2 --cpu-devices 4 examples/multihost.py

On a cluster, start one copy per host with the scheduler's own launcher and
call ``jax.distributed.initialize()`` instead of ``launch.initialize()``. Alone
(``python examples/multihost.py``) it is one process with its own devices.
"""

from commopt import launch

ctx = launch.initialize()            # before anything else touches JAX

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import commopt  # noqa: E402

mesh = jax.make_mesh((jax.device_count(),), ("data",))      # every process's devices
tx = optax.chain(commopt.compressed_mean(commopt.scaled_sign(), axis_name="data"), optax.sgd(0.2))


def loss(params, batch):
  return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


dp = commopt.data_parallel(loss, tx, mesh)
rng = np.random.default_rng(0)
true_w = rng.normal(size=(64, 16)).astype(np.float32)
params = {"w": jnp.zeros((64, 16))}
opt_state = dp.init(params)
for step in range(30):
  # This process's own rows: 16 per local device, drawn from its own stream.
  mine = np.random.default_rng([step, ctx.process_id])
  x = mine.normal(size=(16 * jax.local_device_count(), 64)).astype(np.float32)
  batch = dp.local_batch({"x": x, "y": x @ true_w})
  params, opt_state, losses = dp.step(params, opt_state, batch)
  # Each worker's loss; gathered to every process (a collective: all must call it).
  loss_now = float(np.mean(multihost_utils.process_allgather(losses, tiled=True)))
  if step == 0:
    first = loss_now

if ctx.is_main:
  print(f"{ctx.num_processes} processes, {jax.device_count()} workers: loss {first:.3f} at "
        f"step 1, {loss_now:.3f} at step 30")
