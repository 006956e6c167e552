"""The bundled digits as the network benchmarks use them: ``examples/digits_cnn.py``, every
step's global batch (the same for every method, the PyTorch peer and ``bench_eager.py``) and
the rows the global model is scored on."""

from __future__ import annotations

import sys

from harness import ROOT

EVAL_ROWS = 512
"""Digits (drawn once from the training digits, the same for every method) the global model is
scored on after each step, for the time to the target loss."""


def digits_cnn():
  """``examples/digits_cnn.py`` as a module (the digits, the MLP and the CNN)."""
  sys.path.insert(0, str(ROOT / "examples"))
  import digits_cnn
  return digits_cnn


def eval_rows(n: int):
  """The indices of the :data:`EVAL_ROWS` digits (of ``n``) that the time to the target uses."""
  import numpy as np
  return np.sort(np.random.default_rng(2024).choice(n, min(EVAL_ROWS, n), replace=False))


def batch_rows(n: int, step: int, rows: int):
  """The indices (of ``n`` digits) of step ``step``'s global batch of ``rows`` rows, the same
  for every method, the PyTorch peer and ``bench_eager.py``; worker ``i`` takes the ``i``-th
  share."""
  import numpy as np
  return np.random.default_rng([step, 7]).choice(n, rows, replace=False)
