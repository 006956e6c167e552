"""Communication plans: which collectives a reduction runs, and their bytes.

One ring model for every byte count in commopt: :mod:`commopt.wire` reads
collectives out of compiled HLO with it, and each reduction strategy predicts
its own collectives with it, so a plan and an audit can be compared entry by
entry.
"""

from __future__ import annotations

import contextvars
import itertools
import re
import weakref
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from commopt._src import base, scope

KINDS = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute",
         "collective-broadcast")


def ring_sent_bytes(kind: str, contributed: float, n: int) -> float:
  """Bytes one of ``n`` workers sends for a collective it contributes ``contributed`` bytes to.

  The ring model: an all-reduce sends ``2(n-1)/n`` of its input, an
  all-gather ``n-1`` copies of its contribution, an all-to-all and a
  reduce-scatter ``(n-1)/n`` of their input.
  """
  if kind not in KINDS:
    raise ValueError(f"ring_sent_bytes: `kind` must be one of {KINDS}, got {kind!r}.")
  if kind == "collective-permute":
    return float(contributed)
  if n <= 1:
    return 0.0
  if kind == "all-reduce":
    return 2 * (n - 1) * contributed / n
  if kind == "all-gather":
    return (n - 1) * contributed
  return (n - 1) * contributed / n


class Planned(NamedTuple):
  """One collective a reduction will run for one leaf, or that leaf's share of one:
  leaves exchanged together (``two_phase``) cross in one collective per round, each
  leaf's words end to end, so the shares add up to its bytes.

  Attributes:
    leaf: the leaf's path (``jax.tree_util.keystr``).
    kind: ``"all-reduce"``, ``"all-gather"``, ``"all-to-all"`` or ``"reduce-scatter"``.
    axis: the mesh axis it runs over.
    group_size: workers on that axis.
    contributed_bytes: bytes one worker puts in.
    sent_bytes: bytes one worker sends, by :func:`ring_sent_bytes`.
    packed: whether the bytes are a compressed payload (else dense floats).
  """
  leaf: str
  kind: str
  axis: str
  group_size: int
  contributed_bytes: int
  sent_bytes: float
  packed: bool


def planned(leaf: str, kind: str, axis: str, n: int, contributed: int, packed: bool) -> Planned:
  return Planned(leaf=leaf, kind=kind, axis=axis, group_size=n,
                 contributed_bytes=int(contributed),
                 sent_bytes=ring_sent_bytes(kind, contributed, n), packed=packed)


# ---------------------------------------------------------------------------
# Planners: each reducing transform registers how to predict its collectives.

_PLANNERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


_STEP_PLANNERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


_EXCHANGES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _Recording:
  """The reductions traced while :func:`recording` is active, by marker token.

  ``inside`` is set while a recorded reduction's own update is traced, so a
  reduction nested in another one (``dgc`` around ``compressed_mean``, a
  synchronisation mode around its reducer) is planned once, by the outer one.
  """

  def __init__(self, workers, step, shards=None):
    self.workers = workers
    self.step = step
    self.shards = shards or {}
    self.records: dict = {}
    self.inside = False

  def shard(self, path, x):
    """``x`` (a leaf's abstract value at ``path``) as the :class:`Shard` it is, if one."""
    got = self.shards.get(jax.tree_util.keystr(path))
    return x if got is None else Shard(x.shape, x.dtype, *got)


class Shard(jax.ShapeDtypeStruct):
  """One device's block of a leaf on a mesh with model axes, as a plan reads it.

  Attributes:
    whole_size: the whole leaf's elements (``min_size`` judges the whole leaf).
    senders: the model ranks that split the leaf's dense all-reduce (those of the
      model axes it is replicated over; 1 where it is cut over every model axis).
  """
  __slots__ = ("whole_size", "senders")

  def __init__(self, shape, dtype, whole_size: int, senders: int = 1):
    super().__init__(shape, dtype)
    self.whole_size, self.senders = int(whole_size), int(senders)


# A recorder for `commopt.wire.comm_plan`, active only while it traces a step: the
# transforms it records are nested anywhere in the user's optax tree, and their
# updates take no argument of ours. Outside `comm_plan` it is None and nothing reads it.
_RECORDING: contextvars.ContextVar = contextvars.ContextVar("commopt_plan_recording",
                                                            default=None)
_TOKENS = itertools.count()
_MARK = "commopt_plan_"
_MARKED = re.compile(re.escape(_MARK) + r"(\d+)")


def with_planner(tx, planner, step_planner=None, exchanges=None):
  """Registers ``planner(params, workers) -> [Planned]`` for transform ``tx``; returns it.

  ``workers`` counts the workers on the transform's axis (an int), or on each
  of its axes (a tuple, see :func:`axis_sizes`). :func:`commopt.wire.comm_plan`
  looks the planner up by the returned transform's ``init`` (``tx.init``).

  A transform that does not exchange the same thing every step (the
  synchronisation modes) also registers ``step_planner(params, workers, step)
  -> [Planned]``: what runs at its 0-based ``step`` (nothing on a step without
  an exchange). Without one, every step runs ``planner``'s collectives. Such a
  transform may also register ``exchanges(state)``: whether the update called
  with ``state`` exchanges (traced, the same on every worker), read by
  :func:`exchanges_of`.

  The returned transform is ``tx`` with an ``update`` that, only while
  :func:`recording` is active, records the planner against the updates it
  receives (so a reduction inside ``optax.chain``, ``optax.multi_transform``
  or a wrapper is planned on the leaves that reach it) and marks its own
  trace; otherwise it calls ``tx.update`` directly.
  """
  inner_update = tx.update

  def update_fn(updates, state, params=None, **extra_args):
    rec = _RECORDING.get()
    if rec is None or rec.inside:
      return inner_update(updates, state, params, **extra_args)
    token = next(_TOKENS)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)),
                            updates)
    rec.records[token] = (planner, step_planner, abstract)
    rec.inside = True
    try:
      with jax.named_scope(f"{_MARK}{token}"):
        return inner_update(updates, state, params, **extra_args)
    finally:
      rec.inside = False

  extra = isinstance(tx, optax.GradientTransformationExtraArgs)
  kind = optax.GradientTransformationExtraArgs if extra else optax.GradientTransformation
  out = kind(tx.init, update_fn)
  _PLANNERS[out.init] = planner
  if step_planner is not None:
    _STEP_PLANNERS[out.init] = step_planner
  if exchanges is not None:
    _EXCHANGES[out.init] = exchanges
  return out


def exchanges_of(tx):
  """``tx``'s registered ``exchanges(state)`` (see :func:`with_planner`), or None: a
  transform that did not register one may exchange on every step."""
  return _lookup(_EXCHANGES, tx)


def recording(workers, step=None, shards=None):
  """While active, every transform registered by :func:`with_planner` records its planner
  when its ``update`` is traced; yields the :class:`_Recording` (see :func:`traced_plans`).

  ``shards``: ``{path: (whole_size, senders)}`` for a trace on each device's blocks of
  the parameters (:class:`Shard`), by leaf path."""
  return scope.bound(_RECORDING, _Recording(workers, step, shards))


def subjaxprs(value):
  """The jaxprs inside an equation parameter's ``value`` (a jaxpr, a closed one, or a list)."""
  if hasattr(value, "eqns"):
    yield value
  elif hasattr(getattr(value, "jaxpr", None), "eqns"):
    yield value.jaxpr
  elif isinstance(value, (tuple, list)):
    for v in value:
      yield from subjaxprs(v)


def _marks(jaxpr) -> set:
  """The marker tokens in the name stacks of ``jaxpr``'s equations, sub-jaxprs included."""
  found, seen, todo = set(), set(), [jaxpr]
  while todo:
    j = todo.pop()
    if id(j) in seen:
      continue
    seen.add(id(j))
    for eqn in j.eqns:
      info = getattr(eqn, "source_info", None)
      found.update(int(t) for t in _MARKED.findall(str(getattr(info, "name_stack", ""))))
      for v in eqn.params.values():
        todo.extend(subjaxprs(v))
  return found


def traced_plans(rec: _Recording, jaxpr) -> tuple[list, list]:
  """The plans of the reductions that ``jaxpr`` runs, in trace order, and the paths they cover.

  A reduction traced only on the side (by ``jax.eval_shape``, as ``lax.cond``
  wrappers do to match their branches) leaves no marker in ``jaxpr`` and is
  dropped, so a reduction traced several times is planned once.

  Returns:
    ``(entries, covered)``: every kept reduction's :class:`Planned` entries,
    concatenated, and the paths (``jax.tree_util.keystr``) of the leaves
    they received.
  """
  kept = _marks(jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr)
  if not kept and any(jax.tree.leaves(r[2]) for r in rec.records.values()):
    # Every reduction with leaves left its marker out of the program: not a transform
    # that only shapes a branch, but name stacks no longer reaching the equations.
    raise RuntimeError(
        "comm_plan: the reductions traced in `tx` left no marker in its program; this "
        f"version of JAX (jax {jax.__version__}) does not keep jax.named_scope in the "
        "equations' name stacks, which comm_plan relies on for a chain or wrapper.")
  entries, covered = [], []
  for token in sorted(kept & rec.records.keys()):
    planner, step_planner, abstract = rec.records[token]
    if rec.shards:
      abstract = jax.tree_util.tree_map_with_path(lambda p, x: rec.shard(p, x), abstract)
    if rec.step is None:
      entries += planner(abstract, rec.workers)
    elif step_planner is not None:
      entries += step_planner(abstract, rec.workers, rec.step)
    else:
      entries += planner(abstract, rec.workers)
    covered += [jax.tree_util.keystr(p)
                for p, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]]
  return entries, covered


def _lookup(table, tx):
  init = getattr(tx, "init", None)
  try:
    return table.get(init)
  except TypeError:
    return None


def planner_of(tx):
  """The planner registered for ``tx`` (see :func:`with_planner`), or None."""
  return _lookup(_PLANNERS, tx)


def step_planner_of(tx):
  """The per-step planner registered for ``tx`` (see :func:`with_planner`), else one that
  plans ``planner_of(tx)``'s collectives on every step; None for an unregistered ``tx``."""
  planner = planner_of(tx)
  if planner is None:
    return None
  return _lookup(_STEP_PLANNERS, tx) or (lambda params, workers, step: planner(params, workers))


def axis_sizes(axis_name, workers) -> dict:
  """``{axis: workers}`` for ``axis_name`` (a name or tuple) and ``workers`` (an int or tuple)."""
  names = base.axis_names(axis_name)
  counts = workers if isinstance(workers, tuple) else (workers,)
  if len(names) != len(counts) or any(
      isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
    raise ValueError(
        f"comm_plan: `workers` must give one count >= 1 per axis of {axis_name!r} (an int "
        f"for one axis, a tuple for several), got {workers!r}.")
  return dict(zip(names, counts))


def total_workers(sizes: dict) -> int:
  out = 1
  for n in sizes.values():
    out *= n
  return out


def leaf_plans(params, sizes: dict, axis_name, compressed_plan, dense_plan=None) -> list:
  """One entry per collective: ``compressed_plan(where, leaf)`` for leaves it takes, else dense.

  ``compressed_plan`` returns a list of :class:`Planned` for a leaf it
  compresses, or None for a leaf sent dense: ``dense_plan(where, nbytes,
  axis_name, sizes)`` then gives its collectives (default: one all-reduce of
  the leaf over every axis).
  """
  entries = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    where = jax.tree_util.keystr(path)
    got = compressed_plan(where, leaf)
    if got is None:
      # A leaf the model ranks split sends its part (comm._exchange, dense buckets).
      elements = -(-int(np.prod(leaf.shape, dtype=np.int64)) // getattr(leaf, "senders", 1))
      nbytes = elements * np.dtype(leaf.dtype).itemsize
      got = (dense_plan(where, nbytes, axis_name, sizes) if dense_plan is not None else
             [planned(where, "all-reduce", axis_name, total_workers(sizes), nbytes, packed=False)])
    entries += got
  return entries


def gather_plan(leaf: str, axis_name, sizes: dict, nbytes: int, packed: bool) -> list:
  """An all-gather of ``nbytes`` per worker over ``axis_name``, as :func:`all_gather` runs it.

  Over a tuple of axes the gather runs one axis at a time, the last first,
  each contributing what the previous one gathered.
  """
  names = base.axis_names(axis_name)
  entries = []
  for name in reversed(names):
    entries.append(planned(leaf, "all-gather", name, sizes[name], nbytes, packed))
    nbytes *= sizes[name]
  return entries
