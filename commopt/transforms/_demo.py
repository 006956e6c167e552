"""DeMo: each worker's momentum is its error feedback; only its largest DCT coefficients travel."""

from __future__ import annotations

import optax

from commopt._src import base
from commopt.compressors import chunk_top_k
from commopt.transforms import _global_view
from commopt.transforms._compressed_mean import DEFAULT_MIN_SIZE, compressed_mean


def demo(learning_rate: optax.ScalarOrSchedule, *, axis_name, k: int = 32, chunk: int = 64,
         decay: float = 0.999, weight_decay: float = 0.0, sign: bool = True,
         value_dtype="bfloat16", combine: str = "senders", strategy: str = "auto",
         min_size: int = DEFAULT_MIN_SIZE, seed: int = 0) -> optax.GradientTransformationExtraArgs:
  """DeMo: decoupled momentum; the workers exchange only its fast-moving DCT components.

  No gradient is all-reduced. Each worker keeps its own momentum ``m``
  (``decay`` = β) and, per step::

    m ← β·m + η·g                       η the learning rate, g its own gradient
    s = TopK(DCT(m))                    the k largest DCT-II coefficients of every
                                        chunk × chunk tile (values and in-tile indices)
    m ← m − IDCT(s)                     what was sent leaves the local momentum
    θ ← θ − η·(sign(mean_i IDCT(sᵢ)) + λ·θ)     λ = ``weight_decay``

  Built from commopt's parts: the momentum is the error-feedback residual
  of a :func:`~commopt.compressed_mean` of :func:`~commopt.compressors.chunk_top_k`
  with ``dct=True`` and ``residual_decay=decay``, whose payloads (bfloat16
  values and packed 12-bit indices: 28 bits per coefficient, 146× fewer
  bits than a float32 tile) are all-gathered. The state is an
  ``optax.named_chain``'s: ``state["exchange"].residual`` is each worker's
  momentum. Leaves below ``min_size`` are averaged dense and keep no
  momentum, as a tile sent whole does in DeMo.

  ``combine="senders"`` (the default) averages each coefficient over the
  workers that sent it, as the reference implementation does (a protocol
  of the compressor's own, the same bytes); ``combine="mean"`` averages the
  decoded payloads over all workers (the sum over N), which keeps error
  feedback's conservation of the sum exact. ``sign=False`` applies the mean
  itself instead of its sign.

  Args:
    learning_rate: η, a float or an optax schedule; it scales the gradient
      into the momentum and the signed step, as in the paper.
    axis_name: the data axis.
    k: DCT coefficients sent per tile (DeMo: 32 of 64 × 64).
    chunk: the tile's side (DeMo: 64).
    decay: β, the momentum's decay, in [0, 1] (DeMo: 0.999).
    weight_decay: λ, decoupled weight decay.
    sign: step by the sign of the mean (DeMo) or by the mean itself.
    value_dtype: wire dtype of the coefficients: ``"bfloat16"`` (the default,
      as the reference sends its bfloat16 model's; the rounding stays in the
      momentum), ``"float32"``, ``"float16"`` or None (the gradient's).
    combine: ``"mean"`` or ``"senders"`` (see above).
    strategy: :func:`~commopt.compressed_mean`'s reduction ("auto": gather).
    min_size: leaves with fewer elements are averaged dense.
    seed: the exchange's base key.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` (an ``optax.named_chain``
    of ``"momentum_in"``, ``"exchange"``, ``"sign"``, ``"weight_decay"`` and
    ``"step"``).

  Examples:
    >>> import jax.numpy as jnp, commopt
    >>> tx = commopt.demo(1e-3, axis_name=None, min_size=0)
    >>> params = {"w": jnp.ones((64, 64))}
    >>> updates, state = tx.update({"w": jnp.ones((64, 64))}, tx.init(params), params)
    >>> round(float(updates["w"][0, 0]), 6)       # −η·sign: the whole tile's DC sent
    -0.001

  References:
    Peng, Quesnelle and Kingma, DeMo: Decoupled Momentum Optimization, 2024,
    arXiv:2411.19870.
  """
  fn = "demo"
  sign = base.check_bool("sign", sign, fn=fn)
  weight_decay = base.check_number("weight_decay", weight_decay, fn=fn, low=0.0, low_open=False)
  exchange = compressed_mean(chunk_top_k(k, chunk=chunk, dct=True, value_dtype=value_dtype,
                                         combine=combine),
                             axis_name=axis_name, error_feedback=True, residual_decay=decay,
                             strategy=strategy, min_size=min_size, seed=seed)
  return _global_view.accepting(optax.named_chain(
      ("momentum_in", optax.scale_by_learning_rate(learning_rate, flip_sign=False)),
      ("exchange", exchange),
      ("sign", optax.scale_by_sign() if sign else optax.identity()),
      ("weight_decay", optax.add_decayed_weights(weight_decay)),
      ("step", optax.scale_by_learning_rate(learning_rate))), axis_name, "demo")
