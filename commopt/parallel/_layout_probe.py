"""What tracing ``tx`` tells the step before anything runs (nothing is computed).

- :class:`Layout` and :func:`find_layout`: which optimizer-state leaves are
  per-worker, their partition specs, and whether ``tx`` reads the ``value``
  extra argument (:func:`reads_value`, optax's extra-args protocol).
- :func:`check_tx_axes`: ``tx`` reduces over the axes the step maps over,
  checked when the step is built.

The functions take the :class:`~commopt.DataParallel` as ``dp``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from commopt._src import base
from commopt.comm import _collectives as coll
from commopt.parallel import _layout as lay
from commopt.parallel import _placement as place


class Layout(NamedTuple):
  """Where the step's values live, for one parameter layout (see :meth:`DataParallel.layout`).

  Attributes:
    param_specs: a pytree like the parameters of their ``PartitionSpec``\\ s
      (over the mesh's non-data axes; replicated over the data axes).
    state_specs: a pytree like the optimizer state of ``PartitionSpec``\\ s:
      per-worker leaves lead with the data axes, e.g. ``P('data', None, 'model')``.
    per_worker: a pytree like the optimizer state of bools.
    state_treedef: the optimizer state's tree structure.
    reads_value: whether the optimizer's update reads the ``value`` extra
      argument (optax's extra-args protocol, e.g.
      ``optax.contrib.reduce_on_plateau``): only then does the step average
      the loss over the workers to hand it over.
    shard_local: whether ``tx`` runs on each device's shards of parameters
      sharded over model axes (:mod:`._shard_local_step`); False where they
      are whole, or where ``tx`` needs whole leaves.
  """
  param_specs: Any
  state_specs: Any
  per_worker: Any
  state_treedef: Any
  reads_value: bool = False
  shard_local: bool = False


def _unbound_axis(e: NameError) -> bool:
  """Whether ``e`` is commopt's :class:`~commopt.AxisNameError` or JAX's unbound-axis error
  (a collective of ``tx`` outside commopt's reductions, e.g. a ``jax.lax.psum`` of its own)."""
  return isinstance(e, base.AxisNameError) or "unbound axis name" in str(e)


def axis_error(dp, e: Exception) -> Exception:
  """The :class:`~commopt.AxisNameError` for a ``tx`` that reduces over an axis not mapped."""
  return base.AxisNameError(
      f"data_parallel: `tx` reduces over an axis the step does not map over. The step "
      f"maps over axis_name={dp.axis_name!r} of a mesh with axes "
      f"{tuple(dp.mesh.axis_names)}; give the transforms inside `tx` that axis_name. "
      f"({e})")


def _over_data_axes(dp, probe: Callable) -> Callable:
  """``probe`` in a ``shard_map`` manual over the data axes, replicated in and out."""
  return jax.shard_map(probe, mesh=dp.mesh, in_specs=(P(),), out_specs=P(),
                       axis_names=set(dp.axes))


def check_tx_axes(dp) -> None:
  """An :class:`~commopt.AxisNameError` now if ``tx`` reduces over an axis the step does
  not map over, found by tracing ``tx`` on one scalar parameter (nothing is computed).

  A ``tx`` that cannot run on that parameter (a ``multi_transform`` whose labels
  name the real parameters, ...) is checked when :meth:`layout` first traces it.
  """
  tx, axes = optax.with_extra_args_support(dp.tx), dp.axes

  def probe(p):
    g = jax.tree.map(lambda x: coll.vary(x, axes), p)
    tx.update(g, tx.init(p), p)
    return jnp.zeros(())

  fn = _over_data_axes(dp, probe)
  try:
    with coll.inputs_unchecked():
      jax.eval_shape(fn, {"probe": jax.ShapeDtypeStruct((), jnp.float32)})
  except NameError as e:
    if not _unbound_axis(e):
      raise
    raise axis_error(dp, e) from None
  except Exception:   # noqa: BLE001 - anything else is the layout's to report, with params
    pass


def find_layout(dp, params) -> Layout:
  """:meth:`DataParallel.layout`: traced once per parameter shapes and specs, then cached."""
  param_specs = place.specs_of(dp, params, "parameter")
  flat_specs = jax.tree.leaves(param_specs, is_leaf=lay.is_spec)
  key = (jax.tree.structure(params),
         tuple((tuple(jnp.shape(x)), str(getattr(x, "dtype", None) or jnp.result_type(x)), s)
               for x, s in zip(jax.tree.leaves(params), flat_specs)))
  cached = dp._layouts.get(key)
  if cached is not None:
    return cached
  abstract = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x),
                                        sharding=NamedSharding(dp.mesh, s)),
      params, param_specs)
  if dp.shard_local is not False and any(e is not None for s in flat_specs for e in s):
    result = _shard_local_layout(dp, params, abstract, param_specs)
    if result is not None:
      dp._layouts[key] = result
      return result
  found = _trace_state(dp, abstract)
  by_shape = lay.specs_by_shape(params, param_specs)
  state_specs = [lay.stacked_spec(by_shape.get(tuple(shape), P(*[None] * len(shape))), dp.axes)
                 if m else by_shape.get(tuple(shape), P(*[None] * len(shape)))
                 for shape, m in zip(found["shapes"], found["mask"])]
  result = Layout(
      param_specs=param_specs,
      state_specs=jax.tree_util.tree_unflatten(found["treedef"], state_specs),
      per_worker=jax.tree_util.tree_unflatten(found["treedef"], found["mask"]),
      state_treedef=found["treedef"],
      reads_value=found["reads_value"])
  dp._layouts[key] = result
  return result


def _shard_local_layout(dp, params, abstract, param_specs) -> Layout | None:
  """The shard-local step's layout, or None (with a warning) where ``tx`` reduces a
  sharded leaf by itself, draws an array alike on every shard or fails on shards, and
  ``shard_local="auto"`` lets it run on whole leaves."""
  import warnings

  from commopt.parallel import _shard_probe
  try:
    found = _shard_probe.trace(dp, abstract, param_specs)
    fields = _shard_probe.layout_fields(dp, params, param_specs, found)
  except NameError as e:
    if not _unbound_axis(e):
      raise
    raise axis_error(dp, e) from None
  except (ValueError, TypeError) as e:
    if dp.shard_local is True:
      raise
    # A tx that cannot run on shards (a mask shaped like whole leaves, a callable
    # PowerSGD view) runs on whole leaves, as before there was a shard-local step.
    warnings.warn(
        f"data_parallel: `tx` does not run on the shards of parameters sharded over the model "
        f"axes ({e}); it runs on whole leaves instead, all-gathered over those axes. Pass "
        "shard_local=False to choose that quietly.", stacklevel=4)
    return None
  hazards = found["hazards"]
  if hazards:
    listed = "; ".join(str(h) for h in hazards[:4]) + (" ..." if len(hazards) > 4 else "")
    what = (f"`tx` computes over whole leaves ({listed}), which on a shard-local step would "
            "see only each device's shard of a parameter sharded over the model axes "
            f"{sorted(set(dp.mesh.axis_names) - set(dp.axes))}")
    if dp.shard_local is True:
      raise ValueError(
          f"data_parallel: shard_local=True, but {what}. Use transforms that work per "
          "element (optax.adam, sgd, lion, ...) and commopt's reductions, or "
          "shard_local='auto' to run such a `tx` on whole leaves (all-gathered over the "
          "model axes, at the whole model's memory and bytes).")
    warnings.warn(
        f"data_parallel: {what}; it runs on whole leaves instead, all-gathered over the "
        "model axes, so each model rank compresses and sends the whole leaf. Pass "
        "shard_local=False to choose that quietly.", stacklevel=4)
    return None
  return Layout(**fields, shard_local=True)


def _whole(dp, tree):
  """Inside the step: ``tree`` replicated over the non-data axes (the optimizer sees whole leaves)."""
  if not dp._other_axes:
    return tree
  return jax.tree.map(lambda x: jax.sharding.reshard(x, P(*[None] * jnp.ndim(x))), tree)


def _trace_state(dp, abstract) -> dict:
  """``tx.init`` and ``tx.update`` traced with local gradients to a fixed point: a state
  leaf is per-worker when its new value varies over the data axes.

  Returns ``{"treedef", "mask", "shapes", "reads_value"}`` of the state's leaves.
  """
  found = {}
  axes, opt = dp.axes, dp.optimizer

  def probe(p):
    p = _whole(dp, p)
    state = opt.init(p)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    grads = jax.tree.map(lambda x: coll.vary(x, axes), p)
    if dp.local_params:
      p = grads
    read = reads_value(opt, grads, state, p)
    extra = {} if read is None else {"value": jnp.zeros((), jnp.float32)}
    mask = [False] * len(leaves)
    new = leaves
    for _ in range(len(leaves) + 1):
      s = jax.tree_util.tree_unflatten(
          treedef, [coll.vary(l, axes) if m else l for l, m in zip(leaves, mask)])
      new = jax.tree.leaves(jax.eval_shape(lambda g, s: opt.update(g, s, p, **extra)[1],
                                           grads, s))
      seen = [m or lay.per_worker(x, axes) for x, m in zip(new, mask)]
      if seen == mask:
        break
      mask = seen
    found.update(treedef=treedef, mask=mask, shapes=[jnp.shape(x) for x in leaves],
                 reads_value=bool(read))
    return jnp.zeros(())

  fn = _over_data_axes(dp, probe)
  try:
    with coll.inputs_unchecked():
      jax.eval_shape(fn, abstract)
  except NameError as e:
    if not _unbound_axis(e):
      raise
    raise axis_error(dp, e) from None
  except (TypeError, ValueError) as e:
    if isinstance(e, TypeError) and "required keyword-only argument" in str(e):
      raise TypeError(
          f"data_parallel: `tx.update` needs an extra argument the step cannot supply when "
          f"it traces `tx` to find the state's layout (init): {e}. The step passes `value` "
          "(the workers' mean loss) itself; give any other extra argument a default, and "
          "pass its value to dp.step(..., name=value).") from e
    if "cond branches must have equal output types" in str(e):
      raise ValueError(
          "data_parallel: `tx` runs a lax.cond whose branches return per-worker state in "
          "one branch and replicated state in the other, which shard_map rejects (as "
          "optax.MultiSteps and optax.apply_if_finite do). Use commopt.transforms."
          "multi_steps / commopt.transforms.apply_if_finite (data_parallel already skips "
          "non-finite steps by agreement, skip_nonfinite=True).") from e
    raise
  return found


def update_with_value(tx, updates, state, params, value) -> tuple[Any, bool]:
  """``(tx.update(..., value=value), True)``, or ``(tx.update(...), False)`` for a ``tx``
  that takes no ``value`` keyword (a transform of the user's without extra arguments)."""
  try:
    return tx.update(updates, state, params, value=value), True
  except TypeError as e:
    if "unexpected keyword argument 'value'" not in str(e):
      raise
    return tx.update(updates, state, params), False


def reads_value(opt, grads, state, params) -> bool | None:
  """Whether ``opt.update`` reads the ``value`` extra argument (traced, nothing computed).

  The update is traced with ``value`` as an input of its own; it is read when
  some equation of the trace (or the output) uses that input. None when the
  update does not take it (see :func:`update_with_value`).
  """
  took = []

  def update(g, s, v):
    out, taken = update_with_value(opt, g, s, params, v)
    took.append(taken)
    return out

  closed = jax.make_jaxpr(update)(grads, state, jnp.zeros((), jnp.float32))
  if not took[-1]:
    return None
  var = closed.jaxpr.invars[-1]
  return (any(var is x for eqn in closed.jaxpr.eqns for x in eqn.invars)
          or any(var is x for x in closed.jaxpr.outvars))
