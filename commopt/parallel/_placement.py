"""Placing the step's values on the mesh, and checking what the user placed: :class:`Placer`.

A ``DataParallel`` holds one :class:`Placer`, which holds the mesh and the data
axes it places over and its cache of argument signatures already checked:

- Specs: a parameter's or model-state leaf's sharding over the non-data axes
  (:meth:`Placer.spec_of`), refused over the data axes.
- Placing: :meth:`Placer.put` (arrays already placed pass through), the batch split
  over the data axes (:meth:`Placer.put_batch`, :func:`check_batch`), per-worker
  parameters with ``local_params`` (:meth:`Placer.stack_params`, :meth:`Placer.unstacked`).
- The step's arguments outside tracing (:meth:`Placer.placed`) and an optimizer state
  checked against the layout (:meth:`Placer.checked_layout`).
- A saved state or saved parameters resized to this run's workers (:meth:`Placer.resized`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from commopt._src import vma
from commopt._src.vma import spec_axes
from commopt.transforms import _layout as lay
from commopt.parallel import _resize
from commopt.transforms._layout import Layout, explicit, keystr

_SIGNATURES_KEPT = 64
"""Argument signatures :meth:`Placer.placed` remembers per step (then it starts again)."""


class Placer:
  """Places a ``DataParallel`` step's values on its mesh and checks what the user placed.

  It reads the step's options (mesh, data axes, ``local_params``, the number of
  workers) and its layout (``dp.layout``), and keeps the plans of the argument
  signatures :meth:`placed` has checked (its own cache).

  Args:
    dp: the :class:`~commopt.DataParallel` whose values it places.
  """

  def __init__(self, dp):
    self.dp = dp
    self.mesh = dp.mesh
    self.axes = dp.axes
    self._signatures: dict = {}

  # -- specs -----------------------------------------------------------------------------

  def spec_of(self, x, what: str, path) -> P:
    """The user's sharding of a parameter or model-state leaf over the non-data axes."""
    mesh = self.mesh
    sharding = getattr(x, "sharding", None)
    placed_named = isinstance(sharding, NamedSharding) and not vma.is_tracer(x)
    if placed_named and sharding.mesh is mesh:
      # Placed on this mesh already (every step after the first): its spec is the layout.
      spec = lay.full_spec(sharding.spec, len(x.shape))
      if explicit(mesh) or all(e is None for e in spec):
        self._check_no_data_axes(what, path, spec)
        return spec
    spec = leaf_spec(x)
    if placed_named:
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
    self._check_no_data_axes(what, path, spec)
    return spec

  def _check_no_data_axes(self, what: str, path, spec: P) -> None:
    """A ValueError if ``spec`` shards a parameter or model-state leaf over the data axes."""
    clash = sorted(set(spec_axes(spec)) & set(self.axes))
    if clash:
      raise ValueError(
          f"data_parallel: {what} {keystr(path)} is sharded over the data axis {clash} (spec "
          f"{spec}); data parallelism keeps parameters whole on every worker of the data "
          "axes. Shard them over other mesh axes only (tensor parallelism), e.g. "
          "P(None, 'model').")

  def specs_of(self, tree, what: str):
    """:meth:`spec_of` of every leaf of ``tree``."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return jax.tree_util.tree_unflatten(treedef, [self.spec_of(x, what, p) for p, x in leaves])

  def param_specs(self, layout: Layout):
    """How the step's parameters are placed: the layout's, stacked with ``local_params``."""
    if not self.dp.local_params:
      return layout.param_specs
    return jax.tree.map(lambda s: lay.stacked_spec(s, self.axes), layout.param_specs,
                        is_leaf=lay.is_spec)

  # -- placing -----------------------------------------------------------------------------

  def put(self, tree, specs, *, copy: bool = True, record: list | None = None,
          concrete: bool = False):
    """``tree`` placed by ``specs``; arrays already placed so pass through untouched.

    ``copy``: an array that has to move is copied first, never aliased (see
    :func:`put_leaf`); False for what the step does not donate (the batch, extra
    arguments), which ``device_put`` may then alias. ``record``: a list that gets
    each leaf's target ``NamedSharding``, in leaf order (:meth:`placed`'s plan).
    ``concrete``: no leaf is a tracer (:meth:`placed` checked them all).
    """
    mesh = self.mesh

    def put_one(x, spec):
      target = NamedSharding(mesh, spec)
      if record is not None:
        record.append(target)
      return put_leaf(x, target, copy, concrete)

    # ``tree`` holds values, ``specs`` a spec where ``tree`` has a leaf.
    return jax.tree.map(put_one, tree, specs)

  def put_replicated(self, tree, **kwargs):
    """``tree`` (extra arguments for ``tx.update``) replicated over the whole mesh (options
    as :meth:`put`'s)."""
    return self.put(tree, jax.tree.map(lambda _: P(), tree), **kwargs)

  def put_model_state(self, model_state, **kwargs):
    """Model state (batch statistics, RNG state) replicated over the data axes, each leaf
    keeping its sharding over the model axes (options as :meth:`put`'s)."""
    return self.put(model_state, self.specs_of(model_state, "model state leaf"), **kwargs)

  def put_batch(self, batch, **kwargs):
    """Every batch leaf sharded on its leading axis over the data axes (shapes unchecked;
    options as :meth:`put`'s).

    Not copied: the step does not donate the batch, so a leaf that only changes
    its sharding on the same devices (one device's array on a one-device mesh)
    is aliased, not copied, every step.
    """
    data = P(lay.data_spec(self.axes))
    return self.put(batch, jax.tree.map(lambda x: lay.full_spec(data, jnp.ndim(x)), batch),
                    copy=False, **kwargs)

  # -- per-worker parameters (local_params=True) ------------------------------------------

  def stack_params(self, params):
    """With ``local_params``: one copy of ``params`` per worker, stacked ``[num_workers, ...]``."""
    if not self.dp.local_params:
      return params
    n = self.dp.num_workers
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + tuple(jnp.shape(x))), params)

  def unstacked(self, params):
    """With ``local_params``: per-worker parameters checked and seen as one worker's shapes."""
    if not self.dp.local_params:
      return params
    n, mesh = self.dp.num_workers, self.mesh
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
      if not jnp.shape(x) or jnp.shape(x)[0] != n:
        raise ValueError(
            f"data_parallel: with local_params=True the parameters are per worker, stacked "
            f"[{n}, ...]; parameter {keystr(path)} has shape {tuple(jnp.shape(x))}. Pass "
            "dp.place_params(params) to the first step.")
    def one(x):
      # One worker's shape, keeping the sharding over the other axes.
      sharding = None if vma.is_tracer(x) else getattr(x, "sharding", None)
      if isinstance(sharding, NamedSharding) and sharding.mesh.shape_tuple == mesh.shape_tuple:
        spec = lay.full_spec(sharding.spec, len(jnp.shape(x)))
      else:
        spec = leaf_spec(x)
      sharding = NamedSharding(mesh, P(*spec[1:])) if any(spec[1:]) else None
      return jax.ShapeDtypeStruct(tuple(jnp.shape(x))[1:], x.dtype, sharding=sharding)

    return jax.tree.map(one, params)

  # -- the step's arguments -----------------------------------------------------------------

  def checked_layout(self, params, opt_state) -> Layout:
    """The layout of the step's ``params``, with ``opt_state`` checked against it."""
    dp = self.dp
    layout = dp.layout(self.unstacked(params))
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

  def placed(self, params, opt_state, batch, model_state, key, extra_args=None):
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
    if any(map(vma.is_tracer, before)):
      return args
    treedefs = tuple(t for _, t in flat)
    signature = _signature(treedefs, before)
    plan = None if signature is None else self._signatures.get(signature)
    if plan is not None:
      return self._replay(plan, args, treedefs, before)
    records = [[] for _ in range(6)]   # one list per argument, in the order of `args`
    layout = self.checked_layout(params, opt_state)
    params = self.put(params, self.param_specs(layout), record=records[0], concrete=True)
    opt_state = self.put(opt_state, layout.state_specs, record=records[1], concrete=True)
    if model_state is not None:
      model_state = self.put_model_state(model_state, record=records[3], concrete=True)
    if key is not None:
      key_sharding = NamedSharding(self.mesh, P())
      key = jax.device_put(key, key_sharding)
      records[4] = [functools.partial(jax.device_put, device=key_sharding)] * len(
          jax.tree.leaves(key))
    extra_args = self.put_replicated(extra_args, copy=False, record=records[5], concrete=True)
    try:
      # Not checked here, per call: the step checks the batch's shapes when it is traced.
      batch_placed = self.put_batch(batch, record=records[2], concrete=True)
    except (TypeError, ValueError):
      self.dp._check_batch(batch)   # a placement that fails on shapes, with the shapes named
      raise
    args = (params, opt_state, batch_placed, model_state, key, extra_args)
    after = jax.tree.leaves(args)
    moved = [i for i, (x, y) in enumerate(zip(before, after)) if y is not x]
    _wait(self.mesh, args, [after[i] for i in moved])
    if signature is not None:
      self._remember(signature, before, records, moved, [len(leaves) for leaves, _ in flat])
    return args

  def _replay(self, plan, args, treedefs, before):
    """:meth:`placed` by the plan :meth:`_remember` kept for the arguments' signature."""
    put_indices, put_targets, placers, rebuilt = plan
    if not rebuilt:
      _wait(self.mesh, args, ())
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
    _wait(self.mesh, args, [after[i] for i in put_indices + tuple(i for i, _ in placers)])
    return args

  def _remember(self, signature, before, records, moved, sizes) -> None:
    """Keeps :meth:`placed`'s plan for ``signature``: how each leaf it moved is placed again.

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
        placers.append((i, functools.partial(put_leaf, target=r, copy=copy, concrete=True)))
      elif _same_device(x.sharding, r):
        placers.append((i, functools.partial(_rewrap, target=r)))
      else:
        indices.append(i)
        targets.append(r)
    bounds = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
    rebuilt = tuple((k, lo, hi) for k, (lo, hi) in enumerate(zip(bounds, bounds[1:]))
                    if any(lo <= i < hi for i in moved))
    if len(self._signatures) >= _SIGNATURES_KEPT:
      self._signatures.clear()
    self._signatures[signature] = (tuple(indices), tuple(targets), tuple(placers), rebuilt)

  # -- resizing -----------------------------------------------------------------------------

  def resized(self, saved, target, per_worker, name: str, saved_layouts=None):
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
    mesh = self.mesh

    def layout(x):
      sharding = getattr(x, "sharding", None)
      if not (isinstance(x, jax.Array) and isinstance(sharding, NamedSharding)):
        return None
      spec, sizes = _resize.layout_of(x)
      if sharding.mesh == mesh and not any(spec):
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
                            data_sizes=tuple(mesh.shape[a] for a in self.axes),
                            fn=f"data_parallel.{name}", layouts=saved_layouts)
    flat, treedef = jax.tree_util.tree_flatten(target)
    placed_leaves = [jax.make_array_from_callback(t.shape, t.sharding, lambda idx, v=v: v[idx])
                     for t, v in zip(flat, leaves)]
    return jax.tree_util.tree_unflatten(treedef, placed_leaves)


def leaf_spec(x) -> P:
  """The partition spec ``x``'s type carries over the mesh's explicit axes (P() if none)."""
  sharding = getattr(jax.typeof(x), "sharding", None) if not isinstance(
      x, jax.ShapeDtypeStruct) else x.sharding
  spec = getattr(sharding, "spec", None)
  return lay.full_spec(() if spec is None else spec, len(x.shape))


def put_leaf(x, target: NamedSharding, copy: bool = True, concrete: bool = False):
  """One leaf of :meth:`Placer.put`: ``x`` placed with ``target``, passed through if it
  already is (``concrete``: ``x`` is known not to be a tracer)."""
  if isinstance(x, jax.Array) and (concrete or not isinstance(x, vma.Tracer)):
    if x.sharding == target:
      return x
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      # device_put refuses typed keys on a mesh that spans processes: place
      # their data (a trailing key axis, replicated) and wrap it again.
      data = put_leaf(jax.random.key_data(x), NamedSharding(
          target.mesh, P(*lay.full_spec(target.spec, x.ndim), None)), copy, True)
      return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    # A copy, never an alias: the step donates what it is given, and the
    # caller's own arrays (e.g. one device's parameters) must survive that.
    # (device_put(..., may_alias=False) still aliases onto a mesh in JAX 0.10.)
    if copy and x.is_fully_addressable:
      x = jnp.copy(x)
  return jax.device_put(x, target)


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


def placed_on_trace(fn, shardings_of):
  """``jax.jit(fn)`` whose ``trace`` gives its outputs the shardings ``shardings_of(*args)``
  (``NamedSharding``\\ s on the concrete mesh), and so does ``jax.eval_shape`` of it.

  ``jax.eval_shape(f, params)`` gives the shardings of ``f``'s outputs on the mesh's
  *abstract* mesh (no devices), which orbax cannot restore onto, unless ``f`` is a jitted
  function: then it is ``f.trace(params).out_info``, with ``f``'s ``out_shardings``. An
  optimizer state's shardings depend on the parameters, which no one ``out_shardings``
  fixes, so ``trace`` (and ``lower`` and ``eval_shape``, through it) traces ``fn`` under a
  ``jax.jit`` with the arguments' own ``out_shardings``. A call runs ``fn`` jitted; ``fn``
  places its outputs itself, by the same shardings.

  Args:
    fn: the function (an ``init``); traceable, with array (or pytree) arguments.
    shardings_of: ``shardings_of(*args, **kwargs)``: a pytree prefix of ``fn``'s output of
      ``NamedSharding``\\ s, from the arguments' shapes and shardings alone.
  """
  jitted = jax.jit(fn)

  def trace(*args, **kwargs):
    return jax.jit(fn, out_shardings=shardings_of(*args, **kwargs)).trace(*args, **kwargs)

  jitted.trace = trace
  jitted.lower = lambda *args, **kwargs: trace(*args, **kwargs).lower()
  jitted.eval_shape = lambda *args, **kwargs: trace(*args, **kwargs).out_info
  return jitted


def local_workers(mesh, workers: int) -> int:
  """The workers of ``workers`` (all of ``mesh``'s data-axis devices) that this process
  hosts, at least one: what a ``local_batch``'s rows must divide into (:func:`check_batch`)."""
  return max(1, len(mesh.local_devices) * workers // mesh.size)


def on_cpu(mesh) -> bool:
  """Whether ``mesh`` spans several CPU devices (see :meth:`Placer.placed`)."""
  return mesh.devices.size > 1 and mesh.devices.flat[0].platform == "cpu"


def _same_device(sharding, target) -> bool:
  """Whether ``sharding`` and ``target`` both put the whole array on one and the same device."""
  return (len(target.device_set) == 1 and sharding.device_set == target.device_set
          and sharding.memory_kind == target.memory_kind)


def _rewrap(x, target):
  """``jax.device_put(x, target)`` where both put the whole of ``x`` on one same device:
  the same buffer, with ``target``'s sharding (committed)."""
  return jax.make_array_from_single_device_arrays(x.shape, target, [x])


def _wait(mesh, args, moved) -> None:
  """:meth:`Placer.placed`'s wait: on a multi-device CPU mesh for every argument, on a one-device
  CPU mesh for the arguments that were moved, elsewhere for none."""
  if on_cpu(mesh):
    jax.block_until_ready(args)
  elif moved and mesh.devices.flat[0].platform == "cpu":
    jax.block_until_ready(moved)


def _signature(treedef, leaves):
  """What :meth:`Placer.placed`'s checks depend on: the tree (here the arguments' trees), each
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


def layouts_of(shardings) -> dict:
  """``path_key -> (spec, axis sizes)`` of a pytree of ``NamedSharding``\\ s (or of arrays or
  ``ShapeDtypeStruct``\\ s placed with one): the ``saved_layouts`` of :meth:`Placer.resized`."""
  flat = jax.tree_util.tree_flatten_with_path(
      shardings, is_leaf=lambda x: isinstance(x, NamedSharding))[0]
  return {_resize.path_key(p): _resize.layout_of(s) for p, s in flat}
