"""Collectives of one step run one after the other where gloo carries them between processes.

XLA:CPU orders the collectives of a program only by when they start; gloo tells two
all-reduces apart only by their order on each link. An all-reduce that does not depend
on the one before it (the non-finite verdict beside the exchange) once ran beside it
across 4 processes and took its messages: gloo aborted the job ("Received data size
doesn't match expected size. 8 vs 4"). ``coll.after`` makes the exchange wait for the
verdict. The multi-process case that failed is in ``test_multiprocess.py`` (slow tier);
here the compiled programs show the dependency, with the ordering forced on in one
process.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import commopt
from commopt.comm import _collectives as coll
from commopt.testing import assert_same_bits

COLLECTIVE = re.compile(r" (all-reduce|all-gather|all-to-all|reduce-scatter|"
                        r"collective-permute|conditional)\(")


@pytest.fixture
def ordered(monkeypatch):
  monkeypatch.setattr(coll, "crosses_processes", lambda: True)


def _entry(hlo: str) -> dict:
  """ENTRY's instructions: name -> (line, the names it reads)."""
  body = hlo[hlo.index("\nENTRY"):].split("\n")[1:]
  out = {}
  for line in body:
    m = re.match(r"\s*(?:ROOT )?(%[\w.\-]+) = (.*)", line)
    if m:
      out[m.group(1)] = (line, set(re.findall(r"%[\w.\-]+", m.group(2))))
  return out


def _reads(entry: dict, name: str) -> set:
  """Every ENTRY instruction ``name`` depends on, transitively."""
  seen, todo = set(), [name]
  while todo:
    for dep in entry.get(todo.pop(), ("", ()))[1]:
      if dep in entry and dep not in seen:
        seen.add(dep)
        todo.append(dep)
  return seen


def _mlp():
  k1, k2 = jax.random.split(jax.random.key(0))
  params = {"w1": jax.random.normal(k1, (16, 64)) / 4, "b1": jnp.zeros(64),
            "w2": jax.random.normal(k2, (64, 10)) / 8, "b2": jnp.zeros(10)}

  def loss_fn(p, batch):
    h = jax.nn.relu(batch["x"] @ p["w1"] + p["b1"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"] + p["b2"],
                                                           batch["y"]).mean()

  batch = {"x": jax.random.normal(jax.random.key(1), (32, 16)),
           "y": jnp.arange(32) % 10}
  return params, loss_fn, batch


TXS = {
    "dense": lambda: optax.chain(
        commopt.compressed_mean(commopt.compressors.identity(), axis_name="data"),
        optax.sgd(0.1)),
    "sign two-phase": lambda: optax.chain(
        commopt.compressed_mean(commopt.scaled_sign(), axis_name="data", strategy="two_phase",
                                min_size=0), optax.sgd(0.1)),
    "diloco int4": lambda: commopt.diloco(optax.sgd(0.1), optax.sgd(1.0), axis_name="data",
                                          period=4, strategy="two_phase",
                                          compressor=commopt.int_quant(bits=4)),
}


@pytest.mark.parametrize("name", TXS)
def test_every_collective_of_the_exchange_waits_for_the_verdict(name, ordered):
  params, loss_fn, batch = _mlp()
  mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  dp = commopt.data_parallel(loss_fn, TXS[name](), mesh, local_params=name.startswith("diloco"))
  p, s = dp.place_params(params), dp.init(params)
  entry = _entry(dp.lower(p, s, batch).compile().as_text())
  collectives = [n for n, (line, _) in entry.items() if COLLECTIVE.search(line)]
  verdict = [n for n in collectives if re.search(r"= s32\[\] all-reduce\(", entry[n][0])]
  assert len(verdict) == 1, collectives
  others = [n for n in collectives if n not in verdict]
  assert others, collectives
  for n in others:
    assert verdict[0] in _reads(entry, n), f"{n} does not wait for {verdict[0]}"


def test_without_processes_the_program_is_unchanged():
  params, loss_fn, batch = _mlp()
  mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  dp = commopt.data_parallel(loss_fn, TXS["dense"](), mesh)
  p, s = dp.place_params(params), dp.init(params)
  assert not coll.crosses_processes()
  entry = _entry(dp.lower(p, s, batch).compile().as_text())
  ar = [n for n, (line, _) in entry.items() if "all-reduce(" in line]
  assert len(ar) == 2
  # The exchange and the verdict stay independent: nothing was added between them.
  assert not set(ar) & (_reads(entry, ar[0]) | _reads(entry, ar[1]))


def test_after_is_the_identity_bit_for_bit(ordered):
  x = jnp.array([-0.0, 0.0, jnp.nan, -jnp.inf, jnp.inf, 1e-45, -3.5], jnp.float32)
  tree = {"f32": x, "bf16": x.astype(jnp.bfloat16), "i32": jnp.arange(3),
          "flag": jnp.array(True)}
  for dep in (jnp.array(True), jnp.array(jnp.nan), jnp.arange(4), jnp.zeros(0)):
    got = jax.jit(lambda t, d: coll.after(t, d))(tree, dep)
    for k in tree:
      assert_same_bits(np.asarray(got[k]), np.asarray(tree[k]))
