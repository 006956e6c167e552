"""What every step body shares: its contract, the loss's output, the replicated-update
check and model state made the same on every worker.

A step body is one way of running the step for one kind of parameter layout
(:mod:`._replicated_step`, :mod:`._tensor_parallel_step`): a module with the
functions of :class:`StepBody`, picked by ``DataParallel._body``. The functions
here take the :class:`~commopt.DataParallel` as ``dp``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from commopt.comm import _collectives as coll
from commopt.parallel import _layout as lay
from commopt.parallel._layout import keystr

if TYPE_CHECKING:
  from commopt.parallel._layout_probe import Layout


class StepBody(Protocol):
  """The functions a step-body module defines (a module is a ``StepBody``).

  Both get the parameters and the state already placed by the layout
  (``DataParallel.init`` and ``step_fn`` place them, and place what they return).
  """

  def init(self, dp, layout: Layout, params) -> Any:
    """The optimizer state for ``params``: per-worker leaves stacked ``[num_workers, ...]``."""

  def step(self, dp, layout: Layout, params, opt_state, batch, model_state, key,
           extra_args) -> tuple[Any, Any, Any, Any]:
    """``(params, opt_state, metrics, model_state)`` after one step (``model_state`` is
    None without ``has_state``); the arguments are as :meth:`DataParallel.step_fn`'s."""


# -- the loss -----------------------------------------------------------------------------

def check_model_state(dp, model_state) -> None:
  """A ValueError unless ``model_state`` is given exactly when ``dp.has_state`` (a PRNG key
  given in its place is named as one: the key goes by name)."""
  fn = getattr(dp, "NAME", "data_parallel")
  if dp.has_state and model_state is None:
    raise ValueError(f"{fn}: has_state=True needs `model_state` in every step.")
  if not dp.has_state and model_state is not None:
    hint = ""
    if any(jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)
           for x in jax.tree.leaves(model_state)):
      hint = (" It is a PRNG key: the step's fourth argument is the model state, so pass "
              "the key by name, step(params, state, batch, key=key).")
    raise ValueError(
        f"{fn}: `model_state` was given but has_state=False; pass has_state=True and a "
        "loss_fn(params, model_state, batch) -> (loss, new_model_state)." + hint)


def checked_loss(dp, *args, **kwargs):
  """``loss_fn``, with its output checked against ``has_aux`` / ``has_state``.

  The model state (``has_state``: the second argument) is rebuilt here, inside the
  gradient's trace, where a Flax nnx model merged from it may update its variables
  (batch statistics, RNG counts): nnx refuses to mutate a variable made at another."""
  if dp.has_state:
    args = (args[0], jax.tree.map(lambda x: x, args[1]), *args[2:])
  out = dp.loss_fn(*args, **kwargs)
  fn = getattr(dp, "NAME", "data_parallel")
  pair = isinstance(out, (tuple, list)) and len(out) == 2
  if (dp.has_aux or dp.has_state) and not pair:
    flags = " and ".join(f for f in ("has_aux=True", "has_state=True") if getattr(dp, f[:-5]))
    want = ("(loss, (new_model_state, aux))" if dp.has_aux and dp.has_state
            else "(loss, new_model_state)" if dp.has_state else "(loss, aux)")
    raise ValueError(f"{fn}: with {flags}, `loss_fn` must return {want}; it "
                     f"returned {type(out).__name__}.")
  if dp.has_state and dp.has_aux and not (isinstance(out[1], (tuple, list))
                                          and len(out[1]) == 2):
    raise ValueError(f"{fn}: with has_aux=True and has_state=True, `loss_fn` must "
                     "return (loss, (new_model_state, aux)).")
  return out


def split_out(dp, value):
  """``(loss, aux, new_model_state)`` from what the loss returned."""
  loss, out = value if (dp.has_aux or dp.has_state) else (value, None)
  aux = new_ms = None
  if dp.has_state:
    new_ms, aux = out if dp.has_aux else (out, None)
  elif dp.has_aux:
    aux = out
  return loss, aux, new_ms


# -- replicas that stay the same ----------------------------------------------------------

def check_replicated(dp, tree, what="the update of parameter"):
  """A ValueError if a leaf of ``tree`` differs between workers (inside ``shard_map``)."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if lay.per_worker(leaf, dp.axes):
      raise ValueError(
          f"data_parallel: {what} {keystr(path)} differs between "
          f"workers on axis {dp.axis_name!r}, so the replicas would drift apart. "
          "`tx` must reduce over that axis after anything per-worker, e.g. "
          f"optax.chain(commopt.compressed_mean(c, axis_name={dp.axis_name!r}), optax.sgd(lr)); "
          "transforms that keep parameters per worker between synchronisations "
          "(commopt.local_sgd, commopt.diloco) need data_parallel(..., local_params=True).")


def sync_model_state(dp, new):
  """Inside ``shard_map``: averages model state that differs between workers
  (``model_state_sync='mean'``)."""
  return mean_model_state(new, dp.axes, dp.model_state_sync, dp.num_workers, "data_parallel")


def mean_model_state(new, axes, sync: str, workers: int, fn: str):
  """Inside ``shard_map`` over ``axes``: each floating-point leaf of ``new`` that differs
  between the ``workers`` averaged over them (one all-reduce each, in float32), the rest
  as it is; with ``sync="none"`` (or an integer leaf) a leaf that differs is refused."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(new)
  out = []
  for path, x in leaves:
    if not lay.per_worker(x, axes):
      out.append(x)
      continue
    if sync == "none" or not jnp.issubdtype(x.dtype, jnp.inexact):
      raise ValueError(
          f"{fn}: model state leaf {keystr(path)} ({x.dtype}) differs between "
          f"workers after the loss, and model_state_sync={sync!r} "
          + ("keeps model state replicated without communicating; use "
             "model_state_sync='mean' to average it." if sync == "none"
             else "can only average floating-point state."))
    out.append((coll.psum(x.astype(jnp.float32), axes) / workers).astype(x.dtype))
  return jax.tree_util.tree_unflatten(treedef, out)


def mean_over_workers(mesh, stacked):
  """Outside ``shard_map``: model state stacked ``[num_workers, ...]`` made one.

  Floating-point state is averaged over the workers; the rest (counters)
  advances the same way on every worker, so the first worker's is kept.
  """
  replicated = lambda x: jax.device_put(x, NamedSharding(mesh, P()))
  return jax.tree.map(
      lambda x: jnp.mean(x.astype(jnp.float32), 0).astype(x.dtype)
      if jnp.issubdtype(x.dtype, jnp.inexact) else replicated(x)[0], stacked)
