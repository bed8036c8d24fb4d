"""``Work``: the handle of one logical collective a :class:`Communicator` issued."""

from __future__ import annotations

import time
from typing import Any, Protocol

from ..errors import CollectiveError


class Issuer(Protocol):
    """What a ``Work`` needs of the communicator that issued it (communicator.py's
    ``Communicator``; a protocol, so that the two modules do not import each other)."""

    stats: Any  # its traffic counters: ``seconds`` waited

    def wait_for(self, handle: Any) -> None: ...

    def explain(self, kind: str, error: Exception) -> CollectiveError: ...


class Work:
    """Handle of one logical collective (one or more backend calls); ``wait()`` is idempotent."""

    def __init__(self, comm: Issuer, kind: str, handles: tuple = ()):
        self._comm, self._kind = comm, kind
        self._handles = [handle for handle in handles if handle is not None]
        self._on_done: list = []
        self._done = False

    def then(self, on_done) -> "Work":
        """Run ``on_done()`` once the collective has completed (at ``wait()``, or now if it
        already has), after any callbacks registered before it."""
        self._on_done.append(on_done)
        if self._done:
            self.wait()
        return self

    def wait(self) -> None:
        if self._handles:
            self._wait_handles()
        self._done = True
        callbacks, self._on_done = self._on_done[::-1], []
        while callbacks:  # each dropped once it ran: what it holds is not kept through the next
            callbacks.pop()()

    def _wait_handles(self) -> None:
        """Wait for the backend calls and drop them. A frame of its own: a backend handle holds
        its collective's tensors (a reduce-scatter's whole input), and a loop variable left in
        ``wait()``'s frame would keep them alive through the callbacks run next (the step
        inside backward runs there, and measured one unit's gradient buffer above it)."""
        handles, self._handles = self._handles, []
        started = time.perf_counter()
        try:
            for handle in handles:
                self._comm.wait_for(handle)
        except CollectiveError:  # raised between slices by a stall check: already says why
            self._handles = handles
            raise
        except RuntimeError as error:
            self._handles = handles  # not waited for: a later wait() tries again
            raise self._comm.explain(self._kind, error) from error
        finally:
            self._comm.stats.seconds += time.perf_counter() - started
