"""Traffic accounting: bytes per collective kind, counted in the ring model.

Pure arithmetic over sizes (no process group), so the memory estimator and
the benchmarks predict exactly what :class:`~shardengine.distributed.communicator.Communicator`
records.

[Note: ring-model byte accounting]
For a buffer of S bytes on N ranks a ring all-reduce sends 2(N-1)/N*S bytes
per rank, a reduce-scatter (S = the full input), an all-gather (S = the
full output) and an all-to-all (S = the full input) each send (N-1)/N*S,
and a pipelined broadcast (N-1)/N*S on average. We count what the
implementation we actually call would send in that model, so when a
backend-specific implementation swaps one collective for another, the
counters follow the collective really issued.

How Gloo's reduce-scatter and all-gather are issued, and so counted: see
[Note: Gloo's in-place primitives] in communicator.py.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

import torch


@dataclass
class CommStats:
    """Cumulative traffic of one communicator, per collective kind.

    ``by_group``: the same split by the group the collectives ran over (filled
    for the engine's :class:`~shardengine.distributed.hybrid.HybridCommunicator`:
    ``intra_group``, ``inter_group``, ``all_ranks``); the top-level counters are
    their sum.
    """

    bytes_by_kind: Counter = field(default_factory=Counter)
    calls_by_kind: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    by_group: dict[str, "CommStats"] = field(default_factory=dict)

    @property
    def bytes_total(self) -> int:
        return sum(self.bytes_by_kind.values())

    @property
    def calls(self) -> int:
        return sum(self.calls_by_kind.values())

    def record(self, kind: str, nbytes: int, calls: int = 1) -> None:
        self.bytes_by_kind[kind] += nbytes
        self.calls_by_kind[kind] += calls

    def snapshot(self) -> "CommStats":
        return CommStats(Counter(self.bytes_by_kind), Counter(self.calls_by_kind), self.seconds,
                         {name: group.snapshot() for name, group in self.by_group.items()})

    def since(self, earlier: "CommStats") -> "CommStats":
        """Traffic between ``earlier`` (a snapshot) and now."""
        return CommStats(self.bytes_by_kind - earlier.bytes_by_kind,
                         self.calls_by_kind - earlier.calls_by_kind,
                         self.seconds - earlier.seconds,
                         {name: group.since(earlier.by_group.get(name, CommStats()))
                          for name, group in self.by_group.items()})

    @classmethod
    def combined(cls, groups: dict[str, "CommStats"]) -> "CommStats":
        """The sum of several groups' traffic, keeping each group's under ``by_group``."""
        total = cls(by_group={name: stats.snapshot() for name, stats in groups.items()})
        for stats in groups.values():
            total.bytes_by_kind.update(stats.bytes_by_kind)
            total.calls_by_kind.update(stats.calls_by_kind)
            total.seconds += stats.seconds
        return total

    def as_dict(self) -> dict[str, Any]:
        out = {"bytes_by_kind": dict(self.bytes_by_kind), "calls_by_kind": dict(self.calls_by_kind),
               "bytes_total": self.bytes_total, "seconds": self.seconds}
        if self.by_group:
            out["by_group"] = {name: stats.as_dict() for name, stats in self.by_group.items()}
        return out


def ring_bytes(kind: str, full_bytes: int, world: int) -> int:
    """Bytes one rank sends for a collective over ``full_bytes`` (see the Note above)."""
    if world == 1:
        return 0
    factor = 2 if kind == "all_reduce" else 1
    return factor * (world - 1) * full_bytes // world




def bytes_sent(collective: str, nbytes: int, world: int, in_place_primitives: bool) -> int:
    """What a communicator's counters record for one ``collective`` ("all_reduce", "reduce_scatter",
    "all_gather" or "all_to_all") over a full buffer of ``nbytes`` on ``world`` ranks, as it issues
    it: with Gloo's in-place primitives a reduce-scatter goes out as an all-reduce and an all-gather
    as one broadcast per chunk. The estimator predicts with this very function.

    >>> bytes_sent("reduce_scatter", 1024, 4, in_place_primitives=False), bytes_sent("reduce_scatter", 1024, 4, True)
    (768, 1536)
    """
    if in_place_primitives and collective == "reduce_scatter":
        return ring_bytes("all_reduce", nbytes, world)
    if in_place_primitives and collective == "all_gather":  # one broadcast per chunk
        return world * ring_bytes("broadcast", nbytes // world, world)
    return ring_bytes(collective, nbytes, world)

COLLECTIVES = ("auto", "native")


def uses_in_place_primitives(collectives: str, backend: Optional[str]) -> bool:
    """Whether reduce-scatter and all-gather are built from all-reduce and broadcasts
    (see [Note: Gloo's in-place primitives])."""
    if collectives not in COLLECTIVES:
        raise ValueError(f"collectives must be one of {COLLECTIVES}, got {collectives!r}")
    return collectives == "auto" and backend == "gloo"


def group_by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` split by dtype, in first-seen order (what :meth:`Communicator.broadcast_coalesced`
    sends one collective for)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    return list(by_dtype.values())
