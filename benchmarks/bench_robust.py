"""Byzantine robustness: final loss of each aggregation rule under each attack.

8 workers are simulated with ``jax.vmap(..., axis_name="workers")``; ``f`` of
them (workers ``0 .. f-1``) attack. Krum, Multi-Krum, trimmed mean
(``beta = 0.25``) and centred clipping are configured for ``f = 2`` and run
with ``f = 1, 2``; the median family (coordinate-wise and geometric median)
tolerates any ``f < n/2`` and runs with ``f = 1, 2, 3``; the plain mean (the
baseline) runs with all three. Attacks: sign flip, Gaussian noise, scaled
updates (``-100 u``), ALIE (``z = 1``), inner-product manipulation
(``epsilon = 0.1``), and bit flips of packed ``int_quant`` payloads
(``rate = 0.05``; those runs send every update through that compressor).

Two problems:

- ``convex``: least squares, 8 workers with 64 samples each (d = 10), full
  gradients, SGD; the loss is over all workers' clean data.
- ``digits``: the demo CNN (``examples/digits_cnn.py``) on sklearn's digits, 5
  epochs of SGD (lr 0.05, batches of 16 per worker) with heavy-ball momentum
  0.9 on each worker *before* the attack and the rule (``--momentum-at
  worker``, Karimireddy et al. 2021), so the rule sees momenta; ``--momentum-at
  server`` applies it to the aggregate instead. centered_clip uses ``tau = 10``
  (about the honest momenta's distance to the last aggregate) and 3
  iterations. The loss is over the whole clean training set.

One compiled step per rule (and per wire: dense or compressed) serves every
attack and attacker set: the attack kind and the Byzantine mask are traced
inputs. It prints, per problem, the final loss and its ratio to the honest
plain-mean run, each rule's worst ratio (also against its own run without
attackers) beside its stated factor (``FACTORS``), writes
``benchmarks/results/robust.json`` (after every digits run, so an interrupted
run keeps what it measured) and a heat map ``robust_<problem>.png`` beside it.
``--check`` exits 1 unless every rule meets its stated factor.

The rules' configurations, the attacked chain and the convex problem are
``commopt.aggregators._study``; the stated factors and their check are
``commopt.aggregators._tolerance`` (``tests/test_robust.py`` holds the convex
problem to them). This script adds the demo CNN, the sorting speed, the
tables and the plots.

    python benchmarks/bench_robust.py --problems convex --check     # seconds
    python benchmarks/bench_robust.py --problems digits --check     # ~30 min on 2 CPU cores
    python benchmarks/bench_robust.py --problems digits --rules mean,krum --attacks none,alie --fs 2
    python benchmarks/bench_robust.py --problems speed    # sorting network vs jnp.sort
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

from commopt.aggregators import _sorting  # noqa: E402
from commopt.aggregators._study import (  # noqa: E402
    ATTACKS,
    AXIS,
    CC_ITERS,
    DESIGN_F,
    MEDIAN_F,
    NUM_WORKERS,
    RULES,
    attacked_chain,
    configs,
    masks,
    run_convex,
)
from commopt.aggregators._tolerance import FACTORS, check_factors, loss_ratios  # noqa: E402

DIGITS_TAU = 10.0
"""centered_clip's radius on the CNN: about the honest momenta's distance to the last aggregate."""


# ---------------------------------------------------------------------------
# The demo model.


def digits_runner(rule: str, compressed: bool, *, lr: float, tau: float, momentum: float = 0.9,
                  worker_momentum: bool = True, seed: int = 0):
  """``(init_params, step(params, opt_state, batch, kind, mask), tx_init, loss_on)``.

  ``worker_momentum`` puts the momentum on each worker before the rule;
  otherwise it is applied once, to the aggregate (``optax.sgd(lr, momentum)``).
  """
  sys.path.insert(0, str(ROOT / "examples"))
  from digits_cnn import model_fns
  params, _, loss_fn = model_fns(seed)
  params = jax.tree.map(jnp.asarray, params)
  opt = optax.sgd(lr) if worker_momentum else optax.sgd(lr, momentum=momentum)

  def tx_for(kind, mask):
    return attacked_chain(rule, kind, mask, tau=tau, compressed=compressed, optimizer=opt,
                          momentum=momentum if worker_momentum else 0.0)

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


def run_digits(rules=RULES, names=ATTACKS, fs=(1, 2, 3), *, epochs: int = 5,
               max_steps=None, batch_size: int = 128, lr: float = 0.05, tau: float = DIGITS_TAU,
               momentum: float = 0.9, worker_momentum: bool = True, seed: int = 0,
               on_result=None) -> dict:
  """``{rule: {"attack/f": final training loss}}`` on the demo CNN.

  Prints a line per run; ``on_result(results)`` is called after each run (the
  command line uses it to save partial results).
  """
  sys.path.insert(0, str(ROOT / "examples"))
  from digits_cnn import load_digits_split
  x, y, _, _ = load_digits_split(seed)
  per = batch_size // NUM_WORKERS
  steps = len(x) // (per * NUM_WORKERS)
  full = {"x": jnp.asarray(x), "y": jnp.asarray(y)}
  kinds = list(ATTACKS[:-1])
  results = {}
  for rule in rules:
    row = results.setdefault(rule, {})
    for compressed in (False, True):
      group = [c for c in configs(fs, names, rule) if (c[0] == "bit_flip") == compressed]
      if not group:
        continue
      params0, init, step, loss_fn = digits_runner(
          rule, compressed, lr=lr, tau=tau, momentum=momentum,
          worker_momentum=worker_momentum, seed=seed)
      for kind, f in group:
        t0 = time.perf_counter()
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
        row[f"{kind}/{f}"] = loss = float(loss_fn(params, full))
        print(f"  digits: {rule:<17} {kind}/{f:<3} loss {loss:.4g}  "
              f"({done} steps, {time.perf_counter() - t0:.0f} s)", flush=True)
        if on_result is not None:
          on_result(results)
  return results


# ---------------------------------------------------------------------------
# Speed of the coordinate-wise sort behind the median family.


def run_speed(ns=(8, 16), d: int = 1 << 20, repeats: int = 5) -> dict:
  """Best-of-``repeats`` ms of XLA's ``jnp.sort`` / ``jnp.median`` over axis 0 against the
  sorting network (``sort_workers`` / ``median_workers``), same run, same input."""
  import timeit
  out = {}
  for n in ns:
    x = jnp.asarray(np.random.default_rng(n).normal(size=(n, d)).astype(np.float32))
    pairs = {"sort": (lambda v: jnp.sort(v, axis=0), _sorting.sort_workers),
             "median": (lambda v: jnp.median(v, axis=0), _sorting.median_workers)}
    for what, (xla, net) in pairs.items():
      times = []
      for fn in (xla, net):
        f = jax.jit(fn)
        f(x).block_until_ready()
        times.append(1e3 * min(timeit.repeat(lambda f=f: f(x).block_until_ready(),
                                             number=1, repeat=repeats)))
      out[f"{what} n={n} d={d}"] = {"xla_ms": times[0], "network_ms": times[1],
                                    "speedup": times[0] / times[1]}
      print(f"  {what:<6} n={n:<3} d={d}: jnp {times[0]:8.2f} ms   network {times[1]:8.2f} ms"
            f"   {times[0] / times[1]:5.1f}x", flush=True)
  return out


# ---------------------------------------------------------------------------
# Reporting.


def _order(cols):
  return sorted(cols, key=lambda c: (ATTACKS.index(c.split("/")[0]), c))


def table(results: dict, title: str) -> str:
  """Final loss and its ratio to the honest plain-mean run, one row per attack/f."""
  honest = results.get("mean", {}).get("none/0", float("nan"))
  rules = list(results)
  cols = _order({c for r in results.values() for c in r})
  width = max(15, *(len(r) + 1 for r in rules))
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


def summary(results: dict, factors: dict) -> str:
  """Per rule: the worst ratio under attack, against the honest mean run and against
  the rule's own honest run, and the stated factor (against the honest mean run)."""
  lines = [f"{'rule':<18}{'worst vs honest mean':>28}{'worst vs own honest run':>28}"
           f"{'stated':>10}"]
  for rule in results:
    if rule == "mean":
      continue
    cells = []
    for own in (False, True):
      r = {c: v for c, v in loss_ratios(results, rule, own).items() if c != "none/0"}
      if not r:
        cells.append(f"{'-':>28}")
        continue
      worst = max(r, key=r.get)
      cells.append(f"{f'{r[worst]:.2f}x ({worst})':>28}")
    stated = factors.get(rule)
    if isinstance(stated, dict):
      stated = "/".join(f"{v:g}x" for _, v in sorted(stated.items()))
    elif stated is not None:
      stated = f"{stated:g}x"
    lines.append(f"{rule:<18}" + "".join(cells) + f"{stated or '-':>10}")
  return "\n".join(lines)


def plot(results: dict, problem: str, path: pathlib.Path) -> None:
  """A heat map of log2(loss / honest mean loss), rules x attack/f (needs matplotlib)."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("(matplotlib is not installed: no plot)")
    return
  rules = list(results)
  cols = _order({c for r in results.values() for c in r})
  grid = np.full((len(rules), len(cols)), np.nan)
  for i, rule in enumerate(rules):
    for j, c in enumerate(cols):
      v = loss_ratios(results, rule).get(c)
      if v is not None:
        grid[i, j] = np.log2(min(v, 2.0**10))
  fig, ax = plt.subplots(figsize=(1.0 + 0.5 * len(cols), 1.2 + 0.45 * len(rules)))
  im = ax.imshow(grid, cmap="RdYlGn_r", vmin=-1, vmax=6, aspect="auto")
  ax.set_xticks(range(len(cols)), cols, rotation=60, ha="right", fontsize=8)
  ax.set_yticks(range(len(rules)), rules, fontsize=8)
  for i in range(len(rules)):
    for j in range(len(cols)):
      if np.isfinite(grid[i, j]):
        v = 2.0**grid[i, j]
        ax.text(j, i, "div" if v >= 2.0**10 else f"{v:.1f}", ha="center", va="center", fontsize=6)
  fig.colorbar(im, ax=ax, label="log2(loss / honest mean loss)")
  ax.set_title(f"{problem}: {NUM_WORKERS} workers, f attackers (attack/f)")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  print(f"wrote {path}")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--problems", default="convex,digits",
                 help="comma-separated: convex, digits, speed (the median family's sort)")
  p.add_argument("--rules", default=",".join(RULES))
  p.add_argument("--attacks", default=",".join(ATTACKS))
  p.add_argument("--fs", default="1,2,3",
                 help="attacker counts (each rule runs those it tolerates, see _study.tolerated)")
  p.add_argument("--epochs", type=int, default=5, help="digits: epochs")
  p.add_argument("--max-steps", type=int, default=None, help="digits: stop each run early")
  p.add_argument("--momentum", type=float, default=0.9, help="digits: heavy-ball momentum")
  p.add_argument("--momentum-at", choices=("worker", "server"), default="worker",
                 help="digits: momentum on each worker before the rule, or on the aggregate")
  p.add_argument("--tau", type=float, default=DIGITS_TAU, help="digits: centered_clip radius")
  p.add_argument("--check", action="store_true",
                 help="exit 1 unless every rule meets its stated factor (FACTORS)")
  p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "robust.json"))
  p.add_argument("--report", metavar="JSON", default=None,
                 help="run nothing: print the tables (and --check) of a saved run")
  return p.parse_args(argv)


def report(path: str, do_check: bool) -> None:
  """Tables, summaries, heat maps and the factor check of a saved run."""
  saved = json.loads(pathlib.Path(path).read_text())
  failures = []
  for problem in ("convex", "digits"):
    if problem in saved:
      failures += present(saved[problem], problem, pathlib.Path(path))
      print()
  finish(failures, do_check)


def present(res: dict, problem: str, path: pathlib.Path) -> list[str]:
  """Prints the table and the summary, draws the heat map beside ``path``, and
  returns the runs over their stated factors."""
  print(table(res, problem))
  print(summary(res, FACTORS[problem]))
  plot(res, problem, path.with_name(f"robust_{problem}.png"))
  return [f"{problem}: {line}" for line in check_factors(res, FACTORS[problem])]


def finish(failures: list[str], do_check: bool) -> None:
  if do_check:
    if failures:
      sys.exit("stated factors not met:\n  " + "\n  ".join(failures))
    print("every rule meets its stated factor")


def main(argv=None):
  args = parse_args(argv)
  if args.report:
    return report(args.report, args.check)
  rules = tuple(r for r in args.rules.split(",") if r)
  names = tuple(a for a in args.attacks.split(",") if a)
  for r in rules:
    if r not in RULES:
      sys.exit(f"--rules: unknown {r!r}; valid: {RULES}")
  for a in names:
    if a not in ATTACKS:
      sys.exit(f"--attacks: unknown {a!r}; valid: {ATTACKS}")
  try:
    fs = tuple(int(f) for f in args.fs.split(",") if f)
  except ValueError:
    sys.exit(f"--fs: expected comma-separated integers, got {args.fs!r}")
  if any(not 1 <= f < NUM_WORKERS / 2 for f in fs):
    sys.exit(f"--fs: each f must be in [1, {NUM_WORKERS / 2:g}), got {args.fs!r}")
  out = {"workers": NUM_WORKERS, "design_f": DESIGN_F, "median_f": MEDIAN_F,
         "backend": jax.default_backend(), "machine": platform.platform(), "jax": jax.__version__,
         "digits_settings": {"epochs": args.epochs, "max_steps": args.max_steps,
                             "momentum": args.momentum, "momentum_at": args.momentum_at,
                             "tau": args.tau, "cc_iters": CC_ITERS}}
  path = pathlib.Path(args.out)
  path.parent.mkdir(parents=True, exist_ok=True)

  def save(problem=None, res=None):
    if problem is not None:
      out[problem] = res
    path.write_text(json.dumps(out, indent=1))

  failures = []
  for problem in [p for p in args.problems.split(",") if p]:
    t0 = time.perf_counter()
    if problem == "speed":
      out["speed"] = run_speed()
      save()
      continue
    if problem == "convex":
      res = run_convex(rules, names, fs)
    elif problem == "digits":
      res = run_digits(rules, names, fs, epochs=args.epochs, max_steps=args.max_steps,
                       momentum=args.momentum, worker_momentum=args.momentum_at == "worker",
                       tau=args.tau, on_result=lambda r: save("digits", r))
    else:
      sys.exit(f"--problems: unknown {problem!r}; valid: convex, digits, speed")
    save(problem, res)
    failures += present(res, problem, path)
    print(f"({time.perf_counter() - t0:.1f} s)\n")
  save()
  print(f"wrote {path}")
  finish(failures, args.check)


if __name__ == "__main__":
  main()
