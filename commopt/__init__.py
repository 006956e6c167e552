"""commopt: communication-efficient optimizers for JAX.

Compressors are pure encode/decode pairs; :func:`compressed_mean` turns one
into an Optax transform that reduces over a named mesh axis with the packed
payload on the wire; :func:`data_parallel` builds a ``shard_map`` training
step around it; :mod:`commopt.wire` accounts for and audits the bytes.
"""

from commopt import compressors, testing, wire
from commopt._src.base import Compressor, EmptyState, Reduced
from commopt.compressors import (
    PowerSGDLeafState,
    cast,
    identity,
    power_sgd,
    scaled_sign,
    top_k,
)
from commopt.parallel import DataParallel, data_parallel
from commopt.transforms import (
    DEFAULT_MIN_SIZE,
    CompressedMeanState,
    compressed_mean,
)

__version__ = "0.1.0"

__all__ = [
    "Compressor",
    "CompressedMeanState",
    "DEFAULT_MIN_SIZE",
    "DataParallel",
    "EmptyState",
    "PowerSGDLeafState",
    "Reduced",
    "cast",
    "compressors",
    "compressed_mean",
    "data_parallel",
    "identity",
    "power_sgd",
    "scaled_sign",
    "testing",
    "top_k",
    "wire",
]
