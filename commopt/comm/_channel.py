"""What a compressor's own multi-round protocol may do across the axis.

A compressor never communicates. One with a multi-round protocol (PowerSGD's
two all-reduces, a staged top-k's gathers) describes the rounds in its
``reduce(x, state, key, channel)`` and the :class:`Channel` it is handed
does the collectives, on one device, under ``jax.vmap`` and in ``shard_map``
alike. Every other compressor's payload crosses the axis by
:func:`commopt.comm._exchange.exchange` alone.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from commopt.comm import _collectives as coll
from commopt.comm import _exchange


@dataclasses.dataclass(frozen=True)
class Channel:
  """The collectives of one named axis (``None``: one local worker), and of the model
  axes a leaf's shard is cut on.

  Attributes:
    axis_name: the workers' axis.
    specs: per leaf handed to the protocol, its ``PartitionSpec`` over the model
      axes (``P()``: whole on this device; None: sharded, dimensions unknown), as
      :func:`~commopt.compressed_mean` hands it over; empty where nothing is sharded.
  """
  axis_name: Optional[str | tuple[str, ...]]
  specs: tuple = ()

  def spec(self, i: int = 0):
    """Leaf ``i``'s spec over the model axes (``P()`` when none is known to cut it)."""
    from jax.sharding import PartitionSpec as P
    return self.specs[i] if i < len(self.specs) else P()

  def shard_axes(self, x) -> tuple:
    """The model axes ``x`` is sharded over (:func:`~commopt.comm._collectives.shard_axes`)."""
    return coll.shard_axes(x, self.axis_name)

  def model_sum(self, x: jax.Array, axes: tuple) -> jax.Array:
    """Sum of ``x`` over the model ``axes`` (a leaf's partial sums made whole)."""
    return coll.psum(x, axes) if axes else x

  def model_max(self, x: jax.Array, axes: tuple) -> jax.Array:
    """Maximum of ``x`` over the model ``axes``."""
    return coll.pmax(x, axes) if axes else x

  def model_index(self, axes: tuple):
    """This device's linear index over the model ``axes`` (0 without any)."""
    return jax.lax.axis_index(axes) if axes else jnp.int32(0)

  def model_size(self, axes: tuple) -> int:
    return coll.axis_size(axes) if axes else 1

  def model_gather(self, x: jax.Array, axes: tuple, dim: int) -> jax.Array:
    """``x`` from every device of the model ``axes`` concatenated along ``dim``, in
    :meth:`model_index` order."""
    return coll.all_gather_tiled(x, tuple(axes), dim)

  def mean_split(self, x: jax.Array, axes: tuple, dim: int = -2) -> jax.Array:
    """The workers' mean of ``x``, which is the same on every device of the model
    ``axes``: each of them sends only its slice along ``dim`` across the workers' axis,
    then the slices are gathered over ``axes`` (whole ``x`` where ``dim`` does not divide)."""
    k = self.model_size(axes)
    dim = dim % x.ndim
    if k == 1 or x.shape[dim] % k:
      return self.mean(x)
    size = x.shape[dim] // k
    part = jax.lax.dynamic_slice_in_dim(x, self.model_index(axes) * size, size, axis=dim)
    return self.model_gather(self.mean(part), axes, dim)

  @property
  def size(self) -> int:
    """Workers on the axis (1 locally)."""
    return coll.axis_size(self.axis_name)

  def mean(self, x: jax.Array) -> jax.Array:
    """All-reduce mean of ``x`` in its dtype."""
    return coll.pmean(x, self.axis_name)

  def exchange(self, payload: Any, decode: Callable[[Any], Any], linear: bool,
               add: Optional[Callable[[Any, Any], Any]] = None):
    """Sends ``payload``; ``(mean, local)``: the workers' mean reconstruction and this one's.

    ``decode(payload)`` returns an array or a pytree of arrays; ``mean`` is
    float32. Linear payloads are all-reduced and decoded once; the others are
    all-gathered and summed decoded in one pass (``add(acc, payload)``, see
    :func:`exchange`).
    """
    return _exchange.exchange(payload, decode, "psum" if linear else "gather", self.axis_name,
                              add)
