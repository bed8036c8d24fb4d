"""Uneven data: ranks that take different shares of each global micro-batch.

With ``proportions`` (one share per rank, as ``shardengine.ProportionalSampler``
takes them) the global micro-batch ``micro_batch x world_size`` is split as the
engine's example splits it (largest remainder, ``shardengine.proportional_counts``).
Model states are the same on every rank, activations grow with the micro-batch,
so the rank with the largest share is the one that must fit: the plans are
estimated for it.

>>> shares = rank_shares([.25, .25, .10, .40], world_size=4, micro_batch=8)
>>> shares.micro_batches, shares.worst_rank, shares.worst_micro_batch
((8, 8, 3, 13), 3, 13)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from shardengine.engine_facts import check_proportions, ConfigError, proportional_counts

from ..errors import EstimatorInputError


@dataclass(frozen=True)
class RankShares:
    """Each rank's share and micro-batch; the worst rank holds the largest activations."""

    proportions: tuple[float, ...]
    global_batch: int
    micro_batches: tuple[int, ...]

    @property
    def worst_rank(self) -> int:
        """The rank with the largest micro-batch (the largest share; ties: the lowest rank)."""
        return max(range(len(self.micro_batches)), key=lambda r: (self.micro_batches[r], self.proportions[r], -r))

    @property
    def worst_micro_batch(self) -> int:
        return self.micro_batches[self.worst_rank]

    def header(self) -> str:
        worst = self.worst_rank
        return (f"uneven data: worst rank {worst} (share {self.proportions[worst]:g}), micro-batch "
                f"{self.worst_micro_batch} of the global {self.global_batch} "
                f"(per rank {'/'.join(map(str, self.micro_batches))}); the table is for that rank")

    @staticmethod
    def note() -> str:
        return ("with proportions, every micro-batch shown (setup, largest that fits, suggestions) is the "
                "worst rank's; a time estimate gives its step time and tokens/s of the global batch")

    def to_json_dict(self) -> dict[str, Any]:
        return {"rank": self.worst_rank, "share": self.proportions[self.worst_rank],
                "micro_batch": self.worst_micro_batch, "micro_batches": list(self.micro_batches),
                "global_batch": self.global_batch}


def rank_shares(proportions: Sequence[float], world_size: int, micro_batch: int) -> RankShares:
    """Split the global micro-batch ``micro_batch * world_size`` by ``proportions`` (one per rank,
    >= 0, summing to 1: the engine's own validation, its messages as EstimatorInputError)."""
    global_batch = micro_batch * world_size
    try:
        shares = check_proportions(proportions, world_size)
        counts = proportional_counts(global_batch, shares)
    except ConfigError as error:
        raise EstimatorInputError(str(error)) from None
    return RankShares(shares, global_batch, tuple(counts))


def parse_proportions(text: str) -> list[float]:
    """The CLI's ``--proportions .25,.25,.1,.4``."""
    try:
        return [float(part) for part in text.split(",")]
    except ValueError:
        raise EstimatorInputError(f"--proportions takes comma-separated shares, one per rank, such as "
                                  f".25,.25,.1,.4; got {text!r}") from None
