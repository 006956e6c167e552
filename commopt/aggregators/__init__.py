"""Aggregators: how the workers' contributions are combined (majority vote, ...)."""

from commopt.aggregators._majority_vote import majority_vote, vote_words

__all__ = ["majority_vote", "vote_words"]
