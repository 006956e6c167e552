"""The README's Python examples run as written, on 8 simulated CPU devices."""

import pathlib
import re

import jax.numpy as jnp
import numpy as np
import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
  return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def namespace() -> dict:
  """What the README's fragments assume exists: a model, its loss and a batch."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 12)).astype(np.float32)
  batch = {"x": x, "y": x @ rng.normal(size=(12, 4)).astype(np.float32)}
  params = {"w": jnp.zeros((12, 4)), "b": jnp.zeros((4,))}

  def loss_fn(p, b):
    return jnp.mean(jnp.square(b["x"] @ p["w"] + p["b"] - b["y"]))

  return {"loss_fn": loss_fn, "params": params, "batch": batch}


def test_readme_has_the_examples_this_file_runs():
  """The tour trains, then the checkpoint section saves, restores and resizes its run. The
  examples that moved to the guide (training loops, nnx, majority vote, attacks, sync
  modes, multi-host) run in tests/test_docs.py."""
  blocks = python_blocks()
  assert len(blocks) >= 3
  assert "commopt.data_parallel" in blocks[0] and "dp.step" in blocks[0]
  assert any("checkpoint.save" in b for b in blocks)
  assert any("dp4.step" in b for b in blocks)


@pytest.mark.slow
def test_readme_blocks_run_in_order(capsys):
  ns = namespace()
  first = None
  for i, block in enumerate(python_blocks()):
    exec(compile(block, str(README), "exec"), ns)   # noqa: S102 - the README's own code
    if i == 0:
      first = float(np.mean(ns["losses"]))
  printed = capsys.readouterr().out
  assert "all-reduce" in printed           # the audit of the PowerSGD step
  assert np.isfinite(np.asarray(ns["losses"])).all()
  assert int(ns["opt_state"].total_notfinite) == 0
  # The tour trained, and the step restored onto 4 workers went on from where it was.
  start = float(jnp.mean(jnp.square(ns["batch"]["y"])))   # the loss at the zero parameters
  assert first < start and float(np.mean(ns["losses"])) < start
