"""How many Byzantine workers each robust rule tolerates, and how well.

Two kinds of statement live here. :func:`check_tolerance` is the structural
one: a rule designed for ``f`` Byzantine workers needs enough workers ``n``
(``f < n/2`` for the median family, ``n > 2f + 2`` for Krum), checked when
the update is traced and ``n`` is known. :data:`FACTORS` is the measured
one: on the robustness study's problems (``commopt.aggregators._study`` and
``benchmarks/bench_robust.py``) each rule's final loss under every attack it
tolerates stays within a stated factor of the honest plain-mean run's;
:func:`check_factors` lists the runs that break it.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

FactorSpec = Union[float, dict[int, float]]
"""A stated factor: one number, or ``{f_max: factor}``, one factor per attacker count."""


def check_tolerance(fn: str, n: int, f: Optional[int], *, need: str) -> None:
  """Raises a ``ValueError`` when ``n`` workers are too few for ``f`` Byzantine ones.

  Args:
    fn: the rule's name, for the message.
    n: the number of workers (the axis size).
    f: the number of Byzantine workers to tolerate, or ``None`` (no check).
    need: ``"majority"`` (``f < n/2``) or ``"krum"`` (``n > 2f + 2``).

  Examples:
    >>> from commopt.aggregators._tolerance import check_tolerance
    >>> check_tolerance("krum", 8, 2, need="krum")      # 8 > 2·2 + 2
    >>> check_tolerance("krum", 6, 2, need="krum")
    Traceback (most recent call last):
    ...
    ValueError: krum: `f`=2 Byzantine workers need n > 2f + 2 = 6 workers, but the axis has n=6. Use at least 7 workers or f <= 1.
  """
  if need not in ("majority", "krum"):
    raise ValueError(f"check_tolerance: `need` must be 'majority' or 'krum', got {need!r}.")
  if f is None:
    return
  if need == "krum" and not n > 2 * f + 2:
    raise ValueError(
        f"{fn}: `f`={f} Byzantine workers need n > 2f + 2 = {2 * f + 2} workers, but the "
        f"axis has n={n}. Use at least {2 * f + 3} workers or f <= {max((n - 3) // 2, 0)}"
        + (" (no f works for n < 3)." if n < 3 else "."))
  if need == "majority" and not 2 * f < n:
    raise ValueError(
        f"{fn}: `f`={f} Byzantine workers must be fewer than half of the n={n} workers "
        f"(f < n/2); use f <= {(n - 1) // 2} or more workers.")


FACTORS: dict[str, dict[str, FactorSpec]] = {
    "convex": {rule: 1.5 for rule in ("krum", "multi_krum", "coordinate_median",
                                      "trimmed_mean", "centered_clip", "geometric_median")},
    # Measured on 2 CPU cores, jax 0.10.2 (the closing table of the digits run), rounded
    # up. Krum keeps one worker's update, and the two ALIE attackers send the same
    # vector, so Krum picks it every step (alie/2: 21.8x; 4.1x its own honest run).
    # centered_clip's worst is the scaled attack at f = 2 (6.5x): each attacker
    # still moves the centre by tau/n a step. The median family at f = 3 is 5.6x at
    # worst, against 8.4x for the plain mean under the same sign flips.
    "digits": {"krum": 25.0, "multi_krum": 4.0, "coordinate_median": {2: 4.0, 3: 6.0},
               "trimmed_mean": 3.5, "centered_clip": 7.0, "geometric_median": {2: 4.0, 3: 6.0}},
}
"""The stated factor per problem and rule: its final loss under every attack it
tolerates stays within ``factor ×`` the honest plain-mean run's. A ``{f_max: factor}``
dict states one factor per attacker count (the smallest ``f_max >= f`` applies).
``bench_robust.py --check`` holds a run to them; ``tests/test_robust.py`` holds the
convex problem to them."""


def stated_factor(spec: FactorSpec, f: int) -> float:
  """The factor of ``spec`` for ``f`` attackers.

  Args:
    spec: a number, or ``{f_max: factor}`` (the smallest ``f_max >= f`` applies).
    f: the number of attackers.

  Returns:
    The factor as a float; NaN when ``spec`` states none for ``f``.

  Examples:
    >>> from commopt.aggregators._tolerance import stated_factor
    >>> stated_factor(1.5, 2), stated_factor({2: 4, 3: 6}, 1), stated_factor({2: 4, 3: 6}, 3)
    (1.5, 4.0, 6.0)
  """
  if not isinstance(spec, dict):
    return float(spec)
  fits = [k for k in spec if k >= f]
  return float(spec[min(fits)]) if fits else float("nan")


def loss_ratios(results: dict[str, dict[str, float]], rule: str,
                own: bool = False) -> dict[str, float]:
  """Each run's final loss over a reference run's.

  Args:
    results: ``{rule: {"attack/f": final loss}}``.
    rule: the rule whose runs to compare.
    own: compare with the rule's own run without attackers (``"none/0"``)
      instead of the plain mean's (``results["mean"]["none/0"]``).

  Returns:
    ``{"attack/f": loss / reference}`` (``inf`` for a non-finite loss); empty
    when the reference run is missing.

  Examples:
    >>> from commopt.aggregators._tolerance import loss_ratios
    >>> loss_ratios({"mean": {"none/0": 2.0}, "krum": {"alie/2": 3.0}}, "krum")
    {'alie/2': 1.5}
  """
  ref = results.get(rule if own else "mean", {}).get("none/0")
  if ref is None:
    return {}
  return {c: (v / ref if math.isfinite(v) else float("inf"))
          for c, v in results.get(rule, {}).items()}


def check_factors(results: dict[str, dict[str, float]],
                  factors: dict[str, Any]) -> list[str]:
  """The runs whose loss exceeds the stated factor × the honest plain-mean run's.

  Args:
    results: ``{rule: {"attack/f": final loss}}``, with ``results["mean"]["none/0"]``.
    factors: ``{rule: factor or {f_max: factor}}`` (e.g. ``FACTORS["convex"]``).

  Returns:
    One line per failing run, ``"rule attack/f: ratio x > factor x"``; empty
    when every rule meets its factor.

  Examples:
    >>> from commopt.aggregators._tolerance import check_factors
    >>> results = {"mean": {"none/0": 1.0}, "krum": {"none/0": 1.1, "ipm/2": 1.6}}
    >>> check_factors(results, {"krum": 1.5})
    ['krum ipm/2: 1.60x > 1.5x']
  """
  bad = []
  for rule, spec in factors.items():
    for cfg, ratio in loss_ratios(results, rule).items():
      factor = stated_factor(spec, int(cfg.split("/")[1]))
      if not ratio <= factor:
        bad.append(f"{rule} {cfg}: {ratio:.2f}x > {factor:g}x")
  return bad


__all__ = ["FACTORS", "FactorSpec", "check_factors", "check_tolerance", "loss_ratios",
           "stated_factor"]
