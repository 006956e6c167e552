"""ZeRO-3 data parallelism: parameters and optimizer state sharded over the data axis,
gathered and reduce-scattered by commopt's own collectives, weights and gradients
optionally compressed (qwZ, qgZ).

Each parameter is kept as a :class:`ShardedLeaf`: its flat coordinates, zero-padded to
``N·c``, as ``[N, c]`` rows sharded over the data axis (device ``j`` holds row ``j``).
The step runs the loss inside ``jax.shard_map``: every leaf is gathered whole
(:func:`commopt.comm._zero.gather`: an all-gather, dense or of packed payloads) and its
gradient comes back to its owner by the gather's backward pass (a reduce-scatter, or an
all-to-all of packed payloads summed in float32 by the owner). The optimizer then
updates the ``[N, c]`` rows outside the map, under ``jit``: elementwise transforms touch
only each device's row, and a transform that needs a whole-tree quantity
(``clip_by_global_norm``) gets it from the compiler, so any optax chain gives the
replicated answer. The padding stays zero (the gather gives it no gradient).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, ClassVar, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from commopt._src import base, feedback
from commopt.comm import _collectives as coll
from commopt.comm import _zero as zero_comm
from commopt.parallel import _zero_leaves as zr
from commopt.parallel import _zero_tp as zt
from commopt.parallel._placement import check_batch, local_workers, placed_on_trace
from commopt.parallel._steps import LossContract
from commopt.parallel._zero_leaves import ShardedLeaf, is_sharded as _is_sharded
from commopt.parallel._zero_leaves import is_state_leaf as _is_state_leaf


_NEVER = 2**31 - 1
"""``optax.apply_if_finite``'s ``max_consecutive_errors``: never apply a non-finite update."""

_EVERY_COORDINATE = ("lossless", "rounding", "unbiased")
"""Error kinds of a weight compressor whose gathered weights are the weights: exactly, to a
rounding of each, or in expectation."""

_PROBE = 4096
"""The flat shard length :func:`_dropped_coordinates` reads a compressor's payload at."""


def _dropped_coordinates(compressor: base.Compressor) -> Optional[str]:
  """Why ``compressor`` drops coordinates (sends only some of a shard's), as declared: a
  sparse payload (values and their indices), indices in its payload, or fewer payload bits
  than coordinates; None if it sends every coordinate."""
  if compressor.sparse_values:
    return "its payload is the values it keeps and their indices"
  bits = compressor.payload_bits((_PROBE,), jnp.float32)
  if bits < _PROBE:
    return (f"its payload has {bits} bits for a shard of {_PROBE} coordinates, fewer than "
            "one per coordinate")
  like = jax.ShapeDtypeStruct((_PROBE,), jnp.float32)
  payload = jax.eval_shape(
      lambda x: compressor.encode(x, compressor.init(like), jax.random.key(0))[0], like)
  if isinstance(payload, dict) and "indices" in payload:
    return "its payload carries the indices of the values it keeps"
  return None


def _check_weight_compressor(compressor: Optional[base.Compressor], fn: str) -> None:
  """A ValueError if ``compressor``, the weight gather's, is biased and drops coordinates:
  the forward pass would run on sparsified weights, not the model being trained."""
  if compressor is None or compressor.error_kind in _EVERY_COORDINATE:
    return
  why = _dropped_coordinates(compressor)
  if why is not None:
    raise ValueError(
        f"{fn}: `weights`={compressor.name} is a biased compressor "
        f"(error_kind={compressor.error_kind!r}) that drops coordinates ({why}): every "
        "forward pass would run on sparsified weights, most of them zero, and not on the "
        "model being trained. The weight gather must carry every coordinate: use a "
        "quantizer, e.g. commopt.int_quant(bits=8, rounding='nearest') (ZeRO++'s qwZ) or "
        "commopt.cast('bfloat16'), or weights=None (dense). Sparsifiers belong to `grads` "
        "(with error_feedback=True).")


@dataclasses.dataclass(frozen=True, eq=False)
class ZeroDataParallel(LossContract):
  """The sharded (ZeRO-3) step for ``loss_fn`` and ``tx`` over ``axis_name`` of ``mesh``.

  Use :meth:`shard` on the parameters, :meth:`init` for the optimizer state, :meth:`step`
  to train, :meth:`unshard` to get the whole parameters back (evaluation, export).
  """
  loss_fn: Callable[[Any, Any], jax.Array]
  tx: optax.GradientTransformation
  mesh: jax.sharding.Mesh
  axis_name: Any = "data"
  weights: Optional[base.Compressor] = None
  grads: Optional[base.Compressor] = None
  donate: bool = True
  gather: str = "step"
  skip_nonfinite: bool = True
  has_aux: bool = False
  has_state: bool = False
  model_state_sync: str = "mean"
  hierarchical: bool = False
  hpz: bool = False
  error_feedback: Any = False
  residual_dtype: Any = None
  NAME: ClassVar[str] = "zero_data_parallel"
  _CALLER: ClassVar[str] = NAME    # the factory named in the loss contract's errors

  def __post_init__(self):
    fn = "zero_data_parallel"
    if not callable(self.loss_fn):
      raise ValueError(f"{fn}: `loss_fn` must be callable, got {type(self.loss_fn).__name__}.")
    if not isinstance(self.tx, optax.GradientTransformation):
      raise ValueError(f"{fn}: `tx` must be an optax.GradientTransformation, got "
                       f"{type(self.tx).__name__}.")
    if not isinstance(self.mesh, jax.sharding.Mesh):
      raise ValueError(f"{fn}: `mesh` must be a jax.sharding.Mesh, got "
                       f"{type(self.mesh).__name__}.")
    axes = (self.axis_name,) if isinstance(self.axis_name, str) else self.axis_name
    if (not isinstance(axes, (tuple, list)) or not axes
        or any(a not in self.mesh.axis_names for a in axes)):
      raise ValueError(f"{fn}: `axis_name`={self.axis_name!r} is not an axis of the mesh (or "
                       f"a tuple of its axes); its axes are {tuple(self.mesh.axis_names)}.")
    if not isinstance(self.axis_name, str):   # several axes: sharded over all their devices
      object.__setattr__(self, "axis_name", tuple(axes))
    base.check_choice("gather", self.gather, ("step", "manual"), fn)
    zero_comm.check_compressor(self.weights, "weights", fn)
    _check_weight_compressor(self.weights, fn)
    zero_comm.check_compressor(self.grads, "grads", fn)
    object.__setattr__(self, "_keyed", tuple(
        f"`{what}`={c.name}" for what, c in (("weights", self.weights), ("grads", self.grads))
        if zero_comm.needs_key(c)))
    object.__setattr__(self, "donate", base.check_bool("donate", self.donate, fn=fn))
    object.__setattr__(self, "has_aux", base.check_bool("has_aux", self.has_aux, fn=fn))
    object.__setattr__(self, "has_state", base.check_bool("has_state", self.has_state, fn=fn))
    base.check_choice("model_state_sync", self.model_state_sync, ("mean", "none"), fn)
    if base.check_bool("hierarchical", self.hierarchical, fn=fn) and (
        self.grads is None or isinstance(self.axis_name, str) or len(self.axis_name) != 2):
      raise ValueError(
          f"{fn}: hierarchical=True reduce-scatters the compressed gradient inside each node "
          "and then across nodes: it needs `grads` (a compressor) and axis_name=(slow, fast), "
          f"two mesh axes; got grads={getattr(self.grads, 'name', None)!r}, "
          f"axis_name={self.axis_name!r}.")
    if base.check_bool("hpz", self.hpz, fn=fn) and (
        self.gather != "manual" or isinstance(self.axis_name, str) or len(self.axis_name) != 2):
      raise ValueError(
          f"{fn}: hpz=True keeps a secondary copy of the weights inside each node for the "
          "backward pass's gathers, which only a rematerialised layer-by-layer loss makes: it "
          "needs gather='manual' and axis_name=(slow, fast), two mesh axes; got "
          f"gather={self.gather!r}, axis_name={self.axis_name!r}.")
    self._configure_feedback(fn)
    skip = base.check_bool("skip_nonfinite", self.skip_nonfinite, fn=fn)
    # Outside the map, on the sharded rows: the finiteness of every device's rows is one
    # decision of the whole program (the compiler reduces it), so all devices skip together.
    object.__setattr__(self, "_tx", optax.apply_if_finite(self.tx, _NEVER) if skip else self.tx)
    donated = (0, 1, 3) if self.has_state else (0, 1)
    object.__setattr__(self, "_jitted", jax.jit(self.step_fn,
                                                donate_argnums=donated if self.donate else ()))

  def _configure_feedback(self, fn: str) -> None:
    """``_feedback``: whether workers keep error memories; ``grads`` as error feedback runs
    it (an unbiased compressor scaled to a contraction, as in ``compressed_mean``)."""
    ef = feedback.check_error_feedback(self.error_feedback, fn)
    keep = False
    if ef is not False:
      if self.grads is None:
        raise ValueError(f"{fn}: error_feedback={ef!r} keeps the error of the compressed "
                         "gradient: it needs `grads` (a compressor); got grads=None.")
      compressor, keep = feedback.feedback_compressor(self.grads, ef, fn)
      if keep and (self.hierarchical or self.hpz):
        raise ValueError(
            f"{fn}: error_feedback={ef!r} keeps a worker-side memory of the flat compressed "
            "reduce-scatter; it does not run with hierarchical=True or hpz=True (two encoded "
            "stages). Use one of them, or a deterministic quantizer without a memory.")
      object.__setattr__(self, "grads", compressor)
    if self.residual_dtype is not None and (not keep or not base.is_float_dtype(
        self.residual_dtype)):
      raise ValueError(
          f"{fn}: `residual_dtype`={self.residual_dtype!r} is the dtype of the workers' error "
          "memories: it must be a floating-point dtype (jnp.float32, jnp.bfloat16), with "
          f"error_feedback resolved to a memory (here it is {keep}).")
    object.__setattr__(self, "_feedback", keep)
    object.__setattr__(self, "_residual_dtype", np.dtype(self.residual_dtype or np.float32))

  # -- layout ------------------------------------------------------------------------

  @property
  def workers(self) -> int:
    """Devices on the data axis or axes (the ``N`` of every leaf's ``[N, c]`` rows)."""
    return int(np.prod([self.mesh.shape[a] for a in self._data_axes]))

  @property
  def _data_axes(self) -> tuple:
    return (self.axis_name,) if isinstance(self.axis_name, str) else tuple(self.axis_name)

  def _spec(self, leaf) -> P:
    return zr.rows_spec(leaf, self.axis_name)

  def _shard_value(self, value: np.ndarray, stacked: bool, tp=None) -> ShardedLeaf:
    """One host value as a :class:`ShardedLeaf` on the mesh (by layer when ``stacked``; its
    blocks over the model axes by ``tp``, one layer's spec)."""
    if stacked:
      rows = np.stack([zt.cut(v, tp, self.mesh, self.workers) for v in value])
      leaf = ShardedLeaf(None, value.shape[1:], value.dtype, value.shape[0], tp)
    else:
      rows = zt.cut(value, tp, self.mesh, self.workers)
      leaf = ShardedLeaf(None, value.shape, value.dtype, None, tp)
    leaf.rows = jax.device_put(rows, NamedSharding(self.mesh, self._spec(leaf)))
    return leaf

  def shard(self, params, stacked=None, specs=None):
    """``params`` as a tree of :class:`ShardedLeaf`, each ``[N, c]`` sharded over the axis.

    Args:
      params: the whole parameters. Every process must pass the same values (the
        owners' rows are cut from them).
      stacked: a prefix of ``params``' tree of booleans (e.g. ``{"layers": True}``):
        the leaves under True have a leading layer axis ``L`` and are sharded layer by
        layer, as ``[L, N, c]``, so that a ``lax.scan`` over the layers can gather
        one layer at a time (``gather="manual"``).
      specs: on a mesh with model axes beside the data axes (tensor parallel), a prefix
        of ``params``' tree of ``PartitionSpec`` over the model axes (e.g.
        ``{"w1": P(None, "model")}``, a stacked leaf's with None for its layer axis; None:
        replicated over them). When None, each placed ``jax.Array`` leaf's own sharding
        gives it. Each model rank's block is then sharded over the data axes by itself:
        every device gathers and reduce-scatters its own block, and the loss sees the
        leaf sharded by its spec (see the guide's tensor-parallel section).
    """
    stacked = False if stacked is None else stacked

    def one(flag, tp, x):
      if specs is None:
        tp = zt.spec_of(x, self.mesh, self._data_axes)
      value = np.asarray(jax.device_get(x))
      if not np.issubdtype(value.dtype, np.floating):
        raise ValueError(f"zero_data_parallel.shard: every parameter must be floating point, "
                         f"got a {value.dtype} leaf of shape {value.shape}.")
      if not isinstance(flag, bool):
        raise ValueError(f"zero_data_parallel.shard: `stacked` must hold True or False, "
                         f"got {flag!r}.")
      if flag and value.ndim == 0:
        raise ValueError("zero_data_parallel.shard: a leaf under stacked=True needs a "
                         "leading layer axis, got a scalar.")
      where = f"a {value.dtype} leaf of shape {value.shape}"
      tp = zt.check(tp, value.shape, self.mesh, self._data_axes, where)
      if tp is not None and flag:
        if tp[0] is not None:
          raise ValueError(f"zero_data_parallel.shard: the spec {tp} of {where} under "
                           "stacked=True shards its layer axis; it must start with None.")
        tp = zt.check(P(*tp[1:]), value.shape[1:], self.mesh, self._data_axes, where)
      return self._shard_value(value, flag, tp)

    treedef = jax.tree.structure(params)

    def broadcast(prefix, name, what, **kw):
      try:
        return treedef.flatten_up_to(jax.tree.broadcast(prefix, params, **kw))
      except ValueError as e:
        raise ValueError(f"zero_data_parallel.shard: `{name}` must be a prefix of the "
                         f"parameters' tree of {what}, got {prefix!r}: {e}") from e

    flags = broadcast(stacked, "stacked", "True/False")
    tps = broadcast(specs, "specs", "PartitionSpec/None",
                    is_leaf=lambda x: x is None or isinstance(x, P))
    return treedef.unflatten([one(f, tp, x) for f, tp, x in
                              zip(flags, tps, treedef.flatten_up_to(params))])

  def unshard(self, tree):
    """Every :class:`ShardedLeaf` of ``tree`` (the parameters, or the optimizer state, whose
    per-parameter leaves are sharded the same way) made whole and replicated over the mesh;
    other leaves as they are. For evaluation, export and checkpoints that a run on another
    number of devices restores (:meth:`reshard_state`)."""
    replicated = NamedSharding(self.mesh, P())

    def one(leaf):
      if zr.is_residual(leaf):
        return zr.whole(leaf, self.mesh, self.workers)
      if not _is_sharded(leaf):
        return leaf
      rows = jax.device_put(leaf.rows, replicated)
      whole = lambda r: zt.join(r, leaf.shape, leaf.tp, self.mesh, leaf.dtype)
      if leaf.layers is not None:
        whole = jax.vmap(whole)
      return jax.jit(whole, out_shardings=replicated)(rows)
    with jax.set_mesh(self.mesh):
      return jax.tree.map(one, tree, is_leaf=_is_state_leaf)

  def reshard_state(self, whole_state, sharded):
    """The optimizer state of ``sharded`` (this instance's parameters) from its whole form
    (:meth:`unshard` of a state, perhaps saved by a run on another number of devices):
    every per-parameter leaf sharded as the parameters are, the rest (step counts)
    replicated."""
    self._check_sharded(sharded, "reshard_state")
    return zr.restore_state(self._state_template(sharded), whole_state, self._shard_value,
                            self.mesh, self.axis_name, self.workers)

  def _state_template(self, sharded):
    """The optimizer state's structure: its per-parameter leaves as :class:`ShardedLeaf`\\ s
    (and the error memories as :class:`ResidualLeaf`\\ s) without rows, the rest as
    ``jax.ShapeDtypeStruct``\\ s."""
    template = jax.eval_shape(self._tx.init, sharded)
    if not self._feedback:
      return template
    return zr.ZeroFeedbackState(template, jax.tree.map(
        lambda leaf: zr.ResidualLeaf(None, leaf.shape, self._residual_dtype, leaf.layers,
                                     leaf.tp),
        sharded, is_leaf=_is_sharded))

  def state_shardings(self, sharded):
    """The optimizer state's ``NamedSharding``\\ s on the mesh, a pytree prefix of the state:
    each per-parameter leaf's rows (and error memory) sharded as the parameter's rows, the
    rest (step counts) replicated."""
    self._check_sharded(sharded, "state_shardings")
    return jax.tree.map(
        lambda x: NamedSharding(self.mesh, self._spec(x) if _is_state_leaf(x) else P()),
        self._state_template(sharded), is_leaf=_is_state_leaf)

  @functools.cached_property
  def init(self):
    """``init(sharded)``: the optimizer state of the sharded parameters, sharded as they
    are (:meth:`state_shardings`).

    Jitted, and pure: ``jax.eval_shape(zp.init, sharded)`` gives the state's shapes,
    dtypes and shardings on the mesh's devices, the restore target orbax takes::

        target = {"params": sharded, "opt_state": jax.eval_shape(zp.init, sharded)}
        restored = orbax.checkpoint.StandardCheckpointer().restore(path, target)
    """
    return placed_on_trace(self._init, self.state_shardings)

  def _init(self, sharded):
    """:attr:`init`'s work (traced): ``tx.init`` on the rows, and zero error memories, placed
    by :meth:`state_shardings`."""
    self._check_sharded(sharded, "init")
    state = self._tx.init(sharded)
    if self._feedback:
      state = zr.ZeroFeedbackState(state, jax.tree.map(
          lambda leaf: zr.zeros_like(leaf, self._residual_dtype, self.mesh, self.axis_name,
                                     self.workers), sharded, is_leaf=_is_sharded))
    return jax.device_put(state, self.state_shardings(sharded))

  def _check_sharded(self, sharded, fn: str) -> None:
    leaves = jax.tree.leaves(sharded, is_leaf=_is_sharded)
    bad = [type(x).__name__ for x in leaves if not _is_sharded(x)]
    if bad:
      raise ValueError(f"zero_data_parallel.{fn}: the parameters must come from "
                       f".shard(params) (trees of ShardedLeaf), got leaves of type {bad[0]}.")

  # -- the step ----------------------------------------------------------------------

  @property
  def checkpoint_policy(self):
    """The ``jax.checkpoint`` policy of a layer body under ``gather="manual"``: with
    ``hpz`` it saves each layer's secondary partition (``1/L`` of the layer's weights, ``L``
    devices per node), so the backward pass gathers inside the node only; otherwise None
    (save nothing: the backward gathers each layer again). Combine it with a policy of your
    own by ``jax.checkpoint_policies.save_from_both_policies``."""
    return zero_comm.HPZ_POLICY if self.hpz else None

  def remat(self, fn, **kwargs):
    """``jax.checkpoint(fn, policy=self.checkpoint_policy, **kwargs)``: wrap a scan body
    that gathers one layer, so that only one layer's weights are whole at a time."""
    return jax.checkpoint(fn, policy=self.checkpoint_policy, **kwargs)

  def _gather_fn(self, worker_key, used: list):
    """``gather(tree, key=None)``: every :class:`ShardedLeaf` of ``tree`` (this worker's
    rows, ``[1, c]``, or ``[L, 1, c]`` for a whole stack) made whole; other leaves kept.
    ``used`` collects ``(slot, memory)`` of the leaves gathered with an error memory."""
    def gather(tree, key=None):
      key = worker_key if key is None else key
      leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_sharded)
      out = []
      for i, leaf in enumerate(leaves):
        if not _is_sharded(leaf):
          out.append(leaf)
          continue
        k = None if key is None else jax.random.fold_in(key, i)
        memory = getattr(leaf, "residual", None)
        if memory is not None:
          if any(m is memory for _, m in used):
            raise ValueError(
                "zero_data_parallel: with error_feedback the loss must gather each parameter "
                f"once per step (its error memory is sent with its gradient); a {leaf.shape} "
                "parameter was gathered twice. Gather it once and reuse the result.")
          used.append((leaf.slot, memory))
        options = dict(weights=self.weights, grads=self.grads,
                       hierarchical=self.hierarchical, hpz=self.hpz)
        if leaf.tp is None:
          one = lambda rows, e, k, leaf=leaf, o=options: zero_comm.gather(
              rows[0], leaf.shape, self.axis_name, key=k, residual=e, **o)
        else:             # its own block over the model axes
          one = lambda rows, e, k, leaf=leaf, o=options: zt.gather(
              rows[0], leaf.shape, leaf.tp, self.mesh, self.axis_name, key=k, residual=e, **o)
        if leaf.rows.ndim == 3:      # a whole stack: each layer by itself
          keys = None if k is None else jax.random.split(k, leaf.rows.shape[0])
          out.append(jax.vmap(one)(leaf.rows, memory, keys))
        else:
          out.append(one(leaf.rows, memory, k))
      return jax.tree.unflatten(treedef, out)
    gather.remat = self.remat
    return gather

  def _local_grads(self, sharded, residuals, batch, model_state, key):
    """Inside the map: ``(gradient rows per leaf, this worker's loss [1], new error memories
    or None, new model state or None)``, the loss as ``(loss [1], aux)`` (each aux leaf
    with a leading axis of 1) with ``has_aux``; the model state averaged over the workers
    (``model_state_sync``)."""
    worker_key = None if key is None else jax.random.fold_in(
        key, coll.axis_index(self.axis_name))
    used = []
    gather = self._gather_fn(worker_key, used)

    def loss_of(tree):
      args = (model_state, batch) if self.has_state else (batch,)
      if self.gather == "manual":
        return self._checked_loss(tree, *args, gather)
      return self._checked_loss(gather(tree), *args)

    tree = sharded if residuals is None else zr.merge(sharded, residuals)
    out, grads = jax.value_and_grad(loss_of, has_aux=self.has_aux or self.has_state)(tree)
    memories = None
    if residuals is not None:
      grads, memories = zr.split(grads, residuals, {slot for slot, _ in used})
    loss, aux, new_ms = self._split_out(out)
    if self.has_state:   # after the gradients' collectives (their order across processes)
      new_ms = self._mean_model_state(coll.after(new_ms, grads), self._data_axes, self.workers)
    loss = jnp.reshape(loss, (1,))
    if self.has_aux:
      loss = (loss, jax.tree.map(lambda a: jnp.asarray(a)[None], aux))
    return grads, loss, memories, new_ms

  def step_fn(self, sharded, opt_state, batch, model_state=None, key=None):
    """The pure step: ``(sharded params, opt_state, per-worker losses [N])`` after one update
    (``(losses, aux)`` with ``has_aux``, every aux leaf with a leading worker axis), and
    ``(sharded params, opt_state, model_state, losses)`` with ``has_state``: the model state
    (replicated) as the workers' losses left it, averaged, and kept on a skipped step.

    ``batch`` leaves are split over the data axis on their leading dimension; ``key`` (a
    PRNG key, replicated) is needed only by compressors that draw random bits. It runs
    inside the caller's own ``jax.jit`` or ``lax.scan`` (the tests scan it over steps);
    on a mesh with explicit axes, call that function inside ``jax.set_mesh(mesh)``."""
    self._check_model_state(model_state)
    self._check_batch(batch)   # on static shapes: when the step is traced
    specs = jax.tree.map(self._spec, sharded, is_leaf=_is_sharded)
    residuals = None
    if self._feedback:
      opt_state, residuals = opt_state
    memory_specs = specs if self._feedback else P()
    local = self._data_manual(sharded, specs, memory_specs, batch)
    grads, losses, memories, new_ms = local(sharded, residuals, batch, model_state, key)
    # A non-finite model state (the same mean on every device) skips the step too.
    grads = self._poison_if_nonfinite(grads, new_ms)
    updates, opt_state = self._tx.update(grads, opt_state, sharded)
    new_ms = self._keep_on_skip(new_ms, model_state, opt_state)
    if self._feedback:
      if self.skip_nonfinite:    # a skipped step keeps its memories too
        memories = jax.tree.map(lambda new, old: jnp.where(opt_state.last_finite, new, old),
                                memories, residuals)
      opt_state = zr.ZeroFeedbackState(opt_state, memories)
    new_params = optax.apply_updates(sharded, updates)
    if not self.has_state:
      return new_params, opt_state, losses
    return new_params, opt_state, new_ms, losses

  def _data_manual(self, sharded, specs, memory_specs, batch):
    """:meth:`_local_grads` in a ``shard_map`` manual over the data axes (every axis of a
    data-only mesh). Model axes beside them are left to the compiler (the loss is the
    global-view tensor-parallel one), the explicit ones inside ``auto_axes`` (see
    :mod:`._zero_tp`)."""
    rows = P(self.axis_name)
    data_specs = jax.tree.map(lambda leaf: zr.spec(self.axis_name, leaf.layers), sharded,
                              is_leaf=_is_sharded)
    data_memory = data_specs if self._feedback else P()
    explicit = zt.explicit_model_axes(self.mesh, self._data_axes)
    local = jax.shard_map(   # (inside auto_axes, the mesh is the context's)
        self._local_grads, mesh=None if explicit else self.mesh,
        in_specs=(data_specs, data_memory, jax.tree.map(lambda _: rows, batch), P(), P()),
        out_specs=(data_specs, rows, data_memory, P()),  # rows: a prefix of losses and aux
        axis_names=set(self._data_axes))
    if not explicit:
      return local
    return jax.sharding.auto_axes(local, axes=explicit,
                                  out_sharding=(specs, rows, memory_specs, P()))

  def local_batch(self, batch):
    """The global batch from this process's rows of it (multi-process runs): one array
    per leaf, sharded over the data axis on its leading dimension, process ``p``'s rows
    on the devices it hosts (``jax.make_array_from_process_local_data``). Every process
    calls it with the same leaf shapes."""
    self._check_batch(batch, f"{self.NAME}.local_batch", local_workers(self.mesh, self.workers),
                      "this process hosts")

    def make(x):
      x = np.asarray(x)
      spec = P(self.axis_name, *([None] * (x.ndim - 1)))
      return jax.make_array_from_process_local_data(NamedSharding(self.mesh, spec), x)
    return jax.tree.map(make, batch)

  def _check_batch(self, batch, fn: Optional[str] = None, workers: Optional[int] = None,
                   where: Optional[str] = None) -> None:
    """``data_parallel``'s check (:func:`._placement.check_batch`): every leaf with the same
    leading size, at least one row, divisible by the workers (default: the data axes')."""
    if workers is None:
      workers, where = self.workers, f"on axis {self.axis_name!r}"
    check_batch(batch, fn or self.NAME, workers, where)

  def _place_batch(self, batch):
    """The batch split over the data axis on its leading dimension. Its shapes are checked
    when the step is traced (:meth:`step_fn`), or here when placing fails on them."""
    try:
      return jax.device_put(batch, NamedSharding(self.mesh, P(self.axis_name)))
    except (TypeError, ValueError):
      self._check_batch(batch)   # a placement that fails on shapes, with the shapes named
      raise

  def _place_model_state(self, model_state):
    self._check_model_state(model_state)
    if model_state is None:
      return None
    return jax.device_put(model_state, NamedSharding(self.mesh, P()))

  def lower(self, sharded, opt_state, batch, model_state=None, key=None):
    """The jitted step lowered for these arguments (for :func:`commopt.wire.hlo_collectives`
    and ``.compile().memory_analysis()``)."""
    batch = self._place_batch(batch)
    model_state = self._place_model_state(model_state)
    with jax.set_mesh(self.mesh):
      return self._jitted.lower(sharded, opt_state, batch, model_state, key)

  def step(self, sharded, opt_state, batch, model_state=None, key=None):
    """One jitted step (see :meth:`step_fn`); the batch is placed over the data axis (in a
    multi-process run pass :meth:`local_batch`'s global arrays) and the model state
    (``has_state``) replicated. With ``donate`` the model state is consumed too."""
    self._check_sharded(sharded, "step")
    model_state = self._place_model_state(model_state)
    if key is None and self._keyed:
      raise ValueError(
          f"zero_data_parallel.step: {' and '.join(self._keyed)} draws random bits: pass "
          "key=jax.random.key(seed + step), a new key every step (the same on every "
          "process), or use rounding='nearest'.")
    batch = self._place_batch(batch)
    with jax.set_mesh(self.mesh):
      return self._jitted(sharded, opt_state, batch, model_state, key)


def zero_data_parallel(loss_fn, tx, mesh, *, axis_name="data",
                       weights: Optional[base.Compressor] = None,
                       grads: Optional[base.Compressor] = None,
                       gather: str = "step", skip_nonfinite: bool = True,
                       has_aux: bool = False, has_state: bool = False,
                       model_state_sync: str = "mean", hierarchical: bool = False,
                       hpz: bool = False, error_feedback=False, residual_dtype=None,
                       donate: bool = True) -> ZeroDataParallel:
  """Fully sharded data parallelism (ZeRO-3) with commopt's own gathers and scatters.

  Parameters and optimizer state are sharded over ``axis_name`` (``1/N`` of every leaf
  per device). A step gathers each leaf whole for the loss, whose backward pass returns
  each owner the mean gradient of its part, and the optimizer updates the parts.
  ``weights`` encodes the gather (ZeRO++'s qwZ), ``grads`` the reduce-scatter (qgZ).

  See the guide's "ZeRO-3 with quantized collectives" page.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar`` on one worker's part of the batch;
      ``loss_fn(params, batch, gather)`` with ``gather="manual"``.
    tx: any optax transform; it runs on the sharded rows under ``jit``.
    mesh: the device mesh.
    axis_name: the data axis to shard over (or a tuple, e.g. ``("node", "local")``).
    weights: None (dense all-gather) or a stateless compressor for the weight gather.
    grads: None (dense reduce-scatter) or a stateless compressor for the gradients.
    gather: ``"step"`` (every leaf before ``loss_fn``) or ``"manual"`` (the loss gathers).
    skip_nonfinite: skip a non-finite step on every device together (every state kept).
    has_aux: ``loss_fn`` returns ``(loss, aux)``; the step returns ``(losses, aux)``.
    has_state: ``loss_fn(params, model_state, batch)`` returns ``(loss, new_model_state)``.
    model_state_sync: ``"mean"`` (average model state that differs between workers) or
      ``"none"`` (refuse it).
    hierarchical: with ``grads`` on ``(slow, fast)``, reduce-scatter in nodes, then across.
    hpz: with ``gather="manual"`` and ``axis_name=(slow, fast)``, a secondary partition
      of each layer inside the node, so backward gathers stay there (ZeRO++'s hpZ).
    error_feedback: False (default: none; use deterministic or unbiased quantizers),
      True or ``"auto"`` (as ``compressed_mean``): a worker-side memory per device.
    residual_dtype: the memories' dtype (float32 when None; ``jnp.bfloat16`` halves them).
    donate: donate the parameters and optimizer state to the step.

  Returns:
    A :class:`ZeroDataParallel`: ``shard``, ``init``, ``step``, ``step_fn``, ``unshard``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, commopt
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> loss = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
    >>> zp = commopt.zero_data_parallel(loss, optax.sgd(0.5), mesh,
    ...                                 weights=commopt.int_quant(bits=8, rounding="nearest"))
    >>> params = zp.shard({"w": jnp.zeros((3, 1))})
    >>> state = zp.init(params)
    >>> batch = {"x": jnp.eye(3), "y": jnp.ones((3, 1))}
    >>> for _ in range(30):
    ...   params, state, losses = zp.step(params, state, batch)
    >>> round(float(losses[0]), 4)
    0.0
    >>> zp.unshard(params)["w"].shape
    (3, 1)

  References:
    Rajbhandari et al., ZeRO: Memory Optimizations Toward Training Trillion
    Parameter Models, SC 2020.
    Wang et al., ZeRO++: Extremely Efficient Collective Communication for Giant
    Model Training, arXiv 2306.10209, 2023.
  """
  return ZeroDataParallel(loss_fn, tx, mesh, axis_name=axis_name, weights=weights,
                          grads=grads, donate=donate, gather=gather,
                          skip_nonfinite=skip_nonfinite, has_aux=has_aux,
                          has_state=has_state, model_state_sync=model_state_sync,
                          hierarchical=hierarchical, hpz=hpz,
                          error_feedback=error_feedback, residual_dtype=residual_dtype)
