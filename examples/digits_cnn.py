"""The demo's data and models: sklearn's bundled 8x8 digits, a small Flax nnx CNN, and the
MLP of the network benchmark and the notebooks."""

from __future__ import annotations

import numpy as np
import optax
from flax import nnx

import commopt


def notebook_settings():
  """(small, out): the notebooks' ``COMMOPT_NOTEBOOK_SMALL=1`` switch and their plot folder
  (``COMMOPT_NOTEBOOK_OUT``, default ``runs/notebooks``), created."""
  import os
  import pathlib
  out = pathlib.Path(os.environ.get("COMMOPT_NOTEBOOK_OUT", "runs/notebooks"))
  out.mkdir(parents=True, exist_ok=True)
  return os.environ.get("COMMOPT_NOTEBOOK_SMALL") == "1", out


def load_digits_split(seed: int = 0):
  """(x_train, y_train, x_test, y_test): 1797 images in [0, 1], NHWC, split 80/20."""
  from sklearn.datasets import load_digits
  digits = load_digits()
  x = (digits.images.astype(np.float32) / 16.0)[..., None]
  y = digits.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(x))
  n_test = len(x) // 5
  test, train = order[:n_test], order[n_test:]
  return x[train], y[train], x[test], y[test]


class CNN(nnx.Module):
  """conv 3x3x32, conv 3x3x64 [+ batch norm], dense 256 [+ dropout], dense 10 (1.07M parameters).

  The demo trains it with batch norm and dropout (mutable statistics and
  per-worker randomness); ``batch_norm=False, dropout=0.0`` gives the
  parameters-only model the benchmarks use.
  """

  def __init__(self, rngs: nnx.Rngs, *, batch_norm: bool = False, dropout: float = 0.0,
               sfb: bool = False):
    self.conv1 = nnx.Conv(1, 32, (3, 3), rngs=rngs)
    self.conv2 = nnx.Conv(32, 64, (3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(64, rngs=rngs) if batch_norm else None
    # sfb: the dense layers send sufficient factors where they cost less
    # (commopt.parallel.SFBLinear).
    linear = commopt.parallel.SFBLinear if sfb else nnx.Linear
    self.fc1 = linear(8 * 8 * 64, 256, rngs=rngs)
    self.drop = nnx.Dropout(dropout, rngs=rngs) if dropout else None
    self.fc2 = linear(256, 10, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.conv1(x))
    x = self.conv2(x)
    x = nnx.relu(self.bn(x) if self.bn is not None else x)
    x = nnx.relu(self.fc1(x.reshape(x.shape[0], -1)))
    if self.drop is not None:
      x = self.drop(x)
    return self.fc2(x)


def cross_entropy(model, batch):
  """The demo's loss: ``loss_fn(model, batch)`` for :func:`commopt.nnx_data_parallel`."""
  logits = model(batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def model_fns(seed: int = 0):
  """(params, logits_fn, loss_fn) with params an ``nnx.State`` of the CNN's parameters."""
  graphdef, params = nnx.split(CNN(nnx.Rngs(seed)), nnx.Param)

  def logits_fn(params, images):
    return nnx.merge(graphdef, params)(images)

  def loss_fn(params, batch):
    logits = logits_fn(params, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  return params, logits_fn, loss_fn


def load_digits_flat():
  """(x, y): the 1797 digits as standardised rows of 64 features (float32), and their labels."""
  from sklearn.datasets import load_digits
  x, y = load_digits(return_X_y=True)
  return ((x - x.mean(0)) / (x.std(0) + 1e-6)).astype(np.float32), y.astype(np.int32)


def mlp_fns(hidden: int):
  """(params, loss_fn) of the MLP 64 -> hidden -> hidden -> 10 (ReLU), seeded with key 0.

  ``params`` are host arrays ``{"l0": {"w", "b"}, ...}``; ``loss_fn(params, batch)``
  is the softmax cross-entropy of ``batch["x"]`` against ``batch["y"]``.
  """
  import jax
  keys = jax.random.split(jax.random.key(0), 3)
  sizes = [(64, hidden), (hidden, hidden), (hidden, 10)]
  params = {f"l{i}": {"w": np.asarray(jax.random.normal(k, s) / np.sqrt(s[0]), np.float32),
                      "b": np.zeros(s[1], np.float32)}
            for i, (k, s) in enumerate(zip(keys, sizes))}

  def loss_fn(p, batch):
    h = batch["x"]
    for i in range(3):
      h = h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"]
      h = jax.nn.relu(h) if i < 2 else h
    return optax.softmax_cross_entropy_with_integer_labels(h, batch["y"]).mean()

  return params, loss_fn
