"""One link class of a cluster: what one rank sends per second over it, and a message's latency.

Its own module so that the catalog (interconnects.py) and stated rates (link_rates.py) both
build links without importing each other.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import EstimatorInputError

CATALOG_EFFICIENCY = 0.8


@dataclass(frozen=True)
class Link:
    """One link class: what one rank sends per second, and one message step's latency."""

    name: str
    nominal_bytes_per_s: float
    latency_s: float
    efficiency: float = CATALOG_EFFICIENCY   # achievable fraction of nominal (1.0 when measured)
    description: str = ""
    backend: str = "nccl"                    # whose collectives run over it (decides Gloo's forms)
    overlap: float = 1.0                     # fraction of communication hideable behind compute

    def __post_init__(self) -> None:
        if not (self.nominal_bytes_per_s > 0 and self.latency_s >= 0 and 0 < self.efficiency <= 1
                and 0 <= self.overlap <= 1):
            raise EstimatorInputError(f"link {self.name!r} needs bandwidth > 0, latency >= 0, efficiency in "
                                      f"(0, 1] and overlap in [0, 1]")

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.nominal_bytes_per_s * self.efficiency

    @property
    def beta(self) -> float:
        """Seconds per byte."""
        return 1.0 / self.bandwidth_bytes_per_s
