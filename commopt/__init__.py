"""commopt: communication-efficient optimizers for JAX.

Compressors are pure encode/decode pairs; :func:`compressed_mean` turns one
into an Optax transform that reduces over a named mesh axis with the packed
payload on the wire; :func:`data_parallel` builds a ``shard_map`` training
step around it; :mod:`commopt.wire` accounts for and audits the bytes.
"""

from commopt import aggregators, compressors, testing, wire
from commopt.aggregators import majority_vote
from commopt._src.base import Compressor, EmptyState, Reduced
from commopt.compressors import (
    PowerSGDLeafState,
    adaptive_levels,
    cast,
    identity,
    int_quant,
    natural,
    onebit,
    power_sgd,
    qsgd,
    scaled_sign,
    sign,
    terngrad,
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
    "adaptive_levels",
    "aggregators",
    "cast",
    "compressors",
    "compressed_mean",
    "data_parallel",
    "identity",
    "int_quant",
    "majority_vote",
    "natural",
    "onebit",
    "power_sgd",
    "qsgd",
    "scaled_sign",
    "sign",
    "terngrad",
    "testing",
    "top_k",
    "wire",
]
