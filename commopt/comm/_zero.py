"""ZeRO-3's collectives: a parameter's shard gathered for the forward pass and its gradient
reduce-scattered back by the gather's own backward pass, either one compressed.

A leaf of ``n`` coordinates is kept flat, zero-padded to ``N·c`` (``c = ⌈n/N⌉``), and
worker ``j`` owns coordinates ``j·c`` to ``(j+1)·c`` (:func:`shard_flat`). Inside
``jax.shard_map`` over the data axis, :func:`gather` gives every worker the whole leaf:

- forward: an all-gather of the owners' shards, dense, or each shard encoded by the
  ``weights`` compressor (qwZ: block-quantized int8/int4) and the packed payloads
  gathered as uint32 words, then decoded;
- backward: the cotangent (each worker's own gradient of the whole leaf) split into
  ``N`` chunks, one per owner: a reduce-scatter when dense, or each chunk encoded by
  the ``grads`` compressor (qgZ), an all-to-all of the packed payloads, and the owner
  decoding the ``N`` payloads of its chunk and summing them in float32; then divided by
  ``N`` (the mean).

Error feedback is optional (:func:`gather`'s ``residual``: each worker's memory of the
whole leaf, a full gradient per device); without it the compressors should be unbiased
or deterministic block quantizers (``int_quant(rounding="nearest")`` as ZeRO++ uses). A compressor that draws
random bits takes the ``key`` given to :func:`gather` (per worker and leaf).
"""

from __future__ import annotations

from typing import Optional

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
import numpy as np

from commopt._src import base
from commopt.comm import _collectives as coll
from commopt.comm._exchange import sum_decoded
from commopt.comm._words import to_words


def shard_len(n: int, workers: int) -> int:
  """Coordinates each of ``workers`` owns of a leaf of ``n``: ``⌈n/workers⌉`` (at least 1)."""
  return max(1, -(-n // workers))


def shard_flat(x, workers: int):
  """``x`` flattened, zero-padded to ``workers·c`` and shaped ``[workers, c]`` (row j: owner j).

  A numpy array stays on the host (the parameters are cut there before they are placed);
  a jax array (a cotangent inside the step) stays a jax array."""
  xp = np if isinstance(x, np.ndarray) else jnp
  flat = xp.reshape(x, (-1,))
  c = shard_len(flat.shape[0], workers)
  return xp.pad(flat, (0, workers * c - flat.shape[0])).reshape(workers, c)


def unshard_flat(rows: jax.Array, shape, dtype=None) -> jax.Array:
  """The leaf of ``shape`` from its ``[workers, c]`` rows (the padding dropped)."""
  n = int(np.prod(shape, dtype=np.int64))
  out = jnp.reshape(rows, (-1,))[:n].reshape(shape)
  return out if dtype is None else out.astype(dtype)


def check_compressor(compressor, what: str, fn: str) -> None:
  """A ZeRO compressor must encode a flat shard by itself: stateless, per leaf, flat chunks."""
  if compressor is None:
    return
  if not isinstance(compressor, base.Compressor):
    raise ValueError(f"{fn}: `{what}` must be None (dense) or a commopt Compressor, "
                     f"got {type(compressor).__name__}.")
  if not base.is_stateless_per_leaf(compressor) or "flat_chunks" not in compressor.capabilities:
    raise ValueError(
        f"{fn}: `{what}`={compressor.name} cannot encode a flat shard by itself: it keeps "
        "per-leaf state, runs its own protocol, selects over the whole tree or compresses "
        "by a matrix shape. Use a stateless elementwise or blockwise compressor, e.g. "
        "commopt.int_quant(bits=8, rounding='nearest').")


def needs_key(compressor) -> bool:
  """Whether ``compressor`` draws random bits (its encode refuses ``key=None``)."""
  if compressor is None:
    return False
  like = jax.ShapeDtypeStruct((64,), jnp.float32)
  try:
    jax.eval_shape(lambda x: compressor.encode(x, compressor.init(like), None), like)
  except ValueError as e:
    if "needs a PRNG key" in str(e):
      return True
    raise
  return False


def _encode_rows(compressor, rows: jax.Array, key):
  """Each row of ``rows`` ``[m, c]`` encoded by itself (row ``j`` with ``fold_in(key, j)``)."""
  like = jax.ShapeDtypeStruct(rows.shape[1:], rows.dtype)
  empty = compressor.init(like)
  if key is None:
    payloads = jax.vmap(lambda r: compressor.encode(r, empty, None)[0])(rows)
  else:
    keys = jax.vmap(lambda j: jax.random.fold_in(key, j))(jnp.arange(rows.shape[0]))
    payloads = jax.vmap(lambda r, k: compressor.encode(r, empty, k)[0])(rows, keys)
  return payloads, empty, like


def gather_shard(shard: jax.Array, axis_name, compressor=None, key=None) -> jax.Array:
  """``[N, c]``: every owner's shard (``[c]``), dense or through ``compressor``; varying."""
  if compressor is None:
    return coll.all_gather_varying(shard, axis_name)
  payloads, empty, like = _encode_rows(compressor, shard[None], key)
  words, unpack = to_words(payloads, batch_dims=1)
  gathered = coll.all_gather_varying(words[0], axis_name)
  return jax.vmap(lambda pl: compressor.decode(pl, empty, like))(unpack(gathered))


def scatter_mean(rows: jax.Array, axis_name, compressor=None, key=None) -> jax.Array:
  """``[c]``: the mean over the workers of their row ``j`` of ``rows`` ``[N, c]``, on owner ``j``."""
  workers = coll.axis_size(axis_name)
  if compressor is None:
    total = coll.psum_scatter(rows.reshape(-1).astype(jnp.float32), axis_name)
    return (total / workers).astype(rows.dtype)
  received, _, empty, like = _all_to_all_encoded(rows[:, None, :], axis_name, compressor, key)
  total = sum_decoded(received, lambda acc, pl: compressor.add_decoded(acc, pl, empty, like),
                      jnp.zeros(rows.shape[1:], jnp.float32))
  return (total / workers).astype(rows.dtype)


def scatter_mean_feedback(rows: jax.Array, residual: jax.Array, axis_name, compressor,
                          key=None):
  """:func:`scatter_mean` of ``rows + residual`` through ``compressor``, with error feedback:
  ``(the mean chunk [c] on its owner, float32; the new residual [N, c], what this worker's
  payloads did not carry, in residual's dtype)``."""
  workers = coll.axis_size(axis_name)
  p = rows.astype(jnp.float32) + residual.astype(jnp.float32)
  received, payloads, empty, like = _all_to_all_encoded(p[:, None, :], axis_name, compressor,
                                                        key)
  total = sum_decoded(received, lambda acc, pl: compressor.add_decoded(acc, pl, empty, like),
                      jnp.zeros(rows.shape[1:], jnp.float32))
  sent = jax.vmap(lambda pl: compressor.decode(pl, empty, like))(payloads)
  return total / workers, (p - sent.astype(jnp.float32)).astype(residual.dtype)


def _all_to_all_encoded(rows: jax.Array, axis, compressor, key):
  """Row block ``m`` of ``rows`` ``[M, r, c]`` sent to worker ``m`` of ``axis`` (``M``
  workers), each of its ``r`` rows encoded by ``compressor``, in one all-to-all of packed
  words: ``(payloads [M·r, ...] received, block m from worker m; the payloads sent;
  empty state; like)``."""
  m, r, c = rows.shape
  payloads, empty, like = _encode_rows(compressor, rows.reshape(m * r, c), key)
  words, unpack = to_words(payloads, batch_dims=1)
  received = coll.all_to_all(words.reshape(m, r, -1), axis).reshape(m * r, -1)
  return unpack(received), payloads, empty, like


def _exchange_rows(rows: jax.Array, axis, compressor, key) -> jax.Array:
  """``[M, r, c]`` float32: what :func:`_all_to_all_encoded` received, decoded."""
  received, _, empty, like = _all_to_all_encoded(rows, axis, compressor, key)
  decoded = jax.vmap(lambda pl: compressor.decode(pl, empty, like))(received)
  return decoded.astype(jnp.float32).reshape(rows.shape)


def scatter_mean_hierarchical(rows: jax.Array, axes, compressor, key=None) -> jax.Array:
  """:func:`scatter_mean` over ``axes = (slow, fast)`` in two stages, as ZeRO++'s
  hierarchical qgZ: inside each ``fast`` group (a node) each local rank receives, encoded,
  its peers' rows for the owners that share its local index, and sums them in float32;
  then across ``slow`` each node's partial sums go, encoded again, to the owner's node,
  which sums them. Owner ``j = node·L + local`` (the tuple's index). Each coordinate is
  encoded twice; across the slow axis each worker sends ``L`` times fewer chunks than a
  flat all-to-all."""
  slow, fast = axes
  nodes, local = coll.axis_size(slow), coll.axis_size(fast)
  workers, c = rows.shape
  by_local = rows.reshape(nodes, local, c).transpose(1, 0, 2)       # [L, nodes, c]
  k1, k2 = (None, None) if key is None else (jax.random.fold_in(key, 2),
                                             jax.random.fold_in(key, 3))
  partial = jnp.sum(_exchange_rows(by_local, fast, compressor, k1), axis=0)   # [nodes, c]
  own = jnp.sum(_exchange_rows(partial[:, None, :].astype(rows.dtype), slow, compressor, k2),
                axis=(0, 1))
  return (own / workers).astype(rows.dtype)


HPZ_NAME = "commopt_zero_hpz"
"""The ``jax.ad_checkpoint.checkpoint_name`` of hpZ's secondary partition: a rematerialised
body that saves it (:data:`HPZ_POLICY`) gathers only inside the node in its backward pass."""

HPZ_POLICY = jax.checkpoint_policies.save_only_these_names(HPZ_NAME)


def _stage(x: jax.Array, axis, weights, grads, keys, hierarchical_axes=None) -> jax.Array:
  """``[A, m]`` from ``x`` ``[m]``: every worker of ``axis`` (``A`` of them) gives its ``x``
  (dense, or encoded by ``weights``); the backward pass gives worker ``j`` the mean over the
  workers of their cotangent's row ``j`` (dense, or encoded by ``grads``; in two encoded
  stages over ``hierarchical_axes`` when given)."""
  @jax.custom_vjp
  def run(v):
    return gather_shard(v, axis, weights, keys[0])

  def fwd(v):
    return run(v), None

  def bwd(_, ct):
    if hierarchical_axes is not None:
      return (scatter_mean_hierarchical(ct, hierarchical_axes, grads, keys[1]).astype(x.dtype),)
    return (scatter_mean(ct, axis, grads, keys[1]).astype(x.dtype),)

  run.defvjp(fwd, bwd)
  return run(x)


def _stage_feedback(x: jax.Array, residual: jax.Array, n: int, axis, weights, grads, keys):
  """:func:`_stage` (flat) with a worker-side error memory ``residual`` (``[N, c]``, this
  worker's own, of the whole leaf of ``n`` coordinates): the backward pass sends
  ``cotangent + residual`` encoded, and gives as ``residual``'s cotangent what the
  payloads did not carry (the new residual, which the caller takes from the gradient).
  The padding's memory stays zero (a sign sends ±scale for a zero there)."""
  @jax.custom_vjp
  def run(v, e):
    return gather_shard(v, axis, weights, keys[0])

  def fwd(v, e):
    return run(v, e), e

  def bwd(e, ct):
    mean, new = scatter_mean_feedback(ct, e, axis, grads, keys[1])
    real = (jnp.arange(new.size) < n).reshape(new.shape)
    return mean.astype(x.dtype), jnp.where(real, new, jnp.zeros_like(new))

  run.defvjp(fwd, bwd)
  return run(x, residual)


def _fold(key, i: int):
  return None if key is None else jax.random.fold_in(key, i)


def hpz_secondary(shard: jax.Array, axes, weights, grads, key) -> jax.Array:
  """hpZ's first stage: across ``slow`` each device gathers the shards (``[c]``, padding
  zeroed) of the owners that share its local index (encoded by ``weights``), its part of
  the node's secondary partition, ``[nodes, c]``; the backward pass takes the mean across
  nodes (encoded by ``grads`` when given)."""
  return _stage(shard, axes[0], weights, grads, (_fold(key, 0), _fold(key, 1)))


def hpz_whole(secondary: jax.Array, axes, grads, key) -> jax.Array:
  """hpZ's second stage: the flat leaf (``[N·c]``, owner ``j = node·L + local``) from this
  device's part of the secondary partition (``[nodes, c]``), gathered inside the node
  (``fast``, dense); the backward pass takes the mean inside the node."""
  local = coll.axis_size(axes[1])
  nodes, c = secondary.shape
  whole = _stage(secondary.reshape(-1), axes[1], None, grads, (None, _fold(key, 2)))
  return whole.reshape(local, nodes, c).transpose(1, 0, 2).reshape(-1)    # from [L, nodes·c]


def _gather_hpz(shard: jax.Array, axes, weights, grads, key) -> jax.Array:
  """The flat leaf in two stages, ZeRO++'s hpZ (:func:`hpz_secondary`, then
  :func:`hpz_whole`), the secondary partition between them named :data:`HPZ_NAME`. The
  gradient comes back the other way: a mean inside the node, then across nodes."""
  secondary = checkpoint_name(hpz_secondary(shard, axes, weights, grads, key), HPZ_NAME)
  return hpz_whole(secondary, axes, grads, key)


def mask_padding(shard: jax.Array, n: int, axis_name) -> jax.Array:
  """``shard`` (``[c]``) with the coordinates past the leaf's ``n`` zeroed: the padding gets
  no gradient, whatever a compressor sends for the zeros there (a sign sends ±scale), so
  global norms see none of it."""
  c = shard.shape[0]
  own = coll.axis_index(axis_name) * c + jnp.arange(c) < n
  return jnp.where(own, shard, jnp.zeros_like(shard))


def gather(shard: jax.Array, shape, axis_name, *, weights=None, grads=None,
           key: Optional[jax.Array] = None, hierarchical: bool = False,
           hpz: bool = False, residual: Optional[jax.Array] = None) -> jax.Array:
  """The whole leaf of ``shape`` from this worker's ``shard`` (``[c]``), differentiable.

  The forward pass all-gathers the shards (through ``weights`` when given); the
  backward pass turns each worker's cotangent of the whole leaf into the mean
  over the workers of the owner's chunk (through ``grads`` when given). Call it
  inside ``jax.shard_map`` over ``axis_name``, with ``shard`` varying over it.

  Args:
    shard: this worker's ``[c]`` coordinates (see :func:`shard_flat`).
    shape: the leaf's shape.
    axis_name: the data axis the leaf is sharded over.
    weights: None (dense) or a stateless compressor for the weight gather.
    grads: None (dense reduce-scatter) or a stateless compressor for the gradient.
    key: a key for compressors that draw random bits (folded per direction and row).
    hierarchical: with ``grads`` and ``axis_name = (slow, fast)``, the gradient goes in
      two encoded stages (:func:`scatter_mean_hierarchical`).
    hpz: with ``axis_name = (slow, fast)``, gather across ``slow`` (through ``weights``)
      into a secondary partition named :data:`HPZ_NAME`, then inside ``fast`` (dense);
      a body rematerialised under :data:`HPZ_POLICY` gathers only inside ``fast`` again.
    residual: with ``grads`` (flat), this worker's error memory of the leaf, ``[N, c]``:
      the gradient is sent as ``cotangent + residual``, and ``residual``'s cotangent is the
      new memory (so gather a leaf once per differentiated call).

  Returns:
    The leaf, ``shape`` in ``shard``'s dtype, varying over ``axis_name``.
  """
  shape = tuple(shape)
  n = int(np.prod(shape, dtype=np.int64))
  shard = mask_padding(shard, n, axis_name)
  if hpz:
    return unshard_flat(_gather_hpz(shard, axis_name, weights, grads, key), shape, shard.dtype)
  keys = (_fold(key, 0), _fold(key, 1))
  if residual is not None:
    return unshard_flat(_stage_feedback(shard, residual, n, axis_name, weights, grads, keys),
                        shape, shard.dtype)
  rows = _stage(shard, axis_name, weights, grads, keys,
                axis_name if hierarchical and grads is not None else None)
  return unshard_flat(rows, shape, shard.dtype)
