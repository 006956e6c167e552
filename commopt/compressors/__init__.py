"""Compressors: pure encode/decode pairs that never communicate.

One small module per family, each registering its factories beside them
(:func:`register`): ``_basic`` (identity, casts), ``_sign`` (sign, scaled
sign, 1-bit), ``_levels`` (TernGrad, QSGD, natural, int8/int4, adaptive
levels), ``_coding`` (QSGD's Elias coding cost), ``_sparse`` (sparse payload
primitives), ``_topk``, ``_chunked`` (chunked top-k, DeMo's DCT), ``_random``
(random-k, variance-balanced), ``_threshold`` (threshold, gradient dropping,
AdaComp), ``_lowrank`` (PowerSGD), ``_atomo`` (ATOMO), ``_sketch`` (count
sketch, SketchSGD) and ``_sketchml`` (SketchML).
"""

from commopt._src.base import CAPABILITIES, Compressor, EmptyState, Reduced
from commopt.compressors._atomo import atomo
from commopt.compressors._basic import cast, identity
from commopt.compressors._chunked import chunk_top_k
from commopt.compressors._coding import qsgd_coded_bits, qsgd_elias_bits
from commopt.compressors._levels import adaptive_levels, int_quant, natural, qsgd, terngrad
from commopt.compressors._lowrank import PowerSGDLeafState, power_sgd
from commopt.compressors._random import RandomKState, random_k, variance_balanced
from commopt.compressors._registry import (
    DEFAULTS,
    REGISTRY,
    VARIANTS,
    make,
    options,
    register,
    unregister,
)
from commopt.compressors._sign import onebit, scaled_sign, sign
from commopt.compressors._sketch import CountSketchState, count_sketch, sketch_sgd
from commopt.compressors._sketchml import sketchml
from commopt.compressors._threshold import AdaCompState, adacomp, gradient_dropping, threshold
from commopt.compressors._topk import top_k

__all__ = [
    "adacomp", "AdaCompState", "adaptive_levels", "atomo", "CAPABILITIES", "cast",
    "chunk_top_k", "Compressor", "count_sketch", "CountSketchState", "DEFAULTS",
    "EmptyState", "gradient_dropping", "identity", "int_quant", "make", "natural", "onebit",
    "options", "power_sgd", "PowerSGDLeafState", "qsgd", "qsgd_coded_bits",
    "qsgd_elias_bits", "random_k", "RandomKState", "Reduced", "register", "REGISTRY",
    "scaled_sign", "sign", "sketch_sgd", "sketchml", "terngrad", "threshold", "top_k",
    "unregister", "variance_balanced", "VARIANTS",
]


def __getattr__(name):
  if name == "GlobalCompressor":
    raise AttributeError(
        "commopt.compressors.GlobalCompressor is gone: a commopt.Compressor with "
        "encode_tree= and decode_tree= declares tree-wide selection (see CHANGELOG.md).",
        name=name, obj=None)
  raise AttributeError(f"module 'commopt.compressors' has no attribute {name!r}")
