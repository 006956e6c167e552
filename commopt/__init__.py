"""commopt: communication-efficient optimizers for JAX.

Compressors are pure encode/decode pairs; :func:`compressed_mean` turns one
into an Optax transform that reduces over a named mesh axis with the packed
payload on the wire; :func:`data_parallel` builds a ``shard_map`` training
step around it; :mod:`commopt.wire` accounts for and audits the bytes.
"""

from commopt import aggregators, compressors, testing, wire
from commopt.aggregators import (
    CenteredClipState,
    RobustState,
    centered_clip,
    coordinate_median,
    geometric_median,
    krum,
    majority_vote,
    multi_krum,
    trimmed_mean,
)
from commopt._src.base import Compressor, EmptyState, Reduced
from commopt.compressors import (
    AdaCompState,
    GlobalCompressor,
    PowerSGDLeafState,
    RandomKState,
    adacomp,
    adaptive_levels,
    cast,
    gradient_dropping,
    identity,
    int_quant,
    natural,
    onebit,
    power_sgd,
    qsgd,
    random_k,
    scaled_sign,
    sign,
    terngrad,
    threshold,
    top_k,
    variance_balanced,
)
from commopt.parallel import DataParallel, data_parallel
from commopt.transforms import (
    DEFAULT_MIN_SIZE,
    CompressedMeanState,
    DGCState,
    compressed_mean,
    dgc,
    scheduled_top_k,
)

__version__ = "0.1.0"

__all__ = [
    "adacomp",
    "AdaCompState",
    "adaptive_levels",
    "aggregators",
    "cast",
    "centered_clip",
    "CenteredClipState",
    "compressed_mean",
    "CompressedMeanState",
    "Compressor",
    "compressors",
    "coordinate_median",
    "data_parallel",
    "DataParallel",
    "DEFAULT_MIN_SIZE",
    "dgc",
    "DGCState",
    "EmptyState",
    "geometric_median",
    "GlobalCompressor",
    "gradient_dropping",
    "identity",
    "int_quant",
    "krum",
    "majority_vote",
    "multi_krum",
    "natural",
    "onebit",
    "power_sgd",
    "PowerSGDLeafState",
    "qsgd",
    "random_k",
    "RandomKState",
    "Reduced",
    "RobustState",
    "scaled_sign",
    "scheduled_top_k",
    "sign",
    "terngrad",
    "testing",
    "threshold",
    "top_k",
    "trimmed_mean",
    "variance_balanced",
    "wire",
]
