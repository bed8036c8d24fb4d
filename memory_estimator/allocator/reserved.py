"""What varying batch lengths leave in the caching allocator: the reserved peak, replayed.

[Note: segments kept for the lengths seen]
A step's tensors are carved out of the segments the steps before it left in the cache
(``caching.py``). A step no longer than one already seen finds blocks as large as it needs
(the longer step's segments, split); a step longer than every step before it finds none for
its largest tensors and opens new segments, while the old ones stay cached for requests they
fit. So the reserved peak is set by the *records* of the run's length sequence (each batch
longer than all before it): :func:`replay` runs the step trace (``trace.py``) of each record
through the allocator and reads its peak; the steps in between change nothing the records do
not. The number and height of the records depend on the order the batches come in: the
answer is the range over ``SHUFFLES`` seeded orders of ``lengths.steps`` batches drawn from
the distribution (``lengths.py``), and the verdict uses its top. A run whose batches reach the
cap at once keeps only the cap's segments; one whose lengths never do keeps growing (about
with the logarithm of its steps). The worst order (every batch longer than the last) is
bounded by the device alone: when ``cudaMalloc`` fails the allocator frees what it caches and
retries (slower steps, ``num_alloc_retries``), so it is named in the answer, never counted.

``excess`` is the replayed peak above a single step at the cap: what a reading of
``max_memory_reserved`` (and nvidia-smi) adds to the fixed-length estimate, as a fraction
of that step's shape-dependent bytes (:attr:`ShapeCache.ratio`) so that re-pricing another
micro-batch or plan scales it without replaying again.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

from .caching import CachingAllocator
from .lengths import LengthDistribution
from .trace import StepShape, step_events

SHUFFLES = 8        # seeded orders of the run's batches; the range is over them
_SEED = 20240607


@dataclass(frozen=True)
class ShapeCache:
    """The replayed excess of varying lengths over one step at the cap, as fractions of that
    step's shape-dependent peak (``low``: the lowest of the shuffles, ``high``: the highest)."""

    low: float
    median: float
    high: float
    records: tuple[int, ...]            # record count per shuffle
    expandable: bool
    lengths: LengthDistribution

    def excess(self, shape_bytes: int, which: str = "high") -> int:
        """The excess for a step whose shape-dependent peak is ``shape_bytes``: ``low``, ``median`` or ``high``."""
        return int(round(shape_bytes * getattr(self, which)))


def replay(shape: StepShape, lengths: tuple[int, ...], expandable: bool = False) -> tuple[int, int]:
    """(peak reserved, peak allocated) of steps at these lengths, one after another, in a fresh cache."""
    allocator = CachingAllocator(expandable=expandable)
    for length in lengths:
        handles: dict[int, int] = {}
        for op, key, size in step_events(shape.at(length)):
            if op == "alloc":
                handles[key] = allocator.malloc(size)
            else:
                allocator.free(handles.pop(key))
    return allocator.peak_reserved, allocator.peak_allocated


def records(sequence: list[int]) -> tuple[int, ...]:
    """The lengths longer than every one before them.

    >>> records([3, 1, 4, 1, 5, 9, 2, 6])
    (3, 4, 5, 9)
    """
    out, top = [], 0
    for length in sequence:
        if length > top:
            out.append(length)
            top = length
    return tuple(out)


@lru_cache(maxsize=64)
def shape_cache(shape: StepShape, lengths: LengthDistribution, expandable: bool = False) -> ShapeCache:
    """Replay ``SHUFFLES`` orders of the run and express each one's excess over a step at the cap."""
    cap_reserved, cap_allocated = replay(shape, (lengths.cap,), expandable)
    rng = random.Random(_SEED)
    ratios, counts = [], []
    for _ in range(SHUFFLES):
        seen = records(lengths.sample(rng, lengths.steps))
        peak, _ = replay(shape, seen, expandable)
        ratios.append(max(0, peak - cap_reserved) / max(cap_allocated, 1))
        counts.append(len(seen))
    ordered = sorted(ratios)
    middle = (ordered[(SHUFFLES - 1) // 2] + ordered[SHUFFLES // 2]) / 2
    return ShapeCache(ordered[0], middle, ordered[-1], tuple(counts), expandable, lengths)
