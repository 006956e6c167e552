"""Research models: :mod:`commopt.sim.network`, an α-β cost model of collectives."""

from commopt.sim import network

__all__ = ["network"]
