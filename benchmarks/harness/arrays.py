"""Host arrays placed on the meshes of a multi-process job, each process giving its own part
(no collective)."""

from __future__ import annotations


def global_batch(mesh, rows):
  """This process's rows as one global array per leaf, sharded over the data axis."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(
      NamedSharding(mesh, P("data", *[None] * (np.ndim(x) - 1))), np.asarray(x)), rows)


def zeros_per_worker(mesh, params0):
  """Zeros like ``params0`` with a leading worker axis, sharded over ``mesh``'s data axis."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(
      NamedSharding(mesh, P("data")), np.zeros((1,) + np.shape(x), np.asarray(x).dtype)),
      params0)


def moved(tree, mesh, spec):
  """``tree`` (global arrays) on ``mesh``'s devices with ``spec``: each process copies its own
  shards to its device of ``mesh`` (one local copy per leaf, no collective)."""
  import jax
  from jax.sharding import NamedSharding
  mine = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
  return jax.tree.map(lambda a: jax.make_array_from_single_device_arrays(
      a.shape, NamedSharding(mesh, spec),
      [jax.device_put(s.data, mine) for s in a.addressable_shards]), tree)
