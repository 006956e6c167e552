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

from commopt import (aggregators, comm, compressors, kernels, parallel, sim, testing, transforms,
                     wire)
from commopt._src.base import AxisNameError, Compressor, OptionTypeError
from commopt._src.errors import WireSizeWarning
from commopt.aggregators import majority_vote
from commopt.compressors import (cast, int_quant, power_sgd, qsgd, random_k, scaled_sign, sign,
                                 top_k)
from commopt.parallel import (DataParallel, ZeroDataParallel, data_parallel, local_value_and_grad,
                              zero_data_parallel)
from commopt.transforms import (apply_if_finite, compressed_mean, demo, diloco, local_sgd,
                                multi_steps, onebit_adam, streaming_diloco)

__version__ = "0.1.0"

# The core a newcomer learns first, sorted. Everything else lives in the subpackage that
# says what it is: every compressor in commopt.compressors, every transform (the other
# synchronisation modes, compressed optimizers, wrappers) and every state class in
# commopt.transforms, the robust rules in commopt.aggregators, the other training steps in
# commopt.parallel. A top-level name takes an optax name only where it is a drop-in
# replacement for optax's (apply_if_finite); commopt.compressors.identity is not one.
__all__ = [
    "aggregators", "apply_if_finite", "AxisNameError", "cast", "comm", "compressed_mean",
    "Compressor", "compressors", "data_parallel", "DataParallel", "demo", "diloco",
    "int_quant", "kernels", "local_sgd", "local_value_and_grad", "majority_vote", "multi_steps",
    "nnx_data_parallel", "onebit_adam", "OptionTypeError", "parallel", "power_sgd", "qsgd",
    "random_k", "scaled_sign", "sign", "sim", "streaming_diloco", "testing", "top_k",
    "transforms", "wire", "WireSizeWarning", "zero_data_parallel", "ZeroDataParallel",
]

_HOMES = {
    "compressors": (
        "AdaCompState CountSketchState PowerSGDLeafState RandomKState Reduced adacomp "
        "adaptive_levels atomo chunk_top_k count_sketch gradient_dropping natural onebit "
        "sketch_sgd sketchml terngrad threshold variance_balanced"),
    "transforms": (
        "ApplyIfFiniteState CompressedMeanState DEFAULT_MIN_SIZE DGCState EASGDState "
        "FetchSGDState HierarchicalLocalSGDState MultiStepsState OneBitAdamState "
        "OneBitLambState PeriodicState PipelinedState StaleState StreamingDiLoCoState "
        "ZeroOneAdamState dgc easgd fetch_sgd global_params onebit_lamb pipelined "
        "scheduled_top_k sfb_mean sparseloco stale zero_one_adam"),
    "aggregators": (
        "CenteredClipState RobustState centered_clip coordinate_median geometric_median krum "
        "multi_krum robust_aggregate trimmed_mean"),
    "parallel": (
        "EagerDiLoCo NnxDataParallel NnxTrainState OverlappedDataParallel OverlappedDiLoCo "
        "SFBLinear eager_diloco overlapped_data_parallel overlapped_diloco sfb_mask"),
}

MOVED = {
    "identity": ("commopt.compressors.identity",
                 "it left the top level, where it shadowed optax.identity"),
    "EmptyState": ("commopt.compressors.EmptyState", "a compressor's per-leaf empty state"),
    "GlobalCompressor": ("commopt.Compressor(..., encode_tree=..., decode_tree=...)",
                         "one Compressor class now declares tree-wide selection"),
    **{name: (f"commopt.{home}.{name}", "the top level keeps the core; the rest lives in the "
              "subpackage that says what it is")
       for home, names in _HOMES.items() for name in names.split()},
}
"""Public names that left the top level: ``{name: (new home, why)}`` (see CHANGELOG.md)."""


def __getattr__(name):
  # The nnx entry point imports flax on first use (see commopt.parallel).
  if name == "nnx_data_parallel":
    return getattr(parallel, name)
  if name in MOVED:
    home, why = MOVED[name]
    raise AttributeError(
        f"commopt.{name} moved to {home} ({why}); see CHANGELOG.md.", name=name, obj=None)
  raise AttributeError(f"module 'commopt' has no attribute {name!r}")
