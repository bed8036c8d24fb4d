"""``OrderedReducer``: launches gradient reductions during backward, in a fixed order.

[Note: why a fixed order]
Ranks match collectives by the order they issue them. If each rank reduced a
bucket as soon as its own gradients were ready, a parameter that gets no
gradient on one rank (a branch taken on some ranks only) would reorder that
rank's collectives: a hang, or worse, buckets summed with the wrong partners.
So items (buckets at stages 0-2, units at stage 3) are launched strictly in
one order known to every rank, each as soon as it *and every item before it*
is ready; whatever is left is flushed, in order, when backward ends.

[Note: bounded in-flight reductions]
Stages 2-3 allocate a full gradient buffer per item and free it once its
reduce-scatter completes. Capping the items in flight bounds that memory
while still overlapping communication with the rest of backward (DeepSpeed
double-buffers; the default here is FSDP2's one, see the note below). The oldest is waited for *before* the next item is
launched, not after: launching first would hold one item's buffers more than
the cap for as long as the wait takes, and the wait is at the same moment
either way (a backend runs its collectives in order, so the new one could not
overtake the old).

[Note: one reduction in flight]
The default cap is 1 (``max_inflight_buckets``): while the next item's
gradients are produced, only the previous item's reduction is pending, so a
stage 2-3 backward holds at most two full gradient buffers (the one in flight
and the one being filled). This is FSDP2's depth: ``fully_shard``'s
post-backward (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py) waits
for pending reduce-scatters until fewer than ``reduce_scatter_max_input_buffers``
(default 1) remain before it issues its own. A deeper pipeline held one more
full unit's gradient (in fp32 when reducing in fp32) at the small-batch peak,
where model states dominate, for overlap that a backend running its
collectives in order barely uses. Stages 0-1 keep their full gradients anyway,
so no cap applies there.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Hashable, Optional, Sequence

from ..distributed.work import Work
from ..errors import GradientProducedTwice


class OrderedReducer:
    def __init__(self, launch: Callable[[Hashable], list[Work]], expected: Callable[[Hashable], int],
                 max_inflight: Optional[int] = None):
        """``launch(item)`` issues the item's collectives; ``expected(item)`` is how
        many parameter gradients make it ready."""
        self._launch, self._expected, self._max_inflight = launch, expected, max_inflight
        self._inflight: deque[Work] = deque()
        self.start([])

    def start(self, order: Sequence[Hashable]) -> None:
        """Begin a backward pass whose items will be launched in ``order``."""
        self._order = list(order)
        self._next = 0
        self._arrived: dict[Hashable, int] = {}
        self._launched: set[Hashable] = set()

    def arrived(self, item: Hashable, name: str) -> None:
        """One parameter gradient of ``item`` is ready."""
        if item in self._launched:
            raise GradientProducedTwice(
                f"parameter {name} received a second gradient in this backward pass after its "
                "gradients were already reduced (reentrant activation checkpointing or a second "
                "backward through the same graph). Use torch.utils.checkpoint with "
                "use_reentrant=False, or call backward once per forward.")
        self._arrived[item] = self._arrived.get(item, 0) + 1

    def arrivals(self, item: Hashable) -> int:
        return self._arrived.get(item, 0)

    def launch_ready(self, launch_enabled: bool = True) -> None:
        while launch_enabled and self._next < len(self._order):
            item = self._order[self._next]
            if self._arrived.get(item, 0) < self._expected(item):
                return
            self._launch_item(item)

    def flush(self) -> None:
        """Launch every remaining item in order, then wait for all of them."""
        while self._next < len(self._order):
            self._launch_item(self._order[self._next])
        self.wait_all()

    def wait_all(self) -> None:
        while self._inflight:
            self._inflight.popleft().wait()

    def _launch_item(self, item: Hashable) -> None:
        self._next += 1
        self._launched.add(item)
        while self._max_inflight and len(self._inflight) >= self._max_inflight:
            self._inflight.popleft().wait()  # before this item allocates its buffers
        works = self._launch(item)
        while self._max_inflight and len(self._inflight) + len(works) > self._max_inflight and self._inflight:
            self._inflight.popleft().wait()
        self._inflight.extend(works)
