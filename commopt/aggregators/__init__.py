"""Aggregators: how the workers' contributions are combined (majority vote, robust rules).

:mod:`commopt.aggregators.attacks` has the attack models (sign flip, Gaussian
noise, scaled updates, ALIE, inner-product manipulation, payload bit flips)
used to test and study the robust rules.
"""

from commopt.aggregators import attacks
from commopt.aggregators._majority_vote import majority_vote, vote_words
from commopt.aggregators._robust import (
    CenteredClipState,
    RobustState,
    centered_clip,
    coordinate_median,
    geometric_median,
    krum,
    multi_krum,
    trimmed_mean,
)

__all__ = ["attacks", "CenteredClipState", "centered_clip", "coordinate_median",
           "geometric_median", "krum", "majority_vote", "multi_krum", "RobustState",
           "trimmed_mean", "vote_words"]
