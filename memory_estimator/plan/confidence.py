"""How sure each answer is: per term, what it rests on and the range it can take; the verdict over that range.

[Note: exact, modelled, assumed]
Every term of a plan is one of

- ``exact``: shardengine's own layout of the module (its bucket planner, padding included;
  ``engines/shardengine_exact.py``) — the bytes the engine will allocate;
- ``modelled``: derived from a mechanism in the named source (an engine's buffers from its
  code, activations tensor by tensor, the allocator replayed) — a point, no range claimed;
- ``assumption``: a fact of the run the estimator was not told and took a default for; its
  range is the alternatives (a plain loss over 16-bit logits: with or without an fp32 upcast;
  batch lengths from a mean alone: the shape of their distribution).

The plan's total then holds over ``[low, high]`` (each term at its low and high end). The
verdict is ``fits`` when the high end fits the usable memory, ``does not fit`` only when the
low end exceeds the device, and ``tight`` between: the answer then says what the outcome
turns on. A term that cannot be bounded from above by the run's facts is named in the
verdict (``unbounded``), never left out silently: the order of varying-length batches
(the worst one grows the cache to the device, where the allocator frees it and retries),
activations that were not estimated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..byte_units import format_bytes

BASES = ("exact", "modelled", "assumption")


@dataclass(frozen=True)
class TermConfidence:
    """One term: its bytes at the answer's point, its range and what it rests on."""

    term: str
    basis: str
    bytes: int
    low: int
    high: int
    why: str

    def to_json_dict(self) -> dict[str, Any]:
        return {"term": self.term, "basis": self.basis, "bytes": int(self.bytes), "low": int(self.low),
                "high": int(self.high), "why": self.why}


@dataclass(frozen=True)
class PlanConfidence:
    """The plan's terms with their bases, the range its total holds over, and what is unbounded."""

    terms: tuple[TermConfidence, ...]
    low: int                          # nvidia-smi basis, every term at its low end
    high: int                         # ... at its high end (what the verdict is judged on)
    unbounded: tuple[str, ...] = ()   # what could push the peak above ``high``
    turns_on: tuple[str, ...] = ()    # the assumptions a "tight" verdict depends on
    reserved_offset: int = 0          # context + NCCL: nvidia-smi less reserved

    def holds_over(self, basis: str = "reserved") -> str:
        """The range as a reader states it, e.g. ``61.20–67.90 GiB reserved``."""
        offset = self.reserved_offset if basis == "reserved" else 0
        low, high = self.low - offset, self.high - offset
        if low == high:
            return f"{format_bytes(high)} {basis}"
        return f"{format_bytes(low)}–{format_bytes(high)} {basis}"

    def to_json_dict(self) -> dict[str, Any]:
        return {"terms": [term.to_json_dict() for term in self.terms],
                "nvidia_smi_range_bytes": [int(self.low), int(self.high)],
                "reserved_range_bytes": [int(self.low - self.reserved_offset), int(self.high - self.reserved_offset)],
                "holds_over": self.holds_over(), "unbounded": list(self.unbounded),
                "turns_on": list(self.turns_on),
                "basis_counts": {basis: sum(t.basis == basis for t in self.terms) for basis in BASES}}


def judge(low: int, high: int, usable: int, device_bytes: int) -> str:
    """The verdict over a range: ``fits`` if the high end fits the usable memory, ``does not fit``
    if even the low end exceeds the device, else ``tight``.

    >>> judge(60, 70, 72, 80), judge(60, 75, 72, 80), judge(81, 90, 72, 80)
    ('fits', 'tight', 'does not fit')
    """
    if high <= usable:
        return "fits"
    return "does not fit" if low > device_bytes else "tight"


def unless_text(confidence: PlanConfidence, verdict: str) -> str:
    """``fits unless …`` / ``tight: turns on …``: the line a reader needs beside the verdict."""
    if verdict == "tight" and confidence.turns_on:
        return f"{verdict} ({confidence.holds_over('nvidia-smi')}): turns on " + "; ".join(confidence.turns_on)
    if confidence.unbounded:
        return f"{verdict} unless " + "; or ".join(confidence.unbounded)
    return verdict
