"""Deep Gradient Compression: momentum correction, local clipping, masking, warm-up."""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from commopt._src import base, tree
from commopt.compressors._sparse import METHODS, support
from commopt.compressors._topk import top_k
from commopt.comm import _collectives as coll
from commopt.comm import _plan
from commopt.transforms import _compressed_mean as cm
from commopt.transforms import _global_view

DGC_WARMUP_DENSITIES = (0.25, 0.0625, 0.015625, 0.004, 0.001)
"""DGC's warm-up: sparsity 75% → 93.75% → 98.4375% → 99.6% → 99.9%, as densities."""


class DGCLeafState(NamedTuple):
  """Per-leaf state of DGC's scheduled top-k.

  Attributes:
    count: steps taken (int32); it picks the warm-up stage.
    sent: boolean mask, leaf-shaped, of the coordinates sent at the last step.
  """
  count: jax.Array
  sent: jax.Array


class DGCState(NamedTuple):
  """State of :func:`dgc`.

  Attributes:
    count: number of updates so far (int32).
    velocity: the per-worker momentum ``u``, shaped like the updates.
    inner: the :class:`~commopt.transforms.CompressedMeanState` of the sparse exchange;
      its residual is DGC's accumulated velocity ``v``.
  """
  count: jax.Array
  velocity: Any
  inner: cm.CompressedMeanState


def _check_schedule(densities, boundaries) -> tuple[tuple[float, ...], tuple[int, ...]]:
  given = densities
  if np.ndim(densities) == 0:   # one value (a number, or a string that is none)
    densities = (densities,)
  densities = tuple(densities)
  rule = "a fraction in (0, 1] or a non-empty sequence of them"
  wrong = [d for d in densities if not base.is_real_number(d)]
  if wrong:
    raise base.OptionTypeError(
        f"dgc: `densities` must be {rule}, got {given!r} ({wrong[0]!r}, a "
        f"{type(wrong[0]).__name__}, is not a number); pass numbers such as 0.01.")
  bad = [d for d in densities if not _is_fraction(d)]
  if not densities or bad:
    raise ValueError(
        f"dgc: `densities` must be {rule}, got {densities!r}"
        + (f" ({bad[0]!r} is not)." if bad else "."))
  try:
    boundaries = tuple(boundaries)
  except TypeError:
    raise base.OptionTypeError(
        f"dgc: `boundaries` must be a sequence of steps, got {boundaries!r} "
        f"({type(boundaries).__name__}); pass e.g. (1000,) for two densities.") from None
  if len(boundaries) != len(densities) - 1:
    raise ValueError(
        f"dgc: `boundaries` must hold one step per change of density, "
        f"len(densities) - 1 = {len(densities) - 1} of them, got {boundaries!r}.")
  for b in boundaries:
    base.check_positive_int("boundaries", b, fn="dgc")
  if any(b >= c for b, c in zip(boundaries, boundaries[1:])):
    raise ValueError(f"dgc: `boundaries` must increase strictly, got {boundaries!r}.")
  return tuple(float(d) for d in densities), tuple(int(b) for b in boundaries)


def _is_fraction(value) -> bool:
  try:
    return 0.0 < float(value) <= 1.0
  except (TypeError, ValueError):
    return False


def warmup_density(step: int, densities: float | Sequence[float] = DGC_WARMUP_DENSITIES,
                   boundaries: Sequence[int] = (1, 2, 3, 4)) -> float:
  """The density :func:`dgc` sends at ``step`` (counted from 0).

  ``densities[i]`` holds from ``boundaries[i - 1]`` (inclusive) until
  ``boundaries[i]``; the last density holds from the last boundary on.

  Examples:
    >>> from commopt.transforms._dgc import warmup_density
    >>> [warmup_density(s, (0.25, 0.01), (10,)) for s in (0, 9, 10, 99)]
    [0.25, 0.25, 0.01, 0.01]
  """
  densities, boundaries = _check_schedule(densities, boundaries)
  return densities[int(np.searchsorted(boundaries, step, side="right"))]


def scheduled_top_k(densities: float | Sequence[float], boundaries: Sequence[int] = (),
                    *, method: str = "exact") -> base.Compressor:
  """Top-k whose density follows a step schedule, recording what it sent.

  Each stage is :func:`~commopt.top_k` with its own static ``k``; the step
  switches between them (``lax.switch``), so every stage puts only its own
  payload on the wire. The per-leaf :class:`DGCLeafState` counts steps and
  keeps the mask of the coordinates sent, for momentum factor masking.
  ``payload_bits`` is the last stage's (the steady state), and ``encode`` /
  ``decode`` on their own run the last stage.

  Args:
    densities: a density in (0, 1], or one per stage.
    boundaries: the steps at which each next stage begins, strictly
      increasing, ``len(densities) - 1`` of them.
    method: ``top_k``'s selection, ``"exact"`` or ``"sample"``.

  Returns:
    A :class:`~commopt.Compressor` with a ``reduce`` hook.

  Examples:
    >>> import jax.numpy as jnp, commopt
    >>> from commopt.transforms._dgc import scheduled_top_k
    >>> tx = commopt.compressed_mean(scheduled_top_k((0.5, 0.25), (1,)), min_size=0)
    >>> state = tx.init({"w": jnp.zeros(8)})
    >>> for _ in range(2):
    ...   out, state = tx.update({"w": jnp.arange(1.0, 9.0)}, state)
    ...   print(int(jnp.count_nonzero(out["w"])))
    4
    2

  References:
    Lin et al., Deep Gradient Compression, ICLR 2018 (the warm-up schedule).
  """
  densities, boundaries = _check_schedule(densities, boundaries)
  base.check_choice("method", method, METHODS, "scheduled_top_k")
  stages = [top_k(d, method=method) for d in densities]
  last = stages[-1]

  def init(leaf):
    return DGCLeafState(count=jnp.zeros([], jnp.int32), sent=jnp.zeros(leaf.shape, bool))

  def stage_reduce(compressor, key, channel):
    def run(x):
      payload, _ = compressor.encode(x, base.EmptyState(), key)
      mean, local = channel.exchange(payload, lambda pl: compressor.decode(pl, None, x),
                                     linear=False,
                                     add=lambda acc, pl: compressor.add_decoded(acc, pl, None, x))
      return mean.astype(x.dtype), local, support(payload["indices"], x)
    return run

  def reduce(x, state, key, channel):
    stage = jnp.sum(state.count >= jnp.asarray(boundaries, jnp.int32)) if boundaries else 0
    branches = [stage_reduce(c, key, channel) for c in stages]
    mean, local, sent = jax.lax.switch(stage, branches, x)
    return base.Reduced(mean=mean, local=local,
                        state=DGCLeafState(count=optax.safe_int32_increment(state.count),
                                           sent=sent))

  def encode(x, state, key):
    payload, _ = last.encode(x, base.EmptyState(), key)
    return payload, DGCLeafState(count=optax.safe_int32_increment(state.count),
                                 sent=support(payload["indices"], x))

  name = "scheduled_top_k(" + ", ".join(f"{d:g}" for d in densities) + ")"
  return base.Compressor(name=name, init=init, stateful=True, encode=encode,
                         decode=lambda payload, state, like: last.decode(payload, None, like),
                         payload_bits=last.payload_bits, reduce=reduce,
                         reduce_collective="all-gather")


def dgc(*, axis_name: Optional[str] = None,
        densities: float | Sequence[float] = 0.001, boundaries: Sequence[int] = (),
        momentum: float = 0.9, nesterov: bool = False, clip_norm: Optional[float] = None,
        method: str = "exact", min_size: int = cm.DEFAULT_MIN_SIZE,
        seed: int = 0) -> optax.GradientTransformationExtraArgs:
  """Deep Gradient Compression: momentum SGD's direction, sent as top-k.

  Per worker, with gradient ``g``, velocity ``u`` and accumulation ``v``::

    g ← clip(g, clip_norm / √N)            local gradient clipping
    u ← m·u + g                            momentum correction: the velocity,
    v ← v + u                              not the gradient, is accumulated
    send top-k(v);  v, u ← 0 where sent    momentum factor masking

  and the output is the mean over ``axis_name`` of the sent ``v``. With
  ``nesterov=True`` the accumulated quantity is ``g + m·u``. Momentum is
  inside, so chain it with a plain step: ``optax.chain(dgc(axis_name=...),
  optax.sgd(lr))``; weight decay goes before it
  (``optax.add_decayed_weights``). ``v`` is the error-feedback residual of a
  :func:`~commopt.compressed_mean` over :func:`scheduled_top_k`. Leaves with
  fewer than ``min_size`` elements are averaged dense, with ordinary
  (unmasked) momentum.

  Warm-up: ``densities[i]`` is sent from step ``boundaries[i - 1]`` on; e.g.
  ``densities=DGC_WARMUP_DENSITIES, boundaries=(e, 2e, 3e, 4e)`` with ``e``
  steps per epoch is the paper's exponential warm-up over four epochs. Each
  stage sends only its own ``k`` values and indices.

  Args:
    axis_name: the named axis to reduce over, or ``None`` for one worker.
    densities: the density sent, in (0, 1], or one per warm-up stage.
    boundaries: steps at which each next density begins, strictly increasing,
      ``len(densities) - 1`` of them.
    momentum: ``m``, in [0, 1).
    nesterov: use Nesterov momentum.
    clip_norm: if given (> 0), the global-norm threshold one would clip the
      summed gradient to; each worker clips its own at ``clip_norm / √N``.
    method: top-k selection, ``"exact"`` or ``"sample"`` (DGC's sampled
      threshold).
    min_size: leaves with fewer elements are sent dense.
    seed: seed of the base key (used by ``method="sample"``).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state :class:`DGCState`.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> from commopt.transforms._dgc import dgc
    >>> tx = optax.chain(dgc(densities=(0.5, 0.25), boundaries=(1,), min_size=0),
    ...                  optax.sgd(0.1))
    >>> params = {"w": jnp.zeros(8)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.arange(1.0, 9.0)}, state, params)
    >>> int(jnp.count_nonzero(updates["w"]))
    4

  References:
    Lin et al., Deep Gradient Compression: Reducing the Communication
    Bandwidth for Distributed Training, ICLR 2018.
  """
  densities, boundaries = _check_schedule(densities, boundaries)
  m = base.check_number("momentum", momentum, fn="dgc", low=0, high=1, low_open=False)
  nesterov = base.check_bool("nesterov", nesterov, fn="dgc")
  if clip_norm is not None:
    clip_norm = base.check_number("clip_norm", clip_norm, fn="dgc", low=0.0,
                                  what="None or a finite number > 0")
  min_size = base.check_int("min_size", min_size, fn="dgc", minimum=0)
  seed = base.check_int("seed", seed, fn="dgc")
  inner = cm.compressed_mean(scheduled_top_k(densities, boundaries, method=method),
                             axis_name=axis_name, min_size=min_size, seed=seed)

  def init_fn(params):
    return DGCState(count=jnp.zeros([], jnp.int32),
                    velocity=jax.tree.map(jnp.zeros_like, params),
                    inner=inner.init(params))

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    coll.check_input("dgc", updates, axis_name)
    if clip_norm is not None:
      limit = clip_norm / math.sqrt(coll.axis_size(axis_name))
      norm = base.safe_norm(jax.tree.leaves(updates))
      factor = jnp.minimum(1.0, limit / jnp.maximum(norm, jnp.finfo(jnp.float32).tiny))
      updates = jax.tree.map(lambda g: (g * factor).astype(g.dtype), updates)
    velocity = jax.tree.map(lambda u, g: (m * u + g).astype(u.dtype), state.velocity, updates)
    sent = (jax.tree.map(lambda u, g: (g + m * u).astype(u.dtype), velocity, updates)
            if nesterov else velocity)
    out, inner_state = inner.update(sent, state.inner)

    leaves, treedef = tree.flatten(velocity)
    masked = [u if not isinstance(cs, DGCLeafState) else jnp.where(cs.sent, 0, u)
              for (_, u), cs in zip(leaves, treedef.flatten_up_to(inner_state.compressor_state))]
    return out, DGCState(count=optax.safe_int32_increment(state.count),
                         velocity=jax.tree_util.tree_unflatten(treedef, masked),
                         inner=inner_state)

  # The plan is the inner reduction's: the steady-state (last) density's payload.
  return _plan.with_planner(
      _global_view.accepting(optax.GradientTransformationExtraArgs(init_fn, update_fn),
                             axis_name, "dgc"),
      _plan.planner_of(inner))
