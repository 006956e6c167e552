"""One Optax transform for every robust rule: gather, guard, apply the rule, unflatten.

:func:`robust_aggregate` turns a rule of :mod:`commopt.aggregators.rules` (a
pure function from the ``[n, d]`` matrix of the ``n`` workers' flattened
updates to one ``[d]`` aggregate) into a transform over a named axis, or a
tuple of them. Each worker all-gathers the workers' updates (optionally
compressed: the packed payloads are gathered and decoded one by one, so
only compressed bytes cross the wire), and every worker computes the same
aggregate from the same gathered values, so the output is replicated
(typed invariant inside ``jax.shard_map``).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from commopt._src import base, feedback, tree
from commopt._src.tree import DEFAULT_MIN_SIZE
from commopt._src.base import AxisName, check_axis_name
from commopt.comm import _collectives as coll
from commopt.comm import _plan
from commopt.comm._strategies import compensate, remember
from commopt.comm._exchange import worker_key as worker_key_for
from commopt.transforms import _global_view

PayloadAttack = Callable[..., Any]
"""``payload_attack(payload, *, key, axis_name) -> payload``: corrupts what a worker sends."""

Rule = Callable[..., jax.Array]
"""``rule(x) -> [d]`` for ``x`` of shape ``[n, d]``; ``rule(x, previous)`` with ``with_previous``."""


class RobustState(NamedTuple):
  """State of :func:`robust_aggregate` and of the named robust rules other than
  :func:`~commopt.aggregators.centered_clip`; replicated, except ``residual``.

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
  """State of :func:`~commopt.aggregators.centered_clip` and of
  :func:`robust_aggregate` with ``with_previous=True``; replicated, except ``residual``.

  Attributes:
    count: number of updates so far (int32).
    key: the base PRNG key (raw uint32[2]).
    center: the previous aggregate, shaped like the updates (float32;
      ``optax.MaskedNode()`` for ``None`` and masked leaves); the rule
      starts from it.
    residual: each worker's error memory with ``error_feedback=True`` (as in
      :class:`RobustState`).
  """
  count: jax.Array
  key: jax.Array
  center: Any
  residual: Any = optax.MaskedNode()


# ---------------------------------------------------------------------------
# The wire: dense or through a compressor, maybe attacked, maybe with error feedback.


class _Wire(NamedTuple):
  """How updates cross the axis."""
  compressor: Optional[base.Compressor]
  min_size: int
  payload_attack: Optional[PayloadAttack]
  error_feedback: bool


def _make_wire(fn, compressor, min_size, payload_attack, error_feedback) -> _Wire:
  if compressor is not None and not isinstance(compressor, base.Compressor):
    raise base.OptionTypeError(
        f"{fn}: `compressor` must be None (dense) or a commopt Compressor such as "
        f"commopt.int_quant(), got {compressor!r}.")
  if compressor is not None and not base.is_stateless_per_leaf(compressor):
    raise ValueError(
        f"{fn}: `compressor` must be a stateless per-leaf compressor (each worker's "
        f"payload is decoded on its own); {compressor.name} keeps per-leaf state, runs its "
        "own protocol or selects over the whole tree. Use e.g. commopt.int_quant(), "
        "commopt.qsgd() or commopt.top_k(ratio).")
  base.check_int("min_size", min_size, fn=fn, minimum=0)
  if payload_attack is not None and not callable(payload_attack):
    raise base.OptionTypeError(
        f"{fn}: `payload_attack` must be None or a callable "
        f"payload_attack(payload, *, key, axis_name) (e.g. attacks.bit_flip(...)), got "
        f"{payload_attack!r}.")
  error_feedback = base.check_bool("error_feedback", error_feedback, fn=fn)
  if error_feedback and compressor is None:
    raise ValueError(
        f"{fn}: `error_feedback=True` needs a `compressor` (dense updates lose nothing); "
        f"pass compressor=... or leave error_feedback False.")
  if compressor is not None:
    # A residual only where it stays bounded: C/(1+ω) for an unbiased compressor.
    compressor, error_feedback = feedback.feedback_compressor(compressor, error_feedback, fn)
  return _Wire(compressor, int(min_size), payload_attack, error_feedback)


def _compresses(wire: _Wire, u) -> bool:
  c = wire.compressor
  return c is not None and not tree.is_node(u) and tree.compresses(c, u.shape, u.dtype,
                                                                    wire.min_size)


def _init_residual(wire: _Wire, params):
  """Zero error memories for the compressed leaves (``MaskedNode`` elsewhere)."""
  if not wire.error_feedback:
    return optax.MaskedNode()
  return jax.tree.map(
      lambda p: jnp.zeros(jnp.shape(p), jnp.float32) if _compresses(wire, p)
      else optax.MaskedNode(), params, is_leaf=tree.is_node)


def _gather_leaf(wire: _Wire, u: jax.Array, key, axis_name, residual=None):
  """All workers' versions of one leaf, decoded, as float32 ``[n, *u.shape]``, and
  this worker's new error memory (``None`` without error feedback)."""
  c = wire.compressor
  if _compresses(wire, u):
    state = c.init(u)
    total = None if residual is None else compensate(u, residual)
    payload, _ = c.encode(u if total is None else total.astype(u.dtype), state, key)
    new_residual = None
    if total is not None:     # what this worker's own payload missed
      new_residual = remember(total, c.decode(payload, state, u))
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
    if needed(u) and (tree.is_node(s) or tuple(s.shape) != tuple(u.shape)):
      raise ValueError(
          f"{fn}: {what} does not match `updates` at leaf "
          f"{jax.tree_util.keystr(path) or '<root>'}: update shape {tuple(u.shape)}, {label} "
          f"{getattr(s, 'shape', s)}. Call init with the pytree whose updates you pass.")


def zero_non_finite_workers(gathered: list) -> list:
  """Replaces by zeros every worker whose update holds a non-finite value in any leaf.

  A corrupted payload (a flipped exponent bit) or an overflow would otherwise
  make the distances, norms and sums of the rules NaN on every worker; as
  zeros it is one more outlier for the rule to reject.

  Args:
    gathered: per leaf, the ``[n, ...]`` gathered values, or ``None``.

  Returns:
    ``gathered`` with the rows of those workers set to zero in every leaf.

  Examples:
    >>> import jax.numpy as jnp
    >>> from commopt.aggregators._transform import zero_non_finite_workers
    >>> a, b = zero_non_finite_workers([jnp.array([[1.0], [jnp.nan]]), jnp.array([2.0, 3.0])])
    >>> a.tolist(), b.tolist()
    ([[1.0], [0.0]], [2.0, 0.0])
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


def _gathered_leaves(fn, wire, axis_name, updates, state):
  """(flat leaves with paths, treedef, gathered ``[n, ...]`` float32 per array leaf or
  None, the new error-memory tree)."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(updates, is_leaf=tree.is_node)
  for path, u in leaves:
    if not tree.is_node(u):
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
    if tree.is_node(u):
      gathered.append(None)
      new_residuals.append(r)
      continue
    g, nr = _gather_leaf(wire, u, jax.random.fold_in(worker_key, i), axis_name,
                         None if tree.is_node(r) else r)
    gathered.append(g)
    new_residuals.append(r if nr is None else nr)
  new_residual = (jax.tree_util.tree_unflatten(treedef, new_residuals) if wire.error_feedback
                  else state.residual)
  return leaves, treedef, zero_non_finite_workers(gathered), new_residual


# ---------------------------------------------------------------------------
# Applying the rule: to one [n, d] matrix of all leaves, or leaf by leaf.


def _flat_matrix(gathered) -> jax.Array:
  """Concatenates the gathered leaves into one ``[n, d]`` matrix (one row per worker)."""
  return jnp.concatenate([g.reshape(g.shape[0], -1) for g in gathered if g is not None], axis=1)


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


def _apply(fn, rule, gathered, centers, *, n: int, coordinatewise: bool, with_previous: bool):
  """The rule's output per leaf (``None`` for ``None`` leaves)."""
  args = (lambda x, c: (x, c)) if with_previous else (lambda x, c: (x,))
  if not any(g is not None for g in gathered):
    # No array leaf: trace the rule on zero columns, for its checks of n against f.
    empty = jax.ShapeDtypeStruct((n, 0), jnp.float32)
    jax.eval_shape(rule, *args(empty, jax.ShapeDtypeStruct((0,), jnp.float32)))
    return gathered
  if coordinatewise:
    out = []
    for g, c in zip(gathered, centers):
      if g is None:
        out.append(None)
        continue
      prev = None if c is None else c.reshape(-1).astype(jnp.float32)
      out.append(_output(fn, rule(*args(g.reshape(g.shape[0], -1), prev)), g)
                 .reshape(g.shape[1:]))
    return out
  prev = None
  if with_previous:
    prev = jnp.concatenate([c.reshape(-1).astype(jnp.float32)
                            for c, g in zip(centers, gathered) if g is not None])
  x = _flat_matrix(gathered)
  return _split(_output(fn, rule(*args(x, prev)), x), gathered)


def _output(fn, value, x):
  """The rule's ``[d]`` output, or a ValueError naming the shape it returned."""
  d = int(np.prod(x.shape[1:], dtype=np.int64))
  if getattr(value, "shape", None) != (d,):
    raise ValueError(
        f"{fn}: the rule must return the [d] = ({d},) aggregate of its [n, d] = "
        f"{tuple(x.shape[:1]) + (d,)} input, got shape "
        f"{getattr(value, 'shape', type(value).__name__)}.")
  return value


def _unflatten(treedef, leaves, values):
  out = [u if tree.is_node(u) else v.reshape(u.shape).astype(u.dtype)
         for (_, u), v in zip(leaves, values)]
  return jax.tree_util.tree_unflatten(treedef, out)


def robust_aggregate(rule: Rule, *, axis_name: AxisName,
                     compressor: Optional[base.Compressor] = None, min_size: int = DEFAULT_MIN_SIZE,
                     payload_attack: Optional[PayloadAttack] = None,
                     error_feedback: bool = False, seed: int = 0,
                     coordinatewise: bool = False,
                     with_previous: bool = False) -> optax.GradientTransformationExtraArgs:
  """A robust rule over the workers of a named axis (or several axes), as an Optax transform.

  Each worker flattens its update pytree, the workers' updates are
  all-gathered, and every worker applies ``rule`` to the same ``[n, d]``
  matrix (float32, one row per worker, the array leaves concatenated in tree
  order), so the ``[d]`` output, cast back to each leaf's dtype and shape,
  is the same on every worker. ``None`` and ``optax.MaskedNode`` leaves pass
  through. The rule is traced with ``n`` known, so a rule that checks its
  tolerance against ``n`` (those of :mod:`commopt.aggregators.rules` do)
  raises its ``ValueError`` when the update is traced.

  Whatever the wire, a worker whose update holds a non-finite value (in any
  leaf) is counted as sending zeros, so it cannot make the aggregate NaN;
  rules may assume finite rows.

  Args:
    rule: ``rule(x) -> [d]`` for the ``[n, d]`` matrix ``x`` of the workers'
      flattened updates, e.g. a function of :mod:`commopt.aggregators.rules`
      with its static parameters bound by ``functools.partial``; with
      ``with_previous``, ``rule(x, previous) -> [d]``.
    axis_name: the named axis of the workers, a tuple of axes whose workers
      together take part (``("node", "local")``: every device of a 2-D
      mesh), or ``None`` for one local worker.
    compressor: ``None`` (dense, the default) or a stateless per-leaf
      :class:`~commopt.Compressor`: each worker encodes its update, the
      packed payloads are all-gathered and every worker's payload is
      decoded before the rule is applied. Leaves below ``min_size``
      elements, or that the compressor does not accept, go dense.
    min_size: leaves with fewer elements are sent dense.
    payload_attack: ``None`` or ``payload_attack(payload, *, key, axis_name)``
      applied to what each worker sends, before the all-gather (e.g.
      :func:`commopt.aggregators.attacks.bit_flip`), for attack studies.
    error_feedback: with a ``compressor``, each worker adds its error memory
      (kept in the state, per worker) to its update before encoding and
      keeps what its payload missed, as ``compressed_mean`` does; needed by
      biased compressors (sign, top-k) to converge.
    seed: seed of the base key of the compressor and the payload attack.
    coordinatewise: ``True`` for a rule that treats each column on its own
      (:func:`~commopt.aggregators.rules.coordinate_median`,
      :func:`~commopt.aggregators.rules.trimmed_mean`): it is then applied
      to each leaf's ``[n, d_leaf]`` matrix, which gives the same result
      without concatenating the leaves.
    with_previous: the rule also takes ``previous``, the last aggregate
      (zeros at first; the matching slice of it with ``coordinatewise``),
      kept in the state, as centred clipping needs.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state
    :class:`RobustState`, or :class:`CenteredClipState` with ``with_previous``.

  Examples:
    >>> import functools, jax, jax.numpy as jnp
    >>> from commopt.aggregators import robust_aggregate, rules
    >>> tx = robust_aggregate(functools.partial(rules.trimmed_mean, beta=0.25),
    ...                       axis_name="workers", coordinatewise=True)
    >>> g = jnp.array([[1.0], [2.0], [3.0], [-1e9]])
    >>> run = jax.vmap(lambda u: tx.update(u, tx.init(u))[0], axis_name="workers")
    >>> run(g)[0].tolist()
    [1.5]
    >>> # Any [n, d] -> [d] function is a rule: here the mean of the rows of smallest norm.
    >>> def smallest_half(x):
    ...   keep = jnp.argsort(jnp.linalg.norm(x, axis=1))[:x.shape[0] // 2]
    ...   return jnp.mean(x[keep], axis=0)
    >>> tx = robust_aggregate(smallest_half, axis_name="workers")
    >>> run(g)[0].tolist()
    [1.5]

  References:
    Blanchard et al., Machine Learning with Adversaries: Byzantine Tolerant
    Gradient Descent, NeurIPS 2017 (the all-gather-and-aggregate setting).
  """
  fn = "robust_aggregate"
  if not callable(rule):
    raise TypeError(
        f"{fn}: `rule` must be a callable rule(x) -> [d] on the [n, d] matrix of the "
        f"workers' updates (e.g. functools.partial(rules.multi_krum, f=2)), got {rule!r}.")
  coordinatewise = base.check_bool("coordinatewise", coordinatewise, fn=fn)
  with_previous = base.check_bool("with_previous", with_previous, fn=fn)
  return robust_transform(fn, rule, axis_name, compressor=compressor, min_size=min_size,
                          payload_attack=payload_attack, error_feedback=error_feedback,
                          seed=seed, coordinatewise=coordinatewise, with_previous=with_previous)


def robust_transform(fn: str, rule: Rule, axis_name: AxisName, *,
                     compressor: Optional[base.Compressor], min_size: int,
                     payload_attack: Optional[PayloadAttack], error_feedback: bool, seed: int,
                     coordinatewise: bool = False,
                     with_previous: bool = False) -> optax.GradientTransformationExtraArgs:
  """:func:`robust_aggregate` whose argument errors name ``fn`` (a named rule's factory)."""
  axis_name = check_axis_name(axis_name, fn)
  wire = _make_wire(fn, compressor, min_size, payload_attack, error_feedback)
  seed = base.check_int("seed", seed, fn=fn)

  def init_fn(params):
    count, key = jnp.zeros([], jnp.int32), jax.random.PRNGKey(seed)
    residual = _init_residual(wire, params)
    if not with_previous:
      return RobustState(count=count, key=key, residual=residual)
    center = jax.tree.map(
        lambda p: optax.MaskedNode() if tree.is_node(p) else jnp.zeros(jnp.shape(p), jnp.float32),
        params, is_leaf=tree.is_node)
    return CenteredClipState(count=count, key=key, center=center, residual=residual)

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    coll.check_input(fn, updates, axis_name)
    leaves, treedef, gathered, residual = _gathered_leaves(fn, wire, axis_name, updates, state)
    centers = [None] * len(leaves)
    if with_previous:
      centers = treedef.flatten_up_to(state.center)
      _check_stored(fn, leaves, centers, lambda u: not tree.is_node(u), what="the state",
                    label="centre")
    values = _apply(fn, rule, gathered, centers, n=coll.axis_size(axis_name),
                    coordinatewise=coordinatewise, with_previous=with_previous)
    count = optax.safe_int32_increment(state.count)
    out = _unflatten(treedef, leaves, values)
    if not with_previous:
      return out, RobustState(count=count, key=state.key, residual=residual)
    new_centers = [c if g is None else v for c, g, v in zip(centers, gathered, values)]
    return out, CenteredClipState(count=count, key=state.key, residual=residual,
                                  center=jax.tree_util.tree_unflatten(treedef, new_centers))

  def plan(params, workers):
    sizes = _plan.axis_sizes(axis_name, workers)
    entries = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
      packed = _compresses(wire, leaf)
      nbytes = (-(-wire.compressor.payload_bits(tuple(leaf.shape), leaf.dtype) // 8) if packed
                else base.leaf_size(leaf.shape) * jnp.dtype(leaf.dtype).itemsize)
      entries += _plan.gather_plan(jax.tree_util.keystr(path), axis_name, sizes, nbytes, packed)
    return entries

  return _plan.with_planner(
      _global_view.accepting(optax.GradientTransformationExtraArgs(init_fn, update_fn),
                             axis_name, fn), plan)


__all__ = ["CenteredClipState", "PayloadAttack", "RobustState", "Rule", "robust_aggregate",
           "zero_non_finite_workers"]
