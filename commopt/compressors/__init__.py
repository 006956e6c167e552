"""Compressors: pure encode/decode pairs that never communicate."""

from commopt._src.base import EmptyState
from commopt.compressors._basic import cast, identity
from commopt.compressors._lowrank import PowerSGDLeafState, power_sgd
from commopt.compressors._quantize import (
    adaptive_levels,
    int_quant,
    natural,
    onebit,
    qsgd,
    qsgd_coded_bits,
    qsgd_elias_bits,
    scaled_sign,
    sign,
    terngrad,
)
from commopt.compressors._registry import (
    DEFAULTS, REGISTRY, make, options, register, unregister)
from commopt.compressors._sparsify import (
    AdaCompState,
    GlobalCompressor,
    RandomKState,
    adacomp,
    gradient_dropping,
    random_k,
    threshold,
    top_k,
    variance_balanced,
)

__all__ = ["DEFAULTS", "EmptyState", "REGISTRY", "adaptive_levels", "cast", "identity", "int_quant",
           "make", "natural", "options", "register", "unregister", "onebit", "power_sgd", "PowerSGDLeafState", "qsgd",
           "qsgd_coded_bits", "qsgd_elias_bits", "scaled_sign", "sign", "terngrad", "top_k",
           "AdaCompState", "GlobalCompressor", "RandomKState", "adacomp", "gradient_dropping",
           "random_k", "threshold", "variance_balanced"]
