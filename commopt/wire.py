"""Wire accounting: what one worker sends per step, analytically and from HLO.

:func:`payload_bytes` says what :func:`~commopt.compressed_mean` should put on
the wire for a pytree of parameters; :func:`hlo_collectives` reads every
collective out of a compiled program, so tests can prove the two agree and
that no dense gradient crosses the axis.
"""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from commopt._src import base
from commopt.comm import _collectives, _plan, _strategies
from commopt.comm._plan import (Planned, axis_sizes, planner_of, ring_sent_bytes,
                                step_planner_of)
from commopt._src.tree import DEFAULT_MIN_SIZE, compresses
from commopt.transforms._layout import model_axes, runs_shard_local, update_with_value

__all__ = [
    "CommPlan",
    "Collective",
    "PayloadReport",
    "Planned",
    "comm_plan",
    "hlo_collectives",
    "payload_bytes",
    "record_collectives",
    "ring_sent_bytes",
    "total_bytes",
]


def record_collectives():
  """A context manager that records, at run time, the collectives commopt's code runs.

  Programs **traced** inside the ``with`` block (build a fresh ``jax.jit``, or a
  fresh :func:`~commopt.data_parallel`, inside it) log one event per
  collective and device each time it executes: its kind, the bytes the
  device puts in, the device's index over every bound axis (the worker index
  on a 1-D mesh) and the axis it ran over; on a ``("data", "model")`` mesh a
  device's data-axis exchange is ``of_worker(i, "data")``. A collective in a ``lax.cond``
  branch that does not run logs nothing, which the HLO (where a conditional
  holds both branches) cannot tell. The events come from debug callbacks, so
  the recorded programs run slower; use it in tests and audits.

  Yields:
    A recorder: ``events`` (:class:`commopt.comm._collectives.Event`: kind, bytes, the
    device's index over every bound axis, the axis), ``of_worker(index, axis=None)``
    (``[(kind, bytes), ...]``) and ``clear()``.

  Examples:
    >>> import jax, jax.numpy as jnp, commopt
    >>> with commopt.wire.record_collectives() as rec:
    ...   f = jax.vmap(lambda x: commopt.comm.psum(x, "i"), axis_name="i")
    ...   _ = jax.block_until_ready(f(jnp.ones((2, 3))))
    >>> rec.of_worker(0)
    [('all-reduce', 12)]
  """
  return _collectives.recording()


class PayloadReport(NamedTuple):
  """Bytes one worker contributes per step.

  Attributes:
    per_leaf: a pytree like the parameters with each leaf's bytes (None
      leaves stay None).
    compressed: a pytree of bools: whether each leaf goes through the
      compressor (else it is sent dense).
    total: the sum over leaves, in bytes.
    dense: what plain dense all-reduce inputs would be, in bytes.
  """
  per_leaf: Any
  compressed: Any
  total: int
  dense: int

  @property
  def ratio(self) -> float:
    """Dense bytes over payload bytes (the compression ratio, ≥ 1 is a saving)."""
    return self.dense / self.total if self.total else math.inf


def payload_bytes(compressor: base.Compressor, params,
                  *, min_size: int = DEFAULT_MIN_SIZE) -> PayloadReport:
  """The analytic bytes one worker contributes per step under ``compressed_mean``.

  Args:
    compressor: the compressor given to :func:`~commopt.compressed_mean`.
    params: a pytree of arrays or ``jax.ShapeDtypeStruct``\\ s (None leaves
      are skipped).
    min_size: the same ``min_size`` as given to ``compressed_mean``.

  Returns:
    A :class:`PayloadReport`.

  Examples:
    >>> import jax.numpy as jnp, commopt
    >>> r = commopt.wire.payload_bytes(commopt.scaled_sign(), {"w": jnp.zeros((64, 64))})
    >>> r.total, r.dense   # 128 words of signs + one float32 scale
    (516, 16384)
  """
  def leaf_bytes(leaf):
    if leaf is None:
      return None
    if compresses(compressor, leaf.shape, leaf.dtype, min_size):
      return -(-compressor.payload_bits(tuple(leaf.shape), leaf.dtype) // 8)
    return base.leaf_size(leaf.shape) * np.dtype(leaf.dtype).itemsize

  is_none = lambda x: x is None
  per_leaf = jax.tree.map(leaf_bytes, params, is_leaf=is_none)
  flags = jax.tree.map(
      lambda l: None if l is None else compresses(compressor, l.shape, l.dtype, min_size),
      params, is_leaf=is_none)
  dense = sum(base.leaf_size(l.shape) * np.dtype(l.dtype).itemsize
              for l in jax.tree.leaves(params))
  return PayloadReport(per_leaf=per_leaf, compressed=flags,
                       total=int(sum(jax.tree.leaves(per_leaf))), dense=int(dense))


class CommPlan(NamedTuple):
  """The collectives a reduction runs per step, as :func:`comm_plan` predicts them.

  Attributes:
    collectives: one :class:`Planned` per collective and leaf, in leaf order
      (for a ``tx`` holding several reductions, each reduction's in turn, in
      the order ``tx.update`` runs them).
    dense_sent: what a dense all-reduce of every leaf would send per worker
      (ring model), in bytes; uncovered leaves included.
    dense_bytes: every leaf's bytes, what a dense all-reduce takes in.
    uncovered: the paths (``jax.tree_util.keystr``) of the parameter leaves
      that no reduction in ``tx`` receives (under ``optax.multi_transform``,
      the leaves of a label without one): they are never exchanged, so each
      worker's own update is applied to them. Empty for a compressor or a
      bare reducing transform.
  """
  collectives: list
  dense_sent: float
  dense_bytes: int = 0
  uncovered: tuple = ()

  @property
  def contributed_bytes(self) -> int:
    """Bytes one worker puts into the collectives (compare :func:`total_bytes` of an audit)."""
    return int(sum(c.contributed_bytes for c in self.collectives))

  @property
  def sent_bytes(self) -> float:
    """Bytes one worker sends under the ring model."""
    return float(sum(c.sent_bytes for c in self.collectives))

  @property
  def ratio(self) -> float:
    """Dense bytes sent over these bytes sent (≥ 1 is a saving)."""
    return self.dense_sent / self.sent_bytes if self.sent_bytes else math.inf


def comm_plan(tx, params, workers, *, axis_name="data", strategy: str = "auto",
              inner_strategy: str = "auto", min_size: int = DEFAULT_MIN_SIZE,
              step: Optional[int] = None) -> CommPlan:
  """The collectives a reducing transform runs per step, predicted before anything compiles.

  Each reduction predicts its own collectives (kind, axis, bytes in, bytes
  sent under the ring model), so a run's traffic can be read before it is
  compiled and compared with :func:`hlo_collectives` after.

  The periodic synchronisation modes (``local_sgd``, ``diloco``,
  ``streaming_diloco``, ``easgd``) exchange only on some steps, and
  ``onebit_adam`` (and a compressor with dense warm-up steps, ``power_sgd``'s
  ``start_iter``) all-reduces dense before its freeze: without ``step`` their
  plan is what one full synchronisation (or compressed step) sends; with
  ``step`` it is what runs at that step (empty on a step without an
  exchange; one fragment's share for ``streaming_diloco``; the level that
  synchronises for a hierarchical ``local_sgd``). The step is the
  transform's own count, which does not advance on a step skipped for a
  non-finite gradient.

  Args:
    tx: a compressor, which stands for ``compressed_mean(tx, axis_name=axis_name,
      strategy=..., inner_strategy=..., min_size=...)``; a reducing transform
      made by commopt (``compressed_mean``, ``dgc``, ``majority_vote``, the
      robust rules, the synchronisation modes); or any optax transform that
      contains them, such as the ``tx`` given to
      :func:`~commopt.data_parallel`: ``optax.chain``,
      ``optax.multi_transform`` (each reduction planned on the leaves its
      label covers), ``optax.inject_hyperparams``,
      :func:`~commopt.transforms.apply_if_finite`,
      :func:`~commopt.multi_steps`, nested in any way. Such a ``tx`` is traced
      abstractly (``tx.init`` and one ``tx.update`` per worker under
      ``jax.vmap`` over ``axis_name``, nothing computed); the plan is the sum
      of the plans of the reductions it runs, each on the updates it
      receives, and the leaves none receives are listed in
      :attr:`CommPlan.uncovered`. A reduction run inside another one is part
      of the outer one's plan, and one traced more than once (as
      :func:`~commopt.multi_steps` traces its inner update to shape its
      ``lax.cond``) counts once: under ``multi_steps`` the plan is what
      each ``k``-th call sends.
    params: a pytree of arrays or ``jax.ShapeDtypeStruct``\\ s.
    workers: workers on the axis (an int), or one count per axis for a tuple
      of axes (``(slow, fast)`` for ``strategy="hierarchical"``). Every
      reduction traced in a ``tx`` is planned with these counts, so they
      must be the counts of its own axes.
    axis_name: with a compressor, the axis name(s) it would reduce over; a
      bare reducing transform knows its own. For a ``tx`` that is traced, the
      axis name(s) bound while tracing it: every axis its reductions (and
      wrappers such as ``apply_if_finite``) use must be among them.
    strategy: with a compressor, as given to ``compressed_mean``.
    inner_strategy: with a compressor, as given to ``compressed_mean``.
    min_size: with a compressor, as given to ``compressed_mean``.
    step: the 0-based optimizer step whose exchange to plan (None: a step
      that synchronises everything). In a traced ``tx`` it is each
      reduction's own count (under :func:`~commopt.multi_steps`, inner steps).

  Returns:
    A :class:`CommPlan`.

  Examples:
    >>> import jax.numpy as jnp, commopt
    >>> params = {"w": jnp.zeros((256, 256))}
    >>> gather = commopt.wire.comm_plan(commopt.scaled_sign(), params, 64)
    >>> two_phase = commopt.wire.comm_plan(
    ...     commopt.compressed_mean(commopt.scaled_sign(), axis_name="data", strategy="two_phase"),
    ...     params, 64)
    >>> [c.kind for c in two_phase.collectives]
    ['all-to-all', 'all-gather']
    >>> round(gather.ratio, 1), round(two_phase.ratio, 1)
    (1.0, 31.0)

    A chain, as given to :func:`~commopt.data_parallel`, plans as the
    reduction inside it:

    >>> import optax
    >>> tx = optax.chain(commopt.compressed_mean(commopt.scaled_sign(), axis_name="data"),
    ...                  optax.adam(1e-3))
    >>> chained = commopt.wire.comm_plan(tx, params, 64)
    >>> chained.collectives == gather.collectives, chained.uncovered
    (True, ())
  """
  if step is not None:
    step = base.check_int("step", step, fn="comm_plan", minimum=0)
  uncovered = ()
  on_mesh = _model_mesh(params, axis_name, workers)
  if on_mesh is not None:
    if isinstance(tx, base.Compressor):
      from commopt.transforms import compressed_mean
      tx = compressed_mean(tx, axis_name=axis_name, strategy=strategy,
                           inner_strategy=inner_strategy, min_size=min_size)
    entries, uncovered = _traced_plan(tx, params, workers, axis_name, step, on_mesh)
  elif isinstance(tx, base.Compressor):
    reduction = _strategies.resolve(strategy, tx, "comm_plan", inner_strategy)
    entries = _strategies.plan_reduction(tx, reduction, params, axis_sizes(axis_name, workers),
                                         axis_name, min_size, step)
  else:
    planner = planner_of(tx) if step is None else step_planner_of(tx)
    if planner is not None:                     # a bare reducing transform
      entries = planner(params, workers) if step is None else planner(params, workers, step)
    elif callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None)):
      entries, uncovered = _traced_plan(tx, params, workers, axis_name, step)
    else:
      raise ValueError(
          "comm_plan: `tx` must be a commopt Compressor, a reducing transform made by commopt "
          "(compressed_mean, dgc, majority_vote, a robust rule, a synchronisation mode) or an "
          f"optax transform containing one (optax.chain, multi_transform, ...), got {tx!r}.")
  total = math.prod(workers) if isinstance(workers, tuple) else workers
  dense = sum(base.leaf_size(l.shape) * np.dtype(l.dtype).itemsize
              for l in jax.tree.leaves(params))
  return CommPlan(collectives=entries, dense_sent=ring_sent_bytes("all-reduce", dense, total),
                  dense_bytes=int(dense), uncovered=uncovered)


_UNBOUND = re.compile(r"(?:unbound axis name:?|asks for axis)\s*'?([^\s'.,;]+)")


def _describe(tx) -> str:
  init = getattr(tx, "init", None)
  return f"{type(tx).__name__}(init={getattr(init, '__qualname__', init)!r})"


def _model_mesh(params, axis_name, workers):
  """``(mesh, specs)`` where ``params`` are placed (``NamedSharding``) on one mesh on which
  :func:`~commopt.data_parallel` runs ``tx`` on each device's blocks
  (``parallel._layout.runs_shard_local``); else None."""
  shardings = [getattr(x, "sharding", None) for x in jax.tree.leaves(params)]
  if not shardings or not all(isinstance(s, jax.sharding.NamedSharding) for s in shardings):
    return None
  mesh = shardings[0].mesh
  if any(s.mesh != mesh for s in shardings):
    return None
  if not runs_shard_local(mesh, axis_name, [s.spec for s in shardings]):
    return None
  if not set(base.axis_names(axis_name)) <= set(mesh.axis_names):
    raise ValueError(f"comm_plan: `params` are placed on a mesh with axes "
                     f"{tuple(mesh.axis_names)}, which lacks axis_name={axis_name!r}.")
  counts = tuple(mesh.shape[a] for a in base.axis_names(axis_name))
  if (workers if isinstance(workers, tuple) else (workers,)) != counts:
    raise ValueError(f"comm_plan: workers={workers!r}, but the mesh `params` are placed on "
                     f"has {counts if len(counts) > 1 else counts[0]} on axis_name="
                     f"{axis_name!r}.")
  specs = jax.tree.map(lambda x: x.sharding.spec, params)
  return mesh, specs


def _shards(abstract, specs, mesh, model) -> dict:
  """``{path: (whole_size, senders)}`` of each leaf's block (:class:`_plan.Shard`), the
  senders being the ranks of the ``model`` axes the leaf is replicated over."""
  out = {}
  for (path, x), spec in zip(jax.tree_util.tree_flatten_with_path(abstract)[0],
                             jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))):
    cut = set(_collectives.spec_axes(spec))
    out[jax.tree_util.keystr(path)] = (math.prod(x.shape),
                                      math.prod(mesh.shape[a] for a in model if a not in cut))
  return out


def _traced_plan(tx, params, workers, axis_name, step, on_mesh=None) -> tuple[list, tuple]:
  """The plans of the reductions ``tx`` runs, found by tracing it abstractly on every worker.

  ``tx.init`` and ``tx.update`` run for one worker under ``jax.vmap`` over
  each axis of ``axis_name`` (gradients stacked over the workers, parameters
  shared), inside :func:`jax.make_jaxpr` on ``jax.ShapeDtypeStruct``\\ s:
  nothing is computed. Each reduction registered by ``_plan.with_planner``
  records its planner on the updates it receives; only those whose trace
  lands in the program count.
  """
  sizes = axis_sizes(axis_name, workers)
  shape_of = lambda x: jax.ShapeDtypeStruct(tuple(np.shape(x)), np.dtype(x.dtype))
  abstract = jax.tree.map(shape_of, params)
  counts = tuple(sizes.values())
  grads = jax.tree.map(lambda x: jax.ShapeDtypeStruct(counts + x.shape, x.dtype), abstract)

  def one_worker(g, p):
    state = tx.init(p)
    # A `tx` that reads optax's `value` extra argument (reduce_on_plateau) gets one,
    # as data_parallel's step hands it the mean loss.
    return update_with_value(tx, g, state, p, jnp.zeros((), jnp.float32))[0]

  fn, shards = one_worker, None
  if on_mesh is None:
    for name in reversed(tuple(sizes)):
      fn = jax.vmap(fn, in_axes=(0, None), axis_name=name, axis_size=sizes[name])
  else:
    # As the shard-local step runs it: each device's blocks, in a shard_map manual over
    # every mesh axis, the parameters' specs stated.
    mesh, specs = on_mesh
    data, model = base.axis_names(axis_name), model_axes(mesh, axis_name)
    shards = _shards(abstract, specs, mesh, model)
    shapes = jax.tree.map(lambda x: tuple(x.shape), abstract)

    def one_device(g, p):
      with _collectives.model_sharding(specs, shapes, mesh, model):
        one_worker(jax.tree.map(lambda x: x.reshape(x.shape[len(data):]), g), p)
      return jnp.zeros(())

    grad_specs = jax.tree.map(lambda s: P(*data, *s), specs,
                              is_leaf=lambda s: isinstance(s, P))
    fn = jax.shard_map(one_device, mesh=mesh, in_specs=(grad_specs, specs), out_specs=P())
    placed = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                               sharding=jax.sharding.NamedSharding(mesh, s))
    grads = jax.tree.map(placed, grads, grad_specs)
    abstract = jax.tree.map(placed, abstract, specs)
  with _plan.recording(workers, step, shards) as rec:
    try:
      jaxpr = jax.make_jaxpr(fn)(grads, abstract)
    except NameError as e:
      # JAX's own unbound-axis NameError, or commopt's AxisNameError (a NameError too).
      m = _UNBOUND.search(str(e))
      if m is None and not isinstance(e, base.AxisNameError):
        raise
      axis = f" {m.group(1)!r}" if m else ""
      raise base.AxisNameError(
          f"comm_plan: `tx` communicates over a mesh axis{axis} that `axis_name`="
          f"{axis_name!r} does not bind ({e}). Pass the axis name(s) its reductions use "
          "as `axis_name` (a tuple for several) and their worker counts as `workers`."
      ) from e
  if not rec.records:
    raise ValueError(
        f"comm_plan: `tx` contains no reduction made by commopt, got {_describe(tx)}. `tx` "
        "must be a "
        "commopt Compressor, a reducing transform made by commopt (compressed_mean, dgc, "
        "majority_vote, a robust rule, a synchronisation mode), or an optax transform "
        "containing one (optax.chain, optax.multi_transform, optax.inject_hyperparams, "
        "commopt.transforms.apply_if_finite, commopt.multi_steps, ...).")
  entries, covered = _plan.traced_plans(rec, jaxpr)
  covered = set(covered)
  uncovered = tuple(path for path in (jax.tree_util.keystr(k) for k, _ in
                                      jax.tree_util.tree_flatten_with_path(abstract)[0])
                    if path not in covered)
  return entries, uncovered


class Collective(NamedTuple):
  """One collective of a compiled program.

  Attributes:
    kind: ``all-reduce``, ``all-gather``, ``all-to-all``, ``reduce-scatter`` or
      ``collective-permute``.
    dtypes: the element type of each operand (combined collectives have several).
    shapes: the result shape of each operand.
    group_size: the number of workers in each replica group.
    replica_groups: the groups of device ids that communicate.
    contributed_bytes: bytes one worker puts into the collective.
    sent_bytes: bytes one worker sends under a ring model.
    line: the HLO instruction.
    trips: how many times one run of the program runs it: the product of the known
      trip counts of the ``while`` loops whose bodies hold it (1 outside loops, and
      for a loop whose trip count the compiler does not state).
  """
  kind: str
  dtypes: tuple
  shapes: tuple
  group_size: int
  replica_groups: tuple
  contributed_bytes: int
  sent_bytes: int
  line: str
  trips: int = 1


_KINDS = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute",
          "collective-broadcast")
_INSTR = re.compile(
    r"=\s*(?P<shape>\(.*?\)|[a-z0-9]+\[[0-9,<=]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>" + "|".join(_KINDS) + r")(?P<start>-start)?\(")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,<=]*)\]")


def _element_bits(dtype: str) -> int:
  """Bits per element of an HLO element type (pred is a byte; f8e4m3fn is 8)."""
  if dtype == "pred":
    return 8
  return int(re.match(r"[a-z]+(\d+)", dtype).group(1))


_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[([^\]]*)\],?\s*"
    r"(?:device_ids=\(\[([0-9,]+)\](?:<=\[([0-9,]+)\])?(?:T\(([0-9,]+)\))?\),?\s*)?"
    r"\{([^}]*)\}")


def _iota(shape, source=None, perm=None) -> np.ndarray:
  """Device ids of an iota list: ``arange`` over ``source`` (else ``shape``), transposed, reshaped."""
  dims = [int(i) for i in (source or shape).split(",")]
  ids = np.arange(math.prod(dims)).reshape(dims)
  if perm:
    ids = ids.transpose([int(i) for i in perm.split(",")])
  return ids.reshape([int(i) for i in shape.split(",")])


def _mesh_groups(m) -> tuple:
  """Groups of the mesh-axes form (newer XLA): ``mesh['a'=4,'b'=2] {'b'}`` groups along b."""
  axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
  names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
  ids = (_iota(m.group(2), m.group(3), m.group(4)).reshape(-1) if m.group(2)
         else np.arange(math.prod(sizes)))
  chosen = re.findall(r"'([^']+)'", m.group(5))
  keep = [i for i, n in enumerate(names) if n not in chosen]
  group = [names.index(n) for n in chosen]
  width = math.prod(sizes[i] for i in group)
  ids = ids.reshape(sizes).transpose(keep + group).reshape(-1, width)
  return tuple(tuple(int(i) for i in g) for g in ids)


def _replica_groups(line: str, num_devices: int) -> tuple:
  m = _MESH_GROUPS.search(line)
  if m:
    return _mesh_groups(m)
  m = re.search(r"replica_groups=\{(\{[0-9,{}]*\})?\}", line)
  if m:
    groups = tuple(tuple(int(i) for i in g.split(",") if i)
                   for g in re.findall(r"\{([0-9,]*)\}", m.group(1) or ""))
    return groups or (tuple(range(num_devices)),)
  m = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", line)
  if m:
    shape = [int(i) for i in m.group(1).split(",")]
    ids = np.arange(math.prod(int(i) for i in m.group(2).split(",")))
    ids = ids.reshape([int(i) for i in m.group(2).split(",")])
    if m.group(3):
      ids = ids.transpose([int(i) for i in m.group(3).split(",")])
    return tuple(tuple(int(i) for i in g) for g in ids.reshape(shape[0], -1))
  m = re.search(r"source_target_pairs=\{([0-9,{}]*)\}", line)
  if m:
    return tuple(tuple(int(i) for i in p.split(",")) for p in re.findall(r"\{([0-9,]*)\}", m.group(1)))
  return (tuple(range(num_devices)),)


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?(%?[\w.\-]+)\s.*\{\s*$")
_WHILE = re.compile(r"\swhile\(.*\bbody=(%?[\w.\-]+)")
_TRIPS = re.compile(r'known_trip_count"?\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


def _lines_in_computations(text: str):
  """``(computation, line)`` for every line of HLO ``text``: the name of the computation
  whose body holds it (a header line names the computation that follows it; lines before
  any header, e.g. a lone instruction, get None)."""
  current = None
  for line in text.splitlines():
    if line and not line[0].isspace():
      m = _COMPUTATION.match(line)
      current = m.group(1).lstrip("%") if m else current
    yield current, line


def _loop_trips(text: str) -> dict:
  """``{computation: runs per run of the program}`` for the bodies of ``while`` loops with a
  known trip count (nested loops multiply); computations absent run once."""
  parent, loops = {}, {}
  for current, line in _lines_in_computations(text):
    w = _WHILE.search(line)
    if w:
      t = _TRIPS.search(line)
      body = w.group(1).lstrip("%")
      loops[body] = int(t.group(1)) if t else 1
      parent[body] = current
  trips = {}

  def runs(name, depth=0):
    if name not in loops or depth > 64:
      return 1
    if name not in trips:
      trips[name] = loops[name] * runs(parent[name], depth + 1)
    return trips[name]

  for body in loops:
    runs(body)
  return trips


def parse_hlo(text: str, num_devices: Optional[int] = None) -> list[Collective]:
  """Every collective in HLO ``text`` (the ``-done`` halves of async pairs are skipped),
  with how many times a run of the program runs it (``trips``: inside ``while`` loops of
  known trip count)."""
  if num_devices is None:
    m = re.search(r"num_partitions=(\d+)", text)
    num_devices = int(m.group(1)) if m else jax.device_count()
  loop_trips = _loop_trips(text)
  out = []
  for current, line in _lines_in_computations(text):
    m = _INSTR.search(line)
    if not m:
      continue
    kind = m.group("op")
    arrays = _ARRAY.findall(m.group("shape"))
    if m.group("start") and kind != "all-reduce":
      # An async start returns (operands, results[, context scalars]).
      arrays = [a for a in arrays if a[1]]
      arrays = arrays[len(arrays) // 2:]
    groups = _replica_groups(line, num_devices)
    n = 1 if kind == "collective-permute" else len(groups[0])
    if not arrays:
      continue
    dtypes = tuple(a[0] for a in arrays)
    shapes = tuple(tuple(int(d.lstrip("<=")) for d in a[1].split(",") if d) for a in arrays)
    nbytes = sum(-(-_element_bits(d) * math.prod(s) // 8) for d, s in zip(dtypes, shapes))
    contributed = {"all-reduce": nbytes, "all-gather": nbytes // max(n, 1), "all-to-all": nbytes,
                   "reduce-scatter": nbytes * n, "collective-permute": nbytes,
                   "collective-broadcast": nbytes}[kind]
    sent = ring_sent_bytes(kind, contributed, n)
    out.append(Collective(kind=kind, dtypes=dtypes, shapes=shapes, group_size=n,
                          replica_groups=groups, contributed_bytes=int(contributed),
                          sent_bytes=int(round(sent)), line=line.strip(),
                          trips=loop_trips.get(current, 1)))
  return out


_NARROW_FLOATS = ("bf16", "f16")


def hlo_collectives(fn, *args, stage: str = "auto", **kwargs) -> list[Collective]:
  """Every collective in the compiled HLO of ``fn(*args, **kwargs)``.

  Args:
    fn: a jitted function, anything with a ``lower`` method (e.g.
      :meth:`~commopt.DataParallel.lower` via ``dp``), or a plain function
      (jitted here).
    *args: its arguments, placed as it expects them.
    stage: ``"compiled"`` (after XLA's passes, what runs), ``"lowered"``
      (before backend passes) or ``"auto"``. XLA:CPU widens 16-bit float
      all-reduces to f32 when it compiles (GPUs keep them narrow), so
      ``"auto"`` reads the lowered program on CPU when a collective moves a
      16-bit float, and the compiled one otherwise. (commopt's gathers and
      all-to-alls move narrow floats as unsigned integers of their width.)
    **kwargs: keyword arguments of ``fn``.

  Returns:
    A list of :class:`Collective`, in program order, each instruction once as
    written; its ``trips`` say how many times a run of the program runs it (a
    scan's body once per iteration), which
    ``total_bytes(..., per_run=True)`` counts.

  Examples:
    >>> import jax, jax.numpy as jnp, commopt
    >>> f = jax.jit(lambda x: x * 2)
    >>> commopt.wire.hlo_collectives(f, jnp.ones(3))
    []
  """
  if stage not in ("auto", "compiled", "lowered"):
    raise ValueError(
        f"hlo_collectives: `stage` must be 'auto', 'compiled' or 'lowered', got {stage!r}.")
  if hasattr(fn, "lower"):
    lowered = fn.lower(*args, **kwargs)
  else:
    lowered = jax.jit(fn).lower(*args, **kwargs)
  if stage == "auto":
    before = parse_hlo(lowered.as_text(dialect="hlo"))
    narrow = any(d in _NARROW_FLOATS for c in before for d in c.dtypes)
    if narrow and jax.default_backend() == "cpu":
      return before
  if stage == "lowered":
    return parse_hlo(lowered.as_text(dialect="hlo"))
  return parse_hlo(lowered.compile().as_text())


def total_bytes(collectives, field: str = "contributed_bytes", *, per_run: bool = False) -> int:
  """Sum of ``field`` (``contributed_bytes`` or ``sent_bytes``) over collectives: each
  instruction once, or with ``per_run`` as many times as a run of the program runs it
  (its ``trips``: a scan's body runs once per iteration)."""
  return int(sum(getattr(c, field) * (c.trips if per_run else 1) for c in collectives))
