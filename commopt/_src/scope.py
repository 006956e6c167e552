"""A context variable set for the code inside a ``with`` block.

commopt keeps three, each with a comment at its definition saying why it is not an
argument: the kernels' implementation (``kernels/_dispatch.py``), ``comm_plan``'s recorder
(``comm/_plan.py``) and what the step states about the values it traces
(``comm/_collectives.py``: model axes, the parameters' specs, whether the types are
real). ``tests/test_layering.py`` counts them.
"""

from __future__ import annotations

import contextlib
import contextvars


@contextlib.contextmanager
def bound(var: contextvars.ContextVar, value):
  """``var`` set to ``value`` inside the ``with`` block (and reset after it); yields ``value``."""
  token = var.set(value)
  try:
    yield value
  finally:
    var.reset(token)
