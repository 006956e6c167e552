"""The README's Python examples run as written, on 8 simulated CPU devices."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import commopt

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
  blocks = python_blocks()
  assert len(blocks) >= 3
  assert "commopt.data_parallel" in blocks[0]
  assert any("majority_vote" in b for b in blocks)
  assert any("attacks.attack" in b for b in blocks)
  assert any("nnx_data_parallel" in b for b in blocks) and any("lax.scan" in b for b in blocks)
  assert any("local_value_and_grad" in b for b in blocks)


@pytest.mark.slow
def test_readme_blocks_run_in_order(capsys):
  ns = namespace()
  for block in python_blocks():
    exec(compile(block, str(README), "exec"), ns)   # noqa: S102 - the README's own code
  printed = capsys.readouterr().out
  assert "all-reduce" in printed           # the audit of the PowerSGD step
  assert np.isfinite(np.asarray(ns["losses"])).all()
  assert int(ns["opt_state"].total_notfinite) == 0
  # The nnx model was trained: its batch statistics moved from their initial zeros.
  assert np.abs(np.asarray(ns["model"].bn.mean[...])).max() > 0


@pytest.mark.parametrize("name", ["vote", "tx"])
def test_readme_fragment_trains_under_data_parallel(name):
  """The majority-vote and attacked robust chains from the README train a regression."""
  ns = namespace()
  fragments = [b for b in python_blocks() if "majority_vote" in b or "attacks.attack" in b]
  exec(compile("import jax, optax, commopt\n" + "\n".join(fragments), str(README), "exec"), ns)
  tx = ns[name]
  if name == "vote":
    tx = optax.chain(tx, optax.scale(1e2))   # steps of 0.1 rather than the README's 1e-3
  dp = commopt.data_parallel(ns["loss_fn"], tx, jax.make_mesh((8,), ("data",)))
  params, state = ns["params"], dp.init(ns["params"])
  first = None
  for _ in range(60):
    params, state, losses = dp.step(params, state, ns["batch"])
    first = float(losses.mean()) if first is None else first
  assert float(losses.mean()) < 0.5 * first
