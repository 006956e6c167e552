"""Byzantine-robust aggregation rules as pure functions of the workers' updates.

A rule maps ``x``, the ``[n, d]`` matrix of ``n`` workers' flattened updates
(float32, one row per worker), to one ``[d]`` aggregate; its static
parameters (``f``, the number of Byzantine workers it is designed for;
``beta``, ``iters``, ...) are keyword arguments, bound with
``functools.partial``. Rules do not communicate:
:func:`~commopt.aggregators.robust_aggregate` gathers the rows and applies a
rule on every worker, and the named transforms
(:func:`~commopt.aggregators.krum`, ...) are that with the rule of their
name. A rule is traced with ``n`` known, so that is when one whose ``n`` is
too small for its ``f`` raises a ``ValueError``.

Coordinate-wise rules (:func:`coordinate_median`, :func:`trimmed_mean`)
treat each column on its own; vector rules (:func:`krum`,
:func:`multi_krum`, :func:`geometric_median`, :func:`centered_clip`) use
distances between whole rows. Rows must be finite (the transform replaces
a worker holding a non-finite value by zeros before any rule sees it).

Examples:
  >>> import jax.numpy as jnp
  >>> from commopt.aggregators import rules
  >>> x = jnp.array([[1.0, 1.0], [1.1, 0.9], [0.9, 1.0], [1.0, 1.1], [50.0, -50.0]])
  >>> rules.coordinate_median(x).tolist()
  [1.0, 1.0]
  >>> rules.krum(x, f=1).tolist()
  [1.0, 1.0]
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from commopt._src import base
from commopt.aggregators._sorting import median_workers, sort_workers
from commopt.aggregators._tolerance import check_tolerance


def _check_matrix(x, fn: str) -> None:
  if getattr(x, "ndim", None) != 2:
    raise ValueError(
        f"{fn}: `x` must be the [n, d] matrix of the n workers' flattened updates, got "
        f"shape {getattr(x, 'shape', type(x).__name__)}.")


def _check_f(f, fn: str, optional: bool) -> Optional[int]:
  if f is None and optional:
    return None
  return base.check_int("f", f, fn=fn, minimum=0)


# ---------------------------------------------------------------------------
# Krum and Multi-Krum.


def pairwise_sq_distances(x: jax.Array) -> jax.Array:
  """``[n, n]`` squared Euclidean distances between the rows of ``x`` (``[n, d]``).

  Computed row by row from differences (not from a Gram matrix, which loses
  the small distances between close vectors), with memory ``O(n·d)``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from commopt.aggregators.rules import pairwise_sq_distances
    >>> pairwise_sq_distances(jnp.array([[0.0, 0.0], [3.0, 4.0]])).tolist()
    [[0.0, 25.0], [25.0, 0.0]]
  """
  return jax.lax.map(lambda row: jnp.sum(jnp.square(x - row), axis=1), x)


def krum_scores(x: jax.Array, f: int) -> jax.Array:
  """Krum score of each row: the sum of its ``n − f − 2`` smallest squared distances to the others.

  Examples:
    >>> import jax.numpy as jnp
    >>> from commopt.aggregators.rules import krum_scores
    >>> krum_scores(jnp.array([[0.0], [1.0], [3.0], [10.0]]), f=1).tolist()
    [1.0, 1.0, 4.0, 49.0]
  """
  n = x.shape[0]
  d2 = pairwise_sq_distances(x)
  d2 = jnp.where(jnp.eye(n, dtype=bool), jnp.inf, d2)
  closest = jnp.sort(d2, axis=1)[:, :n - f - 2]
  return jnp.sum(closest, axis=1)


def _mean_of_best(x: jax.Array, f: int, m: int) -> jax.Array:
  _, chosen = jax.lax.top_k(-krum_scores(x, f), m)
  return jnp.mean(x[chosen], axis=0)


def krum(x: jax.Array, f: int) -> jax.Array:
  """Krum: the row closest to its ``n − f − 2`` nearest neighbours.

  Each row's score is the sum of squared distances to its ``n − f − 2``
  nearest other rows (:func:`krum_scores`); the output is the row of lowest
  score (the first on a tie).

  Args:
    x: ``[n, d]``, one flattened update per worker.
    f: the number of Byzantine workers to tolerate (an integer >= 0); needs
      ``n > 2f + 2``, else a ``ValueError``.

  Returns:
    ``[d]``: the chosen row.

  Examples:
    >>> import jax.numpy as jnp
    >>> from commopt.aggregators.rules import krum
    >>> x = jnp.array([[1.0, 1.0], [1.1, 0.9], [0.9, 1.0], [1.0, 1.1], [50.0, -50.0]])
    >>> krum(x, f=1).tolist()
    [1.0, 1.0]

  References:
    Blanchard et al., Machine Learning with Adversaries: Byzantine Tolerant
    Gradient Descent, NeurIPS 2017.
  """
  fn = "krum"
  _check_matrix(x, fn)
  f = _check_f(f, fn, optional=False)
  check_tolerance(fn, x.shape[0], f, need="krum")
  return _mean_of_best(x, f, 1)


def multi_krum(x: jax.Array, f: int, m: Optional[int] = None) -> jax.Array:
  """Multi-Krum: the mean of the ``m`` rows with the best Krum scores.

  Args:
    x: ``[n, d]``, one flattened update per worker.
    f: the number of Byzantine workers to tolerate (an integer >= 0); needs
      ``n > 2f + 2``.
    m: how many rows to average, ``1 <= m <= n − f`` (default ``n − f``, as
      many as can all be honest); ``m = 1`` is :func:`krum`.

  Returns:
    ``[d]``: the mean of the ``m`` lowest-scoring rows.

  Examples:
    >>> import jax.numpy as jnp
    >>> from commopt.aggregators.rules import multi_krum
    >>> x = jnp.array([[1.0], [1.2], [0.7], [3.0], [-40.0]])
    >>> round(float(multi_krum(x, f=1, m=2)[0]), 4)
    1.1

  References:
    Blanchard et al., Machine Learning with Adversaries: Byzantine Tolerant
    Gradient Descent, NeurIPS 2017.
  """
  fn = "multi_krum"
  _check_matrix(x, fn)
  f = _check_f(f, fn, optional=False)
  if m is not None:
    m = base.check_int("m", m, fn=fn, minimum=1)
  n = x.shape[0]
  check_tolerance(fn, n, f, need="krum")
  if m is not None and m > n - f:
    raise ValueError(
        f"multi_krum: `m`={m} must be at most n - f = {n - f} (n={n} workers, f={f}), "
        "so that the averaged updates can all be honest.")
  return _mean_of_best(x, f, n - f if m is None else m)


# ---------------------------------------------------------------------------
# Coordinate-wise rules.


def coordinate_median(x: jax.Array, f: Optional[int] = None) -> jax.Array:
  """The median of each column (for even ``n``, the mean of the two middle values).

  Args:
    x: ``[n, d]``, one flattened update per worker.
    f: optional number of Byzantine workers; ``f >= n/2`` raises a ``ValueError``.

  Returns:
    ``[d]``: the coordinate-wise median, as ``np.median(x, 0)``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from commopt.aggregators.rules import coordinate_median
    >>> coordinate_median(jnp.array([[1.0, -1.0], [2.0, 1e9], [3.0, 0.0]])).tolist()
    [2.0, 0.0]

  References:
    Yin et al., Byzantine-Robust Distributed Learning: Towards Optimal
    Statistical Rates, ICML 2018.
  """
  fn = "coordinate_median"
  _check_matrix(x, fn)
  check_tolerance(fn, x.shape[0], _check_f(f, fn, optional=True), need="majority")
  return median_workers(x)


def trimmed_count(n: int, beta: float) -> int:
  """Values trimmed from each end by :func:`trimmed_mean`: ``⌊beta·n⌋``.

  Examples:
    >>> from commopt.aggregators.rules import trimmed_count
    >>> trimmed_count(8, 0.25), trimmed_count(10, 0.25)
    (2, 2)
  """
  return int(np.floor(beta * n + 1e-9))


def trimmed_mean(x: jax.Array, beta: float, f: Optional[int] = None) -> jax.Array:
  """The ``beta``-trimmed mean of each column.

  Per column, the ``b = ⌊beta·n⌋`` largest and ``b`` smallest of the ``n``
  values are dropped and the remaining ``n − 2b`` averaged; ``beta = 0`` is
  the plain mean.

  Args:
    x: ``[n, d]``, one flattened update per worker.
    beta: the fraction trimmed from each end, in ``[0, 0.5)``.
    f: optional number of Byzantine workers; ``f >= n/2`` or
      ``f > ⌊beta·n⌋`` raise a ``ValueError``.

  Returns:
    ``[d]``: the coordinate-wise trimmed mean.

  Examples:
    >>> import jax.numpy as jnp
    >>> from commopt.aggregators.rules import trimmed_mean
    >>> trimmed_mean(jnp.array([[1.0], [2.0], [3.0], [-1e9]]), beta=0.25).tolist()
    [1.5]

  References:
    Yin et al., Byzantine-Robust Distributed Learning: Towards Optimal
    Statistical Rates, ICML 2018.
  """
  fn = "trimmed_mean"
  _check_matrix(x, fn)
  beta = base.check_number("beta", beta, fn=fn, low=0.0, high=0.5, low_open=False)
  f = _check_f(f, fn, optional=True)
  n = x.shape[0]
  b = trimmed_count(n, beta)
  check_tolerance(fn, n, f, need="majority")
  if f is not None and f > b:
    raise ValueError(
        f"trimmed_mean: `beta`={beta} trims b={b} values from each end "
        f"on n={n} workers, fewer than `f`={f}; use beta >= {f / n:.4g} (and < 0.5).")
  return jnp.mean(sort_workers(x)[b:n - b], axis=0)


# ---------------------------------------------------------------------------
# Geometric median (RFA).


def weiszfeld(x: jax.Array, iters: int, nu: float,
              weights: Optional[jax.Array] = None) -> jax.Array:
  """Smoothed Weiszfeld iterations for the geometric median of the rows of ``x``.

  Starts at the coordinate-wise median (robust, so few iterations suffice;
  RFA starts at the mean); each iteration sets
  ``z = Σ a_i x_i / Σ a_i`` with ``a_i = w_i / max(nu, ||x_i − z||)``.

  Args:
    x: ``[n, d]``.
    iters: the number of iterations.
    nu: the smoothing floor on distances.
    weights: optional ``[n]`` weights of the rows (default: equal).

  Returns:
    The ``[d]`` estimate after ``iters`` iterations.

  Examples:
    >>> import jax.numpy as jnp
    >>> from commopt.aggregators.rules import weiszfeld
    >>> x = jnp.array([[0.0, 0.0], [2.0, 0.0], [0.0, 2.0], [2.0, 2.0]])
    >>> [round(float(v), 4) for v in weiszfeld(x, iters=3, nu=1e-6)]
    [1.0, 1.0]
  """
  n = x.shape[0]
  w = jnp.ones((n,), x.dtype) / n if weights is None else weights / jnp.sum(weights)

  def body(_, z):
    dist = jnp.sqrt(jnp.sum(jnp.square(x - z), axis=1))
    a = w / jnp.maximum(dist, nu)
    return jnp.sum(a[:, None] * x, axis=0) / jnp.sum(a)

  return jax.lax.fori_loop(0, iters, body, median_workers(x))


def geometric_median(x: jax.Array, iters: int = 8, nu: float = 1e-6,
                     f: Optional[int] = None) -> jax.Array:
  """The geometric median of the rows (RFA), by smoothed Weiszfeld iterations.

  Approximates ``argmin_z Σ_i ||x_i − z||`` by ``iters`` iterations of
  :func:`weiszfeld` started from the coordinate-wise median (rather than
  RFA's mean, so that a few iterations suffice even when outliers are far).

  Args:
    x: ``[n, d]``, one flattened update per worker.
    iters: Weiszfeld iterations (an integer >= 1).
    nu: the smoothing floor on distances (> 0).
    f: optional number of Byzantine workers; ``f >= n/2`` raises a ``ValueError``.

  Returns:
    ``[d]``: the estimate.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from commopt.aggregators.rules import geometric_median
    >>> x = jnp.array([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1e6, 1e6]])
    >>> bool(jnp.all(jnp.abs(geometric_median(x, iters=50)) < 1.0))
    True

  References:
    Pillutla, Kakade and Harchaoui, Robust Aggregation for Federated
    Learning, IEEE Transactions on Signal Processing 2022 (RFA).
  """
  fn = "geometric_median"
  _check_matrix(x, fn)
  iters = base.check_int("iters", iters, fn=fn, minimum=1)
  nu = base.check_number("nu", nu, fn=fn, low=0.0)
  check_tolerance(fn, x.shape[0], _check_f(f, fn, optional=True), need="majority")
  return weiszfeld(x, iters, nu)


# ---------------------------------------------------------------------------
# Centred clipping.


def clip_iterations(x: jax.Array, center: jax.Array, tau: float, iters: int) -> jax.Array:
  """``iters`` centred-clipping steps ``v += mean_i (x_i − v)·min(1, tau/||x_i − v||)``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from commopt.aggregators.rules import clip_iterations
    >>> clip_iterations(jnp.array([[1.0], [1.0], [1.0], [1000.0]]), jnp.zeros(1), 1.0, 1).tolist()
    [1.0]
  """

  def body(_, v):
    diff = x - v
    norm = jnp.sqrt(jnp.sum(jnp.square(diff), axis=1))
    scale = jnp.minimum(1.0, tau / jnp.maximum(norm, 1e-30))
    return v + jnp.mean(scale[:, None] * diff, axis=0)

  return jax.lax.fori_loop(0, iters, body, center)


def centered_clip(x: jax.Array, previous: jax.Array, tau: float, iters: int = 1,
                  f: Optional[int] = None) -> jax.Array:
  """Centred clipping: ``previous`` moved by the mean of clipped differences.

  Starting from ``v = previous`` (the last aggregate), each of ``iters``
  iterations sets ``v ← v + (1/n) Σ_i (x_i − v)·min(1, tau / ||x_i − v||)``,
  so each row moves ``v`` by at most ``tau/n`` per iteration.
  :func:`~commopt.aggregators.robust_aggregate` passes ``previous`` when
  called with ``with_previous=True``.

  Args:
    x: ``[n, d]``, one flattened update per worker.
    previous: ``[d]``, the centre to start from.
    tau: the clipping radius (> 0).
    iters: clipping iterations (an integer >= 1).
    f: optional number of Byzantine workers; ``f >= n/2`` raises a ``ValueError``.

  Returns:
    ``[d]``: the final ``v``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from commopt.aggregators.rules import centered_clip
    >>> x = jnp.array([[1.0], [1.0], [1.0], [1000.0]])
    >>> centered_clip(x, jnp.zeros(1), tau=1.0, iters=3).tolist()
    [1.3125]

  References:
    Karimireddy, He and Jaggi, Learning from History for Byzantine Robust
    Optimization, ICML 2021.
  """
  fn = "centered_clip"
  _check_matrix(x, fn)
  tau = base.check_number("tau", tau, fn=fn, low=0.0)
  iters = base.check_int("iters", iters, fn=fn, minimum=1)
  check_tolerance(fn, x.shape[0], _check_f(f, fn, optional=True), need="majority")
  if getattr(previous, "shape", None) != x.shape[1:]:
    raise ValueError(
        f"{fn}: `previous` must be the [d] = {x.shape[1:]} centre of the rows of `x`, got "
        f"shape {getattr(previous, 'shape', type(previous).__name__)}.")
  return clip_iterations(x, previous.astype(x.dtype), tau, iters)


__all__ = [
    "centered_clip",
    "clip_iterations",
    "coordinate_median",
    "geometric_median",
    "krum",
    "krum_scores",
    "multi_krum",
    "pairwise_sq_distances",
    "trimmed_count",
    "trimmed_mean",
    "weiszfeld",
]
