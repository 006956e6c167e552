"""Run by tests/test_multiprocess.py under commopt.launch: a few data_parallel steps per case.

``python tests/multiprocess_worker.py OUT_DIR [CASE ...]`` in each process;
process 0 writes ``OUT_DIR/CASE.npz`` with the final params and optimizer
state gathered to the host. The test runs the same cases in one process
(:func:`run_case`) and compares.
"""

import sys

CASES = ("identity", "identity_nan", "identity_nan_zero", "top_k_nan_zero", "scaled_sign", "top_k",
         "power_sgd", "two_phase", "hierarchical", "zero",
         "zero_quantized", "zero_state")
STEPS = 3


def run_case(case: str, local_rows):
  """Final ``(params, opt_state)`` on the host after STEPS steps; ``local_rows(x)`` picks this
  process's rows of a global batch array."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.experimental import multihost_utils

  import commopt

  if case.startswith("zero"):
    return run_zero(case, local_rows)
  if case == "hierarchical":
    mesh = jax.make_mesh((2, 4), ("node", "local"))
    axis = ("node", "local")
    reducer = commopt.compressed_mean(commopt.scaled_sign(), axis_name=axis, strategy="hierarchical",
                                      min_size=0)
  else:
    mesh = jax.make_mesh((8,), ("data",))
    axis = "data"
    name, strategy = (("scaled_sign", "two_phase") if case == "two_phase"
                      else (case.split("_nan")[0], "auto"))
    # min_size=0: every leaf compressed, so a gather-only case has no dense all-reduce.
    reducer = commopt.compressed_mean(commopt.compressors.make(name), axis_name=axis, strategy=strategy,
                                      min_size=0)
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(64, 48)) * 0.1, jnp.float32),
            "b": jnp.zeros(48)}
  x = rng.normal(size=(32, 64)).astype(np.float32)
  y = rng.normal(size=(32, 48)).astype(np.float32)

  def loss(p, b):
    return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)

  # *_nan_zero: the zero-gradient skip, whose adam takes the skipped step as a zero gradient
  # (top_k: every leaf compressed, so the verdict has an all-reduce of its own).
  zero_skip = case.endswith("_nan_zero")
  opt = optax.adam(0.01) if zero_skip else optax.sgd(0.1)
  dp = commopt.data_parallel(loss, optax.chain(reducer, opt), mesh, axis,
                             skip_nonfinite="zero" if zero_skip else True)
  state = dp.init(params)
  p = params
  for t in range(STEPS):
    xt = x.copy()
    if "_nan" in case and t == 1:
      xt[20, 3] = np.nan   # worker 5's rows, on the second process: every worker skips
    batch = dp.local_batch({"x": local_rows(xt), "y": local_rows(y)})
    p, state, _ = dp.step(p, state, batch)
  return multihost_utils.process_allgather((p, state), tiled=True)


def run_zero(case: str, local_rows):
  """zero_data_parallel (dense, or int8 weights and int4 gradients) for STEPS adam steps:
  the whole parameters and the sharded state on the host."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.experimental import multihost_utils

  import commopt

  mesh = jax.make_mesh((8,), ("data",))
  q = case == "zero_quantized"

  def loss(p, b):
    return jnp.mean((jnp.tanh(b["x"] @ p["w"]) - b["y"]) ** 2)

  def state_loss(p, ms, b):   # a running mean of each worker's activations: model state
    h = b["x"] @ p["w"]
    return loss(p, b), {"mean": 0.9 * ms["mean"] + 0.1 * jnp.mean(h, 0)}

  has_state = case == "zero_state"
  zp = commopt.zero_data_parallel(
      state_loss if has_state else loss, optax.adam(1e-2), mesh, has_state=has_state,
      weights=commopt.int_quant(bits=8, rounding="nearest") if q else None,
      grads=commopt.int_quant(bits=4, rounding="nearest") if q else None)
  rng = np.random.default_rng(1)
  x = rng.normal(size=(32, 64)).astype(np.float32)
  y = np.tanh(x[:, :20]).astype(np.float32)
  sharded = zp.shard({"w": jnp.asarray(rng.normal(size=(64, 20)) * 0.1, jnp.float32)})
  state = zp.init(sharded)
  ms = {"mean": jnp.zeros(20)} if has_state else None
  for _ in range(STEPS):
    batch = zp.local_batch({"x": local_rows(x), "y": local_rows(y)})
    if has_state:
      sharded, state, ms, _ = zp.step(sharded, state, batch, ms)
    else:
      sharded, state, _ = zp.step(sharded, state, batch)
  return multihost_utils.process_allgather((zp.unshard(sharded), state, ms), tiled=True)


def flat(tree):
  import jax
  import numpy as np
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}


if __name__ == "__main__":
  from commopt import launch
  ctx = launch.initialize()
  import pathlib

  import numpy as np
  out = pathlib.Path(sys.argv[1])
  rows = lambda a: np.split(a, ctx.num_processes)[ctx.process_id]
  for case in sys.argv[2:] or CASES:
    result = flat(run_case(case, rows))
    if ctx.is_main:
      np.savez(out / f"{case}.npz", **result)
    print(f"process {ctx.process_id}: {case} done", flush=True)
