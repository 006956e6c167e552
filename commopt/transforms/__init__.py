"""Optax transforms that reduce over a named axis with compression."""

from commopt.transforms._compressed_mean import (
    DEFAULT_MIN_SIZE,
    CompressedMeanState,
    compressed_mean,
    compresses,
)

__all__ = ["DEFAULT_MIN_SIZE", "CompressedMeanState", "compressed_mean", "compresses"]
