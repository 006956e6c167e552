"""Whether a compressor trains at its defaults: bounded residuals and a strongly convex problem.

Both run ``N`` simulated workers (``jax.vmap`` over a named axis) through
:func:`~commopt.compressed_mean` with its default ``error_feedback="auto"``,
inside one ``lax.scan``:

- :func:`residual_growth`: every worker's residual, relative to the size of
  its input, over ``steps`` steps of a constant gradient (the same on every
  worker) or of fresh normal gradients; compared with the bound
  ``2/δ`` that a contraction ``δ`` (:meth:`commopt.Compressor.delta`)
  guarantees.
- :func:`quadratic_gap`: SGD on ``f(x) = ½ Σ λ_i x_i²`` (``λ`` from 0.1 to 1,
  so ``lr·L = lr``) with independent normal noise in every worker's gradient;
  the mean loss over the last fifth of the steps against plain SGD's on the
  same noise (both settle at a noise floor, so the ratio is finite and
  says how much worse the compressor's floor is).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from commopt._src import base, feedback
from commopt.compressors import identity
from commopt.transforms import compressed_mean

SHAPE = (16, 16)
"""The leaf of :func:`quadratic_gap` (a matrix, so low-rank compressors compress it)."""

RESIDUAL_SHAPE = (8, 512)
"""The leaf of :func:`residual_growth`: a matrix whose rows fill QSGD's default bucket."""


class Growth(NamedTuple):
  """:func:`residual_growth`'s result.

  Attributes:
    ratios: ``[steps]``, the largest worker's ``‖e_t‖ / ‖g_t‖`` at each step
      (zeros without a residual).
    bound: ``√(1−δ)/(1−√(1−δ)) ≤ 2/δ``, what a contraction ``δ`` allows
      (``inf`` when the compressor declares none).
    kept: whether a residual is kept at all.
  """
  ratios: np.ndarray
  bound: float
  kept: bool


def _bound(delta) -> float:
  if delta is None:
    return float("inf")
  root = np.sqrt(max(1.0 - delta, 0.0))
  return float(root / (1.0 - root))


def residual_growth(compressor: base.Compressor, gradients: str = "constant", *,
                    num_workers: int = 4, steps: int = 500, error_feedback="auto",
                    seed: int = 0, shape: tuple[int, ...] = RESIDUAL_SHAPE) -> Growth:
  """Every worker's residual over ``steps`` steps, relative to its input.

  Args:
    compressor: the compressor, at the options to check.
    gradients: ``"constant"`` (one normal draw, the same on every worker and
      step) or ``"random"`` (fresh normal draws per worker and step).
    num_workers: simulated workers.
    steps: steps run.
    error_feedback: passed to :func:`~commopt.compressed_mean`.
    seed: seed of the gradients.
    shape: the leaf's shape.

  Returns:
    A :class:`Growth`.
  """
  tx = compressed_mean(compressor, axis_name="w", min_size=0, error_feedback=error_feedback)
  x = jnp.zeros(shape, jnp.float32)
  state = jax.vmap(tx.init, in_axes=None, axis_size=num_workers, axis_name="w")({"x": x})
  kept = not isinstance(state.residual["x"], optax.MaskedNode)
  key = jax.random.key(seed)
  constant = jnp.broadcast_to(jax.random.normal(key, shape), (num_workers,) + shape)
  update = jax.vmap(lambda u, s: tx.update({"x": u}, s), axis_name="w")

  def body(s, t):
    g = (constant if gradients == "constant"
         else jax.random.normal(jax.random.fold_in(key, t), (num_workers,) + shape))
    _, s = update(g, s)
    if not kept:
      return s, jnp.zeros([])
    norm = lambda a: jnp.sqrt(jnp.sum(jnp.square(a.reshape(num_workers, -1)), axis=1))
    return s, jnp.max(norm(s.residual["x"]) / norm(g))

  _, ratios = jax.jit(lambda s: jax.lax.scan(body, s, jnp.arange(steps)))(state)
  used, _ = feedback.feedback_compressor(compressor, error_feedback, "residual_growth")
  return Growth(np.asarray(ratios), _bound(used.delta(shape)), kept)


def _sgd_losses(tx, lr, sigma, num_workers, steps, seed):
  lam = jnp.asarray(np.linspace(0.1, 1.0, int(np.prod(SHAPE))).reshape(SHAPE), jnp.float32)
  x0 = jax.random.normal(jax.random.key(seed), SHAPE)
  state = jax.vmap(tx.init, in_axes=None, axis_size=num_workers, axis_name="w")({"x": x0})
  update = jax.vmap(lambda u, s: tx.update({"x": u}, s), axis_name="w")
  noise_key = jax.random.key(seed + 1)

  def body(carry, t):
    x, s = carry
    noise = jax.random.normal(jax.random.fold_in(noise_key, t), (num_workers,) + SHAPE)
    out, s = update(lam * x + sigma * noise, s)
    x = x - lr * out["x"][0]
    return (x, s), 0.5 * jnp.sum(lam * x * x)

  _, losses = jax.jit(lambda x, s: jax.lax.scan(body, (x, s), jnp.arange(steps)))(x0, state)
  return np.asarray(losses), float(0.5 * jnp.sum(lam * x0 * x0))


class Gap(NamedTuple):
  """:func:`quadratic_gap`'s result.

  Attributes:
    ratio: the compressor's mean loss over the last fifth of the steps over
      plain SGD's (``inf`` if it is not finite).
    initial: the loss at the start.
    final: the compressor's mean loss over the last fifth.
    dense: plain SGD's mean loss over the last fifth.
  """
  ratio: float
  initial: float
  final: float
  dense: float


def quadratic_gap(compressor: base.Compressor, *, lr: float = 0.15, sigma: float = 0.3,
                  num_workers: int = 4, steps: int = 500, error_feedback="auto",
                  seed: int = 0) -> Gap:
  """SGD with ``compressor`` on a noisy strongly convex quadratic, against plain SGD.

  ``f(x) = ½ Σ λ_i x_i²`` over a ``16×16`` leaf, ``λ`` evenly from 0.1 to 1
  (``L = 1``, so ``lr`` is ``lr·L``), ``x₀`` normal; each worker's gradient
  is ``λ x`` plus ``sigma`` times fresh normal noise. Plain SGD (the mean of
  the workers' gradients) runs on the same noise.

  Args:
    compressor: the compressor, at the options to check.
    lr: the step size (``lr·L``).
    sigma: the gradient noise per coordinate and worker.
    num_workers: simulated workers.
    steps: steps run.
    error_feedback: passed to :func:`~commopt.compressed_mean`.
    seed: seed of ``x₀`` and the noise.

  Returns:
    A :class:`Gap`.
  """
  tail = max(steps // 5, 1)
  dense, initial = _sgd_losses(compressed_mean(identity(), axis_name="w", min_size=0), lr, sigma,
                               num_workers, steps, seed)
  losses, _ = _sgd_losses(compressed_mean(compressor, axis_name="w", min_size=0,
                                          error_feedback=error_feedback),
                          lr, sigma, num_workers, steps, seed)
  final, floor = float(np.mean(losses[-tail:])), float(np.mean(dense[-tail:]))
  ratio = final / floor if np.isfinite(final) else float("inf")
  return Gap(ratio, initial, final, floor)
