"""Collectives of one step run one after the other where gloo carries them between processes.

XLA:CPU orders the collectives of a program only by when they start; gloo tells two
all-reduces apart only by their order on each link. An all-reduce that does not depend
on the one before it (the non-finite verdict beside the exchange) once ran beside it
across 4 processes and took its messages: gloo aborted the job ("Received data size
doesn't match expected size. 8 vs 4"). ``coll.after`` makes the exchange wait for the
verdict (or the verdict for the exchange; where the exchange has a dense bucket, the
verdict's flag rides in it and has no collective of its own). The multi-process case
that failed is in ``test_multiprocess.py`` (slow tier); here the compiled programs show
the dependency, with the ordering forced on in one process.
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
def test_the_verdict_rides_in_the_exchange_or_runs_in_order_with_it(name, ordered):
  params, loss_fn, batch = _mlp()
  mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  dp = commopt.data_parallel(loss_fn, TXS[name](), mesh, local_params=name.startswith("diloco"))
  p, s = dp.place_params(params), dp.init(params)
  hlo = dp.lower(p, s, batch).compile().as_text()
  entry = _entry(hlo)
  collectives = [n for n, (line, _) in entry.items() if COLLECTIVE.search(line)]
  # The verdict of its own: an int32 all-reduce; under a synchronisation mode a conditional
  # around it (agreed only on the steps that exchange) that returns the agreed bool.
  verdict = [n for n in collectives
             if re.search(r"= s32\[\] all-reduce\(", entry[n][0])
             or (re.search(r"= \(pred\[\]\) conditional\(", entry[n][0])
                 and any(re.search(r"s32\[\] all-reduce\(", _computation(hlo, b))
                         for b in _branches(entry[n][0])))]
  others = [n for n in collectives if n not in verdict]
  assert others, collectives
  if name == "dense":
    # Every leaf goes through the dense buckets: the flag is one more element of one.
    assert not verdict and len(others) == 1, collectives
    assert re.search(r"f32\[1\]", entry[others[0]][0].split("all-reduce(")[0])
  elif name == "sign two-phase":
    # Every leaf compressed, no dense bucket to ride in: the verdict's all-reduce runs
    # after every collective of the exchange.
    assert len(verdict) == 1, collectives
    for n in others:
      assert n in _reads(entry, verdict[0]), f"{verdict[0]} does not wait for {n}"
  else:
    # Agreed before the exchange (whose conditional takes the verdict).
    assert len(verdict) == 1, collectives
    for n in others:
      assert verdict[0] in _reads(entry, n), f"{n} does not wait for {verdict[0]}"
  assert not _side_by_side(entry)


def _branches(line: str) -> list:
  """The branch computations a conditional instruction names."""
  m = re.search(r"branch_computations=\{([^}]*)\}", line)
  return [b.strip() for b in m.group(1).split(",")] if m else []


def _computation(hlo: str, name: str) -> str:
  """The text of computation ``name`` in ``hlo``."""
  start = re.search(rf"\n{re.escape(name)} [^\n]*\{{\n", hlo)
  return hlo[start.end():hlo.index("\n}", start.end())] if start else ""


def _side_by_side(entry: dict) -> list:
  """Pairs of ENTRY's collectives neither of which waits for the other."""
  names = [n for n, (line, _) in entry.items() if COLLECTIVE.search(line)]
  return [(a, b) for i, a in enumerate(names) for b in names[i + 1:]
          if a not in _reads(entry, b) and b not in _reads(entry, a)]


@pytest.mark.parametrize("skip", [True, False])
def test_buckets_run_one_after_the_other(ordered, skip):
  """Several flat buckets in one step: each all-reduce waits for the one before it. Left
  independent, XLA combines small ones into one tuple all-reduce and may run large ones
  beside each other, which gloo would mix."""
  params, loss_fn, batch = _mlp()
  tx = optax.chain(commopt.compressed_mean(commopt.compressors.identity(), axis_name="data",
                                           bucket_bytes=1024), optax.sgd(0.1))
  mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  dp = commopt.data_parallel(loss_fn, tx, mesh, skip_nonfinite=skip)
  p, s = dp.place_params(params), dp.init(params)
  entry = _entry(dp.lower(p, s, batch).compile().as_text())
  buckets = [n for n, (line, _) in entry.items()
             if re.search(r"= f32\[\d+\]\S* all-reduce\(", line)]
  assert len(buckets) == 3, [entry[n][0] for n in entry if "all-reduce(" in entry[n][0]]
  assert not _side_by_side(entry)


@pytest.mark.slow
def test_without_processes_the_program_is_unchanged():
  params, loss_fn, batch = _mlp()
  mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  assert not coll.crosses_processes()
  dp = commopt.data_parallel(loss_fn, TXS["dense"](), mesh)
  p, s = dp.place_params(params), dp.init(params)
  entry = _entry(dp.lower(p, s, batch).compile().as_text())
  assert len([n for n, (line, _) in entry.items() if "all-reduce(" in line]) == 1
  dp = commopt.data_parallel(loss_fn, TXS["sign two-phase"](), mesh)
  p, s = dp.place_params(params), dp.init(params)
  entry = _entry(dp.lower(p, s, batch).compile().as_text())
  ar = [n for n, (line, _) in entry.items() if COLLECTIVE.search(line)]
  verdict = [n for n in ar if re.search(r"= s32\[\] all-reduce\(", entry[n][0])]
  assert len(ar) > 1 and len(verdict) == 1
  # The exchange and the verdict stay independent: nothing was added between them.
  assert not set(ar) & _reads(entry, verdict[0])


def test_after_is_the_identity_bit_for_bit(ordered):
  x = jnp.array([-0.0, 0.0, jnp.nan, -jnp.inf, jnp.inf, 1e-45, -3.5], jnp.float32)
  tree = {"f32": x, "bf16": x.astype(jnp.bfloat16), "i32": jnp.arange(3),
          "flag": jnp.array(True)}
  for dep in (jnp.array(True), jnp.array(jnp.nan), jnp.arange(4), jnp.zeros(0)):
    got = jax.jit(lambda t, d: coll.after(t, d))(tree, dep)
    for k in tree:
      assert_same_bits(np.asarray(got[k]), np.asarray(tree[k]))


def test_after_orders_the_backward_pass_too(ordered):
  """Differentiated, ``after(x, d)`` gives ``d`` a zero cotangent computed from ``x``'s: the
  gradient is unchanged bit for bit, and what computes ``d`` runs backward after what reads
  ``x``."""
  def f(x, d):
    return jnp.sum(jnp.sin(coll.after(x, jnp.cos(d)))) + jnp.sum(d * d)

  x, d = jnp.linspace(-1.0, 1.0, 8), jnp.linspace(0.5, 2.0, 8)
  gx, gd = jax.jit(jax.grad(f, argnums=(0, 1)))(x, d)
  assert_same_bits(np.asarray(gx), np.asarray(jnp.cos(x)))
  assert_same_bits(np.asarray(gd), np.asarray(2 * d))
  # In the backward computation, d's cotangent reads x's (the isnan of its first element).
  text = str(jax.make_jaxpr(jax.grad(f, argnums=1))(x, d))
  assert text.count("is_finite") + text.count(" ne ") >= 2, text


def _stacked_zero(order: bool):
  """zero_data_parallel gathering a stack of layers one at a time under a scan, the head
  gathered outside it (ordered before the loop by ``after``, or not)."""
  layers = 3
  rng = np.random.default_rng(0)
  params = {"embed": jnp.asarray(rng.normal(size=(8, 32)) / 3, jnp.float32),
            "layers": {"w": jnp.asarray(rng.normal(size=(layers, 32, 32)) / 12, jnp.float32)},
            "head": jnp.asarray(rng.normal(size=(32, 4)) / 6, jnp.float32)}

  def loss_fn(p, b, gather):
    head = gather(p["head"])
    h = jnp.tanh(b["x"] @ gather(p["embed"]))
    if order:
      h = commopt.comm.after(h, head)
    body = gather.remat(lambda h, rows: (h + jnp.tanh(h @ gather(rows)["w"]), None))
    h, _ = jax.lax.scan(body, h, p["layers"])
    return jnp.mean((h @ head - b["y"]) ** 2)

  mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  zp = commopt.zero_data_parallel(loss_fn, optax.sgd(0.1), mesh, gather="manual",
                                  skip_nonfinite=False)
  sharded = zp.shard(params, stacked={"embed": False, "layers": True, "head": False})
  batch = {"x": rng.normal(size=(16, 8)).astype(np.float32),
           "y": rng.normal(size=(16, 4)).astype(np.float32)}
  return zp.lower(sharded, zp.init(sharded), batch).compile().as_text()


def _beside_a_loop(hlo: str) -> list:
  """(collective, loop) pairs of ENTRY where neither waits for the other: a collective at
  the top level that can run beside a loop whose body has collectives of its own."""
  entry = _entry(hlo)
  loops = [n for n, (line, _) in entry.items() if " while(" in line]
  tops = [n for n, (line, _) in entry.items() if COLLECTIVE.search(line)]
  return [(c, w) for c in tops for w in loops
          if c not in _reads(entry, w) and w not in _reads(entry, c)]


def test_a_gather_outside_a_scan_is_ordered_with_its_loops_by_after(ordered):
  """ZeRO-3 with one layer gathered at a time: the head's gather and its gradient's
  reduce-scatter sit outside the scan's loops. Without ``after`` they can run beside a
  loop's gathers (two-node runs aborted on a collective mismatch); with it each waits for
  the loops or they for it."""
  assert _beside_a_loop(_stacked_zero(order=False))
  assert not _beside_a_loop(_stacked_zero(order=True))
