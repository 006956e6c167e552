"""Optax transforms that reduce over a named axis with compression."""

from commopt.transforms._compressed_mean import (
    DEFAULT_MIN_SIZE,
    CompressedMeanState,
    compressed_mean,
    compresses,
)
from commopt.transforms._control import (
    ApplyIfFiniteState,
    MultiStepsState,
    apply_if_finite,
    multi_steps,
)
from commopt.transforms._delayed import PipelinedState, pipelined
from commopt.transforms._demo import demo
from commopt.transforms._dgc import (
    DGC_WARMUP_DENSITIES,
    DGCLeafState,
    DGCState,
    dgc,
    scheduled_top_k,
    warmup_density,
)
from commopt.transforms._fetchsgd import FetchSGDState, fetch_sgd
from commopt.transforms._onebit_adam import OneBitAdamState, onebit_adam
from commopt.transforms._onebit_lamb import OneBitLambState, onebit_lamb
from commopt.transforms._sfb import sfb_dense, sfb_mean, sfb_pays
from commopt.transforms._sync import (
    EASGDState,
    HierarchicalLocalSGDState,
    PeriodicState,
    StaleState,
    StreamingDiLoCoState,
    diloco,
    budget_top_k,
    easgd,
    fragment_of,
    global_params,
    is_sync_step,
    local_sgd,
    sparseloco,
    stale,
    streaming_diloco,
    sync_levels,
)
from commopt.transforms._zero_one_adam import ZeroOneAdamState, zero_one_adam

__all__ = ["ApplyIfFiniteState", "DEFAULT_MIN_SIZE", "CompressedMeanState",
           "DGC_WARMUP_DENSITIES", "EASGDState", "DGCLeafState", "DGCState",
           "HierarchicalLocalSGDState", "MultiStepsState", "OneBitAdamState", "PeriodicState",
           "apply_if_finite", "budget_top_k", "compressed_mean", "compresses", "demo", "dgc", "diloco",
           "fetch_sgd", "FetchSGDState",
           "easgd", "fragment_of", "global_params", "is_sync_step", "sync_levels",
           "local_sgd", "multi_steps", "sparseloco", "onebit_adam", "onebit_lamb", "OneBitLambState",
           "zero_one_adam", "ZeroOneAdamState", "stale", "StaleState", "streaming_diloco",
           "StreamingDiLoCoState",
           "scheduled_top_k", "sfb_dense", "sfb_mean", "sfb_pays", "warmup_density",
           "pipelined", "PipelinedState"]
