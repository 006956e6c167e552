"""Byzantine robustness: final loss of each aggregation rule under each attack.

8 workers are simulated with ``jax.vmap(..., axis_name="workers")``; ``f`` of
them (workers ``0 .. f-1``) attack. Every rule is configured for the design
tolerance ``f = 2`` (Krum, trimmed mean with ``beta = 0.25``) and run with
``f = 1`` and ``f = 2`` actual attackers. Attacks: sign flip, Gaussian noise,
scaled updates (``-100 u``), ALIE (``z = 1``), inner-product manipulation
(``epsilon = 0.1``), and bit flips of packed ``int_quant`` payloads
(``rate = 0.05``; those runs send every update through that compressor).

Two problems:

- ``convex``: least squares, 8 workers with 64 samples each (d = 10), full
  gradients, SGD; the loss is over all workers' clean data.
- ``digits``: the demo CNN (``examples/digits_cnn.py``) on sklearn's digits,
  SGD with momentum; the loss is over the whole clean training set.

One compiled step per rule (and per wire: dense or compressed) serves every
attack and attacker set: the attack kind and the Byzantine mask are traced
inputs. It prints, per problem, the final loss and its ratio to the honest
plain-mean run, and writes ``benchmarks/results/robust.json``.

    python benchmarks/bench_robust.py                               # both problems
    python benchmarks/bench_robust.py --problems convex             # seconds
    python benchmarks/bench_robust.py --problems digits --epochs 1 --max-steps 5
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

import commopt  # noqa: E402
from commopt.aggregators import _robust as robust  # noqa: E402
from commopt.aggregators import attacks  # noqa: E402

AXIS = "workers"
NUM_WORKERS = 8
DESIGN_F = 2
ATTACKS = ("none",) + attacks.KINDS + ("bit_flip",)
RULES = ("mean", "krum", "multi_krum", "coordinate_median", "trimmed_mean",
         "centered_clip", "geometric_median")


def make_rule(name: str, *, tau: float, compressor=None, payload_attack=None):
  """The aggregator ``name`` over ``AXIS``, configured for ``f = DESIGN_F``."""
  wire = dict(compressor=compressor, payload_attack=payload_attack)
  if name == "mean":
    # The plain mean through the same all-gather path: a trimmed mean with beta = 0.
    return robust.trimmed_mean(AXIS, 0.0, **wire)
  if name == "krum":
    return robust.krum(AXIS, DESIGN_F, **wire)
  if name == "multi_krum":
    return robust.multi_krum(AXIS, DESIGN_F, **wire)
  if name == "coordinate_median":
    return robust.coordinate_median(AXIS, DESIGN_F, **wire)
  if name == "trimmed_mean":
    return robust.trimmed_mean(AXIS, DESIGN_F / NUM_WORKERS, DESIGN_F, **wire)
  if name == "centered_clip":
    return robust.centered_clip(AXIS, tau, iters=3, f=DESIGN_F, **wire)
  if name == "geometric_median":
    return robust.geometric_median(AXIS, iters=8, f=DESIGN_F, **wire)
  raise ValueError(f"make_rule: unknown rule {name!r}; valid: {RULES}.")


def attacked_chain(rule: str, kind_index, mask, *, tau: float, compressed: bool,
                   optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
  """attack (kind chosen by the traced ``kind_index`` into ``ATTACKS[:-1]``) -> rule -> optimizer.

  ``compressed=True`` sends updates as ``int_quant`` payloads and flips bits of the
  masked workers' payloads (the ``bit_flip`` attack); the update attack is then skipped.
  """
  if compressed:
    agg = make_rule(rule, tau=tau, compressor=commopt.int_quant(),
                    payload_attack=attacks.bit_flip(mask, rate=0.05))
    return optax.chain(agg, optimizer)

  def corrupt(updates, state, params=None):
    del params
    key = jax.random.fold_in(jax.random.PRNGKey(0), state)
    branches = [lambda u: u] + [
        (lambda u, k=k: attacks.apply_attack(u, k, axis_name=AXIS, byzantine=mask, key=key))
        for k in attacks.KINDS]
    return jax.lax.switch(kind_index, branches, updates), state + 1

  tx_attack = optax.GradientTransformation(lambda p: jnp.zeros([], jnp.uint32), corrupt)
  return optax.chain(tx_attack, make_rule(rule, tau=tau), optimizer)


def configs(fs=(1, 2), names=ATTACKS):
  """(attack, f) pairs: the honest run first."""
  out = [("none", 0)] if "none" in names else []
  return out + [(a, f) for a in names if a != "none" for f in fs]


def masks(f: int) -> np.ndarray:
  m = np.zeros(NUM_WORKERS, bool)
  m[:f] = True
  return m


# ---------------------------------------------------------------------------
# The convex problem.


def least_squares(seed: int = 0, samples: int = 64, dim: int = 10, noise: float = 0.5):
  """Per-worker data ``(A [n, m, d], b [n, m])`` and the global loss ``loss(x)``."""
  rng = np.random.default_rng(seed)
  a = rng.normal(size=(NUM_WORKERS, samples, dim)).astype(np.float32)
  x_star = rng.normal(size=(dim,)).astype(np.float32)
  b = (a @ x_star + noise * rng.normal(size=(NUM_WORKERS, samples))).astype(np.float32)
  a, b = jnp.asarray(a), jnp.asarray(b)

  def loss(x):
    return 0.5 * jnp.mean(jnp.square(jnp.einsum("nmd,d->nm", a, x) - b))

  return a, b, loss


def convex_runner(rules: tuple[str, ...], compressed: bool, *, steps: int = 150,
                  lr: float = 0.1, tau: float = 0.5, seed: int = 0):
  """A jitted ``run(kind_indices [C], masks [C, n]) -> final losses [R, C]``.

  One program for all ``rules`` (compiling once is much faster than once per
  rule); the configurations are vmapped.
  """
  a, b, loss = least_squares(seed)
  dim = a.shape[-1]

  def one(rule, kind_index, mask):
    tx = attacked_chain(rule, kind_index, mask, tau=tau, compressed=compressed,
                        optimizer=optax.sgd(lr))

    def worker(a_w, b_w):
      grad = jax.grad(lambda x: 0.5 * jnp.mean(jnp.square(a_w @ x - b_w)))

      def step(carry, _):
        x, state = carry
        u, state = tx.update(grad(x), state, x)
        return (optax.apply_updates(x, u), state), None

      x0 = jnp.zeros((dim,), jnp.float32)
      (x, _), _ = jax.lax.scan(step, (x0, tx.init(x0)), None, length=steps)
      return x

    xs = jax.vmap(worker, axis_name=AXIS)(a, b)
    return loss(xs[0])

  return jax.jit(lambda ks, ms: jnp.stack(
      [jax.vmap(lambda k, m, r=r: one(r, k, m))(ks, ms) for r in rules]))


def run_convex(rules=RULES, names=ATTACKS, fs=(1, 2), **kw) -> dict:
  """``{rule: {"attack/f": final loss}}`` on the least-squares problem."""
  dense = [c for c in configs(fs, names) if c[0] != "bit_flip"]
  flips = [c for c in configs(fs, names) if c[0] == "bit_flip"]
  kinds = list(ATTACKS[:-1])
  results = {rule: {} for rule in rules}
  for group, compressed in ((dense, False), (flips, True)):
    if not group:
      continue
    ks = jnp.array([kinds.index(k) if k in kinds else 0 for k, _ in group], jnp.int32)
    ms = jnp.asarray(np.stack([masks(f) for _, f in group]))
    losses = np.asarray(convex_runner(tuple(rules), compressed, **kw)(ks, ms))
    for rule, row in zip(rules, losses):
      results[rule].update({f"{k}/{f}": float(v) for (k, f), v in zip(group, row)})
  return results


# ---------------------------------------------------------------------------
# The demo model.


def digits_runner(rule: str, compressed: bool, *, lr: float, tau: float, seed: int = 0):
  """``(init_params, step(params, opt_state, batch, kind, mask), tx_init, loss_on)``."""
  sys.path.insert(0, str(ROOT / "examples"))
  from digits_cnn import model_fns
  params, _, loss_fn = model_fns(seed)
  params = jax.tree.map(jnp.asarray, params)
  opt = optax.sgd(lr, momentum=0.9)

  def tx_for(kind, mask):
    return attacked_chain(rule, kind, mask, tau=tau, compressed=compressed, optimizer=opt)

  def init(params, kind, mask):
    return jax.vmap(lambda _: tx_for(kind, mask).init(params), axis_size=NUM_WORKERS)(
        jnp.arange(NUM_WORKERS))

  @jax.jit
  def step(params, opt_state, batch, kind, mask):
    tx = tx_for(kind, mask)

    def worker(state, shard):
      loss, grads = jax.value_and_grad(loss_fn)(params, shard)
      updates, state = tx.update(grads, state, params)
      return updates, state, loss

    updates, opt_state, _ = jax.vmap(worker, axis_name=AXIS)(opt_state, batch)
    params = optax.apply_updates(params, jax.tree.map(lambda u: u[0], updates))
    return params, opt_state

  return params, jax.jit(init), step, jax.jit(loss_fn)


def run_digits(rules=RULES, names=ATTACKS, fs=(1, 2), *, epochs: int = 2,
               max_steps=None, batch_size: int = 128, lr: float = 0.05, tau: float = 1.0,
               seed: int = 0) -> dict:
  """``{rule: {"attack/f": final training loss}}`` on the demo CNN."""
  sys.path.insert(0, str(ROOT / "examples"))
  from digits_cnn import load_digits_split
  x, y, _, _ = load_digits_split(seed)
  per = batch_size // NUM_WORKERS
  steps = len(x) // (per * NUM_WORKERS)
  full = {"x": jnp.asarray(x), "y": jnp.asarray(y)}
  kinds = list(ATTACKS[:-1])
  results = {}
  for rule in rules:
    row = {}
    for compressed in (False, True):
      group = [c for c in configs(fs, names) if (c[0] == "bit_flip") == compressed]
      if not group:
        continue
      params0, init, step, loss_fn = digits_runner(rule, compressed, lr=lr, tau=tau, seed=seed)
      for kind, f in group:
        k = jnp.int32(kinds.index(kind) if kind in kinds else 0)
        mask = jnp.asarray(masks(f))
        params, state = params0, init(params0, k, mask)
        done = 0
        for epoch in range(epochs):
          order = np.random.default_rng(seed + epoch).permutation(len(x))
          for s in range(steps):
            if max_steps is not None and done >= max_steps:
              break
            idx = order[s * per * NUM_WORKERS:(s + 1) * per * NUM_WORKERS]
            batch = {"x": jnp.asarray(x[idx]).reshape(NUM_WORKERS, per, *x.shape[1:]),
                     "y": jnp.asarray(y[idx]).reshape(NUM_WORKERS, per)}
            params, state = step(params, state, batch, k, mask)
            done += 1
        row[f"{kind}/{f}"] = float(loss_fn(params, full))
      print(f"  digits: {rule} done", flush=True)
    results[rule] = row
  return results


# ---------------------------------------------------------------------------
# Reporting.


def table(results: dict, title: str) -> str:
  """Final loss and ratio to the honest plain-mean run, one row per attack/f."""
  honest = results.get("mean", {}).get("none/0", float("nan"))
  rules = list(results)
  cols = sorted({c for r in results.values() for c in r},
                key=lambda c: (ATTACKS.index(c.split("/")[0]), c))
  width = max(12, *(len(r) + 1 for r in rules))
  lines = [f"{title}: final loss (ratio to honest mean = {honest:.4g})",
           f"{'attack/f':<14}" + "".join(f"{r:>{width}}" for r in rules)]
  for c in cols:
    cells = []
    for r in rules:
      v = results[r].get(c)
      if v is None:
        cells.append(f"{'-':>{width}}")
      elif not np.isfinite(v) or v > 1e6:
        cells.append(f"{'diverged':>{width}}")
      else:
        cells.append(f"{f'{v:.3g} ({v / honest:.2f}x)':>{width}}")
    lines.append(f"{c:<14}" + "".join(cells))
  return "\n".join(lines)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--problems", default="convex,digits", help="convex, digits or both")
  p.add_argument("--rules", default=",".join(RULES))
  p.add_argument("--attacks", default=",".join(ATTACKS))
  p.add_argument("--epochs", type=int, default=2, help="digits: epochs")
  p.add_argument("--max-steps", type=int, default=None, help="digits: stop each run early")
  p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "robust.json"))
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  rules = tuple(r for r in args.rules.split(",") if r)
  names = tuple(a for a in args.attacks.split(",") if a)
  for r in rules:
    if r not in RULES:
      sys.exit(f"--rules: unknown {r!r}; valid: {RULES}")
  for a in names:
    if a not in ATTACKS:
      sys.exit(f"--attacks: unknown {a!r}; valid: {ATTACKS}")
  out = {"workers": NUM_WORKERS, "design_f": DESIGN_F, "backend": jax.default_backend(),
         "machine": platform.platform(), "jax": jax.__version__}
  for problem in [p for p in args.problems.split(",") if p]:
    t0 = time.perf_counter()
    if problem == "convex":
      res = run_convex(rules, names)
    elif problem == "digits":
      res = run_digits(rules, names, epochs=args.epochs, max_steps=args.max_steps)
    else:
      sys.exit(f"--problems: unknown {problem!r}; valid: convex, digits")
    print(table(res, problem))
    print(f"({time.perf_counter() - t0:.1f} s)\n")
    out[problem] = res
  path = pathlib.Path(args.out)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(out, indent=1))
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
