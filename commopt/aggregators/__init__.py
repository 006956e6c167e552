"""Aggregators: how the workers' contributions are combined (majority vote, robust rules).

:func:`robust_aggregate` turns a robust rule, a pure function from the
``[n, d]`` matrix of the ``n`` workers' flattened updates to one ``[d]``
aggregate (:mod:`commopt.aggregators.rules` has Krum, the medians, the
trimmed mean, RFA and centred clipping), into an Optax transform over a
named axis or a tuple of axes; :func:`krum`, :func:`coordinate_median`, ...
are that transform with the rule of their name.

:mod:`commopt.aggregators.attacks` has the attack models (sign flip, Gaussian
noise, scaled updates, ALIE, inner-product manipulation, payload bit flips)
used to test and study the robust rules.
"""

from commopt.aggregators import attacks, rules
from commopt.aggregators._majority_vote import majority_vote, vote_words
from commopt.aggregators._robust import (
    centered_clip,
    coordinate_median,
    geometric_median,
    krum,
    multi_krum,
    trimmed_mean,
)
from commopt.aggregators._transform import CenteredClipState, RobustState, robust_aggregate

__all__ = ["attacks", "CenteredClipState", "centered_clip", "coordinate_median",
           "geometric_median", "krum", "majority_vote", "multi_krum", "robust_aggregate",
           "RobustState", "rules", "trimmed_mean", "vote_words"]
