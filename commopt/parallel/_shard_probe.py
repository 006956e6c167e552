"""What tracing ``tx`` on one device's shards tells the shard-local step (nothing is computed).

The shard-local step (:mod:`._shard_local_step`) runs ``tx`` on each
device's block of every parameter, inside a ``shard_map`` manual over every
mesh axis. :func:`trace` finds, in one trace of ``tx.init`` and ``tx.update``
there:

- which optimizer-state leaves vary over the data axes (per worker) and over
  which model axes (sharded), to a fixed point, and so their partition specs
  (:func:`state_spec`);
- whether ``tx`` computes something over a whole leaf that a shard would
  get wrong (:func:`shard_hazards`): a reduction (sum, max, sort, a matrix
  product's contraction, ...) of a model-sharded value outside commopt's own
  shard-aware code, e.g. ``optax.clip_by_global_norm``'s norm or Muon's
  Newton-Schulz products. Such a ``tx`` runs on whole leaves instead
  (:mod:`._tensor_parallel_step`), or is refused with ``shard_local=True``.

The functions take the :class:`~commopt.DataParallel` as ``dp``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from commopt._src import compat, vma
from commopt.comm import _collectives as coll
from commopt.comm import _plan, _shards
from commopt.parallel import _layout as lay

REDUCING = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
    "reduce_xor", "reduce", "argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin",
    "cumlogsumexp", "sort", "top_k", "dot_general", "conv_general_dilated",
    "reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window",
    "select_and_scatter_add", "fft", "eigh", "svd", "qr", "cholesky", "triangular_solve",
    "lu", "householder_product"})
"""Primitives whose result mixes the elements of an operand: on a shard they see part of it."""

RANDOM = frozenset({"random_bits", "threefry2x32"})
"""Primitives that draw random bits: an array drawn from a key the shards share is the same
on every shard (noise that should differ between a leaf's blocks does not)."""


class Hazard(NamedTuple):
  """A computation of ``tx`` that a shard would get wrong."""
  primitive: str
  where: str

  def __str__(self) -> str:
    what = self.primitive + (" (an array drawn alike on every shard)"
                             if self.primitive in RANDOM else "")
    return f"{what} at {self.where}" if self.where else what


def _contracts(eqn) -> bool:
  if eqn.primitive.name != "dot_general":
    return True
  (lhs_contract, _), _ = eqn.params["dimension_numbers"]
  return bool(lhs_contract)


def shard_hazards(jaxpr, model_axes) -> list[Hazard]:
  """The reductions of a model-sharded value in ``jaxpr`` (sub-jaxprs included), and the
  random draws of arrays from keys every shard shares, outside commopt's shard-aware code
  (:data:`commopt._src.vma.SHARD_AWARE_SCOPE`)."""
  model_axes = frozenset(model_axes)
  found: list[Hazard] = []
  todo = [(jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr, False)]
  seen = set()
  while todo:
    j, inside = todo.pop()
    if (id(j), inside) in seen:
      continue
    seen.add((id(j), inside))
    for eqn in j.eqns:
      here = inside or vma.SHARD_AWARE_SCOPE in str(
          getattr(getattr(eqn, "source_info", None), "name_stack", ""))
      reduces = (eqn.primitive.name in REDUCING and _contracts(eqn)
                 and any(compat.varying_axes_of_type(getattr(v, "aval", None)) & model_axes
                         for v in eqn.invars))
      draws = (eqn.primitive.name in RANDOM
               and any(len(getattr(getattr(v, "aval", None), "shape", ())) > 1
                       or max(getattr(getattr(v, "aval", None), "shape", (0,)) or (0,)) > 2
                       for v in eqn.outvars)
               and not any(compat.varying_axes_of_type(getattr(v, "aval", None)) & model_axes
                           for v in eqn.invars))
      if not here and (reduces or draws):
        hazard = Hazard(eqn.primitive.name, compat.where_traced(eqn))
        if hazard not in found:
          found.append(hazard)
      for v in eqn.params.values():
        todo.extend((sub, here) for sub in _plan.subjaxprs(v))
  return found


def state_spec(path: str, shape, axes: frozenset, stacked: bool, params: list, dp):
  """The partition spec of a state leaf whose block here has ``shape`` and varies over
  the model ``axes`` (and over the data axes when ``stacked``).

  A leaf that mirrors a parameter (its path ends with the parameter's, or it
  is the only parameter with that block shape and those axes) takes the
  parameter's spec, so the saved state has the parameter's global shape.
  Any other leaf sharded over model axes is tiled on its first dimension.
  """
  spec = P(*[None] * len(shape))
  if axes:
    matches = [s for p, local, s in params
               if local == tuple(shape) and frozenset(vma.spec_axes(s)) == axes]
    by_path = [s for p, local, s in sorted(params, key=lambda t: -len(t[0]))
               if p and path.endswith(p) and local == tuple(shape)
               and frozenset(vma.spec_axes(s)) == axes]
    if by_path:
      spec = by_path[0]
    elif len(set(matches)) == 1:
      spec = matches[0]
    elif not shape:
      raise ValueError(
          f"data_parallel: optimizer-state leaf {path} is a scalar that differs between the "
          f"shards of model axes {sorted(axes)}; a shard-local step can only keep state "
          "with a dimension to shard. Pass shard_local=False to run `tx` on whole leaves.")
    else:
      order = [a for a in dp.mesh.axis_names if a in axes]
      spec = P(order[0] if len(order) == 1 else tuple(order), *[None] * (len(shape) - 1))
    spec = lay.full_spec(spec, len(shape))
  return lay.stacked_spec(spec, dp.axes) if stacked else spec


def trace(dp, abstract, param_specs) -> dict:
  """``tx.init`` and ``tx.update`` traced on the shards, to a fixed point of the state's
  varying axes (see the module). Returns ``{"treedef", "paths", "shapes", "axes",
  "stacked", "reads_value", "hazards"}``; ``axes`` are each state leaf's model axes."""
  from commopt.parallel import _layout_probe as probe
  found: dict = {}
  axes, opt = dp.axes, dp.optimizer
  model = frozenset(a for a in dp.mesh.axis_names if a not in axes)
  sizes = dict(dp.mesh.shape)

  def body(p):
    with _shards.model_sharding(param_specs, abstract, sizes):
      state = opt.init(p)
      flat, treedef = jax.tree_util.tree_flatten_with_path(state)
      leaves = [x for _, x in flat]
      grads = jax.tree.map(lambda x: coll.vary(x, axes), p)
      params = grads if dp.local_params else p
      read = probe.reads_value(opt, grads, state, params)
      extra = {} if read is None else {"value": jnp.zeros((), jnp.float32)}
      update = lambda g, s: opt.update(g, s, params, **extra)
      varying = [coll.varying_axes(x) for x in leaves]
      for _ in range(len(leaves) + 1):
        s = jax.tree_util.tree_unflatten(
            treedef, [coll.vary(x, tuple(sorted(v))) if v else x for x, v in zip(leaves, varying)])
        new = jax.tree.leaves(jax.eval_shape(lambda g, s: update(g, s)[1], grads, s))
        seen = [v | coll.varying_axes(x) for x, v in zip(new, varying)]
        if seen == varying:
          break
        varying = seen
      jaxpr = jax.make_jaxpr(update)(grads, s)
    found.update(treedef=treedef, paths=[lay.keystr(p) for p, _ in flat],
                 shapes=[tuple(jnp.shape(x)) for x in leaves],
                 axes=[frozenset(v) & model for v in varying],
                 stacked=[bool(set(v) & set(axes)) for v in varying],
                 reads_value=bool(read), hazards=shard_hazards(jaxpr, model))
    return jnp.zeros(())

  fn = jax.shard_map(body, mesh=dp.mesh, in_specs=(param_specs,), out_specs=P())
  with coll.inputs_unchecked():
    jax.eval_shape(fn, abstract)
  return found


def layout_fields(dp, params, param_specs, found) -> dict:
  """The :class:`~._layout_probe.Layout` fields of a shard-local trace."""
  sizes = dict(dp.mesh.shape)
  described = [(lay.keystr(path), _shards.local_shape(jnp.shape(x), spec, sizes), spec)
               for (path, x), spec in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                          jax.tree.leaves(param_specs, is_leaf=lay.is_spec))]
  specs = [state_spec(path, shape, axes, stacked, described, dp)
           for path, shape, axes, stacked in zip(found["paths"], found["shapes"], found["axes"],
                                                 found["stacked"])]
  unflat = lambda xs: jax.tree_util.tree_unflatten(found["treedef"], xs)
  return dict(param_specs=param_specs, state_specs=unflat(specs),
              per_worker=unflat(found["stacked"]), state_treedef=found["treedef"],
              reads_value=found["reads_value"])


def vary_to_specs(tree, specs) -> Any:
  """Inside the all-manual ``shard_map``: each leaf typed varying over every axis its spec
  names (a state leaf the same on every shard at ``init`` that the step keeps per shard)."""
  return lay.map_specs(lambda x, s: coll.vary(x, vma.spec_axes(s)) if vma.spec_axes(s)
                       else x, tree, specs)
