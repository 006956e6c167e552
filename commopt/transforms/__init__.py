"""Optax transforms that reduce over a named axis with compression."""

from commopt.transforms._compressed_mean import (
    DEFAULT_MIN_SIZE,
    CompressedMeanState,
    compressed_mean,
    compresses,
)
from commopt.transforms._dgc import (
    DGC_WARMUP_DENSITIES,
    DGCLeafState,
    DGCState,
    dgc,
    scheduled_top_k,
    warmup_density,
)

__all__ = ["DEFAULT_MIN_SIZE", "CompressedMeanState", "DGC_WARMUP_DENSITIES", "DGCLeafState",
           "DGCState", "compressed_mean", "compresses", "dgc", "scheduled_top_k",
           "warmup_density"]
