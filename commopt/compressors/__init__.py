"""Compressors: pure encode/decode pairs that never communicate."""

from commopt.compressors._basic import cast, identity
from commopt.compressors._lowrank import PowerSGDLeafState, power_sgd
from commopt.compressors._quantize import scaled_sign
from commopt.compressors._registry import DEFAULTS, REGISTRY, make
from commopt.compressors._sparsify import top_k

__all__ = ["DEFAULTS", "REGISTRY", "cast", "identity", "make", "power_sgd",
           "PowerSGDLeafState", "scaled_sign", "top_k"]
