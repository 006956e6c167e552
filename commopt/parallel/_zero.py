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
replicated answer. The padding stays zero (its gradient is zero).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from commopt._src import base
from commopt.comm import _collectives as coll
from commopt.comm import _zero as zero_comm


@jax.tree_util.register_pytree_node_class
class ShardedLeaf:
  """One parameter sharded over the data axis: ``rows`` ``[N, c]``, and its ``shape`` and
  ``dtype`` (static)."""

  def __init__(self, rows, shape, dtype):
    self.rows = rows
    self.shape = tuple(shape)
    self.dtype = np.dtype(dtype)

  def tree_flatten(self):
    return (self.rows,), (self.shape, self.dtype.name)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], aux[0], aux[1])

  def __repr__(self) -> str:
    rows = getattr(self.rows, "shape", self.rows)
    return f"ShardedLeaf(shape={self.shape}, dtype={self.dtype.name}, rows={rows})"


def _is_sharded(x) -> bool:
  return isinstance(x, ShardedLeaf)


@dataclasses.dataclass(frozen=True, eq=False)
class ZeroDataParallel:
  """The sharded (ZeRO-3) step for ``loss_fn`` and ``tx`` over ``axis_name`` of ``mesh``.

  Use :meth:`shard` on the parameters, :meth:`init` for the optimizer state, :meth:`step`
  to train, :meth:`unshard` to get the whole parameters back (evaluation, export).
  """
  loss_fn: Callable[[Any, Any], jax.Array]
  tx: optax.GradientTransformation
  mesh: jax.sharding.Mesh
  axis_name: str = "data"
  weights: Optional[base.Compressor] = None
  grads: Optional[base.Compressor] = None
  donate: bool = True

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
    if self.axis_name not in self.mesh.axis_names:
      raise ValueError(f"{fn}: `axis_name`={self.axis_name!r} is not an axis of the mesh; "
                       f"its axes are {tuple(self.mesh.axis_names)}.")
    zero_comm.check_compressor(self.weights, "weights", fn)
    zero_comm.check_compressor(self.grads, "grads", fn)
    object.__setattr__(self, "_keyed", tuple(
        f"`{what}`={c.name}" for what, c in (("weights", self.weights), ("grads", self.grads))
        if zero_comm.needs_key(c)))
    object.__setattr__(self, "donate", base.check_bool("donate", self.donate, fn=fn))
    object.__setattr__(self, "_jitted", jax.jit(self.step_fn,
                                                donate_argnums=(0, 1) if self.donate else ()))

  # -- layout ------------------------------------------------------------------------

  @property
  def workers(self) -> int:
    """Devices on the data axis (the ``N`` of every leaf's ``[N, c]`` rows)."""
    return self.mesh.shape[self.axis_name]

  def _rows_sharding(self) -> NamedSharding:
    return NamedSharding(self.mesh, P(self.axis_name))

  def shard(self, params):
    """``params`` as a tree of :class:`ShardedLeaf`, each ``[N, c]`` sharded over the axis.

    Every process must pass the same values (the owners' rows are cut from them)."""
    def one(x):
      value = np.asarray(jax.device_get(x))
      if not np.issubdtype(value.dtype, np.floating):
        raise ValueError(f"zero_data_parallel.shard: every parameter must be floating point, "
                         f"got a {value.dtype} leaf of shape {value.shape}.")
      rows = np.asarray(zero_comm.shard_flat(jnp.asarray(value), self.workers))
      return ShardedLeaf(jax.device_put(rows, self._rows_sharding()), value.shape, value.dtype)
    return jax.tree.map(one, params)

  def unshard(self, sharded):
    """The whole parameters (replicated over the mesh) from a tree of :class:`ShardedLeaf`."""
    replicated = NamedSharding(self.mesh, P())

    def one(leaf):
      rows = jax.device_put(leaf.rows, replicated)
      return jax.jit(lambda r: zero_comm.unshard_flat(r, leaf.shape, leaf.dtype),
                     out_shardings=replicated)(rows)
    with jax.set_mesh(self.mesh):
      return jax.tree.map(one, sharded, is_leaf=_is_sharded)

  def init(self, sharded):
    """The optimizer state of the sharded parameters, sharded as they are."""
    self._check_sharded(sharded, "init")
    with jax.set_mesh(self.mesh):   # around the call, never inside traced code
      return jax.jit(self.tx.init)(sharded)

  def _check_sharded(self, sharded, fn: str) -> None:
    leaves = jax.tree.leaves(sharded, is_leaf=_is_sharded)
    bad = [type(x).__name__ for x in leaves if not _is_sharded(x)]
    if bad:
      raise ValueError(f"zero_data_parallel.{fn}: the parameters must come from "
                       f".shard(params) (trees of ShardedLeaf), got leaves of type {bad[0]}.")

  # -- the step ----------------------------------------------------------------------

  def _local_grads(self, sharded, batch, key):
    """Inside the map: ``(gradient rows [1, c] per leaf, this worker's loss [1])``."""
    worker_key = None if key is None else jax.random.fold_in(
        key, coll.axis_index(self.axis_name))

    def loss_of(tree):
      leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_sharded)
      full = [zero_comm.gather(
          leaf.rows[0], leaf.shape, self.axis_name, weights=self.weights, grads=self.grads,
          key=None if worker_key is None else jax.random.fold_in(worker_key, i))
          for i, leaf in enumerate(leaves)]
      return self.loss_fn(jax.tree.unflatten(treedef, full), batch)

    loss, grads = jax.value_and_grad(loss_of)(sharded)
    return grads, jnp.reshape(loss, (1,))

  def step_fn(self, sharded, opt_state, batch, key=None):
    """The pure step: ``(sharded params, opt_state, per-worker losses [N])`` after one update.

    ``batch`` leaves are split over the data axis on their leading dimension; ``key`` (a
    PRNG key, replicated) is needed only by compressors that draw random bits."""
    rows = P(self.axis_name)
    local = jax.shard_map(
        self._local_grads, mesh=self.mesh,
        in_specs=(jax.tree.map(lambda _: rows, sharded),
                  jax.tree.map(lambda _: rows, batch), P()),
        out_specs=(jax.tree.map(lambda _: rows, sharded), rows))
    grads, losses = local(sharded, batch, key)
    updates, opt_state = self.tx.update(grads, opt_state, sharded)
    return optax.apply_updates(sharded, updates), opt_state, losses

  def lower(self, sharded, opt_state, batch, key=None):
    """The jitted step lowered for these arguments (for :func:`commopt.wire.hlo_collectives`
    and ``.compile().memory_analysis()``)."""
    batch = jax.device_put(batch, self._rows_sharding())
    with jax.set_mesh(self.mesh):
      return self._jitted.lower(sharded, opt_state, batch, key)

  def step(self, sharded, opt_state, batch, key=None):
    """One jitted step (see :meth:`step_fn`); the batch is placed over the data axis."""
    self._check_sharded(sharded, "step")
    if key is None and self._keyed:
      raise ValueError(
          f"zero_data_parallel.step: {' and '.join(self._keyed)} draws random bits: pass "
          "key=jax.random.key(seed + step), a new key every step (the same on every "
          "process), or use rounding='nearest'.")
    batch = jax.device_put(batch, self._rows_sharding())
    with jax.set_mesh(self.mesh):
      return self._jitted(sharded, opt_state, batch, key)


def zero_data_parallel(loss_fn, tx, mesh, *, axis_name: str = "data",
                       weights: Optional[base.Compressor] = None,
                       grads: Optional[base.Compressor] = None,
                       donate: bool = True) -> ZeroDataParallel:
  """Fully sharded data parallelism (ZeRO-3) with commopt's own gathers and scatters.

  Parameters and optimizer state are sharded over ``axis_name``: each device keeps
  ``1/N`` of every leaf (flat, zero-padded). A step gathers every leaf whole for the
  loss, and the gather's backward pass returns each owner the mean gradient of its
  part; the optimizer updates the parts. With ``weights`` the gather moves each owner's
  part encoded (ZeRO++'s qwZ: ``commopt.int_quant(bits=8, rounding="nearest")``), with
  ``grads`` the gradient goes as encoded chunks in one all-to-all and is summed in
  float32 by its owner (qgZ: ``int_quant(bits=4, ...)``). The master weights stay full
  precision on their owner. Neither keeps an error memory (a worker-side residual
  would cost a full gradient per device, which sharding exists to avoid): use
  deterministic or unbiased block quantizers.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``, on one worker's part of the batch.
    tx: any optax transform; it runs on the sharded rows under ``jit``, whole-tree
      quantities (global norms) computed across the devices by the compiler.
    mesh: the device mesh.
    axis_name: the data axis parameters are sharded over and the batch split over.
    weights: None (dense all-gather) or a stateless compressor for the weight gather.
    grads: None (dense reduce-scatter) or a stateless compressor for the gradients.
    donate: donate the parameters and optimizer state to the step.

  Returns:
    A :class:`ZeroDataParallel`: ``shard``, ``init``, ``step``, ``step_fn``, ``unshard``.

  Raises:
    ValueError: an argument is not what is described above (named with its value).

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
                          grads=grads, donate=donate)
