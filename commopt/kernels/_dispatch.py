"""Choosing between a kernel's pure-jnp reference and its Pallas kernel.

Every op in :mod:`commopt.kernels` takes ``implementation`` and ``interpret``:

- ``"xla"``: the pure-jnp reference, on any backend.
- ``"pallas"``: the Pallas kernel. On a GPU it is lowered through Triton; with
  ``interpret=True`` it runs on any backend through the Pallas interpreter
  (slow: for tests). Elsewhere it raises.
- ``"auto"`` (the default): the Pallas kernel on a GPU (or when
  ``interpret=True``) if it supports the arguments, the reference otherwise.

The kernels are written for the Triton lowering of ``pl.pallas_call``: the
arrays stay in global memory (no ``BlockSpec``), each program loads a
power-of-two chunk with a masked ``load`` and writes with a masked ``store``,
so sizes that are not a multiple of the chunk need no padding pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

IMPLEMENTATIONS = ("auto", "xla", "pallas")
PALLAS_BITS = (1, 2, 4, 8)
"""Code widths the Pallas pack kernels handle (a code never straddles a word)."""

_NUM_WARPS = 4


def check_implementation(implementation, interpret, fn: str) -> None:
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"{fn}: `implementation` must be one of {IMPLEMENTATIONS}, got {implementation!r}.")
  if not isinstance(interpret, bool):
    raise ValueError(f"{fn}: `interpret` must be True or False, got {interpret!r}.")


def use_pallas(implementation: str, interpret: bool, fn: str, unsupported: str = "") -> bool:
  """Whether to run the Pallas kernel; ``unsupported`` says why it cannot ('' if it can)."""
  check_implementation(implementation, interpret, fn)
  if implementation == "xla":
    return False
  on_gpu = jax.default_backend() == "gpu"
  if implementation == "auto":
    return not unsupported and (on_gpu or interpret)
  if unsupported:
    raise ValueError(
        f"{fn}: implementation='pallas' {unsupported}; use implementation='xla' or 'auto'.")
  if not (on_gpu or interpret):
    raise ValueError(
        f"{fn}: implementation='pallas' needs a GPU backend, got "
        f"{jax.default_backend()!r}; pass interpret=True to run the kernel on CPU.")
  return True


def check_pallas_bits(bits: int) -> str:
  """'' when the Pallas pack kernels handle ``bits``, else the reason they do not."""
  if bits in PALLAS_BITS:
    return ""
  return f"packs only {PALLAS_BITS} bits per code, got bits={bits}"


def call(kernel, out_shape, grid: int, interpret: bool, name: str):
  """``pl.pallas_call`` over a 1-D grid of whole-array refs, Triton-lowered on GPU."""
  return pl.pallas_call(
      kernel, out_shape=out_shape, grid=(grid,), interpret=interpret, name=name,
      compiler_params=plt.CompilerParams(num_warps=_NUM_WARPS))


def chunk(ref, start, size: int, valid, other=0):
  """``ref[start:start+size]`` where ``valid``, ``other`` elsewhere (a masked load)."""
  return plt.load(ref.at[pl.ds(start, size)], mask=valid, other=other)


def put(ref, start, size: int, value, valid) -> None:
  """``ref[start:start+size] = value`` where ``valid`` (a masked store)."""
  plt.store(ref.at[pl.ds(start, size)], value, mask=valid)


def lanes(size: int, start=0, dtype=jnp.int32):
  """``start + [0, 1, ..., size)`` as a 1-D iota (Triton has no 2-D iota)."""
  return start + jnp.arange(size, dtype=dtype)


def check_block(block, fn: str, minimum: int = 32) -> int:
  """``block`` (elements per Pallas program) as a power of two >= ``minimum``."""
  if (isinstance(block, bool) or not isinstance(block, (int, np.integer))
      or block < minimum or block & (block - 1)):
    raise ValueError(
        f"{fn}: `block` must be a power of two >= {minimum}, got {block!r}.")
  return int(block)
