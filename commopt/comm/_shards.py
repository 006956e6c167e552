"""How parameters are sharded over the model axes, for reductions that need more than vma.

Inside a ``shard_map`` manual over every mesh axis, a value's type says
which axes it varies over (:func:`~commopt.comm._collectives.shard_axes`),
which is all an elementwise or norm-based method needs. A method that
reshapes a leaf (PowerSGD's matrix view) also needs which dimension each
model axis cuts: the leaf's ``PartitionSpec``. :func:`model_sharding` states
the parameters' specs for the code traced inside it (the shard-local step of
:func:`~commopt.data_parallel` enters it; so may a user's own ``shard_map``),
and :func:`specs_for` finds each leaf's spec.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, NamedTuple, Optional

import jax
from jax.sharding import PartitionSpec as P

from commopt._src import tree as tree_lib
from commopt._src.vma import spec_axes
from commopt.comm import _collectives as coll


class _Sharding(NamedTuple):
  specs: Any            # a pytree like the parameters, of PartitionSpecs
  treedef: Any
  flat: tuple           # the specs, flattened
  by_local: dict        # (local shape, shard axes) -> spec, where only one spec has them


def _is_spec(x) -> bool:
  return isinstance(x, P)


def local_shape(shape, spec, sizes: dict) -> tuple[int, ...]:
  """The shape of one device's block of a ``shape`` array sharded by ``spec``."""
  entries = list(spec) + [None] * (len(shape) - len(spec))
  return tuple(n // math.prod(sizes[a] for a in spec_axes((e,))) for n, e in zip(shape, entries))


@contextlib.contextmanager
def model_sharding(specs, shapes, mesh):
  """States the parameters' shardings over the model axes for the code traced inside.

  :func:`~commopt.data_parallel`'s shard-local step enters it around ``tx``;
  enter it yourself inside your own ``shard_map`` manual over the data and
  model axes, around ``tx.init`` and ``tx.update``. It declares the axes the
  specs name as model axes, so that a value varying over them is read as a
  shard of a leaf: whole-leaf quantities (LAMB's norms, the agreed
  non-finite skip, ``min_size``, ``top_k(shard_threshold="leaf")``) and
  independent random draws per shard follow, and PowerSGD's exact protocol
  reads the leaves' dimensions. Without it each shard is compressed as a
  leaf of its own.

  Args:
    specs: a pytree like the parameters of their ``PartitionSpec``\\ s over the
      model axes (no data axis).
    shapes: a pytree like the parameters of their global shapes (tuples), or
      of global arrays / ``ShapeDtypeStruct``\\ s.
    mesh: the ``jax.sharding.Mesh`` (or a dict of axis name -> size).

  Examples:
    >>> import jax, commopt
    >>> from jax.sharding import PartitionSpec as P
    >>> with commopt.comm.model_sharding({"w": P(None, "model")}, {"w": (4, 8)},
    ...                                  {"data": 2, "model": 4}):
    ...   pass
  """
  sizes = dict(mesh) if isinstance(mesh, dict) else dict(mesh.shape)
  flat, treedef = jax.tree_util.tree_flatten(specs, is_leaf=_is_spec)
  shape_leaves = jax.tree_util.tree_leaves(
      shapes, is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x))
  seen: dict = {}
  for spec, shape in zip(flat, shape_leaves):
    shape = tuple(shape) if isinstance(shape, tuple) else tuple(shape.shape)
    key = (local_shape(shape, spec, sizes), tuple(sorted(spec_axes(spec))))
    seen.setdefault(key, set()).add(spec)
  by_local = {k: next(iter(v)) for k, v in seen.items() if len(v) == 1}
  with coll.stating(sharding=_Sharding(specs, treedef, tuple(flat), by_local),
                    model_axes=frozenset(a for spec in flat for a in spec_axes(spec))):
    yield


def specs_for(updates, axis_name) -> list[Optional[P]]:
  """The spec of each leaf of ``updates`` (flattened keeping placeholders, as
  :func:`commopt._src.tree.flatten` does): ``P()`` for a leaf sharded over no
  model axis, the parameter's spec where known, None where the leaf is sharded
  over model axes whose dimensions are unknown (no :func:`model_sharding`, or
  a tree the parameters' structure does not match and a shape several
  parameters share)."""
  leaves = [x for _, x in tree_lib.flatten(updates)[0]]
  ctx = coll.traced().sharding
  if ctx is not None and jax.tree_util.tree_structure(
      updates, is_leaf=tree_lib.is_node) == ctx.treedef:
    return [P() if tree_lib.is_node(x) or not coll.shard_axes(x, axis_name) else s
            for x, s in zip(leaves, ctx.flat)]
  out = []
  for x in leaves:
    axes = () if tree_lib.is_node(x) else coll.shard_axes(x, axis_name)
    if not axes:
      out.append(P())
    elif ctx is None:
      out.append(None)
    else:
      out.append(ctx.by_local.get((tuple(x.shape), axes)))
  return out
