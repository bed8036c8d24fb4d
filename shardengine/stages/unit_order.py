"""Stage 3's collectives in one order on every rank, whichever units each rank runs.

:class:`UnitOrder` is the unit scheduler's side of [Note: checked collective order]
(distributed/sequence.py): it names each unit gather and reduction for the rounds,
takes part in another rank's gather (``serve``), and agrees on the order of a
backward's reductions.

[Note: ranks that run different units]
The reductions of a backward are launched in one order (step/reducer.py), derived
from the units' forward order, which is each rank's own. Where the ranks' forwards
called different units (a rank's routing picked other experts), those orders
differ, and the rounds would find one rank reducing unit 3 while another waits to
reduce unit 5, neither of which can be served. So at the start of each backward
the ranks compare their orders (one round); if they differ, every rank takes the
units' fixed order (the blocks last-registered first, the root last). A unit this
rank never ran is then reduced, with zeros from this rank, when its backward ends,
and its place in the order makes later units wait as long: correct, and on the
data-dependent path only.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

from ..distributed.sequence import GATHER, OTHER, REDUCE, VALUE, CollectiveSequence, OpId
from ..distributed.work import Work
from ..flat.bucket import FlatBucket

T = TypeVar("T")
_REDUCTION_ORDER, _FORWARD_DONE = 1, 2  # the keys of agree_values()
_OTHER_KINDS = {1: "all-reduce", 2: "reduce-scatter", 3: "all-gather", 4: "all-to-all", 5: "broadcast",
                6: "object all-gather"}


class UnitOrder:
    """Rounds before stage 3's unit collectives (one order on every rank; see the Note)."""

    def __init__(self, comm: Any, buckets: Callable[[], list[FlatBucket]],
                 serve_bucket: Callable[[FlatBucket], None], unit_name: Callable[[FlatBucket], str]):
        """``comm``: the engine's (hybrid) communicator; ``buckets()``: the engine's buckets in
        their fixed order, each named by ``unit_name``; ``serve_bucket`` takes part in another
        rank's gather of one."""
        self.buckets, self.serve_bucket, self.unit_name = buckets, serve_bucket, unit_name
        self.sequence: Optional[CollectiveSequence] = None
        if comm.world_size > 1:  # collective: every rank builds its engine alike (fingerprint)
            self.sequence = comm.check_order(self.serve, self.describe)
        self._index: dict[int, int] = {}

    def enable(self) -> None:
        """From now on (the engine is built: its wrap-time collectives were equal on every rank)."""
        if self.sequence is not None:
            self.sequence.enabled = True

    def _bucket_index(self, bucket: FlatBucket) -> int:
        if id(bucket) not in self._index:
            self._index = {id(b): i for i, b in enumerate(self.buckets())}
        return self._index[id(bucket)]

    def gather(self, bucket: FlatBucket, issue: Callable[[], Work]) -> Work:
        return self._run((GATHER, self._bucket_index(bucket), 0), issue)

    def reduce(self, bucket: FlatBucket, issue: Callable[[], T]) -> T:
        return self._run((REDUCE, self._bucket_index(bucket), 0), issue)

    def _run(self, op: OpId, issue: Callable[[], T]) -> T:
        return issue() if self.sequence is None else self.sequence.run(op, issue)

    def reduction_order(self, order: list, units: list) -> list:
        """``order`` where every rank has the same, else the units' fixed order (see the Note)."""
        if self.sequence is None:
            return order
        digest = hash(tuple(units.index(unit) for unit in order)) & (2 ** 62 - 1)
        if len(set(self.sequence.agree_values(_REDUCTION_ORDER, digest))) == 1:
            return order
        return units[:-1][::-1] + units[-1:]

    def forward_done(self, raised: bool = False) -> list[int]:
        """The model's forward returns (or ``raised``): one round, so that no rank leaves its
        forward while another still needs it to serve a gather, and code between forward and
        backward may synchronize the ranks itself (``dist.all_reduce(loss)``, a barrier). The
        ranks whose forward raised (failure.py: [Note: an exception inside forward])."""
        if self.sequence is None:
            return [0] if raised else []
        values = self.sequence.agree_values(_FORWARD_DONE, int(raised))
        return [rank for rank, value in enumerate(values) if value]

    def serve(self, op: OpId) -> None:
        self.serve_bucket(self.buckets()[op[1]])

    def describe(self, op: OpId) -> str:
        kind, key, value = op
        if kind in (GATHER, REDUCE):
            bucket = self.buckets()[key]
            what = "gathering" if kind == GATHER else "reducing the gradients of"
            return f"{what} unit {self.unit_name(bucket)!r} (bucket {key})"
        if kind == VALUE:
            return ("starting a backward (agreeing on its reductions' order)" if key == _REDUCTION_ORDER
                    else "ending a forward")
        if kind == OTHER:
            return (f"{_OTHER_KINDS.get(key, 'a collective')} of {value} bytes (the step's agreement, "
                    "a buffer broadcast, clipping, or a state dict, checkpoint or summon_full_params gather)")
        return f"collective {op}"
