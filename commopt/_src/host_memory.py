"""Host memory: freed heap memory reused from step to step instead of mapped afresh.

XLA:CPU allocates a step's temporary buffers at every execution and frees them at its end.
glibc's ``malloc`` serves a large request by ``mmap`` and unmaps it at ``free``, and trims
the heap's free top back to the system, so each step faults every page of its large
temporaries in again, where a buffer kept from the step before is written without a page
fault (``benchmarks/bench_base.py --host-memory system`` times the steps without the
settings below, beside the default ``reuse``). Three of glibc's own settings keep such
memory in the process: no ``mmap`` for large requests (``M_MMAP_MAX = 0``), no trimming
(``M_TRIM_THRESHOLD`` at its largest), and one arena for every thread
(``M_ARENA_MAX = 1``): a thread other than the main one otherwise allocates from an arena
of its own, whose heaps are at most 64 MB, and glibc maps any larger request afresh
whatever ``M_MMAP_MAX`` says. XLA's temporaries are one such request once a step's exceed
64 MB (DiLoCo's step on ``bench_network.py``'s 4.3M-parameter MLP with the agreed skip is
one; ``bench_network.py --host-memory system`` times it without these settings). The
process then keeps its peak heap for its lifetime, as a GPU runtime's caching allocator
does. The environment variables pass on to the processes a script starts.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import warnings
from typing import Mapping

MODES = ("reuse", "system")

_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8     # <malloc.h>
_NEVER_TRIM = 2**31 - 1                     # mallopt's largest (an int)

ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(_NEVER_TRIM), "MALLOC_ARENA_MAX": "1"}
"""The environment that asks glibc, at a process's start, for what :func:`reuse` sets."""

_log = logging.getLogger("commopt")


def users_own(parent: Mapping[str, str]) -> bool:
  """Whether ``parent`` holds a malloc setting of the user's: a ``MALLOC_*`` variable, or a
  ``glibc.malloc.*`` tunable in ``GLIBC_TUNABLES``."""
  return (any(k.startswith("MALLOC_") for k in parent)
          or "glibc.malloc." in parent.get("GLIBC_TUNABLES", ""))


def check_mode(mode, fn: str) -> str:
  if mode not in MODES:
    raise ValueError(f"{fn}: `host_memory` must be one of {MODES}, got {mode!r}.")
  return mode


def env_for(parent: Mapping[str, str], mode: str) -> dict:
  """The variables a launched process gets for ``mode`` (none for ``"system"``, or where
  ``parent`` already holds a malloc setting of the user's)."""
  if mode == "system" or users_own(parent):
    return {}
  return dict(ENV)


def reuse() -> bool:
  """Sets this process's glibc ``malloc`` to keep freed memory (no ``mmap`` for large
  requests, no trimming, one arena for every thread) from now on; False, with one log
  line, where the C library has no ``mallopt`` (not glibc) or refuses."""
  try:
    mallopt = ctypes.CDLL(None).mallopt
  except (OSError, AttributeError):
    _log.info("commopt: this C library has no mallopt; host memory is left as it is.")
    return False
  mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
  ok = (mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM) == 1
        and mallopt(_M_ARENA_MAX, 1) == 1)
  if not ok:
    _log.info("commopt: mallopt refused the host-memory settings; left as they are.")
  elif _jax_started():
    warnings.warn(
        "reuse_host_memory() was called after JAX started its runtime: its threads keep "
        "the malloc arenas they already have, so a step's temporaries above 64 MB are still "
        "mapped afresh at every step. Call it first thing, before JAX runs anything, or "
        "start the program with commopt.launch, which sets it in the environment.",
        stacklevel=3)
  return ok


def _jax_started() -> bool:
  """Whether JAX has started a backend in this process (without importing JAX)."""
  started = getattr(sys.modules.get("jax._src.xla_bridge"), "backends_are_initialized", None)
  try:
    return bool(started is not None and started())
  except Exception:   # a private JAX function: if it changes, say nothing rather than fail
    return False
