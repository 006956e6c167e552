"""Periodic synchronisation: local SGD and DiLoCo, with compressed exchanges.

Each worker keeps its own parameters and steps them with the inner optimizer
on its own gradients; every ``period`` steps the workers exchange what they
moved since the last synchronisation (``anchor − local``, the pseudo-gradient),
reduce it through :func:`~commopt.compressed_mean` (any compressor, with error
feedback), and an outer optimizer applies the mean to the anchor, which every
worker then takes as its parameters. Between synchronisations nothing crosses
the axis: the exchange sits in a ``lax.cond`` on the step counter, which is
the same on every worker.

Local SGD is the outer optimizer ``sgd(1.0)``: the new anchor is the mean of
the workers' parameters. DiLoCo's default outer optimizer is Nesterov SGD
(learning rate 0.7, momentum 0.9) for dense exchanges, and ``sgd(1.0)``
where the exchange keeps an error-feedback residual, whose memory then
stands in for the outer momentum (SparseLoCo); :func:`diloco` says which
pairings of inner and outer optimizer are stable, and why.

The transforms output per-worker updates, so the parameters differ between
workers between synchronisations: run them under
``commopt.data_parallel(..., local_params=True)``, under ``jax.vmap`` over the
workers, or in your own ``shard_map`` with per-worker parameters.

One module a mode: ``_diloco`` (with :class:`PeriodicState`, which
:func:`local_sgd` shares), ``_local_sgd`` (with its hierarchical form),
``_streaming_diloco``, ``_sparseloco`` (DiLoCo with SparseLoCo's exchange), ``_easgd`` and
``_stale``; ``_common`` holds what they
share (the schedule, the exchange, the outer optimizer and the steps every
mode takes), ``_global_params`` reads the global model out of their states.
"""

from __future__ import annotations

from commopt.transforms._sync._common import _wide, is_sync_step  # _compressed_momentum uses _wide
from commopt.transforms._sync._diloco import PeriodicState, diloco
from commopt.transforms._sync._easgd import EASGDState, easgd
from commopt.transforms._sync._global_params import global_params
from commopt.transforms._sync._local_sgd import HierarchicalLocalSGDState, local_sgd, sync_levels
from commopt.transforms._sync._sparseloco import sparseloco
from commopt.transforms._sync._stale import (
    BUDGET_BYTES_PER_VALUE,
    STALENESS,
    StaleState,
    budget_top_k,
    stale,
)
from commopt.transforms._sync._streaming_diloco import (
    StreamingDiLoCoState,
    fragment_of,
    streaming_diloco,
)

__all__ = ["BUDGET_BYTES_PER_VALUE", "EASGDState", "HierarchicalLocalSGDState", "PeriodicState",
           "STALENESS", "StaleState", "StreamingDiLoCoState", "budget_top_k", "diloco", "easgd",
           "fragment_of", "global_params", "is_sync_step", "local_sgd", "sparseloco", "stale",
           "streaming_diloco", "sync_levels"]
