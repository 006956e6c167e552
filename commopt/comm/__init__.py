"""Communication: the one layer of commopt that moves data between workers.

- :mod:`commopt.comm._collectives`: collectives over a named axis that also
  run under ``jax.vmap`` and locally (``axis_name=None``); the only code that
  calls ``jax.lax``'s collectives. It also holds what the step states about its
  trace: the model axes and how parameters are sharded over them
  (:func:`model_sharding`), for methods that need a leaf's dimensions.
- :mod:`commopt.comm._strategies`: how compressed payloads cross an axis
  beyond a plain all-reduce or all-gather: ``two_phase`` (all-to-all of
  compressed chunks, re-compression, all-gather) and ``hierarchical`` (dense
  inside a fast axis, compressed across a slow one).
- :mod:`commopt.comm._exchange`: the payload exchange every reduction sends
  through (gathered payloads summed decoded in one pass, :func:`sum_decoded`),
  and the per-worker keys.
- :mod:`commopt.comm._channel`: the :class:`Channel` a compressor's own
  multi-round protocol (PowerSGD) is handed to do its collectives with.

Compressors never communicate; transforms and aggregators call this layer.
"""

from commopt.comm._channel import Channel
from commopt.comm._exchange import (
    exchange,
    sum_decoded,
    worker_key,
)
from commopt.comm._collectives import (
    after,
    all_gather,
    all_gather_tiled,
    all_to_all,
    axis_index,
    axis_size,
    bound_axis_size,
    cond,
    mean_factors,
    model_sharding,
    pmean,
    psum,
    psum_scatter,
    vary,
    vary_like,
    varying_axes,
)

__all__ = [
    "Channel",
    "model_sharding",
    "exchange",
    "sum_decoded",
    "worker_key",
    "after",
    "all_gather",
    "all_gather_tiled",
    "all_to_all",
    "axis_index",
    "axis_size",
    "bound_axis_size",
    "cond",
    "mean_factors",
    "pmean",
    "psum",
    "psum_scatter",
    "vary",
    "vary_like",
    "varying_axes",
]
