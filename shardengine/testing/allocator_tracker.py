"""Allocator-level CPU memory: every allocation and free (storage ``resize_`` included), with peaks.

On CPU torch has no ``max_memory_allocated``. torch's CPU allocator reports each
allocation and free to the profiler when it runs with ``profile_memory=True``
(``[memory]`` instant events, +/- bytes); ``resize_`` of a storage allocates a new
block and frees the old one, so it is seen too. Gloo work threads carry the
profiler's thread-local state and are seen; plain Python threads are not.

[Note: counting from the profiler's memory events]
A block allocated before :class:`AllocatorTracker` started is invisible, and so is
its free: live bytes are the bytes allocated while tracking and still alive. Run
one tracker over the whole measurement.

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
from typing import Iterator

import torch

_PREFIX = "allocator_tracker::"


class AllocatorTracker:
    """Records CPU allocator events while active; query live bytes and per-phase peaks after exit."""

    def __init__(self) -> None:
        self._profile = torch.autograd.profiler.profile(use_cpu=True, profile_memory=True)
        self._deltas: list[tuple[int, int]] = []
        self._phases: dict[str, tuple[int, int]] = {}

    def __enter__(self) -> "AllocatorTracker":
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._profile.__exit__(*exc)
        for event in self._profile.kineto_results.events():
            if event.name() == "[memory]" and str(event.device_type()) == "DeviceType.CPU":
                self._deltas.append((event.start_ns(), event.nbytes()))
            elif event.name().startswith(_PREFIX):
                self._phases[event.name()[len(_PREFIX):]] = (event.start_ns(), event.end_ns())
        self._deltas.sort()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Mark a named span whose peak :meth:`peak_in` reports."""
        with torch.profiler.record_function(_PREFIX + name):
            yield

    def _live_before(self, time_ns: int) -> int:
        return sum(delta for when, delta in self._deltas if when < time_ns)

    def peak_in(self, name: str) -> int:
        """Most bytes alive at once inside the phase ``name`` (counting what was alive when it began)."""
        start, end = self._phases[name]
        live = peak = self._live_before(start)
        for when, delta in self._deltas:
            if start <= when <= end:
                live += delta
                peak = max(peak, live)
        return peak

    def live_at_start_of(self, name: str) -> int:
        """Bytes alive when the phase ``name`` began."""
        return self._live_before(self._phases[name][0])

    def live_at_end(self) -> int:
        """Bytes allocated while tracking and still alive when it stopped."""
        return sum(delta for _, delta in self._deltas)
