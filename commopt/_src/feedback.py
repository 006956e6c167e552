"""What error feedback does with each kind of compressor error.

Error feedback (``p = u + e; e' = p − C(p)``) keeps a bounded residual only
when ``C`` is a contraction: ``‖p − C(p)‖² ≤ (1 − δ)‖p‖²`` gives
``‖e‖ ≤ √(1−δ)/(1 − √(1−δ)) · sup‖u‖ ≤ (2/δ) sup‖u‖`` (Stich & Karimireddy
2020). An unbiased compressor with variance factor ω > 0 is not one (QSGD,
TernGrad at their usual levels), and its residual grows geometrically; but
``C/(1+ω)`` is a contraction with ``δ = 1/(1+ω)`` (Beznosikov et al. 2020,
Lemma 1), so that is what error feedback uses when asked for. A compressor
whose output magnitude does not follow its input (``sign``) has no bound at
all. A residual also acts as a delay of about ``1/δ`` steps; when the kept
part is drawn at random whatever the magnitudes (random-k), every coordinate
waits that long, which is stable only for step sizes below about ``δ/L``.
A compressor that only rounds each value to a nearby one (a cast to bfloat16:
at most ``2⁻⁸`` of the value) is a contraction with ``δ`` within ``2⁻¹⁶`` of 1;
its error does not build up in float32 parameters, so a residual, a copy of
the model per worker read and written every step, buys nothing by default.

:func:`feedback_compressor` turns a compressor and the user's
``error_feedback`` option into the compressor that is run and whether a
residual is kept.
"""

from __future__ import annotations

import dataclasses

from commopt._src import base

# Kinds whose residual is kept under ``error_feedback="auto"``.
_AUTO_KEEPS = ("contractive", "biased")


def check_error_feedback(value, fn: str):
  """``value`` if it is ``"auto"``, ``True`` or ``False``, else a TypeError naming it."""
  if value is True or value is False or (isinstance(value, str) and value == "auto"):
    return value
  raise base.OptionTypeError(
      f"{fn}: `error_feedback` must be 'auto', True or False, got {value!r} "
      f"({type(value).__name__}).")


def scaled(compressor: base.Compressor) -> base.Compressor:
  """``C/(1+ω)`` of an unbiased compressor: the same payload, decoded times ``1/(1+ω)``.

  A contraction with ``δ = 1/(1+ω)`` (in expectation), so its error-feedback
  residual stays bounded. Linearity is kept (the factor is the same on every
  worker for a leaf's shape).
  """
  if compressor.error_kind != "unbiased":
    raise ValueError(f"scaled: {compressor.name} is not declared unbiased "
                     f"(error_kind={compressor.error_kind!r}).")

  def factor(shape):
    return 1.0 / (1.0 + float(compressor.error_bound(tuple(shape))))

  def decode(payload, state, like):
    out = compressor.decode(payload, state, like)
    return (out * factor(like.shape)).astype(out.dtype)

  def decode_tree(payload, likes):
    outs = compressor.decode_tree(payload, likes)
    return [(o * factor(l.shape)).astype(o.dtype) for o, l in zip(outs, likes)]

  def reduce(x, state, key, channel):
    r = compressor.reduce(x, state, key, channel)
    f = factor(x.shape)
    return base.Reduced(mean=(r.mean * f).astype(r.mean.dtype),
                        local=(r.local * f).astype(r.local.dtype), state=r.state)

  def reduce_tree(xs, states, keys, channel):
    rs = compressor.reduce_tree(xs, states, keys, channel)
    return [base.Reduced(mean=(r.mean * factor(x.shape)).astype(r.mean.dtype),
                         local=(r.local * factor(x.shape)).astype(r.local.dtype), state=r.state)
            for r, x in zip(rs, xs)]

  return dataclasses.replace(
      compressor, name=f"{compressor.name}/(1+ω)", decode=decode, accumulate=None,
      # Its payload no longer decodes to the values it carries: no sparse fast path.
      sparse_values=False,
      decode_tree=decode_tree if compressor.decode_tree is not None else None,
      reduce=reduce if compressor.reduce is not None else None,
      reduce_tree=reduce_tree if compressor.reduce_tree is not None else None,
      error_kind="expected_contractive", error_bound=factor)


def feedback_compressor(compressor: base.Compressor, error_feedback, fn: str
                        ) -> tuple[base.Compressor, bool]:
  """The compressor to run and whether to keep a residual, for ``error_feedback``.

  ===================== ====================== ======================================
  error kind            ``"auto"``             ``True``
  ===================== ====================== ======================================
  lossless              no residual            no residual (nothing is lost)
  rounding              no residual            residual
  contractive           residual               residual
  biased (undeclared)   residual               residual
  expected_contractive  no residual            residual (stable for lr·L ≲ δ)
  unbiased              no residual            residual of ``C/(1+ω)``
  direction             no residual            ValueError (the residual grows as t)
  ===================== ====================== ======================================

  ``False`` never keeps a residual and runs the compressor as it is.
  """
  check_error_feedback(error_feedback, fn)
  kind = compressor.error_kind
  if error_feedback is False or kind == "lossless":
    return compressor, False
  if error_feedback == "auto":
    return compressor, kind in _AUTO_KEEPS
  if kind == "direction":
    raise ValueError(
        f"{fn}: error_feedback=True with {compressor.name}, whose output has the same "
        "magnitude whatever its input's: its residual p − C(p) grows with every step. Use "
        "commopt.scaled_sign() (a contraction, EF-signSGD) for error feedback, or "
        "error_feedback=False (or 'auto') to run it without a residual (signSGD).")
  if kind == "unbiased":
    return scaled(compressor), True
  return compressor, True
