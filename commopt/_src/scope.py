"""Values offered to the transforms traced inside a ``with`` block (context variables).

A wrapper (``apply_if_finite``) offers a value to whichever transform inside it can use
it (a passenger for its all-reduce, a verdict to settle) without threading it through
``optax``'s update signature.
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
