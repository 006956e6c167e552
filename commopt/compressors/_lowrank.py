"""Low-rank compression: PowerSGD."""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple, Union

import jax
import jax.numpy as jnp
import optax

from commopt._src import base, tree, vma
from commopt.compressors._registry import register

View = Union[str, Callable[[tuple[int, ...]], tuple[int, int]]]

RESIDUALS = ("aggregate", "local")
"""What :func:`power_sgd`'s error feedback subtracts (its ``residual`` option)."""


class PowerSGDLeafState(NamedTuple):
  """Per-leaf PowerSGD state.

  Attributes:
    q: the warm-started right factor ``[m, rank]``: float64 for float64
      leaves, float32 for every narrower float.
    count: reductions of this leaf so far (int32), the same on every worker;
      the first ``start_iter`` of them send the leaf dense.
  """
  q: jax.Array
  count: jax.Array


def _matrix_shape(shape, view: View, fn: str = "power_sgd") -> tuple[int, int]:
  """``(n, m)``: the matrix a leaf of ``shape`` is viewed as (errors name ``fn``)."""
  if callable(view):
    n, m = view(tuple(shape))
  elif view == "last":
    n, m = base.leaf_size(shape[:-1]), shape[-1]
  else:  # "first"
    n, m = shape[0], base.leaf_size(shape[1:])
  if n * m != base.leaf_size(shape):
    raise ValueError(
        f"{fn}: `view` mapped shape {tuple(shape)} to ({n}, {m}), which "
        f"does not hold its {base.leaf_size(shape)} elements.")
  return int(n), int(m)


def _check_view(view: View, fn: str) -> View:
  """``view`` if it is ``"last"``, ``"first"`` or a callable (for :func:`power_sgd` and ATOMO)."""
  if not (callable(view) or isinstance(view, str)):
    raise base.OptionTypeError(
        f"{fn}: `view` must be 'last', 'first' or a callable shape -> (n, m), "
        f"got {view!r} ({type(view).__name__}).")
  if not (callable(view) or view in ("last", "first")):
    raise ValueError(
        f"{fn}: `view` must be 'last', 'first' or a callable shape -> (n, m), "
        f"got {view!r}.")
  return view


def _work_dtype(dtype):
  """The dtype the factors are computed in: float64 for float64 leaves, else float32."""
  return jnp.promote_types(dtype, jnp.float32)


_FAR = 2.0 ** 32
"""Magnitudes :func:`_far_scales` leaves alone: within a factor ``_FAR`` of 1."""


def _far_scales(m: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(down, up)`` of :func:`commopt._src.base.pow2_scales` where ``m`` is
  further than :data:`_FAR` from 1, and ``(1, 1)`` elsewhere.

  For factorisations (QR, SVD) of a matrix whose max-abs is ``m``: the
  scaling is exact, and leaving ordinary magnitudes alone keeps their
  results bit for bit.
  """
  down, up = base.pow2_scales(m)
  far = (m > _FAR) | (m < 1 / _FAR)
  one = jnp.ones_like(m)
  return jnp.where(far, down, one), jnp.where(far, up, one)


def _unit(x: jax.Array) -> jax.Array:
  """``x`` (``[..., a, b]``), each matrix scaled by a power of two to a max-abs in ``[1, 2)``
  when its max-abs is far from 1 (:func:`_far_scales`), else as it is.

  What it feeds depends only on the span of the columns: the orthonormal
  basis of ``M (cQ)`` is that of ``M Q``.
  """
  down, _ = _far_scales(jnp.max(jnp.abs(x), axis=(-2, -1), keepdims=True))
  return x * down


def _column_norms(col: jax.Array) -> jax.Array:
  """``‖col‖₂`` over axis -2, keeping it, scaled by a power of two so no square overflows."""
  down, up = base.pow2_scales(jnp.max(jnp.abs(col), axis=-2, keepdims=True))
  return up * jnp.linalg.norm(col * down, axis=-2, keepdims=True)


def _orthogonalize(p: jax.Array, epsilon: float = 0.0) -> jax.Array:
  """Orthonormal columns spanning ``p`` (``[..., n, r]``, batched over leading axes).

  ``epsilon == 0``: Householder QR, which stays finite for rank-deficient
  (even zero) inputs. ``epsilon > 0``: modified Gram-Schmidt as PyTorch's
  PowerSGD hook runs it, each column divided by its norm plus ``epsilon`` (a
  zero column stays zero instead of dividing by zero). Either way nothing is
  squared at an extreme scale: QR runs on ``p`` scaled by a power of two to a
  max-abs near 1 where it is far from 1 (:func:`_unit`; the basis does not
  depend on it), and Gram-Schmidt's norms are computed scaled
  (:func:`_column_norms`), so ``epsilon`` keeps its meaning.
  """
  if epsilon == 0:
    q, _ = jnp.linalg.qr(_unit(p), mode="reduced")
    return q
  cols = []
  for i in range(p.shape[-1]):
    col = p[..., i:i + 1]
    for done in cols:
      col = col - jnp.sum(done * col, axis=-2, keepdims=True) * done
    cols.append(col / (_column_norms(col) + epsilon))
  return jnp.concatenate(cols, axis=-1)


def _transpose(x: jax.Array) -> jax.Array:
  return jnp.swapaxes(x, -1, -2)


class _Options(NamedTuple):
  """:func:`power_sgd`'s options, checked (:func:`_options`)."""
  rank: int
  view: View
  min_compression_rate: float
  seed: int
  start_iter: int
  orthogonalization_epsilon: float
  residual: str
  batched: bool


def _options(rank, view, min_compression_rate, seed, start_iter, orthogonalization_epsilon,
             residual, batched) -> _Options:
  """:func:`power_sgd`'s arguments, each checked (its errors name ``power_sgd``)."""
  fn = "power_sgd"
  rank = base.check_positive_int("rank", rank, fn=fn)
  view = _check_view(view, fn)
  min_compression_rate = base.check_number(
      "min_compression_rate", min_compression_rate, fn=fn, low=0.0, high=float("inf"),
      low_open=False, high_open=False, what="a number >= 0")
  seed = base.check_int("seed", seed, fn=fn)
  start_iter = base.check_int("start_iter", start_iter, fn=fn, minimum=0)
  orthogonalization_epsilon = base.check_number(
      "orthogonalization_epsilon", orthogonalization_epsilon, fn=fn, low=0, low_open=False,
      what="a number >= 0")
  base.check_choice("residual", residual, RESIDUALS, fn)
  batched = base.check_bool("batched", batched, fn=fn)
  return _Options(rank, view, min_compression_rate, seed, start_iter,
                  orthogonalization_epsilon, residual, batched)


def _dims(opts: _Options, shape) -> tuple[int, int, int]:
  """``(n, m, r)``: a leaf's matrix view and its rank, clipped to ``min(n, m)``."""
  n, m = _matrix_shape(shape, opts.view)
  return n, m, min(opts.rank, n, m)


def _accepts(opts: _Options, shape, dtype) -> bool:
  """Whether a leaf is compressed: a matrix compressing at least ``min_compression_rate``."""
  if len(shape) < 2:
    return False
  n, m, r = _dims(opts, shape)
  return n * m >= opts.min_compression_rate * (n + m) * r


def _init(opts: _Options, leaf) -> PowerSGDLeafState:
  """The seeded ``Q`` ``[m, r]`` in the work dtype, the same on every worker; no reductions yet."""
  _, m, r = _dims(opts, leaf.shape)
  q = jax.random.normal(jax.random.PRNGKey(opts.seed), (m, r), _work_dtype(leaf.dtype))
  return PowerSGDLeafState(q=q, count=jnp.zeros([], jnp.int32))


def _init_shard(opts: _Options, leaf, spec, channel) -> PowerSGDLeafState:
  """This device's block of the whole leaf's :func:`_init` state, for a leaf sharded by
  ``spec`` over model axes (inside a ``shard_map`` manual over them): the whole seeded
  ``Q`` ``[m, r]``, of which this shard keeps the rows of its columns, so that the sharded
  protocol is the unsharded one exactly."""
  _, cols = _matrix_axes(opts, spec, leaf.ndim)
  state = _init(opts, leaf)
  if not cols:
    return state      # the columns are whole here: so is Q
  split = leaf.ndim - 1 if opts.view == "last" else 1
  entries = (list(spec) + [None] * leaf.ndim)[split:leaf.ndim]
  cuts = [vma.spec_axes((e,)) for e in entries]
  local = leaf.shape[split:]
  whole = tuple(n * channel.model_size(axes) for n, axes in zip(local, cuts))
  r = state.q.shape[1]
  q = jax.random.normal(jax.random.PRNGKey(opts.seed), (math.prod(whole), r), state.q.dtype)
  starts = [channel.model_index(axes) * n for n, axes in zip(local, cuts)]
  q = jax.lax.dynamic_slice(q.reshape(*whole, r), (*starts, 0), (*local, r))
  return state._replace(q=q.reshape(-1, r))


# ---------------------------------------------------------------------------
# The multi-round protocol: a gradient's way through ``reduce`` (or ``reduce_tree``).


def _reduce(opts: _Options, x, state, key, channel) -> base.Reduced:
  """One leaf: the protocol on a group of one."""
  del key
  return _reduce_groups(opts, [([x], [state], channel.spec(0))], channel)[0][0]


def _reduce_tree(opts: _Options, xs, states, keys, channel) -> list:
  """Every compressed leaf at once, as PyTorch's hook runs them: every leaf's ``P`` in one
  all-reduce, every ``Q`` in another. With ``batched=True`` the leaves with the same matrix
  shape, rank, dtype and sharding are stacked into one group (one batched
  orthogonalisation); without, each leaf is a group of its own. The results in ``xs``'s
  order."""
  del keys
  groups = {}
  for i, x in enumerate(xs):
    shared = (_dims(opts, x.shape), jnp.dtype(x.dtype), channel.spec(i))
    groups.setdefault(shared if opts.batched else i, []).append(i)
  members = list(groups.values())
  reduced = _reduce_groups(opts, [([xs[i] for i in idx], [states[i] for i in idx],
                                   channel.spec(idx[0])) for idx in members], channel)
  out = [None] * len(xs)
  for idx, got in zip(members, reduced):
    for i, r in zip(idx, got):
      out[i] = r
  return out


def _matrix_axes(opts: _Options, spec, ndim: int) -> tuple[tuple, tuple]:
  """``(rows, cols)``: the model axes that cut the rows and the columns of a leaf's matrix
  view, from its ``spec`` over the model axes (``((), ())`` when it is whole here, or
  sharded with its dimensions unknown: then the shard is its own matrix)."""
  if spec is None:
    return (), ()
  entries = list(spec) + [None] * (ndim - len(spec))
  if not vma.spec_axes(entries):
    return (), ()
  if callable(opts.view):
    raise ValueError(
        f"power_sgd: a leaf sharded over model axes (spec {spec}) needs view='last' or "
        "view='first', which say which dimensions are the matrix's rows and columns; "
        "a callable view does not.")
  split = ndim - 1 if opts.view == "last" else 1
  return vma.spec_axes(entries[:split]), vma.spec_axes(entries[split:])


class _Group(NamedTuple):
  """Leaves of one matrix shape, dtype and sharding, as the rounds see them."""
  wire: jnp.dtype          # the leaves' dtype, in which the factors cross the wire
  single: bool             # one leaf: ``[n, m]`` matrices, else stacked ``[g, n, m]``
  axes: tuple              # (rows, cols): the model axes cutting the matrix (_matrix_axes)


def _reduce_groups(opts: _Options, groups, channel) -> list:
  """The protocol on ``groups`` (``(xs, states, spec)`` each: leaves of one matrix shape,
  dtype and sharding, stacked when several); one list of
  :class:`~commopt._src.base.Reduced` per group, each with its leaf's next state.

  Dense for the first ``start_iter`` reductions (:func:`_dense_round`), the
  two rounds after (:func:`_two_rounds`), whose all-reduces carry every
  group at once. A leaf sharded over model axes with a known ``spec`` is
  this device's block of the matrix: the rounds sum its partial products
  over those axes, so the result is the unsharded protocol's.
  """
  info, mats, qs = [], [], []
  for xs, states, spec in groups:
    n, m, _ = _dims(opts, xs[0].shape)
    wire = xs[0].dtype
    single = len(xs) == 1
    stack = (lambda t: t[0]) if single else jnp.stack
    mats.append(stack([x.reshape(n, m).astype(_work_dtype(wire)) for x in xs]))
    qs.append(stack([s.q for s in states]))
    info.append(_Group(wire, single, _matrix_axes(opts, spec, xs[0].ndim)))
  # Every leaf counts the same reductions: one switch for all (see PowerSGDLeafState).
  count = groups[0][1][0].count
  if opts.start_iter:
    means, locals_, q_next = jax.lax.cond(
        count < opts.start_iter, lambda ops: _dense_round(info, *ops, channel),
        lambda ops: _two_rounds(opts, info, *ops, channel), (mats, qs))
  else:
    means, locals_, q_next = _two_rounds(opts, info, mats, qs, channel)
  count = optax.safe_int32_increment(count)
  out = []
  for (xs, _, _), g, mean, local, q in zip(groups, info, means, locals_, q_next):
    if g.single:
      mean, local, q = mean[None], local[None], q[None]
    out.append([base.Reduced(mean=mean[i].reshape(x.shape).astype(x.dtype),
                             local=local[i].reshape(x.shape).astype(x.dtype),
                             state=PowerSGDLeafState(q=q[i], count=count))
                for i, x in enumerate(xs)])
  return out


def _dense_round(info, mats, qs, channel):
  """The warm-up: the exact means of ``mats``, sent in their wire dtypes; nothing is owed."""
  sent = [mat.astype(g.wire) for g, mat in zip(info, mats)]
  means = channel.mean(sent)
  return ([mean.astype(mat.dtype) for mean, mat in zip(means, mats)],
          [s.astype(mat.dtype) for s, mat in zip(sent, mats)], qs)


def _mean_split(info, xs, which: int, channel) -> list:
  """:meth:`Channel.mean_split` of each ``x`` over its group's model axes ``axes[which]``
  (``dim=-2``), the workers' means of every group in one all-reduce."""
  parts, cuts = [], []
  for g, x in zip(info, xs):
    axes = g.axes[which]
    k = channel.model_size(axes)
    cut = k > 1 and x.shape[-2] % k == 0
    if cut:
      size = x.shape[-2] // k
      x = jax.lax.dynamic_slice_in_dim(x, channel.model_index(axes) * size, size, axis=-2)
    parts.append(x)
    cuts.append(cut)
  means = _packed_mean(parts, channel)
  return [channel.model_gather(mean, g.axes[which], -2) if cut else mean
          for g, mean, cut in zip(info, means, cuts)]


def _packed_mean(xs: list, channel) -> list:
  """``channel.mean`` of each of ``xs``, those of one dtype laid end to end in one buffer:
  one all-reduce per dtype, which the compiler cannot split (it would chain each group's
  next all-reduce after the previous group's orthogonalisation). Elementwise, so the
  means are those of the arrays sent one by one."""
  if len(xs) == 1:
    return [channel.mean(xs[0])]
  by_dtype = {}
  for i, x in enumerate(xs):
    by_dtype.setdefault(jnp.dtype(x.dtype), []).append(i)
  out = [None] * len(xs)
  for idx in by_dtype.values():
    if len(idx) == 1:
      out[idx[0]] = channel.mean(xs[idx[0]])
      continue
    flat = channel.mean(tree.concat_flat([xs[i].reshape(-1) for i in idx]))
    start = 0
    for i in idx:
      out[i] = flat[start:start + xs[i].size].reshape(xs[i].shape)
      start += xs[i].size
  return out


SMALL_RANK = 4
"""Up to this rank the protocol's products with the leaf's matrix are written out
elementwise (:func:`_left_product`, :func:`_outer`)."""


def _left_product(mat: jax.Array, p: jax.Array) -> jax.Array:
  """``Mᵀ P`` (``[..., n, m]``, ``[..., n, r]`` to ``[..., m, r]``).

  At rank up to :data:`SMALL_RANK` as ``r`` sums over the rows of ``M ⊙ pⱼ``
  in one read of ``M``: a matrix-vector product against the rows is
  memory-bound, and XLA:CPU's dot contracts ``M``'s leading axis, a strided read
  the reduction avoids (``benchmarks/bench_step.py`` times the PowerSGD step). The rows are summed in
  order, not blocked as a dot sums them: the result differs in rounding only.
  """
  if p.shape[-1] > SMALL_RANK:
    return _transpose(mat) @ p
  prod = jnp.expand_dims(mat, -3) * jnp.expand_dims(_transpose(p), -1)   # [..., r, n, m]
  return _transpose(jnp.sum(prod, axis=-2))


def _outer(p: jax.Array, q: jax.Array) -> jax.Array:
  """``P Qᵀ`` (``[..., n, r]``, ``[..., m, r]`` to ``[..., n, m]``).

  At rank up to :data:`SMALL_RANK` as ``r`` broadcast products added in
  order, which the compiler fuses into whatever reads the result (the
  residual, the optimizer's step) instead of writing an ``[n, m]`` product
  first.
  """
  if p.shape[-1] > SMALL_RANK:
    return p @ _transpose(q)
  acc = p[..., :, 0:1] * jnp.expand_dims(q[..., :, 0], -2)
  for j in range(1, p.shape[-1]):
    acc = p[..., :, j:j + 1] * jnp.expand_dims(q[..., :, j], -2) + acc
  return acc


def _two_rounds(opts: _Options, info, mats, qs, channel):
  """The two rounds on each group's ``mat`` ``[..., n, m]`` (work dtype):
  ``(means, locals, q_nexts)``, one per group.

  Every group's ``P`` crosses the workers' axis in one all-reduce, then
  every group's ``Q`` in another. ``axes = (rows, cols)``: the model axes
  that cut ``mat``'s rows and columns when it is this device's block of a
  sharded leaf. Then ``M Q`` is summed over ``cols`` and ``Mᵀ P̂`` over
  ``rows`` (partial products made whole), ``P`` is gathered over ``rows`` to
  be orthogonalised whole (it is ``[n, r]``, not the leaf), and each factor
  crosses the workers' axis only once per model group: each device sends
  its slice (:meth:`Channel.mean_split`).
  """
  sent = []
  for g, mat, q in zip(info, mats, qs):
    _, cols = g.axes
    # Q carries the inputs' magnitude from the last step; only its span
    # matters here, so it enters at a max-abs near 1 (the same on every
    # worker: Q is), and M Q overflows only where M's own rows would.
    q_max = channel.model_max(jnp.max(jnp.abs(q), axis=(-2, -1), keepdims=True), cols)
    sent.append(channel.model_sum(mat @ (q * _far_scales(q_max)[0]), cols).astype(g.wire))
  p_hats, q_locals = [], []
  for g, mat, p in zip(info, mats, _mean_split(info, sent, 1, channel)):
    rows, _ = g.axes
    p = p.astype(mat.dtype)
    p_hat = _orthogonalize(channel.model_gather(p, rows, -2), opts.orthogonalization_epsilon)
    k = channel.model_size(rows)
    if k > 1:
      size = p.shape[-2]
      p_hat = jax.lax.dynamic_slice_in_dim(p_hat, channel.model_index(rows) * size, size, -2)
    p_hats.append(p_hat)
    # What this worker sends, rounded to the wire dtype so that its own
    # reconstruction matches its share of the mean exactly.
    q_locals.append(channel.model_sum(_left_product(mat, p_hat), rows).astype(g.wire))
  means, locals_, q_next = [], [], []
  for g, mat, q, p_hat, q_local, q_mean in zip(info, mats, qs, p_hats, q_locals,
                                               _mean_split(info, q_locals, 0, channel)):
    _, cols = g.axes
    work = mat.dtype
    q_mean = q_mean.astype(work)
    mean = _outer(p_hat, q_mean)
    local = mean if opts.residual == "aggregate" else _outer(p_hat, q_local.astype(work))
    # An all-zero step (e.g. a frozen layer) would leave Q = 0 and lose the
    # warm start; keep the previous Q then.
    nonzero = jnp.any(q_mean != 0, axis=(-2, -1), keepdims=True).astype(jnp.int32)
    means.append(mean)
    locals_.append(vma.vary_like(local, mat))
    q_next.append(jnp.where(channel.model_max(nonzero, cols) > 0, q_mean, q))
  return means, locals_, q_next


# ---------------------------------------------------------------------------
# The one-worker protocol as a payload: ``encode``, ``decode``, ``payload_bits``.


def _encode(opts: _Options, x, state, key):
  """The payload ``{"p": P̂, "q": MᵀP̂}`` (``P̂`` orthonormal) in ``x``'s dtype; the next state."""
  del key
  n, m, _ = _dims(opts, x.shape)
  mat = x.reshape(n, m).astype(_work_dtype(x.dtype))
  p_hat = _orthogonalize(mat @ _unit(state.q), opts.orthogonalization_epsilon)
  q = mat.T @ p_hat
  payload = {"p": p_hat.astype(x.dtype), "q": q.astype(x.dtype)}
  return payload, PowerSGDLeafState(q=q, count=optax.safe_int32_increment(state.count))


def _decode(payload, state, like) -> jax.Array:
  """``P̂ Qᵀ`` with ``like``'s shape and dtype."""
  work = _work_dtype(like.dtype)
  mat = payload["p"].astype(work) @ payload["q"].astype(work).T
  return mat.reshape(like.shape).astype(like.dtype)


def _payload_bits(opts: _Options, shape, dtype) -> int:
  """``(n + m) r`` values of the leaf's dtype."""
  n, m, r = _dims(opts, shape)
  return (n + m) * r * base.dtype_bits(dtype)


def power_sgd(rank: int = 1, *, view: View = "last",
              min_compression_rate: float = 2.0, seed: int = 0, start_iter: int = 0,
              orthogonalization_epsilon: float = 0.0, residual: str = "local",
              batched: bool = False) -> base.Compressor:
  """PowerSGD: rank-``r`` compression by one warm-started power iteration.

  A leaf is viewed as a matrix ``M`` [n, m]. Each step computes, over the
  workers' ``M_w``, ``P = mean_w(M_w Q)``, ``P̂ = orth(P)`` and
  ``Q' = mean_w(M_wᵀ P̂)``, and every worker receives ``P̂ Q'ᵀ``; ``Q'`` is kept
  and warm-starts the next step. Through :func:`~commopt.compressed_mean` two
  all-reduces cross the wire per step (every leaf's ``P`` in one, every ``Q`` in
  the other). Leaves with at most one dimension, or whose compression rate
  ``nm / ((n + m) r)`` is below ``min_compression_rate``, are sent dense. The
  options mirror PyTorch's PowerSGD hook (``view="first"`` is its layout).

  See the guide's "Compressors and aggregators" page (PowerSGD) for the view,
  the warm-up, the residual choice and PyTorch's option names.

  Args:
    rank: the rank ``r`` of the approximation (positive; clipped to
      ``min(n, m)`` per leaf).
    view: ``"last"`` (default: ``[prod(shape[:-1]), shape[-1]]``, Flax's kernels),
      ``"first"`` (``[shape[0], prod(shape[1:])]``) or a callable ``shape -> (n, m)``.
    min_compression_rate: leaves compressing less than this go dense.
    seed: seed of the initial ``Q``; it is the same on every worker.
    start_iter: reductions (optimizer steps) sent dense before compressing;
      an integer >= 0.
    orthogonalization_epsilon: 0 (default) orthogonalises ``P`` by Householder
      QR; a positive value uses Gram-Schmidt with it added to each column's norm.
    residual: ``"local"`` (default: input less this worker's reconstruction) or
      ``"aggregate"`` (less the aggregate ``P̂ Q'ᵀ``, the paper's): what error feedback keeps.
    batched: run the protocol once per group of same-shaped matrices.

  Returns:
    A :class:`~commopt.Compressor` whose ``reduce`` runs the two-round
    protocol on one leaf and ``reduce_tree`` on every compressed leaf at once.
    Its ``encode`` and ``decode`` are the one-worker protocol as a payload,
    ``(P̂, MᵀP̂)``, which always compresses.

  Examples:
    >>> import jax, jax.numpy as jnp, commopt
    >>> tx = commopt.compressed_mean(
    ...     commopt.power_sgd(rank=1, min_compression_rate=0), min_size=0)
    >>> m = jnp.outer(jnp.arange(4.0), jnp.ones(3))   # exactly rank 1
    >>> out, _ = tx.update({"w": m}, tx.init({"w": m}))
    >>> bool(jnp.allclose(out["w"], m, atol=1e-5))
    True

  References:
    Vogels et al., PowerSGD: Practical Low-Rank Gradient Compression for
    Distributed Optimization, NeurIPS 2019 (Algorithms 1 and 2).
    ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.PowerSGDState``
    (PyTorch), whose options these mirror.
  """
  opts = _options(rank, view, min_compression_rate, seed, start_iter,
                  orthogonalization_epsilon, residual, batched)
  return base.Compressor(
      name=f"power_sgd(rank={opts.rank})",
      init=functools.partial(_init, opts),
      init_shard=functools.partial(_init_shard, opts),
      stateful=True,
      encode=functools.partial(_encode, opts),
      decode=_decode,
      payload_bits=functools.partial(_payload_bits, opts),
      linear=False,
      accepts=functools.partial(_accepts, opts),
      reduce=functools.partial(_reduce, opts),
      # A callable view runs leaf by leaf (unless batched): compressed_mean names the leaf
      # in the error a sharded one raises (_matrix_axes).
      reduce_tree=(functools.partial(_reduce_tree, opts)
                   if opts.batched or not callable(opts.view) else None),
      dense_steps=opts.start_iter,
  )


register("power_sgd", power_sgd, {"rank": 2},
         variants=({"rank": 1, "view": "first"},
                   {"rank": 2, "residual": "aggregate", "orthogonalization_epsilon": 1e-8,
                    "batched": True}))
