"""Byzantine-robust aggregation: Krum, medians, trimmed mean, centred clipping, RFA.

Each factory here is :func:`~commopt.aggregators.robust_aggregate` with the
rule of its name from :mod:`commopt.aggregators.rules`: every worker
all-gathers the workers' updates (optionally compressed) over a named axis,
or a tuple of axes, and computes the same robust aggregate, so the output is
replicated.

Coordinate-wise rules (:func:`coordinate_median`, :func:`trimmed_mean`) work
leaf by leaf. Vector rules (:func:`krum`, :func:`multi_krum`,
:func:`centered_clip`, :func:`geometric_median`) treat each worker's whole
update pytree as one flattened vector: distances and norms are over all
leaves together.

The tolerance of each rule is the number ``f`` of Byzantine workers out of
``n`` it is designed for. The number of workers ``n`` is known only when the
update is traced, so that is when a rule whose ``n`` is too small for its
``f`` raises a ``ValueError``.
"""

from __future__ import annotations

import functools
from typing import Optional

import optax

from commopt._src import base
from commopt._src.tree import DEFAULT_MIN_SIZE
from commopt.aggregators import rules
from commopt._src.base import AxisName
from commopt.aggregators._sorting import (  # noqa: F401  (importable from here too)
    median_workers,
    sort_workers,
    sorting_network,
)
from commopt.aggregators._tolerance import check_tolerance  # noqa: F401
from commopt.aggregators._transform import (  # noqa: F401
    CenteredClipState,
    PayloadAttack,
    RobustState,
    robust_transform,
    zero_non_finite_workers,
)
from commopt.aggregators.rules import (  # noqa: F401
    clip_iterations,
    krum_scores,
    pairwise_sq_distances,
    trimmed_count,
    weiszfeld,
)


def _optional_f(f, fn: str) -> Optional[int]:
  return None if f is None else base.check_int("f", f, fn=fn, minimum=0)


def krum(f: int, *, axis_name: AxisName, compressor: Optional[base.Compressor] = None,
         min_size: int = DEFAULT_MIN_SIZE, payload_attack: Optional[PayloadAttack] = None,
         error_feedback: bool = False, seed: int = 0) -> optax.GradientTransformationExtraArgs:
  """Krum: the worker update closest to its ``n − f − 2`` nearest neighbours.

  Each worker's whole update (all leaves, flattened) is one vector ``x_i``.
  Its score is the sum of squared distances to its ``n − f − 2`` nearest
  other vectors; the output is the ``x_i`` of lowest score (the first on a
  tie), on every worker (:func:`commopt.aggregators.rules.krum`).

  Tolerance: ``f`` Byzantine workers out of ``n`` when ``n > 2f + 2``
  (Blanchard et al.); with ``n = 8`` that is ``f <= 2``. Fewer workers
  raise a ``ValueError`` when the update is traced.

  Krum keeps one worker's update, so even without attackers it has the
  variance of a single worker's batch; and colluding attackers that send the
  same update (ALIE) have the lowest scores and are picked every step. On the
  demo CNN both cost more than any other rule here (``benchmarks/bench_robust.py``);
  prefer :func:`multi_krum` or the median family.

  Args:
    axis_name: the named axis of the workers, or a tuple of axes (``None``:
      one local worker, which is always too few for Krum).
    f: the number of Byzantine workers to tolerate (an integer >= 0).
    compressor: ``None`` (dense) or a stateless per-leaf compressor whose
      packed payloads are gathered and decoded before the rule (see
      :func:`~commopt.aggregators.robust_aggregate`).
    min_size: leaves with fewer elements are sent dense.
    payload_attack: ``None`` or ``payload_attack(payload, *, key, axis_name)``
      applied to what each worker sends (see :mod:`commopt.aggregators.attacks`).
    error_feedback: with a ``compressor``, keep each worker's error memory
      in the state and add it to the next update before encoding.
    seed: seed of the base key of the compressor and the payload attack.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state :class:`RobustState`.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from commopt.aggregators import krum
    >>> tx = krum(f=1, axis_name="workers")
    >>> g = jnp.array([[1.0, 1.0], [1.1, 0.9], [0.9, 1.0], [1.0, 1.1], [50.0, -50.0]])
    >>> run = jax.vmap(lambda u: tx.update(u, tx.init(u))[0], axis_name="workers")
    >>> run(g)[4].tolist()
    [1.0, 1.0]

  References:
    Blanchard et al., Machine Learning with Adversaries: Byzantine Tolerant
    Gradient Descent, NeurIPS 2017.
  """
  fn = "krum"
  f = base.check_int("f", f, fn=fn, minimum=0)
  return robust_transform(fn, functools.partial(rules.krum, f=f), axis_name,
                          compressor=compressor, min_size=min_size,
                          payload_attack=payload_attack, error_feedback=error_feedback, seed=seed)


def multi_krum(f: int, m: Optional[int] = None, *, axis_name: AxisName,
               compressor: Optional[base.Compressor] = None, min_size: int = DEFAULT_MIN_SIZE,
               payload_attack: Optional[PayloadAttack] = None,
               error_feedback: bool = False, seed: int = 0) -> optax.GradientTransformationExtraArgs:
  """Multi-Krum: the mean of the ``m`` worker updates with the best Krum scores.

  Scores are those of :func:`krum` (over the flattened update pytree); the
  ``m`` lowest-scoring updates are averaged. ``m = 1`` is Krum; ``m = n − f``
  (the default) averages as many updates as can all be honest
  (:func:`commopt.aggregators.rules.multi_krum`).

  Tolerance: ``f`` out of ``n`` when ``n > 2f + 2``, and ``1 <= m <= n − f``;
  violations raise a ``ValueError`` when the update is traced.

  Args:
    axis_name: the named axis of the workers, or a tuple of axes.
    f: the number of Byzantine workers to tolerate (an integer >= 0).
    m: how many updates to average (default ``n − f``).
    compressor: ``None`` (dense) or a stateless per-leaf compressor whose
      packed payloads are gathered and decoded before the rule (see
      :func:`~commopt.aggregators.robust_aggregate`).
    min_size: leaves with fewer elements are sent dense.
    payload_attack: ``None`` or ``payload_attack(payload, *, key, axis_name)``
      applied to what each worker sends (see :mod:`commopt.aggregators.attacks`).
    error_feedback: with a ``compressor``, keep each worker's error memory
      in the state and add it to the next update before encoding.
    seed: seed of the base key of the compressor and the payload attack.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state :class:`RobustState`.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from commopt.aggregators import multi_krum
    >>> tx = multi_krum(f=1, m=2, axis_name="workers")
    >>> g = jnp.array([[1.0], [1.2], [0.7], [3.0], [-40.0]])
    >>> run = jax.vmap(lambda u: tx.update(u, tx.init(u))[0], axis_name="workers")
    >>> round(float(run(g)[0, 0]), 4)
    1.1

  References:
    Blanchard et al., Machine Learning with Adversaries: Byzantine Tolerant
    Gradient Descent, NeurIPS 2017.
  """
  fn = "multi_krum"
  f = base.check_int("f", f, fn=fn, minimum=0)
  if m is not None:
    m = base.check_int("m", m, fn=fn, minimum=1)
  return robust_transform(fn, functools.partial(rules.multi_krum, f=f, m=m), axis_name,
                          compressor=compressor, min_size=min_size,
                          payload_attack=payload_attack, error_feedback=error_feedback, seed=seed)


def coordinate_median(f: Optional[int] = None, *, axis_name: AxisName,
                      compressor: Optional[base.Compressor] = None,
                      min_size: int = DEFAULT_MIN_SIZE,
                      payload_attack: Optional[PayloadAttack] = None,
                      error_feedback: bool = False, seed: int = 0) -> optax.GradientTransformationExtraArgs:
  """The coordinate-wise median of the workers' updates.

  Each coordinate of each leaf is the median of the ``n`` workers' values
  (for even ``n``, the mean of the two middle values, as ``np.median``;
  :func:`commopt.aggregators.rules.coordinate_median`).

  Tolerance: fewer than half of the workers, ``f < n/2`` (breakdown point
  1/2): with ``f`` arbitrarily large values per coordinate, the median stays
  within the range of the honest values. Pass ``f`` to have that checked
  when the update is traced (``f >= n/2`` raises a ``ValueError``).

  Args:
    axis_name: the named axis of the workers, or a tuple of axes.
    f: optional number of Byzantine workers to check against ``n``.
    compressor: ``None`` (dense) or a stateless per-leaf compressor whose
      packed payloads are gathered and decoded before the rule (see
      :func:`~commopt.aggregators.robust_aggregate`).
    min_size: leaves with fewer elements are sent dense.
    payload_attack: ``None`` or ``payload_attack(payload, *, key, axis_name)``
      applied to what each worker sends (see :mod:`commopt.aggregators.attacks`).
    error_feedback: with a ``compressor``, keep each worker's error memory
      in the state and add it to the next update before encoding.
    seed: seed of the base key of the compressor and the payload attack.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state :class:`RobustState`.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from commopt.aggregators import coordinate_median
    >>> tx = coordinate_median(axis_name="workers")
    >>> g = jnp.array([[1.0, -1.0], [2.0, 1e9], [3.0, 0.0]])
    >>> run = jax.vmap(lambda u: tx.update(u, tx.init(u))[0], axis_name="workers")
    >>> run(g)[0].tolist()
    [2.0, 0.0]

  References:
    Yin et al., Byzantine-Robust Distributed Learning: Towards Optimal
    Statistical Rates, ICML 2018.
  """
  fn = "coordinate_median"
  f = _optional_f(f, fn)
  return robust_transform(fn, functools.partial(rules.coordinate_median, f=f), axis_name,
                          compressor=compressor, min_size=min_size,
                          payload_attack=payload_attack, error_feedback=error_feedback, seed=seed,
                          coordinatewise=True)


def trimmed_mean(beta: float, f: Optional[int] = None, *, axis_name: AxisName,
                 compressor: Optional[base.Compressor] = None, min_size: int = DEFAULT_MIN_SIZE,
                 payload_attack: Optional[PayloadAttack] = None,
                 error_feedback: bool = False, seed: int = 0) -> optax.GradientTransformationExtraArgs:
  """The coordinate-wise ``beta``-trimmed mean of the workers' updates.

  Per coordinate, the ``b = ⌊beta·n⌋`` largest and ``b`` smallest of the
  ``n`` values are dropped and the remaining ``n − 2b`` averaged
  (:func:`commopt.aggregators.rules.trimmed_mean`). ``beta = 0`` is the
  plain mean.

  Tolerance: ``f <= b = ⌊beta·n⌋`` Byzantine workers (so ``f < n/2``, as
  ``beta < 1/2``): every value that survives the trim lies within the range
  of the honest values. Pass ``f`` to have it checked when the update is
  traced (``f >= n/2`` or ``f > ⌊beta·n⌋`` raise a ``ValueError``).

  Args:
    axis_name: the named axis of the workers, or a tuple of axes.
    beta: the fraction trimmed from each end, in ``[0, 0.5)``.
    f: optional number of Byzantine workers to check against ``n`` and ``beta``.
    compressor: ``None`` (dense) or a stateless per-leaf compressor whose
      packed payloads are gathered and decoded before the rule (see
      :func:`~commopt.aggregators.robust_aggregate`).
    min_size: leaves with fewer elements are sent dense.
    payload_attack: ``None`` or ``payload_attack(payload, *, key, axis_name)``
      applied to what each worker sends (see :mod:`commopt.aggregators.attacks`).
    error_feedback: with a ``compressor``, keep each worker's error memory
      in the state and add it to the next update before encoding.
    seed: seed of the base key of the compressor and the payload attack.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state :class:`RobustState`.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from commopt.aggregators import trimmed_mean
    >>> tx = trimmed_mean(beta=0.25, axis_name="workers")
    >>> g = jnp.array([[1.0], [2.0], [3.0], [-1e9]])
    >>> run = jax.vmap(lambda u: tx.update(u, tx.init(u))[0], axis_name="workers")
    >>> run(g)[0].tolist()
    [1.5]

  References:
    Yin et al., Byzantine-Robust Distributed Learning: Towards Optimal
    Statistical Rates, ICML 2018.
  """
  fn = "trimmed_mean"
  beta = base.check_number("beta", beta, fn=fn, low=0.0, high=0.5, low_open=False)
  f = _optional_f(f, fn)
  return robust_transform(fn, functools.partial(rules.trimmed_mean, beta=beta, f=f), axis_name,
                          compressor=compressor, min_size=min_size,
                          payload_attack=payload_attack, error_feedback=error_feedback, seed=seed,
                          coordinatewise=True)


def geometric_median(iters: int = 8, *, axis_name: AxisName, nu: float = 1e-6,
                     f: Optional[int] = None,
                     compressor: Optional[base.Compressor] = None, min_size: int = DEFAULT_MIN_SIZE,
                     payload_attack: Optional[PayloadAttack] = None,
                     error_feedback: bool = False, seed: int = 0) -> optax.GradientTransformationExtraArgs:
  """Robust federated aggregation (RFA): the geometric median of the updates.

  Each worker's whole update (flattened) is one vector; the output
  approximates ``argmin_z Σ_i ||x_i − z||`` by ``iters`` smoothed Weiszfeld
  iterations (``nu`` guards against dividing by a zero distance). They start
  from the coordinate-wise median rather than RFA's mean, so that a few
  iterations suffice even when outliers are far away
  (:func:`commopt.aggregators.rules.geometric_median`).

  Tolerance: fewer than half of the workers, ``f < n/2`` (breakdown point
  1/2). Pass ``f`` to have that checked when the update is traced.

  Args:
    axis_name: the named axis of the workers, or a tuple of axes.
    iters: Weiszfeld iterations (an integer >= 1; RFA uses a handful).
    nu: the smoothing floor on distances (> 0).
    f: optional number of Byzantine workers to check against ``n``.
    compressor: ``None`` (dense) or a stateless per-leaf compressor whose
      packed payloads are gathered and decoded before the rule (see
      :func:`~commopt.aggregators.robust_aggregate`).
    min_size: leaves with fewer elements are sent dense.
    payload_attack: ``None`` or ``payload_attack(payload, *, key, axis_name)``
      applied to what each worker sends (see :mod:`commopt.aggregators.attacks`).
    error_feedback: with a ``compressor``, keep each worker's error memory
      in the state and add it to the next update before encoding.
    seed: seed of the base key of the compressor and the payload attack.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state :class:`RobustState`.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from commopt.aggregators import geometric_median
    >>> tx = geometric_median(iters=50, axis_name="workers")
    >>> g = jnp.array([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1e6, 1e6]])
    >>> run = jax.vmap(lambda u: tx.update(u, tx.init(u))[0], axis_name="workers")
    >>> bool(jnp.all(jnp.abs(run(g)[0]) < 1.0))
    True

  References:
    Pillutla, Kakade and Harchaoui, Robust Aggregation for Federated
    Learning, IEEE Transactions on Signal Processing 2022 (RFA).
  """
  fn = "geometric_median"
  iters = base.check_int("iters", iters, fn=fn, minimum=1)
  nu = base.check_number("nu", nu, fn=fn, low=0.0)
  f = _optional_f(f, fn)
  rule = functools.partial(rules.geometric_median, iters=iters, nu=nu, f=f)
  return robust_transform(fn, rule, axis_name, compressor=compressor, min_size=min_size,
                          payload_attack=payload_attack, error_feedback=error_feedback, seed=seed)


def centered_clip(tau: float, iters: int = 1, *, axis_name: AxisName,
                  f: Optional[int] = None,
                  compressor: Optional[base.Compressor] = None, min_size: int = DEFAULT_MIN_SIZE,
                  payload_attack: Optional[PayloadAttack] = None,
                  error_feedback: bool = False, seed: int = 0) -> optax.GradientTransformationExtraArgs:
  """Centred clipping: the centre moved by the mean of clipped differences.

  Starting from the previous aggregate ``v`` (zeros at first, kept in the
  replicated state), each of ``iters`` iterations sets
  ``v ← v + (1/n) Σ_i (x_i − v)·min(1, tau / ||x_i − v||)`` over the
  flattened updates ``x_i``; the final ``v`` is the output and the next
  step's centre (:func:`commopt.aggregators.rules.centered_clip`). Each
  Byzantine worker can move ``v`` by at most ``tau/n`` per iteration. Put it
  after worker momentum, as the paper does
  (``optax.chain(optax.trace(0.9), centered_clip(...), optax.scale(-lr))``),
  so the honest updates vary little between steps.

  Tolerance: the analysis covers a Byzantine fraction up to about 0.1 and
  the rule works in practice for ``f < n/2``. Pass ``f`` to have ``f < n/2``
  checked when the update is traced.

  Args:
    axis_name: the named axis of the workers, or a tuple of axes.
    tau: the clipping radius (> 0), on the scale of the honest updates' spread.
    iters: clipping iterations per step (an integer >= 1; the paper uses 1).
    f: optional number of Byzantine workers to check against ``n``.
    compressor: ``None`` (dense) or a stateless per-leaf compressor whose
      packed payloads are gathered and decoded before the rule (see
      :func:`~commopt.aggregators.robust_aggregate`).
    min_size: leaves with fewer elements are sent dense.
    payload_attack: ``None`` or ``payload_attack(payload, *, key, axis_name)``
      applied to what each worker sends (see :mod:`commopt.aggregators.attacks`).
    error_feedback: with a ``compressor``, keep each worker's error memory
      in the state and add it to the next update before encoding.
    seed: seed of the base key of the compressor and the payload attack.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state
    :class:`CenteredClipState`.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from commopt.aggregators import centered_clip
    >>> tx = centered_clip(tau=1.0, iters=3, axis_name="workers")
    >>> g = jnp.array([[1.0], [1.0], [1.0], [1000.0]])
    >>> run = jax.vmap(lambda u: tx.update(u, tx.init(u))[0], axis_name="workers")
    >>> float(run(g)[0, 0])     # 1, then the outlier moves v by at most tau/n a step
    1.3125

  References:
    Karimireddy, He and Jaggi, Learning from History for Byzantine Robust
    Optimization, ICML 2021.
  """
  fn = "centered_clip"
  tau = base.check_number("tau", tau, fn=fn, low=0.0)
  iters = base.check_int("iters", iters, fn=fn, minimum=1)
  f = _optional_f(f, fn)
  rule = functools.partial(rules.centered_clip, tau=tau, iters=iters, f=f)
  return robust_transform(fn, rule, axis_name, compressor=compressor, min_size=min_size,
                          payload_attack=payload_attack, error_feedback=error_feedback, seed=seed,
                          with_previous=True)


__all__ = [
    "CenteredClipState",
    "RobustState",
    "centered_clip",
    "check_tolerance",
    "coordinate_median",
    "geometric_median",
    "krum",
    "krum_scores",
    "median_workers",
    "multi_krum",
    "pairwise_sq_distances",
    "sort_workers",
    "sorting_network",
    "trimmed_count",
    "trimmed_mean",
    "weiszfeld",
    "zero_non_finite_workers",
]
