"""Byzantine attack models, applied to chosen workers inside the same mapped step.

Attacks run where the aggregator runs (inside ``jax.shard_map`` or
``jax.vmap(..., axis_name=...)``): every worker calls the attack, and the
workers named in ``byzantine`` replace their update by the corrupted one,
the others pass theirs through. Omniscient attacks (ALIE, inner-product
manipulation) learn the honest workers' statistics with collectives over the
axis, as the threat model allows.

- :func:`apply_attack` corrupts an update pytree (a function);
- :func:`attack` is the same as an Optax transform, to chain before an
  aggregator: ``optax.chain(attack("alie", (0, 1), axis_name="data"), krum(2, axis_name="data"))``;
- :func:`bit_flip` corrupts packed payloads on the wire: pass it as the
  ``payload_attack`` of a robust aggregator used with a ``compressor``.

``byzantine`` is a tuple of worker indices, or a boolean mask of shape
``[n]`` (which may be a traced array, so one compiled step can sweep attacker
sets).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from commopt._src import base, tree
from commopt._src.base import AxisName, check_axis_name
from commopt.comm import _collectives as coll

KINDS = ("sign_flip", "gaussian", "scaled", "alie", "ipm")
"""The update attacks of :func:`apply_attack`."""

DEFAULTS = {"scale": -100.0, "sigma": 1.0, "z": 1.0, "epsilon": 0.1}
"""Default attack parameters."""


class AttackState(NamedTuple):
  """State of :func:`attack` (replicated).

  Attributes:
    count: number of updates so far (int32); the step key is
      ``fold_in(key, count)``.
    key: the base PRNG key (raw uint32[2]).
  """
  count: jax.Array
  key: jax.Array


def byzantine_mask(byzantine, n: int, fn: str = "attack") -> jax.Array:
  """A boolean ``[n]`` mask of the Byzantine workers.

  Args:
    byzantine: a sequence of distinct worker indices in ``[0, n)``, or a
      boolean array of shape ``[n]`` (possibly traced).
    n: the number of workers.
    fn: the caller's name, for error messages.

  Returns:
    A boolean ``jax.Array`` of shape ``[n]``.
  """
  if isinstance(byzantine, (jax.Array, np.ndarray)):
    if byzantine.shape != (n,) or byzantine.dtype != jnp.bool_:
      raise ValueError(
          f"{fn}: `byzantine` as an array must be a boolean mask of shape ({n},) (one "
          f"entry per worker), got {byzantine.dtype}{list(byzantine.shape)}.")
    return jnp.asarray(byzantine)
  try:
    idx = [int(i) for i in byzantine]
    bad = [i for i, j in zip(idx, byzantine) if isinstance(j, bool) or i != j]
  except (TypeError, ValueError):
    idx, bad = [], [byzantine]
  if bad or len(set(idx)) != len(idx) or any(not 0 <= i < n for i in idx):
    raise ValueError(
        f"{fn}: `byzantine` must be distinct worker indices in [0, {n}) or a boolean mask "
        f"of shape ({n},), got {byzantine!r}.")
  mask = np.zeros(n, bool)
  mask[idx] = True
  return jnp.asarray(mask)


def alie_z(n: int, f: int) -> float:
  """The ``z`` of Baruch et al.: ``Φ⁻¹((n − s)/n)`` with ``s = ⌊n/2 + 1⌋ − f``.

  The largest shift (in honest standard deviations) that still leaves the
  attackers inside the majority. It is 0 for ``n = 8, f = 1``, so studies
  often fix ``z = 1`` instead (the default of :func:`apply_attack`).
  """
  from statistics import NormalDist
  s = int(np.floor(n / 2 + 1)) - f
  return float(NormalDist().inv_cdf((n - s) / n))


def _honest_stats(u, honest, n_honest, axis_name, need_std: bool):
  """Mean (and std) over the honest workers of one leaf, with psums."""
  x = u.astype(jnp.float32)
  mean = coll.psum(jnp.where(honest, x, 0.0), axis_name) / n_honest
  if not need_std:
    return mean, None
  var = coll.psum(jnp.where(honest, jnp.square(x - mean), 0.0), axis_name) / n_honest
  return mean, jnp.sqrt(var)


def apply_attack(updates: Any, kind: str, *, axis_name: AxisName,
                 byzantine: Sequence[int] | jax.Array, key: Optional[jax.Array] = None,
                 scale: float = DEFAULTS["scale"], sigma: float = DEFAULTS["sigma"],
                 z: float = DEFAULTS["z"], epsilon: float = DEFAULTS["epsilon"]) -> Any:
  """Replaces the Byzantine workers' updates by corrupted ones.

  Call it on every worker inside the mapped step; workers not in
  ``byzantine`` get their update back unchanged. Per leaf, a Byzantine
  worker sends:

  - ``"sign_flip"``: ``−u``;
  - ``"gaussian"``: ``N(0, sigma²)`` noise in place of ``u`` (needs ``key``);
  - ``"scaled"``: ``scale · u`` (default ``−100``: a large update uphill);
  - ``"alie"`` (a little is enough): ``μ − z·σ`` with ``μ, σ`` the
    coordinate-wise mean and standard deviation of the honest updates;
  - ``"ipm"`` (inner-product manipulation): ``−epsilon · μ``.

  ALIE and IPM cost psums over the axis (the attackers' omniscience).

  Args:
    updates: this worker's update pytree (``None`` / ``optax.MaskedNode``
      leaves pass through).
    kind: one of :data:`KINDS`.
    axis_name: the named axis of the workers, or a tuple of axes (``None``: one
      worker, index 0).
    byzantine: the attackers' indices, or a boolean mask of shape ``[n]``.
    key: a PRNG key, the same on every worker (``"gaussian"`` folds in the
      worker index and the leaf number).
    scale: the factor of ``"scaled"``.
    sigma: the noise standard deviation of ``"gaussian"``.
    z: the shift of ``"alie"``, in honest standard deviations (see :func:`alie_z`).
    epsilon: the factor of ``"ipm"``.

  Returns:
    The update pytree this worker sends.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from commopt.aggregators.attacks import apply_attack
    >>> g = jnp.array([[1.0], [2.0], [3.0], [4.0]])
    >>> f = lambda u: apply_attack(u, "ipm", axis_name="w", byzantine=(3,), epsilon=0.5)
    >>> jax.vmap(f, axis_name="w")(g)[:, 0].tolist()
    [1.0, 2.0, 3.0, -1.0]

  References:
    Baruch, Baruch and Goldberg, A Little Is Enough: Circumventing Defenses
    for Distributed Learning, NeurIPS 2019 (ALIE).
    Xie, Koyejo and Gupta, Fall of Empires: Breaking Byzantine-tolerant SGD
    by Inner Product Manipulation, UAI 2020 (IPM).
  """
  fn = "apply_attack"
  if kind not in KINDS:
    raise ValueError(f"{fn}: `kind` must be one of {KINDS}, got {kind!r}.")
  if kind == "gaussian" and key is None:
    raise ValueError(f"{fn}: kind='gaussian' needs a PRNG `key`, got None.")
  axis_name = check_axis_name(axis_name, fn)
  n = coll.axis_size(axis_name)
  mask = byzantine_mask(byzantine, n, fn)
  index = coll.axis_index(axis_name)
  is_byz = mask[index]
  honest = ~is_byz
  n_honest = jnp.maximum(jnp.sum(~mask), 1).astype(jnp.float32)
  worker_key = None if key is None else jax.random.fold_in(key, index)

  def corrupt(i, u):
    if kind == "sign_flip":
      bad = -u.astype(jnp.float32)
    elif kind == "scaled":
      bad = scale * u.astype(jnp.float32)
    elif kind == "gaussian":
      bad = sigma * jax.random.normal(jax.random.fold_in(worker_key, i), u.shape, jnp.float32)
    else:
      mean, std = _honest_stats(u, honest, n_honest, axis_name, need_std=kind == "alie")
      bad = mean - z * std if kind == "alie" else -epsilon * mean
    return jnp.where(is_byz, bad.astype(u.dtype), u)

  leaves, treedef = jax.tree_util.tree_flatten(updates, is_leaf=tree.is_node)
  out = [u if tree.is_node(u) else corrupt(i, u) for i, u in enumerate(leaves)]
  return jax.tree_util.tree_unflatten(treedef, out)


def attack(kind: str, byzantine: Sequence[int] | jax.Array, *, axis_name: AxisName,
           seed: int = 0, **params) -> optax.GradientTransformationExtraArgs:
  """:func:`apply_attack` as an Optax transform, to chain before an aggregator.

  Args:
    kind: one of :data:`KINDS`.
    axis_name: the named axis of the workers, or a tuple of axes.
    byzantine: the attackers' indices, or a boolean mask of shape ``[n]``.
    seed: seed of the base key (the step key is ``fold_in(key, count)``).
    **params: ``scale``, ``sigma``, ``z`` or ``epsilon`` (see :func:`apply_attack`).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state :class:`AttackState`.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> from commopt.aggregators.attacks import attack
    >>> from commopt.aggregators import coordinate_median
    >>> tx = optax.chain(attack("scaled", (0,), axis_name="w"), coordinate_median(axis_name="w"))
    >>> g = jnp.array([[1.0], [2.0], [3.0]])
    >>> jax.vmap(lambda u: tx.update(u, tx.init(u))[0], axis_name="w")(g)[0].tolist()
    [2.0]

  References:
    Baruch et al., A Little Is Enough, NeurIPS 2019.
    Xie et al., Fall of Empires, UAI 2020.
  """
  base.check_choice("kind", kind, KINDS, "attack")
  seed = base.check_int("seed", seed, fn="attack")
  unknown = sorted(set(params) - set(DEFAULTS))
  if unknown:
    raise ValueError(
        f"attack: unknown parameter(s) {unknown}; valid are {sorted(DEFAULTS)}.")
  for name, value in params.items():
    base.check_number(name, value, fn="attack", low=-float("inf"), what="a finite number")

  def init_fn(params_):
    del params_
    return AttackState(count=jnp.zeros([], jnp.int32), key=jax.random.PRNGKey(seed))

  def update_fn(updates, state, params_=None, **extra_args):
    del params_, extra_args
    key = jax.random.fold_in(state.key, state.count)
    out = apply_attack(updates, kind, axis_name=axis_name, byzantine=byzantine, key=key,
                       **params)
    return out, AttackState(count=optax.safe_int32_increment(state.count), key=state.key)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _flip_words(words: jax.Array, key, rate: float) -> jax.Array:
  """XORs each bit of unsigned ``words`` with a Bernoulli(rate) bit."""
  width = jnp.iinfo(words.dtype).bits
  bits = jax.random.bernoulli(key, rate, words.shape + (width,))
  shifts = jnp.arange(width, dtype=words.dtype)
  noise = jnp.sum(bits.astype(words.dtype) << shifts, axis=-1, dtype=words.dtype)
  return words ^ noise


def bit_flip(byzantine: Sequence[int] | jax.Array, *, rate: float = 0.05,
             floats: bool = False):
  """A payload attack that flips random bits of the Byzantine workers' payloads.

  Returns a hook ``payload_attack(payload, *, key, axis_name) -> payload``
  for the robust aggregators' ``payload_attack=`` argument. Before the
  all-gather, each Byzantine worker XORs every bit of the unsigned-integer
  leaves of its payload (packed signs, levels, indices) with a
  Bernoulli(``rate``) bit; honest workers send theirs unchanged. Decoded
  values stay bounded by the payload's scales, so this models transmission
  corruption of compressed traffic. With ``floats=True`` the bits of float
  leaves (scales, dense leaves) are flipped too, through a bitcast; that can
  produce ``inf`` and ``NaN``, which no rule here filters.

  Args:
    byzantine: the attackers' indices, or a boolean mask of shape ``[n]``.
    rate: the probability each bit is flipped, in ``(0, 1]``.
    floats: also flip the bits of floating-point leaves.

  Returns:
    The hook.

  Examples:
    >>> import jax, jax.numpy as jnp, commopt
    >>> from commopt.aggregators.attacks import bit_flip
    >>> from commopt.aggregators import coordinate_median
    >>> tx = coordinate_median(axis_name="w", compressor=commopt.int_quant(block_size=None),
    ...                        payload_attack=bit_flip((2,), rate=0.5))
    >>> g = jnp.ones((3, 64))
    >>> out = jax.vmap(lambda u: tx.update(u, tx.init(u))[0], axis_name="w")(g)
    >>> bool(jnp.allclose(out, 1.0))
    True

  References:
    Xie, Koyejo and Gupta, Zeno: Distributed Stochastic Gradient Descent
    with Suspicion-based Fault-tolerance, ICML 2019 (bit-flip failures).
  """
  rate_ = base.check_number("rate", rate, fn="bit_flip", low=0.0, high=1.0, high_open=False,
                            what="a probability in (0, 1]")
  floats = base.check_bool("floats", floats, fn="bit_flip")

  def hook(payload, *, key, axis_name):
    n = coll.axis_size(axis_name)
    is_byz = byzantine_mask(byzantine, n, "bit_flip")[coll.axis_index(axis_name)]
    leaves, treedef = jax.tree_util.tree_flatten(payload)
    out = []
    for i, x in enumerate(leaves):
      k = jax.random.fold_in(key, i)
      if jnp.issubdtype(x.dtype, jnp.unsignedinteger):
        bad = _flip_words(x, k, rate_)
      elif floats and jnp.issubdtype(x.dtype, jnp.floating):
        utype = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[jnp.dtype(x.dtype).itemsize]
        bad = jax.lax.bitcast_convert_type(
            _flip_words(jax.lax.bitcast_convert_type(x, utype), k, rate_), x.dtype)
      else:
        out.append(x)
        continue
      out.append(jnp.where(is_byz, bad, x))
    return jax.tree_util.tree_unflatten(treedef, out)

  return hook


__all__ = ["AttackState", "DEFAULTS", "KINDS", "alie_z", "apply_attack", "attack",
           "bit_flip", "byzantine_mask"]
