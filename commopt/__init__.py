"""commopt: communication-efficient optimizers for JAX.

Compressors are pure encode/decode pairs; :func:`compressed_mean` turns one
into an Optax transform that reduces over a named mesh axis with the packed
payload on the wire; :func:`data_parallel` builds a ``shard_map`` training
step around it; :mod:`commopt.wire` accounts for and audits the bytes.

The package is built in layers; a module imports only from its own layer or
the ones below it (``tests/test_layering.py`` walks the import graph):

Layers, lowest first: _src < kernels < compressors < comm < transforms < aggregators < parallel < wire, testing, launch, elastic, checkpoint, sim

- ``_src``: the compressor protocol, argument checks, bit and block helpers.
- ``kernels``: bit packing and top-k selection, a jnp reference beside each
  Pallas kernel.
- ``compressors``: pure encode/decode pairs; they never communicate.
- ``comm``: the only code that calls collectives (``jax.lax.psum``,
  ``all_gather``, ...): ``None``-safe wrappers, the reduction strategies,
  the channel a compressor's own protocol runs over.
- ``transforms``: ``compressed_mean``, DGC, skip-on-non-finite and
  accumulation wrappers.
- ``aggregators``: majority vote, Byzantine-robust rules, attack models.
- ``parallel``: the data-parallel training step around an optimizer.
- ``wire`` and ``testing``: byte accounting and the HLO audit; simulated
  workers.
- ``launch``, ``elastic`` and ``checkpoint``: multi-process runs on one machine, restarted
  on the processes left when one dies; orbax
  checkpoints, restorable onto another number of workers.
- ``sim``: research models: an α-β cost model of collectives that prices a
  communication plan on a network.
"""

from commopt import aggregators, compressors, parallel, sim, testing, transforms, wire
from commopt.aggregators import (
    CenteredClipState,
    RobustState,
    centered_clip,
    coordinate_median,
    geometric_median,
    krum,
    majority_vote,
    multi_krum,
    robust_aggregate,
    trimmed_mean,
)
from commopt._src.base import AxisNameError, Compressor, OptionTypeError, Reduced
from commopt._src.errors import WireSizeWarning
from commopt.compressors import (
    AdaCompState,
    PowerSGDLeafState,
    RandomKState,
    adacomp,
    adaptive_levels,
    atomo,
    cast,
    chunk_top_k,
    count_sketch,
    CountSketchState,
    gradient_dropping,
    int_quant,
    natural,
    onebit,
    power_sgd,
    qsgd,
    random_k,
    scaled_sign,
    sign,
    sketch_sgd,
    sketchml,
    terngrad,
    threshold,
    top_k,
    variance_balanced,
)
from commopt.parallel import (
    DataParallel,
    EagerDiLoCo,
    eager_diloco,
    OverlappedDataParallel,
    OverlappedDiLoCo,
    overlapped_data_parallel,
    overlapped_diloco,
    ZeroDataParallel,
    data_parallel,
    local_value_and_grad,
    zero_data_parallel,
)
from commopt.transforms import (
    DEFAULT_MIN_SIZE,
    ApplyIfFiniteState,
    CompressedMeanState,
    MultiStepsState,
    apply_if_finite,
    multi_steps,
    DGCState,
    compressed_mean,
    demo,
    dgc,
    diloco,
    easgd,
    EASGDState,
    fetch_sgd,
    FetchSGDState,
    global_params,
    HierarchicalLocalSGDState,
    local_sgd,
    onebit_adam,
    OneBitAdamState,
    onebit_lamb,
    OneBitLambState,
    zero_one_adam,
    ZeroOneAdamState,
    PeriodicState,
    pipelined, PipelinedState,
    stale,
    StaleState,
    streaming_diloco,
    StreamingDiLoCoState,
    scheduled_top_k,
    sfb_mean,
    sparseloco,
)

__version__ = "0.1.0"

__all__ = [
    "adacomp",
    "AdaCompState",
    "adaptive_levels",
    "apply_if_finite",
    "ApplyIfFiniteState",
    "atomo",
    "AxisNameError",
    "aggregators",
    "cast",
    "chunk_top_k",
    "centered_clip",
    "CenteredClipState",
    "compressed_mean",
    "CompressedMeanState",
    "Compressor",
    "compressors",
    "count_sketch",
    "CountSketchState",
    "coordinate_median",
    "data_parallel",
    "EagerDiLoCo",
    "eager_diloco",
    "OverlappedDataParallel",
    "OverlappedDiLoCo",
    "overlapped_data_parallel",
    "overlapped_diloco",
    "DataParallel",
    "DEFAULT_MIN_SIZE",
    "demo",
    "dgc",
    "DGCState",
    "diloco",
    "global_params",
    "HierarchicalLocalSGDState",
    "easgd",
    "EASGDState",
    "fetch_sgd",
    "FetchSGDState",
    "geometric_median",
    "gradient_dropping",
    "int_quant",
    "krum",
    "local_sgd",
    "local_value_and_grad",
    "multi_steps",
    "MultiStepsState",
    "majority_vote",
    "multi_krum",
    "robust_aggregate",
    "natural",
    "nnx_data_parallel",
    "NnxDataParallel",
    "NnxTrainState",
    "onebit",
    "OptionTypeError",
    "WireSizeWarning",
    "parallel",
    "PeriodicState",
    "pipelined", "PipelinedState",
    "power_sgd",
    "PowerSGDLeafState",
    "qsgd",
    "random_k",
    "RandomKState",
    "Reduced",
    "RobustState",
    "scaled_sign",
    "sfb_mean",
    "sparseloco",
    "SFBLinear",
    "sfb_mask",
    "scheduled_top_k",
    "onebit_adam",
    "OneBitAdamState",
    "onebit_lamb",
    "OneBitLambState",
    "zero_one_adam",
    "ZeroOneAdamState",
    "sign",
    "sim",
    "sketch_sgd",
    "sketchml",
    "stale",
    "StaleState",
    "streaming_diloco",
    "StreamingDiLoCoState",
    "terngrad",
    "testing",
    "threshold",
    "top_k",
    "transforms",
    "trimmed_mean",
    "variance_balanced",
    "zero_data_parallel",
    "ZeroDataParallel",
    "wire",
]


MOVED = {
    "identity": ("commopt.compressors.identity",
                 "it left the top level, where it shadowed optax.identity"),
    "EmptyState": ("commopt.compressors.EmptyState", "a compressor's per-leaf empty state"),
    "GlobalCompressor": ("commopt.Compressor(..., encode_tree=..., decode_tree=...)",
                         "one Compressor class now declares tree-wide selection"),
}
"""Public names that left the top level: ``{name: (new home, why)}`` (see CHANGELOG.md)."""


def __getattr__(name):
  # The nnx entry points import flax on first use (see commopt.parallel).
  if name in parallel._NNX + parallel._SFB_NNX:
    return getattr(parallel, name)
  if name in MOVED:
    home, why = MOVED[name]
    raise AttributeError(
        f"commopt.{name} moved to {home} ({why}); see CHANGELOG.md.", name=name, obj=None)
  raise AttributeError(f"module 'commopt' has no attribute {name!r}")
