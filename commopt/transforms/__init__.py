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
from commopt.transforms._dgc import (
    DGC_WARMUP_DENSITIES,
    DGCLeafState,
    DGCState,
    dgc,
    scheduled_top_k,
    warmup_density,
)

from commopt.transforms._sync import (
    EASGDState,
    PeriodicState,
    StaleState,
    StreamingDiLoCoState,
    diloco,
    easgd,
    fragment_of,
    is_sync_step,
    local_sgd,
    stale,
    streaming_diloco,
)

__all__ = ["ApplyIfFiniteState", "DEFAULT_MIN_SIZE", "CompressedMeanState",
           "DGC_WARMUP_DENSITIES", "EASGDState", "DGCLeafState", "DGCState", "MultiStepsState", "PeriodicState",
           "apply_if_finite", "compressed_mean", "compresses", "dgc", "diloco", "easgd", "fragment_of", "is_sync_step",
           "local_sgd", "multi_steps", "stale", "StaleState", "streaming_diloco",
           "StreamingDiLoCoState",
           "scheduled_top_k", "warmup_density"]
