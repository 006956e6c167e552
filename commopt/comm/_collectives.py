"""Collectives over a named axis that work under shard_map, vmap and locally.

The only module of commopt that calls JAX's collectives (``jax.lax.psum``,
``all_gather``, ``all_to_all``, ...); everything else goes through these
wrappers (``tests/test_layering.py`` checks it).

``axis_name=None`` means one local worker: every collective is the identity.
Inside ``jax.shard_map`` with ``check_vma=True`` the gathered payloads are
typed invariant, so a reduced value can leave the map replicated.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from commopt._src import base, finite, scope, vma
from commopt._src import tree as tree_lib
from commopt._src.vma import spec_axes, vary, vary_like, varying_axes  # noqa: F401  (re-exported)


# -- recording the collectives a program runs ----------------------------------------------
# Each collective here calls `_record` while it is traced; where a `recording` is active
# (`commopt.wire.record_collectives`), the compiled program reports each run of it, device
# by device, through a host callback.

class Event(NamedTuple):
  """One collective one device ran (see :class:`Recorder`).

  Attributes:
    kind: ``"all-reduce"``, ``"all-gather"``, ...
    nbytes: bytes the device put in.
    index: the device's position in the map: its linear index over every
      bound axis (the worker index on a 1-D mesh or under one ``vmap``).
    axis: the axis (or tuple of axes) the collective ran over.
  """
  kind: str
  nbytes: int
  index: int
  axis: Any


class Recorder:
  """Collectives that ran, one :class:`Event` per device per collective.

  Filled at run time by the programs traced while :func:`recording` is
  active: a collective inside a branch that does not run records nothing.
  Each device records its own events with its index over every bound axis,
  so on a 2-D mesh (``("data", "model")``, the optimizer manual over both)
  a device's events are its own, once each, and ``axis`` tells the
  data-axis exchange from the gathers inside a model group.
  """

  def __init__(self):
    self.events: list[Event] = []

  def add(self, kind: str, nbytes: int, axis, index) -> None:
    for i in np.ravel(np.asarray(index)):
      self.events.append(Event(kind, nbytes, int(i), axis))

  def of_worker(self, index: int = 0, axis=None) -> list[tuple[str, int]]:
    """The ``(kind, bytes)`` of every collective device ``index`` ran, in order
    (over ``axis`` only, if given)."""
    return [(e.kind, e.nbytes) for e in self.events
            if e.index == index and (axis is None or e.axis == axis)]

  def clear(self) -> None:
    self.events.clear()


_RECORDERS: list[Recorder] = []


@contextlib.contextmanager
def recording():
  """Programs traced inside record each collective of this module when it runs."""
  rec = Recorder()
  _RECORDERS.append(rec)
  try:
    yield rec
  finally:
    _RECORDERS.remove(rec)


def _record(kind: str, tree, axis_name) -> None:
  if not _RECORDERS or axis_name is None:
    return
  nbytes = sum(int(np.prod(jnp.shape(x))) * jnp.result_type(x).itemsize
               for x in jax.tree.leaves(tree))
  bound = vma.bound_axis_names()
  device = jax.lax.axis_index(bound if bound else axis_name)
  jax.debug.callback(functools.partial(_RECORDERS[-1].add, kind, nbytes, axis_name), device)


# -- the collectives ---------------------------------------------------------------------


def _all_gather_invariant(x: jax.Array, axis_name, *, axis: int = 0, tiled: bool = False):
  """``all_gather`` whose result is typed invariant over ``axis_name`` (inside shard_map).

  JAX 0.10–0.12 spell it ``all_gather(..., to="invarying")``; no supported
  release has the older ``all_gather_invariant``.
  """
  return jax.lax.all_gather(x, axis_name, axis=axis, tiled=tiled, to="invarying")


def tracks_varying(axis_name: str) -> bool:
  """Whether values' types here record if they vary over the bound ``axis_name``.

  True inside ``jax.shard_map`` with ``check_vma=True`` (the default), false
  under ``check_vma=False`` and ``jax.vmap``, where every type looks
  invariant. Read from the public API: ``axis_index`` is typed varying
  exactly when the types are tracked (JAX 0.10–0.12). The probe adds one
  ``axis_index`` to the trace, which the compiler removes unused.
  """
  return axis_name in vma.varying_axes_of_type(jax.typeof(jax.lax.axis_index(axis_name)))


def bound_axis_size(axis_name) -> Optional[int]:
  """Workers on ``axis_name`` (a name or tuple of names) if it is bound here, else None.

  Bound means: inside ``jax.shard_map`` over that axis or ``jax.vmap(...,
  axis_name=...)``. A transform's ``init`` uses it to size per-worker chunks
  when it is called inside the mapped context (as :func:`~commopt.data_parallel`
  and :mod:`commopt.testing` do) and to fall back to whole-leaf sizes otherwise.
  """
  if axis_name is None:
    return None
  try:
    return int(jax.lax.psum(1, axis_name))
  except NameError:
    return None


class Traced(NamedTuple):
  """What the code tracing commopt's transforms states about the values they are traced on.

  Attributes:
    model_axes: the mesh axes a value varying over is one device's shard of a leaf
      (:func:`model_axes`, :func:`commopt.comm.model_sharding`).
    sharding: the parameters' ``PartitionSpec``\\ s over those axes, where stated
      (:func:`model_sharding`; read by :func:`specs_for`).
    typed: False inside a trace whose values do not carry their real varying types
      (:func:`inputs_unchecked`).
  """
  model_axes: frozenset = frozenset()
  sharding: Any = None
  typed: bool = True


# The one context variable of the exchange. These facts belong to the trace that the
# step (or a user's own shard_map) runs, not to any transform: optax's `update` has no
# argument for them, and a user states them once around `tx.init` and `tx.update`
# (`commopt.comm.model_sharding`) however deep the transforms that read them are nested.
_TRACED: contextvars.ContextVar = contextvars.ContextVar("commopt_traced", default=Traced())


def traced() -> Traced:
  """The :class:`Traced` facts of the code being traced."""
  return _TRACED.get()


def stating(**facts):
  """Code traced inside sees :func:`traced` with ``facts`` replaced (a ``with`` block)."""
  return scope.bound(_TRACED, _TRACED.get()._replace(**facts))


def inputs_unchecked():
  """Reductions traced inside skip :func:`check_input`'s varying-type check.

  For tracing that does not give values their real types, e.g. the fixed
  point :meth:`commopt.DataParallel.layout` runs, whose first rounds see
  optimizer state typed invariant that the step keeps per worker. Whether
  the axis is bound is still checked.
  """
  return stating(typed=False)


def check_input(fn: str, tree: Any, axis_name) -> None:
  """Raises unless ``axis_name`` is bound here and ``tree`` still differs between its workers.

  Every reduction of commopt calls it on its input when it is traced (Python
  on types; nothing is added to the program but an unused ``axis_index``):

  - an axis that is not bound (a wrong name, or a transform called outside
    the ``shard_map`` / ``vmap`` over it) raises :class:`~commopt.AxisNameError`
    naming ``fn``, the axis asked for and the axes bound, where JAX would
    raise a bare unbound-axis ``NameError`` from deep inside the trace;
  - inside ``jax.shard_map`` with ``check_vma=True`` (JAX's default), an
    array leaf whose type is invariant over an axis of ``axis_name`` was
    already reduced before it came here, usually because ``jax.grad`` of
    parameters passed replicated (``in_specs=P()``) sums the gradients over
    the axis with a dense all-reduce (the transpose of the implicit
    broadcast). Reducing it again would send the dense values and the
    payload both, so it raises, pointing to
    :func:`commopt.parallel.local_value_and_grad`. A value the same on every
    worker on purpose goes through once cast:
    ``jax.lax.pcast(x, axis_name, to="varying")``.

  Under ``check_vma=False`` and ``jax.vmap`` types carry no such record and
  only the axis is checked.
  """
  if axis_name is None:
    return
  names = base.axis_names(axis_name)
  missing = [a for a in names if bound_axis_size(a) is None]
  if missing:
    bound = vma.bound_axis_names()
    where = (f"the axes bound here are {bound}" if bound else
             "no axis is bound here (the transform runs outside any jax.shard_map or "
             "jax.vmap over a named axis)")
    raise base.AxisNameError(
        f"{fn}: axis_name={axis_name!r} asks for axis {missing[0]!r}, which is not bound "
        f"where the update runs; {where}. Name one of the mesh axes the step maps over "
        "(commopt.data_parallel maps over its `axis_name`), call the transform inside "
        "jax.shard_map / jax.vmap over that axis, or pass axis_name=None for one local worker.")
  tracked = [a for a in names if tracks_varying(a)]
  if not tracked or not _TRACED.get().typed:
    return
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if not vma.is_tracer(x):
      continue
    invariant = [a for a in tracked if a not in varying_axes(x)]
    if invariant:
      a = invariant[0]
      raise ValueError(
          f"{fn}: the input {jax.tree_util.keystr(path)} is already the same on every worker "
          f"of axis {a!r} (its type inside jax.shard_map is invariant over {a!r}), so it was "
          f"reduced before it reached {fn}, and reducing it again would send the dense values "
          "and the payload both. Usually jax.grad of parameters passed replicated "
          "(in_specs=P()) did it: JAX sums such gradients over the axis with a dense "
          "all-reduce. Keep gradients on each worker with commopt.local_value_and_grad("
          f"loss_fn, {axis_name!r}) (or differentiate with respect to jax.lax.pcast(params, "
          f"{a!r}, to='varying')). To reduce a value that is the same on every worker on "
          f"purpose, cast it first: jax.lax.pcast(x, {a!r}, to='varying'). (With Flax nnx, "
          "commopt.nnx_data_parallel runs the whole step this way.)")


def check_state_kept(fn: str, axis_name, what: str) -> None:
  """Raises inside a ``jax.shard_map(..., check_vma=False)`` over ``axis_name``.

  There the types do not say which values differ between workers, so nothing
  checks that per-worker state (``what``: error-feedback residuals, ...)
  leaves the map per worker: with ``out_specs=P()`` for it, ``shard_map``
  keeps worker 0's copy and drops the others' without a word (an
  ``nnx.Optimizer`` stepped inside ``nnx.shard_map(..., check_vma=False)``
  does exactly that). Under ``check_vma=True`` a wrong ``out_specs`` is a
  type error, and under ``jax.vmap`` the state stays batched, so neither
  raises here.
  """
  if axis_name is None:
    return
  names = base.axis_names(axis_name)
  manual = set(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()) or ())
  untracked = [a for a in names if a in manual and not tracks_varying(a)]
  if untracked:
    raise ValueError(
        f"{fn}: it keeps {what} per worker, and it runs inside a jax.shard_map over "
        f"{untracked[0]!r} with check_vma=False, where nothing checks that each worker's copy "
        "leaves the map: with out_specs=P() for the optimizer state, shard_map keeps worker "
        "0's and silently drops the others'. Use check_vma=True (JAX's default) with the "
        "state's per-worker specs (DataParallel.state_specs, commopt.parallel.stack_workers / "
        "unstack_workers), or commopt.data_parallel / commopt.nnx_data_parallel, which do "
        f"this; or a {fn} that keeps no per-worker state (error_feedback=False).")


def cond(pred, true_fn, false_fn, *operands):
  """``lax.cond`` whose branch outputs are typed varying over the same axes.

  Inside ``shard_map`` a branch that passes state through unchanged and one
  that updates it (per-worker residuals, accumulated gradients) return
  different varying-axis types, which ``lax.cond`` rejects. Each output leaf
  is cast to the union of the two branches' varying axes. ``pred`` must be
  the same on every worker whenever a branch communicates (a counter, or a
  flag that was itself reduced over the axis), else workers deadlock.
  """
  t = jax.eval_shape(true_fn, *operands)
  f = jax.eval_shape(false_fn, *operands)
  if jax.tree.structure(t) != jax.tree.structure(f):
    raise ValueError(
        f"cond: the branches return different structures: {jax.tree.structure(t)} and "
        f"{jax.tree.structure(f)}.")
  axes = jax.tree.map(lambda a, b: tuple(sorted(varying_axes(a) | varying_axes(b))), t, f)

  def joined(fn):
    def branch(*ops):
      return jax.tree.map(lambda x, ax: vary(x, ax), fn(*ops), axes)
    return branch

  return jax.lax.cond(pred, joined(true_fn), joined(false_fn), *operands)


def axis_size(axis_name: Optional[str]) -> int:
  """Number of workers on ``axis_name`` (1 when it is None)."""
  if axis_name is None:
    return 1
  return int(jax.lax.psum(1, axis_name))


def axis_index(axis_name: Optional[str]):
  if axis_name is None:
    return jnp.int32(0)
  return jax.lax.axis_index(axis_name)


def psum(tree: Any, axis_name: Optional[str]) -> Any:
  """All-reduce sum of every leaf (identity locally)."""
  if axis_name is None:
    return tree
  _record("all-reduce", tree, axis_name)
  return jax.lax.psum(tree, axis_name)


def scatters_in_order() -> bool:
  """Whether a scatter-add applies its updates in order, so that adding every worker's
  sparse payload in one scatter equals adding them worker after worker, bit for bit:
  XLA:CPU's does; a GPU's runs its updates in parallel, in no fixed order."""
  return jax.default_backend() == "cpu"


def crosses_processes() -> bool:
  """Whether this program's collectives run between processes on CPUs (through gloo), where
  :func:`after` must order them (see there)."""
  return jax.process_count() > 1 and jax.devices()[0].platform == "cpu"


def after(tree: Any, *deps: Any) -> Any:
  """``tree`` unchanged, but computed only once every leaf of ``deps`` exists.

  Where a collective's input waits for an earlier collective's output, the runtime runs
  them one after the other. Otherwise XLA:CPU orders two collectives of one program only
  by when they start, and gloo, which carries them between processes, tells two
  all-reduces apart only by their order on each link: an all-reduce that does not depend
  on the one before it can run beside it and take its messages (gloo aborts the job with
  "Received data size doesn't match expected size" when the sizes differ, and would mix
  their values when they agree). Every float leaf of ``tree`` is made to read ``deps``:
  ``x - 0.0``, bit for bit ``x`` (``-0.0`` and NaN included), with the zero computed from
  the first element of each dependency (``isnan(d) * 0.0``, which the compiler cannot
  fold), fused into the leaf's producer or consumer; an integer leaf (a packed payload's
  words) is ``x + 0`` with that zero converted to its type. Only where collectives cross
  processes on CPUs (:func:`crosses_processes`); elsewhere ``tree`` is returned as is. A
  leaf whose varying axes do not include the dependencies' keeps no dependency (its type
  must not change).

  Differentiated, the order holds in the backward pass too, reversed: the dependencies'
  cotangents (zeros added to them) are computed after the leaf's, so the collectives that
  produced ``deps`` have their backward collectives run after those of what reads ``tree``
  (for a leaf whose varying axes are the dependencies'). E.g. a weight gathered outside a
  ``lax.scan`` whose body gathers too: ``h = after(h, w)`` before the scan orders the
  gather of ``w`` before the loop, and its gradient's reduce-scatter after the loop's.
  """
  leaves = [jnp.ravel(d)[0] for d in jax.tree.leaves(deps)
            if hasattr(d, "dtype") and d.size]
  if not leaves or not crosses_processes():
    return tree
  first = sum(d.astype(jnp.float32) for d in leaves)
  over = set(varying_axes(first))

  def wait(x):
    if not hasattr(x, "dtype") or not over <= set(varying_axes(x)):
      return x
    if jnp.issubdtype(x.dtype, jnp.integer):
      # Words of a packed payload: ``x + 0``, the zero converted from the float one.
      return x + _zero_of(first).astype(x.dtype)
    if not jnp.issubdtype(x.dtype, jnp.floating):
      return x
    if over == set(varying_axes(x)):
      return _after_both_ways(x, first)
    return x - _zero_of(first).astype(x.dtype)

  return jax.tree.map(wait, tree)


def _zero_of(d):
  """``0.0`` (float32) that the compiler computes from ``d``: ``isnan(d) * 0.0``."""
  return jnp.isnan(d).astype(jnp.float32) * 0.0


@jax.custom_vjp
def _after_both_ways(x, d):
  """``x - 0.0`` computed after ``d`` (a float32 scalar); in the backward pass ``d``'s
  cotangent, a zero, is computed after ``x``'s, so what computes ``d`` runs backward after
  what reads ``x`` (the reverse order, as consistent)."""
  return x - _zero_of(d).astype(x.dtype)


def _after_fwd(x, d):
  return _after_both_ways(x, d), None


def _after_bwd(_, ct):
  return ct, _zero_of(jnp.ravel(ct)[0].astype(jnp.float32))


_after_both_ways.defvjp(_after_fwd, _after_bwd)


def pmax(tree: Any, axis_name) -> Any:
  """All-reduce maximum of every leaf (identity locally)."""
  if axis_name is None or axis_name == ():
    return tree
  _record("all-reduce", tree, axis_name)
  return jax.lax.pmax(tree, axis_name)


def model_axes(axes):
  """Code traced inside treats ``axes`` as model axes: a value varying over them is one
  device's shard of a leaf (see :func:`shard_axes`); entered by
  :func:`commopt.comm.model_sharding`."""
  return stating(model_axes=frozenset(axes))


def shard_axes(x, axis_name) -> tuple[str, ...]:
  """The model axes ``x`` varies over (besides ``axis_name``'s), in sorted order.

  Inside a ``shard_map`` manual over the data and model axes, with the model
  axes declared (:func:`model_axes`, entered by the shard-local step of
  :func:`~commopt.data_parallel` and by :func:`commopt.comm.model_sharding`),
  these are the axes a leaf's shard is cut on: a quantity of the whole leaf
  (a norm, a count, a maximum) is the partial one summed (or maxed) over
  them (:func:`leaf_sum`). Empty where no model axis is declared (a value
  varying over a data axis its transform was not told of is per worker, not
  a shard), under ``jax.vmap``, locally, and for leaves replicated over the
  model axes.
  """
  model = _TRACED.get().model_axes
  if not model:
    return ()
  skip = set() if axis_name is None else set(
      axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,))
  return tuple(sorted((varying_axes(x) & model) - skip))


def leaf_sum(value: Any, like, axis_name) -> Any:
  """``value``, a sum over this device's shard of ``like``, summed over ``like``'s
  :func:`shard_axes`: the sum over the whole leaf (the same on all its shards)."""
  axes = shard_axes(like, axis_name)
  return psum(value, axes) if axes else value


def leaf_max(value: Any, like, axis_name) -> Any:
  """:func:`leaf_sum` for a maximum."""
  axes = shard_axes(like, axis_name)
  return pmax(value, axes) if axes else value


def shard_index(like, axis_name):
  """This device's linear index over ``like``'s :func:`shard_axes` (0 when it has none):
  which shard of the leaf it holds, the same on every worker of ``axis_name``."""
  axes = shard_axes(like, axis_name)
  return jax.lax.axis_index(axes) if axes else jnp.int32(0)


# -- how parameters are sharded over the model axes ---------------------------------------
# Inside a shard_map manual over every mesh axis, a value's type says which axes it varies
# over (shard_axes), which is all an elementwise or norm-based method needs. A method that
# reshapes a leaf (PowerSGD's matrix view) also needs which dimension each model axis cuts:
# the leaf's PartitionSpec. model_sharding states the parameters' specs for the code
# traced inside it (the shard-local step of data_parallel enters it; so may a user's own
# shard_map), and specs_for finds each leaf's spec.

class _Sharding(NamedTuple):
  specs: Any            # a pytree like the parameters, of PartitionSpecs
  treedef: Any
  flat: tuple           # the specs, flattened
  by_local: dict        # (local shape, shard axes) -> spec, where only one spec has them


def _is_spec(x) -> bool:
  return isinstance(x, P)


def local_shape(shape, spec, sizes: dict) -> tuple[int, ...]:
  """The shape of one device's block of a ``shape`` array sharded by ``spec``."""
  entries = list(spec) + [None] * (len(shape) - len(spec))
  return tuple(n // math.prod(sizes[a] for a in spec_axes((e,))) for n, e in zip(shape, entries))


@contextlib.contextmanager
def model_sharding(specs, shapes, mesh, axes=None):
  """States the parameters' shardings over the model axes for the code traced inside.

  :func:`~commopt.data_parallel`'s shard-local step enters it around ``tx``;
  enter it yourself inside your own ``shard_map`` manual over the data and
  model axes, around ``tx.init`` and ``tx.update``. It declares the axes the
  specs name as model axes, so that a value varying over them is read as a
  shard of a leaf: whole-leaf quantities (LAMB's norms, the agreed
  non-finite skip, ``min_size``, ``top_k(shard_threshold="leaf")``) and
  independent random draws per shard follow, and PowerSGD's exact protocol
  reads the leaves' dimensions. Without it each shard is compressed as a
  leaf of its own.

  Args:
    specs: a pytree like the parameters of their ``PartitionSpec``\\ s over the
      model axes (no data axis).
    shapes: a pytree like the parameters of their global shapes (tuples), or
      of global arrays / ``ShapeDtypeStruct``\\ s.
    mesh: the ``jax.sharding.Mesh`` (or a dict of axis name -> size).
    axes: the model axes (default: those the specs name). Name every non-data
      axis of the mesh to have the model ranks split the dense all-reduce of
      leaves replicated over them (each byte crosses the data axis once).

  Examples:
    >>> import jax, commopt
    >>> from jax.sharding import PartitionSpec as P
    >>> with commopt.comm.model_sharding({"w": P(None, "model")}, {"w": (4, 8)},
    ...                                  {"data": 2, "model": 4}):
    ...   pass
  """
  sizes = dict(mesh) if isinstance(mesh, dict) else dict(mesh.shape)
  flat, treedef = jax.tree_util.tree_flatten(specs, is_leaf=_is_spec)
  shape_leaves = jax.tree_util.tree_leaves(
      shapes, is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x))
  seen: dict = {}
  for spec, shape in zip(flat, shape_leaves):
    shape = tuple(shape) if isinstance(shape, tuple) else tuple(shape.shape)
    key = (local_shape(shape, spec, sizes), tuple(sorted(spec_axes(spec))))
    seen.setdefault(key, set()).add(spec)
  by_local = {k: next(iter(v)) for k, v in seen.items() if len(v) == 1}
  with stating(sharding=_Sharding(specs, treedef, tuple(flat), by_local),
                    model_axes=frozenset(a for spec in flat for a in spec_axes(spec))
               | frozenset(axes or ())):
    yield


def specs_for(updates, axis_name) -> list[Optional[P]]:
  """The spec of each leaf of ``updates`` (flattened keeping placeholders, as
  :func:`commopt._src.tree.flatten` does): ``P()`` for a leaf sharded over no
  model axis, the parameter's spec where known, None where the leaf is sharded
  over model axes whose dimensions are unknown (no :func:`model_sharding`, or
  a tree the parameters' structure does not match and a shape several
  parameters share)."""
  leaves = [x for _, x in tree_lib.flatten(updates)[0]]
  ctx = traced().sharding
  if ctx is not None and jax.tree_util.tree_structure(
      updates, is_leaf=tree_lib.is_node) == ctx.treedef:
    return [P() if tree_lib.is_node(x) or not shard_axes(x, axis_name) else s
            for x, s in zip(leaves, ctx.flat)]
  out = []
  for x in leaves:
    axes = () if tree_lib.is_node(x) else shard_axes(x, axis_name)
    if not axes:
      out.append(P())
    elif ctx is None:
      out.append(None)
    else:
      out.append(ctx.by_local.get((tuple(x.shape), axes)))
  return out


def model_axes_of(tree, axis_name) -> tuple:
  """The model axes any leaf of ``tree`` is sharded over (:func:`shard_axes`), sorted."""
  return tuple(sorted({a for x in jax.tree.leaves(tree) for a in shard_axes(x, axis_name)}))


def axes_of(axis_name) -> tuple:
  """``axis_name`` as a tuple of axis names; ``()`` for None (one local worker)."""
  return () if axis_name is None else base.axis_names(axis_name)


def per_worker(x, axis_name) -> bool:
  """Whether ``x`` is typed varying over an axis of ``axis_name`` (differs between workers)."""
  return bool(set(varying_axes(x)) & set(axes_of(axis_name)))


def agreed_finite(tree, axis_name) -> jax.Array:
  """Whether every worker's ``tree`` is finite: one int32 all-reduce over ``axis_name`` and
  the model axes any leaf is sharded over (so every shard of every worker agrees)."""
  local_bad = jnp.logical_not(finite.all_finite(tree)).astype(jnp.int32)
  axes = axes_of(axis_name) + model_axes_of(tree, axis_name)
  return (psum(local_bad, axes) if axes else local_bad) == 0


def reduced_finite(tree, axis_name) -> jax.Array:
  """Whether the reduced ``tree`` is finite, judged alike on every device: leaves the same
  everywhere (varying over no mesh axis) by themselves; leaves sharded over model axes
  (and the same on every worker) by one int32 all-reduce over those axes. Leaves that
  differ between the workers of ``axis_name`` are not read: no worker's own values decide.
  Where no varying types exist (``jax.vmap``, ``check_vma=False``) every leaf is read."""
  leaves = jax.tree.leaves(tree)
  ok = finite.all_finite([x for x in leaves if not varying_axes(x)])
  sharded = [x for x in leaves if not per_worker(x, axis_name) and shard_axes(x, axis_name)]
  if sharded:
    bad = jnp.logical_not(finite.all_finite(sharded)).astype(jnp.int32)
    ok = ok & (psum(bad, model_axes_of(sharded, axis_name)) == 0)
  return ok


def mean_factors(n: int) -> tuple[float, float]:
  """``(pre, post)`` for a mean over ``n`` workers that cannot overflow: ``psum(x · pre) / post``.

  ``pre = 2^-k`` with ``2^k`` the least power of two ``>= n``, and
  ``post = n · pre`` in ``(1/2, 1]``. Every partial sum of ``x · pre`` is at
  most ``n · pre ≤ 1`` times the largest ``|x|``, so a sum that runs in the
  values' own dtype (a 16-bit all-reduce on a GPU) or is rounded back to it
  (XLA:CPU widens it to float32) stays finite whenever the values are, and
  the mean is finite whenever it is representable. Both factors are exact,
  so the collective's result is bit for bit ``psum(x) / n`` wherever that is
  finite and ``x · pre`` is normal; the compiler may fuse the scaling into
  the computation of ``x`` and round that differently (a training run then
  differs from the unscaled one in its last bits). The wire carries ``x``'s
  dtype, at its size.
  """
  k = max(int(n) - 1, 0).bit_length()
  return 2.0 ** -k, n / 2.0 ** k


def _is_float(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _prescaled(x) -> bool:
  """Whether :func:`pmean` sums ``x`` pre-scaled: floats narrower than 32 bits, whose sum
  of a few workers' ordinary values overflows (float16 past 65504). Wider floats are
  summed as they are: their sum overflows only past about ``3.4e38 / n`` (where the
  agreed skip drops the step), and the scaling would cost a pass over every leaf."""
  return _is_float(x) and jnp.dtype(jnp.result_type(x)).itemsize < 4


def pmean(x: Any, axis_name: Optional[str]) -> Any:
  """All-reduce mean of every leaf in its own dtype (identity locally): one all-reduce
  for the whole pytree.

  Floating-point leaves narrower than 32 bits are summed pre-scaled
  (:func:`mean_factors`), so a mean of finite values that is representable comes out
  finite in 16 bits too, with nothing widened on the wire. Float32 and wider leaves are
  summed as they are and divided after, as ``lax.pmean`` does (bit for bit its result):
  their sum overflows only past about ``3.4e38 / n``, where the agreed non-finite skip
  drops the step, and pre-scaling them would cost a pass over every leaf before the
  all-reduce (``benchmarks/bench_base.py`` times the identity step, whose dense mean this
  is, against a hand-written ``lax.pmean`` step).
  """
  if axis_name is None:
    return x
  _record("all-reduce", x, axis_name)
  n = axis_size(axis_name)
  pre, post = mean_factors(n)

  def scale(v, factor):
    return v if n == 1 else v * jnp.asarray(factor, jnp.result_type(v))

  def finish(total, v):
    if not _prescaled(v) or n == 1:
      return (total / n).astype(v.dtype) if n > 1 else total
    return (total / jnp.asarray(post, jnp.result_type(v))).astype(v.dtype)

  sent = jax.tree.map(lambda v: scale(v, pre) if _prescaled(v) else v, x)
  totals = jax.lax.psum(sent, axis_name)
  return jax.tree.map(finish, totals, x)


_BITS = {1: jnp.uint8, 2: jnp.uint16}


def as_bits(move, x):
  """``move(x)`` for a collective that moves values without arithmetic (a gather, an
  all-to-all), a float narrower than 32 bits moved as unsigned integers of its width, bit
  for bit: XLA:CPU widens bfloat16 gathers to float32 and 8-bit float ones to float16
  when it compiles (twice the bytes); integers it moves as they are. Differentiated, the
  tangent moves as ``move`` moves floats."""
  if not (jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize in _BITS):
    return move(x)
  return _moved_as_bits(move, x)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _moved_as_bits(move, x):
  bits = move(jax.lax.bitcast_convert_type(x, _BITS[x.dtype.itemsize]))
  return jax.lax.bitcast_convert_type(bits, x.dtype)


@_moved_as_bits.defjvp
def _moved_as_bits_jvp(move, primals, tangents):
  return _moved_as_bits(move, primals[0]), move(tangents[0])


def all_to_all(x: jax.Array, axis_name: Optional[str]) -> jax.Array:
  """Row ``j`` of ``x`` (``[N, ...]``) goes to worker ``j``; row ``w`` of the result came from worker ``w``.

  Locally (``axis_name=None``) ``x`` must have one row and is returned as it is.
  """
  if axis_name is None:
    return x
  _record("all-to-all", x, axis_name)
  return as_bits(lambda v: jax.lax.all_to_all(v, axis_name, 0, 0, tiled=False), x)


def psum_scatter(x: jax.Array, axis_name: Optional[str]) -> jax.Array:
  """Sum over the axis of ``x`` (``[N·c]``), worker ``j`` keeping coordinates ``j·c`` to ``(j+1)·c``.

  Locally it is ``x`` itself.
  """
  if axis_name is None:
    return x
  _record("reduce-scatter", x, axis_name)
  return jax.lax.psum_scatter(x, axis_name, scatter_dimension=0, tiled=True)


def all_gather(tree: Any, axis_name) -> Any:
  """Stacks every worker's leaves on a new leading axis.

  Locally the leading axis has size 1. Under ``shard_map`` the result is typed
  invariant when the input varies over the axis, so a value computed from it
  may be returned replicated. Over a tuple of axes (every device of a 2-D
  mesh) the leaves are gathered one axis at a time, the last first, and the
  leading axes merged: worker ``i`` of the result is the one whose
  ``jax.lax.axis_index(axis_name)`` is ``i``, and the result is invariant over
  all of them (one gather over the tuple would leave it varying).

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from commopt.comm import all_gather
    >>> x = jnp.arange(6.0).reshape(2, 3)
    >>> g = jax.vmap(jax.vmap(lambda v: all_gather(v, ("a", "b")), axis_name="b"),
    ...              axis_name="a")(x)
    >>> g[1, 2].tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
  """
  if axis_name is None:
    return jax.tree.map(lambda x: x[None], tree)
  if isinstance(axis_name, (tuple, list)):
    for name in reversed(axis_name):
      tree = all_gather(tree, name)
    k = len(axis_name)
    return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[k:]), tree)

  def gather(x):
    _record("all-gather", x, axis_name)
    if axis_name in varying_axes(x):
      return as_bits(lambda v: _all_gather_invariant(v, axis_name), x)
    return as_bits(lambda v: jax.lax.all_gather(v, axis_name), x)

  return jax.tree.map(gather, tree)


def all_gather_varying(x: jax.Array, axis_name) -> jax.Array:
  """Every worker's ``x`` stacked on a new leading axis, typed varying (as ``x``).

  What a ZeRO-3 weight gather needs: the gathered weights feed each worker's
  own loss, so their cotangent differs between workers and is reduce-scattered
  by the gather's own backward pass; an invariant result would make autodiff
  all-reduce it densely first. Locally the leading axis has size 1.
  """
  if axis_name is None:
    return x[None]
  _record("all-gather", x, axis_name)
  return as_bits(lambda v: jax.lax.all_gather(v, axis_name), x)


def all_gather_tiled(x, axis_name, axis: int):
  """Concatenates every worker's ``x`` along ``axis``; typed invariant when ``x`` varies.

  Over a tuple of axes (``()``: none) the blocks come in the order of
  ``jax.lax.axis_index`` over the tuple: gathered one axis at a time, the last first.
  """
  if isinstance(axis_name, (tuple, list)):
    for name in reversed(axis_name):
      x = all_gather_tiled(x, name, axis)
    return x
  if axis_name is None:
    return x
  _record("all-gather", x, axis_name)
  if axis_name in varying_axes(x):
    return as_bits(lambda v: _all_gather_invariant(v, axis_name, axis=axis, tiled=True), x)
  return as_bits(lambda v: jax.lax.all_gather(v, axis_name, axis=axis, tiled=True), x)
