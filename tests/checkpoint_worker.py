"""Run by tests/test_multiprocess.py under commopt.launch: checkpoints across processes.

``python tests/checkpoint_worker.py OUT MODE`` in every process:

- ``save``: STEPS steps, saving a checkpoint at step SAVE_AT into ``OUT/ckpt``,
  and every step from the first on with an asynchronous
  ``checkpoint.CheckpointManager`` into ``OUT/managed`` (the last KEEP kept;
  the step's buffers are donated to the next step while orbax writes); writes
  ``OUT/uninterrupted.npz`` (final params and optimizer state).
- ``resume``: first checks that every process refuses a copy of ``OUT/ckpt`` with
  one bit flipped in one worker's residual (only the process holding that shard
  can see it); then restores ``OUT/ckpt`` and runs on to STEPS; writes
  ``OUT/resumed.npz``. The manager's step SAVE_AT restores bit for bit the same.
- ``resize``: restores ``OUT/ckpt`` onto this run's workers (fewer) and trains
  on; writes ``OUT/resized.npz`` with the workers' mean residual restored and
  the losses. The manager's step SAVE_AT restores bit for bit the same.
"""

import sys

STEPS, SAVE_AT, KEEP = 6, 3, 3


def batch(step):
  import numpy as np
  rng = np.random.default_rng(step)
  w = np.random.default_rng(99).normal(size=(64, 48)).astype(np.float32) * 0.1
  x = rng.normal(size=(32, 64)).astype(np.float32)
  return {"x": x, "y": x @ w}


def make():
  import jax
  import jax.numpy as jnp
  import optax

  import commopt
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  reducer = commopt.compressed_mean(commopt.scaled_sign(), axis_name="data", min_size=0,
                                    strategy="two_phase")
  loss = lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)
  dp = commopt.data_parallel(loss, optax.chain(reducer, optax.sgd(0.2, momentum=0.9)), mesh)
  return dp, {"w": jnp.zeros((64, 48)), "b": jnp.zeros(48)}


def rows(ctx, b):
  import numpy as np
  return {k: np.split(v, ctx.num_processes)[ctx.process_id] for k, v in b.items()}


def host(tree):
  import jax
  import numpy as np
  from jax.experimental import multihost_utils
  tree = multihost_utils.process_allgather(tree, tiled=True)
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}


def read_alone(path):
  """Every leaf as orbax reads it without commopt's checks (whole, on a local device)."""
  import jax
  import numpy as np
  import orbax.checkpoint as ocp
  one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  with ocp.StandardCheckpointer() as ckpt:
    tree = ckpt.metadata(path).item_metadata.tree
    got = ckpt.restore(path, jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), tree))
  return {jax.tree_util.keystr(k): np.asarray(v)
          for k, v in jax.tree_util.tree_flatten_with_path(got)[0]}


def refuses_damaged_copy(ctx, out, dp, params):
  """One bit flipped in the stored residual of one worker: every process raises."""
  import shutil

  import numpy as np
  from jax.experimental import multihost_utils

  from commopt import checkpoint
  before = read_alone(out / "ckpt")
  largest = max((f for f in (out / "ckpt").rglob("*") if f.is_file() and f.parent.name == "d"),
                key=lambda f: f.stat().st_size)
  for n, point in enumerate((0.5, 0.3, 0.7, 0.2, 0.8, 0.1, 0.9)):
    damaged = out / f"damaged{n}"
    if ctx.is_main:
      shutil.copytree(out / "ckpt", damaged)
      data = damaged / largest.relative_to(out / "ckpt")
      raw = bytearray(data.read_bytes())
      raw[int(len(raw) * point)] ^= 0x10
      data.write_bytes(bytes(raw))
    multihost_utils.sync_global_devices(f"damaged copy {n}")
    try:
      after = read_alone(damaged)           # the same files, the same outcome in every process
    except ValueError:
      continue
    changed = [k for k in before if not np.array_equal(after[k], before[k], equal_nan=True)]
    if changed == ["['opt_state']['inner_state'][0]['residual']['w']"]:
      break
  else:
    raise AssertionError("no point of the largest data file changes one residual alone")
  try:
    checkpoint.restore(damaged, dp, params)
  except checkpoint.CorruptCheckpointError as e:
    assert "inner_state[0].residual['w']" in str(e), e
  else:
    raise AssertionError(f"process {ctx.process_id} restored a damaged checkpoint")


if __name__ == "__main__":
  from commopt import launch
  ctx = launch.initialize()
  import pathlib

  import numpy as np

  from commopt import checkpoint

  out, mode = pathlib.Path(sys.argv[1]), sys.argv[2]
  dp, params = make()
  if mode == "save":
    p, s = params, dp.init(params)
    with checkpoint.CheckpointManager(out / "managed", max_to_keep=KEEP, async_save=True) as mgr:
      for step in range(STEPS):
        if step == SAVE_AT:
          checkpoint.save(out / "ckpt", p, s, step=step)
        if step:                            # from the first step's global arrays on
          assert mgr.save(step, p, s)
        p, s, _ = dp.step(p, s, dp.local_batch(rows(ctx, batch(step))))
    assert mgr.all_steps() == list(range(STEPS - KEEP, STEPS)), mgr.all_steps()
    result = host((p, s))
    name = "uninterrupted"
  else:
    if mode == "resume":
      refuses_damaged_copy(ctx, out, dp, params)
    got = checkpoint.restore(out / "ckpt", dp, params)
    assert got.step == SAVE_AT, got.step
    with checkpoint.CheckpointManager(out / "managed") as mgr:
      managed = mgr.restore(dp, params, step=SAVE_AT)
    assert (managed.step, managed.saved_workers) == (got.step, got.saved_workers)
    want = host((got.params, got.opt_state))
    for k, v in host((managed.params, managed.opt_state)).items():
      assert v.dtype == want[k].dtype and v.tobytes() == want[k].tobytes(), k
    p, s, losses = got.params, got.opt_state, []
    first = host(s)
    for step in range(got.step, STEPS if mode == "resume" else STEPS + 10):
      p, s, l = dp.step(p, s, dp.local_batch(rows(ctx, batch(step))))
      losses.append(float(np.mean(host(l)[""])))
    if mode == "resume":
      result, name = host((p, s)), "resumed"
    else:
      residual = first[".inner_state[0].residual['w']"]
      result = {"mean_residual": residual.mean(axis=0), "workers": np.asarray(residual.shape[0]),
                "saved_workers": np.asarray(got.saved_workers), "losses": np.asarray(losses)}
      name = "resized"
  if ctx.is_main:
    np.savez(out / f"{name}.npz", **result)
  print(f"process {ctx.process_id}: {mode} done", flush=True)
