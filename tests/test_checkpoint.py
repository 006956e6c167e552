"""Orbax checkpoints of a data_parallel run: save, restore onto an abstract target, continue."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import commopt


def host(tree):
  """Every leaf as numpy, typed PRNG keys as their key data."""
  def one(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    return np.asarray(x)
  return jax.tree.map(one, tree)


@pytest.mark.parametrize("name", ["scaled_sign", "top_k", "power_sgd"])
def test_a_restored_run_continues_bit_identically(name, mesh, tmp_path):
  params = {"w": jnp.ones((64, 48)) * 0.1, "b": jnp.zeros(48)}
  tx = optax.chain(commopt.compressed_mean(commopt.compressors.make(name), axis_name="data",
                                           min_size=0),
                   optax.sgd(0.1, momentum=0.9))
  dp = commopt.data_parallel(lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2),
                             tx, mesh, donate=False)
  rng = np.random.default_rng(0)
  batches = [{"x": rng.normal(size=(32, 64)).astype(np.float32),
              "y": rng.normal(size=(32, 48)).astype(np.float32)} for _ in range(5)]
  p, s = params, dp.init(params)
  for b in batches[:2]:
    p, s, _ = dp.step(p, s, b)
  path = tmp_path / "step2"
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(path, {"params": p, "opt_state": s})
  # Fresh target: shapes, dtypes and shardings only, nothing computed.
  target = dict(zip(("params", "opt_state"), dp.abstract_state(params)))
  with ocp.StandardCheckpointer() as ckpt:
    restored = ckpt.restore(path, target)
  residual = restored["opt_state"].inner_state[0].residual["w"]
  assert residual.shape[0] == mesh.size and residual.sharding.spec[0] == "data"
  p2, s2 = restored["params"], restored["opt_state"]
  for b in batches[2:]:
    p, s, _ = dp.step(p, s, b)
    p2, s2, _ = dp.step(p2, s2, b)
  jax.tree.map(np.testing.assert_array_equal, host((p2, s2)), host((p, s)))


# --- another number of workers ------------------------------------------------------

from hypothesis import given, strategies as st  # noqa: E402

from commopt import checkpoint  # noqa: E402
from commopt.parallel import _resize  # noqa: E402


def _loss(p, b):
  return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)


def _run(devices, axes, reducer_fn):
  mesh = jax.make_mesh(devices, axes, devices=jax.devices()[:int(np.prod(devices))])
  axis = axes if len(axes) > 1 else axes[0]
  tx = optax.chain(reducer_fn(axis), optax.sgd(0.2, momentum=0.9))
  return commopt.data_parallel(_loss, tx, mesh, axis, donate=False)


REDUCERS = {
    "scaled_sign": lambda a: commopt.compressed_mean(commopt.scaled_sign(), axis_name=a,
                                                     min_size=0),
    "top_k/two_phase": lambda a: commopt.compressed_mean(commopt.top_k(0.1), axis_name=a,
                                                         min_size=0, strategy="two_phase"),
    "dgc": lambda a: commopt.transforms.dgc(axis_name=a, densities=0.1, min_size=0),
    "hierarchical": lambda a: commopt.compressed_mean(
        commopt.scaled_sign(), axis_name=a, min_size=0, strategy="hierarchical",
        inner_strategy="two_phase"),
}


def _batches(n, rows=24):
  rng = np.random.default_rng(1)
  w = rng.normal(size=(64, 48)).astype(np.float32) * 0.1
  out = []
  for _ in range(n):
    x = rng.normal(size=(rows, 64)).astype(np.float32)
    out.append({"x": x, "y": x @ w})
  return out


def _per_worker_means(state, per_worker, first):
  """Per per-worker float leaf (by path): the mean over the first data axis (``first``
  workers), per rank of the other axes (float64)."""
  out = {}
  for (path, x), f in zip(jax.tree_util.tree_flatten_with_path(state)[0],
                          jax.tree.leaves(per_worker)):
    key = _resize.path_key(path)
    if f and _resize.SERVER_FIELD not in key and jnp.issubdtype(x.dtype, jnp.floating):
      x = np.asarray(x, np.float64)
      out[key] = x.reshape((first, -1) + x.shape[1:]).mean(axis=0)
  return out


def _server_vectors(state):
  """Every two-phase server memory as one flat vector per leaf (per local rank when 2-D)."""
  out = {}
  for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
    key = _resize.path_key(path)
    if _resize.SERVER_FIELD in key:
      out[key] = np.asarray(x)
  return out


@pytest.mark.slow
@pytest.mark.parametrize("case,old,new", [
    ("scaled_sign", (8,), (4,)), pytest.param("scaled_sign", (4,), (8,), marks=pytest.mark.slow),
    ("scaled_sign", (8,), (3,)), ("top_k/two_phase", (8,), (4,)),
    pytest.param("top_k/two_phase", (4,), (6,), marks=pytest.mark.slow),
    ("dgc", (8,), (4,)), ("hierarchical", (2, 4), (1, 4))])
def test_restoring_onto_another_number_of_workers_keeps_what_error_feedback_owes(
    case, old, new, tmp_path):
  axes = ("data",) if len(old) == 1 else ("node", "local")
  params = {"w": jnp.zeros((64, 48)), "b": jnp.zeros(48)}
  dp_old, dp_new = _run(old, axes, REDUCERS[case]), _run(new, axes, REDUCERS[case])
  batches = _batches(16)
  p, s = params, dp_old.init(params)
  for b in batches[:4]:
    p, s, _ = dp_old.step(p, s, b)
  checkpoint.save(tmp_path / "ck", p, s, step=4)
  got = checkpoint.restore(tmp_path / "ck", dp_new, params)
  assert (got.step, got.saved_workers) == (4, int(np.prod(old)))
  flags = dp_new.per_worker(params)
  # The owed update: every per-worker float leaf's mean over workers, unchanged
  # (the sum scales by new/old); with 2-D data axes, per local rank.
  before, after = (_per_worker_means(s, flags, old[0]),
                   _per_worker_means(got.opt_state, flags, new[0]))
  assert before and before.keys() == after.keys()
  for k in before:
    assert np.abs(before[k]).max() > 0, k          # something is owed
    np.testing.assert_allclose(after[k], before[k], rtol=1e-6, atol=1e-7, err_msg=str(k))
  # Server memories: the same values, re-split into the new chunks.
  for k, old_v in _server_vectors(s).items():
    new_v = _server_vectors(got.opt_state)[k]
    rest = 1 if len(old) == 1 else old[1]
    flat = lambda v, n: v.reshape(n, rest, -1).transpose(1, 0, 2).reshape(rest, -1)
    a, b = flat(old_v, old[0]), flat(new_v, new[0])
    m = min(a.shape[1], b.shape[1])
    np.testing.assert_array_equal(a[:, :m], b[:, :m])
    assert not a[:, m:].any() and not b[:, m:].any()
  # Replicated state (momentum, counts, keys) is carried as it is.
  for (path, x), f in zip(jax.tree_util.tree_flatten_with_path(got.opt_state)[0],
                          jax.tree.leaves(flags)):
    if not f:
      want = dict((_resize.path_key(q), y) for q, y in jax.tree_util.tree_flatten_with_path(s)[0])
      np.testing.assert_array_equal(np.asarray(x), np.asarray(want[_resize.path_key(path)]))
  # And it trains on, on the new workers.
  p2, s2, losses = got.params, got.opt_state, []
  for b in batches[4:]:
    p2, s2, l = dp_new.step(p2, s2, b)
    losses.append(float(np.mean(l)))
  assert losses[-1] < losses[0] / 2, losses


@given(st.integers(1, 64), st.integers(1, 64))
def test_overlap_weights_average_and_keep_the_mean(old, new):
  w = _resize.overlap_weights(old, new)
  np.testing.assert_allclose(w.sum(axis=1), 1.0)
  np.testing.assert_allclose(w.sum(axis=0), new / old)
  assert (w >= 0).all()


def test_same_number_of_workers_restores_bit_identically_through_checkpoint(mesh, tmp_path):
  dp = _run((8,), ("data",), REDUCERS["top_k/two_phase"])
  params = {"w": jnp.zeros((64, 48)), "b": jnp.zeros(48)}
  batches = _batches(5)
  p, s = params, dp.init(params)
  for b in batches[:2]:
    p, s, _ = dp.step(p, s, b)
  checkpoint.save(tmp_path / "ck", p, s)
  got = checkpoint.restore(tmp_path / "ck", dp, jax.eval_shape(lambda: params))
  assert got.step is None and got.saved_workers == 8
  p2, s2 = got.params, got.opt_state
  for b in batches[2:]:
    p, s, _ = dp.step(p, s, b)
    p2, s2, _ = dp.step(p2, s2, b)
  jax.tree.map(np.testing.assert_array_equal, host((p2, s2)), host((p, s)))


@pytest.mark.slow
def test_resize_errors_name_the_problem(tmp_path):
  params = {"w": jnp.zeros((64, 48)), "b": jnp.zeros(48)}
  dp8 = _run((8,), ("data",), REDUCERS["scaled_sign"])
  s = dp8.init(params)
  other = _run((4,), ("data",), REDUCERS["dgc"])
  with pytest.raises(ValueError, match=r"resize_state: the saved state has no leaf for .*"
                                       r"saved from another optimizer"):
    other.resize_state(s, params)
  dp2d = _run((1, 4), ("node", "local"), REDUCERS["hierarchical"])
  dp2d_old = _run((1, 3), ("node", "local"), REDUCERS["hierarchical"])
  with pytest.raises(ValueError, match=r"only the first data axis may change size"):
    dp2d.resize_state(dp2d_old.init(params), params)
  with pytest.raises(ValueError, match=r"checkpoint.restore: `directory` .* does not exist"):
    checkpoint.restore(tmp_path / "nothing", dp8, params)
  with pytest.raises(ValueError, match=r"checkpoint.save: `step` must be an int or None, got 1.5"):
    checkpoint.save(tmp_path / "x", params, s, step=1.5)


@pytest.mark.slow
def test_per_worker_parameters_restore_onto_half_the_workers(tmp_path):
  params = {"w": jnp.zeros((64, 48)), "b": jnp.zeros(48)}

  def run(n):
    mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
    tx = commopt.diloco(optax.sgd(0.2), axis_name="data", period=3, compressor=commopt.top_k(0.1),
                        min_size=0)
    return commopt.data_parallel(_loss, tx, mesh, local_params=True, donate=False)

  dp8, dp4 = run(8), run(4)
  batches = _batches(10)
  p, s = dp8.place_params(params), dp8.init(params)
  for b in batches[:4]:                      # one synchronisation, then a step apart
    p, s, _ = dp8.step(p, s, b)
  checkpoint.save(tmp_path / "ck", p, s, step=4)
  got = checkpoint.restore(tmp_path / "ck", dp4, params)
  assert got.saved_workers == 8 and got.params["w"].shape == (4, 64, 48)
  for k in params:
    np.testing.assert_allclose(np.asarray(got.params[k]).mean(0), np.asarray(p[k]).mean(0),
                               rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(np.asarray(got.opt_state.inner_state.anchor["w"]),
                                np.asarray(s.inner_state.anchor["w"]))
  p4, s4, losses = got.params, got.opt_state, []
  for b in batches[4:]:
    p4, s4, l = dp4.step(p4, s4, b)
    losses.append(float(np.mean(l)))
  assert losses[-1] < losses[0], losses
  with pytest.raises(ValueError, match=r"resize_params: parameters are per worker only with "
                                       r"local_params=True"):
    _run((4,), ("data",), REDUCERS["scaled_sign"]).resize_params(p, params)


# --- damaged checkpoints are detected -------------------------------------------------

import json  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

CorruptCheckpointError = checkpoint.CorruptCheckpointError
EARLIER = r"restore an earlier checkpoint"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """Checkpoints of one step on 8 workers: with per-worker residuals (``min_size=0``) and
  without (every leaf dense, so all state is replicated). Tests damage copies."""
  out = {}
  for name, min_size in (("per_worker", 0), ("replicated", 10**9)):
    dp = _run((8,), ("data",), lambda a, m=min_size: commopt.compressed_mean(
        commopt.scaled_sign(), axis_name=a, min_size=m))
    params = {"w": jnp.zeros((64, 48)), "b": jnp.zeros(48)}
    p, s, _ = dp.step(params, dp.init(params), _batches(1)[0])
    path = pathlib.Path(checkpoint.save(tmp_path_factory.mktemp("saved") / name, p, s, step=1))
    out[name] = (dp, params, p, s, path)
  return out


def _copy(saved, name, tmp_path):
  dp, params, p, s, path = saved[name]
  return dp, params, (p, s), shutil.copytree(path, tmp_path / "ck")


def _read_with_orbax_alone(path):
  """Every leaf as orbax reads it, without commopt's checks, by key path."""
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  with ocp.StandardCheckpointer() as ckpt:
    tree = ckpt.metadata(path).item_metadata.tree
    got = ckpt.restore(path, jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), tree))
  return {_resize.path_key(k): np.asarray(v)
          for k, v in jax.tree_util.tree_flatten_with_path(got)[0]}


def _flip_one_bit(original, tmp_path, wanted):
  """A copy of ``original`` with one bit flipped inside the stored chunks of a leaf whose key
  path ``wanted`` accepts, and that leaf's key path: points of the largest data file are
  tried (chunks are laid out in the order they were written) until orbax, reading the copy
  without commopt's checks, returns that leaf changed and the others intact."""
  before = _read_with_orbax_alone(original)
  largest = max((f for f in original.rglob("*") if f.is_file() and f.parent.name == "d"),
                key=lambda f: f.stat().st_size)
  for n, point in enumerate((0.5, 0.3, 0.7, 0.2, 0.8, 0.1, 0.9)):
    path = shutil.copytree(original, tmp_path / f"ck{n}")
    data = path / largest.relative_to(original)
    raw = bytearray(data.read_bytes())
    raw[int(len(raw) * point)] ^= 0x10
    data.write_bytes(bytes(raw))
    try:
      after = _read_with_orbax_alone(path)
    except Exception:  # noqa: BLE001 - orbax noticed this one (a ValueError, or its own
      continue         # Exception wrapping tensorstore's "ZSTD_decompressStream() failed")
    changed = [k for k in before if not np.array_equal(after[k], before[k], equal_nan=True)]
    if len(changed) == 1 and wanted(changed[0]):
      return path, changed[0]
  pytest.fail(f"no point of {largest} changes exactly one leaf that {wanted} accepts")


@pytest.mark.parametrize("name", ["per_worker", "replicated"])
def test_flipped_bits_in_a_saved_array_are_detected(name, saved, tmp_path):
  dp, params, p, s, original = saved[name]
  # Orbax alone reads the changed bit as a wrong number, without a word ...
  path, leaf = _flip_one_bit(original, tmp_path,
                             lambda k: ("residual" in k) == (name == "per_worker"))
  keypath = {_resize.path_key(k): jax.tree_util.keystr(k) for k, _ in
             jax.tree_util.tree_flatten_with_path({"params": p, "opt_state": s})[0]}[leaf]
  # (Reading it in other pieces, tensorstore may fail to decompress the chunk instead.)
  message = (rf"checkpoint {re.escape(repr(str(path)))} is corrupt: (the data read for the leaf "
             rf"{re.escape(keypath)} differs from the checksum recorded when it was saved "
             rf"\({checkpoint.CHECKSUMS}\)|orbax cannot read its arrays \(.*decompress).*{EARLIER}")
  # ... restore names the leaf, whether it reads the shards as saved or whole (resized).
  with pytest.raises(CorruptCheckpointError, match=message):
    checkpoint.restore(path, dp, params)
  if name == "per_worker":
    with pytest.raises(CorruptCheckpointError, match=message):
      checkpoint.restore(path, _run((4,), ("data",), REDUCERS["scaled_sign"]), params)


def _damage(file: pathlib.Path, how: str):
  raw = file.read_bytes()
  if how == "delete":
    file.unlink()
  elif how == "truncate":
    file.write_bytes(raw[:len(raw) // 2])
  else:                                     # garble: a stray byte in the middle
    file.write_bytes(raw[:len(raw) // 2] + b"\x00" + raw[len(raw) // 2 + 1:])


# Reading a damaged manifest, orbax's asyncio loop may close before tensorstore's callback
# for the failed read arrives ("Event loop is closed", raised on tensorstore's thread and
# reported at teardown now and then): a race inside the libraries on this error path.
@pytest.mark.filterwarnings("ignore:Exception ignored in:pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("file,how,problem", [
    ("_METADATA", "truncate", "orbax's tree metadata _METADATA is truncated or garbled"),
    ("_METADATA", "garble", "orbax's tree metadata _METADATA is truncated or garbled"),
    ("_METADATA", "delete", "orbax's tree metadata _METADATA is missing"),
    ("_CHECKPOINT_METADATA", "truncate",
     "orbax's checkpoint metadata _CHECKPOINT_METADATA is truncated or garbled"),
    ("_CHECKPOINT_METADATA", "garble",
     "orbax's checkpoint metadata _CHECKPOINT_METADATA is truncated or garbled"),
    ("_CHECKPOINT_METADATA", "delete",
     "orbax's checkpoint metadata _CHECKPOINT_METADATA is missing"),
    ("manifest.ocdbt", "truncate",
     "orbax cannot read the metadata of its arrays .*manifest.ocdbt.*Error decoding manifest"),
    (checkpoint.CHECKSUMS, "truncate",
     f"the checksum file {checkpoint.CHECKSUMS} has changed since it was written"),
    (checkpoint.CHECKSUMS, "garble",
     f"the checksum file {checkpoint.CHECKSUMS} has changed since it was written"),
    (checkpoint.CHECKSUMS, "delete",
     f"_CHECKPOINT_METADATA records a checksum file {checkpoint.CHECKSUMS}, but it is missing"),
])
def test_damaged_metadata_names_the_file_and_what_is_wrong(file, how, problem, saved, tmp_path):
  dp, params, _, path = _copy(saved, "per_worker", tmp_path)
  _damage(path / file, how)
  with pytest.raises(CorruptCheckpointError,
                     match=rf"checkpoint {re.escape(repr(str(path)))} is corrupt: {problem}"
                           rf".*{EARLIER}"):
    checkpoint.restore(path, dp, params)


def test_a_checkpoint_without_checksums_restores_unverified(saved, tmp_path):
  dp, params, (p, s), _ = _copy(saved, "per_worker", tmp_path)
  # As checkpoints were written before checksums: orbax alone, the same tree.
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(tmp_path / "old", {"params": p, "opt_state": s, "step": np.asarray(1, np.int64)})
  assert not (tmp_path / "old" / checkpoint.CHECKSUMS).exists()
  got = checkpoint.restore(tmp_path / "old", dp, params)
  assert got.step == 1
  jax.tree.map(np.testing.assert_array_equal, host((got.params, got.opt_state)), host((p, s)))


def test_the_handler_name_orbax_records_stays_what_checkpoints_already_hold(saved, tmp_path):
  # Orbax records the item's handler by this name in _CHECKPOINT_METADATA; checkpoints written
  # when commopt.checkpoint was one module hold it, and must still restore.
  import json
  name = "commopt.checkpoint.ChecksummedHandler"
  *_, path = saved["per_worker"]
  assert json.loads((path / "_CHECKPOINT_METADATA").read_text())["item_handlers"] == name
  p, s = saved["per_worker"][2:4]
  with checkpoint.CheckpointManager(tmp_path / "run") as mgr:
    mgr.save(1, p, s)
  step = json.loads((tmp_path / "run" / "1" / "_CHECKPOINT_METADATA").read_text())
  assert step["item_handlers"] == {checkpoint.ITEM: name}


def test_restoring_into_another_dtype_verifies_then_casts(saved, tmp_path):
  dp, params, (p, s), path = _copy(saved, "per_worker", tmp_path)
  half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  got = checkpoint.restore(path, dp, half)
  assert got.params["w"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got.params["w"]),
                                np.asarray(p["w"].astype(jnp.bfloat16)))


KILLED_SAVE = pathlib.Path(__file__).with_name("killed_save_worker.py")


@pytest.mark.slow
def test_a_save_killed_midway_leaves_the_previous_checkpoint_and_nothing_that_restores(tmp_path):
  script = KILLED_SAVE
  out = tmp_path / "run"
  out.mkdir()
  root = pathlib.Path(__file__).resolve().parents[1]
  env = dict(os.environ, PYTHONPATH=str(root))
  with open(tmp_path / "log.txt", "wb") as log:
    proc = subprocess.Popen([sys.executable, str(script), str(out)], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
      deadline = time.monotonic() + 240
      while not (out / "stalled").exists():
        assert proc.poll() is None, (tmp_path / "log.txt").read_text()[-3000:]
        assert time.monotonic() < deadline, "the save never reached its checksum file"
        time.sleep(0.2)
    finally:
      proc.kill()
      proc.wait()
  temporary = pathlib.Path((out / "stalled").read_text())
  assert temporary.parent == out and temporary.name != "step_2" and temporary.is_dir()
  assert not (out / "step_2").exists()                  # never committed
  dp = _run((8,), ("data",), REDUCERS["scaled_sign"])
  params = {"w": jnp.zeros((64, 48)), "b": jnp.zeros(48)}
  with pytest.raises(ValueError, match=r"`directory` .*step_2' does not exist"):
    checkpoint.restore(out / "step_2", dp, params)
  with pytest.raises(CorruptCheckpointError, match=EARLIER):  # the remains do not restore either
    checkpoint.restore(temporary, dp, params)
  got = checkpoint.restore(out / "step_1", dp, params)     # the previous checkpoint, verified
  assert got.step == 1
  np.testing.assert_array_equal(np.asarray(got.params["w"]), np.full((64, 48), 0.5, np.float32))


# --- CheckpointManager: retention, best-k, async saves --------------------------------

from typing import Any, NamedTuple  # noqa: E402

from commopt.testing import assert_same_bits  # noqa: E402

GUIDE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "guide" / "checkpoints.md"


class Small(NamedTuple):
  """A tiny run: 8 workers with per-worker residuals and two-phase server memories, the same
  step on 4 workers, the parameters, five batches, and (params, opt_state) after each of the
  first three."""
  dp: Any
  dp4: Any
  params: Any
  batches: list
  trained: list


@pytest.fixture(scope="module")
def small():
  dp = _run((8,), ("data",), REDUCERS["top_k/two_phase"])
  params = {"w": jnp.zeros((64, 48)), "b": jnp.zeros(48)}
  batches = _batches(5)
  p, s, trained = params, dp.init(params), []
  for b in batches[:3]:
    p, s, _ = dp.step(p, s, b)
    trained.append((p, s))
  return Small(dp, _run((4,), ("data",), REDUCERS["top_k/two_phase"]), params, batches, trained)


def _steps_on_disk(root: pathlib.Path) -> list[int]:
  return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit())


def _tiny():
  """Parameters and an optimizer state to save where nothing trains."""
  return {"w": jnp.arange(6.0)}, {"count": jnp.ones((), jnp.int32), "mu": {"w": jnp.ones(6)}}


def test_the_manager_keeps_the_last_max_to_keep_steps_each_with_its_checksums(tmp_path):
  p, s = _tiny()
  root = tmp_path / "run"
  with checkpoint.CheckpointManager(root, max_to_keep=2) as mgr:
    assert [mgr.save(step, p, s) for step in range(5)] == [True] * 5
    assert mgr.all_steps() == [3, 4] and mgr.latest_step() == 4 and mgr.best_step() == 4
    assert mgr.save(4, p, s) is False                 # not after the latest step
  assert _steps_on_disk(root) == [3, 4]
  for step in (3, 4):
    item = root / str(step) / checkpoint.ITEM
    assert (item / checkpoint.CHECKSUMS).is_file()
    # The same file checkpoint.save writes for the same content.
    plain = pathlib.Path(checkpoint.save(tmp_path / f"plain{step}", p, s, step=step))
    assert (item / checkpoint.CHECKSUMS).read_bytes() == (plain / checkpoint.CHECKSUMS).read_bytes()
  # A new manager on the same root sees them; every second step only, by the interval (and,
  # as orbax decides, the first step saved into an empty directory).
  with checkpoint.CheckpointManager(root, max_to_keep=3, save_interval_steps=2) as mgr:
    assert mgr.all_steps() == [3, 4]
    assert [mgr.save(step, p, s) for step in (5, 6, 7, 8)] == [False, True, False, True]
    assert mgr.save(9, p, s, force=True) is True      # off the interval
    assert mgr.all_steps() == [6, 8, 9]
  assert _steps_on_disk(root) == [6, 8, 9]
  with checkpoint.CheckpointManager(tmp_path / "new", save_interval_steps=2) as mgr:
    assert [mgr.save(step, p, s) for step in (1, 2, 3, 4)] == [True, True, False, True]


@pytest.mark.parametrize("mode,kept,best", [("min", [2, 4], 4), ("max", [1, 5], 1)])
def test_the_manager_keeps_the_best_steps_by_a_metric(mode, kept, best, tmp_path):
  p, s = _tiny()
  losses = {1: 5.0, 2: 1.0, 3: 3.0, 4: 0.5, 5: 4.0}
  with checkpoint.CheckpointManager(tmp_path / "run", max_to_keep=2, best_mode=mode,
                                    best_fn=lambda m: m["loss"]) as mgr:
    for step, loss in losses.items():
      assert mgr.save(step, p, s, metrics={"loss": np.float32(loss)})
    assert mgr.all_steps() == kept and mgr.best_step() == best
  assert _steps_on_disk(tmp_path / "run") == kept
  # Steps saved without metrics: kept and not ranked (orbax's default), or deleted first.
  for keep, survivors in ((True, [1, 3, 4]), (False, [3, 4])):
    with checkpoint.CheckpointManager(tmp_path / f"keep{keep}", max_to_keep=2,
                                      best_fn=lambda m: m["loss"],
                                      keep_checkpoints_without_metrics=keep) as mgr:
      mgr.save(1, p, s)
      mgr.save(2, p, s, metrics={"loss": 2.0})
      mgr.save(3, p, s, metrics={"loss": 1.0})
      mgr.save(4, p, s, metrics={"loss": 0.5})
      assert mgr.all_steps() == survivors and mgr.best_step() == 4


def test_an_async_save_restores_bit_identically_and_the_run_continues(small, tmp_path):
  dp, params, batches = small.dp, small.params, small.batches
  p, s = small.trained[1]
  want = host((p, s))
  with checkpoint.CheckpointManager(tmp_path / "run", async_save=True) as mgr:
    assert mgr.save(2, p, s)                         # returns while orbax writes
    p1, s1 = p, s
    for b in batches[2:]:                            # training goes on meanwhile
      p1, s1, _ = dp.step(p1, s1, b)
    mgr.wait_until_finished()
    got = mgr.restore(dp, jax.eval_shape(lambda: params))
  assert (got.step, got.saved_workers) == (2, 8)
  assert_same_bits(host((got.params, got.opt_state)), want)
  p2, s2 = got.params, got.opt_state
  for b in batches[2:]:
    p2, s2, _ = dp.step(p2, s2, b)
  assert_same_bits(host((p2, s2)), host((p1, s1)))


@pytest.mark.slow
def test_the_manager_restores_onto_another_number_of_workers(small, tmp_path):
  dp4, params, batches = small.dp4, small.params, small.batches
  p, s = small.trained[1]
  with checkpoint.CheckpointManager(tmp_path / "run") as mgr:
    mgr.save(2, p, s)
    got = mgr.restore(dp4, params)
  assert (got.step, got.saved_workers) == (2, 8)
  assert got.opt_state.inner_state[0].residual["w"].shape == (4, 64, 48)
  # The rule of checkpoint.restore: DataParallel.resize_state of the saved state.
  assert_same_bits(host(got.opt_state), host(dp4.resize_state(s, params)))
  assert_same_bits(host(got.params), host(p))
  p4, s4, losses = got.params, got.opt_state, []
  for b in batches[2:]:
    p4, s4, l = dp4.step(p4, s4, b)
    losses.append(float(np.mean(l)))
  assert np.isfinite(losses).all()


def test_a_damaged_step_names_itself_and_the_step_before_it_restores(small, tmp_path):
  dp, params, trained = small.dp, small.params, small.trained
  root = tmp_path / "run"
  with checkpoint.CheckpointManager(root, max_to_keep=3) as mgr:
    for step, (p, s) in enumerate(trained, 1):
      mgr.save(step, p, s)
    item = root / "3" / checkpoint.ITEM
    damaged, _ = _flip_one_bit(item, tmp_path, lambda k: True)
    shutil.rmtree(item)
    shutil.copytree(damaged, item)
    step3 = re.escape(repr(str(root / "3")))
    with pytest.raises(CorruptCheckpointError,
                       match=rf"^CheckpointManager.restore: step 3 \({step3}\) is corrupt: "
                             rf"the data read for the leaf .* differs from the checksum recorded "
                             rf"when it was saved \(state/{checkpoint.CHECKSUMS}\).*{EARLIER}.*: "
                             rf"restore\(dp, params, step=2\)"):
      mgr.restore(dp, params)
    got = mgr.restore(dp, params, step=mgr.all_steps()[-2])
    assert got.step == 2
    assert_same_bits(host((got.params, got.opt_state)), host(trained[1]))
    # A damaged metadata file names the file in the step; the first step has no earlier one.
    (root / "1" / checkpoint.ITEM / checkpoint.CHECKSUMS).unlink()
    with pytest.raises(CorruptCheckpointError,
                       match=rf"step 1 .* records a checksum file state/{checkpoint.CHECKSUMS}, "
                             rf"but it is missing; no earlier step is kept"):
      mgr.restore(dp, params, step=1)


def test_a_failed_async_save_leaves_the_steps_before_it(small, tmp_path, monkeypatch):
  dp, params = small.dp, small.params
  (p1, s1), (p2, s2) = small.trained[:2]
  root = tmp_path / "run"
  mgr = checkpoint.CheckpointManager(root, max_to_keep=1, async_save=True)
  mgr.save(1, p1, s1)
  mgr.wait_until_finished()

  def fails(directory, data):                      # as a crash while the step is finalized
    (pathlib.Path(directory) / checkpoint.CHECKSUMS).write_bytes(data[:len(data) // 2])
    raise OSError("disk full")

  monkeypatch.setattr(checkpoint._checksums, "write", fails)   # what the handler calls
  assert mgr.save(2, p2, s2)
  with pytest.raises(OSError, match="disk full"):
    mgr.wait_until_finished()
  monkeypatch.undo()
  assert mgr.all_steps() == [1] and _steps_on_disk(root) == [1]
  left = [d for d in root.iterdir() if d.name.startswith("2.")]
  assert left and "tmp" in left[0].name             # orbax's temporary directory, never listed
  got = mgr.restore(dp, params)
  assert got.step == 1
  assert_same_bits(host((got.params, got.opt_state)), host((p1, s1)))
  mgr.close()
  with checkpoint.CheckpointManager(root, max_to_keep=1) as again:
    assert again.all_steps() == [1]
    again.save(2, p2, s2)                            # after it deleted the remains
  assert _steps_on_disk(root) == [2] and not [d for d in root.iterdir() if "tmp" in d.name]


def test_the_manager_arguments_are_checked(small, tmp_path):
  Manager = checkpoint.CheckpointManager
  bad = [
      (dict(max_to_keep=0), ValueError,
       r"CheckpointManager: `max_to_keep` must be None \(keep every step\) or a positive "
       r"integer, got 0\."),
      (dict(max_to_keep=2.0), commopt.OptionTypeError, r"`max_to_keep` .* got 2\.0 \(float\); "
                                                       r"pass 2 \(an int\)"),
      (dict(best_fn="loss"), commopt.OptionTypeError,
       r"`best_fn` must be None or a function of a step's metrics dict that returns a number, "
       r"got 'loss' \(str\)"),
      (dict(best_mode="lowest"), ValueError,
       r"`best_mode` must be one of \('min', 'max'\), got 'lowest'"),
      (dict(keep_checkpoints_without_metrics=1), commopt.OptionTypeError,
       r"`keep_checkpoints_without_metrics` must be True or False, got 1 \(int\)"),
      (dict(save_interval_steps=0), ValueError,
       r"`save_interval_steps` must be a positive integer, got 0"),
      (dict(async_save="yes"), commopt.OptionTypeError,
       r"`async_save` must be True or False, got 'yes' \(str\)"),
  ]
  for kwargs, error, message in bad:
    with pytest.raises(error, match=message):
      Manager(tmp_path / "run", **kwargs)
  with pytest.raises(commopt.OptionTypeError, match=r"`directory` must be a path .* got 3 \(int\)"):
    Manager(3)
  dp, params = small.dp, small.params
  s = small.trained[0][1]
  with Manager(tmp_path / "run", best_fn=lambda m: m.get("loss")) as mgr:
    with pytest.raises(ValueError, match=r"CheckpointManager.restore: no step is saved in"):
      mgr.restore(dp, params)
    for step, error, message in [
        (-1, ValueError, r"CheckpointManager.save: `step` must be an integer >= 0, got -1\."),
        (1.5, commopt.OptionTypeError, r"`step` must be an integer >= 0, got 1\.5 \(float\)")]:
      with pytest.raises(error, match=message):
        mgr.save(step, params, s)
    with pytest.raises(commopt.OptionTypeError, match=r"`metrics\['loss'\]` must be a number .* "
                                                      r"got 'low' \(str\)"):
      mgr.save(1, params, s, metrics={"loss": "low"})
    with pytest.raises(commopt.OptionTypeError, match=r"`metrics` must be None or a dict"):
      mgr.save(1, params, s, metrics=[0.5])
    with pytest.raises(ValueError, match=r"`best_fn` must return a finite number for the "
                                         r"metrics \{'acc': 0\.5\}, got None"):
      mgr.save(1, params, s, metrics={"acc": 0.5})
    with pytest.raises(commopt.OptionTypeError, match=r"`force` must be True or False"):
      mgr.save(1, params, s, force="yes")
    assert mgr.all_steps() == []                     # nothing was written
    mgr.save(1, params, s, metrics={"loss": 1.0})
    with pytest.raises(ValueError, match=r"step 1 is already saved in .*; `force=True` saves "
                                         r"off the save interval but replaces no step"):
      mgr.save(1, params, s, force=True)
    with pytest.raises(ValueError, match=r"CheckpointManager.restore: step 7 is not saved in "
                                         r".*; the steps kept are \[1\]\."):
      mgr.restore(dp, params, step=7)
    with pytest.raises(ValueError, match=r"CheckpointManager.restore: `dp` must be a "
                                         r"commopt.DataParallel"):
      mgr.restore("dp", params)


def _guide_blocks(phrase: str) -> list[str]:
  """The Python blocks of the guide's checkpoints page from the one containing ``phrase``."""
  blocks = re.findall(r"^```python\n(.*?)^```", GUIDE.read_text(), flags=re.S | re.M)
  start = next(i for i, b in enumerate(blocks) if phrase in b)
  return blocks[start:]


def _guide_namespace(small, tmp_path):
  """What the guide's page defines before its own blocks (the README's section): a step on 8
  workers, its parameters and optimizer state after one step, and the same step on 4 workers."""
  p, s = small.trained[0]
  return dict(dp=small.dp, dp4=small.dp4, params=p, opt_state=s, ckpt_dir=str(tmp_path))


def test_the_guides_manager_examples_run_as_written(small, tmp_path):
  ns = _guide_namespace(small, tmp_path)
  p, s = ns["params"], ns["opt_state"]
  blocks = _guide_blocks("checkpoint.CheckpointManager(ckpt_dir")
  exec(compile(blocks[0], str(GUIDE), "exec"), ns)  # noqa: S102
  assert ns["restored"].step == 300
  assert_same_bits(host((ns["restored"].params, ns["restored"].opt_state)), host((p, s)))
  assert ns["restored4"].opt_state.inner_state[0].residual["w"].shape[0] == 4
  exec(compile(blocks[1], str(GUIDE), "exec"), ns)  # noqa: S102
  assert ns["restored"].step == 3
  # Again, on the same directory, with the latest step damaged: the page's remedy restores
  # the step before it (the saves of steps already kept are skipped; step 4 ranks last).
  (tmp_path / "best" / "3" / checkpoint.ITEM / checkpoint.CHECKSUMS).write_bytes(b"{}")
  exec(compile(blocks[1], str(GUIDE), "exec"), ns)  # noqa: S102
  assert ns["restored"].step == 2


def test_the_guides_own_orbax_manager_recipe_restores_and_resizes(small, tmp_path):
  """The page's recipe for users of their own orbax CheckpointManager: onto
  dp.abstract_state(params) bit for bit, and dp.resize_state onto 4 workers."""
  ns = _guide_namespace(small, tmp_path)
  p, s, dp, dp4 = ns["params"], ns["opt_state"], ns["dp"], ns["dp4"]
  exec(compile(_guide_blocks("ocp.CheckpointManager(")[0], str(GUIDE), "exec"), ns)  # noqa: S102
  restored = ns["restored"]
  residual = restored["opt_state"].inner_state[0].residual["w"]
  assert residual.sharding.spec[0] == "data" and residual.shape[0] == 8
  assert_same_bits(host((restored["params"], restored["opt_state"])), host((p, s)))
  assert_same_bits(host(ns["opt_state4"]), host(dp4.resize_state(s, p)))
  # Both continue: bit for bit on 8 workers, and on 4.
  b = small.batches[1]
  assert_same_bits(host(dp.step(restored["params"], restored["opt_state"], b)[:2]),
                   host(dp.step(p, s, b)[:2]))
  _, _, losses = dp4.step(ns["params4"], ns["opt_state4"], b)
  assert np.isfinite(np.asarray(losses)).all()
