"""Choosing between a kernel's pure-jnp reference and its Pallas kernel.

Every op in :mod:`commopt.kernels` takes ``implementation`` and ``interpret``:

- ``"xla"``: the pure-jnp reference, on any backend.
- ``"pallas"``: the Pallas kernel. On a GPU it is lowered through Triton; with
  ``interpret=True`` it runs on any backend through the Pallas interpreter
  (slow: for tests). Elsewhere it raises.
- ``"auto"``: the Pallas kernel on a GPU (or when ``interpret=True``) if it
  supports the arguments, the reference otherwise.
- ``None`` (the default): whatever the innermost :func:`implementation` scope
  says, ``"auto"`` outside any scope.

The compressors call the ops without these arguments, so a scope chooses the
implementation of a whole compressor: ``with implementation("xla"): ...``
runs every op inside on its reference, ``with implementation("pallas",
interpret=True): ...`` every op whose Pallas kernel supports the arguments on
that kernel (and the others on their references). Both give the same payload
bits: the references and the kernels compute the same codes, in the same order.

The kernels are written for the Triton lowering of ``pl.pallas_call``: the
arrays stay in global memory (no ``BlockSpec``), each program loads a
power-of-two chunk with a masked ``load`` and writes with a masked ``store``,
so sizes that are not a multiple of the chunk need no padding pass.

Whether a GPU can run them is decided in one place, :func:`capabilities`
(shown by :func:`commopt.kernels.info`): a GPU backend whose JAX still ships
the Pallas Triton lowering runs the kernels; otherwise ``"auto"`` runs the
references and logs why, once. No kernel is written for Mosaic GPU yet;
``info()`` says whether this machine could run one.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from typing import Iterator, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from commopt._src import vma

try:   # deprecated in JAX 0.11 and to be removed: the kernels need it on a GPU
  from jax.experimental.pallas import triton as plt
except ImportError:   # pragma: no cover - a JAX without the Triton lowering
  plt = None

_LOG = logging.getLogger("commopt.kernels")

IMPLEMENTATIONS = ("auto", "xla", "pallas")
PALLAS_BITS = (1, 2, 4, 8)
"""Code widths the Pallas pack kernels handle (a code never straddles a word)."""

_NUM_WARPS = 4


class Choice(NamedTuple):
  """The implementation an op uses when it is called without one."""
  implementation: str
  interpret: bool


# A process-wide setting, as jax.default_matmul_precision is: which kernels run is chosen
# once around a whole program (`commopt.kernels.implementation`), not passed to every
# compressor.
_CHOICE: contextvars.ContextVar[Choice] = contextvars.ContextVar(
    "commopt_kernels_implementation", default=Choice("auto", False))


def check_implementation(implementation, interpret, fn: str) -> None:
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"{fn}: `implementation` must be one of {IMPLEMENTATIONS}, got {implementation!r}.")
  if not isinstance(interpret, bool):
    raise ValueError(f"{fn}: `interpret` must be True or False, got {interpret!r}.")


@contextlib.contextmanager
def implementation(name: str, *, interpret: bool = False) -> Iterator[Choice]:
  """A scope in which every kernel op called without ``implementation`` uses ``name``.

  The compressors call the ops of :mod:`commopt.kernels` without choosing an
  implementation, so this picks it for whole compressors (and anything built
  on them). Inside ``implementation("pallas")`` an op whose Pallas kernel does
  not handle its arguments (e.g. 9-bit codes) runs its reference, as under
  ``"auto"``; an op called with ``implementation="pallas"`` itself raises
  instead. Explicit ``implementation`` and ``interpret`` arguments win over
  the scope; scopes nest, the innermost wins.

  The choice is read when an op is traced: a function that ``jax.jit`` traced
  outside the scope keeps its first trace inside it. Trace (or jit) the
  function inside the scope.

  Args:
    name: ``"auto"``, ``"xla"`` or ``"pallas"``.
    interpret: run the Pallas kernels through the Pallas interpreter (any
      backend; ``"pallas"`` off a GPU needs it).

  Yields:
    The :class:`Choice` in force inside the scope.

  Raises:
    ValueError: ``name`` is not one of the implementations, or ``interpret``
      is not a bool.

  Examples:
    >>> import jax, jax.numpy as jnp, commopt
    >>> from commopt import kernels
    >>> c = commopt.scaled_sign()
    >>> x = jnp.array([1.0, -3.0, 2.0])
    >>> with kernels.implementation("pallas", interpret=True):
    ...   fused = c.encode(x, None, None)[0]
    >>> with kernels.implementation("xla"):
    ...   reference = c.encode(x, None, None)[0]
    >>> fused["signs"].tolist() == reference["signs"].tolist()
    True
  """
  check_implementation(name, interpret, "implementation")
  choice = Choice(name, interpret)
  token = _CHOICE.set(choice)
  try:
    yield choice
  finally:
    _CHOICE.reset(token)


@functools.lru_cache(maxsize=None)
def capabilities(backend: Optional[str] = None) -> dict:
  """What the kernels can run on ``backend`` (the default backend if None), and why.

  The one capability check of the package: ``"native"`` is ``"triton"`` when
  the backend is a GPU and this JAX has the Pallas Triton lowering, else None,
  with ``"reason"`` saying why; ``"interpret"`` whether the Pallas interpreter
  can run the kernels (it needs the same Triton ``load``/``store`` ops);
  ``"mosaic_gpu"`` whether this machine could run Mosaic GPU kernels (a GPU of
  compute capability 9.0 or newer and the module present; none is written yet).
  """
  backend = backend or jax.default_backend()
  devices = jax.devices(backend)
  kind = devices[0].device_kind if devices else "none"
  capability = getattr(devices[0], "compute_capability", None) if devices else None
  try:
    from jax.experimental.pallas import mosaic_gpu  # noqa: F401
    has_mosaic = True
  except ImportError:   # pragma: no cover
    has_mosaic = False
  if backend != "gpu":
    native, reason = None, f"the {backend!r} backend has no Pallas GPU lowering: the references run"
  elif plt is None:
    native, reason = None, ("this JAX has no Pallas Triton lowering "
                            "(jax.experimental.pallas.triton): the references run")
  else:
    native, reason = "triton", "GPU backend with the Pallas Triton lowering"
  try:
    mosaic_ready = has_mosaic and capability is not None and float(capability) >= 9.0
  except (TypeError, ValueError):
    mosaic_ready = False
  return {
      "backend": backend, "device": kind, "compute_capability": capability,
      "native": native, "reason": reason, "interpret": plt is not None,
      "mosaic_gpu": {"could_run": mosaic_ready, "used": False,
                     "reason": "no commopt kernel is written for Mosaic GPU yet"},
  }


def info() -> dict:
  """Which implementation the kernel ops run on this machine, and why.

  Returns:
    A dict: ``backend``, ``device``, ``compute_capability``; ``native``
    (``"triton"`` where the Pallas kernels compile for the GPU, else None)
    and ``reason``; ``auto_runs`` (what an op called with ``"auto"`` runs);
    ``interpret`` (whether the Pallas interpreter can run the kernels);
    ``mosaic_gpu`` (whether this machine could run Mosaic GPU kernels; none is
    written yet, so they are never used); ``scope`` (the innermost
    :func:`implementation` scope's choice).

  Examples:
    >>> from commopt import kernels
    >>> facts = kernels.info()
    >>> facts["auto_runs"] in ("pallas (triton)", "xla reference")
    True
  """
  facts = dict(capabilities())
  facts["mosaic_gpu"] = dict(facts["mosaic_gpu"])
  facts["auto_runs"] = "pallas (triton)" if facts["native"] else "xla reference"
  facts["scope"] = current()._asdict()
  return facts


_WARNED: set = set()


def _warn_once(fn: str, reason: str) -> None:
  if (fn, reason) not in _WARNED:
    _WARNED.add((fn, reason))
    _LOG.warning("commopt.kernels.%s runs its reference: %s.", fn, reason)


def current() -> Choice:
  """The implementation (and interpret flag) of the innermost :func:`implementation` scope."""
  return _CHOICE.get()


def resolve(implementation: Optional[str], interpret: Optional[bool], fn: str,
            unsupported: str = "") -> tuple[bool, bool]:
  """``(run the Pallas kernel?, interpret?)`` for one call of an op.

  ``None`` for ``implementation`` or ``interpret`` takes the value of the
  innermost :func:`implementation` scope. ``unsupported`` says why the Pallas
  kernel cannot take the arguments ('' if it can): a scope's ``"pallas"``
  then falls back to the reference, an explicit ``"pallas"`` raises.
  """
  scope = _CHOICE.get()
  from_scope = implementation is None
  if from_scope:
    implementation = scope.implementation
  if interpret is None:
    interpret = scope.interpret
  check_implementation(implementation, interpret, fn)
  if implementation == "xla":
    return False, interpret
  caps = capabilities()
  runnable = caps["interpret"] if interpret else caps["native"] is not None
  if implementation == "auto" or (from_scope and unsupported):
    if unsupported:
      return False, interpret
    if not runnable and caps["backend"] == "gpu":
      _warn_once(fn, caps["reason"])
    return runnable, interpret
  if unsupported:
    raise ValueError(
        f"{fn}: implementation='pallas' {unsupported}; use implementation='xla' or 'auto'.")
  if not runnable:
    if caps["backend"] == "gpu" or interpret:
      raise ValueError(f"{fn}: implementation='pallas' cannot run here: {caps['reason']}; "
                       f"use implementation='xla' or 'auto'.")
    raise ValueError(
        f"{fn}: implementation='pallas' needs a GPU backend, got "
        f"{jax.default_backend()!r}; pass interpret=True (or use "
        f"kernels.implementation('pallas', interpret=True)) to run the kernel on CPU.")
  return True, interpret


def use_pallas(implementation: Optional[str], interpret: Optional[bool], fn: str,
               unsupported: str = "") -> bool:
  """Whether to run the Pallas kernel (see :func:`resolve`)."""
  return resolve(implementation, interpret, fn, unsupported)[0]


def check_pallas_bits(bits: int) -> str:
  """'' when the Pallas pack kernels handle ``bits``, else the reason they do not."""
  if bits in PALLAS_BITS:
    return ""
  return f"packs only {PALLAS_BITS} bits per code, got bits={bits}"


def call(kernel, out_shape, grid: int, interpret: bool, name: str):
  """``pl.pallas_call`` over a 1-D grid of whole-array refs, Triton-lowered on GPU.

  Inside ``jax.shard_map`` the outputs are typed varying over every mesh axis
  an input varies over (``pallas_call`` needs it said).
  """
  def run(*args):
    axes = frozenset().union(*(vma.varying_axes(a) for a in args))
    shapes = jax.tree.map(lambda s: vma.varying_struct(s.shape, s.dtype, axes), out_shape)
    return pl.pallas_call(
        kernel, out_shape=shapes, grid=(grid,), interpret=interpret, name=name,
        compiler_params=plt.CompilerParams(num_warps=_NUM_WARPS))(*args)
  return run


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
