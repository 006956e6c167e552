"""Byzantine-robust aggregation: Krum, medians, trimmed mean, centred clipping, RFA.

Every rule is an Optax transform over a named axis. Each worker all-gathers
the workers' updates (optionally compressed: the packed payloads are gathered
and decoded one by one, so only compressed bytes cross the wire), and every
worker computes the same robust aggregate from the same gathered values, so
the output is replicated (typed invariant inside ``jax.shard_map``).

Coordinate-wise rules (:func:`coordinate_median`, :func:`trimmed_mean`) work
leaf by leaf. Vector rules (:func:`krum`, :func:`multi_krum`,
:func:`centered_clip`, :func:`geometric_median`) treat each worker's whole
update pytree as one flattened vector: distances and norms are over all
leaves together.

The tolerance of each rule is the number ``f`` of Byzantine workers out of
``n`` it is designed for. The axis size ``n`` is known only when the update
is traced, so that is when a rule whose ``n`` is too small for its ``f``
raises a ``ValueError``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from commopt._src import base
from commopt.comm import _collectives as coll
from commopt.comm._channel import worker_key as worker_key_for

PayloadAttack = Callable[..., Any]
"""``payload_attack(payload, *, key, axis_name) -> payload``: corrupts what a worker sends."""


class RobustState(NamedTuple):
  """State of :func:`krum`, :func:`multi_krum`, :func:`coordinate_median`,
  :func:`trimmed_mean` and :func:`geometric_median` (replicated).

  Attributes:
    count: number of updates so far (int32); the step key is
      ``fold_in(key, count)``.
    key: the base PRNG key (raw uint32[2]) of the compressor and of a
      ``payload_attack``.
    residual: with ``error_feedback=True``, each worker's error memory (float32,
      shaped like the updates; ``optax.MaskedNode()`` where a leaf is sent
      dense); else ``optax.MaskedNode()``. It differs between workers.
  """
  count: jax.Array
  key: jax.Array
  residual: Any = optax.MaskedNode()


class CenteredClipState(NamedTuple):
  """State of :func:`centered_clip` (replicated).

  Attributes:
    count: number of updates so far (int32).
    key: the base PRNG key (raw uint32[2]).
    center: the previous aggregate, shaped like the updates (float32;
      ``optax.MaskedNode()`` for ``None`` and masked leaves); the clipping
      starts from it.
    residual: each worker's error memory with ``error_feedback=True`` (as in
      :class:`RobustState`).
  """
  count: jax.Array
  key: jax.Array
  center: Any
  residual: Any = optax.MaskedNode()


def _is_node(x) -> bool:
  return x is None or isinstance(x, optax.MaskedNode)


def _check_compressor(compressor, fn: str):
  if compressor is None:
    return
  if not isinstance(compressor, base.Compressor):
    raise ValueError(
        f"{fn}: `compressor` must be None (dense) or a commopt Compressor such as "
        f"commopt.int_quant(), got {compressor!r}.")
  if not base.is_stateless_per_leaf(compressor):
    raise ValueError(
        f"{fn}: `compressor` must be a stateless per-leaf compressor (each worker's "
        f"payload is decoded on its own); {compressor.name} keeps per-leaf state, runs its "
        "own protocol or selects over the whole tree. Use e.g. commopt.int_quant(), "
        "commopt.qsgd() or commopt.top_k(ratio).")


def check_tolerance(fn: str, n: int, f: Optional[int], *, need: str) -> None:
  """Raises a ``ValueError`` when ``n`` workers are too few for ``f`` Byzantine ones.

  Args:
    fn: the rule's name, for the message.
    n: the number of workers (the axis size).
    f: the number of Byzantine workers to tolerate, or ``None`` (no check).
    need: ``"majority"`` (``f < n/2``) or ``"krum"`` (``n > 2f + 2``).
  """
  if f is None:
    return
  if need == "krum" and not n > 2 * f + 2:
    raise ValueError(
        f"{fn}: `f`={f} Byzantine workers need n > 2f + 2 = {2 * f + 2} workers, but the "
        f"axis has n={n}. Use at least {2 * f + 3} workers or f <= {max((n - 3) // 2, 0)}"
        + (" (no f works for n < 3)." if n < 3 else "."))
  if need == "majority" and not 2 * f < n:
    raise ValueError(
        f"{fn}: `f`={f} Byzantine workers must be fewer than half of the n={n} workers "
        f"(f < n/2); use f <= {(n - 1) // 2} or more workers.")


class _Wire(NamedTuple):
  """How updates cross the axis: dense or through a compressor, maybe attacked."""
  compressor: Optional[base.Compressor]
  min_size: int
  payload_attack: Optional[PayloadAttack]
  error_feedback: bool = False


def _make_wire(fn, compressor, min_size, payload_attack, error_feedback=False) -> _Wire:
  _check_compressor(compressor, fn)
  base.check_int("min_size", min_size, fn=fn, minimum=0)
  if payload_attack is not None and not callable(payload_attack):
    raise ValueError(
        f"{fn}: `payload_attack` must be None or a callable "
        f"payload_attack(payload, *, key, axis_name) (e.g. attacks.bit_flip(...)), got "
        f"{payload_attack!r}.")
  if not isinstance(error_feedback, bool):
    raise ValueError(f"{fn}: `error_feedback` must be True or False, got {error_feedback!r}.")
  if error_feedback and compressor is None:
    raise ValueError(
        f"{fn}: `error_feedback=True` needs a `compressor` (dense updates lose nothing); "
        f"pass compressor=... or leave error_feedback False.")
  return _Wire(compressor, int(min_size), payload_attack, error_feedback)


def _compresses(wire: _Wire, u) -> bool:
  c = wire.compressor
  return (c is not None and not _is_node(u) and base.leaf_size(u.shape) >= max(wire.min_size, 1)
          and c.accepts(tuple(u.shape), u.dtype))


def _init_residual(wire: _Wire, params):
  """Zero error memories for the compressed leaves (``MaskedNode`` elsewhere)."""
  if not wire.error_feedback:
    return optax.MaskedNode()
  return jax.tree.map(
      lambda p: jnp.zeros(jnp.shape(p), jnp.float32) if _compresses(wire, p)
      else optax.MaskedNode(), params, is_leaf=_is_node)


def _gather(wire: _Wire, u: jax.Array, key, axis_name, residual=None):
  """All workers' versions of one leaf, decoded, as float32 ``[n, *u.shape]``, and
  this worker's new error memory (``None`` without error feedback)."""
  c = wire.compressor
  if _compresses(wire, u):
    state = c.init(u)
    total = None if residual is None else u.astype(jnp.float32) + residual
    payload, _ = c.encode(u if total is None else total.astype(u.dtype), state, key)
    new_residual = None
    if total is not None:     # what this worker's own payload missed
      new_residual = total - c.decode(payload, state, u).astype(jnp.float32)
    if wire.payload_attack is not None:
      payload = wire.payload_attack(payload, key=jax.random.fold_in(key, 1), axis_name=axis_name)
    gathered = coll.all_gather(payload, axis_name)
    decoded = jax.vmap(lambda pl: c.decode(pl, state, u))(gathered)
    return decoded.astype(jnp.float32), new_residual
  if wire.payload_attack is not None:
    u = wire.payload_attack(u, key=jax.random.fold_in(key, 1), axis_name=axis_name)
  return coll.all_gather(u, axis_name).astype(jnp.float32), None


def _check_stored(fn, leaves, stored, needed, *, what: str, label: str) -> None:
  """Raises unless every leaf ``needed(u)`` has a stored array of its shape."""
  for (path, u), s in zip(leaves, stored):
    if needed(u) and (_is_node(s) or tuple(s.shape) != tuple(u.shape)):
      raise ValueError(
          f"{fn}: {what} does not match `updates` at leaf "
          f"{jax.tree_util.keystr(path) or '<root>'}: update shape {tuple(u.shape)}, {label} "
          f"{getattr(s, 'shape', s)}. Call init with the pytree whose updates you pass.")


def _gathered_leaves(fn, wire, updates, state, axis_name):
  """(flat leaves with paths, treedef, gathered [n, ...] float32 per array leaf or None,
  the new error-memory tree)."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(updates, is_leaf=_is_node)
  for path, u in leaves:
    if not _is_node(u):
      base.check_float_leaf(fn, path, u, verb="aggregated")
  if wire.error_feedback:
    residuals = treedef.flatten_up_to(state.residual)
    _check_stored(fn, leaves, residuals, lambda u: _compresses(wire, u),
                  what="the error memory", label="memory")
  else:
    residuals = [None] * len(leaves)
  worker_key = worker_key_for(state.key, state.count, wire.compressor, axis_name)
  gathered, new_residuals = [], []
  for i, ((_, u), r) in enumerate(zip(leaves, residuals)):
    if _is_node(u):
      gathered.append(None)
      new_residuals.append(r)
      continue
    g, nr = _gather(wire, u, jax.random.fold_in(worker_key, i), axis_name,
                    None if _is_node(r) else r)
    gathered.append(g)
    new_residuals.append(r if nr is None else nr)
  new_residual = (jax.tree_util.tree_unflatten(treedef, new_residuals) if wire.error_feedback
                  else state.residual)
  return leaves, treedef, zero_non_finite_workers(gathered), new_residual


def zero_non_finite_workers(gathered):
  """Replaces by zeros every worker whose update holds a non-finite value in any leaf.

  A corrupted payload (a flipped exponent bit) or an overflow would otherwise
  make the distances, norms and sums of the rules NaN on every worker; as
  zeros it is one more outlier for the rule to reject.
  """
  arrays = [g for g in gathered if g is not None]
  if not arrays:
    return gathered
  bad = jnp.zeros(arrays[0].shape[:1], bool)
  for g in arrays:
    bad = bad | ~jnp.all(jnp.isfinite(g.reshape(g.shape[0], -1)), axis=1)
  return [None if g is None else
          jnp.where(bad.reshape((-1,) + (1,) * (g.ndim - 1)), jnp.zeros((), g.dtype), g)
          for g in gathered]


def _unflatten(treedef, leaves, values):
  out = [u if _is_node(u) else v.reshape(u.shape).astype(u.dtype)
         for (_, u), v in zip(leaves, values)]
  return jax.tree_util.tree_unflatten(treedef, out)


def _flat_matrix(gathered) -> jax.Array:
  """Concatenates the gathered leaves into one ``[n, d]`` matrix (one row per worker)."""
  parts = [g.reshape(g.shape[0], -1) for g in gathered if g is not None]
  return jnp.concatenate(parts, axis=1)


def _split(vector, gathered):
  """Splits a flat ``[d]`` vector back into leaves shaped like the gathered rows."""
  out, start = [], 0
  for g in gathered:
    if g is None:
      out.append(None)
      continue
    size = int(np.prod(g.shape[1:], dtype=np.int64))
    out.append(vector[start:start + size].reshape(g.shape[1:]))
    start += size
  return out


def _has_arrays(gathered) -> bool:
  return any(g is not None for g in gathered)


def _transform(fn: str, axis_name, wire: _Wire, seed: int, aggregate,
               check_n: Callable[[int], None], vector: bool):
  """A stateless-rule transform: ``aggregate`` maps gathered values to the output.

  ``vector=True``: ``aggregate(X [n, d]) -> [d]`` on the flattened updates;
  else ``aggregate(G [n, ...]) -> [...]`` leaf by leaf.
  """

  def init_fn(params):
    return RobustState(count=jnp.zeros([], jnp.int32), key=jax.random.PRNGKey(seed),
                       residual=_init_residual(wire, params))

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    check_n(coll.axis_size(axis_name))
    leaves, treedef, gathered, residual = _gathered_leaves(fn, wire, updates, state, axis_name)
    if not _has_arrays(gathered):
      values = gathered
    elif vector:
      values = _split(aggregate(_flat_matrix(gathered)), gathered)
    else:
      values = [None if g is None else aggregate(g) for g in gathered]
    new_state = RobustState(count=optax.safe_int32_increment(state.count), key=state.key,
                            residual=residual)
    return _unflatten(treedef, leaves, values), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


_COMMON_ARGS = """
    compressor: ``None`` (dense, the default) or a stateless per-leaf
      :class:`~commopt.Compressor`: each worker encodes its update, the packed
      payloads are all-gathered and every worker's payload is decoded before
      the rule is applied. Leaves below ``min_size`` elements, or that the
      compressor does not accept, go dense.
      Whatever the wire, a worker whose update holds a non-finite value (in
      any leaf) is counted as sending zeros, so it cannot make the aggregate
      NaN.
    min_size: leaves with fewer elements are sent dense.
    payload_attack: ``None`` or ``payload_attack(payload, *, key, axis_name)``
      applied to what each worker sends, before the all-gather (e.g.
      :func:`commopt.aggregators.attacks.bit_flip`), for attack studies.
    error_feedback: with a ``compressor``, each worker adds its error memory
      (kept in the state, per worker) to its update before encoding and keeps
      what its payload missed, as ``compressed_mean`` does; needed by biased
      compressors (sign, top-k) to converge.
    seed: seed of the base key of the compressor and the payload attack."""


# ---------------------------------------------------------------------------
# Sorting the workers' values coordinate by coordinate.

SORT_NETWORK_MAX_N = 32
"""Up to this many workers, :func:`sort_workers` runs a sorting network."""


@functools.lru_cache(maxsize=None)
def sorting_network(n: int) -> tuple[tuple[int, int], ...]:
  """Batcher's odd-even merge sort comparators ``(i, j)``, ``i < j``, for ``n`` inputs.

  Built for the next power of two; comparators that touch an index ``>= n``
  are dropped, which is exact because such an input would be a ``+inf`` pad
  that no comparator moves. ``n = 8`` takes 19 comparators.
  """
  p = 1
  while p < n:
    p *= 2
  pairs = []
  run = 1
  while run < p:
    k = run
    while k >= 1:
      for j in range(k % run, p - k, 2 * k):
        for i in range(min(k, p - j - k)):
          if (i + j) // (2 * run) == (i + j + k) // (2 * run) and i + j + k < n:
            pairs.append((i + j, i + j + k))
      k //= 2
    run *= 2
  return tuple(pairs)


def sort_workers(x: jax.Array) -> jax.Array:
  """``jnp.sort(x, axis=0)`` for the ``[n, ...]`` values of ``n`` workers.

  For ``n <= SORT_NETWORK_MAX_N`` a sorting network of elementwise min/max
  over whole rows, one fused pass (14-30x faster than XLA's sort for
  ``n = 8, 16`` on CPU; a median keeps only the comparators that reach the
  middle rows, which XLA prunes: ~300x; ``bench_robust.py --problems speed``);
  beyond, ``jnp.sort``. Inputs must not hold NaN (the rules zero non-finite
  workers first; see :func:`zero_non_finite_workers`).
  """
  n = x.shape[0]
  if n > SORT_NETWORK_MAX_N:
    return jnp.sort(x, axis=0)
  rows = list(x)
  for i, j in sorting_network(n):
    rows[i], rows[j] = jnp.minimum(rows[i], rows[j]), jnp.maximum(rows[i], rows[j])
  return jnp.stack(rows)


def median_workers(x: jax.Array) -> jax.Array:
  """The coordinate-wise median over axis 0 (the mean of the middle two for even ``n``)."""
  n = x.shape[0]
  s = sort_workers(x)
  return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _doc(fn):
  fn.__doc__ = fn.__doc__.replace("    {common}", _COMMON_ARGS.strip("\n"))
  return fn


# ---------------------------------------------------------------------------
# Krum and Multi-Krum.


def pairwise_sq_distances(x: jax.Array) -> jax.Array:
  """``[n, n]`` squared Euclidean distances between the rows of ``x`` (``[n, d]``).

  Computed row by row from differences (not from a Gram matrix, which loses
  the small distances between close vectors), with memory ``O(n·d)``.
  """
  return jax.lax.map(lambda row: jnp.sum(jnp.square(x - row), axis=1), x)


def krum_scores(x: jax.Array, f: int) -> jax.Array:
  """Krum score of each row: the sum of its ``n − f − 2`` smallest distances to the others."""
  n = x.shape[0]
  d2 = pairwise_sq_distances(x)
  d2 = jnp.where(jnp.eye(n, dtype=bool), jnp.inf, d2)
  closest = jnp.sort(d2, axis=1)[:, :n - f - 2]
  return jnp.sum(closest, axis=1)


def _multi_krum_rule(f: int, m: Optional[int]):
  def aggregate(x):
    n = x.shape[0]
    scores = krum_scores(x, f)
    k = n - f if m is None else m
    _, chosen = jax.lax.top_k(-scores, k)
    return jnp.mean(x[chosen], axis=0)
  return aggregate


@_doc
def krum(axis_name: Optional[str], f: int, *, compressor: Optional[base.Compressor] = None,
         min_size: int = 0, payload_attack: Optional[PayloadAttack] = None,
         error_feedback: bool = False, seed: int = 0) -> optax.GradientTransformationExtraArgs:
  """Krum: the worker update closest to its ``n − f − 2`` nearest neighbours.

  Each worker's whole update (all leaves, flattened) is one vector ``x_i``.
  Its score is the sum of squared distances to its ``n − f − 2`` nearest
  other vectors; the output is the ``x_i`` of lowest score (the first on a
  tie), on every worker.

  Tolerance: ``f`` Byzantine workers out of ``n`` when ``n > 2f + 2``
  (Blanchard et al.); with ``n = 8`` that is ``f <= 2``. A smaller axis
  raises a ``ValueError`` when the update is traced.

  Krum keeps one worker's update, so even without attackers it has the
  variance of a single worker's batch; and colluding attackers that send the
  same update (ALIE) have the lowest scores and are picked every step. On the
  demo CNN both cost more than any other rule here (``benchmarks/bench_robust.py``);
  prefer :func:`multi_krum` or the median family.

  Args:
    axis_name: the named axis of the workers (``None``: one local worker,
      which is always too few for Krum).
    f: the number of Byzantine workers to tolerate (an integer >= 0).
    {common}

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state :class:`RobustState`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from commopt.aggregators._robust import krum
    >>> tx = krum("workers", f=1)
    >>> g = jnp.array([[1.0, 1.0], [1.1, 0.9], [0.9, 1.0], [1.0, 1.1], [50.0, -50.0]])
    >>> run = jax.vmap(lambda u: tx.update(u, tx.init(u))[0], axis_name="workers")
    >>> run(g)[4].tolist()
    [1.0, 1.0]

  References:
    Blanchard et al., Machine Learning with Adversaries: Byzantine Tolerant
    Gradient Descent, NeurIPS 2017.
  """
  fn = "krum"
  base.check_axis_name(axis_name, fn)
  f = base.check_int("f", f, fn=fn, minimum=0)
  wire = _make_wire(fn, compressor, min_size, payload_attack, error_feedback)
  return _transform(fn, axis_name, wire, seed, _multi_krum_rule(f, 1),
                    lambda n: check_tolerance(fn, n, f, need="krum"), vector=True)


@_doc
def multi_krum(axis_name: Optional[str], f: int, m: Optional[int] = None, *,
               compressor: Optional[base.Compressor] = None, min_size: int = 0,
               payload_attack: Optional[PayloadAttack] = None,
               error_feedback: bool = False, seed: int = 0) -> optax.GradientTransformationExtraArgs:
  """Multi-Krum: the mean of the ``m`` worker updates with the best Krum scores.

  Scores are those of :func:`krum` (over the flattened update pytree); the
  ``m`` lowest-scoring updates are averaged. ``m = 1`` is Krum; ``m = n − f``
  (the default) averages as many updates as can all be honest.

  Tolerance: ``f`` out of ``n`` when ``n > 2f + 2``, and ``1 <= m <= n − f``;
  violations raise a ``ValueError`` when the update is traced.

  Args:
    axis_name: the named axis of the workers.
    f: the number of Byzantine workers to tolerate (an integer >= 0).
    m: how many updates to average (default ``n − f``).
    {common}

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state :class:`RobustState`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from commopt.aggregators._robust import multi_krum
    >>> tx = multi_krum("workers", f=1, m=2)
    >>> g = jnp.array([[1.0], [1.2], [0.7], [3.0], [-40.0]])
    >>> run = jax.vmap(lambda u: tx.update(u, tx.init(u))[0], axis_name="workers")
    >>> round(float(run(g)[0, 0]), 4)
    1.1

  References:
    Blanchard et al., Machine Learning with Adversaries: Byzantine Tolerant
    Gradient Descent, NeurIPS 2017.
  """
  fn = "multi_krum"
  base.check_axis_name(axis_name, fn)
  f = base.check_int("f", f, fn=fn, minimum=0)
  if m is not None:
    m = base.check_int("m", m, fn=fn, minimum=1)
  wire = _make_wire(fn, compressor, min_size, payload_attack, error_feedback)

  def check_n(n):
    check_tolerance(fn, n, f, need="krum")
    if m is not None and m > n - f:
      raise ValueError(
          f"multi_krum: `m`={m} must be at most n - f = {n - f} (n={n} workers, f={f}), "
          "so that the averaged updates can all be honest.")

  return _transform(fn, axis_name, wire, seed, _multi_krum_rule(f, m), check_n, vector=True)


# ---------------------------------------------------------------------------
# Coordinate-wise rules.


@_doc
def coordinate_median(axis_name: Optional[str], f: Optional[int] = None, *,
                      compressor: Optional[base.Compressor] = None, min_size: int = 0,
                      payload_attack: Optional[PayloadAttack] = None,
                      error_feedback: bool = False, seed: int = 0) -> optax.GradientTransformationExtraArgs:
  """The coordinate-wise median of the workers' updates.

  Each coordinate of each leaf is the median of the ``n`` workers' values
  (for even ``n``, the mean of the two middle values, as ``np.median``).

  Tolerance: fewer than half of the workers, ``f < n/2`` (breakdown point
  1/2): with ``f`` arbitrarily large values per coordinate, the median stays
  within the range of the honest values. Pass ``f`` to have that checked
  when the update is traced (``f >= n/2`` raises a ``ValueError``).

  Args:
    axis_name: the named axis of the workers.
    f: optional number of Byzantine workers to check against ``n``.
    {common}

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state :class:`RobustState`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from commopt.aggregators._robust import coordinate_median
    >>> tx = coordinate_median("workers")
    >>> g = jnp.array([[1.0, -1.0], [2.0, 1e9], [3.0, 0.0]])
    >>> run = jax.vmap(lambda u: tx.update(u, tx.init(u))[0], axis_name="workers")
    >>> run(g)[0].tolist()
    [2.0, 0.0]

  References:
    Yin et al., Byzantine-Robust Distributed Learning: Towards Optimal
    Statistical Rates, ICML 2018.
  """
  fn = "coordinate_median"
  base.check_axis_name(axis_name, fn)
  if f is not None:
    f = base.check_int("f", f, fn=fn, minimum=0)
  wire = _make_wire(fn, compressor, min_size, payload_attack, error_feedback)
  return _transform(fn, axis_name, wire, seed, median_workers,
                    lambda n: check_tolerance(fn, n, f, need="majority"), vector=False)


def trimmed_count(n: int, beta: float) -> int:
  """Values trimmed from each end by :func:`trimmed_mean`: ``⌊beta·n⌋``."""
  return int(np.floor(beta * n + 1e-9))


@_doc
def trimmed_mean(axis_name: Optional[str], beta: float, f: Optional[int] = None, *,
                 compressor: Optional[base.Compressor] = None, min_size: int = 0,
                 payload_attack: Optional[PayloadAttack] = None,
                 error_feedback: bool = False, seed: int = 0) -> optax.GradientTransformationExtraArgs:
  """The coordinate-wise ``beta``-trimmed mean of the workers' updates.

  Per coordinate, the ``b = ⌊beta·n⌋`` largest and ``b`` smallest of the
  ``n`` values are dropped and the remaining ``n − 2b`` averaged.
  ``beta = 0`` is the plain mean.

  Tolerance: ``f <= b = ⌊beta·n⌋`` Byzantine workers (so ``f < n/2``, as
  ``beta < 1/2``): every value that survives the trim lies within the range
  of the honest values. Pass ``f`` to have it checked when the update is
  traced (``f >= n/2`` or ``f > ⌊beta·n⌋`` raise a ``ValueError``).

  Args:
    axis_name: the named axis of the workers.
    beta: the fraction trimmed from each end, in ``[0, 0.5)``.
    f: optional number of Byzantine workers to check against ``n`` and ``beta``.
    {common}

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state :class:`RobustState`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from commopt.aggregators._robust import trimmed_mean
    >>> tx = trimmed_mean("workers", beta=0.25)
    >>> g = jnp.array([[1.0], [2.0], [3.0], [-1e9]])
    >>> run = jax.vmap(lambda u: tx.update(u, tx.init(u))[0], axis_name="workers")
    >>> run(g)[0].tolist()
    [1.5]

  References:
    Yin et al., Byzantine-Robust Distributed Learning: Towards Optimal
    Statistical Rates, ICML 2018.
  """
  fn = "trimmed_mean"
  base.check_axis_name(axis_name, fn)
  beta = base.check_number("beta", beta, fn=fn, low=0.0, high=0.5, low_open=False)
  if f is not None:
    f = base.check_int("f", f, fn=fn, minimum=0)
  wire = _make_wire(fn, compressor, min_size, payload_attack, error_feedback)

  def check_n(n):
    check_tolerance(fn, n, f, need="majority")
    if f is not None and f > trimmed_count(n, beta):
      raise ValueError(
          f"trimmed_mean: `beta`={beta} trims b={trimmed_count(n, beta)} values from each end "
          f"on n={n} workers, fewer than `f`={f}; use beta >= {f / n:.4g} (and < 0.5).")

  def aggregate(g):
    b = trimmed_count(g.shape[0], beta)
    s = sort_workers(g)
    return jnp.mean(s[b:g.shape[0] - b], axis=0)

  return _transform(fn, axis_name, wire, seed, aggregate, check_n, vector=False)


# ---------------------------------------------------------------------------
# Geometric median (RFA).


def weiszfeld(x: jax.Array, iters: int, nu: float, weights: Optional[jax.Array] = None):
  """Smoothed Weiszfeld iterations for the geometric median of the rows of ``x``.

  Starts at the coordinate-wise median (robust, so few iterations suffice;
  RFA starts at the mean); each iteration sets
  ``z = Σ a_i x_i / Σ a_i`` with ``a_i = w_i / max(nu, ||x_i − z||)``.

  Returns:
    The ``[d]`` estimate after ``iters`` iterations.
  """
  n = x.shape[0]
  w = jnp.ones((n,), x.dtype) / n if weights is None else weights / jnp.sum(weights)

  def body(_, z):
    dist = jnp.sqrt(jnp.sum(jnp.square(x - z), axis=1))
    a = w / jnp.maximum(dist, nu)
    return jnp.sum(a[:, None] * x, axis=0) / jnp.sum(a)

  return jax.lax.fori_loop(0, iters, body, median_workers(x))


@_doc
def geometric_median(axis_name: Optional[str], iters: int = 8, *, nu: float = 1e-6,
                     f: Optional[int] = None,
                     compressor: Optional[base.Compressor] = None, min_size: int = 0,
                     payload_attack: Optional[PayloadAttack] = None,
                     error_feedback: bool = False, seed: int = 0) -> optax.GradientTransformationExtraArgs:
  """Robust federated aggregation (RFA): the geometric median of the updates.

  Each worker's whole update (flattened) is one vector; the output
  approximates ``argmin_z Σ_i ||x_i − z||`` by ``iters`` smoothed Weiszfeld
  iterations (``nu`` guards against dividing by a zero distance). They start
  from the coordinate-wise median rather than RFA's mean, so that a few
  iterations suffice even when outliers are far away.

  Tolerance: fewer than half of the workers, ``f < n/2`` (breakdown point
  1/2). Pass ``f`` to have that checked when the update is traced.

  Args:
    axis_name: the named axis of the workers.
    iters: Weiszfeld iterations (an integer >= 1; RFA uses a handful).
    nu: the smoothing floor on distances (> 0).
    f: optional number of Byzantine workers to check against ``n``.
    {common}

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state :class:`RobustState`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from commopt.aggregators._robust import geometric_median
    >>> tx = geometric_median("workers", iters=50)
    >>> g = jnp.array([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1e6, 1e6]])
    >>> run = jax.vmap(lambda u: tx.update(u, tx.init(u))[0], axis_name="workers")
    >>> bool(jnp.all(jnp.abs(run(g)[0]) < 1.0))
    True

  References:
    Pillutla, Kakade and Harchaoui, Robust Aggregation for Federated
    Learning, IEEE Transactions on Signal Processing 2022 (RFA).
  """
  fn = "geometric_median"
  base.check_axis_name(axis_name, fn)
  iters = base.check_int("iters", iters, fn=fn, minimum=1)
  nu = base.check_number("nu", nu, fn=fn, low=0.0)
  if f is not None:
    f = base.check_int("f", f, fn=fn, minimum=0)
  wire = _make_wire(fn, compressor, min_size, payload_attack, error_feedback)
  return _transform(fn, axis_name, wire, seed, lambda x: weiszfeld(x, iters, nu),
                    lambda n: check_tolerance(fn, n, f, need="majority"), vector=True)


# ---------------------------------------------------------------------------
# Centred clipping.


def clip_iterations(x: jax.Array, center: jax.Array, tau: float, iters: int) -> jax.Array:
  """``iters`` centred-clipping steps ``v += mean_i (x_i − v)·min(1, tau/||x_i − v||)``."""

  def body(_, v):
    diff = x - v
    norm = jnp.sqrt(jnp.sum(jnp.square(diff), axis=1))
    scale = jnp.minimum(1.0, tau / jnp.maximum(norm, 1e-30))
    return v + jnp.mean(scale[:, None] * diff, axis=0)

  return jax.lax.fori_loop(0, iters, body, center)


@_doc
def centered_clip(axis_name: Optional[str], tau: float, iters: int = 1, *,
                  f: Optional[int] = None,
                  compressor: Optional[base.Compressor] = None, min_size: int = 0,
                  payload_attack: Optional[PayloadAttack] = None,
                  error_feedback: bool = False, seed: int = 0) -> optax.GradientTransformationExtraArgs:
  """Centred clipping: the centre moved by the mean of clipped differences.

  Starting from the previous aggregate ``v`` (zeros at first, kept in the
  replicated state), each of ``iters`` iterations sets
  ``v ← v + (1/n) Σ_i (x_i − v)·min(1, tau / ||x_i − v||)`` over the
  flattened updates ``x_i``; the final ``v`` is the output and the next
  step's centre. Each Byzantine worker can move ``v`` by at most ``tau/n``
  per iteration. Put it after worker momentum, as the paper does
  (``optax.chain(optax.trace(0.9), centered_clip(...), optax.scale(-lr))``),
  so the honest updates vary little between steps.

  Tolerance: the analysis covers a Byzantine fraction up to about 0.1 and
  the rule works in practice for ``f < n/2``. Pass ``f`` to have ``f < n/2``
  checked when the update is traced.

  Args:
    axis_name: the named axis of the workers.
    tau: the clipping radius (> 0), on the scale of the honest updates' spread.
    iters: clipping iterations per step (an integer >= 1; the paper uses 1).
    f: optional number of Byzantine workers to check against ``n``.
    {common}

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state
    :class:`CenteredClipState`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from commopt.aggregators._robust import centered_clip
    >>> tx = centered_clip("workers", tau=1.0, iters=3)
    >>> g = jnp.array([[1.0], [1.0], [1.0], [1000.0]])
    >>> run = jax.vmap(lambda u: tx.update(u, tx.init(u))[0], axis_name="workers")
    >>> float(run(g)[0, 0])     # 1, then the outlier moves v by at most tau/n a step
    1.3125

  References:
    Karimireddy, He and Jaggi, Learning from History for Byzantine Robust
    Optimization, ICML 2021.
  """
  fn = "centered_clip"
  base.check_axis_name(axis_name, fn)
  tau = base.check_number("tau", tau, fn=fn, low=0.0)
  iters = base.check_int("iters", iters, fn=fn, minimum=1)
  if f is not None:
    f = base.check_int("f", f, fn=fn, minimum=0)
  wire = _make_wire(fn, compressor, min_size, payload_attack, error_feedback)

  def init_fn(params):
    center = jax.tree.map(
        lambda p: optax.MaskedNode() if _is_node(p) else jnp.zeros(jnp.shape(p), jnp.float32),
        params, is_leaf=_is_node)
    return CenteredClipState(count=jnp.zeros([], jnp.int32), key=jax.random.PRNGKey(seed),
                             center=center, residual=_init_residual(wire, params))

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    check_tolerance(fn, coll.axis_size(axis_name), f, need="majority")
    leaves, treedef, gathered, residual = _gathered_leaves(fn, wire, updates, state, axis_name)
    centers = treedef.flatten_up_to(state.center)
    _check_stored(fn, leaves, centers, lambda u: not _is_node(u), what="the state",
                  label="centre")
    values = gathered
    new_centers = centers
    if _has_arrays(gathered):
      start = jnp.concatenate([c.reshape(-1).astype(jnp.float32)
                               for c, g in zip(centers, gathered) if g is not None])
      v = clip_iterations(_flat_matrix(gathered), start, tau, iters)
      values = _split(v, gathered)
      new_centers = [c if g is None else val for c, g, val in zip(centers, gathered, values)]
    new_state = CenteredClipState(
        count=optax.safe_int32_increment(state.count), key=state.key,
        center=jax.tree_util.tree_unflatten(treedef, new_centers), residual=residual)
    return _unflatten(treedef, leaves, values), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


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
