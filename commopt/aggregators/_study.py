"""The robustness study behind the stated factors: rules × attacks on least squares.

8 workers are simulated with ``jax.vmap(..., axis_name="workers")``; ``f`` of
them (workers ``0 .. f-1``) attack. Krum, Multi-Krum, trimmed mean
(``beta = 0.25``) and centred clipping are configured for ``f = 2`` and run
with ``f = 1, 2``; the median family (coordinate-wise and geometric median)
tolerates any ``f < n/2`` and runs with ``f = 1, 2, 3``; the plain mean (the
baseline) runs with all three. Attacks: those of
:mod:`commopt.aggregators.attacks` and bit flips of packed ``int_quant``
payloads (``rate = 0.05``; those runs send every update through that
compressor).

:func:`run_convex` is the least-squares problem whose final losses
``tests/test_robust.py`` holds to ``FACTORS["convex"]``
(:mod:`commopt.aggregators._tolerance`); ``benchmarks/bench_robust.py``
prints and plots it, and runs the demo CNN through the same
:func:`attacked_chain`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from commopt.aggregators import _robust as robust
from commopt.aggregators import attacks
from commopt.compressors import int_quant

AXIS = "workers"
NUM_WORKERS = 8
DESIGN_F = 2
"""The ``f`` Krum, Multi-Krum, the trimmed mean and centred clipping are configured for."""
MEDIAN_FAMILY = ("coordinate_median", "geometric_median")
"""Rules that tolerate any ``f < n/2``: configured for, and run up to, ``f = MEDIAN_F``."""
MEDIAN_F = (NUM_WORKERS - 1) // 2
ATTACKS = ("none",) + attacks.KINDS + ("bit_flip",)
RULES = ("mean", "krum", "multi_krum", "coordinate_median", "trimmed_mean",
         "centered_clip", "geometric_median")
CC_ITERS = 3
"""centered_clip iterations per step (the paper uses 1; 3 trains faster on the CNN)."""


def tolerated(rule: str, f: int) -> bool:
  """Whether ``rule`` is run with ``f`` attackers: ``f <= MEDIAN_F`` for the median
  family and the plain mean (the baseline), ``f <= DESIGN_F`` for the others."""
  return f <= (MEDIAN_F if rule in MEDIAN_FAMILY + ("mean",) else DESIGN_F)


def make_rule(name: str, *, tau: float, compressor=None,
              payload_attack=None) -> optax.GradientTransformationExtraArgs:
  """The aggregator ``name`` over ``AXIS``, configured for the largest ``f`` it is run with."""
  # Every leaf of the least-squares model is small: compress them all.
  wire = dict(compressor=compressor, payload_attack=payload_attack, min_size=0)
  if name == "mean":
    # The plain mean through the same all-gather path: a trimmed mean with beta = 0.
    return robust.trimmed_mean(0.0, axis_name=AXIS, **wire)
  if name == "krum":
    return robust.krum(DESIGN_F, axis_name=AXIS, **wire)
  if name == "multi_krum":
    return robust.multi_krum(DESIGN_F, axis_name=AXIS, **wire)
  if name == "coordinate_median":
    return robust.coordinate_median(MEDIAN_F, axis_name=AXIS, **wire)
  if name == "trimmed_mean":
    # beta = f/n with f = DESIGN_F (at f = MEDIAN_F it would equal the median).
    return robust.trimmed_mean(DESIGN_F / NUM_WORKERS, DESIGN_F, axis_name=AXIS, **wire)
  if name == "centered_clip":
    return robust.centered_clip(tau, axis_name=AXIS, iters=CC_ITERS, f=DESIGN_F, **wire)
  if name == "geometric_median":
    return robust.geometric_median(axis_name=AXIS, iters=8, f=MEDIAN_F, **wire)
  raise ValueError(f"make_rule: `name` must be one of {RULES}, got {name!r}.")


def attacked_chain(rule: str, kind_index, mask, *, tau: float, compressed: bool,
                   optimizer: optax.GradientTransformation,
                   momentum: float = 0.0) -> optax.GradientTransformation:
  """[worker momentum ->] attack (kind chosen by the traced ``kind_index`` into
  ``ATTACKS[:-1]``) -> rule -> optimizer.

  ``momentum > 0`` puts each worker's heavy-ball momentum (``optax.trace``) before
  the attack and the rule, as Karimireddy et al. (2021) do: the rule then sees
  momenta, whose spread across honest workers is much smaller than the
  gradients'. The attackers see the honest momenta (ALIE and IPM use their mean
  and spread).

  ``compressed=True`` sends updates as ``int_quant`` payloads and flips bits of the
  masked workers' payloads (the ``bit_flip`` attack); the update attack is then skipped.
  """
  before = (optax.trace(momentum),) if momentum > 0 else ()
  if compressed:
    agg = make_rule(rule, tau=tau, compressor=int_quant(),
                    payload_attack=attacks.bit_flip(mask, rate=0.05))
    return optax.chain(*before, agg, optimizer)

  def corrupt(updates, state, params=None):
    del params
    key = jax.random.fold_in(jax.random.PRNGKey(0), state)
    branches = [lambda u: u] + [
        (lambda u, k=k: attacks.apply_attack(u, k, axis_name=AXIS, byzantine=mask, key=key))
        for k in attacks.KINDS]
    return jax.lax.switch(kind_index, branches, updates), state + 1

  tx_attack = optax.GradientTransformation(lambda p: jnp.zeros([], jnp.uint32), corrupt)
  return optax.chain(*before, tx_attack, make_rule(rule, tau=tau), optimizer)


def configs(fs=(1, 2, 3), names=ATTACKS, rule=None) -> list[tuple[str, int]]:
  """(attack, f) pairs, the honest run first; only those ``rule`` tolerates if given."""
  out = [("none", 0)] if "none" in names else []
  out += [(a, f) for a in names if a != "none" for f in fs]
  return [c for c in out if rule is None or tolerated(rule, c[1])]


def masks(f: int) -> np.ndarray:
  """The Byzantine mask of ``f`` attackers: workers ``0 .. f-1``."""
  m = np.zeros(NUM_WORKERS, bool)
  m[:f] = True
  return m


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
  rule); the configurations are vmapped. Each worker takes full gradients of
  its 64 samples (d = 10) for ``steps`` SGD steps; the loss is over all
  workers' clean data.
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


def run_convex(rules=RULES, names=ATTACKS, fs=(1, 2, 3), **kw) -> dict[str, dict[str, float]]:
  """``{rule: {"attack/f": final loss}}`` on the least-squares problem.

  Examples:
    >>> from commopt.aggregators._study import run_convex
    >>> res = run_convex(("mean", "coordinate_median"), ("none", "scaled"), fs=(2,), steps=20)
    >>> sorted(res["coordinate_median"]), res["mean"]["scaled/2"] > res["mean"]["none/0"]
    (['none/0', 'scaled/2'], True)
  """
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
      # One program runs every configuration; keep those the rule is meant for.
      results[rule].update({f"{k}/{f}": float(v) for (k, f), v in zip(group, row)
                            if tolerated(rule, f)})
  return results


__all__ = ["ATTACKS", "AXIS", "CC_ITERS", "DESIGN_F", "MEDIAN_F", "MEDIAN_FAMILY", "NUM_WORKERS",
           "RULES", "attacked_chain", "configs", "convex_runner", "least_squares", "make_rule",
           "masks", "run_convex", "tolerated"]
