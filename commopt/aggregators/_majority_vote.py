"""signSGD with majority vote: workers send sign bits, everyone takes the vote."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from commopt import kernels
from commopt._src import base, tree, vma
from commopt._src import bits as bitops
from commopt._src.base import AxisName, check_axis_name
from commopt.comm import _collectives as coll
from commopt.comm import _plan
from commopt.transforms import _global_view


def _bitsliced_count(words: list[jax.Array]) -> list[jax.Array]:
  """Adds 1-bit lanes of each word: plane ``k`` holds bit ``k`` of every lane's count.

  Lane ``j`` of the result is the number of inputs whose bit ``j`` is set,
  written in binary across the planes. Only bitwise ops on whole words: 32
  coordinates are counted at once, and nothing is unpacked.
  """
  planes = [jnp.zeros_like(words[0]) for _ in range(len(words).bit_length())]
  for w in words:
    carry = w
    for k, plane in enumerate(planes):
      planes[k], carry = plane ^ carry, plane & carry
  return planes


def _compare(planes: list[jax.Array], threshold: int) -> tuple[jax.Array, jax.Array]:
  """Per lane: (count > threshold, count == threshold), as packed words."""
  ones = jnp.uint32(0xFFFFFFFF)
  greater = jnp.zeros_like(planes[0])
  equal = jnp.full_like(planes[0], ones)
  for k in reversed(range(len(planes))):
    if (threshold >> k) & 1:
      equal = equal & planes[k]
    else:
      greater = greater | (equal & planes[k])
      equal = equal & ~planes[k]
  return greater, equal


def vote_words(gathered: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The majority of ``N`` workers' packed sign words, ``[N, W]`` uint32.

  Returns:
    ``(negative, tie)``: packed words whose bit is set where more than half
    the workers sent a negative sign, and where exactly half did.
  """
  n = gathered.shape[0]
  greater, equal = _compare(_bitsliced_count([gathered[i] for i in range(n)]), n // 2)
  tie = equal if n % 2 == 0 else jnp.zeros_like(equal)
  return greater, tie


def majority_vote(*, axis_name: AxisName = None) -> optax.GradientTransformationExtraArgs:
  """signSGD with majority vote: the sign of the sum of the workers' signs.

  Each worker packs the signs of its update into bits (``⌈d/32⌉`` uint32
  words per leaf, as :func:`~commopt.sign` does) and all-gathers them. The
  vote is counted straight from the packed words: a bit-sliced adder sums 32
  coordinates per word operation and a bitwise comparison with ``N/2`` gives
  the majority, so the N workers' signs are never unpacked to floats; only
  the result is. Every float leaf is voted (there is no dense fallback: a
  dense leaf would not be on the same ±1 scale).

  Rules: a zero coordinate is sent as ``+1`` (as by :func:`~commopt.sign`).
  The output is ``sign(Σ_w s_w)`` with ``sign(0) = 0``: on a tie, possible
  only for an even number of workers, the coordinate does not move.

  Signum (signSGD with momentum) is each worker's momentum voted on::

    optax.chain(optax.trace(decay=0.9), majority_vote(axis_name="data"), optax.scale(-lr))

  The momentum stays per worker (``data_parallel`` keeps it so, sharded over
  the axis) and only sign bits cross the wire.

  Args:
    axis_name: the named axis to vote over, a tuple of axes whose workers
      all vote (``("node", "local")``: every device of a 2-D mesh), or
      ``None`` for one local worker (the output is then the sign of the
      input).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with no state
    (``optax.EmptyState``).

  Examples:
    >>> import jax, jax.numpy as jnp, commopt
    >>> tx = commopt.majority_vote(axis_name="workers")
    >>> g = jnp.array([[1.0, -2.0, 3.0], [-1.0, -1.0, 2.0], [2.0, 1.0, -5.0]])
    >>> vote = jax.vmap(lambda u: tx.update(u, tx.init(u))[0], axis_name="workers")
    >>> vote(g)[0].tolist()
    [1.0, -1.0, 1.0]

  References:
    Bernstein et al., signSGD: Compressed Optimisation for Non-Convex
    Problems, ICML 2018.
    Bernstein et al., signSGD with Majority Vote is Communication Efficient
    and Fault Tolerant, ICLR 2019.
  """
  axis_name = check_axis_name(axis_name, "majority_vote")

  def vote(path, u):
    if tree.is_node(u):
      return u
    base.check_float_leaf("majority_vote", path, u, verb="voted")
    n = base.leaf_size(u.shape)
    words = kernels.sign_bits(u.reshape(-1))
    negative, tie = vote_words(coll.all_gather(words, axis_name))
    neg = bitops.unpack(negative, n, 1).astype(jnp.float32)
    zero = bitops.unpack(tie, n, 1).astype(jnp.float32)
    return ((1.0 - 2.0 * neg) * (1.0 - zero)).reshape(u.shape).astype(u.dtype)

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    coll.check_input("majority_vote", updates, axis_name)
    with vma.shard_aware():   # a vote per coordinate: a shard's words are its own
      return jax.tree_util.tree_map_with_path(vote, updates, is_leaf=tree.is_node), state

  def plan(params, workers):
    sizes = _plan.axis_sizes(axis_name, workers)
    return [entry for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
            for entry in _plan.gather_plan(jax.tree_util.keystr(path), axis_name, sizes,
                                           4 * -(-base.leaf_size(leaf.shape) // 32), True)]

  return _plan.with_planner(
      _global_view.accepting(
          optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update_fn),
          axis_name, "majority_vote"), plan)
