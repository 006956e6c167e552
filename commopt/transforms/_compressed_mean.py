"""compressed_mean: the mean of the workers' compressed updates, with error feedback."""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from commopt._src import base, feedback, finite, tree, vma
from commopt._src.tree import DEFAULT_MIN_SIZE, compresses  # noqa: F401  (re-exported)
from commopt.transforms import _global_view
from commopt.comm import _collectives as coll
from commopt.comm import _exchange, _plan, _strategies
from commopt.comm._channel import Channel


STRATEGIES = ("auto", "psum", "gather", "two_phase", "hierarchical")
INNER_STRATEGIES = ("auto", "psum", "gather", "two_phase")
"""The names ``compressed_mean`` takes; :mod:`commopt.comm._strategies` holds the objects."""


class CompressedMeanState(NamedTuple):
  """State of :func:`compressed_mean`.

  Attributes:
    count: number of updates so far (int32); the step key is
      ``fold_in(key, count)``.
    key: the base PRNG key (raw uint32[2]).
    residual: per-worker error-feedback memory, shaped like the updates (for
      ``strategy="hierarchical"``: only this local rank's shard, flat
      ``[⌈n/L⌉]`` for a leaf of ``n`` elements and ``L`` local ranks);
      ``optax.MaskedNode()`` for dense and ``None`` leaves, or everywhere when
      error feedback is off.
    compressor_state: per-leaf compressor state (e.g. PowerSGD's ``q``);
      ``optax.MaskedNode()`` for leaves that are not compressed.
    server_residual: the second error memory of ``strategy="two_phase"``
      (what re-encoding the averaged chunk missed): only this worker's own
      chunk, flat ``[⌈n/N⌉]`` for ``N`` workers (with hierarchical and
      ``inner_strategy="two_phase"``: its chunk of its shard,
      ``[⌈⌈n/L⌉/S⌉]`` for ``S`` nodes); ``optax.MaskedNode()`` for other
      strategies and without error feedback.

  Both memories are float32 for 16-bit float leaves (bf16, f16) unless
  ``residual_dtype`` says otherwise. The per-worker parts are allocated when ``init`` runs where
  the axis is bound (inside ``jax.shard_map`` or ``jax.vmap`` over it, as
  :func:`~commopt.data_parallel` and :mod:`commopt.testing` call it). Called
  outside, where the number of workers is unknown, ``init`` keeps each memory
  whole (``[n]``, or the update's shape) with every worker using only its own
  part; ``update`` accepts either layout, by the stored shape, and keeps it.
  """
  count: jax.Array
  key: jax.Array
  residual: Any
  compressor_state: Any
  server_residual: Any = None


def _check_leaf(path, leaf, what: str):
  if not tree.is_node(leaf):
    base.check_float_leaf("compressed_mean", path, leaf, verb="compressed", what=what)


def _server_memories(state: CompressedMeanState, treedef) -> list:
  """One server memory (or ``MaskedNode``) per leaf; states without the field have none."""
  if state.server_residual is None:
    return [optax.MaskedNode()] * treedef.num_leaves
  return treedef.flatten_up_to(state.server_residual)


FN = "compressed_mean"


class _Config(NamedTuple):
  """What :func:`compressed_mean` decided once, from its options (validated)."""
  compressor: base.Compressor
  axis_name: Any
  reduction: _strategies.Strategy
  error_feedback: bool
  server_memory: bool
  residual_dtype: Any
  min_size: int
  seed: int
  bucket_bytes: Any = "auto"
  residual_decay: float = 1.0

  def sends_dense(self) -> bool:
    """Whether the compressor's mean is the dense mean: a lossless, linear, stateless
    per-leaf compressor summed by an all-reduce (identity), whose leaves then share the
    dense leaves' buckets."""
    c = self.compressor
    return (c.error_kind == "lossless" and c.linear and not c.stateful and c.reduce is None
            and c.encode_tree is None and c.reduce_tree is None and self.reduction.name == "psum")

  def compresses(self, leaf) -> bool:
    """Whether ``leaf`` goes through the compressor (else it is sent dense): a shard of a
    leaf sharded over model axes is judged by the whole leaf's size."""
    if tree.is_node(leaf):
      return False
    axes = coll.shard_axes(leaf, self.axis_name)
    size = base.leaf_size(leaf.shape) * (coll.axis_size(axes) if axes else 1)
    return compresses(self.compressor, leaf.shape, leaf.dtype, self.min_size, size)

  def memory_dtype(self, dtype):
    """The error memories' dtype: 16-bit floats cannot hold a small update next to a
    large residual, so they get float32 unless ``residual_dtype`` says otherwise."""
    if self.residual_dtype is not None:
      return self.residual_dtype
    return jnp.float32 if jnp.dtype(dtype).itemsize < 4 else dtype

  def memory_shapes(self, shape, workers):
    """(residual shape, server memory shape) of a compressed leaf (see Strategy.memory_shapes)."""
    return self.reduction.memory_shapes(shape, self.axis_name, workers)


def _check_axis(axis_name, strategy: str, inner_strategy: str) -> None:
  if strategy == "hierarchical":
    if not (isinstance(axis_name, tuple) and len(axis_name) == 2
            and all(isinstance(a, str) for a in axis_name) and axis_name[0] != axis_name[1]):
      raise ValueError(
          "compressed_mean: strategy='hierarchical' needs `axis_name` = (slow, fast), two "
          f"distinct mesh axis names such as ('node', 'local'), got {axis_name!r}"
          + ("; on one device (axis_name=None) use any other strategy." if axis_name is None
             else "."))
    base.check_choice("inner_strategy", inner_strategy, INNER_STRATEGIES, FN)
  elif axis_name is not None and not isinstance(axis_name, str):
    error = ValueError if isinstance(axis_name, tuple) else base.OptionTypeError
    raise error(
        f"compressed_mean: `axis_name` must be None or a mesh axis name (str), "
        f"got {axis_name!r}; a (slow, fast) pair needs strategy='hierarchical'.")


def _check_residual_dtype(residual_dtype) -> None:
  try:
    float_residual = residual_dtype is None or base.is_float_dtype(residual_dtype)
  except TypeError:
    raise base.OptionTypeError(
        "compressed_mean: `residual_dtype` must be a floating-point dtype or None, got "
        f"{residual_dtype!r} ({type(residual_dtype).__name__}); pass e.g. jnp.float32.") from None
  if not float_residual:
    raise ValueError(
        "compressed_mean: `residual_dtype` must be a floating-point dtype or "
        f"None, got {residual_dtype!r}.")


def _configure(compressor, axis_name, error_feedback, residual_dtype, min_size, strategy,
               inner_strategy, seed, bucket_bytes="auto", residual_decay=1.0) -> _Config:
  """Validates every option and decides the strategy and the error-feedback policy, once."""
  if not isinstance(compressor, base.Compressor):
    raise base.OptionTypeError(
        f"compressed_mean: `compressor` must be a commopt Compressor (e.g. "
        f"commopt.scaled_sign()), got {compressor!r}.")
  base.check_choice("strategy", strategy, STRATEGIES, FN)
  _check_axis(axis_name, strategy, inner_strategy)
  if strategy != "hierarchical":
    inner_strategy = "auto"
  compressor, error_feedback = feedback.feedback_compressor(compressor, error_feedback, FN)
  reduction = _strategies.resolve(strategy, compressor, FN, inner_strategy)
  min_size = base.check_int("min_size", min_size, fn=FN, minimum=0)
  seed = base.check_int("seed", seed, fn=FN)
  _check_residual_dtype(residual_dtype)
  bucket_bytes = _exchange.check_bucket_bytes(bucket_bytes, FN)
  residual_decay = base.check_number("residual_decay", residual_decay, fn=FN, low=0.0, high=1.0,
                                     low_open=False, high_open=False, what="a number in [0, 1]")
  if residual_decay != 1.0 and not error_feedback:
    raise ValueError(
        f"{FN}: residual_decay={residual_decay} decays the error-feedback residual, but "
        f"{compressor.name} keeps none here (error_feedback resolved to False); pass "
        "error_feedback=True or leave residual_decay at 1.0.")
  return _Config(compressor=compressor, axis_name=axis_name, reduction=reduction,
                 error_feedback=error_feedback,
                 # Two-phase reductions keep a second error memory.
                 server_memory=error_feedback and reduction.keeps_server_memory,
                 residual_dtype=residual_dtype, min_size=min_size, seed=seed,
                 bucket_bytes=bucket_bytes, residual_decay=residual_decay)


def _init(cfg: _Config, params) -> CompressedMeanState:
  """Zero memories for the compressed leaves, sized for the workers where the axis is bound."""
  leaves, treedef = tree.flatten(params)
  specs = coll.specs_for(params, cfg.axis_name)
  residual, cstate, server = [], [], []
  for (path, leaf), spec in zip(leaves, specs):
    _check_leaf(path, leaf, "a parameter")
    if cfg.compresses(leaf):
      rdtype = cfg.memory_dtype(leaf.dtype)
      rshape, sshape = cfg.memory_shapes(leaf.shape, coll.bound_axis_size)
      residual.append(jnp.zeros(rshape, rdtype) if cfg.error_feedback else optax.MaskedNode())
      with _strategies.naming(jax.tree_util.keystr(path), spec):
        cstate.append(cfg.compressor.init_block(leaf, spec, Channel(cfg.axis_name, (spec,))))
      server.append(jnp.zeros(sshape, rdtype) if cfg.server_memory else optax.MaskedNode())
    else:
      residual.append(optax.MaskedNode())
      cstate.append(optax.MaskedNode())
      server.append(optax.MaskedNode())
  unflat = lambda xs: jax.tree_util.tree_unflatten(treedef, xs)
  return CompressedMeanState(count=jnp.zeros([], jnp.int32), key=jax.random.PRNGKey(cfg.seed),
                             residual=unflat(residual), compressor_state=unflat(cstate),
                             server_residual=unflat(server))


def _check_state(cfg: _Config, state: CompressedMeanState, leaves, treedef) -> None:
  """A ValueError unless ``state`` was made by ``init`` for updates like these."""
  def mismatch(detail):
    return ValueError(
        f"compressed_mean: the state does not match `updates`: {detail}. Call "
        "init with the pytree whose updates you pass.")

  r_leaves, r_treedef = tree.flatten(state.residual)
  if r_treedef != treedef:
    raise mismatch(f"it was initialised for the structure {r_treedef}, but the "
                   f"updates have {treedef}")
  cstates = treedef.flatten_up_to(state.compressor_state)
  servers = _server_memories(state, treedef)
  for (path, u), (_, r), cs, m in zip(leaves, r_leaves, cstates, servers):
    if not cfg.compresses(u):
      continue
    where = jax.tree_util.keystr(path)
    if cfg.error_feedback and isinstance(r, optax.MaskedNode):
      raise mismatch(f"leaf {where} has no residual, but its update {u.shape} is compressed")
    if cfg.server_memory and tree.is_node(m):
      raise mismatch(f"leaf {where} has no server memory, but strategy="
                     f"{cfg.reduction.name!r} keeps one")
    # Whole memories, or the parts of this many workers (see CompressedMeanState).
    shapes = {cfg.memory_shapes(u.shape, lambda a: None),
              cfg.memory_shapes(u.shape, coll.axis_size)}
    for memory, i, what in ((r, 0, "a residual"), (m, 1, "a server memory")):
      if not tree.is_node(memory) and tuple(memory.shape) not in {sh[i] for sh in shapes}:
        raise mismatch(
            f"leaf {where} has {what} of shape {tuple(memory.shape)}, but an update of "
            f"shape {tuple(u.shape)} needs one of {sorted({sh[i] for sh in shapes})}; "
            "a per-worker part must be made for the number of workers on the axis")
    expected = jax.eval_shape(cfg.compressor.init, jax.ShapeDtypeStruct(u.shape, u.dtype))
    got = jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), cs)
    want = jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), expected)
    if got != want:
      raise mismatch(f"leaf {where} has compressor state {got}, but an update of "
                     f"shape {tuple(u.shape)} needs {want}")


def _leaf_key(cfg: _Config, wkey, i: int, u):
  """Leaf ``i``'s key: ``fold_in(wkey, i)``, and the index of this device's shard where
  the leaf is sharded over model axes, so that shards draw independently (every worker
  holding the same shard draws alike where the compressor's randomness is shared)."""
  key = jax.random.fold_in(wkey, i)
  if coll.shard_axes(u, cfg.axis_name):
    key = jax.random.fold_in(key, coll.shard_index(u, cfg.axis_name))
  return key


def _update(cfg: _Config, updates, state: CompressedMeanState, params=None, **extra_args):
  """Checks, then dense leaves by one all-reduce each and compressed ones by the strategy.

  A leaf sharded over model axes (inside a ``shard_map`` manual over them) is
  compressed as its own leaf, shard by shard (see :func:`compressed_mean`).
  """
  del params
  with vma.shard_aware():
    return _update_leaves(cfg, updates, state, finite.offered(extra_args, cfg.axis_name))


def _answer(cfg: _Config, nf: Optional[finite.NonFinite], carried, out: list,
            new_state: CompressedMeanState, state: CompressedMeanState, updates):
  """The answer to a non-finite skip's ``nf`` (:mod:`commopt._src.finite`): ``(out,
  new_state)`` as they are, or with the state wrapped in an ``Answer`` where this exchange
  carried the flag (``carried``: the flag's mean from a dense bucket), or in a ``Settled``
  where it settles the zero-gradient skip (it reduces the skip's very ``updates``): then
  its means are judged too, and where the verdict is false they are zeroed and ``state``
  is kept."""
  settles = nf is not None and nf.zero and jax.tree.structure(updates) == nf.structure
  if nf is None or (not settles and (nf.agreed is not None or carried is None)):
    return out, new_state       # nothing to tell: the skip agrees by itself
  if nf.agreed is not None:
    ok = nf.agreed
  else:
    if carried is None:
      # No dense bucket carried the flag (every leaf compressed): its own all-reduce,
      # after every collective of the exchange (gloo needs them in one order).
      carried = coll.psum(coll.after(nf.flag, [o for o in out if o is not None]),
                          cfg.axis_name)
    ok = jnp.isfinite(carried)
  if not settles:
    return out, finite.Answer(new_state, ok)
  # The means are the same on every worker: so is their verdict.
  ok = ok & coll.reduced_finite(out, cfg.axis_name)
  out = [finite.zero_unless(ok, o) for o in out]
  return out, finite.Settled(finite.hold_unless(ok, new_state, state), ok)


def _update_leaves(cfg: _Config, updates, state: CompressedMeanState,
                   nf: Optional[finite.NonFinite] = None):
  """Check; split dense from compressed; the dense leaves' means by bucketed all-reduces
  (the skip's flag riding along), the compressed ones' by the strategy with error
  feedback (:meth:`~commopt.comm._strategies.Strategy.reduce_all`); answer the skip."""
  flat, treedef = tree.flatten(updates)
  for path, u in flat:
    _check_leaf(path, u, "an update")
  coll.check_input(FN, updates, cfg.axis_name)
  _check_state(cfg, state, flat, treedef)
  leaves = [u for _, u in flat]
  residuals = treedef.flatten_up_to(state.residual)
  if cfg.residual_decay != 1.0:
    residuals = [r if tree.is_node(r) else r * jnp.asarray(cfg.residual_decay, r.dtype)
                 for r in residuals]
  cstates = treedef.flatten_up_to(state.compressor_state)
  memories = _server_memories(state, treedef)
  compressed = ([] if cfg.sends_dense() else
                [i for i, u in enumerate(leaves) if cfg.compresses(u)])
  sent = set(compressed)
  dense = [i for i, u in enumerate(leaves) if not tree.is_node(u) and i not in sent]
  out = list(leaves)
  carried = None
  if dense:
    # The non-finite skip's flag, where one was handed over, rides along.
    means, carried = _exchange.bucketed_mean([leaves[i] for i in dense], cfg.axis_name,
                                             cfg.reduction.dense_mean,
                                             _exchange.resolve(cfg.bucket_bytes),
                                             nf.flag if nf is not None else None)
    for i, m in zip(dense, means):
      out[i] = m
  if compressed:
    if cfg.error_feedback or cfg.server_memory:
      coll.check_state_kept(FN, cfg.axis_name, "error-feedback residuals")
    wkey = _exchange.worker_key(state.key, state.count, cfg.compressor, cfg.axis_name)
    specs = coll.specs_for(updates, cfg.axis_name)
    batch = _strategies.Batch(
        updates=[leaves[i] for i in compressed],
        residuals=[residuals[i] if cfg.error_feedback else None for i in compressed],
        memories=[None if tree.is_node(memories[i]) else memories[i] for i in compressed],
        states=[cstates[i] for i in compressed],
        keys=[_leaf_key(cfg, wkey, i, leaves[i]) for i in compressed],
        specs=[specs[i] for i in compressed],
        paths=[jax.tree_util.keystr(flat[i][0]) for i in compressed])
    results = cfg.reduction.reduce_all(cfg.compressor, batch, wkey, cfg.axis_name,
                                       wait_for=[out[i] for i in dense])
    for i, result in zip(compressed, results):
      out[i] = result.out
      if cfg.error_feedback:
        residuals[i] = result.residual
      cstates[i] = result.state
      if result.memory is not None:
        memories[i] = result.memory
  unflat = lambda xs: jax.tree_util.tree_unflatten(treedef, xs)
  new_state = CompressedMeanState(
      count=optax.safe_int32_increment(state.count), key=state.key,
      residual=unflat(residuals),
      compressor_state=unflat(cstates), server_residual=unflat(memories))
  out, new_state = _answer(cfg, nf, carried, out, new_state, state, updates)
  return unflat(out), new_state


def compressed_mean(
    compressor: base.Compressor,
    *,
    axis_name: Optional[str | tuple[str, str]] = None,
    error_feedback: bool | str = "auto",
    residual_dtype=None,
    min_size: int = DEFAULT_MIN_SIZE,
    strategy: str = "auto",
    inner_strategy: str = "auto",
    seed: int = 0,
    bucket_bytes: int | str | None = "auto",
    residual_decay: float = 1.0,
) -> optax.GradientTransformationExtraArgs:
  """The mean over ``axis_name`` of every worker's compressed updates.

  Each worker compresses its input plus its error-feedback residual
  (``p = u + e``, ``e' = p - decode(encode(p))``), the packed payloads cross the
  axis, and every worker receives the mean of the reconstructions. The same code
  runs on one device (``axis_name=None``), under ``jax.vmap(..., axis_name=...)``
  and inside ``jax.shard_map``. Before an optimizer in an ``optax.chain`` it
  compresses gradients; after one it compresses updates (EF-SGD). It does not
  filter non-finite input: :func:`commopt.data_parallel` and
  :func:`commopt.transforms.apply_if_finite` skip such steps.

  See the guide's "Choosing a compressor" page (strategies, error feedback), its
  "Data parallel training" page (non-finite steps) and the Design page (keys, buckets).

  Args:
    compressor: a :class:`~commopt.Compressor`.
    axis_name: the named axis to reduce over, or ``None`` for one local worker;
      ``(slow, fast)`` for ``strategy="hierarchical"``.
    error_feedback: ``"auto"`` (default: a residual only where the compressor's
      :attr:`~commopt.Compressor.error_kind` keeps it bounded), ``True`` or ``False``.
    residual_dtype: dtype of the error memories; ``None`` (default) is float32
      for 16-bit float leaves and the leaf's dtype otherwise.
    min_size: leaves with fewer elements are sent dense (an ordinary pmean).
    strategy: ``"auto"`` (by linearity: ``"psum"`` or ``"gather"``), ``"psum"``
      (linear compressors only), ``"gather"``, ``"two_phase"`` or ``"hierarchical"``.
    inner_strategy: for ``"hierarchical"``, the reduction across the slow
      axis: ``"auto"``, ``"psum"``, ``"gather"`` or ``"two_phase"``.
    seed: seed of the base key.
    bucket_bytes: how dense leaves are all-reduced: an int, in flat buffers of at
      most that many bytes; ``None``, as one tuple; ``"auto"`` (default), 25 MB
      buffers on XLA:CPU across processes, else one tuple.
    residual_decay: β in ``p = u + β·e``, in [0, 1]: 1 (default) keeps every
      unsent part until sent; below 1 a decaying accumulator (needs a residual).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state
    :class:`CompressedMeanState`.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, commopt
    >>> tx = optax.chain(commopt.compressed_mean(commopt.scaled_sign(), min_size=0),
    ...                  optax.sgd(0.1))
    >>> params = {"w": jnp.ones(8)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.arange(8.0)}, state, params)
    >>> updates["w"].shape
    (8,)

  References:
    Seide et al., 1-bit SGD, Interspeech 2014 (error feedback).
    Karimireddy et al., Error Feedback Fixes SignSGD, ICML 2019.
    Stich and Karimireddy, The Error-Feedback Framework: Better Rates for SGD
    with Delayed Gradients and Compressed Updates, JMLR 2020.
    Beznosikov et al., On Biased Compression for Distributed Learning, 2020.
  """
  cfg = _configure(compressor, axis_name, error_feedback, residual_dtype, min_size, strategy,
                   inner_strategy, seed, bucket_bytes, residual_decay)

  def planner(params, workers, step=None):
    # Leaves whose mean is the dense mean (identity) share the dense leaves' buckets.
    min_size = math.inf if cfg.sends_dense() else cfg.min_size
    return _strategies.plan_reduction(cfg.compressor, cfg.reduction, params,
                                      _plan.axis_sizes(axis_name, workers), axis_name,
                                      min_size, step)

  return _plan.with_planner(
      _global_view.accepting(
          optax.GradientTransformationExtraArgs(functools.partial(_init, cfg),
                                                functools.partial(_update, cfg)),
          axis_name, "compressed_mean"),
      planner, planner)
