"""FetchSGD: momentum and error accumulation inside a count sketch."""

from __future__ import annotations

from typing import NamedTuple, Union

import jax
import jax.numpy as jnp
import optax

from commopt._src import base, tree
from commopt.comm import _collectives as coll
from commopt.comm import _plan
from commopt.compressors._sketch import (
    heavy_hitters,
    median_estimate,
    sketch,
    sketch_hashes,
    sketch_seeds,
)
from commopt.transforms._control import _check_axes
from commopt.transforms import _global_view

ZEROING = ("subtract", "buckets")


class FetchSGDState(NamedTuple):
  """State of :func:`fetch_sgd`, the same on every worker.

  Attributes:
    count: steps so far (int32).
    momentum: the momentum sketch ``S_u``, float32 ``[rows, cols]``.
    error: the error sketch ``S_e``, float32 ``[rows, cols]``.
  """
  count: jax.Array
  momentum: jax.Array
  error: jax.Array


def _flat_leaves(tree_):
  """``(leaves, treedef)`` with placeholders kept (:func:`commopt._src.tree.flatten`)."""
  leaves, treedef = tree.flatten(tree_)
  return [leaf for _, leaf in leaves], [path for path, _ in leaves], treedef


def fetch_sgd(learning_rate: Union[float, optax.Schedule], k: int, rows: int, cols: int,
              momentum: float = 0.9, *, axis_name, zeroing: str = "buckets",
              seed: int = 0) -> optax.GradientTransformationExtraArgs:
  """FetchSGD: SGD with momentum and error feedback carried out in count-sketch space.

  Every leaf's gradient is laid end to end in one vector of ``D`` coordinates
  and sketched (:func:`commopt.compressors._sketch.sketch`, fixed hashes drawn
  from ``seed``, the same on every worker). Per step, with workers' gradients
  ``g_w`` and sketch ``S(·)``::

    S   = mean_w S(g_w)              one all-reduce of [rows, cols] float32
    S_u ← ρ S_u + S                  momentum, in the sketch
    S_e ← S_e + lr · S_u             error accumulation, in the sketch
    Δ   = top-k of U(S_e)            U: median-of-rows estimate of all D coordinates
    S_u, S_e: Δ's buckets zeroed (``zeroing``)
    update = −Δ

  Since the sketch is linear, the mean of the workers' sketches is the sketch
  of the mean gradient, and the momentum and error live in the state (the
  same on every worker) instead of on each worker: a worker sends
  ``rows·cols`` floats per step whatever ``D`` and the number of workers, and
  keeps nothing of its own.

  ``zeroing`` takes the applied coordinates out of the sketches.
  ``"buckets"`` (the default, as the authors' code does) zeroes, in both
  sketches, every bucket a coordinate of Δ hashes to, forgetting whatever
  else shares those buckets too. ``"subtract"`` (Algorithm 1 of the paper)
  subtracts ``S(Δ)`` from ``S_e`` and the sketch of the momentum's estimate at
  Δ's coordinates from ``S_u``: nothing else is forgotten, but the estimates'
  error (about ``‖S_e‖/√cols`` per coordinate) stays in ``S_e`` and comes
  back later, and with a table much smaller than the model that error grows
  faster than the steps remove it. On the digits MLP (8970 weights, 8
  workers, 40 steps, learning rate 0.3) ``"subtract"`` diverged with each
  table smaller than the model that was tried (5×400, 5×600, 3×1000 and
  1×3000, k from 100 to 300), where ``"buckets"`` trained.

  Weight decay enters the gradient before the sketch:
  ``optax.chain(optax.add_decayed_weights(wd), fetch_sgd(...))``.

  Args:
    learning_rate: a float or an optax schedule of the step.
    k: coordinates updated per step, in ``[1, D]``.
    rows: hash rows of the sketch, >= 1.
    cols: buckets per row, >= 1.
    momentum: ρ, in [0, 1).
    axis_name: the data axis (a name or tuple of names), or None for one worker.
    zeroing: ``"buckets"`` or ``"subtract"``, as above.
    seed: seed of the hashes; the same on every worker.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; state :class:`FetchSGDState`.
    :func:`commopt.wire.comm_plan` gives its one all-reduce per step.

  Examples:
    >>> import jax, jax.numpy as jnp, commopt
    >>> tx = commopt.transforms.fetch_sgd(0.1, k=4, rows=5, cols=32, axis_name="data")
    >>> dp = commopt.data_parallel(lambda p, b: jnp.mean((b @ p["w"] - 1.0) ** 2), tx,
    ...                            jax.make_mesh((1,), ("data",)))
    >>> params = {"w": jnp.zeros(64)}
    >>> params, state, losses = dp.step(params, dp.init(params), jnp.eye(64)[:8])
    >>> int(jnp.count_nonzero(params["w"]))      # k coordinates moved
    4

  References:
    Rothchild, Panda, Ullah, Ivkin, Stoica, Braverman, Gonzalez and Arora,
    FetchSGD: Communication-Efficient Federated Learning with Sketching, ICML 2020.
    Charikar, Chen and Farach-Colton, Finding Frequent Items in Data Streams,
    ICALP 2002.
  """
  fn = "fetch_sgd"
  _check_axes(axis_name, fn)
  k = base.check_positive_int("k", k, fn=fn)
  rows = base.check_positive_int("rows", rows, fn=fn)
  cols = base.check_positive_int("cols", cols, fn=fn)
  momentum = base.check_number("momentum", momentum, fn=fn, low=0, high=1, low_open=False)
  base.check_choice("zeroing", zeroing, ZEROING, fn)
  if not callable(learning_rate):
    base.check_number("learning_rate", learning_rate, fn=fn, low=0, low_open=False)
  seed = base.check_int("seed", seed, fn=fn)

  def sizes_of(leaves, paths, what):
    sizes = []
    for path, leaf in zip(paths, leaves):
      if tree.is_node(leaf):
        sizes.append(0)
        continue
      base.check_float_leaf(fn, path, leaf, verb="sketched", what=what)
      sizes.append(base.leaf_size(jnp.shape(leaf)))
    total = sum(sizes)
    if k > total:
      raise ValueError(
          f"{fn}: `k` must be at most the number of coordinates sketched ({total}), got k={k}.")
    return sizes

  def init_fn(params):
    leaves, paths, _ = _flat_leaves(params)
    sizes_of(leaves, paths, "a parameter")
    zeros = jnp.zeros((rows, cols), jnp.float32)
    return FetchSGDState(count=jnp.zeros([], jnp.int32), momentum=zeros, error=zeros)

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    coll.check_input(fn, updates, axis_name)
    leaves, paths, treedef = _flat_leaves(updates)
    sizes = sizes_of(leaves, paths, "an update")
    seeds = sketch_seeds(jax.random.PRNGKey(seed), rows)
    flat = tree.concat_flat([leaf.reshape(-1).astype(jnp.float32)
                            for leaf, size in zip(leaves, sizes) if size])
    table = coll.pmean(sketch(flat, seeds, cols), axis_name)
    s_u = momentum * state.momentum + table
    lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
    s_e = state.error + lr * s_u
    values, indices = heavy_hitters(s_e, seeds, flat.shape[0], k)
    if zeroing == "subtract":
      s_e = s_e - sketch(values, seeds, cols, indices)
      s_u = s_u - sketch(median_estimate(s_u, seeds, indices), seeds, cols, indices)
    else:
      buckets, _ = sketch_hashes(seeds, indices, cols)
      hit = jnp.zeros((rows, cols), bool).at[jnp.arange(rows)[:, None], buckets].set(True)
      s_u, s_e = jnp.where(hit, 0.0, s_u), jnp.where(hit, 0.0, s_e)
    delta = jnp.zeros(flat.shape, jnp.float32).at[indices].set(values)
    out, start = [], 0
    for leaf, size in zip(leaves, sizes):
      if not size:
        out.append(leaf)
        continue
      out.append((-delta[start:start + size]).reshape(leaf.shape).astype(leaf.dtype))
      start += size
    return jax.tree_util.tree_unflatten(treedef, out), FetchSGDState(
        count=optax.safe_int32_increment(state.count), momentum=s_u, error=s_e)

  def planner(params, workers):
    sizes = _plan.axis_sizes(axis_name, workers)
    return [_plan.planned("<sketch>", "all-reduce", axis_name, _plan.total_workers(sizes),
                          rows * cols * 4, packed=True)]

  return _plan.with_planner(
      _global_view.accepting(optax.GradientTransformationExtraArgs(init_fn, update_fn),
                             axis_name, "fetch_sgd"), planner)
