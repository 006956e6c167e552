"""Placing the step's values on the mesh, and checking what the user placed.

- Specs: a parameter's or model-state leaf's sharding over the non-data axes
  (:func:`spec_of`), refused over the data axes.
- Placing: :func:`put` (arrays already placed pass through), the batch split
  over the data axes (:func:`put_batch`, :func:`check_batch`), per-worker
  parameters with ``local_params`` (:func:`stack_params`, :func:`unstacked`).
- The step's arguments outside tracing (:func:`placed`) and an optimizer state
  checked against the layout (:func:`checked_layout`).
- A saved state or saved parameters resized to this run's workers (:func:`resized`).

The functions that read the step's options take the
:class:`~commopt.DataParallel` as ``dp``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from commopt._src import compat
from commopt.parallel import _layout as lay
from commopt.parallel._layout import keystr

if TYPE_CHECKING:
  from commopt.parallel._layout_probe import Layout


def explicit(mesh) -> bool:
  """Whether every axis of ``mesh`` is explicit (shardings are part of the array types)."""
  return all(t == AxisType.Explicit for t in mesh.axis_types)


def spec_of(dp, x, what: str, path) -> P:
  """The user's sharding of a parameter or model-state leaf over the non-data axes."""
  mesh = dp.mesh
  sharding = getattr(x, "sharding", None)
  if (isinstance(sharding, NamedSharding) and sharding.mesh is mesh
      and not compat.is_tracer(x)):
    # Placed on this mesh already (every step after the first): its spec is the layout.
    spec = lay.full_spec(sharding.spec, len(x.shape))
    if explicit(mesh) or all(e is None for e in spec):
      lay.check_no_data_axes(what, path, spec, dp.axes)
      return spec
  spec = lay.leaf_spec(x)
  if not compat.is_tracer(x) and isinstance(sharding, NamedSharding):
    placed = lay.full_spec(sharding.spec, len(jnp.shape(x)))
    if any(e is not None for e in placed) and placed != spec:
      if sharding.mesh.shape_tuple != mesh.shape_tuple:
        raise ValueError(
            f"data_parallel: {what} {keystr(path)} is sharded ({placed}) on a mesh of shape "
            f"{dict(sharding.mesh.shape)}, not on the step's mesh {dict(mesh.shape)}; "
            "place it on the mesh given to data_parallel.")
      if not explicit(mesh):
        raise ValueError(
            f"data_parallel: {what} {keystr(path)} is placed with {placed} on a mesh whose "
            f"axes are not all explicit ({dict(zip(mesh.axis_names, mesh.axis_types))}). "
            "The optimizer state can only follow a tensor-parallel layout whose sharding "
            "is part of the array type: build the mesh with jax.make_mesh(shape, names) "
            "(explicit axes by default) and place the parameters on it.")
      spec = placed
  lay.check_no_data_axes(what, path, spec, dp.axes)
  return spec


def specs_of(dp, tree, what: str):
  """:func:`spec_of` of every leaf of ``tree``."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  return jax.tree_util.tree_unflatten(treedef, [spec_of(dp, x, what, p) for p, x in leaves])


def put(mesh, tree, specs, *, copy: bool = True, record: list | None = None):
  """``tree`` placed by ``specs``; arrays already placed so pass through untouched.

  ``copy``: an array that has to move is copied first, never aliased (see
  :func:`put_leaf`); False for what the step does not donate (the batch, extra
  arguments), which ``device_put`` may then alias. ``record``: a list that gets
  each leaf's target ``NamedSharding``, in leaf order (:func:`placed`'s plan).
  """
  def put_one(x, spec):
    target = NamedSharding(mesh, spec)
    if record is not None:
      record.append(target)
    return put_leaf(x, target, copy)

  return lay.map_specs(put_one, tree, specs)


def put_leaf(x, target: NamedSharding, copy: bool = True):
  """One leaf of :func:`put`: ``x`` placed with ``target``, passed through if it already is."""
  if isinstance(x, jax.Array) and not compat.is_tracer(x):
    if x.sharding == target:
      return x
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      # device_put refuses typed keys on a mesh that spans processes: place
      # their data (a trailing key axis, replicated) and wrap it again.
      data = put_leaf(jax.random.key_data(x), NamedSharding(
          target.mesh, P(*lay.full_spec(target.spec, x.ndim), None)), copy)
      return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    # A copy, never an alias: the step donates what it is given, and the
    # caller's own arrays (e.g. one device's parameters) must survive that.
    # (device_put(..., may_alias=False) still aliases onto a mesh in JAX 0.10.)
    if copy and x.is_fully_addressable:
      x = jnp.copy(x)
  return jax.device_put(x, target)


def put_replicated(mesh, tree, *, copy: bool = True, record: list | None = None):
  """``tree`` (extra arguments for ``tx.update``) replicated over the whole mesh."""
  return put(mesh, tree, jax.tree.map(lambda _: P(), tree), copy=copy, record=record)


def put_model_state(dp, model_state, *, record: list | None = None):
  """Model state (batch statistics, RNG state) replicated over the data axes, each leaf
  keeping its sharding over the model axes."""
  return put(dp.mesh, model_state, specs_of(dp, model_state, "model state leaf"),
             record=record)


def put_batch(dp, batch, *, record: list | None = None):
  """Every batch leaf sharded on its leading axis over the data axes (shapes unchecked).

  Not copied: the step does not donate the batch, so a leaf that only changes
  its sharding on the same devices (one device's array on a one-device mesh)
  is aliased, not copied, every step.
  """
  data = P(lay.data_spec(dp.axes))
  return put(dp.mesh, batch, jax.tree.map(lambda x: lay.full_spec(data, jnp.ndim(x)), batch),
             copy=False, record=record)


def check_batch(batch, fn: str, workers: int, where: str) -> None:
  """A ValueError naming the leaves and their shapes unless every batch leaf has a
  leading axis, all of the same non-zero size, divisible by ``workers``.

  Each worker takes the same contiguous rows of every leaf, so leaves of
  different lengths would pair row ``i`` of one with another row of the
  next; a batch of no rows has no loss (a mean over nothing is NaN). Python
  on static shapes: inside the step it runs when the step is traced (once
  per batch shape, under the user's ``jit`` or ``scan`` too), not per call.

  Args:
    batch: a pytree of arrays (or tracers, or ``ShapeDtypeStruct``\\ s).
    fn: the caller, for messages.
    workers: what the rows must divide into.
    where: those workers, for messages.
  """
  shapes = [(keystr(path), tuple(jnp.shape(x)))
            for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]]
  listed = ", ".join(f"{k}: {s}" for k, s in shapes)
  for k, s in shapes:
    if not s:
      raise ValueError(
          f"{fn}: batch leaf {k} has shape (), with no leading axis to split over the "
          f"{workers} workers {where}; give every batch leaf a leading (batch) axis "
          f"(batch: {listed}).")
  if len({s[0] for _, s in shapes}) > 1:
    raise ValueError(
        f"{fn}: batch leaves must share their leading size, so that each worker gets the "
        f"same rows of every leaf; got {listed}. Give every leaf the same number of rows.")
  if shapes and shapes[0][1][0] == 0:
    raise ValueError(
        f"{fn}: the batch is empty, with 0 rows ({listed}): a step on no data has no loss "
        f"(a mean over nothing is NaN). Skip the step, or give a multiple of the "
        f"{workers} workers' rows.")
  if shapes and shapes[0][1][0] % workers:
    k, s = shapes[0]
    raise ValueError(
        f"{fn}: batch leaf {k} has shape {s}; its leading axis must be divisible by the "
        f"{workers} workers {where}.")


# -- per-worker parameters (local_params=True) ----------------------------------------

def stack_params(dp, params):
  """With ``local_params``: one copy of ``params`` per worker, stacked ``[num_workers, ...]``."""
  if not dp.local_params:
    return params
  n = dp.num_workers
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + tuple(jnp.shape(x))), params)


def param_specs(dp, layout: Layout):
  """How the step's parameters are placed: the layout's, stacked with ``local_params``."""
  if not dp.local_params:
    return layout.param_specs
  return jax.tree.map(lambda s: lay.stacked_spec(s, dp.axes), layout.param_specs,
                      is_leaf=lay.is_spec)


def unstacked(dp, params):
  """With ``local_params``: per-worker parameters checked and seen as one worker's shapes."""
  if not dp.local_params:
    return params
  n = dp.num_workers
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    if not jnp.shape(x) or jnp.shape(x)[0] != n:
      raise ValueError(
          f"data_parallel: with local_params=True the parameters are per worker, stacked "
          f"[{n}, ...]; parameter {keystr(path)} has shape {tuple(jnp.shape(x))}. Pass "
          "dp.place_params(params) to the first step.")
  def one(x):
    # One worker's shape, keeping the sharding over the other axes.
    sharding = None if compat.is_tracer(x) else getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding) and sharding.mesh.shape_tuple == dp.mesh.shape_tuple:
      spec = lay.full_spec(sharding.spec, len(jnp.shape(x)))
    else:
      spec = lay.leaf_spec(x)
    sharding = NamedSharding(dp.mesh, P(*spec[1:])) if any(spec[1:]) else None
    return jax.ShapeDtypeStruct(tuple(jnp.shape(x))[1:], x.dtype, sharding=sharding)

  return jax.tree.map(one, params)


# -- the step's arguments ---------------------------------------------------------------

def checked_layout(dp, params, opt_state) -> Layout:
  """The layout of the step's ``params``, with ``opt_state`` checked against it."""
  layout = dp.layout(unstacked(dp, params))
  treedef = jax.tree.structure(opt_state)
  if treedef != layout.state_treedef:
    raise ValueError(
        "data_parallel: `opt_state` does not have the structure that `init` returns "
        f"({layout.state_treedef}); got {treedef}.")
  leaves = jax.tree_util.tree_flatten_with_path(opt_state)[0]
  for (path, x), stacked in zip(leaves, jax.tree.leaves(layout.per_worker)):
    if stacked and (not jnp.shape(x) or jnp.shape(x)[0] != dp.num_workers):
      raise ValueError(
          f"data_parallel: optimizer-state leaf {keystr(path)} is per-worker and must lead "
          f"with the {dp.num_workers} workers of axis {dp.axis_name!r}, but has shape "
          f"{tuple(jnp.shape(x))}: a state made for another number of workers cannot be "
          "used as it is (its error residuals would be dropped or duplicated).")
  return layout


def on_cpu(mesh) -> bool:
  """Whether ``mesh`` spans several CPU devices (see :func:`placed`)."""
  return mesh.devices.size > 1 and mesh.devices.flat[0].platform == "cpu"


def placed(dp, params, opt_state, batch, model_state, key, extra_args=None):
  """Outside tracing, the arguments placed as the step expects them.

  XLA:CPU can deadlock when a multi-device program is launched while the
  previous one is still running: in the native stacks of a stuck process,
  seven devices wait in the step's first all-reduce while the eighth
  device's launch waits for that device's in-flight-computation semaphore,
  until the rendezvous times out and aborts the process ("only 7 of 8
  arrived"). Seen in 6 of 20 runs of 300 small steps under CPU contention. So on CPU meshes the step waits until its inputs (the
  previous step's outputs, the batch as placed) are ready: 0 of 48 runs
  failed after. On a one-device CPU mesh only arguments that had to be
  moved are waited for; on other platforms (whose streams order a copy
  before the step that reads it) nothing is. Arrays already placed pass
  through untouched (donation still aliases them).

  The checks run once per argument signature (:func:`_signature`): a call
  whose arguments are typed and placed as in an earlier call whose checks
  passed skips them, and moves the leaves that call moved the same way
  (every step after the first: the previous step's outputs pass through, a
  batch given unplaced is placed again).
  """
  extra_args = {} if extra_args is None else extra_args
  args = (params, opt_state, batch, model_state, key, extra_args)
  # Each argument flattened by itself, so that a call that moves only the batch rebuilds
  # only the batch (unflattening parameters held in Python pytree nodes, such as flax
  # nnx Variables, costs more than placing the batch).
  flat = [jax.tree.flatten(a) for a in args]
  before = [x for leaves, _ in flat for x in leaves]
  if any(compat.is_tracer(x) for x in before):
    return args
  treedefs = tuple(t for _, t in flat)
  signature = _signature(treedefs, before)
  plan = None if signature is None else dp._placed_signatures.get(signature)
  if plan is not None:
    put_indices, put_targets, placers, rebuilt = plan
    if not rebuilt:
      _wait(dp.mesh, args, ())
      return args
    after = list(before)
    if put_indices:   # one device_put for the leaves moved as they are
      for i, y in zip(put_indices, jax.device_put([before[i] for i in put_indices],
                                                   list(put_targets))):
        after[i] = y
    for i, place_leaf in placers:
      after[i] = place_leaf(before[i])
    args = list(args)
    for k, lo, hi in rebuilt:
      args[k] = jax.tree.unflatten(treedefs[k], after[lo:hi])
    args = tuple(args)
    _wait(dp.mesh, args, [after[i] for i in put_indices + tuple(i for i, _ in placers)])
    return args
  records = [[] for _ in range(6)]   # one list per argument, in the order of `args`
  layout = checked_layout(dp, params, opt_state)
  params = put(dp.mesh, params, param_specs(dp, layout), record=records[0])
  opt_state = put(dp.mesh, opt_state, layout.state_specs, record=records[1])
  if model_state is not None:
    model_state = put_model_state(dp, model_state, record=records[3])
  if key is not None:
    key_sharding = NamedSharding(dp.mesh, P())
    key = jax.device_put(key, key_sharding)
    records[4] = [functools.partial(jax.device_put, device=key_sharding)] * len(
        jax.tree.leaves(key))
  extra_args = put_replicated(dp.mesh, extra_args, copy=False, record=records[5])
  try:
    # Not checked here, per call: the step checks the batch's shapes when it is traced.
    batch_placed = put_batch(dp, batch, record=records[2])
  except (TypeError, ValueError):
    dp._check_batch(batch)   # a placement that fails on shapes, with the shapes named
    raise
  args = (params, opt_state, batch_placed, model_state, key, extra_args)
  after = jax.tree.leaves(args)
  moved = [i for i, (x, y) in enumerate(zip(before, after)) if y is not x]
  _wait(dp.mesh, args, [after[i] for i in moved])
  if signature is not None:
    _remember(dp, signature, before, records, moved, [len(leaves) for leaves, _ in flat])
  return args


def _remember(dp, signature, before, records, moved, sizes) -> None:
  """Keeps :func:`placed`'s plan for ``signature``: how each leaf it moved is placed again.

  The plan is ``(indices, targets, placers, rebuilt)``: the leaves ``put_leaf`` moves with
  one ``device_put`` (not copied, not typed keys) and their targets, then
  ``(index, placer)`` for the others (copies of donated arguments, typed keys,
  and one device's arrays that only change their sharding's type on that
  device, e.g. a batch on a one-device mesh, which :func:`_rewrap` gives the
  target sharding in a fraction of a ``device_put``'s time, aliased as
  ``device_put`` would); ``rebuilt`` is ``(argument, first leaf, end)`` of the
  arguments holding a moved leaf, the only ones unflattened again.
  """
  flat = []   # (target or placer, copy) per leaf, in the order of `before`
  for k, record in enumerate(records):
    copy = k not in (2, 5)   # the batch and extra arguments are not donated
    flat += [(r, copy) for r in record]
  if len(flat) != len(before):
    return
  indices, targets, placers = [], [], []
  for i in moved:
    r, copy = flat[i]
    x = before[i]
    if callable(r):
      placers.append((i, r))
    elif type(x) is np.ndarray:   # copied to the devices by the one device_put
      indices.append(i)
      targets.append(r)
    elif (copy and x.is_fully_addressable) or jax.dtypes.issubdtype(x.dtype,
                                                                   jax.dtypes.prng_key):
      placers.append((i, functools.partial(put_leaf, target=r, copy=copy)))
    elif _same_device(x.sharding, r):
      placers.append((i, functools.partial(_rewrap, target=r)))
    else:
      indices.append(i)
      targets.append(r)
  bounds = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
  rebuilt = tuple((k, lo, hi) for k, (lo, hi) in enumerate(zip(bounds, bounds[1:]))
                  if any(lo <= i < hi for i in moved))
  if len(dp._placed_signatures) >= _SIGNATURES_KEPT:
    dp._placed_signatures.clear()
  dp._placed_signatures[signature] = (tuple(indices), tuple(targets), tuple(placers), rebuilt)


def _same_device(sharding, target) -> bool:
  """Whether ``sharding`` and ``target`` both put the whole array on one and the same device."""
  return (len(target.device_set) == 1 and sharding.device_set == target.device_set
          and sharding.memory_kind == target.memory_kind)


def _rewrap(x, target):
  """``jax.device_put(x, target)`` where both put the whole of ``x`` on one same device:
  the same buffer, with ``target``'s sharding (committed)."""
  return jax.make_array_from_single_device_arrays(x.shape, target, [x])


def _wait(mesh, args, moved) -> None:
  """:func:`placed`'s wait: on a multi-device CPU mesh for every argument, on a one-device
  CPU mesh for the arguments that were moved, elsewhere for none."""
  if on_cpu(mesh):
    jax.block_until_ready(args)
  elif moved and mesh.devices.flat[0].platform == "cpu":
    jax.block_until_ready(moved)


_SIGNATURES_KEPT = 64
"""Argument signatures :func:`placed` remembers per step (then it starts again)."""


def _signature(treedef, leaves):
  """What :func:`placed`'s checks depend on: the tree (here the arguments' trees), each
  leaf's type, shape, dtype and sharding (a host ``numpy`` array: its shape and dtype,
  since it is placed afresh at every call anyway); None if a leaf is neither (a Python
  scalar, say), and the call is then checked in full."""
  parts = []
  for x in leaves:
    if isinstance(x, jax.Array):
      parts.append((x.shape, x.dtype, x.sharding, x.committed))
    elif type(x) is np.ndarray:
      parts.append((np.ndarray, x.shape, x.dtype))
    else:
      return None
  return treedef, tuple(parts)


# -- resizing ---------------------------------------------------------------------------

def layouts_of(shardings) -> dict:
  """``path_key -> (spec, axis sizes)`` of a pytree of ``NamedSharding``\\ s (or of arrays or
  ``ShapeDtypeStruct``\\ s placed with one): the ``saved_layouts`` of :func:`resized`."""
  from commopt.parallel import _resize

  flat = jax.tree_util.tree_flatten_with_path(
      shardings, is_leaf=lambda x: isinstance(x, NamedSharding))[0]
  return {_resize.path_key(p): _resize.layout_of(s) for p, s in flat}


def resized(dp, saved, target, per_worker, name: str, saved_layouts=None):
  """``saved`` resized to ``target``'s shapes by :mod:`commopt.parallel._resize`, placed
  by ``target``'s shardings (``name`` is the caller, for messages).

  ``saved_layouts`` (``path_key -> (spec, axis sizes)``, None where unknown) is how
  each saved leaf was split over the mesh it was saved on: a restore reads it from
  orbax's metadata. Without it, a saved array's own ``NamedSharding`` tells (a state
  taken from a run on another mesh), except a leaf replicated on this step's mesh,
  which is what a state read whole ("as saved") looks like whatever its saved layout:
  unknown. Only two-phase server memories of model-sharded parameters depend on it,
  since they hold each device's block of the parameter, flattened
  (:func:`._resize._server`).
  """
  from jax.experimental import multihost_utils

  from commopt.parallel import _resize

  def layout(x):
    sharding = getattr(x, "sharding", None)
    if not (isinstance(x, jax.Array) and isinstance(sharding, NamedSharding)):
      return None
    spec, sizes = _resize.layout_of(x)
    if sharding.mesh == dp.mesh and not any(spec):
      return None
    return spec, sizes

  flat_saved = jax.tree_util.tree_flatten_with_path(saved)[0]
  if saved_layouts is None:
    saved_layouts = {_resize.path_key(p): layout(x) for p, x in flat_saved}

  def host(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      x = multihost_utils.process_allgather(x, tiled=True)
    if jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    return np.asarray(x)

  saved = {_resize.path_key(p): host(x) for p, x in flat_saved}
  leaves = _resize.resize(saved, target, per_worker,
                          data_sizes=tuple(dp.mesh.shape[a] for a in dp.axes),
                          fn=f"data_parallel.{name}", layouts=saved_layouts)
  flat, treedef = jax.tree_util.tree_flatten(target)
  placed_leaves = [jax.make_array_from_callback(t.shape, t.sharding, lambda idx, v=v: v[idx])
                   for t, v in zip(flat, leaves)]
  return jax.tree_util.tree_unflatten(treedef, placed_leaves)
