"""Allocator-level CPU memory: every allocation and free (storage ``resize_`` included), with peaks.

On CPU torch has no ``max_memory_allocated``. torch's CPU allocator reports each
allocation and free to the profiler when it runs with ``profile_memory=True``
(``[memory]`` instant events, +/- bytes); ``resize_`` of a storage allocates a new
block and frees the old one, so it is seen too. Frees on threads without the
profiler's thread-local state are not reported: see the Note.

[Note: counting from the profiler's memory events]
The profiler reports a free only on a thread that carries its thread-local
state, and only for a block its reporter saw allocated. Two kinds of report are
therefore missing or unmatched, and the raw sum of +/- bytes is wrong both ways:

* a free made on another thread is never reported. Gloo's work threads drop
  their reference to a collective's tensors after the collective ran (outside
  the profiler's scope); when the main thread let go first, the bytes are freed
  there, unseen. Racy: a gradient bucket at one step, not at the next, so the
  bytes alive read up to a gradient high (4 B/param) in some runs;
* a free of a block allocated before this tracker started (in an earlier
  profiled span of the process) is reported although its allocation was not.

So each allocation is paired with its free by address. A free with no tracked
allocation is ignored (the block was never counted). An address handed out
again while its earlier block still counts as alive proves that block was
freed, unseen, before: it is counted freed at that reallocation (the latest it
can have been, so live bytes are never read below the truth; ``inferred_frees``
says how many). A block freed unseen whose address is never reused stays
counted: an over-estimate, never an under-estimate. Inferred late, such a free
would also be subtracted from whatever was measured after the block's true
free; so bytes held by something built at a point are counted as the blocks
allocated *since* that point (``since=``), not as a difference of two totals.

>>> import torch
>>> with AllocatorTracker() as tracker:
...     a = torch.empty(1000, dtype=torch.uint8)
...     with tracker.phase("grow"):
...         _ = a.untyped_storage().resize_(4000)
...     del a, _
>>> tracker.peak_in("grow"), tracker.live_at_end()  # resize_ holds old and new block while it copies
(5000, 0)
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

_PREFIX = "allocator_tracker::"


class AllocatorTracker:
    """Records CPU allocator events while active; query live bytes and per-phase peaks after exit."""

    def __init__(self) -> None:
        # (profile_all_threads=True would follow every thread, but then reports no memory events.)
        self._profile = torch.autograd.profiler.profile(use_cpu=True, profile_memory=True)
        self._deltas: list[tuple[int, int, int]] = []
        self._phases: dict[str, tuple[int, int]] = {}
        self.inferred_frees = 0  # frees the profiler did not report, proven by an address reused

    def __enter__(self) -> "AllocatorTracker":
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._profile.__exit__(*exc)
        allocations = []
        events = list(self._profile.kineto_results.experimental_event_tree())
        while events:
            event = events.pop()
            events.extend(event.children)
            fields = event.extra_fields
            if isinstance(fields, torch._C._profiler._ExtraFields_Allocation):
                if fields.device.type == "cpu":
                    allocations.append((event.start_time_ns, fields.ptr, fields.alloc_size))
            elif event.name.startswith(_PREFIX):
                self._phases[event.name[len(_PREFIX):]] = (event.start_time_ns, event.end_time_ns)
        self._deltas = self._paired(sorted(allocations, key=lambda a: a[0]))

    def _paired(self, allocations: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        """(time, +/- bytes, when the block was allocated) from the allocator's reports, each free
        matched to its allocation (see [Note: counting from the profiler's memory events])."""
        alive: dict[int, tuple[int, int]] = {}  # address -> (bytes, allocated at)
        deltas = []
        for when, ptr, size in allocations:
            if size > 0:
                if ptr in alive:  # freed on a thread the profiler does not follow
                    deltas.append((when, -alive[ptr][0], alive[ptr][1]))
                    self.inferred_frees += 1
                alive[ptr] = (size, when)
                deltas.append((when, size, when))
            elif ptr in alive:
                freed, born = alive.pop(ptr)
                deltas.append((when, -freed, born))
        return deltas

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Mark a named span whose peak :meth:`peak_in` reports."""
        with torch.profiler.record_function(_PREFIX + name):
            yield

    def _born_after(self, since: Optional[str]) -> int:
        return self._phases[since][0] if since is not None else -1

    def _live_before(self, time_ns: int, born_after: int) -> int:
        return sum(delta for when, delta, born in self._deltas if when < time_ns and born >= born_after)

    def peak_in(self, name: str, since: Optional[str] = None) -> int:
        """Most bytes alive at once inside the phase ``name`` (counting what was alive when it began);
        with ``since``, only blocks allocated after the phase ``since`` began (see :meth:`live_at_start_of`)."""
        start, end = self._phases[name]
        born_after = self._born_after(since)
        live = peak = self._live_before(start, born_after)
        for when, delta, born in self._deltas:
            if start <= when <= end and born >= born_after:
                live += delta
                peak = max(peak, live)
        return peak

    def live_at_start_of(self, name: str, since: Optional[str] = None) -> int:
        """Bytes alive when the phase ``name`` began; with ``since``, only those allocated after the
        phase ``since`` began: what was built since then, unaffected by older blocks whose unseen
        free is inferred later (a difference of two totals would subtract those)."""
        return self._live_before(self._phases[name][0], self._born_after(since))

    def live_at_end(self) -> int:
        """Bytes allocated while tracking and still alive when it stopped."""
        return sum(delta for _, delta, _ in self._deltas)
